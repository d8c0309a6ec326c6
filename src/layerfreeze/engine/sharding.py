"""The Freezer's FSDP2 wiring: resharding before it touches parameters, checks that it holds the sharded ones, and
the unsharded mirror rank 0's strategy observes.

Under FSDP2 (``fully_shard``, :mod:`layerfreeze.distributed.fsdp`) every rank holds one shard of each parameter (a
DTensor). The Freezer reads blocks, names and optimizer origins from those sharded parameters, so it reshards a group
an evaluation pass left unsharded before any freeze, thaw, step or checksum (:func:`sharded`), refuses blocks and
optimizers that hold stand-ins for them (:func:`check_parameters`), and gives a strategy that reads the model's
weights an unsharded copy kept equal to the sharded model (:func:`make_mirror`,
:class:`~layerfreeze.distributed.fsdp.Mirror`). Everything here is a no-op on a model that is not sharded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from layerfreeze.distributed import comm
from layerfreeze.distributed.fsdp import (
    Mirror,
    check_blocks_hold_model_parameters,
    check_optimizer_holds_sharded_parameters,
    reshard_all,
)
from layerfreeze.models.blocks import Block
from layerfreeze.strategies import Strategy


def sharded(fsdp: Sequence[nn.Module]) -> None:
    """Register the sharded parameters on every FSDP2 module of the model again (``fsdp``: the Freezer's
    :func:`~layerfreeze.distributed.fsdp.fsdp_modules`), when a group kept its unsharded ones after a forward with no
    backward (an evaluation pass under ``no_grad``; the root group does not reshard after forward). Until then a
    block's parameters, read through its modules, are FSDP's all-gather buffers: freezing or thawing them would be
    undone by the next all-gather, they would enter the optimizer, and a checksum's ``.numpy()`` would pin their
    storage so FSDP's next reshard fails. No-op unsharded."""
    if fsdp:
        reshard_all(fsdp)


def check_parameters(model: nn.Module, blocks: Sequence[Block], optimizer: torch.optim.Optimizer | None,
                     registered: dict[str, nn.Parameter]) -> None:
    """The blocks and the optimizer hold the model's (sharded) parameters, not stand-ins (FSDP2; see
    :func:`~layerfreeze.distributed.fsdp.check_blocks_hold_model_parameters`).

    Args:
        registered: The parameters the modules held before :func:`sharded` (``{}`` unsharded).

    Raises:
        ValueError: a block or the optimizer holds tensors standing in for the model's parameters.
    """
    check_blocks_hold_model_parameters(model, blocks)
    if optimizer is not None:
        check_optimizer_holds_sharded_parameters(model, optimizer, registered)


def make_mirror(model: nn.Module, strategy: Strategy, mirror: nn.Module | None, *, fsdp: Sequence[nn.Module],
                decides: bool, distributed: bool) -> Mirror | None:
    """The :class:`~layerfreeze.distributed.fsdp.Mirror` rank 0's strategy observes, or None when the model is
    not sharded or the strategy does not observe it (:attr:`~layerfreeze.strategies.Strategy.reads_model`).
    Collective when it is made (a full refresh; under ``distributed``, whether rank 0 has one).

    Raises:
        ValueError: on every rank, when rank 0 gave no ``mirror``; on rank 0, a mirror that does not fit.
    """
    if not fsdp or not strategy.reads_model:
        return None
    missing = decides and mirror is None
    if distributed:
        missing = comm.broadcast_object(missing)
    if missing:
        raise ValueError(
            f"strategy {strategy.name!r} reads the model's weights on rank 0, and FSDP2 holds one shard of "
            "each on every rank: give rank 0's Freezer mirror=copy.deepcopy(model) taken before fully_shard / "
            "shard_blocks (an unsharded copy, ideally on the CPU), which it keeps equal to the sharded model")
    made = Mirror(model, mirror if decides else None)
    made.refresh()
    return made
