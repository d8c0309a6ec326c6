"""Issue 42: does a precision or torch.compile cost accuracy, and what do they cost or save in time, on the suite's
tasks?

For each task (the suite's jobs and sizes, ``benchmarks.suite_tasks.SIZES``, by default ``bbc``; or ``default-job``, the
CLI's defaults), seed and row (``none``,
``smartfrz``), one run per variant, a precision (``train.precision``: by default ``32-true`` and ``bf16-mixed``)
crossed with a compile mode (``train.compile``: by default ``false``), one after another in this process. Reported
per task, row and variant: the mean test accuracy over the seeds and its difference in points to the eager
``32-true`` run of the same row and seed (mean, and the worst seed), the mean train seconds and their ratio to that
run's (compiling included: train seconds count every step), the seconds spent compiling on their own, the graphs
compiled per run, and the blocks frozen at the end. Accuracy does not depend on timing; time ratios need the machine
to itself.

    python -m benchmarks.precision_compile                 # bbc, 3 seeds, 32-true vs bf16-mixed, eager
    python -m benchmarks.precision_compile --seeds 0 --precisions 32-true --compiles false,blocks   # compile
    python -m benchmarks.precision_compile --quick --seeds 0         # a smoke test (the suite's quick sizes)
    python -m benchmarks.precision_compile --tasks default-job --seeds 0 --rows smartfrz --precisions 32-true \\
        --compiles false,blocks                                          # the default job, eager vs compiled blocks

Writes ``OUT/results.json`` (after every run) and ``OUT/precision_compile.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path
from typing import Any

from benchmarks import memory_table, suite_tasks
from benchmarks.cli import entry, seed_list
from layerfreeze.train.config import build_config
from layerfreeze.train.trainer import Trainer

#: The rows of each task and seed.
ROWS = ("none", "smartfrz")
#: What every variant is compared to: float32, eager.
BASE = "32-true/false"


def variant(precision: str, compile_mode: str) -> str:
    """A variant's name: ``"<precision>/<compile>"`` (``"bf16-mixed/blocks"``)."""
    return f"{precision}/{compile_mode}"


def base_config(task: str, seed: int, quick: bool, threads: int | None) -> dict[str, Any]:
    """A task's config before the row and variant: ``default-job`` is `make demo` (the CLI's defaults, as
    ``benchmarks.memory_table`` runs it; ``--quick``: its quick size), another name a suite task at its size."""
    if task == "default-job":
        return memory_table.task_config(task, "quick" if quick else "suite", seed, threads)[0]
    return suite_tasks.base_config(suite_tasks.task_spec(task, quick), seed, threads)


def run_one(task: str, seed: int, row: str, precision: str, compile_mode: str, out: Path, quick: bool,
            threads: int | None) -> dict:
    """One training run; its accuracy, train seconds, compile figures and frozen blocks."""
    cfg = base_config(task, seed, quick, threads)
    cfg["train"]["precision"] = precision
    cfg["train"]["compile"] = {"false": False, "true": True}.get(compile_mode, compile_mode)
    cfg["freeze"] = {"strategy": row}
    run_dir = out / f"{task}-{row}-{precision}-{compile_mode}-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg["run"]["dir"] = str(run_dir)
    summary = Trainer(build_config(cfg)).run()
    compiled = summary.get("compile") or {}
    return {"accuracy": summary["test_accuracy"], "train_s": summary["train_time_s"],
            "frozen": len(summary["frozen_blocks"]), "precision": summary["precision"],
            "graphs": compiled.get("graphs", 0), "compile_s": compiled.get("compile_s", 0.0),
            "train_compile_s": compiled.get("train_compile_s", 0.0)}


def table(results: dict[str, Any], variants: list[str]) -> str:
    """The Markdown table: per task, row and variant, accuracy and time against the eager ``32-true`` run."""
    lines = ["| task | row | precision/compile | test acc % (mean) | Δ pts vs 32-true/false (mean, worst seed) | "
             "train s (mean) | time ratio | compile s (in steps) | train s without compiling | ratio without "
             "compiling | graphs | blocks frozen (mean) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for task, rows in results.items():
        for row, by_variant in rows.items():
            base = by_variant.get(BASE, {})
            for name in variants:
                runs = by_variant.get(name, {})
                if not runs:
                    continue
                seeds = sorted(runs)
                acc = statistics.mean(runs[s]["accuracy"] for s in seeds)
                secs = statistics.mean(runs[s]["train_s"] for s in seeds)
                paired = [s for s in seeds if s in base]
                deltas = [100 * (runs[s]["accuracy"] - base[s]["accuracy"]) for s in paired]
                delta = (f"{statistics.mean(deltas):+.2f} ({min(deltas):+.2f})" if deltas and name != BASE
                         else "-")
                ratio = (f"{secs / statistics.mean(base[s]['train_s'] for s in paired):.2f}" if paired else "-")
                frozen = statistics.mean(runs[s]["frozen"] for s in seeds)
                compile_s = statistics.mean(runs[s]["compile_s"] for s in seeds)
                in_steps = statistics.mean(runs[s].get("train_compile_s", 0.0) for s in seeds)
                bare = statistics.mean(runs[s]["train_s"] - runs[s].get("train_compile_s", 0.0) for s in seeds)
                bare_base = (statistics.mean(base[s]["train_s"] - base[s].get("train_compile_s", 0.0) for s in paired)
                             if paired else None)
                bare_ratio = f"{bare / bare_base:.2f}" if bare_base else "-"
                graphs = statistics.mean(runs[s]["graphs"] for s in seeds)
                lines.append(f"| {task} | {row} | {name} | {100 * acc:.2f} | {delta} | {secs:.1f} | {ratio} | "
                             f"{compile_s:.1f} ({in_steps:.1f}) | {bare:.1f} | {bare_ratio} | {graphs:.0f} | "
                             f"{frozen:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="bbc", help="comma-separated tasks: default-job (the CLI's defaults) "
                        "or suite tasks (benchmarks.suite_tasks.TASKS: bbc, fmnist-mobilenet, fmnist-resnet)")
    parser.add_argument("--seeds", type=seed_list, default=[0, 1, 2], help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--precisions", default="32-true,bf16-mixed", help="comma-separated train.precision values")
    parser.add_argument("--compiles", default="false", help="comma-separated train.compile values (false, blocks, "
                        "true)")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated strategies")
    parser.add_argument("--quick", action="store_true", help="the suite's quick sizes (a smoke test)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: all cores)")
    parser.add_argument("--out", default="runs/bench-precision-compile", help="output folder")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pairs = [(p, c) for p in args.precisions.split(",") for c in args.compiles.split(",")]
    variants = [variant(p, c) for p, c in pairs]
    results: dict[str, Any] = {}
    for task in args.tasks.split(","):
        for seed in args.seeds:
            for row in args.rows.split(","):
                for precision, compile_mode in pairs:
                    got = run_one(task, seed, row, precision, compile_mode, out, args.quick, args.threads)
                    name = variant(precision, compile_mode)
                    results.setdefault(task, {}).setdefault(row, {}).setdefault(name, {})[seed] = got
                    (out / "results.json").write_text(json.dumps(results, indent=2))
                    print(f"{task} seed {seed} {row} {name}: {100 * got['accuracy']:.2f}% in {got['train_s']:.1f} s "
                          f"({got['graphs']} graphs, {got['compile_s']:.1f} s compiling)", flush=True)
    text = table(results, variants)
    (out / "precision_compile.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main))
