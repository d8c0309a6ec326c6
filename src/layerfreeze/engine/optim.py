"""Optimizer surgery for freezing: frozen parameters out of the param groups and back, one param group per block.

Why each part matters (each is a public fault seen in other tools): a parameter left in an optimizer keeps
receiving momentum and (decoupled) weight decay updates when its gradient is zero instead of None, so "frozen"
weights drift, and its state keeps costing memory (two fp32 copies for Adam) -- so a frozen block's parameters
leave the param groups and their state is freed (:func:`remove_from_optimizer`). A thaw puts each parameter back
into the group it came from (:func:`add_to_optimizer`), so the number of param groups never changes (LR schedulers
keep working) and checkpoints load without "different number of parameter groups" errors. A learning rate per
block (discriminative LR, FreezeOut's per-block annealing) needs param groups holding only that block's
parameters, which :func:`block_param_groups` builds and :func:`exclusive_groups` checks.

Param groups are named by their index in ``optimizer.param_groups``; an *origin* maps ``id(parameter)`` to the
index of the group it belongs in (:func:`group_origin`). :class:`~layerfreeze.engine.Freezer` uses these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from layerfreeze.distributed.fsdp import fsdp_modules
from layerfreeze.models.blocks import Block


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer behind a framework's wrapper (accelerate's ``AcceleratedOptimizer``, itself a
    ``torch.optim.Optimizer`` subclass that never runs its ``__init__``; Lightning's ``LightningOptimizer``), or
    ``optimizer`` itself."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def group_origin(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """``{id(param): index of its param group}`` for every parameter now in ``optimizer``."""
    return {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}


def remove_from_optimizer(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> dict[int, int]:
    """Take ``params`` out of the optimizer's param groups and free their optimizer state.

    Why: a parameter left in a param group keeps getting momentum and weight-decay updates, and its state (Adam's
    two moments) keeps its memory.

    Returns:
        ``{id(param): index of the param group it was in}`` for the parameters that were in the optimizer.
    """
    ids = {id(p) for p in params}
    origin: dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        kept = []
        for p in group["params"]:
            if id(p) in ids:
                origin[id(p)] = gi
                optimizer.state.pop(p, None)
            else:
                kept.append(p)
        group["params"] = kept
    return origin


def add_to_optimizer(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter], group_index: int) -> None:
    """Append ``params`` to param group ``group_index`` (no-op for parameters already in the optimizer)."""
    present = {id(p) for g in optimizer.param_groups for p in g["params"]}
    group = optimizer.param_groups[group_index]
    group["params"].extend(p for p in params if id(p) not in present)


def block_param_groups(
    model: nn.Module,
    blocks: Sequence[Block],
    lr: float,
    weight_decay: float = 0.0,
    lr_decay: float = 1.0,
    no_decay: Callable[[str, nn.Parameter], bool] | None = None,
) -> list[dict[str, Any]]:
    """Optimizer param groups with one group per block (two if ``no_decay`` splits it), for discriminative LRs.

    Discriminative learning rates (Howard & Ruder, "Universal Language Model Fine-tuning for Text
    Classification", ACL 2018, sec. 3.2): block ``l`` of ``L`` gets ``lr / lr_decay ** (L - 1 - l)``, so the head
    gets ``lr`` and each earlier block ``lr_decay`` times less (ULMFiT uses 2.6). Parameters in no block go to a
    last group with ``lr``.

    Args:
        model: The model the blocks belong to.
        blocks: Its blocks, front to back.
        lr: Learning rate of the head.
        weight_decay: Weight decay of the groups (0 for parameters selected by ``no_decay``).
        lr_decay: Factor between consecutive blocks' learning rates, ``>= 1``.
        no_decay: ``(name, param) -> bool`` selecting parameters without weight decay (e.g. biases, LayerNorm).

    Returns:
        A list for ``torch.optim.*(groups, ...)``; each group has a ``"block"`` key naming its block.

    Raises:
        ValueError: ``lr <= 0`` or ``lr_decay < 1``.
    """
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if lr_decay < 1:
        raise ValueError(f"lr_decay must be >= 1 (ULMFiT uses 2.6), got {lr_decay}")
    groups: list[dict[str, Any]] = []
    num = len(blocks)

    def add(name: str, named: list[tuple[str, nn.Parameter]], block_lr: float) -> None:
        decay = [p for n, p in named if not (no_decay and no_decay(n, p))]
        plain = [p for n, p in named if no_decay and no_decay(n, p)]
        if decay:
            groups.append({"params": decay, "lr": block_lr, "weight_decay": weight_decay, "block": name})
        if plain:
            groups.append({"params": plain, "lr": block_lr, "weight_decay": 0.0, "block": name})

    for block in blocks:
        add(block.name, list(block.named_parameters()), lr / lr_decay ** (num - 1 - block.index))
    owned = {id(p) for b in blocks for p in b.parameters()}
    add("(unassigned)", [(n, p) for n, p in model.named_parameters() if id(p) not in owned], lr)
    return groups


#: The per-group learning rates a scheduler keeps beside ``lr`` and ``initial_lr``: OneCycleLR's ``max_lr`` and
#: ``min_lr`` (it schedules from them, not from ``base_lrs``), CyclicLR's ``max_lr`` (its base is ``base_lrs``).
SCHEDULED_KEYS = ("max_lr", "min_lr")


def _schedulers(scheduler: Any) -> Any:
    """``scheduler`` and, for a ``SequentialLR`` / ``ChainedScheduler``, the schedulers it runs (recursively), each
    once; nothing for None."""
    seen: set[int] = set()
    todo = [scheduler] if scheduler is not None else []
    while todo:
        each = todo.pop()
        if id(each) not in seen:
            seen.add(id(each))
            yield each
            todo.extend(getattr(each, "_schedulers", None) or [])


def set_group_lr(optimizer: torch.optim.Optimizer, group_index: int, lr: float, scheduler: Any = None,
                 base: float | None = None, current: float | None = None) -> None:
    """Give param group ``group_index`` the base learning rate ``lr``: its schedule scaled by ``lr / base``.

    Every learning rate of the group is scaled by that ratio: the LR of the next step (``current``, default the
    group's ``lr``: the schedule's factor at this step is kept, so a thaw during warmup or decay does not take one
    step at the unscheduled base), ``initial_lr``, OneCycleLR's / CyclicLR's ``max_lr`` and ``min_lr``, and the
    scheduler's ``base_lrs`` and ``max_lrs`` entries, and those of the schedulers a ``SequentialLR`` or
    ``ChainedScheduler`` runs (it has none of its own: a warm-up then decay set the LR back at its next step).
    ``base`` is the group's base LR before (default: its ``initial_lr``, else ``current``); when it is 0 the group's
    LRs are set to ``lr`` instead.
    """
    schedulers = list(_schedulers(scheduler))
    group = optimizer.param_groups[group_index]
    now = group["lr"] if current is None else current
    old = group.get("initial_lr", now) if base is None else base
    if not old:
        group["lr"] = lr
        if "initial_lr" in group:
            group["initial_lr"] = lr
        for each in schedulers:
            if isinstance(getattr(each, "base_lrs", None), list) and group_index < len(each.base_lrs):
                each.base_lrs[group_index] = lr
        return
    ratio = lr / old

    def scaled(value: float) -> float:  # exactly lr where it was the base (no rounding of lr / old * old)
        return lr if value == old else value * ratio

    group["lr"] = scaled(now)
    for key in ("initial_lr", *SCHEDULED_KEYS):
        if key in group:
            group[key] = scaled(group[key])
    for each in schedulers:
        for name in ("base_lrs", "max_lrs"):
            values = getattr(each, name, None)
            if isinstance(values, list) and group_index < len(values):
                values[group_index] = scaled(values[group_index])


def load_param_groups(optimizer: torch.optim.Optimizer, saved: Sequence[Sequence[str]],
                      params: Mapping[str, nn.Parameter]) -> None:
    """Make param group ``gi`` hold the parameters named ``saved[gi]`` (``params`` maps names to parameters) and
    clear the optimizer state, so ``optimizer.load_state_dict`` of the saved run fits it.

    Raises:
        ValueError: ``saved`` has another number of param groups than ``optimizer``.
        KeyError: a saved name is not in ``params``.
    """
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"Checkpoint optimizer has {len(saved)} param groups, this one has {len(optimizer.param_groups)}; "
            "build the optimizer the same way as the saved run"
        )
    for group, names in zip(optimizer.param_groups, saved):
        group["params"] = [params[n] for n in names]
    optimizer.state.clear()


def block_groups(origin: Mapping[int, int], block: Block, params: Iterable[nn.Parameter] | None = None) -> list[int]:
    """The indices of the param groups ``block``'s parameters (``params`` when given: a list of them already made,
    e.g. :class:`~layerfreeze.engine.params.BlockParams`'s) belong in (per ``origin``), ascending."""
    return sorted({origin[id(p)] for p in (block.parameters() if params is None else params) if id(p) in origin})


def exclusive_groups(
    optimizer: torch.optim.Optimizer, origin: Mapping[int, int], block: Block, purpose: str
) -> list[int]:
    """The param groups of ``block`` (:func:`block_groups`), checked to hold no other block's parameters.

    Raises:
        ValueError: a group also holds other parameters; the message says what ``purpose`` needed and to build the
            optimizer from :func:`block_param_groups`.
    """
    own = {id(p) for p in block.parameters()}
    indices = block_groups(origin, block)
    for gi in indices:
        if any(id(p) not in own for p in optimizer.param_groups[gi]["params"]):
            raise ValueError(
                f"Cannot give block {block.name!r} {purpose}: param group {gi} also holds other blocks' "
                "parameters. Build the optimizer from layerfreeze.block_param_groups(...) (one group per block)."
            )
    return indices


def scale_group_lrs(
    optimizer: torch.optim.Optimizer, scales: Mapping[int, float], written: dict[int, tuple[float, float]],
    relative: bool = False,
) -> None:
    """Multiply param group ``gi``'s scheduled LR by ``scales[gi]`` (after the scheduler has set this step's LR).

    ``written`` maps a group to ``(unscaled LR, LR written here last time)`` and is updated. A group whose LR is
    still the value written last time has not been rescheduled (no scheduler, or the scheduler only runs per
    epoch), so the factor is applied to the remembered unscaled LR, not compounded. Schedulers that derive the next
    LR from the current one (StepLR, ExponentialLR) compound the factor when they step where the Freezer's scaled LR
    is in the group (between ``freezer.step()`` and the next ``after_backward()`` or ``epoch_end()``); stepped after
    the optimizer step or ``epoch_end()`` they find the unscaled LR (:func:`~layerfreeze.engine.steps.rest_lrs`,
    :func:`~layerfreeze.engine.lr_factors.restore_unscaled`). ``relative``: the scheduler
    multiplies the LR it finds (ReduceLROnPlateau), so a rescheduled LR found where the scaled one was written is the
    unscaled one times the scheduler's change.
    """
    for gi, scale in scales.items():
        group = optimizer.param_groups[gi]
        unscaled, last = written.get(gi, (None, None))
        if last is None or group["lr"] != last:
            # a plateau reduction of the scaled LR written at the last step: the factor came with it, once more
            multiplied = relative and unscaled is not None and last and last != unscaled
            unscaled = unscaled * (group["lr"] / last) if multiplied else group["lr"]
        group["lr"] = unscaled * scale
        written[gi] = (unscaled, group["lr"])


def base_lr(optimizer: torch.optim.Optimizer, groups: Sequence[int],
            written: Mapping[int, tuple[float, float]]) -> float | None:
    """The LR of the first of ``groups`` before any scaling: its ``initial_lr`` (set by a scheduler), else the
    unscaled LR remembered in ``written`` (:func:`scale_group_lrs`), else its ``lr``; None without groups."""
    if not groups:
        return None
    group = optimizer.param_groups[groups[0]]
    unscaled = written.get(groups[0], (None,))[0]
    return group.get("initial_lr", unscaled or group["lr"])


def check_model_and_optimizer(model: Any, optimizer: Any) -> None:
    """What ``Freezer(model, optimizer)`` was given is a model and an optimizer of that model.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``optimizer`` (when not None) has no ``param_groups``.
        ValueError: the optimizer holds parameters and none is the model's (one built for another model or a copy:
            freezing would remove nothing from it, and the model would not train). A model sharded with FSDP2 is
            checked by :func:`~layerfreeze.distributed.fsdp.check_optimizer_holds_sharded_parameters` instead.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"Freezer needs the model (a torch.nn.Module) first, not a {type(model).__name__}")
    if optimizer is None:
        return
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(f"Freezer's optimizer must be a torch.optim.Optimizer (or None), not a "
                        f"{type(optimizer).__name__}")
    if fsdp_modules(model):
        return
    held = [p for group in optimizer.param_groups for p in group["params"]]
    mine = {id(p) for p in model.parameters()}
    if held and mine and not any(id(p) in mine for p in held):
        raise ValueError(f"the optimizer holds {len(held)} parameter tensors and none is this model's (was it built "
                         "for another model, or before a copy or .to() that replaced them?): build it from this "
                         "model, e.g. torch.optim.AdamW(block_param_groups(model, discover_blocks(model)))")
