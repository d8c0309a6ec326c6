"""Issue 42: does a precision cost accuracy, and what does it cost in time, on the suite's tasks?

For each task (the suite's jobs and sizes, ``benchmarks.suite.SIZES``; by default ``bbc``), seed and row (``none``,
``smartfrz``), one run per precision (``train.precision``: by default ``32-true`` and ``bf16-mixed``), one after
another in this process. Reported per task and precision: the mean test accuracy over the seeds and its difference in
points to ``32-true`` of the same row and seed (mean, and the worst seed), the mean train seconds and their ratio to
``32-true``'s, and the blocks frozen at the end. Accuracy does not depend on timing; time ratios need the machine to
itself.

    python -m benchmarks.precision                                   # bbc, 3 seeds, 32-true vs bf16-mixed
    python -m benchmarks.precision --tasks bbc --seeds 0 --precisions 32-true,bf16-mixed,16-mixed,bf16-true
    python -m benchmarks.precision --quick --seeds 0                 # a smoke test (the suite's quick sizes)

Writes ``OUT/results.json`` (after every run) and ``OUT/precision.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path
from typing import Any

from benchmarks import suite
from layerfreeze.train.config import build_config
from layerfreeze.train.trainer import Trainer

#: The rows of each task and seed.
ROWS = ("none", "smartfrz")
#: What every precision is compared to.
BASE = "32-true"


def run_one(spec: suite.TaskSpec, seed: int, row: str, precision: str, out: Path, threads: int | None) -> dict:
    """One training run; its accuracy, train seconds and frozen blocks."""
    cfg = suite.base_config(spec, seed, threads)
    cfg["train"]["precision"] = precision
    cfg["freeze"] = {"strategy": row}
    run_dir = out / f"{spec.task}-{row}-{precision}-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg["run"]["dir"] = str(run_dir)
    summary = Trainer(build_config(cfg)).run()
    return {"accuracy": summary["test_accuracy"], "train_s": summary["train_time_s"],
            "frozen": len(summary["frozen_blocks"]), "precision": summary["precision"]}


def table(results: dict[str, Any], precisions: list[str]) -> str:
    """The Markdown table: per task, row and precision, accuracy and time against ``32-true``."""
    lines = ["| task | row | precision | test acc % (mean) | Δ pts vs 32-true (mean, worst seed) | train s (mean) | "
             "time ratio | blocks frozen (mean) |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for task, rows in results.items():
        for row, by_precision in rows.items():
            base = by_precision.get(BASE, {})
            for precision in precisions:
                runs = by_precision.get(precision, {})
                if not runs:
                    continue
                seeds = sorted(runs)
                acc = statistics.mean(runs[s]["accuracy"] for s in seeds)
                secs = statistics.mean(runs[s]["train_s"] for s in seeds)
                paired = [s for s in seeds if s in base]
                deltas = [100 * (runs[s]["accuracy"] - base[s]["accuracy"]) for s in paired]
                delta = (f"{statistics.mean(deltas):+.2f} ({min(deltas):+.2f})" if deltas and precision != BASE
                         else "-")
                ratio = (f"{secs / statistics.mean(base[s]['train_s'] for s in paired):.2f}" if paired else "-")
                frozen = statistics.mean(runs[s]["frozen"] for s in seeds)
                lines.append(f"| {task} | {row} | {precision} | {100 * acc:.2f} | {delta} | {secs:.1f} | {ratio} | "
                             f"{frozen:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="bbc", help="comma-separated suite tasks (benchmarks.suite.TASKS)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--precisions", default="32-true,bf16-mixed", help="comma-separated train.precision values")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated strategies")
    parser.add_argument("--quick", action="store_true", help="the suite's quick sizes (a smoke test)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: all cores)")
    parser.add_argument("--out", default="runs/bench-precision", help="output folder")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    precisions = args.precisions.split(",")
    results: dict[str, Any] = {}
    for task in args.tasks.split(","):
        spec = suite.task_spec(task, args.quick)
        for seed in (int(s) for s in args.seeds.split(",")):
            for row in args.rows.split(","):
                for precision in precisions:
                    got = run_one(spec, seed, row, precision, out, args.threads)
                    results.setdefault(task, {}).setdefault(row, {}).setdefault(precision, {})[seed] = got
                    (out / "results.json").write_text(json.dumps(results, indent=2))
                    print(f"{task} seed {seed} {row} {precision}: {100 * got['accuracy']:.2f}% "
                          f"in {got['train_s']:.1f} s", flush=True)
    text = table(results, precisions)
    (out / "precision.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
