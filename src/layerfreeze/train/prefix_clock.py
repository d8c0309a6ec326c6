"""The frozen prefix's own forward time per training step (issue 42: the prefix as an inference workload).

Once blocks ``0..k-1`` are frozen, their forward builds no autograd graph: their parameters do not require grad and
neither does their input, so autograd records nothing and saves no activation for them (``torch.no_grad`` would add
nothing; ``inference_mode`` would be wrong, its outputs cannot be saved by the trainable suffix's backward). Under
``train.compile: blocks`` each frozen block's region is compiled for its all-frozen key, which AOTAutograd compiles
as an inference graph. What is left to show is what the prefix costs: :class:`PrefixClock` times the forward of the
frozen prefix on each training step, from a forward pre-hook on the prefix's first module to a forward hook on its
last, and the trainer logs it as ``prefix_forward_s`` beside ``suffix_s`` (the rest of the step: the trainable
blocks' forward, the loss, the backward, the optimizer and the freezing stage) in ``metrics.jsonl``.

On the CPU the hooks read ``time.perf_counter()``. On CUDA they record two CUDA events, and the elapsed time is read
when the step is recorded, after the step's loss has been read on the host (which waited for the forward), so the
clock adds no synchronisation. Steps where the prefix does not run (a warm activation cache serves it) or where
nothing is frozen carry neither field. Under ``train.compile: true`` the whole model is one compiled region and the
prefix has no boundary to time: the clock is off.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from layerfreeze.models.blocks import Block


class PrefixClock:
    """Times the frozen prefix's forward on the steps it is armed for.

    Args:
        blocks: The model's blocks in forward order.
        device: The training device (CUDA events there, ``perf_counter`` elsewhere).
    """

    def __init__(self, blocks: list[Block], device: torch.device) -> None:
        self.blocks = blocks
        self.cuda = device.type == "cuda"
        self.prefix = 0
        self._handles: list[Any] = []
        self._armed = False
        self._start: Any = None
        self._end: Any = None

    def refresh(self, prefix: int) -> None:
        """Move the hooks to the prefix of ``prefix`` frozen blocks (none when it is 0); a no-op when unchanged."""
        if prefix == self.prefix:
            return
        self.close()
        self.prefix = prefix
        if prefix == 0:
            return
        modules = [m for block in self.blocks[:prefix] for _, m in block.modules]
        if modules:  # blocks in forward order, a block's modules in its own order
            self._handles = [modules[0].register_forward_pre_hook(self._on_start),
                             modules[-1].register_forward_hook(self._on_end)]

    def arm(self) -> None:
        """Time the next training forward (evaluation forwards between steps are not counted)."""
        self._armed, self._start, self._end = True, None, None

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _on_start(self, module: nn.Module, args: Any) -> None:
        if self._armed and self._start is None:  # the first forward of the step (not a checkpoint's recompute)
            self._start = self._mark()

    def _on_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._armed and self._start is not None and self._end is None:
            self._end = self._mark()

    def read(self) -> float | None:
        """Seconds the prefix's forward took on the armed step (None: it did not run), and disarm. On CUDA call it
        after the step's loss was read on the host: the prefix's events are complete by then."""
        self._armed = False
        if self._start is None or self._end is None:
            return None
        if self.cuda:
            return self._start.elapsed_time(self._end) / 1000.0
        return self._end - self._start

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.prefix = 0
