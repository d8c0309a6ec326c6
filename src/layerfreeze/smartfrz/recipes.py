"""The SmartFRZ collection recipes: the small networks, datasets and settings the shipped predictor's runs come from.

A *recipe* builds a :class:`~layerfreeze.smartfrz.collect.Setup` (model, train data, fixed probe batch, loss,
optimizer settings) from a seed; :func:`~layerfreeze.smartfrz.collect.collect` records each recipe with each seed
and learning rate. Recipes register with :func:`register_recipe` (the decorator style of every layerfreeze registry,
:mod:`layerfreeze.registry`); ``layerfreeze predictor collect --recipes`` names them. The datasets are installed
offline (scikit-learn's digits, Fashion-MNIST, BBC News with MiniLM-L6's tokenizer: its topics, or its text as
next-token chunks), each split into fixed subsets independent of the run's seed; the model zoo is a few small
MLPs, CNNs, a tiny ViT, a narrow ResNet, tiny GPT-2 and Llama decoders built from configs, and the installed
MobileNetV2 and MiniLM-L6. Where no weights install (the CNN, the ViT), a fine-tune recipe pretrains its network on
Fashion-MNIST itself, once per runs folder. Recipes are trained from scratch or fine-tuned, with SGD or AdamW,
under cosine, linear or constant LRs (after a 5% warm-up, or the trainer's 10% in the third round), for 90 to 3,000
steps.

Every registered recipe is in the shipped predictor's corpus (``PREDICTOR_CARD.md`` lists the recipes and seeds,
and the commands that reproduce it): changing any of them, or the data and models they use, changes the runs behind
it. They came in three rounds (the first ten; constant LRs, the short and long runs, the decoder LMs and the ViT
fine-tune; the trainer's warm-up and short runs from scratch), each registered after the last, so a round's runs
never move when a later one is added.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..loop import train_steps
from ..registry import Registry
from .collect import Setup
from .runs import PipelineError


def hf_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of a Hugging Face sequence classifier from a tokenized batch."""
    return model(**{k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}).logits




@dataclass(frozen=True)
class Recipe:
    """A registered collection recipe. ``build(seed, quick, cache_dir) -> Setup``; ``minutes``: estimated
    wall-clock minutes of one full-size run on a 2-core CPU (measured from a few steps, see the card)."""

    name: str
    arch: str
    dataset: str
    mode: str
    lrs: tuple[float, ...]
    minutes: float
    build: Callable[[int, bool, Path], Setup] = field(compare=False)
    description: str = ""


#: Registered recipes, ``{name: Recipe}`` in registration order (the order ``collect`` records them in).
RECIPES: Registry[Recipe] = Registry("recipe")


def register_recipe(name: str, *, arch: str, dataset: str, mode: str, lrs: tuple[float, ...], minutes: float,
                    description: str = "") -> Callable[[Callable[[int, bool, Path], Setup]],
                                                       Callable[[int, bool, Path], Setup]]:
    """Decorator: register ``fn(seed, quick, cache_dir) -> Setup`` as recipe ``name``.

    Args:
        arch / dataset: Recorded in each run's ``meta.json`` (the predictor card groups runs by them).
        mode: ``"scratch"`` or ``"finetune"``.
        lrs: The learning rates ``collect`` records the recipe with (one run per seed and rate).
        minutes: Estimated wall-clock minutes of one full-size run on a 2-core CPU.

    Raises:
        ValueError: ``mode`` is neither, or ``name`` is already registered.
    """
    if mode not in ("scratch", "finetune"):
        raise ValueError(f"mode must be 'scratch' or 'finetune', got {mode!r}")

    def deco(fn: Callable[[int, bool, Path], Setup]) -> Callable[[int, bool, Path], Setup]:
        RECIPES.add(name, Recipe(name, arch, dataset, mode, tuple(lrs), minutes, fn, description))
        return fn

    return deco


def get_recipes(names: list[str] | None) -> list[Recipe]:
    """Recipes by name (all, in registration order, for None).

    Raises:
        PipelineError: an unknown name (the message lists the known ones).
    """
    if not names:
        return list(RECIPES.values())
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise PipelineError(f"unknown recipe(s) {', '.join(unknown)}; known: {', '.join(RECIPES)}")
    return [RECIPES[n] for n in names]


# ---- data (cached per process; subsets are fixed, independent of the run's seed) ------------------------------


def _split_probe_test(x: dict[str, torch.Tensor], y: torch.Tensor, probe: int, test: int
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """Held-out samples in a fixed shuffled order (seed 0; splits are often sorted by class): the first ``probe``
    are the probe batch, the next ``test`` the accuracy subset."""
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    p = {k: v[order[:probe]] for k, v in x.items()}
    t = {k: v[order[probe:probe + test]] for k, v in x.items()}
    return p, t, y[order[probe:probe + test]]


@functools.lru_cache(maxsize=2)
def _digits(size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes; no download), a fixed stratified 80/20
    split, standardised with the train mean/std; ``size`` != 8 resizes (bilinear) for the fine-tune recipe."""
    from sklearn.datasets import load_digits

    from ..data import stratified_split

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0
    if size != 8:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    y = torch.tensor(d.target, dtype=torch.int64)
    tr, te = stratified_split(y.tolist(), 0.2, seed=0)
    mean, std = x[tr].mean(), x[tr].std()
    x = (x - mean) / std
    return x[tr], y[tr], x[te], y[te]


FMNIST_MEAN, FMNIST_STD = 0.2860, 0.3530


@functools.lru_cache(maxsize=4)
def _fmnist(size: int, n_train: int, n_test: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fashion-MNIST subsets as ``(N, 1, size, size)`` uint8 (the first ``n_train`` / ``n_test`` images)."""
    from ..data import load_fashion_mnist

    tr = load_fashion_mnist("train", size=size, limit=n_train)
    te = load_fashion_mnist("test", size=size, limit=n_test)
    return tr.images, tr.labels, te.images, te.labels


def _gray(x: torch.Tensor) -> torch.Tensor:
    return (x.float() / 255.0 - FMNIST_MEAN) / FMNIST_STD


def _imagenet_rgb(x: torch.Tensor) -> torch.Tensor:
    from ..data import IMAGENET_MEAN, IMAGENET_STD

    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (x.float().div(255.0).expand(-1, 3, -1, -1) - mean) / std


def _bbc_split(labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Article indices ``(train, test)`` of the fixed stratified 80/20 split of :mod:`layerfreeze.tasks` (seed 0),
    the train side in a seeded order (the split is sorted by class; the order mixes them). Shared by the
    classification and the language-model recipes, so both see the same articles on each side."""
    from ..data import stratified_split

    tr, te = stratified_split(labels, 0.2, seed=0)
    return torch.tensor(tr)[torch.randperm(len(tr), generator=torch.Generator().manual_seed(0))], torch.tensor(te)


@functools.lru_cache(maxsize=2)
def _bbc(max_length: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """BBC News tokenized with MiniLM-L6's tokenizer to ``max_length``; the fixed stratified 80/20 split of
    :mod:`layerfreeze.tasks` (seed 0)."""
    from transformers import AutoTokenizer

    from ..assets import minilm_dir
    from ..data import load_bbc_news
    from ..tasks import _quiet_transformers

    _quiet_transformers()
    texts, labels, _ = load_bbc_news()
    tok = AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)
    enc = tok(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    x = {k: enc[k].long() for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}
    y = torch.tensor(labels, dtype=torch.int64)
    tr_t, te_t = _bbc_split(labels)
    return {k: v[tr_t] for k, v in x.items()}, y[tr_t], {k: v[te_t] for k, v in x.items()}, y[te_t]


# ---- models ----------------------------------------------------------------------------------------------------


def mlp(sizes: list[int]) -> nn.Sequential:
    """``Flatten`` then Linear-ReLU pairs; blocks are the Linear layers (the last is the head)."""
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def small_cnn(in_ch: int, widths: list[int], pools: list[bool], spatial: int, hidden: int, classes: int
              ) -> nn.Sequential:
    """One block per conv stage (Conv3x3-BN-ReLU[-MaxPool]), then a Flatten-Linear-ReLU block and the head."""
    stages: list[nn.Module] = []
    c = in_ch
    for w, pool in zip(widths, pools):
        mods: list[nn.Module] = [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU()]
        if pool:
            mods.append(nn.MaxPool2d(2))
            spatial //= 2
        stages.append(nn.Sequential(*mods))
        c = w
    stages.append(nn.Sequential(nn.Flatten(), nn.Linear(c * spatial * spatial, hidden), nn.ReLU()))
    stages.append(nn.Linear(hidden, classes))
    return nn.Sequential(*stages)


class PatchEmbed(nn.Module):
    """Non-overlapping ``patch`` x ``patch`` patches -> tokens ``(B, N, dim)`` plus learned positions."""

    def __init__(self, in_ch: int, size: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_ch, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, (size // patch) ** 2, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos


class MeanPoolHead(nn.Module):
    """LayerNorm, mean over tokens, Linear."""

    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).mean(dim=1))


def tiny_vit(size: int, patch: int, dim: int, depth: int, heads: int, classes: int) -> nn.Sequential:
    """A pre-norm ViT as an ``nn.Sequential``: patch embedding, ``depth`` encoder layers, mean-pool head."""
    layers = [nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                         norm_first=True) for _ in range(depth)]
    return nn.Sequential(PatchEmbed(1, size, patch, dim), *layers, MeanPoolHead(dim, classes))


class NarrowResNet(nn.Module):
    """A ResNet with torchvision's BasicBlock, one block per stage and narrow widths, for small images.

    Has ``conv1``, ``bn1``, ``layer1``..``layer4``, ``fc``, so :func:`~layerfreeze.blocks.discover_blocks` sees the
    torchvision ResNet blocks (stem, layer1..4, fc).
    """

    def __init__(self, in_ch: int = 1, widths: tuple[int, ...] = (16, 32, 64, 128), classes: int = 10) -> None:
        super().__init__()
        from torchvision.models.resnet import BasicBlock

        self.conv1 = nn.Conv2d(in_ch, widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        c = widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            down = None
            if stride != 1 or c != w:
                down = nn.Sequential(nn.Conv2d(c, w, 1, stride=stride, bias=False), nn.BatchNorm2d(w))
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(c, w, stride, down)))
            c = w
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ---- the recipes -----------------------------------------------------------------------------------------------


def _q(quick: bool, full: Any, small: Any) -> Any:
    return small if quick else full


def _sched(quick: bool, steps: int, act_every: int = 5, snapshot_every: int | None = None, quick_steps: int = 24
           ) -> dict[str, Any]:
    """Run length and recording cadence; quick mode: a few dozen steps, a snapshot every step, activations every
    3rd snapshot."""
    if quick:
        return {"steps": quick_steps, "snapshot_every": 1, "act_every": 3}
    return {"steps": steps, "act_every": act_every, "snapshot_every": snapshot_every}


def _digits_setup(seed: int, quick: bool, model_fn: Callable[[], nn.Module], **opt: Any) -> Setup:
    xtr, ytr, xte, yte = _digits(8)
    n = 256 if quick else len(ytr)
    probe, test, test_y = _split_probe_test({"x": xte}, yte, _q(quick, 128, 16), _q(quick, 1000, 32))
    torch.manual_seed(seed)
    return Setup(model_fn(), {"x": xtr[:n]}, ytr[:n], probe, test_x=test, test_y=test_y, **opt)


@register_recipe("mlp-digits", arch="mlp", dataset="digits", mode="scratch", lrs=(0.02, 0.08), minutes=0.05,
        description="MLP 64-256-256-128-10 on scikit-learn's 8x8 digits, SGD")
def _mlp_digits(seed: int, quick: bool, cache_dir: Path) -> Setup:
    return _digits_setup(seed, quick, lambda: mlp([64, 256, 256, 128, 10]), batch_size=_q(quick, 32, 16),
                         optimizer="sgd", weight_decay=5e-4, **_sched(quick, 450))


@register_recipe("cnn-digits", arch="cnn", dataset="digits", mode="scratch", lrs=(0.02, 0.1), minutes=0.1,
        description="4-stage CNN (32-64-64-64) on 8x8 digits, SGD")
def _cnn_digits(seed: int, quick: bool, cache_dir: Path) -> Setup:
    widths = _q(quick, [32, 64, 64, 64], [8, 8, 8, 8])
    return _digits_setup(seed, quick, lambda: small_cnn(1, widths, [False, True, False, True], 8, 64, 10),
                         batch_size=_q(quick, 32, 16), optimizer="sgd", weight_decay=5e-4,
                         **_sched(quick, 450))


def _fmnist_setup(seed: int, quick: bool, model_fn: Callable[[], nn.Module], size: int, n_train: int,
                  rgb: bool = False, **opt: Any) -> Setup:
    xtr, ytr, xte, yte = _fmnist(size, _q(quick, n_train, 256), 2000)
    prep = _imagenet_rgb if rgb else _gray
    probe, test, test_y = _split_probe_test({"x": xte}, yte, _q(quick, 128, 16), _q(quick, 1000, 32))
    torch.manual_seed(seed)
    model = model_fn()
    return Setup(model, {"x": prep(xtr)}, ytr, {"x": prep(probe["x"])}, test_x={"x": prep(test["x"])},
                 test_y=test_y, **opt)


@register_recipe("mlp-fmnist", arch="mlp", dataset="fashion-mnist", mode="scratch", lrs=(1e-3, 3e-3), minutes=0.4,
        description="MLP 784-512-256-128-10 on Fashion-MNIST (all 60k, 28x28), AdamW")
def _mlp_fmnist(seed: int, quick: bool, cache_dir: Path) -> Setup:
    sizes = _q(quick, [784, 512, 256, 128, 10], [784, 32, 32, 10])
    return _fmnist_setup(seed, quick, lambda: mlp(sizes), 28, 60000, batch_size=_q(quick, 128, 16),
                         optimizer="adamw", weight_decay=1e-2, **_sched(quick, 3000))


@register_recipe("cnn-fmnist", arch="cnn", dataset="fashion-mnist", mode="scratch", lrs=(0.02, 0.08), minutes=1.3,
        description="4-stage CNN (16-16-32-32) on a 30k Fashion-MNIST subset (28x28), SGD")
def _cnn_fmnist(seed: int, quick: bool, cache_dir: Path) -> Setup:
    widths = _q(quick, [16, 16, 32, 32], [4, 4, 8, 8])
    return _fmnist_setup(seed, quick, lambda: small_cnn(1, widths, [False, True, False, True], 28, 64, 10), 28,
                         30000, batch_size=_q(quick, 64, 16), optimizer="sgd", weight_decay=5e-4,
                         **_sched(quick, 2000))


@register_recipe("vit-fmnist", arch="vit", dataset="fashion-mnist", mode="scratch", lrs=(1e-3, 3e-3), minutes=0.9,
        description="Tiny ViT (patch 7, dim 64, 4 pre-norm layers) on a 30k Fashion-MNIST subset, AdamW")
def _vit_fmnist(seed: int, quick: bool, cache_dir: Path) -> Setup:
    dim, depth = _q(quick, (64, 4), (16, 2))
    return _fmnist_setup(seed, quick, lambda: tiny_vit(28, 7, dim, depth, 4, 10), 28, 30000,
                         batch_size=_q(quick, 64, 16), optimizer="adamw", weight_decay=5e-2, grad_clip=1.0,
                         **_sched(quick, 2000))


def _save_pretrained(model: nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """Write a recipe's pretrained weights to ``path`` through a temporary name (a killed collection leaves no half
    file for the next one to load) and return them."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    return state


def _pretrained_cnn(cache_dir: Path, quick: bool) -> dict[str, torch.Tensor]:
    """The CNN of ``cnn-fmnist`` trained on Fashion-MNIST (fixed seed 1234, 600 SGD steps; 20 in quick mode),
    cached in ``<out>/_pretrained/`` so every run of the fine-tune recipe starts from the same weights."""
    name = "cnn-fmnist-s1234" + ("-quick" if quick else "") + ".pt"
    path = Path(cache_dir) / "_pretrained" / name
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=True)
    widths = _q(quick, [16, 16, 32, 32], [4, 4, 8, 8])
    xtr, ytr, _, _ = _fmnist(28, _q(quick, 30000, 256), 2000)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = small_cnn(1, widths, [False, True, False, True], 28, 64, 10)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        g = torch.Generator().manual_seed(1234)
        x = _gray(xtr)
        model.train()
        batches = (torch.randint(0, len(ytr), (64,), generator=g) for _ in range(_q(quick, 600, 20)))
        train_steps(model, opt, batches, lambda idx: F.cross_entropy(model(x[idx]), ytr[idx]))
    return _save_pretrained(model, path)


def _cnn_ft_setup(seed: int, quick: bool, cache_dir: Path, **opt: Any) -> Setup:
    """The :func:`_pretrained_cnn` body with a new head seeded by ``seed``, on digits upsampled to 28x28."""
    state = _pretrained_cnn(cache_dir, quick)
    widths = _q(quick, [16, 16, 32, 32], [4, 4, 8, 8])
    xtr, ytr, xte, yte = _digits(28)
    n = 256 if quick else len(ytr)
    probe, test, test_y = _split_probe_test({"x": xte}, yte, _q(quick, 128, 16), _q(quick, 1000, 32))
    torch.manual_seed(seed)
    model = small_cnn(1, widths, [False, True, False, True], 28, 64, 10)
    head = {k: v for k, v in model.state_dict().items() if k.startswith(f"{len(widths) + 1}.")}
    model.load_state_dict({**state, **head})  # pretrained body, new (seeded) head
    return Setup(model, {"x": xtr[:n]}, ytr[:n], probe, test_x=test, test_y=test_y, **opt)


@register_recipe("cnn-fmnist-to-digits", arch="cnn", dataset="digits", mode="finetune", lrs=(0.005, 0.02), minutes=0.15,
        description="The cnn-fmnist CNN pretrained on Fashion-MNIST, fine-tuned on digits upsampled to 28x28 "
                    "with a new head, SGD")
def _cnn_ft_digits(seed: int, quick: bool, cache_dir: Path) -> Setup:
    return _cnn_ft_setup(seed, quick, cache_dir, batch_size=_q(quick, 32, 16), optimizer="sgd", weight_decay=5e-4,
                         schedule="linear", **_sched(quick, 300))


@register_recipe("resnet-fmnist", arch="resnet", dataset="fashion-mnist", mode="scratch", lrs=(0.05, 0.1), minutes=1.5,
        description="Narrow ResNet (BasicBlock x1 per stage, 16-32-64-128) on a 30k Fashion-MNIST subset (28x28), "
                    "SGD")
def _resnet_fmnist(seed: int, quick: bool, cache_dir: Path) -> Setup:
    widths = _q(quick, (16, 32, 64, 128), (4, 8, 8, 8))
    return _fmnist_setup(seed, quick, lambda: NarrowResNet(1, widths, 10), 28, 30000, batch_size=_q(quick, 64, 16),
                         optimizer="sgd", weight_decay=5e-4, **_sched(quick, 1000))


@register_recipe("mobilenetv2-fmnist", arch="mobilenet_v2", dataset="fashion-mnist", mode="finetune", lrs=(0.01, 0.03),
        minutes=1.2, description="torchvision MobileNetV2 with ImageNet weights fine-tuned on an 8k Fashion-MNIST "
                                 "subset (32x32 RGB), SGD")
def _mobilenet_fmnist(seed: int, quick: bool, cache_dir: Path) -> Setup:
    from ..tasks import load_vision_model

    setup = _fmnist_setup(seed, quick, lambda: load_vision_model("mobilenet_v2", 10, pretrained=True), 32, 8000,
                          rgb=True, batch_size=_q(quick, 32, 8), optimizer="sgd", weight_decay=4e-5,
                          schedule="linear", **_sched(quick, 600))
    setup.probe_x = {"x": setup.probe_x["x"][:_q(quick, 64, 8)]}  # 20 blocks: a smaller probe keeps it on disk
    return setup


def _bbc_setup(seed: int, quick: bool, model_fn: Callable[[], nn.Module], **opt: Any) -> Setup:
    xtr, ytr, xte, yte = _bbc(_q(quick, 64, 32))
    n = 64 if quick else len(ytr)
    probe, test, test_y = _split_probe_test(xte, yte, _q(quick, 64, 8), _q(quick, 381, 16))
    torch.manual_seed(seed)
    return Setup(model_fn(), {k: v[:n] for k, v in xtr.items()}, ytr[:n], probe, forward=hf_forward, test_x=test,
                 test_y=test_y, **opt)


@register_recipe("minilm-bbc", arch="minilm-l6", dataset="bbc-news", mode="finetune", lrs=(5e-5, 1.5e-4), minutes=2.5,
        description="MiniLM-L6 (installed weights) fine-tuned on BBC News (max_length 64, batch 16), AdamW")
def _minilm_bbc(seed: int, quick: bool, cache_dir: Path) -> Setup:
    from ..assets import minilm_dir
    from ..tasks import load_text_model

    return _bbc_setup(seed, quick, lambda: load_text_model(minilm_dir(), 5)[0], batch_size=_q(quick, 16, 4),
                      optimizer="adamw", weight_decay=1e-2, grad_clip=1.0, schedule="linear",
                      **_sched(quick, 90, act_every=4, snapshot_every=1, quick_steps=8))


@register_recipe("tinybert-bbc", arch="bert-tiny", dataset="bbc-news", mode="scratch", lrs=(5e-4, 1e-3), minutes=2.3,
        description="A 4-layer BERT (hidden 128) from scratch on BBC News with MiniLM's tokenizer, AdamW")
def _tinybert_bbc(seed: int, quick: bool, cache_dir: Path) -> Setup:
    from transformers import BertConfig, BertForSequenceClassification

    from ..tasks import _quiet_transformers

    _quiet_transformers()
    hidden, layers = _q(quick, (128, 4), (16, 2))
    cfg = BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=4 * hidden, max_position_embeddings=64, num_labels=5)
    return _bbc_setup(seed, quick, lambda: BertForSequenceClassification(cfg), batch_size=_q(quick, 32, 8),
                      optimizer="adamw", weight_decay=1e-2, grad_clip=1.0,
                      **_sched(quick, 450, quick_steps=12))


# ---- the corpus's second round: constant LR, short and long runs, decoder LMs, a ViT fine-tune -----------------
# Added after the first predictor of version 2 was trained; in the shipped one (2026-12-01 evening).
# Each fills a gap of the first round: no run kept a constant LR (SGD or AdamW); the only run near 100 steps was
# MiniLM's and no CNN was fine-tuned with AdamW; no SGD run was 3,000 steps; no decoder LM; no fine-tuned
# transformer other than MiniLM (the ViT fine-tune).


@register_recipe("mlp-digits-sgd-const", arch="mlp", dataset="digits", mode="scratch", lrs=(0.01, 0.05),
                 minutes=0.05, description="The mlp-digits MLP, SGD at a constant LR (after the 5% warm-up) for "
                                           "1,500 steps (34 epochs)")
def _mlp_digits_sgd_const(seed: int, quick: bool, cache_dir: Path) -> Setup:
    return _digits_setup(seed, quick, lambda: mlp([64, 256, 256, 128, 10]), batch_size=_q(quick, 32, 16),
                         optimizer="sgd", weight_decay=5e-4, schedule="constant", **_sched(quick, 1500))


@register_recipe("cnn-fmnist-sgd-const", arch="cnn", dataset="fashion-mnist", mode="scratch", lrs=(0.01, 0.04),
                 minutes=2.7, description="The cnn-fmnist CNN, SGD at a constant LR for 3,000 steps (6.4 epochs "
                                          "of its 30k subset): a long SGD run")
def _cnn_fmnist_sgd_const(seed: int, quick: bool, cache_dir: Path) -> Setup:
    widths = _q(quick, [16, 16, 32, 32], [4, 4, 8, 8])
    return _fmnist_setup(seed, quick, lambda: small_cnn(1, widths, [False, True, False, True], 28, 64, 10), 28,
                         30000, batch_size=_q(quick, 64, 16), optimizer="sgd", weight_decay=5e-4,
                         schedule="constant", **_sched(quick, 3000))


@register_recipe("cnn-fmnist-to-digits-short", arch="cnn", dataset="digits", mode="finetune", lrs=(3e-4, 1e-3),
                 minutes=0.05, description="The cnn-fmnist-to-digits fine-tune in 100 AdamW steps at a constant LR "
                                           "(2.3 epochs of digits): a short CNN fine-tune")
def _cnn_ft_digits_short(seed: int, quick: bool, cache_dir: Path) -> Setup:
    return _cnn_ft_setup(seed, quick, cache_dir, batch_size=_q(quick, 32, 16), optimizer="adamw", weight_decay=1e-2,
                         schedule="constant", **_sched(quick, 100))


def _vit_dims(quick: bool) -> tuple[int, int]:
    """``(dim, depth)`` of the fine-tuned ViT: the vit-fmnist ViT (quick: 16 wide, 2 layers)."""
    return _q(quick, (64, 4), (16, 2))


def _pretrained_vit(cache_dir: Path, quick: bool) -> dict[str, torch.Tensor]:
    """The ViT of ``vit-fmnist`` trained on Fashion-MNIST for ``vit-fmnist-to-digits`` to fine-tune: no ViT
    weights install offline, so the recipe pretrains its own, once, and caches them in ``<out>/_pretrained/``
    (every run and seed of the fine-tune then starts from the same weights, as from a downloaded checkpoint).

    Fixed seed 1234 (init and batches, drawn with replacement from the 30k subset, 64 a batch), 800 AdamW steps
    (20 in quick mode) at lr 1e-3, weight decay 0.05, grad clip 1.0, 5% warm-up then cosine: the settings
    vit-fmnist trains with at lr 1e-3, in 0.4x its steps (the pretrained ViT gets 83.5% of the first 2,000
    Fashion-MNIST test images right; a better one is not the point, its features only have to be learned ones).
    Returns its ``state_dict``.
    """
    from ..loop import lr_lambda, warmup_steps

    name = "vit-fmnist-s1234" + ("-quick" if quick else "") + ".pt"
    path = Path(cache_dir) / "_pretrained" / name
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=True)
    dim, depth = _vit_dims(quick)
    steps = _q(quick, 800, 20)
    xtr, ytr, _, _ = _fmnist(28, _q(quick, 30000, 256), 2000)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = tiny_vit(28, 7, dim, depth, 4, 10)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(steps, warmup_steps(steps, 0.05, rounding="round"), "cosine"))
        g = torch.Generator().manual_seed(1234)
        x = _gray(xtr)
        model.train()
        batches = (torch.randint(0, len(ytr), (64,), generator=g) for _ in range(steps))
        train_steps(model, opt, batches, lambda idx: F.cross_entropy(model(x[idx]), ytr[idx]), scheduler=sched,
                    grad_clip=1.0)
    return _save_pretrained(model, path)


@register_recipe("vit-fmnist-to-digits", arch="vit", dataset="digits", mode="finetune", lrs=(2e-4, 1e-3),
                 minutes=0.15, description="The vit-fmnist ViT pretrained on Fashion-MNIST (in the recipe, cached), "
                                          "fine-tuned on digits upsampled to 28x28 with a new classifier, AdamW, "
                                          "linear decay, 300 steps")
def _vit_ft_digits(seed: int, quick: bool, cache_dir: Path) -> Setup:
    state = _pretrained_vit(cache_dir, quick)
    dim, depth = _vit_dims(quick)
    xtr, ytr, xte, yte = _digits(28)
    n = 256 if quick else len(ytr)
    probe, test, test_y = _split_probe_test({"x": xte}, yte, _q(quick, 128, 16), _q(quick, 1000, 32))
    torch.manual_seed(seed)
    model = tiny_vit(28, 7, dim, depth, 4, 10)
    # a new classifier (seeded) on the pretrained body and final norm, as a ViT's classifier is reset to fine-tune
    fc = {k: v for k, v in model.state_dict().items() if k.startswith(f"{depth + 1}.fc.")}
    model.load_state_dict({**state, **fc})
    return Setup(model, {"x": xtr[:n]}, ytr[:n], probe, test_x=test, test_y=test_y, batch_size=_q(quick, 32, 16),
                 optimizer="adamw", weight_decay=5e-2, grad_clip=1.0, schedule="linear", **_sched(quick, 300))


#: The LM recipes' vocabulary (see :func:`_bbc_lm`) and context (tokens per chunk).
LM_VOCAB, LM_CONTEXT = 8192, 64


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position: ``logits`` ``(B, T, V)``, ``labels`` ``(B, T)`` already
    shifted (``labels[b, t]`` is the token after input ``t``, :func:`_bbc_lm`), so position ``t``'s logits are
    scored against ``labels[:, t]``; computed in float32."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


@functools.lru_cache(maxsize=1)
def _bbc_token_streams() -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(train stream, held-out stream, tokenizer vocabulary size)`` of :func:`_bbc_lm`: MiniLM-L6 token ids
    ``(n,)`` int64, every article followed by ``[SEP]``. Cached apart from the chunking, so recipes at another
    context or vocabulary (quick mode, tests) tokenize the 2,225 articles only once per process."""
    from transformers import AutoTokenizer

    from ..assets import minilm_dir
    from ..data import load_bbc_news
    from ..tasks import _quiet_transformers

    _quiet_transformers()
    texts, labels, _ = load_bbc_news()
    tok = AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)
    tr, te = (idx.tolist() for idx in _bbc_split(labels))
    # articles run past the tokenizer's 512-token model length: nothing here feeds them to MiniLM, so say nothing
    tok.model_max_length = 1 << 30

    def stream(idx: list[int]) -> torch.Tensor:
        ids = tok([texts[i] for i in idx], add_special_tokens=False)["input_ids"]
        return torch.tensor([t for article in ids for t in (*article, tok.sep_token_id)], dtype=torch.int64)

    return stream(tr), stream(te), len(tok)


@functools.lru_cache(maxsize=2)
def _bbc_lm(context: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """BBC News as next-token chunks for the causal-LM recipes: ``(train inputs, train labels, held-out inputs,
    held-out labels)``, each ``(N, context)`` int64 in ``[0, vocab)``; ``labels[n, t]`` is the token after
    ``inputs[n, t]`` in the stream.

    Each side of :func:`_bbc`'s fixed stratified 80/20 split (seed 0; the train articles in its seeded order, so
    topics mix) is tokenized with MiniLM-L6's WordPiece tokenizer without special tokens, every article followed
    by ``[SEP]`` (a document boundary, as GPT-2's end-of-text), and concatenated: 869,384 train tokens (1,781
    articles) and 211,379 held-out (444). The stream is cut into consecutive chunks of ``context`` tokens, the
    labels being the stream shifted by one (the target of a chunk's last position is the first token of the next
    chunk), so every position of every chunk is a prediction and no padding or ignored label is needed; the tail
    that does not fill a chunk is dropped (13,584 train and 3,302 held-out chunks at 64).

    Vocabulary: MiniLM's ids are mapped to ``vocab`` ids, 0 for ``[UNK]`` and ``1 .. vocab - 1`` for the train
    stream's most frequent tokens, most frequent first (ties by tokenizer id); every other token, train or
    held-out, becomes 0. Why: an LM's head computes ``(B, T, vocab)`` logits; at MiniLM's 30,522 that is ~5x
    the cost of the four 128-wide layers, and a run would not fit a few minutes on 2 CPU cores. 8,191 tokens
    cover 96.3% of the train stream (``[UNK]`` is 3.7% of the train targets and 4.5% of the held-out ones, the
    most frequent token, ``the``, 4.9%); at 4,096 ``[UNK]`` would be the most frequent target (9.9%), and
    predicting it would inflate the accuracy.
    """
    train, held, tokenizer_vocab = _bbc_token_streams()
    counts = torch.bincount(train, minlength=tokenizer_vocab)
    order = torch.sort(counts, descending=True, stable=True).indices
    keep = order[: vocab - 1][counts[order[: vocab - 1]] > 0]
    remap = torch.zeros(tokenizer_vocab, dtype=torch.int64)
    remap[keep] = torch.arange(1, len(keep) + 1)

    def chunks(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = remap[s]
        n = (len(s) - 1) // context
        return s[: n * context].view(n, context), s[1: n * context + 1].view(n, context)

    return (*chunks(train), *chunks(held))


def _lm_setup(seed: int, quick: bool, model_fn: Callable[[int, int], nn.Module], **opt: Any) -> Setup:
    """A causal-LM Setup on :func:`_bbc_lm` chunks: ``model_fn(vocab, context)`` built after seeding with
    ``seed``; inputs ``{"input_ids": (N, T)}``, labels ``(N, T)``, forward :func:`~layerfreeze.lm.lm_forward`
    (per-token logits), loss :func:`token_cross_entropy`. Probe: 64 held-out chunks (4,096 tokens; every
    block's output is ``(64, T, H)``, the head's ``(64, T, vocab)`` logits, subsampled per sample); test: 512
    other held-out chunks (32,768 next tokens), so the test accuracy is next-token top-1 accuracy. Quick mode:
    16-token chunks, a 512-token vocabulary, 64 train chunks."""
    from ..lm import lm_forward

    context, vocab = _q(quick, (LM_CONTEXT, LM_VOCAB), (16, 512))
    xtr, ytr, xte, yte = _bbc_lm(context, vocab)
    n = 64 if quick else len(ytr)
    probe, test, test_y = _split_probe_test({"input_ids": xte}, yte, _q(quick, 64, 8), _q(quick, 512, 16))
    torch.manual_seed(seed)
    return Setup(model_fn(vocab, context), {"input_ids": xtr[:n]}, ytr[:n], probe, forward=lm_forward,
                 loss_fn=token_cross_entropy, test_x=test, test_y=test_y, **opt)


def tiny_gpt2(vocab: int, context: int, dim: int, depth: int, heads: int) -> nn.Module:
    """A GPT-2 (``GPT2LMHeadModel`` from a config, random init; LM head tied to the token embeddings as in
    GPT-2) with dropout off: a from-scratch run that sees each token under once needs no regularisation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from ..tasks import _quiet_transformers

    _quiet_transformers()
    cfg = GPT2Config(vocab_size=vocab, n_positions=context, n_embd=dim, n_layer=depth, n_head=heads,
                     n_inner=4 * dim, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                     eos_token_id=None, pad_token_id=None)
    return GPT2LMHeadModel(cfg)


def tiny_llama(vocab: int, context: int, dim: int, depth: int, heads: int) -> nn.Module:
    """A Llama (``LlamaForCausalLM`` from a config, random init): RMSNorm, rotary positions, SwiGLU MLP of width
    ``8/3 * dim`` rounded up to a multiple of 32, grouped-query attention (half as many key/value heads), and an
    LM head untied from the embeddings (as Llama 2/3), so the head block trains its own ``(vocab, dim)`` matrix
    where the GPT-2 recipe's head owns only its final norm."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..tasks import _quiet_transformers

    _quiet_transformers()
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=-(-8 * dim // 96) * 32,
                      num_hidden_layers=depth, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      max_position_embeddings=context, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg)


@register_recipe("gpt-bbc", arch="gpt2-tiny", dataset="bbc-news-lm", mode="scratch", lrs=(1e-3, 3e-3), minutes=2.7,
                 description="A 4-layer GPT-2 (hidden 128, tied head) from scratch on next-token prediction over "
                             "BBC News (64-token chunks, 8,192-token vocabulary), AdamW, cosine, 600 steps (0.7 epoch)")
def _gpt_bbc(seed: int, quick: bool, cache_dir: Path) -> Setup:
    dim, depth = _q(quick, (128, 4), (16, 2))
    return _lm_setup(seed, quick, lambda vocab, context: tiny_gpt2(vocab, context, dim, depth, 4),
                     batch_size=_q(quick, 16, 8), optimizer="adamw", weight_decay=0.1, grad_clip=1.0,
                     **_sched(quick, 600, quick_steps=12))


@register_recipe("llama-bbc", arch="llama-tiny", dataset="bbc-news-lm", mode="scratch", lrs=(5e-4, 2e-3),
                 minutes=2.3, description="A 4-layer Llama (hidden 128, untied head) from scratch on the same "
                                          "next-token task, AdamW at a constant LR, 501 steps (0.6 epoch)")
def _llama_bbc(seed: int, quick: bool, cache_dir: Path) -> Setup:
    dim, depth = _q(quick, (128, 4), (16, 2))
    return _lm_setup(seed, quick, lambda vocab, context: tiny_llama(vocab, context, dim, depth, 4),
                     batch_size=_q(quick, 16, 8), optimizer="adamw", weight_decay=0.1, grad_clip=1.0,
                     schedule="constant", **_sched(quick, 500, quick_steps=12))


# ---- the third round: the trainer's own settings, and short runs from scratch (2026-12-01, issue 16) --------------
# Every recipe above warms up for 5% of its run; `layerfreeze train` warms up for 10% (TrainConfig.warmup_fraction)
# with linear decay. Predictors trained without runs of that schedule froze MiniLM-L6's layer 1 at the first decision
# (step 7) of the suite's BBC runs (label: ~step 39); offline, one of them calls it freezable at step 7 of a run with
# a 10% warm-up (p 0.94) but not of the same run with 5% (0.75). And every from-scratch run above is 450-3,000
# steps: the only runs of about 100-150 steps were fine-tunes, whose front blocks are done early, and a predictor
# trained on them froze a from-scratch ResNet's stem at step 7 of 144 (BENCHMARKS "The shipped predictor since
# 2026-12-01 evening"). These recipes train with
# the trainer's schedule (10% warm-up, linear decay): MiniLM-L6 as minilm-bbc otherwise, and the suite's kind of
# short run from scratch (AdamW, batch 128, ~3 epochs of a 6k subset, a snapshot every step) on the families the
# predictor trains on; the ResNet family stays held out.
TRAINER_SCHEDULE = {"schedule": "linear", "warmup": 0.1}


@register_recipe("minilm-bbc-warmup10", arch="minilm-l6", dataset="bbc-news", mode="finetune", lrs=(5e-5, 1.5e-4),
                 minutes=2.0, description="minilm-bbc with the trainer's schedule: 10% warm-up, then linear decay")
def _minilm_bbc_warmup10(seed: int, quick: bool, cache_dir: Path) -> Setup:
    setup = _minilm_bbc(seed, quick, cache_dir)
    setup.warmup = TRAINER_SCHEDULE["warmup"]
    return setup


def _fmnist_short(seed: int, quick: bool, model_fn: Callable[[], nn.Module], weight_decay: float,
                  **opt: Any) -> Setup:
    return _fmnist_setup(seed, quick, model_fn, 28, 6000, batch_size=_q(quick, 128, 16), optimizer="adamw",
                         weight_decay=weight_decay, **TRAINER_SCHEDULE, **opt, **_sched(quick, 150, snapshot_every=1))


@register_recipe("mlp-fmnist-short", arch="mlp", dataset="fashion-mnist", mode="scratch", lrs=(1e-3, 3e-3),
                 minutes=0.05, description="The mlp-fmnist MLP from scratch in 150 AdamW steps (batch 128, 3.2 epochs "
                                           "of a 6k subset), the trainer's schedule: a short run from scratch")
def _mlp_fmnist_short(seed: int, quick: bool, cache_dir: Path) -> Setup:
    sizes = _q(quick, [784, 512, 256, 128, 10], [784, 32, 32, 10])
    return _fmnist_short(seed, quick, lambda: mlp(sizes), 1e-2)


@register_recipe("cnn-fmnist-short", arch="cnn", dataset="fashion-mnist", mode="scratch", lrs=(1e-3, 3e-3),
                 minutes=0.2, description="The cnn-fmnist CNN from scratch in 150 AdamW steps (batch 128, 3.2 epochs "
                                          "of a 6k subset), the trainer's schedule: a short run from scratch")
def _cnn_fmnist_short(seed: int, quick: bool, cache_dir: Path) -> Setup:
    widths = _q(quick, [16, 16, 32, 32], [4, 4, 8, 8])
    return _fmnist_short(seed, quick, lambda: small_cnn(1, widths, [False, True, False, True], 28, 64, 10), 5e-4)


@register_recipe("vit-fmnist-short", arch="vit", dataset="fashion-mnist", mode="scratch", lrs=(1e-3, 3e-3),
                 minutes=0.2, description="The vit-fmnist ViT from scratch in 150 AdamW steps (batch 128, 3.2 epochs "
                                          "of a 6k subset), the trainer's schedule: a short run from scratch")
def _vit_fmnist_short(seed: int, quick: bool, cache_dir: Path) -> Setup:
    dim, depth = _q(quick, (64, 4), (16, 2))
    return _fmnist_short(seed, quick, lambda: tiny_vit(28, 7, dim, depth, 4, 10), 5e-2, grad_clip=1.0)


#: Held out from predictor training by default: an unseen architecture family (ResNet, residual CNN) and a text
#: transformer trained from scratch (BERT-tiny on BBC News). MiniLM-L6 and MobileNetV2 fine-tunes are in the training
#: set: a predictor trained on scratch-trained networks only (version 1, and version 2 with these two held out) froze
#: every MiniLM layer at its first full window on BBC News (91.9% and 90.5% test accuracy against 98.0% and 96.9%
#: without freezing): under Adam every layer of a fine-tuned transformer moves its weights alike, and only runs of
#: fine-tuned transformers show that the deep layers' representations still change.
DEFAULT_HOLDOUT = ("resnet-fmnist", "tinybert-bbc")
