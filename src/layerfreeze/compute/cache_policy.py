"""What the frozen-prefix cache keeps, and how one batch is served: the cache's policy and plan.

* :class:`CachePolicy` -- what the cache keeps (``freeze.cache.mode: auto`` in the CLI): an entry is stored only when
  it will be read again under a boundary that has been stable long enough, and freed after its last read. The rules
  use only what the run measures (the data order, the step the frozen prefix last changed), never timing.
* :class:`_Plan` -- one batch's lookups and how its misses are computed (from the inputs, or extended from an older
  boundary; under FSDP2, what every rank agreed on).

The cached forward that follows them is :class:`~layerfreeze.compute.cached_prefix.CachedPrefix`; the overview of the
cache is :mod:`layerfreeze.compute.cache`. Imports nothing of layerfreeze: the cache's other modules import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CachePolicy"]


class CachePolicy:
    """Which entries the cache stores and keeps: only those that will be read again (``freeze.cache.mode: auto``).

    An entry costs its bytes from the step it is stored to the step it is dropped, and pays only when it is read:
    at its sample's next visit, as a hit (the boundary has not moved) or as the start of an extension (the boundary
    moved deeper: blocks up to the old boundary are not recomputed). Measured on SmartFRZ runs (HISTORY.md "Where
    the memory goes"), a cache that stores every miss holds most of its bytes for entries that are never read: written
    in the last epoch, or for a boundary that moved right after, so that 85 MiB of MobileNetV2's shallowest outputs
    made its tensor peak 1.25x that of not freezing. Two rules, both from what the run measures, none from timing (so
    what the cache holds is the same on any machine):

    * **Read again.** An entry is stored only for a sample the run visits again (``next_visit``: the step of its next
      visit, from the data order; None after its last one), and freed at its last read; when the boundary moves,
      entries of samples not visited again are freed at once. Nothing is written in a run's last epoch.
    * **Stable long enough.** A boundary set during training is stable enough for an entry when the steps it has held
      (its *age*, measured from the step the frozen prefix last changed, ``boundary_since``) are at least the steps
      until that entry's read (``next_visit - now``): a boundary that has held ``a`` steps has then held at least
      as long as it must still hold, the rule that keeps a power-law (Lindy) lifetime more likely than not to last
      until the read. A boundary set before the first step (``boundary_since() == 0``: ``static``'s k, blocks
      frozen from the start) is the run's plan, not a move: its entries are stored from the first step.

    Entries below a boundary that moved stay only while their sample is visited again: they are extended at that
    visit (and replaced by the deeper entry when the new boundary is stable enough), else freed.

    Args:
        now: The step being computed (1-based, as ``next_visit`` counts).
        next_visit: ``next_visit(index)``: the step of sample ``index``'s next visit after ``now()``, or None.
        boundary_since: The step count at which the frozen prefix last changed (0: before the first step);
            :attr:`~layerfreeze.engine.Freezer.prefix_since`.

    Counters: ``skipped_last`` / ``skipped_unstable`` (misses not stored: no next visit / boundary too young),
    ``freed`` (entries dropped by the policy).
    """

    def __init__(self, now: Callable[[], int], next_visit: Callable[[int], int | None],
                 boundary_since: Callable[[], int]) -> None:
        self.now = now
        self.next_visit = next_visit
        self.boundary_since = boundary_since
        self.skipped_last = 0
        self.skipped_unstable = 0
        self.freed = 0

    def read_again(self, index: int) -> bool:
        """Whether sample ``index`` is visited again in the run."""
        return self.next_visit(index) is not None

    def stores(self, index: int) -> bool:
        """Whether a miss of sample ``index`` computed now is stored (and counts why not)."""
        following = self.next_visit(index)
        if following is None:
            self.skipped_last += 1
            return False
        since = self.boundary_since()
        if since == 0:
            return True
        now = self.now()
        if now - (since + 1) >= following - now:  # age (steps held before this one) >= steps until the read
            return True
        self.skipped_unstable += 1
        return False

    def stats(self) -> dict[str, int]:
        return {"policy_skipped_last": self.skipped_last, "policy_skipped_unstable": self.skipped_unstable,
                "policy_freed": self.freed}


class _Plan:
    """One batch's lookups and how its misses are computed
    (:meth:`~layerfreeze.compute.cached_prefix.CachedPrefix._plan`)."""

    def __init__(self, indices: list[int], found: list[Any], miss: list[int], device: torch.device) -> None:
        self.indices, self.found, self.miss, self.device = indices, found, miss, device
        self.start = 0  # boundary the misses are extended from; 0: the prefix from the inputs
        self.old: torch.Tensor | None = None  # the misses' states at ``start``
        self.compute_only = False  # FSDP2: run the computation another rank needs, keep nothing of it
