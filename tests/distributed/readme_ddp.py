"""One rank of the README's own-loop DDP snippet, run as written: ``python -m tests.distributed.readme_ddp SPEC.json``
(launched by tests/test_readme_snippets.py).

The snippet builds its own tiny model, optimizer and DistributedSampler loader (its marked setup); this execs its
text alone and writes rank<r>.json: the final weights' hashes, the freezer's step count and history.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from tests.conftest import README, readme_block
from tests.distributed.worker import weight_hashes

MARKER = "In your own loop, three lines change"


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    namespace: dict = {}
    exec(compile(readme_block(MARKER), f"{README}#scale-out", "exec"), namespace)  # noqa: S102 - our own README
    model, loader = namespace["model"], namespace["loader"]
    assert loader.sampler.num_replicas == int(os.environ["WORLD_SIZE"]) and loader.sampler.rank == rank
    freezer = namespace["freezer"]
    out = Path(spec["out"]) / f"rank{rank}.json"
    out.write_text(json.dumps({"hashes": weight_hashes(model), "steps": freezer.step_count, "planned": len(loader),
                               "strategy": freezer.strategy.name, "rebuilds": namespace["ddp"].rebuilds,
                               "history": [[h["kind"], h["index"], h["step"]] for h in freezer.history]}))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
