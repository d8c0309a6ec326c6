"""Checks that a freeze stays a freeze and that training does what the frozen set says.

Four silent faults this module turns into warnings or errors (each seen in real training code):

* **A re-wrapped frozen parameter.** ``block.weight = nn.Parameter(block.weight.data)`` (dtype or quantization
  conversions, some loaders, weight tying done late) creates a new ``Parameter`` with ``requires_grad=True``: the
  frozen block silently gets gradients again and backward runs through the whole prefix. :meth:`FrozenSet.check`
  (every optimizer step, O(parameters), no tensor work) finds every frozen block's parameter that is not the object
  frozen, requires grad, or is in the optimizer, re-freezes it and warns naming it (or raises, by option). A step
  where nothing could have changed skips the walk (the quick path below).
* **A frozen weight that moved** (an in-place update outside the optimizer, a loader, a bug): a checksum of each
  frozen block (BLAKE2b of its parameters' bytes) is taken when it freezes and verified by
  :meth:`FrozenSet.verify_checksums` (the trainer calls it at every checkpoint and at the end of the run):
  :class:`FrozenWeightsChangedError` names the block and the parameter. For a demoted block
  (:mod:`layerfreeze.engine.demote`) the checksum covers what is kept, the float32 master copy a thaw restores, and
  the demoted weights in use must be exactly its cast.
* **A trainable block that gets no gradient**: after each change of the frozen set, the first backward is checked
  (:meth:`FrozenSet.check_gradients`); a trainable block none of whose parameters got a gradient is a warning naming
  it and the usual causes (an input computed under ``no_grad`` or detached; reentrant gradient checkpointing whose
  input does not require grad because the prefix before it is frozen, transformers #21381; an unused module).
* **A block switched on that the optimizer does not update**: after a thaw, the first backward records which of
  the thawed block's parameters got a gradient (and a few of their values where the gradient is largest), and the
  next :meth:`FrozenSet.check_updated` (the Freezer's ``step()``, after ``optimizer.step()``) warns naming the block
  when none of them changed. The fault of an optimizer that does not hold what was switched on: DeepSpeed ZeRO-3
  builds its partitions once, so a layer switched on later was never updated (DeepSpeed#5639, under LISA and BAdam
  callbacks); a callback that froze layers before the Trainer built its optimizer trained nothing it switched on
  (LMFlow#726). The engine's own thaw puts a block back into its param group, so with a ``torch.optim`` optimizer
  this cannot happen; the check is for optimizers that keep their own copy of the parameter list.

None of the checks reads a device tensor on the host on a step without a stage, except the last one's comparison
after an optimizer step that left the version counters alone (fused optimizers; issue 40). :meth:`FrozenSet.check`
runs every step, so it has a quick path: when no module of the process registered a parameter, submodule or buffer
since the last full check (:func:`~layerfreeze.engine.params.structure_version`), the optimizer is the same object
holding as many parameters, no block froze or thawed, and no frozen parameter requires grad, nothing it looks for can
have happened and the walk is skipped. Not seen by the quick path until the next full check (a freeze, a thaw, any
registration): a parameter swapped into a param group for another one (same count), a parameter written into
``module._parameters`` directly. On an FSDP2-sharded model (which swaps parameters that way) every step walks.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from layerfreeze.engine.params import install_hooks, structure_version


class FrozenWeightsChangedError(RuntimeError):
    """A frozen block's weights differ from their checksum taken when it froze."""


class UnfrozenParameterError(RuntimeError):
    """A frozen block's parameter was replaced or made trainable again (raised when ``on_unfrozen="error"``)."""


class RanksDivergedError(RuntimeError):
    """A thawed block's weights differ across data-parallel ranks after the step that followed its thaw."""


class BlockModuleReplacedError(UnfrozenParameterError):
    """A block's module, or a parameter the block holds outside its modules, is no longer part of the model: it was
    replaced (``model.layer[0] = nn.Linear(...)``) after the Freezer was built (raised whatever ``on_unfrozen``)."""


def replaced_parts(model: nn.Module, blocks: Iterable[Any]) -> list[str]:
    """What of ``blocks`` the model no longer holds: ``"<module name> (block <name>)"`` for each block module not
    among ``model.modules()`` and each of a block's own parameters (``Block.params``) not among its parameters.
    Identity, not names: a module wrapped in place (activation checkpointing's wrapper) is still found."""
    modules = {id(m) for m in model.modules()}
    params = {id(p) for p in model.parameters()}
    gone = [f"{name or '(the model)'} (block {block.name!r})" for block in blocks for name, m in block.modules
            if id(m) not in modules]
    gone += [f"{name} (block {block.name!r})" for block in blocks for name, p in block.params if id(p) not in params]
    return gone


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor's local data (a DTensor's shard under FSDP2), on the CPU, as raw bytes."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.detach().reshape(-1).contiguous().cpu().view(torch.uint8)


#: Values of each parameter a thawed block's check compares before and after the next optimizer step.
PROBE_VALUES = 8


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class _Probe:
    """One parameter of a thawed block, as it was after the backward that gave it a gradient: its version counter
    and its values at the positions of the largest gradients (``where``, on its device)."""

    param: nn.Parameter
    version: int
    where: torch.Tensor
    values: torch.Tensor

    def changed(self) -> bool:
        """True when the parameter was written in place since (its version counter moved: ``torch.optim``'s
        for-loop and foreach steps), or one of the probed values differs (fused steps do not move the counter)."""
        if self.param._version != self.version:
            return True
        now = _local_tensor(self.param).detach().reshape(-1)[self.where]
        return not torch.equal(now, self.values)  # a host read: only after a step that moved no version counter


def _bits_sum(t: torch.Tensor) -> int:
    """The sum of ``t``'s elements read as integers of their size (on its device; one host read): equal tensors give
    equal sums whatever the reduction order or thread count (integer addition, modulo 2**64), where a float sum's
    rounding could differ between ranks."""
    flat = t.detach().contiguous().reshape(-1)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(flat.element_size(), torch.uint8)
    return int(flat.view(ints).sum(dtype=torch.int64).item())


def checksum(named: Iterable[tuple[str, torch.Tensor]],
             gather: Callable[[Any], list[Any]] | None = None) -> dict[str, str]:
    """``{name: BLAKE2b-128 hex digest of the tensor's bytes}`` (bitwise: any change of any element changes it).

    Args:
        gather: For sharded tensors (FSDP2): a collective that returns every rank's object in rank order
            (:func:`~layerfreeze.distributed.all_gather_object`). Each rank hashes its own shard, and the digests of
            all ranks are hashed together into one, ``"shards<N>:<hex>"``, the same on every rank (so a checkpoint
            written by rank 0 holds what every rank verifies against). The ``shards<N>`` tag names the layout: a
            digest taken on another number of ranks is not comparable (:meth:`FrozenSet.load_state_dict`).
    """
    local = {name: hashlib.blake2b(_local(t).numpy().tobytes(), digest_size=16).hexdigest() for name, t in named}
    if gather is None:
        return local
    ranks = gather(local)
    return {name: f"shards{len(ranks)}:" + hashlib.blake2b("".join(r[name] for r in ranks).encode(),
                                                            digest_size=16).hexdigest() for name in local}


def _layout(digest: str) -> str:
    """``"shards<N>"`` for a digest of :func:`checksum` with ``gather``, ``""`` for one of whole tensors."""
    return digest.split(":", 1)[0] if ":" in digest else ""


class FrozenSet:
    """What each frozen block froze (the parameter objects and their checksums), for the checks above.

    Args:
        on_unfrozen: ``"warn"`` (re-freeze and warn) or ``"error"`` (raise :class:`UnfrozenParameterError`).
        warn: Where warnings go: ``warn(message, record)`` (the Freezer sends them to ``warnings`` and its
            ``on_event`` callback, so the CLI logs them as events).
        quick: Let :meth:`check` skip its walk when nothing can have changed (the module docstring); False walks on
            every call (the Freezer's choice on an FSDP2-sharded model).

    Raises:
        ValueError: an unknown ``on_unfrozen``.
    """

    def __init__(self, on_unfrozen: str = "warn",
                 warn: Callable[[str, dict[str, Any]], None] | None = None,
                 gather: Callable[[Any], list[Any]] | None = None, quick: bool = True) -> None:
        if on_unfrozen not in ("warn", "error"):
            raise ValueError(f"on_unfrozen must be 'warn' or 'error', got {on_unfrozen!r}")
        self.on_unfrozen = on_unfrozen
        self._warn = warn or (lambda message, record: warnings.warn(message, stacklevel=3))
        #: Sharded parameters (FSDP2): the collective that makes checksums the same on every rank (see
        #: :func:`checksum`); :meth:`on_freeze` and :meth:`verify_checksums` are collectives then.
        self.gather = gather
        self.params: dict[int, dict[str, nn.Parameter]] = {}  # block index -> name -> the frozen object
        self.checksums: dict[int, dict[str, str]] = {}
        self.dtypes: dict[int, dict[str, torch.dtype]] = {}  # block index -> name -> dtype its checksum was taken in
        self.gradients_pending = True  # check the next backward (the run starts with a new frozen set)
        self.switched_on: set[int] = set()  # blocks thawed since the last gradient check
        self.awaiting_update: dict[int, list[_Probe]] = {}  # thawed blocks with gradients, until the next step
        self.thawed_unchecked: set[int] = set()  # thawed blocks not compared across ranks yet (check_ranks_agree)
        self.quick = quick
        if quick:
            install_hooks()  # what structure_version counts
        self._changes = 0  # freezes, thaws and loads: a full check is due after each
        self._checked: tuple[Any, ...] | None = None  # what the last full check saw (_state)
        self._watched: list[nn.Parameter] = []  # the frozen parameters it found, for their requires_grad
        self._structure_seen: int | None = None  # structure_version at the last look for replaced block modules
        #: Full walks :meth:`check` did (the quick path skips the others; tests read it).
        self.full_checks = 0

    def on_freeze(self, index: int, named: list[tuple[str, nn.Parameter]]) -> None:
        self._changes += 1
        self.params[index] = dict(named)
        self.checksums[index] = checksum(named, self.gather)
        self.dtypes[index] = {n: t.dtype for n, t in named}
        self.gradients_pending = True
        self.switched_on.discard(index)
        self.awaiting_update.pop(index, None)
        self.thawed_unchecked.discard(index)

    def retake(self, index: int, named: list[tuple[str, nn.Parameter]]) -> None:
        """Take the checksum of ``named`` (parameters that replaced others in frozen block ``index``) anew."""
        if index in self.checksums:
            self.checksums[index].update(checksum(named, self.gather))
            self.dtypes.setdefault(index, {}).update((n, t.dtype) for n, t in named)
            self.params.setdefault(index, {}).update(named)

    def on_thaw(self, index: int) -> None:
        self._changes += 1
        self.params.pop(index, None)
        self.checksums.pop(index, None)
        self.dtypes.pop(index, None)
        self.gradients_pending = True
        self.switched_on.add(index)
        self.thawed_unchecked.add(index)

    def check(self, freezer: Any) -> list[str]:
        """Re-freeze every frozen block's parameter that was replaced, made trainable or put back in the optimizer.

        Returns:
            The names of the parameters re-frozen.

        Raises:
            UnfrozenParameterError: with ``on_unfrozen="error"``.
        """
        if self.quick and self._checked is not None and self._checked == self._state(freezer) \
                and not any(p.requires_grad for p in self._watched):
            return []  # nothing it looks for can have happened since the last full check (module docstring)
        fixed = self._full_check(freezer)
        if self.quick:
            self._checked = self._state(freezer)
            self._watched = [p for frozen in self.params.values() for p in frozen.values()]
        return fixed

    def _state(self, freezer: Any) -> tuple[Any, ...]:
        """What :meth:`check`'s quick path compares: the structure version, the optimizer and how many parameters it
        holds, and the freezes and thaws so far."""
        optimizer = freezer.optimizer
        held = sum(len(g["params"]) for g in optimizer.param_groups) if optimizer is not None else 0
        return structure_version(), id(optimizer), held, self._changes

    def _full_check(self, freezer: Any) -> list[str]:
        """:meth:`check`'s walk over every frozen block's parameters (and, after any registration, over the model's
        modules for replaced block modules).

        Raises:
            BlockModuleReplacedError: a block's module was replaced since the Freezer was built.
        """
        self.full_checks += 1
        if not self.quick or structure_version() != self._structure_seen:
            self._structure_seen = structure_version()
            gone = replaced_parts(freezer.model, freezer.blocks)
            if gone:  # frozen: the new module would train unseen; trainable: it is in no block and no param group
                raise BlockModuleReplacedError(
                    f"{', '.join(gone)} is no longer in the model: it was replaced after the Freezer was built, and "
                    "the Freezer (its frozen set, checks, cache) and the optimizer still hold the old one. Replace "
                    "modules before building the optimizer and the Freezer, or close this Freezer and build both "
                    "again on the changed model")
        in_optimizer = ({id(p) for g in freezer.optimizer.param_groups for p in g["params"]}
                        if freezer.optimizer is not None else set())
        fixed = []
        for index, frozen in self.params.items():
            block = freezer.blocks[index]
            for name, p in freezer.named_frozen_parameters(block):
                old = frozen.get(name)
                if old is p and not p.requires_grad and id(p) not in in_optimizer:
                    continue
                what = ("was replaced by a new Parameter" if old is not p else
                        "requires grad again" if p.requires_grad else "is back in the optimizer")
                message = (f"parameter {name!r} of frozen block {block.name!r} {what}: it would train (and "
                           "backward would run through the frozen prefix)")
                if self.on_unfrozen == "error":
                    raise UnfrozenParameterError(message + "; freeze it again after replacing it, or thaw the block")
                freezer.refreeze_parameter(p, old)
                frozen[name] = p
                fixed.append(name)
                until = " until its block thaws" if what == "requires grad again" else ""
                self._warn(message + f"; re-frozen{until}", {"kind": "refrozen", "block": block.name,
                                                             "parameter": name, "cause": what})
        return fixed

    def verify_checksums(self, freezer: Any) -> None:
        """Compare every frozen block's weights with their checksum from freeze time (bitwise).

        A weight cast to another dtype since its block froze (``model.to(torch.float64)`` after the Freezer was built:
        the bytes differ, whatever the values) gets its checksum taken again in the new dtype, with a warning.

        Raises:
            FrozenWeightsChangedError: naming the block and the parameters that moved.
        """
        for index, expected in self.checksums.items():
            block = freezer.blocks[index]
            kept = getattr(freezer, "kept_frozen_parameters", freezer.named_frozen_parameters)
            named = kept(block)
            now = checksum(named, self.gather)
            moved = sorted(n for n in expected if now.get(n) != expected[n])
            if moved:
                moved = self._recast(block, named, now, moved)
            mismatched = getattr(freezer, "demotion_mismatches", lambda b: [])(block)
            if mismatched:
                raise FrozenWeightsChangedError(
                    f"demoted frozen block {block.name!r}: the weights in use ({', '.join(mismatched)}) are not the "
                    "cast of its float32 master copy: something wrote into the demoted weights")
            if moved:
                raise FrozenWeightsChangedError(
                    f"frozen block {block.name!r} changed since it froze (parameters {', '.join(moved)}): something "
                    "updated it outside the optimizer (an in-place write, a loader, a second optimizer). Its "
                    "checkpoint would not hold the weights that were trained against. If you changed them on purpose "
                    f"(loaded weights into it), thaw and freeze the block again (freezer.thaw({block.index}); "
                    f"freezer.freeze({block.index})): its checksum is then taken from the new weights")

    def _recast(self, block: Any, named: list[tuple[str, torch.Tensor]], now: dict[str, str],
                moved: list[str]) -> list[str]:
        """Of the ``moved`` weights of frozen ``block``, take those cast to another dtype since it froze as they are
        now (their checksum ``now``), with a warning; returns the others (their values moved)."""
        was = self.dtypes.get(block.index, {})
        dtypes = {n: t.dtype for n, t in named}
        cast = [n for n in moved if n in was and n in dtypes and dtypes[n] != was[n]]
        if cast:
            how = ", ".join(sorted({f"{str(was[n]).removeprefix('torch.')} -> {str(dtypes[n]).removeprefix('torch.')}"
                                    for n in cast}))
            self.checksums[block.index].update({n: now[n] for n in cast})
            was.update({n: dtypes[n] for n in cast})
            self._warn(f"frozen block {block.name!r}: {', '.join(cast)} were cast ({how}) since it froze (a "
                       "model.to(dtype) after the Freezer was built); their checksum is taken again in the new dtype, "
                       "so a cast that rounded them is not detected. Cast the model before building the Freezer",
                       {"kind": "frozen_cast", "block": block.name, "parameters": cast})
        return [n for n in moved if n not in cast]

    def check_gradients(self, freezer: Any) -> list[str]:
        """After the first backward since the frozen set changed: the trainable blocks that got no gradient.

        Returns:
            Their names (each also warned about); empty when every trainable block got one or no check was due.
        """
        if not self.gradients_pending:
            return []
        self.gradients_pending = False
        self._probe_switched_on(freezer)
        missing = []
        for block in freezer.blocks:
            if freezer.frozen[block.index]:
                continue
            trainable = [p for p in block.parameters() if p.requires_grad]
            if trainable and all(p.grad is None for p in trainable):
                missing.append(block.name)
        if missing:
            prefix = freezer.frozen_prefix
            cause = ("its input was computed under no_grad or detached, the block is unused in the forward, or "
                     "reentrant gradient checkpointing (use_reentrant=True) got an input that does not require grad")
            if prefix:
                cause += (f" (the frozen prefix of {prefix} block(s) in front of it makes that input not require "
                          "grad: use use_reentrant=False or make the first trainable block's input require grad)")
            self._warn(f"trainable block(s) {', '.join(missing)} got no gradient in the first backward since the "
                       f"frozen set changed; likely cause: {cause}", {"kind": "no_gradient", "blocks": missing})
        return missing

    def _probe_switched_on(self, freezer: Any) -> None:
        """Remember, for each block thawed since the last check, its parameters that got a gradient: their version
        counter and their values at the :data:`PROBE_VALUES` positions of the largest gradient magnitudes (what the
        next optimizer step must change, unless its learning rate is 0). The positions are found on the device
        (``topk``: a fixed shape; ``nonzero`` would read the count on the host, a synchronisation)."""
        for index in sorted(self.switched_on):
            if freezer.frozen[index]:
                continue
            probes = []
            for p in freezer.blocks[index].parameters():
                if not p.requires_grad or p.grad is None:
                    continue
                grad = _local_tensor(p.grad).detach()
                grad = (grad.to_dense() if grad.is_sparse else grad).reshape(-1)  # nn.Embedding(sparse=True)
                where = torch.topk(grad.abs(), min(PROBE_VALUES, grad.numel()), sorted=False).indices
                probes.append(_Probe(p, p._version, where, _local_tensor(p).detach().reshape(-1)[where].clone()))
            if probes:
                self.awaiting_update[index] = probes
        self.switched_on.clear()

    def check_updated(self, freezer: Any) -> list[str]:
        """After the optimizer step that followed a thaw: the thawed blocks that got gradients and that the step did
        not change (each also warned about). A block all of whose param groups have learning rate 0 is not checked.

        Returns:
            Their names; empty when every one changed or no check was due.
        """
        if not self.awaiting_update:
            return []
        stale = []
        groups = freezer.optimizer.param_groups if freezer.optimizer is not None else []
        for index, probes in sorted(self.awaiting_update.items()):
            held = {id(p) for p in freezer.blocks[index].parameters()}
            lrs = [g["lr"] for g in groups if any(id(p) in held for p in g["params"])]
            if lrs and all(lr == 0 for lr in lrs):
                continue
            if not any(probe.changed() for probe in probes):
                stale.append(freezer.blocks[index].name)
        self.awaiting_update.clear()
        if stale:
            self._warn(f"block(s) {', '.join(stale)} were switched on and got gradients, but the optimizer step that "
                       "followed did not change them: the optimizer does not update what was thawed. Likely cause: an "
                       "optimizer that keeps its own list of parameters, built before the thaw (DeepSpeed ZeRO-3, "
                       "DeepSpeed#5639), or one built while they were frozen and that the Freezer was not given "
                       "(LMFlow#726; pass it to Freezer(...) or attach_optimizer); a step skipped by a fp16 GradScaler "
                       "(an inf gradient) gives this warning once too", {"kind": "not_updated", "blocks": stale})
        return stale

    def check_ranks_agree(self, freezer: Any, gather: Callable[[Any], list[Any]]) -> None:
        """After the optimizer step that followed a thaw, on data-parallel ranks that each hold the whole model (DDP):
        the thawed blocks' trainable weights are the same on every rank (each weight's :func:`_bits_sum`). A
        collective (``gather``: every rank's object in rank order); the blocks compared are the thaws' (rank 0's
        decisions, the same on every rank).

        Why: a ``DistributedDataParallel`` built before a thaw all-reduces only what required grad when it was built
        (``accelerator.prepare(model)`` under several processes, a wrapper of one's own): the thawed block trained on
        each rank's gradients alone, and the ranks drifted apart in silence.

        Raises:
            RanksDivergedError: on every rank, naming the blocks and saying what to do.
        """
        blocks = sorted(i for i in self.thawed_unchecked if not freezer.frozen[i])
        self.thawed_unchecked.clear()
        if not blocks:
            return
        # (a sharded weight, a DTensor of tensor parallelism, holds another part on each rank: not compared)
        mine = [[_bits_sum(p) for p in freezer.blocks[i].parameters() if p.requires_grad and not hasattr(p, "to_local")]
                for i in blocks]
        everyone = gather(mine)
        differ = [freezer.blocks[i].name for k, i in enumerate(blocks) if any(r[k] != everyone[0][k] for r in everyone)]
        if differ:
            raise RanksDivergedError(
                f"block(s) {', '.join(differ)} were thawed, and after the optimizer step that followed their weights "
                "differ across ranks: the model's DistributedDataParallel wrapper was built before the thaw and "
                "does not all-reduce their gradients (accelerate's prepare under several processes, or your own "
                "DistributedDataParallel). Wrap the model with layerfreeze.distributed.FreezeDDP instead, or call "
                "layerfreeze.distributed.rebuild_ddp(ddp, freezer) after every freezer.step() that changed "
                "freezer.frozen")

    def state_dict(self) -> dict[str, Any]:
        return {str(i): dict(c) for i, c in self.checksums.items()}

    def dtypes_state_dict(self) -> dict[str, dict[str, str]]:
        """``{block index: {name: dtype}}`` the checksums were taken in (``"torch.float32"``), saved beside them."""
        return {str(i): {n: str(d) for n, d in dtypes.items()} for i, dtypes in self.dtypes.items()}

    def load_state_dict(self, state: dict[str, Any], dtypes: dict[str, dict[str, str]] | None = None) -> None:
        """Take the saved checksums (the weights at freeze time), for blocks frozen in this run too.

        A block whose saved checksums were taken on another layout (sharded over another number of ranks, or
        unsharded: :func:`checksum`) keeps the ones its re-freeze just took from the loaded weights (which the
        checkpoint's SHA-256 verified): digests of other shards are not comparable. So does a weight whose saved dtype
        (``dtypes``, :meth:`dtypes_state_dict`; None for a checkpoint written before it) is not this run's: a float32
        checkpoint resumed into a model cast before the Freezer (``model.to(torch.float64)``) failed every later
        checkpoint's check."""
        self._changes += 1
        for key, sums in state.items():
            mine = self.checksums.get(int(key))
            if mine is None:
                continue
            if {_layout(d) for d in sums.values()} != {_layout(d) for d in mine.values()}:
                continue
            saved, now = (dtypes or {}).get(key, {}), self.dtypes.get(int(key), {})
            cast = {n for n, d in saved.items() if n in now and n in mine and str(now[n]) != d}
            self.checksums[int(key)] = {n: mine[n] if n in cast else d for n, d in sums.items()}
