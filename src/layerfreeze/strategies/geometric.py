"""``geometric``: progressive freezing on a geometric schedule (PipeTransformer's freeze algorithm).

Source: He, Li, Soltanolkotabi, Avestimehr, "PipeTransformer: Automated Elastic Pipelining for Distributed Training
of Large-scale Models", ICML 2021, sec. 3.1 (freeze algorithm): after each epoch the number of frozen layers moves
a fraction ``alpha`` of the way towards all layers, ``L_T = L_{T-1} + alpha * (L - L_{T-1})`` with ``L_0 = 0``,
i.e. ``L_T = L * (1 - (1 - alpha) ** T)``. In the paper this geometric sequence is combined with a gradient-based
criterion; this strategy implements the geometric schedule alone, as the project's design specifies. The count is
rounded up, as in the authors' code (github.com/Distributed-AI/PipeTransformer, ``pipe_transformer/freeze/
auto_freeze.py``: ``math.ceil(calculate_frozen_layer_num(num_layer, alpha, e))``, applied from epoch ``e``, that is
after ``e`` epochs).
"""

from __future__ import annotations

import math
from typing import Any

from layerfreeze.strategies.base import PrefixSchedule, StageContext, is_number
from layerfreeze.strategies.registry import register_strategy

#: Taken off before rounding up, so float rounding does not add a block to an exact integer count
#: (9 * (1 - (1 - 1/3) ** 2) is exactly 5 but may come out as 5.000000000000001 in floats).
_EPS = 1e-9


def geometric_frozen(count: int, alpha: float, epochs_done: int) -> float:
    """``count * (1 - (1 - alpha) ** epochs_done)``: the real-valued number of frozen blocks after that many epochs."""
    return count * (1.0 - (1.0 - alpha) ** epochs_done)


@register_strategy("geometric")
class GeometricFreezing(PrefixSchedule):
    """Freezes a prefix of blocks that grows geometrically towards every non-head block, once per epoch.

    Rule, at the end of epoch ``T`` (``T = ctx.epoch + 1`` epochs completed):

    * ``L`` = number of blocks before the last one (``len(blocks) - 1``), i.e. every block but the head: the paper
      freezes the Transformer's layers and never its task head, and freezing the head would stop all learning.
      The authors' code counts the encoder layers alone (``num_layer = 12``) and freezes the embeddings with them;
      ``L`` here counts the embeddings and a pooler (BERT's) too, so the prefix may differ by one block in an
      epoch, and ``frozen = L`` freezes a pooler as well;
    * ``frozen(T) = L * (1 - (1 - alpha) ** T)`` (the closed form of ``L_T = L_{T-1} + alpha * (L - L_{T-1})``,
      ``L_0 = 0``), rounded up to an int as the authors' code does (after taking 1e-9 off, against float rounding)
      and capped at ``L``;
    * freeze blocks ``0..frozen(T)-1`` that are not frozen yet. Blocks are never thawed.

    With ``alpha = 1/3`` and ``L = 7``: after epochs 1, 2, 3, 4, 5 the prefix is 3, 4, 5, 6, 7 blocks long (exact
    values 2.33, 3.89, 4.93, 5.62, 6.08), so from epoch 5 on only the head trains; ``alpha = 1`` freezes all ``L``
    after epoch 1. Any ``alpha`` freezes all ``L`` once ``L * (1 - alpha) ** T < 1``.
    Nothing happens at the start stage or between epochs.

    Telemetry signals: ``epochs_done``, ``frozen_real`` (the value before rounding), ``target_frozen`` and ``count``.

    Args:
        alpha: Fraction of the remaining trainable blocks frozen per epoch, in ``(0, 1]`` (default 1/3).

    Raises:
        ValueError: ``alpha`` outside ``(0, 1]``.
    """

    def __init__(self, alpha: float = 1 / 3) -> None:
        super().__init__()
        if not is_number(alpha) \
                or not 0.0 < alpha <= 1.0:
            raise ValueError(f"geometric: alpha must be a number in (0, 1] (fraction of the remaining blocks frozen "
                             f"per epoch; PipeTransformer uses 1/3), got {alpha!r}")
        self.alpha = float(alpha)

    def target_frozen(self, count: int, epochs_done: int) -> int:
        """Number of leading blocks frozen after ``epochs_done`` epochs with ``count`` freezable (non-head) blocks."""
        return min(count, math.ceil(geometric_frozen(count, self.alpha, epochs_done) - _EPS))

    def schedule(self, ctx: StageContext, count: int) -> tuple[int, dict[str, Any], str]:
        epochs_done = ctx.epoch + 1
        real = geometric_frozen(count, self.alpha, epochs_done)
        target = self.target_frozen(count, epochs_done)
        signals = {"epochs_done": epochs_done, "frozen_real": real, "target_frozen": target, "count": count}
        reason = f"geometric: after epoch {epochs_done}, {real:.3f} of {count} blocks -> first {target} frozen"
        return target, signals, reason

    def state_dict(self) -> dict[str, Any]:
        return {"target": self.target, "alpha": self.alpha}

    def __repr__(self) -> str:
        return f"GeometricFreezing(alpha={self.alpha})"
