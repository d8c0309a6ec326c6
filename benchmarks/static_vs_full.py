"""Full fine-tuning (strategy none) against static freezing, same seed and data order, one process.

Prints a table: test accuracy, train time per epoch and its ratio to full fine-tuning, measured training FLOPs per
step and ratio, peak memory. Writes the rows as JSON to ``--out``.

    python -m benchmarks.static_vs_full                      # MiniLM-L6 / BBC News, 3 epochs, k=5
    python -m benchmarks.static_vs_full --task fashion-mnist --k 10 --epochs 1 --limit-train 10000
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.cli import count, entry
from benchmarks.jobs import CLI_CONFIG, JOBS, parse_jobs
from layerfreeze.runs.summary import format_bytes, format_flops
from layerfreeze.train.config import build_config
from layerfreeze.train.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="default-job", help=f"a benchmark job (benchmarks/jobs.py): "
                        f"{', '.join(j for j in JOBS if j != 'bbc')}")
    parser.add_argument("--k", type=int, default=5, help="static: number of leading blocks frozen")
    parser.add_argument("--epochs", type=count(1), default=3)
    parser.add_argument("--limit-train", type=int)
    parser.add_argument("--limit-test", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench-static-vs-full")
    args = parser.parse_args()
    job = parse_jobs(args.task, tuple(j for j in JOBS if j != "bbc"), flag="--task")[0]

    rows = []
    for strategy, params in (("none", {}), ("static", {"k": args.k})):
        config = build_config({
            **CLI_CONFIG[job],
            "train": {"epochs": args.epochs, "seed": args.seed},
            "data": {"limit_train": args.limit_train, "limit_test": args.limit_test},
            "freeze": {"strategy": strategy, "params": params},
            "run": {"dir": f"{args.out}/{strategy}", "progress": False, "checkpoint": False},
        })
        s = Trainer(config).run()
        rows.append({
            "strategy": strategy if not params else f"{strategy} k={args.k}",
            "test_accuracy": s["test_accuracy"],
            "time_per_epoch_s": s["time_per_epoch_s"],
            "mean_epoch_s": statistics.mean(s["time_per_epoch_s"]),
            "flops_per_step": s["flops_per_step_last"],
            "peak_memory_bytes": s["peak_memory_bytes"],
            "frozen_blocks": s["frozen_blocks"],
        })
        print(json.dumps(rows[-1]), flush=True)

    base = rows[0]
    table = Table(title=f"{args.task}: full fine-tuning vs static freezing ({args.epochs} epochs, seed {args.seed})")
    for col in ("strategy", "test acc", "train s/epoch", "time ratio", "FLOPs/step", "FLOPs ratio", "peak memory"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["strategy"], f"{r['test_accuracy']:.4f}", f"{r['mean_epoch_s']:.1f}",
            f"{r['mean_epoch_s'] / base['mean_epoch_s']:.3f}", format_flops(r["flops_per_step"]),
            f"{r['flops_per_step'] / base['flops_per_step']:.3f}", format_bytes(r["peak_memory_bytes"]),
        )
    Console(width=140).print(table)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    raise SystemExit(entry(main))
