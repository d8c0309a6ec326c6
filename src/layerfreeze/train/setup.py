"""What a training run is built from: seed, device, optimizer, LR schedule, batches, hold-out split, strategy.

The optimizer has one param group per block; each epoch's batches come from a fixed permutation (so a resumed run
replays them); the hold-out split is the stability guard's validation set; the strategy is checked against the
model's blocks before anything trains.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from layerfreeze.engine.optim import block_param_groups
from layerfreeze.errors import ConfigError
from layerfreeze.models.blocks import Block
from layerfreeze.strategies import Strategy, UnknownStrategyError, create_strategy
from layerfreeze.train.config import Config
from layerfreeze.train.loop import lr_lambda, warmup_steps


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"run.device is {name!r} but CUDA is not available on this machine; use cpu or auto")
    return torch.device(name)


def no_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Biases and normalisation weights (1-D tensors) get no weight decay (the usual BERT/ResNet practice)."""
    return param.ndim <= 1


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches of one epoch: a permutation of ``range(n)`` from ``seed + epoch``, cut into batches.

    Deterministic, so a resumed run replays exactly the batches the interrupted one had left.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    return [perm[i : i + batch_size] for i in range(0, n, batch_size)]


def sample_keys(dataset: Dataset) -> list[int]:
    """The ``"index"`` each position of ``dataset`` carries: its position in the underlying dataset (through
    ``Subset`` objects, which the hold-out split and the data limits make), which is what the task datasets put in
    ``item["index"]`` and what the activation cache keys entries by."""
    if isinstance(dataset, Subset):
        inner = sample_keys(dataset.dataset)
        return [inner[i] for i in dataset.indices]
    return list(range(len(dataset)))  # type: ignore[arg-type]


class VisitPlan:
    """When the run visits each sample: the steps :func:`epoch_batches` gives, for the activation cache's policy
    (:class:`~layerfreeze.compute.cache.CachePolicy`: is an entry read again, and when).

    Args:
        keys: Per dataset position, the sample's cache key (:func:`sample_keys`).
        batch_size / seed / epochs: The run's (``train``).
        total_steps: The run's last step (``max_steps`` cuts the last epochs short).

    Steps are 1-based, as the trainer counts them: epoch ``e``'s batch ``b`` is step ``e * steps_per_epoch + b + 1``.
    """

    def __init__(self, keys: list[int], batch_size: int, seed: int, epochs: int, total_steps: int) -> None:
        self.keys = list(keys)
        self.batch_size, self.seed, self.epochs, self.total_steps = batch_size, seed, epochs, total_steps
        self.steps_per_epoch = math.ceil(len(self.keys) / batch_size)
        self._epochs: dict[int, dict[int, int]] = {}

    def _visits(self, epoch: int) -> dict[int, int]:
        """``{key: step}`` of one epoch (the two latest epochs asked for are kept)."""
        if epoch not in self._epochs:
            steps: dict[int, int] = {}
            for b, batch in enumerate(epoch_batches(len(self.keys), self.batch_size, self.seed, epoch)):
                step = epoch * self.steps_per_epoch + b + 1
                if step > self.total_steps:
                    break
                for pos in batch:
                    steps[self.keys[pos]] = step
            for old in [e for e in self._epochs if e < epoch - 1]:
                del self._epochs[old]
            self._epochs[epoch] = steps
        return self._epochs[epoch]

    def next_visit(self, key: int, now: int) -> int | None:
        """The step of sample ``key``'s first visit after step ``now``, or None when the run does not visit it again."""
        epoch = max(0, (now - 1) // self.steps_per_epoch)
        for e in (epoch, epoch + 1):
            if e >= self.epochs:
                return None
            step = self._visits(e).get(int(key))
            if step is not None and step > now:
                return step
        return None


def holdout(dataset: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """Split ``dataset`` into (train, validation) with a fixed permutation from ``seed``; validation gets
    ``ceil(fraction * n)`` samples (at least 1). Raises ValueError when nothing would be left to train on."""
    n = len(dataset)
    n_val = max(1, math.ceil(fraction * n))
    if n_val >= n:
        raise ConfigError(f"freeze.guard.val_fraction {fraction} leaves no training data ({n} samples)")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return Subset(dataset, sorted(perm[n_val:])), Subset(dataset, sorted(perm[:n_val]))


def build_strategy(config: Config, num_blocks: int | None = None) -> Strategy:
    """The config's strategy, built once per run (a SmartFRZ predictor file is read here), its parameter values
    checked, and with ``num_blocks`` checked against the model (``static``'s k must leave the head trainable, ...).

    Raises:
        ConfigError: an unknown strategy or parameter (``freeze.strategy: ...``), or a parameter value out of range
            or not fitting the model (``freeze.params: ...``); the message says what to change.
    """
    try:
        return create_strategy(config.freeze.strategy, config.freeze.params, num_blocks=num_blocks)
    except UnknownStrategyError as exc:
        raise ConfigError(f"freeze.strategy: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"freeze.params: {exc}") from None


def check_strategy_fits(strategy: Strategy, num_blocks: int) -> None:
    """Check a strategy built by :func:`build_strategy` without ``num_blocks`` against the model's block count.

    Raises:
        ConfigError: a parameter that does not fit the model (``freeze.params: ...``, e.g. ``static``'s k leaving no
            trainable head); the message says what to change.
    """
    try:
        strategy.validate(num_blocks)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"freeze.params: {exc}") from None


def build_optimizer(config: Config, model: nn.Module, blocks: list[Block]) -> torch.optim.Optimizer:
    """``train.optimizer`` (AdamW or SGD) over one param group per block (:func:`block_param_groups`: LR decayed
    by ``train.lr_decay`` per block from the head down, no weight decay for biases and norms)."""
    train = config.train
    groups = block_param_groups(model, blocks, train.lr, train.weight_decay, train.lr_decay,
                                no_decay=no_weight_decay)
    for group in groups:  # weights frozen before training (LoRA's base model) never enter the optimizer
        group["params"] = [p for p in group["params"] if p.requires_grad]
    if train.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=train.lr, weight_decay=train.weight_decay)
    return torch.optim.SGD(groups, lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)


def build_scheduler(config: Config, optimizer: torch.optim.Optimizer,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule of ``train``: warm-up over ``warmup_fraction`` of ``total_steps``, then ``schedule``."""
    warmup = warmup_steps(total_steps, config.train.warmup_fraction, "floor")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, warmup, config.train.schedule))
