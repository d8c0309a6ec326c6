"""The trainer's step: one optimizer step and its per-step bookkeeping, the one place where a training step happens.

:func:`train_step` is the step itself (forward, loss, backward, the Freezer's gradient stage, clip, optimizer and
LR steps; distributed: the one all-reduce of the loss, a Ctrl-C and a due checkpoint), with the loss checked before
it reaches the weights (:func:`check_finite`); in one process the loss is read once the backward is queued
(:class:`HostScalar`), the step's one host read of a device value (issue 40; ``tests/test_host_sync.py``).
:func:`timed_step` is what the epoch loop times around it: the
memory ledger's sample, the training FLOPs measured on the step itself whenever the frozen set changes, the
strategy's freezing stage, the frozen prefix's placement. :func:`record_step` counts the step and writes its records
(``metrics.jsonl``, each rank's own); :func:`check_stuck` stops a run that learns nothing. :func:`on_freeze_event`
is the Freezer's event sink: each freeze or thaw logged, and the ledger's next sample asked for, whose ``memory``
event (:func:`memory_fields`) says what the change gave back. Each function takes the
:class:`~layerfreeze.train.trainer.Trainer` whose step it runs.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from layerfreeze import distributed as dist_
from layerfreeze.distributed.fsdp import CollectiveBytes
from layerfreeze.runs import measure
from layerfreeze.runs import telemetry as tm
from layerfreeze.runs.ledger_records import memory_change, memory_change_by_device
from layerfreeze.runs.rundir import Event
from layerfreeze.train.checkpointing import checkpoint_due
from layerfreeze.train.ranks import step_comm, sync_buffers, track_comm
from layerfreeze.train.setup import place, to_device

if TYPE_CHECKING:
    from layerfreeze.train.trainer import Trainer


class DivergenceError(RuntimeError):
    """The training loss became non-finite, or sat at chance level for ``run.divergence_window_steps`` steps."""


def train_step(trainer: Trainer, batch: dict[str, torch.Tensor], global_count: int, local_count: int) -> float:
    """:meth:`Trainer.train_step <layerfreeze.train.trainer.Trainer.train_step>`: one optimizer step; returns this
    rank's loss: the batch mean in one process, the *sum* over this rank's ``local_count`` counted samples when
    distributed (the caller all-reduces it into the global mean)."""
    host_batch, batch = batch, trainer.precision.convert_input(to_device(batch, trainer.device))
    if trainer.distributed:
        counter = CollectiveBytes() if trainer.fsdp else contextlib.nullcontext()
        with counter:  # FSDP2: the bytes its all-gathers and reduce-scatters send in this forward and backward
            with trainer.precision.autocast():
                if trainer.fsdp:
                    sync_buffers(trainer)
                    logits = (trainer.runner(batch, host_batch=host_batch) if trainer.runner is not None
                              else trainer.task.forward(trainer.model, batch))
                else:
                    logits = trainer.ddp(batch)
                losses = trainer.task.objective.sample_losses(logits, batch)
                local = local_count  # 0 for a padded rank (see ranks.local_batches)
                losses = losses[:local]
                loss_sum = losses.sum()
            # one all-reduce per step, before backward: the global loss (checked below), a Ctrl-C on any rank, a
            # periodic checkpoint due by rank 0's clock, so every rank stops or checkpoints at the same step
            total, stops, due = dist_.all_reduce_sum(
                [float(loss_sum.detach()), float(trainer._stop_requested),
                 float(checkpoint_due(trainer) and trainer.is_main)])
            trainer._stop_agreed, trainer._due = stops > 0, due > 0
            value = total / global_count
            check_finite(trainer, value)
            # FSDP2's reduce-scatter averages the gradients over the ranks as DDP's all-reduce does
            trainer.precision.backward(loss_sum * dist_.loss_scale(local, global_count))
        if trainer.fsdp:
            trainer._collective_bytes = dict(counter.bytes)
    else:
        with trainer.precision.autocast():
            logits = (trainer.runner(batch, host_batch=host_batch) if trainer.runner is not None
                      else trainer.task.forward(trainer.model, batch))
            loss = trainer.task.loss(logits, batch)
        reading = HostScalar(loss)  # queued behind the forward; read once the backward is queued too
        trainer._due = checkpoint_due(trainer)
        trainer.precision.backward(loss)
        value = reading.value()
        check_finite(trainer, value)  # before the optimizer step: a non-finite loss still never reaches the weights
    trainer.freezer.after_backward()
    params = [p for g in trainer.optimizer.param_groups for p in g["params"] if p.grad is not None]
    trainer.precision.step(trainer.optimizer, trainer.scheduler, trainer.config.train.grad_clip, params)
    return value


class HostScalar:
    """A device scalar's value on the host, copied without stalling the device's queue: the one loss value per step the
    trainer logs (issue 40: it budgets that read, and no other, on a step without a stage).

    Made right after the forward: on a device other than the CPU the value is copied ``non_blocking`` into a host
    buffer (pinned memory on CUDA, with an event recorded after the copy). :meth:`value` is called after the backward
    has been queued: it waits for the event, i.e. for the forward only, while the backward keeps the device busy; the
    host then queues the optimizer step without the device's queue having drained. Reading ``float(loss)`` before
    ``backward()`` instead waits for the forward with nothing queued behind it, and the device idles while the host
    queues the backward. On the CPU it is a plain read.
    """

    def __init__(self, t: torch.Tensor) -> None:
        t = t.detach()
        self._event = None
        if t.device.type == "cpu":
            self._host = t
            return
        cuda = t.device.type == "cuda"
        self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        self._host.copy_(t, non_blocking=True)
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(t.device))

    def value(self) -> float:
        """The value (waits for the copy on CUDA: for the work queued before it, not after)."""
        if self._event is not None:
            self._event.synchronize()
        return float(self._host)


def check_finite(trainer: Trainer, loss: float) -> None:
    """Stop before a non-finite loss reaches the weights (the run's checkpoint then holds the last good ones).

    Raises:
        DivergenceError: the (global) loss is NaN or infinite.
    """
    if not math.isfinite(loss):
        raise DivergenceError(f"the training loss is {loss} at step {trainer.progress['step'] + 1}: the run "
                              "diverged. Lower train.lr or set train.grad_clip, then resume from the checkpoint")


def timed_step(trainer: Trainer, batch: dict[str, torch.Tensor], global_count: int, local_count: int,
               epoch: int) -> tuple[float, float, Any]:
    """One step of the epoch loop, timed: :meth:`Trainer.train_step <layerfreeze.train.trainer.Trainer.train_step>`
    inside the memory ledger's step, its training FLOPs measured with ``FlopCounterMode`` whenever the frozen set
    (with the cache: or the epoch) changed since the last measurement (a ``flops_remeasured`` event), then the
    strategy's freezing stage (timed: a strategy's own cost counts against it) and the frozen prefix's placement.

    Returns:
        ``(loss, step_time_s, decision)``: the step's loss (see ``train_step``), its seconds, the stage's decision.
    """
    # with the cache, whether the prefix runs depends on the epoch (cold, then warm): measure per epoch
    key = (tuple(trainer.freezer.frozen), epoch if trainer.runner is not None else None)
    remeasure = key != trainer._measured_for
    if trainer.compiled is not None:  # a changed frozen set: each region's graph for its new trainable set
        trainer.compiled.refresh(trainer.freezer.frozen)
    if trainer.prefix_clock is not None:  # the frozen prefix's forward, timed on its own
        trainer.prefix_clock.refresh(trainer.freezer.frozen_prefix)
        trainer.prefix_clock.arm()
    compiling = trainer.compiled.compile_seconds() if trainer.compiled is not None else 0.0
    trainer._step_lr = trainer.optimizer.param_groups[-1]["lr"]  # the LR this step runs at (its record's lr)
    t0 = time.perf_counter()
    with ledger_step(trainer, trainer.progress["step"] + 1):
        if remeasure:
            loss, flops = measure.measure_flops(
                functools.partial(trainer.train_step, batch, global_count, local_count))
        else:
            loss = trainer.train_step(batch, global_count, local_count)
    if remeasure:
        trainer.progress["flops_per_step"] = flops
        if trainer.progress["flops_first"] is None:
            trainer.progress["flops_first"] = flops
        trainer._measured_for = key
        trainer.telemetry.log_event(Event.FLOPS_REMEASURED, trainer.progress["step"] + 1,
                                    flops_per_step=flops, frozen_blocks=trainer.freezer.frozen_blocks)
    decision = trainer.freezer.step()  # timed: a strategy's own cost counts against it
    place(trainer)
    step_time = time.perf_counter() - t0
    if trainer.compiled is not None:  # the seconds of this step that compiled (record_step logs them)
        trainer._step_compile_s = trainer.compiled.compile_seconds() - compiling
    return loss, step_time, decision


def record_step(trainer: Trainer, loss: float, count: int, step_time: float, decision: Any) -> None:
    """Count the step (``progress``: step, FLOPs, training time) and write its records: the step record of
    ``metrics.jsonl`` (rank 0's), each rank's own (``ranks/rankN/metrics.jsonl``), both with the bytes of the step's
    collectives and, at the ledger's sampled steps, its ``memory``; the phases of the gradient bytes sent."""
    comm = step_comm(trainer)
    trainer.progress["step"] += 1
    trainer.progress["flops_total"] += trainer.progress["flops_per_step"]
    trainer.progress["train_time_s"] += step_time
    memory = memory_fields(trainer)  # this rank's ledger: rank 0's in metrics.jsonl, each rank's own
    rank_fields = {**comm, **memory}  # what both records carry
    if trainer.compiled is not None:  # graphs compiled in this step (0 once every region has its graphs)
        graphs = trainer.compiled.compiled_graphs()
        rank_fields["compiles"] = graphs - trainer._graphs_logged
        trainer._graphs_logged = graphs
        # and the seconds of the step spent compiling: train time without them is what the compiled code costs
        rank_fields["compile_s"] = trainer._step_compile_s
        trainer.progress["train_compile_s"] += trainer._step_compile_s
    prefix = trainer.prefix_clock.read() if trainer.prefix_clock is not None else None
    if prefix is not None:  # the step's time split at the frozen prefix's end (see train/prefix_clock.py)
        rank_fields.update(prefix_forward_s=prefix, suffix_s=max(step_time - prefix, 0.0))
    trainer.telemetry.log_step(
        trainer.progress["step"], loss=loss, lr=trainer._step_lr,
        step_time_s=step_time, samples_per_s=count / step_time,
        flops_per_step=trainer.progress["flops_per_step"], flops_total=trainer.progress["flops_total"],
        frozen_count=sum(trainer.freezer.frozen), frozen_prefix=trainer.freezer.frozen_prefix,
        peak_memory_bytes=measure.peak_memory_bytes(trainer.device), **tm.signals_of(decision), **rank_fields,
    )
    trainer.rank_telemetry.log_step(trainer.progress["step"], **trainer.rank_record(), **rank_fields)
    if comm:
        track_comm(trainer, comm.get("grad_bytes_allreduced", comm.get("reduce_scatter_bytes")))


def check_stuck(trainer: Trainer, loss: float) -> None:
    """Stop a run whose loss sits at chance level (``ln`` of the number of classes, per token for a language
    model) for ``run.divergence_window_steps`` steps: it learns nothing. With the stability guard the most
    recently frozen block is thawed first and the window starts again.

    Raises:
        DivergenceError: the mean loss of the last window is at least 98% of the chance level.
    """
    window = trainer.config.run.divergence_window_steps
    if not window or trainer.task.num_classes < 2:
        return
    recent = trainer.progress.setdefault("recent_losses", [])
    recent.append(loss)
    del recent[:-window]
    chance = math.log(trainer.task.num_classes)
    if len(recent) < window or sum(recent) / window < 0.98 * chance:
        return
    mean = sum(recent) / window
    floor = set(trainer.freezer.floor)  # a memory budget keeps these frozen
    latest = [h for h in trainer.freezer.history if h["kind"] == "freeze" and trainer.freezer.frozen[h["index"]]
              and h["index"] not in floor]
    if trainer.guard is not None and latest:
        recent.clear()
        trainer.freezer.thaw(latest[-1]["index"], reason=f"divergence: loss {mean:.4g} at chance level "
                                                         f"({chance:.4g}) for {window} steps")
        return
    raise DivergenceError(f"the training loss has been at chance level for {window} steps (mean {mean:.4g}, "
                          f"chance ln({trainer.task.num_classes}) = {chance:.4g}): the run learns nothing. Check "
                          "the labels and train.lr (or raise run.divergence_window_steps, or set it to null)")


def ledger_step(trainer: Trainer, step: int) -> contextlib.AbstractContextManager[Any]:
    """The memory ledger's step ``step`` (it samples the step when due), or nothing without a ledger."""
    return trainer.ledger.step(step) if trainer.ledger is not None else contextlib.nullcontext()


def memory_fields(trainer: Trainer) -> dict[str, Any]:
    """The step record's ``memory`` when the ledger sampled this step (and a ``memory`` event after a change of
    the frozen set: what it gave back per bucket, between the last sample before it and this one)."""
    if trainer.ledger is None or not trainer.ledger.last_step_sampled:
        return {}
    snap = trainer.ledger.last
    if trainer._memory_changes and trainer._memory_before is not None and snap.step > trainer._memory_before.step:
        trainer.telemetry.log_event(Event.MEMORY, snap.step, before_step=trainer._memory_before.step,
                                    changes=trainer._memory_changes, tensor_bytes=snap.tensor_bytes,
                                    returned_bytes=memory_change(trainer._memory_before, snap),
                                    returned_devices=memory_change_by_device(trainer._memory_before, snap),
                                    params_dtype=snap.params_dtype)
    if snap.step > getattr(trainer._memory_before, "step", -1):
        trainer._memory_before, trainer._memory_changes = None, []
    return {"memory": snap.to_record()}


def on_freeze_event(trainer: Trainer, record: dict[str, Any]) -> None:
    """A freeze, thaw or stage record from the Freezer (``Freezer.on_event``): logged as an event, with what the
    block held at the ledger's last sample; a freeze or thaw asks the ledger to sample the next step."""
    fields = {k: v for k, v in record.items() if k not in ("kind", "step")}
    if trainer.ledger is not None and record["kind"] in (Event.FREEZE, Event.THAW) and "index" in record:
        if trainer.ledger.last is not None:  # what the block held at the ledger's last sample
            fields["held_bytes"] = trainer.ledger.block_bytes(record["index"])
            if trainer._memory_before is None:
                trainer._memory_before = trainer.ledger.last
        trainer._memory_changes.append({"kind": record["kind"], "block": record["block"]})
        trainer.ledger.request()  # the next step is sampled: what the change gave back
    trainer.telemetry.log_event(record["kind"], record["step"], **fields)
    reason = str(record.get("reason") or "")
    if record["kind"] == Event.THAW and reason.startswith("guard:") and trainer.is_main:
        # a safety net that acts in silence is one the user cannot judge (issue 29): every guard thaw is a line
        tqdm.write(f"stability guard: thawed {record.get('block')} at step {record['step']} "
                   f"(held-out {reason.removeprefix('guard: ')})")
