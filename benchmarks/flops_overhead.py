"""What counting a training step's FLOPs costs: a normal step, one counted by ``FlopCounterMode``, one counted by
:class:`~layerfreeze.runs.flops.TotalFlopCounter` (what :func:`~layerfreeze.runs.measure.measure_flops` uses).

For each task the script builds the model and data as ``layerfreeze train`` would (nothing frozen, the activation cache
and the ledger off, so every step does the same work) and times ``--steps`` steps of the trainer's own step
(:meth:`Trainer.train_step <layerfreeze.train.trainer.Trainer.train_step>`: forward, loss, backward, clipping,
optimizer step) in each of three modes, interleaved step by step in one process so that drift (warm-up, other
processes) spreads evenly over them:

* ``normal``: no counter;
* ``FlopCounterMode``: ``torch.utils.flop_counter.FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)``,
  how ``measure_flops`` counted before issue 40;
* ``TotalFlopCounter``: the same count, totals only.

Overhead = (mode's median step - ``normal``'s) in ms; per op = that over the ops one step dispatches (counted once
with a pass-through dispatch mode: every op a counter sees). The two counts of every counted step must be equal (the
table says so; the script stops otherwise).

    python -m benchmarks.flops_overhead                     # the default job's MiniLM-L6 / BBC News and MobileNetV2
    python -m benchmarks.flops_overhead --tasks fashion-mnist --steps 5 --batch-size 32   # a quick look
    python -m benchmarks.flops_overhead --threads 1 --batch-size 8 --max-length 32   # steadier beside other jobs

A task whose offline asset is not installed (``layerfreeze assets``) is left out with a note. The model trains on
``run.device`` = auto (a GPU when there is one; the clock waits for it). Prints a table and writes
``--out/results.json``. Run it alone on the machine: other processes sharing the cores distort the timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.cli import count, entry
from layerfreeze.runs.flops import FLOP_FORMULAS, TotalFlopCounter
from layerfreeze.train.assets import AssetMissingError
from layerfreeze.train.config import IMAGE_TASKS, build_config
from layerfreeze.train.setup import epoch_batches
from layerfreeze.train.trainer import Trainer

#: The default job (MiniLM-L6 / BBC News, 128 tokens, batch 32) and the suite's MobileNetV2 / Fashion-MNIST (batch 128).
TASKS = {
    "bbc-news": {"task": "bbc-news", "model": {"max_length": 128}, "train": {"batch_size": 32}},
    "fashion-mnist": {"task": "fashion-mnist", "train": {"batch_size": 128}, "data": {"limit_train": 4096}},
}
MODES = ("normal", "FlopCounterMode", "TotalFlopCounter")


class _OpCount(TorchDispatchMode):
    """Counts the ops that reach a dispatch mode (what a FLOP counter's ``__torch_dispatch__`` is called for)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _now(device: torch.device) -> float:
    """A clock reading after the device's queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _counter(mode: str):
    if mode == "FlopCounterMode":
        return FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
    return TotalFlopCounter()


def measure(name: str, overrides: dict, steps: int, out: Path, batch_size: int | None = None,
            max_length: int | None = None, threads: int | None = None) -> dict:
    """Median seconds of a step per mode for one task (see the module docstring), the ops one step dispatches and
    the two counters' counts (FLOPs per step, equal)."""
    overrides = json.loads(json.dumps(overrides))
    if batch_size:
        overrides.setdefault("train", {})["batch_size"] = batch_size
    if max_length and overrides.get("task") not in IMAGE_TASKS:  # tokens per sample: the text tasks' alone
        overrides.setdefault("model", {})["max_length"] = max_length
    run = {"dir": str(out / name), "progress": False, "checkpoint": False, "tensorboard": False, "ledger": False}
    if threads:
        run["threads"] = threads
    config = build_config({**overrides, "freeze": {"strategy": "none", "cache": {"mode": "off"}}, "run": run})
    trainer = Trainer(config)
    trainer.setup()
    n = config.train.batch_size
    batches = epoch_batches(len(trainer.train_set), n, config.train.seed, 0)
    needed = 3 + len(MODES) * steps
    batches = (batches * (needed // len(batches) + 1))[:needed]  # a small training set: its batches again
    loader = DataLoader(trainer.train_set, batch_sampler=batches, generator=torch.Generator())
    trainer.model.train()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    flops: dict[str, set[int]] = {m: set() for m in MODES[1:]}
    ops = 0
    for i, (batch, ids) in enumerate(zip(loader, batches)):
        if i == 2:  # after the first two steps, which allocate the optimizer's state
            counter = _OpCount()
            with counter:
                trainer.train_step(batch, len(ids), len(ids))
            ops = counter.ops
            continue
        mode = "normal" if i < 2 else MODES[(i - 3) % len(MODES)]
        counter = None if mode == "normal" else _counter(mode)
        t0 = _now(trainer.device)
        if counter is None:
            trainer.train_step(batch, len(ids), len(ids))
        else:
            with counter:
                trainer.train_step(batch, len(ids), len(ids))
        seconds = _now(trainer.device) - t0
        if counter is not None:
            flops[mode].add(int(counter.get_total_flops()))
        if i >= 3:
            times[mode].append(seconds)
    trainer.freezer.close()
    if flops["FlopCounterMode"] != flops["TotalFlopCounter"] or len(flops["FlopCounterMode"]) != 1:
        raise AssertionError(f"{name}: the counts differ: {flops}")
    med = {m: statistics.median(v) for m, v in times.items()}
    over = {m: med[m] - med["normal"] for m in MODES[1:]}
    return {"task": name, "device": str(trainer.device), "threads": torch.get_num_threads(), "batch_size": n,
            "steps_per_mode": steps,
            "ops_per_step": ops, "flops_per_step": flops["TotalFlopCounter"].pop(), "step_s": med,
            "overhead_s": over, "overhead_per_op_us": {m: 1e6 * over[m] / max(1, ops) for m in over}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {', '.join(TASKS)}")
    parser.add_argument("--steps", type=count(5), default=7, help="timed training steps per mode and task (>= 5)")
    parser.add_argument("--batch-size", type=int, help="instead of the task's (a quick look)")
    parser.add_argument("--max-length", type=int, help="tokens per text sample, instead of 128 (a quick look)")
    parser.add_argument("--threads", type=int, help="CPU threads (run.threads; 1 is steadier on a shared machine)")
    parser.add_argument("--out", default="runs/bench-flops-overhead")
    args = parser.parse_args()
    out = Path(args.out)
    rows, missing = [], []
    for task in args.tasks.split(","):
        try:
            rows.append(measure(task, TASKS[task], args.steps, out, args.batch_size, args.max_length,
                                args.threads))
        except AssetMissingError as err:  # an offline asset not installed: the other tasks still run
            missing.append(f"{task}: {err}")
    table = Table(title="Counting a training step's FLOPs: median step (trainer's step, nothing frozen) without a "
                        "counter, under FlopCounterMode, under TotalFlopCounter (measure_flops); overhead over the "
                        "normal step, in all and per dispatched op")
    for col in ("task", "device", "threads", "batch", "ops/step", "FLOPs/step (both)", "normal", "FlopCounterMode",
                "TotalFlopCounter", "overhead FCM", "overhead Total", "per op FCM", "per op Total"):
        table.add_column(col, justify="right")
    for r in rows:
        s, o, p = r["step_s"], r["overhead_s"], r["overhead_per_op_us"]
        table.add_row(r["task"], r["device"], str(r["threads"]), str(r["batch_size"]), str(r["ops_per_step"]),
                      f"{r['flops_per_step']:.4g}", *(f"{1000 * s[m]:.1f} ms" for m in MODES),
                      *(f"{1000 * o[m]:+.1f} ms" for m in MODES[1:]), *(f"{p[m]:.1f} us" for m in MODES[1:]))
    Console(width=180).print(table)
    for line in missing:
        print(f"left out: {line}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    raise SystemExit(entry(main))
