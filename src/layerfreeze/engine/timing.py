"""How long a training step takes, measured by the Freezer between two ``step()`` calls, on the host.

What a strategy's stage cadence needs to know (issue 40, item 2): a stage is worth running only when its cost is
small beside the step's. :class:`StepTimes` keeps the wall-clock intervals between consecutive ``Freezer.step()``
calls (``time.perf_counter`` when ``step()`` ends, so an interval holds one training step and, on a stage step, the
stage), split into steps that ran a stage and steps that did not, the last :data:`KEEP` of each. Reading the clock is
host work only (no device synchronisation): on a GPU the interval is how fast the host gets through the steps, which is
the GPU's pace once the host waits on it (a full queue), and the host's own when the host is the bottleneck (the cost
issue 40 is about). An interval spanning an epoch's end or a resume is not kept (the Freezer calls :meth:`restart`):
evaluation and checkpoints happen there. The strategies read the medians in
:attr:`~layerfreeze.strategies.StageContext.step_seconds` / ``stage_step_seconds``.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

#: Intervals kept per kind (steps with a stage, steps without).
KEEP = 16


class StepTimes:
    """The last :data:`KEEP` step intervals (seconds) of each kind, and their medians."""

    def __init__(self) -> None:
        self.step: deque[float] = deque(maxlen=KEEP)
        self.stage: deque[float] = deque(maxlen=KEEP)
        self._last: float | None = None

    def mark(self, staged: bool) -> None:
        """A ``step()`` call ends now; ``staged``: it ran a stage. Keeps the interval since the previous mark."""
        now = time.perf_counter()
        if self._last is not None:
            (self.stage if staged else self.step).append(now - self._last)
        self._last = now

    def restart(self) -> None:
        """The next interval is not a step's (an epoch's end, a resume): start measuring again at the next mark."""
        self._last = None

    def medians(self) -> tuple[float | None, float | None]:
        """``(median step without a stage, median step with one)`` in seconds; None for a kind not measured yet."""
        return (statistics.median(self.step) if self.step else None,
                statistics.median(self.stage) if self.stage else None)
