"""The corpus's second and third rounds of SmartFRZ recipes (constant LRs, a short and a long run, GPT-2 and Llama
decoders on BBC News next-token prediction, a ViT fine-tune; the trainer's 10% warm-up, short runs from scratch):
each collects in quick mode with the blocks it should have; the
collector's test accuracy is per label (token-level for an LM) and unchanged for classifiers; ``schedule="constant"``
holds the LR after the warm-up."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from layerfreeze.smartfrz.collect import collect, evaluate_test, record_run
from layerfreeze.smartfrz.labels import label_run
from layerfreeze.smartfrz.recipes.registry import DEFAULT_HOLDOUT, RECIPES
from layerfreeze.smartfrz.recipes.rounds import token_cross_entropy
from layerfreeze.smartfrz.setup import Setup

pytestmark = pytest.mark.usefixtures("one_thread")

#: The shipped predictor's recipes, in registration order (the card's command and the digests depend on them).
SHIPPED = ["mlp-digits", "cnn-digits", "mlp-fmnist", "cnn-fmnist", "vit-fmnist", "cnn-fmnist-to-digits",
           "resnet-fmnist", "mobilenetv2-fmnist", "minilm-bbc", "tinybert-bbc"]

#: name: (arch, dataset, mode, optimizer, schedule, full-size steps, quick blocks)
NEW = {
    "mlp-digits-sgd-const": ("mlp", "digits", "scratch", "sgd", "constant", 1500, ["1", "3", "5", "7"]),
    "cnn-fmnist-sgd-const": ("cnn", "fashion-mnist", "scratch", "sgd", "constant", 3000, list("012345")),
    "cnn-fmnist-to-digits-short": ("cnn", "digits", "finetune", "adamw", "constant", 100, list("012345")),
    "vit-fmnist-to-digits": ("vit", "digits", "finetune", "adamw", "linear", 300, list("0123")),
    "gpt-bbc": ("gpt2-tiny", "bbc-news-lm", "scratch", "adamw", "cosine", 600,
                ["transformer.embeddings", "transformer.h.0", "transformer.h.1", "head"]),
    "llama-bbc": ("llama-tiny", "bbc-news-lm", "scratch", "adamw", "constant", 501,
                  ["model.embed_tokens", "model.layers.0", "model.layers.1", "head"]),
    "minilm-bbc-warmup10": ("minilm-l6", "bbc-news", "finetune", "adamw", "linear", 90,
                            ["bert.embeddings", *(f"bert.encoder.layer.{i}" for i in range(6)), "bert.pooler",
                             "classifier"]),
    "mlp-fmnist-short": ("mlp", "fashion-mnist", "scratch", "adamw", "linear", 150, ["1", "3", "5"]),
    "cnn-fmnist-short": ("cnn", "fashion-mnist", "scratch", "adamw", "linear", 150, list("012345")),
    "vit-fmnist-short": ("vit", "fashion-mnist", "scratch", "adamw", "linear", 150, list("0123")),
}
#: The third round: trained with `layerfreeze train`'s schedule (10% warm-up; the rounds before it warm up 5%).
THIRD_ROUND = ("minilm-bbc-warmup10", "mlp-fmnist-short", "cnn-fmnist-short", "vit-fmnist-short")


@pytest.fixture(scope="module")
def quick_new(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("runs-new")
    metas = collect(out, list(NEW), seeds=[0], lrs=[1e-3], quick=True)
    torch.set_num_threads(before)
    return out, {m["recipe"]: m for m in metas}


def test_the_new_recipes_are_registered_after_the_shipped_ones():
    from layerfreeze.smartfrz.recipes.rounds import TRAINER_SCHEDULE
    from layerfreeze.train.config import TrainConfig

    assert list(RECIPES)[:len(SHIPPED)] == SHIPPED and list(RECIPES)[len(SHIPPED):] == list(NEW)
    # the third round trains with `layerfreeze train`'s own schedule, whatever its defaults become
    trainer = TrainConfig()
    assert TRAINER_SCHEDULE == {"schedule": trainer.schedule, "warmup": trainer.warmup_fraction}
    assert DEFAULT_HOLDOUT == ("resnet-fmnist", "tinybert-bbc")
    for name, (arch, dataset, mode, *_rest) in NEW.items():
        r = RECIPES[name]
        assert (r.arch, r.dataset, r.mode) == (arch, dataset, mode)
        assert len(r.lrs) == 2 and r.lrs[0] < r.lrs[1] and 0 < r.minutes <= 3 and r.description


@pytest.mark.assets("fashion_mnist", "bbc_news", "minilm")  # quick_new collects every NEW recipe
@pytest.mark.parametrize("name", list(NEW))
def test_a_new_recipe_collects_in_quick_mode(quick_new, name):
    out, metas = quick_new
    arch, dataset, mode, optimizer, schedule, _, blocks = NEW[name]
    meta = metas[name]
    run = out / f"{name}_s0_lr0.001"
    assert json.loads((run / "meta.json").read_text()) == meta
    assert meta["status"] == "complete" and meta["quick"] is True
    assert (meta["arch"], meta["dataset"], meta["mode"]) == (arch, dataset, mode)
    assert meta["optimizer"]["name"] == optimizer and meta["schedule"] == schedule
    assert meta["warmup"] == (0.1 if name in THIRD_ROUND else 0.05)
    assert meta["blocks"] == blocks and meta["head"] == len(blocks) - 1
    assert len(meta["losses"]) == meta["steps"] // meta["snapshot_every"]
    assert all(math.isfinite(v) for v in meta["losses"])
    assert 0.0 <= meta["test_accuracy"] <= 1.0 and meta["wall_seconds"] > 0
    assert len(meta["act_dims_full"]) == len(blocks) and all(d > 0 for d in meta["act_dims_full"])
    w = load_file(str(run / "weights.safetensors"))
    assert w["samples"].shape == (meta["steps"] // meta["snapshot_every"] + 1, len(blocks), 1024)
    labels = label_run(run, write=False)
    assert labels["cka"][0][-1] == pytest.approx(1.0) and not any(labels["freezable"][-1])


@pytest.mark.assets("fashion_mnist", "bbc_news", "minilm")  # quick_new collects every NEW recipe
@pytest.mark.parametrize("name", ["gpt-bbc", "llama-bbc"])
def test_the_lm_recipes_train_on_shifted_token_chunks(quick_new, name):
    _, metas = quick_new
    setup = RECIPES[name].build(0, True, None)
    ids, labels = setup.train_x["input_ids"], setup.train_y
    assert ids.shape == labels.shape == (64, 16) and ids.dtype == labels.dtype == torch.int64
    assert torch.equal(ids[:, 1:], labels[:, :-1]) and torch.equal(ids[1:, 0], labels[:-1, -1])  # one stream
    assert int(ids.max()) < 512 and setup.test_y.shape == (16, 16) and setup.probe_x["input_ids"].shape == (8, 16)
    logits = setup.forward(setup.model, {"input_ids": ids[:2]})
    assert logits.shape == (2, 16, 512)
    # every block's probe output is (P, T, H) or the head's (P, T, vocab) logits, flattened per sample
    assert metas[name]["act_dims_full"] == [16 * 16, 16 * 16, 16 * 16, 16 * 512]
    assert metas[name]["block_params"][-1] == (32 if name == "gpt-bbc" else 16 + 512 * 16)  # tied vs untied head


@pytest.mark.assets("fashion_mnist", "bbc_news")
def test_the_full_size_recipes_without_pretraining(tmp_path):
    from layerfreeze.models.discovery import find_blocks

    short = THIRD_ROUND[1:]
    for name in ("mlp-digits-sgd-const", "cnn-fmnist-sgd-const", "gpt-bbc", "llama-bbc", *short):
        _, _, _, optimizer, schedule, steps, _ = NEW[name]
        setup = RECIPES[name].build(0, False, tmp_path)
        warmup = 0.1 if name in THIRD_ROUND else 0.05
        assert (setup.optimizer, setup.schedule, setup.steps, setup.warmup) == (optimizer, schedule, steps, warmup)
        if name in short:  # the suite's kind of short run from scratch: a snapshot every step, ~3 epochs of 6k
            assert (setup.snapshot_every, setup.batch_size, len(setup.train_y)) == (1, 128, 6000)
    gpt = RECIPES["gpt-bbc"].build(0, False, tmp_path)
    assert gpt.train_x["input_ids"].shape == (13584, 64) and gpt.test_y.shape == (512, 64)
    assert (gpt.batch_size, gpt.snapshot_every) == (16, 4)
    found = find_blocks(gpt.model)
    assert [b.name for b in found.blocks] == ["transformer.embeddings", *(f"transformer.h.{i}" for i in range(4)),
                                              "head"]
    assert [b.num_parameters() for b in found.blocks] == [8192 * 128 + 64 * 128] + [198272] * 4 + [256]
    assert found.blocks[-1].tied == {"lm_head.weight": "transformer.embeddings"}
    llama = find_blocks(RECIPES["llama-bbc"].build(0, False, tmp_path).model).blocks
    assert [b.name for b in llama] == ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)), "head"]
    assert llama[-1].num_parameters() == 8192 * 128 + 128 and not llama[-1].tied


class _Table(nn.Module):
    """A stand-in model: the forward looks its logits up by sample index (``batch["i"]``)."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", logits)


def _table_setup(logits: torch.Tensor, labels: torch.Tensor, loss_fn=token_cross_entropy) -> tuple[Setup, nn.Module]:
    n = len(labels)
    model = _Table(logits)
    setup = Setup(nn.Linear(1, 1), {"x": torch.zeros(n, 1)}, labels, {"x": torch.zeros(2, 1)},
                  forward=lambda m, batch: m.table[batch["i"]], loss_fn=loss_fn,
                  test_x={"i": torch.arange(n)}, test_y=labels, steps=1, batch_size=1)
    return setup, model


def test_lm_accuracy_and_loss_are_per_token_by_hand():
    labels = torch.tensor([[1, 2, 0], [3, 3, 1]])
    predicted = torch.tensor([[1, 0, 0], [3, 1, 1]])      # right at 4 of 6 tokens, no chunk right throughout
    setup, model = _table_setup(5.0 * F.one_hot(predicted, 4).float(), labels)
    acc, loss = evaluate_test(setup, model)
    assert acc == pytest.approx(4 / 6)
    right, wrong = math.log(1 + 3 * math.exp(-5)), math.log(math.exp(5) + 3)  # -log softmax at 5 and at 0 of (5,0,0,0)
    assert loss == pytest.approx((4 * right + 2 * wrong) / 6, rel=1e-6)


def test_lm_accuracy_over_several_test_batches_weights_every_token_once():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(300, 5, 7, generator=g), torch.randint(0, 7, (300, 5), generator=g)
    setup, model = _table_setup(logits, labels)          # batches of 128, 128 and 44 chunks
    acc, loss = evaluate_test(setup, model)
    assert acc == float((logits.argmax(-1) == labels).sum()) / 1500
    assert loss == pytest.approx(float(F.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1))), rel=1e-5)


def _old_evaluate_test(setup: Setup, model: nn.Module) -> tuple[float, float]:
    """``collect.evaluate_test`` before it counted labels (one label per sample), verbatim but for the None case."""
    model.eval()
    correct, loss_sum = 0, 0.0
    with torch.no_grad():
        for s in range(0, len(setup.test_y), 128):
            batch = {k: v[s:s + 128] for k, v in setup.test_x.items()}
            logits = setup.forward(model, batch)
            labels = setup.test_y[s:s + 128]
            correct += int((logits.argmax(-1) == labels).sum())
            loss_sum += float(setup.loss_fn(logits, labels)) * len(labels)
    return correct / len(setup.test_y), loss_sum / len(setup.test_y)


def test_classification_results_are_unchanged():
    g = torch.Generator().manual_seed(1)
    logits, labels = torch.randn(300, 10, generator=g), torch.randint(0, 10, (300,), generator=g)
    setup, model = _table_setup(logits, labels, loss_fn=F.cross_entropy)
    new, old = evaluate_test(setup, model), _old_evaluate_test(setup, model)
    assert new == old and new[0] == float((logits.argmax(-1) == labels).sum()) / 300   # bit for bit


def _lr_trace(run_dir, schedule: str, steps: int = 40, warmup: float = 0.1, lr: float = 0.01) -> torch.Tensor:
    """The LR factor of every step, read back from a recorded run: one Linear layer on all-ones inputs, loss = the
    sum of its outputs, plain SGD (no momentum or decay), so each step moves every weight by ``-lr_t * batch``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    setup = Setup(model, {"x": torch.ones(32, 4)}, torch.zeros(32, dtype=torch.int64), {"x": torch.ones(4, 4)},
                  loss_fn=lambda out, _y: out.sum(), steps=steps, batch_size=8, optimizer="sgd", momentum=0.0,
                  schedule=schedule, warmup=warmup, snapshot_every=1, act_every=10)
    record_run(setup, run_dir, lr=lr, seed=0, info={"recipe": "lr-trace"})
    w = load_file(str(run_dir / "weights.safetensors"))
    real = w["samples"][:, 0, w["mask"][0].bool()].double()              # (steps + 1, 10): the 10 weights
    moves = (real[:-1] - real[1:]) / (lr * 8)                             # (steps, 10)
    assert torch.allclose(moves, moves[:, :1].expand_as(moves), atol=1e-4)
    return moves[:, 0]


def test_constant_schedule_holds_the_lr_after_the_warm_up(tmp_path):
    trace = _lr_trace(tmp_path / "constant", "constant")
    # warm-up: max(1, round(0.1 * 40)) = 4 steps at 1/4 .. 4/4, then the base LR to the last step
    expected = torch.tensor([0.25, 0.5, 0.75] + [1.0] * 37, dtype=torch.float64)
    assert torch.allclose(trace, expected, atol=1e-4)
    cosine = _lr_trace(tmp_path / "cosine", "cosine")                 # the same run decays under cosine
    assert torch.allclose(cosine[:4], expected[:4], atol=1e-4) and float(cosine[-1]) < 0.01
    with pytest.raises(ValueError, match="'constant'"):
        Setup(nn.Linear(1, 1), {"x": torch.zeros(2, 1)}, torch.zeros(2), {"x": torch.zeros(2, 1)}, schedule="step")
