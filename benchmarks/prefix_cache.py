"""Frozen-prefix activation cache: the same frozen run with and without the cache, one process, same seed.

Default: MiniLM-L6 on BBC News with the embeddings and the first 5 of 6 encoder layers frozen (static k=6), 3
epochs. The first epoch fills the cache; later epochs read the frozen prefix's output instead of running it.
Prints per-epoch training time, the ratio of epochs after the first, measured FLOPs per step, cache size, and
whether the losses of the two runs are identical.

    python -m benchmarks.prefix_cache [--epochs 3] [--k 6] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.cli import count, entry
from benchmarks.jobs import CLI_CONFIG, JOBS, parse_jobs
from layerfreeze.runs.rundir import read_metrics
from layerfreeze.runs.summary import format_bytes, format_flops
from layerfreeze.train.config import build_config
from layerfreeze.train.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="default-job", help=f"a benchmark job (benchmarks/jobs.py): "
                        f"{', '.join(j for j in JOBS if j != 'bbc')}")
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--epochs", type=count(1), default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--out", default="runs/bench-prefix-cache")
    args = parser.parse_args()
    job = parse_jobs(args.task, tuple(j for j in JOBS if j != "bbc"), flag="--task")[0]

    rows = {}
    for mode in ("off", "on"):
        config = build_config({
            **CLI_CONFIG[job], "train": {"epochs": args.epochs},
            "freeze": {"strategy": "static", "params": {"k": args.k}, "cache": {"mode": mode, "dtype": args.dtype}},
            "run": {"dir": f"{args.out}/cache-{mode}", "progress": False, "checkpoint": False},
        })
        summary = Trainer(config).run()
        records = read_metrics(f"{args.out}/cache-{mode}")
        epochs = [r for r in records if r["type"] == "epoch"]
        rows[mode] = {
            "epoch_s": summary["time_per_epoch_s"], "accuracy": summary["test_accuracy"],
            "flops_last": summary["flops_per_step_last"], "flops_first": summary["flops_per_step_first"],
            "cache_bytes": epochs[-1].get("cache_size_bytes", 0),
            "losses": [r["loss"] for r in records if r["type"] == "step"],
        }
        print(json.dumps({k: v for k, v in rows[mode].items() if k != "losses"}), flush=True)

    off, on = rows["off"], rows["on"]
    later = lambda r: sum(r["epoch_s"][1:]) / max(1, len(r["epoch_s"]) - 1)  # noqa: E731
    table = Table(title=f"{args.task}: static k={args.k}, frozen-prefix cache off vs on ({args.epochs} epochs)")
    for col in ("cache", "epoch 1 s", "later epochs s", "later ratio", "FLOPs/step (last)", "cache size", "test acc"):
        table.add_column(col, justify="right")
    for mode, r in rows.items():
        table.add_row(mode, f"{r['epoch_s'][0]:.1f}", f"{later(r):.1f}", f"{later(r) / later(off):.3f}",
                      format_flops(r["flops_last"]), format_bytes(r["cache_bytes"]), f"{r['accuracy']:.4f}")
    Console(width=140).print(table)
    same = off["losses"] == on["losses"]
    print(f"losses identical: {same}" + ("" if same else f" (max abs diff "
          f"{max(abs(a - b) for a, b in zip(off['losses'], on['losses'])):.3g})"))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    raise SystemExit(entry(main))
