"""A model's loss and task metric on a dataset: in one process, or sharded over the ranks and all-reduced; and the
trainer's evaluation of its model (:func:`evaluate_trainer`)."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from layerfreeze.distributed import comm as dist_
from layerfreeze.distributed.fsdp import fsdp_modules, reshard_all
from layerfreeze.train.ranks import sync_buffers
from layerfreeze.train.tasks import Task

if TYPE_CHECKING:
    from layerfreeze.train.trainer import Trainer


@torch.no_grad()
def evaluate_sums(task: Task, model: nn.Module, device: torch.device, batch_size: int,
                  dataset: Dataset | None = None) -> tuple[float, float, int]:
    """``(summed loss, summed metric, count)`` on ``dataset`` (default: the task's test set), from
    ``task.objective.sums`` (classification: correct predictions over samples; LM: token losses over tokens).

    Leaves the model in eval mode; the training loop switches it back.
    """
    model.eval()
    loader = DataLoader(task.test_set if dataset is None else dataset, batch_size=batch_size, shuffle=False,
                        generator=torch.Generator())  # own generator: keep the global RNG untouched
    total_loss, total_metric, count = 0.0, 0.0, 0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        loss_sum, metric_sum, n = task.objective.sums(task.forward(model, batch), batch)
        total_loss, total_metric, count = total_loss + loss_sum, total_metric + metric_sum, count + n
    return total_loss, total_metric, count


def evaluate(task: Task, model: nn.Module, device: torch.device, batch_size: int,
             dataset: Dataset | None = None) -> tuple[float, float]:
    """Mean loss and the task's metric on ``dataset`` (default: the task's test set): accuracy (fraction in [0, 1])
    for a classifier, perplexity for a language model (``task.objective.metric`` names it).

    Leaves the model in eval mode; the training loop switches it back.
    """
    return task.objective.finish(*evaluate_sums(task, model, device, batch_size, dataset))


def evaluate_sharded(task: Task, model: nn.Module, device: torch.device, batch_size: int, dataset: Dataset | None,
                     rank: int, world: int, same_batches: bool = False) -> tuple[float, float]:
    """:func:`evaluate` of a distributed run: each rank takes every world-th sample and the sums are all-reduced,
    so every rank gets the whole set's loss and metric.

    Args:
        same_batches: Every rank runs as many forward passes as the rank with the most samples (a sharded model,
            FSDP2: each forward is a collective). A rank with fewer batches runs the missing ones on the set's first
            sample and drops their output.
    """
    dataset = task.test_set if dataset is None else dataset
    part = Subset(dataset, range(rank, len(dataset), world))
    sums = evaluate_sums(task, model, device, batch_size, part) if len(part) else (0.0, 0.0, 0)
    if same_batches and len(dataset):
        most = math.ceil(math.ceil(len(dataset) / world) / batch_size)
        filler = {k: v.to(device, non_blocking=True) for k, v in default_collate([dataset[0]]).items()}
        model.eval()
        with torch.no_grad():
            for _ in range(most - math.ceil(len(part) / batch_size)):
                task.forward(model, filler)
    return task.objective.finish(*dist_.all_reduce_sum(list(sums)))


def evaluate_trainer(trainer: Trainer, dataset: Dataset | None = None) -> tuple[float, float]:
    """:func:`evaluate` of a :class:`~layerfreeze.train.trainer.Trainer`'s model on ``dataset`` (default: the test
    set); distributed, sharded over the ranks (:func:`evaluate_sharded`)."""
    precision = trainer.precision
    forward = trainer.task.forward
    # the forward as training runs it (train.precision): its autocast, its input dtype
    task = dataclasses.replace(trainer.task, forward=lambda m, b: forward(m, precision.convert_input(b)))
    with precision.autocast():
        return _evaluate_trainer(trainer, task, dataset)


def _evaluate_trainer(trainer: Trainer, task: Task, dataset: Dataset | None) -> tuple[float, float]:
    bs = trainer.config.train.eval_batch_size
    if not trainer.distributed:
        return evaluate(task, trainer.model, trainer.device, bs, dataset)
    if trainer.fsdp:
        sync_buffers(trainer)  # every rank evaluates the model the checkpoint holds
    result = evaluate_sharded(task, trainer.model, trainer.device, bs, dataset, trainer.rank, trainer.world,
                              same_batches=trainer.fsdp)
    if trainer.fsdp:  # the root group keeps its gathered parameters after a forward without backward
        reshard_all(fsdp_modules(trainer.model))
    return result
