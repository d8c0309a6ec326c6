"""A new Freezer on a model that an earlier Freezer froze blocks of (a second ``fit`` on the same model, a Trainer's
second ``train()``, a ``copy.deepcopy`` of a model a Freezer froze).

The earlier Freezer, closed (or a deep copy of it, carried along with the copied model's hooks), leaves its blocks
frozen and keeps its eval-mode pre-hooks on their modules. A new Freezer that ignored them reported those blocks
trainable while they stayed frozen and never trained, and a block it thawed ran in eval mode (BatchNorm statistics
frozen, dropout off) in a block that trains. :func:`take_over` gives the new Freezer's run what the earlier run froze,
once its own start stage has run: every parameter of the new model that the earlier Freezer froze, that the user had
not frozen before it, and that the new strategy did not freeze again, trains again (in the new optimizer: the param
group it had when the same optimizer is reused, else group 0), its block's modules leave eval mode and the earlier
Freezer's hooks stop touching that block. Blocks outside the new model keep the earlier Freezer's state and hooks.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from torch import nn

from layerfreeze.engine.mechanics import FROZEN_MARK, frozen_parameters
from layerfreeze.engine.optim import add_to_optimizer

if TYPE_CHECKING:
    from layerfreeze.engine.freezer import Freezer


def earlier_freezers(freezer: Freezer) -> list[Any]:
    """The Freezers other than ``freezer`` whose eval-mode hooks are on ``freezer.model``'s modules: closed ones, and
    deep copies (a copied model's hooks are bound to a copy of its Freezer, which nothing else knows of)."""
    own = (type(freezer)._eval_hook, type(freezer)._eval_frozen_blocks)
    found: dict[int, Any] = {}
    for module in freezer.model.modules():
        for hook in module._forward_pre_hooks.values():
            owner = getattr(hook, "__self__", None)
            if getattr(hook, "__func__", None) in own and owner is not freezer:
                found[id(owner)] = owner
    return list(found.values())


def _left_frozen(freezer: Freezer, other: Any, mine: set[int]) -> dict[int, list[nn.Parameter]]:
    """``{block index of other: its parameters in freezer's model that other froze and freezer takes back}``: not
    frozen by the user before ``other`` was built (by name, so that a deep copy's parameters are told apart too), not
    in a block ``freezer`` froze, frozen still."""
    names = {id(p): n for n, p in other.model.named_parameters()}
    users = {other._names[i] for i in other._frozen_before if i in other._names}
    kept = {id(p) for b in freezer.blocks if freezer.frozen[b.index] for p in b.parameters()}
    left = {}
    for block in other.blocks:
        if other.frozen[block.index]:
            params = [p for p in frozen_parameters(block, other.train_bn) if id(p) in mine and id(p) not in kept
                      and not p.requires_grad and names.get(id(p)) not in users]
            if params:
                left[block.index] = params
    return left


def put_into(freezer: Freezer, optimizer: Any, origin: dict[int, int]) -> None:
    """Put the parameters :func:`take_over` made trainable that ``optimizer`` does not hold into it: the param group
    each had when the earlier Freezer's optimizer is ``optimizer`` (reused: a Trainer's second ``train()``), else
    group 0 (an optimizer built while they were frozen, over what required grad); ``origin`` records the group."""
    for p, earlier, group in freezer._taken_back:
        if id(p) not in origin and p.requires_grad:
            gi = group if earlier is optimizer and group is not None else 0
            gi = min(gi, len(optimizer.param_groups) - 1)
            add_to_optimizer(optimizer, [p], gi)
            origin[id(p)] = gi


def take_over(freezer: Freezer) -> None:
    """Give ``freezer`` what earlier Freezers on its model left frozen (module docstring), once its strategy's start
    stage has run; warn naming the blocks that train again."""
    mine = {id(p) for p in freezer.model.parameters()}
    taken: list[nn.Parameter] = []
    for other in earlier_freezers(freezer):
        for index, params in _left_frozen(freezer, other, mine).items():
            for _, module in other.blocks[index].modules:  # its hooks stop putting the block in eval mode
                for key, hook in list(module._forward_pre_hooks.items()):
                    if getattr(hook, "__self__", None) is other:
                        del module._forward_pre_hooks[key]  # not the handle: a deep copy's points at the original
                module.train(freezer.model.training)
            other._hooks.pop(index, None)
            other.frozen[index] = False  # its root hook skips the block from now on
            for p in params:
                p.requires_grad_(True)
                if hasattr(p, FROZEN_MARK):
                    delattr(p, FROZEN_MARK)
                freezer._frozen_before.discard(id(p))
                freezer._taken_back.append((p, other.optimizer, other._origin.get(id(p))))
            taken += params
    if freezer.optimizer is not None:
        put_into(freezer, freezer.optimizer, freezer._origin)
    if taken:
        ids = {id(p) for p in taken}
        names = [b.name for b in freezer.blocks if any(id(p) in ids for p in b.parameters())]
        warnings.warn(f"Freezer: block(s) {', '.join(names) or '(outside the blocks)'} were left frozen by an "
                      "earlier Freezer on this model (closed, or copied with it); they train again from this "
                      "Freezer's start, where its strategy decides anew (to keep them frozen: Freezer(..., "
                      "floor=[...]) or freezer.freeze(...))", stacklevel=3)
