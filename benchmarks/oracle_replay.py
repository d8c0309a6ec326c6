"""What the CKA oracle's own freezing schedule would cost and save, trained for real.

The suite's oracle line (``benchmarks/suite.py``) is computed, not trained: it says when each block's CKA to its
final output converged in a `none` run, and sums per-prefix step FLOPs. This script takes those schedules from a
suite ``results.json`` and

1. prints the oracle's FLOPs ratio at other CKA thresholds (``--taus``), from the stored CKA records: how much a
   policy faithful to looser labels could save at most;
2. trains each seed in one process: `none`, then one fixed schedule per threshold in ``--train-taus`` that freezes
   every block at the step the oracle gives it at that threshold (default: the suite's own oracle schedule, at the
   labels' tau); ``--cache`` adds the frozen-prefix activation cache to every row. It prints accuracy, time and
   measured FLOPs per seed and row, and their mean over the seeds.

So it answers "does even a perfect predictor of the labels meet a target?" on the suite's own task sizes.

    python -m benchmarks.oracle_replay runs/bench-suite/results.json --task fmnist-mobilenet --cache
    python -m benchmarks.oracle_replay runs/bench-suite/results.json --task bbc --taus 0.99,0.995,0.998
    python -m benchmarks.oracle_replay runs/bench-suite/results.json --task bbc --cache --train-taus 0.998,0.9995

FLOPs at other thresholds use the per-prefix step FLOPs the suite measured; a prefix it did not measure takes the
nearest shallower measured one (an upper bound: a deeper prefix never costs more).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks import suite, suite_tasks  # the suite's task specs and configs: the replay must run the same job
from benchmarks.cli import entry, seed_list
from layerfreeze.strategies import register_strategy
from layerfreeze.strategies.base import Decision, StageContext, Strategy


class OracleSchedule(Strategy):
    """Freeze block ``i`` once ``steps[i]`` optimizer steps are done (None: never); asked after every step.

    Args:
        steps: One freeze step (int >= 0) or None per block, in forward order.

    Raises:
        ValueError: at the start stage, ``steps`` does not have one entry per block.
    """

    name = "oracle"

    def __init__(self, steps: list[int | None] | None = None) -> None:
        super().__init__()
        self.steps = list(steps or [])
        self.stage_every = 1

    def decide(self, ctx: StageContext) -> Decision:
        if len(self.steps) != len(ctx.blocks):
            raise ValueError(f"oracle: {len(self.steps)} freeze steps for {len(ctx.blocks)} blocks")
        due = [b.index for b in ctx.blocks if not b.frozen and not b.is_head
               and self.steps[b.index] is not None and ctx.step >= self.steps[b.index]]
        return Decision(freeze=due, reason="oracle schedule" if due else "")


def schedule_at_tau(task: dict[str, Any], oracle: dict[str, Any], tau: float | None) -> list[int | None]:
    """One seed's oracle schedule, a freeze step (or None) per block in forward order: at ``tau`` from the stored
    CKA records (the labels' window and delta), or the schedule the suite stored (its labels' tau) when ``tau`` is
    None."""
    from benchmarks.oracle import oracle_freeze_steps

    if tau is None:
        return [oracle["freeze_steps"].get(b) for b in task["blocks"]]
    return oracle_freeze_steps(oracle["cka"], oracle["record_steps"], task["blocks"].index(task["head"]), tau=tau)


def flops_at_taus(task: dict[str, Any], taus: list[float]) -> list[tuple[float, list[float]]]:
    """Per tau, the oracle's FLOPs ratio of every seed (from the stored CKA records and per-prefix FLOPs)."""
    from benchmarks.oracle import oracle_flops

    out = []
    for tau in taus:
        ratios = []
        for seed in task["seeds"]:
            o = seed["oracle"]
            measured = {int(k): v for k, v in o["flops_per_step_by_prefix"].items()}
            per_prefix = {p: measured[max(k for k in measured if k <= p)] for p in range(len(task["blocks"]) + 1)}
            frozen = schedule_at_tau(task, o, tau)
            ratios.append(oracle_flops(frozen, per_prefix, task["total_steps"]) / (measured[0] * task["total_steps"]))
        out.append((tau, ratios))
    return out


def row_name(tau: float | None) -> str:
    """The compare row (and registered strategy) of the schedule at ``tau``: ``oracle`` for the stored one."""
    return "oracle" if tau is None else f"oracle-tau{tau:g}"


def oracle_strategy(name: str) -> type[OracleSchedule]:
    """The :class:`OracleSchedule` class registered as row ``name`` (:func:`suite.row_class`)."""
    return suite.row_class(OracleSchedule, name)


def format_schedule(steps: list[int | None], blocks: list[str]) -> str:
    """``"embeddings@6, layer.0@6, layer.1@39"``: the blocks that freeze, with their steps (``-``: none)."""
    return ", ".join(f"{b}@{t}" for b, t in zip(blocks, steps) if t is not None) or "-"


def _taus(parser: argparse.ArgumentParser, flag: str, text: str) -> list[float]:
    """Comma-separated CKA thresholds in (0, 1]; a parser error (exit 2) names the flag otherwise."""
    try:
        taus = [float(t) for t in text.split(",")]
    except ValueError:
        parser.error(f"{flag} must be comma-separated numbers, got {text!r}")
    if not all(0 < t <= 1 for t in taus):
        parser.error(f"{flag} are CKA thresholds in (0, 1], got {text!r}")
    return taus


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="a results.json written by benchmarks/suite.py (with its oracle records)")
    parser.add_argument("--task", required=True, choices=list(suite_tasks.TASKS))
    parser.add_argument("--seeds", type=seed_list, help="comma-separated seeds (default: every seed in the results)")
    parser.add_argument("--taus", default="0.9,0.95,0.98,0.99,0.995,0.998",
                        help="CKA thresholds for the computed FLOPs table")
    parser.add_argument("--train-taus", help="comma-separated CKA thresholds whose oracle schedules are trained, one "
                        "row each (default: the suite's stored oracle schedule)")
    parser.add_argument("--cache", action="store_true", help="freeze.cache.mode=auto for every row")
    parser.add_argument("--no-train", action="store_true", help="only the computed FLOPs table")
    parser.add_argument("--out", default="runs/oracle-replay", help="run folders (default runs/oracle-replay)")
    args = parser.parse_args(argv)
    try:
        results = json.loads(Path(args.results).read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"{args.results}: cannot read it as JSON ({exc})")
    try:
        task = results["tasks"][args.task]
        sizes = results["meta"]["sizes"][args.task]
        for s in task["seeds"]:
            s["oracle"]["cka"], s["oracle"]["freeze_steps"], s["seed"]  # noqa: B018 (checked, not used here)
        task["title"], task["blocks"], task["head"], task["total_steps"]  # noqa: B018
    except (KeyError, TypeError, IndexError) as exc:
        parser.error(f"{args.results}: not a results.json of benchmarks/suite.py with task {args.task!r} and its "
                     f"oracle records (missing {exc})")
    taus = _taus(parser, "--taus", args.taus)
    train_taus: list[float | None] = [None] if args.train_taus is None else _taus(parser, "--train-taus",
                                                                                 args.train_taus)
    held = [s["seed"] for s in task["seeds"]]
    if args.seeds is not None and set(args.seeds) - set(held):
        parser.error(f"--seeds: the results hold seeds {', '.join(map(str, held))}, not "
                     f"{', '.join(str(s) for s in args.seeds if s not in held)}")
    seeds = [s for s in task["seeds"] if args.seeds is None or s["seed"] in args.seeds]
    console = Console(width=None if sys.stdout.isatty() else 160, soft_wrap=False)

    table = Table(title=f"{task['title']}: oracle FLOPs ratio by CKA threshold (computed, no cache)")
    table.add_column("tau")
    for s in seeds:
        table.add_column(f"seed {s['seed']}", justify="right")
    for tau, ratios in flops_at_taus({**task, "seeds": seeds}, taus):
        table.add_row(f"{tau:g}", *(f"{r:.3f}" for r in ratios))
    console.print(table)
    if args.no_train:
        return 0

    names = [row_name(t) for t in train_taus]
    for name in names:
        register_strategy(name)(oracle_strategy(name))
    spec = replace(suite_tasks.TASKS[args.task], **sizes)
    trained = []
    for s in seeds:
        schedules = {name: schedule_at_tau(task, s["oracle"], t) for name, t in zip(names, train_taus)}
        none, rs = suite.train_beside_none(spec, s["seed"], args.cache, names,
                                           {name: {"steps": steps} for name, steps in schedules.items()},
                                           Path(args.out) / args.task / f"seed{s['seed']}", console)
        trained += [(s["seed"], name, none, r, format_schedule(schedules[name], task["blocks"]))
                    for name, r in zip(names, rs)]
    cache = "with" if args.cache else "without"
    rows = suite.beside_none_table(f"{task['title']}: the oracle's schedule trained ({cache} the activation cache)",
                                   "oracle acc %", trained)
    console.print(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main))
