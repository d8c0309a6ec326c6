"""Demoted frozen blocks: while a block is frozen, its weights in a smaller dtype and, where the activation cache serves
it, off the training device; a thaw gives back the float32 weights exactly as they were when it froze.

Why: a frozen block's weights are read, never written. Keeping them in float32 on the training device costs the same
memory as a trainable block's weights, for a forward that bfloat16 computes nearly as well (diffusers casts its frozen
VAE, text encoder and UNet to the mixed-precision dtype for the same reason), and a frozen prefix that the activation
cache serves is not read at all on a cache hit (axolotl's ``layer_offloading``, OneTrainer's RAM offloading and musubi's
``--blocks_to_swap`` offload fixed frozen bases; here the frozen set changes during the run).

What :class:`Demoter` does to a block it manages (:class:`~layerfreeze.engine.freezer.Freezer` calls it at every freeze
and thaw; ``Freezer(..., demote=Demotion(...))``):

* **dtype** (``Demotion(dtype="bfloat16" | "float16")``), when the block freezes: a *master copy* of its floating
  parameters and buffers is kept where it costs no device memory (host memory, or a checksummed safetensors file on
  disk, :attr:`Demotion.master`), then the block's tensors are cast in place (``tensor.data``: the ``Parameter``
  objects stay the same, so the optimizer's bookkeeping, the integrity checks and DDP see no new object). A forward
  pre-hook casts the block's floating inputs to the demoted dtype and a forward hook casts its floating outputs back to
  the dtype its weights had (the trainable part's dtype, float32), so the block computes exactly
  ``block.to(dtype)(x.to(dtype)).to(float32)`` and the next block gets its input in its own dtype.
* **offload** (``Demotion(offload="cpu")``), for the blocks of the frozen prefix the activation cache serves
  (:meth:`Demoter.offload_prefix`, which the CLI trainer calls after every step with the cache's depth): the block's
  parameters move to host memory, and on the training device each is an empty placeholder of its dtype (so
  ``p.device`` and ``p.dtype`` stay what the model's code expects). A block that must run -- a cache miss, an
  evaluation -- is brought back for the length of its forward (the pre-hook copies it to the device, the forward hook
  drops the device copy); a thaw, a cache turned off or a shallower cached prefix brings it back for good.
* **thaw**: the float32 master copy is put back (bitwise the weights at the freeze; a master copy on disk is checked
  against its checksums first, :class:`DemotedWeightsError` if it does not match), the hooks are removed.
* **checkpoints and state dicts**: ``model.state_dict()`` returns a managed block's float32 master values (and an
  offloaded one's host copy), so a checkpoint (:mod:`layerfreeze.checkpoint`, or any framework's) holds the weights a
  non-demoted run would hold; ``model.load_state_dict`` puts float32 values back into a managed block first and demotes
  it again afterwards, with the loaded values as its new master copy. A resumed run therefore demotes the same blocks
  the same way, and a later thaw restores the same float32 bits.
* **integrity** (:mod:`layerfreeze.engine.integrity`): the frozen-weight checksum taken at the freeze covers the
  float32 weights a thaw restores (:meth:`Demoter.kept`), and :meth:`Demoter.mismatches` checks that the demoted copy
  in use is exactly the cast of that master copy.

A block is managed only if demoting it cannot change another block: every parameter it owns is used by its own modules
only (no tied weight shared with another block, no parameter held outside its modules such as a ViT class token, which
the model's own forward reads outside any block); other blocks stay as they are, named in :attr:`Demoter.skipped`.
Demotion needs BatchNorm layers of frozen blocks in eval mode (``train_bn=False``: their running statistics are cast
too) and an unsharded model (FSDP2 keeps DTensor shards the swap cannot replace); the Freezer refuses both.

Memory, per managed block of ``P`` float32 parameter bytes (the ledger shows each: :meth:`Demoter.ledger_bytes`):
``params_frozen`` on the training device ``P / 2`` with bfloat16/float16, ``0`` while offloaded; ``params_master``
``P`` in host memory (``master: memory``) or on disk (``master: disk``, the default when training on the CPU, where
host memory *is* the device memory); ``params_offloaded`` in host memory: what the offloaded block holds there
(``P / 2`` when demoted). Costs: a cast per frozen block at the freeze; with offload, one copy of the block's
weights to the device per forward that runs it (counted in :attr:`Demoter.transfer_bytes`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerfreeze.engine import demotion
from layerfreeze.engine.demotion import DEMOTE_DTYPES, DemotedWeightsError, Demotion, cast_floating, out_of_range
from layerfreeze.engine.integrity import checksum
from layerfreeze.models.blocks import Block
from layerfreeze.runs.ledger_buckets import DISK, Bucket

__all__ = ["DEMOTE_DTYPES", "DemotedWeightsError", "Demoter", "Demotion", "build_demoter"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------------------------
# One managed block
# --------------------------------------------------------------------------------------------------------------


class _Managed:
    """What the Demoter holds for one frozen block it manages.

    ``tensors``: ``(qualified name, tensor)`` of the block's owned parameters, then the floating buffers of its
    modules (the tensors cast; offload moves the parameters only). ``module_keys``: per module of the block, its
    tensors' names relative to it (for the state-dict hooks).
    """

    def __init__(self, block: Block, params: list[tuple[str, nn.Parameter]]) -> None:
        self.block = block
        self.params = list(params)
        names = {id(p) for _, p in params}
        buffers = [(f"{prefix}.{name}" if prefix else name, b) for prefix, module in block.modules
                   for name, b in module.named_buffers() if b.is_floating_point()]
        self.buffers = buffers
        self.tensors: list[tuple[str, torch.Tensor]] = [*params, *buffers]
        floating = [p for _, p in params if p.is_floating_point()]
        #: The dtype the trainable part works in: the block's weights' dtype before the demotion (float32).
        self.out_dtype = floating[0].dtype if floating else torch.float32
        self.dtypes = {name: t.dtype for name, t in self.tensors}
        self.device = floating[0].device if floating else torch.device("cpu")
        self.module_keys: list[tuple[nn.Module, dict[str, str]]] = []
        for prefix, module in block.modules:
            keys = {}
            for rel, p in module.named_parameters():
                if id(p) in names:
                    keys[rel] = f"{prefix}.{rel}" if prefix else rel
            for rel, b in module.named_buffers():
                if b.is_floating_point():
                    keys[rel] = f"{prefix}.{rel}" if prefix else rel
            self.module_keys.append((module, keys))
        self.demoted = False
        self.master: dict[str, torch.Tensor] | None = None  # in host memory
        self.master_file: Path | None = None  # or on disk
        self.master_sums: dict[str, str] = {}  # BLAKE2b of each master tensor
        self.master_bytes = 0
        self.offloaded = False
        self.store: dict[str, torch.Tensor] = {}  # an offloaded block's parameters in host memory
        self.hooks: list[Any] = []
        self.keep_vars = False  # the state_dict call in progress asked for the live Parameter objects
        self.loading = 0  # nested load_state_dict hooks of the block's modules in progress
        self.reoffload = False  # offload again after the load
        self.restore_data: dict[str, torch.Tensor] = {}  # the demoted tensors full_precision() put aside

    def by_name(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)


def _remove(root: str, made: list[str]) -> None:
    """Delete the master files under ``root``, then the folders made for them (deepest first) that are empty (a
    run's ``demoted/rankN``: a data-parallel run left them behind, empty)."""
    shutil.rmtree(root, True)
    for folder in made:
        try:
            os.rmdir(folder)
        except OSError:  # not empty (another rank's folder, a kept file): leave it
            break

class Demoter:
    """Demotes (casts, offloads) the frozen blocks a :class:`~layerfreeze.engine.freezer.Freezer` freezes, and restores
    them exactly at a thaw (module docstring). The Freezer builds it from ``Freezer(..., demote=...)``.

    Args:
        spec: What to do (:class:`Demotion`).
        blocks: The model's blocks, front to back.

    Attributes:
        skipped: ``{block index: why}`` for blocks it never demotes (a tied or outside parameter).
        transfer_bytes / transfers: Bytes (and count) of offloaded weights copied to the device to run a block.

    Byte source of the memory ledger (:meth:`ledger_bytes`): ``params_master`` (host memory or disk) and
    ``params_offloaded`` (host memory).
    """

    def __init__(self, spec: Demotion, blocks: Sequence[Block]) -> None:
        self.spec = spec
        self.blocks = list(blocks)
        self.dtype = spec.torch_dtype
        self.skipped: dict[int, str] = {}
        self._managed: dict[int, _Managed] = {}
        self.transfer_bytes = 0
        self.transfers = 0
        self.master_places: set[str] = set()  # where master copies were kept during the run: "memory", "disk"
        #: Thaws that gave a demoted block its float32 weights back. Each one replaced the dtype of trainable
        #: parameters' data, which resets their autograd gradient accumulators: a DDP wrapper built before it must be
        #: rebuilt even when the frozen set is the one it was built for (a block switched off and on again).
        self.restores = 0
        self._root: Path | None = None
        self._finalizer: weakref.finalize | None = None
        users: dict[int, set[int]] = {}  # parameter id -> the blocks whose modules use it
        for block in self.blocks:
            for _, p in block._all_named_parameters():
                users.setdefault(id(p), set()).add(block.index)
        for block in self.blocks:
            why = None
            if block.params:
                why = (f"it holds parameters outside its modules ({', '.join(n for n, _ in block.params)}), which the "
                       "model's forward reads outside the block")
            elif block.tied:
                why = f"its modules use tied parameters owned by another block ({', '.join(block.tied)})"
            else:
                shared = [n for n, p in block.named_parameters() if len(users.get(id(p), ())) > 1]
                if shared:
                    why = f"its parameters are tied into another block's modules ({', '.join(shared)})"
            if why is not None:
                self.skipped[block.index] = why

    # ---- queries -------------------------------------------------------------------------------------------

    def manages(self, index: int) -> bool:
        """Whether block ``index`` is frozen and demoted/offloadable by this Demoter."""
        return index in self._managed

    def is_demoted(self, index: int) -> bool:
        m = self._managed.get(index)
        return m is not None and m.demoted

    def is_offloaded(self, index: int) -> bool:
        m = self._managed.get(index)
        return m is not None and m.offloaded

    @property
    def demoted_blocks(self) -> list[str]:
        return [m.block.name for _, m in sorted(self._managed.items()) if m.demoted]

    @property
    def offloaded_blocks(self) -> list[str]:
        return [m.block.name for _, m in sorted(self._managed.items()) if m.offloaded]

    # ---- freeze / thaw -------------------------------------------------------------------------------------

    def on_freeze(self, block: Block, params: list[tuple[str, nn.Parameter]]) -> str | None:
        """Take over a block that just froze: cast it (with a dtype) and install its hooks.

        Args:
            params: ``(name, parameter)`` the freeze stopped training (all the block's own ones: ``train_bn=False``).

        Returns:
            None when the block is managed now, else why not (it is in :attr:`skipped`).
        """
        if block.index in self.skipped:
            return self.skipped[block.index]
        if block.index in self._managed:
            return None
        m = _Managed(block, params)
        if self.dtype is not None and (why := out_of_range(block.name, self.dtype, m.tensors)) is not None:
            return why  # float32 while frozen (a later freeze checks again)
        self._managed[block.index] = m
        if self.dtype is not None and any(t.is_floating_point() and t.dtype != self.dtype for _, t in m.tensors):
            self._demote(m, take_master=True)
        self._install_hooks(m)
        return None

    def on_thaw(self, block: Block) -> None:
        """Give a block that thaws its float32 weights back, exactly, on the training device, and remove its hooks.

        Raises:
            DemotedWeightsError: the master copy does not match its checksums (the block stays demoted).
        """
        m = self._managed.get(block.index)
        if m is None:
            return
        if m.offloaded:
            self._restore_offloaded(m)
        if m.demoted:
            self._promote(m)
            self._drop_master(m)
            self.restores += 1
        for handle in m.hooks:
            handle.remove()
        del self._managed[block.index]

    def offload_prefix(self, depth: int) -> None:
        """Offload the managed blocks among ``0..depth-1`` (the frozen prefix the activation cache serves), bring back
        for good the offloaded blocks at ``depth`` and beyond. No-op without ``offload``.

        Call it with the cache's depth after every step (the CLI trainer does), and with 0 when the cache is off.
        """
        if self.spec.offload is None:
            return
        for index, m in sorted(self._managed.items()):
            if index < depth and not m.offloaded:
                self._offload(m)
            elif index >= depth and m.offloaded:
                self._restore_offloaded(m)

    def demoted_bytes(self, block: Block) -> dict[str, dict[str, int]]:
        """What demoting ``block`` at its freeze changes, in bytes per bucket and device, the block left untouched (a
        memory plan's figure): ``params_frozen`` and ``buffers`` shrink by the cast (negative, on the tensors'
        devices), ``params_master`` grows by the master copy, in host memory (``"cpu"``) or on disk (:data:`DISK`).
        Empty for a block it would not manage (:attr:`skipped`), one it would keep in float32 for values beyond the
        dtype's range (:func:`~layerfreeze.engine.demotion.out_of_range`), or with nothing to cast. Offloading moves
        the cast weights to host memory (``params_offloaded``), which changes no total: left out."""
        m = _Managed(block, list(block.named_parameters()))
        if self.dtype is None or block.index in self.skipped or demotion.beyond_range(self.dtype, m.tensors):
            return {}
        size = torch.empty((), dtype=self.dtype).element_size()
        owned = {n for n, _ in m.params}
        out: dict[str, dict[str, int]] = {}
        for name, t in m.tensors:
            if t.is_floating_point() and t.dtype != self.dtype:
                per = out.setdefault(Bucket.PARAMS_FROZEN if name in owned else Bucket.BUFFERS, {})
                per[str(t.device)] = per.get(str(t.device), 0) - t.numel() * (t.element_size() - size)
        if out:  # _demote takes a master copy of every tensor of the block
            place = "cpu" if self._master_place(m) == "memory" else DISK
            out[Bucket.PARAMS_MASTER] = {place: sum(_nbytes(t) for _, t in m.tensors)}
        return out

    # ---- integrity -----------------------------------------------------------------------------------------

    def kept(self, block: Block, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The weights a thaw of ``block`` would give back, as ``(name, tensor)`` for the names of ``named`` (the
        block's frozen parameters): the master copy of a demoted block, the host copy of an offloaded one, else the
        live tensors. What the frozen-weight checksum is verified against.

        Raises:
            DemotedWeightsError: a master file that does not match its checksums.
        """
        m = self._managed.get(block.index)
        if m is None or not (m.demoted or m.offloaded):
            return named
        source = self._master(m) if m.demoted else m.store
        return [(n, source.get(n, t)) for n, t in named]

    def mismatches(self, block: Block) -> list[str]:
        """Names of ``block``'s tensors whose demoted copy in use (on the device or offloaded) is not exactly the cast
        of its master copy (empty for a block that is not demoted).

        Raises:
            DemotedWeightsError: a master copy that does not match its checksums (the message names the block).
        """
        m = self._managed.get(block.index)
        if m is None or not m.demoted:
            return []
        master = self._master(m)
        live = {n: (m.store[n] if m.offloaded and n in m.store else t) for n, t in m.tensors}
        want = checksum((n, master[n].to(live[n].dtype)) for n in live if n in master)
        got = checksum((n, live[n]) for n in live if n in master)
        return sorted(n for n in want if want[n] != got.get(n))

    # ---- memory --------------------------------------------------------------------------------------------

    def ledger_bytes(self) -> dict[str, dict[str, int]]:
        """What the Demoter holds, for the memory ledger: ``params_master`` (``{"cpu": bytes}`` in host memory,
        ``{"disk": bytes}`` for master files) and ``params_offloaded`` (``{"cpu": bytes}``)."""
        memory = sum(m.master_bytes for m in self._managed.values() if m.master is not None)
        disk = sum(m.master_bytes for m in self._managed.values() if m.master_file is not None)
        offloaded = sum(_nbytes(t) for m in self._managed.values() if m.offloaded for t in m.store.values()
                        if t.device.type == "cpu")
        return {Bucket.PARAMS_MASTER: {"cpu": memory, DISK: disk}, Bucket.PARAMS_OFFLOADED: {"cpu": offloaded}}

    def summary(self) -> dict[str, Any]:
        """For a run's summary: the settings, the blocks demoted / offloaded now, those skipped and why, the transfer
        count and bytes, and ``master_places``: where master copies were kept during the run (``memory``, ``disk``:
        files under ``directory``, deleted by :meth:`close`)."""
        return {**self.spec.to_dict(), "demoted_blocks": self.demoted_blocks,
                "master_places": sorted(self.master_places),
                "master_dir": str(self.spec.directory) if self.spec.directory is not None else None,
                "offloaded_blocks": self.offloaded_blocks,
                "skipped": {self.blocks[i].name: why for i, why in sorted(self.skipped.items())},
                "transfers": self.transfers, "transfer_bytes": self.transfer_bytes}

    # ---- lifetime ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Training is over: give every managed block its float32 weights back on the device (they stay frozen),
        remove the hooks and delete the master files. Idempotent.

        Raises:
            DemotedWeightsError: a master copy does not match its checksums (the files are kept then).
        """
        for index in sorted(self._managed):
            self.on_thaw(self._managed[index].block)
        if self._finalizer is not None:
            self._finalizer()
        self._root = None

    # ---- mechanics -----------------------------------------------------------------------------------------

    def _master_place(self, m: _Managed) -> str:
        if self.spec.master != "auto":
            return self.spec.master
        return "disk" if m.device.type == "cpu" else "memory"

    def _demote(self, m: _Managed, take_master: bool) -> None:
        """Keep the master copy (when ``take_master``), then cast the block's floating tensors in place."""
        if take_master:
            self._take_master(m)
        with torch.no_grad():
            for _, t in m.tensors:
                if t.is_floating_point() and t.dtype != self.dtype:
                    t.data = t.data.to(self.dtype)
        m.demoted = True

    def _take_master(self, m: _Managed) -> None:
        self._drop_master(m)
        master = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in m.tensors}
        m.master_sums = checksum(master.items())
        m.master_bytes = sum(_nbytes(t) for t in master.values())
        self.master_places.add(self._master_place(m))
        if self._master_place(m) == "disk":
            from safetensors.torch import save_file

            path = self._ensure_root() / f"block-{m.block.index:04d}.safetensors"
            tmp = path.with_name(path.name + ".tmp")
            save_file(master, str(tmp), metadata={"format": "layerfreeze-demoted-master", "block": m.block.name})
            tmp.replace(path)
            m.master_file = path
        else:
            m.master = master

    def _master(self, m: _Managed) -> dict[str, torch.Tensor]:
        """The block's master copy (read from its file and checked against its checksums when on disk)."""
        if m.master is not None:
            master = m.master
        elif m.master_file is not None:
            from safetensors.torch import load_file

            try:
                master = load_file(str(m.master_file))
            except Exception as exc:  # a missing or damaged file: safetensors raises its own error types
                raise DemotedWeightsError(
                    f"the float32 master copy of demoted block {m.block.name!r} ({m.master_file}) is unreadable "
                    f"({type(exc).__name__}: {exc}); its weights cannot be restored exactly") from None
        else:
            raise DemotedWeightsError(f"demoted block {m.block.name!r} has no master copy (the Demoter was closed)")
        sums = checksum(master.items())
        bad = sorted(n for n in m.master_sums if sums.get(n) != m.master_sums[n])
        if bad:
            where = m.master_file if m.master_file is not None else "host memory"
            raise DemotedWeightsError(
                f"the float32 master copy of demoted block {m.block.name!r} ({where}) does not match its checksums "
                f"(tensors {', '.join(bad)}): it was modified or corrupted, so its weights cannot be restored exactly")
        return master

    def _drop_master(self, m: _Managed) -> None:
        if m.master_file is not None:
            m.master_file.unlink(missing_ok=True)
        m.master, m.master_file, m.master_sums, m.master_bytes = None, None, {}, 0

    def _promote(self, m: _Managed) -> None:
        """Put the master copy back into the block's tensors (float32, on the training device)."""
        master = self._master(m)
        with torch.no_grad():
            for name, t in m.tensors:
                if name in master:
                    t.data = master[name].to(device=t.device, dtype=m.dtypes[name])
        m.demoted = False

    def _offload(self, m: _Managed) -> None:
        """Move the block's parameters to host memory; leave an empty placeholder of their dtype on the device."""
        with torch.no_grad():
            for name, p in m.params:
                data = p.data
                m.store[name] = data if data.device.type == "cpu" else data.to("cpu")
                p.data = torch.empty(0, dtype=data.dtype, device=data.device)
        m.offloaded = True

    def _bring(self, m: _Managed) -> None:
        """Copy an offloaded block's parameters to the device for one forward (the store keeps the host copy)."""
        with torch.no_grad():
            for name, p in m.params:
                stored = m.store[name]
                p.data = stored.to(p.device)
                if p.device.type != "cpu":
                    self.transfer_bytes += _nbytes(stored)
        self.transfers += 1

    def _release(self, m: _Managed) -> None:
        """Drop the device copy an offloaded block got for its forward."""
        with torch.no_grad():
            for _, p in m.params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _restore_offloaded(self, m: _Managed) -> None:
        """Bring an offloaded block back to the device for good."""
        with torch.no_grad():
            for name, p in m.params:
                stored = m.store.pop(name)
                p.data = stored.to(p.device)
        m.store = {}
        m.offloaded = False

    def _ensure_root(self) -> Path:
        if self._root is None:
            directory = self.spec.directory
            made: list[str] = []  # the folders made here (deepest first), removed with the files when empty
            if directory is not None:
                made = [str(p) for p in (Path(directory), *Path(directory).parents) if not p.exists()]
                Path(directory).mkdir(parents=True, exist_ok=True)
            self._root = Path(tempfile.mkdtemp(prefix="layerfreeze-demoted-", dir=directory))
            self._finalizer = weakref.finalize(self, _remove, str(self._root), made)
        return self._root

    # ---- hooks ---------------------------------------------------------------------------------------------

    def _install_hooks(self, m: _Managed) -> None:
        for module, keys in m.module_keys:
            m.hooks.append(module.register_forward_pre_hook(self._pre_hook(m), with_kwargs=True))
            m.hooks.append(module.register_forward_hook(self._post_hook(m)))
            m.hooks.append(module.register_state_dict_pre_hook(self._state_pre_hook(m)))
            m.hooks.append(module.register_state_dict_post_hook(self._state_post_hook(m, keys)))
            m.hooks.append(module.register_load_state_dict_pre_hook(self._load_pre_hook(m)))
            m.hooks.append(module.register_load_state_dict_post_hook(self._load_post_hook(m)))

    def _pre_hook(self, m: _Managed) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if m.offloaded:
                self._bring(m)
            if m.demoted and self.dtype is not None:
                return cast_floating(args, self.dtype), cast_floating(kwargs, self.dtype)
            return None
        return hook

    def _post_hook(self, m: _Managed) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if m.offloaded:
                self._release(m)
            if m.demoted and self.dtype is not None:
                return cast_floating(output, m.out_dtype, only=self.dtype)
            return None
        return hook

    def _state_pre_hook(self, m: _Managed) -> Callable[..., None]:
        def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            m.keep_vars = keep_vars
        return hook

    def _state_post_hook(self, m: _Managed, keys: dict[str, str]) -> Callable[..., None]:
        def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            if m.keep_vars or not (m.demoted or m.offloaded):
                return  # keep_vars asks for the live Parameter objects
            source = self._master(m) if m.demoted else m.store
            for rel, name in keys.items():
                key = prefix + rel
                if key in state_dict and name in source:
                    state_dict[key] = source[name]
        return hook

    def _load_pre_hook(self, m: _Managed) -> Callable[..., None]:
        def hook(module: nn.Module, *args: Any) -> None:
            # the values loaded must land in float32 tensors on the device, not in a demoted or empty one
            m.loading += 1
            if m.loading == 1:
                m.reoffload = m.offloaded
                if m.offloaded:
                    self._restore_offloaded(m)
                if m.demoted:
                    self._promote(m)
        return hook

    def _load_post_hook(self, m: _Managed) -> Callable[..., None]:
        def hook(module: nn.Module, incompatible: Any) -> None:
            m.loading -= 1
            if m.loading == 0 and m.block.index in self._managed:
                if self.dtype is not None:  # the loaded values are the new master copy
                    self._demote(m, take_master=True)
                if m.reoffload:
                    self._offload(m)
        return hook

    @contextmanager
    def full_precision(self) -> Iterator[None]:
        """Inside, every managed block holds its float32 weights on the device (masters put back, offloaded blocks
        brought back); on exit each is demoted and offloaded again as it was, from the same master copy."""
        undo = []
        for m in self._managed.values():
            undo.append((m, m.offloaded, m.demoted))
            if m.offloaded:
                self._restore_offloaded(m)
            if m.demoted:
                demoted = {n: t.data for n, t in m.tensors}
                self._promote(m)
                m.restore_data = demoted
        try:
            yield
        finally:
            for m, offloaded, demoted in undo:
                if demoted:
                    with torch.no_grad():
                        for n, t in m.tensors:
                            t.data = m.restore_data[n]
                    m.restore_data = {}
                    m.demoted = True
                if offloaded:
                    self._offload(m)


def build_demoter(demote: Demotion | dict[str, Any] | str | torch.dtype | None, blocks: Sequence[Block], *,
                  train_bn: bool, sharded: bool) -> Demoter | None:
    """The :class:`Demoter` of ``Freezer(..., demote=...)``: a :class:`Demotion`, its keyword arguments as a dict
    (``{"dtype": "bfloat16"}``) or a dtype alone (``"bfloat16"``, ``torch.float16``: ``Demotion(dtype=...)``); None
    without one.

    Raises:
        TypeError: ``demote`` is none of these.
        ValueError: ``train_bn`` (the BatchNorm layers of frozen blocks keep training, in float32, inside blocks that
            demotion casts), an FSDP2-sharded model (``sharded``: its parameters are DTensor shards), or a bad
            :class:`Demotion` setting.
    """
    if demote is None:
        return None
    if isinstance(demote, Demotion):
        spec = demote
    elif isinstance(demote, (str, torch.dtype)):
        spec = Demotion(dtype=demote)
    elif isinstance(demote, Mapping):
        spec = Demotion.from_settings(demote)
    else:
        raise TypeError(f"demote must be a Demotion, a dict of its settings ({{'dtype': 'bfloat16'}}) or a dtype "
                        f"('bfloat16', 'float16'), got {type(demote).__name__}")
    if train_bn:
        raise ValueError("demote needs train_bn=False: with train_bn the BatchNorm layers of frozen blocks keep "
                         "training, in float32, inside blocks that demotion casts")
    if sharded:
        raise ValueError("demote does not work on an FSDP2-sharded model (its parameters are DTensor shards); "
                         "shard_blocks frees the memory of frozen blocks another way")
    return Demoter(spec, blocks)
