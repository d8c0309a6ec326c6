"""Data-parallel training whose frozen set changes mid-run: one decision for all ranks, a DDP wrapper rebuilt
around the trainable parameters on every change, FSDP2 sharding per block, per-rank data shards, and a lost rank
named, not a hang.

* :mod:`~layerfreeze.distributed.comm` -- the process group, small collectives, per-rank shards, the watchdog;
* :mod:`~layerfreeze.distributed.ddp` -- :class:`FreezeDDP` and :func:`rebuild_ddp` (DDP re-initialized in place
  around the trainable parameters; the Lightning/HF callbacks use the same function), :class:`GradientBytes`;
* :mod:`~layerfreeze.distributed.fsdp` -- FSDP2: :func:`shard_blocks` (one ``fully_shard`` group per block), the
  full-state helpers behind :func:`~layerfreeze.checkpoint.save_full_checkpoint`, the
  :class:`~layerfreeze.distributed.fsdp.Mirror` a weight-reading strategy observes on rank 0.

Freeze decisions are the same on every rank because only rank 0 runs the strategy and the
:class:`~layerfreeze.engine.Freezer` broadcasts each decision (:func:`~layerfreeze.engine.stages.share_decision`).
"""

from layerfreeze.distributed.comm import (
    FILE_STORE_ENV,
    RankLostError,
    RankWatchdog,
    all_gather_object,
    all_reduce_sum,
    broadcast_object,
    choose_rank_device,
    close_distributed,
    init_distributed,
    is_distributed,
    launched_world_size,
    local_device,
    loss_scale,
    rank,
    rank_device,
    shard,
    world_size,
)
from layerfreeze.distributed.ddp import (
    FreezeDDP,
    GradientBytes,
    frozen_state_names,
    rebuild_ddp,
    sync_frozen_buffers,
)
from layerfreeze.distributed.fsdp import CollectiveBytes, shard_blocks, tied_across_blocks

__all__ = [
    "FILE_STORE_ENV",
    "CollectiveBytes",
    "FreezeDDP",
    "GradientBytes",
    "RankLostError",
    "RankWatchdog",
    "all_gather_object",
    "all_reduce_sum",
    "broadcast_object",
    "choose_rank_device",
    "close_distributed",
    "frozen_state_names",
    "init_distributed",
    "is_distributed",
    "launched_world_size",
    "local_device",
    "loss_scale",
    "rank",
    "rank_device",
    "rebuild_ddp",
    "shard",
    "shard_blocks",
    "sync_frozen_buffers",
    "tied_across_blocks",
    "world_size",
]
