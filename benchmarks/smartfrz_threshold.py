"""What SmartFRZ's decision threshold trades: accuracy against FLOPs and time, on the suite's own jobs.

SmartFRZ freezes a block when the predictor's ``p(freeze now) >= threshold``
(``layerfreeze.strategies.smartfrz.strategy``; the shipped predictor's card sets 0.85, the threshold its held-out
metrics were measured at). A higher threshold waits for a surer call: later freezes, fewer FLOPs saved, and (the
question) less accuracy lost. Per seed, one process trains `none` and then SmartFRZ at each threshold of
``--thresholds`` (same seed, data order and budget as ``benchmarks/suite.py``), and prints accuracy, time and measured
FLOPs per seed and row, and the mean over seeds.

    python -m benchmarks.smartfrz_threshold --task bbc --thresholds 0.95,0.99 --cache
    python -m benchmarks.smartfrz_threshold --task fmnist-mobilenet --thresholds 0.85,0.95 --seeds 0,1 --cache

The rows are the shipped predictor with another threshold, not another predictor; choosing the threshold on these
tasks' test accuracy would tune the default on the benchmark, so this script measures the trade-off only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from benchmarks import suite, suite_tasks  # the suite's task specs and configs: the same jobs
from benchmarks.cli import entry, seed_list
from layerfreeze.strategies import register_strategy
from layerfreeze.strategies.smartfrz.strategy import SmartFRZ


def row_name(threshold: float) -> str:
    """The compare row (and registered strategy) of SmartFRZ at ``threshold``: ``smartfrz-p0.95``."""
    return f"smartfrz-p{threshold:g}"


def threshold_strategy(name: str) -> type[SmartFRZ]:
    """A :class:`SmartFRZ` subclass registered as row ``name`` (:func:`suite.row_class`); its threshold comes as the
    row's parameter."""
    return suite.row_class(SmartFRZ, name)


def parse_thresholds(parser: argparse.ArgumentParser, text: str) -> list[float]:
    """Comma-separated decision thresholds in (0, 1); a parser error (exit 2) otherwise."""
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        parser.error(f"--thresholds must be comma-separated numbers, got {text!r}")
    if not all(0 < t < 1 for t in values):
        parser.error(f"--thresholds are probabilities in (0, 1), got {text!r}")
    return values


def format_steps(freeze_steps: dict[str, int | None], blocks: list[str]) -> str:
    """``"embeddings@14, layer.0@104"``: the blocks a row froze, in forward order, with their steps."""
    return ", ".join(f"{b}@{freeze_steps[b]}" for b in blocks if freeze_steps.get(b) is not None) or "-"


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=list(suite_tasks.TASKS))
    parser.add_argument("--thresholds", required=True, help="comma-separated decision thresholds, one row each")
    parser.add_argument("--seeds", type=seed_list, default=[0, 1, 2], help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--cache", action="store_true", help="freeze.cache.mode=auto for every row")
    parser.add_argument("--out", default="runs/smartfrz-threshold", help="run folders")
    args = parser.parse_args(argv)
    thresholds = parse_thresholds(parser, args.thresholds)
    seeds = args.seeds
    names = [row_name(t) for t in thresholds]
    for name in names:
        register_strategy(name)(threshold_strategy(name))
    spec = suite_tasks.task_spec(args.task, False)
    console = Console(width=None if sys.stdout.isatty() else 160, soft_wrap=False)
    trained = []
    for seed in seeds:
        none, rows = suite.train_beside_none(spec, seed, args.cache, names,
                                             {name: {"threshold": t} for name, t in zip(names, thresholds)},
                                             Path(args.out) / args.task / f"seed{seed}", console)
        trained += [(seed, name, none, r, format_steps(r["freeze_steps"], r["blocks"])) for name, r in zip(names, rows)]
    cache = "with" if args.cache else "without"
    table = suite.beside_none_table(f"{spec.title}: SmartFRZ by decision threshold ({cache} the activation cache)",
                                    "acc %", trained)
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main))
