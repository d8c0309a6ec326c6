"""What the training-loop hooks do every time they run: a step's bookkeeping, all in one place.

The :class:`~layerfreeze.engine.freezer.Freezer`'s ``after_backward()``, ``step()`` and ``epoch_end()`` call the
functions of the same name here:

* :func:`after_backward`, after every ``loss.backward()``: counts the backward and checks the first one since the
  frozen set changed (every trainable block got a gradient: ``FrozenSet.check_gradients``);
* :func:`sum_gradients`, at every ``optimizer.step()`` (:func:`hook_optimizer`; at ``after_backward`` for a Freezer
  without an optimizer), when the strategy asks for ``grad_l1``: adds the trainable gradients to their running sums
  in ``Freezer._grad_sums`` on the device (the gradient signal a stage reads and hands the strategy, then starts
  over: :func:`~layerfreeze.engine.stages.stage`);
* :func:`step`, after every ``optimizer.step()`` (and the scheduler's): counts the step, reshards under FSDP2, checks
  that the frozen set is still frozen and that a block thawed before the step was updated by it
  (:mod:`layerfreeze.engine.integrity`), runs a freezing stage every ``strategy.stage_every`` steps
  (:mod:`layerfreeze.engine.stages`), applies the LR factors to this step's LR
  (:mod:`layerfreeze.engine.lr_factors`) and marks the step's end on the clock (:mod:`layerfreeze.engine.timing`);
* :func:`epoch_end`: an epoch-end stage if the strategy wants one, and the epoch count.

None of them reads a device tensor on the host on a step without a stage (issue 40): the gradient sums stay on the
device, the integrity checks look at Python objects (``tests/test_host_sync.py`` counts the synchronisations).

:func:`integrity_warning` is where the integrity checks' warnings go (``warnings`` and the Freezer's ``on_event``).
The functions take the :class:`~layerfreeze.engine.freezer.Freezer` whose hook runs, and read and update its parts.
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import CosineAnnealingWarmRestarts, CyclicLR, LambdaLR, OneCycleLR

from layerfreeze.distributed import comm
from layerfreeze.engine import optimizer_load
from layerfreeze.engine.lr_factors import apply_lr_scales, refuse_scheduler_built_after, restore_unscaled
from layerfreeze.engine.optim import inner_optimizer
from layerfreeze.engine.sharding import sharded
from layerfreeze.engine.stages import stage, sums_gradients
from layerfreeze.strategies import Decision

if TYPE_CHECKING:  # the hooks' work on a Freezer; the Freezer calls it, never the other way round
    from layerfreeze.engine.freezer import Freezer


def after_backward(freezer: Freezer) -> None:
    """Count a backward and check its gradients if due (every trainable block got one; one that did not is a
    warning, :func:`integrity_warning`). When the strategy lists ``"grad_l1"`` in its ``signals`` and the Freezer
    has no optimizer to read them at (:func:`hook_optimizer`), also add the gradients to the running sums
    (:func:`sum_gradients`)."""
    freezer._backward_calls += 1
    if freezer.step_count == 0:  # before the first optimizer step: the start stage's LR factors applied twice
        refuse_scheduler_built_after(freezer.optimizer, freezer._lr_written, freezer.strategy.name)
    rest_lrs(freezer)
    freezer.integrity.check_gradients(freezer)
    if freezer._grad_hook is None:
        sum_gradients(freezer)


def sum_gradients(freezer: Freezer, found_inf: torch.Tensor | None = None) -> None:
    """Add the trainable blocks' gradients to the Freezer's running sums
    (:class:`~layerfreeze.engine.grad_signal.GradientSums`, on the gradients' device: one ``torch._foreach_add_``,
    no host synchronisation) when the strategy lists ``"grad_l1"``. Off rank 0 nothing is summed (no strategy reads
    it there; DDP all-reduced the gradients: rank 0's sums are global), except under FSDP2, where every rank sums its
    own shards (no collective: the stage all-reduces the per-block norms)."""
    if sums_gradients(freezer):  # lists the parameters once per frozen set
        freezer._grad_sums.add_trainable(freezer.frozen, freezer._params, found_inf)


def hook_optimizer(freezer: Freezer) -> None:
    """Read the gradients for ``grad_l1`` at every ``optimizer.step()`` (a step post-hook on the Freezer's optimizer),
    instead of at ``after_backward``: once per update whatever the number of backward passes (gradient accumulation
    calls ``after_backward`` after each, on gradients that still hold the earlier micro-batches'), after a
    ``GradScaler`` unscaled them, and never for a step it skipped on an overflow. After the step, not before it:
    Lightning runs the forward and backward inside ``optimizer.step(closure)``, so before the step the gradients are
    the previous update's (or, with ``accumulate_grad_batches``, the first micro-batches' alone); the optimizers of
    ``torch.optim`` leave ``.grad`` as they found it. A previous hook is removed; none is
    set without an optimizer that takes one, or for a strategy that does not read ``grad_l1``. A wrapper (accelerate's
    ``AcceleratedOptimizer`` subclasses ``torch.optim.Optimizer`` but never runs its ``__init__``, so it has no hooks)
    gets the hook on the optimizer it wraps, whose step runs once per real update. Its ``load_state_dict`` is watched
    too (:func:`~layerfreeze.engine.optimizer_load.watch`: an optimizer loaded before the Freezer's state)."""
    optimizer_load.watch(freezer)
    _unhook(freezer)
    optimizer = inner_optimizer(freezer.optimizer)
    if not hasattr(optimizer, "_optimizer_step_post_hooks"):
        return
    ref = weakref.ref(freezer)  # the optimizer does not keep the Freezer alive

    def scale(optimizer: Any, args: Any, kwargs: Any) -> None:
        owner = ref()
        if owner is not None:
            owner._stepping = True
            if owner._lr_scale:  # (a no-op where the LR is still the one freezer.step() wrote: rest_lrs)
                apply_lr_scales(owner.optimizer, owner.blocks, owner._origin, owner._lr_scale, owner._lr_written,
                                relative=multiplies(owner.scheduler))

    def unscale(optimizer: Any, args: Any, kwargs: Any) -> None:
        owner = ref()
        if owner is not None:
            owner._stepping = False
            if owner._lr_written:
                if owner.step_count == 0:  # (freezer.step() would see the restored LRs; lr_factors.restore_unscaled)
                    refuse_scheduler_built_after(owner.optimizer, owner._lr_written, owner.strategy.name)
                restore_unscaled(owner.optimizer, owner._lr_written)

    freezer._lr_hook = [optimizer.register_step_pre_hook(scale), optimizer.register_step_post_hook(unscale)]
    if "grad_l1" not in freezer.strategy.signals:
        return

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        owner = ref()
        if owner is not None:  # a GradScaler steps a fused optimizer on an overflow too, saying so in found_inf
            sum_gradients(owner, getattr(optimizer, "found_inf", None))

    freezer._grad_hook = optimizer.register_step_post_hook(after_step)


def release_gradients(freezer: Freezer) -> None:
    """Remove the optimizer hooks of :func:`hook_optimizer` and free the running sums (``Freezer.close``)."""
    _unhook(freezer)
    optimizer_load.unwatch(freezer)
    freezer._grad_sums.load_state_dict({})


def _unhook(freezer: Freezer) -> None:
    if freezer._grad_hook is not None:
        freezer._grad_hook.remove()
        freezer._grad_hook = None
    for handle in freezer._lr_hook or ():
        handle.remove()
    freezer._lr_hook = None


#: Schedulers that compute each LR from their base, whatever they find in the group (:func:`rest_lrs`).
ABSOLUTE_SCHEDULERS = (LambdaLR, OneCycleLR, CyclicLR, CosineAnnealingWarmRestarts)


def multiplies(scheduler: Any) -> bool:
    """Whether ``scheduler`` multiplies the LR it finds in a group (ReduceLROnPlateau): a change of the scaled LR
    written at the last step is then that LR times the scheduler's change (``scale_group_lrs``' ``relative``)."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def rest_lrs(freezer: Freezer) -> None:
    """Give the param groups a factor scales their unscaled LR between optimizer steps, where a scheduler may step
    (``after_backward``, ``epoch_end``); the optimizer's step pre-hook applies the factors again
    (:func:`hook_optimizer`). Why: a step a GradScaler skipped on an overflow runs no step hook, so the scheduler that
    followed found the scaled LR, and one that multiplies what it finds (LinearLR's warm-up) took the factor into its
    next LR: two skipped steps under a 5-step warm-up trained FreezeOut's first block at 3.6 times its LR to the
    warm-up's end, in silence. Not inside an optimizer step (Lightning runs the backward in the step's closure), nor
    for an optimizer without step hooks (nothing would apply the factors again), nor under a scheduler given as
    ``scheduler=`` that computes each LR from its base (LambdaLR, OneCycleLR, CyclicLR, warm restarts: what it finds
    does not matter, and the LR in the groups stays the one the step runs at, which the CLI trainer records)."""
    if freezer._lr_written and freezer._lr_hook and not freezer._stepping \
            and not isinstance(freezer.scheduler, ABSOLUTE_SCHEDULERS):
        restore_unscaled(freezer.optimizer, freezer._lr_written)


def step(freezer: Freezer) -> Decision | None:
    """Count an optimizer step, reshard under FSDP2, run the integrity checks, a freezing stage when one is due
    (every ``strategy.stage_every`` steps) and apply the LR factors.

    Returns:
        The stage's decision, or None when no stage ran.

    Raises:
        UnfrozenParameterError: a frozen block's parameter was replaced or made trainable and the Freezer was built
            with ``on_unfrozen="error"``.
        RuntimeError: from the stage (:func:`~layerfreeze.engine.stages.stage`).
    """
    if freezer.step_count == 0:  # a loop without after_backward(): the start stage's LR factors applied twice
        refuse_scheduler_built_after(freezer.optimizer, freezer._lr_written, freezer.strategy.name)
    freezer.step_count += 1
    optimizer_load.forget(freezer)  # the optimizer's state is its own from now on, not a load's (optimizer_load)
    if freezer.total_steps is not None and freezer.step_count == freezer.total_steps + 1:
        # the strategies that place their stages by the fraction of training done read past the end as the end
        # (freezeout's LRs are 0 from there: training stopped in silence); counting micro-batches instead of
        # optimizer steps (gradient accumulation, accelerate's accumulate()) gets here halfway through the run
        warnings.warn(f"freezer.step() was called {freezer.step_count} times, more than total_steps="
                      f"{freezer.total_steps}: call it once per optimizer step that updated the weights (with "
                      "gradient accumulation: only on the step that syncs, e.g. accelerate's "
                      "`if accelerator.sync_gradients`), and give total_steps the run's optimizer steps",
                      stacklevel=3)
    sharded(freezer._fsdp)
    freezer.integrity.check(freezer)
    freezer.integrity.check_updated(freezer)  # a block thawed before this step must have been updated by it
    if freezer.distributed and not freezer._fsdp:  # every rank a whole replica: the same thawed weights on all
        freezer.integrity.check_ranks_agree(freezer, comm.all_gather_object)
    every = freezer.strategy.stage_every
    decision = stage(freezer, event="step") if every and freezer.step_count % every == 0 else None
    if freezer._lr_scale:  # (a plateau scheduler multiplies what it finds: the scaled LR, stepped after step())
        apply_lr_scales(freezer.optimizer, freezer.blocks, freezer._origin, freezer._lr_scale, freezer._lr_written,
                        relative=multiplies(freezer.scheduler))
    freezer._step_times.mark(staged=decision is not None)
    warn_missing_epoch_end(freezer)
    return decision


def warn_missing_epoch_end(freezer: Freezer) -> None:
    """Warn once when a strategy that decides only at epoch ends (``gradual``, ``linear``, ``geometric``) has gone
    without ``freezer.epoch_end()`` for two epochs of ``steps_per_epoch``, or, without it, for over half of
    ``total_steps``: a loop that never called it trained only the head under ``gradual`` and froze nothing under the
    others, in silence."""
    strategy = freezer.strategy
    if not strategy.at_epoch_end or strategy.stage_every or freezer._epoch_end_warned:
        return
    spe, total, since = freezer.steps_per_epoch, freezer.total_steps, freezer._epoch_started
    due = since + 2 * spe if spe else total // 2 + 1 if total and freezer.epoch == 0 else None
    if due is not None and freezer.step_count >= due:
        freezer._epoch_end_warned = True
        span = f"{spe} per epoch" if spe else f"the run has {total}"
        warnings.warn(f"freezer.epoch_end() has not been called for {freezer.step_count - since} optimizer steps "
                      f"({span}): strategy {strategy.name!r} decides only at epoch ends, so it has made no decision "
                      "since its start. Call freezer.epoch_end() after each epoch's last step", stacklevel=4)


def epoch_end(freezer: Freezer) -> Decision | None:
    """Run an epoch-end stage if the strategy wants one (``strategy.at_epoch_end``), then count the epoch.

    Returns:
        The stage's decision, or None when no stage ran.
    """
    decision = stage(freezer, event="epoch_end") if freezer.strategy.at_epoch_end else None
    freezer.epoch += 1
    freezer._epoch_started = freezer.step_count  # (warn_missing_epoch_end)
    rest_lrs(freezer)  # a per-epoch scheduler stepped after epoch_end() finds the unscaled LR
    freezer._step_times.restart()  # evaluation and checkpoints happen between epochs: not a step's time
    return decision


def integrity_warning(freezer: Freezer, message: str, record: dict[str, Any]) -> None:
    """Where the integrity checks (:class:`~layerfreeze.engine.integrity.FrozenSet`) send a warning: to
    ``warnings`` and, with this step's count, to the Freezer's ``on_event`` (the CLI logs it as an event)."""
    # stacklevel 5: this function, the FrozenSet check, after_backward() / step() here, the Freezer's hook, and the
    # training loop that called it
    warnings.warn(message, stacklevel=5)
    if freezer.on_event is not None:
        freezer.on_event({**record, "step": freezer.step_count, "message": message})
