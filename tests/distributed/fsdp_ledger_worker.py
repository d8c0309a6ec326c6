"""One rank of the FSDP2 memory-ledger test: ``python -m tests.distributed.fsdp_ledger_worker SPEC.json``.

Three blocks (16->24, 24->24, and a 24->5 head whose 5 rows do not divide over 2 ranks) sharded with
:func:`layerfreeze.distributed.shard_blocks`, AdamW, a Freezer with block 0 frozen (static k=1), a
:class:`~layerfreeze.runs.ledger.MemoryLedger` sampling every step. Two steps; this rank writes the second step's
ledger record and, per parameter, its block, whether it trains, its whole bytes, its local shard's bytes
(``numel * itemsize`` of ``to_local()``) and its padded shard's bytes (``ceil(dim0 / world) * rest * itemsize``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
from torch import nn

from layerfreeze import Freezer, discover_blocks
from layerfreeze.distributed import close_distributed, init_distributed, rank, shard_blocks, world_size
from layerfreeze.runs.ledger import MemoryLedger


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    init_distributed(timeout_s=30)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 24), nn.ReLU()), nn.Sequential(nn.Linear(24, 24), nn.ReLU()),
                          nn.Linear(24, 5))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    blocks = discover_blocks(model)
    shard_blocks(model, blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    freezer = Freezer(model, optimizer, "static", {"k": 1}, blocks=blocks)
    ledger = MemoryLedger(model, optimizer, freezer=freezer, every=1)
    g = torch.Generator().manual_seed(rank())
    for step in (1, 2):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
        with ledger.step(step):
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        freezer.step()
    world = world_size()
    params = {}
    for name, p in model.named_parameters():
        local = p.to_local()
        shape = shapes[name]
        rest = math.prod(shape[1:])
        params[name] = {"block": int(name.split(".")[0]), "trainable": p.requires_grad,
                        "whole_bytes": math.prod(shape) * p.element_size(),
                        "local_bytes": local.numel() * local.element_size(),
                        "padded_bytes": math.ceil(shape[0] / world) * rest * p.element_size()}
    out = {"memory": ledger.last.to_record(), "params": params, "summary": ledger.summary()}
    ledger.close()
    freezer.close()
    (Path(spec["out"]) / f"rank{rank()}.json").write_text(json.dumps(out))
    close_distributed()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
