"""Resumable checkpoints that carry the freeze state.

A checkpoint is a folder:

* ``model.safetensors`` — the model's weights (safetensors, no pickle);
* ``state.pt`` — optimizer, LR scheduler, :class:`~layerfreeze.engine.Freezer` state (frozen blocks, param-group
  membership by parameter name, strategy state), RNG states, the caller's extra fields (step, epoch, config),
  and the SHA-256 of ``model.safetensors`` so a truncated or corrupt weights file is detected, not loaded;
* ``state.pt.sha256`` — the SHA-256 of ``state.pt`` (``sha256sum``'s format), checked before ``state.pt`` is
  unpickled: a flipped byte in the optimizer state or the RNG states is detected too, not resumed from (format 2; a
  format-1 checkpoint, written before, has no such file and its state file is read unverified).

Loading restores, in this order: weights, freezer state (re-freezes blocks and rebuilds the optimizer's param
groups so they match the saved ones), optimizer state, scheduler state, RNG states. That order is what avoids the
public faults "loaded state dict has a different number of parameter groups", a ``KeyError`` packing state of
removed parameters, and resumed runs whose frozen blocks silently train again (or thawed ones never do).

Every file is fsynced, then the folder, then it is renamed into place and its parent fsynced, so a kill or a power
loss at any instant leaves either the old or the new checkpoint complete, never a half-written one under a final
name. :class:`CheckpointStore` keeps the last K of them in a run folder (``checkpoints/NNNNNN-stepSSSSSSSSS/``,
with ``checkpoint`` a symbolic link to the newest), and resumes from the newest complete one, falling back past a
corrupt one with a message.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_model, save_file, save_model
from torch import nn

from layerfreeze.distributed.fsdp import (
    BY_NAME,
    full_optimizer_state,
    full_state_options,
    is_sharded,
    load_full_optimizer_state,
)
from layerfreeze.engine.optim import inner_optimizer
from layerfreeze.errors import CheckpointError
from layerfreeze.models.discovery import refuse_empty_parameters
from layerfreeze.runs import rundir

if TYPE_CHECKING:  # the checkpoint reads and restores a Freezer's state_dict, it never builds one
    from layerfreeze.engine.freezer import Freezer

FORMAT_VERSION = 2
#: Format versions :func:`read_state` reads (1: no ``state.pt.sha256``).
READABLE_FORMATS = (1, 2)
#: The file beside ``state.pt`` holding its SHA-256.
STATE_DIGEST = "state.pt.sha256"


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, in hex (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's data and metadata to disk (the folder: so a rename in it survives power loss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    """The Python, NumPy and torch (CPU and CUDA) RNG states, as plain values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, keys.tolist(), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` output."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _refuse_empty_weights(model: nn.Module) -> None:
    """Refuse a model whose parameters hold no elements, as the state dict would write them: a demoted block the
    activation cache serves keeps a 0-element placeholder on the device while its state dict entry is the real
    weight (:mod:`layerfreeze.engine.demote`), so only a parameter still empty in the state dict is refused. The
    state dict is built only when some parameter is empty."""
    empty = {name for name, p in model.named_parameters() if p.numel() == 0}
    if empty:
        state = model.state_dict()
        refuse_empty_parameters(((n, state.get(n, p)) for n, p in model.named_parameters() if n in empty),
                                "save_checkpoint")


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    freezer: Freezer | None = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    *,
    model_state: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict[str, Any] | None = None,
    freezer_state: dict[str, Any] | None = None,
    verify: bool = True,
) -> Path:
    """Write a checkpoint folder at ``path`` (replacing an older one atomically).

    Args:
        extra: Caller fields to keep (plain Python values / tensors), e.g. ``{"step": 120, "epoch": 2}``.
        model_state / optimizer_state / freezer_state: Full state dicts to write instead of ``model`` /
            ``optimizer`` / ``freezer``'s own (a sharded model's gathered state:
            :func:`layerfreeze.checkpoint.save_full_checkpoint`).
        verify: With a ``freezer`` (and no ``freezer_state``), first check every frozen block's weights against
            their checksum from freeze time (:meth:`~layerfreeze.engine.Freezer.verify_frozen_weights`): a weight
            that moved while frozen is never checkpointed. ``False`` for a caller that has just verified them (the
            CLI trainer does, on every rank).

    Returns:
        The checkpoint folder.

    Raises:
        EmptyParameterError: a weight to be written holds no elements (a DeepSpeed ZeRO-3 placeholder outside a
            gather, DeepSpeed#5041); nothing is written.
        FrozenWeightsChangedError: a frozen weight moved since its block froze (``verify``), naming the block and
            the parameter; nothing is written.
    """
    if verify and freezer is not None and freezer_state is None:
        freezer.verify_frozen_weights()
    if model_state is not None:
        refuse_empty_parameters(model_state.items(), "save_checkpoint")
    else:
        _refuse_empty_weights(model)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if model_state is not None:
        save_file({k: v.detach().contiguous() for k, v in model_state.items()}, str(tmp / "model.safetensors"))
    else:
        save_model(model, str(tmp / "model.safetensors"))
    if optimizer_state is None and optimizer is not None:
        optimizer_state = optimizer.state_dict()
    state = {
        "format_version": FORMAT_VERSION,
        "model_sha256": file_sha256(tmp / "model.safetensors"),
        "optimizer": optimizer_state,
        # its class: an AdamW state loads into an SGD without complaint, and its first step() raised KeyError
        "optimizer_class": _optimizer_class(optimizer) if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "freezer": freezer_state if freezer_state is not None else (
            freezer.state_dict() if freezer is not None else None),
        "rng": rng_state(),
        "extra": extra or {},
    }
    torch.save(state, tmp / "state.pt")
    (tmp / STATE_DIGEST).write_text(f"{file_sha256(tmp / 'state.pt')}  state.pt\n")
    for name in ("model.safetensors", "state.pt", STATE_DIGEST):
        _fsync(tmp / name)
    _fsync(tmp)
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    _fsync(path.parent)
    shutil.rmtree(old, ignore_errors=True)
    return path


def _optimizer_class(optimizer: Any) -> str:
    """The class name of the ``torch.optim`` optimizer under ``optimizer``'s wrappers (accelerate's, Lightning's:
    :func:`~layerfreeze.engine.optim.inner_optimizer`)."""
    return type(inner_optimizer(optimizer)).__name__


def read_state(path: Path) -> dict[str, Any]:
    """The verified ``state.pt`` of checkpoint folder ``path``: the state file checked against ``state.pt.sha256``
    before it is unpickled, the weights file against the SHA-256 the state records.

    Raises:
        CheckpointError: a missing file, a state file that does not match its SHA-256 or is unreadable, another
            format version, corrupt weights.
    """
    weights, state_file = path / "model.safetensors", path / "state.pt"
    if not path.is_dir():
        what = "is a file, not a checkpoint folder" if path.exists() else "does not exist"
        raise CheckpointError(f"Checkpoint {path} {what} (a checkpoint is the folder save_checkpoint wrote, with "
                              "model.safetensors and state.pt)")
    for f in (weights, state_file):
        if not f.is_file():
            raise CheckpointError(f"Checkpoint {path} is incomplete: {f.name} is missing")
    digest_file = path / STATE_DIGEST
    if digest_file.is_file():
        recorded = digest_file.read_text(errors="replace").split()[:1]
        if recorded != [file_sha256(state_file)]:
            raise CheckpointError(f"Checkpoint state file {state_file} does not match its recorded SHA-256 "
                                  f"({digest_file.name}): corrupt/truncated")
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a corrupt file
        # torch's own text for a refused unpickling advises weights_only=False ("arbitrary code execution"): never
        # the advice for a corrupt file
        reason = ("torch.load(weights_only=True) refused it" if "weights_only" in str(exc)
                  else str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise CheckpointError(f"Checkpoint state file {state_file} is unreadable ({reason}); it is corrupt") from exc
    version = state.get("format_version") if isinstance(state, dict) else None
    if version not in READABLE_FORMATS:
        raise CheckpointError(f"Checkpoint {path} has format {version!r}; this version of layerfreeze reads "
                              f"{', '.join(map(str, READABLE_FORMATS))}")
    if version >= 2 and not digest_file.is_file():
        raise CheckpointError(f"Checkpoint {path} is incomplete: {STATE_DIGEST} is missing")
    if file_sha256(weights) != state["model_sha256"]:
        raise CheckpointError(f"Checkpoint weights {weights} do not match their recorded SHA-256: corrupt/truncated")
    return state


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    freezer: Freezer | None = None,
    scheduler: Any = None,
    restore_rng: bool = True,
    *,
    load_weights: Any = None,
    load_optimizer: Any = None,
) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save_checkpoint` into live objects built the same way.

    A full checkpoint of a sharded model (:func:`save_full_checkpoint`: every weight, and the optimizer state keyed
    by parameter name, as its ``state.pt`` records) loads too, into an unsharded model (to go on training in one
    process, or to evaluate); into a sharded one, use :func:`load_full_checkpoint`.

    Args:
        load_weights: ``(model, weights_file)`` to load the weights another way (a sharded model); default
            safetensors' ``load_model``.
        load_optimizer: ``(optimizer, saved_state)`` likewise; default ``optimizer.load_state_dict`` (for a full
            checkpoint of a sharded model, its optimizer state put back by parameter name).

    Returns:
        The ``extra`` dict given at save time.

    Raises:
        CheckpointError: missing files, a weights file whose checksum does not match (truncated / corrupt), an
            unknown format version, or state that does not fit the given objects.
    """
    path = Path(path)
    state = read_state(path)
    weights = path / "model.safetensors"
    saved_optimizer = state["optimizer"]
    if load_optimizer is None and isinstance(saved_optimizer, dict) and saved_optimizer.get("format") == BY_NAME:
        if is_sharded(model):
            raise CheckpointError(f"Checkpoint {path} is a full checkpoint of a sharded model (save_full_checkpoint) "
                                  "and this model is sharded: load it with layerfreeze.load_full_checkpoint")
        load_optimizer = functools.partial(load_full_optimizer_state, model)
    saved_class = state.get("optimizer_class")
    if optimizer is not None and saved_class is not None and saved_class != _optimizer_class(optimizer):
        raise CheckpointError(f"Checkpoint {path} holds the state of a {saved_class} optimizer; this one is a "
                              f"{_optimizer_class(optimizer)}: build the optimizer the saved run used")
    try:
        (load_weights or (lambda m, f: load_model(m, str(f))))(model, weights)
        if freezer is not None and state["freezer"] is not None:
            freezer.load_state_dict(state["freezer"])
        if optimizer is not None and state["optimizer"] is not None:
            (load_optimizer or (lambda o, saved: o.load_state_dict(saved)))(optimizer, state["optimizer"])
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
    except (ValueError, KeyError, RuntimeError) as exc:
        hint = ("; it was saved with a Freezer, whose param groups the optimizer's state needs: pass freezer= (built "
                "as the saved run's)" if freezer is None and state["freezer"] is not None else "")
        raise CheckpointError(f"Checkpoint {path} does not fit this run: {exc}{hint}") from exc
    if restore_rng:
        set_rng_state(state["rng"])
    return state["extra"]


_ENTRY = re.compile(r"^(\d{6})-step(\d{9})$")


class CheckpointStore:
    """The last ``keep`` checkpoints of a run, written so that a kill at any instant loses at most the one being
    written, and read back newest-complete-first.

    Layout under ``root`` (a run folder): ``checkpoints/NNNNNN-stepSSSSSSSSS/`` (``N`` counts saves, ``S`` is the
    optimizer step), each a :func:`save_checkpoint` folder, and ``checkpoint``, a symbolic link to the newest,
    replaced atomically after each save (where the filesystem has no links, there is none; the folders suffice).
    A folder still named ``*.tmp`` is an interrupted save: ignored and removed. A run folder written before this
    layout (a plain ``checkpoint/`` folder) is still read.

    Args:
        root: The run folder.
        keep: Complete checkpoints to keep, ``>= 1`` (older ones are deleted after each save).

    Raises:
        ValueError: ``keep < 1``.
    """

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 checkpoints, got {keep}")
        self.root = Path(root)
        self.dir = self.root / rundir.CHECKPOINTS_DIR
        self.link = self.root / rundir.CHECKPOINT_LINK
        self.keep = keep

    def entries(self) -> list[Path]:
        """Finished checkpoint folders, newest first (by save count)."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if p.is_dir() and _ENTRY.match(p.name)]
        return sorted(found, key=lambda p: p.name, reverse=True)

    def candidates(self) -> list[Path]:
        """Where a resume may start, newest first: the store's folders, else a legacy ``checkpoint/`` folder."""
        entries = self.entries()
        if entries:
            return entries
        legacy = self.link
        return [legacy] if legacy.is_dir() and not legacy.is_symlink() and (legacy / "state.pt").exists() else []

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             freezer: Freezer | None = None, scheduler: Any = None, extra: dict[str, Any] | None = None,
             **kwargs: Any) -> Path:
        """Write a new checkpoint (see :func:`save_checkpoint` for ``kwargs``), point ``checkpoint`` at it, and
        delete the ones beyond ``keep``. Returns its folder."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        entries = self.entries()
        count = int(_ENTRY.match(entries[0].name).group(1)) + 1 if entries else 1
        path = self.dir / f"{count:06d}-step{step:09d}"
        save_checkpoint(path, model, optimizer, freezer, scheduler, extra, **kwargs)
        self._point_link(path)
        for old in self.entries()[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def save_full(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, freezer: Freezer | None = None,
                  scheduler: Any = None, extra: dict[str, Any] | None = None) -> Path | None:
        """:meth:`save` of a sharded (FSDP2) model: its full state gathered on rank 0
        (:func:`gather_full_state`), written there as the store's next checkpoint; read it back with
        ``load_latest(..., loader=load_full_checkpoint)``. Collective: every rank calls it; it returns once the
        checkpoint is complete.

        Returns:
            The checkpoint folder on rank 0, None on the other ranks.
        """
        full = gather_full_state(model, optimizer, freezer)
        path = None
        if torch.distributed.get_rank() == 0:
            path = self.save(step, model, None, None, scheduler, extra, **full)
        torch.distributed.barrier()
        return path

    def _point_link(self, path: Path) -> None:
        if self.link.exists() and not self.link.is_symlink():
            return  # a legacy checkpoint/ folder: leave it
        tmp = self.root / ".checkpoint.link.tmp"
        try:
            if tmp.is_symlink() or tmp.exists():
                tmp.unlink()
            os.symlink(os.path.relpath(path, self.root), tmp)
            os.replace(tmp, self.link)
            _fsync(self.root)
        except OSError:
            pass  # no symbolic links here: resume reads checkpoints/ itself

    def load_latest(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    freezer: Freezer | None = None, scheduler: Any = None,
                    loader: Any = None) -> tuple[Path, dict[str, Any]]:
        """Load the newest checkpoint that verifies, falling back (with a warning naming it and why) past corrupt
        or incomplete ones.

        Args:
            loader: ``loader(path, model, optimizer, freezer, scheduler) -> extra``; default :func:`load_checkpoint`
                (:func:`layerfreeze.checkpoint.load_full_checkpoint` for a sharded model).

        Returns:
            ``(folder, extra)`` of the checkpoint loaded.

        Raises:
            FileNotFoundError: the run has no checkpoint at all.
            CheckpointError: every checkpoint is corrupt (the message lists them and why).
        """
        loader = loader or load_checkpoint
        candidates = self.candidates()
        if not candidates:
            raise FileNotFoundError(f"no checkpoint in {self.root} (expected {self.dir}/NNNNNN-stepSSSSSSSSS/)")
        problems = []
        for path in candidates:
            try:
                read_state(path)  # verify before touching the live objects
                return path, loader(path, model, optimizer, freezer, scheduler)
            except CheckpointError as exc:
                problems.append(f"{path.name}: {exc}")
                if path is not candidates[-1]:
                    warnings.warn(f"checkpoint {path} is unusable ({exc}); falling back to an older one",
                                  stacklevel=2)
        raise CheckpointError(f"no usable checkpoint in {self.dir}: " + "; ".join(problems) + "; nothing can be "
                              "resumed from this folder: start the run again with another --run-dir")


def gather_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, freezer: Any = None) -> dict[str, Any]:
    """The full (unsharded) model state on rank 0's CPU, the optimizer state keyed by parameter name and the
    Freezer's state with its gradient sums whole, of a sharded (FSDP2) model: what :func:`save_full_checkpoint`
    writes.

    Collective: every rank calls it. The model state is gathered through ``torch.distributed.checkpoint``
    (``full_state_dict=True, cpu_offload=True``: rank 0 gets it, the other ranks an empty dict); the optimizer
    state by :func:`~layerfreeze.distributed.fsdp.full_optimizer_state` (every rank gets it); the Freezer's by
    ``freezer.state_dict(full=True)`` (AutoFreeze's running gradient sums, one shard on each rank, gathered).

    Returns:
        ``{"model_state", "optimizer_state", "freezer_state"}``: keyword arguments of :func:`save_checkpoint`.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model_state = get_model_state_dict(model, options=full_state_options(cpu_offload=True))
    return {"model_state": model_state, "optimizer_state": full_optimizer_state(model, optimizer),
            "freezer_state": freezer.state_dict(full=True) if freezer is not None else None}


def save_full_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, freezer: Any,
                         scheduler: Any = None, extra: dict[str, Any] | None = None) -> Path:
    """Gather the full model and optimizer state on rank 0 and write a checkpoint folder there.

    Collective: every rank calls it. Frozen weights are in it like every other weight; the optimizer state holds
    only trainable parameters (the Freezer removed the frozen ones), keyed by parameter name.

    Returns:
        The checkpoint folder (written by rank 0 only; the others return the same path once it is complete).
    """
    full = gather_full_state(model, optimizer, freezer)
    path = Path(path)
    if torch.distributed.get_rank() == 0:
        save_checkpoint(path, model, None, None, scheduler, extra, **full)
    torch.distributed.barrier()
    return path


def load_full_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, freezer: Any,
                         scheduler: Any = None, restore_rng: bool = True) -> dict[str, Any]:
    """Restore :func:`save_full_checkpoint` on every rank: weights (re-sharded), freeze state (re-freezes blocks and
    rebuilds the param groups), optimizer state, scheduler, RNG.

    Returns:
        The ``extra`` dict given at save time.

    Raises:
        CheckpointError: missing, corrupt or incompatible checkpoint.
    """
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    return load_checkpoint(
        path, model, optimizer, freezer, scheduler, restore_rng,
        load_weights=lambda m, f: set_model_state_dict(m, load_file(str(f)), options=full_state_options()),
        load_optimizer=lambda o, saved: load_full_optimizer_state(model, o, saved))
