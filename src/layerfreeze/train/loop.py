"""The learning-rate schedule and the optimizer step that the CLI trainer and the SmartFRZ collector share.

:func:`lr_lambda` is the schedule of every layerfreeze run (linear warm-up, then linear or cosine decay to zero, or
constant); :func:`warmup_steps` turns a warm-up fraction into steps, with the rounding as an explicit parameter
because the CLI trainer and the SmartFRZ collector have always rounded differently and the shipped predictor was
trained on runs recorded with the collector's rounding. :func:`apply_step` is what follows a backward in both
(clip, optimizer step, scheduler step, gradients dropped); :func:`train_steps` is the plain loop around it, without
freezing, cache or checkpoints, that the collector records its runs with (the CLI trainer's loop,
:class:`~layerfreeze.train.trainer.Trainer`, adds those around the same :func:`apply_step`, which its step,
:func:`~layerfreeze.train.step.train_step`, calls).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")

#: The ways :func:`warmup_steps` rounds.
ROUNDINGS = ("floor", "round")


def warmup_steps(total_steps: int, fraction: float, rounding: str = "floor") -> int:
    """Optimizer steps of linear warm-up for a warm-up ``fraction`` of a run of ``total_steps`` steps.

    Args:
        total_steps: Planned optimizer steps.
        fraction: Warm-up as a fraction of the run, e.g. 0.05.
        rounding: ``"floor"``: ``int(fraction * total_steps)``, 0 (no warm-up) when that is under one step (the CLI
            trainer's). ``"round"``: ``max(1, round(fraction * total_steps))``, Python's round-half-to-even and at
            least one step (the SmartFRZ collector's: every run behind the shipped predictor was recorded with it,
            so changing it would change the weight histories that reproduce the predictor).

    Raises:
        ValueError: an unknown ``rounding``.
    """
    if rounding == "floor":
        return int(fraction * total_steps)
    if rounding == "round":
        return max(1, round(fraction * total_steps))
    raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")


def lr_lambda(total_steps: int, warmup_steps: int, schedule: str) -> Callable[[int], float]:
    """Multiplier of the base LR at a step: linear warm-up to 1, then linear/cosine decay to 0 (or constant).

    Args:
        total_steps: Planned optimizer steps; the decay reaches 0 there (and stays 0 after).
        warmup_steps: Steps of warm-up (:func:`warmup_steps`); step ``s < warmup_steps`` gets ``(s + 1) /
            warmup_steps``.
        schedule: ``"cosine"``, ``"linear"`` or ``"constant"`` after the warm-up.

    Returns:
        ``factor(step)`` for ``torch.optim.lr_scheduler.LambdaLR`` (``step`` = scheduler steps taken, from 0).
    """

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(1.0, progress)
        return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def apply_step(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
               grad_clip: float | None = None, params: Iterable[nn.Parameter] = (),
               scaler: torch.amp.GradScaler | None = None) -> None:
    """The step after a backward: ``clip_grad_norm_(params, grad_clip)`` when ``grad_clip`` is set (a max global
    norm; parameters without a gradient are skipped), ``optimizer.step()``, ``scheduler.step()``, then
    ``optimizer.zero_grad(set_to_none=True)``.

    ``params`` is the caller's: the norm is summed in its order, so a run keeps its own (the trainer clips the
    optimizer's parameters, group by group; the collector the model's, in ``model.parameters()`` order).

    With a ``scaler`` (loss scaling, Micikevicius et al. 2018, sec. 3.2) the gradients are unscaled before the clip,
    ``scaler.step`` steps the optimizer (skipping it on an inf or NaN gradient) and ``scaler.update`` moves the
    scale; the scheduler steps either way, as Lightning's does.
    """
    if scaler is not None:
        scaler.unscale_(optimizer)
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(list(params), grad_clip)
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    if scheduler is not None:
        step_scheduler(scheduler, quiet=scaler is not None)
    optimizer.zero_grad(set_to_none=True)


def step_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler, quiet: bool = False) -> None:
    """``scheduler.step()``; ``quiet``: without PyTorch's "lr_scheduler.step() before optimizer.step()" warning, for
    a step whose optimizer step was skipped on purpose (a loss scaler's inf skip, or nothing trainable had a
    gradient): the schedule follows the run's steps, not the optimizer's."""
    if not quiet:
        scheduler.step()
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()` before"), UserWarning)
        scheduler.step()


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable[T],
                loss: Callable[[T], torch.Tensor], *, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                grad_clip: float | None = None,
                on_step: Callable[[int, torch.Tensor], bool | None] | None = None) -> int | None:
    """One optimizer step per item of ``batches``, no freezing: the loop the SmartFRZ collector records runs with.

    Each step: ``loss(batch)`` (a scalar tensor); if it is not finite the loop stops before touching the weights;
    else backward and :func:`apply_step` (clipping over ``model.parameters()``), then ``on_step(step, loss)``
    (``step`` 1-based), which stops the loop by returning True. Gradients are dropped before the first step.

    Returns:
        None when every batch was trained on; else the step that stopped the loop (its loss not finite, nothing
        applied; or ``on_step`` returned True, after the step was applied).
    """
    optimizer.zero_grad(set_to_none=True)  # whatever the caller left in .grad is not this loop's
    for step, batch in enumerate(batches, start=1):
        value = loss(batch)
        if not torch.isfinite(value):
            return step
        value.backward()
        apply_step(optimizer, scheduler, grad_clip, model.parameters())
        if on_step is not None and on_step(step, value):
            return step
    return None
