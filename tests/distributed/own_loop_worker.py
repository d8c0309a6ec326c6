"""One rank of an own-loop DDP run: ``python -m tests.distributed.own_loop_worker SPEC.json``
(tests/test_ddp_own_loop.py).

The 5-block MLP of :mod:`tests.distributed.worker` under :class:`~layerfreeze.distributed.FreezeDDP`, AdamW with one
param group per block, a LambdaLR scheduler and the spec's strategy, for ``steps`` steps of 8 samples per rank.
``hand_at``/``hand``: after that step, the user freezes parameter ``hand`` by hand (``requires_grad_(False)``).
``batchnorm``: a ``BatchNorm1d`` in each stage, built with ``momentum=None`` (a cumulative average).
``plain_ddp``: torch's ``DistributedDataParallel`` built once instead (accelerate's ``prepare`` under several
processes), with ``rebuild``: :func:`~layerfreeze.distributed.rebuild_ddp` after every step that changed the frozen set.
``save_at``/``checkpoint``: rank 0 writes a checkpoint after that step; ``resume``: start from one. Per step it
records the frozen set, which parameters require grad and every weight's SHA-256; at the end, the wrapper's rebuilds.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from layerfreeze import Freezer, block_param_groups, discover_blocks, load_checkpoint, save_checkpoint
from layerfreeze.distributed import FreezeDDP, close_distributed, init_distributed, rank, rebuild_ddp
from tests.distributed.worker import mlp_task, weight_hashes


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    init_distributed(timeout_s=30)
    task = mlp_task(batchnorm=spec.get("batchnorm", False))
    model = task.model
    for module in model.modules():
        if isinstance(module, nn.BatchNorm1d):
            module.momentum = None
    blocks = discover_blocks(model)
    optimizer = torch.optim.AdamW(block_param_groups(model, blocks, lr=0.01))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    freezer = Freezer(model, optimizer, spec["strategy"], spec.get("params", {}), blocks=blocks,
                      scheduler=scheduler, total_steps=spec["steps"])
    start = load_checkpoint(spec["resume"], model, optimizer, freezer, scheduler)["step"] if spec.get("resume") else 0
    ddp = nn.parallel.DistributedDataParallel(model) if spec.get("plain_ddp") else FreezeDDP(model, freezer)
    records = []
    for step in range(start, spec["steps"]):
        g = torch.Generator().manual_seed(100 * step + rank())
        idx = torch.randint(0, len(task.train_set), (8,), generator=g).tolist()
        x = torch.stack([task.train_set[i]["pixel_values"] for i in idx])
        y = torch.stack([task.train_set[i]["labels"] for i in idx])
        nn.functional.cross_entropy(ddp(x), y).backward()
        freezer.after_backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        before = list(freezer.frozen)
        freezer.step()
        if spec.get("rebuild") and freezer.frozen != before:
            rebuild_ddp(ddp, freezer)
        if step + 1 == spec.get("hand_at"):
            model.get_parameter(spec["hand"]).requires_grad_(False)
        records.append({"step": step + 1, "frozen": list(freezer.frozen), "hashes": weight_hashes(model),
                        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()}})
        if step + 1 == spec.get("save_at") and rank() == 0:
            save_checkpoint(spec["checkpoint"], model, optimizer, freezer, scheduler, extra={"step": step + 1})
    freezer.close()
    (Path(spec["out"]) / f"rank{rank()}.json").write_text(json.dumps({"records": records}))
    close_distributed()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
