"""Can a fixed freeze schedule meet the default job's target? A prefix frozen at given steps, trained for real.

Issue 16 asks for SmartFRZ within 0.3 points of ``none`` at <= 0.5x its training time on ``make demo``'s job
(MiniLM-L6 / BBC News, 3 epochs = 168 steps, the activation cache on). Before tuning a policy towards it, this script
measures the frontier of the simplest policies: freeze blocks ``0 .. d-1`` once ``t`` optimizer steps are done and
keep them frozen (with the cache, from then on the prefix is computed once per sample and then read back). Each
schedule ``d@t`` is one run of the default job; stages joined by ``+`` grow the prefix in steps (``5@28+6@120``:
blocks 0-4 after step 28, block 5 after step 120). ``none`` is run first unless ``--none-from`` names a finished
``none`` run folder of the same job (its accuracy and FLOPs are the reference).

    python -m benchmarks.default_job_frontier --schedules 6@28,5@28,6@14,7@56
    python -m benchmarks.default_job_frontier --schedules 5@28+6@120,5@20+6@112+7@140
    python -m benchmarks.default_job_frontier --schedules 6@28 --none-from runs/default-job/none

Prints test accuracy, the difference to ``none`` in points, training FLOPs (measured, cache hits excluded) and their
ratio, the cache hit rate, and the training time ratio (meaningful only when nothing else ran on the machine: run
it alone for times). Outputs ``OUT/frontier.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.cli import entry
from benchmarks.oracle_replay import OracleSchedule  # freeze each block at a given step
from layerfreeze.strategies import register_strategy
from layerfreeze.train.config import build_config
from layerfreeze.train.trainer import Trainer

#: The default job's non-head blocks (MiniLM-L6 for sequence classification), front to back, and the head.
N_BLOCKS = 9


def parse_schedule(text: str) -> list[int | None]:
    """``"d@t"`` or stages ``"d@t+d'@t'+..."`` -> one freeze step (None: never) per block, front to back.

    Stage ``d@t`` freezes blocks ``0 .. d-1`` (those not frozen by an earlier stage) once ``t`` steps are done.

    Raises:
        ValueError: a stage is not two non-negative integers with ``1 <= d < N_BLOCKS``, or the stages do not grow
            the prefix (each deeper than the last, at the same step or later).
    """
    steps: list[int | None] = [None] * N_BLOCKS
    last_depth, last_step = 0, 0
    for stage in text.split("+"):
        d, _, t = stage.partition("@")
        try:
            depth, step = int(d), int(t)
        except ValueError:
            raise ValueError(f"schedule {text!r}: stage {stage!r} is not d@t (two integers)") from None
        if not 1 <= depth < N_BLOCKS or step < 0:
            raise ValueError(f"schedule {text!r}: need 1 <= d <= {N_BLOCKS - 1} (the head never freezes) and t >= 0")
        if depth <= last_depth or step < last_step:
            raise ValueError(f"schedule {text!r}: each stage must freeze a deeper prefix at the same step or later")
        steps[last_depth:depth] = [step] * (depth - last_depth)
        last_depth, last_step = depth, step
    return steps


def row_name(text: str) -> str:
    """``"5@28+6@120"`` -> ``"d5@28+d6@120"`` (the row and its run folder)."""
    return "+".join(f"d{stage}" for stage in text.split("+"))


def run(name: str, out: Path, threads: int | None, params: dict[str, Any] | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"run": {"dir": str(out / name), "progress": False, "checkpoint": False,
                                   "tensorboard": False, "threads": threads}}
    if params is None:
        cfg["freeze"] = {"strategy": "none"}
    else:
        cfg["freeze"] = {"strategy": "oracle", "params": params}
    return Trainer(build_config(cfg)).run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", required=True, help="comma-separated d@t: freeze blocks 0..d-1 after t steps; "
                   "stages joined by + (5@28+6@120)")
    p.add_argument("--out", type=Path, default=Path("runs/bench-frontier"))
    p.add_argument("--none-from", type=Path, help="a finished none run folder of the same job (its summary.json)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    try:
        schedules = {row_name(s.strip()): parse_schedule(s.strip()) for s in args.schedules.split(",") if s.strip()}
    except ValueError as exc:
        p.error(str(exc))
    register_strategy("oracle")(OracleSchedule)
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "frontier.json"
    results: dict[str, Any] = json.loads(results_path.read_text()) if results_path.is_file() else {}
    if args.none_from:
        results["none"] = json.loads((args.none_from / "summary.json").read_text())
    elif "none" not in results:
        results["none"] = run("none", args.out, args.threads, None)
        results_path.write_text(json.dumps(results, indent=2))
    for name, steps in schedules.items():
        if name in results:
            continue
        results[name] = run(name, args.out, args.threads, {"steps": steps})
        results_path.write_text(json.dumps(results, indent=2))
    none = results["none"]
    table = Table(title="The default job: a prefix frozen at fixed steps (cache on by default)")
    for h in ("row", "test acc %", "Δ pts", "train FLOPs", "FLOPs ratio", "cache hit rate", "time ratio"):
        table.add_column(h, justify="right")
    for name, r in results.items():
        cache = r.get("cache") or {}
        rate = cache.get("hit_rate")
        table.add_row(name, f"{100 * r['test_accuracy']:.2f}",
                      f"{100 * (r['test_accuracy'] - none['test_accuracy']):+.2f}",
                      f"{r['flops_total'] / 1e12:.1f} T", f"{r['flops_total'] / none['flops_total']:.3f}",
                      "-" if rate is None else f"{rate:.2f}",
                      f"{r['train_time_s'] / none['train_time_s']:.3f}")
    Console(width=160).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main))
