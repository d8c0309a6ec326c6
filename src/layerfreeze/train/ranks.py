"""The trainer's distributed bookkeeping (DDP and FSDP2 under ``torchrun``; in one process each is a no-op or absent).

Each rank's share of every global batch (:func:`local_batches`), rank 0's buffers broadcast under FSDP2
(:func:`sync_buffers`), each rank's per-step record (:func:`rank_record`) and the bytes its collectives sent
(:func:`step_comm`, :func:`track_comm`), a DDP rebuild's event (:func:`on_rebuild`), and whether a Ctrl-C stopped
every rank at the same step (:func:`stopped_together`). Each takes the :class:`~layerfreeze.train.trainer.Trainer`
whose state it reads and keeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from layerfreeze import distributed as dist_
from layerfreeze.distributed.ddp import frozen_state_names
from layerfreeze.distributed.fsdp import broadcast_buffers, local_tensor
from layerfreeze.runs import measure
from layerfreeze.runs.rundir import Event

if TYPE_CHECKING:
    from layerfreeze.train.trainer import Trainer


def local_batches(trainer: Trainer, batches: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """This rank's share of each global batch and how many of its samples count (all of it in one process).

    Without the cache a rank takes every world-th position of the batch (DistributedSampler's interleaving).
    With the cache a sample always goes to the same rank (``index % world``): each rank caches the prefix output
    of its own samples, so from the second epoch on every sample is a hit (interleaving would move a sample to
    another rank's cache about half the time on 2 ranks); the shares then vary a little from step to step,
    which the loss weighting keeps exact. A rank whose share would be empty gets the batch's first sample with
    zero loss weight: every rank must run the step.
    """
    if not trainer.distributed:
        return batches, [len(b) for b in batches]
    shares = [share_of(trainer, b, trainer.rank) for b in batches]
    return [s or b[:1] for s, b in zip(shares, batches)], [len(s) for s in shares]


def share_of(trainer: Trainer, batch: list[int], rank: int) -> list[int]:
    """Rank ``rank``'s part of a global batch (:func:`local_batches`): ``index % world`` with the cache, every
    world-th position without it."""
    if trainer.runner is not None:
        return [i for i in batch if i % trainer.world == rank]
    return dist_.shard(batch, rank, trainer.world)


def one_sample_share(trainer: Trainer, epoch_batches: Any) -> tuple[int, int] | None:
    """The first training step (1-based) at which some rank's share of the batch holds a single sample, and that
    rank (0 in one process); None when no step does. ``epoch_batches(n, batch_size, seed, epoch)`` gives an epoch's
    batches (:func:`~layerfreeze.train.setup.epoch_batches`).

    Why: a BatchNorm layer in training mode cannot normalise one sample ("Expected more than 1 value per channel
    when training"); a last batch of one sample (``n % batch_size == 1``), or a rank's share of one under torchrun,
    stopped the run there, as a raw error, an epoch or more into it. The batches are fixed by the seed, so the
    trainer finds such a step before the first one (:func:`~layerfreeze.train.setup.setup_trainer`).
    """
    cfg = trainer.config.train
    step = 0
    for epoch in range(cfg.epochs):
        for batch in epoch_batches(len(trainer.train_set), cfg.batch_size, cfg.seed, epoch):
            step += 1
            if step > trainer.total_steps:
                return None
            if not trainer.distributed:
                sizes = [len(batch)]
            else:  # an empty share runs the batch's first sample (local_batches)
                sizes = [len(share_of(trainer, batch, r)) or 1 for r in range(trainer.world)]
            if 1 in sizes:
                return step, sizes.index(1)
    return None


def stopped_together(trainer: Trainer) -> bool:
    """True after a Ctrl-C that every rank agreed on (all stopped after the same step and checkpointed), or
    any Ctrl-C on one process: then no rank is left inside a collective."""
    return trainer._stop_agreed if trainer.distributed else True


def sync_buffers(trainer: Trainer) -> None:
    """FSDP2: rank 0's buffers on every rank (what DDP's ``broadcast_buffers`` does before each forward), except
    the buffers of frozen blocks (unless ``freeze.train_bn``: then their BatchNorm statistics still change), the
    same set DDP leaves out (:func:`~layerfreeze.distributed.frozen_state_names`); those once, at the forward after
    the frozen set changed. A collective."""
    frozen = tuple(trainer.freezer.frozen)
    if frozen != trainer._synced_for:
        skip = set(frozen_state_names(trainer.model, trainer.freezer))
        trainer._sync_list = [b for n, b in trainer.model.named_buffers() if n not in skip]
        trainer._synced_for = frozen
        # the frozen blocks' buffers once more, as they leave the broadcasts (each rank's last forward updated them
        # with its own share): the same call DDP's rebuild makes
        dist_.sync_frozen_buffers(trainer.model, trainer.freezer)
    broadcast_buffers(trainer._sync_list)


def rank_record(trainer: Trainer) -> dict[str, Any]:
    """This rank's fields of its per-step record (``ranks/rankN/metrics.jsonl`` in a distributed run):
    ``rank``; ``peak_memory_bytes`` (this process: the CUDA allocator's peak on a GPU, peak RSS on the CPU);
    ``param_bytes`` and ``trainable_param_bytes`` (the parameters this rank holds: its shards under FSDP2, the
    whole model under DDP); ``optimizer_state_bytes`` (the optimizer state it holds, sharded like its
    parameters under FSDP2); then the fields of every ``trainer.rank_fields`` callable. The step loop adds the
    bytes of the step's collectives (``grad_bytes_allreduced``, or ``all_gather_bytes`` and
    ``reduce_scatter_bytes``)."""
    params = [local_tensor(p) for p in trainer.model.parameters()]
    trainable = [local_tensor(p) for p in trainer.model.parameters() if p.requires_grad]
    state = [local_tensor(v) for st in trainer.optimizer.state.values() for v in st.values()
             if isinstance(v, torch.Tensor)]
    record = {"rank": trainer.rank, "peak_memory_bytes": measure.peak_memory_bytes(trainer.device),
              "param_bytes": sum(t.numel() * t.element_size() for t in params),
              "trainable_param_bytes": sum(t.numel() * t.element_size() for t in trainable),
              "optimizer_state_bytes": sum(t.numel() * t.element_size() for t in state)}
    for fields in trainer.rank_fields:
        record.update(fields(trainer))
    return record


def step_comm(trainer: Trainer) -> dict[str, Any]:
    """The bytes the last step's collectives sent, for its records: FSDP2's all-gathers and reduce-scatters, DDP's
    all-reduced gradient bytes, with the world size; nothing in one process."""
    if trainer.fsdp:
        return {"all_gather_bytes": trainer._collective_bytes["all_gather"],
                "reduce_scatter_bytes": trainer._collective_bytes["reduce_scatter"],
                "world_size": trainer.world}
    if trainer.distributed:
        return {"grad_bytes_allreduced": trainer.ddp.bytes_per_step(), "world_size": trainer.world}
    return {}


def track_comm(trainer: Trainer, nbytes: int) -> None:
    """Phases of gradient bytes all-reduced per step: a new phase whenever the per-step count changes."""
    phases = trainer.progress.setdefault("comm_phases", [])
    if not phases or phases[-1]["grad_bytes_per_step"] != nbytes:
        phases.append({"from_step": trainer.progress["step"], "grad_bytes_per_step": nbytes,
                       "frozen_blocks": len(trainer.freezer.frozen_blocks)})


def on_rebuild(trainer: Trainer, record: dict[str, Any]) -> None:
    """Telemetry of a DDP rebuild (its time counts in the step that triggered it)."""
    trainer.telemetry.log_event(Event.DDP_REBUILD, record["step"], **{k: v for k, v in record.items() if k != "step"})
