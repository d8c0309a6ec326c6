"""A new Freezer on a model that an earlier Freezer froze blocks of (a second ``fit`` on the same model, a Trainer's
second ``train()``, a ``copy.deepcopy`` of a model a Freezer froze).

The earlier Freezer, closed (or a deep copy of it, carried along with the copied model's hooks), leaves its blocks
frozen and keeps its eval-mode pre-hooks on their modules. A new Freezer that ignored them reported those blocks
trainable while they stayed frozen and never trained, and a block it thawed ran in eval mode (BatchNorm statistics
frozen, dropout off) in a block that trains. :func:`take_over` gives the new Freezer's run what the earlier run froze,
once its own start stage has run: every parameter of the new model that the earlier Freezer froze, that the user had
not frozen before it, and that the new strategy did not freeze again, trains again (in the new optimizer: the param
group it had when the same optimizer is reused, else the one it would have had: :class:`_Placement`), its block's
modules leave eval mode and the earlier Freezer's hooks stop touching that block. Blocks outside the new model keep
the earlier Freezer's state and hooks; what cannot be taken over (a block reaching outside the new model, blocks a
deep copy's Freezer holds demoted) is refused before the new Freezer changes anything (:func:`check_earlier`).
:func:`release_earlier` lets go of the same blocks before an optimizer is built over what requires grad.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from copy import deepcopy
from typing import TYPE_CHECKING, Any

from torch import nn

from layerfreeze.engine.mechanics import (
    FROZEN_MARK,
    closed_freezers,
    frozen_by_user,
    frozen_parameters,
    refuse_second_freezer,
)
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


def closed_record(freezer: Freezer, what: str = "copy.deepcopy of a model") -> dict[str, Any]:
    """The attributes of what a copy (``copy.deepcopy``: an EMA copy, ``torch.optim.swa_utils.AveragedModel``, a
    best-model snapshot) or a pickle (``torch.save(model)``) of a model carries of its Freezer, whose eval-mode hooks
    sit on its frozen blocks' modules: a closed Freezer that knows only which blocks are frozen, what it may take over
    (the parameters' names, the user's frozen ones) and keeps the frozen blocks in eval mode. Not the optimizer and
    its state, the strategy (Egeria's worker thread could not be copied: ``TypeError: cannot pickle
    '_queue.SimpleQueue'``) or the checks: a copy carried the whole Freezer, twice the optimizer state in memory, and
    ``torch.save(model)`` wrote the optimizer's state into the model's file.

    Raises:
        TypeError: ``freezer`` holds demoted or offloaded blocks (``demote=``): the copy would get their low-precision
            weights, with the demotion's hooks bound to this model's float32 master copies (a copy's forward failed,
            its ``state_dict()`` returned this model's weights; a pickle failed with "Can't pickle local object").
            The message, which starts with ``what``, says what to copy or save instead.
    """
    if freezer.demoter is not None and any(freezer.demoter.manages(b.index) for b in freezer.blocks):
        raise TypeError(
            f"{what} whose Freezer holds demoted blocks (demote=): the copy would hold their low-precision weights, "
            "with hooks bound to this model's float32 master copies. For a snapshot of the weights save or copy "
            "model.state_dict() (it holds the float32 weights); for the model itself, copy or save it before building "
            "the Freezer or after closing it (close() gives the blocks their float32 weights back)")
    # the parameters it knew and the user's frozen ones by name, not by id(): an id of this model's parameter means
    # nothing in a copy or another process, and a live object may reuse it (the param groups they came from go too:
    # without an optimizer they are never read, :func:`seed_origins`)
    names = freezer._names
    return dict(model=freezer.model, blocks=freezer.blocks, frozen=list(freezer.frozen), train_bn=freezer.train_bn,
                _names={n: n for n in names.values()}, _frozen_before={names[i] for i in freezer._frozen_before
                                                                       if i in names},
                _origin={}, optimizer=None, demoter=None, _hooks={}, _root_eval_hook=None, closed=True)


def copied(freezer: Freezer, memo: dict[int, Any]) -> Freezer:
    """What a ``copy.deepcopy`` of a model carries of its Freezer: a closed Freezer over the copy, with the
    attributes of :func:`closed_record` (which raises ``TypeError`` while blocks are demoted)."""
    record = closed_record(freezer)
    copy = object.__new__(type(freezer))
    memo[id(freezer)] = copy
    copy.__dict__.update(deepcopy(record, memo))
    return copy


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


def _left_frozen(model: nn.Module, earlier: list[Any]) -> Iterator[tuple[Any, Any, list[nn.Parameter], bool]]:
    """``(earlier Freezer, its frozen block, parameters, kept)`` for each block of ``model`` an earlier Freezer holds
    frozen: the block's frozen parameters in ``model`` that the earlier Freezer knew (not those added to the block
    since: peft's LoRA adapters inside it) and the user had not frozen before it (both told by name too, so that a
    deep copy's are as well), and whether they are to stay frozen as the user's (:func:`_frozen_since`)."""
    mine = {id(p) for p in model.parameters()}
    for other in earlier:
        names = {id(p): n for n, p in other.model.named_parameters()}
        known = set(other._names.values())
        users = {other._names[i] for i in other._frozen_before if i in other._names}
        kept = _frozen_since(other, mine, users)
        for block in other.blocks:
            ours = [p for p in frozen_parameters(block, other.train_bn) if id(p) in mine
                    and (id(p) in other._names or names.get(id(p)) in known)]
            if other.frozen[block.index] and ours:
                yield other, block, [p for p in ours if names.get(id(p)) not in users], kept


def _frozen_since(other: Any, mine: set[int], users: set[str]) -> bool:
    """Whether a parameter of ``mine`` that trained under the earlier Freezer ``other`` (neither frozen by it nor by
    the user before it) has been frozen since by something other than a Freezer: peft's ``get_peft_model`` freezing
    the base model for LoRA, the user's ``requires_grad_(False)`` (freeze everything, then make the head trainable).
    The user has set what trains since; what ``other`` left frozen then stays frozen, as the user's, but for what the
    user made trainable again. Training it again trained a LoRA model's base weights, and the blocks of a head-only
    run, added to its optimizer."""
    held = {id(p) for b in other.blocks if other.frozen[b.index] for p in frozen_parameters(b, other.train_bn)}
    known = set(other._names.values())  # by name too: a deep copy's parameters are other objects
    return any(frozen_by_user(p) for n, p in other.model.named_parameters()  # those it saw, not LoRA's added since
               if (id(p) in other._names or n in known) and id(p) in mine and id(p) not in held and n not in users)


def _keep_as_users(p: nn.Parameter) -> bool:
    """``p``, frozen by an earlier Freezer, is the user's from now on (:func:`_frozen_since`): without the Freezer's
    mark, so no Freezer's thaw trains it while it stays frozen. Returns whether it is frozen (the user may have made it
    trainable since)."""
    if hasattr(p, FROZEN_MARK):
        delattr(p, FROZEN_MARK)
    return not p.requires_grad


def _warn_kept(kept: list[str], stacklevel: int) -> None:
    """Say which blocks an earlier Freezer left frozen stay frozen as the user's."""
    if kept:
        warnings.warn(f"Freezer: block(s) {', '.join(kept)} were left frozen by an earlier Freezer on this model, and "
                      "other parameters were frozen since it closed (peft's get_peft_model, requires_grad_(False)): "
                      "they stay frozen, as yours (to train them, requires_grad_(True) on them before building the "
                      "optimizer and the Freezer)", stacklevel=stacklevel + 1)


class _Placement:
    """The param group of ``optimizer`` a parameter it does not hold would have had, had it been trainable when the
    optimizer was built over what required grad (the HF Trainer's ``create_optimizer``, the CLI's
    ``build_optimizer``): in an optimizer of :func:`~layerfreeze.engine.optim.block_param_groups` (groups with a
    ``"block"`` key), its own block's group; elsewhere, and between a block's decay and no-decay groups, the group of
    its nearest *twin*, a parameter the optimizer holds of the same module class and attribute (``LayerNorm.weight``,
    ``Linear.bias``: the same weight decay as the next layer's); group 0 when it has neither. Group 0 for everything
    put the taken-back biases and norms under weight decay, and every taken-back block in the first block's LR group;
    in the HF Trainer the resumed optimizer's groups then no longer matched the checkpoint's."""

    def __init__(self, model: nn.Module, blocks: list[Any], optimizer: Any) -> None:
        self.groups = optimizer.param_groups
        order = {id(p): i for i, p in enumerate(model.parameters())}
        self.kind: dict[int, tuple[Any, ...]] = {}
        for module in model.modules():
            for attr, p in module.named_parameters(recurse=False):
                self.kind.setdefault(id(p), (type(module), attr, p.ndim))
        self.twins: dict[tuple[Any, ...], list[tuple[int, int]]] = {}  # kind -> (model position, group), held
        for gi, group in enumerate(self.groups):
            for p in group["params"]:
                if id(p) in self.kind:
                    self.twins.setdefault(self.kind[id(p)], []).append((order[id(p)], gi))
        self.order = order
        self.block_of = {id(p): b.name for b in blocks for p in b.parameters()}

    def group(self, p: nn.Parameter) -> int:
        """The group index for ``p`` (class docstring)."""
        held = self.twins.get(self.kind.get(id(p), ()), [])
        where = self.order.get(id(p), 0)
        twin = min(held, key=lambda pos_gi: abs(pos_gi[0] - where))[1] if held else None
        block = self.block_of.get(id(p))
        own = [gi for gi, g in enumerate(self.groups) if block is not None and g.get("block") == block]
        if own:
            decay = self.groups[twin].get("weight_decay") if twin is not None else None
            return next((gi for gi in own if self.groups[gi].get("weight_decay") == decay), own[0])
        return twin if twin is not None else 0


def seed_origins(freezer: Freezer, optimizer: Any, origin: dict[int, int],
                 left: list[tuple[nn.Parameter, Any, int | None]]) -> None:
    """Record in ``origin`` (parameter id -> param group of ``optimizer``) the group of each parameter an earlier
    Freezer left frozen that ``optimizer`` does not hold (``left``: ``(param, the earlier Freezer's optimizer, its group
    there)``), before ``freezer``'s checks (a thaw learning rate's check of one group per block refused a block whose
    parameters were not in the optimizer): the group it had when the optimizer is the earlier Freezer's (reused: a
    Trainer's second ``train()``), else where :class:`_Placement` puts it."""
    placement: _Placement | None = None
    for p, earlier, group in left:
        if id(p) in origin:
            continue
        if earlier is optimizer and group is not None and group < len(optimizer.param_groups):
            origin[id(p)] = group
            continue
        placement = placement or _Placement(freezer.model, freezer.blocks, optimizer)
        origin[id(p)] = placement.group(p)


def adopt_origins(freezer: Freezer) -> None:
    """Before ``freezer``'s own checks: the param group of each parameter earlier Freezers left frozen that its
    optimizer does not hold (:func:`seed_origins`), as if ``freezer`` had taken it out of that group."""
    left = [(p, other.optimizer, other._origin.get(id(p)))
            for other, _, params, kept in _left_frozen(freezer.model, freezer._earlier) if not kept for p in params]
    seed_origins(freezer, freezer.optimizer, freezer._origin, left)


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
    """Put the parameters :func:`take_over` made trainable that ``optimizer`` does not hold into it, each into its
    group in ``origin`` (:func:`seed_origins`, which the Freezer's checks already had, records any still missing)."""
    seed_origins(freezer, optimizer, origin, freezer._taken_back)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for p, _, _ in freezer._taken_back:
        if p.requires_grad and id(p) not in held:
            add_to_optimizer(optimizer, [p], origin[id(p)])
            held.add(id(p))


def _train_again(p: nn.Parameter) -> None:
    """``p``, frozen by an earlier Freezer, trains again (and no longer carries that Freezer's mark)."""
    p.requires_grad_(True)
    if hasattr(p, FROZEN_MARK):
        delattr(p, FROZEN_MARK)


def take_over(freezer: Freezer) -> None:
    """Give ``freezer`` what earlier Freezers on its model left frozen (module docstring), once its strategy's start
    stage has run; warn naming the blocks that train again.

    Every block of ``freezer``'s model that an earlier Freezer froze is let go of (:func:`_release`). Of its
    parameters, those the user had frozen before that Freezer (told by name, so that a deep copy's are too) stay as
    they are; the others are no longer taken as the user's (a thaw by ``freezer`` trains them) and keep their earlier
    param group (:func:`put_into`), and those ``freezer``'s start stage did not freeze again train again.
    """
    kept = {id(p) for b in freezer.blocks if freezer.frozen[b.index]
            for p in frozen_parameters(b, freezer.train_bn)}
    taken: list[nn.Parameter] = []
    users: list[str] = []
    for other, block, params, as_users in list(_left_frozen(freezer.model, freezer._earlier)):
        _release(other, block, freezer.model)
        if as_users:
            frozen = [p for p in params if _keep_as_users(p)]
            freezer._frozen_before.update(id(p) for p in frozen)
            if frozen:
                users.append(block.name)
            continue
        for p in params:
            freezer._frozen_before.discard(id(p))
            freezer._taken_back.append((p, other.optimizer, other._origin.get(id(p))))
            if id(p) not in kept and not p.requires_grad:
                _train_again(p)
                taken.append(p)
    freezer.eval_frozen()  # the modules released took the model's mode: its own frozen blocks back in eval mode
    if freezer.optimizer is not None:
        put_into(freezer, freezer.optimizer, freezer._origin)
    _warn_kept(users, stacklevel=3)
    if taken:
        ids = {id(p) for p in taken}
        names = [b.name for b in freezer.blocks if any(id(p) in ids for p in b.parameters())]
        warnings.warn(f"Freezer: block(s) {', '.join(names) or '(outside the blocks)'} were left frozen by an "
                      "earlier Freezer on this model (closed, or copied with it); they train again from this "
                      "Freezer's start, where its strategy decides anew (to keep them frozen: Freezer(..., "
                      "floor=[...]) or freezer.freeze(...))", stacklevel=3)


def release_earlier(model: nn.Module, cls: type) -> list[str]:
    """Let go of every block of ``model`` that earlier Freezers (of class ``cls``) left frozen, before an optimizer is
    built over what requires grad (see :func:`~layerfreeze.engine.freezer.release_earlier_freezers`).

    Returns:
        The names of the blocks made trainable again (warned about), in the earlier Freezers' order; those kept
        frozen as the user's (:func:`_frozen_since`) are warned about apart.

    Raises:
        ValueError: as :func:`check_earlier`.
        RuntimeError: ``model`` has an open Freezer (:func:`~layerfreeze.engine.mechanics.refuse_second_freezer`).
    """
    refuse_second_freezer(model)  # an open Freezer's blocks are its own
    released, users = [], []
    for other, block, params, kept in list(_left_frozen(model, check_earlier(model, cls))):
        _release(other, block, model)
        if kept:
            if [p for p in params if _keep_as_users(p)]:
                users.append(block.name)
            continue
        for p in params:
            if not p.requires_grad:
                _train_again(p)
        released.append(block.name)
    _warn_kept(users, stacklevel=3)
    if released:
        warnings.warn(f"Freezer: block(s) {', '.join(released)} were left frozen by an earlier Freezer on this model "
                      "(closed, or copied with it); they are trainable again before the optimizer is built, and the "
                      "next Freezer's strategy decides anew", stacklevel=3)
    return released

