"""Learning rates per block: the factors a strategy sets on a block's LR, and the LR a thaw sets.

A strategy's :class:`~layerfreeze.strategies.Decision` may carry ``lr_scale`` (block -> factor): the Freezer keeps
them (``Freezer._lr_scale``, a factor of 1 drops the entry) and, after every step, multiplies each scaled block's
scheduled LR by its factor (:func:`apply_lr_scales`, after the scheduler set this step's LR). ``Freezer._lr_written``
maps a param group to ``(unscaled LR, LR written here last time)``, so a factor is not compounded when no scheduler
rewrote the LR (:func:`~layerfreeze.engine.optim.scale_group_lrs`); a thaw's own LR (:func:`set_block_lr`) drops
that record. A factor or an LR of its own needs param groups holding only the block's parameters
(:func:`~layerfreeze.engine.optim.exclusive_groups`). These are plain functions over the Freezer's parts (the
optimizer, the blocks, the parameter -> param-group origin and the two dicts above), which they read and update.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from layerfreeze.engine.optim import (
    SCHEDULED_KEYS,
    base_lr,
    block_groups,
    exclusive_groups,
    scale_group_lrs,
    set_group_lr,
)
from layerfreeze.models.blocks import Block


def apply_lr_scales(optimizer: torch.optim.Optimizer | None, blocks: Sequence[Block], origin: Mapping[int, int],
                    lr_scale: Mapping[int, float], lr_written: dict[int, tuple[float, float]],
                    relative: bool = False) -> None:
    """Multiply each scaled block's scheduled LR by its factor
    (:func:`~layerfreeze.engine.optim.scale_group_lrs`, whose ``relative`` this passes on); no-op without an
    optimizer."""
    if optimizer is not None:
        scales = {gi: scale for index, scale in lr_scale.items() for gi in block_groups(origin, blocks[index])}
        scale_group_lrs(optimizer, scales, lr_written, relative)


def restore_unscaled(optimizer: torch.optim.Optimizer, lr_written: dict[int, tuple[float, float]]) -> None:
    """After an optimizer step (a step post-hook, :func:`~layerfreeze.engine.steps.hook_optimizer`): give every param
    group a factor scaled its unscaled LR back, until ``freezer.step()`` applies this step's factor.

    Why: the scheduler steps between the two, and the schedulers that derive the next LR from the current one
    (LinearLR's warm-up and so SequentialLR, CosineAnnealingLR, StepLR, ReduceLROnPlateau stepped per step) took the
    factor into their next LR, and the Freezer multiplied it in again: under a 3-step LinearLR warm-up, FreezeOut's
    first block trained at 3.6 times its LR from the second step, in silence. A group whose LR was changed since the
    Freezer wrote it is left alone."""
    for gi, (unscaled, wrote) in list(lr_written.items()):
        group = optimizer.param_groups[gi]
        if unscaled is not None and group["lr"] == wrote:
            group["lr"] = unscaled
            lr_written[gi] = (unscaled, unscaled)


def set_lr_scales(lr_scale: dict[int, float], factors: Mapping[int, float], optimizer: torch.optim.Optimizer | None,
                  origin: Mapping[int, int], blocks: Sequence[Block]) -> None:
    """Take a stage's LR ``factors`` (block index -> factor) into ``lr_scale`` (a factor of 1 removes the block).

    Raises:
        ValueError: a factor on a block whose param group holds other blocks too (checked when there is an
            optimizer; without one yet, :func:`check_lr_scales` checks them when it is attached).
    """
    for i, scale in factors.items():
        if optimizer is not None:  # without one yet, attach_optimizer checks and applies the factors
            numeric_lrs(optimizer, exclusive_groups(optimizer, origin, blocks[i], "a learning-rate factor"), blocks[i],
                        "a learning-rate factor")
        if scale == 1.0:
            lr_scale.pop(i, None)
        else:
            lr_scale[i] = float(scale)


def refuse_scheduler_built_after(optimizer: torch.optim.Optimizer | None, lr_written: Mapping[int, tuple[float, float]],
                                 strategy: str) -> None:
    """Refuse an LR scheduler built after the Freezer whose start stage set LR factors (FreezeOut's ``1 / t_i``).

    Why: a scheduler takes each group's LR when it is built as its base (``initial_lr``, ``base_lrs``); built after
    the factors were written, its base holds them, and the Freezer multiplies them in again after every scheduler
    step: the first block trained at about twice FreezeOut's LR, in silence. Seen as a group whose ``initial_lr`` is
    the scaled LR the Freezer wrote (``lr_written``), not the LR it scaled. The Freezer checks it before its first
    step (``after_backward``, ``step``), when nothing but the constructor has written.

    Raises:
        RuntimeError: naming the group and the two LRs, and saying to build the scheduler first and pass it.
    """
    if optimizer is None:
        return
    for gi, (unscaled, wrote) in sorted(lr_written.items()):
        group = optimizer.param_groups[gi]
        if wrote != unscaled and group.get("initial_lr") == wrote:
            raise RuntimeError(
                f"an LR scheduler was built after the Freezer: it took param group {gi}'s learning rate {wrote:g}, "
                f"which strategy {strategy!r} had scaled from {unscaled:g} by its per-block factor, as its base, so "
                "the factor would apply twice from its next step. Build the scheduler before the Freezer and pass it: "
                "Freezer(..., scheduler=scheduler)")


def check_lr_scales(optimizer: torch.optim.Optimizer, origin: Mapping[int, int], blocks: Sequence[Block],
                    lr_scale: Mapping[int, float]) -> None:
    """Every scaled block's param groups hold that block only (the factors set before ``optimizer`` was attached).

    Raises:
        ValueError: a group that also holds other blocks' parameters.
    """
    for i in lr_scale:
        numeric_lrs(optimizer, exclusive_groups(optimizer, origin, blocks[i], "a learning-rate factor"), blocks[i],
                    "a learning-rate factor")


def numeric_lrs(optimizer: torch.optim.Optimizer, groups: Sequence[int], block: Block, purpose: str) -> None:
    """Refuse to give ``block`` ``purpose`` (a factor, an LR of its own) when one of its param ``groups`` has no
    numeric ``lr``: Adafactor with ``relative_step=True`` (``lr=None``) computes its own step size, so a factor
    failed with a bare ``TypeError`` ("unsupported operand type(s) for *: 'NoneType' and 'float'") from the Freezer's
    constructor, and a thaw's LR (gradual's discriminative LRs) was written where Adafactor never reads it.

    Raises:
        ValueError: naming the group and its ``lr``, and what to build instead.
    """
    for gi in groups:
        lr = optimizer.param_groups[gi].get("lr")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)):
            raise ValueError(
                f"Cannot give block {block.name!r} {purpose}: its param group {gi} has lr={lr!r}, no learning rate "
                "to scale (Adafactor with relative_step=True computes its own step size). Build the optimizer with a "
                "learning rate, e.g. Adafactor(params, lr=1e-3, relative_step=False, scale_parameter=False, "
                "warmup_init=False), or use a strategy that sets no learning rates")


def check_block_lr(optimizer: torch.optim.Optimizer | None, origin: Mapping[int, int], block: Block, lr: float,
                   purpose: str = "its own learning rate") -> None:
    """Raise ValueError when ``lr`` cannot be given to ``block``: no optimizer, ``lr`` not finite and ``> 0``, a param
    group that also holds other blocks' parameters, or none of its parameters in a param group."""
    if optimizer is None or not 0 < lr < math.inf:
        raise ValueError(f"set_block_lr needs an optimizer and a finite lr > 0 (got lr={lr})")
    groups = exclusive_groups(optimizer, origin, block, purpose)
    numeric_lrs(optimizer, groups, block, purpose)
    if not groups:
        raise ValueError(f"Cannot give block {block.name!r} {purpose}: none of its parameters is in a param group of "
                         "the optimizer (build the optimizer from layerfreeze.block_param_groups(...), one group per "
                         "block)")


def check_thaw_lrs(optimizer: torch.optim.Optimizer | None, origin: Mapping[int, int], blocks: Sequence[Block],
                   strategy: Any) -> None:
    """For a strategy whose thaws set learning rates (``Strategy.thaw_lrs``: ``gradual``), check when the optimizer
    is known that every block but the head has param groups of its own: the first thaw, an epoch into the run,
    raised it before.

    Raises:
        ValueError: from :func:`check_block_lr`.
    """
    if optimizer is None or not getattr(strategy, "thaw_lrs", False):
        return
    for block in blocks[:-1]:
        check_block_lr(optimizer, origin, block, 1.0, f"the learning rate {strategy.name!r} gives a thawed block")


def keep_plateau_base(optimizer: torch.optim.Optimizer | None, scheduler: Any) -> None:
    """Under ``ReduceLROnPlateau``, which keeps no base LR, record each param group's LR now (before any reduction:
    the Freezer is built after the scheduler, before the first step) as its ``initial_lr``, the base a thaw's ``lr``
    scales (:func:`set_block_lr`): a thaw after reductions gave the block ``lr`` itself, ``2**k`` times its place in
    the schedule after ``k`` halvings. ``initial_lr`` travels with the optimizer's state dict; another scheduler's
    groups have it already."""
    if optimizer is not None and isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])


def set_block_lr(optimizer: torch.optim.Optimizer, origin: Mapping[int, int], block: Block, lr: float,
                 scheduler: Any, lr_written: dict[int, tuple[float, float]]) -> None:
    """Set the base LR of ``block``'s param groups (and the scheduler's), forgetting what a factor wrote there.

    ``lr`` is the base LR the schedule scales (:func:`~layerfreeze.engine.optim.set_group_lr`), as the scheduler's
    ``base_lrs``. Under OneCycleLR that is ``max_lr / div_factor`` (the LR it starts from): ``lr`` peaks at ``lr *
    div_factor``, as the other groups' peaks are their ``initial_lr * div_factor``. Under ReduceLROnPlateau it is
    the LR the group had when the Freezer got the scheduler (:func:`keep_plateau_base`): the reductions made so far
    scale it too.

    Warns (UserWarning) when a group carries a scheduler's ``initial_lr`` but no ``scheduler`` was given: that
    scheduler's next step would set the group's LR back (pass ``scheduler=`` to the Freezer); not under OneCycleLR,
    whose schedule follows the group's own ``max_lr`` and ``min_lr``, scaled here.

    Raises:
        ValueError: a group that also holds other blocks' parameters.
    """
    for gi in exclusive_groups(optimizer, origin, block, "its own learning rate"):
        group = optimizer.param_groups[gi]
        # OneCycleLR schedules from the group's own max_lr / min_lr, which set_group_lr scales: its steps keep the LR
        if scheduler is None and "initial_lr" in group and not all(key in group for key in SCHEDULED_KEYS):
            warnings.warn(f"block {block.name!r} gets lr {lr:g}, but an LR scheduler over this optimizer (its param "
                          "groups carry initial_lr) was not given to the Freezer: its next step sets the LR back. "
                          "Pass it: Freezer(..., scheduler=scheduler)", stacklevel=4)
        unscaled, wrote = lr_written.pop(gi, (None, None))
        current = unscaled if unscaled is not None and group["lr"] == wrote else group["lr"]  # before any factor
        set_group_lr(optimizer, gi, lr, scheduler, base=base_lr(optimizer, [gi], {gi: (unscaled, wrote)}),
                     current=current)


def block_lrs(optimizer: torch.optim.Optimizer, origin: Mapping[int, int], blocks: Sequence[Block],
              lr_written: Mapping[int, tuple[float, float]],
              params_of: Callable[[int], Sequence[nn.Parameter]] | None = None) -> list[float | None]:
    """Each block's LR before any factor (:func:`~layerfreeze.engine.optim.base_lr`; None for a block with no
    param group): what a strategy reads as :attr:`~layerfreeze.strategies.StageContext.block_lrs`. ``params_of``:
    block ``i``'s parameters, listed already (``BlockParams.of``: a stage need not walk the modules again)."""
    return [base_lr(optimizer, block_groups(origin, b, None if params_of is None else params_of(b.index)), lr_written)
            for b in blocks]
