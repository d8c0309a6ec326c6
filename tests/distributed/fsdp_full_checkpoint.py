"""One rank of tests/test_checkpoint.py's FSDP2 full-checkpoint test: ``python -m tests.distributed.fsdp_full_checkpoint
SPEC.json``.

Trains the 5-block MLP of :mod:`tests.distributed.worker`, sharded with
:func:`layerfreeze.distributed.fsdp.shard_blocks`, with gradual unfreezing (a thaw every 2 steps), writes a full
checkpoint after step ``save_at`` with :func:`layerfreeze.checkpoint.save_full_checkpoint`, trains one step more, and
writes the full weights then (rank<r>.json) so the test can check that the checkpoint, loaded with
:func:`layerfreeze.load_checkpoint` into an unsharded model, trains on to the same weights; ``load_checkpoint`` into the
sharded model itself must refuse, naming :func:`layerfreeze.checkpoint.load_full_checkpoint`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from layerfreeze import CheckpointError, Freezer, block_param_groups, discover_blocks, load_checkpoint
from layerfreeze.checkpoint import save_full_checkpoint
from layerfreeze.distributed import close_distributed, init_distributed, loss_scale, rank, shard, shard_blocks
from tests.distributed.worker import mlp_task


def batch(task, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimizer step ``step`` (0-based): 16 samples, the same on every rank and in the test."""
    idx = torch.randperm(len(task.train_set), generator=torch.Generator().manual_seed(step))[:16].tolist()
    x = torch.stack([task.train_set[i]["pixel_values"] for i in idx])
    y = torch.stack([task.train_set[i]["labels"] for i in idx])
    return x, y


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    assert init_distributed(timeout_s=60)
    task = mlp_task()
    model = task.model
    blocks = discover_blocks(model)
    shard_blocks(model, blocks)
    optimizer = torch.optim.AdamW(block_param_groups(model, blocks, lr=0.01), lr=0.01)
    freezer = Freezer(model, optimizer, "gradual", {"every_steps": 2})
    for step in range(spec["save_at"] + 1):
        x, y = batch(task, step)
        local = shard(list(range(len(y))))
        loss = nn.functional.cross_entropy(model(x[local]), y[local], reduction="sum")
        (loss * loss_scale(len(local), len(y))).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        freezer.step()
        if step + 1 == spec["save_at"]:
            save_full_checkpoint(spec["checkpoint"], model, optimizer, freezer, extra={"step": step + 1})
            try:  # the sharded model itself: load_checkpoint names the function that reads it (and touches nothing)
                load_checkpoint(spec["checkpoint"], model, optimizer, freezer)
                refused = None
            except CheckpointError as exc:
                refused = str(exc)
    weights = {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}
    out = Path(spec["out"]) / f"rank{rank()}.json"
    out.write_text(json.dumps({"weights": weights, "frozen": list(freezer.frozen), "refused": refused}))
    close_distributed()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
