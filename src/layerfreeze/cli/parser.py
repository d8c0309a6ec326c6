"""The command line's arguments: the parser of every subcommand (argparse), its errors, and the config overrides
the flags make. Imported by :mod:`layerfreeze.cli.commands` and :mod:`layerfreeze.cli.entry`."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import Any, NoReturn

from layerfreeze._version import __version__
from layerfreeze.budget.parse import BUDGET_FORMS
from layerfreeze.distributed.comm import launched_main_rank
from layerfreeze.errors import ConfigError
from layerfreeze.strategies import DEFAULT_STRATEGY, STRATEGIES
from layerfreeze.train.compare import DEFAULT_ROWS
from layerfreeze.train.config_file import parse_override

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
    "precision": "train.precision",
    "compile": "train.compile",
}


def main_rank() -> bool:
    """Whether this process speaks: rank 0 under torchrun (``RANK``), or the only process."""
    return launched_main_rank()


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """A description wraps to the terminal's width; an epilog of examples (indented lines) keeps its line breaks."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n  " in text:
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


class Parser(argparse.ArgumentParser):
    """argparse's parser, with errors that say what to do, on one line (no usage block: the line names the
    subcommand's ``--help``): an option's value that starts with ``-`` (``--memory -1GiB``) is named with the
    ``--option=VALUE`` form, an unknown option gets the closest known one, and under torchrun only rank 0 prints
    (every rank exits with code 2)."""

    def error(self, message: str) -> NoReturn:
        found = re.search(r"argument (\S+?)(?:/\S+)?: expected one argument", message)
        if found:
            message += (f" (a value that starts with '-' is written {found.group(1)}=VALUE; see {self.prog} "
                        "--help)")
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            options = [c.strip(" '") for c in choice.group(2).split(",")]
            close = difflib.get_close_matches(choice.group(1), options, n=1, cutoff=0.6)
            if close:
                message += f" (did you mean {close[0]}?)"
        if "--help" not in message:
            message += f"; {self.prog} --help lists the options"
        if main_rank():
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
        self.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else ""))


def build_parser() -> Parser:
    parser = Parser(
        prog="layerfreeze",
        description="Train neural networks cheaper by freezing blocks as they train.",
    )
    parser.add_argument("--version", action="version", version=f"layerfreeze {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.subcommands = {}  # type: ignore[attr-defined]  # name -> its parser (errors name their subcommand)

    def add(name: str, **kw: Any) -> Parser:
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
        formatter_class=HelpFormatter,
    )
    add_run_arguments(train)
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
        formatter_class=HelpFormatter)
    comp.add_argument("--rows", help=f"comma-separated strategies, each once, 'lora' for the LoRA row (rank 8), "
                      f"'lora-r4' for LoRA of rank 4 (default: {', '.join(DEFAULT_ROWS)}, those registered)")
    comp.add_argument("--config", "-c", help="YAML, TOML or JSON config file (its freeze.params apply to its "
                      "strategy's row; a run's config.json works too)")
    for flag, what in RUN_FLAG_HELP.items():
        if flag not in ("strategy",):
            what = ("output folder (default runs/compare-<task>-<time>), one run folder per row in it"
                    if flag == "run-dir" else what)
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
        formatter_class=HelpFormatter)
    plan.add_argument("--memory", "-m", required=True, metavar="BUDGET",
                      help=f"tensor-peak budget: {BUDGET_FORMS_HELP}")
    plan.add_argument("--check", type=int, metavar="N", help="then train N steps under the plan (at most the run's "
                      "length) and print the predicted against the measured tensor peak")
    plan.add_argument("--json", metavar="FILE", help="also write the plan (every prefix's cost) as JSON")
    add_run_arguments(plan, run_dir_help="with --check: the folder the check's run is kept in (default: a "
                      "temporary folder, removed after); without --check nothing is written")
    plan.add_argument("--no-progress", action="store_true", help="no progress bar (--check)")

    blocks = add("blocks", help="show the blocks of a task's model (what strategies freeze)",
                 description="Build the task's model (no data is read) and list its blocks front to back, the rule "
                 "that found them and the weights two blocks share.",
                 epilog="examples:\n  layerfreeze blocks\n  layerfreeze blocks --task fashion-mnist --model resnet18\n"
                 "  layerfreeze blocks --task text-lm --model path/to/causal-lm-folder",
                 formatter_class=HelpFormatter)
    blocks.add_argument("--config", "-c", help="YAML, TOML or JSON config file")
    for flag in ("task", "model"):
        blocks.add_argument(f"--{flag}", help=RUN_FLAG_HELP[flag])
    blocks.add_argument("--data", help="not needed (no data is read); accepted for train's command lines")
    blocks.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any config key, e.g. --set model.blocks='[stem, layers.*, head]' (repeatable)")

    rep = add("report", help="write an HTML report with PNG plots for a run or compare folder",
              description="Write RUN_DIR/report/index.html with PNG plots (loss, accuracy, what froze when, memory by "
              "bucket) for a folder written by `layerfreeze train` or `compare` (needs matplotlib).")
    rep.add_argument("run_dir", metavar="RUN_DIR", help="a folder written by `layerfreeze train` or `compare`")

    from layerfreeze.smartfrz import parser as smartfrz_parser

    parser.subcommands["predictor"] = smartfrz_parser.add_parser(sub)  # type: ignore[attr-defined]

    conf = add(
        "config", help="print the full run configuration: every key with its default (YAML, a config file to edit)",
        description="Print every config key with its value and what it means, as a YAML config file: the defaults, "
        "or what the given task, strategy, config file and --set make of them (presets filled in). No data or model "
        "is needed.",
        epilog="examples:\n  layerfreeze config > run.yaml\n  layerfreeze config --task fashion-mnist -s static\n"
        "  layerfreeze config --config runs/my-run/config.json",
        formatter_class=HelpFormatter)
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
    "epochs": "passes over the training data (default: the task's; `layerfreeze config --task T` prints them)",
    "batch-size": "samples per optimizer step (the global batch under torchrun; default: the task's)",
    "lr": "learning rate of every block, the head's when train.lr_decay > 1 gives earlier blocks smaller ones "
          "(default: the task's)",
    "seed": "seed of weights, data order and dropout (default 0)",
    "max-steps": "stop after this many optimizer steps (default: none, the run's epochs decide)",
    "limit-train": "use only N training samples (a random subset drawn with data.split_seed; fashion-mnist: its "
                   "first N, stored in random order)",
    "limit-test": "use only N test samples (drawn as --limit-train's)",
    "run-dir": "output folder (default runs/<task>-<strategy>-<time>)",
    "device": "auto (default), cpu, cuda, cuda:N",
    "precision": "auto (default: bf16-mixed on a CUDA GPU with bfloat16, 32-true elsewhere), 32-true, bf16-mixed, "
                 "16-mixed or bf16-true (Lightning's names)",
    "compile": "torch.compile: false (default), blocks (each block on its own) or true (the whole model)",
}
RUN_FLAG_TYPES: dict[str, Any] = {"epochs": int, "batch-size": int, "seed": int, "max-steps": int,
                                  "limit-train": int, "limit-test": int, "lr": float}
#: The budget forms ``train --memory-budget``, ``compare --memory-budget`` and ``plan --memory`` list: the text
#: :func:`~layerfreeze.budget.parse.parse_budget`'s errors give (``%%``: argparse's escape of ``%``).
BUDGET_FORMS_HELP = BUDGET_FORMS.replace("%", "%%")
MEMORY_BUDGET_HELP = (f"tensor-peak budget: {BUDGET_FORMS_HELP}. Freezes the shortest prefix that fits from the start "
                      "and never thaws it (`layerfreeze plan` shows it)")


def add_run_arguments(parser: argparse.ArgumentParser, run_dir_help: str | None = None) -> None:
    """The flags that configure a run (``train`` and ``plan`` share them: :data:`TRAIN_FLAGS`, ``--param``,
    ``--set``); ``run_dir_help`` replaces ``--run-dir``'s help (what the folder is for in that subcommand)."""
    parser.add_argument("--config", "-c", help="YAML, TOML or JSON config file (a run's config.json works too)")
    for flag, what in RUN_FLAG_HELP.items():
        what = run_dir_help if flag == "run-dir" and run_dir_help else what
        names = [f"--{flag}", "-s"] if flag == "strategy" else [f"--{flag}"]
        parser.add_argument(*names, type=RUN_FLAG_TYPES.get(flag), help=what)
        if flag == "strategy":
            parser.add_argument("--param", "-p", action="append", default=[], metavar="NAME=VALUE",
                                help="strategy parameter, e.g. -p k=5 (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any config key, e.g. --set train.warmup_fraction=0.06 (repeatable)")


def refuse_repeats(items: list[str], flag: str) -> None:
    """Refuse a ``KEY=VALUE`` given twice with two values among ``items`` (``flag``'s, repeatable): the last one won,
    in silence (``-p k=1 -p k=2`` trained with k=2)."""
    given: dict[str, str] = {}
    for item in items:
        key, _, value = item.partition("=")
        key = key.strip()
        if key in given and given[key] != value:
            raise ConfigError(f"{flag} {key}={given[key]} and {flag} {item} set the same key; give it once")
        given[key] = value


def same_value(a: str, b: str) -> bool:
    """Two spellings of one value: equal as written, as YAML reads them (``true`` and ``True``) or as numbers (``0.1``
    and ``1e-1``)."""
    if a.strip() == b.strip() or parse_override(f"x={a}") == parse_override(f"x={b}"):
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def overrides_of(args: argparse.Namespace, flags: dict[str, str]) -> list[dict[str, Any]]:
    refuse_repeats(getattr(args, "param", []), "-p")
    refuse_repeats(args.set, "--set")
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
    given = dict(item.partition("=")[::2] for item in getattr(args, "param", []))
    flagged = {key: attr for attr, key in flags.items() if getattr(args, attr, None) is not None}
    for item in args.set:
        key, _, value = item.partition("=")
        attr = flagged.get(key.strip())
        if attr is not None and not same_value(value, str(getattr(args, attr))):
            # the --set won in silence: `--strategy static --set freeze.strategy=none` trained none
            raise ConfigError(f"--{attr.replace('_', '-')} {getattr(args, attr)} and --set {item} set the same key "
                              f"({key.strip()}); give it once")
        name = key.strip().removeprefix("freeze.params.")
        if key.strip().startswith("freeze.params.") and name in given and given[name] != value:
            raise ConfigError(f"-p {name}={given[name]} and --set {item} set the same strategy parameter; give it "
                              "once")
        out.append(parse_override(item))
    if getattr(args, "no_progress", False):
        out.append({"run": {"progress": False}})
    if getattr(args, "no_tensorboard", False):
        out.append({"run": {"tensorboard": False}})
    if getattr(args, "no_ledger", False):
        out.append({"run": {"ledger": False}})
    return out


def subparser_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
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
