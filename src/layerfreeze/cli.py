"""``layerfreeze`` command line: ``train``, ``compare``, ``plan``, ``blocks``, ``report``, ``predictor``, ``config``,
``strategies``, ``assets``.

Exit codes: 0 success; 2 bad input (config, strategy, missing asset, undiscoverable blocks, bad checkpoint, a memory
budget nothing meets) found before training starts; 130 interrupted (a resumable checkpoint was written); 1 the run
was stopped (a peer rank was lost, the loss diverged or sat at chance level, a frozen weight moved; the last
checkpoint is resumable).
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console

from layerfreeze.distributed.comm import RankLostError, close_distributed, launched_world_size
from layerfreeze.errors import ConfigError, UnknownStrategyError, UserError
from layerfreeze.runs import rundir
from layerfreeze.strategies import DEFAULT_STRATEGY, STRATEGIES, strategy_parameters
from layerfreeze.strategies.registry import did_you_mean
from layerfreeze.train.assets import check_assets
from layerfreeze.train.compare import DEFAULT_ROWS, unknown_rows
from layerfreeze.train.config import load_config, parse_override

# flag -> config key (the flag's value is parsed as YAML, like --set)
TRAIN_FLAGS = {
    "task": "task",
    "model": "model.name_or_path",
    "data": "data.path",
    "strategy": "freeze.strategy",
    "epochs": "train.epochs",
    "batch_size": "train.batch_size",
    "lr": "train.lr",
    "seed": "train.seed",
    "max_steps": "train.max_steps",
    "limit_train": "data.limit_train",
    "limit_test": "data.limit_test",
    "run_dir": "run.dir",
    "device": "run.device",
    "parallel": "run.parallel",
    "memory_budget": "freeze.memory_budget",
}


def _main_rank() -> bool:
    """Whether this process speaks: rank 0 under torchrun (``RANK``), or the only process."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with errors that say what to do: an option's value that starts with ``-`` (``--memory
    -1GiB``) is named with the ``--option=VALUE`` form, an unknown option gets the closest known one and the usage of
    its own subcommand, and under torchrun only rank 0 prints (every rank exits with code 2)."""

    def error(self, message: str) -> NoReturn:
        found = re.search(r"argument (\S+?)(?:/\S+)?: expected one argument", message)
        if found:
            message += (f" (a value that starts with '-' is written {found.group(1)}=VALUE, e.g. "
                        f"{found.group(1)}=-1; see {self.prog} --help)")
        if _main_rank():
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)

    def unknown(self, extras: list[str]) -> NoReturn:
        """Refuse arguments this (sub)command does not take, naming the closest option it has."""
        known = [s for action in self._actions for s in action.option_strings]
        hints = []
        for item in extras:
            flag = item.split("=", 1)[0]
            if flag.startswith("-"):
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
                if close:
                    hints.append(f"{flag}: did you mean {close[0]}?")
        self.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else "")
                   + f"; {self.prog} --help lists the options")


def _parser() -> _Parser:
    parser = _Parser(
        prog="layerfreeze",
        description="Train neural networks cheaper by freezing blocks as they train.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.subcommands = {}  # type: ignore[attr-defined]  # name -> its parser (errors name their subcommand)

    def add(name: str, **kw: Any) -> _Parser:
        p = sub.add_parser(name, **kw)
        parser.subcommands[name] = p  # type: ignore[attr-defined]
        return p

    train = add(
        "train",
        help="train with a freezing strategy (no arguments: MiniLM-L6 on BBC News)",
        description="Train with a freezing strategy. With no arguments: fine-tune MiniLM-L6 on BBC News with the "
        f"default strategy ({DEFAULT_STRATEGY}). Config sections: task, model, data, train, freeze, run "
        "(`layerfreeze config` prints every key with its default).",
        epilog="examples:\n  layerfreeze train\n  layerfreeze train --strategy none --epochs 3\n"
        "  layerfreeze train --task fashion-mnist --strategy static -p k=8\n"
        "  layerfreeze train --config run.yaml --set train.lr=3e-5\n  layerfreeze train --resume runs/my-run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_arguments(train)
    train.add_argument("--memory-budget", metavar="BUDGET", help=MEMORY_BUDGET_HELP)
    train.add_argument("--parallel", metavar="{ddp,fsdp}",
                       help="under torchrun: ddp (default: every rank holds the whole model) or fsdp (FSDP2: every "
                       "rank holds a shard of each parameter)")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its checkpoint")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--no-tensorboard", action="store_true", help="no TensorBoard event files")
    train.add_argument("--no-ledger", action="store_true",
                       help="no memory ledger (run.ledger: false; --set run.ledger_every=N sets its cadence)")
    train.add_argument("--no-report", action="store_true", help="no HTML report at the end")

    comp = add(
        "compare",
        help="run several strategies (and a LoRA row) on one task with the same seed and budget, print a table",
        description="Run strategies one after another in one process, same seed, data order and budget; print and "
        "save a table (the task's metric: test accuracy, or perplexity for text-lm; wall time and FLOPs with ratios "
        "to none, peak memory, what froze when).",
        epilog="examples:\n  layerfreeze compare --epochs 3\n  layerfreeze compare --rows none,static,smartfrz "
        "-p static.k=3\n  layerfreeze compare --rows none,lisa,badam,lora --row-set lora.train.lr=1e-3",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    comp.add_argument("--rows", help=f"comma-separated strategies, each once, 'lora' for the LoRA row (rank 8), "
                      f"'lora-r4' for LoRA of rank 4 (default: {','.join(DEFAULT_ROWS)}, those registered)")
    comp.add_argument("--config", "-c", help="YAML, TOML or JSON config file (its freeze.params apply to its "
                      "strategy's row; a run's config.json works too)")
    for flag, what in RUN_FLAG_HELP.items():
        if flag not in ("strategy",):
            comp.add_argument(f"--{flag}", type=RUN_FLAG_TYPES.get(flag), help=what)
    comp.add_argument("--memory-budget", metavar="BUDGET", help=MEMORY_BUDGET_HELP + " (every row)")
    comp.add_argument("--row-param", "-p", action="append", default=[], metavar="ROW.NAME=VALUE",
                      help="a parameter of one row's strategy, e.g. -p autofreeze.interval=20 (repeatable)")
    comp.add_argument("--row-set", action="append", default=[], metavar="ROW.KEY=VALUE",
                      help="a config key of one row only, e.g. --row-set lora.train.lr=1e-3 (repeatable)")
    comp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="any config key, for every row, e.g. --set model.max_length=64 (repeatable)")
    comp.add_argument("--no-progress", action="store_true", help="no progress bar")
    comp.add_argument("--no-report", action="store_true", help="no HTML report at the end")

    plan = add(
        "plan", help="what to freeze to fit a memory budget: each block's bytes measured, the frozen prefix that fits",
        description="Measure each block's bytes in every bucket (parameters, gradients, optimizer state, saved "
        "activations, the activation cache) on two real training steps at the run's batch size with nothing frozen, "
        "predict every frozen prefix's tensor peak (the memory ledger's figure), and print the shortest prefix that "
        "fits the budget, its predicted peak and what it gives up. The task/model/data flags are train's; `layerfreeze "
        "train --memory-budget BUDGET` with the same flags applies the plan.",
        epilog="examples:\n  layerfreeze plan --memory 3GiB\n  layerfreeze plan --memory 60% --task fashion-mnist "
        "--check 20\n  layerfreeze plan --memory 800MiB --set model.max_length=64 --json plan.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("--memory", "-m", required=True, metavar="BUDGET",
                      help="the budget: 3GiB, 800MiB, 2.5GB, 1000000B (a size), or 0.6 / 60%% (of the tensor peak "
                      "with nothing frozen)")
    plan.add_argument("--check", type=int, metavar="N", help="then train N steps under the plan (at most the run's "
                      "length) and print the predicted against the measured tensor peak")
    plan.add_argument("--json", metavar="FILE", help="also write the plan (every prefix's cost) as JSON")
    _add_run_arguments(plan)
    plan.add_argument("--no-progress", action="store_true", help="no progress bar (--check)")

    blocks = add("blocks", help="show the blocks of a task's model (what strategies freeze)",
                 description="Build the task's model (no data is read) and list its blocks front to back, the rule "
                 "that found them and the weights two blocks share.",
                 epilog="examples:\n  layerfreeze blocks\n  layerfreeze blocks --task fashion-mnist --model resnet18\n"
                 "  layerfreeze blocks --task text-lm --model path/to/causal-lm-folder",
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    blocks.add_argument("--config", "-c", help="YAML, TOML or JSON config file")
    for flag in ("task", "model"):
        blocks.add_argument(f"--{flag}", help=RUN_FLAG_HELP[flag])
    blocks.add_argument("--data", help="not needed (no data is read); accepted for train's command lines")
    blocks.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any config key, e.g. --set model.blocks='[stem, layers.*, head]' (repeatable)")

    rep = add("report", help="write an HTML report with PNG plots for a run or compare folder",
              description="Write report.html with PNG plots (loss, accuracy, what froze when, memory by bucket) for "
              "a folder written by `layerfreeze train` or `compare` (needs matplotlib).")
    rep.add_argument("run_dir", metavar="RUN_DIR", help="a folder written by `layerfreeze train` or `compare`")

    from layerfreeze.smartfrz import cli as smartfrz_cli

    parser.subcommands["predictor"] = smartfrz_cli.add_parser(sub)  # type: ignore[attr-defined]

    conf = add(
        "config", help="print the full run configuration: every key with its default (YAML, a config file to edit)",
        description="Print every config key with its value and what it means, as a YAML config file: the defaults, "
        "or what the given task, strategy, config file and --set make of them (presets filled in). No data or model "
        "is needed.",
        epilog="examples:\n  layerfreeze config > run.yaml\n  layerfreeze config --task fashion-mnist -s static\n"
        "  layerfreeze config --config runs/my-run/config.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    conf.add_argument("--config", "-c", help="YAML, TOML or JSON config file to start from")
    for flag in ("task", "model", "data", "strategy"):
        conf.add_argument(f"--{flag}", *(["-s"] if flag == "strategy" else []), help=RUN_FLAG_HELP[flag])
    conf.add_argument("--param", "-p", action="append", default=[], metavar="NAME=VALUE",
                      help="strategy parameter, e.g. -p k=5 (repeatable)")
    conf.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="any config key, e.g. --set train.lr=3e-5 (repeatable)")

    add("strategies", help="list the freezing strategies and their parameters",
        description="List every registered freezing strategy with its parameters and their defaults (set them with "
        "-p NAME=VALUE) and the first line of its description; the default strategy is marked.")
    add("assets", help="check the offline assets (models, datasets) and how to install missing ones",
        description="Check which offline assets are installed (MiniLM-L6, BBC News, MobileNetV2 weights, "
        "Fashion-MNIST) and print where each is, or the command that installs it; exit code 2 when one is missing.")
    return parser


#: Help of the flags that configure a run (``train``, ``plan``; ``compare`` takes them but the strategy).
RUN_FLAG_HELP = {
    "task": "bbc-news (default), fashion-mnist, text-csv, image-folder, text-lm",
    "model": "local Hugging Face model folder (text-lm: a causal LM), or mobilenet_v2 / resnet18",
    "data": "CSV file (text-csv), image folder (image-folder), text or CSV file (text-lm)",
    "strategy": f"freezing strategy (default {DEFAULT_STRATEGY}): {', '.join(sorted(STRATEGIES))}",
    "epochs": "passes over the training data",
    "batch-size": "samples per optimizer step (the global batch under torchrun)",
    "lr": "learning rate of the head",
    "seed": "seed of weights, data order and dropout",
    "max-steps": "stop after this many optimizer steps",
    "limit-train": "use only N training samples (a seeded subset)",
    "limit-test": "use only N test samples (a seeded subset)",
    "run-dir": "output folder (default runs/<task>-<strategy>-<time>)",
    "device": "auto (default), cpu, cuda, cuda:N",
}
RUN_FLAG_TYPES: dict[str, Any] = {"epochs": int, "batch-size": int, "seed": int, "max-steps": int,
                                  "limit-train": int, "limit-test": int, "lr": float}
MEMORY_BUDGET_HELP = ("tensor-peak budget (3GiB, 800MiB, 1000000B, or 0.6 / 60%% of the peak with nothing frozen): "
                      "freeze the shortest prefix that fits from the start and never thaw it (`layerfreeze plan` "
                      "shows it)")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that configure a run (``train`` and ``plan`` share them: :data:`TRAIN_FLAGS`, ``--param``,
    ``--set``)."""
    parser.add_argument("--config", "-c", help="YAML, TOML or JSON config file (a run's config.json works too)")
    for flag, what in RUN_FLAG_HELP.items():
        names = [f"--{flag}", "-s"] if flag == "strategy" else [f"--{flag}"]
        parser.add_argument(*names, type=RUN_FLAG_TYPES.get(flag), help=what)
        if flag == "strategy":
            parser.add_argument("--param", "-p", action="append", default=[], metavar="NAME=VALUE",
                                help="strategy parameter, e.g. -p k=5 (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any config key, e.g. --set train.warmup_fraction=0.06 (repeatable)")


def _overrides(args: argparse.Namespace, flags: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for attr, key in flags.items():
        value = getattr(args, attr, None)
        if attr == "memory_budget" and value is not None:  # a string, as written: "60" is never 60 bytes
            out.append({"freeze": {"memory_budget": str(value)}})
        elif value is not None:
            out.append(parse_override(f"{key}={value}"))
    for item in getattr(args, "param", []):
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--param {item!r} must look like NAME=VALUE, e.g. -p k=5")
        out.append(parse_override(f"freeze.params.{name}={value}"))
    out.extend(parse_override(item) for item in args.set)
    if getattr(args, "no_progress", False):
        out.append({"run": {"progress": False}})
    if getattr(args, "no_tensorboard", False):
        out.append({"run": {"tensorboard": False}})
    if getattr(args, "no_ledger", False):
        out.append({"run": {"ledger": False}})
    return out


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


def _cmd_train(args: argparse.Namespace, console: Console) -> int:
    from layerfreeze.engine.integrity import FrozenWeightsChangedError, UnfrozenParameterError
    from layerfreeze.runs.summary import print_summary
    from layerfreeze.train.step import DivergenceError
    from layerfreeze.train.trainer import Trainer

    overrides = _overrides(args, TRAIN_FLAGS)
    config_path = args.config
    if args.resume:
        run_dir = Path(args.resume)
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
        saved_strategy = (saved.get("freeze") or {}).get("strategy")
        if args.strategy is not None and args.strategy != saved_strategy:
            raise ConfigError(f"--resume {run_dir}: the run's strategy is {saved_strategy!r}; a resumed run keeps it "
                              "(drop --strategy, or start a new run)")
        overrides = [saved, *overrides]
    config = load_config(config_path, overrides)
    if args.resume:
        _check_resume_parallel(Path(args.resume), saved, config.run.parallel)
    world = launched_world_size()
    main_rank = _main_rank()  # under torchrun rank 0 alone speaks
    shown: list[bool] = []

    def show_run_dir(trainer: Trainer) -> None:
        """Name the run folder once it exists (before the first step): a run that fails while it is being set up
        (a missing asset, undiscoverable blocks) never creates it, so it must not be named before."""
        if main_rank and not shown and trainer.run_dir.is_dir():
            shown.append(True)
            console.print(f"run dir {trainer.run_dir}", highlight=False)

    trainer = Trainer(config, step_callbacks=[show_run_dir])
    checkpoint = trainer.run_dir / rundir.CHECKPOINT_LINK
    again = f"torchrun --nproc_per_node {world} -m layerfreeze" if world > 1 else "layerfreeze"
    if main_rank:
        console.print(run_header(config, world), highlight=False)
    try:
        summary = trainer.run()
    except KeyboardInterrupt:
        if trainer.stopped_together:
            close_distributed()  # every rank stopped after the same step, checkpointed: none is in a collective
        if main_rank:
            if (trainer.run_dir / rundir.CHECKPOINTS_DIR).is_dir():
                console.print(f"\nInterrupted. A checkpoint is in {checkpoint}; continue with:\n"
                              f"  {again} train --resume {trainer.run_dir}")
            else:
                console.print("\nInterrupted before the first checkpoint; nothing to resume.")
        return 130
    except (DivergenceError, FrozenWeightsChangedError, UnfrozenParameterError) as exc:
        Console(stderr=True, soft_wrap=True).print(
            f"[bold red]layerfreeze: run stopped:[/] {exc}\nThe last checkpoint is in {checkpoint} "
            f"(continue with: {again} train --resume {trainer.run_dir})", highlight=False)
        return 1
    except RankLostError as exc:
        Console(stderr=True, soft_wrap=True).print(
            f"[bold red]layerfreeze: error:[/] {exc}\nThe last complete checkpoint in {checkpoint} "
            f"is resumable: {again} train --resume {trainer.run_dir}", highlight=False)
        return 1
    close_distributed()  # every rank finished; a gloo group left alive can abort the exit (SIGABRT)
    if not main_rank:
        return 0
    print_summary(summary, console=console)
    metrics = trainer.run_dir / rundir.METRICS_FILE
    console.print(f"metrics: {metrics}   TensorBoard: tensorboard --logdir {trainer.run_dir}")
    _report(trainer.run_dir, args, console)
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
    if freeze.demote is not None:
        d = freeze.demote
        what = " + ".join(x for x in (d.dtype, f"offload {d.offload}" if d.offload else None) if x)
        parts.append(f"demote {what} (float32 master copies: {d.master})")
    return " | ".join(parts)


def _report(run_dir: Path | str, args: argparse.Namespace, console: Console) -> None:
    """The HTML report at the end of train/compare (skipped with --no-report or without matplotlib)."""
    if getattr(args, "no_report", False):
        return
    from layerfreeze.runs.report import write_report

    try:
        console.print(f"report: {write_report(run_dir)}")
    except ImportError as exc:
        console.print(f"report skipped: {exc}")


def _cmd_compare(args: argparse.Namespace, console: Console) -> int:
    import time

    from layerfreeze.train.compare import compare
    from layerfreeze.train.config import deep_merge, read_config_file

    if args.rows is not None and not args.rows.strip(", "):
        raise ConfigError("--rows is empty; name the rows, e.g. --rows none,static,smartfrz (omit it for all)")
    rows = [r.strip() for r in args.rows.split(",") if r.strip()] if args.rows else \
        [r for r in DEFAULT_ROWS if r in STRATEGIES or r == "lora"]
    unknown = unknown_rows(rows)
    if unknown:
        guesses = "".join(did_you_mean(r, [*STRATEGIES, "lora"]) for r in unknown)
        raise UnknownStrategyError(f"Unknown row(s) {', '.join(unknown)}{guesses}; available: "
                                   f"{', '.join(sorted(STRATEGIES))}, lora (rank 8), lora-r<N> (rank N)")
    base: dict[str, Any] = read_config_file(args.config) if args.config else {}
    for override in _overrides(args, {k: v for k, v in TRAIN_FLAGS.items() if k != "strategy"}):
        base = deep_merge(base, override)
    task = base.get("task", "bbc-news")
    run_dir = base.get("run", {}).get("dir") or f"runs/compare-{task}-{time.strftime('%Y%m%d-%H%M%S')}"
    row_params: dict[str, dict[str, Any]] = {}
    for item in args.row_param:
        key, sep, _ = item.partition("=")
        row, dot, name = key.partition(".")
        if not sep or not dot or row not in rows:
            raise ConfigError(f"--row-param {item!r} must look like ROW.NAME=VALUE with ROW one of {', '.join(rows)}")
        row_params = deep_merge(row_params, parse_override(item))
    row_overrides: dict[str, dict[str, Any]] = {}
    for item in args.row_set:
        key, sep, _ = item.partition("=")
        row, dot, name = key.partition(".")
        if not sep or "." not in name or row not in rows:
            raise ConfigError(f"--row-set {item!r} must look like ROW.SECTION.KEY=VALUE with ROW one of "
                              f"{', '.join(rows)}")
        row_overrides = deep_merge(row_overrides, parse_override(item))
    results = compare(base, rows, run_dir, console=console, row_params=row_params, row_overrides=row_overrides)
    console.print(f"table: {Path(run_dir) / rundir.COMPARE_MD}   rows: {Path(run_dir) / rundir.COMPARE_JSON}   "
                  f"({len(results)} runs)")
    _report(run_dir, args, console)
    stopped = [r["row"] for r in results if r.get("stopped")]
    if stopped:  # the table is complete for the others; the exit code says not every row finished
        Console(stderr=True, soft_wrap=True).print(
            f"[bold red]layerfreeze: rows stopped before their end:[/] {', '.join(stopped)} (why: the table's last "
            f"column and compare.json; each one's run folder holds its last checkpoint)", highlight=False)
        return 1
    return 0


def _cmd_plan(args: argparse.Namespace, console: Console) -> int:
    import tempfile

    from rich.table import Table

    from layerfreeze.budget.plan import ROW_NOTES
    from layerfreeze.runs.summary import format_bytes
    from layerfreeze.train.setup import plan_headline
    from layerfreeze.train.trainer import Trainer

    overrides = [*_overrides(args, TRAIN_FLAGS), {"freeze": {"memory_budget": args.memory}}]
    config = load_config(args.config, overrides)
    if args.check is not None and args.check < 1:
        raise ConfigError(f"--check {args.check}: give the number of training steps to check the plan on (>= 1)")
    trainer = Trainer(config)
    trainer.setup(plan_only=True)
    plan = trainer.memory_plan
    measured = plan.measured
    cache = measured.cache
    console.print(f"[bold]layerfreeze plan[/] {config.task} | {trainer.task.model_name} ({len(plan.block_names)} "
                  f"blocks) | batch {measured.batch_size} | strategy {config.freeze.strategy} | cache "
                  + (f"on ({cache.samples} samples, {cache.dtype})" if cache is not None else "off"), highlight=False)
    console.print(plan_headline(plan), highlight=False)
    b = measured.buckets
    console.print(f"measured on {measured.steps} real steps with nothing frozen: tensor peak "
                  f"{format_bytes(plan.none_peak_bytes)} (parameters {format_bytes(b.get('params_trainable', 0))}, "
                  f"gradients {format_bytes(b.get('grads', 0))}, optimizer state "
                  f"{format_bytes(b.get('optimizer', 0))}, "
                  f"saved activations {format_bytes(b.get('activations', 0))}, buffers "
                  f"{format_bytes(b.get('buffers', 0))})", highlight=False)
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
        Path(args.json).write_text(json.dumps(plan.to_dict(), indent=2))
        console.print(f"plan: {args.json}")
    if args.check is None:
        return 0
    steps = args.check
    if steps > trainer.total_steps:
        console.print(f"check: --check {steps} is more than the run's {trainer.total_steps} steps "
                      f"({config.train.epochs} epoch(s) of {trainer.batches_per_epoch}); checking all "
                      f"{trainer.total_steps}", highlight=False)
        steps = trainer.total_steps
    run_dir = Path(config.run.dir) if config.run.dir else Path(tempfile.mkdtemp(prefix="layerfreeze-plan-check-"))
    checked = load_config(args.config, [*overrides, {"train": {"max_steps": steps}, "run": {
        "dir": str(run_dir), "ledger": True, "ledger_every": 1, "checkpoint": False, "tensorboard": False,
        "progress": not args.no_progress}}])
    console.print(f"check: training {steps} steps under the plan in {run_dir}", highlight=False)
    summary = Trainer(checked).run()
    got = summary["memory_plan"]
    seen = min(summary["steps"] * checked.train.batch_size, cache.samples) if cache is not None else 0
    for_steps = plan.predicted_for_samples(seen)
    measured_peak = got["measured_peak_bytes"]
    console.print(
        f"check: predicted tensor peak {format_bytes(for_steps)} for these {summary['steps']} steps"
        + (f" (the cache holding {seen} of {cache.samples} samples; {format_bytes(plan.predicted_peak_bytes)} once "
           "it holds them all)" if cache is not None and chosen.cache_budget_bytes is not None else "")
        + f", measured {format_bytes(measured_peak)}: {100 * (measured_peak / for_steps - 1):+.1f}%; "
        + ("within" if measured_peak <= plan.budget_bytes else "[bold red]over[/]")
        + f" the budget of {format_bytes(plan.budget_bytes)}", highlight=False)
    return 0


def _cmd_blocks(args: argparse.Namespace, console: Console) -> int:
    from layerfreeze.models.blocks import describe_blocks
    from layerfreeze.models.discovery import find_blocks
    from layerfreeze.train.tasks import build_model

    config = load_config(args.config, _overrides(args, {"task": "task", "model": "model.name_or_path",
                                                        "data": "data.path"}), inputs=False)
    model, model_name = build_model(config)
    found = find_blocks(model, config.model.blocks)
    console.print(f"{model_name}: {len(found.blocks)} blocks (front to back; the last is the head)")
    console.print(f"rule: {found.rule}", highlight=False)
    console.print(describe_blocks(found.blocks), highlight=False)
    for line in found.ties:
        console.print(f"tied: {line}", highlight=False)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from layerfreeze.train.config import config_yaml

    flags = {k: TRAIN_FLAGS[k] for k in ("task", "model", "data", "strategy")}
    sys.stdout.write(config_yaml(load_config(args.config, _overrides(args, flags), inputs=False)))
    return 0


def _cmd_strategies(console: Console) -> int:
    for name, cls in sorted(STRATEGIES.items()):
        params = ", ".join(f"{k}={v!r}" for k, v in strategy_parameters(name).items()) or "-"
        doc = (inspect.getdoc(cls) or "").splitlines()[0]
        default = "  (default)" if name == DEFAULT_STRATEGY else ""
        console.print(f"[bold]{name}[/]{default}  params: {params}\n    {doc}", highlight=False)
    return 0


def _cmd_assets(console: Console) -> int:
    missing = 0
    for name, status in check_assets().items():
        ok = Path(status).exists()
        missing += not ok
        console.print(f"{'ok' if ok else 'MISSING':>7}  {name:<14} {status}", highlight=False)
    return 0 if missing == 0 else 2


def _subparser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)subcommand ``args`` was parsed by (``predictor collect``'s, ``train``'s, ...)."""
    current = parser
    while True:
        found = None
        for action in current._actions:  # argparse keeps its subparsers in these actions
            if isinstance(action, argparse._SubParsersAction):
                name = getattr(args, action.dest or "", None)
                found = action.choices.get(name) if name else None
        if found is None:
            return current
        current = found


def _leave_process_group() -> None:
    """After an error, destroy the process group torchrun's ranks joined, if any (no barrier: a peer may not reach
    it), so the exit is a plain exit code and not gloo's "terminate called without an active exception"."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    """The library's own warnings as one line for people (``layerfreeze: warning: ...``, rank 0 alone); other
    packages' warnings as Python prints them."""
    if "layerfreeze" not in Path(filename).parts:
        _PYTHON_SHOWWARNING(message, category, filename, lineno, file, line)
    elif _main_rank():
        Console(stderr=True, soft_wrap=True).print(f"[bold yellow]layerfreeze: warning:[/] {message}",
                                                   highlight=False)


_PYTHON_SHOWWARNING = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``layerfreeze`` command; returns the exit code.

    Every problem with the input is one line on stderr, ``layerfreeze: error: ...`` (under torchrun from rank 0
    alone; every rank exits with the same code), and exit code 2, before anything trains.
    """
    parser = _parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _subparser(parser, args).unknown(extras)  # type: ignore[attr-defined]
    # Logs and pipes get 120 columns (tables fold to fit); terminals keep their own width.
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 120)
    err = Console(stderr=True, soft_wrap=True)
    if args.command is None:
        parser.print_help()
        return 0
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            return _run(args, console)
        except (UserError, FileNotFoundError) as exc:
            if _main_rank():
                err.print(f"[bold red]layerfreeze: error:[/] {exc}", highlight=False)
            _leave_process_group()
            return 2


def _run(args: argparse.Namespace, console: Console) -> int:
    """Run the subcommand ``args`` names; its exit code."""
    if args.command == "train":
        return _cmd_train(args, console)
    if args.command == "compare":
        return _cmd_compare(args, console)
    if args.command == "plan":
        return _cmd_plan(args, console)
    if args.command == "blocks":
        return _cmd_blocks(args, console)
    if args.command == "report":
        from layerfreeze.runs.report import write_report

        console.print(f"report: {write_report(args.run_dir)}")
        return 0
    if args.command == "predictor":
        from layerfreeze.smartfrz import cli as smartfrz_cli

        return smartfrz_cli.run(args, console)
    if args.command == "config":
        return _cmd_config(args)
    if args.command == "strategies":
        return _cmd_strategies(console)
    return _cmd_assets(console)


if __name__ == "__main__":
    sys.exit(main())
