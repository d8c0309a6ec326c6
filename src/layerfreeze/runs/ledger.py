"""The memory ledger: where a training step's bytes go, per bucket, per device and per block.

A training step's memory, in the buckets PyTorch's memory snapshot and DeepSpeed's memory estimators talk about:

==================== ===================================================================================================
bucket               what it counts (bytes of tensor storage, each storage once)
==================== ===================================================================================================
``params_trainable`` the model's parameters that require grad (also split by dtype: ``params_dtype``)
``params_frozen``    the model's parameters that do not
``buffers``          the model's buffers (BatchNorm running statistics, position ids, ...)
``grads``            the parameters' ``.grad`` tensors
``optimizer``        every tensor in ``optimizer.state`` (Adam/AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``)
``activations``      tensors autograd saved for backward during the forward (through
                     :class:`torch.autograd.graph.saved_tensors_hooks`), parameters and buffers left out
``cache_memory``     the frozen-prefix activation cache in host memory (a byte source, see below)
``cache_disk``       the cache's shards on disk (device ``"disk"``: not memory, never in the tensor total)
``side_models``      frozen models beside the trained one (``FrozenModule``, ``FrozenDifferentiable``)
``params_master``    float32 master copies of demoted frozen blocks (host memory, or ``"disk"``; a byte source:
                     :class:`~layerfreeze.engine.demote.Demoter`)
``params_offloaded`` frozen blocks' parameters moved off the training device (host memory; the same byte source)
==================== ===================================================================================================

plus, beside them, the CUDA caching allocator's ``allocated`` / ``reserved`` bytes and their peaks per CUDA device
(``torch.cuda.memory_allocated`` ...: what the card really holds, temporaries and fragmentation included) and the
process's resident set size (``rss_bytes``, host memory). ``params``, ``grads``, ``optimizer`` and ``activations`` are
also counted per block (a tensor belongs to the block that owns its parameter; an activation to the block whose
modules were running when autograd saved it, see :class:`MemoryLedger`).

**When each bucket is read.** A step's buckets peak at different moments, and the ledger reads each one at its own:
saved activations when the backward starts (the storages autograd holds for it then: all the forward saved, less a
graph dropped during the forward); parameters, gradients and optimizer state right after ``optimizer.step()``
(gradients are complete and the optimizer's state exists: Adam creates it at its first step;
``zero_grad(set_to_none=True)`` frees the gradients right after); buffers and the byte sources when the step ends.
Without an optimizer step in the step, everything but activations is read when it ends.

**The tensor total and the tensor peak** (:attr:`LedgerSnapshot.tensor_bytes`, :attr:`LedgerPeaks.tensor`): a
step's tensor total is the sum over every bucket on a memory device (everything but ``"disk"``) of the bucket's bytes
read as above; the tensor peak is the largest tensor total over the sampled steps of a run. It counts the storages
the model, its optimizer and autograd hold, each at its largest in the step, and no temporaries (the gradient flowing
through backward, kernel workspaces, a foreach optimizer's scratch) and no allocator rounding: the CUDA allocator's
peak beside it shows those. Saved activations and gradients coexist only partly (backward frees the one as it builds
the other), so the tensor total is an upper bound of the bytes those buckets hold together at any one moment. This is
the figure a memory budget is checked against.

**Byte sources.** Objects that hold memory the ledger cannot find from the model and the optimizer report it
themselves: any object with a ``ledger_bytes()`` method (or a plain callable) returning ``{bucket: bytes}`` or
``{bucket: {device: bytes}}`` (``"disk"`` for bytes on disk; a plain int is on the ledger's ``device``). The
activation cache (:class:`~layerfreeze.compute.cache.CachedPrefix`, :class:`~layerfreeze.compute.store.ActivationCache`)
and the frozen models (:class:`~layerfreeze.compute.frozen.FrozenModule`, :class:`~layerfreeze.compute.frozen.
FrozenDifferentiable`) have it; so can your own (a replay buffer, a teacher). A source may also have
``ledger_tensors()`` returning the tensors it holds, so autograd saving one of them (a frozen model's buffer) is not
counted again as an activation. This module imports nothing above :mod:`layerfreeze.runs`: the model, its blocks and
the freezer are duck-typed (see :class:`MemoryLedger`).

**Devices.** A tensor counts on its own device (``str(tensor.device)``: ``"cpu"``, ``"cuda:1"``); a DTensor (FSDP2)
counts its local shard, so under ``torch.distributed`` each rank's ledger is that rank's: a parameter of ``N`` bytes
sharded over ``W`` ranks counts ``N / W`` on each when its first dimension divides by ``W``. A storage is counted whole
(a saved slice keeps its whole storage alive) and once per snapshot, so what FSDP2 allocates is what counts: each
parameter's shard is padded to ``ceil(dim0 / W)`` rows on every rank (a rank with fewer rows holds the padding too);
the gradients of one ``fully_shard`` group are views of one reduce-scatter output (padded the same way; counted once,
for the block of the group's first parameter with a gradient); Adam's moments are the shard's own size (no
padding); Adam's ``step`` is a plain 4-byte tensor per parameter on every rank.

**Stability.** The bucket names (:class:`Bucket`), :meth:`LedgerSnapshot.to_record`'s fields (a ``metrics.jsonl``
step record's ``memory``) and :meth:`LedgerPeaks.summary`'s keys (``summary.json``'s ``memory``) are what the trainer
writes and what tables, the report and a memory planner read: buckets may be added, none changes its meaning.

Cost: a sampled step runs one Python call per tensor autograd saves and per module call of a block, and walks the
parameters, gradients, buffers and optimizer state once; a step that is not sampled runs two Python calls per block
module call (the block hooks stay registered) and nothing else. ``python -m benchmarks.ledger_overhead`` measures it.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import psutil
import torch
from torch import nn

__all__ = [
    "BLOCK_BUCKETS",
    "BUCKET_LABELS",
    "DISK",
    "Bucket",
    "ByteSource",
    "LedgerPeaks",
    "LedgerSnapshot",
    "MemoryLedger",
    "Peak",
    "bucket_label",
    "memory_change",
    "memory_change_by_device",
]


class Bucket(enum.StrEnum):
    """The ledger's buckets (see the module docstring); byte sources may add buckets of their own names."""

    PARAMS_TRAINABLE = "params_trainable"
    PARAMS_FROZEN = "params_frozen"
    BUFFERS = "buffers"
    GRADS = "grads"
    OPTIMIZER = "optimizer"
    ACTIVATIONS = "activations"
    CACHE_MEMORY = "cache_memory"
    CACHE_DISK = "cache_disk"
    SIDE_MODELS = "side_models"
    PARAMS_MASTER = "params_master"
    PARAMS_OFFLOADED = "params_offloaded"


#: What each bucket is called in tables and plots.
BUCKET_LABELS: dict[str, str] = {
    Bucket.PARAMS_TRAINABLE: "parameters, trainable",
    Bucket.PARAMS_FROZEN: "parameters, frozen",
    Bucket.BUFFERS: "buffers",
    Bucket.GRADS: "gradients",
    Bucket.OPTIMIZER: "optimizer state",
    Bucket.ACTIVATIONS: "saved activations",
    Bucket.CACHE_MEMORY: "activation cache (memory)",
    Bucket.CACHE_DISK: "activation cache (disk)",
    Bucket.SIDE_MODELS: "frozen side models",
    Bucket.PARAMS_MASTER: "master copies (demoted)",
    Bucket.PARAMS_OFFLOADED: "parameters, offloaded",
}


def bucket_label(bucket: str) -> str:
    """A bucket's name for people (:data:`BUCKET_LABELS`; a byte source's own bucket keeps its name)."""
    return BUCKET_LABELS.get(bucket, bucket)


#: The buckets counted per block (``params`` = trainable + frozen parameters of the block).
BLOCK_BUCKETS = ("params", "grads", "optimizer", "activations")

#: The device name of bytes on disk: reported, never part of a tensor total.
DISK = "disk"

#: The model's own buckets, in the order tables show them (byte sources' buckets follow).
MODEL_BUCKETS = (Bucket.PARAMS_TRAINABLE, Bucket.PARAMS_FROZEN, Bucket.BUFFERS, Bucket.GRADS, Bucket.OPTIMIZER,
                 Bucket.ACTIVATIONS)


class ByteSource(Protocol):
    """What the ledger asks of an object that holds memory: its bytes per bucket (and, optionally, per device).

    ``ledger_bytes()`` returns ``{bucket: bytes}`` or ``{bucket: {device: bytes}}``, bytes as non-negative ints,
    devices as ``str(torch.device)`` (``"cpu"``, ``"cuda:1"``) or :data:`DISK`. Optionally ``ledger_tensors()``
    returns the tensors it holds (never counted as saved activations).
    """

    def ledger_bytes(self) -> Mapping[str, int | Mapping[str, int]]:
        ...


# --------------------------------------------------------------------------------------------------------------
# Snapshots and peaks
# --------------------------------------------------------------------------------------------------------------


@dataclass
class LedgerSnapshot:
    """What one sampled step held, in bytes.

    Attributes:
        step: The step it describes (the caller's count, 1-based in the CLI trainer).
        devices: ``{device: {bucket: bytes}}``, devices as ``str(torch.device)`` and :data:`DISK`.
        params_dtype: ``{"trainable" | "frozen": {dtype: bytes}}`` (``"float32"``, ``"bfloat16"``, ...).
        block_names: The blocks, front to back (empty without blocks).
        blocks: ``{bucket: [bytes per block]}`` for :data:`BLOCK_BUCKETS`, in ``block_names`` order.
        blocks_frozen: Per block, whether it was frozen (from the freezer; empty without one).
        activations_outside: Saved-activation bytes no block's modules were running for (the loss, ops after the
            last block; ops between two blocks count for the block after them).
        allocator: ``{cuda device: {"allocated", "reserved", "peak_allocated", "peak_reserved"}}`` from the CUDA
            caching allocator when the step ended (peaks since the last ``torch.cuda.reset_peak_memory_stats``);
            empty on CPU.
        rss_bytes: The process's resident set size when the step ended (host memory, everything included).
    """

    step: int
    devices: dict[str, dict[str, int]] = field(default_factory=dict)
    params_dtype: dict[str, dict[str, int]] = field(default_factory=dict)
    block_names: list[str] = field(default_factory=list)
    blocks: dict[str, list[int]] = field(default_factory=dict)
    blocks_frozen: list[bool] = field(default_factory=list)
    activations_outside: int = 0
    allocator: dict[str, dict[str, int]] = field(default_factory=dict)
    rss_bytes: int = 0

    @property
    def buckets(self) -> dict[str, int]:
        """``{bucket: bytes}`` summed over devices (``cache_disk`` included: it is the only bucket on disk)."""
        out: dict[str, int] = {}
        for per_bucket in self.devices.values():
            for bucket, n in per_bucket.items():
                out[bucket] = out.get(bucket, 0) + n
        return {b: out[b] for b in _bucket_order(out)}

    @property
    def tensor_bytes(self) -> int:
        """The tensor total (module docstring): every bucket on every memory device, the disk left out."""
        return sum(self.tensor_bytes_on(d) for d in self.devices if d != DISK)

    def tensor_bytes_on(self, device: str) -> int:
        """The tensor total of one device (0 for :data:`DISK` or a device it has nothing on)."""
        return 0 if device == DISK else sum(self.devices.get(device, {}).values())

    def block_bytes(self, index: int) -> dict[str, int]:
        """``{bucket: bytes}`` block ``index`` held, for :data:`BLOCK_BUCKETS` (empty without blocks)."""
        return {b: values[index] for b, values in self.blocks.items() if index < len(values)}

    def to_record(self) -> dict[str, Any]:
        """The snapshot as the JSON object of a ``metrics.jsonl`` step record's ``memory`` field:
        ``buckets``, ``tensor_bytes``, ``devices`` (each with its ``tensor_bytes``), ``params_dtype``, ``blocks``
        (``names``, ``frozen`` and one list per :data:`BLOCK_BUCKETS` bucket), ``activations_outside``,
        ``allocator``, ``rss_bytes``. :meth:`from_record` reads it back."""
        record: dict[str, Any] = {
            "buckets": self.buckets,
            "tensor_bytes": self.tensor_bytes,
            "devices": {d: {**b, "tensor_bytes": self.tensor_bytes_on(d)} for d, b in self.devices.items()},
            "params_dtype": self.params_dtype,
            "activations_outside": self.activations_outside,
            "rss_bytes": self.rss_bytes,
        }
        if self.block_names:
            record["blocks"] = {"names": self.block_names, **self.blocks,
                                **({"frozen": self.blocks_frozen} if self.blocks_frozen else {})}
        if self.allocator:
            record["allocator"] = self.allocator
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any], step: int = 0) -> LedgerSnapshot:
        """A snapshot from :meth:`to_record`'s object (a step record's ``memory``)."""
        blocks = dict(record.get("blocks") or {})
        names = list(blocks.pop("names", []))
        frozen = list(blocks.pop("frozen", []))
        devices = {d: {b: int(n) for b, n in per.items() if b != "tensor_bytes"}
                   for d, per in (record.get("devices") or {}).items()}
        return cls(step=step, devices=devices, params_dtype=dict(record.get("params_dtype") or {}),
                   block_names=names, blocks={b: list(v) for b, v in blocks.items()}, blocks_frozen=frozen,
                   activations_outside=int(record.get("activations_outside", 0)),
                   allocator=dict(record.get("allocator") or {}), rss_bytes=int(record.get("rss_bytes", 0)))


def _bucket_order(names: Iterable[str]) -> list[str]:
    """The model's buckets first in :data:`MODEL_BUCKETS` order, then the cache's, then others by name."""
    rank = {b.value: i for i, b in enumerate(Bucket)}
    return sorted(set(names), key=lambda b: (rank.get(b, len(rank)), b))


@dataclass
class Peak:
    """A peak: its ``bytes`` and the ``step`` it was reached at (the first such step)."""

    bytes: int
    step: int


@dataclass
class LedgerPeaks:
    """Peaks over a run's sampled steps (:meth:`update` with each snapshot).

    Attributes:
        buckets: Per bucket, the largest total over devices.
        tensor: The tensor peak (module docstring) and its step.
        at_tensor_peak: ``{bucket: bytes}`` at the tensor peak's step (what the peak is made of).
        devices: Per memory device, its largest tensor total.
        blocks: ``{bucket: [largest bytes per block]}`` for :data:`BLOCK_BUCKETS`; ``block_names`` names them.
        allocator: Per CUDA device, the largest ``peak_allocated`` / ``peak_reserved`` seen.
        rss: The largest resident set size seen at a sampled step's end.
        samples: How many snapshots were taken.
    """

    buckets: dict[str, Peak] = field(default_factory=dict)
    tensor: Peak | None = None
    at_tensor_peak: dict[str, int] = field(default_factory=dict)
    devices: dict[str, Peak] = field(default_factory=dict)
    block_names: list[str] = field(default_factory=list)
    blocks: dict[str, list[int]] = field(default_factory=dict)
    allocator: dict[str, dict[str, int]] = field(default_factory=dict)
    rss: Peak | None = None
    samples: int = 0

    def update(self, snap: LedgerSnapshot) -> None:
        """Fold one snapshot into the peaks (ties keep the earlier step)."""
        self.samples += 1
        for bucket, n in snap.buckets.items():
            _raise(self.buckets, bucket, n, snap.step)
        total = snap.tensor_bytes
        if self.tensor is None or total > self.tensor.bytes:
            self.tensor = Peak(total, snap.step)
            self.at_tensor_peak = {b: n for b, n in snap.buckets.items()}
        for device in snap.devices:
            if device != DISK:
                _raise(self.devices, device, snap.tensor_bytes_on(device), snap.step)
        if snap.block_names:
            if snap.block_names != self.block_names:
                self.block_names, self.blocks = list(snap.block_names), {}
            for bucket, values in snap.blocks.items():
                old = self.blocks.get(bucket, [0] * len(values))
                self.blocks[bucket] = [max(a, b) for a, b in zip(old, values)]
        for device, stats in snap.allocator.items():
            mine = self.allocator.setdefault(device, {})
            for key in ("peak_allocated", "peak_reserved"):
                if key in stats:
                    mine[key] = max(mine.get(key, 0), int(stats[key]))
        if self.rss is None or snap.rss_bytes > self.rss.bytes:
            self.rss = Peak(snap.rss_bytes, snap.step)

    def summary(self) -> dict[str, Any]:
        """The peaks as ``summary.json``'s ``memory`` entry: ``samples``; ``buckets``: ``{bucket: {"peak_bytes",
        "step"}}``; ``tensor_peak_bytes``, ``tensor_peak_step``, ``at_tensor_peak``; ``devices``: ``{device:
        {"tensor_peak_bytes", "step"}}``; ``blocks`` (``names`` and the per-block peaks); ``allocator``;
        ``rss_peak_bytes``, ``rss_peak_step``. None where nothing was sampled."""
        out: dict[str, Any] = {
            "samples": self.samples,
            "buckets": {b: {"peak_bytes": p.bytes, "step": p.step}
                        for b, p in sorted(self.buckets.items(), key=lambda kv: _bucket_order(self.buckets)
                                           .index(kv[0]))},
            "tensor_peak_bytes": self.tensor.bytes if self.tensor else None,
            "tensor_peak_step": self.tensor.step if self.tensor else None,
            "at_tensor_peak": dict(self.at_tensor_peak),
            "devices": {d: {"tensor_peak_bytes": p.bytes, "step": p.step} for d, p in self.devices.items()},
            "rss_peak_bytes": self.rss.bytes if self.rss else None,
            "rss_peak_step": self.rss.step if self.rss else None,
        }
        if self.block_names:
            out["blocks"] = {"names": list(self.block_names), **{b: list(v) for b, v in self.blocks.items()}}
        if self.allocator:
            out["allocator"] = {d: dict(v) for d, v in self.allocator.items()}
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint (a resumed run keeps its peaks); :meth:`load_state_dict` reads it."""
        return self.summary()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.samples = int(state.get("samples", 0))
        self.buckets = {b: Peak(int(v["peak_bytes"]), int(v["step"])) for b, v in (state.get("buckets") or {}).items()}
        t = state.get("tensor_peak_bytes")
        self.tensor = None if t is None else Peak(int(t), int(state["tensor_peak_step"]))
        self.at_tensor_peak = {b: int(n) for b, n in (state.get("at_tensor_peak") or {}).items()}
        self.devices = {d: Peak(int(v["tensor_peak_bytes"]), int(v["step"]))
                        for d, v in (state.get("devices") or {}).items()}
        blocks = dict(state.get("blocks") or {})
        self.block_names = list(blocks.pop("names", []))
        self.blocks = {b: [int(n) for n in v] for b, v in blocks.items()}
        self.allocator = {d: {k: int(n) for k, n in v.items()} for d, v in (state.get("allocator") or {}).items()}
        r = state.get("rss_peak_bytes")
        self.rss = None if r is None else Peak(int(r), int(state["rss_peak_step"]))


def _raise(peaks: dict[str, Peak], key: str, value: int, step: int) -> None:
    old = peaks.get(key)
    if old is None or value > old.bytes:
        peaks[key] = Peak(int(value), int(step))


def memory_change(before: LedgerSnapshot, after: LedgerSnapshot) -> dict[str, int]:
    """``{bucket: before - after}`` for every bucket either holds, and ``tensor_bytes``: what happened between two
    snapshots gave back (positive) or took (negative). Between the last sample before a freeze and the first after
    it, the freeze's return: gradients, optimizer state and, for a block that joins the frozen prefix, its saved
    activations (plus whatever else changed: a smaller last batch, the cache filling)."""
    a, b = before.buckets, after.buckets
    out = {bucket: a.get(bucket, 0) - b.get(bucket, 0) for bucket in _bucket_order([*a, *b])}
    out["tensor_bytes"] = before.tensor_bytes - after.tensor_bytes
    return out


def memory_change_by_device(before: LedgerSnapshot, after: LedgerSnapshot) -> dict[str, dict[str, int]]:
    """``{device: {bucket: before - after}}``: :func:`memory_change` per device (:data:`DISK` included), buckets that
    did not change left out, devices with no change left out. What a freeze gave back *where*: a demoted block's
    weights leave ``params_frozen`` of the training device for ``params_offloaded`` of ``"cpu"`` (negative: taken)
    when offloaded, and its float32 master copy is taken on ``"cpu"`` or ``"disk"``."""
    out: dict[str, dict[str, int]] = {}
    for device in sorted({*before.devices, *after.devices}):
        a, b = before.devices.get(device, {}), after.devices.get(device, {})
        changed = {bucket: a.get(bucket, 0) - b.get(bucket, 0) for bucket in _bucket_order([*a, *b])}
        changed = {bucket: n for bucket, n in changed.items() if n}
        if changed:
            out[device] = changed
    return out


# --------------------------------------------------------------------------------------------------------------
# Counting storages
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


class _Tally:
    """Bytes per device and bucket, per block, each storage once."""

    def __init__(self, num_blocks: int) -> None:
        self.devices: dict[str, dict[str, int]] = {}
        self.blocks = {b: [0] * num_blocks for b in BLOCK_BUCKETS}
        self.params_dtype: dict[str, dict[str, int]] = {}
        self.seen: set[Any] = set()
        self.held: set[Any] = set()  # storage keys of the parameters and buffers walked

    def add(self, bucket: str, device: str, nbytes: int) -> None:
        per = self.devices.setdefault(str(device), {})
        bucket = str(bucket)  # a plain str, also for a Bucket member
        per[bucket] = per.get(bucket, 0) + int(nbytes)


class _Live:
    """One storage autograd holds for backward: how many saved tensors hold it, its bytes, device and block."""

    __slots__ = ("block", "count", "device", "nbytes")

    def __init__(self, nbytes: int, device: str, block: int | None) -> None:
        self.count, self.nbytes, self.device, self.block = 0, nbytes, device, block


class _Saved:
    """What the pack hook gives autograd to keep: the tensor (detached: a saved output holding its own ``grad_fn``
    would be a reference cycle), and a release of its storage's count when autograd drops it."""

    __slots__ = ("key", "segment", "tensor")

    def __init__(self, tensor: torch.Tensor, segment: _Segment | None, key: Any) -> None:
        self.tensor, self.segment, self.key = tensor, segment, key

    def __del__(self) -> None:
        if self.segment is not None:
            self.segment.release(self.key)


class _Segment:
    """The saved activations of one forward (a step with gradient accumulation has several; the largest counts):
    the storages autograd holds, counted when the backward starts (its first unpack), so a graph dropped during the
    forward (a check that ran an op under autograd) is not counted."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.live: dict[Any, _Live] = {}
        self.pending: list[_Live] = []  # saved between blocks: they count for the next block that runs
        self.result: tuple[dict[str, int], list[int], int] | None = None  # (per device, per block, outside)

    def hold(self, key: Any, nbytes: int, device: str, block: int | None) -> None:
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = _Live(nbytes, device, block)
            if block is None:
                self.pending.append(entry)
        entry.count += 1

    def release(self, key: Any) -> None:
        entry = self.live.get(key)
        if entry is not None:
            entry.count -= 1
            if entry.count <= 0:
                del self.live[key]

    def enter_block(self, index: int) -> None:
        for entry in self.pending:
            entry.block = index
        self.pending = []

    def close(self) -> tuple[dict[str, int], list[int], int]:
        """The bytes held now (once: later calls return the first result)."""
        if self.result is None:
            devices: dict[str, int] = {}
            blocks, outside = [0] * self.num_blocks, 0
            for entry in self.live.values():
                devices[entry.device] = devices.get(entry.device, 0) + entry.nbytes
                if entry.block is None:
                    outside += entry.nbytes
                else:
                    blocks[entry.block] += entry.nbytes
            self.result = devices, blocks, outside
            self.live, self.pending = {}, []
        return self.result


# --------------------------------------------------------------------------------------------------------------
# The ledger
# --------------------------------------------------------------------------------------------------------------


class MemoryLedger:
    """Exact bytes per bucket, device and block of the steps of a training loop (module docstring for the buckets).

    In your own loop::

        ledger = MemoryLedger(model, optimizer, freezer=freezer, sources=[cache])   # every=1: every step
        for batch in loader:
            with ledger.step():                     # around the forward, backward and optimizer step
                loss = loss_fn(model(batch))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if ledger.last_step_sampled:
                print(ledger.last.buckets, ledger.last.tensor_bytes)
            freezer.step()
        print(ledger.peaks.summary()["tensor_peak_bytes"])
        ledger.close()                              # or use the ledger as a context manager

    A framework's loop whose hooks cannot hold a ``with`` block calls :meth:`begin` and :meth:`end` instead (the
    Hugging Face Trainer's ``on_step_begin`` / ``on_step_end``, Lightning's ``on_train_batch_start`` /
    ``on_train_batch_end``).

    Args:
        model: The model being trained (its parameters, buffers and gradients are counted).
        optimizer: Its optimizer (state counted; a ``torch.optim.Optimizer``, a sequence of them, or a framework's
            wrapper holding one as ``.optimizer``); None: no optimizer bucket, everything read when the step ends.
        blocks: Block-like objects, front to back, for the per-block figures: each with a ``name``, ``modules``
            (``(qualified name, module)`` pairs, as :class:`~layerfreeze.models.blocks.Block` has) and
            ``parameters()``. Default: the freezer's blocks, else none (no per-block figures).
        freezer: A :class:`~layerfreeze.engine.Freezer` (anything with ``blocks`` and ``frozen``): its blocks and which
            of them are frozen.
        sources: Byte sources (:class:`ByteSource`: ``ledger_bytes()``, or callables returning the same mapping).
        every: Sample one step in ``every`` (steps ``every``, ``2 * every``, ... by the caller's count), the first
            step always, and a step asked for with :meth:`request`.
        device: Where a byte source's plain-int bytes are (default: the device of the model's first parameter).

    Attribution of saved activations: a tensor saved while a block's module runs counts for that block (the
    innermost one when blocks nest); one saved between two blocks (a ReLU that is a sibling module, a pooling in the
    model's forward) counts for the next block that runs; one saved after the last block (the loss) counts in
    ``activations_outside``. A storage saved by several ops counts once, for the first. Tensors saved during a
    backward (recomputation of activation checkpointing) are not counted. After a backward, the next saved tensor
    starts a new forward (gradient accumulation): the largest forward of the step counts.

    Raises:
        ValueError: ``every < 1``.
        TypeError: an optimizer that is not a ``torch.optim.Optimizer``; a source without ``ledger_bytes`` that is
            not callable.
    """

    def __init__(self, model: nn.Module, optimizer: Any = None, *, blocks: Sequence[Any] | None = None,
                 freezer: Any = None, sources: Iterable[Any] = (), every: int = 1,
                 device: torch.device | str | None = None) -> None:
        if int(every) < 1:
            raise ValueError(f"MemoryLedger: every must be >= 1 (sample one step in `every`), got {every}")
        self.model = model
        self.optimizers = _inner_optimizers(optimizer)
        self.freezer = freezer
        if blocks is None and freezer is not None:
            blocks = freezer.blocks
        self.blocks = list(blocks or [])
        self.sources: list[Any] = []
        for source in sources:
            self.add_source(source)
        self.every = int(every)
        if device is None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = str(torch.device(device))
        self.last: LedgerSnapshot | None = None
        self.peaks = LedgerPeaks()
        self.steps = 0
        self._requested = False
        self._sampling = False
        self._step = 0
        self._stack: list[int] = []
        self._segments: list[_Segment] = []
        self._unpacked = False
        self._after_opt: _Tally | None = None
        self._held: set[Any] = set()
        self._process = psutil.Process(os.getpid())
        self._hooks: list[Any] = []
        self._closed = False
        self._block_of: dict[int, int] = {}
        self._unowned: set[int] = set()  # parameters of no block (checked once)
        self._in_backward = getattr(torch._C, "_current_autograd_node", lambda: None)
        self._index_blocks()
        for index, block in enumerate(self.blocks):
            for _, module in block.modules:
                self._hooks.append(module.register_forward_pre_hook(self._enter_block(index)))
                self._hooks.append(module.register_forward_hook(self._leave_block, always_call=True))
        for opt in self.optimizers:
            self._hooks.append(opt.register_step_post_hook(self._after_optimizer_step))
        self._held = self._held_storages()

    # ---- configuration ----------------------------------------------------------------------------------------

    def add_source(self, source: Any) -> None:
        """Count a byte source too (:class:`ByteSource`, or a callable returning its mapping).

        Raises:
            TypeError: ``source`` has no ``ledger_bytes`` and is not callable.
        """
        if not hasattr(source, "ledger_bytes") and not callable(source):
            raise TypeError(f"MemoryLedger: a byte source needs a ledger_bytes() method or must be callable, got "
                            f"{type(source).__qualname__}")
        self.sources.append(source)

    def request(self) -> None:
        """Sample the next step whatever the cadence (the CLI trainer asks after every freeze and thaw)."""
        self._requested = True

    def _index_blocks(self) -> None:
        self._block_of = {id(p): i for i, b in enumerate(self.blocks) for p in b.parameters()}

    # ---- a step -----------------------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether step ``step`` (the caller's count) is sampled: the first, every ``every``-th, or requested."""
        return self._requested or self.steps == 0 or step % self.every == 0

    def begin(self, step: int | None = None) -> bool:
        """Start a step (``step``: the caller's step number; default the ledger's own count + 1); returns whether
        it is sampled. Pair with :meth:`end` (:meth:`step` does both).

        Raises:
            RuntimeError: a step is already open, or the ledger is closed.
        """
        if self._closed:
            raise RuntimeError("MemoryLedger is closed")
        if self._sampling:
            raise RuntimeError("MemoryLedger.begin: a step is already open; call end() first")
        self._step = self.steps + 1 if step is None else int(step)
        if not self.due(self._step):
            return False
        self._requested = False
        self._sampling = True
        self._stack, self._segments, self._unpacked, self._after_opt = [], [_Segment(len(self.blocks))], False, None
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        return True

    def end(self) -> LedgerSnapshot | None:
        """End the step begun with :meth:`begin`: the snapshot (also :attr:`last`, folded into :attr:`peaks`) when it
        was sampled, else None."""
        self.steps += 1
        if not self._sampling:
            return None
        self._saved_hooks.__exit__(None, None, None)
        self._sampling = False
        snap = self._snapshot(self._step)
        self.last = snap
        self.peaks.update(snap)
        return snap

    @contextmanager
    def step(self, step: int | None = None) -> Iterator[MemoryLedger]:
        """``with ledger.step():`` around one training step (forward, backward, optimizer step): :meth:`begin`,
        then :meth:`end`, also when the step raises (then nothing is recorded)."""
        self.begin(step)
        try:
            yield self
        except BaseException:
            if self._sampling:
                self._saved_hooks.__exit__(None, None, None)
                self._sampling = False
            self.steps += 1
            raise
        self.end()

    @property
    def last_step_sampled(self) -> bool:
        """Whether the step that just ended was sampled (:attr:`last` describes it)."""
        return self.last is not None and self.last.step == self._step and not self._sampling

    def sample(self, step: int | None = None) -> LedgerSnapshot:
        """A snapshot now, outside a step: parameters, buffers, whatever gradients and optimizer state exist, the
        byte sources; no saved activations. Not folded into :attr:`peaks`."""
        return self._snapshot(self._step if step is None else int(step), activations=False)

    def block_bytes(self, index: int) -> dict[str, int]:
        """``{bucket: bytes}`` of block ``index`` at the last sampled step (empty before the first)."""
        return self.last.block_bytes(index) if self.last is not None else {}

    def summary(self) -> dict[str, Any]:
        """``summary.json``'s ``memory`` entry: :meth:`LedgerPeaks.summary` and the cadence (``every``)."""
        return {"ledger": True, "every": self.every, **self.peaks.summary()}

    # ---- hooks --------------------------------------------------------------------------------------------------

    def _enter_block(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self._sampling:
                self._stack.append(index)
                seg = self._segments[-1]
                if seg.pending:
                    seg.enter_block(index)
        return hook

    def _leave_block(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._sampling and self._stack:
            self._stack.pop()

    def _pack(self, t: torch.Tensor) -> _Saved:
        if not (_is_parameter(t) or _is_parameter(t._base)) and self._in_backward() is None:
            if self._unpacked:  # a backward ran since the last forward: a new forward (gradient accumulation)
                self._unpacked = False
                self._segments.append(_Segment(len(self.blocks)))
            info = _storage(t)
            if info is not None and info[0] not in self._held:
                seg = self._segments[-1]
                seg.hold(info[0], info[1], info[2], self._stack[-1] if self._stack else None)
                return _Saved(t.detach(), seg, info[0])
        return _Saved(t.detach(), None, None)

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        if not self._unpacked and self._sampling:  # the backward starts: what the forward saved is all held now
            self._unpacked = True
            self._segments[-1].close()
        return saved.tensor

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._sampling:  # gradients are complete and the optimizer's state exists: count them now
            tally = _Tally(len(self.blocks))
            self._count_model(tally)
            self._count_optimizer(tally)
            self._after_opt = tally

    # ---- counting -----------------------------------------------------------------------------------------------

    def _held_storages(self) -> set[Any]:
        """Storage keys of the model's parameters and buffers and the sources' tensors: never saved activations."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        for source in self.sources:
            held = getattr(source, "ledger_tensors", None)
            tensors += list(held()) if held is not None else []
        return {info[0] for info in map(_storage, tensors) if info is not None}

    def _block(self, p: torch.Tensor) -> int | None:
        index = self._block_of.get(id(p))
        if index is None and self.blocks and id(p) not in self._unowned:
            self._index_blocks()  # parameters replaced since (FSDP2 sharding, a re-wrapped weight)
            index = self._block_of.get(id(p))
            if index is None:
                self._unowned.add(id(p))
        return index

    def _count_model(self, tally: _Tally) -> None:
        """The parameters (trainable/frozen, by dtype, per block) and their gradients, in one walk."""
        sums: dict[tuple[str, str], int] = {}
        dtypes = tally.params_dtype
        held = set()
        per_block_params, per_block_grads = tally.blocks["params"], tally.blocks["grads"]
        for p in self.model.parameters():
            index = self._block(p)
            info = _storage(p)
            if info is not None:
                key, nbytes, device = info
                held.add(key)
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
        tally.held = held

    def _count_buffers(self, tally: _Tally) -> None:
        sums: dict[str, int] = {}
        for b in self.model.buffers():
            info = _storage(b)
            if info is None:
                continue
            key, nbytes, device = info
            tally.held.add(key)
            if key not in tally.seen:
                tally.seen.add(key)
                sums[device] = sums.get(device, 0) + nbytes
        for device, n in sums.items():
            tally.add(Bucket.BUFFERS, device, n)

    def _count_optimizer(self, tally: _Tally) -> None:
        sums: dict[str, int] = {}
        per_block = tally.blocks["optimizer"]
        for opt in self.optimizers:
            for p, state in opt.state.items():
                index = self._block(p) if isinstance(p, torch.Tensor) else None
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

    def _source_tensors(self) -> set[Any]:
        keys = set()
        for source in self.sources:
            held = getattr(source, "ledger_tensors", None)
            for t in (held() if held is not None else ()):
                info = _storage(t)
                if info is not None:
                    keys.add(info[0])
        return keys

    def _count_sources(self, tally: _Tally) -> None:
        for source in self.sources:
            report = source.ledger_bytes() if hasattr(source, "ledger_bytes") else source()
            for bucket, value in report.items():
                per_device = value if isinstance(value, Mapping) else {self.device: value}
                for device, nbytes in per_device.items():
                    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
                        raise ValueError(f"MemoryLedger: byte source {type(source).__qualname__} reported "
                                         f"{nbytes!r} for bucket {bucket!r} on {device!r}; bytes must be ints >= 0")
                    tally.add(str(bucket), str(device), nbytes)

    def _allocator(self, devices: Iterable[str]) -> dict[str, dict[str, int]]:
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

    def _snapshot(self, step: int, activations: bool = True) -> LedgerSnapshot:
        after = self._after_opt if activations else None
        if after is not None:  # parameters, gradients and optimizer state as they were right after optimizer.step()
            tally = after
        else:
            tally = _Tally(len(self.blocks))
            self._count_model(tally)
            self._count_optimizer(tally)
        self._count_buffers(tally)
        self._held = tally.held | self._source_tensors()
        outside = 0
        if activations and self._segments:
            # a forward whose backward never ran (no backward in the step) counts what it holds now
            per_device, per_block, outside = max((seg.close() for seg in self._segments),
                                                 key=lambda r: sum(r[0].values()))
            for device, n in per_device.items():
                tally.add(Bucket.ACTIVATIONS, device, n)
            tally.blocks["activations"] = list(per_block)
            self._segments = []
        self._after_opt = None
        self._count_sources(tally)
        for device in tally.devices:  # every model bucket on every memory device, zeros included: records line up
            for bucket in MODEL_BUCKETS if device != DISK else ():
                tally.devices[device].setdefault(bucket.value, 0)
        devices = {d: {b: per[b] for b in _bucket_order(per)} for d, per in sorted(tally.devices.items())}
        frozen = [bool(f) for f in getattr(self.freezer, "frozen", [])] if self.freezer is not None else []
        return LedgerSnapshot(
            step=step, devices=devices, params_dtype=tally.params_dtype,
            block_names=[str(b.name) for b in self.blocks],
            blocks=tally.blocks if self.blocks else {}, blocks_frozen=frozen if self.blocks else [],
            activations_outside=outside, allocator=self._allocator(tally.devices),
            rss_bytes=int(self._process.memory_info().rss))

    # ---- lifetime -----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the ledger's hooks from the model and optimizer (idempotent)."""
        if self._sampling:
            self._saved_hooks.__exit__(None, None, None)
            self._sampling = False
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._closed = True

    def __enter__(self) -> MemoryLedger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        peak = self.peaks.tensor
        return (f"MemoryLedger(every={self.every}, blocks={len(self.blocks)}, sources={len(self.sources)}, "
                f"samples={self.peaks.samples}, tensor_peak={None if peak is None else peak.bytes})")
