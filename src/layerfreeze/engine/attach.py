"""An optimizer given to a Freezer after it was built (:meth:`~layerfreeze.engine.freezer.Freezer.attach_optimizer`):
what a framework does when it creates the optimizer after the initial freeze (Lightning's ``configure_optimizers``
runs after ``setup``; the HF Trainer's ``create_optimizer``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from layerfreeze.distributed.fsdp import check_optimizer_holds_sharded_parameters
from layerfreeze.engine.lr_factors import apply_lr_scales, check_lr_scales, check_thaw_lrs, keep_plateau_base
from layerfreeze.engine.mechanics import frozen_parameters, not_optimized
from layerfreeze.engine.optim import group_origin, remove_from_optimizer
from layerfreeze.engine.sharding import sharded
from layerfreeze.engine.takeover import put_into, seed_origins

if TYPE_CHECKING:
    from layerfreeze.engine.freezer import Freezer


def attach_optimizer(freezer: Freezer, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    """Take the frozen blocks' parameters out of ``optimizer`` (no state, no update), check the learning-rate factors
    and thaw learning rates the strategy needs against its param groups, then hand it (and ``scheduler``, when given)
    to ``freezer`` and apply the factors. Checked before anything of ``freezer`` changes: on a refusal ``optimizer``
    holds what it held (its param groups and state as given) and ``freezer`` keeps the optimizer it had.

    Raises:
        ValueError: from :func:`~layerfreeze.engine.lr_factors.check_lr_scales` /
            :func:`~layerfreeze.engine.lr_factors.check_thaw_lrs` (a factor or a thaw's LR on a block whose param group
            holds other blocks too), or an FSDP2 model's parameters the optimizer does not hold as shards.
    """
    registered = dict(freezer.model.named_parameters()) if freezer._fsdp else {}
    sharded(freezer._fsdp)
    check_optimizer_holds_sharded_parameters(freezer.model, optimizer, registered)
    origin = group_origin(optimizer)
    seed_origins(freezer, optimizer, origin, freezer._taken_back)  # what an earlier Freezer left frozen: its groups
    groups = [list(g["params"]) for g in optimizer.param_groups]
    frozen = [p for b in freezer.blocks if freezer.frozen[b.index] for p in frozen_parameters(b, freezer.train_bn)]
    state = {p: optimizer.state[p] for p in frozen if p in optimizer.state}
    remove_from_optimizer(optimizer, frozen)
    try:
        check_lr_scales(optimizer, origin, freezer.blocks, freezer._lr_scale)
        check_thaw_lrs(optimizer, origin, freezer.blocks, freezer.strategy)
    except BaseException:
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params
        optimizer.state.update(state)
        raise
    freezer.optimizer = optimizer
    if scheduler is not None:
        freezer.scheduler = scheduler
    keep_plateau_base(optimizer, freezer.scheduler)
    put_into(freezer, optimizer, origin)  # what an earlier Freezer left frozen and this one took back
    freezer._origin = origin
    freezer._not_optimized = not_optimized(freezer.model, origin)
    freezer._lr_written = {}
    apply_lr_scales(optimizer, freezer.blocks, origin, freezer._lr_scale, freezer._lr_written)
