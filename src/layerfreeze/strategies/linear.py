"""``linear``: progressive freezing on a linear schedule (MosaicML Composer's ``LayerFreezing``).

Source: MosaicML Composer, ``composer/algorithms/layer_freezing/layer_freezing.py``: ``LayerFreezing`` runs on
``Event.EPOCH_END`` and calls ``freeze_layers``, whose ``_freeze_schedule`` returns 0 while
``current_duration <= freeze_start`` and ``freeze_level * (current_duration - freeze_start) / (1 - freeze_start)``
after it; the number of layers frozen is ``int(fraction * len(layers[0:-1]))`` (every layer but the last), frozen
front to back. Composer attributes the idea to FreezeOut (Brock et al. 2017) and SVCCA's freeze training (Raghu et
al. 2017).
"""

from __future__ import annotations

import math
from typing import Any

from layerfreeze.strategies.base import PrefixSchedule, StageContext, is_number
from layerfreeze.strategies.registry import register_strategy

#: Added before truncating to an int, so float rounding does not drop a block whose exact count is an integer
#: (e.g. 0.6 - 0.5 = 0.09999999999999998 in floats, which would give int(1.9999999999999996) = 1 instead of 2).
_EPS = 1e-9


def linear_freeze_fraction(t: float, freeze_start: float, freeze_level: float) -> float:
    """Composer's ``_freeze_schedule``: the fraction of blocks frozen when a fraction ``t`` of training is done."""
    if t <= freeze_start:
        return 0.0
    return freeze_level * ((t - freeze_start) / (1.0 - freeze_start))


@register_strategy("linear")
class LinearFreezing(PrefixSchedule):
    """Freezes a growing prefix of blocks at each epoch end, its length rising linearly with training progress.

    Rule, at the end of every epoch, with ``t = ctx.progress`` (optimizer steps done / ``total_steps``):

    * ``fraction = 0`` if ``t <= freeze_start``, else ``freeze_level * (t - freeze_start) / (1 - freeze_start)``
      (Composer's ``_freeze_schedule``, same order of operations);
    * ``count`` = number of blocks before the last one (``len(blocks) - 1``), i.e. every block but the head.
      Composer counts differently: the leaf modules that hold parameters, all but the last (its ``_get_layers``,
      ``flat_children[0:-1]``), so the two agree where each block is one such layer; here a block (a Transformer
      layer, a ResNet stage) freezes whole. Either way ``fraction = 1`` never reaches the head;
    * ``target = int(fraction * count)`` (truncation, as in Composer, after adding 1e-9 so a float rounding error
      such as ``1.9999999999999996`` does not lose a block; this is the one place we depart from Composer's floats),
      capped at ``count``;
    * freeze blocks ``0..target-1`` that are not frozen yet. Blocks are never thawed (the target only grows).

    With the defaults over 10 equal epochs and 7 non-head blocks: epochs 1-5 freeze nothing, then after epochs
    6, 7, 8, 9, 10 the prefix is 1, 2, 4, 5, 7 blocks long. Nothing happens at the start stage or between epochs.

    Telemetry signals: ``t``, ``fraction``, ``target_frozen`` and ``count``.

    Args:
        freeze_start: Fraction of training before freezing begins, in ``[0, 1)`` (default 0.5).
        freeze_level: Fraction of the non-head blocks frozen at the end of training, in ``(0, 1]`` (default 1.0).

    Raises:
        ValueError: a parameter outside its range.
        RuntimeError: (at the start stage) the Freezer was built without ``total_steps``, so ``t`` is unknown.
    """

    needs_progress = True  # the start stage already needs the run's length (Freezer(total_steps=...))

    def __init__(self, freeze_start: float = 0.5, freeze_level: float = 1.0) -> None:
        super().__init__()
        if not is_number(freeze_start) or not 0.0 <= freeze_start < 1.0:
            raise ValueError(f"linear: freeze_start must be a number in [0, 1) (fraction of training before freezing "
                             f"begins), got {freeze_start!r}")
        if not is_number(freeze_level) or not 0.0 < freeze_level <= 1.0:
            raise ValueError(f"linear: freeze_level must be a number in (0, 1] (fraction of the non-head blocks "
                             f"frozen by the end of training), got {freeze_level!r}")
        self.freeze_start = float(freeze_start)
        self.freeze_level = float(freeze_level)

    def target_frozen(self, t: float, count: int) -> int:
        """Number of leading blocks frozen at progress ``t`` with ``count`` freezable (non-head) blocks."""
        fraction = linear_freeze_fraction(t, self.freeze_start, self.freeze_level)
        return min(count, math.floor(fraction * count + _EPS))

    def schedule(self, ctx: StageContext, count: int) -> tuple[int, dict[str, Any], str]:
        t = ctx.progress
        fraction = linear_freeze_fraction(t, self.freeze_start, self.freeze_level)
        target = self.target_frozen(t, count)
        signals = {"t": t, "fraction": fraction, "target_frozen": target, "count": count}
        return target, signals, f"linear: t={t:.3f}, fraction {fraction:.3f} of {count} blocks -> first {target} frozen"

    def state_dict(self) -> dict[str, Any]:
        return {"target": self.target, "freeze_start": self.freeze_start, "freeze_level": self.freeze_level}

    def __repr__(self) -> str:
        return f"LinearFreezing(freeze_start={self.freeze_start}, freeze_level={self.freeze_level})"
