"""One rank of the FSDP2 test: ``python -m tests.distributed.fsdp_worker SPEC.json`` (see tests/test_fsdp.py).

Trains the 5-block MLP of :mod:`tests.distributed.worker` for ``steps`` steps with gradual unfreezing (a thaw every
3 steps) and one manual freeze at step 7, with a no-grad evaluation forward between steps. Sharded with
:func:`layerfreeze.distributed.fsdp.shard_blocks` when launched as several ranks, a plain model in one process. Per step
it records the full weights' SHA-256, the reduce-scatter bytes and the number of optimizer states; it can save a full
checkpoint after step ``save_at`` and start from one (``resume``).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from layerfreeze import Freezer, block_param_groups, discover_blocks
from layerfreeze.checkpoint import load_full_checkpoint, save_full_checkpoint
from layerfreeze.distributed import close_distributed, init_distributed, is_distributed, loss_scale, rank, shard
from layerfreeze.distributed.fsdp import CollectiveBytes, shard_blocks
from tests.distributed.worker import mlp_task, weight_hashes


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    # every thawed block must be seen updated by the step after its thaw, on its local shard
    warnings.filterwarnings("error", message=".*were switched on and got gradients")
    sharded = init_distributed(timeout_s=60)
    task = mlp_task()
    model = task.model
    blocks = discover_blocks(model)
    if sharded:
        shard_blocks(model, blocks)
    optimizer = torch.optim.AdamW(block_param_groups(model, blocks, lr=0.01), lr=0.01)
    freezer = Freezer(model, optimizer, "gradual", {"every_steps": 3})
    start = 0
    if spec.get("resume"):
        start = load_full_checkpoint(spec["resume"], model, optimizer, freezer)["step"]
    records = []
    for step in range(start, spec["steps"]):
        g = torch.Generator().manual_seed(step)
        idx = torch.randperm(len(task.train_set), generator=g)[:16].tolist()
        local = shard(idx) if sharded else idx
        x = torch.stack([task.train_set[i]["pixel_values"] for i in local])
        y = torch.stack([task.train_set[i]["labels"] for i in local])
        with CollectiveBytes() as comm:
            losses = nn.functional.cross_entropy(model(x), y, reduction="sum")
            (losses * (loss_scale(len(local), len(idx)) if sharded else 1 / len(idx))).backward()
        freezer.after_backward()  # the first backward after a thaw probes the thawed block (sharded: its shard)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        freezer.step()
        if step + 1 == 7:
            freezer.freeze(3, reason="manual, mid-run")
        with torch.no_grad():  # an evaluation forward between steps
            model(x)
        weights = full_weights(model)
        records.append({"step": step + 1, "frozen": list(freezer.frozen), "hashes": weight_hashes_of(weights),
                        "reduce_scatter_bytes": comm.bytes["reduce_scatter"], "optimizer_states": len(optimizer.state),
                        "weights": {k: v.tolist() for k, v in weights.items()}})
        if spec.get("save_at") == step + 1:
            save_full_checkpoint(spec["checkpoint"], model, optimizer, freezer, extra={"step": step + 1})
    out = Path(spec["out"]) / f"rank{rank() if is_distributed() else 0}{spec.get('suffix', '')}.json"
    out.write_text(json.dumps({"records": records, "history": freezer.history}))
    close_distributed()


def weight_hashes_of(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    module = nn.Module()
    for k, v in weights.items():
        module.register_buffer(k.replace(".", "_"), v)
    return weight_hashes(module)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
