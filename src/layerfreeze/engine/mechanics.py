"""The freeze/thaw mechanics on one block, as stateless helpers (Lightning's ``BaseFinetuning.freeze`` /
``make_trainable`` style); :class:`~layerfreeze.engine.freezer.Freezer` wires them to a model, an optimizer
(:mod:`~layerfreeze.engine.optim`) and a strategy.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from layerfreeze.models.blocks import Block

_NORM_TYPES = (nn.modules.batchnorm._BatchNorm,)


def frozen_parameters(block: Block, train_bn: bool = False) -> list[nn.Parameter]:
    """The parameters that freezing ``block`` stops training (BatchNorm affine ones stay if ``train_bn``)."""
    if not train_bn:
        return list(block.parameters())
    keep = {id(p) for _, m in block.modules for sub in m.modules() if isinstance(sub, _NORM_TYPES)
            for p in sub.parameters(recurse=False)}
    return [p for p in block.parameters() if id(p) not in keep]


#: The attribute a parameter the Freezer froze carries (True) until a thaw: a parameter that is frozen when a Freezer
#: is built and carries it was frozen by an earlier Freezer (a second ``fit`` on the same model), not by the user, so
#: the new Freezer may thaw it.
FROZEN_MARK = "_layerfreeze_frozen"


def frozen_by_user(p: nn.Parameter) -> bool:
    """Whether ``p`` is frozen, and not by a Freezer (it carries no :data:`FROZEN_MARK`): by the user or a library
    (peft's base weights), before a Freezer or since."""
    return not p.requires_grad and not getattr(p, FROZEN_MARK, False)


def frozen_before(model: nn.Module) -> set[int]:
    """``id`` of each parameter of ``model`` frozen before a Freezer was built (:func:`frozen_by_user`), so that a
    thaw leaves it frozen (a thaw made the user's frozen layer train); one an earlier Freezer froze is not among
    them."""
    return {id(p) for p in model.parameters() if frozen_by_user(p)}


def not_optimized(model: nn.Module, origin: Mapping[int, int]) -> set[int]:
    """``id`` of each trainable parameter of ``model`` the optimizer does not hold (``origin``: the group of each it
    holds): a thaw does not add it (a thaw put it into param group 0)."""
    return {id(p) for p in model.parameters() if p.requires_grad and id(p) not in origin}


def stop_training(params: Iterable[nn.Parameter], before: set[int]) -> None:
    """Freeze ``params``: no gradient, ``requires_grad`` off, and :data:`FROZEN_MARK` on those not frozen ``before``
    (:func:`frozen_before`)."""
    for p in params:
        if id(p) not in before:
            setattr(p, FROZEN_MARK, True)
        p.requires_grad_(False)
        p.grad = None


def resume_training(params: Iterable[nn.Parameter], before: set[int]) -> list[nn.Parameter]:
    """Thaw ``params`` but those frozen ``before`` the Freezer (:func:`frozen_before`), which stay frozen.

    Returns:
        The parameters made trainable.
    """
    thawed = [p for p in params if id(p) not in before]
    for p in thawed:
        p.requires_grad_(True)
        if hasattr(p, FROZEN_MARK):
            delattr(p, FROZEN_MARK)
    return thawed


#: The attribute a BatchNorm layer of a frozen block carries: its ``momentum`` when the block froze
#: (:func:`record_momentum`).
FROZEN_MOMENTUM = "_layerfreeze_momentum"
#: The attribute a frozen block's module carries: its BatchNorm layers, found as it froze (:func:`record_momentum`).
FROZEN_NORMS = "_layerfreeze_norms"


def record_momentum(module: nn.Module) -> None:
    """Record each BatchNorm layer's ``momentum`` in ``module`` (:data:`FROZEN_MOMENTUM`), as its block freezes: what
    tells :func:`set_eval_mode` a recalibration (``momentum`` set to None since) from a layer built with
    ``momentum=None`` (a cumulative average). ``module`` keeps the list of those layers (:data:`FROZEN_NORMS`), so
    that :func:`frozen_blocks_to_eval` does not walk every sub-module of every frozen block at every forward."""
    norms = [sub for sub in module.modules() if isinstance(sub, _NORM_TYPES)]
    for sub in norms:
        setattr(sub, FROZEN_MOMENTUM, sub.momentum)
    object.__setattr__(module, FROZEN_NORMS, tuple(norms))


def set_eval_mode(module: nn.Module, train_bn: bool = False) -> None:
    """Put ``module`` and its sub-modules in eval mode (BatchNorm layers excepted when ``train_bn``).

    A BatchNorm layer in training mode whose ``momentum`` was set to None since its block froze
    (:func:`record_momentum`) is being recalibrated (its statistics were reset and are averaged anew over a pass of
    the data: ``torch.optim.swa_utils.update_bn``, Lightning's ``StochasticWeightAveraging``) and keeps training mode:
    in eval mode a frozen block's reset statistics stayed at 0 and 1, and the averaged model's output was wrong. One
    built with ``momentum=None`` goes to eval mode like any other: kept training, a frozen block normalised with each
    batch's statistics and its running ones changed at every step (under DDP differently on every rank); a
    recalibration cannot be told from its setting, so ``update_bn`` leaves such a layer of a frozen block as it
    reset it."""
    for sub in module.modules():
        norm = isinstance(sub, _NORM_TYPES)
        sub.training = bool(norm and sub.training and (train_bn or _recalibrating(sub)))


def _recalibrating(norm: nn.Module) -> bool:
    """Whether BatchNorm layer ``norm`` of a frozen block is being recalibrated (:func:`set_eval_mode`)."""
    return norm.momentum is None and getattr(norm, FROZEN_MOMENTUM, None) is not None


def frozen_blocks_to_eval(blocks: list[Block], frozen: list[bool], train_bn: bool = False) -> None:
    """Put every frozen block (``frozen[i]``) back in eval mode, before any block is called (the Freezer runs it
    from a pre-hook on the whole model, in training mode).

    Why not the blocks' own pre-hooks alone: they run inside the block's ``__call__``, after a wrapper that reads
    ``module.training`` there has decided. transformers up to 5.17 at least checkpoints a training-mode layer's
    whole ``__call__`` (``GradientCheckpointingLayer``), so after the HF Trainer's ``model.train()`` a frozen
    layer ran under a reentrant checkpoint, where the checkpointing boundary's hook (grad mode off there) could not
    mark its output, and no checkpointed layer after it got a gradient (issue 41, transformers #21381's fault
    again; found with transformers 5.17). One pass over the frozen blocks. A frozen block in eval mode already gets its
    BatchNorm layers' mode from :func:`set_eval_mode`'s recalibration test: Lightning's ``StochasticWeightAveraging``
    resets their statistics and sets ``momentum=None`` with no ``train()`` after (the frozen block's statistics
    stayed reset, 0 and 1), and puts the momentum back after (the layers go back to eval mode).
    """
    for index, is_frozen in enumerate(frozen):
        if is_frozen:
            for _, module in blocks[index].modules:
                if module.training:
                    set_eval_mode(module, train_bn)
                elif not train_bn:  # in eval mode already: a recalibration begun (or ended) since (set_eval_mode)
                    for sub in getattr(module, FROZEN_NORMS, ()):
                        sub.training = _recalibrating(sub)


#: The open Freezer of each model, held weakly (a model's own hooks keep its Freezer alive until close()).
_OPEN: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def _sharing(model: nn.Module) -> list[Any]:
    """The registered Freezers still alive whose model shares parameters with ``model`` (the model itself, a
    submodule or a parent of it, a ``torch.compile`` wrapper of it), open or closed."""
    mine = {id(p) for p in model.parameters()}
    found = []
    for other_model, ref in list(_OPEN.items()):
        other = ref()
        if other is not None and (other_model is model or any(id(p) in mine for p in other_model.parameters())):
            found.append(other)
    return found


def open_freezer(model: nn.Module) -> Any:
    """The open Freezer (built, not closed) whose model shares parameters with ``model`` (:func:`_sharing`), or
    None. What to close when a Freezer was dropped without :meth:`~layerfreeze.engine.Freezer.close`: its hooks on
    the model keep it alive, and at work."""
    return next((other for other in _sharing(model) if not other.closed), None)


def closed_freezers(model: nn.Module) -> list[Any]:
    """The closed Freezers still alive (their hooks hold them) whose model shares parameters with ``model``."""
    return [other for other in _sharing(model) if other.closed]


def refuse_second_freezer(model: nn.Module) -> None:
    """Refuse a Freezer on a model that shares parameters with one that has an open Freezer (:func:`open_freezer`).

    Raises:
        RuntimeError: two Freezers over the same blocks step two strategies, each freezing and thawing what the
            other set, and each step counted twice: a framework callback registered twice (transformers only warns,
            then calls it twice), two callbacks, or a Freezer built again without closing the first.
    """
    other = open_freezer(model)
    if other is not None:
        raise RuntimeError(
            f"this {type(model).__name__} already has an open Freezer (strategy {other.strategy.name!r}, on its "
            f"{type(other.model).__name__}): a second one would run its own strategy over the same blocks, freezing "
            "and thawing what the first set. Close the first (freezer.close(), or build it in a `with` block; "
            "lost it? layerfreeze.open_freezer(model).close()) before building another. Two framework callbacks "
            "(LayerFreeze, LayerFreezeCallback) on one model do the same: use one")


def claim_model(model: nn.Module, freezer: Any) -> None:
    """Record ``freezer`` as ``model``'s open Freezer (:func:`refuse_second_freezer`)."""
    _OPEN[model] = weakref.ref(freezer)
