"""A block's freeze and thaw on a :class:`~layerfreeze.engine.freezer.Freezer`: the stateless mechanics
(:mod:`~layerfreeze.engine.mechanics`, :mod:`~layerfreeze.engine.optim`) wired to its optimizer, its eval-mode hooks,
its integrity checks, its demotion and its history. ``Freezer.freeze`` / ``Freezer.thaw`` resolve the block and check
what they are asked first (the floor, a thaw's learning rate), then call these.

What freezing a block does, and why each part matters (each is a public fault seen in other tools):

* ``requires_grad_(False)``: autograd builds no graph for a frozen prefix (its output does not require grad, so no
  activations are kept for backward and backward stops at the first trainable block).
* The parameters leave the optimizer's param groups and their optimizer state is freed
  (:func:`~layerfreeze.engine.optim.remove_from_optimizer`: "frozen" weights would otherwise drift under momentum and
  weight decay, and their state keep its memory).
* ``.grad`` is set to None so no stale gradient is applied or clipped later. BatchNorm running statistics and
  dropout go to eval mode (a forward pre-hook re-applies it after every ``model.train()``), unless ``train_bn=True``
  (fastai / Lightning ``train_bn``): then BatchNorm layers keep training, affine parameters included.

Thawing reverses all of it and puts each parameter back into the param group it came from (the number of param
groups never changes), with no optimizer state: a block switched on starts from fresh state (zero Adam moments),
as the rotating strategies' papers prescribe (``lisa``, ``badam``); a block frozen and thawed in the same stage is
switched off and on again, its state cleared. A parameter the optimizer never held (its block was frozen before
the optimizer was built) goes into param group 0, so a thaw never leaves a block untrained (LMFlow#726), and the
first optimizer step after a thaw is checked to have changed the block
(:meth:`~layerfreeze.engine.integrity.FrozenSet.check_updated`). The frozen blocks need not be a prefix: a frozen
block above a trainable one saves its weight gradients and optimizer state, while backward still runs through it
(only a frozen prefix, :attr:`~layerfreeze.engine.freezer.Freezer.frozen_prefix`, saves its backward and is what the
activation cache serves).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from torch import nn

from layerfreeze.engine.integrity import UnfrozenParameterError
from layerfreeze.engine.lr_factors import check_block_lr
from layerfreeze.engine.mechanics import (
    frozen_by_user,
    frozen_parameters,
    record_momentum,
    resume_training,
    set_eval_mode,
    stop_training,
)
from layerfreeze.engine.optim import add_to_optimizer, remove_from_optimizer
from layerfreeze.engine.sharding import sharded
from layerfreeze.engine.stages import FLOOR_REASON
from layerfreeze.models.blocks import Block

if TYPE_CHECKING:
    from layerfreeze.engine.freezer import Freezer


class PinnedBlockError(RuntimeError):
    """A thaw of a block the Freezer's floor keeps frozen (a memory budget's plan)."""


def freeze_block(freezer: Freezer, block: Block, reason: str) -> bool:
    """Freeze ``block`` (see :meth:`Freezer.freeze <layerfreeze.engine.freezer.Freezer.freeze>`).

    Returns:
        True if the block was trainable and is now frozen, False if it was already frozen.
    """
    if freezer.frozen[block.index]:
        return False
    sharded(freezer._fsdp)
    params = frozen_parameters(block, freezer.train_bn)
    # what the user set since the Freezer was built: frozen by hand mid-run (requires_grad_(False)), the thaw leaves
    # it frozen, as one frozen before (a rotating strategy's next thaw made it train again); made trainable again,
    # the thaw trains it (it was kept frozen)
    freezer._frozen_before.update(id(p) for p in params if frozen_by_user(p))
    freezer._frozen_before.difference_update(id(p) for p in params if p.requires_grad)
    stop_training(params, freezer._frozen_before)
    if freezer.optimizer is not None:
        found = remove_from_optimizer(freezer.optimizer, params)
        freezer._origin.update(found)
        # held now though not when the Freezer was built (optimizer.add_param_group since): a thaw puts them back
        freezer._not_optimized.difference_update(found)
    for _, module in block.modules:
        record_momentum(module)  # what set_eval_mode tells a recalibration (update_bn) by
        set_eval_mode(module, freezer.train_bn)
        freezer._hooks.setdefault(block.index, []).append(module.register_forward_pre_hook(freezer._eval_hook))
    if freezer._root_eval_hook is None and block.modules and block.modules[0][1] is not freezer.model:
        freezer._root_eval_hook = freezer.model.register_forward_pre_hook(freezer._eval_frozen_blocks)
    freezer.frozen[block.index] = True
    named = freezer.named_frozen_parameters(block)
    freezer.integrity.on_freeze(block.index, named)  # the checksum of the float32 weights a thaw gives back
    extra: dict[str, Any] = {}
    if freezer.demoter is not None:
        skipped = freezer.demoter.on_freeze(block, named)
        if skipped is not None:
            extra["demote_skipped"] = skipped
        elif freezer.demoter.is_demoted(block.index):
            extra["demoted"] = freezer.demoter.spec.dtype
    record(freezer, "freeze", block, reason, **extra)
    return True


def warn_if_nothing_trains(freezer: Freezer, block: Block) -> None:
    """Warn when freezing ``block`` by hand (:meth:`Freezer.freeze <layerfreeze.engine.freezer.Freezer.freeze>`)
    left no parameter of the model training: the next ``loss.backward()`` raises torch's "element 0 of tensors does
    not require grad", far from its cause. No strategy freezes the head, and a stage never leaves nothing to train
    (:func:`~layerfreeze.engine.stages.keep_one_training`); a hand freeze can: of the head, or of the last block with
    trainable parameters when the others hold none (peft's LoRA froze the base and the head)."""
    if any(p.requires_grad for p in freezer.model.parameters()):
        return
    why = "every block frozen" if all(freezer.frozen) else "no trainable parameter in the blocks not frozen"
    # stacklevel 3: this function, Freezer.freeze, its caller
    warnings.warn(f"freezing block {block.name!r} left {why}: nothing trains, and loss.backward() raises; thaw a "
                  "block (freezer.thaw(key)) before the next step", stacklevel=3)


def thaw_block(freezer: Freezer, block: Block) -> bool:
    """Make frozen ``block`` trainable again, back in the param groups it came from, as far as the user had it
    trainable before the Freezer (:func:`~layerfreeze.engine.mechanics.resume_training`; a parameter the optimizer
    did not hold is not added to it). No record and no learning rate: :meth:`Freezer.thaw
    <layerfreeze.engine.freezer.Freezer.thaw>` does both.

    Returns:
        True if the block was frozen and is now trainable, False if it was trainable already.
    """
    if not freezer.frozen[block.index]:
        return False
    sharded(freezer._fsdp)
    if freezer.demoter is not None:  # the float32 weights, exactly as they froze, before anything else
        freezer.demoter.on_thaw(block)
    for handle in freezer._hooks.pop(block.index, []):
        handle.remove()
    for _, module in block.modules:
        module.train(freezer.model.training)
    params = resume_training(frozen_parameters(block, freezer.train_bn), freezer._frozen_before)
    if freezer.optimizer is not None:
        for p in params:
            if id(p) not in freezer._not_optimized:  # (one frozen before attach_optimizer goes to group 0)
                add_to_optimizer(freezer.optimizer, [p], freezer._origin.get(id(p), 0))
    freezer.frozen[block.index] = False
    freezer.integrity.on_thaw(block.index)
    return True


def thaw_asked(freezer: Freezer, block: Block, lr: float | None, reason: str) -> bool:
    """A thaw asked of the Freezer (:meth:`Freezer.thaw <layerfreeze.engine.freezer.Freezer.thaw>`, whose docstring
    gives the errors and the warning): ``lr`` and the floor checked before anything changes, then
    :func:`thaw_block`, the block's learning rate, and the record."""
    if lr is not None:  # checked before anything changes: a refused lr left the block half thawed
        check_block_lr(freezer.optimizer, freezer._origin, block, lr)
    if block.index in freezer._floor:
        raise PinnedBlockError(
            f"block {block.name} is in the Freezer's floor ({FLOOR_REASON}: it stays frozen so the run's tensor "
            "peak fits the budget); thawing it would bring back its gradients, optimizer state and saved "
            "activations. Raise the budget (or plan without it) to train it")
    was_frozen = thaw_block(freezer, block)
    if lr is not None:
        freezer.set_block_lr(block, lr)
    if was_frozen and freezer._lr_scale.get(block.index) == 0.0:  # it trained at LR 0, in silence, until refrozen
        by = "" if reason == "manual" else f" ({reason})"
        # stacklevel 3: this function, Freezer.thaw, its caller
        warnings.warn(f"Freezer.thaw{by}: block {block.name} thaws with the learning-rate factor 0 that strategy "
                      f"{freezer.strategy.name!r} gives it (its schedule has ended for this block): it trains at "
                      f"learning rate 0{', whatever lr= says,' if lr is not None else ''} until the strategy "
                      "freezes it again", stacklevel=3)
    if was_frozen:
        record(freezer, "thaw", block, reason, lr=lr)
    return was_frozen


def record(freezer: Freezer, kind: str, block: Block, reason: str, **extra: Any) -> None:
    """Append a freeze or thaw to the Freezer's :attr:`history` (not one a resume replays) and pass it to its
    ``on_event``: ``kind``, block name and index, step, epoch, reason, how many blocks are frozen, the frozen prefix,
    and ``extra`` (None values left out)."""
    rec = {"kind": kind, "block": block.name, "index": block.index, "step": freezer.step_count,
           "epoch": freezer.epoch, "reason": reason, "frozen_count": sum(freezer.frozen),
           "frozen_prefix": freezer.frozen_prefix, **{k: v for k, v in extra.items() if v is not None}}
    if reason != "resume":
        freezer.history.append(rec)
    if freezer.on_event is not None:
        freezer.on_event(rec)


def refreeze(freezer: Freezer, param: nn.Parameter, old: nn.Parameter | None) -> None:
    """:meth:`Freezer.refreeze_parameter <layerfreeze.engine.freezer.Freezer.refreeze_parameter>`: no grad, out of
    the optimizer, and ``param`` takes over ``old``'s param-group origin and name. A ``param`` that replaced ``old``
    in a frozen block (``module.weight = nn.Parameter(...)``: loaded or resized weights, warned about) gets its own
    checksum: the checkpoint's check of frozen weights refused every later checkpoint of the run.

    Raises:
        UnfrozenParameterError: ``param`` replaced one of a demoted block, whose float32 master copy is the old
            weight's (a thaw would restore it, a checkpoint write it).
    """
    if param.requires_grad:  # made trainable by hand while its block is frozen: it trains when the block thaws
        freezer._frozen_before.discard(id(param))
    stop_training([param], freezer._frozen_before)  # (the Freezer's mark: not the user's frozen parameter)
    if freezer.optimizer is not None:  # put back in a param group by the user: a thaw puts it there again
        found = remove_from_optimizer(freezer.optimizer, [param])
        freezer._origin.update(found)
        freezer._not_optimized.difference_update(found)
    if old is not None and old is not param:
        if id(old) in freezer._origin:
            freezer._origin[id(param)] = freezer._origin.pop(id(old))
        if id(old) in freezer._names:
            freezer._names[id(param)] = freezer._names.pop(id(old))
        for block in freezer.blocks:
            named = [(n, p) for n, p in freezer.named_frozen_parameters(block) if p is param]
            if not (freezer.frozen[block.index] and named):
                continue
            if freezer.demoter is not None and freezer.demoter.manages(block.index):
                raise UnfrozenParameterError(
                    f"parameter {named[0][0]!r} of demoted frozen block {block.name!r} was replaced: the block's "
                    "float32 master copy, which a thaw restores and a checkpoint writes, is the old weight's. Thaw "
                    "the block before replacing its weights (or build the Freezer without demote=)")
            freezer.integrity.retake(block.index, named)
