"""The gradient signal ``grad_l1``: each block's gradient L1 norm, summed over the backward passes since the last
stage, accumulated on the gradients' device and read on the host once per stage.

Why on the device: reading a sum per block per backward (``float(g.abs().sum())``) is a host synchronisation per
block on every step; on a GPU each one waits for every kernel queued before it and stops the host from running ahead
(issue 40: AutoFreeze did that on every backward). Here a backward queues, per device, one
``torch._foreach_norm(grads, 1)`` (one fused kernel on CUDA), the norms cast to float64 and one ``index_add_`` into a
float64 accumulator per device; :meth:`GradientSums.values` copies the accumulators to the host once (a stage, a
checkpoint).

The sums differ from the former host sums in the last bits: a tensor's norm is ``torch._foreach_norm``'s reduction
(not ``g.abs().sum()``'s), and a block's tensors are added in float64 (they were added in the gradients' dtype).
Sources: AutoFreeze's gradient-norm test (:mod:`layerfreeze.strategies.autofreeze`) reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from layerfreeze.distributed.fsdp import local_tensor


class GradientSums:
    """Per-block sums of gradient L1 norms (float64), on the device(s) the gradients are on.

    Args:
        num_blocks: The number of blocks (one sum each).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._host = [0.0] * num_blocks  # loaded from a checkpoint; the device sums add to it
        self._device: dict[torch.device, torch.Tensor] = {}
        self._index: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}  # block of each gradient

    def add(self, active: Sequence[tuple[int, Sequence[nn.Parameter]]],
            reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        """Add this backward's L1 norm of each block's gradients (parameters without a gradient are skipped; a
        DTensor's local shard is summed). No host synchronisation: everything is queued on the gradients' devices.

        Args:
            active: ``(block index, its parameters)`` for the blocks to sum (the trainable ones).
            reduce: An in-place all-reduce (sum) of a float64 tensor of one sum per block, applied to this backward's
                sums before they are added (FSDP2: each rank holds a shard of every gradient); a collective then, so
                every rank calls :meth:`add`.
        """
        if reduce is None:  # the common case, kept short: it runs on every backward
            flat = [(index, p) for index, params in active for p in params]
            grads = [p.grad for _, p in flat]
            if grads and all(g is not None and type(g) is torch.Tensor for g in grads):
                device = grads[0].device
                if all(g.device == device for g in grads):
                    self._add(device, grads, [index for index, _ in flat], None)
                    return
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[int]]] = {}
        for index, params in active:
            for p in params:
                g = p.grad
                if g is None:
                    continue
                g = local_tensor(g)
                grads, owners = by_device.setdefault(g.device, ([], []))
                grads.append(g)
                owners.append(index)
        if reduce is not None and not by_device:
            by_device[torch.device("cpu")] = ([], [])  # a rank with no gradient still joins the collective
        for device, (grads, owners) in by_device.items():
            self._add(device, grads, owners, reduce)

    def _add(self, device: torch.device, grads: list[torch.Tensor], owners: list[int],
             reduce: Callable[[torch.Tensor], None] | None) -> None:
        """Add the L1 norms of ``grads`` (all on ``device``) to the sums of their blocks (``owners``)."""
        acc = self._device.get(device)
        if acc is None:
            acc = self._device[device] = torch.zeros(self.num_blocks, dtype=torch.float64, device=device)
        if not grads:
            step = acc.new_zeros(self.num_blocks)
            if reduce is not None:
                reduce(step)
                acc.add_(step)
            return
        norms = _l1_norms(grads)
        index = self._index_tensor(device, owners, acc)
        if reduce is None:
            acc.index_add_(0, index, norms)
        else:
            step = acc.new_zeros(self.num_blocks).index_add_(0, index, norms)
            reduce(step)
            acc.add_(step)

    def _index_tensor(self, device: torch.device, owners: list[int], like: torch.Tensor) -> torch.Tensor:
        """The block index of each gradient, as a tensor on ``device``, made once per pattern of blocks and filled
        on the device (a copy from the host would be a blocking copy on CUDA, a synchronisation)."""
        key = (device, tuple(owners))
        found = self._index.get(key)
        if found is None:
            if len(self._index) > 64:  # patterns change with the frozen set; keep a few
                self._index.clear()
            runs: list[list[int]] = []  # [block, count] in order
            for i in owners:
                if runs and runs[-1][0] == i:
                    runs[-1][1] += 1
                else:
                    runs.append([i, 1])
            found = self._index[key] = torch.cat([like.new_full((n,), i, dtype=torch.long) for i, n in runs])
        return found

    def values(self) -> list[float]:
        """The sums, one float per block: one copy to the host per device (a host synchronisation: at a stage)."""
        out = list(self._host)
        for acc in self._device.values():
            for i, v in enumerate(acc.cpu().tolist()):
                out[i] += v
        return out

    def reset(self, values: Sequence[float] | None = None) -> None:
        """Start over from zero (a stage), or from ``values`` (a checkpoint's sums)."""
        self._host = [float(v) for v in values] if values is not None else [0.0] * self.num_blocks
        for acc in self._device.values():
            acc.zero_()


def _l1_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each gradient's L1 norm, as one float64 tensor on their device: ``torch._foreach_norm`` for dense ones (one
    kernel on CUDA), ``abs().sum()`` for sparse ones."""
    try:
        return torch.stack(torch._foreach_norm(grads, 1)).to(torch.float64)
    except (RuntimeError, NotImplementedError):  # a sparse gradient (nn.Embedding(sparse=True))
        pass
    return torch.stack([g.abs().sum() if g.layout != torch.strided else torch.linalg.vector_norm(g, 1)
                        for g in grads]).to(torch.float64)
