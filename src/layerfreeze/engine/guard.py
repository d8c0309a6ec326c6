"""Stability guard: undo a freeze that hurt.

Dynamic freezing can go both ways. After each freeze the guard remembers the validation metric measured just
before it; if later measurements are worse than that by more than ``tolerance`` (relative) for ``patience``
consecutive evaluations, the most recently frozen block is thawed and kept trainable for ``cooldown`` evaluations
(the strategy's requests to freeze it again are ignored until then). Off by default for the classic strategies so
they stay faithful to their papers; available to all. Its thaws appear in telemetry with ``reason="guard: ..."``.
"""

from __future__ import annotations

import math
from typing import Any


class StabilityGuard:
    """Watches a validation metric after each freeze and asks for a thaw when it worsens.

    Args:
        tolerance: Allowed relative worsening, ``> 0`` (0.05: 5 % above the pre-freeze value for a loss).
        patience: Consecutive worse evaluations before thawing, ``>= 1``.
        cooldown: Evaluations the thawed block stays trainable, ``>= 0``.
        mode: ``"min"`` for a loss (lower is better), ``"max"`` for an accuracy.

    Raises:
        ValueError: a parameter outside its range.
    """

    def __init__(self, tolerance: float = 0.05, patience: int = 1, cooldown: int = 2, mode: str = "min") -> None:
        if not tolerance > 0:
            raise ValueError(f"guard tolerance must be > 0 (relative worsening allowed), got {tolerance}")
        if patience < 1:
            raise ValueError(f"guard patience must be >= 1 evaluation, got {patience}")
        if cooldown < 0:
            raise ValueError(f"guard cooldown must be >= 0 evaluations, got {cooldown}")
        if mode not in ("min", "max"):
            raise ValueError(f"guard mode must be 'min' (loss) or 'max' (accuracy), got {mode!r}")
        self.tolerance, self.patience, self.cooldown, self.mode = tolerance, patience, cooldown, mode
        self.last_value: float | None = None
        self.reference: float | None = None
        self.watching: list[int] = []  # blocks frozen since the reference was taken, most recent last
        self.bad = 0
        self.cooling: dict[int, int] = {}

    def on_freeze(self, index: int) -> None:
        """A block was frozen (not by the guard): compare later evaluations with the last value before it."""
        if not self.watching:
            self.reference = self.last_value
            self.bad = 0
        self.watching.append(index)

    def release(self, indices: Any) -> None:
        """Stop watching ``indices`` (blocks a memory budget keeps frozen: the guard must never thaw them); the
        reference goes when nothing is watched any more."""
        keep = [i for i in self.watching if i not in indices]
        if keep != self.watching:
            self.watching = keep
            if not keep:
                self.reference, self.bad = None, 0

    def blocks_freeze(self, index: int) -> bool:
        """True while ``index`` is cooling down after a guard thaw (the engine then skips freezing it)."""
        return self.cooling.get(index, 0) > 0

    def observe(self, value: float, frozen: list[bool]) -> int | None:
        """Take one evaluation; return the block index to thaw, or None.

        Non-finite values count as worse.
        """
        self.cooling = {i: n - 1 for i, n in self.cooling.items() if n > 1}
        thaw = None
        self.watching = [i for i in self.watching if frozen[i]]
        if self.watching and self.reference is None:
            self.reference = value  # frozen before any evaluation (start stage): the first one is the baseline
        elif self.watching:
            if self._worse(value, self.reference):
                self.bad += 1
                if self.bad >= self.patience:
                    thaw = self.watching.pop()
                    self.cooling[thaw] = self.cooldown
                    self.bad = 0
            else:
                self.bad = 0
        self.last_value = value
        if not self.watching:
            self.reference = None
        return thaw

    def _worse(self, value: float, reference: float) -> bool:
        if not math.isfinite(value):
            return True
        margin = self.tolerance * abs(reference)
        return value > reference + margin if self.mode == "min" else value < reference - margin

    def state_dict(self) -> dict[str, Any]:
        """Resumable state (plain values)."""
        return {"last_value": self.last_value, "reference": self.reference, "watching": list(self.watching),
                "bad": self.bad, "cooling": dict(self.cooling)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.last_value, self.reference = state["last_value"], state["reference"]
        self.watching, self.bad = list(state["watching"]), state["bad"]
        self.cooling = {int(k): v for k, v in state["cooling"].items()}
