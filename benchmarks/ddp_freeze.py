"""Data-parallel freezing: MiniLM-L6 on BBC News on 2 CPU ranks (gloo), full training vs strategies that freeze.

Each row is a real ``torchrun --standalone --nproc_per_node N -m layerfreeze train`` run (same seed, same global
batches); the table comes from the runs' ``summary.json`` and ``metrics.jsonl``: per phase of the frozen set, the
gradient bytes DDP all-reduced per step (counted by FreezeDDP's communication hook), the fp32 bytes of the
parameters that were trainable then (the two must be equal: frozen blocks send nothing), the mean step time, and per
run the DDP rebuild times and the test accuracy. Run it alone on the machine (timings beside another torch process
are meaningless on 2 cores).

    python -m benchmarks.ddp_freeze [--ranks 2] [--epochs 3] [--limit-train 480] [--rows none smartfrz lisa ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.cli import count, entry, names
from layerfreeze.runs.rundir import SUMMARY_FILE, read_metrics
from layerfreeze.runs.summary import format_bytes

#: Row name -> CLI arguments. linear with freeze_start 0 freezes a growing prefix at every epoch end.
ROWS = {
    "none": ["-s", "none"],
    "linear": ["-s", "linear", "-p", "freeze_start=0"],
    "smartfrz": ["-s", "smartfrz"],
    # the rotating strategies (issue 30): a DDP rebuild at every switch (LISA every k=20 steps, BAdam every 12)
    "lisa": ["-s", "lisa"],
    "badam": ["-s", "badam"],
}


def run_row(name: str, args: argparse.Namespace) -> tuple[dict, list[dict], float]:
    run_dir = Path(args.out) / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks),
           "-m", "layerfreeze", "train", "--task", "bbc-news", "--epochs", str(args.epochs),
           "--limit-train", str(args.limit_train), "--run-dir", str(run_dir), "--no-progress", "--no-report",
           "--set", "run.checkpoint=false", *ROWS[name]]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    return json.loads((run_dir / SUMMARY_FILE).read_text()), read_metrics(run_dir), wall


def phases(records: list[dict]) -> list[dict]:
    """Consecutive steps trained under the same DDP build (the frozen set their backward ran with): bytes
    all-reduced per step, the fp32 bytes of the parameters trainable then, mean step time."""
    rebuilds = [r for r in records if r.get("kind") == "ddp_rebuild"]
    steps = [r for r in records if r["type"] == "step" and "grad_bytes_allreduced" in r]
    out: list[dict] = []
    for r in steps:
        build = [b for b in rebuilds if b["step"] < r["step"]][-1]  # a rebuild after step s serves step s + 1
        if not out or out[-1]["build"] is not build:
            out.append({"build": build, "frozen": len(build["frozen_blocks"]), "from": r["step"], "to": r["step"],
                        "bytes": set(), "trainable_bytes": build["trainable_parameters"] * 4, "times": []})
        out[-1]["to"] = r["step"]
        out[-1]["bytes"].add(r["grad_bytes_allreduced"])
        out[-1]["times"].append(r["step_time_s"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=count(1), default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--epochs", type=count(1), default=3)
    parser.add_argument("--limit-train", type=int, default=480, help="training samples (BBC News has 1,780)")
    parser.add_argument("--rows", nargs="+", type=names(list(ROWS)), default=[list(ROWS)],
                        help=f"rows, comma-separated as in the other scripts (spaces work too; default "
                             f"{','.join(ROWS)})")
    parser.add_argument("--out", default="runs/bench-ddp-freeze")
    args = parser.parse_args()
    args.rows = [name for group in args.rows for name in group]

    table = Table(title=f"MiniLM-L6 / BBC News on {args.ranks} ranks (gloo, {args.threads} thread(s) each), "
                        f"{args.limit_train} training samples, {args.epochs} epochs")
    for col in ("row", "steps", "frozen blocks", "grad bytes all-reduced / step", "trainable fp32 bytes",
                "step time s", "DDP rebuilds s", "test acc", "wall s"):
        table.add_column(col, justify="right")
    for name in args.rows:
        summary, records, wall = run_row(name, args)
        rebuild = ", ".join(f"{s:.3f}" for s in summary.get("ddp_rebuild_s", []))
        for i, ph in enumerate(phases(records)):
            sent = "/".join(format_bytes(b) for b in sorted(ph["bytes"]))
            first = i == 0
            table.add_row(name if first else "", f"{ph['from']}-{ph['to']}", str(ph["frozen"]), sent,
                          format_bytes(ph["trainable_bytes"]), f"{sum(ph['times']) / len(ph['times']):.3f}",
                          rebuild if first else "", f"{summary['test_accuracy']:.4f}" if first else "",
                          f"{wall:.0f}" if first else "")
        print(json.dumps({"row": name, "accuracy": summary["test_accuracy"], "train_time_s": summary["train_time_s"],
                          "rebuild_s": summary.get("ddp_rebuild_s"), "phases": [
                              {k: (sorted(v) if isinstance(v, set) else v) for k, v in ph.items()
                               if k not in ("times", "build")}
                              for ph in phases(records)]}), flush=True)
    Console(width=160).print(table)


if __name__ == "__main__":
    raise SystemExit(entry(main))
