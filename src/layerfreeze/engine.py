"""The freezing engine: the mechanics every strategy uses (freeze, thaw, optimizer surgery, checkpointable state).

Strategies decide, the engine applies. The mechanics are small module-level helpers (in the spirit of Lightning's
``BaseFinetuning.freeze`` / ``make_trainable``) and :class:`Freezer` wires them to a model, an optimizer and a
strategy for use in any training loop::

    freezer = Freezer(model, optimizer, strategy="static", strategy_params={"k": 5})
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        freezer.after_backward()      # only needed by gradient-based strategies
        optimizer.step(); optimizer.zero_grad(set_to_none=True)
        freezer.step()
    freezer.epoch_end()

What freezing a block does, and why each part matters (each is a public fault seen in other tools):

* ``requires_grad_(False)``: autograd builds no graph for a frozen prefix (its output does not require grad, so no
  activations are kept for backward and backward stops at the first trainable block).
* The parameters leave the optimizer's param groups and their optimizer state is freed. A parameter left in an
  optimizer keeps receiving momentum and (decoupled) weight decay updates when its gradient is zero instead of
  None, so "frozen" weights drift; its state also keeps costing memory (two fp32 copies for Adam).
* ``.grad`` is set to None so no stale gradient is applied or clipped later.
* BatchNorm running statistics and dropout go to eval mode (a forward pre-hook re-applies it after every
  ``model.train()``), unless ``train_bn=True`` (fastai / Lightning ``train_bn``): then BatchNorm layers keep
  training, affine parameters included.

Thawing reverses all of it and puts each parameter back into the param group it came from, so the number of param
groups never changes (LR schedulers keep working) and checkpoints load without "different number of parameter
groups" errors. A learning rate for the thawed block may be given (discriminative LR); that needs param groups that
hold only that block's parameters, which :func:`block_param_groups` builds.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .blocks import Block, discover_blocks
from .guard import StabilityGuard
from .integrity import FrozenSet
from .strategies import Decision, StageContext, Strategy, create_strategy
from .strategies.base import BlockView

STATE_VERSION = 1

_NORM_TYPES = (nn.modules.batchnorm._BatchNorm,)


# --------------------------------------------------------------------------------------------------------------
# Mechanics (stateless helpers)
# --------------------------------------------------------------------------------------------------------------


def frozen_parameters(block: Block, train_bn: bool = False) -> list[nn.Parameter]:
    """The parameters that freezing ``block`` stops training (BatchNorm affine ones stay if ``train_bn``)."""
    if not train_bn:
        return list(block.parameters())
    keep = {id(p) for _, m in block.modules for sub in m.modules() if isinstance(sub, _NORM_TYPES)
            for p in sub.parameters(recurse=False)}
    return [p for p in block.parameters() if id(p) not in keep]


def set_eval_mode(module: nn.Module, train_bn: bool = False) -> None:
    """Put ``module`` and its sub-modules in eval mode (BatchNorm layers excepted when ``train_bn``)."""
    for sub in module.modules():
        sub.training = bool(train_bn and isinstance(sub, _NORM_TYPES) and sub.training)


def remove_from_optimizer(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> dict[int, int]:
    """Take ``params`` out of the optimizer's param groups and free their optimizer state.

    Why: a parameter left in a param group keeps getting momentum and weight-decay updates, and its state (Adam's
    two moments) keeps its memory.

    Returns:
        ``{id(param): index of the param group it was in}`` for the parameters that were in the optimizer.
    """
    ids = {id(p) for p in params}
    origin: dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        kept = []
        for p in group["params"]:
            if id(p) in ids:
                origin[id(p)] = gi
                optimizer.state.pop(p, None)
            else:
                kept.append(p)
        group["params"] = kept
    return origin


def add_to_optimizer(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter], group_index: int) -> None:
    """Append ``params`` to param group ``group_index`` (no-op for parameters already in the optimizer)."""
    present = {id(p) for g in optimizer.param_groups for p in g["params"]}
    group = optimizer.param_groups[group_index]
    group["params"].extend(p for p in params if id(p) not in present)


def block_param_groups(
    model: nn.Module,
    blocks: Sequence[Block],
    lr: float,
    weight_decay: float = 0.0,
    lr_decay: float = 1.0,
    no_decay: Callable[[str, nn.Parameter], bool] | None = None,
) -> list[dict[str, Any]]:
    """Optimizer param groups with one group per block (two if ``no_decay`` splits it), for discriminative LRs.

    Discriminative learning rates (Howard & Ruder, "Universal Language Model Fine-tuning for Text
    Classification", ACL 2018, sec. 3.2): block ``l`` of ``L`` gets ``lr / lr_decay ** (L - 1 - l)``, so the head
    gets ``lr`` and each earlier block ``lr_decay`` times less (ULMFiT uses 2.6). Parameters in no block go to a
    last group with ``lr``.

    Args:
        model: The model the blocks belong to.
        blocks: Its blocks, front to back.
        lr: Learning rate of the head.
        weight_decay: Weight decay of the groups (0 for parameters selected by ``no_decay``).
        lr_decay: Factor between consecutive blocks' learning rates, ``>= 1``.
        no_decay: ``(name, param) -> bool`` selecting parameters without weight decay (e.g. biases, LayerNorm).

    Returns:
        A list for ``torch.optim.*(groups, ...)``; each group has a ``"block"`` key naming its block.

    Raises:
        ValueError: ``lr <= 0`` or ``lr_decay < 1``.
    """
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if lr_decay < 1:
        raise ValueError(f"lr_decay must be >= 1 (ULMFiT uses 2.6), got {lr_decay}")
    groups: list[dict[str, Any]] = []
    num = len(blocks)

    def add(name: str, named: list[tuple[str, nn.Parameter]], block_lr: float) -> None:
        decay = [p for n, p in named if not (no_decay and no_decay(n, p))]
        plain = [p for n, p in named if no_decay and no_decay(n, p)]
        if decay:
            groups.append({"params": decay, "lr": block_lr, "weight_decay": weight_decay, "block": name})
        if plain:
            groups.append({"params": plain, "lr": block_lr, "weight_decay": 0.0, "block": name})

    for block in blocks:
        add(block.name, list(block.named_parameters()), lr / lr_decay ** (num - 1 - block.index))
    owned = {id(p) for b in blocks for p in b.parameters()}
    add("(unassigned)", [(n, p) for n, p in model.named_parameters() if id(p) not in owned], lr)
    return groups


# --------------------------------------------------------------------------------------------------------------
# The Freezer
# --------------------------------------------------------------------------------------------------------------


class Freezer:
    """Applies a freezing strategy to a model and its optimizer, in any training loop.

    Args:
        model: The model being trained.
        optimizer: Its optimizer (may be None for pure inference-style freezing; then only ``requires_grad``,
            gradients and BatchNorm modes are handled, and learning-rate factors wait for
            :meth:`attach_optimizer`).
        strategy: A :class:`~layerfreeze.strategies.Strategy` or a registered name (``"none"``, ``"static"``...).
        strategy_params: Parameters for a strategy given by name.
        blocks: Module-name patterns, or ready :class:`~layerfreeze.blocks.Block` objects; default: discovered.
        train_bn: Keep BatchNorm layers of frozen blocks training (statistics and affine parameters).
        scheduler: The LR scheduler, if any; its ``base_lrs`` are updated when a thaw sets a learning rate.
        total_steps: Planned optimizer steps (needed by schedule-based strategies).
        steps_per_epoch: Optimizer steps per epoch, if known.
        on_event: Called with each freeze/thaw record (a dict), e.g. to log it to telemetry.
        guard: An optional :class:`~layerfreeze.guard.StabilityGuard`; feed it with :meth:`report_metric`.
        on_unfrozen: What to do when a frozen block's parameter was replaced (``module.weight = nn.Parameter(...)``),
            requires grad again or is back in the optimizer (checked after every step,
            :class:`~layerfreeze.integrity.FrozenSet`): ``"warn"`` re-freezes it and warns naming it, ``"error"``
            raises :class:`~layerfreeze.integrity.UnfrozenParameterError`.
        distributed: Decide on rank 0 and broadcast each decision to every rank (``torch.distributed``), so all
            ranks freeze and thaw the same blocks at the same step whatever the strategy looks at. Default: on when
            a process group of more than one rank is initialized. Only rank 0 runs the strategy (its hooks,
            threads and signals); the other ranks apply what it decided. Every rank must create the Freezer and
            call :meth:`step`, :meth:`epoch_end` and :meth:`report_metric` at the same points (they are
            collectives then).

    The strategy's start stage runs in the constructor, so blocks a strategy freezes from the start are frozen
    before the first forward pass, and learning-rate factors it sets apply to the first step (create the LR
    scheduler before the Freezer, or it would take the scaled LRs as its base).

    Raises:
        BlockDiscoveryError: blocks cannot be discovered (see :func:`~layerfreeze.blocks.discover_blocks`).
        UnknownStrategyError / ValueError: bad strategy name or parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        strategy: str | Strategy = "none",
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
    ) -> None:
        from . import distributed as dist_

        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_bn = train_bn
        self.total_steps = total_steps
        self.steps_per_epoch = steps_per_epoch
        self.on_event = on_event
        self.guard = guard
        if blocks and isinstance(blocks[0], Block):
            self.blocks: list[Block] = list(blocks)  # type: ignore[arg-type]
        else:
            self.blocks = discover_blocks(model, blocks)  # type: ignore[arg-type]
        if isinstance(strategy, str):
            strategy = create_strategy(strategy, **(strategy_params or {}))
        elif strategy_params:
            raise ValueError("strategy_params is only used with a strategy given by name")
        self.strategy = strategy
        self.frozen = [False] * len(self.blocks)
        self.step_count = 0
        self.epoch = 0
        self.history: list[dict[str, Any]] = []
        self.last_signals: dict[str, Any] = {}
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._origin: dict[int, int] = {}
        if optimizer is not None:
            self._origin = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._hooks: dict[int, list[Any]] = {}
        self.integrity = FrozenSet(on_unfrozen, warn=self._integrity_warning)
        self._grad_l1 = [0.0] * len(self.blocks)
        self._backward_calls = 0
        self._lr_scale: dict[int, float] = {}
        self._lr_written: dict[int, tuple[float, float]] = {}  # group -> (unscaled lr, lr we wrote)
        self.distributed = dist_.is_distributed() if distributed is None else bool(distributed)
        if self.distributed and not dist_.is_distributed():
            raise RuntimeError("Freezer(distributed=True) needs an initialized torch.distributed process group of "
                               "more than one rank")
        #: Whether this process runs the strategy: always in one process, on rank 0 only when distributed.
        self.decides = not self.distributed or dist_.rank() == 0
        self.strategy.validate(len(self.blocks))
        if self.decides:
            self.strategy.attach(model, self.blocks)
        self._stage(event="start")
        self._apply_lr_scales()  # LR factors from the start stage already apply to the first step

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
        """A block by index or name. Raises KeyError listing the names for an unknown name."""
        if isinstance(key, int):
            return self.blocks[key]
        for b in self.blocks:
            if b.name == key:
                return b
        raise KeyError(f"No block named {key!r}; blocks: {', '.join(b.name for b in self.blocks)}")

    def trainable_parameters(self) -> int:
        """Number of scalar parameters that currently require grad."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    # ---- freeze / thaw -------------------------------------------------------------------------------------

    def freeze(self, key: int | str, reason: str = "manual") -> bool:
        """Freeze one block (see the module docstring for everything that entails).

        Returns:
            True if the block was trainable and is now frozen, False if it was already frozen.
        """
        block = self.block(key)
        if self.frozen[block.index]:
            return False
        params = frozen_parameters(block, self.train_bn)
        for p in params:
            p.requires_grad_(False)
            p.grad = None
        if self.optimizer is not None:
            self._origin.update(remove_from_optimizer(self.optimizer, params))
        for _, module in block.modules:
            set_eval_mode(module, self.train_bn)
            self._hooks.setdefault(block.index, []).append(module.register_forward_pre_hook(self._eval_hook))
        self.frozen[block.index] = True
        self.integrity.on_freeze(block.index, self.named_frozen_parameters(block))
        self._record("freeze", block, reason)
        return True

    def thaw(self, key: int | str, lr: float | None = None, reason: str = "manual") -> bool:
        """Thaw one block: it trains again, back in the param groups it came from.

        Args:
            key: Block index or name.
            lr: Learning rate for the block's param groups (discriminative LR); None keeps the groups' LR.

        Returns:
            True if the block was frozen and is now trainable.

        Raises:
            ValueError: ``lr`` given but a target param group also holds other blocks' parameters (build the
                optimizer with :func:`block_param_groups`).
        """
        block = self.block(key)
        was_frozen = self.frozen[block.index]
        if was_frozen:
            for handle in self._hooks.pop(block.index, []):
                handle.remove()
            for _, module in block.modules:
                module.train(self.model.training)
            params = frozen_parameters(block, self.train_bn)
            for p in params:
                p.requires_grad_(True)
            if self.optimizer is not None:
                for p in params:
                    add_to_optimizer(self.optimizer, [p], self._origin.get(id(p), 0))
            self.frozen[block.index] = False
            self.integrity.on_thaw(block.index)
        if lr is not None:
            self.set_block_lr(block, lr)
        if was_frozen:
            self._record("thaw", block, reason, lr=lr)
        return was_frozen

    def set_block_lr(self, key: int | str | Block, lr: float) -> None:
        """Set the learning rate of the param groups holding ``block``'s parameters (and the scheduler's base LR).

        Raises:
            ValueError: no optimizer, ``lr <= 0``, or a group that also holds other blocks' parameters.
        """
        block = key if isinstance(key, Block) else self.block(key)
        if self.optimizer is None or lr <= 0:
            raise ValueError(f"set_block_lr needs an optimizer and lr > 0 (got lr={lr})")
        for gi in self._exclusive_groups(block, "its own learning rate"):
            group = self.optimizer.param_groups[gi]
            group["lr"] = lr
            if "initial_lr" in group:
                group["initial_lr"] = lr
            if self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
                self.scheduler.base_lrs[gi] = lr
            self._lr_written.pop(gi, None)

    def named_frozen_parameters(self, block: Block) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` pairs that freezing ``block`` stops training (see :func:`frozen_parameters`)."""
        keep = {id(p) for p in frozen_parameters(block, self.train_bn)}
        return [(n, p) for n, p in block.named_parameters() if id(p) in keep]

    def refreeze_parameter(self, param: nn.Parameter, old: nn.Parameter | None = None) -> None:
        """Freeze ``param`` again (it replaced ``old`` in a frozen block, or was made trainable by someone else):
        no grad, out of the optimizer, and it takes over ``old``'s param-group origin and name."""
        param.requires_grad_(False)
        param.grad = None
        if self.optimizer is not None:
            remove_from_optimizer(self.optimizer, [param])
        if old is not None and old is not param:
            if id(old) in self._origin:
                self._origin[id(param)] = self._origin.pop(id(old))
            if id(old) in self._names:
                self._names[id(param)] = self._names.pop(id(old))

    def verify_frozen_weights(self) -> None:
        """Check every frozen block's weights against their checksum from freeze time (bitwise).

        Raises:
            FrozenWeightsChangedError: a frozen weight moved (the message names the block and parameter).
        """
        self.integrity.verify_checksums(self)

    def _integrity_warning(self, message: str, record: dict[str, Any]) -> None:
        warnings.warn(message, stacklevel=4)
        if self.on_event is not None:
            self.on_event({**record, "step": self.step_count, "message": message})

    def _block_group_indices(self, block: Block) -> list[int]:
        return sorted({self._origin[id(p)] for p in block.parameters() if id(p) in self._origin})

    def _exclusive_groups(self, block: Block, purpose: str) -> list[int]:
        """The param groups of ``block``; ValueError if one also holds other blocks' parameters."""
        own = {id(p) for p in block.parameters()}
        indices = self._block_group_indices(block)
        for gi in indices:
            if any(id(p) not in own for p in self.optimizer.param_groups[gi]["params"]):
                raise ValueError(
                    f"Cannot give block {block.name!r} {purpose}: param group {gi} also holds other blocks' "
                    "parameters. Build the optimizer from layerfreeze.block_param_groups(...) (one group per block)."
                )
        return indices

    def _apply_lr_scales(self) -> None:
        """Multiply each scaled block's scheduled LR by its factor (after the scheduler has set this step's LR).

        A group whose LR is still the value we wrote last time has not been rescheduled (no scheduler, or the
        scheduler only runs per epoch), so the factor is applied to the remembered unscaled LR, not compounded.
        Schedulers that derive the next LR from the current one (StepLR, ExponentialLR) would compound the factor:
        use LambdaLR-style schedulers (as the CLI trainer does) with strategies that scale LRs.
        """
        if self.optimizer is None:
            return
        for index, scale in self._lr_scale.items():
            for gi in self._block_group_indices(self.blocks[index]):
                group = self.optimizer.param_groups[gi]
                unscaled, written = self._lr_written.get(gi, (None, None))
                if written is None or group["lr"] != written:
                    unscaled = group["lr"]
                group["lr"] = unscaled * scale
                self._lr_written[gi] = (unscaled, group["lr"])

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> None:
        """Give a Freezer built with ``optimizer=None`` the optimizer a framework creates after the initial freeze.

        Why: Lightning calls ``configure_optimizers`` after the ``setup`` hook, and the blocks a strategy freezes
        from the start must be frozen before that (and before DDP registers the trainable parameters). Parameters
        of frozen blocks that are in ``optimizer`` leave it now, before any step (no state, no update); each
        parameter's group is remembered so a thaw puts it back there (a parameter ``optimizer`` never held goes
        back to group 0). Learning-rate factors the strategy set without an optimizer are applied now.

        Raises:
            ValueError: a strategy's learning-rate factor on a block whose param group holds other blocks too.
        """
        self.optimizer = optimizer
        if scheduler is not None:
            self.scheduler = scheduler
        self._origin = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        for block in self.blocks:
            if self.frozen[block.index]:
                remove_from_optimizer(optimizer, frozen_parameters(block, self.train_bn))
        for i in self._lr_scale:
            self._exclusive_groups(self.blocks[i], "a learning-rate factor")
        self._lr_written = {}
        self._apply_lr_scales()

    def close(self) -> None:
        """Release what the strategy attached (hooks, background threads). Idempotent."""
        if self.decides:
            self.strategy.detach()

    def __enter__(self) -> Freezer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- training-loop hooks -------------------------------------------------------------------------------

    def after_backward(self) -> None:
        """Collect gradient signals (per-block L1 norm of gradients) after ``loss.backward()``.

        Only needed when the strategy lists ``"grad_l1"`` in its ``signals``; cheap otherwise (returns at once).
        """
        self._backward_calls += 1
        self.integrity.check_gradients(self)
        if "grad_l1" not in self.strategy.signals or not self.decides:
            return  # off rank 0 no strategy reads it (gradients are all-reduced, so rank 0's sums are global)
        with torch.no_grad():
            for block in self.blocks:
                if self.frozen[block.index]:
                    continue
                grads = [p.grad for p in block.parameters() if p.grad is not None]
                if grads:
                    self._grad_l1[block.index] += float(sum(g.abs().sum() for g in grads))

    def step(self) -> Decision | None:
        """Call once after each ``optimizer.step()``; runs a freezing stage every ``strategy.stage_every`` steps."""
        self.step_count += 1
        self.integrity.check(self)
        every = self.strategy.stage_every
        decision = self._stage(event="step") if every and self.step_count % every == 0 else None
        self._apply_lr_scales()
        return decision

    def epoch_end(self) -> Decision | None:
        """Call at the end of each epoch; runs an epoch-end stage if the strategy wants one."""
        decision = self._stage(event="epoch_end") if self.strategy.at_epoch_end else None
        self.epoch += 1
        return decision

    def report_metric(self, value: float) -> int | None:
        """Give the stability guard a validation value (loss by default); it may thaw the latest frozen block.

        Returns:
            The index of the block the guard thawed, or None (also None without a guard).
        """
        if self.guard is None:
            return None
        index, reference = None, float("nan")
        if self.decides:
            index = self.guard.observe(float(value), list(self.frozen))
            if self.guard.reference is not None:
                reference = self.guard.reference
        if self.distributed:
            from .distributed import broadcast_object

            index, reference, value = broadcast_object((index, reference, value))
        if index is not None:
            self.thaw(index, reason=f"guard: metric {value:.4g} worse than {reference:.4g} before the freeze")
        return index

    # ---- checkpoint ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: frozen set, optimizer param-group membership, counters, strategy state.

        Save it beside ``optimizer.state_dict()``; on resume call :meth:`load_state_dict` *before*
        ``optimizer.load_state_dict`` so the param groups match (see :mod:`layerfreeze.checkpoint`).
        """
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "blocks": [b.name for b in self.blocks],
            "frozen": list(self.frozen),
            "step": self.step_count,
            "epoch": self.epoch,
            "history": list(self.history),
            "strategy": {"name": self.strategy.name, "state": self.strategy.state_dict()},
            "grad_l1": list(self._grad_l1),
            "backward_calls": self._backward_calls,
            "train_bn": self.train_bn,
            "lr_scale": dict(self._lr_scale),
            "lr_written": dict(self._lr_written),
            "guard": self.guard.state_dict() if self.guard is not None else None,
            "frozen_checksums": self.integrity.state_dict(),
        }
        if self.optimizer is not None:
            state["param_groups"] = [[self._names[id(p)] for p in g["params"]] for g in self.optimizer.param_groups]
            state["origin"] = {self._names[i]: gi for i, gi in self._origin.items() if i in self._names}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: re-freezes/thaws blocks and rebuilds the optimizer's param groups.

        Raises:
            ValueError: the state is from another version, another set of blocks, another strategy, or an
                optimizer with a different number of param groups.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"Freezer state version {state.get('version')!r} != {STATE_VERSION}; cannot resume it")
        names = [b.name for b in self.blocks]
        if state["blocks"] != names:
            raise ValueError(f"Checkpoint blocks {state['blocks']} do not match this model's blocks {names}")
        if state["strategy"]["name"] != self.strategy.name:
            raise ValueError(
                f"Checkpoint was written by strategy {state['strategy']['name']!r}, this run uses "
                f"{self.strategy.name!r}; resume with the same strategy"
            )
        self.train_bn = state.get("train_bn", self.train_bn)
        for block, frozen in zip(self.blocks, state["frozen"]):
            if frozen and not self.frozen[block.index]:
                self.freeze(block.index, reason="resume")
            elif not frozen and self.frozen[block.index]:
                self.thaw(block.index, reason="resume")
        if self.optimizer is not None and "param_groups" in state:
            by_name = dict(self.model.named_parameters())
            if len(state["param_groups"]) != len(self.optimizer.param_groups):
                raise ValueError(
                    f"Checkpoint optimizer has {len(state['param_groups'])} param groups, this one has "
                    f"{len(self.optimizer.param_groups)}; build the optimizer the same way as the saved run"
                )
            for group, saved in zip(self.optimizer.param_groups, state["param_groups"]):
                group["params"] = [by_name[n] for n in saved]
            self._origin = {id(by_name[n]): gi for n, gi in state["origin"].items()}
            self.optimizer.state.clear()
        self.integrity.load_state_dict(state.get("frozen_checksums", {}))
        self.step_count = state["step"]
        self.epoch = state["epoch"]
        self.history = list(state["history"])
        self._grad_l1 = list(state["grad_l1"])
        self._backward_calls = state["backward_calls"]
        self._lr_scale = {int(k): v for k, v in state["lr_scale"].items()}
        self._lr_written = {int(k): tuple(v) for k, v in state["lr_written"].items()}
        if self.decides:
            self.strategy.load_state_dict(state["strategy"]["state"])
        if self.guard is not None and state.get("guard") is not None:
            self.guard.load_state_dict(state["guard"])
        if self.distributed:  # the stage cadence may come from the strategy's state (smartfrz): take rank 0's
            from .distributed import broadcast_object

            self.strategy.stage_every, self.strategy.at_epoch_end = broadcast_object(
                (self.strategy.stage_every, self.strategy.at_epoch_end))

    # ---- internals -----------------------------------------------------------------------------------------

    def _eval_hook(self, module: nn.Module, args: Any) -> None:
        # model.train() flips frozen blocks back to training mode; undo it before they run.
        if module.training:
            set_eval_mode(module, self.train_bn)

    def _record(self, kind: str, block: Block, reason: str, **extra: Any) -> None:
        record = {
            "kind": kind,
            "block": block.name,
            "index": block.index,
            "step": self.step_count,
            "epoch": self.epoch,
            "reason": reason,
            "frozen_count": sum(self.frozen),
            "frozen_prefix": self.frozen_prefix,
        }
        record.update({k: v for k, v in extra.items() if v is not None})
        if reason != "resume":
            self.history.append(record)
        if self.on_event is not None:
            self.on_event(record)

    def _context(self, event: str) -> StageContext:
        views = [
            BlockView(b.name, b.index, self.frozen[b.index], b.is_head, b.num_parameters()) for b in self.blocks
        ]
        signals: dict[str, Any] = {}
        if "grad_l1" in self.strategy.signals and event != "start":
            if self._backward_calls == 0:
                raise RuntimeError(
                    f"Strategy {self.strategy.name!r} needs gradients, but freezer.after_backward() was never called. "
                    "Call it after loss.backward() and before optimizer.zero_grad()."
                )
            signals["grad_l1"] = list(self._grad_l1)
        block_lrs = None
        if self.optimizer is not None:
            block_lrs = []
            for b in self.blocks:
                groups = self._block_group_indices(b)
                g = self.optimizer.param_groups[groups[0]] if groups else None
                unscaled = self._lr_written.get(groups[0], (None,))[0] if groups else None
                block_lrs.append(None if g is None else g.get("initial_lr", unscaled or g["lr"]))
        return StageContext(
            step=self.step_count,
            epoch=self.epoch,
            event=event,
            blocks=views,
            total_steps=self.total_steps,
            steps_per_epoch=self.steps_per_epoch,
            signals=signals,
            block_lrs=block_lrs,
        )

    def _stage(self, event: str) -> Decision:
        decision = Decision()
        error: str | None = None
        if self.decides:
            try:
                decision = self._admissible(self.strategy.decide(self._context(event)))
            except Exception as exc:
                if not self.distributed:
                    raise
                error = f"{type(exc).__name__}: {exc}"
                self._share(decision, error)  # the other ranks raise too instead of waiting for a decision
                raise
            self.last_signals = dict(decision.signals)
        if self.distributed:
            decision = self._share(decision, error)
        self._grad_l1 = [0.0] * len(self.blocks)
        self._backward_calls = 0
        for i in decision.freeze:
            if self.freeze(i, reason=decision.reason or self.strategy.name) and self.guard is not None:
                self.guard.on_freeze(i)
        for i in decision.thaw:
            self.thaw(i, lr=decision.thaw_lr.get(i), reason=decision.reason or self.strategy.name)
        for i, scale in decision.lr_scale.items():
            if self.optimizer is not None:  # without one yet, attach_optimizer checks and applies the factors
                self._exclusive_groups(self.blocks[i], "a learning-rate factor")
            if scale == 1.0:
                self._lr_scale.pop(i, None)
            else:
                self._lr_scale[i] = float(scale)
        return decision

    def _admissible(self, decision: Decision) -> Decision:
        """``decision`` without freezes the stability guard holds back (cooling down after a guard thaw).

        Raises:
            RuntimeError: the strategy tried to freeze the head.
        """
        for i in decision.freeze:
            if self.blocks[i].is_head:
                raise RuntimeError(f"Strategy {self.strategy.name!r} tried to freeze the head ({self.blocks[i].name})")
        if self.guard is not None:
            decision.freeze = [i for i in decision.freeze if not self.guard.blocks_freeze(i)]
        return decision

    def _share(self, decision: Decision, error: str | None) -> Decision:
        """Rank 0's decision (and stage cadence) on every rank; signals stay on rank 0, which logs them.

        Why: strategies read signals that can differ across ranks (a background thread finishing at another step,
        float noise in a local statistic); applying rank 0's decision everywhere keeps the frozen sets, and so the
        DDP wrappers and the weights, identical.
        """
        from .distributed import broadcast_object

        payload = None
        if self.decides:
            payload = {"error": error, "freeze": list(decision.freeze), "thaw": list(decision.thaw),
                       "reason": decision.reason, "thaw_lr": dict(decision.thaw_lr),
                       "lr_scale": dict(decision.lr_scale), "stage_every": self.strategy.stage_every,
                       "at_epoch_end": self.strategy.at_epoch_end}
        payload = broadcast_object(payload)
        if payload["error"] is not None:
            if self.decides:
                return decision
            raise RuntimeError(f"the freezing strategy failed on rank 0: {payload['error']}")
        self.strategy.stage_every, self.strategy.at_epoch_end = payload["stage_every"], payload["at_epoch_end"]
        if self.decides:
            return decision
        return Decision(freeze=payload["freeze"], thaw=payload["thaw"], reason=payload["reason"],
                        thaw_lr=payload["thaw_lr"], lr_scale=payload["lr_scale"])
