"""A new Freezer on a model that an earlier Freezer froze blocks of (a second ``fit`` on the same model, a Trainer's
second ``train()``, a ``copy.deepcopy`` of a model a Freezer froze).

The earlier Freezer, closed (or a deep copy of it, carried along with the copied model's hooks), leaves its blocks
frozen and keeps its eval-mode pre-hooks on their modules. A new Freezer that ignored them reported those blocks
trainable while they stayed frozen and never trained, and a block it thawed ran in eval mode (BatchNorm statistics
frozen, dropout off) in a block that trains. :func:`take_over` gives the new Freezer's run what the earlier run froze,
once its own start stage has run: every parameter of the new model that the earlier Freezer froze, that the user had
not frozen before it, and that the new strategy did not freeze again, trains again (in the new optimizer: the param
group it had when the same optimizer is reused, else group 0), its block's modules leave eval mode and the earlier
Freezer's hooks stop touching that block. Blocks outside the new model keep the earlier Freezer's state and hooks;
what cannot be taken over (a block reaching outside the new model, blocks a deep copy's Freezer holds demoted) is
refused before the new Freezer changes anything (:func:`check_earlier`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from torch import nn

from layerfreeze.engine.mechanics import FROZEN_MARK, closed_freezers, frozen_parameters
from layerfreeze.engine.optim import add_to_optimizer

if TYPE_CHECKING:
    from layerfreeze.engine.freezer import Freezer


def earlier_freezers(model: nn.Module, cls: type) -> list[Any]:
    """The Freezers (of class ``cls``) that froze blocks of ``model``, before a new one is built on it: those whose
    eval-mode hooks are on its modules, closed ones and deep copies (a copied model's hooks are bound to a copy of its
    Freezer, which nothing else knows of), and the closed ones sharing its parameters (a Freezer on a parent model,
    whose hooks sit on modules outside ``model``)."""
    own = (cls._eval_hook, cls._eval_frozen_blocks)
    found: dict[int, Any] = {id(other): other for other in closed_freezers(model)}
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            owner = getattr(hook, "__self__", None)
            if getattr(hook, "__func__", None) in own:
                found[id(owner)] = owner
    return list(found.values())


def check_earlier(model: nn.Module, cls: type) -> list[Any]:
    """Refuse, before a new Freezer changes anything, what it cannot take over from earlier Freezers on ``model``.

    Returns:
        The earlier Freezers (:func:`earlier_freezers`), for :func:`adopt_origins` and :func:`take_over`.

    Raises:
        ValueError: naming the blocks, and what to do: a block demoted by another Freezer (a ``copy.deepcopy`` taken
            while a Freezer with ``demote`` was open carries low-precision weights whose float32 master copies are the
            original model's: a new Freezer trained the copy in bfloat16 and its ``state_dict()`` returned the
            original's weights; a closed Freezer has given them back), or a frozen block that reaches outside
            ``model`` (a Freezer on a submodule of it: letting go of the block would leave its other part frozen
            with nothing keeping it in eval mode, keeping it would report frozen weights as trainable).
    """
    mine = {id(p) for p in model.parameters()}
    earlier = earlier_freezers(model, cls)
    for other in earlier:
        demoted = [b.name for b in other.blocks if other.demoter is not None and other.demoter.is_demoted(b.index)]
        if demoted:
            raise ValueError(
                f"this model's block(s) {', '.join(demoted)} are demoted by another Freezer (a copy.deepcopy of a "
                "model taken while its Freezer with demote= was open): their weights are low-precision and their "
                "float32 master copies are the original model's. Copy the model before building that Freezer or "
                "after closing it (close() gives demoted blocks their float32 weights back)")
        for block in other.blocks:
            inside = [id(p) in mine for p in frozen_parameters(block, other.train_bn)]
            if other.frozen[block.index] and any(inside) and not all(inside):
                raise ValueError(
                    f"block {block.name!r}, frozen by an earlier Freezer on a larger model, reaches outside this "
                    "model: part of its weights are here, part outside. Build the Freezer on the model that holds "
                    "the whole block, or on one that holds none of it")
    return earlier


def adopt_origins(freezer: Freezer) -> None:
    """Before ``freezer``'s own checks: the param groups that earlier Freezers sharing its optimizer recorded for the
    parameters they took out of it, as if ``freezer`` had taken them out (a Trainer's second ``train()``: a thaw
    learning rate's check of one group per block refused a block whose parameters had left the optimizer)."""
    mine = {id(p) for p in freezer.model.parameters()}
    for other in freezer._earlier:
        if other.optimizer is not None and other.optimizer is freezer.optimizer:
            for i, gi in other._origin.items():
                if i in mine and i not in freezer._origin and gi < len(freezer.optimizer.param_groups):
                    freezer._origin[i] = gi


def _release(other: Any, block: Any, model: nn.Module) -> None:
    """``other`` lets go of its frozen ``block``: its hooks leave the block's modules (by the hooks dict: a deep copy's
    handles point at the original's), the modules take ``model``'s mode, its record says the block is not frozen (its
    root hook skips it), and its root hook goes once it holds no block."""
    for _, module in block.modules:
        for key, hook in list(module._forward_pre_hooks.items()):
            if getattr(hook, "__self__", None) is other:
                del module._forward_pre_hooks[key]
        module.train(model.training)
    other._hooks.pop(block.index, None)
    other.frozen[block.index] = False
    if not any(other.frozen):
        for key, hook in list(other.model._forward_pre_hooks.items()):
            if getattr(hook, "__self__", None) is other:
                del other.model._forward_pre_hooks[key]
        other._root_eval_hook = None


def put_into(freezer: Freezer, optimizer: Any, origin: dict[int, int]) -> None:
    """Put the parameters :func:`take_over` made trainable that ``optimizer`` does not hold into it: the param group
    each had when the earlier Freezer's optimizer is ``optimizer`` (reused: a Trainer's second ``train()``), else
    group 0 (an optimizer built while they were frozen, over what required grad); ``origin`` records the group. One
    the new strategy froze again gets its earlier group recorded, for its thaw, when the optimizer is the same."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for p, earlier, group in freezer._taken_back:
        same = earlier is optimizer and group is not None
        gi = origin.get(id(p), min(group if same else 0, len(optimizer.param_groups) - 1))
        if p.requires_grad and id(p) not in held:
            add_to_optimizer(optimizer, [p], gi)
            held.add(id(p))
            origin[id(p)] = gi
        elif not p.requires_grad and same and id(p) not in origin:
            origin[id(p)] = gi


def take_over(freezer: Freezer) -> None:
    """Give ``freezer`` what earlier Freezers on its model left frozen (module docstring), once its strategy's start
    stage has run; warn naming the blocks that train again.

    Every block of ``freezer``'s model that an earlier Freezer froze is let go of (:func:`_release`). Of its
    parameters, those the user had frozen before that Freezer (told by name, so that a deep copy's are too) stay as
    they are; the others are no longer taken as the user's (a thaw by ``freezer`` trains them) and keep their earlier
    param group (:func:`put_into`), and those ``freezer``'s start stage did not freeze again train again.
    """
    mine = {id(p) for p in freezer.model.parameters()}
    kept = {id(p) for b in freezer.blocks if freezer.frozen[b.index]
            for p in frozen_parameters(b, freezer.train_bn)}
    taken: list[nn.Parameter] = []
    for other in freezer._earlier:
        names = {id(p): n for n, p in other.model.named_parameters()}
        users = {other._names[i] for i in other._frozen_before if i in other._names}
        for block in other.blocks:
            ours = [p for p in frozen_parameters(block, other.train_bn) if id(p) in mine]
            if not other.frozen[block.index] or not ours:
                continue
            _release(other, block, freezer.model)
            for p in ours:
                if names.get(id(p)) in users:
                    continue
                freezer._frozen_before.discard(id(p))
                freezer._taken_back.append((p, other.optimizer, other._origin.get(id(p))))
                if id(p) not in kept and not p.requires_grad:
                    p.requires_grad_(True)
                    if hasattr(p, FROZEN_MARK):
                        delattr(p, FROZEN_MARK)
                    taken.append(p)
    freezer.eval_frozen()  # the modules released took the model's mode: its own frozen blocks back in eval mode
    if freezer.optimizer is not None:
        put_into(freezer, freezer.optimizer, freezer._origin)
    if taken:
        ids = {id(p) for p in taken}
        names = [b.name for b in freezer.blocks if any(id(p) in ids for p in b.parameters())]
        warnings.warn(f"Freezer: block(s) {', '.join(names) or '(outside the blocks)'} were left frozen by an "
                      "earlier Freezer on this model (closed, or copied with it); they train again from this "
                      "Freezer's start, where its strategy decides anew (to keep them frozen: Freezer(..., "
                      "floor=[...]) or freezer.freeze(...))", stacklevel=3)
