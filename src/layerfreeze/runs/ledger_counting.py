"""How the memory ledger counts: each tensor storage once, on its own device, for its bucket and block.

The ledger (:class:`~layerfreeze.runs.ledger.MemoryLedger`) wires these into a training step; the buckets are
:mod:`~layerfreeze.runs.ledger_buckets`'s.

* storages: :func:`_storage` (a storage's key, bytes and device), :func:`_is_parameter`, :func:`_dtype_name`;
* a tally of one snapshot (:class:`_Tally`) and the walks that fill it: parameters and gradients
  (:func:`_count_model`), buffers (:func:`_count_buffers`), optimizer state (:func:`_count_optimizer`), byte sources
  (:func:`_count_sources`), the storages that are never saved activations (:func:`_held_storages`), the CUDA
  caching allocator's figures (:func:`_allocator`);
* saved tensors: what the saved-tensor hooks keep (:class:`_Saved`) and the storages one forward holds for backward
  (:class:`_Segment`, :class:`_Live`);
* optimizers: :func:`innermost_optimizer` (a framework's wrapper unwrapped), :func:`_inner_optimizers`.

**Devices.** A tensor counts on its own device (``str(tensor.device)``: ``"cpu"``, ``"cuda:1"``); a DTensor (FSDP2)
counts its local shard, so under ``torch.distributed`` each rank's ledger is that rank's: a parameter of ``N`` bytes
sharded over ``W`` ranks counts ``N / W`` on each when its first dimension divides by ``W``. A storage is counted whole
(a saved slice keeps its whole storage alive) and once per snapshot, so what FSDP2 allocates is what counts: each
parameter's shard is padded to ``ceil(dim0 / W)`` rows on every rank (a rank with fewer rows holds the padding too);
the gradients of one ``fully_shard`` group are views of one reduce-scatter output (padded the same way; counted once,
for the block of the group's first parameter with a gradient); Adam's moments are the shard's own size (no
padding); Adam's ``step`` is a plain 4-byte tensor per parameter on every rank.

Nothing here synchronizes the host with a device: storages are read through their metadata (``untyped_storage()``,
``data_ptr()``, ``nbytes()``), the allocator's figures are the host's (``torch.cuda.memory_allocated`` ...).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from layerfreeze.runs.ledger_buckets import BLOCK_BUCKETS, Bucket

__all__ = ["innermost_optimizer"]


# --------------------------------------------------------------------------------------------------------------
# Storages
# --------------------------------------------------------------------------------------------------------------


def _storage(t: torch.Tensor) -> tuple[Any, int, str] | None:
    """``(key, bytes, device)`` of the storage behind ``t``: the key identifies the storage (so a storage shared by
    several tensors, views included, counts once), the bytes are the whole storage's (what keeping it alive costs).
    A DTensor (FSDP2) counts its local shard's storage (FSDP2's padding included). None for a tensor without memory
    (meta)."""
    if type(t) is not torch.Tensor and type(t) is not nn.Parameter:
        local = getattr(t, "_local_tensor", None)
        if isinstance(local, torch.Tensor):
            t = local
    device = t.device
    if device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass without a storage of its own
        return ("id", id(t)), t.numel() * t.element_size(), str(device)
    name = str(device)
    return (name, storage.data_ptr()), storage.nbytes(), name


def _is_parameter(t: torch.Tensor | None) -> bool:
    """``isinstance(t, nn.Parameter)``, fast for a plain tensor (the metaclass check is a Python call)."""
    return t is not None and type(t) is not torch.Tensor and isinstance(t, nn.Parameter)


def _is_weight_cast(t: torch.Tensor) -> bool:
    """``t`` (or the tensor it is a view of: a linear saves ``weight.t()``) is autocast's copy of a trainable
    parameter in the compute dtype (``ToCopyBackward0`` straight onto the parameter's gradient accumulator): the
    casts autocast caches for the whole forward and the backward holds."""
    if t._base is not None:
        t = t._base
    fn = t.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    nxt = fn.next_functions[0][0] if fn.next_functions else None
    return nxt is not None and _is_parameter(getattr(nxt, "variable", None))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------------------------------------------


def innermost_optimizer(optimizer: Any) -> Any:
    """What a framework's optimizer wrapper holds, unwrapped through ``.optimizer`` / ``._optimizer`` (accelerate's
    ``AcceleratedOptimizer``, itself an Optimizer subclass; Lightning's ``LightningOptimizer``); anything without
    one (an optimizer, a class, a factory) is returned as it is."""
    while True:
        inner = getattr(optimizer, "optimizer", None)
        inner = inner if inner is not None else getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer or isinstance(inner, (list, tuple, dict)):
            return optimizer
        optimizer = inner


def _inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The ``torch.optim`` optimizers behind ``optimizer`` (one, a sequence, or a framework's wrapper)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, (list, tuple)):
        return [o for item in optimizer for o in _inner_optimizers(item)]
    optimizer = innermost_optimizer(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"MemoryLedger: optimizer must be a torch.optim.Optimizer (or a framework's wrapper of one), "
                        f"got {type(optimizer).__qualname__}")
    return [optimizer]


# --------------------------------------------------------------------------------------------------------------
# A snapshot's tally: the model, its optimizer, the byte sources, the allocator
# --------------------------------------------------------------------------------------------------------------


class _Tally:
    """Bytes per device and bucket, per block, each storage once."""

    def __init__(self, num_blocks: int) -> None:
        self.devices: dict[str, dict[str, int]] = {}
        self.blocks = {b: [0] * num_blocks for b in BLOCK_BUCKETS}
        self.params_dtype: dict[str, dict[str, int]] = {}
        self.seen: set[Any] = set()

    def add(self, bucket: str, device: str, nbytes: int) -> None:
        per = self.devices.setdefault(str(device), {})
        bucket = str(bucket)  # a plain str, also for a Bucket member
        per[bucket] = per.get(bucket, 0) + int(nbytes)


def _held_storages(model: nn.Module, sources: Iterable[Any]) -> set[Any]:
    """Storage keys of the model's parameters and buffers and the sources' tensors: never saved activations."""
    tensors = [*model.parameters(), *model.buffers()]
    for source in sources:
        held = getattr(source, "ledger_tensors", None)
        tensors += list(held()) if held is not None else []
    return {info[0] for info in map(_storage, tensors) if info is not None}


def _count_model(tally: _Tally, model: nn.Module, block: Callable[[torch.Tensor], int | None]) -> None:
    """The parameters (trainable/frozen, by dtype, per block) and their gradients, in one walk."""
    sums: dict[tuple[str, str], int] = {}
    dtypes = tally.params_dtype
    per_block_params, per_block_grads = tally.blocks["params"], tally.blocks["grads"]
    for p in model.parameters():
        index = block(p)
        info = _storage(p)
        if info is not None:
            key, nbytes, device = info
            if key not in tally.seen:
                tally.seen.add(key)
                kind = "trainable" if p.requires_grad else "frozen"
                sums[(f"params_{kind}", device)] = sums.get((f"params_{kind}", device), 0) + nbytes
                per_dtype = dtypes.setdefault(kind, {})
                name = _dtype_name(p.dtype)
                per_dtype[name] = per_dtype.get(name, 0) + nbytes
                if index is not None:
                    per_block_params[index] += nbytes
        g = p.grad
        info = None if g is None else _storage(g)
        if info is not None and info[0] not in tally.seen:
            key, nbytes, device = info
            tally.seen.add(key)
            sums[(Bucket.GRADS.value, device)] = sums.get((Bucket.GRADS.value, device), 0) + nbytes
            if index is not None:
                per_block_grads[index] += nbytes
    for (bucket, device), n in sums.items():
        tally.add(bucket, device, n)


def _count_buffers(tally: _Tally, model: nn.Module) -> None:
    sums: dict[str, int] = {}
    for b in model.buffers():
        info = _storage(b)
        if info is None:
            continue
        key, nbytes, device = info
        if key not in tally.seen:
            tally.seen.add(key)
            sums[device] = sums.get(device, 0) + nbytes
    for device, n in sums.items():
        tally.add(Bucket.BUFFERS, device, n)


def _count_optimizer(tally: _Tally, optimizers: Iterable[torch.optim.Optimizer],
                     block: Callable[[torch.Tensor], int | None]) -> None:
    sums: dict[str, int] = {}
    per_block = tally.blocks["optimizer"]
    for opt in optimizers:
        for p, state in opt.state.items():
            index = block(p) if isinstance(p, torch.Tensor) else None
            for value in state.values():
                info = _storage(value) if isinstance(value, torch.Tensor) else None
                if info is None or info[0] in tally.seen:
                    continue
                key, nbytes, device = info
                tally.seen.add(key)
                sums[device] = sums.get(device, 0) + nbytes
                if index is not None:
                    per_block[index] += nbytes
    for device, n in sums.items():
        tally.add(Bucket.OPTIMIZER, device, n)


def _check_bucket_name(source: Any, bucket: str) -> None:
    """A source's own bucket name is kept as it is; one a letter or two away from the ledger's own is a typo (a new
    bucket would hold the bytes the named one misses).

    Raises:
        ValueError: naming the bucket it is close to.
    """
    known = [b.value for b in Bucket]
    if bucket in known:
        return
    close = difflib.get_close_matches(bucket, known, n=1, cutoff=0.8)
    if close:
        raise ValueError(f"MemoryLedger: byte source {type(source).__qualname__} reported bucket {bucket!r}: did you "
                         f"mean {close[0]!r}? (a source may add buckets of its own names, but not near-copies of the "
                         "ledger's)")


def _count_sources(tally: _Tally, sources: Iterable[Any], default_device: str) -> None:
    for source in sources:
        report = source.ledger_bytes() if hasattr(source, "ledger_bytes") else source()
        for bucket, value in report.items():
            _check_bucket_name(source, str(bucket))
            per_device = value if isinstance(value, Mapping) else {default_device: value}
            for device, nbytes in per_device.items():
                if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
                    raise ValueError(f"MemoryLedger: byte source {type(source).__qualname__} reported "
                                     f"{nbytes!r} for bucket {bucket!r} on {device!r}; bytes must be ints >= 0")
                tally.add(str(bucket), str(device), nbytes)


def _allocator(devices: Iterable[str]) -> dict[str, dict[str, int]]:
    """The CUDA caching allocator's figures for each CUDA device the ledger saw (never initializes CUDA)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    out = {}
    for name in sorted({d for d in devices if d.startswith("cuda")}):
        dev = torch.device(name)
        out[name] = {"allocated": int(torch.cuda.memory_allocated(dev)),
                     "reserved": int(torch.cuda.memory_reserved(dev)),
                     "peak_allocated": int(torch.cuda.max_memory_allocated(dev)),
                     "peak_reserved": int(torch.cuda.max_memory_reserved(dev))}
    return out


# --------------------------------------------------------------------------------------------------------------
# Saved activations: what autograd holds for backward
# --------------------------------------------------------------------------------------------------------------


class _Live:
    """One storage autograd holds for backward: how many saved tensors hold it, its bytes, device and block (the
    first block that saved it, which it counts for), and ``last``: the last block that saved it (the number of
    blocks when an op after the last block, the loss, saved it too; None until known)."""

    __slots__ = ("block", "cast", "count", "device", "last", "nbytes")

    def __init__(self, nbytes: int, device: str, block: int | None, cast: bool = False) -> None:
        self.count, self.nbytes, self.device, self.block, self.cast = 0, nbytes, device, block, cast
        self.last = block


class _Saved:
    """What the pack hook gives autograd to keep: the tensor (detached: a saved output holding its own ``grad_fn``
    would be a reference cycle), and a release of its storage's count when autograd drops it."""

    __slots__ = ("key", "segment", "tensor")

    def __init__(self, tensor: torch.Tensor, segment: _Segment | None, key: Any) -> None:
        self.tensor, self.segment, self.key = tensor, segment, key

    def __del__(self) -> None:
        if self.segment is not None:
            self.segment.release(self.key)


#: What one forward's saved activations come to (:meth:`_Segment.close`): bytes per device, per block, outside every
#: block, autocast's weight casts per device, and per block ``k`` the bytes a frozen prefix of ``k`` blocks still
#: holds of the storages counted for blocks before ``k`` (:meth:`_Segment.close`).
SegmentResult = tuple[dict[str, int], list[int], int, dict[str, int], list[int]]


class _Segment:
    """The saved activations of one forward (a step with gradient accumulation has several; the largest counts):
    the storages autograd holds, counted when the backward starts (its first unpack), so a graph dropped during the
    forward (a check that ran an op under autograd) is not counted."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.live: dict[Any, _Live] = {}
        self.pending: list[_Live] = []  # saved between blocks: they count for the next block that runs
        self.again: list[_Live] = []  # saved again between blocks: the next block that runs saved them last
        self.result: SegmentResult | None = None

    def hold(self, key: Any, nbytes: int, device: str, block: int | None, cast: bool = False) -> None:
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = _Live(nbytes, device, block, cast)
            if block is None:
                self.pending.append(entry)
        elif block is None:
            self.again.append(entry)
        elif entry.last is None or block > entry.last:
            entry.last = block
        entry.count += 1

    def release(self, key: Any) -> None:
        entry = self.live.get(key)
        if entry is not None:
            entry.count -= 1
            if entry.count <= 0:
                del self.live[key]

    def enter_block(self, index: int) -> None:
        for entry in self.pending:
            entry.block = entry.last = index
        for entry in self.again:
            entry.last = index if entry.last is None else max(entry.last, index)
        self.pending, self.again = [], []

    def close(self) -> SegmentResult:
        """The bytes held now (once: later calls return the first result): activations per device, per block and
        outside every block, autocast's weight casts per device (counted per block with the activations), and
        ``shared``: per block ``k``, the bytes of the storages counted for a block before ``k`` that block ``k`` or a
        later one (or the loss) saved too. A ReLU or Tanh at a block's end saves its output, the next block's first
        Linear saves the same storage as its input, and the storage counts for the first; a frozen prefix of ``k``
        blocks gives back what its blocks saved less ``shared[k]``, which the blocks from ``k`` on still save."""
        if self.result is None:
            devices: dict[str, int] = {}
            casts: dict[str, int] = {}
            blocks, outside = [0] * self.num_blocks, 0
            change = [0] * (self.num_blocks + 1)
            for entry in self.again:  # saved again after the last block: the loss holds them whatever is frozen
                entry.last = self.num_blocks
            for entry in self.live.values():
                where = casts if entry.cast else devices
                where[entry.device] = where.get(entry.device, 0) + entry.nbytes
                if entry.block is None:
                    outside += entry.nbytes
                    continue
                blocks[entry.block] += entry.nbytes
                if entry.last is not None and entry.last > entry.block:  # held across boundaries block+1 .. last
                    change[entry.block + 1] += entry.nbytes
                    change[min(entry.last, self.num_blocks - 1) + 1] -= entry.nbytes
            shared, running = [], 0
            for k in range(self.num_blocks):
                running += change[k]
                shared.append(running)
            self.result = devices, blocks, outside, casts, shared
            self.live, self.pending, self.again = {}, [], []
        return self.result
