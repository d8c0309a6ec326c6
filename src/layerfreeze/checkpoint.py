"""Resumable checkpoints that carry the freeze state.

A checkpoint is a folder:

* ``model.safetensors`` — the model's weights (safetensors, no pickle);
* ``state.pt`` — optimizer, LR scheduler, :class:`~layerfreeze.engine.Freezer` state (frozen blocks, param-group
  membership by parameter name, strategy state), RNG states, the caller's extra fields (step, epoch, config),
  and the SHA-256 of ``model.safetensors`` so a truncated or corrupt weights file is detected, not loaded.

Loading restores, in this order: weights, freezer state (re-freezes blocks and rebuilds the optimizer's param
groups so they match the saved ones), optimizer state, scheduler state, RNG states. That order is what avoids the
public faults "loaded state dict has a different number of parameter groups", a ``KeyError`` packing state of
removed parameters, and resumed runs whose frozen blocks silently train again (or thawed ones never do).

A folder is written next to the destination and renamed into place, so an interrupted save never leaves a
half-written checkpoint under the final name.
"""

from __future__ import annotations

import hashlib
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_file, save_model
from torch import nn

from .engine import Freezer

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or from an incompatible version."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
) -> Path:
    """Write a checkpoint folder at ``path`` (replacing an older one atomically).

    Args:
        extra: Caller fields to keep (plain Python values / tensors), e.g. ``{"step": 120, "epoch": 2}``.
        model_state / optimizer_state: Full state dicts to write instead of ``model`` / ``optimizer``'s own (a
            sharded model's gathered state: :func:`layerfreeze.fsdp.save_full_checkpoint`).

    Returns:
        The checkpoint folder.
    """
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
        "model_sha256": _sha256(tmp / "model.safetensors"),
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "freezer": freezer.state_dict() if freezer is not None else None,
        "rng": rng_state(),
        "extra": extra or {},
    }
    torch.save(state, tmp / "state.pt")
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def read_state(path: Path) -> dict[str, Any]:
    """The verified ``state.pt`` of checkpoint folder ``path`` (its weights file checked against its SHA-256).

    Raises:
        CheckpointError: a missing file, an unreadable state file, another format version, corrupt weights.
    """
    weights, state_file = path / "model.safetensors", path / "state.pt"
    for f in (weights, state_file):
        if not f.is_file():
            raise CheckpointError(f"Checkpoint {path} is incomplete: {f.name} is missing")
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a corrupt file
        raise CheckpointError(f"Checkpoint state file {state_file} is unreadable ({exc}); it is corrupt") from exc
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"Checkpoint {path} has format {state.get('format_version')!r}, need {FORMAT_VERSION}")
    if _sha256(weights) != state["model_sha256"]:
        raise CheckpointError(f"Checkpoint weights {weights} do not match their recorded SHA-256: corrupt/truncated")
    return state


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    freezer: Freezer | None = None,
    scheduler: Any = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save_checkpoint` into live objects built the same way.

    Returns:
        The ``extra`` dict given at save time.

    Raises:
        CheckpointError: missing files, a weights file whose checksum does not match (truncated / corrupt), an
            unknown format version, or state that does not fit the given objects.
    """
    path = Path(path)
    state = read_state(path)
    weights = path / "model.safetensors"
    try:
        load_model(model, str(weights))
        if freezer is not None and state["freezer"] is not None:
            freezer.load_state_dict(state["freezer"])
        if optimizer is not None and state["optimizer"] is not None:
            optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"Checkpoint {path} does not fit this run: {exc}") from exc
    if restore_rng:
        set_rng_state(state["rng"])
    return state["extra"]
