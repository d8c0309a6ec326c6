"""Weight recorder for SmartFRZ: a fixed sample of each active block's weights, snapshotted into a ring buffer.

"Layer tailoring" (SmartFRZ, Li et al., ICLR 2023, sec. 3.2): every block, whatever its size, is represented by
the same number of weights, sampled once at fixed positions, so one predictor serves blocks and networks of any
size. Positions are drawn once per block with a seeded generator and spread over the block's weight tensors in
proportion to their sizes. A block with fewer weights than the sample size contributes all of them and the rest is
padding (zeros, with ``mask == False``), which the features ignore.

Cost per snapshot: one gather of ``sample_size`` values per active block, on the weights' device, brought to the
host by :class:`~layerfreeze.strategies.smartfrz.reader.StageReader` in one copy with no host synchronisation
(:meth:`WeightRecorder.picks` says what to read, :meth:`WeightRecorder.record` files a read's values into the
preallocated ``(window, sample_size)`` float32 ring buffers; :meth:`WeightRecorder.snapshot` does both at once);
frozen blocks are not recorded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from layerfreeze.models.blocks import Block
from layerfreeze.strategies.smartfrz.reader import Pick, StageReader


class BlockSample:
    """Fixed sampled positions of one block's parameters.

    Attributes:
        index: Block index.
        picks: ``[(parameter, flat positions LongTensor)]``; positions are into ``parameter.view(-1)``.
        mask: ``(sample_size,)`` bool, False for padding when the block is smaller than the sample size.
    """

    def __init__(self, block: Block, sample_size: int, generator: torch.Generator) -> None:
        self.index = block.index
        params = [p for p in block.parameters()]
        sizes = torch.tensor([p.numel() for p in params], dtype=torch.float64)
        total = int(sizes.sum())
        self.mask = torch.zeros(sample_size, dtype=torch.bool)
        self.picks: list[tuple[nn.Parameter, torch.Tensor]] = []
        if total <= sample_size:  # small block: take everything, pad the rest
            for p in params:
                self.picks.append((p, torch.arange(p.numel())))
            self.mask[:total] = True
            return
        # proportional allocation with largest remainders, so counts add up to sample_size exactly
        exact = sizes / total * sample_size
        counts = exact.floor().long()
        order = torch.argsort(exact - counts, descending=True)
        counts[order[: sample_size - int(counts.sum())]] += 1
        for p, n in zip(params, counts.tolist()):
            if n:
                positions = torch.randperm(p.numel(), generator=generator)[:n].sort().values
                self.picks.append((p, positions))
        self.mask[:] = True


def _offsets(picks: list[tuple[nn.Parameter, torch.Tensor]]) -> list[tuple[nn.Parameter, torch.Tensor, int]]:
    """``picks`` with the column where each one's values start in its block's row."""
    out, start = [], 0
    for p, idx in picks:
        out.append((p, idx, start))
        start += idx.numel()
    return out


class WeightRecorder:
    """Ring buffers of the last ``window`` weight samples of every block.

    Args:
        blocks: The model's blocks (front to back).
        sample_size: Weights sampled per block (default 1,024).
        window: Snapshots kept per block (default 30).
        seed: Seed of the position sampling (fixed: the same blocks get the same positions).

    Shapes: :meth:`window_of` returns ``(n, sample_size)`` float32 (oldest first) with ``n <= window``.
    """

    def __init__(self, blocks: list[Block], sample_size: int = 1024, window: int = 30, seed: int = 0) -> None:
        if sample_size < 8 or window < 3:
            raise ValueError(f"sample_size must be >= 8 and window >= 3, got {sample_size}, {window}")
        g = torch.Generator().manual_seed(seed)
        self.sample_size, self.window = sample_size, window
        self.samples = [BlockSample(b, sample_size, g) for b in blocks]
        self.buffers = torch.zeros(len(blocks), window, sample_size)
        self.steps = torch.zeros(len(blocks), window, dtype=torch.int64)  # optimizer step of each snapshot
        self.counts = [0] * len(blocks)  # snapshots taken per block (not capped)
        self._reader: StageReader | None = None  # snapshot()'s own reader, made at its first call
        self._weight_picks: list[list[Pick]] | None = None  # per block, made at the first read

    def picks(self, active: list[bool]) -> list[Pick]:
        """The reads of one snapshot: every active block's sampled weights into the row of its index (the
        parameters themselves: read under ``no_grad``, whatever their data is at the time)."""
        if self._weight_picks is None:
            self._weight_picks = [[Pick(p, idx, i, start) for p, idx, start in _offsets(sample.picks)]
                                  for i, sample in enumerate(self.samples)]
        return [pick for i, on in enumerate(active) if on for pick in self._weight_picks[i]]

    def record(self, values: torch.Tensor, active: list[bool], step: int) -> None:
        """File one snapshot: row ``i`` of ``values`` (``(>= num_blocks, sample_size)`` float32, host) is active
        block ``i``'s sample, taken after optimizer step ``step``; inactive blocks are skipped."""
        rows = [i for i, on in enumerate(active) if on]
        if not rows:
            return
        slots = [self.counts[i] % self.window for i in rows]
        first, last = rows[0], rows[-1] + 1
        if last - first == len(rows) and slots.count(slots[0]) == len(slots):
            # the common case (a frozen prefix, every active block recorded at the same stages): two slices
            self.buffers[first:last, slots[0]] = values[first:last]
            self.steps[first:last, slots[0]] = step
        else:
            index = (torch.tensor(rows), torch.tensor(slots))
            self.buffers.index_put_(index, values[index[0]])  # one copy for every active block
            self.steps.index_put_(index, torch.tensor(step, dtype=self.steps.dtype))
        for i in rows:
            self.counts[i] += 1

    def snapshot(self, active: list[bool], step: int = 0) -> None:
        """Record the current sample of every active block (frozen blocks are skipped), taken after ``step``: read
        and filed at once (one synchronising read on an accelerator; SmartFRZ's stages read without one, a stage
        later: :mod:`~layerfreeze.strategies.smartfrz.strategy`)."""
        if self._reader is None:
            self._reader = StageReader(len(self.samples), self.sample_size)
        self.record(self._reader.launch(self.picks(active)).settle().values, active, step)

    def _oldest_first(self, ring: torch.Tensor, index: int) -> torch.Tensor:
        """Block ``index``'s row of ``ring`` (``buffers`` or ``steps``), oldest snapshot first, copied."""
        n = min(self.counts[index], self.window)
        if n < self.window:
            return ring[index, :n].clone()
        return torch.roll(ring[index], shifts=-(self.counts[index] % self.window), dims=0).clone()

    def window_of(self, index: int) -> torch.Tensor:
        """The recorded snapshots of block ``index``, oldest first: ``(min(count, window), sample_size)``."""
        return self._oldest_first(self.buffers, index)

    def steps_of(self, index: int) -> torch.Tensor:
        """``(min(count, window),)`` int64: the optimizer step of each snapshot of :meth:`window_of`."""
        return self._oldest_first(self.steps, index)

    def mask_of(self, index: int) -> torch.Tensor:
        """``(sample_size,)`` bool: which positions of block ``index`` are real weights (not padding)."""
        return self.samples[index].mask

    def ready(self, index: int, min_count: int | None = None) -> bool:
        """True once block ``index`` has ``min_count`` snapshots (default: a full window)."""
        return self.counts[index] >= (self.window if min_count is None else min_count)

    def state_dict(self) -> dict[str, Any]:
        return {"buffers": self.buffers.clone(), "steps": self.steps.clone(), "counts": list(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["buffers"].shape != self.buffers.shape:
            raise ValueError(f"recorder state has shape {tuple(state['buffers'].shape)}, "
                             f"this recorder {tuple(self.buffers.shape)}")
        self.buffers.copy_(state["buffers"])
        self.steps.copy_(state["steps"])
        self.counts = list(state["counts"])
