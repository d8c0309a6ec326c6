"""``geometric``: progressive freezing on a geometric schedule (PipeTransformer's freeze algorithm).

Source: He, Li, Soltanolkotabi, Avestimehr, "PipeTransformer: Automated Elastic Pipelining for Distributed Training
of Large-scale Models", ICML 2021, sec. 3.1 (freeze algorithm): after each epoch the number of frozen layers moves
a fraction ``alpha`` of the way towards all layers, ``L_T = L_{T-1} + alpha * (L - L_{T-1})`` with ``L_0 = 0``,
i.e. ``L_T = L * (1 - (1 - alpha) ** T)``. In the paper this geometric sequence is combined with a gradient-based
criterion; this strategy implements the geometric schedule alone, as the project's design specifies.
"""

from __future__ import annotations

import math
from typing import Any

from layerfreeze.strategies.base import PrefixSchedule, StageContext, is_number
from layerfreeze.strategies.registry import register_strategy

#: Added before flooring, so float rounding does not drop a block whose exact count is an integer
#: (9 * (1 - (1 - 1/3)) is 2.9999999999999996 in floats, but exactly 3).
_EPS = 1e-9


def geometric_frozen(count: int, alpha: float, epochs_done: int) -> float:
    """``count * (1 - (1 - alpha) ** epochs_done)``: the real-valued number of frozen blocks after that many epochs."""
    return count * (1.0 - (1.0 - alpha) ** epochs_done)


@register_strategy("geometric")
class GeometricFreezing(PrefixSchedule):
    """Freezes a prefix of blocks that grows geometrically towards every non-head block, once per epoch.

    Rule, at the end of epoch ``T`` (``T = ctx.epoch + 1`` epochs completed):

    * ``L`` = number of blocks before the last one (``len(blocks) - 1``), i.e. every block but the head: the paper
      freezes the Transformer's layers and never its task head, and freezing the head would stop all learning;
    * ``frozen(T) = L * (1 - (1 - alpha) ** T)`` (the closed form of ``L_T = L_{T-1} + alpha * (L - L_{T-1})``,
      ``L_0 = 0``), floored to an int (after adding 1e-9 against float rounding) and capped at ``L``;
    * freeze blocks ``0..frozen(T)-1`` that are not frozen yet. Blocks are never thawed.

    With ``alpha = 1/3`` and ``L = 7``: after epochs 1, 2, 3, 4, 5 the prefix is 2, 3, 4, 5, 6 blocks long and stays
    at 6 (``frozen(T) < L`` for every ``T`` when ``alpha < 1``; ``alpha = 1`` freezes all ``L`` after epoch 1).
    Nothing happens at the start stage or between epochs.

    Telemetry signals: ``epochs_done``, ``frozen_real`` (the unfloored value), ``target_frozen`` and ``count``.

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
        return min(count, math.floor(geometric_frozen(count, self.alpha, epochs_done) + _EPS))

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
