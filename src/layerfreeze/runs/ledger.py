"""The memory ledger: where a training step's bytes go, per bucket, per device and per block.

:class:`MemoryLedger`, the class you use, wires three modules into a training step:

* :mod:`~layerfreeze.runs.ledger_buckets` -- the buckets (:class:`Bucket`, the table of what each counts), their
  labels and order, :data:`DISK`, what a byte source reports (:class:`ByteSource`);
* :mod:`~layerfreeze.runs.ledger_counting` -- how the bytes are counted: each storage once, on its own device (FSDP2
  shards included), saved activations through autograd's saved-tensor hooks, optimizers unwrapped;
* :mod:`~layerfreeze.runs.ledger_records` -- what a sampled step held (:class:`LedgerSnapshot`, with the tensor total),
  the peaks over a run (:class:`LedgerPeaks`), what changed between two snapshots (:func:`memory_change`,
  :func:`memory_change_by_device`).

Beside the buckets, the ledger reads the CUDA caching allocator's ``allocated`` / ``reserved`` bytes and their peaks
per CUDA device (``torch.cuda.memory_allocated`` ...: what the card really holds, temporaries and fragmentation
included) and the process's resident set size (``rss_bytes``, host memory). ``params``, ``grads``, ``optimizer`` and
``activations`` are also counted per block (a tensor belongs to the block that owns its parameter; an activation to
the block whose modules were running when autograd saved it, see :class:`MemoryLedger`).

**When each bucket is read.** A step's buckets peak at different moments, and the ledger reads each one at its own:
saved activations when the backward starts (the storages autograd holds for it then: all the forward saved, less a
graph dropped during the forward); parameters, gradients and optimizer state right after ``optimizer.step()``
(gradients are complete and the optimizer's state exists: Adam creates it at its first step;
``zero_grad(set_to_none=True)`` frees the gradients right after); buffers and the byte sources when the step ends.
Without an optimizer step in the step, everything but activations is read when it ends.

**Byte sources.** Objects that hold memory the ledger cannot find from the model and the optimizer report it
themselves: any object with a ``ledger_bytes()`` method (or a plain callable) returning ``{bucket: bytes}`` or
``{bucket: {device: bytes}}`` (``"disk"`` for bytes on disk; a plain int is on the ledger's ``device``). The
activation cache (:class:`~layerfreeze.compute.cached_prefix.CachedPrefix`,
:class:`~layerfreeze.compute.store.ActivationCache`) and the frozen models
(:class:`~layerfreeze.compute.frozen.FrozenModule`, :class:`~layerfreeze.compute.frozen.FrozenDifferentiable`) have
it; so can your own (a replay buffer, a teacher). A source may also have ``ledger_tensors()`` returning the tensors it
holds, so autograd saving one of them (a frozen model's buffer) is not counted again as an activation. This module
and the three above import nothing above :mod:`layerfreeze.runs`: the model, its blocks and the freezer are
duck-typed (see :class:`MemoryLedger`).

Cost: a sampled step runs one Python call per tensor autograd saves and per module call of a block, and walks the
parameters, gradients, buffers and optimizer state once; a step that is not sampled runs two Python calls per block
module call (the block hooks stay registered) and nothing else. ``python -m benchmarks.ledger_overhead`` measures it.

The names of this module's ``__all__`` stay importable from here, wherever they are defined.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import psutil
import torch
from torch import nn

from layerfreeze.runs.ledger_buckets import (
    BLOCK_BUCKETS,
    BUCKET_LABELS,
    DISK,
    MODEL_BUCKETS,
    Bucket,
    ByteSource,
    _bucket_order,
    bucket_label,
)
from layerfreeze.runs.ledger_counting import (
    _allocator,
    _count_buffers,
    _count_model,
    _count_optimizer,
    _count_sources,
    _held_storages,
    _inner_optimizers,
    _is_parameter,
    _is_weight_cast,
    _Saved,
    _Segment,
    _storage,
    _Tally,
)
from layerfreeze.runs.ledger_records import LedgerPeaks, LedgerSnapshot, Peak, memory_change, memory_change_by_device

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


class MemoryLedger:
    """Exact bytes per bucket, device and block of the steps of a training loop (the buckets:
    :mod:`~layerfreeze.runs.ledger_buckets`).

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
            of them are frozen; with ``ledger_bytes`` (a Freezer has it) also a byte source: the ``strategy``
            bucket (its strategy's state and the gradient sums AutoFreeze reads).
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
        if hasattr(freezer, "ledger_bytes"):  # what freezing holds: the strategy's state, its gradient sums
            self.add_source(freezer)
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

    # ---- configuration ----------------------------------------------------------------------------------------

    def add_source(self, source: Any) -> None:
        """Count a byte source too (:class:`ByteSource`, or a callable returning its mapping). A source already
        counted is not added again: the same object, an :class:`~layerfreeze.compute.store.ActivationCache` whose
        :class:`~layerfreeze.compute.cached_prefix.CachedPrefix` is a source (it reports the cache's bytes), or a
        strategy whose :class:`~layerfreeze.engine.Freezer` is one (it reports the strategy's bytes).

        Raises:
            TypeError: ``source`` has no ``ledger_bytes`` and is not callable.
        """
        if not hasattr(source, "ledger_bytes") and not callable(source):
            raise TypeError(f"MemoryLedger: a byte source needs a ledger_bytes() method or must be callable, got "
                            f"{type(source).__qualname__}")
        # a CachedPrefix reports its ActivationCache's bytes, a Freezer its strategy's: given both, counted twice
        if any(_covers(s, source) for s in self.sources):
            return
        self.sources = [s for s in self.sources if not _covers(source, s)]
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
        # the storages of the parameters, buffers and sources as they are now: one freed since the last sample (a
        # demotion's cast, a thaw's restore, a LISA switch) may hold one of this step's activations now
        self._held = _held_storages(self.model, self.sources)
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
                seg.hold(info[0], info[1], info[2], self._stack[-1] if self._stack else None, _is_weight_cast(t))
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
            _count_model(tally, self.model, self._block)
            _count_optimizer(tally, self.optimizers, self._block)
            self._after_opt = tally

    # ---- counting -----------------------------------------------------------------------------------------------

    def _block(self, p: torch.Tensor) -> int | None:
        index = self._block_of.get(id(p))
        if index is None and self.blocks and id(p) not in self._unowned:
            self._index_blocks()  # parameters replaced since (FSDP2 sharding, a re-wrapped weight)
            index = self._block_of.get(id(p))
            if index is None:
                self._unowned.add(id(p))
        return index

    def _snapshot(self, step: int, activations: bool = True) -> LedgerSnapshot:
        after = self._after_opt if activations else None
        if after is not None:  # parameters, gradients and optimizer state as they were right after optimizer.step()
            tally = after
        else:
            tally = _Tally(len(self.blocks))
            _count_model(tally, self.model, self._block)
            _count_optimizer(tally, self.optimizers, self._block)
        _count_buffers(tally, self.model)
        outside, shared = 0, []
        if activations and self._segments:
            # a forward whose backward never ran (no backward in the step) counts what it holds now
            per_device, per_block, outside, casts, shared = max(
                (seg.close() for seg in self._segments), key=lambda r: sum(r[0].values()) + sum(r[3].values()))
            for device, n in per_device.items():
                tally.add(Bucket.ACTIVATIONS, device, n)
            for device, n in casts.items():  # autocast's copies of the weights (train.precision *-mixed)
                tally.add(Bucket.AUTOCAST, device, n)
            tally.blocks["activations"] = list(per_block)
            self._segments = []
        self._after_opt = None
        _count_sources(tally, self.sources, self.device)
        for device in tally.devices:  # every model bucket on every memory device, zeros included: records line up
            for bucket in MODEL_BUCKETS if device != DISK else ():
                tally.devices[device].setdefault(bucket.value, 0)
        devices = {d: {b: per[b] for b in _bucket_order(per)} for d, per in sorted(tally.devices.items())}
        frozen = [bool(f) for f in getattr(self.freezer, "frozen", [])] if self.freezer is not None else []
        return LedgerSnapshot(
            step=step, devices=devices, params_dtype=tally.params_dtype,
            block_names=[str(b.name) for b in self.blocks],
            blocks=tally.blocks if self.blocks else {}, blocks_frozen=frozen if self.blocks else [],
            activations_outside=outside, activations_shared=list(shared) if self.blocks else [],
            allocator=_allocator(tally.devices),
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


def _covers(a: Any, b: Any) -> bool:
    """Whether byte source ``a`` reports ``b``'s bytes: ``b`` itself, its activation cache, its strategy (either
    given as its bound ``ledger_bytes`` method, the callable form of a source, counts as the object)."""
    a, b = getattr(a, "__self__", a), getattr(b, "__self__", b)
    return a is b or getattr(a, "cache", None) is b or getattr(a, "strategy", None) is b
