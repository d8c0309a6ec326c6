"""The subcommands: ``train``, ``compare``, ``plan``, ``blocks``, ``config``, ``strategies``, ``assets`` (each
``cmd_NAME(args, console)`` -> exit code; ``report`` and ``predictor`` are dispatched by :mod:`layerfreeze.cli.entry`).
Errors a user can fix are raised (:class:`~layerfreeze.errors.UserError`); the entry point prints them."""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from layerfreeze.budget.measure import CACHE_BUCKETS
from layerfreeze.cli.parser import TRAIN_FLAGS, main_rank, overrides_of, refuse_repeats, same_value
from layerfreeze.distributed.comm import RankLostError, close_distributed, launched_world_size
from layerfreeze.errors import ConfigError, UnknownStrategyError
from layerfreeze.runs import rundir
from layerfreeze.runs.ledger_buckets import Bucket, bucket_label
from layerfreeze.strategies import DEFAULT_STRATEGY, STRATEGIES, strategy_parameters
from layerfreeze.strategies.registry import did_you_mean
from layerfreeze.train.assets import check_assets
from layerfreeze.train.compare import DEFAULT_ROWS, unknown_rows
from layerfreeze.train.config_file import leaf_values, parse_override, same_path
from layerfreeze.train.config_load import load_config


def _check_resume_parallel(run_dir: Path, saved: dict[str, Any], parallel: str) -> None:
    """A run saved under DDP (or in one process) resumes unsharded: its checkpoint's optimizer state is
    ``optimizer.state_dict()``, which a sharded model cannot take. (An FSDP2 run's full checkpoint resumes either
    way.)

    Raises:
        ConfigError: ``run.parallel`` is fsdp and the saved run's is not.
    """
    was = (saved.get("run") or {}).get("parallel", "ddp")
    if parallel == "fsdp" and was != "fsdp":
        raise ConfigError(f"--resume {run_dir}: the run was saved with run.parallel {was} (its optimizer state is "
                          "not the by-name one of an FSDP2 checkpoint); resume it with --parallel ddp, or start a new "
                          "run with --parallel fsdp")


#: What a resumed run cannot change: what it trains, on what, in which order (its checkpoint and data position
#: belong to them), and its optimizer's settings: the checkpoint's optimizer state brings back the optimizer's own
#: lr, weight decay and momentum over the new ones (a change was announced and then ignored), and another optimizer
#: cannot read it (sgd over an AdamW state failed the first step, and its crash checkpoint could not be resumed).
#: ``freeze.strategy`` has its own message; ``run.parallel`` its own check.
FIXED_ON_RESUME = ("task", "model.", "data.", "freeze.params.", "train.batch_size", "train.seed")
FIXED_OPTIMIZER = ("train.optimizer", "train.lr", "train.lr_decay", "train.weight_decay", "train.momentum")
#: How the frozen blocks are held: a memory budget freezes a prefix from the start (a resume that added one froze
#: blocks the checkpoint trained, then stopped at the checksum check, and every later resume with it), demotion
#: casts or moves the frozen blocks (the checkpoint's were held otherwise); where its float32 master copies wait
#: (``freeze.demote.master``) may change.
FIXED_FROZEN = ("freeze.memory_budget", "freeze.demote")


#: Config keys holding a file or folder: a run started before they were saved absolute keeps a relative one.
PATH_KEYS = ("data.path", "data.test_path", "model.name_or_path")


def _check_saved_paths(run_dir: Path, saved: dict[str, Any], args: argparse.Namespace) -> None:
    """A resume whose saved config names a relative path that is not here (a run started before config.json kept
    absolute paths, resumed from another folder): take the flag's path in its place when given (``--data``,
    ``--model``; the checkpoint's record of the data's sizes, and its weights, still refuse what does not fit), else
    refuse saying what to do.

    Raises:
        ConfigError: naming the path and the fix.
    """
    from layerfreeze.train.config import IMAGE_TASKS

    places = [("data", "path", "--data", args.data), ("data", "test_path", None, None)]
    if saved.get("task") not in IMAGE_TASKS:  # an image task's model.name_or_path is an architecture's name
        places.append(("model", "name_or_path", "--model", args.model))
    for section_name, key, flag, given in places:
        section = saved.get(section_name) or {}
        value = section.get(key)
        if not isinstance(value, str) or Path(value).expanduser().is_absolute() or Path(value).exists():
            continue
        if given is not None:
            section[key] = given
            continue
        raise ConfigError(f"--resume {run_dir}: its {section_name}.{key} {value!r} is relative to the folder the run "
                          f"was started in, and {Path.cwd()} has no {value}: run the resume from that folder"
                          + (f", or give {flag} with its path from here" if flag else ""))


def _same_budget(a: Any, b: Any) -> bool:
    """Two ways of writing one memory budget (``0.6`` and ``60%``, ``1GiB`` and ``1073741824``)."""
    from layerfreeze.budget import parse_budget
    from layerfreeze.errors import BudgetError

    try:
        x, y = parse_budget(a), parse_budget(b)
    except BudgetError:
        return False
    return (x.bytes, x.fraction) == (y.bytes, y.fraction)


def resume_changes(run_dir: Path, saved: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """The settings the command line changes on a resumed run, one line each (``"train.epochs 3 -> 5"``), so no
    change goes unseen.

    Raises:
        ConfigError: a setting a resumed run cannot change (:data:`FIXED_ON_RESUME`, :data:`FIXED_OPTIMIZER`),
            before anything is written.
    """
    before, after = ({'.'.join(k): v for k, v in leaf_values(d).items()} for d in (saved, config))
    changed = {k: (before.get(k), v) for k, v in after.items() if k in before and before[k] != v
               and not (k in PATH_KEYS and same_path(before[k], v))}
    changed.update({k: (v, None) for k, v in before.items() if k not in after and v is not None
                    and not any(a.startswith(k + ".") for a in after)})  # {} -> {num_intervals: 5}: the key below
    # a section set where the run had none (freeze.demote null -> {dtype: ...}), a strategy parameter the run did not
    # set (-p num_intervals=5): keys the saved config lacks
    changed.update({k: (None, v) for k, v in after.items()
                    if k not in before and v is not None and k.startswith((*FIXED_FROZEN, "freeze.params."))})
    budget = changed.get("freeze.memory_budget")
    if budget is not None and None not in budget and _same_budget(*budget):  # 0.6 and 60%: one budget
        del changed["freeze.memory_budget"]
    fixed = sorted(k for k in changed if k.startswith(FIXED_ON_RESUME) or k == "task")
    optimizer = sorted(k for k in changed if k.startswith(FIXED_OPTIMIZER))
    frozen = sorted(k for k in changed if k.startswith(FIXED_FROZEN) and k != "freeze.demote.master")
    for keys, kept in ((fixed, "what it trains and on what"),
                       (optimizer, "its optimizer and the optimizer's settings (the checkpoint's optimizer state "
                                   "brings them back)"),
                       (frozen, "how its frozen blocks are held (the memory budget's prefix frozen from the start, "
                                "their demotion), as its checkpoints have them")):
        if keys:
            what = "; ".join(f"{k} {changed[k][0]!r} -> {changed[k][1]!r}" for k in keys)
            raise ConfigError(f"--resume {run_dir}: a resumed run keeps {kept} ({what}); drop those flags, or start "
                              "a new run (--config with the run's config.json takes its settings)")
    return [f"{k} {old!r} -> {new!r} (from the command line)" for k, (old, new) in sorted(changed.items())
            if not k.startswith("run.")]


def cmd_train(args: argparse.Namespace, console: Console) -> int:
    from layerfreeze.compute import CacheRefused, CacheWriteError
    from layerfreeze.engine.integrity import FrozenWeightsChangedError, UnfrozenParameterError
    from layerfreeze.runs.summary import print_summary
    from layerfreeze.train.step import DivergenceError
    from layerfreeze.train.trainer import Trainer

    overrides = overrides_of(args, TRAIN_FLAGS)
    config_path = args.config
    if args.resume:
        run_dir = Path(args.resume)
        if not run_dir.is_dir():
            what = "is a file" if run_dir.exists() else "does not exist"
            raise ConfigError(f"--resume {run_dir}: {what} (give the run folder `layerfreeze train` wrote, e.g. "
                              "runs/bbc-news-smartfrz-<time>)")
        if not (run_dir / rundir.CONFIG_FILE).is_file():
            raise ConfigError(f"--resume {run_dir}: not a layerfreeze run folder (no {rundir.CONFIG_FILE})")
        try:
            saved = json.loads((run_dir / rundir.CONFIG_FILE).read_text())
            saved["run"].update(dir=str(run_dir), resume=str(run_dir))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"--resume {run_dir}: its {rundir.CONFIG_FILE} is not a saved layerfreeze config "
                              f"({exc}); it cannot be resumed") from None
        if config_path:
            raise ConfigError("--resume takes the run's saved config; drop --config (use --set to change a key)")
        if getattr(args, "run_dir", None) and Path(args.run_dir).resolve() != run_dir.resolve():
            raise ConfigError(f"--resume {run_dir} goes on in that run's own folder; drop --run-dir {args.run_dir} "
                              f"(or start a new run there: --config {run_dir / rundir.CONFIG_FILE})")
        _check_saved_paths(run_dir, saved, args)
        saved_strategy = (saved.get("freeze") or {}).get("strategy")
        if args.strategy is not None and args.strategy != saved_strategy:
            raise ConfigError(f"--resume {run_dir}: the run's strategy is {saved_strategy!r}; a resumed run keeps it "
                              "(drop --strategy, or start a new run)")
        overrides = [saved, *overrides]
    config = load_config(config_path, overrides)
    if args.resume:
        _check_resume_parallel(Path(args.resume), saved, config.run.parallel)
        for line in resume_changes(Path(args.resume), saved, config.model_dump(mode="json")):
            if main_rank():
                console.print(f"resume: {line}", highlight=False)
    world = launched_world_size()
    speaks = main_rank()  # under torchrun rank 0 alone speaks
    shown: list[bool] = []

    def show_run_dir(trainer: Trainer) -> None:
        """Name the run folder once it exists (before the first step): a run that fails while it is being set up
        (a missing asset, undiscoverable blocks) never creates it, so it must not be named before."""
        if speaks and not shown and trainer.run_dir.is_dir():
            shown.append(True)
            trainer.say(f"run dir {trainer.run_dir}")  # after the run header, the first time

    trainer = Trainer(config, step_callbacks=[show_run_dir])
    checkpoint = trainer.run_dir / rundir.CHECKPOINT_LINK
    again = f"torchrun --nproc_per_node {world} -m layerfreeze" if world > 1 else "layerfreeze"
    # printed with the run's first line: a run that fails while it is set up prints its error alone
    trainer.header = functools.partial(console.print, run_header(config, world), highlight=False)
    try:
        summary = trainer.run()
    except KeyboardInterrupt:
        if trainer.stopped_together:
            close_distributed()  # every rank stopped after the same step, checkpointed: none is in a collective
        by = trainer.stop_signal
        what = "Interrupted" if by == signal.SIGINT else f"Stopped by {by.name}"
        if speaks:
            if (trainer.run_dir / rundir.CHECKPOINTS_DIR).is_dir():
                console.print(f"\n{what}. A checkpoint is in {shell_word(checkpoint)}; continue with:\n"
                              f"  {again} train --resume {shell_word(trainer.run_dir)}")
            else:
                console.print(f"\n{what} before the first checkpoint; nothing to resume.")
        return 128 + int(by)  # 130 for Ctrl-C, 143 for SIGTERM, as a shell reports a process the signal ended
    except (DivergenceError, FrozenWeightsChangedError, UnfrozenParameterError, CacheRefused,
            CacheWriteError) as exc:
        # the cache's own stops (freeze.cache.mode on) go on without it: the mode may change on a resume
        off = " --set freeze.cache.mode=auto" if isinstance(exc, (CacheRefused, CacheWriteError)) else ""
        Console(stderr=True, soft_wrap=True).print(
            f"[bold red]layerfreeze: run stopped:[/] {escape(str(exc))}\nThe last checkpoint is in "
            f"{shell_word(checkpoint)} (continue with: {again} train --resume {shell_word(trainer.run_dir)}{off})",
            highlight=False)
        return 1
    except RankLostError as exc:
        Console(stderr=True, soft_wrap=True).print(
            f"[bold red]layerfreeze: error:[/] {escape(str(exc))}\nThe last complete checkpoint in "
            f"{shell_word(checkpoint)} is resumable: {again} train --resume {shell_word(trainer.run_dir)}",
            highlight=False)
        return 1
    close_distributed()  # every rank finished; a gloo group left alive can abort the exit (SIGABRT)
    if not speaks:
        return 0
    print_summary(summary, console=console)
    metrics = trainer.run_dir / rundir.METRICS_FILE
    console.print(f"metrics: {shell_word(metrics)}   TensorBoard: tensorboard --logdir {shell_word(trainer.run_dir)}")
    write_run_report(trainer.run_dir, args, console)
    return 0


def run_header(config: Any, world: int = 1) -> str:
    """The line ``layerfreeze train`` starts with: the task, the strategy and its parameters, and what else shapes
    the run (its ranks and how they share the model, the memory budget, demotion and where its master copies go)."""
    freeze = config.freeze
    parts = [f"[bold]layerfreeze[/] {config.task}",
             f"strategy {freeze.strategy}" + (f" {freeze.params}" if freeze.params else "")]
    if world > 1:
        parts.append(f"{world} ranks, " + ("FSDP2 (each holds a shard)" if config.run.parallel == "fsdp" else "DDP"))
    if freeze.memory_budget is not None:
        parts.append(f"memory budget {freeze.memory_budget}")
    if config.train.precision != "auto":
        parts.append(f"precision {config.train.precision}")
    if config.train.compile:
        parts.append(f"compile {config.train.compile} ({config.train.compile_backend})")
    if freeze.demote is not None:
        d = freeze.demote
        what = " + ".join(x for x in (d.dtype, f"offload {d.offload}" if d.offload else None) if x)
        parts.append(f"demote {what} (float32 master copies: {d.master})")
    return " | ".join(parts)


def shell_word(path: Path | str) -> str:
    """``path`` for a printed line: a shell word (quoted when it holds a space or a shell character: the printed
    `train --resume` and `tensorboard --logdir` lines are copied as they are) with rich's markup escaped (rich read
    ``runs/[lr=1]`` as a style tag and printed ``runs/``)."""
    return escape(shlex.quote(str(path)))


def write_run_report(run_dir: Path | str, args: argparse.Namespace, console: Console) -> None:
    """The HTML report at the end of train/compare (skipped with --no-report or without matplotlib)."""
    if getattr(args, "no_report", False):
        return
    from layerfreeze.runs.report import write_report

    try:
        console.print(f"report: {shell_word(write_report(run_dir))}")
    except (ImportError, ConfigError) as exc:  # a report folder it cannot write: a traceback after the run's table
        console.print(f"report skipped: {escape(str(exc))}", highlight=False)


def cmd_compare(args: argparse.Namespace, console: Console) -> int:
    import time

    from layerfreeze.train.compare import compare
    from layerfreeze.train.config_file import deep_merge, read_config_file

    if args.rows is not None and not args.rows.strip(", "):
        raise ConfigError("--rows is empty; name the rows, e.g. --rows none,static,smartfrz (omit it for all)")
    rows = [r.strip() for r in args.rows.split(",") if r.strip()] if args.rows else \
        [r for r in DEFAULT_ROWS if r in STRATEGIES or r == "lora"]
    unknown = unknown_rows(rows)
    zero_rank = [r for r in unknown if re.fullmatch(r"lora-r0*", r)]
    if zero_rank:
        raise ConfigError(f"row {zero_rank[0]}: a LoRA rank is at least 1 (lora-r<N>, e.g. lora-r4)")
    if unknown:
        guesses = "".join(did_you_mean(r, [*STRATEGIES, "lora"]) for r in unknown)
        raise UnknownStrategyError(f"Unknown row(s) {', '.join(unknown)}{guesses}; available: "
                                   f"{', '.join(sorted(STRATEGIES))}, lora (rank 8), lora-r<N> (rank N)")
    base: dict[str, Any] = read_config_file(args.config) if args.config else {}
    for override in overrides_of(args, {k: v for k, v in TRAIN_FLAGS.items() if k != "strategy"}):
        base = deep_merge(base, override)
    task = base.get("task", "bbc-news")
    run_dir = base.get("run", {}).get("dir") or f"runs/compare-{task}-{time.strftime('%Y%m%d-%H%M%S')}"
    refuse_repeats(args.row_param, "--row-param")
    refuse_repeats(args.row_set, "--row-set")
    row_params: dict[str, dict[str, Any]] = {}
    for item in args.row_param:
        key, sep, _ = item.partition("=")
        row, dot, name = key.partition(".")
        if not sep or not dot:
            raise ConfigError(f"--row-param {item!r} must look like ROW.NAME=VALUE, e.g. static.k=3")
        if row not in rows:
            raise ConfigError(f"--row-param {item!r}: {row} is not one of the rows ({', '.join(rows)}); add it to "
                              "--rows or drop the parameter")
        row_params = deep_merge(row_params, parse_override(item))
    row_overrides: dict[str, dict[str, Any]] = {}
    for item in args.row_set:
        key, sep, _ = item.partition("=")
        row, dot, name = key.partition(".")
        if not sep or "." not in name:
            raise ConfigError(f"--row-set {item!r} must look like ROW.SECTION.KEY=VALUE, e.g. lora.train.lr=1e-3")
        if row not in rows:
            raise ConfigError(f"--row-set {item!r}: {row} is not one of the rows ({', '.join(rows)}); add it to "
                              "--rows or drop the setting")
        row_overrides = deep_merge(row_overrides, parse_override(item))
    try:
        results = compare(base, rows, run_dir, console=console, row_params=row_params, row_overrides=row_overrides)
    except KeyboardInterrupt:  # the row's own checkpoint is in its folder; a comparison is not resumed as a whole
        console.print(f"\nInterrupted. {shell_word(Path(run_dir) / rundir.COMPARE_MD)} lists the rows run so far, "
                      f"the one cut and those not run. `layerfreeze train --resume {shell_word(Path(run_dir))}/<row>` "
                      f"finishes the cut row (`layerfreeze report {shell_word(run_dir)}` then includes it); a "
                      "comparison itself does not resume: run "
                      "`layerfreeze compare` again with another --run-dir for the rows not run", highlight=False)
        return 130
    console.print(f"table: {shell_word(Path(run_dir) / rundir.COMPARE_MD)}   "
                  f"rows: {shell_word(Path(run_dir) / rundir.COMPARE_JSON)}   ({len(results)} runs)")
    write_run_report(run_dir, args, console)
    stopped = [r["row"] for r in results if r.get("stopped")]
    if stopped:  # the table is complete for the others; the exit code says not every row finished
        Console(stderr=True, soft_wrap=True).print(
            f"[bold red]layerfreeze: rows stopped before their end:[/] {', '.join(stopped)} (why: the table's last "
            f"column and compare.json; each one's run folder holds its last checkpoint)", highlight=False)
        return 1
    return 0


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    import tempfile

    from rich.table import Table

    from layerfreeze.budget.plan import ROW_NOTES
    from layerfreeze.runs.summary import format_bytes
    from layerfreeze.train.setup import plan_headline
    from layerfreeze.train.trainer import Trainer

    if launched_world_size() > 1:
        raise ConfigError("layerfreeze plan measures the run in one process and makes no plan per rank yet: run it "
                          "without torchrun (its --memory budget is then one process's)")
    for item in args.set:  # --memory won in silence over the budget --set named
        key, _, value = item.partition("=")
        if key.strip() == "freeze.memory_budget" and not same_value(value, args.memory):
            raise ConfigError(f"--memory {args.memory} and --set {item} set the same budget; give it once (--memory)")
    overrides = [*overrides_of(args, TRAIN_FLAGS), {"freeze": {"memory_budget": args.memory}}]
    config = load_config(args.config, overrides)
    if args.check is not None and args.check < 1:
        raise ConfigError(f"--check {args.check}: give the number of training steps to check the plan on (>= 1)")
    if args.json:
        rundir.check_writable(Path(args.json), "--json")
    trainer = Trainer(config)
    trainer.setup(plan_only=True)
    plan = trainer.memory_plan
    measured = plan.measured
    cache = measured.cache
    console.print(f"[bold]layerfreeze plan[/] {config.task} | {trainer.task.model_name} ({len(plan.block_names)} "
                  f"blocks) | batch {measured.batch_size} | strategy {config.freeze.strategy} | cache "
                  + (f"on ({cache.samples} samples, {cache.dtype})" if cache is not None else "off"), highlight=False)
    console.print(plan_headline(plan), highlight=False)
    # every bucket of that peak (autocast's weight casts too, under bf16-mixed / 16-mixed), so the parts add up to
    # it: the cache and what the strategy holds are left out of it (MemoryPlan.none_peak_bytes)
    parts = ", ".join(f"{bucket_label(bucket)} {format_bytes(n)}" for bucket, n in measured.buckets.items()
                      if n and bucket not in (*CACHE_BUCKETS, Bucket.STRATEGY))
    console.print(f"measured on {measured.steps} real steps with nothing frozen: tensor peak "
                  f"{format_bytes(plan.none_peak_bytes)} ({parts})", highlight=False)
    head, cells = plan.rows()
    table = Table(title=f"each frozen prefix under a budget of {format_bytes(plan.budget_bytes)} (tensor peak)")
    for col in head:
        if col == "frozen up to":  # block names are long (bert.encoder.layer.11): folded, never cut with "…"
            table.add_column(col, justify="left", overflow="fold", min_width=min(32, max(map(len, plan.block_names))))
        else:
            table.add_column(col, justify="right", no_wrap=True)
    for row in cells:
        table.add_row(*row)
    console.print(table)
    console.print(ROW_NOTES, highlight=False)
    chosen = plan.chosen
    console.print(f"[bold]plan[/]: budget {plan.budget} = {format_bytes(plan.budget_bytes)}; predicted tensor peak "
                  f"{format_bytes(plan.predicted_peak_bytes)} ({format_bytes(chosen.model_bytes)} model"
                  + (f" + {format_bytes(chosen.cache_bytes)} cache in memory, the rest of it on disk)"
                     if chosen.cache_budget_bytes is not None else ")"), highlight=False)
    console.print(f"gives up: {plan.gives_up()}", highlight=False)
    settings = [f"freeze.memory_budget: {plan.budget} (train --memory-budget {plan.budget}) keeps blocks "
                f"0..{plan.k - 1} frozen from the start; the strategy may freeze more, never thaw them" if plan.k else
                f"freeze.memory_budget: {plan.budget} (train --memory-budget {plan.budget}): nothing frozen from the "
                "start"]
    if config.freeze.strategy == "static" and config.freeze.params.get("k", 0) < plan.k:
        settings.append(f"static's k={config.freeze.params.get('k')} acts as k={plan.k}")
    if chosen.cache_budget_bytes is not None:
        settings.append(f"the activation cache keeps up to {format_bytes(chosen.cache_budget_bytes)} in memory "
                        "(freeze.cache.budget_mb), spilling the rest to disk")
    console.print("settings: " + "; ".join(settings), highlight=False)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(plan.to_dict(), indent=2))
        console.print(f"plan: {args.json}")
    if args.check is None:
        return 0
    steps = args.check
    if steps > trainer.total_steps:
        epochs = config.train.epochs
        whole = epochs * trainer.batches_per_epoch
        length = (f"train.max_steps {config.train.max_steps}, of {epochs} epoch(s) of {trainer.batches_per_epoch}"
                  if trainer.total_steps < whole else f"{epochs} epoch(s) of {trainer.batches_per_epoch}")
        console.print(f"check: --check {steps} is more than the run's {trainer.total_steps} steps ({length}); "
                      f"checking all {trainer.total_steps}", highlight=False)
        steps = trainer.total_steps
    scratch = None if config.run.dir else tempfile.TemporaryDirectory(prefix="layerfreeze-plan-check-")
    run_dir = Path(config.run.dir) if scratch is None else Path(scratch.name)
    checked = load_config(args.config, [*overrides, {"train": {"max_steps": steps}, "run": {
        "dir": str(run_dir), "ledger": True, "ledger_every": 1, "checkpoint": False, "tensorboard": False,
        "progress": not args.no_progress}}])
    console.print(f"check: training {steps} step{'s' if steps != 1 else ''} under the plan in "
                  + (f"{run_dir}" if scratch is None else "a temporary folder (removed after; --run-dir keeps it)"),
                  highlight=False)
    try:
        summary = Trainer(checked).run()
    except KeyboardInterrupt:  # the plan above stands; the check is a measurement, nothing to resume
        console.print("check: interrupted; the plan above stands (no check figures)", highlight=False)
        return 130
    finally:
        if scratch is not None:
            scratch.cleanup()
    got = summary["memory_plan"]
    seen = min(summary["steps"] * checked.train.batch_size, cache.samples) if cache is not None else 0
    for_steps = plan.predicted_for_samples(seen)
    measured_peak = got["measured_peak_bytes"]
    console.print(
        f"check: predicted tensor peak {format_bytes(for_steps)} for these {summary['steps']} "
        f"step{'s' if summary['steps'] != 1 else ''}"
        + (f" (the cache holding {seen} of {cache.samples} samples; {format_bytes(plan.predicted_peak_bytes)} once "
           "it holds them all)" if cache is not None and chosen.cache_budget_bytes is not None else "")
        + f", measured {format_bytes(measured_peak)}: {100 * (measured_peak / for_steps - 1):+.1f}%; "
        + ("within" if measured_peak <= plan.budget_bytes else "[bold red]over[/]")
        + f" the budget of {format_bytes(plan.budget_bytes)}", highlight=False)
    return 0


def cmd_blocks(args: argparse.Namespace, console: Console) -> int:
    from layerfreeze.models.blocks import describe_blocks, unassigned_warning
    from layerfreeze.models.discovery import find_blocks
    from layerfreeze.train.tasks import build_model

    config = load_config(args.config, overrides_of(args, {"task": "task", "model": "model.name_or_path",
                                                        "data": "data.path"}), inputs=False)
    model, model_name = build_model(config)
    found = find_blocks(model, config.model.blocks)
    console.print(f"{model_name}: {len(found.blocks)} blocks (front to back; the last is the head)")
    console.print(f"rule: {found.rule}", highlight=False)
    console.print(describe_blocks(found.blocks), highlight=False)
    for line in found.ties:
        console.print(f"tied: {line}", highlight=False)
    if (unassigned := unassigned_warning(model, found.blocks)) is not None:
        console.print(f"not in any block: {unassigned}", highlight=False)
    sized = {"text-csv": Path.is_file, "image-folder": Path.is_dir}.get(config.task)  # what build_model reads
    if sized is not None and not (config.data.path and sized(Path(config.data.path))):
        console.print("head: sized here for 2 classes (no --data to read the classes from: a CSV file for "
                      "text-csv, a folder for image-folder); a run sizes it for the classes in its data (the other "
                      "blocks do not change)", highlight=False)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from layerfreeze.train.config_yaml import config_yaml
    from layerfreeze.train.setup import build_strategy

    flags = {k: TRAIN_FLAGS[k] for k in ("task", "model", "data", "strategy")}
    config = load_config(args.config, overrides_of(args, flags), inputs=False)
    build_strategy(config)  # its parameter values checked as `train` checks them (the model's block count aside)
    sys.stdout.write(config_yaml(config, preset_as_comment=not args.config))  # presets stay presets (a file's own)
    return 0


def cmd_strategies(console: Console) -> int:
    for name, cls in sorted(STRATEGIES.items()):
        params = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v!r}"
                           for k, v in strategy_parameters(name).items()) or "-"
        doc = (inspect.getdoc(cls) or "").splitlines()[0].replace("``", "`")  # reST literals, as people read them
        default = "  (default)" if name == DEFAULT_STRATEGY else ""
        console.print(f"[bold]{name}[/]{default}  params: {params}\n    {doc}", highlight=False)
    return 0


def cmd_assets(console: Console) -> int:
    missing = 0
    for name, status in check_assets().items():
        ok = Path(status).exists()
        missing += not ok
        console.print(f"{'ok' if ok else 'MISSING':>7}  {name:<14} {status}", highlight=False)
    return 0 if missing == 0 else 2
