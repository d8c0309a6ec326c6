"""What a checkpoint of the default job costs: MiniLM-L6 (22.7M parameters) with AdamW state, written by
:class:`~layerfreeze.checkpoint.CheckpointStore` (safetensors + state, every file and folder fsynced, atomic rename),
against the time of one training step of the default job (batch 32, 128 tokens). Prints a table.

    python -m benchmarks.checkpoint_cost [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader

from benchmarks.cli import count, entry
from layerfreeze import Freezer, block_param_groups
from layerfreeze.checkpoint import CheckpointStore
from layerfreeze.runs.summary import format_bytes
from layerfreeze.train.config import build_config
from layerfreeze.train.tasks import build_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=count(1), default=3)
    args = parser.parse_args()
    task = build_task(build_config({}))
    model = task.model
    freezer = Freezer(model, None, "none")
    optimizer = torch.optim.AdamW(block_param_groups(model, freezer.blocks, lr=5e-5), lr=5e-5)
    freezer.attach_optimizer(optimizer)
    batch = next(iter(DataLoader(task.train_set, batch_size=32)))
    steps = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(task.forward(model, batch), batch["labels"]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        store = CheckpointStore(Path(tmp), keep=2)
        saves = []
        for i in range(args.repeats):
            t0 = time.perf_counter()
            path = store.save(i + 1, model, optimizer, freezer)
            saves.append(time.perf_counter() - t0)
        size = sum(f.stat().st_size for f in path.iterdir())
    step, save = min(steps), min(saves)
    table = Table(title="Checkpoint cost, MiniLM-L6 + AdamW state (default job)")
    for col in ("checkpoint size", f"write s (best of {args.repeats})", "training step s", "write / step",
                "every 10 min costs"):
        table.add_column(col, justify="right")
    table.add_row(format_bytes(size), f"{save:.2f}", f"{step:.2f}", f"{save / step:.2f}",
                  f"{100 * save / 600:.2f}% of the run")
    Console(width=140).print(table)


if __name__ == "__main__":
    raise SystemExit(entry(main))
