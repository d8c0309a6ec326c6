"""Behaviour unchanged, shown: run three reference trainings and compare their step records with another checkout's.

A refactoring (issue 39: the Freezer, the trainer, the ledger and the cache split into single-job modules) must not
change what a run does. This script runs three trainings through the CLI, each in its own process, and compares the
``metrics.jsonl`` records of two such sets bit for bit, leaving out only what a clock decides (wall time, step time,
samples per second, the ``time`` stamp of a record) and what the process's state decides (its resident set size,
which on the CPU is also the allocator peak; the cache's automatic budget, a share of the memory free at start):

* ``bbc``: the suite's BBC task (``benchmarks.suite``'s size: MiniLM-L6, 832 samples, 32 tokens, batch 16, 2 epochs)
  at seed 0 with the default strategy;
* ``default-job``: ``layerfreeze train`` with no arguments (MiniLM-L6 on BBC News, 3 epochs, 168 steps);
* ``fmnist-mobilenet``: the suite's MobileNetV2 / Fashion-MNIST task at seed 0 with the default strategy.

    python -m benchmarks.same_records run runs/records-before          # about 8 minutes on 2 cores
    python -m benchmarks.same_records compare runs/records-before runs/records-after

``compare`` prints, per job, how many records of each type matched and the first difference (job, record, key,
both values), and exits 1 on any difference or missing record, 0 when every record is the same.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from benchmarks.cli import entry

#: Keys a clock decides (seconds, rates, Unix time): left out of the comparison.
CLOCK_KEYS = frozenset({
    "time", "wall_time_s", "step_time_s", "samples_per_s", "train_time_s", "elapsed_s", "epoch_time_s",
    "eval_time_s", "time_s", "seconds", "step_ms", "data_time_s", "stage_time_s", "tokens_per_s",
})
#: Record keys that name the run's folder or machine, not its behaviour.
PLACE_KEYS = frozenset({"run_dir", "dir", "path", "hostname", "pid"})
#: Keys the process's state decides, not the run: its resident set size (``rss_bytes``; on the CPU the allocator
#: peak is the process's peak RSS, ``peak_memory_bytes``), and the activation cache's automatic budget (a quarter of
#: the host memory available when the run started).
PROCESS_KEYS = frozenset({"rss_bytes", "peak_memory_bytes", "peak_rss_bytes", "budget_bytes", "cache_budget_bytes"})

JOBS = ("bbc", "default-job", "fmnist-mobilenet")


def job_config(job: str) -> dict[str, Any] | None:
    """The job's config (None: the default job, run with no config at all)."""
    if job == "default-job":
        return None
    from benchmarks.suite_tasks import base_config, task_spec

    config = base_config(task_spec(job, quick=False), seed=0, threads=None)
    config["run"].update({"checkpoint": False})
    return config


def run(out: Path, jobs: list[str]) -> None:
    """Run each job into ``out/<job>`` with the CLI, one process each."""
    out.mkdir(parents=True, exist_ok=True)
    for job in jobs:
        run_dir = out / job
        cmd = [sys.executable, "-m", "layerfreeze", "train", "--run-dir", str(run_dir), "--no-progress",
               "--no-tensorboard", "--no-report"]
        config = job_config(job)
        if config is not None:
            path = out / f"{job}.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            cmd += ["--config", str(path)]
        print("same_records:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)


def _clock(key: str) -> bool:
    """A key a clock decides: one of :data:`CLOCK_KEYS`, or a name in seconds or milliseconds (``*_s``,
    ``*_seconds``, ``*_ms``: ``checkpoint_s``, ``cache_saved_seconds``)."""
    return key in CLOCK_KEYS or key.endswith(("_s", "_seconds", "_ms"))


def _strip(value: Any) -> Any:
    """The value with every clock- or place-decided key removed, at any depth."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items()
                if not _clock(k) and k not in PLACE_KEYS and k not in PROCESS_KEYS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def records(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl records, stripped of clock keys; config records are left out (they hold paths)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    out = [json.loads(line) for line in lines if line.strip()]
    return [_strip(r) for r in out if r.get("type") != "config"]


def first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """The path and both values of the first place where a and b differ (None when equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{where}.{key}: only in {'before' if key in a else 'after'}"
            diff = first_difference(a[key], b[key], f"{where}.{key}")
            if diff:
                return diff
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} items before, {len(b)} after"
        for i, (x, y) in enumerate(zip(a, b)):
            diff = first_difference(x, y, f"{where}[{i}]")
            if diff:
                return diff
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None  # NaN is NaN (a value the record holds as "no value"), though NaN != NaN
    if type(a) is not type(b) or a != b:
        return f"{where}: before {a!r}, after {b!r}"
    return None


def compare(before: Path, after: Path, jobs: list[str]) -> int:
    """Print one line per job; 0 when every job's records are identical, 1 otherwise."""
    failed = 0
    for job in jobs:
        a, b = records(before / job), records(after / job)
        kinds: dict[str, int] = {}
        for r in a:
            kinds[r.get("type", "?")] = kinds.get(r.get("type", "?"), 0) + 1
        diff = None if len(a) == len(b) else f"{len(a)} records before, {len(b)} after"
        for i, (x, y) in enumerate(zip(a, b)):
            if diff:
                break
            d = first_difference(x, y)
            if d:
                diff = f"record {i} ({x.get('type')}, step {x.get('step')}){d}"
        counted = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        if diff:
            failed += 1
            print(f"{job:18s} DIFFERENT: {diff}")
        else:
            print(f"{job:18s} identical: {counted} records")
    print(f"left out: clock keys ({', '.join(sorted(CLOCK_KEYS))}, *_s, *_seconds, *_ms); "
          f"process keys ({', '.join(sorted(PROCESS_KEYS))}); "
          f"place keys ({', '.join(sorted(PLACE_KEYS))})")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.same_records", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the reference jobs into OUT/<job>")
    r.add_argument("out", type=Path, help="folder for the jobs' run folders")
    c = sub.add_parser("compare", help="compare two folders written by run")
    c.add_argument("before", type=Path, help="the folder of the runs before the change")
    c.add_argument("after", type=Path, help="the folder of the runs after the change")
    for p in (r, c):
        p.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated subset of {', '.join(JOBS)}")
    args = parser.parse_args(argv)
    jobs = [j for j in args.jobs.split(",") if j]
    unknown = sorted(set(jobs) - set(JOBS))
    if unknown:
        parser.error(f"unknown job(s) {', '.join(unknown)}; choose from {', '.join(JOBS)}")
    if args.command == "run":
        run(args.out, jobs)
        return 0
    return compare(args.before, args.after, jobs)


if __name__ == "__main__":
    raise SystemExit(entry(main))
