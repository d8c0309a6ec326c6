"""``train.compile`` (issue 42): after every freeze or thaw the next backward gives gradients to exactly the trainable
blocks, under ``blocks`` and ``true``, on nn.Sequential, a tiny BERT and a tiny Llama; recompiles stay bounded (a
frozen prefix growing block by block, LISA's switches); the trainer's compiled run equals its eager run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layerfreeze import Freezer
from layerfreeze.runs.rundir import read_metrics
from layerfreeze.train.compile import RECOMPILE_LIMIT, CompiledRegions
from layerfreeze.train.config import build_config
from layerfreeze.train.trainer import Trainer
from tests.conftest import blob_task
from tests.integration_models import tiny_bert

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Layer(nn.Module):
    """A block of its own class (identical blocks share one compiled function)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) + x


def _stack(blocks: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Layer() for _ in range(blocks - 1)], nn.Linear(8, 3))


def _tiny_llama() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      num_labels=3, pad_token_id=0)
    return transformers.LlamaForSequenceClassification(config)


def _batch(kind: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    if kind == "sequential":
        return {"x": torch.randn(4, 8, generator=g)}
    return {"input_ids": torch.randint(1, 64, (4, 10), generator=g)}


def _loss(model: nn.Module, kind: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(batch["x"]) if kind == "sequential" else model(**batch).logits
    return out.float().square().mean()


MODELS = {"sequential": _stack, "bert": lambda: tiny_bert(layers=3), "llama": _tiny_llama}


@pytest.mark.parametrize("mode", ["blocks", True])
@pytest.mark.parametrize("kind", ["sequential", "bert", "llama"])
def test_after_every_freeze_and_thaw_exactly_the_trainable_blocks_get_gradients(kind, mode):
    model = MODELS[kind]()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with Freezer(model, optimizer, "none") as freezer:
        regions = CompiledRegions(model, [m for b in freezer.blocks for _, m in b.modules], mode, "aot_eager")
        middle = len(freezer.blocks) // 2
        for change in ("start", "freeze 0", "freeze middle", "thaw 0", "thaw middle", "freeze 0"):
            action, _, which = change.partition(" ")
            index = {"0": 0, "middle": middle}.get(which)
            if action == "freeze":
                freezer.freeze(index)
            elif action == "thaw":
                freezer.thaw(index)
            regions.refresh(freezer.frozen)
            before = {b.name: [p.detach().clone() for p in b.parameters()] for b in freezer.blocks}
            _loss(model, kind, _batch(kind, g)).backward()
            for block, frozen in zip(freezer.blocks, freezer.frozen):
                grads = [p.grad for p in block.parameters()]
                if frozen:
                    assert all(grad is None for grad in grads), (change, block.name)
                else:  # every trainable block got a gradient, the thawed one included
                    assert any(grad is not None and grad.abs().sum() > 0 for grad in grads), (change, block.name)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for block, frozen in zip(freezer.blocks, freezer.frozen):
                moved = any(not torch.equal(a, p) for a, p in zip(before[block.name], block.parameters()))
                assert moved != frozen, (change, block.name)
        assert regions.compiled_graphs() > 0  # the steps ran compiled
        regions.close()
    assert "forward" not in model.__dict__  # eager again


def test_a_thaw_under_inductor_trains_the_thawed_block():
    model = _stack(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Freezer(model, optimizer, "none") as freezer:
        regions = CompiledRegions(model, [m for b in freezer.blocks for _, m in b.modules], "blocks", "inductor")
        x = torch.randn(4, 8)
        freezer.freeze(0)
        regions.refresh(freezer.frozen)
        model(x).square().mean().backward()
        assert model[0].linear.weight.grad is None
        optimizer.zero_grad(set_to_none=True)
        freezer.thaw(0)
        regions.refresh(freezer.frozen)
        before = model[0].linear.weight.detach().clone()
        model(x).square().mean().backward()
        assert model[0].linear.weight.grad is not None
        optimizer.step()
        assert not torch.equal(before, model[0].linear.weight)
        regions.close()


def test_a_growing_frozen_prefix_compiles_at_most_one_graph_per_changed_region():
    """The default job's shape: 9 blocks (embeddings-like first, identical layers, head) frozen one by one, 8 events,
    a few steps between them; a block of a class already compiled for its new key reuses that graph."""
    model = _stack(9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    per_event = []
    with Freezer(model, optimizer, "none") as freezer:
        regions = CompiledRegions(model, [m for b in freezer.blocks for _, m in b.modules], "blocks", "aot_eager")
        for event in range(9):
            if event:
                freezer.freeze(event - 1)
            regions.refresh(freezer.frozen)
            start = regions.compiled_graphs()
            for _ in range(3):
                model(torch.randn(4, 8, generator=g)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            per_event.append(regions.compiled_graphs() - start)
        regions.close()
    # start: the first Layer (its input needs no grad), the other Layers (their inputs need grad), the head. Freeze
    # block 0: one graph for a frozen Layer whose successor's input needs no grad (that pattern is the first Layer's,
    # compiled). Blocks 1-6 freeze into graphs already there. Freeze block 7: the head's input no longer needs grad.
    assert per_event == [3, 1, 0, 0, 0, 0, 0, 0, 1]
    assert sum(per_event) < RECOMPILE_LIMIT


def test_lisa_switching_for_200_steps_compiles_each_variant_once(tmp_path):
    cfg = build_config({
        "train": {"epochs": 34, "batch_size": 16, "lr": 0.01, "compile": "blocks", "compile_backend": "aot_eager",
                  "max_steps": 200},
        "freeze": {"strategy": "lisa", "params": {"k": 5, "gamma": 1, "seed": 0}, "cache": {"mode": "off"}},
        "run": {"dir": str(tmp_path / "lisa"), "progress": False, "device": "cpu", "checkpoint": False,
                "tensorboard": False, "divergence_window_steps": None},
    })
    summary = Trainer(cfg, task=_stack_task()).run()
    compiles = [r["compiles"] for r in read_metrics(tmp_path / "lisa") if r["type"] == "step"]
    switches = [r for r in read_metrics(tmp_path / "lisa") if r["type"] == "event" and r["kind"] == "thaw"]
    assert len(compiles) == 200 and len(switches) >= 30  # a switch every 5 steps
    evaluations = sum(r["eval_compiles"] for r in read_metrics(tmp_path / "lisa") if r["type"] == "epoch")
    assert summary["compile"]["graphs"] == sum(compiles) + evaluations < RECOMPILE_LIMIT
    assert sum(compiles[100:]) == 0  # every variant compiled by then: switches reuse them


def _stack_task():
    from layerfreeze.train.data import GaussianBlobs
    from layerfreeze.train.tasks import Task, image_forward

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), *[Layer() for _ in range(5)], nn.Linear(8, 4))
    return Task("blobs", model, GaussianBlobs(96, seed=1), GaussianBlobs(32, seed=2), 4, "stack", image_forward)


def test_the_trainer_compiled_equals_its_eager_run_and_logs_compiles(tmp_path):
    def run(name, compile_mode):
        cfg = build_config({
            "train": {"epochs": 2, "batch_size": 16, "lr": 0.01, "compile": compile_mode,
                      "compile_backend": "aot_eager"},
            "freeze": {"strategy": "static", "params": {"k": 2}},
            "run": {"dir": str(tmp_path / name), "progress": False, "device": "cpu"},
        })
        return Trainer(cfg, task=blob_task()).run()

    eager, compiled = run("eager", False), run("blocks", "blocks")
    losses = {n: [r["loss"] for r in read_metrics(tmp_path / n) if r["type"] == "step"] for n in ("eager", "blocks")}
    assert losses["eager"] == losses["blocks"]  # aot_eager runs the same kernels: the same run
    assert eager["test_accuracy"] == compiled["test_accuracy"]
    assert eager["flops_total"] == compiled["flops_total"]
    assert "compile" not in eager
    c = compiled["compile"]
    assert (c["mode"], c["backend"], c["regions"]) == ("blocks", "aot_eager", 4)
    steps = [r for r in read_metrics(tmp_path / "blocks") if r["type"] == "step"]
    epochs = [r for r in read_metrics(tmp_path / "blocks") if r["type"] == "epoch"]
    # the evaluation's graphs (no autograd: other variants) go in its epoch's record; they were counted in the next
    # step's, which then read "compiles 15, compile_s 0.00"
    assert epochs[0]["eval_compiles"] > 0 and steps[len(steps) // 2]["compiles"] == 0  # the step after it
    assert sum(r["compiles"] for r in steps) + sum(r["eval_compiles"] for r in epochs) == c["graphs"] > 0
    assert c["compile_s"] > 0
    # nested compiles (a backward compiled inside its forward's) counted once: the sum of Dynamo's metrics gave
    # 94.5 s of compiling in an 87.9 s run
    assert c["compile_s"] < compiled["wall_time_s"]
    # the steps' own compiling, step by step: train time without it is what the compiled code costs
    assert sum(r["compile_s"] for r in steps) == pytest.approx(c["train_compile_s"]) and c["train_compile_s"] > 0
    assert c["train_compile_s"] <= c["compile_s"] + 1e-9 and steps[-1]["compile_s"] == 0.0
    assert all(r["compile_s"] == 0.0 for r in steps if r["compiles"] == 0)
    assert steps[-1]["compiles"] == 0


def test_compile_true_keeps_the_cache_off_in_auto_and_refuses_it_on(tmp_path, capsys):
    # the cached forward runs the trainable blocks one by one, never model.forward, the one compiled region: with the
    # cache in use (auto, the default) no training step was compiled, in silence
    from layerfreeze.errors import ConfigError

    cfg = build_config({
        "train": {"epochs": 1, "batch_size": 16, "lr": 0.01, "compile": True, "compile_backend": "aot_eager"},
        "freeze": {"strategy": "static", "params": {"k": 2}},
        "run": {"dir": str(tmp_path / "true"), "progress": False, "device": "cpu"},
    })
    summary = Trainer(cfg, task=blob_task()).run()
    assert "cache: auto, off: train.compile true compiles the model's forward" in capsys.readouterr().out
    assert not summary["cache"]["used"] and summary["compile"]["train_compile_s"] > 0
    with pytest.raises(ConfigError, match=r"train.compile true .* Use --compile blocks .* freeze.cache.mode=off"):
        build_config({"train": {"compile": True}, "freeze": {"cache": {"mode": "on"}}})
