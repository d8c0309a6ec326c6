"""What to freeze to fit a memory budget: each frozen prefix's predicted tensor peak, and the smallest that fits.

**The prediction.** From one measurement with nothing frozen (:func:`~layerfreeze.budget.measure.measure_blocks`:
per block its parameters ``P``, gradients ``G``, optimizer state ``O`` and saved activations ``A``), the tensor peak
(:mod:`layerfreeze.runs.ledger`) with blocks ``0..k-1`` frozen is predicted as

    ``peak(k) = peak(0) - sum over b < k of (G_b + O_b + A_b - D_b) + S_k + cache(k)``

A frozen prefix keeps its parameters (now frozen: same bytes) and buffers, and gives back its gradients, its optimizer
state (the Freezer frees it) and every activation it saved: it builds no graph, so only its output stays, saved by the
first trainable block. The ledger counts a storage once, for the first block whose modules saved it, so where the
prefix's last block saved its output too (it ends in a ReLU, a Tanh or a Sigmoid, which save their output; ResNet's
blocks do) the output counts in ``A`` of the prefix: ``S_k`` is what blocks before ``k`` saved that blocks from ``k`` on
save too (``BlockBytes.activations_shared``, measured per boundary), which the prefix does not give back. A block frozen
*above* a trainable one gives back only ``G + O`` (backward still runs through it), so prefixes are the frozen sets
worth considering: for the same number of frozen blocks they save the most, and the search is over ``k = 0 .. (first
head block)``. ``D_b`` is what demoting block ``b`` at its freeze changes (``Freezer(demote=...)``, ``freeze.demote``; 0
without): its weights and floating buffers at the demoted dtype (``-P_b / 2`` from float32 to bfloat16) plus their
float32 master copy where it is kept in host memory (``+P_b``; not on disk). The prediction is exact where the first
trainable block saves its input whether or not that input requires grad (every block of a BERT-like encoder or of
MobileNetV2 opens with a linear map or a convolution, which saves it for its weight gradient); a block that opens with a
parameter-free op on its input (the head's dropout) saves a little less once its input is frozen, so the prediction is
an upper bound there (measured: 6.6% above for MobileNetV2's classifier alone, 0.05% for MiniLM-L6's).

**Freezing more never costs more** than the prefix the plan freezes, with one exception the plan bounds: the
activation cache (:mod:`layerfreeze.compute.cache`), which keeps each training sample's prefix output in host
memory. ``cache(k)`` is the input fingerprints plus the states of every sample at the deepest-costing boundary from
``k`` on (a strategy may freeze further; each sample keeps one entry; at ``k = 0`` none for a strategy that never
freezes block 0, ``lisa``, whose run has no frozen prefix then), capped by the memory the budget leaves:
the plan gives the cache ``budget - peak_model(k) - fingerprints`` (``cache_budget_bytes``) and the cache spills the
rest to checksummed shards on disk batch by batch (``shard_bytes=0``: no write buffer above its budget), which the
tensor peak leaves out.

**The plan** freezes the shortest prefix whose peak fits (``peak_model(k) + fingerprints <= budget``: the cache can
always spill), from the start, and the engine keeps it frozen (:class:`~layerfreeze.engine.Freezer`'s ``floor``):
a strategy may freeze more, never thaw a block of the floor; the stability guard neither. The tensor peak is what
the ledger sums over every memory device (host memory included: the cache lives there), with no temporaries and no
allocator rounding; on a GPU the allocator's peak beside it shows those.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from layerfreeze.budget.measure import BlockBytes, blocks_of, measure_blocks, measure_cache
from layerfreeze.budget.parse import Budget, parse_budget
from layerfreeze.engine.demote import Demoter, Demotion, build_demoter
from layerfreeze.engine.grad_signal import GradientSums, unsummed
from layerfreeze.engine.params import BlockParams
from layerfreeze.errors import BudgetError
from layerfreeze.models.blocks import Block, stack_layers
from layerfreeze.runs.ledger_buckets import DISK, Bucket
from layerfreeze.runs.summary import format_bytes
from layerfreeze.strategies import Strategy, create_strategy
from layerfreeze.strategies.base import storage_bytes

__all__ = ["MemoryPlan", "PrefixCost", "budget_at_least", "plan_memory", "plan_prefix"]


@dataclass
class PrefixCost:
    """What freezing blocks ``0..k-1`` from the start costs and gives back (bytes).

    Attributes:
        k: Blocks frozen from the start (a frozen prefix; 0: nothing).
        frozen: Their names.
        buckets: The model's buckets predicted (parameters trainable / frozen, buffers, gradients, optimizer state,
            saved activations).
        returned: What the prefix gives back against nothing frozen: ``grads``, ``optimizer``, ``activations``.
        model_bytes: The predicted tensor peak without the cache.
        cache_full_bytes: The cache's states for every sample (its size with no memory cap); 0 without a cache.
        cache_bytes: The cache's predicted host memory under the budget: fingerprints plus the states it keeps
            in memory (the rest on disk).
        cache_budget_bytes: The memory the plan lets the cache keep its states in (None: no cache).
        predicted_bytes: ``model_bytes + cache_bytes``: the predicted tensor peak.
        least_bytes: ``model_bytes`` plus the fingerprints: the least this prefix needs (every state on disk).
        fits: ``least_bytes <= budget``.
    """

    k: int
    frozen: list[str]
    buckets: dict[str, int]
    returned: dict[str, int]
    model_bytes: int
    cache_full_bytes: int
    cache_bytes: int
    cache_budget_bytes: int | None
    predicted_bytes: int
    least_bytes: int
    fits: bool


#: What the columns of :meth:`MemoryPlan.rows` hold (``layerfreeze plan`` prints it under the table).
ROW_NOTES = (
    "gives back: the gradients, optimizer state and saved activations the frozen prefix returns; peak, no cache: "
    "the predicted tensor peak of the model; cache in memory: what the activation cache keeps in host memory under "
    "the budget (the rest spills to disk), sized for the deepest prefix the strategy may freeze from k on, so k=0 "
    "has one when the strategy freezes later, from block 0 ('-': nothing cached); predicted peak: the two together")


def _cost(measured: BlockBytes, k: int, budget: int, cache_cap: int | None, strategy_freezes: bool,
          starts_prefix: bool) -> PrefixCost:
    model = measured.model_bytes(k)
    cache = measured.cache
    full = fingerprints = 0
    # with no floor, the cache serves a prefix only where the strategy freezes block 0 itself (not lisa's)
    later = strategy_freezes and (k > 0 or starts_prefix)
    used = cache is not None and (cache.usable(k) or (later and cache.usable(max(k, 1))))
    if used:
        full = cache.deepest_from(k) if strategy_freezes else cache.at(k)
        fingerprints = cache.fingerprints
    least = model + fingerprints
    room = None
    if used:
        room = max(0, budget - least)
        if cache_cap is not None:
            room = min(room, cache_cap)
    kept = fingerprints + (min(full, room) if room is not None else 0)
    return PrefixCost(k=k, frozen=measured.block_names[:k], buckets=measured.model_buckets(k),
                      returned=measured.returned(k), model_bytes=model, cache_full_bytes=full, cache_bytes=kept,
                      cache_budget_bytes=room, predicted_bytes=model + kept, least_bytes=least, fits=least <= budget)


@dataclass
class MemoryPlan:
    """The frozen prefix that fits a memory budget, its predicted tensor peak, and every prefix's cost.

    Attributes:
        budget: The budget as written (``"3GiB"``, ``"0.6"``).
        budget_bytes: The budget in bytes (a fraction taken of ``none_peak_bytes``).
        none_peak_bytes: The tensor peak with nothing frozen (measured; the cache and what the strategy holds left
            out: the ``none`` row's peak, what a fraction is taken of).
        k: Blocks frozen from the start: blocks ``0..k-1``.
        block_names: Every block, front to back.
        predicted_peak_bytes: The predicted tensor peak of the run under the plan.
        cache_budget_bytes: The host memory the activation cache may keep states in (the rest spills to disk);
            None without a cache.
        candidates: :class:`PrefixCost` of every prefix, ``k = 0 .. max``.
        measured: The measurement it was made from (:class:`~layerfreeze.budget.measure.BlockBytes`).
        strategy_freezes: Whether the run's strategy may freeze beyond the floor (the cache is then sized for the
            deepest-costing boundary).
        strategy_starts_prefix: Whether it may freeze block 0 itself, starting a frozen prefix where the floor is
            empty (False for ``lisa``, whose embeddings always train: ``k = 0`` has no cache).
    """

    budget: str
    budget_bytes: int
    none_peak_bytes: int
    k: int
    block_names: list[str]
    predicted_peak_bytes: int
    cache_budget_bytes: int | None
    candidates: list[PrefixCost]
    measured: BlockBytes
    strategy_freezes: bool = True
    strategy_starts_prefix: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def floor(self) -> list[int]:
        """The block indices the engine keeps frozen (``Freezer(..., floor=plan.floor)``): ``0..k-1``."""
        return list(range(self.k))

    @property
    def frozen_from_start(self) -> list[str]:
        """The names of the blocks frozen from the start (what the plan gives up)."""
        return self.block_names[: self.k]

    @property
    def chosen(self) -> PrefixCost:
        """The chosen prefix's :class:`PrefixCost`."""
        return self.candidates[self.k]

    def gives_up(self) -> str:
        """What the plan gives up, in words: ``"nothing"``, or the blocks frozen from the start and what they hold."""
        if self.k == 0:
            return "nothing: every block trains (a strategy may still freeze)"
        params = sum(self.measured.blocks["params"][: self.k])
        total = sum(self.measured.blocks["params"])
        names = self.frozen_from_start
        shown = ", ".join(names) if len(names) <= 4 else f"{names[0]} .. {names[-1]}"
        held = self.chosen.buckets.get(Bucket.STRATEGY, 0)
        why = ""
        if held and self.budget_bytes >= self.none_peak_bytes:  # "100%": room for what only the strategy holds
            why = (f", to make room for the freezing strategy's own state ({format_bytes(held)}), which the "
                   f"budget's reference, the tensor peak with nothing frozen and no strategy, leaves out")
        return (f"{self.k} of {len(self.block_names)} blocks frozen from the start ({shown}): "
                f"{format_bytes(params)} of {format_bytes(total)} of parameters never train{why}")

    def predicted_for_samples(self, samples: int) -> int:
        """The predicted tensor peak when the cache holds ``samples`` samples (a run shorter than an epoch: the
        cache fills as samples are first seen), the fingerprints and states scaled by ``samples / cache.samples``."""
        cache = self.measured.cache
        c = self.chosen
        if cache is None or not cache.samples or c.cache_budget_bytes is None:
            return c.predicted_bytes
        share = min(1.0, samples / cache.samples)
        kept = int(share * cache.fingerprints) + min(int(share * c.cache_full_bytes), c.cache_budget_bytes)
        return c.model_bytes + kept

    def rows(self) -> tuple[list[str], list[list[str]]]:
        """``(headers, cells)``: one row per prefix (``k`` blocks frozen from the start, up to the one named), for a
        table that fits 120 columns with block names of 32 characters; the chosen one is marked ``<-``.
        :data:`ROW_NOTES` says what each column holds (every bucket per prefix is in :meth:`to_dict`)."""
        cache = self.measured.cache is not None
        head = ["k", "frozen up to", "gives back", "peak, no cache"]
        if cache:
            head += ["cache in memory"]
        head += ["predicted peak", "fits"]
        cells = []
        for c in self.candidates:
            last = c.frozen[-1] if c.k else "-"
            row = [str(c.k), last, format_bytes(sum(c.returned.values())) if c.k else "-",
                   format_bytes(c.model_bytes)]
            if cache:
                row += [format_bytes(c.cache_bytes) if c.cache_full_bytes else "-"]
            row += [format_bytes(c.predicted_bytes), ("yes <-" if c.k == self.k else "yes") if c.fits else "no"]
            cells.append(row)
        return head, cells

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON); :meth:`from_dict` reads it back."""
        out = asdict(self)
        out["floor"] = self.floor
        out["frozen_from_start"] = self.frozen_from_start
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryPlan:
        """Read :meth:`to_dict` back."""
        data = {k: v for k, v in data.items() if k not in ("floor", "frozen_from_start")}
        data["candidates"] = [PrefixCost(**c) for c in data["candidates"]]
        data["measured"] = BlockBytes.from_dict(data["measured"])
        return cls(**data)


def budget_at_least(nbytes: int) -> str:
    """``nbytes`` written as a budget that reads back (:func:`~layerfreeze.budget.parse.parse_budget`) as at least
    ``nbytes``: :func:`~layerfreeze.runs.summary.format_bytes`'s figure rounded up, not to the nearest (``32076`` ->
    ``"31.4KiB"``, where ``format_bytes`` says ``"31.3 KiB"``, 32051 bytes), or ``"512B"`` below a KiB."""
    if nbytes < 1024:
        return f"{nbytes}B"
    unit, size = next((u, s) for u, s in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                      if nbytes >= s)
    decimals = 2 if nbytes / size < 10 else 1
    step = 10**decimals
    ticks = -(-nbytes * step // size)  # ceil(nbytes / size * step), in integers: no float rounding
    while True:  # the parser multiplies in floats: one more step where that lands a byte short
        text = f"{ticks / step:.{decimals}f}{unit}"
        if parse_budget(text).bytes >= nbytes:  # type: ignore[operator]
            return text
        ticks += 1


def plan_prefix(measured: BlockBytes, budget: str | int | float | Budget, *, cache_budget_bytes: int | None = None,
                strategy_freezes: bool = True, strategy_starts_prefix: bool = True) -> MemoryPlan:
    """The shortest frozen prefix whose predicted tensor peak fits ``budget`` (module docstring: the prediction).

    Args:
        measured: :func:`~layerfreeze.budget.measure.measure_blocks`'s measurement (with ``cache`` when the run
            keeps the activation cache).
        budget: ``"3GiB"``, ``"800MiB"``, ``"0.6"`` / ``"60%"`` (of ``none``'s tensor peak), an int of bytes, a float
            fraction, or a :class:`~layerfreeze.budget.parse.Budget`.
        cache_budget_bytes: The most host memory the run gives the cache anyway (``freeze.cache.budget_mb``); the
            plan gives it at most what the budget leaves.
        strategy_freezes: Whether the run's strategy may freeze beyond the floor (False for ``none``): then the
            cache is sized for the deepest-costing boundary, and counted even when the floor is empty unless
            ``strategy_starts_prefix`` is False.
        strategy_starts_prefix: Whether the strategy may freeze block 0 itself (False for a strategy that always
            trains it, :attr:`~layerfreeze.strategies.base.Strategy.trains_first_block`: ``lisa``): with no floor
            such a run has no frozen prefix, so nothing for the activation cache.

    Raises:
        BudgetError: the budget cannot be read, or no prefix fits (``smallest_bytes``: the least any reaches, every
            block before the head frozen and the cache on disk; the message says what to change).
    """
    parsed = parse_budget(budget)
    held = measured.buckets.get(Bucket.STRATEGY, 0)  # what the strategy holds, in every prefix's peak
    none_peak = measured.model_bytes(0) - held  # the `none` row's peak: what a fraction is taken of
    limit = parsed.resolve(none_peak)
    candidates = [_cost(measured, k, limit, cache_budget_bytes, strategy_freezes, strategy_starts_prefix)
                  for k in range(measured.max_prefix + 1)]
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        best = min(candidates, key=lambda c: c.least_bytes)
        raise BudgetError(
            f"no frozen set fits a memory budget of {parsed.describe(none_peak)}: the smallest tensor peak reachable "
            f"is {format_bytes(best.least_bytes)} ({best.least_bytes} bytes; {best.k} of {len(measured.block_names)} "
            f"blocks frozen from the start, the head training) at batch size {measured.batch_size}, where nothing "
            f"frozen needs {format_bytes(none_peak)}"
            + (f" and the freezing strategy holds {format_bytes(best.buckets.get(Bucket.STRATEGY, 0))} more there "
               "(its own state: another strategy may hold less)" if best.buckets.get(Bucket.STRATEGY, 0) else "")
            + f". Raise the budget to at least {budget_at_least(best.least_bytes)}, or lower train.batch_size (saved "
            "activations scale with it)", smallest_bytes=best.least_bytes)
    chosen = fitting[0]
    return MemoryPlan(budget=str(parsed), budget_bytes=limit, none_peak_bytes=none_peak, k=chosen.k,
                      block_names=list(measured.block_names), predicted_peak_bytes=chosen.predicted_bytes,
                      cache_budget_bytes=chosen.cache_budget_bytes, candidates=candidates, measured=measured,
                      strategy_freezes=strategy_freezes, strategy_starts_prefix=strategy_starts_prefix)


def plan_memory(model: nn.Module, batch: Any, budget: str | int | float | Budget, *,
                loss: Callable[[nn.Module, Any], torch.Tensor] | None = None, optimizer: Any = None,
                blocks: Sequence[str] | Sequence[Block] | None = None, steps: int = 2,
                cache_dataset: Any = None, cache_dtype: torch.dtype | None = None,
                cache_budget_bytes: int | None = None, strategy_freezes: bool = True,
                sources: Sequence[Any] = (), train_bn: bool = False, unfrozen: bool = False,
                strategy: str | Strategy | None = None, params: dict[str, Any] | None = None,
                cache_batch: Any = None, demote: Demotion | dict[str, Any] | None = None) -> MemoryPlan:
    """Measure ``model`` on ``batch`` and plan the frozen prefix that fits ``budget``.

    Two real training steps with nothing frozen (:func:`~layerfreeze.budget.measure.measure_blocks`: the model, its
    buffers and the RNG come back as they were), then :func:`plan_prefix`. Apply the plan with
    ``Freezer(model, optimizer, ..., floor=plan.floor)``: blocks ``0..k-1`` frozen before the first step and never
    thawed, by the strategy or the stability guard. With ``cache_dataset`` the activation cache's bytes for that
    training set count too (:func:`~layerfreeze.budget.measure.measure_cache`); give the cache
    ``ActivationCache(budget_bytes=plan.cache_budget_bytes, shard_bytes=0)``.

    Args:
        model: The model, on its training device, nothing frozen yet.
        batch: One training batch at the run's batch size, on the model's device.
        budget: ``"3GiB"``, ``"800MiB"``, ``"0.6"`` or ``"60%"`` (of the tensor peak with nothing frozen), an int
            of bytes or a float fraction (:mod:`layerfreeze.budget.parse`).
        loss: ``loss(model, batch)`` -> scalar tensor (default
            :func:`~layerfreeze.budget.measure.default_loss`: ``model(**batch).loss``, or cross-entropy of
            ``model(x)`` for an ``(x, y)`` batch).
        optimizer: The run's optimizer (its kind is measured, its state never touched), its class, or None (AdamW).
        blocks: Module-name patterns or blocks (default: discovered).
        steps: Training steps measured.
        cache_dataset / cache_dtype: The training set the activation cache would hold, and its storage dtype.
        cache_batch: ``batch`` as the model's forward takes it, for the cache's prefix (default ``batch``): where
            ``loss`` converts the batch (``bf16-true``'s bfloat16 inputs), the same conversion.
        cache_budget_bytes: The most host memory the cache gets anyway.
        strategy_freezes: Whether the strategy may freeze beyond the floor (False for ``none``). A ``strategy``
            that never freezes block 0 (``lisa``) is charged no activation cache where the floor is empty.
        sources: Byte sources beside the model (frozen side models), counted in every prefix's peak.
        train_bn: BatchNorm layers of frozen blocks keep training (the cache then refuses a prefix holding one).
        unfrozen: Measure as if no block were frozen (a Freezer already froze some; see
            :func:`~layerfreeze.budget.measure.measure_blocks`).
        strategy / params: The run's strategy (a name and its parameters, or an instance not yet attached), or
            None: what it holds (SmartFRZ's recorder, Egeria's shadow copy and reference: the ledger's ``strategy``
            bucket) counts in every prefix's peak, measured on a twin of it attached to ``model`` for the steps.
        demote: The run's ``Freezer(demote=...)`` (a :class:`~layerfreeze.engine.demote.Demotion` or its keyword
            arguments), or None: a frozen prefix's weights and floating buffers count at the demoted dtype, plus
            their float32 master copy where it is kept in host memory (``master: memory``, or ``auto`` on an
            accelerator); one on disk (``auto`` on the CPU) is not memory. An offload moves the cast weights to host
            memory, which changes no total.

    Returns:
        A :class:`MemoryPlan`: ``plan.floor``, ``plan.predicted_peak_bytes``, ``plan.gives_up()``, every prefix in
        ``plan.candidates``.

    Raises:
        BudgetError: the budget cannot be read or cannot be met (``smallest_bytes``).
        BlockDiscoveryError / TypeError / ValueError: as :func:`~layerfreeze.budget.measure.measure_blocks` and
            :func:`~layerfreeze.budget.measure.measure_cache`; ValueError also for a ``demote`` the Freezer refuses
            (a bad setting, ``train_bn``).
    """
    parsed = parse_budget(budget)  # a malformed budget fails before anything runs
    if strategy is not None or demote is not None:
        blocks = blocks_of(model, blocks)
    demoter = build_demoter(demote, blocks, train_bn=train_bn, sharded=False)  # type: ignore[arg-type]
    with _attached_twin(strategy, params, model, blocks) as (held, per_block):
        measured = measure_blocks(model, batch, loss=loss, optimizer=optimizer, blocks=blocks, steps=steps,
                                  sources=[*sources, *held], unfrozen=unfrozen)
    if per_block is not None:  # AutoFreeze's gradient sums: a frozen prefix's are never allocated
        measured.blocks[Bucket.STRATEGY] = per_block
    if demoter is not None:
        measured.demoted = _demoted_per_block(demoter, blocks)  # type: ignore[arg-type]
    if cache_dataset is not None:
        measured.cache = measure_cache(model, batch if cache_batch is None else cache_batch, cache_dataset,
                                       blocks=blocks, dtype=cache_dtype, train_bn=train_bn)
    starts = not (held and getattr(held[0], "trains_first_block", False))  # held[0]: the strategy's twin
    return plan_prefix(measured, parsed, cache_budget_bytes=cache_budget_bytes, strategy_freezes=strategy_freezes,
                       strategy_starts_prefix=starts)


def _demoted_per_block(demoter: Demoter, blocks: Sequence[Block]) -> dict[str, list[int]]:
    """``{bucket: [bytes per block]}`` demoting each block changes on memory devices (the disk left out; 0 for the
    head, never frozen)."""
    out: dict[str, list[int]] = {}
    for i, block in enumerate(blocks):
        for bucket, per in ({} if block.is_head else demoter.demoted_bytes(block)).items():
            out.setdefault(str(bucket), [0] * len(blocks))[i] = sum(n for d, n in per.items() if d != DISK)
    return out


@contextmanager
def _attached_twin(strategy: str | Strategy | None, params: dict[str, Any] | None, model: nn.Module,
                   blocks: Any) -> Iterator[tuple[list[Any], list[int] | None]]:
    """A twin of the run's strategy attached to ``model`` (the RNG untouched), detached afterwards: ``([twin],
    None)``, or ``([], None)`` without a strategy. A strategy that reads ``grad_l1`` (AutoFreeze) also gets the
    Freezer's gradient sums of every block (:class:`~layerfreeze.engine.grad_signal.GradientSums`, allocated for the
    measurement: a float32 copy of the trainable weights) as a second byte source, and their bytes per block (a
    frozen prefix holds none) in place of None."""
    if strategy is None:
        yield [], None
        return
    with warnings.catch_warnings():  # the run's own strategy says what it has to say (egeria's settings), once
        warnings.simplefilter("ignore", UserWarning)
        twin = copy.deepcopy(strategy) if isinstance(strategy, Strategy) else create_strategy(
            strategy, params or None, num_blocks=len(blocks))
    with torch.random.fork_rng(devices=[]):
        twin.attach(model, blocks)
    held: list[Any] = [twin]
    per_block = None
    if "grad_l1" in twin.signals:
        sums = GradientSums(len(blocks), unsummed(blocks, stack_layers(blocks), twin))
        sums.prepare([False] * len(blocks), BlockParams(blocks, cache=False))
        held.append(lambda: {Bucket.STRATEGY: storage_bytes(sums.held_tensors())})
        per_block = [sum(t.numel() * t.element_size() for t in sums.of_block(i)) for i in range(len(blocks))]
    try:
        yield held, per_block
    finally:
        twin.detach()
