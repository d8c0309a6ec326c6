"""One rank of the FSDP2 shard-layout test: ``python -m tests.distributed.fsdp_layouts_worker SPEC.json``.

A tiny transformer (token embedding and a position embedding held by the root, three encoder layers, norm and head:
five blocks) sharded the way users write it, ``spec["layout"]``: ``"root"`` (``fully_shard(model)`` only: frozen and
trainable parameters in one group), ``"blocks"`` (:func:`layerfreeze.distributed.fsdp.shard_blocks`, the blocks
discovered before sharding and given to the Freezer), ``"layers"`` (``fully_shard`` on each encoder layer, then the
root), or ``"none"`` (one process, not sharded: the reference). AdamW, a Freezer (static k=2, ``on_unfrozen="error"``),
and an evaluation pass (``model.eval()``, a forward under ``torch.no_grad()``, ``model.train()``) after every step, each
freeze and thaw coming right after one: thaw block 1 after step 3, freeze block 2 after step 5, verify the frozen
weights, save the Freezer's state and thaw block 2 after step 7; 9 steps.

Per step (0: before training) it records the full weights, the frozen set, whether the sharded parameters require
grad, how many optimizer entries are not the model's (sharded) parameters, and the warnings caught.
``spec["mistakes"]``: the orders the Freezer refuses (:func:`mistakes`) instead.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from layerfreeze import Freezer, discover_blocks
from layerfreeze.distributed import close_distributed, init_distributed, loss_scale, rank, shard, shard_blocks

VOCAB, WIDTH, LENGTH, CLASSES, BATCH = 32, 16, 6, 4, 8
ACTIONS = {3: [("thaw", 1)], 5: [("freeze", 2)], 7: [("verify", None), ("state_dict", None), ("thaw", 2)]}


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.02)  # held by the root: block 0 owns it
        # no biases: a key bias gets a zero gradient, whose rounding noise AdamW scales up to full steps (one
        # process and two ranks would differ there by ~1e-3)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True,
                                                               bias=False) for _ in range(3))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h).mean(1))


def full_weights(model: nn.Module) -> dict[str, list]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().reshape(-1).tolist()
            for k, v in model.state_dict().items()}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    sharded = init_distributed(timeout_s=60)
    layout = spec["layout"] if sharded else "none"
    torch.manual_seed(0)
    model = TinyTransformer()
    blocks = discover_blocks(model)
    if layout == "root":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    elif layout == "blocks":
        shard_blocks(model, blocks)
    elif layout == "layers":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    if spec.get("mistakes"):
        mistakes(model, blocks, Path(spec["out"]))
        return
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=g)
    local = shard(range(BATCH)) if sharded else list(range(BATCH))

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            loss = float(nn.functional.cross_entropy(model(ids), labels))
        model.train()
        return loss

    caught: list[str] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        params = dict(model.named_parameters())  # the sharded parameters: the same objects all run long
        optimizer = torch.optim.AdamW(params.values(), lr=0.01)
        freezer = Freezer(model, optimizer, "static", {"k": 2}, blocks=blocks if layout == "blocks" else None,
                          on_unfrozen="error")
        names = [[n for n, _ in b.named_parameters()] for b in freezer.blocks]
        records = []
        saved = None
        for step in range(10):
            if step:
                out = model(ids[local])
                loss = nn.functional.cross_entropy(out, labels[local], reduction="sum")
                (loss * (loss_scale(len(local), BATCH) if sharded else 1 / BATCH)).backward()
                freezer.after_backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                freezer.step()
            eval_loss = evaluate()  # the evaluation pass: the root group stays unsharded after it
            for action, index in ACTIONS.get(step, []):
                if action == "verify":
                    freezer.verify_frozen_weights()
                elif action == "state_dict":
                    saved = [len(group) for group in freezer.state_dict()["param_groups"]]
                else:
                    getattr(freezer, action)(index)
            in_model = {id(p) for p in params.values()}
            records.append({
                "step": step, "eval_loss": eval_loss, "frozen": list(freezer.frozen), "weights": full_weights(model),
                "requires_grad": [[params[n].requires_grad for n in block] for block in names],
                "foreign_in_optimizer": sum(id(p) not in in_model for grp in optimizer.param_groups
                                            for p in grp["params"]),
                "optimizer_params": sum(len(grp["params"]) for grp in optimizer.param_groups)})
        caught = [str(w.message) for w in seen]
    result = {"records": records, "blocks": names, "saved_param_groups": saved, "warnings": caught}
    (Path(spec["out"]) / f"rank{rank() if sharded else 0}.json").write_text(json.dumps(result))
    close_distributed()


def mistakes(model: nn.Module, blocks: list, out: Path) -> None:
    """Two orders a Freezer must refuse at construction, under ``fully_shard(model)`` (layout ``"root"``): blocks
    discovered before sharding (the position embedding they hold is no longer the model's), and an optimizer built
    after an evaluation pass (over FSDP's unsharded parameters). Then the right order, the Freezer built after an
    evaluation pass (the pretrained model's score), and one training step."""
    errors = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    try:
        Freezer(model, optimizer, "static", {"k": 2}, blocks=blocks)
    except ValueError as exc:
        errors.append(str(exc))
    with torch.no_grad():
        model(torch.zeros(2, LENGTH, dtype=torch.long))
    late = torch.optim.AdamW(model.parameters(), lr=0.01)
    try:
        Freezer(model, late, "static", {"k": 2})
    except ValueError as exc:
        errors.append(str(exc))
    with torch.no_grad():
        model(torch.zeros(2, LENGTH, dtype=torch.long))
    freezer = Freezer(model, optimizer, "static", {"k": 2})
    before = full_weights(model)
    ids = torch.randint(0, VOCAB, (4, LENGTH), generator=torch.Generator().manual_seed(rank()))
    nn.functional.cross_entropy(model(ids), torch.zeros(4, dtype=torch.long)).backward()
    optimizer.step()
    freezer.step()
    after = full_weights(model)
    changed = sorted(k for k in after if after[k] != before[k])
    (out / f"rank{rank()}.json").write_text(json.dumps({"errors": errors, "frozen": freezer.frozen_blocks,
                                                         "changed": changed}))
    close_distributed()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
