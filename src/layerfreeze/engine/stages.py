"""Freezing stages: what the strategy is shown, what of its decision is admissible, rank 0's decision shared with
every rank, and how it is applied.

A *stage* is one call of the strategy's :meth:`~layerfreeze.strategies.Strategy.decide`: at the start (the
Freezer's constructor, :func:`start`), every ``strategy.stage_every`` steps and at an epoch's end if the strategy
wants one (:mod:`layerfreeze.engine.steps` decides when). :func:`stage` runs one:

1. under FSDP2, the mirror rank 0's strategy observes is refreshed from the sharded model (a collective);
2. on the deciding rank (always in one process, rank 0 when distributed), the strategy gets a
   :class:`~layerfreeze.strategies.StageContext` (:func:`context`: the blocks, the gradient signals summed since the
   last stage, each block's LR, a read-only view of the optimizer state) and its decision is made admissible (no
   freeze of the head, none the stability guard holds back, no thaw of the Freezer's floor);
3. under ``distributed``, rank 0's decision goes to every rank (:func:`share_decision`), so all ranks freeze and
   thaw the same blocks at the same step;
4. the gradient signals start over, the decision's freezes and thaws are applied (the Freezer's ``freeze`` /
   ``thaw``) and its LR factors are kept (:mod:`layerfreeze.engine.lr_factors`).

The stability guard's verdict on a validation metric is decided and shared the same way (:func:`report_metric`).
The functions take the :class:`~layerfreeze.engine.freezer.Freezer` whose stage they run, read its parts and apply
the decision through its ``freeze`` / ``thaw``.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerfreeze.distributed import comm
from layerfreeze.engine.lr_factors import apply_lr_scales, block_lrs, set_lr_scales
from layerfreeze.engine.mechanics import frozen_parameters
from layerfreeze.errors import StrategyError
from layerfreeze.strategies import Decision, StageContext, Strategy
from layerfreeze.strategies.base import BlockView

if TYPE_CHECKING:  # the stages run a Freezer's strategy; the Freezer calls them, never the other way round
    from layerfreeze.engine.freezer import Freezer

#: The reason recorded for a block the floor freezes.
FLOOR_REASON = "memory budget"


def run_length(name: str, value: Any) -> int | None:
    """``Freezer(total_steps=...)`` or ``steps_per_epoch``, which place the stages (the run's progress), checked:
    ``None`` or an int >= 1 (a NumPy integer too), returned as an int.

    Raises:
        ValueError: anything else (a string, a float, a bool, zero), with what to give.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"Freezer({name}={value!r}): give a whole number of optimizer steps >= 1 (e.g. epochs * "
                         "len(train_loader)), or leave it out")
    return int(value)


def prefix_since(history: Sequence[dict[str, Any]]) -> int:
    """The step count at which the frozen prefix got its current length, from a Freezer's freeze/thaw records (0:
    before the first step, the start stage): :attr:`~layerfreeze.engine.freezer.Freezer.prefix_since`."""
    since, prefix = 0, 0
    for record in history:
        if record.get("frozen_prefix", prefix) != prefix:
            since, prefix = int(record["step"]), int(record["frozen_prefix"])
    return since


def on_shards(freezer: Freezer) -> bool:
    """Whether each rank holds a shard of every gradient (FSDP2 over several processes): every rank then sums its
    own, and reading the per-block norms is a collective (:func:`~layerfreeze.engine.stages.stage`)."""
    return bool(freezer._fsdp) and freezer.distributed


def start(freezer: Freezer, floor: Sequence[int | str] | None) -> None:
    """The start stage, run by the Freezer's constructor: freeze the ``floor`` (``Freezer.pin``), run the strategy's
    start stage, and apply the LR factors it set, so they already apply to the first step."""
    if floor:
        freezer.pin(floor)
    stage(freezer, event="start")
    apply_lr_scales(freezer.optimizer, freezer.blocks, freezer._origin, freezer._lr_scale, freezer._lr_written)
    prepare_grad_sums(freezer)


def sums_gradients(freezer: Freezer) -> bool:
    """Whether this process keeps the gradient sums: the strategy reads ``grad_l1``, and this rank decides (rank 0
    when distributed) or holds a shard of every gradient (FSDP2: every rank)."""
    return "grad_l1" in freezer.strategy.signals and (freezer.decides or on_shards(freezer))


def prepare_grad_sums(freezer: Freezer) -> None:
    """Allocate the gradient sums of the trainable blocks now, where this process keeps them
    (:meth:`~layerfreeze.engine.grad_signal.GradientSums.prepare`): the memory ledger counts them from the start."""
    if sums_gradients(freezer):
        freezer._grad_sums.prepare(freezer.frozen, freezer._params)


def stage(freezer: Freezer, event: str) -> Decision:
    """Run one freezing stage (``event``: ``"start"``, ``"step"`` or ``"epoch_end"``) and apply its decision (module
    docstring). Collective under ``distributed`` and under FSDP2 with a mirror: every rank calls it at the same point.

    Returns:
        The decision applied (on ranks other than 0, rank 0's, without its signals).

    Raises:
        RuntimeError: the strategy needs gradients, the Freezer has no optimizer and ``after_backward`` was never
            called; the strategy tried to freeze the head; on ranks other than 0, the strategy failed on rank 0. The
            strategy's own exception is re-raised (on rank 0 only when distributed, after the other ranks were told).
    """
    decision = Decision()
    error: str | None = None
    if freezer._mirror is not None and event != "start":  # the start stage follows the full refresh at creation
        freezer._mirror.refresh(trainable_only=True)
        if freezer.strategy.reads_optimizer_state and freezer.optimizer is not None:
            freezer._mirror.refresh_moments(freezer.optimizer)  # Adam's moments whole, as the weights (a collective)
    grad_l1 = None
    if on_shards(freezer) and "grad_l1" in freezer.strategy.signals and event != "start":
        # each rank holds a shard of every gradient sum: the per-block norms are all-reduced, on every rank
        grad_l1 = freezer._grad_sums.values(reduce=comm.all_reduce_tensor)
    if freezer.decides:
        try:
            decision = _admissible(freezer, freezer.strategy.decide(context(freezer, event, grad_l1)))
        except Exception as exc:
            if not freezer.distributed:
                raise
            error = f"{type(exc).__name__}: {exc}"
            share_decision(freezer.strategy, decision, error)  # the other ranks raise too instead of waiting
            raise
        freezer.last_signals = dict(decision.signals)
    if freezer.distributed:
        decision = share_decision(freezer.strategy, decision, error)
    freezer._grad_sums.reset()
    freezer._backward_calls = 0
    freezer._in_stage = True  # Freezer.freeze's "nothing trains" would see the decision half applied
    try:
        for i in decision.freeze:
            if freezer.freeze(i, reason=decision.reason or freezer.strategy.name) and freezer.guard is not None:
                freezer.guard.on_freeze(i)
        for i in decision.thaw:
            freezer.thaw(i, lr=decision.thaw_lr.get(i), reason=decision.reason or freezer.strategy.name)
    finally:
        freezer._in_stage = False
    set_lr_scales(freezer._lr_scale, decision.lr_scale, freezer.optimizer, freezer._origin, freezer.blocks)
    return decision


def context(freezer: Freezer, event: str, grad_l1: list[float] | None = None) -> StageContext:
    """What the strategy sees at a stage: the blocks (frozen or not), the step and epoch, the signals it asked for
    (``grad_l1``: each block's L1 norm of its gradients summed since the last stage by
    :func:`~layerfreeze.engine.steps.sum_gradients`; copied to the host here, once per stage, unless given, as the
    all-reduced values under FSDP2), each block's LR
    before factors, a read-only view of the optimizer state (None without an optimizer; under FSDP2 the mirror's,
    with whole moments) and the medians of the recent step times (:mod:`layerfreeze.engine.timing`).

    Raises:
        RuntimeError: the strategy needs ``grad_l1``, the Freezer has no optimizer, and ``after_backward`` was never
            called since the last stage.
    """
    of = freezer._params.of  # each block's parameters, listed once per structure change (Block.num_parameters walks)
    views = [BlockView(b.name, b.index, freezer.frozen[b.index], b.is_head, sum(p.numel() for p in of(b.index)),
                       freezer._layers[b.index]) for b in freezer.blocks]
    signals: dict[str, Any] = {}
    if "grad_l1" in freezer.strategy.signals and event != "start":
        if freezer._backward_calls == 0 and freezer._grad_hook is None:  # no optimizer step reads them either
            raise RuntimeError(
                f"Strategy {freezer.strategy.name!r} needs gradients, but freezer.after_backward() was never called "
                "and the Freezer has no optimizer to read them at its step. Call it after loss.backward() and "
                "before optimizer.zero_grad(), or give the Freezer the optimizer."
            )
        signals["grad_l1"] = grad_l1 if grad_l1 is not None else freezer._grad_sums.values()  # one host copy
    step_seconds, stage_step_seconds = freezer._step_times.medians()
    lrs = optimizer_state = None
    if freezer.optimizer is not None:
        lrs = block_lrs(freezer.optimizer, freezer._origin, freezer.blocks, freezer._lr_written, of)
        optimizer_state = (freezer._mirror.optimizer_view(freezer.optimizer) if freezer._mirror is not None
                           else _optimizer_state_view(freezer.optimizer))
    return StageContext(
        step=freezer.step_count,
        epoch=freezer.epoch,
        event=event,
        blocks=views,
        total_steps=freezer.total_steps,
        steps_per_epoch=freezer.steps_per_epoch,
        signals=signals,
        block_lrs=lrs,
        optimizer_state=optimizer_state,
        step_seconds=step_seconds,
        stage_step_seconds=stage_step_seconds,
    )


def _admissible(freezer: Freezer, decision: Decision) -> Decision:
    """``decision`` without freezes the stability guard holds back (cooling down after a guard thaw), and
    without thaws of the floor (``Freezer.pin``).

    Raises:
        StrategyError: the strategy tried to freeze the head (a ``RuntimeError``).
        TypeError, IndexError: not a :class:`Decision`, or a block that is not an index ``0..n-1`` (a custom
            strategy's mistake, named with the strategy; ``-1`` is not read as the last block).
    """
    _check_decision(freezer, decision)
    for i in decision.freeze:
        if freezer.blocks[i].is_head:
            raise StrategyError(
                f"Strategy {freezer.strategy.name!r} tried to freeze the head ({freezer.blocks[i].name}); a strategy "
                "freezes the blocks before it (Block.is_head, StageContext.blocks[i].is_head)")
    if freezer.guard is not None:
        decision.freeze = [i for i in decision.freeze if not freezer.guard.blocks_freeze(i)]
    refused = [i for i in decision.thaw if i in freezer._floor]
    if refused:
        decision.thaw = [i for i in decision.thaw if i not in freezer._floor]
        decision.thaw_lr = {i: lr for i, lr in decision.thaw_lr.items() if i not in freezer._floor}
        new = [i for i in refused if i not in freezer._refused]
        freezer._refused.update(refused)
        if new:
            # stacklevel 5: this function, stage(), start() / steps.step() / steps.epoch_end(), the Freezer's
            # constructor / step() / epoch_end(), and the training loop that called it
            warnings.warn(f"strategy {freezer.strategy.name!r} asked to thaw "
                          f"{', '.join(freezer.blocks[i].name for i in new)}, in the Freezer's floor "
                          f"({FLOOR_REASON}): they stay frozen", stacklevel=5)
    keep_one_training(freezer, decision)  # after the floor's refusals: a refused thaw trains nothing
    return decision


def keep_one_training(freezer: Freezer, decision: Decision) -> None:
    """Drop from ``decision.freeze`` the deepest block that trains now when the decision would leave no parameter of
    the model training (warned once per block): then the next ``loss.backward()`` raised torch's "element 0 of tensors
    does not require grad" in the middle of the run. Strategies never freeze the head, but a head with nothing to train
    (peft's LoRA freezes the base model and the head: only the adapters in the blocks train) leaves the last block with
    adapters as the only one that trains. A decision that leaves something training is left as it is."""
    if not decision.freeze:
        return
    of = freezer._params.of
    for i in decision.thaw:
        if freezer.frozen[i]:  # what the thaw makes trainable (mechanics.resume_training)
            trains = any(id(p) not in freezer._frozen_before for p in frozen_parameters(freezer.blocks[i],
                                                                                       freezer.train_bn))
        else:  # switched off and on in this stage: it trains as it does now
            trains = any(p.requires_grad for p in of(i))
        if trains:
            return
    freezing = {id(p) for i in decision.freeze for p in frozen_parameters(freezer.blocks[i], freezer.train_bn)}
    if any(p.requires_grad and id(p) not in freezing for p in freezer.model.parameters()):
        return  # the head, a block the decision leaves training, train_bn's BatchNorm, a parameter outside the blocks
    training = [i for i in decision.freeze if not freezer.frozen[i] and any(p.requires_grad for p in of(i))]
    if not training:
        return
    kept = max(training)
    decision.freeze = [i for i in decision.freeze if i != kept]
    if kept not in freezer._kept:
        freezer._kept.add(kept)
        # stacklevel 6: this function, _admissible, stage(), start() / steps.step() / steps.epoch_end(), the Freezer
        # constructor / step() / epoch_end(), the training loop that called it
        idle = (" at the learning-rate factor 0 the strategy gives it (its schedule has ended): its steps change "
                "nothing" if decision.lr_scale.get(kept, freezer._lr_scale.get(kept)) == 0.0 else "")
        warnings.warn(f"strategy {freezer.strategy.name!r} asked to freeze {freezer.blocks[kept].name}, which would "
                      "have left nothing to train: the blocks it leaves trainable hold no trainable parameter (peft's "
                      f"LoRA froze the base model and the head?). {freezer.blocks[kept].name} keeps training{idle}",
                      stacklevel=6)


def _check_decision(freezer: Freezer, decision: Any) -> None:
    """What a strategy's ``decide`` returned is a :class:`Decision` whose blocks are indices ``0..n-1``."""
    name = getattr(freezer.strategy, "name", type(freezer.strategy).__name__)
    if not isinstance(decision, Decision):
        raise TypeError(f"strategy {name!r}: decide() must return a layerfreeze.strategies.Decision (Decision() to "
                        f"change nothing), got {type(decision).__name__}")
    n = len(freezer.blocks)
    for field in ("freeze", "thaw"):
        for i in getattr(decision, field):
            if isinstance(i, bool) or not isinstance(i, numbers.Integral):
                raise TypeError(f"strategy {name!r}: Decision.{field} holds block indices (int), got {i!r}; a "
                                f"block's index is its position in ctx.blocks")
            if not 0 <= i < n:
                raise IndexError(f"strategy {name!r}: Decision.{field} holds block index {i}, out of range: the "
                                 f"model has {n} blocks, 0 to {n - 1}")


def report_metric(freezer: Freezer, value: float) -> int | None:
    """The stability guard's verdict on a validation ``value``, decided on the deciding rank and shared with every
    rank (a collective under ``distributed``), applied as a thaw (``Freezer.report_metric``).

    Returns:
        The index of the block the guard thawed, or None (also None without a guard).
    """
    if freezer.guard is None:
        return None
    index, reference = None, float("nan")
    if freezer.decides:
        freezer.guard.release(freezer._floor)
        before = freezer.guard.reference  # read first: a thaw of the last watched block clears it (it said "nan")
        index = freezer.guard.observe(float(value), list(freezer.frozen))
        if before is not None:
            reference = before
    if freezer.distributed:
        index, reference, value = comm.broadcast_object((index, reference, value))
    if index is not None and index in freezer._floor:  # never: the guard does not watch the floor
        index = None
    if index is not None:
        freezer.thaw(index, reason=f"guard: metric {value:.4g} worse than {reference:.4g} before the freeze")
    return index


def share_decision(strategy: Strategy, decision: Decision, error: str | None = None) -> Decision:
    """Rank 0's freeze decision (and the strategy's stage cadence) on every rank; a collective.

    Why: strategies read signals that can differ across ranks (a background thread finishing at another step,
    float noise in a local statistic); applying rank 0's decision everywhere keeps the frozen sets, and so the
    DDP wrappers and the weights, identical. Only rank 0 runs the strategy; its ``decision`` and ``error``
    (the strategy's exception as text, or None) are what count, the other ranks' arguments are ignored. The
    decision's signals stay on rank 0, which logs them; ``strategy.stage_every`` / ``at_epoch_end`` take rank 0's
    values on every rank (smartfrz sets its cadence at the start stage).

    Returns:
        ``decision`` on rank 0; on the other ranks a :class:`~layerfreeze.strategies.Decision` with rank 0's
        freezes, thaws, reason, thaw LRs and LR factors (no signals).

    Raises:
        RuntimeError: on the other ranks, when the strategy failed on rank 0 (the message carries its error);
            rank 0 gets ``decision`` back and re-raises its own exception.
    """
    payload = None
    if comm.rank() == 0:
        payload = {"error": error, "freeze": list(decision.freeze), "thaw": list(decision.thaw),
                   "reason": decision.reason, "thaw_lr": dict(decision.thaw_lr),
                   "lr_scale": dict(decision.lr_scale), "stage_every": strategy.stage_every,
                   "at_epoch_end": strategy.at_epoch_end}
    payload = comm.broadcast_object(payload)
    if payload["error"] is not None:
        if comm.rank() == 0:
            return decision
        raise RuntimeError(f"the freezing strategy failed on rank 0: {payload['error']}")
    strategy.stage_every, strategy.at_epoch_end = payload["stage_every"], payload["at_epoch_end"]
    if comm.rank() == 0:
        return decision
    return Decision(freeze=payload["freeze"], thaw=payload["thaw"], reason=payload["reason"],
                    thaw_lr=payload["thaw_lr"], lr_scale=payload["lr_scale"])


def _optimizer_state_view(optimizer: torch.optim.Optimizer) -> Callable[[nn.Parameter], Any]:
    """``view(param)`` -> ``(optimizer.state[param], its param group)``, or None when the optimizer does not hold
    ``param`` (a frozen block's parameters leave it) or keeps no state for it yet: what a strategy may read of the
    optimizer (:attr:`~layerfreeze.strategies.base.StageContext.optimizer_state`). The parameter -> group map is
    built on first use, once per stage (freezes and thaws move parameters between groups between stages)."""
    groups: dict[int, dict[str, Any]] = {}

    def view(param: nn.Parameter) -> Any:
        if not groups:
            groups.update({id(p): g for g in optimizer.param_groups for p in g["params"]})
        group = groups.get(id(param))
        state = optimizer.state.get(param)
        return None if group is None or not state else (state, group)

    return view
