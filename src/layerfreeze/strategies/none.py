"""``none``: full training, the baseline every number is compared with."""

from __future__ import annotations

from layerfreeze.strategies.base import Decision, StageContext, Strategy
from layerfreeze.strategies.registry import register_strategy


@register_strategy("none")
class NoFreezing(Strategy):
    """Never freezes anything: plain full training (the baseline of every benchmark)."""

    def decide(self, ctx: StageContext) -> Decision:
        return Decision()
