"""Egeria's measurement: a block's plasticity, the SP loss between its output in the training weights and in a
reference model on a fixed probe batch, and the rule that calls it stable.

Source: Wang et al., "Egeria: Efficient DNN Training with Knowledge-Guided Layer Freezing", EuroSys 2023
(sec. 3: training plasticity from a reference model's semantic knowledge). The SP loss is the
similarity-preserving loss of Tung & Mori, "Similarity-Preserving Knowledge Distillation", ICCV 2019 (eq. 1-4).
The functions here are pure (tensors in, floats out) except :func:`evaluate`, the background worker's job, which
runs two forwards and may build a new reference (:mod:`~layerfreeze.strategies.egeria.reference`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_map_only

from layerfreeze.models.probe import probe_outputs
from layerfreeze.strategies.egeria.reference import build_reference

#: Smallest denominator of the relative change, so a plasticity of exactly 0 does not divide by zero.
EPS = 1e-12


def _similarity(a: torch.Tensor) -> torch.Tensor:
    """Row-normalised Gram matrix of ``a`` flattened to ``(B, -1)``, in float64 on the CPU."""
    flat = a.detach().reshape(a.shape[0], -1).to("cpu", torch.float64)
    return F.normalize(flat @ flat.T, p=2, dim=1)


def sp_loss(a: torch.Tensor, b: torch.Tensor) -> float:
    """Similarity-preserving (SP) loss between two activations of the same ``B`` samples (Tung & Mori 2019).

    ``G = normalize_rows(A A^T)`` with ``A`` the activations flattened to ``(B, -1)``, and
    ``SP = ||G_a - G_b||_F^2 / B^2``. Only the ``B x B`` sample similarities are compared, so the trailing shapes
    of ``a`` and ``b`` may differ, and scaling either input by a constant does not change the result.

    Args:
        a: Activations ``(B, ...)``, ``B >= 1``.
        b: Activations ``(B, ...)`` of the same samples.

    Returns:
        The loss, a float in ``[0, 4]`` (0 when the two similarity structures are equal).

    Raises:
        ValueError: an input has no batch dimension, or the batch sizes differ.
    """
    if a.dim() == 0 or b.dim() == 0 or a.shape[0] == 0:
        raise ValueError(f"sp_loss needs activations of shape (B, ...) with B >= 1, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"sp_loss needs the same samples on both sides: batch {a.shape[0]} != {b.shape[0]}")
    diff = _similarity(a) - _similarity(b)
    return float((diff * diff).sum()) / a.shape[0] ** 2


def relative_change(previous: float, current: float, eps: float = EPS) -> float:
    """``|current - previous| / max(|previous|, eps)`` (NaN if either value is NaN)."""
    return abs(current - previous) / max(abs(previous), eps)


def advance_count(count: int, previous: float | None, current: float, tolerance: float) -> tuple[float, int]:
    """One step of the freezing rule: the relative change and the new count of consecutive stable evaluations.

    With no ``previous`` value (first measurement against a reference without baseline) the change is NaN and
    the count is kept. Otherwise the count grows by one when the change is below ``tolerance`` and restarts at 0
    when it is not (a NaN change, from a NaN plasticity, restarts it too).
    """
    if previous is None:
        return math.nan, count
    change = relative_change(previous, current)
    return change, (count + 1 if change < tolerance else 0)


def plasticity_decision(history: Sequence[float], tolerance: float, patience: int) -> bool:
    """Whether a block with this plasticity series (one reference, oldest first) may be frozen now.

    True when each of the last ``patience`` relative changes between consecutive values is below ``tolerance``
    (so at least ``patience + 1`` values are needed).
    """
    count, previous = 0, None
    for value in history:
        _, count = advance_count(count, previous, float(value), tolerance)
        previous = float(value)
    return count >= patience


def block_outputs(model: nn.Module, names: dict[int, str], probe: tuple[Any, Any]) -> dict[int, torch.Tensor]:
    """Run ``model`` on the probe batch and return the output of each named module, by block index
    (:func:`~layerfreeze.models.probe.probe_outputs`)."""
    # the CPU copies of the probe batch are float32
    args, kwargs = tree_map_only(torch.Tensor, lambda t: t.float() if t.is_floating_point() else t, probe)
    modules = {index: model.get_submodule(name) for index, name in names.items()}
    return probe_outputs(model, modules, lambda m: m(*args, **kwargs))


@dataclass
class Evaluation:
    step: int
    plasticity: list[float | None]
    reference: nn.Module | None = None
    report: dict[str, Any] | None = None
    baseline: list[float | None] | None = None


def evaluate(step: int, shadow: nn.Module, reference: nn.Module, probe: tuple[Any, Any], names: dict[int, str],
              num_blocks: int, refresh: bool, quantization: str) -> Evaluation:
    """The worker's job: plasticity of the named blocks, then (if ``refresh``) a new reference and baselines.

    Reads only its arguments (the shadow is not written by the training thread while an evaluation runs), so it
    is safe to run in the background.
    """
    with torch.no_grad():
        trained = block_outputs(shadow, names, probe)
        result = Evaluation(step, plasticity_per_block(trained, block_outputs(reference, names, probe), num_blocks))
        if refresh:
            result.reference, result.report = build_reference(shadow, quantization)
            result.baseline = plasticity_per_block(trained, block_outputs(result.reference, names, probe), num_blocks)
    return result


def plasticity_per_block(trained: dict[int, torch.Tensor], reference: dict[int, torch.Tensor],
                num_blocks: int) -> list[float | None]:
    """Per block index, :func:`sp_loss` between its output in the training weights and in a reference (None for
    a block missing from either)."""
    values: list[float | None] = [None] * num_blocks
    for i, out in trained.items():
        if i in reference:
            values[i] = sp_loss(out, reference[i])
    return values
