"""What one collection run needs (:class:`Setup`): the network, the data, the fixed probe batch, the loss and the
optimizer settings. A recipe (:mod:`layerfreeze.smartfrz.recipes`) builds one from a seed; the collector
(:func:`~layerfreeze.smartfrz.collect.record_run`) and the counterfactual runs train from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

#: Weight snapshots per run: the online strategy's default ``snapshot_every`` is ``round(total_steps / 150)``.
TARGET_SNAPSHOTS = 150
#: LR schedules a Setup may ask for, after its linear warm-up (:func:`~layerfreeze.train.loop.lr_lambda` computes them).
SCHEDULES = ("cosine", "linear", "constant")


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def call_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``model(batch["x"])``: the forward of the image and tabular recipes."""
    return model(batch["x"])


@dataclass
class Setup:
    """Everything one run needs. Tensors are in memory; a batch is ``{key: tensor[idx]}`` over ``train_x``.

    Attributes:
        model: The network (initialised by the recipe from the run's seed).
        train_x / train_y: Training inputs ``{key: (N, ...)}`` and labels: class indices ``(N,)`` for a
            classifier, or ``(N, T)`` for a causal LM (``train_y[n, t]`` is the token after input token ``t``
            of chunk ``n``: the next-token shift is in the data, so ``forward``'s logits ``(N, T, V)`` line up
            with it position by position).
        probe_x: The fixed probe batch ``{key: (P, ...)}`` (same for every seed of a recipe).
        test_x / test_y: A fixed test subset for the final accuracy (optional); ``test_y`` shaped like
            ``train_y``.
        forward: ``(model, batch dict) -> logits``: ``(B, C)``, or ``(B, T, V)`` per token for a causal LM (the
            prediction is ``argmax`` over the last dim, compared element-wise with the labels).
        loss_fn: ``(logits, labels) -> scalar loss``, the mean over the batch's labels (:func:`evaluate_test`
            weights each batch by its number of labels).
        steps: Optimizer steps (rounded up to a multiple of ``snapshot_every``).
        batch_size: Samples per step.
        optimizer: ``"sgd"`` (with ``momentum``, Nesterov off) or ``"adamw"``.
        weight_decay / momentum / grad_clip: Optimizer settings (``grad_clip`` is a max global norm or None).
        schedule: ``"cosine"`` or ``"linear"`` decay to zero after a ``warmup`` fraction of linear warm-up, or
            ``"constant"``: the base LR from the end of the warm-up to the last step (no decay; see
            :func:`~layerfreeze.train.loop.lr_lambda`). A run without decay ends with the optimizer's noise still in the
            weights, which is what many fine-tunes and SGD runs do, and what a freezing policy meets there.
        snapshot_every: Steps between weight snapshots; None: ``max(1, round(steps / 150))``.
        act_every: Every how many snapshots the probe activations are recorded.
        blocks: Module-name patterns for :func:`~layerfreeze.models.discovery.discover_blocks` (None: discovered).
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
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {self.schedule!r}")
        if self.snapshot_every is None:
            self.snapshot_every = max(1, round(self.steps / TARGET_SNAPSHOTS))
        self.steps = math.ceil(self.steps / self.snapshot_every) * self.snapshot_every
        if self.act_every < 1:
            raise ValueError(f"act_every must be >= 1, got {self.act_every}")


def make_optimizer(setup: Setup, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if setup.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=setup.momentum, weight_decay=setup.weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=setup.weight_decay)
