"""The gradient signal ``grad_l1``: each block's gradient L1 norm, summed over the backward passes since the last
stage, accumulated on the gradients' device and read on the host once per stage.

Why on the device: reading a sum per block per backward (``float(g.abs().sum())``) is a host synchronisation per
block on every step; on a GPU each one waits for every kernel queued before it and stops the host from running ahead
(issue 40: AutoFreeze did that on every backward). Here a backward queues, per device, one
``torch._foreach_norm(grads, 1)`` (one fused kernel on CUDA) and one ``torch.stack`` of the norms into a row of a
float64 buffer of :data:`PENDING_ROWS` backward passes; when the buffer is full, or the sums are read
(:meth:`GradientSums.values`: a stage, a checkpoint), one ``index_add_`` adds its rows, in order, into a float64
accumulator per device, and :meth:`GradientSums.values` copies the accumulators to the host once.

Cost (issue 40's CPU proxy, ``python -m benchmarks.step_overhead``: 18 gradients, 8.9k values): a backward used to
queue four ops (the norms, a stack, a cast to float64, an ``index_add_``); it queues two now, and the trainable
parameters are listed once per frozen set (:meth:`GradientSums.add_trainable`), not on every backward: ~84 -> ~60 us
a backward on the 2-core CPU, one thread. Most of what is left is the norms (~30 us there): ``torch._foreach_norm``
runs one kernel per tensor on the CPU, and a float32 L1 norm is a serial sum (about a nanosecond a value); a faster
sum (vectorized, or in float64) would change the values in their last bits.

The sums are bitwise those of the per-backward formula (``acc.index_add_(0, block_of_each_gradient,
stack(norms).to(float64))`` on every backward; ``tests/test_grad_signal.py``): the same norms, widened to float64
exactly, are added in the same order (backward by backward, gradient by gradient: ``index_add_`` is a serial loop on
the CPU; on CUDA it uses atomics, whose order was never fixed). They differ from the former host sums in the last
bits: a tensor's norm is ``torch._foreach_norm``'s reduction (not ``g.abs().sum()``'s), and a block's tensors are
added in float64 (they were added in the gradients' dtype).
Sources: AutoFreeze's gradient-norm test (:mod:`layerfreeze.strategies.autofreeze`) reads them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from layerfreeze.distributed.fsdp import local_tensor

if TYPE_CHECKING:
    from layerfreeze.engine.params import BlockParams

#: Backward passes whose norms are kept (one float64 row each) before they are added to the sums.
PENDING_ROWS = 32


@dataclass(eq=False)
class _Plan:
    """The trainable parameters of one frozen set, flattened, and where their norms go.

    Attributes:
        key: What the plan was made for (:meth:`GradientSums.add_trainable`'s), None: made for one call.
        params: Every trainable block's parameters, block by block, in ``block.parameters()`` order.
        owners: The block of each parameter.
        device: Their one device when all are plain tensors there (the pending rows' path), else None.
        dtype: The gradients' dtype (their promoted dtype when they differ): the norms' and ``torch.stack``'s.
        rows: ``(PENDING_ROWS, len(params))`` of ``dtype`` on ``device``: one backward's norms per row (made on first
            use), and ``row_views``, its rows.
        index: ``(PENDING_ROWS * len(params),)`` int64 on ``device``: ``owners`` repeated, one copy per row.
    """

    key: object
    params: list[nn.Parameter]
    owners: list[int]
    device: torch.device | None
    dtype: torch.dtype
    rows: torch.Tensor | None = None
    row_views: list[torch.Tensor] | None = None
    index: torch.Tensor | None = None


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
        self._plan: _Plan | None = None  # add_trainable's, for the frozen set of its key
        self._pending: _Plan | None = None  # the plan whose rows hold norms not yet added
        self._used = 0  # rows of _pending.rows in use

    def add_trainable(self, frozen: Sequence[bool], params: BlockParams,
                      reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        """:meth:`add` for every block not ``frozen`` (``params.of(i)``: block ``i``'s parameters), the list made
        once per frozen set and structure version (``params.version()``; every call when it is None)."""
        version = params.version()
        key = None if version is None else (version, tuple(frozen))
        plan = self._plan
        if plan is None or key is None or plan.key != key:
            plan = self._plan = _plan([(i, params.of(i)) for i, f in enumerate(frozen) if not f], key)
        self._add(plan, reduce)

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
        self._add(_plan(active, None), reduce)

    def _add(self, plan: _Plan, reduce: Callable[[torch.Tensor], None] | None) -> None:
        if reduce is None and plan.key is not None and plan.device is not None:  # the common case: every backward
            try:
                norms = torch._foreach_norm([p.grad for p in plan.params], 1)  # a None or sparse gradient raises
            except (TypeError, RuntimeError, NotImplementedError):
                norms = None
            if norms is not None:
                self._pend(plan, norms)
                return
        self._fold()  # the pending rows first: the sums keep the order of the backward passes
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[int]]] = {}
        for p, index in zip(plan.params, plan.owners):
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
            self._add_now(device, grads, owners, reduce)

    def _pend(self, plan: _Plan, norms: list[torch.Tensor]) -> None:
        """Put one backward's ``norms`` (one per ``plan.params``) in the next pending row; add the rows when full."""
        if self._pending is not plan:
            self._fold()
            self._pending = plan
        if plan.rows is None:
            acc = self._accumulator(plan.device)
            plan.rows = acc.new_empty(PENDING_ROWS, len(plan.params), dtype=plan.dtype)
            plan.row_views = list(plan.rows.unbind(0))
            plan.index = self._index_tensor(plan.device, plan.owners, acc).repeat(PENDING_ROWS)
        torch.stack(norms, out=plan.row_views[self._used])  # (a stack into float64 would take 3x as long)
        self._used += 1
        if self._used == PENDING_ROWS:
            self._fold()

    def _fold(self) -> None:
        """Add the pending rows to their device's sums, row after row (one ``index_add_``)."""
        plan, used = self._pending, self._used
        if plan is None or not used:
            return
        self._used = 0
        n = len(plan.params)
        norms = plan.rows[:used].view(-1).to(torch.float64)  # exact: every float dtype widens to float64
        self._accumulator(plan.device).index_add_(0, plan.index[: used * n], norms)

    def _accumulator(self, device: torch.device) -> torch.Tensor:
        acc = self._device.get(device)
        if acc is None:
            acc = self._device[device] = torch.zeros(self.num_blocks, dtype=torch.float64, device=device)
        return acc

    def _add_now(self, device: torch.device, grads: list[torch.Tensor], owners: list[int],
                 reduce: Callable[[torch.Tensor], None] | None) -> None:
        """Add the L1 norms of ``grads`` (all on ``device``) to the sums of their blocks (``owners``)."""
        acc = self._accumulator(device)
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
        self._fold()
        out = list(self._host)
        for acc in self._device.values():
            for i, v in enumerate(acc.cpu().tolist()):
                out[i] += v
        return out

    def reset(self, values: Sequence[float] | None = None) -> None:
        """Start over from zero (a stage), or from ``values`` (a checkpoint's sums)."""
        self._used = 0  # pending rows are dropped with the sums
        self._host = [float(v) for v in values] if values is not None else [0.0] * self.num_blocks
        for acc in self._device.values():
            acc.zero_()


def _plan(active: Sequence[tuple[int, Sequence[nn.Parameter]]], key: object) -> _Plan:
    """The flattened ``active`` (see :class:`_Plan`)."""
    params = [p for _, ps in active for p in ps]
    owners = [i for i, ps in active for _ in ps]
    devices = {p.device for p in params}
    plain = all(type(p) in (nn.Parameter, torch.Tensor) and p.is_floating_point() for p in params)
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in params]) if params else torch.float32
    return _Plan(key, params, owners, devices.pop() if plain and len(devices) == 1 else None, dtype)


def _l1_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each gradient's L1 norm, as one float64 tensor on their device: ``torch._foreach_norm`` for dense ones (one
    kernel on CUDA), ``abs().sum()`` for sparse ones."""
    try:
        return torch.stack(torch._foreach_norm(grads, 1)).to(torch.float64)
    except (RuntimeError, NotImplementedError):  # a sparse gradient (nn.Embedding(sparse=True))
        pass
    return torch.stack([g.abs().sum() if g.layout != torch.strided else torch.linalg.vector_norm(g, 1)
                        for g in grads]).to(torch.float64)
