"""``static``: freeze the first ``k`` blocks for the whole run (classic transfer learning, feature extraction).

Source: the standard fine-tuning practice of keeping the lower layers of a pretrained network fixed (Yosinski et al.,
"How transferable are features in deep neural networks?", NeurIPS 2014, sec. 4: "frozen" vs "fine-tuned" layers).
"""

from __future__ import annotations

from typing import Any

from layerfreeze.strategies.base import Decision, StageContext, Strategy, is_int
from layerfreeze.strategies.registry import register_strategy


@register_strategy("static")
class StaticFreezing(Strategy):
    """Freezes blocks ``0..k-1`` before the first step and never changes them.

    Args:
        k: Number of leading blocks to freeze, ``0 <= k``; it must leave the head trainable (checked at the start
            stage, when the number of blocks is known).

    Raises:
        ValueError: ``k`` is negative or not an int; at the start stage, ``k`` would reach the head.
    """

    def __init__(self, k: int = 1) -> None:
        super().__init__()
        if not is_int(k) or k < 0:
            raise ValueError(f"static: k must be an integer >= 0 (number of leading blocks to freeze), got {k!r}")
        self.k = k

    def validate(self, num_blocks: int) -> None:
        """Raise ValueError when ``k`` would freeze the head of a model with ``num_blocks`` blocks."""
        if self.k >= num_blocks:
            raise ValueError(
                f"static: k={self.k} would freeze the head; this model has {num_blocks} blocks, so k must be at most "
                f"{num_blocks - 1} (see `layerfreeze blocks` for the list)"
            )

    def decide(self, ctx: StageContext) -> Decision:
        if ctx.event != "start":
            return Decision()
        self.validate(len(ctx.blocks))
        return Decision(freeze=list(range(self.k)), reason=f"static: first {self.k} blocks")

    def state_dict(self) -> dict[str, Any]:
        return {"k": self.k}

    def __repr__(self) -> str:
        return f"StaticFreezing(k={self.k})"
