"""What the CKA oracle's own freezing schedule would cost and save, trained for real.

The suite's oracle line (``benchmarks/suite.py``) is computed, not trained: it says when each block's CKA to its
final output converged in a `none` run, and sums per-prefix step FLOPs. This script takes those schedules from a
suite ``results.json`` and

1. prints the oracle's FLOPs ratio at other CKA thresholds (``--taus``), from the stored CKA records: how much a
   policy faithful to looser labels could save at most;
2. trains each seed twice in one process, `none` and a fixed schedule that freezes every block at the oracle's step
   (``--cache`` adds the frozen-prefix activation cache to both), and prints accuracy, time and measured FLOPs.

So it answers "does even a perfect predictor of the labels meet a target?" on the suite's own task sizes.

    python benchmarks/oracle_replay.py runs/bench-suite/results.json --task fmnist-mobilenet --cache
    python benchmarks/oracle_replay.py runs/bench-suite/results.json --task bbc --taus 0.99,0.995,0.998

FLOPs at other thresholds use the per-prefix step FLOPs the suite measured; a prefix it did not measure takes the
nearest shallower measured one (an upper bound: a deeper prefix never costs more).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import suite  # noqa: E402  (the suite's task specs and configs: the replay must run the same job)

from layerfreeze.strategies import register_strategy  # noqa: E402
from layerfreeze.strategies.base import Decision, StageContext, Strategy  # noqa: E402


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


def flops_at_taus(task: dict[str, Any], taus: list[float]) -> list[tuple[float, list[float]]]:
    """Per tau, the oracle's FLOPs ratio of every seed (from the stored CKA records and per-prefix FLOPs)."""
    from layerfreeze.oracle import oracle_flops, oracle_freeze_steps

    head = task["blocks"].index(task["head"])
    out = []
    for tau in taus:
        ratios = []
        for seed in task["seeds"]:
            o = seed["oracle"]
            measured = {int(k): v for k, v in o["flops_per_step_by_prefix"].items()}
            per_prefix = {p: measured[max(k for k in measured if k <= p)] for p in range(len(task["blocks"]) + 1)}
            frozen = oracle_freeze_steps(o["cka"], o["record_steps"], head, tau=tau)
            ratios.append(oracle_flops(frozen, per_prefix, task["total_steps"]) / (measured[0] * task["total_steps"]))
        out.append((tau, ratios))
    return out


def main(argv: list[str] | None = None) -> int:
    from layerfreeze.compare import compare

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="a results.json written by benchmarks/suite.py (with its oracle records)")
    parser.add_argument("--task", required=True, choices=list(suite.TASKS))
    parser.add_argument("--seeds", help="comma-separated seeds (default: every seed in the results)")
    parser.add_argument("--taus", default="0.9,0.95,0.98,0.99,0.995,0.998",
                        help="CKA thresholds for the computed FLOPs table")
    parser.add_argument("--cache", action="store_true", help="freeze.cache.mode=auto for both rows")
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
    try:
        taus = [float(t) for t in args.taus.split(",")]
    except ValueError:
        parser.error(f"--taus must be comma-separated numbers, got {args.taus!r}")
    if not all(0 < t <= 1 for t in taus):
        parser.error(f"--taus are CKA thresholds in (0, 1], got {args.taus!r}")
    seeds = [s for s in task["seeds"] if args.seeds is None or str(s["seed"]) in args.seeds.split(",")]
    if not seeds:
        parser.error(f"--seeds {args.seeds}: the results hold seeds {[s['seed'] for s in task['seeds']]}")
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

    register_strategy("oracle")(OracleSchedule)
    spec = replace(suite.TASKS[args.task], **sizes)
    rows = Table(title=f"{task['title']}: the oracle's schedule trained ({'with' if args.cache else 'without'} "
                       "the activation cache)")
    for h in ("seed", "none acc %", "oracle acc %", "Δ pts", "time ratio", "FLOPs ratio"):
        rows.add_column(h, justify="right")
    for s in seeds:
        base = suite.base_config(spec, s["seed"], None)
        if args.cache:
            base["freeze"] = {"cache": {"mode": "auto"}}
        steps = [s["oracle"]["freeze_steps"].get(b) for b in task["blocks"]]
        run_dir = Path(args.out) / args.task / f"seed{s['seed']}"
        shutil.rmtree(run_dir, ignore_errors=True)  # this script's own run folders from an earlier replay
        none, oracle = compare(base, ["none", "oracle"], run_dir,
                               console=console, row_params={"oracle": {"steps": steps}})
        rows.add_row(str(s["seed"]), f"{100 * none['test_accuracy']:.2f}", f"{100 * oracle['test_accuracy']:.2f}",
                     f"{100 * oracle['accuracy_delta']:+.2f}", f"{oracle['time_ratio']:.3f}",
                     f"{oracle['flops_ratio']:.3f}")
    console.print(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
