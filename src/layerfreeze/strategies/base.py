"""The strategy interface: a policy that, at each freezing stage, says which blocks to freeze or thaw.

Strategies decide; the engine (:mod:`layerfreeze.engine`) applies. A strategy never touches the model or the
optimizer, so the same strategy works in the CLI trainer, in a user's own loop, in Lightning and in the HF Trainer.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


def is_int(value: Any) -> bool:
    """True for an ``int`` that is not a ``bool`` (parameter validation: ``True`` is not a block count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """True for a finite ``int``/``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class BlockView:
    """What a strategy sees of one block at a freezing stage."""

    name: str
    index: int
    frozen: bool
    is_head: bool
    num_parameters: int
    #: A layer of the model's repeated stack, not its embeddings, stem, pooler or head
    #: (:func:`~layerfreeze.models.blocks.stack_layers`).
    is_layer: bool = True


@dataclass
class StageContext:
    """Everything a strategy may look at during a freezing stage.

    Attributes:
        step: Optimizer steps completed so far (the stage happens after step ``step``).
        epoch: 0-based epoch the stage belongs to; at an epoch-end stage, the epoch just finished.
        event: ``"start"`` (before the first step), ``"step"`` (every ``stage_every`` steps) or ``"epoch_end"``.
        blocks: The blocks in forward order.
        total_steps: Planned optimizer steps for the run, if known (needed by schedule-based strategies).
        steps_per_epoch: Optimizer steps per epoch, if known.
        signals: Signals the strategy asked for in :attr:`Strategy.signals`, e.g.
            ``{"grad_l1": [float per block]}`` accumulated since the previous stage.
        block_lrs: Base learning rate of each block (its first param group's ``initial_lr``, else ``lr``) before any
            scaling by the strategy; None without an optimizer.
        optimizer_state: Read-only view of the optimizer: ``optimizer_state(param)`` -> ``(state, param_group)`` of a
            parameter the optimizer holds (for Adam/AdamW: ``state["exp_avg"]``, ``state["exp_avg_sq"]`` (tensors
            of the parameter's shape), ``state["step"]``; ``group["betas"]``, ``group["eps"]``), or None (the
            parameter is not in the optimizer, e.g. a frozen block's, or has no state yet). A strategy must not
            change what it returns. None without an optimizer.
        step_seconds: Median wall-clock seconds of the recent training steps that ran no stage (the last 16), as the
            Freezer measured them between its ``step()`` calls on the host (``time.perf_counter``, no device
            synchronisation; :mod:`layerfreeze.engine.timing`); None until measured. What a stage's cost is weighed
            against when a strategy sets its cadence.
        stage_step_seconds: The same for the recent steps that ran a stage (the stage's own time included); None until
            measured.
    """

    step: int
    epoch: int
    event: str
    blocks: list[BlockView]
    total_steps: int | None = None
    steps_per_epoch: int | None = None
    signals: dict[str, Any] = field(default_factory=dict)
    block_lrs: list[float] | None = None
    optimizer_state: Callable[[Any], Any] | None = None
    step_seconds: float | None = None
    stage_step_seconds: float | None = None

    @property
    def progress(self) -> float | None:
        """Fraction of training done, in [0, 1], when ``total_steps`` is known."""
        if not self.total_steps:
            return None
        return min(1.0, self.step / self.total_steps)

    def require_progress(self, who: str) -> float:
        """:attr:`progress`, or RuntimeError: strategy ``who`` needs the run length (``Freezer(total_steps=...)``)."""
        if self.progress is None:
            raise RuntimeError(
                f"Strategy {who!r} needs the planned number of optimizer steps to know the fraction of training done: "
                "pass total_steps=<planned optimizer steps> to Freezer(...) (the CLI trainer does this); under "
                "Lightning, whose LayerFreeze callback passes the Trainer's estimate, give Trainer(max_steps=...) or "
                "a finite max_epochs"
            )
        return self.progress

    @property
    def frozen_prefix(self) -> int:
        """Number of leading blocks that are frozen."""
        k = 0
        for b in self.blocks:
            if not b.frozen:
                break
            k += 1
        return k


@dataclass
class Decision:
    """What a strategy wants done at a stage: block indices to freeze and to thaw, and why.

    ``thaw_lr`` optionally maps a block index to the learning rate its parameters get back (discriminative LR);
    ``lr_scale`` maps a block index to a factor the engine multiplies into that block's scheduled learning rate
    after every step until changed again (1.0 removes it; used by FreezeOut's per-block annealing);
    ``signals`` carries the strategy's internal values (ratios, plasticity, schedules) to telemetry.
    """

    freeze: list[int] = field(default_factory=list)
    thaw: list[int] = field(default_factory=list)
    reason: str = ""
    thaw_lr: dict[int, float] = field(default_factory=dict)
    lr_scale: dict[int, float] = field(default_factory=dict)
    signals: dict[str, Any] = field(default_factory=dict)


class Strategy:
    """Base class of freezing strategies.

    Subclasses are registered with :func:`~layerfreeze.strategies.register_strategy` (which sets :attr:`name`),
    optionally set :attr:`signals`, and implement :meth:`decide`. They are asked at the
    start of training (``event="start"``), every ``stage_every`` optimizer steps if :attr:`stage_every` is set, and
    at each epoch end if :attr:`at_epoch_end` is true. Strategies keep their own state in plain attributes and
    expose it through :meth:`state_dict` / :meth:`load_state_dict` so runs resume exactly.
    """

    name: ClassVar[str] = "base"
    #: Signals the engine must collect for this strategy, e.g. ``("grad_l1",)``.
    signals: ClassVar[tuple[str, ...]] = ()
    #: Whether ``grad_l1`` must cover the head too. False (AutoFreeze, which never scores the head): the engine keeps
    #: no gradient sums for the head and reports 0.0 for it; an LM head is often the largest block.
    head_signals: ClassVar[bool] = True
    #: Whether ``grad_l1`` covers only the layers of the repeated stack (``BlockView.is_layer``; AutoFreeze scores
    #: only the encoder layers): the engine keeps no gradient sums for the embeddings, a pooler or the head.
    layer_signals_only: ClassVar[bool] = False
    #: Whether a block's learning-rate factor reaches 0 where the strategy freezes it (FreezeOut): anyone else's thaw
    #: of such a block trains it at LR 0 until the strategy freezes it again, so the stability guard cannot undo its
    #: freezes (the Freezer refuses the pair).
    anneals_to_zero: ClassVar[bool] = False
    #: Whether block 0 always trains (LISA's embeddings): with no floor below it the run has no frozen prefix, so
    #: the activation cache serves nothing, and a memory plan charges the strategy none
    #: (:func:`~layerfreeze.budget.plan.plan_memory`).
    trains_first_block: ClassVar[bool] = False

    def __init__(self) -> None:
        self.stage_every: int | None = None
        self.at_epoch_end: bool = False
        #: True for a strategy whose thaws give blocks learning rates of their own (``Decision.thaw_lr``): the
        #: engine then checks, when it gets the optimizer, that every block has param groups of its own, instead
        #: of failing at the first thaw, an epoch into the run.
        self.thaw_lrs: bool = False

    def validate(self, num_blocks: int) -> None:
        """Check the parameters against the model's number of blocks; raise ValueError with what to change."""

    @property
    def reads_model(self) -> bool:
        """True for a strategy that observes the model itself (it overrides :meth:`attach`: SmartFRZ reads weight
        samples, Egeria copies the weights and runs them). Under FSDP2 the engine then gives it an unsharded mirror
        of the model to observe (:class:`~layerfreeze.distributed.fsdp.Mirror`)."""
        return type(self).attach is not Strategy.attach

    @property
    def reads_optimizer_state(self) -> bool:
        """True for a strategy that reads the optimizer's per-parameter state through
        :attr:`StageContext.optimizer_state` (SmartFRZ's gradient signal-to-noise gate reads Adam's moments). Under
        FSDP2 the engine then gathers that state whole into the mirror at every stage
        (:meth:`~layerfreeze.distributed.fsdp.Mirror.refresh_moments`), as it gathers the weights."""
        return False

    def attach(self, model: Any, blocks: list[Any]) -> None:
        """Called once by the engine before the start stage, for strategies that observe the model themselves
        (weights, activations). They must not change the model, the optimizer or ``requires_grad``."""

    def detach(self) -> None:
        """Release what :meth:`attach` set up (hooks, threads). Called by ``Freezer.close()``."""

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors the strategy itself holds (recorder buffers, copies, reference models' weights), for the
        memory ledger's ``strategy`` bucket (:meth:`ledger_bytes`). Default: none."""
        return []

    def ledger_tensors(self) -> list[torch.Tensor]:
        """:meth:`held_tensors`: the memory ledger never counts them as saved activations."""
        return self.held_tensors()

    def ledger_bytes(self) -> dict[str, dict[str, int]]:
        """The memory ledger's byte-source report (:class:`~layerfreeze.runs.ledger_buckets.ByteSource`):
        ``{"strategy": {device: bytes}}`` of :meth:`held_tensors`, each storage once, or ``{}`` when it holds
        none."""
        out = storage_bytes(self.held_tensors())
        return {"strategy": out} if out else {}

    def decide(self, ctx: StageContext) -> Decision:
        """Return the blocks to freeze / thaw at this stage. The head is never frozen (the engine enforces it)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The strategy's resumable state (plain Python values)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def storage_bytes(tensors: Iterable[torch.Tensor]) -> dict[str, int]:
    """Bytes per device of the storages under ``tensors``, each storage once (views of one buffer count once)."""
    seen: set[tuple[str, int]] = set()
    out: dict[str, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        out[key[0]] = out.get(key[0], 0) + int(storage.nbytes())
    return out


class PrefixSchedule(Strategy):
    """The skeleton shared by the schedules that freeze a growing prefix at epoch ends (``linear``, ``geometric``).

    At each epoch end the subclass's :meth:`schedule` gives the number of leading blocks that should be frozen
    (``target``) with its signals and reason, and blocks ``0..target-1`` that are not frozen yet are frozen. The
    start stage resets ``target`` to 0; other stages decide nothing. ``target`` is the resumable state.

    Attributes:
        needs_progress: The schedule reads the fraction of training done, so every stage (the start included)
            checks that the run's length is known (:meth:`StageContext.require_progress`).
    """

    needs_progress: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self.at_epoch_end = True
        self.target = 0

    def schedule(self, ctx: StageContext, count: int) -> tuple[int, dict[str, Any], str]:
        """``(target, signals, reason)`` at this epoch end, with ``count`` freezable (non-head) blocks."""
        raise NotImplementedError

    def decide(self, ctx: StageContext) -> Decision:
        if self.needs_progress:
            ctx.require_progress(self.name)
        if ctx.event == "start":
            self.target = 0
            return Decision()
        if ctx.event != "epoch_end":
            return Decision()
        self.target, signals, reason = self.schedule(ctx, len(ctx.blocks) - 1)
        freeze = [i for i in range(self.target) if not ctx.blocks[i].frozen]
        return Decision(freeze=freeze, reason=reason, signals=signals)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.target = int(state.get("target", 0))


class LayerRotation(Strategy):
    """The skeleton shared by the strategies that rotate which middle layers train (``lisa``, ``badam``).

    Both see the blocks as the papers see a decoder LM: block 0 is the embeddings, the last block the head (final
    norm + LM head; the engine never freezes it), and blocks ``1..L-2`` the middle (transformer) layers. Every
    ``k`` optimizer steps (a step stage, ``stage_every = k``) the subclass's :meth:`switch` says which layers switch
    off and which switch on; the engine frees the optimizer state of every block that switches off and gives every
    block that switches on fresh state, back in its own param groups (a block named in both lists is switched off
    and on again: its state starts afresh).

    These are **not prefix freezes**: a frozen block above the lowest trainable one still runs forward and backward
    (the gradient flows through it to the trainable blocks below), so freezing it saves its weight gradients and its
    optimizer state (and their computation), not its backward; only blocks below the lowest trainable block (a
    frozen prefix: BAdam's frozen embeddings, the layers under its active one) save their backward and their saved
    activations, and only they can be served by the activation cache (:mod:`layerfreeze.compute.cache`, which reads
    :attr:`~layerfreeze.engine.Freezer.frozen_prefix`).

    The random numbers come from the strategy's own generator (``random.Random(seed)``), never the global RNG, and
    its state is part of :meth:`state_dict`, so a resumed run samples what the uninterrupted one samples. ``seed``
    None takes ``torch.initial_seed()`` (the run's seed once ``torch.manual_seed`` was called; it draws nothing).

    Raises (constructor):
        ValueError: ``k`` not an int ``>= 1``, ``seed`` not an int or None.
    """

    def __init__(self, k: int, seed: int | None) -> None:
        super().__init__()
        if not is_int(k) or k < 1:
            raise ValueError(f"{self.name}: k must be an integer >= 1 (optimizer steps between switches), got {k!r}")
        if seed is not None and not is_int(seed):
            raise ValueError(f"{self.name}: seed must be an integer or None (None: torch.initial_seed()), got "
                             f"{seed!r}")
        self.k = k
        self.seed = int(torch.initial_seed()) if seed is None else int(seed)
        self.rng = random.Random(self.seed)
        self.stage_every = k
        self.switches = 0

    @staticmethod
    def middle(num_blocks: int) -> list[int]:
        """The middle layers of a model of ``num_blocks`` blocks: ``1..num_blocks-2``."""
        return list(range(1, num_blocks - 1))

    def switch(self, ctx: StageContext) -> tuple[list[int], list[int], dict[str, Any], str]:
        """``(switch off, switch on, signals, reason)`` at a step stage (every ``k`` steps)."""
        raise NotImplementedError

    def start(self, ctx: StageContext) -> tuple[list[int], list[int], dict[str, Any], str]:
        """``(freeze, thaw, signals, reason)`` at the start stage: the first trainable set."""
        raise NotImplementedError

    def decide(self, ctx: StageContext) -> Decision:
        if ctx.event == "start":
            self.validate(len(ctx.blocks))
            self.switches = 0
            off, on, signals, reason = self.start(ctx)
            off = [i for i in off if not ctx.blocks[i].frozen]
            on = [i for i in on if ctx.blocks[i].frozen]
        elif ctx.event == "step" and ctx.step > 0 and ctx.step % self.k == 0:
            self.switches += 1
            off, on, signals, reason = self.switch(ctx)
        else:
            return Decision()
        signals = {"switches": self.switches, **signals}
        return Decision(freeze=off, thaw=on, reason=reason, signals=signals)

    def rotation_state(self) -> dict[str, Any]:
        """The state both keep: switches done, the seed and the generator's state (plain values)."""
        return {"k": self.k, "seed": self.seed, "switches": self.switches, "rng": _plain(self.rng.getstate())}

    def load_rotation_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`rotation_state` (also after a JSON round trip, which turns tuples into lists)."""
        self.switches = int(state.get("switches", 0))
        if "rng" in state:
            version, internal, gauss = state["rng"]
            self.rng.setstate((version, tuple(internal), gauss))


def _plain(value: Any) -> Any:
    """Tuples as lists, recursively (the generator's state as a checkpoint stores it)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value
