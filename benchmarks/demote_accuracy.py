"""What demoting frozen blocks costs in accuracy and gives back in bytes (issue 31, item 2): each freezing row of the
suite's tasks run twice per seed, as it is and with ``freeze.demote`` (frozen blocks cast to bfloat16, optionally
offloaded), everything else equal (seed, data order, budget).

Per task and seed, two ``layerfreeze.train.compare`` runs in this process: the rows as they are
(``OUT/<task>/seed<N>/plain/``), then the same rows with ``freeze.demote.dtype`` (``OUT/<task>/seed<N>/demoted/``).
Per row: test accuracy of both and their difference (points, demoted minus plain; mean [min, max] over seeds), the
peak bytes of the frozen parameters on the training device (``params_frozen``), of the float32 master copies
(``params_master``, host memory or disk) and of offloaded weights (``params_offloaded``, host memory), the tensor peak
per device and its ratio demoted / plain. Bytes come from the memory ledger (``run.ledger_every=1``): exact, the same
on any machine; times are not reported.

    python -m benchmarks.demote_accuracy                         # the suite's three tasks, static and smartfrz, 3 seeds
    python -m benchmarks.demote_accuracy --tasks default-job --seeds 0      # the default job (MiniLM-L6 / BBC News)
    python -m benchmarks.demote_accuracy --offload cpu --device cuda        # offloaded too, bytes per device
    python -m benchmarks.demote_accuracy --tasks fmnist-mobilenet --size tiny --seeds 0 --rows static   # seconds

Tasks: the suite's (``benchmarks/suite.py`` TASKS, at SIZES; ``--size quick`` for QUICK_SIZES, ``--size tiny`` for
3 steps, a check that the script runs) and ``default-job`` (``make demo``: the CLI's defaults). Writes
``OUT/results.json`` (after every seed) and ``OUT/demote.md``, and prints one table per task.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.cli import entry, seed_list
from benchmarks.jobs import parse_jobs
from benchmarks.memory_table import markdown, rich_table
from benchmarks.memory_table import task_config as memory_task_config
from benchmarks.suite_tasks import SIZE_FIELDS, TASKS, base_config, dataset_sizes, row_settings, task_spec, total_steps
from layerfreeze.runs.rundir import finite
from layerfreeze.runs.summary import format_bytes
from layerfreeze.train.compare import compare
from layerfreeze.train.config_file import deep_merge

ROWS = ("static", "smartfrz")
#: ``--size tiny``: 3 steps on a few samples per task, to check the script runs (its test); not a measurement.
TINY: dict[str, tuple[int | None, ...]] = {
    #                    epochs  limit_train  limit_test  max_length  batch_size  max_steps
    "bbc":              (1,      48,          32,         32,         16,         3),
    "fmnist-mobilenet": (1,      96,          32,         None,       32,         3),
    "fmnist-resnet":    (1,      96,          32,         None,       32,         3),
}
BUCKETS = ("params_frozen", "params_master", "params_offloaded")


def task_config(task: str, size: str, seed: int, threads: int | None) -> tuple[dict[str, Any], dict, dict]:
    """``(base config, row_params, row_overrides)`` of a suite task (or ``default-job``) at a size and seed."""
    if task == "default-job":
        base, params, overrides = memory_task_config("default-job", "suite", seed, threads)
        if size == "tiny":
            base = deep_merge(base, {"train": {"max_steps": 3}, "data": {"limit_train": 48, "limit_test": 32},
                                     "model": {"max_length": 32}})
        return base, params, overrides
    spec = task_spec(task, quick=size == "quick")
    if size == "tiny":
        spec = replace(TASKS[task], **dict(zip(SIZE_FIELDS, TINY[task])))
    params, overrides = row_settings(spec, total_steps(spec, dataset_sizes(spec)[0]))
    return base_config(spec, seed, threads), params, overrides


def row_numbers(result: dict[str, Any]) -> dict[str, Any]:
    """What the tables read from one compare row: accuracy, the demotion buckets' peaks, tensor peaks per device."""
    mem = result.get("memory") or {}
    return {
        "test_accuracy": result.get("test_accuracy"),
        "stopped": result.get("stopped"),
        **{b: (mem.get("buckets", {}).get(b) or {}).get("peak_bytes", 0) for b in BUCKETS},
        "tensor_peak_bytes": result.get("tensor_peak_bytes"),
        "devices": {d: p["tensor_peak_bytes"] for d, p in (mem.get("devices") or {}).items()},
        "demote": result.get("demote"),
    }


def _mean_bytes(pairs: list[tuple[dict[str, Any], dict[str, Any]]], which: int, key: str) -> float | None:
    values = [pair[which][key] for pair in pairs if finite(pair[which][key])]
    return statistics.fmean(values) if values else None


def aggregate(seeds: list[dict[str, dict[str, Any]]], rows: list[str]) -> dict[str, dict[str, Any]]:
    """Per row, over seeds (each ``{"plain": {row: numbers}, "demoted": {row: numbers}}``): accuracies and their
    difference (mean, min, max), and the mean of each byte figure. A seed where either run stopped is left out of the
    accuracy (``stopped`` counts them)."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        pairs = [(s["plain"][row], s["demoted"][row]) for s in seeds if row in s["plain"] and row in s["demoted"]]
        ok = [(p, d) for p, d in pairs if finite(p["test_accuracy"]) and finite(d["test_accuracy"])]

        def span(values: list[float]) -> dict[str, float] | None:
            return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)} if values else None

        devices = sorted({d for p, d_ in pairs for d in (*p["devices"], *d_["devices"])})
        out[row] = {
            "seeds": len(pairs), "stopped": len(pairs) - len(ok),
            "acc_plain": span([p["test_accuracy"] for p, _ in ok]),
            "acc_demoted": span([d["test_accuracy"] for _, d in ok]),
            "delta_pts": span([100 * (d["test_accuracy"] - p["test_accuracy"]) for p, d in ok]),
            **{f"{b}_{w}": _mean_bytes(pairs, i, b) for b in (*BUCKETS, "tensor_peak_bytes")
               for i, w in ((0, "plain"), (1, "demoted"))},
            "devices": {dev: {w: statistics.fmean([pair[i]["devices"].get(dev, 0) for pair in pairs])
                              for i, w in ((0, "plain"), (1, "demoted"))} for dev in devices},
        }
    return out


def table(agg: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """(headers, cells) of one task's table."""
    devices = sorted({d for a in agg.values() for d in a["devices"]})

    def acc(s: dict[str, float] | None) -> str:
        return f"{100 * s['mean']:.2f} [{100 * s['min']:.2f}, {100 * s['max']:.2f}]" if s else "-"

    def size(n: float | None) -> str:
        return format_bytes(int(n)) if finite(n) else "-"

    head = ["row", "seeds", "test acc % plain", "test acc % demoted", "Δ pts mean [min, max]",
            "frozen params plain -> demoted", "master copies", "offloaded", "tensor peak plain -> demoted",
            *(f"tensor peak {d}" for d in devices if len(devices) > 1)]
    cells = []
    for row, a in agg.items():
        d = a["delta_pts"]
        cells.append([
            row, f"{a['seeds']}" + (f" ({a['stopped']} stopped)" if a["stopped"] else ""),
            acc(a["acc_plain"]), acc(a["acc_demoted"]),
            f"{d['mean']:+.2f} [{d['min']:+.2f}, {d['max']:+.2f}]" if d else "-",
            f"{size(a['params_frozen_plain'])} -> {size(a['params_frozen_demoted'])}",
            size(a["params_master_demoted"]), size(a["params_offloaded_demoted"]),
            f"{size(a['tensor_peak_bytes_plain'])} -> {size(a['tensor_peak_bytes_demoted'])}",
            *(f"{size(a['devices'][dev]['plain'])} -> {size(a['devices'][dev]['demoted'])}"
              if dev in a["devices"] else "-" for dev in devices if len(devices) > 1)])
    return head, cells


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated: {', '.join(TASKS)}, default-job")
    parser.add_argument("--rows", default=",".join(ROWS), help="freezing strategies (each run plain and demoted)")
    parser.add_argument("--seeds", type=seed_list, default=[0, 1, 2], help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--size", choices=("suite", "quick", "tiny"), default="suite",
                        help="the suite's SIZES, QUICK_SIZES, or 3 steps (tiny: a check that it runs)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16", help="freeze.demote.dtype")
    parser.add_argument("--offload", choices=("cpu",), help="freeze.demote.offload (default: none)")
    parser.add_argument("--master", choices=("auto", "memory", "disk"), default="auto", help="freeze.demote.master")
    parser.add_argument("--device", help="run.device (auto, cpu, cuda:N)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--out", default="runs/bench-demote")
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    if "none" in rows:
        parser.error("--rows: 'none' freezes nothing, so it has nothing to demote; give freezing strategies")
    out = Path(args.out)
    console = Console(width=200)
    demote = {"dtype": args.dtype, "offload": args.offload, "master": args.master}
    results: dict[str, Any] = {"rows": rows, "seeds": args.seeds, "size": args.size, "demote": demote, "tasks": {}}
    md = []
    for task in parse_jobs(args.tasks, (*TASKS, "default-job")):
        per_seed: list[dict[str, dict[str, Any]]] = []
        for seed in args.seeds:
            base, params, overrides = task_config(task, args.size, seed, args.threads)
            base = deep_merge(base, {"run": {"ledger": True, "ledger_every": 1}})
            if args.device:
                base = deep_merge(base, {"run": {"device": args.device}})
            got: dict[str, dict[str, Any]] = {}
            for kind, config in (("plain", base), ("demoted", deep_merge(base, {"freeze": {"demote": demote}}))):
                folder = out / task / f"seed{seed}" / kind
                shutil.rmtree(folder, ignore_errors=True)
                got[kind] = {r["row"]: row_numbers(r) for r in compare(config, rows, folder, console=console,
                                                                          row_params=params, row_overrides=overrides)}
            per_seed.append(got)
            results["tasks"][task] = {"per_seed": per_seed, "rows": aggregate(per_seed, rows)}
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps(results, indent=2))
        head, cells = table(results["tasks"][task]["rows"])
        title = (f"{task}: demoted ({args.dtype}" + (f", offload {args.offload}" if args.offload else "")
                 + f") vs not, seed(s) {', '.join(map(str, args.seeds))}")
        console.print(rich_table(title, head, cells))
        md += [f"**{title}**", "", markdown(head, cells)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "demote.md").write_text("\n".join(md))
    return results


if __name__ == "__main__":
    raise SystemExit(entry(main))
