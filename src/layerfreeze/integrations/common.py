"""What the Lightning and Hugging Face callbacks share: the mechanics around a :class:`~layerfreeze.engine.Freezer`
that a framework's own loop needs and a hand-written loop does not.

* :class:`OptimizerSnapshot` — keep an optimizer's loaded state across a freezer restore, for frameworks that load
  the optimizer state *before* a callback can restore the frozen set (the HF Trainer).
* :func:`full_optimizer_state_dict` — the optimizer's ``state_dict`` with every parameter it was built with back
  in its param group, in the model's order: what the framework's own ``create_optimizer`` builds on resume, so its
  own ``optimizer.load_state_dict`` never meets "a parameter group that doesn't match the size of optimizer's
  group".
* the framework's own ``DistributedDataParallel`` object re-initialized in place around the trainable parameters
  after a freeze or thaw (:func:`~layerfreeze.distributed.ddp.rebuild_ddp`, the mechanism :class:`~layerfreeze.
  distributed.FreezeDDP` uses too: no "Expected to have finished reduction in the prior iteration", no silent
  desync after a thaw, Lightning #20340, no ``find_unused_parameters=True``).
* :class:`CheckpointBoundary` — the frozen prefix's output requires grad under reentrant activation checkpointing,
  so the trainable layers after it still get gradients (transformers #21381, #23170).
* :class:`FreezeSession` — one freezer in a framework's loop: its events, the DDP wrapper and the boundary kept in
  step with the frozen set, the optional memory ledger (:class:`~layerfreeze.runs.ledger.MemoryLedger`), and the
  values to log.
* :func:`plan_on_first_batch` — a memory budget's plan (:mod:`layerfreeze.budget`) measured on the framework's first
  training batch, the run's random streams left as they were.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from layerfreeze.budget.plan import MemoryPlan, plan_memory
from layerfreeze.distributed.ddp import rebuild_ddp, wrapper_key
from layerfreeze.engine.freezer import Freezer
from layerfreeze.models.blocks import output_tensor
from layerfreeze.models.discovery import refuse_pattern_string
from layerfreeze.runs.ledger import MemoryLedger
from layerfreeze.runs.telemetry import signals_of
from layerfreeze.strategies.registry import check_strategy_arguments

#: The file each framework checkpoint folder gets for the freezer's state (HF Trainer checkpoints).
STATE_FILE = "layerfreeze.pt"
#: Prefix of every value the callbacks log.
LOG_PREFIX = "layerfreeze/"


def inner_scheduler(scheduler: Any) -> Any:
    """The LR scheduler behind accelerate's ``AcceleratedScheduler``, or ``scheduler`` itself (None stays None)."""
    while scheduler is not None and hasattr(scheduler, "scheduler") and not hasattr(scheduler, "base_lrs"):
        scheduler = scheduler.scheduler
    return scheduler


def is_checkpointing(model: nn.Module) -> bool:
    """True when a module of ``model`` runs with activation (gradient) checkpointing, Hugging Face style (a
    ``gradient_checkpointing`` attribute set to True, what ``gradient_checkpointing_enable()`` sets)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


# --------------------------------------------------------------------------------------------------------------
# The optimizer across a restore, and in a framework's checkpoint
# --------------------------------------------------------------------------------------------------------------


class OptimizerSnapshot:
    """The per-parameter state and the group settings (lr, initial_lr, ...) of an optimizer, kept by reference.

    Why: a framework that loads the optimizer state before a callback can act (the HF Trainer loads it in
    ``_prepare_for_training``, before ``on_train_begin``) would lose it to the freezer's restore, which frees the
    state of the blocks its start stage freezes and clears the rest (:meth:`Freezer.load_state_dict`), and to the
    start stage's LR factors applied on top of the loaded, already scaled LRs. Take the snapshot before building the
    Freezer, :meth:`restore` it after ``freezer.load_state_dict``: every parameter the restored groups hold gets its
    loaded state back, and each group its loaded settings.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.state = dict(optimizer.state)
        self.settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]

    def restore(self) -> None:
        """Put the snapshot's state and group settings back (parameters no group holds now get no state)."""
        for group, settings in zip(self.optimizer.param_groups, self.settings):
            group.update(settings)
            for p in group["params"]:
                if p in self.state:
                    self.optimizer.state[p] = self.state[p]


def full_optimizer_state_dict(freezer: Freezer) -> dict[str, Any]:
    """``freezer.optimizer.state_dict()`` as if nothing were frozen: every parameter the optimizer was built with
    back in its param group, each group in the model's parameter order, frozen parameters without state.

    Why: a framework that rebuilds the optimizer on resume from the parameters that require grad *before* any
    callback can restore the frozen set (the HF Trainer's ``create_optimizer``) builds these full groups; loading
    the freezer's shrunken groups into them fails ("loaded state dict contains a parameter group that doesn't match
    the size of optimizer's group"), and a thawed parameter appended at the end of its group would take another
    parameter's Adam moments. The full form loads into the rebuilt optimizer exactly; the freezer's restore then
    takes the frozen parameters out again (:class:`OptimizerSnapshot` keeps the loaded state meanwhile).
    """
    optimizer = freezer.optimizer
    by_name = dict(freezer.model.named_parameters())
    order = {id(p): i for i, p in enumerate(by_name.values())}
    members = [list(g["params"]) for g in optimizer.param_groups]
    present = {id(p) for group in members for p in group}
    for name, gi in freezer.state_dict()["origin"].items():
        p = by_name[name]
        if id(p) not in present:
            members[gi].append(p)
            present.add(id(p))
    saved = [g["params"] for g in optimizer.param_groups]
    try:
        for group, params in zip(optimizer.param_groups, members):
            group["params"] = sorted(params, key=lambda p: order.get(id(p), len(order)))
        return optimizer.state_dict()
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params


# --------------------------------------------------------------------------------------------------------------
# DDP rebuilt in place
# --------------------------------------------------------------------------------------------------------------
# Reentrant activation checkpointing after a frozen prefix
# --------------------------------------------------------------------------------------------------------------


def _mark_requires_grad(module: nn.Module, args: Any, output: Any) -> None:
    tensor = output_tensor(output)
    if (torch.is_grad_enabled() and isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
            and not tensor.requires_grad and tensor.grad_fn is None):
        tensor.requires_grad_(True)


class CheckpointBoundary:
    """A forward hook on the frozen prefix's last block that makes its output require grad.

    Why: ``torch.utils.checkpoint`` with ``use_reentrant=True`` returns outputs that require grad only when one of
    its tensor inputs does. After a frozen prefix none does (the prefix builds no graph), so every checkpointed
    trainable layer after it gets no gradient and the loss trains only the head, with a mere warning
    (transformers #21381, #23170: frozen embeddings + gradient checkpointing). Transformers' own fix,
    ``enable_input_require_grads()``, marks the *embeddings'* output, which makes backward run through every frozen
    layer after them; marking the prefix's own output keeps backward stopping at the first trainable block (one
    extra gradient, of the boundary activation). :meth:`update` moves the hook when the prefix changes.
    """

    def __init__(self) -> None:
        self.handle: Any = None
        self.index: int | None = None

    def update(self, freezer: Freezer) -> None:
        """Hook block ``frozen_prefix - 1`` (nothing when no block, or every block but the head, is frozen)."""
        k = freezer.frozen_prefix
        index = k - 1 if 0 < k < len(freezer.blocks) else None
        if index == self.index:
            return
        self.close()
        if index is not None:
            module = freezer.blocks[index].modules[-1][1]
            self.handle = module.register_forward_hook(_mark_requires_grad)
        self.index = index

    def close(self) -> None:
        """Remove the hook."""
        if self.handle is not None:
            self.handle.remove()
        self.handle, self.index = None, None


# --------------------------------------------------------------------------------------------------------------
# A memory budget in a framework's loop
# --------------------------------------------------------------------------------------------------------------


def plan_on_first_batch(budget: Any, model: nn.Module, optimizer: Any, loader: Iterable[Any], *,
                        move: Callable[[Any], Any] = lambda batch: batch,
                        loss: Callable[[nn.Module, Any], torch.Tensor] | None = None, blocks: Any = None,
                        unfrozen: bool = False, strategy: Any = None, params: dict[str, Any] | None = None,
                        sources: Sequence[Any] = ()) -> MemoryPlan:
    """The plan of a memory budget (:func:`~layerfreeze.budget.plan.plan_memory`) measured on the first batch of the
    framework's training loader, or ``budget`` itself when it is a ready :class:`~layerfreeze.budget.plan.MemoryPlan`.

    The batch is drawn from a fresh iterator with Python's, NumPy's and torch's random states kept (a shuffling
    sampler draws its seed from them), so the run's own batches and dropout masks are those it would have had.

    Args:
        budget: ``"3GiB"``, ``"0.6"``, an int of bytes, a float fraction, or a :class:`MemoryPlan`.
        model / optimizer: The network and the framework's optimizer (its kind is measured, its state untouched).
        loader: The training loader (its first batch is measured).
        move: Puts a batch on the model's device.
        loss: ``loss(model, batch)`` -> scalar (default :func:`~layerfreeze.budget.measure.default_loss`).
        blocks: The blocks (a Freezer's), or None to discover them.
        unfrozen: Measure as if no block were frozen (the Freezer already froze its start stage's blocks).
        strategy / params: The strategy a Freezer will get (not yet attached): a twin's bytes count
            (:func:`~layerfreeze.budget.plan.plan_memory`).
        sources: Byte sources already holding memory, e.g. a Freezer's attached strategy.

    Raises:
        BudgetError: the budget cannot be read or met.
    """
    if isinstance(budget, MemoryPlan):
        return budget
    states = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []):
        try:
            batch = next(iter(loader))
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
    return plan_memory(model, move(batch), budget, loss=loss, optimizer=optimizer, blocks=blocks, unfrozen=unfrozen,
                       strategy=strategy, params=params, sources=sources)


def check_callback_arguments(where: str, strategy: Any, params: Any, blocks: Any) -> None:
    """Refuse a callback's arguments of the wrong kind when it is made, not at its first hook
    (:func:`~layerfreeze.strategies.registry.check_strategy_arguments`; ``blocks`` as one string).

    Raises:
        TypeError: the message says what to pass instead.
    """
    check_strategy_arguments(strategy, params, where)
    refuse_pattern_string(blocks, where)  # before list() splits it into characters


# --------------------------------------------------------------------------------------------------------------
# One freezer in a framework's loop
# --------------------------------------------------------------------------------------------------------------


class FreezeSession:
    """A Freezer inside a framework's loop: its freeze/thaw records, the DDP wrapper and the checkpointing boundary
    kept in step with its frozen set, and the values to log after a stage.

    Args:
        freezer: The freezer.
        checkpointing: Keep a :class:`CheckpointBoundary` (the model runs with activation checkpointing).
        ddp_built_for: The frozen set (one bool per block) the framework's DDP wrapper was built for; default: the
            freezer's current one.
        ledger_every: Keep a memory ledger over the freezer's model, optimizer and blocks, sampling one optimizer
            step in ``ledger_every`` (and the step after every freeze or thaw); None: no ledger. The framework's
            callback calls :meth:`begin_step` before the step's first forward and :meth:`end_step` after its
            optimizer step.
    """

    def __init__(self, freezer: Freezer, checkpointing: bool = False,
                 ddp_built_for: tuple[bool, ...] | None = None, ledger_every: int | None = None) -> None:
        self.freezer = freezer
        self.ledger = None if ledger_every is None else MemoryLedger(
            freezer.model, freezer.optimizer, freezer=freezer, every=ledger_every,
            sources=[freezer.demoter] if freezer.demoter is not None else [])  # the Freezer counts its strategy
        self._ledger_open = False
        # the start stage's freezes (made in the Freezer's constructor, before this session): the timeline's first
        # entries, logged with the first stage's values
        self.events: list[dict[str, Any]] = list(freezer.history)
        freezer.on_event = self._on_event
        self.boundary = CheckpointBoundary() if checkpointing else None
        # the ddp.wrapper_key the framework's wrapper was built for; which parameters require grad: first seen
        self.ddp_built: tuple[Any, ...] = (tuple(freezer.frozen) if ddp_built_for is None else tuple(ddp_built_for),
                                           getattr(freezer, "dtype_restores", 0), None)
        self.ddp_rebuilds = 0
        self.sync(None)

    def _on_event(self, record: dict[str, Any]) -> None:
        self.events.append(record)
        if self.ledger is not None and record.get("kind") in ("freeze", "thaw"):
            self.ledger.request()  # the next step is sampled: what the change gave back

    def begin_step(self, step: int) -> None:
        """Before the first forward of optimizer step ``step`` (1-based): the ledger's step opens (no-op without a
        ledger, or when one is open)."""
        if self.ledger is not None and not self._ledger_open:
            self.ledger.begin(step)
            self._ledger_open = True

    def end_step(self) -> None:
        """After the optimizer step (before the freezer's stage): the ledger's step closes."""
        if self.ledger is not None and self._ledger_open:
            self._ledger_open = False
            self.ledger.end()

    def memory_metrics(self) -> dict[str, float]:
        """The ledger's last sample as values to log (bytes, floats): ``layerfreeze/memory/<bucket>``,
        ``layerfreeze/memory/tensor_total`` and the run's ``layerfreeze/memory/tensor_peak`` so far; empty without a
        ledger or before its first sample."""
        if self.ledger is None or self.ledger.last is None:
            return {}
        snap = self.ledger.last
        out = {f"{LOG_PREFIX}memory/{bucket}": float(n) for bucket, n in snap.buckets.items()}
        out[f"{LOG_PREFIX}memory/tensor_total"] = float(snap.tensor_bytes)
        if self.ledger.peaks.tensor is not None:
            out[f"{LOG_PREFIX}memory/tensor_peak"] = float(self.ledger.peaks.tensor.bytes)
        return out

    def sync(self, ddp: Any) -> bool:
        """Bring the boundary hook and ``ddp`` (a ``DistributedDataParallel``, or anything else: ignored) up to the
        freezer's frozen set; True when the DDP wrapper was rebuilt. Collective under DDP (see :func:`rebuild_ddp`).
        """
        if self.boundary is not None:
            self.boundary.update(self.freezer)
        if not isinstance(ddp, nn.parallel.DistributedDataParallel):
            return False
        key = wrapper_key(self.freezer, ddp.module)
        if self.ddp_built[2] is None:
            self.ddp_built = (*self.ddp_built[:2], key[2])
        if key == self.ddp_built:
            return False
        rebuild_ddp(ddp, self.freezer)
        self.ddp_built = key
        self.ddp_rebuilds += 1
        return True

    def metrics(self, decision: Any) -> dict[str, float]:
        """Values to log after a stage, all floats, named ``layerfreeze/...``: the frozen count and prefix, each
        numeric strategy signal (a per-block one as ``layerfreeze/<signal>/<block>``, NaN entries left out), and for
        each freeze/thaw since the last call ``layerfreeze/frozen/<block>`` (1.0 frozen, 0.0 thawed: the timeline).
        Empty when neither a stage nor an event happened."""
        events, self.events = self.events, []
        signals = signals_of(decision)
        if not events and not signals:
            return {}
        out = {f"{LOG_PREFIX}frozen_count": float(sum(self.freezer.frozen)),
               f"{LOG_PREFIX}frozen_prefix": float(self.freezer.frozen_prefix)}
        for key, value in signals.items():
            name = LOG_PREFIX + key.removeprefix("signal_")
            if isinstance(value, list):
                for block, v in zip(self.freezer.blocks, value):
                    if v is not None and math.isfinite(v):
                        out[f"{name}/{block.name}"] = float(v)
            elif math.isfinite(value):
                out[name] = float(value)
        for event in events:  # the timeline: freezes and thaws (a warning record of the integrity check has no block)
            if event.get("kind") in ("freeze", "thaw") and "block" in event:
                out[f"{LOG_PREFIX}frozen/{event['block']}"] = 1.0 if event["kind"] == "freeze" else 0.0
        return out

    def close(self) -> None:
        """Remove the boundary hook and the ledger's hooks, and release the strategy's hooks and threads."""
        if self.boundary is not None:
            self.boundary.close()
        if self.ledger is not None:
            self.ledger.close()
        self.freezer.close()
