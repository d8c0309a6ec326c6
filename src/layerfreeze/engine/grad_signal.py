"""The gradient signal ``grad_l1``: each block's gradient summed over the updates since the last stage, its L1 norm
read on the host once per stage.

What it is: for block ``i``, ``grad_l1[i] = sum over the block's parameters p of ||sum_t g_t(p)||_1``, the L1 norm of
the gradient *summed* over the interval, as AutoFreeze's public code computes it (``freeze_intermediate_e2e_lr.py``:
``grad_tensor_dict[name] += param.grad`` after every backward, ``torch.norm(..., p=1)`` of each sum at the evaluation,
the sums then zeroed). :class:`GradientSums` keeps one running sum per trainable parameter, on the gradient's device,
in float32 (float64 for a float64 gradient). The engine adds each update's gradients once, at the optimizer's step
(:func:`layerfreeze.engine.steps.hook_optimizer`): with gradient accumulation, once per update, not per backward.

Cost per update (issue 40): one ``torch._foreach_add_`` of the trainable gradients into their sums: no host
synchronisation, one fused kernel on CUDA; on the CPU, for the step-overhead model's 18 gradients, 9.2 us warm and 23
us right after a backward (``python -m benchmarks.grad_norm_floor``). The list of trainable parameters and their sums
is made once per frozen set and structure version (:meth:`GradientSums.add_trainable`), not on every update. A stage
reads the sums (:meth:`GradientSums.values`: ``torch._foreach_norm``, an ``index_add_`` per device into float64
per-block totals, one copy to the host per device) and zeroes them (:meth:`GradientSums.reset`).

Memory: one float32 copy of the trainable blocks' gradients (the public code holds the same), on their devices, but
for a head the strategy does not read (``Strategy.head_signals``: AutoFreeze's); a block's sums are freed at the
next update after it froze. :meth:`GradientSums.held_tensors` lists them for the memory ledger's ``strategy`` bucket
(the Freezer reports them with its strategy's: ``Freezer.ledger_bytes``). Under
FSDP2 each rank sums its own shard of every gradient (a DTensor's local tensor, no collective per update), and the
per-block norms of the shards are all-reduced at the stage (:meth:`GradientSums.values` with ``reduce``): the L1 norm of
a whole tensor is the sum of its shards' L1 norms.

A checkpoint holds the sums of the interval in progress (:meth:`GradientSums.state_dict`, CPU tensors keyed
``"block.position"``), so a resumed run reads the same ``grad_l1`` at its next stage as the uninterrupted one; under
FSDP2 :meth:`GradientSums.full_state_dict` gathers the shards (a collective) and :meth:`GradientSums.load_state_dict`
takes each rank's shard of the whole.

Sources: AutoFreeze's gradient-norm test (:mod:`layerfreeze.strategies.autofreeze`) reads them.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerfreeze.distributed.fsdp import local_tensor

if TYPE_CHECKING:
    from layerfreeze.engine.params import BlockParams

Key = tuple[int, int]  # (block index, position in the block's parameter list)
_GRAD = operator.attrgetter("grad")


@dataclass(eq=False)
class _Plan:
    """The trainable parameters of one frozen set and the running sum of each one's gradient.

    Attributes:
        key: What the plan was made for (``(structure version, frozen set)``), None: made for one call.
        params: Every trainable block's parameters, block by block, in ``block.parameters()`` order.
        sums: The running sum of each one's gradient (its local shard under FSDP2), same order.
        sharded: Whether any parameter is a DTensor (the gradients are read through their local tensor).
    """

    key: object
    params: list[nn.Parameter]
    sums: list[torch.Tensor]
    sharded: bool


def unsummed(blocks: Sequence[Any], layers: Sequence[bool], strategy: Any) -> list[bool]:
    """Per block, whether ``strategy`` never reads its ``grad_l1`` (:class:`GradientSums`' ``skip``): the head unless
    ``strategy.head_signals``, and every block but the stack's ``layers`` when ``strategy.layer_signals_only``
    (:func:`~layerfreeze.models.blocks.stack_layers`)."""
    return [(b.is_head and not strategy.head_signals) or (strategy.layer_signals_only and not layers[b.index])
            for b in blocks]


class GradientSums:
    """Per-parameter running sums of the trainable blocks' gradients since the last stage, and each block's L1 norm
    of them (module docstring).

    Args:
        num_blocks: The number of blocks (one ``grad_l1`` value each).
        skip: Per block, whether it is never summed (a block the strategy does not read: :func:`unsummed`);
            default none.
    """

    def __init__(self, num_blocks: int, skip: Sequence[bool] | None = None) -> None:
        self.num_blocks = num_blocks
        self.skip = list(skip) if skip is not None else [False] * num_blocks
        self._sums: dict[Key, torch.Tensor] = {}
        self._params: dict[Key, nn.Parameter] = {}  # the parameter each sum is of (its sharding, for a checkpoint)
        self._plan: _Plan | None = None
        self._loaded: dict[Key, torch.Tensor] = {}  # a checkpoint's sums, taken by the next plan
        #: Gradients added since the last reset (0: :meth:`values` reads NaN, nothing was summed).
        self.added = 0
        self._kept: torch.Tensor | None = None  # steps a GradScaler did not skip, on the device (add_trainable)

    def add_trainable(self, frozen: Sequence[bool], params: BlockParams, found_inf: torch.Tensor | None = None) -> None:
        """Add this update's gradients of every block neither ``frozen`` nor in :attr:`skip` (``params.of(i)``:
        block ``i``'s parameters) to their running sums; the list is made once per frozen set and structure version
        (``params.version()``; every call when it is None). Parameters without a gradient are skipped. No host
        synchronisation: one ``torch._foreach_add_`` queued on the gradients' device(s).

        ``found_inf``: a ``GradScaler``'s flag for this step (non-zero: it overflowed and the update was skipped),
        given where the optimizer steps even then (a fused one: the scaler hands it ``found_inf`` instead of not
        calling ``step``). Such a step's gradients are left out on the device, still with no synchronisation, and
        an interval of only such steps reads NaN (:meth:`values`)."""
        plan = self.prepare(frozen, params)
        grads = list(map(_GRAD, plan.params))
        if plan.sharded:
            grads = [None if g is None else local_tensor(g) for g in grads]
        enabled = torch.is_grad_enabled()
        torch.set_grad_enabled(False)  # (a gradient made with create_graph=True must not put the sums in a graph)
        try:
            if found_inf is not None:
                keep = found_inf == 0
                self._kept = keep.float() if self._kept is None else self._kept + keep.float()
                self._add_one_by_one(plan, grads, keep)  # where(keep, g, 0): an inf times 0 would be NaN
            elif not grads:
                pass  # nothing to sum: every block but the head is frozen or pinned (a memory budget's floor)
            elif grads[0] is not None and grads[0].device != plan.sums[0].device:
                self._add_one_by_one(plan, grads)  # the model moved after the sums were made
            else:
                torch._foreach_add_(plan.sums, grads)  # a None gradient raises TypeError, before adding anything
        except TypeError:
            self._add_one_by_one(plan, grads)
        finally:
            torch.set_grad_enabled(enabled)
        self.added += 1

    def _add_one_by_one(self, plan: _Plan, grads: list[torch.Tensor | None], keep: torch.Tensor | None = None) -> None:
        """Add ``grads`` one by one, skipping a missing one (each masked by ``keep``, a 0-dim bool tensor, where
        given); a sum on another device than its gradient (the model was moved after the Freezer was built:
        ``accelerator.prepare``, ``model.to("cuda")``) follows it there."""
        for k, g in enumerate(grads):
            if g is None:
                continue
            s = plan.sums[k]
            if s.device != g.device:
                s = plan.sums[k] = s.to(g.device)
                key = next(key for key, p in self._params.items() if p is plan.params[k])
                self._sums[key] = s
            s.add_(g if keep is None else torch.where(keep.to(g.device), g, 0))

    def prepare(self, frozen: Sequence[bool], params: BlockParams) -> _Plan:
        """The sums of the trainable blocks of ``frozen``, allocated now (zeros) if they are not yet: the Freezer
        calls it when it starts, so the memory ledger and a memory plan see them before the first update."""
        version = params.version()
        key = None if version is None else (version, tuple(frozen))
        plan = self._plan
        if plan is None or key is None or plan.key != key:
            plan = self._plan = self._make_plan(frozen, params, key)
            stray = sorted(f"{i}.{j}" for i, j in self._loaded if not frozen[i] and not self.skip[i])
            if stray:
                raise ValueError(f"gradient sums: the checkpoint holds sums for {', '.join(stray)}, which name no "
                                 "parameter of those blocks; it is from another model")
        return plan

    def _make_plan(self, frozen: Sequence[bool], params: BlockParams, key: object) -> _Plan:
        """The plan of a frozen set: a zero sum for each trainable parameter that has none (a checkpoint's when it
        holds one); the sums of blocks no longer trainable are dropped (their memory freed)."""
        plan_params: list[nn.Parameter] = []
        sums: list[torch.Tensor] = []
        kept: dict[Key, torch.Tensor] = {}
        owners: dict[Key, nn.Parameter] = {}
        sharded = False
        for i, f in enumerate(frozen):
            if f or self.skip[i]:
                continue
            for j, p in enumerate(params.of(i)):
                local = local_tensor(p.detach())
                sharded = sharded or hasattr(p, "to_local")
                s = self._sums.get((i, j))
                loaded = self._loaded.pop((i, j), None)
                if s is None or s.shape != local.shape or s.device != local.device:
                    dtype = torch.promote_types(local.dtype, torch.float32)
                    s = torch.zeros(local.shape, dtype=dtype, device=local.device)
                    if loaded is not None:
                        s.copy_(_shard_of(loaded, p))
                kept[(i, j)] = s
                owners[(i, j)] = p
                plan_params.append(p)
                sums.append(s)
        self._sums, self._params = kept, owners
        return _Plan(key, plan_params, sums, sharded)

    def held_tensors(self) -> list[torch.Tensor]:
        """The running sums (the memory ledger's ``strategy`` bucket)."""
        return list(self._sums.values())

    def of_block(self, index: int) -> list[torch.Tensor]:
        """Block ``index``'s running sums (empty for a frozen block)."""
        return [s for (i, _), s in self._sums.items() if i == index]

    def values(self, reduce: Callable[[torch.Tensor], None] | None = None) -> list[float]:
        """Each block's ``grad_l1``: the sum of its parameters' ``||sum_t g_t||_1``, one float per block (0.0 for a
        block without sums; NaN for every block when nothing was added since the last reset: every optimizer step
        of the interval was skipped, by a ``GradScaler`` on an overflow), read with one copy to the host per device
        (a host synchronisation: at a stage).

        Args:
            reduce: An in-place all-reduce (sum) of a float64 tensor of one value per block (FSDP2: each rank holds
                a shard of every sum); a collective then, so every rank calls :meth:`values`.
        """
        totals: list[torch.Tensor] = []
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[int]]] = {}
        for (i, _), s in self._sums.items():
            sums, owners = by_device.setdefault(s.device, ([], []))
            sums.append(s)
            owners.append(i)
        for device, (sums, owners) in by_device.items():
            total = torch.zeros(self.num_blocks, dtype=torch.float64, device=device)
            norms = torch.stack(torch._foreach_norm(sums, 1)).to(torch.float64)
            total.index_add_(0, torch.tensor(owners, device="cpu").to(device, non_blocking=True), norms)
            totals.append(total)
        if reduce is not None:
            total = torch.zeros(self.num_blocks, dtype=torch.float64) if not totals else totals[0]
            for t in totals[1:]:
                total += t.to(total.device)
            reduce(total)  # a rank without sums still joins the collective
            totals = [total]
        out = [0.0] * self.num_blocks
        for total in totals:
            for i, v in enumerate(total.cpu().tolist()):
                out[i] += v
        if self._kept is not None and float(self._kept) == 0:  # every step a GradScaler skipped (add_trainable)
            return [math.nan] * self.num_blocks
        return out if self.added else [math.nan] * self.num_blocks

    def reset(self) -> None:
        """Start the sums over from zero (a stage)."""
        if self._sums:
            torch._foreach_zero_(list(self._sums.values()))
        self._loaded = {}
        self.added = 0
        self._kept = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The sums of the interval in progress, as CPU tensors keyed ``"block.position"`` (a copy to the host: a
        checkpoint). Under FSDP2 these are this rank's shards: use :meth:`full_state_dict` for a checkpoint."""
        out = {f"{i}.{j}": s.detach().to("cpu", copy=True) for (i, j), s in self._sums.items()}
        out.update({f"{i}.{j}": t for (i, j), t in self._loaded.items()})  # loaded, not yet taken by a plan
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """:meth:`state_dict` with every sum whole: a DTensor parameter's shards are gathered (a collective under
        FSDP2: every rank calls it, in the same order)."""
        from torch.distributed.tensor import DTensor

        out = self.state_dict()
        for (i, j), s in self._sums.items():
            p = self._params[(i, j)]
            if isinstance(p, DTensor):
                whole = DTensor.from_local(s, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                           run_check=False).full_tensor()
                out[f"{i}.{j}"] = whole.to("cpu")
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` or :meth:`full_state_dict` output (``{}``: start over, the sums freed): the
        sums are put in place by the next :meth:`prepare`, for the parameters trainable then (each rank takes its
        shard of a whole sum under FSDP2).

        Raises:
            ValueError: not a mapping of ``"block.position"`` keys of this model's blocks to floating-point tensors
                (:meth:`prepare` raises for a position or shape the model does not have).
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"gradient sums: expected a mapping of 'block.position' to tensors, got "
                             f"{type(state).__name__}; the checkpoint is damaged or not layerfreeze's")
        loaded: dict[Key, torch.Tensor] = {}
        for name, tensor in state.items():
            parts = str(name).split(".")
            if len(parts) != 2 or not all(x.isdigit() for x in parts) or int(parts[0]) >= self.num_blocks:
                raise ValueError(f"gradient sums: key {name!r} is not 'block.position' of one of the "
                                 f"{self.num_blocks} blocks; the checkpoint is from another model")
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise ValueError(f"gradient sums: {name!r} holds {type(tensor).__name__}"
                                 f"{'' if not isinstance(tensor, torch.Tensor) else ' of ' + str(tensor.dtype)}, "
                                 "not a floating-point tensor; the checkpoint is damaged or not layerfreeze's")
            loaded[(int(parts[0]), int(parts[1]))] = tensor
        self._sums, self._params, self._plan, self._loaded = {}, {}, None, loaded
        self.added = 1 if loaded else 0


def _shard_of(whole: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``whole`` (a checkpoint's whole sum) for parameter ``p``: ``whole`` itself unless ``p``
    is a DTensor, then the part ``p``'s placements give this rank (computed locally, no collective).

    Raises:
        ValueError: ``whole`` is not of ``p``'s shape (one rank's shard, saved without ``full=True``; another model).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if whole.shape != p.shape:
        raise ValueError(
            f"gradient sums: the checkpoint holds a sum of shape {tuple(whole.shape)} for a parameter of shape "
            f"{tuple(p.shape)}: it is from another model, or one rank's shards of an FSDP2 run saved without "
            "gathering them (save with layerfreeze.save_full_checkpoint, or Freezer.state_dict(full=True))")
    if not isinstance(p, DTensor):
        return whole
    return distribute_tensor(whole.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()
