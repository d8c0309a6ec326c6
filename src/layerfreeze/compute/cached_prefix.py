"""The cached forward: :class:`CachedPrefix`, the model's forward with the frozen prefix's per-sample output read from
a store instead of running the prefix, and the checks that keep it right (the cache's overview:
:mod:`layerfreeze.compute.cache`).

:class:`CachedPrefix` is the forward: cached states for hits, ``prefix`` (or ``extend`` from an older boundary) for
misses, then the split's ``suffix`` with gradients (:mod:`layerfreeze.models.forward_split`). It asks the Freezer only
through :class:`FrozenPrefixSource` (its blocks, its frozen prefix length, putting frozen blocks in eval mode). What
it stores and keeps is its :class:`~layerfreeze.compute.cache_policy.CachePolicy`'s to say; the storage is
:class:`~layerfreeze.compute.store.ActivationCache`.

Correctness rules (each one guards against reusing a stale value silently):

* A hit is used only after its sample's inputs are checked against the fingerprint taken when it was cached
  (:meth:`~layerfreeze.models.forward_split.ModelSplit.fingerprint`); a change means random augmentation ->
  :class:`CacheRefused` (or, with ``fallback=True``, the cache turns itself off and the full forward runs).
* A prefix module that is stochastic in its current mode -> :class:`CacheRefused` (or fallback).
* A prefix block whose parameters or buffers were modified in place since they were cached (``Tensor._version``
  changed: an optimizer step after a thaw, ``load_state_dict``), or cast or moved (``model.to(torch.float64)``, which
  changes no version), invalidates every entry that went through it.
* The cache serves the precision it was filled under: the autocast state (on or off, and its dtype) of its first
  forward. A forward under another one (a float32 evaluation after bfloat16 mixed-precision training) runs the full
  forward, with a warning the first time: the stored states were rounded to the other precision.
* A thaw (shallower depth) drops entries deeper than the new boundary.
* A shard file whose size, SHA-256 or per-entry CRC-32 does not match the index is dropped with a warning
  (``corrupt_shards``) and its entries are recomputed, never returned (:mod:`layerfreeze.compute.store`).

Equality. In float32 the cached path gives the same logits as the full forward bit for bit whenever the prefix's
kernels give a sample the same bits whatever else is in its batch. On CPU they do for batches of 4 or more rows
(tested with 1 and 2 threads); a batch of 1-3 rows (a short last batch, a few misses recomputed together) may get
another GEMM kernel and differ in the last bits, as any change of batch size would without a cache. Storing in
float16/bfloat16 rounds the state (about 1e-3 relative).

A cache holds the outputs of one model for one dataset: ``index`` must identify a sample of that dataset (never
mix train and test batches), and entries are valid only for the weights they were computed with.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from layerfreeze.compute.batch_inputs import batch_indices, names_its_input, resolve_input_key, sample_indices
from layerfreeze.compute.cache_policy import CachePolicy, _Plan
from layerfreeze.compute.determinism import (
    CHANGED_INPUTS,
    CacheRefused,
    check_prefix_deterministic,
    precision_key,
    precision_warning,
    refuse_random_draws,
)
from layerfreeze.compute.store import ActivationCache, CacheWriteError, pad_dim0
from layerfreeze.distributed import comm
from layerfreeze.distributed.fsdp import fsdp_modules, reshard_all, root_parameters
from layerfreeze.models.blocks import Block
from layerfreeze.models.discovery import split_for
from layerfreeze.models.forward_split import ModelSplit
from layerfreeze.runs.ledger_buckets import Bucket

__all__ = ["CachedPrefix", "FrozenPrefixSource", "sample_indices"]


def _signature(block: Block) -> tuple[tuple[Any, ...], ...]:
    """``(id, version, dtype, device)`` of the block's parameters and buffers (those held outside its modules, such as a
    class token, included): changes when any is modified in place, replaced, cast or moved (``Module.to`` changes no
    version)."""
    tensors = [t for _, module in block.modules for t in (*module.parameters(), *module.buffers())]
    return tuple((id(t), t._version, t.dtype, t.device) for t in (*tensors, *(p for _, p in block.params)))


class FrozenPrefixSource(Protocol):
    """What :class:`CachedPrefix` asks of whoever freezes the blocks; :class:`~layerfreeze.engine.Freezer` is one.

    The cache needs three things: the blocks (to split the forward and watch their weights), how many leading
    blocks are frozen (the default depth and the deepest one it may cache), and a way to put frozen blocks in eval
    mode when their forward is skipped (on a hit the blocks do not run, so a forward pre-hook that re-applies eval
    mode after ``model.train()`` would not run either, and the determinism check would see training mode).
    """

    @property
    def blocks(self) -> Sequence[Block]:
        """The model's blocks, front to back."""
        ...

    @property
    def frozen_prefix(self) -> int:
        """Number of leading blocks that are frozen."""
        ...

    def eval_frozen(self, depth: int | None = None) -> None:
        """Put the frozen blocks among blocks ``0..depth-1`` (all blocks when None) in eval mode now."""
        ...


def _on_device(positions: list[int], device: torch.device | str | None) -> torch.Tensor:
    """``positions`` as a long tensor on ``device``, copied without blocking the host (``torch.tensor(...,
    device=cuda)`` copies and then synchronises the stream: a host synchronisation per call)."""
    return torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _now(device: torch.device) -> float:
    """A clock reading for timing work on ``device``: CUDA work is asynchronous, so wait for it first."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class CachedPrefix:
    """The model's forward with the frozen prefix's output read from an
    :class:`~layerfreeze.compute.store.ActivationCache`.

    In a loop with a Freezer, two lines::

        runner = CachedPrefix(model, freezer=freezer)   # before the loop
        logits = runner(batch)                          # instead of the model's forward; batch has "index"

    Args:
        model: The model being trained.
        blocks: Its blocks; default the freezer's ``blocks``.
        split: How its forward splits (default :func:`~layerfreeze.models.discovery.split_for`).
        cache: The storage (default: an :class:`~layerfreeze.compute.store.ActivationCache` with its defaults: a quarter
            of the host memory available (:func:`~layerfreeze.compute.store.auto_budget_bytes`), then shards in the
            system temp directory).
        freezer: The :class:`~layerfreeze.engine.Freezer` (any :class:`FrozenPrefixSource`), if any: its
            ``frozen_prefix`` is the default depth, a depth beyond it is refused, and it puts the frozen prefix's
            blocks in eval mode before the check (:meth:`~layerfreeze.engine.Freezer.eval_frozen`), as its forward
            pre-hook would if the prefix ran.
        fallback: On a refusal (stochastic prefix, changed inputs), warn once, turn the cache off for good and run
            the full forward, instead of raising :class:`CacheRefused`.
        on_disable: Called with the reason when ``fallback`` turns the cache off (the trainer logs a ``cache_off``
            event).
        input_key: The batch key holding the model input, for a family whose input key is not fixed
            (``nn.Sequential``: ``batch["x"]`` with ``input_key="x"``). Default: ``"pixel_values"`` when the batch
            has it, else the batch's one tensor that is neither ``"index"`` nor a label (``"labels"``, ``"label"``,
            ``"y"``, ``"target"``, ``"targets"``), found on the first call.
        policy: What to store and keep (:class:`CachePolicy`); None (default): every miss is stored, entries stay
            until a deeper one replaces them or a thaw or a weight change drops them.

    Counters (samples unless said): ``prefix_samples`` (computed from the input), ``extend_samples`` (carried from
    an older boundary), ``full_forwards`` (calls that ran the model's own forward: depth 0 or cache off),
    ``invalidations`` (entries dropped because a prefix block's weights changed); the cache has ``hits`` /
    ``misses``. ``saved_seconds`` estimates the prefix forward time the cache avoided: per boundary depth ``d``, the
    measured seconds per sample of computing blocks ``0..d-1`` (timed when the cache computes them: the whole prefix,
    or an older boundary's cost plus the extension's) times the samples served at ``d`` from the cache, plus, for
    samples extended from an older boundary ``a``, the cost up to ``a``. It leaves out the cache's own overhead
    (lookups, copies, checks), which the trainer's measured step times include.

    Under FSDP2 (a model sharded over several ranks, e.g. by :func:`~layerfreeze.distributed.shard_blocks`) every
    block's forward is a collective (the all-gather of its shards), so every rank must run the same blocks: each
    call, the ranks agree (one ``all_gather_object``) on what all of them run. Only hits anywhere: the prefix runs
    nowhere (what saves its all-gathers). Misses on some rank: every rank runs the same computation (an extension
    from an older boundary when every rank can extend from the same one, else the prefix from the inputs; a rank
    without misses drops the result), which gives each row the same bits as computing it alone (see "Equality").
    A refusal on any rank (a stochastic prefix, changed inputs) turns the cache off on every rank, or raises on
    every rank. The first call runs the model's own forward once (no grad, eval mode, modes restored after; see
    :meth:`warm_up`), because FSDP2 needs its root module to run first.

    Raises (constructor):
        ValueError: neither ``blocks`` nor ``freezer``; the model's family has no split
            (:func:`~layerfreeze.models.discovery.split_for`); an ``input_key`` the model's family does not read (its
            input keys are fixed); a sharded model whose root FSDP2 group holds parameters
            (:func:`~layerfreeze.distributed.fsdp.root_parameters`: only the root module's forward gathers them,
            and the split runs the blocks one by one).
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[Block] | None = None,
        split: ModelSplit | None = None,
        cache: ActivationCache | None = None,
        *,
        freezer: FrozenPrefixSource | None = None,
        fallback: bool = False,
        on_disable: Callable[[str], None] | None = None,
        input_key: str | None = None,
        policy: CachePolicy | None = None,
    ) -> None:
        if blocks is None:
            if freezer is None:
                raise ValueError("CachedPrefix needs the model's blocks or the freezer= that holds them")
            blocks = freezer.blocks
        self.model = model
        self.blocks = list(blocks)
        # the input key is found in the first batch for a split of ours whose family lets it be named
        self._find_input_key = split is None and input_key is None
        if split is None:
            split = split_for(model, self.blocks, **({"input_key": input_key} if input_key is not None else {}))
            if input_key is not None and input_key not in split.input_keys:
                raise ValueError(
                    f"CachedPrefix(input_key={input_key!r}): the {split.family} split reads the batch keys "
                    f"{', '.join(split.input_keys)}, which are fixed for this family; leave input_key out")
            self._find_input_key = self._find_input_key and names_its_input(split)
        self.split = split
        self.cache = cache if cache is not None else ActivationCache()
        self.freezer = freezer
        self.fallback = fallback
        self.on_disable = on_disable
        self.policy = policy
        self.disabled: str | None = None
        self.prefix_samples = 0
        self.extend_samples = 0
        self.full_forwards = 0
        self.invalidations = 0
        self.saved_seconds = 0.0
        self._cost: dict[int, float] = {}  # depth -> measured seconds per sample to compute blocks 0..depth-1
        self._fingerprints: dict[int, torch.Tensor] = {}
        self._print_bytes = 0  # bytes of the fingerprints (each its own storage)
        self._signatures: dict[int, tuple[tuple[Any, ...], ...]] = {}
        #: The autocast state the cache was filled under (:func:`precision_key`; None until its first forward): a
        #: forward under another one runs the full forward.
        self.precision: tuple[bool, torch.dtype | None] | None = None
        self._precision_warned = False
        #: FSDP2 over several ranks: every call is agreed on by all ranks (see the class docstring).
        self.sharded = bool(fsdp_modules(model)) and comm.is_distributed()
        self._warm = not self.sharded
        if self.sharded:
            held = root_parameters(model)
            if held:
                raise ValueError(
                    f"the model's root FSDP2 group holds parameters ({', '.join(held[:4])}): only the root module's "
                    "forward gathers them, and the cached forward runs the blocks one by one. Shard each block's "
                    "modules (layerfreeze.distributed.shard_blocks) with every parameter inside a block's modules, "
                    "or train without the cache")

    def __call__(self, batch: dict[str, Any], depth: int | None = None, *,
                 host_batch: dict[str, Any] | None = None) -> torch.Tensor:
        return self.forward(batch, depth, host_batch=host_batch)

    def forward(self, batch: dict[str, Any], depth: int | None = None, *,
                host_batch: dict[str, Any] | None = None) -> torch.Tensor:
        """Logits ``(B, num_classes)`` for ``batch``, with blocks ``0..depth-1`` served from the cache.

        Args:
            batch: A collated batch with ``"index"`` (``(B,)`` sample positions) and the model inputs.
            depth: Frozen prefix length; default ``freezer.frozen_prefix``. Depth 0 runs the full forward.
            host_batch: The same batch as it was on the host before it was moved to the device (the CLI trainer
                gives it): the inputs' fingerprints are taken from it, so the check of a hit reads nothing back from
                the device (on a GPU that read is a host synchronisation every step, issue 40). Fingerprints taken
                on the host and on the device agree to far better than the check's tolerance (float64 sums).

        Raises:
            CacheRefused: a stochastic prefix module, a trainable prefix parameter, or a sample whose inputs
                changed since it was cached (unless ``fallback``).
            ValueError: no ``depth`` and no freezer; ``depth`` beyond the freezer's frozen prefix; no ``"index"``
                (unless ``fallback``: the cache turns itself off); an ``"index"`` that is not one integer per sample
                (:func:`~layerfreeze.compute.batch_inputs.batch_indices`).
            TypeError: ``batch`` is not a dict (a tuple batch).
        """
        if depth is None:
            if self.freezer is None:
                raise ValueError("CachedPrefix.forward needs a depth when it has no freezer")
            depth = self.freezer.frozen_prefix
        depth = min(int(depth), self.split.max_depth)
        self._check_input_keys(batch)
        if depth == 0 or self.disabled is not None:
            self.full_forwards += 1
            self._warm = True
            return self.split.full(self.model, batch)
        if "index" not in batch:
            return self._refused(ValueError(
                "the batch has no 'index' (each sample's position in its dataset, e.g. {'index': i} in the dataset's "
                f"items); its keys: {', '.join(map(str, batch))}. The activation cache is keyed by it"), batch)
        if not self._same_precision(batch):
            self.full_forwards += 1
            return self.split.full(self.model, batch)
        if not self._warm:
            self.warm_up(batch)
        refused: CacheRefused | None = None
        plan: _Plan | None = None
        try:
            self._check_prefix(depth)
            self._check_weights(depth)
            if self.cache.depth != depth:
                self.cache.advance(depth)
                self._prune()
            indices = batch_indices(batch, self.split.input_keys[0])
            self._check_inputs(indices, batch if host_batch is None else host_batch)
            plan = self._plan(batch, indices, depth)
        except CacheRefused as exc:
            refused = exc
        if self.sharded:
            refused, plan = self._agree(refused, plan)
        if refused is not None:
            return self._refused(refused, batch)
        if self.freezer is not None:  # demote offload="cpu": the served prefix's weights leave the device (no-op else)
            self.freezer.offload_prefix(depth)
        try:
            state = self._states(batch, plan, depth)
        except CacheRefused as exc:  # the prefix drew random numbers as it ran (determinism.refuse_random_draws)
            return self._refused(exc, batch)
        return self.split.suffix(self.model, state, batch, depth)

    def _refused(self, why: Exception, batch: dict[str, Any]) -> torch.Tensor:
        """Raise ``why``, or with ``fallback`` turn the cache off for good and run the full forward."""
        if not self.fallback:
            raise why
        self._turn_off(str(why))
        self.full_forwards += 1
        return self.split.full(self.model, batch)

    @torch.no_grad()
    def warm_up(self, batch: dict[str, Any]) -> None:
        """Run the model's own forward on ``batch`` once, without grad, in eval mode (every module's mode restored
        after), then reshard every FSDP2 module: FSDP2 takes the first of its modules to run forward as its root,
        and refuses a forward of the real root after one of an inner module ("FSDP requires running forward
        through the root module first"), which the split's stages are. A no-op unsharded or once done; the first
        call of :meth:`forward` does it otherwise (call it yourself before measuring a step). A collective under
        FSDP2: every rank calls it at the same point."""
        if self._warm:
            return
        self._check_input_keys(batch)
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            self.split.full(self.model, batch)
        finally:
            for m, training in modes:
                m.training = training
        reshard_all(fsdp_modules(self.model))
        # under the caller's autocast, its cache kept this no-grad pass's casts of FSDP2's unsharded weights (the
        # same Parameter objects at every all-gather): the step's forward reused them and the blocks after the first
        # trainable one got no gradient
        torch.clear_autocast_cache()
        self._warm = True

    # ---- checks --------------------------------------------------------------------------------------------

    def _check_input_keys(self, batch: dict[str, Any]) -> None:
        """The split's input is in ``batch`` (:func:`~layerfreeze.compute.batch_inputs.resolve_input_key`; its
        TypeError and ValueError); on the first call, its input key is found if the family lets it be named."""
        self.split = resolve_input_key(self.split, self.model, self.blocks, batch, find=self._find_input_key)
        self._find_input_key = False  # found (or the default one is there): a refused batch keeps the search on

    def _same_precision(self, batch: dict[str, Any]) -> bool:
        """Whether this forward runs under the autocast state the cache was filled under (the first one is taken;
        :func:`~layerfreeze.compute.determinism.precision_warning` says what the first one that does not is)."""
        first = batch[self.split.input_keys[0]]
        key = precision_key(first.device if isinstance(first, torch.Tensor) else torch.device("cpu"))
        self.precision = key if self.precision is None else self.precision
        if not self._precision_warned and (why := precision_warning(self.model, key, self.precision)) is not None:
            self._precision_warned = True
            warnings.warn(why, stacklevel=3)
        return key == self.precision

    def _check_prefix(self, depth: int) -> None:
        if self.freezer is not None:
            if self.freezer.frozen_prefix < depth:
                raise ValueError(
                    f"depth {depth} is beyond the frozen prefix ({self.freezer.frozen_prefix} blocks): a trainable "
                    "block's output cannot be cached"
                )
            self.freezer.eval_frozen(depth)  # the prefix may not run, so its eval-mode pre-hooks may not either
        modules = self.split.prefix_modules(self.model, depth)
        try:
            check_prefix_deterministic(self.blocks, depth, modules)
        except CacheRefused as exc:
            hint = "" if self.freezer is not None else (
                " (if a Freezer froze these blocks, pass freezer= to CachedPrefix: it puts them in eval mode)"
            )
            raise CacheRefused(f"{exc}{hint}") from None
        named = [(f"{name}.{pname}", p) for name, module in modules for pname, p in module.named_parameters()]
        named += [item for block in self.blocks[:depth] for item in block.params]  # a class token, ...
        for name, p in named:
            if p.requires_grad:
                raise CacheRefused(
                    f"parameter '{name}' in the cached prefix (depth {depth}) requires grad: it trains, "
                    "so its block's output changes every step. Cache only a frozen prefix"
                )

    def _check_weights(self, depth: int) -> None:
        """Drop entries computed through a prefix block whose parameters or buffers changed since."""
        for block in self.blocks[:depth]:
            sig = _signature(block)
            old = self._signatures.get(block.index)
            if old is not None and old != sig:
                self.invalidations += self.cache.drop_deeper_than(block.index)
            self._signatures[block.index] = sig

    def _check_inputs(self, indices: list[int], batch: dict[str, Any]) -> None:
        prints = self.split.fingerprint(batch).detach().cpu()
        for pos, index in enumerate(indices):
            old = self._fingerprints.get(index)
            if old is not None and not torch.allclose(old, prints[pos], rtol=1e-9, atol=1e-9):
                raise CacheRefused(CHANGED_INPUTS.format(index=index))
        for pos, index in enumerate(indices):
            # a copy, not a view: a view would keep its whole batch's prints alive for as long as any one of them
            new = prints[pos].clone()
            old = self._fingerprints.get(index)
            self._print_bytes += _nbytes(new) - (0 if old is None else _nbytes(old))
            self._fingerprints[index] = new

    def _prune(self) -> None:
        """The boundary moved: free the entries of samples the run does not visit again (policy only)."""
        if self.policy is None:
            return
        for index in self.cache.indices():
            if not self.policy.read_again(index):
                for d in self.cache.depths(index):
                    self.policy.freed += self.cache.drop(index, d)

    def _turn_off(self, reason: str) -> None:
        self.disabled = reason
        self.cache.close()  # its folder too: off for good (and a full disk gets its space back)
        if self.freezer is not None:
            self.freezer.offload_prefix(0)  # nothing is served from now on: offloaded weights come back
        warnings.warn(f"activation cache turned off, running the full forward from now on: {reason}",
                      RuntimeWarning, stacklevel=3)
        if self.on_disable is not None:
            self.on_disable(reason)

    # ---- states --------------------------------------------------------------------------------------------

    def _plan(self, batch: dict[str, Any], indices: list[int], depth: int) -> _Plan:
        """Look the batch up (hits counted here, once) and decide how its misses would be computed: from the
        entries of one common older boundary (``start > 0``, their states read now), else from the inputs."""
        first = batch[self.split.input_keys[0]]
        device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
        found = self.cache.lookup(indices, depth)
        miss = [p for p, t in enumerate(found) if t is None]
        plan = _Plan(indices, found, miss, device)
        if not miss:
            return plan
        # Misses are computed at the whole batch's shape, never on a sub-batch of the misses: a kernel may round a
        # row differently when the number of rows (or the padded length) changes, and which rows miss depends on
        # the cache's history -- a resumed run starts cold where the uninterrupted one extended from an older
        # boundary. At the batch's shape a row's state depends on that row only, so a cached, an uncached and a
        # resumed run compute every state alike (bit for bit in float32; tests/test_faults.py). When every miss has
        # an entry at the same older boundary, one extension from it at the batch's shape serves them; otherwise
        # (a miss without any entry, or misses at different boundaries) one prefix of the whole batch does, whose
        # rows equal the extensions' (split.extend's contract). Either way a batch costs at most one prefix.
        starts = {max((d for d in self.cache.depths(indices[p]) if d < depth), default=0) for p in miss}
        start = starts.pop() if len(starts) == 1 else 0
        if start > 0:
            plan.old = self.cache.get_batch([indices[p] for p in miss], start, device=device, count=False,
                                            pad_to=self.split.padded_length(batch, start))
            plan.start = start if plan.old is not None else 0  # lost to a corrupt shard just now: from the inputs
        return plan

    def _agree(self, refused: CacheRefused | None, plan: _Plan | None) -> tuple[CacheRefused | None, _Plan | None]:
        """What every rank does this call (FSDP2: each prefix block's forward is a collective). One
        ``all_gather_object`` of each rank's refusal (or None) and need (None: only hits; else the boundary its
        misses would start from, 0 for the inputs). A refusal anywhere is everybody's; else the prefix runs nowhere
        (only hits), everywhere from one common boundary (every rank has misses and the same start), or everywhere
        from the inputs (a rank with nothing to compute computes and drops it, ``plan.compute_only``)."""
        need = None if plan is None or not plan.miss else plan.start
        votes = comm.all_gather_object((None if refused is None else str(refused), need))
        for r, (reason, _) in enumerate(votes):
            if reason is not None:
                return (refused if refused is not None else CacheRefused(f"rank {r}: {reason}")), None
        needs = [n for _, n in votes]
        assert plan is not None
        if all(n is None for n in needs):
            return None, plan
        starts = set(needs)
        plan.start = starts.pop() if len(starts) == 1 else 0  # every rank the same start: extend; else the inputs
        if plan.start == 0:
            plan.old = None
        plan.compute_only = not plan.miss
        return None, plan

    def _states(self, batch: dict[str, Any], plan: _Plan, depth: int) -> torch.Tensor:
        """The boundary states ``(B, ...)`` of the batch: hits from the cache, misses computed (as ``plan`` says)
        and stored."""
        indices, found, miss, device = plan.indices, plan.found, plan.miss, plan.device
        size = len(indices)
        pad_to = self.split.padded_length(batch, depth)
        hit = [p for p, t in enumerate(found) if t is not None]
        hit_states = None
        if hit:
            self.saved_seconds += len(hit) * self._cost.get(depth, 0.0)
            rows = [found[p] for p in hit]
            if pad_to is not None:
                rows = [pad_dim0(t, pad_to) for t in rows]  # type: ignore[arg-type]
            # non_blocking: a blocking copy to a GPU synchronises the stream (the rows stay alive until it is done)
            hit_states = torch.stack(rows).to(device, non_blocking=True)  # type: ignore[arg-type]
            if self.policy is not None:  # a last read: its bytes go back now
                for p in hit:
                    if not self.policy.read_again(indices[p]):
                        self.policy.freed += self.cache.drop(indices[p], depth)
            if not miss and not plan.compute_only:
                return hit_states
        rows = _on_device(miss, device)
        t0 = _now(device)
        extend = plan.start > 0 and plan.old is not None
        with refuse_random_draws(depth):  # a stochastic module check_prefix_deterministic does not know
            if extend:
                old = plan.old
                filler = old[:1].expand(size, *old.shape[1:]).clone()  # the other rows: any state, then dropped
                filler[rows] = old
                states = self.split.extend(self.model, filler, batch, plan.start, depth)
            else:  # no common older entry (or it was lost to a corrupt shard just now): the whole batch's prefix
                states = self.split.prefix(self.model, batch, depth)
        if extend:
            self.extend_samples += len(miss)
            base = self._cost.get(plan.start, 0.0)
            self.saved_seconds += len(miss) * base
        else:
            self.prefix_samples += len(miss)
            base = 0.0
        if plan.compute_only:  # FSDP2: computed because another rank had misses; this rank's rows are all hits
            return hit_states
        self._record_cost(depth, base + (_now(device) - t0) / size)
        lengths = self.split.lengths(batch, depth)
        keep = miss
        if self.policy is not None:
            keep = [p for p in miss if self.policy.stores(indices[p])]
            for p in miss:  # a sample not visited again: its older entry (extended just now) is read for the last time
                if not self.policy.read_again(indices[p]):
                    for d in self.cache.depths(indices[p]):
                        self.policy.freed += self.cache.drop(indices[p], d)
        if keep:
            at = _on_device(keep, device)
            try:
                self.cache.put_batch([indices[p] for p in keep], depth, states[at],
                                     None if lengths is None else lengths[torch.tensor(keep)])
            except CacheWriteError as exc:  # a full disk: the states are right, only storing them failed
                if not self.fallback:
                    raise
                self._turn_off(exc.reason)  # it turns itself off: the advice to let it is not for here
        if hit_states is not None:  # states holds every row at the batch's shape; the hits replace theirs
            states = states.clone()
            states[_on_device(hit, states.device)] = hit_states.to(states.dtype)
        return states

    def _record_cost(self, depth: int, per_sample: float) -> None:
        """Running estimate of the per-sample cost of blocks ``0..depth-1`` (an exponential mean: the first batches
        of a depth pay one-off allocation costs)."""
        old = self._cost.get(depth)
        self._cost[depth] = per_sample if old is None else 0.8 * old + 0.2 * per_sample

    #: The :meth:`summary` counters that add up across processes (a resumed run carries them in its checkpoint).
    RUN_COUNTERS = ("hits", "misses", "saved_seconds")

    def summary(self, carried: dict[str, float] | None = None) -> dict[str, Any]:
        """What the cache did, for a run's summary: ``used`` (False once turned off; ``disabled`` says why),
        ``hits`` / ``misses`` (sample lookups; both 0: on but idle, no frozen prefix ever ran through it),
        ``hit_rate``, ``memory_bytes`` / ``disk_bytes`` / ``budget_bytes``, ``saved_seconds`` (see the class
        docstring), ``corrupt_shards``; with a :class:`CachePolicy`, its counters (``policy_skipped_last``,
        ``policy_skipped_unstable``, ``policy_freed``: this process's).

        Args:
            carried: :data:`RUN_COUNTERS` of the processes before this one (a resumed run's checkpoint), added to
                this process's own before ``hit_rate`` is taken; the sizes are this process's.
        """
        s = self.stats()
        hits, misses, saved = (s[k] + (carried or {}).get(k, 0) for k in self.RUN_COUNTERS)
        lookups = hits + misses
        return {"used": s["disabled"] is None, "disabled": s["disabled"], "hits": hits, "misses": misses,
                "hit_rate": hits / lookups if lookups else None, "memory_bytes": s["memory_bytes"],
                "disk_bytes": s["disk_bytes"], "budget_bytes": s["budget_bytes"], "saved_seconds": saved,
                "corrupt_shards": s["corrupt_shards"],
                **(self.policy.stats() if self.policy is not None else {})}

    def ledger_bytes(self) -> dict[str, dict[str, int]]:
        """What the cache holds, for the memory ledger (:class:`~layerfreeze.runs.ledger.MemoryLedger`'s byte-source
        protocol): the store's entries in host memory and on disk
        (:meth:`~layerfreeze.compute.store.ActivationCache.ledger_bytes`), plus the per-sample input fingerprints the
        hits are checked against (host memory)."""
        out = self.cache.ledger_bytes()
        out[Bucket.CACHE_MEMORY]["cpu"] = out[Bucket.CACHE_MEMORY].get("cpu", 0) + self._print_bytes
        return out

    def stats(self) -> dict[str, Any]:
        """Counters (samples) and cache sizes (bytes), for logs."""
        return {
            **self.cache.stats(),
            **(self.policy.stats() if self.policy is not None else {}),
            "prefix_samples": self.prefix_samples,
            "extend_samples": self.extend_samples,
            "full_forwards": self.full_forwards,
            "invalidations": self.invalidations,
            "saved_seconds": self.saved_seconds,
            "disabled": self.disabled,
        }

    def run_counts(self, carried: dict[str, float] | None = None) -> dict[str, float]:
        """:data:`RUN_COUNTERS` over the whole run (``carried``: those of the processes before this one), what a
        checkpoint keeps so a resumed run's summary counts every lookup once."""
        whole = self.summary(carried)
        return {k: whole[k] for k in self.RUN_COUNTERS}

    def epoch_fields(self, carried: dict[str, float] | None = None) -> dict[str, Any]:
        """The numeric :meth:`stats` as ``cache_<name>`` fields of an epoch record (``cache_disabled``: why, once
        the cache is off): :data:`RUN_COUNTERS` over the whole run (``carried``: those of the processes before this
        one, as :meth:`summary` counts them), the others this process's."""
        stats = {**self.stats(), **self.run_counts(carried)}
        fields = {f"cache_{k}": v for k, v in stats.items() if isinstance(v, (int, float))}
        if self.disabled:
            fields["cache_disabled"] = self.disabled
        return fields
