"""The freezing engine: freeze and thaw blocks of a model as a strategy decides, in any training loop (Freezer).

Strategies decide, the engine applies. The mechanics are small helpers (in the spirit of Lightning's
``BaseFinetuning.freeze`` / ``make_trainable``; the optimizer's part is :mod:`layerfreeze.engine.optim`) and
:class:`Freezer` wires them to a model, an optimizer, its LR scheduler and a strategy::

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, ...)      # before the Freezer
    with Freezer(model, optimizer, scheduler=scheduler, total_steps=steps) as freezer:   # strategy: smartfrz
        for epoch in range(epochs):
            for batch in loader:
                model(**batch).loss.backward()
                freezer.after_backward()      # checks every trainable block got a gradient
                optimizer.step(); scheduler.step(); optimizer.zero_grad(set_to_none=True)
                freezer.step()                # after the scheduler: LR factors apply to this step's LR
            freezer.epoch_end()

What freezing and thawing a block do, and why each part matters: :mod:`layerfreeze.engine.freezing`.

A thawed block's learning rate may be given (discriminative LR; param groups of one block each,
:func:`~layerfreeze.engine.optim.block_param_groups`). A **floor** (``Freezer(..., floor=plan.floor)``,
:meth:`Freezer.pin`) is a set of blocks a memory budget's plan (:mod:`layerfreeze.budget`) keeps frozen from the
first step: a thaw past it would break the budget.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from layerfreeze.distributed import comm
from layerfreeze.engine import lr_factors, optimizer_load, steps
from layerfreeze.engine import state as checkpoint_state
from layerfreeze.engine.arguments import callback, distributed_mode, flag, lr_scheduler, resolve
from layerfreeze.engine.attach import attach_optimizer
from layerfreeze.engine.demote import Demoter, build_demoter
from layerfreeze.engine.demotion import Demotion
from layerfreeze.engine.freezing import freeze_block, refreeze, thaw_asked, warn_if_nothing_trains
from layerfreeze.engine.grad_signal import GradientSums, unsummed
from layerfreeze.engine.guard import StabilityGuard
from layerfreeze.engine.integrity import FrozenSet
from layerfreeze.engine.mechanics import (
    claim_model,
    frozen_before,
    frozen_blocks_to_eval,
    frozen_parameters,
    not_optimized,
    set_eval_mode,
)
from layerfreeze.engine.optim import group_origin
from layerfreeze.engine.params import BlockParams
from layerfreeze.engine.sharding import check_parameters, make_mirror, sharded
from layerfreeze.engine.stages import FLOOR_REASON, prefix_since, report_metric, run_length, stage, start
from layerfreeze.engine.takeover import adopt_origins, closed_record, copied, release_earlier, take_over
from layerfreeze.engine.timing import StepTimes
from layerfreeze.models.blocks import Block, block_by_key
from layerfreeze.strategies import DEFAULT_STRATEGY, Decision, Strategy
from layerfreeze.strategies.base import storage_bytes


class Freezer:
    """Applies a freezing strategy to a model and its optimizer, in any training loop.

    Args:
        model: The model being trained.
        optimizer: Its optimizer (may be None for pure inference-style freezing; then only ``requires_grad``,
            gradients and BatchNorm modes are handled, and learning-rate factors wait for
            :meth:`attach_optimizer`).
        strategy: A :class:`~layerfreeze.strategies.Strategy` or a registered name (``"none"``, ``"static"``...);
            default the package's default, :data:`~layerfreeze.strategies.DEFAULT_STRATEGY` (``"smartfrz"``).
        strategy_params: Parameters for a strategy given by name.
        blocks: Module-name patterns, or ready :class:`~layerfreeze.models.blocks.Block` objects; default: discovered.
        train_bn: Keep BatchNorm layers of frozen blocks training (statistics and affine parameters).
        scheduler: The LR scheduler, if any; its ``base_lrs`` are updated when a thaw sets a learning rate.
        total_steps: Planned optimizer steps of the run; needed by ``smartfrz`` (the default), ``linear`` and
            ``freezeout``, which place their stages by the fraction of training done; ``autofreeze`` takes its
            evaluation interval from it (a tenth of the run; 50 steps, with a warning, without it).
        steps_per_epoch: Optimizer steps per epoch, if known.
        on_event: Called with each freeze/thaw record (a dict), e.g. to log it to telemetry.
        guard: An optional :class:`~layerfreeze.engine.guard.StabilityGuard`; feed it with :meth:`report_metric`.
        floor: Blocks (indices or names) that must stay frozen: frozen before the strategy's start stage and never
            thawed (a memory budget's plan: ``floor=plan.floor``, :func:`layerfreeze.budget.plan_memory`); see
            :meth:`pin`.
        on_unfrozen: What to do when a frozen block's parameter was replaced (``module.weight = nn.Parameter(...)``),
            requires grad again or is back in the optimizer (checked after every step,
            :class:`~layerfreeze.engine.integrity.FrozenSet`): ``"warn"`` re-freezes it and warns naming it, ``"error"``
            raises :class:`~layerfreeze.engine.integrity.UnfrozenParameterError`.
        demote: Demote frozen blocks (:mod:`layerfreeze.engine.demote`): a
            :class:`~layerfreeze.engine.demote.Demotion`, its keyword arguments as a dict (``{"dtype": "bfloat16",
            "master": "disk"}``) or a dtype alone (``"bfloat16"``): each block that freezes is cast to that dtype
            (its float32 master copy kept in host memory or on disk, restored exactly at a thaw) and/or, with
            ``offload="cpu"``, moved to host memory while :meth:`offload_prefix` says the activation cache serves it.
            None (default): frozen blocks keep their weights as they are. Every rank of a distributed run demotes the
            same blocks (the same decisions, the same settings).
        distributed: Decide on rank 0 and broadcast each decision to every rank (``torch.distributed``), so all
            ranks freeze and thaw the same blocks at the same step whatever the strategy looks at. Default: on when
            a process group of more than one rank is initialized. Only rank 0 runs the strategy (its hooks,
            threads and signals); the other ranks apply what it decided. Every rank must create the Freezer and
            call :meth:`step`, :meth:`epoch_end` and :meth:`report_metric` at the same points (they are
            collectives then).
        mirror: For a sharded model (FSDP2) and a strategy that observes the model itself (its ``attach`` reads
            weights or activations: ``smartfrz``, ``egeria``): an unsharded copy of the model, e.g.
            ``copy.deepcopy(model)`` taken *before* ``fully_shard`` / :func:`~layerfreeze.distributed.shard_blocks`
            (FSDP2 modules cannot be copied), ideally on the CPU. Rank 0's strategy observes it instead of the
            sharded model (whose rank-0 shards it could not read whole without a collective the other ranks never
            join): the Freezer sets its parameters to the model's full values before every freezing stage (the
            trainable ones; all of them at the start and after :meth:`load_state_dict`), gathered by every rank
            (:class:`~layerfreeze.distributed.fsdp.Mirror`), and passes the model's forward inputs to its root
            forward pre-hooks (Egeria's probe). Needed on rank 0 only (None elsewhere); ignored for an unsharded
            model or a strategy that does not observe the model.

    The strategy's start stage runs in the constructor, so blocks a strategy freezes from the start are frozen
    before the first forward pass, and learning-rate factors it sets apply to the first step (create the LR
    scheduler before the Freezer, or it would take the scaled LRs as its base).

    Raises:
        BlockDiscoveryError: blocks cannot be discovered (see :func:`~layerfreeze.models.discovery.discover_blocks`).
        EmptyParameterError: a block's parameter holds no elements (a ZeRO-3 placeholder outside a gather,
            axolotl#1687: checksums and freezes would pass on nothing; ``discovery.refuse_empty_parameters``).
        UnknownStrategyError / ValueError / TypeError: bad strategy name or parameters; a sharded model with a
            strategy that observes the model and no ``mirror`` on rank 0 (raised on every rank); ``demote`` with
            ``train_bn=True`` (the BatchNorm layers of frozen blocks keep training in float32) or with an
            FSDP2-sharded model.
        RuntimeError: the strategy needs ``total_steps`` and none was given (the message says to pass it); ``model``
            has an open Freezer (two would run two strategies over the same blocks: close the first).
        ValueError: blocks of ``model`` are demoted by another Freezer (a ``copy.deepcopy`` taken while a Freezer
            with ``demote`` was open), or a block an earlier Freezer froze reaches outside ``model``
            (:func:`~layerfreeze.engine.takeover.check_earlier`).
        ValueError: a ``floor`` block that is the head; ``total_steps``/``steps_per_epoch`` not an int >= 1.

    Warns:
        UserWarning: a ``guard`` with a strategy that anneals a block's learning rate to 0 before freezing it
            (FreezeOut: ``Strategy.anneals_to_zero``): a guard's thaw cannot undo its freezes.

    Use it as a context manager (``with Freezer(...) as freezer:``) or call :meth:`close` when training ends:
    some strategies hold hooks and a background thread (Egeria's reference model).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        strategy: str | Strategy = DEFAULT_STRATEGY,
        strategy_params: dict[str, Any] | None = None,
        *,
        blocks: Sequence[str] | Sequence[Block] | None = None,
        train_bn: bool = False,
        scheduler: Any = None,
        total_steps: int | None = None,
        steps_per_epoch: int | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        guard: StabilityGuard | None = None,
        distributed: bool | None = None,
        on_unfrozen: str = "warn",
        mirror: nn.Module | None = None,
        demote: Demotion | dict[str, Any] | str | torch.dtype | None = None,
        floor: Sequence[int | str] | None = None,
    ) -> None:
        resolved = resolve(model, optimizer, strategy, strategy_params, blocks, guard, type(self))  # raises first
        #: Earlier Freezers on the model (closed, or deep copies): what take_over takes from (engine/takeover.py).
        self._earlier = resolved.earlier
        self.model = model
        self.optimizer = optimizer
        self.scheduler = lr_scheduler(scheduler)
        lr_factors.keep_plateau_base(optimizer, scheduler)
        self.train_bn = flag("train_bn", train_bn)
        self.total_steps = run_length("total_steps", total_steps)
        self.steps_per_epoch = run_length("steps_per_epoch", steps_per_epoch)
        self.on_event = callback(on_event)
        self.guard = guard
        self._fsdp = resolved.fsdp
        self.blocks: list[Block] = resolved.blocks
        strategy = resolved.strategy
        self.strategy = strategy
        self.frozen = [False] * len(self.blocks)
        self.step_count = 0
        self.epoch = 0
        self.history: list[dict[str, Any]] = []
        self.last_signals: dict[str, Any] = {}
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._origin: dict[int, int] = {}
        if optimizer is not None:
            self._origin = group_origin(optimizer)
            adopt_origins(self)  # groups an earlier Freezer with this optimizer took parameters out of
            optimizer_load.hold(self)  # a state loaded before the Freezer: its start stage frees part of it
        # what the user set before the Freezer, a thaw gives back as it was (mechanics.frozen_before, not_optimized)
        self._frozen_before = frozen_before(model)
        self._not_optimized = not_optimized(model, self._origin) if optimizer is not None else set()
        self._taken_back: list[tuple[nn.Parameter, Any, int | None]] = []  # take_over's (param, optimizer, group)
        self._hooks: dict[int, list[Any]] = {}
        self._root_eval_hook: Any = None  # registered at the first freeze (_eval_frozen_blocks)
        self.integrity = FrozenSet(on_unfrozen, warn=functools.partial(steps.integrity_warning, self),
                                   quick=not self._fsdp)
        self._params = BlockParams(self.blocks, cache=not self._fsdp)  # walked again after a structure change
        self._layers = resolved.layers  # the repeated stack's blocks (BlockView.is_layer: models.blocks.stack_layers)
        self._grad_sums = GradientSums(len(self.blocks), unsummed(self.blocks, self._layers, strategy))
        self._grad_hook: Any = None  # the optimizer step post-hook adding gradients to the grad_l1 sums (steps.py)
        self._lr_hook: list[Any] | None = None  # the LR factors' optimizer step pre- and post-hook (steps.py)
        self._stepping = False  # inside optimizer.step(), between those two hooks (steps.rest_lrs)
        self._epoch_started, self._epoch_end_warned = 0, False  # the last epoch_end's step (warn_missing_epoch_end)
        self._step_times = StepTimes()  # the step intervals the strategies read (timing.py)
        self._backward_calls = 0
        self._lr_scale: dict[int, float] = {}
        self._lr_written: dict[int, tuple[float, float]] = {}  # group -> (unscaled lr, lr we wrote)
        self._floor: set[int] = set()
        self._refused: set[int] = set()  # floor blocks whose thaw a strategy asked for (warned once each)
        self._in_stage = False  # stages.stage is applying a decision
        self._kept: set[int] = set()  # blocks a stage kept training, or nothing would have trained (warned once each)
        self.closed = False  # close() ran: freeze, thaw and the loop hooks are refused from then on
        self.distributed = distributed_mode(distributed)
        #: Whether this process runs the strategy: always in one process, on rank 0 only when distributed.
        self.decides = not self.distributed or comm.rank() == 0
        if self._fsdp and self.distributed:  # checksums of shards: the same on every rank (integrity.checksum)
            self.integrity.gather = comm.all_gather_object
        check_parameters(model, self.blocks, optimizer, resolved.registered)
        self._mirror = make_mirror(model, self.strategy, mirror, fsdp=self._fsdp, decides=self.decides,
                                   distributed=self.distributed)
        #: The :class:`~layerfreeze.engine.demote.Demoter` of ``demote`` (None without it): also a byte source of
        #: the memory ledger (master copies, offloaded weights).
        self.demoter: Demoter | None = build_demoter(demote, self.blocks, train_bn=train_bn, sharded=bool(self._fsdp))
        # before attach: nothing to release
        lr_factors.check_thaw_lrs(optimizer, self._origin, self.blocks, self.strategy)
        if self.decides:
            if self._mirror is not None:
                self.strategy.attach(self._mirror.mirror, self._mirror.blocks(self.blocks))
                self._mirror.forward_inputs()
            else:
                self.strategy.attach(model, self.blocks)
        try:
            start(self, floor)  # the floor, then the start stage; its LR factors already apply to the first step
            take_over(self)  # what an earlier Freezer on the model left frozen trains again (engine/takeover.py)
            steps.hook_optimizer(self)
        except BaseException:
            self.close()  # nobody holds this Freezer to close it: release the strategy's hooks and threads here
            raise
        claim_model(model, self)

    # ---- queries -------------------------------------------------------------------------------------------

    @property
    def frozen_prefix(self) -> int:
        """Number of leading blocks that are frozen (backward stops at block ``frozen_prefix``)."""
        k = 0
        while k < len(self.frozen) and self.frozen[k]:
            k += 1
        return k

    @property
    def frozen_blocks(self) -> list[str]:
        """Names of the frozen blocks, front to back."""
        return [b.name for b, f in zip(self.blocks, self.frozen) if f]

    def block(self, key: int | str) -> Block:
        """A block by index (0..n-1) or name (a str): :func:`~layerfreeze.models.blocks.block_by_key`, whose
        IndexError, KeyError and TypeError list the blocks."""
        return block_by_key(self.blocks, key)

    def eval_frozen(self, depth: int | None = None) -> None:
        """Put the frozen blocks among blocks ``0..depth-1`` (all blocks when None) in eval mode now.

        The same as their forward pre-hook does before they run (``model.train()`` flips frozen blocks back to
        training mode; BatchNorm layers stay training with ``train_bn``). For code that uses a frozen block's
        output without running it: the activation cache (:class:`~layerfreeze.compute.cache.CachedPrefix`) on a hit.
        """
        for block in self.blocks[:depth]:
            if self.frozen[block.index]:
                for _, module in block.modules:
                    self._eval_hook(module, ())

    @property
    def floor(self) -> list[int]:
        """The blocks that must stay frozen (indices, front to back): see :meth:`pin`."""
        return sorted(self._floor)

    def trainable_parameters(self) -> int:
        """Number of scalar parameters that currently require grad."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    # ---- freeze / thaw -------------------------------------------------------------------------------------

    def freeze(self, key: int | str, reason: str = "manual") -> bool:
        """Freeze one block (:mod:`~layerfreeze.engine.freezing` says everything that entails).

        Returns:
            True if the block was trainable and is now frozen, False if it was already frozen.

        Raises:
            RuntimeError: after :meth:`close`.
        """
        self._check_open("freeze")
        block = self.block(key)
        froze = freeze_block(self, block, reason)
        if froze and not self._in_stage:  # a stage half applied may train nothing for now (stages.keep_one_training)
            warn_if_nothing_trains(self, block)
        return froze

    def pin(self, keys: Sequence[int | str], reason: str = FLOOR_REASON) -> list[int]:
        """Add blocks to the floor: freeze them now (those not frozen yet) and keep them frozen.

        From then on a strategy may freeze more, but its thaws of a floor block are dropped (one warning per block),
        the stability guard stops watching them (it never thaws them), and :meth:`thaw` refuses them. Why: a memory
        budget's plan (:mod:`layerfreeze.budget`) freezes a prefix so the run's tensor peak fits; thawing any of it
        would bring back its gradients, optimizer state and saved activations.

        Returns:
            The blocks this call froze (indices).

        Raises:
            ValueError: a key is the head (a run must train something) or an unknown block.
        """
        blocks = [self.block(key) for key in keys]  # every key checked before anything freezes
        for block in blocks:
            if block.is_head:
                raise ValueError(f"the floor cannot hold the head ({block.name}): a run must train something")
        froze = []
        for block in blocks:
            self._floor.add(block.index)
            if self.freeze(block.index, reason=reason):
                froze.append(block.index)
        if self.guard is not None:
            self.guard.release(self._floor)
        return froze

    def thaw(self, key: int | str, lr: float | None = None, reason: str = "manual") -> bool:
        """Thaw one block: it trains again, back in the param groups it came from. What was set before the Freezer
        was built comes back as it was: a parameter frozen then (the user's own frozen layer, peft's base weights)
        stays frozen, and a parameter the optimizer did not hold is not added to it. So does one frozen by hand since
        (``requires_grad_(False)``) while its block trained, in the checkpoint too; one frozen by hand while its
        block was frozen cannot be told from the freeze (``requires_grad`` was off already) and trains after a thaw.

        Args:
            key: Block index or name.
            lr: The base learning rate of the block's param groups (discriminative LR): what the LR scheduler's
                schedule scales, as its ``base_lrs`` (under OneCycleLR ``max_lr / div_factor``, so the block peaks at
                ``lr * div_factor``; :func:`~layerfreeze.engine.lr_factors.set_block_lr`); None keeps the groups' LR.

        Returns:
            True if the block was frozen and is now trainable.

        Warns:
            UserWarning: the strategy's learning-rate factor for the block is 0 (FreezeOut past the block's ``t_i``):
                it trains at learning rate 0 until the strategy freezes it again.

        Raises:
            ValueError: ``lr`` given but not finite and ``> 0``, or a target param group also holds other blocks'
                parameters (build the optimizer with :func:`~layerfreeze.engine.optim.block_param_groups`), or the
                optimizer holds none of the block's parameters; checked before anything changes.
            PinnedBlockError: the block is in the floor (:meth:`pin`: a memory budget keeps it frozen).
            RuntimeError: after :meth:`close`.
        """
        self._check_open("thaw")
        return thaw_asked(self, self.block(key), lr, reason)

    def replan(self) -> Decision | None:
        """After the run's length changed (a resume onto another ``total_steps``), run the strategy's stage at the
        current step again and apply it, so its per-block learning-rate factors (FreezeOut's) and the freezes they
        bring follow the new length from the next step: the factors restored with the state were computed for the old
        length (a run resumed past its old end kept factor 0 and trained nothing for a step). Only for a strategy
        that set factors; call it after the param groups hold this step's scheduled LRs (each factor multiplies the
        LR found there). Collective when distributed: every rank calls it.

        Returns:
            The stage's decision, or None when the strategy set no factor (nothing to redo).
        """
        self._check_open("replan")
        if not self._lr_scale:
            return None
        decision = stage(self, event="step")
        lr_factors.apply_lr_scales(self.optimizer, self.blocks, self._origin, self._lr_scale, self._lr_written)
        return decision

    def set_block_lr(self, key: int | str | Block, lr: float) -> None:
        """Set the base learning rate of the param groups holding ``block``'s parameters, and the scheduler's (see
        :meth:`thaw`'s ``lr``).

        Raises:
            ValueError: no optimizer, ``lr`` not finite and ``> 0``, or a group that also holds other blocks'
                parameters.
        """
        block = key if isinstance(key, Block) else self.block(key)
        lr_factors.check_block_lr(self.optimizer, self._origin, block, lr)
        lr_factors.set_block_lr(self.optimizer, self._origin, block, lr, self.scheduler, self._lr_written)

    def named_frozen_parameters(self, block: Block) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` pairs that freezing ``block`` stops training (see :func:`frozen_parameters`)."""
        keep = {id(p) for p in frozen_parameters(block, self.train_bn)}
        return [(n, p) for n, p in block.named_parameters() if id(p) in keep]

    def kept_frozen_parameters(self, block: Block) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)``: the weights a thaw of frozen ``block`` gives back (what the frozen-weight checksum
        covers): its parameters, or for a demoted or offloaded block the float32 master copy / host copy
        (:meth:`~layerfreeze.engine.demote.Demoter.kept`)."""
        named = self.named_frozen_parameters(block)
        return named if self.demoter is None else self.demoter.kept(block, named)  # type: ignore[return-value]

    def demotion_mismatches(self, block: Block) -> list[str]:
        """Names of frozen ``block``'s tensors whose demoted copy is not exactly the cast of its master copy (empty
        without demotion)."""
        return [] if self.demoter is None else self.demoter.mismatches(block)

    def offload_prefix(self, depth: int) -> None:
        """Move the weights of the frozen blocks among ``0..depth-1`` off the training device (``demote`` with
        ``offload="cpu"``), bring back those at ``depth`` and beyond; no-op otherwise. ``depth``: the frozen prefix the
        activation cache serves (0 when it serves none: the cache is off). A block that must run (a cache miss, an
        evaluation) is copied to the device for its forward only; a thaw brings it back for good
        (:mod:`layerfreeze.engine.demote`)."""
        if self.demoter is not None:
            self.demoter.offload_prefix(min(int(depth), self.frozen_prefix))

    def ledger_tensors(self) -> list[torch.Tensor]:
        """What freezing itself holds: the strategy's ``held_tensors()`` and the gradient sums AutoFreeze reads."""
        return [*self.strategy.held_tensors(), *self._grad_sums.held_tensors()]

    def ledger_bytes(self) -> dict[str, dict[str, int]]:
        """``{"strategy": {device: bytes}}`` of :meth:`ledger_tensors` (``{}``: none): ``MemoryLedger(freezer=)``."""
        held = storage_bytes(self.ledger_tensors())
        return {"strategy": held} if held else {}

    @property
    def dtype_restores(self) -> int:
        """How many thaws gave a demoted block its float32 weights back (0 without ``demote``). A DDP wrapper built
        before the latest one must be rebuilt even for the same frozen set: the restored parameters got new gradient
        accumulators, which the wrapper's hooks do not see (:class:`~layerfreeze.distributed.ddp.FreezeDDP` and the
        callbacks compare it too)."""
        return 0 if self.demoter is None else self.demoter.restores

    @property
    def prefix_since(self) -> int:
        """The step count at which the frozen prefix got its current length (0: before the first step, the start
        stage), from :attr:`history`; what the activation cache's ``auto`` policy measures the boundary's age from."""
        return prefix_since(self.history)

    def refreeze_parameter(self, param: nn.Parameter, old: nn.Parameter | None = None) -> None:
        """Freeze ``param`` again (it replaced ``old`` in a frozen block, or was made trainable by someone else):
        no grad, out of the optimizer, and it takes over ``old``'s param-group origin and name."""
        refreeze(self, param, old)

    def verify_frozen_weights(self) -> None:
        """Check every frozen block's weights against their checksum from freeze time (bitwise). A parameter that
        replaced one of a frozen block since the last :meth:`step` is re-frozen first, with its own checksum and a
        warning (:class:`~layerfreeze.engine.integrity.FrozenSet`), as :meth:`step` would. Under FSDP2 every rank
        calls it (it may reshard the model: :meth:`step`).

        Raises:
            FrozenWeightsChangedError: a frozen weight moved (the message names the block and parameter).
            UnfrozenParameterError: a replaced or unfrozen parameter, with ``on_unfrozen="error"``.
        """
        sharded(self._fsdp)
        self.integrity.check(self)  # a parameter replaced since the last step is re-frozen first, and named
        self.integrity.verify_checksums(self)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> None:
        """Give a Freezer built with ``optimizer=None`` the optimizer a framework creates after the initial freeze.

        Why: Lightning calls ``configure_optimizers`` after the ``setup`` hook, and the blocks a strategy freezes
        from the start must be frozen before that (and before DDP registers the trainable parameters). Parameters
        of frozen blocks that are in ``optimizer`` leave it now, before any step (no state, no update); each
        parameter's group is remembered so a thaw puts it back there (a parameter ``optimizer`` never held goes
        back to group 0). Learning-rate factors the strategy set without an optimizer are applied now.

        Raises:
            ValueError: a strategy's learning-rate factor (or a thaw's LR) on a block whose param group holds other
                blocks too; checked before anything changes (:func:`~layerfreeze.engine.attach.attach_optimizer`).
        """
        attach_optimizer(self, optimizer, scheduler)
        steps.hook_optimizer(self)

    def close(self) -> None:
        """Release what the strategy attached (hooks, threads); demoted blocks get their float32 weights back on the
        device and stay frozen (:meth:`~layerfreeze.engine.demote.Demoter.close`). Idempotent."""
        self.closed = True
        steps.release_gradients(self)
        if self.decides:
            self.strategy.detach()
        if self._mirror is not None:
            self._mirror.close()
        if self.demoter is not None:
            self.demoter.close()

    def _check_open(self, what: str) -> None:
        """Refuse ``what`` on a closed Freezer: its strategy is detached and its demoted blocks got their float32
        weights back, so a freeze now would demote a block nothing restores again (it stayed bfloat16 for good)."""
        if self.closed:
            raise RuntimeError(f"Freezer.{what}() after close() (or after its `with` block): the strategy is detached "
                               "and demoted blocks are restored; build a new Freezer for more training")

    def __deepcopy__(self, memo: dict[int, Any]) -> Freezer:
        """What a copied model carries of this Freezer: :func:`~layerfreeze.engine.takeover.copied`."""
        return copied(self, memo)

    def __getstate__(self) -> dict[str, Any]:
        """What a pickled model (``torch.save(model)``) carries of this Freezer: the same closed record as a copy's
        (:func:`~layerfreeze.engine.takeover.closed_record`)."""
        return closed_record(self, "pickling a model (torch.save(model))")

    def __enter__(self) -> Freezer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- training-loop hooks -------------------------------------------------------------------------------

    def after_backward(self) -> None:
        """Call after each ``loss.backward()``: checks that every trainable block got a gradient (after a change of
        the frozen set). ``grad_l1`` (AutoFreeze) is read at each ``optimizer.step()``, or here without an optimizer."""
        self._check_open("after_backward")
        steps.after_backward(self)

    def step(self) -> Decision | None:
        """Call once after each ``optimizer.step()`` that updated the weights; runs a freezing stage every
        ``strategy.stage_every`` steps. With gradient accumulation, call it only on the step that syncs (accelerate:
        ``if accelerator.sync_gradients``); past ``total_steps`` it warns once (a count of micro-batches gets there
        halfway through the run).

        Under FSDP2 it first reshards a group an evaluation pass left unsharded
        (:func:`layerfreeze.distributed.fsdp.reshard_all`), as :meth:`freeze`, :meth:`thaw` and
        :meth:`verify_frozen_weights` do: every rank calls them at the same point.

        Raises:
            RuntimeError: after :meth:`close`.
        """
        self._check_open("step")
        return steps.step(self)

    def epoch_end(self) -> Decision | None:
        """Call at the end of each epoch; runs an epoch-end stage if the strategy wants one."""
        self._check_open("epoch_end")
        return steps.epoch_end(self)

    def report_metric(self, value: float) -> int | None:
        """Give the stability guard a validation value (loss by default); it may thaw the latest frozen block.

        Returns:
            The index of the block the guard thawed, or None (also None without a guard).
        """
        return report_metric(self, value)

    # ---- checkpoint ----------------------------------------------------------------------------------------

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """Everything needed to resume: frozen set, optimizer param-group membership, counters, strategy state, the
        gradients summed since the last stage (AutoFreeze's signal; CPU tensors).

        Save it beside ``optimizer.state_dict()``; on resume call :meth:`load_state_dict` *before*
        ``optimizer.load_state_dict`` so the param groups match (see :mod:`layerfreeze.checkpoint`).

        ``full=True``: under FSDP2, gather the gradient sums' shards whole (a collective: every rank calls it, as
        :func:`~layerfreeze.checkpoint.save_full_checkpoint` does); without it, this rank's shards.
        """
        return checkpoint_state.state_dict(self, full=full)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: re-freezes/thaws blocks and rebuilds the optimizer's param groups.

        Raises:
            ValueError: the state is from another version, another set of blocks, another strategy, or an
                optimizer with a different number of param groups.
        """
        checkpoint_state.load_state_dict(self, state)

    # ---- internals -----------------------------------------------------------------------------------------

    def _eval_hook(self, module: nn.Module, args: Any) -> None:
        # model.train() flips frozen blocks back to training mode; undo it before they run.
        if module.training:
            set_eval_mode(module, self.train_bn)

    def _eval_frozen_blocks(self, model: nn.Module, args: Any) -> None:
        # before the model's forward; why the blocks' own pre-hooks do not suffice: mechanics.frozen_blocks_to_eval
        if model.training:
            frozen_blocks_to_eval(self.blocks, self.frozen, self.train_bn)


def release_earlier_freezers(model: nn.Module) -> list[str]:
    """Make trainable again what earlier Freezers on ``model`` (closed, or deep-copied with it) left frozen, before
    building an optimizer over the parameters that require grad.

    A new :class:`Freezer` takes over what they left frozen by itself (:mod:`layerfreeze.engine.takeover`), but an
    optimizer built before it over ``requires_grad`` parameters (the HF Trainer's ``create_optimizer``: a second
    ``train()`` with a new Trainer on the same model) leaves those parameters out, and a checkpoint of that run did not
    load into the optimizer its resume builds. Call this before building such an optimizer (the HF callback does it
    when the Trainer is built; the CLI trainer before its optimizer). Parameters the user had frozen before an
    earlier Freezer stay frozen, and so does all it left frozen when everything that trained under it was frozen
    since (peft's ``get_peft_model`` freezing the base for LoRA: a warning says so); the released blocks' modules
    take ``model``'s training mode.

    Returns:
        The names of the blocks made trainable again (a warning names them too); empty when there were none.

    Raises:
        ValueError: a block an earlier Freezer holds demoted (a copy taken while it was open), or one that reaches
            outside ``model`` (:func:`~layerfreeze.engine.takeover.check_earlier`).
        RuntimeError: ``model`` still has an open Freezer, whose frozen blocks are its own (close it first).
    """
    return release_earlier(model, Freezer)

