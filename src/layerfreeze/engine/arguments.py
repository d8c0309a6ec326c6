"""A :class:`~layerfreeze.engine.freezer.Freezer`'s arguments checked and resolved before it touches the model: the
model and optimizer, the strategy's name and parameters, a second Freezer on the model, what earlier Freezers left
(:func:`~layerfreeze.engine.takeover.check_earlier`), the blocks (discovered or given) and the strategy built for them.
Everything here raises before anything is frozen, hooked or claimed.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from layerfreeze.distributed import comm
from layerfreeze.distributed.fsdp import fsdp_modules
from layerfreeze.engine.guard import StabilityGuard
from layerfreeze.engine.mechanics import refuse_second_freezer
from layerfreeze.engine.optim import check_model_and_optimizer
from layerfreeze.engine.sharding import sharded
from layerfreeze.engine.takeover import check_earlier
from layerfreeze.models.blocks import Block, stack_layers, unassigned_warning
from layerfreeze.models.discovery import discover_blocks, refuse_empty_parameters
from layerfreeze.strategies import Strategy, create_strategy
from layerfreeze.strategies.registry import check_strategy_arguments


class Resolved(NamedTuple):
    """What :func:`resolve` found: the Freezer's blocks and strategy, and what it needs to know of the model."""

    blocks: list[Block]
    strategy: Strategy
    earlier: list[Any]  # earlier Freezers on the model (closed, or deep copies): what take_over takes from
    fsdp: list[nn.Module]  # the model's FSDP2 modules (empty: not sharded)
    registered: dict[str, nn.Parameter]  # a sharded model's parameters by name, read before the blocks ({} otherwise)
    layers: list[bool]  # per block, a layer of the repeated stack (stack_layers)


def resolve(model: nn.Module, optimizer: torch.optim.Optimizer | None, strategy: str | Strategy,
            strategy_params: dict[str, Any] | None, blocks: Sequence[str] | Sequence[Block] | None,
            guard: StabilityGuard | None, freezer_type: type) -> Resolved:
    """Check a Freezer's arguments and resolve its blocks and strategy (the errors: ``Freezer``'s docstring).

    ``freezer_type`` is the Freezer class (what :func:`~layerfreeze.engine.takeover.check_earlier` looks for).

    Warns:
        UserWarning: parameters outside every block (:func:`~layerfreeze.models.blocks.unassigned_warning`); a
            ``guard`` beside a strategy that anneals a block's learning rate to 0 before freezing it (FreezeOut).
    """
    check_model_and_optimizer(model, optimizer)
    check_strategy_arguments(strategy, strategy_params)
    if guard is not None and not isinstance(guard, StabilityGuard):  # a dict raised AttributeError at the first stage
        raise TypeError(f"Freezer(guard=...) must be a layerfreeze.StabilityGuard (e.g. StabilityGuard(tolerance=0.05, "
                        f"patience=1)) or None, not a {type(guard).__name__}")
    refuse_second_freezer(model)
    earlier = check_earlier(model, freezer_type)  # refuses what cannot be taken over
    fsdp = fsdp_modules(model)
    registered = dict(model.named_parameters()) if fsdp else {}
    sharded(fsdp)  # blocks, names and optimizer origins are read from the sharded parameters
    if blocks and isinstance(blocks[0], Block):  # blocks given ready-made skip discovery's check
        resolved: list[Block] = list(blocks)  # type: ignore[arg-type]
    else:
        resolved = discover_blocks(model, blocks)  # type: ignore[arg-type]
    refuse_empty_parameters(((n, p) for b in resolved for n, p in b.named_parameters()), "Freezer")
    if (unassigned := unassigned_warning(model, resolved)) is not None:
        warnings.warn(f"Freezer: {unassigned}", stacklevel=3)
    if isinstance(strategy, str):  # built and checked against the blocks here, once
        strategy = create_strategy(strategy, strategy_params, num_blocks=len(resolved))
    elif strategy_params:
        raise ValueError("strategy_params is only used with a strategy given by name")
    if guard is not None and strategy.anneals_to_zero:  # the CLI's config refuses the pair for a new run
        warnings.warn(f"Freezer: a stability guard with strategy {strategy.name!r}, which anneals a block's learning "
                      "rate to 0 before it freezes it: a guard's thaw trains the block at 0 until the strategy freezes "
                      "it again, so the guard cannot undo its freezes. Drop the guard, or pick a strategy the guard "
                      "can undo", stacklevel=3)
    return Resolved(resolved, strategy, earlier, fsdp, registered, stack_layers(resolved))


def flag(name: str, value: Any) -> bool:
    """A Freezer option that is True or False (``distributed="no"`` was True, and refused as a request for a process
    group; ``train_bn="no"`` kept BatchNorm layers of frozen blocks training)."""
    if not isinstance(value, bool):
        raise TypeError(f"Freezer({name}=...) must be True or False, not {value!r}")
    return value


def callback(on_event: Any) -> Any:
    """``on_event``, checked to be callable or None (an int raised "'int' object is not callable" from the start
    stage's first freeze)."""
    if on_event is not None and not callable(on_event):
        raise TypeError(f"Freezer(on_event=...) must be a function of one record (a dict) or None, not "
                        f"{type(on_event).__name__} {on_event!r}")
    return on_event


def lr_scheduler(scheduler: Any) -> Any:
    """``scheduler``, checked to be an LR scheduler (an object with a ``step`` method: ``torch.optim.lr_scheduler``'s,
    ``ReduceLROnPlateau``, Hugging Face's) or None: a name such as ``scheduler="cosine"`` was kept, and the first thaw
    that sets an LR failed on it far into the run."""
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise TypeError(f"Freezer(scheduler=...) must be the LR scheduler object you step (e.g. "
                        f"torch.optim.lr_scheduler.LambdaLR(optimizer, ...)) or None, not {type(scheduler).__name__} "
                        f"{scheduler!r}")
    return scheduler


def distributed_mode(distributed: Any) -> bool:
    """``Freezer(distributed=...)``: None follows the process group (on when one of more than one rank is initialized);
    True needs one (:func:`flag` for the type)."""
    if distributed is None:
        return comm.is_distributed()
    if flag("distributed", distributed) and not comm.is_distributed():
        raise RuntimeError("Freezer(distributed=True) needs an initialized torch.distributed process group of more "
                           "than one rank")
    return distributed
