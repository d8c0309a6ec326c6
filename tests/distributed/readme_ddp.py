"""One rank of the README's own-loop DDP snippet, run as written: ``python -m tests.distributed.readme_ddp SPEC.json``
(launched by tests/test_readme_snippets.py).

Fills in what the snippet leaves to the user (``model``, ``optimizer``, ``steps``, ``loader`` with a
DistributedSampler, ``loss_fn``), execs the snippet's text, and writes rank<r>.json: the final weights' hashes, the
freezer's step count and history.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from layerfreeze import block_param_groups, discover_blocks
from tests.conftest import README, readme_block
from tests.distributed.worker import weight_hashes

MARKER = "In your own loop, three lines change"


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)  # the same initial weights and data on every rank
    x, y = torch.randn(256, 16), torch.randint(0, 4, (256,))
    data = TensorDataset(x + y[:, None].float(), y)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4)], nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(block_param_groups(model, discover_blocks(model), lr=3e-3))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=world, rank=rank,
                                                                          shuffle=True, seed=0))
    namespace = {"model": model, "optimizer": optimizer, "loader": loader, "steps": len(loader),
                 "loss_fn": nn.functional.cross_entropy}
    exec(compile(readme_block(MARKER), f"{README}#scale-out", "exec"), namespace)  # noqa: S102 - our own README
    freezer = namespace["freezer"]
    out = Path(spec["out"]) / f"rank{rank}.json"
    out.write_text(json.dumps({"hashes": weight_hashes(model), "steps": freezer.step_count, "planned": len(loader),
                               "strategy": freezer.strategy.name, "rebuilds": namespace["ddp"].rebuilds,
                               "history": [[h["kind"], h["index"], h["step"]] for h in freezer.history]}))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
