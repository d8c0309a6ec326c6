"""Collect training runs for the SmartFRZ predictor: train small networks to the end and record every block.

A *recipe* builds a :class:`Setup` (model, train data, fixed probe batch, loss, optimizer settings) from a seed; a
*run* is one recipe trained with one seed and one learning rate, with a plain loop (no freezing). While it trains we
record, every ``snapshot_every`` optimizer steps (and before the first step), each block's weight sample exactly as
the online :class:`~layerfreeze.smartfrz.recorder.WeightRecorder` does (1,024 weights per block at fixed positions
drawn with seed 0, spread over the block's tensors in proportion to their sizes; smaller blocks padded), over the
*whole* trajectory, not only a last window. Every ``act_every``-th snapshot, and at the final one, each block's
output on the fixed probe batch is recorded too; :mod:`.labels` turns those into CKA labels.

On-disk format (``RUN_FORMAT_VERSION`` 1), one folder per run, ``<out>/<recipe>_s<seed>_lr<lr>/``:

``meta.json``
    ``format`` ("layerfreeze-smartfrz-run"), ``format_version``, ``status`` ("complete" or "diverged"),
    ``run``, ``recipe``, ``arch``, ``dataset``, ``mode`` ("scratch" or "finetune"), ``seed``, ``lr``,
    ``optimizer`` (name, weight decay, momentum, grad clip), ``schedule`` ("cosine" or "linear", with a 5% linear
    warm-up), ``batch_size``, ``steps`` (optimizer steps), ``snapshot_every``, ``act_every``, ``blocks`` (names,
    front to back), ``block_params`` (parameter counts), ``head`` (index of the head block or null),
    ``sample_size``, ``sample_seed``, ``probe_size``, ``act_features`` (features kept per probe sample),
    ``act_dims_full`` (a block's flattened output size per probe sample before subsampling), ``losses`` (mean
    training loss between consecutive snapshots), ``test_accuracy`` (final, on a fixed test subset),
    ``quick`` (shrunk for tests), ``wall_seconds``, ``versions`` (python, torch, layerfreeze, ...).
    A diverged run (NaN/Inf loss or weights) has ``status: "diverged"`` and ``diverged_at_step`` and no tensor
    files; it is never labelled or trained on, and is not retried (it would diverge the same way).
``weights.safetensors``
    ``samples`` ``(N_snap, L, S)`` float32: snapshot ``k`` (taken after step ``steps[k]``) of the ``S`` sampled
    weights of each of the ``L`` blocks (padding is 0); ``mask`` ``(L, S)`` uint8, 1 for a real weight, 0 for
    padding; ``steps`` ``(N_snap,)`` int64 = ``0, snapshot_every, 2 * snapshot_every, ..., steps``.
``activations.safetensors``
    ``act.<i>`` ``(N_act, P, D_i)`` float16: block ``i``'s output on the ``P`` probe samples (model in eval mode,
    no grad; the first tensor of a tuple output), flattened per sample and subsampled to ``D_i <= act_features``
    features at fixed positions ``pos.<i>`` ``(D_i,)`` int64 (seeded per block; all features when the output is
    small enough), clamped to the float16 range; ``act_steps`` ``(N_act,)`` int64, the steps of snapshots ``0,
    act_every, 2 * act_every, ...`` and always the final one.

Files are written through temporary names and renamed; ``meta.json`` is written last, so a folder without it is an
unfinished run and is redone, and a finished one is skipped (collection resumes where it stopped).

Your own runs: build a :class:`Setup` for your model and data and call :func:`record_run`, or register a recipe with
:func:`recipe`; then ``layerfreeze predictor label`` / ``train`` work on the folder as on ours.
"""

from __future__ import annotations

import functools
import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..blocks import Block, discover_blocks, output_tensor
from .recorder import WeightRecorder
from .runs import (ACTIVATIONS_FILE, META_FILE, RUN_FORMAT, RUN_FORMAT_VERSION, WEIGHTS_FILE, PipelineError,
                   is_finished, write_json_atomic)

SAMPLE_SIZE = 1024
SAMPLE_SEED = 0          # the online strategy's default seed: runs sample the positions it would sample
ACT_FEATURES = 1024
TARGET_SNAPSHOTS = 150   # the online strategy's default snapshot_every is round(total_steps / 150)
_F16_MAX = 65504.0


# --------------------------------------------------------------------------------------------------------------
# Setups and recipes
# --------------------------------------------------------------------------------------------------------------


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def call_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``model(batch["x"])``: the forward of the image and tabular recipes."""
    return model(batch["x"])


def hf_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of a Hugging Face sequence classifier from a tokenized batch."""
    return model(**{k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}).logits


@dataclass
class Setup:
    """Everything one run needs. Tensors are in memory; a batch is ``{key: tensor[idx]}`` over ``train_x``.

    Attributes:
        model: The network (initialised by the recipe from the run's seed).
        train_x / train_y: Training inputs ``{key: (N, ...)}`` and class labels ``(N,)``.
        probe_x: The fixed probe batch ``{key: (P, ...)}`` (same for every seed of a recipe).
        test_x / test_y: A fixed test subset for the final accuracy (optional).
        forward: ``(model, batch dict) -> logits``.
        loss_fn: ``(logits, labels) -> scalar loss``.
        steps: Optimizer steps (rounded up to a multiple of ``snapshot_every``).
        batch_size: Samples per step.
        optimizer: ``"sgd"`` (with ``momentum``, Nesterov off) or ``"adamw"``.
        weight_decay / momentum / grad_clip: Optimizer settings (``grad_clip`` is a max global norm or None).
        schedule: ``"cosine"`` or ``"linear"`` decay to zero after a ``warmup`` fraction of linear warm-up.
        snapshot_every: Steps between weight snapshots; None: ``max(1, round(steps / 150))``.
        act_every: Every how many snapshots the probe activations are recorded.
        blocks: Module-name patterns for :func:`~layerfreeze.blocks.discover_blocks` (None: discovered).
    """

    model: nn.Module
    train_x: dict[str, torch.Tensor]
    train_y: torch.Tensor
    probe_x: dict[str, torch.Tensor]
    forward: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor] = call_forward
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    test_x: dict[str, torch.Tensor] | None = None
    test_y: torch.Tensor | None = None
    steps: int = 1000
    batch_size: int = 64
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    momentum: float = 0.9
    grad_clip: float | None = None
    schedule: str = "cosine"
    warmup: float = 0.05
    snapshot_every: int | None = None
    act_every: int = 5
    blocks: list[str] | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in ("sgd", "adamw"):
            raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {self.optimizer!r}")
        if self.schedule not in ("cosine", "linear"):
            raise ValueError(f"schedule must be 'cosine' or 'linear', got {self.schedule!r}")
        if self.snapshot_every is None:
            self.snapshot_every = max(1, round(self.steps / TARGET_SNAPSHOTS))
        self.steps = math.ceil(self.steps / self.snapshot_every) * self.snapshot_every
        if self.act_every < 1:
            raise ValueError(f"act_every must be >= 1, got {self.act_every}")


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


RECIPES: dict[str, Recipe] = {}


def recipe(name: str, *, arch: str, dataset: str, mode: str, lrs: tuple[float, ...], minutes: float,
           description: str = "") -> Callable[[Callable[[int, bool, Path], Setup]], Callable[[int, bool, Path], Setup]]:
    """Register ``fn(seed, quick, cache_dir) -> Setup`` as recipe ``name`` (usable as a decorator)."""
    if mode not in ("scratch", "finetune"):
        raise ValueError(f"mode must be 'scratch' or 'finetune', got {mode!r}")

    def deco(fn: Callable[[int, bool, Path], Setup]) -> Callable[[int, bool, Path], Setup]:
        RECIPES[name] = Recipe(name, arch, dataset, mode, tuple(lrs), minutes, fn, description)
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


@functools.lru_cache(maxsize=2)
def _bbc(max_length: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """BBC News tokenized with MiniLM-L6's tokenizer to ``max_length``; the fixed stratified 80/20 split of
    :mod:`layerfreeze.tasks` (seed 0)."""
    from transformers import AutoTokenizer

    from ..assets import minilm_dir
    from ..data import load_bbc_news, stratified_split
    from ..tasks import _quiet_transformers

    _quiet_transformers()
    texts, labels, _ = load_bbc_news()
    tok = AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)
    enc = tok(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    x = {k: enc[k].long() for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}
    y = torch.tensor(labels, dtype=torch.int64)
    tr, te = stratified_split(labels, 0.2, seed=0)
    tr_t = torch.tensor(tr)[torch.randperm(len(tr), generator=torch.Generator().manual_seed(0))]  # mix classes
    te_t = torch.tensor(te)
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


@recipe("mlp-digits", arch="mlp", dataset="digits", mode="scratch", lrs=(0.02, 0.08), minutes=0.05,
        description="MLP 64-256-256-128-10 on scikit-learn's 8x8 digits, SGD")
def _mlp_digits(seed: int, quick: bool, cache_dir: Path) -> Setup:
    return _digits_setup(seed, quick, lambda: mlp([64, 256, 256, 128, 10]), batch_size=_q(quick, 32, 16),
                         optimizer="sgd", weight_decay=5e-4, **_sched(quick, 450))


@recipe("cnn-digits", arch="cnn", dataset="digits", mode="scratch", lrs=(0.02, 0.1), minutes=0.1,
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


@recipe("mlp-fmnist", arch="mlp", dataset="fashion-mnist", mode="scratch", lrs=(1e-3, 3e-3), minutes=0.4,
        description="MLP 784-512-256-128-10 on Fashion-MNIST (all 60k, 28x28), AdamW")
def _mlp_fmnist(seed: int, quick: bool, cache_dir: Path) -> Setup:
    sizes = _q(quick, [784, 512, 256, 128, 10], [784, 32, 32, 10])
    return _fmnist_setup(seed, quick, lambda: mlp(sizes), 28, 60000, batch_size=_q(quick, 128, 16),
                         optimizer="adamw", weight_decay=1e-2, **_sched(quick, 3000))


@recipe("cnn-fmnist", arch="cnn", dataset="fashion-mnist", mode="scratch", lrs=(0.02, 0.08), minutes=1.3,
        description="4-stage CNN (16-16-32-32) on a 30k Fashion-MNIST subset (28x28), SGD")
def _cnn_fmnist(seed: int, quick: bool, cache_dir: Path) -> Setup:
    widths = _q(quick, [16, 16, 32, 32], [4, 4, 8, 8])
    return _fmnist_setup(seed, quick, lambda: small_cnn(1, widths, [False, True, False, True], 28, 64, 10), 28,
                         30000, batch_size=_q(quick, 64, 16), optimizer="sgd", weight_decay=5e-4,
                         **_sched(quick, 2000))


@recipe("vit-fmnist", arch="vit", dataset="fashion-mnist", mode="scratch", lrs=(1e-3, 3e-3), minutes=0.9,
        description="Tiny ViT (patch 7, dim 64, 4 pre-norm layers) on a 30k Fashion-MNIST subset, AdamW")
def _vit_fmnist(seed: int, quick: bool, cache_dir: Path) -> Setup:
    dim, depth = _q(quick, (64, 4), (16, 2))
    return _fmnist_setup(seed, quick, lambda: tiny_vit(28, 7, dim, depth, 4, 10), 28, 30000,
                         batch_size=_q(quick, 64, 16), optimizer="adamw", weight_decay=5e-2, grad_clip=1.0,
                         **_sched(quick, 2000))


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
        for _ in range(_q(quick, 600, 20)):
            idx = torch.randint(0, len(ytr), (64,), generator=g)
            loss = F.cross_entropy(model(x[idx]), ytr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    return state


@recipe("cnn-fmnist-to-digits", arch="cnn", dataset="digits", mode="finetune", lrs=(0.005, 0.02), minutes=0.15,
        description="The cnn-fmnist CNN pretrained on Fashion-MNIST, fine-tuned on digits upsampled to 28x28 "
                    "with a new head, SGD")
def _cnn_ft_digits(seed: int, quick: bool, cache_dir: Path) -> Setup:
    state = _pretrained_cnn(cache_dir, quick)
    widths = _q(quick, [16, 16, 32, 32], [4, 4, 8, 8])
    xtr, ytr, xte, yte = _digits(28)
    n = 256 if quick else len(ytr)
    probe, test, test_y = _split_probe_test({"x": xte}, yte, _q(quick, 128, 16), _q(quick, 1000, 32))
    torch.manual_seed(seed)
    model = small_cnn(1, widths, [False, True, False, True], 28, 64, 10)
    head = {k: v for k, v in model.state_dict().items() if k.startswith(f"{len(widths) + 1}.")}
    model.load_state_dict({**state, **head})  # pretrained body, new (seeded) head
    return Setup(model, {"x": xtr[:n]}, ytr[:n], probe, test_x=test, test_y=test_y, batch_size=_q(quick, 32, 16),
                 optimizer="sgd", weight_decay=5e-4, schedule="linear", **_sched(quick, 300))


@recipe("resnet-fmnist", arch="resnet", dataset="fashion-mnist", mode="scratch", lrs=(0.05, 0.1), minutes=1.5,
        description="Narrow ResNet (BasicBlock x1 per stage, 16-32-64-128) on a 30k Fashion-MNIST subset (28x28), "
                    "SGD")
def _resnet_fmnist(seed: int, quick: bool, cache_dir: Path) -> Setup:
    widths = _q(quick, (16, 32, 64, 128), (4, 8, 8, 8))
    return _fmnist_setup(seed, quick, lambda: NarrowResNet(1, widths, 10), 28, 30000, batch_size=_q(quick, 64, 16),
                         optimizer="sgd", weight_decay=5e-4, **_sched(quick, 1000))


@recipe("mobilenetv2-fmnist", arch="mobilenet_v2", dataset="fashion-mnist", mode="finetune", lrs=(0.01, 0.03),
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


@recipe("minilm-bbc", arch="minilm-l6", dataset="bbc-news", mode="finetune", lrs=(5e-5, 1.5e-4), minutes=2.5,
        description="MiniLM-L6 (installed weights) fine-tuned on BBC News (max_length 64, batch 16), AdamW")
def _minilm_bbc(seed: int, quick: bool, cache_dir: Path) -> Setup:
    from ..assets import minilm_dir
    from ..tasks import load_text_model

    return _bbc_setup(seed, quick, lambda: load_text_model(minilm_dir(), 5)[0], batch_size=_q(quick, 16, 4),
                      optimizer="adamw", weight_decay=1e-2, grad_clip=1.0, schedule="linear",
                      **_sched(quick, 90, act_every=4, snapshot_every=1, quick_steps=8))


@recipe("tinybert-bbc", arch="bert-tiny", dataset="bbc-news", mode="scratch", lrs=(5e-4, 1e-3), minutes=2.3,
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


#: Held out from predictor training by default: an unseen architecture family (ResNet, residual CNN) and a text
#: transformer trained from scratch (BERT-tiny on BBC News). MiniLM-L6 and MobileNetV2 fine-tunes are in the training
#: set: a predictor trained on scratch-trained networks only (version 1, and version 2 with these two held out) froze
#: every MiniLM layer at its first full window on BBC News (91.9% and 90.5% test accuracy against 98.0% and 96.9%
#: without freezing): under Adam every layer of a fine-tuned transformer moves its weights alike, and only runs of
#: fine-tuned transformers show that the deep layers' representations still change.
DEFAULT_HOLDOUT = ("resnet-fmnist", "tinybert-bbc")


# --------------------------------------------------------------------------------------------------------------
# Recording one run
# --------------------------------------------------------------------------------------------------------------


def _lr_factor(step: int, total: int, warmup: float, schedule: str) -> float:
    """Linear warm-up over ``warmup * total`` steps, then cosine or linear decay to zero at ``total``."""
    w = max(1, round(warmup * total))
    if step < w:
        return (step + 1) / w
    p = (step - w) / max(1, total - w)
    return 0.5 * (1 + math.cos(math.pi * p)) if schedule == "cosine" else 1.0 - p


def _make_optimizer(setup: Setup, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if setup.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=setup.momentum, weight_decay=setup.weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=setup.weight_decay)


class _ActivationProbe:
    """Forward hooks on each block's last module; keeps a float16 subsample of every probe-batch output."""

    def __init__(self, blocks: list[Block], max_features: int) -> None:
        self.max_features = max_features
        self.positions: list[torch.Tensor | None] = [None] * len(blocks)
        self.full_dims: list[int | None] = [None] * len(blocks)
        self.rows: list[list[torch.Tensor]] = [[] for _ in blocks]
        self._current: list[torch.Tensor | None] = [None] * len(blocks)
        self._handles = [block.modules[-1][1].register_forward_hook(self._hook(i)) for i, block in enumerate(blocks)]
        self.enabled = False

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.enabled:
                return
            out = output_tensor(output)
            self._current[i] = out.detach().float().reshape(out.shape[0], -1)
        return hook

    def record(self, model: nn.Module, forward: Callable[..., torch.Tensor], probe: dict[str, torch.Tensor]) -> None:
        was_training = model.training
        model.eval()
        self.enabled = True
        try:
            with torch.no_grad():
                forward(model, probe)
        finally:
            self.enabled = False
            model.train(was_training)
        for i, out in enumerate(self._current):
            if out is None:
                raise RuntimeError(f"block {i} produced no output on the probe batch (is it used in forward?)")
            if self.positions[i] is None:
                d = out.shape[1]
                self.full_dims[i] = d
                if d > self.max_features:
                    g = torch.Generator().manual_seed(10_007 * (i + 1))
                    self.positions[i] = torch.randperm(d, generator=g)[: self.max_features].sort().values
                else:
                    self.positions[i] = torch.arange(d)
            self.rows[i].append(out[:, self.positions[i]].clamp(-_F16_MAX, _F16_MAX).to(torch.float16))
            self._current[i] = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _versions() -> dict[str, str]:
    import sys

    from .. import __version__

    out = {"python": platform.python_version(), "torch": torch.__version__, "layerfreeze": __version__}
    for name in ("torchvision", "transformers", "sklearn"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = getattr(mod, "__version__", "?")
    return out


def _accuracy(setup: Setup, model: nn.Module) -> float | None:
    if setup.test_x is None or setup.test_y is None or len(setup.test_y) == 0:
        return None
    model.eval()
    correct = 0
    with torch.no_grad():
        for s in range(0, len(setup.test_y), 128):
            batch = {k: v[s:s + 128] for k, v in setup.test_x.items()}
            correct += int((setup.forward(model, batch).argmax(-1) == setup.test_y[s:s + 128]).sum())
    model.train()
    return correct / len(setup.test_y)


def run_name(recipe_name: str, seed: int, lr: float) -> str:
    return f"{recipe_name}_s{seed}_lr{lr:g}"


def record_run(setup: Setup, out_dir: str | Path, *, lr: float, seed: int, info: dict[str, Any] | None = None,
               sample_size: int = SAMPLE_SIZE, act_features: int = ACT_FEATURES,
               progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Train ``setup`` to the end with a plain loop and write the run folder ``out_dir`` (format in the module
    docstring). The data order is drawn from ``seed``; the model is already initialised by the caller.

    Args:
        info: Extra meta keys: ``recipe`` (default: the folder name; the train/held-out split is by recipe),
            ``arch``, ``dataset``, ``mode``...
        progress: Called as ``progress(step, steps)`` after each snapshot.

    Returns:
        The written ``meta.json`` content (``status`` "complete" or "diverged").
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (META_FILE, WEIGHTS_FILE, ACTIVATIONS_FILE):
        (out_dir / name).unlink(missing_ok=True)
    t0 = time.perf_counter()
    model = setup.model
    blocks = discover_blocks(model, setup.blocks)
    every, steps = int(setup.snapshot_every), int(setup.steps)
    n_snap = steps // every + 1
    recorder = WeightRecorder(blocks, sample_size, window=max(3, n_snap), seed=SAMPLE_SEED)
    probe = _ActivationProbe(blocks, act_features)
    opt = _make_optimizer(setup, model, lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, steps, setup.warmup, setup.schedule))
    gen = torch.Generator().manual_seed(seed)
    n_train = len(setup.train_y)
    if n_train < setup.batch_size:
        raise PipelineError(f"{n_train} training samples, fewer than one batch of {setup.batch_size}")
    per_epoch = n_train // setup.batch_size
    order = torch.randperm(n_train, generator=gen)
    act_steps: list[int] = []
    losses: list[float] = []
    meta: dict[str, Any] = {
        "format": RUN_FORMAT, "format_version": RUN_FORMAT_VERSION, "status": "running", "run": out_dir.name,
        "recipe": out_dir.name, "arch": None, "dataset": None, "mode": None, **(info or {}), "seed": seed, "lr": lr,
        "optimizer": {"name": setup.optimizer, "weight_decay": setup.weight_decay,
                      "momentum": setup.momentum if setup.optimizer == "sgd" else None, "grad_clip": setup.grad_clip},
        "schedule": setup.schedule, "warmup": setup.warmup, "batch_size": setup.batch_size, "steps": steps,
        "snapshot_every": every, "act_every": setup.act_every, "blocks": [b.name for b in blocks],
        "block_params": [b.num_parameters() for b in blocks],
        "head": next((b.index for b in blocks if b.is_head), None), "sample_size": sample_size,
        "sample_seed": SAMPLE_SEED, "probe_size": int(len(next(iter(setup.probe_x.values())))),
        "act_features": act_features, "train_size": n_train,
    }

    def snapshot(k: int, step: int) -> None:
        recorder.snapshot([True] * len(blocks))
        if k % setup.act_every == 0 or k == n_snap - 1:
            probe.record(model, setup.forward, setup.probe_x)
            act_steps.append(step)

    model.train()
    try:
        snapshot(0, 0)
        running, count = 0.0, 0
        for step in range(1, steps + 1):
            pos = (step - 1) % per_epoch
            if pos == 0 and step > 1:
                order = torch.randperm(n_train, generator=gen)
            idx = order[pos * setup.batch_size:(pos + 1) * setup.batch_size]
            batch = {k: v[idx] for k, v in setup.train_x.items()}
            loss = setup.loss_fn(setup.forward(model, batch), setup.train_y[idx])
            if not torch.isfinite(loss):
                return _diverged(out_dir, meta, step, t0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if setup.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), setup.grad_clip)
            opt.step()
            sched.step()
            running += loss.item()
            count += 1
            if step % every == 0:
                losses.append(running / count)
                running, count = 0.0, 0
                if not all(torch.isfinite(p).all() for p in model.parameters()):
                    return _diverged(out_dir, meta, step, t0)
                snapshot(step // every, step)
                if progress is not None:
                    progress(step, steps)
    finally:
        probe.remove()

    samples = recorder.buffers[:, :n_snap].transpose(0, 1).contiguous()       # (N_snap, L, S)
    mask = torch.stack([recorder.mask_of(i) for i in range(len(blocks))]).to(torch.uint8)
    snap_steps = torch.arange(n_snap, dtype=torch.int64) * every
    tmp_w = out_dir / (WEIGHTS_FILE + ".tmp")
    save_file({"samples": samples, "mask": mask, "steps": snap_steps}, str(tmp_w))
    tmp_w.replace(out_dir / WEIGHTS_FILE)
    acts = {f"act.{i}": torch.stack(rows).contiguous() for i, rows in enumerate(probe.rows)}
    acts.update({f"pos.{i}": p.to(torch.int64).contiguous() for i, p in enumerate(probe.positions)})
    acts["act_steps"] = torch.tensor(act_steps, dtype=torch.int64)
    tmp_a = out_dir / (ACTIVATIONS_FILE + ".tmp")
    save_file(acts, str(tmp_a))
    tmp_a.replace(out_dir / ACTIVATIONS_FILE)
    meta.update(status="complete", act_dims_full=probe.full_dims, losses=losses,
                test_accuracy=_accuracy(setup, model), wall_seconds=round(time.perf_counter() - t0, 2),
                versions=_versions())
    write_json_atomic(out_dir / META_FILE, meta)
    return meta


def _diverged(out_dir: Path, meta: dict[str, Any], step: int, t0: float) -> dict[str, Any]:
    meta.update(status="diverged", diverged_at_step=step, wall_seconds=round(time.perf_counter() - t0, 2),
                versions=_versions())
    write_json_atomic(out_dir / META_FILE, meta)
    return meta


def collect(out: str | Path, recipes: list[str] | None = None, seeds: list[int] = (0, 1),
            lrs: list[float] | None = None, quick: bool = False,
            on_run: Callable[[str, str, dict[str, Any] | None], None] | None = None) -> list[dict[str, Any]]:
    """Record every (recipe, seed, learning rate) run into ``out``, skipping finished ones.

    Args:
        out: The runs folder.
        recipes: Recipe names (None: all).
        seeds: Seeds (model init and data order).
        lrs: Learning rates overriding each recipe's own pair (None: the recipe's).
        quick: Shrink every recipe to a few seconds (tests, CI).
        on_run: Called as ``on_run(run_name, "skipped" | "complete" | "diverged", meta)``.

    Returns:
        The meta of every run (recorded now or earlier), in order.
    """
    from .runs import read_meta

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    metas = []
    for r in get_recipes(list(recipes) if recipes else None):
        for seed in seeds:
            for lr in (lrs or r.lrs):
                name = run_name(r.name, seed, lr)
                run_dir = out / name
                if is_finished(run_dir):
                    meta = read_meta(run_dir)
                    metas.append(meta)
                    if on_run:
                        on_run(name, "skipped", meta)
                    continue
                setup = r.build(seed, quick, out)
                info = {"recipe": r.name, "arch": r.arch, "dataset": r.dataset, "mode": r.mode, "quick": quick}
                meta = record_run(setup, run_dir, lr=lr, seed=seed, info=info)
                metas.append(meta)
                if on_run:
                    on_run(name, meta["status"], meta)
    return metas
