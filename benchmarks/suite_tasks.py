"""The suite's three tasks (``bbc``, ``fmnist-mobilenet``, ``fmnist-resnet``): each one's model, optimisation, LoRA
row and sizes, and the config every row of a task shares.

:mod:`benchmarks.suite` runs them; the scripts that measure something else on the same jobs (``lr_grid``,
``adaptivity``, ``oracle_replay``, ``smartfrz_threshold``, ``precision_compile``, ``memory_table``,
``demote_accuracy``, ``same_records``, ``lightning_finetuning``) build their runs from here, so they train what the
suite trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

# ----------------------------------------------------------------------------------------------------------------
# Sizes: what sets the suite's run time. Target: the whole suite, 3 tasks x every row x 3 seeds, under an hour on
# the 2-core CPU machine. Measured full-training step times (no freezing, 2 threads): MiniLM-L6 at 32 tokens and
# batch 16 0.38 s (64 tokens, batch 32: 1.12 s); MobileNetV2 at 32x32, batch 128: 0.27 s; ResNet-18 at 32x32,
# batch 128: 0.28 s. The sizes give `none` ~40 s of training per task and seed (104, 150, 144 steps), so that the
# ten rows (time ratios summing to ~7.5) plus loading and evaluation fit ~6.5 min per task and seed.
# None: all the data (limits) / not used (max_length of an image task). Limits take a seeded random subset.
# ----------------------------------------------------------------------------------------------------------------
SIZE_FIELDS = ("epochs", "limit_train", "limit_test", "max_length", "batch_size", "max_steps")
SIZES: dict[str, tuple[int | None, ...]] = {
    #                    epochs  limit_train  limit_test  max_length  batch_size  max_steps
    "bbc":              (2,      832,         None,       32,         16,         None),
    "fmnist-mobilenet": (2,      9600,        2000,       None,       128,        None),
    "fmnist-resnet":    (3,      6144,        2000,       None,       128,        None),
}
#: ``--quick``: enough steps for every stage to run once or twice, not a measurement (BBC: the 8 steps' 128
#: articles and 64 to test, where it tokenized and evaluated all 1,780 and 445).
QUICK_SIZES: dict[str, tuple[int | None, ...]] = {
    #                    epochs  limit_train  limit_test  max_length  batch_size  max_steps
    "bbc":              (1,      128,         64,         32,         16,         8),
    "fmnist-mobilenet": (1,      256,         128,        None,       64,         None),
    "fmnist-resnet":    (1,      256,         128,        None,       64,         None),
}


@dataclass(frozen=True)
class TaskSpec:
    """One task of the suite: model, optimisation, the LoRA row's settings, and its sizes (from SIZES)."""

    title: str
    task: str
    model: str | None
    pretrained: bool
    optimizer: str
    lr: float
    weight_decay: float
    static_k: int
    lora_lr: float | None  # None: no LoRA row for this task (see lora_note)
    lora_note: str = ""
    epochs: int = 1
    limit_train: int | None = None
    limit_test: int | None = None
    max_length: int | None = None
    batch_size: int = 32
    max_steps: int | None = None


#: The tasks. Learning rates: MiniLM's full fine-tuning rate is the task's usual 5e-5; ResNet-18 from scratch:
#: AdamW 1e-3 reached 83.4% after 48 steps where SGD 0.05 (momentum 0.9) reached 78.2%; LoRA on MobileNetV2: 3e-3
#: reached 80.3% after 48 steps, 1e-3 71.0%, 1e-2 80.9% with an unstable first epoch (3,072 samples, 2 epochs).
TASKS: dict[str, TaskSpec] = {
    "bbc": TaskSpec(
        "MiniLM-L6 fine-tuned on BBC News", "bbc-news", None, True, "adamw", 5e-5, 0.01, static_k=5,
        lora_lr=1e-3, lora_note="LoRA rank 8 on query/value, classifier trained, AdamW 1e-3 (LoRA wants a larger "
        "learning rate than full fine-tuning)"),
    "fmnist-mobilenet": TaskSpec(
        "MobileNetV2 (ImageNet weights) fine-tuned on Fashion-MNIST", "fashion-mnist", "mobilenet_v2", True, "adamw",
        1e-3, 1e-4, static_k=10, lora_lr=3e-3,
        lora_note="LoRA rank 8 on every convolution with groups=1 (the stem, the 1x1 expand/project convs and the "
        "last 1x1 conv; depthwise convs have no low-rank form), classifier trained, AdamW 3e-3"),
    "fmnist-resnet": TaskSpec(
        "ResNet-18 trained from scratch on Fashion-MNIST", "fashion-mnist", "resnet18", False, "adamw", 1e-3, 5e-4,
        static_k=3, lora_lr=None,
        lora_note="no LoRA row: LoRA adapts a pretrained network; on a randomly initialised ResNet its frozen base "
        "weights are random features, so the row would only measure that"),
}


def task_spec(key: str, quick: bool) -> TaskSpec:
    """The task's spec with its sizes from SIZES (QUICK_SIZES with ``quick``)."""
    sizes = (QUICK_SIZES if quick else SIZES)[key]
    return replace(TASKS[key], **dict(zip(SIZE_FIELDS, sizes)))


# ----------------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------------
def dataset_sizes(spec: TaskSpec) -> tuple[int, int]:
    """(train, test) samples the task's runs use (the BBC split is the task's fixed stratified 80/20 one)."""
    from layerfreeze.train import data

    if spec.task == "bbc-news":
        _, labels, _ = data.load_bbc_news()
        train, test = (len(s) for s in data.stratified_split(labels, 0.2, 0))
    else:
        train, test = 60_000, 10_000  # Fashion-MNIST
    return (min(train, spec.limit_train or train), min(test, spec.limit_test or test))


def total_steps(spec: TaskSpec, n_train: int) -> int:
    steps = math.ceil(n_train / spec.batch_size) * spec.epochs
    return min(steps, spec.max_steps) if spec.max_steps else steps


def base_config(spec: TaskSpec, seed: int, threads: int | None) -> dict[str, Any]:
    """The config every row of one task and seed shares (rows add their strategy and run folder).

    The trainer's stop for a loss at chance level is off: a strategy that learns nothing on a task (``gradual``,
    ULMFiT's one block per epoch, on a 2-epoch run) is a measured row of the suite, not an error that ends it."""
    model: dict[str, Any] = {"pretrained": spec.pretrained}
    if spec.model:
        model["name_or_path"] = spec.model
    if spec.max_length:
        model["max_length"] = spec.max_length
    train = {"epochs": spec.epochs, "batch_size": spec.batch_size, "optimizer": spec.optimizer, "lr": spec.lr,
             "weight_decay": spec.weight_decay, "seed": seed}
    if spec.max_steps:
        train["max_steps"] = spec.max_steps
    return {
        "task": spec.task, "model": model, "train": train,
        "data": {"limit_train": spec.limit_train, "limit_test": spec.limit_test},
        "run": {"progress": False, "checkpoint": False, "tensorboard": False, "threads": threads,
                "divergence_window_steps": None},
    }


def row_settings(spec: TaskSpec, steps: int) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(row_params, row_overrides) for compare: static's k; Egeria evaluates about 8 times per run (AutoFreeze 10
    times, its own default as in its public code); the LoRA row's learning rate."""
    interval = max(1, round(steps / 8))
    params = {"static": {"k": spec.static_k}, "egeria": {"interval": interval}}
    overrides: dict[str, dict[str, Any]] = {}
    if spec.lora_lr is not None:
        overrides["lora"] = {"train": {"lr": spec.lora_lr}}  # targets: the per-model default (tasks.py)
    return params, overrides
