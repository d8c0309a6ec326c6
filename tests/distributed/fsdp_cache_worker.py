"""One rank of the FSDP2 activation-cache test: ``python -m tests.distributed.fsdp_cache_worker SPEC.json``.

The 5-block MLP of :mod:`tests.distributed.worker` sharded with :func:`layerfreeze.distributed.shard_blocks` on 2
ranks, SGD, a Freezer with blocks 0-1 frozen (static k=2) and block 2 frozen by hand after step 3. Each rank trains on
its own 8 samples per step (:data:`PLAN`), chosen so that the ranks' caches disagree: both miss, one hits while the
other misses, both hit, both extend from the same older boundary, one extends while the other starts cold. With
``spec["cache"]`` the forward is a :class:`~layerfreeze.compute.cache.CachedPrefix`, else the model's own. Per step it
records the logits' and the full weights' SHA-256 and the cache's counters; ``spec["autocast"]``: each step's forward
under bfloat16 autocast. ``spec["root_only"]``: the model sharded
by ``fully_shard(model)`` alone instead, and what the cache's ``on`` and ``auto`` modes say of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from layerfreeze import CachedPrefix, Freezer, discover_blocks
from layerfreeze.distributed import close_distributed, init_distributed, rank, shard_blocks
from tests.distributed.fsdp_strategy_worker import full_hashes
from tests.distributed.worker import mlp_task

#: Per step, each rank's sample indices (rank 0, rank 1).
PLAN = [
    (range(0, 8), range(8, 16)),     # 1: both cold: the prefix everywhere
    (range(0, 8), range(16, 24)),    # 2: rank 0 hits, rank 1 misses: both run the prefix, rank 0 drops it
    (range(0, 8), range(8, 16)),     # 3: both hit: the prefix runs nowhere; block 2 freezes after this step
    (range(0, 8), range(8, 16)),     # 4: both have depth-2 entries: both extend from boundary 2
    (range(0, 8), range(16, 24)),    # 5: rank 0 hits at depth 3, rank 1 could extend: both run the prefix
    (range(32, 40), range(16, 24)),  # 6: rank 0 cold, rank 1 hits
]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    init_distributed(timeout_s=spec.get("timeout", 30))
    task = mlp_task()
    model = task.model
    blocks = discover_blocks(model)
    if spec.get("root_only"):  # fully_shard(model) alone: the root group holds every parameter
        refusals(spec, model, blocks, task)
        return
    shard_blocks(model, blocks)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, optimizer, "static", {"k": 2}, blocks=blocks)
    runner = CachedPrefix(model, freezer=freezer) if spec["cache"] else None
    records = []
    for step, shares in enumerate(PLAN, start=1):
        idx = list(shares[rank()])
        batch = {"pixel_values": torch.stack([task.train_set[i]["pixel_values"] for i in idx]),
                 "labels": torch.stack([task.train_set[i]["labels"] for i in idx]), "index": torch.tensor(idx)}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.get("autocast", False)):
            logits = runner(batch) if runner is not None else model(batch["pixel_values"])
        nn.functional.cross_entropy(logits.float(), batch["labels"]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        freezer.step()
        if step == 3:
            freezer.freeze(2, reason="by hand")
        record = {"step": step, "logits": hashlib.sha256(logits.detach().float().numpy().tobytes()).hexdigest(),
                  "hashes": full_hashes(model)}
        if runner is not None:
            stats = runner.stats()
            record.update({k: stats[k] for k in ("hits", "misses", "prefix_samples", "extend_samples")})
        records.append(record)
    freezer.close()
    (Path(spec["out"]) / f"rank{rank()}.json").write_text(json.dumps({"records": records}))
    close_distributed()


def refusals(spec: dict, model: nn.Module, blocks: list, task) -> None:
    """What ``freeze.cache`` ``on`` and ``auto`` do with a model whose root FSDP2 group holds parameters."""
    from torch.distributed.fsdp import fully_shard

    from layerfreeze.compute.cache import CacheRefused, build_cached_prefix

    fully_shard(model)
    out: dict = {}
    try:
        build_cached_prefix(model, blocks, task.train_set, mode="on")
    except CacheRefused as exc:
        out["on"] = str(exc)
    reasons: list[str] = []
    out["auto_runner"] = build_cached_prefix(model, blocks, task.train_set, mode="auto", on_disable=reasons.append)
    out["auto"] = reasons
    (Path(spec["out"]) / f"rank{rank()}.json").write_text(json.dumps(out))
    close_distributed()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
