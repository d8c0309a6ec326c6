"""``none``: full training, the baseline every number is compared with."""

from __future__ import annotations

from .base import Decision, StageContext, Strategy


class NoFreezing(Strategy):
    """Never freezes anything: plain full training (the baseline of every benchmark)."""

    name = "none"

    def decide(self, ctx: StageContext) -> Decision:
        return Decision()
