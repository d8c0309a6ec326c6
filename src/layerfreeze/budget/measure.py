"""Each block's bytes in every bucket, measured on a few real training steps with nothing frozen.

:func:`measure_blocks` runs ``steps`` real steps (forward, loss, backward, an optimizer step) of the model on one
batch, at the run's batch size, under the memory ledger (:class:`~layerfreeze.runs.ledger.MemoryLedger`, sampling
every step) and keeps the step with the largest tensor total: per block its parameters, gradients, optimizer state
and saved activations (:class:`BlockBytes`), plus what belongs to no block (buffers, the loss's saved tensors,
parameters outside every block). :func:`measure_cache` adds what the frozen-prefix activation cache would hold at
each boundary for a whole training set (:class:`CacheBytes`). :mod:`layerfreeze.budget.plan` predicts a frozen
set's tensor peak from them.

The model comes back as it was: the steps run a twin of the optimizer at learning rate 0 (its own state, dropped
afterwards), and the trainable parameters (copied to host memory first), the buffers (BatchNorm statistics), the
gradients, every module's train/eval mode and the global RNG state (CPU and CUDA) are restored, so a run that plans
first trains exactly as one that does not. Call it before building the :class:`~layerfreeze.engine.Freezer` (a
parameter that does not require grad counts as frozen).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from layerfreeze.compute.determinism import CacheRefused, check_prefix_deterministic
from layerfreeze.engine.mechanics import set_eval_mode
from layerfreeze.models.blocks import Block
from layerfreeze.models.discovery import discover_blocks, split_for
from layerfreeze.runs.ledger import MemoryLedger
from layerfreeze.runs.ledger_buckets import BLOCK_BUCKETS, DISK, Bucket
from layerfreeze.runs.ledger_counting import innermost_optimizer

__all__ = ["BlockBytes", "CacheBytes", "default_loss", "measure_blocks", "measure_cache"]

#: The per-block buckets (the ledger's, :class:`~layerfreeze.runs.ledger.Bucket`) that freezing a block into the
#: frozen prefix gives back.
RETURNED = (Bucket.GRADS, Bucket.OPTIMIZER, Bucket.ACTIVATIONS)

#: The ledger's buckets of the activation cache (left out of the model's prediction; the plan adds its own).
CACHE_BUCKETS = (Bucket.CACHE_MEMORY, Bucket.CACHE_DISK)


@dataclass
class CacheBytes:
    """What the frozen-prefix activation cache (:class:`~layerfreeze.compute.cache.CachedPrefix`) would hold in host
    memory for a whole training set, per boundary.

    Attributes:
        samples: Training samples the cache holds one entry each of (after the first epoch).
        full: ``full[d - 1]``: bytes of every sample's state at boundary ``d`` (blocks ``0..d-1`` frozen), ``d`` in
            ``1..max_depth``, each cut to the sample's length as the cache stores it, in the storage dtype.
        fingerprints: Bytes of the per-sample input fingerprints the cache checks hits against (``samples`` of them).
        dtype: The storage dtype (``"float32"``, ``"bfloat16"``, ...).
        refused_from: The first boundary whose prefix the cache refuses (a module that stays stochastic once the
            blocks before it are frozen: a Dropout between blocks, BatchNorm with ``train_bn``), or None. The
            CLI's ``auto`` cache turns itself off for good there, so nothing is cached at or beyond it.
        refusal: Why (the cache's own message), or None.
    """

    samples: int
    full: list[int]
    fingerprints: int
    dtype: str
    refused_from: int | None = None
    refusal: str | None = None

    def usable(self, depth: int) -> bool:
        """Whether a frozen prefix of ``depth`` blocks is cached (``depth >= 1`` and before :attr:`refused_from`)."""
        return depth >= 1 and (self.refused_from is None or depth < self.refused_from)

    def at(self, depth: int) -> int:
        """Bytes of every sample's state at boundary ``depth`` (0 where nothing is cached)."""
        return self.full[min(depth, len(self.full)) - 1] if self.usable(depth) else 0

    def deepest_from(self, depth: int) -> int:
        """The most any cached boundary from ``max(depth, 1)`` down holds: the cache's size when a strategy may freeze
        further than ``depth`` (each sample keeps one entry, at its own boundary); 0 when the cache is off there."""
        return max((self.at(d) for d in range(max(depth, 1), len(self.full) + 1)), default=0)


@dataclass
class BlockBytes:
    """Bytes of a training step with nothing frozen, per block and bucket (the memory ledger's figures).

    Attributes:
        block_names: The blocks, front to back.
        heads: Per block, whether it is the head (never frozen).
        blocks: ``{bucket: [bytes per block]}`` for ``params``, ``grads``, ``optimizer``, ``activations``, and
            ``strategy`` when the strategy holds memory per trainable block (AutoFreeze's gradient sums: a block's
            go when it freezes; :func:`~layerfreeze.budget.plan.plan_memory` adds it).
        buckets: ``{bucket: bytes}`` of the measured step (the ledger's buckets, every device).
        devices: ``{device: {bucket: bytes}}`` of the measured step.
        tensor_bytes: Its tensor total: ``none``'s tensor peak on this batch.
        activations_outside: Saved-activation bytes of no block (the loss, ops after the last block).
        activations_shared: Per block ``k``, the saved-activation bytes counted for blocks before ``k`` that block
            ``k`` or a later one saves too (the ledger's
            :attr:`~layerfreeze.runs.ledger_records.LedgerSnapshot.activations_shared`): a frozen prefix of ``k``
            blocks does not give them back. Empty (read as zeros) in a measurement written before it existed.
        demoted: ``{bucket: [bytes per block]}``: how a block's bytes on memory devices change when the run demotes
            it at its freeze (``Freezer(demote=...)``, ``freeze.demote``;
            :meth:`~layerfreeze.engine.demote.Demoter.demoted_bytes`): ``params_frozen`` and ``buffers`` negative
            (the cast), ``params_master`` its float32 master copy where it is kept in host memory (one on disk is not
            memory: 0). Empty without demotion; :func:`~layerfreeze.budget.plan.plan_memory` fills it.
        batch_size: Samples in the measured batch.
        steps: Steps run; the one with the largest tensor total is kept.
        allocator: On CUDA, the caching allocator's figures at the kept step (``peak_allocated``, ...).
        cache: What the activation cache would hold (:func:`measure_cache`), or None (no cache).
    """

    block_names: list[str]
    heads: list[bool]
    blocks: dict[str, list[int]]
    buckets: dict[str, int]
    devices: dict[str, dict[str, int]]
    tensor_bytes: int
    activations_outside: int
    batch_size: int
    steps: int
    allocator: dict[str, dict[str, int]] = field(default_factory=dict)
    cache: CacheBytes | None = None
    activations_shared: list[int] = field(default_factory=list)
    demoted: dict[str, list[int]] = field(default_factory=dict)

    @property
    def max_prefix(self) -> int:
        """The longest frozen prefix: every block before the first head."""
        return next((i for i, h in enumerate(self.heads) if h), len(self.heads))

    def returned(self, k: int) -> dict[str, int]:
        """``{bucket: bytes}`` a frozen prefix of ``k`` blocks gives back (:data:`RETURNED`): its gradients, its
        optimizer state and its saved activations but for those the blocks from ``k`` on save too
        (:attr:`activations_shared`: the prefix's output, where its last block's ReLU saved it and the first trainable
        block's Linear saves it as its input; the ledger counts a storage once, for the first block that saved it);
        and, where :attr:`blocks` has a ``strategy`` list, what the strategy holds per block (AutoFreeze's gradient
        sums)."""
        out = {b: sum(self.blocks[b][:k]) for b in (*RETURNED, Bucket.STRATEGY) if b in self.blocks}
        if 0 < k < len(self.activations_shared):
            out[Bucket.ACTIVATIONS] -= self.activations_shared[k]
        return out

    def model_buckets(self, k: int) -> dict[str, int]:
        """The buckets predicted with blocks ``0..k-1`` frozen (the cache left out): the measured ones less
        :meth:`returned`, the prefix's parameters moved from trainable to frozen, plus what demoting them changes
        (:attr:`demoted`)."""
        out = {b: n for b, n in self.buckets.items() if b not in CACHE_BUCKETS}
        for bucket, n in self.returned(k).items():
            out[bucket] = out.get(bucket, 0) - n
        moved = sum(self.blocks["params"][:k])
        out[Bucket.PARAMS_TRAINABLE] = out.get(Bucket.PARAMS_TRAINABLE, 0) - moved
        out[Bucket.PARAMS_FROZEN] = out.get(Bucket.PARAMS_FROZEN, 0) + moved
        for bucket, n in self.demotion(k).items():
            out[bucket] = out.get(bucket, 0) + n
        return out

    def demotion(self, k: int) -> dict[str, int]:
        """``{bucket: bytes}`` demoting blocks ``0..k-1`` changes on memory devices (:attr:`demoted`; empty
        without demotion)."""
        return {b: sum(per[:k]) for b, per in self.demoted.items()} if k else {}

    def model_bytes(self, k: int) -> int:
        """The predicted tensor total with blocks ``0..k-1`` frozen, the cache left out: ``tensor_bytes`` less
        :meth:`returned`, plus :meth:`demotion` (a measured cache, if the step held one, is left out too)."""
        cache = sum(n for d, per in self.devices.items() if d != DISK for b, n in per.items() if b in CACHE_BUCKETS)
        return self.tensor_bytes - cache - sum(self.returned(k).values()) + sum(self.demotion(k).values())

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BlockBytes:
        """Read :meth:`to_dict` back."""
        data = dict(data)
        cache = data.pop("cache", None)
        return cls(**data, cache=None if cache is None else CacheBytes(**cache))


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss :func:`measure_blocks` uses unless given one.

    * a mapping (a Hugging Face batch): ``model(**batch)`` with ``"index"`` left out, and its ``.loss`` (the batch
      must hold ``labels``); an output without ``.loss`` with ``batch["labels"]``: cross-entropy of its logits;
    * a ``(inputs, targets)`` pair: ``F.cross_entropy(model(inputs), targets)``.

    Raises:
        TypeError: another kind of batch, or an output with no loss and no labels (pass ``loss=``).
    """
    if isinstance(batch, Mapping):
        inputs = {k: v for k, v in batch.items() if k != "index"}
        out = model(**inputs)
        loss = getattr(out, "loss", None)
        if isinstance(loss, torch.Tensor):
            return loss
        logits = getattr(out, "logits", out)
        if "labels" in batch and isinstance(logits, torch.Tensor):
            return F.cross_entropy(logits, batch["labels"])
        raise TypeError("default_loss: the model's output has no .loss and the batch no 'labels'; pass "
                        "loss=lambda model, batch: ... (a scalar tensor)")
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, targets = batch
        return F.cross_entropy(model(inputs), targets)
    raise TypeError(f"default_loss: a batch of type {type(batch).__name__} is neither a mapping nor an (inputs, "
                    "targets) pair; pass loss=lambda model, batch: ... (a scalar tensor)")


def blocks_of(model: nn.Module, blocks: Sequence[str] | Sequence[Block] | None) -> list[Block]:
    """``blocks`` as :class:`~layerfreeze.models.blocks.Block` objects (discovered from names or patterns, or
    from the model when None)."""
    if blocks and isinstance(blocks[0], Block):
        return list(blocks)  # type: ignore[arg-type]
    return discover_blocks(model, blocks)  # type: ignore[arg-type]


def _twin_optimizer(optimizer: Any, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """An optimizer of the same kind over ``params``, its own (empty) state, every learning rate 0.

    ``optimizer``: None (AdamW), a ``torch.optim.Optimizer`` (its class and each group's settings; a framework's
    wrapper holding one: the one inside, :func:`~layerfreeze.runs.ledger_counting.innermost_optimizer`), or a class /
    factory called with the parameter list."""
    held = {id(p) for p in params}
    optimizer = innermost_optimizer(optimizer)  # a framework's wrapper: the optimizer inside
    if optimizer is None:
        twin = torch.optim.AdamW(params, lr=0.0)
    elif isinstance(optimizer, torch.optim.Optimizer):
        groups = []
        for g in optimizer.param_groups:
            members = [p for p in g["params"] if id(p) in held]
            if members:
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": members})
        listed = {id(p) for g in groups for p in g["params"]}
        missing = [p for p in params if id(p) not in listed]
        if missing:  # trainable parameters the optimizer does not hold: the twin holds them, in a group of its own
            groups.append({"params": missing})
        try:
            twin = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k != "lr"})
        except TypeError:  # a class whose defaults are not all constructor arguments: the groups carry them
            twin = type(optimizer)(groups)
    else:
        twin = optimizer(params)
    for g in twin.param_groups:
        g["lr"] = 0.0
    return twin


@contextmanager
def _preserved(model: nn.Module, params: list[nn.Parameter]) -> Iterator[None]:
    """Everything the measuring steps touch, put back: trainable weights and their ``requires_grad``, buffers,
    gradients, modes, RNG."""
    weights = [p.detach().to("cpu", copy=True) for p in params]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = {p: p.grad for p in model.parameters()}
    modes = [(m, m.training) for m in model.modules()]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    for p in grads:
        p.grad = None
    try:
        yield
    finally:
        with torch.no_grad():
            for p, saved in zip(params, weights):
                p.copy_(saved)
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads.items():
            p.grad = g
        for p, flag in flags:
            p.requires_grad_(flag)
        for m, training in modes:
            m.training = training
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _batch_size(batch: Any) -> int:
    if isinstance(batch, Mapping):
        batch = next((v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "index"), None)
    elif isinstance(batch, (tuple, list)):
        batch = batch[0]
    return int(batch.shape[0]) if isinstance(batch, torch.Tensor) and batch.ndim else 0


def measure_blocks(model: nn.Module, batch: Any, *, loss: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                   optimizer: Any = None, blocks: Sequence[str] | Sequence[Block] | None = None, steps: int = 2,
                   sources: Sequence[Any] = (), unfrozen: bool = False) -> BlockBytes:
    """Each block's bytes in every bucket, from ``steps`` real training steps on ``batch`` with nothing frozen.

    Args:
        model: The model, on its training device, before any block is frozen.
        batch: One training batch at the run's batch size, on the model's device (the step's activations scale with
            its size; pad as the run pads).
        loss: ``loss(model, batch)`` -> a scalar tensor; default :func:`default_loss`.
        optimizer: What the run's optimizer is (its state is measured, never touched): a ``torch.optim.Optimizer``
            (its class and group settings), a class or factory called with the trainable parameters, or None (AdamW).
        blocks: Module-name patterns or :class:`~layerfreeze.models.blocks.Block` objects; default: discovered.
        steps: Training steps to run (the one with the largest tensor total is kept; 2: the optimizer's state
            exists from the first step's ``optimizer.step()`` on).
        sources: Byte sources the run holds beside the model (frozen side models: ``FrozenModule``), counted in the
            total (:class:`~layerfreeze.runs.ledger.MemoryLedger`).
        unfrozen: Measure as if no block were frozen: every block's parameters require grad during the steps (their
            flags come back after), for a model whose Freezer already froze some (Lightning's start stage runs
            before the optimizer and the data exist). A frozen block's modules still run in eval mode (the Freezer's
            hooks).

    Returns:
        :class:`BlockBytes`. The model, its gradients, buffers, modes and the RNG state come back as they were.

    Raises:
        ValueError: ``steps < 1``, or no parameter of the model requires grad.
        BlockDiscoveryError: the blocks cannot be discovered.
        TypeError: ``loss`` not given and :func:`default_loss` cannot read the batch.
    """
    if steps < 1:
        raise ValueError(f"measure_blocks: steps must be >= 1, got {steps}")
    found = blocks_of(model, blocks)
    thawed = {id(p) for b in found for p in b.parameters()} if unfrozen else set()
    params = [p for p in model.parameters() if p.requires_grad or id(p) in thawed]
    if not params:
        raise ValueError("measure_blocks: no parameter of the model requires grad; measure before freezing")
    loss = loss or default_loss
    snaps = []
    with _preserved(model, params):
        for p in params:
            p.requires_grad_(True)
        twin = _twin_optimizer(optimizer, params)
        snaps = _measure_steps(model, batch, loss, twin, found, sources, steps)
        del twin
    snap = max(snaps, key=lambda s: s.tensor_bytes)
    return BlockBytes(
        block_names=[b.name for b in found], heads=[bool(b.is_head) for b in found],
        blocks={b: list(snap.blocks[b]) for b in BLOCK_BUCKETS}, buckets=dict(snap.buckets),
        devices={d: dict(per) for d, per in snap.devices.items()}, tensor_bytes=snap.tensor_bytes,
        activations_outside=snap.activations_outside, batch_size=_batch_size(batch), steps=steps,
        allocator={d: dict(v) for d, v in snap.allocator.items()}, activations_shared=list(snap.activations_shared))


def _measure_steps(model: nn.Module, batch: Any, loss: Callable[[nn.Module, Any], torch.Tensor],
                   twin: torch.optim.Optimizer, blocks: list[Block], sources: Sequence[Any], steps: int) -> list[Any]:
    """``steps`` training steps under a ledger sampling each; their snapshots."""
    snaps = []
    with MemoryLedger(model, twin, blocks=blocks, sources=sources, every=1) as ledger:
        model.train()
        for _ in range(steps):
            with ledger.step():
                value = loss(model, batch)
                value.backward()
                twin.step()
                twin.zero_grad(set_to_none=True)
            snaps.append(ledger.last)
    return snaps


def _state_tensor(state: Any) -> torch.Tensor:
    if isinstance(state, torch.Tensor):
        return state
    raise TypeError(f"measure_cache: the split's boundary state is a {type(state).__name__}, not a tensor")


def measure_cache(model: nn.Module, batch: Mapping[str, Any], dataset: Any, *,
                  blocks: Sequence[str] | Sequence[Block] | None = None, dtype: torch.dtype | None = None,
                  input_key: str = "pixel_values", read_batch_size: int = 256, train_bn: bool = False) -> CacheBytes:
    """What the activation cache would hold in host memory with every sample of ``dataset`` cached, per boundary.

    Each boundary's state is computed on ``batch`` (the model's forward split,
    :func:`~layerfreeze.models.discovery.split_for`, under ``no_grad``, one block at a time); a state cut to each
    sample's length (text) is scaled by the lengths over ``dataset`` (read through a ``DataLoader``: only the
    inputs, no model), a fixed-size one by the number of samples.

    Args:
        model / batch: As :func:`measure_blocks` (a mapping holding the model inputs).
        dataset: The training set the cache would hold (its items as the run's loader gives them).
        blocks: As :func:`measure_blocks`.
        dtype: The cache's storage dtype (None: as computed).
        input_key: The input's batch key for an ``nn.Sequential`` (:func:`split_for`).
        read_batch_size: Items per ``DataLoader`` batch when reading the lengths.
        train_bn: The run keeps BatchNorm training in frozen blocks (then the cache refuses a prefix holding one).

    Each boundary's prefix is also checked as the cache checks it when training (the blocks before it in eval mode,
    the model's other modules training: :func:`~layerfreeze.compute.determinism.check_prefix_deterministic`); the
    first one refused is ``refused_from``.

    Raises:
        ValueError: the model's family has no forward split (no cache for it).
    """
    found = blocks_of(model, blocks)
    split = split_for(model, found, input_key=input_key)
    per_position, per_sample, has_length = [], [], []
    refused_from, refusal = None, None
    with _preserved(model, []):
        model.train()
        for depth in range(1, split.max_depth + 1):
            for _, module in found[depth - 1].modules:
                set_eval_mode(module, train_bn)  # what freezing the block does
            try:
                check_prefix_deterministic(found, depth, split.prefix_modules(model, depth))
            except CacheRefused as exc:
                refused_from, refusal = depth, str(exc)
                break
    with _preserved(model, []), torch.no_grad():  # no weight changes under no_grad; BatchNorm statistics may
        state = None
        for depth in range(1, split.max_depth + 1):
            state = split.prefix(model, batch, 1) if depth == 1 else split.extend(model, state, batch, depth - 1,
                                                                                  depth)
            t = _state_tensor(state)
            store = dtype if dtype is not None and t.is_floating_point() else t.dtype
            size = torch.empty((), dtype=store).element_size()
            one = t[0].numel() * size
            lengths = split.lengths(batch, depth)
            has_length.append(lengths is not None)
            per_position.append(one // t.shape[1] if lengths is not None else 0)
            per_sample.append(one)
        prints = split.fingerprint(batch)
    samples = len(dataset)
    totals = [0] * split.max_depth
    if any(has_length):
        for part in DataLoader(dataset, batch_size=read_batch_size):
            for d in range(split.max_depth):
                if has_length[d]:
                    totals[d] += int(split.lengths(part, d + 1).sum())
    full = [totals[d] * per_position[d] if has_length[d] else samples * per_sample[d] for d in range(split.max_depth)]
    fingerprint = prints[0].numel() * prints.element_size() if prints.ndim else 0
    name = str(dtype).removeprefix("torch.") if dtype is not None else "as computed"
    return CacheBytes(samples=samples, full=full, fingerprints=samples * fingerprint, dtype=name,
                      refused_from=refused_from, refusal=refusal)
