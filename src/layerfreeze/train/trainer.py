"""The CLI's trainer: a small, readable train/eval loop with freezing, telemetry and resumable checkpoints.

The whole path, in order: seed -> task (model, data) -> blocks -> optimizer (one param group per block) -> LR
schedule (warm-up, then linear/cosine decay) -> :class:`~layerfreeze.engine.Freezer` -> for each epoch: a fixed
permutation from ``seed + epoch`` -> steps (forward, loss, backward, clip, step) -> evaluation -> checkpoint.
:class:`Trainer` holds the run's state and its epoch loop (:meth:`Trainer.run`); each job of the loop has a module
beside it, each function taking the trainer: the setup (:mod:`~layerfreeze.train.setup`), the step and its
per-step records and checks (:mod:`~layerfreeze.train.step`), checkpoints and resume
(:mod:`~layerfreeze.train.checkpointing`), the distributed bookkeeping (:mod:`~layerfreeze.train.ranks`), the
evaluation (:mod:`~layerfreeze.train.evaluation`) and the summary (:mod:`~layerfreeze.train.summary`).

Measurements per step: loss, learning rate, step time (s: forward, backward, optimizer step and the strategy's
freezing stage; data loading and evaluation excluded), samples/s, training FLOPs per step measured with
``FlopCounterMode`` on a real step (re-measured whenever the frozen set changes), cumulative FLOPs, peak memory
(bytes: the process's peak RSS, the CUDA allocator's peak on a GPU) and, every ``run.ledger_every`` steps and at the
step after every freeze or thaw, the memory ledger (:class:`~layerfreeze.runs.ledger.MemoryLedger`: bytes per bucket,
device and block, in the step record's ``memory``; a ``memory`` event with what the change gave back per bucket; each
bucket's peak and the tensor peak in the summary's ``memory``); the ledger's own cost is inside the step time. A
checkpoint is written at every epoch end and when the run is interrupted (Ctrl-C or an exception), so
``layerfreeze train --resume RUN_DIR`` continues exactly where it stopped (same batches, same RNG).

Launched by ``torchrun`` (``WORLD_SIZE`` > 1) the same loop is data-parallel (:mod:`layerfreeze.distributed`):
``train.batch_size`` stays the *global* batch, each rank takes its interleaved share of every batch
(``batch[rank::world]``) and weights its summed loss so the all-reduced gradient is the global batch's mean (the
run follows the single-process trajectory up to float rounding); the model trains inside
:class:`~layerfreeze.distributed.ddp.FreezeDDP` (rebuilt around the trainable parameters on every freeze/thaw), rank 0
decides every freeze, loss and evaluation are all-reduced, and rank 0 alone writes telemetry, checkpoints (with
every rank's RNG state) and the summary. A rank that dies makes the others stop with
:class:`~layerfreeze.distributed.RankLostError` naming it; the last checkpoint stays resumable.

With ``run.parallel: fsdp`` the model is sharded instead (FSDP2): blocks are discovered, then
:func:`~layerfreeze.distributed.shard_blocks` puts each block's modules in its own ``fully_shard`` group (and the root
in one), then the optimizer is built over the sharded parameters; no DDP wrapper. The batches, loss weighting and
rank-0 decisions are the DDP path's (FSDP2's reduce-scatter averages the gradients as DDP's all-reduce does).
What differs: checkpoints are full ones (:meth:`~layerfreeze.checkpoint.CheckpointStore.save_full`: every weight and
the by-name optimizer state gathered on rank 0, in the same store), read back with
:func:`~layerfreeze.checkpoint.load_full_checkpoint`; rank 0's buffers (BatchNorm statistics) are broadcast before
every forward, as DDP does, so the checkpoint holds what every rank runs with; every evaluation runs the same number of
forward passes on every rank (each is a collective); a strategy that reads the model (``smartfrz``, ``egeria``)
observes an unsharded CPU mirror on rank 0 (``Freezer(mirror=...)``); the activation cache agrees with the other
ranks before each forward what all of them run (:class:`~layerfreeze.compute.cache.CachedPrefix`).

Each rank of a distributed run also writes its own step records (``ranks/rankN/metrics.jsonl``,
:meth:`Trainer.rank_record`): its peak memory, the bytes of its parameters (its shards under FSDP2) and optimizer
state, the bytes its collectives sent, and at the ledger's sampled steps its own memory ledger (``memory``: under
FSDP2 the bytes of its shards, :mod:`layerfreeze.runs.ledger`); the summary lists each rank's (``ranks``, each with
its ledger's peaks in ``memory``; the summary's own ``memory`` and ``metrics.jsonl``'s are rank 0's). Every checkpoint
holds each rank's ledger peaks, and a resumed rank restores its own.
"""

from __future__ import annotations

import functools
import math
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate
from tqdm.auto import tqdm

from layerfreeze.engine.integrity import FrozenWeightsChangedError, UnfrozenParameterError
from layerfreeze.runs import measure, rundir
from layerfreeze.runs import telemetry as tm
from layerfreeze.runs.rundir import Event
from layerfreeze.train.checkpointing import restore_totals, resume, write_checkpoint
from layerfreeze.train.compile import CompiledRegions
from layerfreeze.train.config import Config
from layerfreeze.train.evaluation import evaluate_trainer
from layerfreeze.train.prefix_clock import PrefixClock
from layerfreeze.train.ranks import local_batches, rank_record, stopped_together
from layerfreeze.train.setup import epoch_batches, place, setup_trainer, to_device
from layerfreeze.train.step import DivergenceError, check_stuck, on_freeze_event, record_step, timed_step, train_step
from layerfreeze.train.summary import cache_summary, write_summary
from layerfreeze.train.tasks import Task


class Trainer:
    """Runs one configured training with freezing.

    Args:
        config: A validated :class:`~layerfreeze.train.config.Config`.
        task: A ready task (model + data); default: built from the config.
        run_dir: Where metrics, TensorBoard files, checkpoints and the summary go (default ``config.run.dir``,
            else ``runs/<task>-<strategy>-<time>``).
        step_callbacks: Called with the trainer once before the first step (``trainer.progress["step"]`` is the
            starting step: 0, or where a resumed run continues) and after every optimizer step, outside the timed
            part of the step (after its telemetry record). They may read ``model``, ``task``, ``train_set``,
            ``freezer``, ``total_steps``, ``device`` and ``progress``, and must leave the model (weights, train/eval
            modes), the optimizer and the global RNG as they found them, so the run is the same with or without
            them. Example: recording each block's output on a probe batch every few steps (the benchmark oracle).
            Under ``run.parallel: fsdp`` they run on every rank at the same points, so they may gather the sharded
            weights (``DTensor.full_tensor``, a collective).

    Attributes:
        rank_fields: Callables ``f(trainer) -> dict`` whose fields join each rank's per-step record
            (:meth:`rank_record`, ``ranks/rankN/metrics.jsonl``) in a distributed run, called on every rank after
            every step. The hook for per-rank measurements such as a memory ledger's buckets.

    Raises:
        ConfigError: at construction, when the run folder already holds a run and the config does not resume it,
            or is a file (:func:`~layerfreeze.runs.rundir.check_run_dir`).
        ConfigError, AssetMissingError, BlockDiscoveryError: from :meth:`run`, before training starts: bad config,
            missing asset, undiscoverable blocks.
    """

    def __init__(self, config: Config, task: Task | None = None, run_dir: str | Path | None = None,
                 step_callbacks: list[Callable[[Trainer], None]] | None = None) -> None:
        self.config = config
        self.task = task
        self.step_callbacks = list(step_callbacks or [])
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(run_dir or config.run.dir or f"runs/{config.task}-{config.freeze.strategy}-{stamp}")
        rundir.check_run_dir(self.run_dir, resuming=bool(config.run.resume))
        self.distributed = False  # set by setup() when the launcher describes several ranks
        self.fsdp = False  # set by setup(): distributed with run.parallel fsdp
        self._stop_agreed = False  # distributed: some rank got a Ctrl-C (all-reduced in every step)
        self.stop_signal = signal.SIGINT  # what stopped the run: SIGINT (Ctrl-C) or, single-process, SIGTERM
        self.rank_fields: list[Callable[[Trainer], dict[str, Any]]] = []
        self.rank_telemetry: tm.Telemetry | tm.NullTelemetry = tm.NullTelemetry()
        self._collective_bytes: dict[str, int] = {}  # FSDP2: bytes of the last step's all-gathers / reduce-scatters
        self.resumed_from_step: int | None = None  # set by a resume: the step the checkpoint held
        self.compiled: CompiledRegions | None = None  # set by setup() under train.compile
        self._graphs_logged = 0  # graphs compiled up to the last step record (its ``compiles``)
        self._step_compile_s = 0.0  # seconds the last timed step spent compiling (its record's ``compile_s``)
        #: The head's param-group LR the last step ran at, read before its optimizer step (its record's ``lr``; read
        #: after, it was the next step's: the logged curve ran one step early and ended at 0).
        self._step_lr = 0.0
        self.prefix_clock: PrefixClock | None = None  # set by setup(): the frozen prefix's forward seconds per step
        #: Called once, by :meth:`say`, before the run's first console line (the CLI prints its run header then), so a
        #: run that fails while it is set up prints its error alone.
        self.header: Callable[[], None] | None = None

    # ------------------------------------------------------------------------------------------------------

    def setup(self, plan_only: bool = False) -> None:
        """Build everything a run trains with: process group, seed, task, blocks, strategy, sharding (FSDP2),
        optimizer, LR schedule, memory plan, Freezer, cache, DDP wrapper, run folder
        (:func:`~layerfreeze.train.setup.setup_trainer`). :meth:`run` calls it; call it yourself only to drive
        :meth:`train_step` by hand (``benchmarks/smartfrz_overhead.py`` times steps that way).

        Args:
            plan_only: Stop after the memory plan (``freeze.memory_budget``: :attr:`memory_plan`), before anything
                is written (``layerfreeze plan``).

        Raises:
            ConfigError, AssetMissingError, BlockDiscoveryError: bad config (``run.parallel: fsdp`` in one process
                too), missing asset, undiscoverable blocks.
            BudgetError: ``freeze.memory_budget`` cannot be met (before the run folder is created).
        """
        setup_trainer(self, plan_only)

    def say(self, line: str) -> None:
        """Print ``line`` on rank 0's console (through tqdm, above a progress bar), after :attr:`header` the first
        time."""
        if not self.is_main:
            return
        header, self.header = self.header, None
        if header is not None:
            header()
        tqdm.write(line)

    def train_step(self, batch: dict[str, torch.Tensor], global_count: int, local_count: int) -> float:
        """One optimizer step (after :meth:`setup`); returns this rank's loss: the batch mean in one process, the *sum*
        over this rank's ``local_count`` counted samples when distributed (the caller all-reduces it into the global
        mean). See :func:`~layerfreeze.train.step.train_step`."""
        return train_step(self, batch, global_count, local_count)

    def rank_record(self) -> dict[str, Any]:
        """This rank's fields of its per-step record (``ranks/rankN/metrics.jsonl`` in a distributed run): its peak
        memory, the bytes of its parameters and optimizer state, then the fields of every :attr:`rank_fields`
        callable (:func:`~layerfreeze.train.ranks.rank_record`)."""
        return rank_record(self)

    @property
    def stopped_together(self) -> bool:
        """True after a Ctrl-C that every rank agreed on (all stopped after the same step and checkpointed), or
        any Ctrl-C on one process: then no rank is left inside a collective."""
        return stopped_together(self)

    # ------------------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train, evaluate every epoch, checkpoint, and return the summary (also written to ``summary.json``).

        Raises:
            KeyboardInterrupt: after a Ctrl-C, or a SIGTERM in a single-process run (``kill``, ``docker stop``, a
                SLURM preemption; :attr:`stop_signal` says which), re-raised after writing a resumable checkpoint.
        """
        cfg = self.config
        measure.release_garbage()  # an earlier run in this process (compare's rows) must not count in this one's peak
        try:  # what fails before training (a bad config, a refused resume) leaves no Freezer open on the model
            self.setup()
            self.progress: dict[str, Any] = {
                "step": 0, "flops_total": 0, "train_time_s": 0.0, "epoch_times_s": [], "flops_per_step": None,
                "flops_first": None, "history_eval": [], "train_compile_s": 0.0,
            }
            start_epoch, skip = 0, 0
            if cfg.run.resume:
                start_epoch, skip = resume(self, Path(cfg.run.resume))
                place(self)  # the resumed frozen set's prefix, offloaded as the interrupted run had it
                if self.is_main:  # only now: a resume refused (a checkpoint that does not fit) leaves the run as it was
                    rundir.write_config(self.run_dir, cfg.model_dump(mode="json"))
            # after a resume was accepted, as config.json; in TensorBoard at the first step this process trains
            first = 0 if self.resumed_from_step is None else self.resumed_from_step + 1
            self.telemetry.log_config(cfg.model_dump(mode="json"), step=first)
            restore_totals(self)  # the cache's counters and the ledger's peaks a resumed run goes on from
            on_event = functools.partial(on_freeze_event, self)
            if not cfg.run.resume or self.progress["step"] == 0:
                for record in self.freezer.history:  # blocks frozen at the start stage
                    on_event(record)
            self.freezer.on_event = on_event
            for callback in self.step_callbacks:
                callback(self)
            if self.ddp is not None:
                self.ddp.sync()  # the first build's bytes/time are logged before step 1, a resume's rebuild too
            if self.fsdp and self.runner is not None:  # FSDP2's root module must run first; not inside a measured step
                self.runner.warm_up(to_device(default_collate([self.train_set[0]]), self.device))
            measure.reset_peak_memory(self.device)
            wall_start = time.perf_counter()
            self._measured_for: tuple[Any, ...] | None = None  # the frozen set (and epoch) the FLOPs were measured for
            epoch, done_in_epoch = start_epoch, skip
            self._last_checkpoint_time = time.monotonic()
        except BaseException:
            if getattr(self, "freezer", None) is not None:
                self.freezer.close()
            raise
        restore_sigint = self._install_sigint()
        # the epochs the run reaches, which the progress bar counts to: train.max_steps may end it before
        # train.epochs (`--max-steps 1` showed "epoch 1/3" for a run of one step)
        epochs_run = min(cfg.train.epochs, math.ceil(self.total_steps / max(1, self.batches_per_epoch)))
        try:
            for epoch in range(start_epoch, cfg.train.epochs):
                # a checkpoint taken after an epoch's last step but before its end (evaluation, epoch-end stage)
                # resumes into that epoch's end
                finishing = epoch == start_epoch and skip > 0
                if self.progress["step"] >= self.total_steps and not finishing:
                    break
                batches = epoch_batches(len(self.train_set), cfg.train.batch_size, cfg.train.seed, epoch)
                done_in_epoch = skip if epoch == start_epoch else 0
                todo = batches[done_in_epoch:][: max(0, self.total_steps - self.progress["step"])]
                global_sizes = [len(b) for b in todo]
                shares, local_counts = local_batches(self, todo)
                # An iterator over a DataLoader draws a base seed from its generator; without one it would draw
                # from the global RNG, and a resumed run (one more iterator) would get other dropout masks.
                loader = DataLoader(self.train_set, batch_sampler=shares, generator=torch.Generator())
                epoch_time, epoch_loss, epoch_n = 0.0, 0.0, 0
                partial = self.progress.get("epoch_partial")
                if finishing and partial and partial["epoch"] == epoch:  # the epoch's sums up to the checkpoint
                    epoch_time, epoch_loss, epoch_n = partial["time"], partial["loss"], partial["n"]
                self.model.train()
                bar = tqdm(loader, total=done_in_epoch + len(todo), initial=done_in_epoch,  # max_steps may end it early
                           disable=not (cfg.run.progress and self.is_main),
                           desc=f"epoch {epoch + 1}/{epochs_run}", unit="step", leave=False)
                for batch, n, local in zip(bar, global_sizes, local_counts):
                    loss, step_time, decision = timed_step(self, batch, n, local, epoch)
                    due = self._due
                    done_in_epoch += 1
                    epoch_time += step_time
                    epoch_loss += loss * n
                    epoch_n += n
                    # the epoch's sums so far go into every checkpoint (periodic, Ctrl-C, exception)
                    self.progress["epoch_partial"] = {"epoch": epoch, "time": epoch_time, "loss": epoch_loss,
                                                      "n": epoch_n}
                    record_step(self, loss, n, step_time, decision)  # the step counted, its records written
                    check_stuck(self, loss)
                    bar.set_postfix(loss=f"{loss:.4f}", frozen=f"{sum(self.freezer.frozen)}/{len(self.freezer.blocks)}")
                    for callback in self.step_callbacks:
                        callback(self)
                    every = cfg.freeze.guard.every_steps if cfg.freeze.guard else None
                    if every and self.progress["step"] % every == 0:
                        self._guard_check()
                        place(self)  # a thaw by the guard shortens the frozen prefix
                        self.model.train()
                    # distributed: only a stop every rank has agreed on (all-reduced in the step) ends the loop here
                    if self._stop_agreed if self.distributed else self._stop_requested:
                        raise KeyboardInterrupt(f"stopped by {self.stop_signal.name} after a complete step")
                    if due:
                        write_checkpoint(self, epoch, done_in_epoch, reason="periodic")
                bar.close()
                self._end_epoch(epoch, epoch_time, epoch_loss / max(1, epoch_n), steps=done_in_epoch, of=len(batches))
                done_in_epoch = 0
        except BaseException as exc:
            coordinated = not self.distributed or isinstance(exc, DivergenceError) or (
                isinstance(exc, KeyboardInterrupt) and self._stop_agreed)
            coordinated = coordinated and not isinstance(exc, (FrozenWeightsChangedError, UnfrozenParameterError))
            # A failure on one rank leaves the others inside a collective: no collective checkpoint then; the last
            # complete one stays, and a lost peer is named.
            path = write_checkpoint(self, epoch, done_in_epoch, reason=type(exc).__name__) if coordinated else None
            self.telemetry.log_event(Event.INTERRUPTED, self.progress["step"], epoch=epoch, error=repr(exc),
                                     checkpoint=str(path) if path else None)
            self.telemetry.close()
            self.rank_telemetry.close()
            lost = None if coordinated or self.watchdog is None else self.watchdog.explain(exc)
            if lost is not None:
                raise lost from exc
            raise
        finally:
            restore_sigint()
            # what demotion held at the end, before close() gives the frozen blocks their float32 weights back
            demote_at_end = self.freezer.demoter.summary() if self.freezer.demoter is not None else None
            self.freezer.close()
            if self.compiled is not None:
                self.compiled.close()
            if self.prefix_clock is not None:
                self.prefix_clock.close()
            if self.watchdog is not None:
                self.watchdog.close()
            cache_at_end = cache_summary(self)  # before close() empties the store
            if self.ledger is not None:
                self.ledger.close()
            if self.runner is not None:
                self.runner.cache.close()
        self.freezer.verify_frozen_weights()
        summary = write_summary(self, time.perf_counter() - wall_start, cache_at_end, demote_at_end)
        self.telemetry.close()
        self.rank_telemetry.close()
        return summary

    def _install_sigint(self) -> Callable[[], None]:
        """First Ctrl-C (or SIGTERM): finish the current step, checkpoint, stop. A second one: stop at once.

        Stopping between steps keeps model, optimizer and data position consistent, so the resumed run is exact.
        SIGTERM (``kill``, ``docker stop``, a SLURM preemption, whose grace period is seconds to minutes) is answered
        so in a single-process run; under torchrun it keeps its default, because a rank blocked in a collective
        (its peer gone) runs no Python handler, and torchrun's SIGTERM after a peer's failure must end it.
        """
        self._stop_requested = False  # this process got a Ctrl-C / SIGTERM
        self._stop_agreed = False  # distributed: some rank got one (all-reduced in every step)
        self._due = False  # a periodic checkpoint is due after this step (agreed across ranks)
        self.stop_signal = signal.SIGINT
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum: int, frame: Any) -> None:
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True
            self.stop_signal = signal.Signals(signum)
            again = "press again" if signum == signal.SIGINT else "a second SIGTERM"
            if self.is_main:  # under torchrun the terminal's Ctrl-C reaches every rank: rank 0 alone says it
                tqdm.write(f"{'Ctrl-C' if signum == signal.SIGINT else 'SIGTERM'}: stopping after this step and "
                           f"writing a checkpoint ({again} stops now)")

        signals = [signal.SIGINT] if self.distributed else [signal.SIGINT, signal.SIGTERM]
        previous = {signum: signal.signal(signum, handler) for signum in signals}

        def restore() -> None:
            for signum, old in previous.items():
                signal.signal(signum, old)

        return restore

    def _end_epoch(self, epoch: int, epoch_time: float, train_loss: float, *, steps: int, of: int) -> None:
        """The epoch's evaluation, records and end stage; it ran ``steps`` of its ``of`` batches (fewer: cut short by
        ``train.max_steps``)."""
        eval_start = time.perf_counter()
        graphs = self.compiled.compiled_graphs() if self.compiled is not None else 0
        eval_loss, eval_acc = evaluate_trainer(self)
        eval_time = time.perf_counter() - eval_start
        compiled = {}
        if self.compiled is not None:  # the evaluation's own graphs: in the epoch's record, not the next step's
            compiled = {"eval_compiles": self.compiled.compiled_graphs() - graphs}
            self._graphs_logged += compiled["eval_compiles"]
        metric = self.task.objective.metric  # accuracy, or perplexity for a language model
        self.progress["epoch_times_s"].append(epoch_time)
        self.progress.setdefault("epoch_steps", []).append([steps, of])  # a checkpoint from before 0.2.x lacks it
        self.progress["history_eval"].append({"epoch": epoch, "loss": eval_loss, metric: eval_acc})
        self.telemetry.log_epoch(
            epoch, self.progress["step"], train_loss=train_loss, eval_loss=eval_loss, **{f"eval_{metric}": eval_acc},
            epoch_time_s=epoch_time, eval_time_s=eval_time, frozen_blocks=self.freezer.frozen_blocks,
            peak_memory_bytes=measure.peak_memory_bytes(self.device), **self._cache_stats(), **compiled,
        )
        # one line per epoch, also without the progress bar
        if self.is_main:
            tqdm.write(f"epoch {epoch + 1}: train loss {train_loss:.4f}  eval loss {eval_loss:.4f}  {metric} "
                       f"{eval_acc:.4f}  train time {epoch_time:.1f} s  frozen {sum(self.freezer.frozen)}"
                       f"/{len(self.freezer.blocks)}")
        if self.guard is not None:
            self._guard_check()
        decision = self.freezer.epoch_end()
        place(self)  # an epoch-end stage (or the guard's thaw) moved the frozen prefix
        if decision is not None and decision.signals:
            self.telemetry.log_event(Event.STAGE, self.progress["step"], epoch=epoch, **tm.signals_of(decision))
        write_checkpoint(self, epoch + 1, 0, reason="epoch_end")

    def _cache_stats(self) -> dict[str, Any]:
        return {} if self.runner is None else self.runner.epoch_fields(getattr(self, "_cache_base", {}))

    def _guard_check(self) -> None:
        val_loss, val_acc = evaluate_trainer(self, self.val_set)
        metric = self.task.objective.metric
        self.telemetry.log_step(self.progress["step"], val_loss=val_loss, **{f"val_{metric}": val_acc})
        self.freezer.report_metric(val_loss)
