"""The memory ledger's records: what a sampled step held (:class:`LedgerSnapshot`), the peaks over a run's sampled
steps (:class:`LedgerPeaks`, :class:`Peak`) and what changed between two snapshots (:func:`memory_change`,
:func:`memory_change_by_device`). The buckets they hold, :data:`BLOCK_BUCKETS` and :data:`DISK` are
:mod:`~layerfreeze.runs.ledger_buckets`'s; the ledger that takes the snapshots is
:class:`~layerfreeze.runs.ledger.MemoryLedger`.

**The tensor total and the tensor peak** (:attr:`LedgerSnapshot.tensor_bytes`, :attr:`LedgerPeaks.tensor`): a
step's tensor total is the sum over every bucket on a memory device (everything but ``"disk"``) of the bucket's bytes
read when the ledger reads it (:mod:`~layerfreeze.runs.ledger`: each bucket at its own moment of the step); the
tensor peak is the largest tensor total over the sampled steps of a run. It counts the storages the model, its
optimizer and autograd hold, each at its largest in the step, and no temporaries (the gradient flowing through
backward, kernel workspaces, a foreach optimizer's scratch) and no allocator rounding: the CUDA allocator's peak beside
it shows those. Saved activations and gradients coexist only partly (backward frees the one as it builds the other),
so the tensor total is an upper bound of the bytes those buckets hold together at any one moment. This is the figure a
memory budget is checked against.

**Stability.** :meth:`LedgerSnapshot.to_record`'s fields (a ``metrics.jsonl`` step record's ``memory``) and
:meth:`LedgerPeaks.summary`'s keys (``summary.json``'s ``memory``) are what the trainer writes and what tables, the
report and a memory planner read: fields may be added, none changes its meaning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from layerfreeze.runs.ledger_buckets import DISK, _bucket_order

__all__ = [
    "LedgerPeaks",
    "LedgerSnapshot",
    "Peak",
    "memory_change",
    "memory_change_by_device",
]


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
        activations_shared: Per block ``k``, the saved-activation bytes counted for blocks before ``k`` (a storage
            counts for the first block that saved it) that block ``k`` or a later one (or the loss) saved too: a
            block ending in a ReLU, which saves its output, and the next block's Linear, which saves the same storage
            as its input. A frozen prefix of ``k`` blocks still holds them (the memory planner,
            :mod:`layerfreeze.budget.measure`, reads it). Not in :meth:`to_record`: empty in a snapshot read back.
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
    activations_shared: list[int] = field(default_factory=list)
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
    def from_record(cls, record: Mapping[str, Any], step: int | None = None) -> LedgerSnapshot:
        """A snapshot read back from ``metrics.jsonl``: a whole step record (its ``memory`` and its ``step``), or
        :meth:`to_record`'s object alone (a step record's ``memory``; give ``step``, else 0).

        Args:
            record: A step record holding ``memory``, or the ``memory`` object itself.
            step: The step it describes; default: the step record's ``step``.

        Raises:
            ValueError: ``record`` is neither (a step the ledger did not sample has no ``memory``; records with one
                are those of the first step, every ``run.ledger_every`` steps, and the step after a freeze or thaw).
        """
        if "memory" in record and "devices" not in record:
            if step is None and isinstance(record.get("step"), int):
                step = record["step"]
            record = record["memory"] or {}
        if "devices" not in record:
            where = f"step {record.get('step')}'s record" if "step" in record else "this record"
            raise ValueError(f"{where} holds no memory ledger sample (no 'memory' field, or not its 'devices'): the "
                             "ledger samples the first step, every run.ledger_every steps and the step after a freeze "
                             "or thaw; pick a step record with 'memory' (or pass record['memory'])")
        step = 0 if step is None else step
        blocks = dict(record.get("blocks") or {})
        names = list(blocks.pop("names", []))
        frozen = list(blocks.pop("frozen", []))
        devices = {d: {b: int(n) for b, n in per.items() if b != "tensor_bytes"}
                   for d, per in (record.get("devices") or {}).items()}
        return cls(step=step, devices=devices, params_dtype=dict(record.get("params_dtype") or {}),
                   block_names=names, blocks={b: list(v) for b, v in blocks.items()}, blocks_frozen=frozen,
                   activations_outside=int(record.get("activations_outside", 0)),
                   allocator=dict(record.get("allocator") or {}), rss_bytes=int(record.get("rss_bytes", 0)))


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
