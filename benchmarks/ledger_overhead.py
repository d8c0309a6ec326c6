"""The memory ledger's cost: a training step with and without it, on the real models and data.

For each task the script builds the model and data as ``layerfreeze train`` would (nothing frozen, the activation cache
off, so every step does the same work) and times ``--steps`` training steps in each of three modes, interleaved step by
step so that drift (warm-up, other processes) spreads evenly over them:

* ``off``: no ledger;
* ``sampled``: a :class:`~layerfreeze.runs.ledger.MemoryLedger` samples the step (saved-tensor hooks in the forward,
  one walk over parameters, gradients, buffers and optimizer state, the block hooks);
* ``idle``: a ledger is attached but does not sample the step (its block hooks still run).

A ledger is built before each timed ledger step, outside the timed part (building it registers its hooks once per run
in the trainer). Overhead = (mode's median step - ``off``'s) / ``off``'s; at a cadence of N (``run.ledger_every``) a
run pays ``(sampled + (N - 1) * idle) / N``. The table also gives how many tensors autograd saved per step (one Python
call each) and the parameter count.

    python -m benchmarks.ledger_overhead                              # the default job's model and MobileNetV2
    python -m benchmarks.ledger_overhead --tasks fmnist-mobilenet --steps 4 --batch-size 32   # a quick look

The model trains on ``run.device`` = auto (a GPU when there is one; the clock waits for it). Prints a table and
writes ``--out/results.json``. Run it alone on the machine (other processes sharing the cores
distort the timings: a difference of a fraction of a percent needs a quiet machine and enough steps).
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
from torch.utils.data import DataLoader

from benchmarks.cli import count, entry
from benchmarks.jobs import CLI_CONFIG, parse_jobs
from layerfreeze.runs.ledger import MemoryLedger
from layerfreeze.train.config import IMAGE_TASKS, build_config
from layerfreeze.train.setup import epoch_batches
from layerfreeze.train.trainer import Trainer

#: The default job (MiniLM-L6 / BBC News, 128 tokens, batch 32) and the suite's MobileNetV2 / Fashion-MNIST (batch 128).
TASKS = {
    # the benchmarks' job names (benchmarks/jobs.py): the default job's step, MobileNetV2 / Fashion-MNIST at batch 128
    "default-job": {**CLI_CONFIG["default-job"], "model": {"max_length": 128}, "train": {"batch_size": 32}},
    "fmnist-mobilenet": {**CLI_CONFIG["fmnist-mobilenet"], "train": {"batch_size": 128},
                         "data": {"limit_train": 4096}},
}
MODES = ("off", "sampled", "idle")
CADENCES = (1, 10)


def _now(device: torch.device) -> float:
    """A clock reading after the device's queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _saved_tensors(trainer: Trainer, batch: dict) -> int:
    """How many tensors autograd saves in one forward of ``batch`` (each is one call of the ledger's pack hook)."""
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        batch = {k: v.to(trainer.device) for k, v in batch.items()}
        trainer.task.loss(trainer.task.forward(trainer.model, batch), batch)
    return count


def measure(name: str, overrides: dict, steps: int, out: Path, batch_size: int | None,
            max_length: int | None) -> dict:
    overrides = json.loads(json.dumps(overrides))
    if batch_size:
        overrides.setdefault("train", {})["batch_size"] = batch_size
    if max_length and overrides.get("task") not in IMAGE_TASKS:  # tokens per sample: the text tasks' alone
        overrides.setdefault("model", {})["max_length"] = max_length
    config = build_config({**overrides, "freeze": {"strategy": "none", "cache": {"mode": "off"}},
                           "run": {"dir": str(out / name), "progress": False, "checkpoint": False,
                                   "tensorboard": False, "ledger": False}})
    trainer = Trainer(config)
    trainer.setup()
    n = config.train.batch_size
    batches = epoch_batches(len(trainer.train_set), n, config.train.seed, 0)[: 2 + len(MODES) * steps]
    loader = DataLoader(trainer.train_set, batch_sampler=batches, generator=torch.Generator())
    trainer.model.train()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    saved = None
    for i, (batch, ids) in enumerate(zip(loader, batches)):
        if saved is None:
            saved = _saved_tensors(trainer, batch)
        mode = "off" if i < 2 else MODES[(i - 2) % len(MODES)]  # the first two steps allocate optimizer state
        ledger = None
        if mode != "off":
            ledger = MemoryLedger(trainer.model, trainer.optimizer, freezer=trainer.freezer, every=10**9)
            if mode == "idle":
                ledger.steps = 1  # past the first step, which a ledger always samples
        t0 = _now(trainer.device)
        if ledger is None:
            trainer.train_step(batch, len(ids), len(ids))
        else:
            with ledger.step():
                trainer.train_step(batch, len(ids), len(ids))
        seconds = _now(trainer.device) - t0
        if ledger is not None:
            assert ledger.last_step_sampled == (mode == "sampled")
            ledger.close()
        if i >= 2:
            times[mode].append(seconds)
    trainer.freezer.close()
    med = {m: statistics.median(v) for m, v in times.items()}
    over = {m: (med[m] - med["off"]) / med["off"] for m in ("sampled", "idle")}
    return {"task": name, "batch_size": n, "steps_per_mode": steps, "parameters": sum(
        p.numel() for p in trainer.model.parameters()), "parameter_tensors": len(list(trainer.model.parameters())),
        "saved_tensors_per_step": saved, "step_s": med, "overhead": over,
        "overhead_at_every": {str(k): (over["sampled"] + (k - 1) * over["idle"]) / k for k in CADENCES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {', '.join(TASKS)}")
    parser.add_argument("--steps", type=count(1), default=10, help="timed training steps per mode and task")
    parser.add_argument("--batch-size", type=int, help="instead of the task's (a quick look)")
    parser.add_argument("--max-length", type=int, help="tokens per text sample, instead of 128 (a quick look)")
    parser.add_argument("--out", default="runs/bench-ledger-overhead")
    args = parser.parse_args()
    out = Path(args.out)
    rows = [measure(t, TASKS[t], args.steps, out, args.batch_size, args.max_length)
            for t in parse_jobs(args.tasks, tuple(TASKS))]
    table = Table(title="The memory ledger's cost per training step: median step time without a ledger, with one "
                        "sampling the step, with one attached but idle")
    for col in ("task", "batch", "saved tensors/step", "param tensors", "step, off", "step, sampled", "step, idle",
                "sampled", "idle", *(f"every {k}" for k in CADENCES)):
        table.add_column(col, justify="right")
    for r in rows:
        s, o = r["step_s"], r["overhead"]
        table.add_row(r["task"], str(r["batch_size"]), str(r["saved_tensors_per_step"]), str(r["parameter_tensors"]),
                      *(f"{1000 * s[m]:.1f} ms" for m in MODES), f"{100 * o['sampled']:+.2f}%",
                      f"{100 * o['idle']:+.2f}%", *(f"{100 * r['overhead_at_every'][str(k)]:+.2f}%" for k in CADENCES))
    Console(width=160).print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    raise SystemExit(entry(main))
