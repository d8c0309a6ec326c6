"""SmartFRZ's online cost: recorder snapshot + predictor, against the cost of one training step.

For each task the script builds the real model and data (as ``layerfreeze train`` would) and times ``--steps`` full
training steps (forward, backward, clip, optimizer step, nothing frozen). Then it times a SmartFRZ stage with every
block active (every block gathered into its ring buffer) and predictions (features + attention network) for
(a) the front block only: the usual stage under the prefix rule, whose visit stops at the first block that does not
freeze, and (b) every non-head block: the worst case (``prefix=False``, or a stage where all blocks freeze).
Overhead = stage time / (stage interval x step time), with the strategy's default interval
``max(1, round(total_steps / 150))`` (``--every N`` to set it). Once blocks freeze the steps get cheaper, but so do
the stages (frozen blocks are neither recorded nor predicted). The gradient signal-to-noise gate's part of a stage
(``snr_gate``, on by default since issue 29) is timed apart: Adam's moments read at every block's sampled positions.

    python -m benchmarks.smartfrz_overhead                     # MiniLM-L6 / BBC News and MobileNetV2 / F-MNIST
    python -m benchmarks.smartfrz_overhead --tasks default-job --steps 20

Prints a table and writes ``--out/results.json``. Run it alone on the machine (other torch processes share the
cores and distort both timings).
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
from layerfreeze.train.config import build_config
from layerfreeze.train.setup import epoch_batches
from layerfreeze.train.trainer import Trainer

TASKS = {
    # the benchmarks' job names (benchmarks/jobs.py): the default job's step, MobileNetV2 / Fashion-MNIST at batch 128
    "default-job": {**CLI_CONFIG["default-job"], "model": {"max_length": 128}, "train": {"batch_size": 32}},
    "fmnist-mobilenet": {**CLI_CONFIG["fmnist-mobilenet"], "train": {"batch_size": 128},
                         "data": {"limit_train": 4096}},
}


def time_stage(strategy, blocks, repeats: int, predict: int | None = None) -> float:
    """Median seconds of one stage with every block active: snapshot every block, then predict the first
    ``predict`` non-head blocks (None: all of them), as :meth:`SmartFRZ.decide` does."""
    rec = strategy.recorder
    for step in range(rec.window):  # fill the windows
        rec.snapshot([True] * len(blocks), step)
    asked = [b for b in blocks if not b.is_head][:predict]
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        rec.snapshot([True] * len(blocks), rec.window + r)
        for b in asked:
            strategy.predict(b.index, len(blocks), total_steps=1000)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_gate(strategy, freezer, repeats: int) -> float:
    """Median seconds of the gradient signal-to-noise gate's part of a stage (issue 29; on by default): plan the
    read of Adam's moments at every watched block's sampled positions, gather and bring them to the host
    (:class:`~layerfreeze.strategies.smartfrz.reader.StageReader`, the gate's rows alone here) and compute each
    block's z into the gate, from the optimizer state the timed steps left."""
    from layerfreeze.engine.stages import context
    from layerfreeze.strategies.smartfrz.snr_gate import SNRGate

    if strategy.gate is None:
        strategy.gate = SNRGate(len(freezer.blocks))
    ctx = context(freezer, "step")
    n = len(ctx.blocks)
    watched = [b.index for b in ctx.blocks if not b.frozen and not b.is_head]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        moments = strategy._moments.plan(watched, ctx.optimizer_state, m_row=n, v_row=2 * n)
        read = strategy.reader.launch(moments.picks, moments.steps).settle()
        for i, (z, adam_step) in strategy._moments.z_from(moments, read.values, read.scalars).items():
            strategy.gate.observe(i, z, adam_step)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(name: str, overrides: dict, steps: int, every: int | None, out: Path) -> dict:
    config = build_config({**overrides, "freeze": {"strategy": "smartfrz"},
                           "run": {"dir": str(out / name), "progress": False, "checkpoint": False,
                                   "tensorboard": False}})
    trainer = Trainer(config)
    trainer.setup()
    batches = epoch_batches(len(trainer.train_set), config.train.batch_size, config.train.seed, 0)[:steps + 2]
    loader = DataLoader(trainer.train_set, batch_sampler=batches, generator=torch.Generator())
    trainer.model.train()
    step_times = []
    for i, (batch, ids) in enumerate(zip(loader, batches)):
        t0 = time.perf_counter()
        trainer.train_step(batch, len(ids), len(ids))  # one process: every sample of the batch counts
        if i >= 2:  # the first steps allocate optimizer state
            step_times.append(time.perf_counter() - t0)
    step = statistics.median(step_times)
    strategy = trainer.freezer.strategy
    blocks = trainer.freezer.blocks
    typical = time_stage(strategy, blocks, repeats=20, predict=1)
    worst = time_stage(strategy, blocks, repeats=20)
    gate = time_gate(strategy, trainer.freezer, repeats=20)
    interval = every or max(1, round(trainer.total_steps / 150))
    return {"task": name, "blocks": len(blocks), "sample_size": strategy.sample_size, "window": strategy.window,
            "step_s": step, "stage_s": typical, "stage_worst_s": worst, "stage_every": interval,
            "total_steps": trainer.total_steps, "overhead": typical / (interval * step),
            "overhead_worst": worst / (interval * step), "gate_s": gate,
            "overhead_with_gate": (typical + gate) / (interval * step)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {', '.join(TASKS)}")
    parser.add_argument("--steps", type=count(1), default=10, help="timed training steps per task")
    parser.add_argument("--every", type=int, help="stage interval in steps (default: the strategy's)")
    parser.add_argument("--out", default="runs/bench-smartfrz-overhead")
    args = parser.parse_args()
    out = Path(args.out)
    rows = [measure(t, TASKS[t], args.steps, args.every, out) for t in parse_jobs(args.tasks, tuple(TASKS))]
    table = Table(title="SmartFRZ online cost per stage: every block recorded; predicted: the front block (prefix "
                        "rule, the usual stage) / every non-head block (worst case); the SNR gate (snr_gate, on by "
                        "default) per stage")
    for col in ("task", "blocks", "train step", "stage, front block", "stage, all blocks", "stage every",
                "overhead", "overhead, worst", "SNR gate", "overhead with gate"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["task"], str(r["blocks"]), f"{1000 * r['step_s']:.1f} ms", f"{1000 * r['stage_s']:.2f} ms",
                      f"{1000 * r['stage_worst_s']:.2f} ms", f"{r['stage_every']} steps",
                      f"{100 * r['overhead']:.2f}%", f"{100 * r['overhead_worst']:.2f}%",
                      f"{1000 * r['gate_s']:.2f} ms", f"{100 * r['overhead_with_gate']:.2f}%")
    Console(width=140).print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    raise SystemExit(entry(main))
