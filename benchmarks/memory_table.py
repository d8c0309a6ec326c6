"""Where the memory goes per strategy: the memory ledger's peak of every bucket, the tensor peak and the process's RSS.

One ``layerfreeze compare`` per task (rows one after another in this process, same seed, data order and budget), the
ledger sampling every step (``run.ledger_every=1``, ``--every`` to change it), then two tables per task:

* rows x buckets: each bucket's peak (parameters trainable / frozen, buffers, gradients, optimizer state, saved
  activations, the activation cache in memory and on disk, frozen side models), the tensor peak (the largest sum of
  the buckets on a memory device over the run's steps, :mod:`layerfreeze.runs.ledger`) and its ratio to ``none``, the
  process's peak memory (``peak_memory_bytes``: peak RSS on a CPU, ``torch.cuda.max_memory_allocated`` on a GPU),
  on CUDA each device's allocator peak (``torch.cuda.max_memory_allocated`` per device, from the ledger), and test
  accuracy, and the activation cache's hit rate (hits over hits + misses, samples);
* what the freezes gave back: per row, the sum over its ``memory`` events (the ledger's first sample after each
  freeze or thaw against the last one before it) of each bucket's change (a freeze at step 0, before the first
  sample, shows only in the first table, against ``none``).

Tasks (the benchmarks' job names, :mod:`benchmarks.jobs`): ``fmnist-mobilenet`` is the suite's MobileNetV2 /
Fashion-MNIST at the suite's sizes (``benchmarks/suite.py`` SIZES: 2 epochs of 9,600 images, batch 128, 150 steps);
``default-job`` is ``make demo`` (MiniLM-L6 / BBC News, 3 epochs, 128 tokens, batch 32). ``--size`` applies to both:
``suite`` (the sizes above), ``quick`` (the suite's QUICK_SIZES; the default job: 1 epoch of 256 articles, 64
tokens), ``small`` (2 epochs of 2,048 images, 64 steps; the default job: 1 epoch of 640 articles), ``tiny`` (3 steps
of 32 samples each: checks the script runs, not a measurement).

    python -m benchmarks.memory_table              # fmnist-mobilenet and the default job: none, static, smartfrz
    python -m benchmarks.memory_table --tasks fmnist-mobilenet --size small --threads 1
    python -m benchmarks.memory_table --demote bfloat16              # each strategy also demoted (rows static+bf16)
    python -m benchmarks.memory_table --demote bfloat16 --offload cpu --device cuda   # and offloaded off the GPU
    python -m benchmarks.memory_table --size tiny --rows none,static --demote bfloat16   # seconds per task

``--demote DTYPE`` (``bfloat16``/``float16``) adds, after the rows, each freezing row again with
``freeze.demote.dtype`` set (``static+bf16``, ``smartfrz+bf16``; ``+offload`` with ``--offload cpu``, which moves the
frozen prefix the activation cache serves to host memory), in a second comparison in ``OUT/<task>-demote/`` with the
same seed, data order and budget; ratios are to the plain ``none``. ``--set KEY=VALUE`` applies a config key to every
row. Writes ``OUT/<task>/`` (the comparison folders), ``OUT/results.json`` and ``OUT/memory.md`` (the tables
as Markdown), and prints them. Bytes are exact and do not depend on the machine's load; times are not reported.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.cli import entry
from benchmarks.jobs import parse_jobs
from benchmarks.suite_tasks import QUICK_SIZES, SIZE_FIELDS, TASKS, base_config, row_settings, task_spec, total_steps
from layerfreeze.runs import rundir
from layerfreeze.runs.ledger_buckets import bucket_label
from layerfreeze.runs.rundir import Event, finite
from layerfreeze.runs.summary import format_bytes
from layerfreeze.train.compare import compare
from layerfreeze.train.config_file import deep_merge, parse_override

ROWS = ("none", "static", "smartfrz")
#: ``--size small``: the suite's MobileNetV2 task on fewer images (64 steps), for a run of a few minutes on one core;
#: ``--size tiny``: 3 steps of 32 images, to check the script runs (its test), not a measurement.
SMALL = {"fmnist-mobilenet": (2, 2048, 1000, None, 64, None)}
TINY = {"fmnist-mobilenet": (1, 96, 32, None, 32, 3)}
#: The default job at ``--size small``, ``quick`` and ``tiny`` (``suite``: the CLI's defaults as they are).
DEFAULT_JOB_SIZES: dict[str, dict[str, Any]] = {
    "small": {"train": {"epochs": 1}, "data": {"limit_train": 640, "limit_test": 256}},
    "quick": {"train": {"epochs": 1}, "data": {"limit_train": 256, "limit_test": 128}, "model": {"max_length": 64}},
    "tiny": {"train": {"epochs": 1, "max_steps": 3}, "data": {"limit_train": 96, "limit_test": 32},
             "model": {"max_length": 32}},
}
#: The jobs this table runs.
JOBS = ("fmnist-mobilenet", "default-job")
#: The short names of demoted rows: ``static+bf16``.
DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


def demoted_name(row: str, dtype: str, offload: str | None) -> str:
    """The table name of ``row`` run with demotion: ``static+bf16``, ``static+bf16+offload``."""
    return f"{row}+{DTYPE_SHORT.get(dtype, dtype)}" + ("+offload" if offload else "")


def task_config(task: str, size: str, seed: int, threads: int | None) -> tuple[dict[str, Any], dict, dict]:
    """``(base config, row_params, row_overrides)`` of a task at a size."""
    if task == "default-job":  # `make demo`: the CLI's defaults
        base = {"task": "bbc-news", "train": {"seed": seed},
                "run": {"progress": False, "checkpoint": False, "tensorboard": False, "threads": threads,
                        "divergence_window_steps": None}}
        return deep_merge(base, DEFAULT_JOB_SIZES.get(size, {})), {}, {}
    spec = task_spec("fmnist-mobilenet", quick=size == "quick")
    if size in ("small", "tiny"):
        sizes = (SMALL if size == "small" else TINY)["fmnist-mobilenet"]
        spec = replace(TASKS["fmnist-mobilenet"], **dict(zip(SIZE_FIELDS, sizes)))
    n_train = spec.limit_train or 60_000
    params, overrides = row_settings(spec, total_steps(spec, n_train))
    return base_config(spec, seed, threads), params, overrides


def buckets_of(rows: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for r in rows:
        names += [b for b in (r.get("memory") or {}).get("buckets", {}) if b not in names]
    return names


def returned(run_dir: Path) -> dict[str, int]:
    """The sum of a run's ``memory`` events' ``returned_bytes`` per bucket (and ``events``: how many)."""
    out: dict[str, int] = {"events": 0}
    for rec in rundir.read_metrics(run_dir):
        if rec.get("type") == "event" and rec.get("kind") == Event.MEMORY:
            out["events"] += 1
            for bucket, n in rec.get("returned_bytes", {}).items():
                out[bucket] = out.get(bucket, 0) + int(n)
    return out


def tables(task: str, rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    """(headers, cells) of the bucket table and of the returned table."""
    buckets = buckets_of(rows)
    base = next((r for r in rows if r["row"] == "none"), None)
    cuda = sorted({d for r in rows for d in ((r.get("memory") or {}).get("allocator") or {})})
    devices = sorted({d for r in rows for d in ((r.get("memory") or {}).get("devices") or {})})
    head = ["row", "test acc %", "cache hit rate", *(bucket_label(b) for b in buckets), "tensor peak", "ratio to none",
            *(f"tensor peak {d}" for d in devices if len(devices) > 1),
            "peak memory (process)", *(f"{d} peak allocated" for d in cuda)]
    cells = []
    for r in rows:
        mem = r.get("memory") or {}
        peak = r.get("tensor_peak_bytes")
        ratio = peak / base["tensor_peak_bytes"] if base and finite(peak) and base.get("tensor_peak_bytes") else None
        acc = r.get("test_accuracy")
        hit_rate = (r.get("cache") or {}).get("hit_rate")
        cells.append([r["row"], f"{100 * acc:.2f}" if finite(acc) else "-",
                      f"{100 * hit_rate:.1f}%" if finite(hit_rate) else "-",
                      *(format_bytes(mem["buckets"][b]["peak_bytes"]) if b in mem.get("buckets", {}) else "-"
                        for b in buckets),
                      format_bytes(peak) if finite(peak) else "-", f"{ratio:.3f}" if ratio is not None else "-",
                      *(format_bytes(mem["devices"][d]["tensor_peak_bytes"]) if d in mem.get("devices", {}) else "-"
                        for d in devices if len(devices) > 1),
                      format_bytes(r["peak_memory_bytes"]) if finite(r.get("peak_memory_bytes")) else "-",
                      *(format_bytes(mem["allocator"][d]["peak_allocated"]) if d in mem.get("allocator", {}) else "-"
                        for d in cuda)])
    back_buckets = ["grads", "optimizer", "activations", "cache_memory",
                    *(b for b in ("params_frozen", "params_master", "params_offloaded")
                      if any(b in (r.get("returned") or {}) for r in rows))]
    back_head = ["row", "memory events", *(bucket_label(b) for b in back_buckets), "tensor total"]
    back = []
    for r in rows:
        got = r.get("returned") or {}

        def signed(n: int) -> str:
            return ("-" if n < 0 else "") + format_bytes(abs(n))

        back.append([r["row"], str(got.get("events", 0)),
                     *(signed(got.get(b, 0)) for b in (*back_buckets, "tensor_bytes"))])
    return head, cells, back_head, back


def markdown(head: list[str], cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells]) + "\n"


def rich_table(title: str, head: list[str], cells: list[list[str]]) -> Table:
    """``head`` / ``cells`` as a rich table for the console: the ``row`` column left-aligned, numbers right; every
    column at least as wide as its widest cell (a row name or a number is never cut), headers wrapped over lines
    instead of cut with "…"."""
    table = Table(title=title)
    for i, col in enumerate(head):
        widest = max((len(row[i]) for row in cells), default=0)
        longest_word = max((len(w) for w in col.split()), default=0)
        table.add_column(col, justify="left" if col == "row" else "right", overflow="fold",
                         min_width=max(widest, min(longest_word, 12)))
    for row in cells:
        table.add_row(*row)
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default=",".join(JOBS), help=f"comma-separated jobs: {', '.join(JOBS)}")
    parser.add_argument("--rows", default=",".join(ROWS), help="strategies, none first")
    parser.add_argument("--size", choices=("suite", "small", "quick", "tiny"), default="suite",
                        help="every task's sizes: the suite's / the CLI's (suite), a few minutes (small), QUICK_SIZES "
                        "(quick), 3 steps (tiny)")
    parser.add_argument("--demote", choices=sorted(DTYPE_SHORT),
                        help="also run each freezing row with freeze.demote.dtype (rows static+bf16, ...)")
    parser.add_argument("--offload", choices=("cpu",), help="with --demote: freeze.demote.offload too")
    parser.add_argument("--every", type=int, default=1, help="run.ledger_every (1: every step sampled)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--device", help="run.device (auto, cpu, cuda:N); on CUDA the table adds the allocator's peak")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config key for every row")
    parser.add_argument("--out", default="runs/bench-memory")
    args = parser.parse_args(argv)
    if args.offload and not args.demote:
        parser.error("--offload goes with --demote DTYPE (the demoted rows are the ones offloaded)")
    tasks = parse_jobs(args.tasks, JOBS)
    out = Path(args.out)
    rows = args.rows.split(",")
    console = Console(width=200)
    results: dict[str, Any] = {"rows": rows, "size": args.size, "every": args.every, "set": args.set,
                               "demote": args.demote, "offload": args.offload,
                               "quick_sizes": QUICK_SIZES["fmnist-mobilenet"], "tasks": {}}
    md = []
    for task in tasks:
        base, params, overrides = task_config(task, args.size, args.seed, args.threads)
        base = deep_merge(base, {"run": {"ledger": True, "ledger_every": args.every}})
        if args.device:
            base = deep_merge(base, {"run": {"device": args.device}})
        for item in args.set:
            base = deep_merge(base, parse_override(item))
        got = compare(base, rows, out / task, console=console, row_params=params, row_overrides=overrides)
        demoted_rows = [r for r in rows if r != "none"]
        if args.demote and demoted_rows:
            demoted = deep_merge(base, {"freeze": {"demote": {"dtype": args.demote, "offload": args.offload}}})
            for r in compare(demoted, demoted_rows, out / f"{task}-demote", console=console, row_params=params,
                             row_overrides=overrides):
                got.append({**r, "row": demoted_name(r["row"], args.demote, args.offload)})
        for r in got:
            if r.get("run_dir"):
                r["returned"] = returned(Path(r["run_dir"]))
        results["tasks"][task] = [{k: r.get(k) for k in ("row", "test_accuracy", "steps", "memory",
                                                         "tensor_peak_bytes", "tensor_peak_ratio",
                                                         "peak_memory_bytes", "frozen_blocks", "freeze_steps",
                                                         "returned", "stopped", "demote", "cache")} for r in got]
        head, cells, back_head, back = tables(task, got)
        for title, h, c in ((f"{task}: peak bytes per bucket (memory ledger), tensor peak, process RSS", head, cells),
                            (f"{task}: what the freezes gave back (sum over memory events; negative: taken)",
                             back_head, back)):
            console.print(rich_table(title, h, c))
            md += [f"**{title}**", "", markdown(h, c)]
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "memory.md").write_text("\n".join(md))


if __name__ == "__main__":
    raise SystemExit(entry(main))
