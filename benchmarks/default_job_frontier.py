"""Can any single freeze meet the default job's target? One prefix frozen at one step, trained for real.

Issue 16 asks for SmartFRZ within 0.3 points of ``none`` at <= 0.5x its training time on ``make demo``'s job
(MiniLM-L6 / BBC News, 3 epochs = 168 steps, the activation cache on). Before tuning a policy towards it, this script
measures the frontier of the simplest policies: freeze blocks ``0 .. d-1`` once ``t`` optimizer steps are done and
keep them frozen (with the cache, from then on the prefix is computed once per sample and then read back). Each
schedule ``d@t`` is one run of the default job; ``none`` is run first unless ``--none-from`` names a finished
``none`` run folder of the same job (its accuracy and FLOPs are the reference).

    python benchmarks/default_job_frontier.py --schedules 6@28,5@28,6@14,7@56
    python benchmarks/default_job_frontier.py --schedules 6@28 --none-from runs/default-job/none

Prints test accuracy, the difference to ``none`` in points, training FLOPs (measured, cache hits excluded) and their
ratio, the cache hit rate, and the training time ratio (meaningful only when nothing else ran on the machine: run
it alone for times). Outputs ``OUT/frontier.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle_replay import OracleSchedule  # noqa: E402  (freeze each block at a given step)

from layerfreeze.config import build_config  # noqa: E402
from layerfreeze.strategies import register_strategy  # noqa: E402
from layerfreeze.trainer import Trainer  # noqa: E402

#: The default job's non-head blocks (MiniLM-L6 for sequence classification), front to back, and the head.
N_BLOCKS = 9


def parse_schedule(text: str) -> tuple[int, int]:
    """``"d@t"`` -> ``(d, t)``.

    Raises:
        ValueError: not two non-negative integers with ``1 <= d < N_BLOCKS``.
    """
    d, _, t = text.partition("@")
    depth, step = int(d), int(t)
    if not 1 <= depth < N_BLOCKS or step < 0:
        raise ValueError(f"schedule {text!r}: need 1 <= d <= {N_BLOCKS - 1} (the head never freezes) and t >= 0")
    return depth, step


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
    p.add_argument("--schedules", required=True, help="comma-separated d@t: freeze blocks 0..d-1 after t steps")
    p.add_argument("--out", type=Path, default=Path("runs/bench-frontier"))
    p.add_argument("--none-from", type=Path, help="a finished none run folder of the same job (its summary.json)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    try:
        schedules = [parse_schedule(s.strip()) for s in args.schedules.split(",") if s.strip()]
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
    for depth, step in schedules:
        name = f"d{depth}@{step}"
        if name in results:
            continue
        steps = [step if i < depth else None for i in range(N_BLOCKS)]
        results[name] = run(name, args.out, args.threads, {"steps": steps})
        results_path.write_text(json.dumps(results, indent=2))
    none = results["none"]
    table = Table(title="The default job: one prefix frozen at one step (cache on by default)")
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
    sys.exit(main())
