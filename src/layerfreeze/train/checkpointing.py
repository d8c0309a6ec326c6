"""The trainer's checkpoints: when one is due, writing one, and resuming a run from the newest.

A checkpoint (:class:`~layerfreeze.checkpoint.CheckpointStore`) holds the model, the optimizer, the Freezer, the LR
schedule and the run's ``progress`` (step, FLOPs, times, the epoch's sums so far, the cache's lookup counters, the
ledger's peaks), the config, the world size and, distributed, every rank's RNG state. Under FSDP2 it is a full one
(every weight gathered on rank 0), read back re-sharded. Each function takes the
:class:`~layerfreeze.train.trainer.Trainer` whose state it saves or restores.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from layerfreeze import distributed as dist_
from layerfreeze.checkpoint import CheckpointStore, load_checkpoint, load_full_checkpoint, rng_state, set_rng_state
from layerfreeze.errors import ConfigError
from layerfreeze.runs import measure, rundir
from layerfreeze.runs.rundir import Event

if TYPE_CHECKING:
    from layerfreeze.train.trainer import Trainer


def checkpoint_due(trainer: Trainer) -> bool:
    """A periodic checkpoint is due after this step: every ``run.checkpoint_every_steps`` steps, or when
    ``run.checkpoint_every_minutes`` have passed since the last one (distributed: rank 0's clock decides)."""
    run = trainer.config.run
    if not run.checkpoint:
        return False
    every = run.checkpoint_every_steps
    if every and (trainer.progress["step"] + 1) % every == 0:
        return True
    minutes = run.checkpoint_every_minutes
    return bool(minutes) and time.monotonic() - trainer._last_checkpoint_time >= 60 * minutes


def cache_counts(trainer: Trainer) -> dict[str, float]:
    """The cache's lookup counters over the whole run: those saved in the checkpoint a resumed run started from,
    plus this process's (whose cache started cold). Work a killed process did after its last checkpoint is
    replayed, so it is not counted twice."""
    return {} if trainer.runner is None else trainer.runner.run_counts(getattr(trainer, "_cache_base", {}))


def peak_memory(trainer: Trainer) -> int:
    """The run's peak memory (:func:`~layerfreeze.runs.measure.peak_memory_bytes`) over every process that trained
    it: the peak saved in the checkpoint a resumed run started from, or this process's, whichever is larger. A
    resumed run's summary (and compare's ``peak mem``) covered only the last process: a run killed after an
    unfrozen phase showed the frozen phase's peak as the run's, while its tensor peak covered the whole run."""
    return max(int(trainer.progress.get("peak_memory_bytes") or 0), measure.peak_memory_bytes(trainer.device))


def write_checkpoint(trainer: Trainer, epoch: int, batch_in_epoch: int, reason: str) -> Path | None:
    """Write a checkpoint into the run's store (rank 0; collective when distributed: every rank's RNG state
    goes into it). Its time is reported (``checkpoint_s`` in the event, ``checkpoint_time_s`` in the summary)."""
    if not trainer.config.run.checkpoint:
        return None
    t0 = time.perf_counter()
    trainer.freezer.verify_frozen_weights()  # never checkpoint weights that moved while frozen
    trainer.progress["cache_counts"] = cache_counts(trainer)
    trainer.progress["peak_memory_bytes"] = peak_memory(trainer)
    trainer.progress["precision"] = trainer.precision.state_dict()
    if trainer.ledger is not None:
        trainer.progress["ledger"] = trainer.ledger.peaks.state_dict()
    if trainer.distributed and trainer.ledger is not None:  # each rank's ledger peaks (its shards under FSDP2)
        trainer.progress["ledger_ranks"] = dist_.all_gather_object(trainer.ledger.peaks.state_dict())
    extra = {"epoch": epoch, "batch_in_epoch": batch_in_epoch, "progress": dict(trainer.progress),
             "config": trainer.config.model_dump(mode="json"), "world_size": trainer.world,
             "data": data_shape(trainer)}
    if trainer.distributed:
        extra["rng_ranks"] = dist_.all_gather_object(rng_state())
    path = None
    if trainer.fsdp:  # every weight and the by-name optimizer state, gathered on rank 0 (collective)
        path = trainer.store.save_full(trainer.progress["step"], trainer.model, trainer.optimizer, trainer.freezer,
                                       trainer.scheduler, extra=extra)
    elif trainer.is_main:
        path = trainer.store.save(trainer.progress["step"], trainer.model, trainer.optimizer, trainer.freezer,
                                  trainer.scheduler, extra=extra, verify=False)  # verified above, on every rank
    if trainer.distributed:
        torch.distributed.barrier()  # nobody goes on (or exits) before the checkpoint is complete
    seconds = time.perf_counter() - t0
    trainer.progress["checkpoints"] = trainer.progress.get("checkpoints", 0) + 1
    trainer.progress["checkpoint_time_s"] = trainer.progress.get("checkpoint_time_s", 0.0) + seconds
    trainer._last_checkpoint_time = time.monotonic()
    trainer.telemetry.log_event(Event.CHECKPOINT, trainer.progress["step"], epoch=epoch,
                                batch_in_epoch=batch_in_epoch, reason=reason, path=str(path), checkpoint_s=seconds)
    return path


def resume(trainer: Trainer, path: Path) -> tuple[int, int]:
    """Load the newest complete checkpoint of run folder ``path`` (or the checkpoint folder ``path``); a run
    stopped before its first checkpoint starts again from the beginning, with a message.

    Returns:
        ``(epoch, batch_in_epoch)`` to continue from.
    """
    loader = load_full_checkpoint if trainer.fsdp else load_checkpoint  # FSDP2: re-sharded on every rank
    try:
        if (path / "state.pt").is_file() and not (path / rundir.CHECKPOINT_LINK).exists():
            ckpt, extra = path, loader(path, trainer.model, trainer.optimizer, trainer.freezer, trainer.scheduler)
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ckpt, extra = CheckpointStore(path, trainer.config.run.keep_checkpoints).load_latest(
                    trainer.model, trainer.optimizer, trainer.freezer, trainer.scheduler, loader=loader)
            for w in caught:
                if trainer.is_main:
                    tqdm.write(f"resume: {w.message}")
                trainer.telemetry.log_event(Event.CHECKPOINT_SKIPPED, 0, reason=str(w.message))
    except FileNotFoundError:
        if trainer.is_main:
            tqdm.write(f"resume: {path} has no checkpoint yet (the run stopped before its first one): "
                       "starting it again from the beginning")
        trainer.telemetry.purge_from(0)  # a restart from the beginning: everything is redone
        trainer.telemetry.log_event(Event.RESUMED, 0, epoch=0, path=None, from_start=True)
        trainer.rank_telemetry.log_event(Event.RESUMED, 0, epoch=0, path=None, from_start=True)
        return 0, 0
    saved_data, data = extra.get("data"), data_shape(trainer)
    if saved_data is not None and saved_data != data:  # its batches, positions and cache keys belong to that data
        changed = ", ".join(f"{k} {saved_data.get(k)} then, {v} now" for k, v in data.items() if saved_data.get(k) != v)
        raise ConfigError(f"--resume {path}: the data changed since the checkpoint ({changed}); a resumed run needs "
                          "the data it was trained on: restore it, or start a new run")
    saved_precision, precision = (extra["progress"].get("precision") or {}).get("name"), trainer.precision.name
    frozen = trainer.freezer.frozen_blocks
    if frozen and saved_precision not in (None, precision) and "bf16-true" in (saved_precision, precision):
        raise ConfigError(  # the checksums of the frozen blocks are of the weights in the dtype they froze in
            f"--resume {path}: the checkpoint was trained under train.precision {saved_precision} and has frozen "
            f"blocks ({', '.join(frozen[:3])}{', ...' if len(frozen) > 3 else ''}); {precision} would "
            f"cast their weights, which stay as they froze: resume with --precision {saved_precision}, or start a "
            "new run")
    if saved_precision not in (None, precision) and "16-mixed" in (saved_precision, precision):
        raise ConfigError(  # its optimizer steps fused, with the scaler's scale: a param group's "fused" is saved
            f"--resume {path}: the checkpoint was trained under train.precision {saved_precision}; 16-mixed steps "
            "the optimizer with a loss scaler (fused where it can), and the optimizer state of one does not carry "
            f"over to the other: resume with --precision {saved_precision}, or start a new run")
    done, end = int(extra["progress"]["step"]), trainer.total_steps
    if done > end:  # nothing would train, and the summary would say the run ended at this config's end
        train = trainer.config.train
        raise ConfigError(f"--resume {path}: the run is at step {done}, past this config's end at step {end} "
                          f"(train.epochs {train.epochs}, train.max_steps {train.max_steps}); resume with a larger "
                          "--epochs / --max-steps, or without them to go on to the run's own end")
    reschedule(trainer)
    rngs = extra.get("rng_ranks")
    if trainer.distributed and rngs is not None and len(rngs) == trainer.world:
        set_rng_state(rngs[trainer.rank])  # each rank continues its own dropout stream
    saved_world = extra.get("world_size", 1)
    trainer.progress.update(extra["progress"])
    trainer.telemetry.purge_from(trainer.progress["step"] + 1)  # the steps after the checkpoint are redone
    trainer.telemetry.log_event(Event.RESUMED, trainer.progress["step"], epoch=extra["epoch"], path=str(ckpt),
                                world_size=trainer.world, saved_world_size=saved_world)
    trainer.rank_telemetry.log_event(Event.RESUMED, trainer.progress["step"], epoch=extra["epoch"], path=str(ckpt))
    trainer.resumed_from_step = int(trainer.progress["step"])
    if trainer.is_main:
        tqdm.write(f"resumed from {ckpt} (step {trainer.resumed_from_step}, epoch {extra['epoch'] + 1})")
    if saved_world != trainer.world and trainer.is_main:
        tqdm.write(f"resuming a run saved on {saved_world} rank(s) on {trainer.world}: same global batches and "
                   "frozen set, but the per-rank random streams (dropout) differ from the interrupted run")
    return extra["epoch"], extra["batch_in_epoch"]


def reschedule(trainer: Trainer) -> None:
    """After a resume: the next step's learning rates from this run's schedule, not the saved run's.

    A resume with another ``--epochs`` / ``--max-steps`` builds the schedule for the new length, but the optimizer's
    groups hold the LRs the old plan set for the next step (they are part of its state), and a ``LambdaLR`` computes
    its own only at its next ``step()``: the first resumed step ran at the old plan's LR (at LR 0 for a run resumed past
    its old end, which then changed nothing). Each group's LR is set to ``base_lr * lambda(last_epoch)``, and the
    strategy's LR factors, computed for the old length too, are computed again for the new one
    (:meth:`~layerfreeze.engine.Freezer.replan`); a resume onto the same schedule finds the LRs it would set and
    changes nothing."""
    scheduler, optimizer = trainer.scheduler, trainer.optimizer
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    if lrs == list(scheduler.get_last_lr()):
        return
    scheduler._last_lr = lrs  # what get_last_lr() reports for this step
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    trainer.freezer.replan()


def data_shape(trainer: Trainer) -> dict[str, int]:
    """What a checkpoint records of its data, to refuse a resume on other data: the training and test sets' sizes
    (after the split and the limits) and the number of classes."""
    return {"train samples": len(trainer.train_set), "test samples": len(trainer.task.test_set),
            "classes": int(trainer.task.num_classes)}


def restore_totals(trainer: Trainer) -> None:
    """What a resumed run goes on counting from (its ``progress``, after :func:`resume`; nothing on a fresh run):
    the cache's lookup counters (:func:`cache_counts`) and the memory ledger's peaks, each rank its own."""
    trainer._cache_base = dict(trainer.progress.get("cache_counts") or {})
    if trainer.progress.get("precision"):  # the loss scale of 16-mixed goes on where it was
        changed = trainer.precision.load_state_dict(trainer.progress["precision"])
        if changed and trainer.is_main:
            tqdm.write(f"resume: {changed}")
    if trainer.ledger is not None and trainer.progress.get("ledger"):  # a resumed run's peaks cover the whole run
        per_rank = trainer.progress.get("ledger_ranks") or []
        own = (per_rank[trainer.rank] if trainer.distributed and len(per_rank) == trainer.world
               else trainer.progress["ledger"])
        trainer.ledger.peaks.load_state_dict(own)  # each rank its own (FSDP2: its shards' bytes)
