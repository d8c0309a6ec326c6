"""One rank of the FSDP2 strategy test: ``python -m tests.distributed.fsdp_strategy_worker SPEC.json``.

The 5-block MLP of :mod:`tests.distributed.worker`, sharded with :func:`layerfreeze.distributed.shard_blocks` when
launched as several ranks (a plain model in one process: the reference), AdamW over one param group per block, and
a Freezer running ``spec["strategy"]`` with ``spec["params"]``, ``freezer.after_backward()`` after every backward
(what a gradient-based strategy reads) and, on rank 0, ``mirror=`` an unsharded copy taken before sharding (what a
strategy that reads weights observes; ``spec["no_mirror"]``: none, which the Freezer refuses on every rank).
``spec["timeout"]`` bounds every collective (seconds). One process takes each batch in rank order (rank 0's share
first), so what Egeria keeps as its probe (the first rows of the first forward) is rank 0's share, as on two ranks.

Per step it records the full weights' SHA-256 (every rank gathers them), the frozen set and, on the rank that
decides, the strategy's last signals. ``spec["checkpoint_at"]`` (sharded only): after that step, write
``save_full_checkpoint``, build a fresh model, optimizer and Freezer, ``load_full_checkpoint`` into them and go on
with those (a resume in mid-interval, in the same processes).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from layerfreeze import Freezer, block_param_groups, discover_blocks, load_full_checkpoint, save_full_checkpoint
from layerfreeze.distributed import close_distributed, init_distributed, loss_scale, rank, shard, shard_blocks
from tests.distributed.worker import mlp_task


def full_hashes(model: nn.Module) -> dict[str, str]:
    """SHA-256 of every full weight (a collective under FSDP2: every rank gathers each one)."""
    out = {}
    for k, v in model.state_dict().items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = hashlib.sha256(full.detach().contiguous().numpy().tobytes()).hexdigest()
    return out


def resumed(spec: dict, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
            freezer: Freezer) -> tuple[nn.Module, torch.optim.Optimizer, Freezer]:
    """Write a full checkpoint of the sharded run, then a fresh sharded model, optimizer and Freezer restored from
    it (collective: every rank)."""
    save_full_checkpoint(folder, model, optimizer, freezer)
    freezer.close()
    model = mlp_task().model
    blocks = discover_blocks(model)
    shard_blocks(model, blocks)
    optimizer = torch.optim.AdamW(block_param_groups(model, blocks, lr=0.01), lr=0.01)
    freezer = Freezer(model, optimizer, spec["strategy"], spec.get("params", {}), blocks=blocks,
                      total_steps=spec["steps"])
    load_full_checkpoint(folder, model, optimizer, freezer)
    return model, optimizer, freezer


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    sharded = init_distributed(timeout_s=spec.get("timeout", 60))
    task = mlp_task()
    model = task.model
    blocks = discover_blocks(model)
    # before sharding: FSDP2 modules cannot be copied
    mirror = copy.deepcopy(model) if rank() == 0 and not spec.get("no_mirror") else None
    if sharded:
        shard_blocks(model, blocks)
    optimizer = torch.optim.AdamW(block_param_groups(model, blocks, lr=0.01), lr=0.01)
    steps = spec["steps"]
    checkpoint_at = spec.get("checkpoint_at") if sharded else None
    out = Path(spec["out"]) / f"rank{rank()}.json"
    try:
        freezer = Freezer(model, optimizer, spec["strategy"], spec.get("params", {}), blocks=blocks,
                          total_steps=steps, mirror=mirror)
    except ValueError as exc:  # spec["no_mirror"]: refused on every rank
        out.write_text(json.dumps({"error": str(exc)}))
        close_distributed()
        return
    records = [{"step": 0, "frozen": list(freezer.frozen), "hashes": full_hashes(model)}]
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        idx = torch.randperm(len(task.train_set), generator=g)[:16].tolist()
        local = shard(idx) if sharded else shard(idx, 0, 2) + shard(idx, 1, 2)
        x = torch.stack([task.train_set[i]["pixel_values"] for i in local])
        y = torch.stack([task.train_set[i]["labels"] for i in local])
        loss = nn.functional.cross_entropy(model(x), y, reduction="sum")
        (loss * (loss_scale(len(local), len(idx)) if sharded else 1 / len(idx))).backward()
        freezer.after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        freezer.step()
        records.append({"step": step + 1, "frozen": list(freezer.frozen), "hashes": full_hashes(model),
                        "signals": freezer.last_signals if freezer.decides else None})
        if step + 1 == checkpoint_at:
            model, optimizer, freezer = resumed(spec, Path(spec["out"]) / "ckpt", model, optimizer, freezer)
    freezer.verify_frozen_weights()
    freezer.close()
    out.write_text(json.dumps({"records": records, "history": freezer.history}, default=float))
    close_distributed()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
