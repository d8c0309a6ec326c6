"""``autofreeze``: freeze the front blocks whose gradient norm has stopped changing (gradient-norm test).

Source: Y. Liu, S. Agarwal, S. Venkataraman, "AutoFreeze: Automatically Freezing Model Blocks to Accelerate
Fine-tuning", arXiv:2102.01386, 2021, sec. 3 (Algorithm 1, the gradient-norm test), and the authors' public code
(github.com/YuhanLiu11/AutoFreeze, ``freeze_intermediate_e2e_lr.py``: the evaluation loop of ``main``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from layerfreeze.strategies.base import Decision, StageContext, Strategy, is_int, is_number
from layerfreeze.strategies.registry import register_strategy


def percentile_linear(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` by linear interpolation (``numpy.percentile``'s default ``"linear"``
    method): sort, take the virtual index ``h = (n - 1) * q / 100`` and interpolate between the two neighbours.

    Unlike numpy it returns ``inf`` rather than NaN when both neighbours are ``inf`` (numpy computes
    ``inf - inf``); with finite values it equals ``numpy.percentile(values, q)`` up to rounding.
    """
    a = sorted(values)
    h = (len(a) - 1) * q / 100.0
    lo = math.floor(h)
    frac = h - lo
    if frac == 0.0 or a[lo] == a[lo + 1]:
        return a[lo]
    if math.isinf(a[lo + 1]):
        return math.inf
    return a[lo] + (a[lo + 1] - a[lo]) * frac


@register_strategy("autofreeze")
class AutoFreeze(Strategy):
    """AutoFreeze's gradient-norm test: ten times a run, freeze the front blocks that changed least.

    The rule, at each stage (every ``interval`` optimizer steps; ``grad_l1[i]`` = ``sum_p ||sum_t g_t(p)||_1`` over
    block ``i``'s parameters ``p``: the L1 norm of the gradient summed over the backward passes since the previous
    stage, as the public code's ``grad_tensor_dict``; the Freezer adds each update's gradients to a running sum at
    ``optimizer.step()``, after a ``GradScaler`` unscaled them, once per update whatever the gradient accumulation;
    a Freezer without an optimizer at ``Freezer.after_backward``; :mod:`layerfreeze.engine.grad_signal`):

    1. ``cur[i] = grad_l1[i]`` for every *active layer* ``i``: a layer of the model's repeated stack
       (``BlockView.is_layer``, :func:`~layerfreeze.models.blocks.stack_layers`: BERT's ``encoder.layer.N``), not the
       embeddings, a pooler or the head, as the public code scores only the encoder layers (the parameters whose name
       holds ``encoder``, ``freeze_intermediate_e2e_lr.py``).
    2. At the first stage there is no previous value: ``cur`` is stored as ``prev`` and nothing is decided.
    3. Otherwise ``ratio[i] = |prev[i] - cur[i]| / prev[i]``, the relative change of the block's gradient norm
       between two intervals. ``prev[i] = 0`` (the block got no gradient in the previous interval, or it was not
       active then) gives ``ratio = inf``: "not known to be stable", so the block and every block after it stay
       trainable at this stage.
    4. ``threshold`` = the ``percentile``-th percentile of the active layers' ratios, by linear
       interpolation between the two nearest ranks (``numpy.percentile``'s default method; an ``inf`` pair gives
       ``inf``, not NaN). The default 50 is the median, as in the paper.
    5. Let ``k`` be the first active layer with ``ratio[k] >= threshold``. Freeze the active blocks before ``k``
       that lie in the contiguous run of active blocks that starts right after the current frozen prefix (the
       candidates), so the frozen blocks stay a prefix; the public code sets ``start_layer = k``. The embeddings (the
       blocks before the stack) freeze with the first frozen layer, never alone, as the public code freezes them
       when ``start_layer > 0``. Since the maximum ratio is always ``>= threshold``, at least one layer stays
       trainable, and what follows the stack (a pooler, the head) never freezes. Blocks are never thawed.
    6. ``prev = cur``.

    If an active block's ``grad_l1`` is not finite (NaN / inf from an overflow, or NaN: every optimizer step of
    the interval was skipped), the stage decides nothing and keeps the previous ``prev``.

    Differences from the public code: at each freeze it builds the model and a new BERTAdam again (its
    ``frozen_model``), which resets the Adam moments of the layers that keep training; here their state is kept (the
    engine frees only the frozen blocks' state), which changes the next intervals' gradients a little. The others are
    at edges: it raises ZeroDivisionError for ``prev = 0`` (here ``inf``),
    and gives ratio 0 to a layer with ``cur = 0`` (here the formula, i.e. 1.0). It sums a layer's norms in float32
    on the host (here float64). It adds ``param.grad`` after every backward, so with gradient accumulation a
    micro-batch's gradient is added once for each later micro-batch of its step too (here once per update).

    When it decides: as the public code, ``num_intervals`` times per run (10 by default: its ``--num_intervals``),
    every ``interval = floor(total_steps / num_intervals)`` optimizer steps (``main``'s ``grad_eval_step``), fixed at
    the start stage from the run length the Freezer is given. An explicit ``interval`` (in steps) overrides it. A run
    whose length is unknown (``Freezer`` without ``total_steps``) and no ``interval`` evaluates every 50 steps, with a
    warning. How often it evaluates matters: each evaluation can freeze, so a fixed interval that is short for the run
    freezes more and earlier (a 2,000-step run: every 50 steps froze 8 of 9 blocks, every 200 steps 6).

    Memory and cost: the running sums are one float32 copy of the trainable layers' gradients on their device, the
    embeddings, a pooler and the head left out (the public code holds them for every parameter, the classifier
    included), freed block by block as blocks freeze, in the
    memory ledger's ``strategy`` bucket and in a memory plan; a checkpoint holds them too. Per update: one
    ``torch._foreach_add_``, no host synchronisation; a stage reads the norms with one copy to the host.

    Args:
        interval: Optimizer steps between two evaluations (``stage_every``); integer ``>= 1``, or None (default):
            ``floor(total_steps / num_intervals)``, at least 1.
        num_intervals: Evaluations per run when ``interval`` is None; integer ``>= 1``, or None (default): 10, the
            public code's default. Give ``interval`` or ``num_intervals``, not both.
        percentile: Percentile of the active blocks' ratios used as threshold, ``0 <= percentile <= 100``,
            default 50. 0 never freezes (the first candidate is always at or above the minimum); 100 freezes up to
            the block with the largest ratio.

    Raises:
        ValueError: a parameter outside its range.
        UserWarning (a warning, at the first step stage): neither ``interval`` nor the run length is known; it
            evaluates every 50 steps. At a resume: the checkpoint's cadence differs from this run's length's.
        RuntimeError (from the engine): a Freezer without an optimizer, and ``freezer.after_backward()`` was never
            called between two stages.

    Signals: ``ratios`` (per block; NaN for blocks without a ratio: frozen, not a layer, or first stage),
    ``threshold``, ``candidates`` (size of the candidate run), ``first_unstable`` (``k``, -1 if none this stage),
    ``grad_l1`` (the ``cur`` values; NaN for frozen blocks and those not a layer), ``interval`` (the steps between two
    evaluations this run uses).
    """

    signals = ("grad_l1",)
    head_signals = False  # the head is never a candidate: no gradient sums for it
    layer_signals_only = True  # nor the embeddings or a pooler: only the stack's layers are scored

    #: Steps between two evaluations when neither ``interval`` nor the run length is known.
    FALLBACK_INTERVAL = 50

    #: Evaluations per run when neither ``interval`` nor ``num_intervals`` is given (the public code's default).
    NUM_INTERVALS = 10

    def __init__(self, interval: int | None = None, percentile: float = 50.0, num_intervals: int | None = None
                 ) -> None:
        super().__init__()
        if interval is not None and (not is_int(interval) or interval < 1):
            raise ValueError(
                f"autofreeze: interval must be an integer >= 1 (optimizer steps between two evaluations) or null "
                f"(total_steps // num_intervals), got {interval!r}"
            )
        if num_intervals is not None and (not is_int(num_intervals) or num_intervals < 1):
            raise ValueError(f"autofreeze: num_intervals must be an integer >= 1 (evaluations per run), "
                             f"got {num_intervals!r}")
        if interval is not None and num_intervals is not None:
            raise ValueError(f"autofreeze: give interval ({interval} steps between evaluations) or num_intervals "
                             f"({num_intervals} evaluations a run), not both")
        if (not is_number(percentile)
                or not 0 <= percentile <= 100):
            raise ValueError(f"autofreeze: percentile must be a number in [0, 100], got {percentile!r}")
        self.interval = interval
        self.num_intervals = int(num_intervals) if num_intervals is not None else self.NUM_INTERVALS
        self.percentile = float(percentile)
        self.stage_every = interval  # None: set at the start stage from the run length
        #: ``cur`` of the previous evaluation, one entry per block (None where the block had no value).
        self.prev: list[float | None] | None = None
        #: Number of step-stages evaluated so far.
        self.evaluations = 0
        #: The start stage found no run length and fell back to FALLBACK_INTERVAL: warn at the first step stage,
        #: unless a checkpoint's cadence replaced it by then.
        self._unknown_length = False

    def validate(self, num_blocks: int) -> None:
        """AutoFreeze works with any number of blocks (with fewer than 3 it can never freeze anything)."""
        if num_blocks < 1:
            raise ValueError(f"autofreeze: the model has no blocks (got {num_blocks})")

    def decide(self, ctx: StageContext) -> Decision:
        if ctx.event == "start" and self.stage_every is None:
            if ctx.total_steps:
                self.stage_every = max(1, ctx.total_steps // self.num_intervals)
            else:
                self.stage_every, self._unknown_length = self.FALLBACK_INTERVAL, True
            return Decision(signals={"interval": self.stage_every})
        if ctx.event != "step":
            return Decision()
        if self._unknown_length:
            self._unknown_length = False
            warnings.warn(
                f"autofreeze: the run length is unknown, so it evaluates every {self.FALLBACK_INTERVAL} steps; give "
                f"it (Freezer(total_steps=...); the CLI, Lightning and the Hugging Face Trainer pass it when "
                f"max_steps or max_epochs is set) for {self.num_intervals} evaluations a run, or set interval",
                stacklevel=2)
        grad = ctx.signals.get("grad_l1")
        if grad is None or len(grad) != len(ctx.blocks):
            raise RuntimeError(
                "autofreeze needs ctx.signals['grad_l1'] (one value per block); drive it through "
                "layerfreeze.Freezer and call freezer.after_backward() after each loss.backward()"
            )
        nan = math.nan
        active = [b.index for b in ctx.blocks if not b.frozen and not b.is_head and b.is_layer]
        cur: list[float | None] = [None] * len(ctx.blocks)
        for i in active:
            cur[i] = float(grad[i])
        self.evaluations += 1
        signals: dict[str, Any] = {"grad_l1": [nan if v is None else v for v in cur], "interval": self.stage_every}
        if any(not math.isfinite(cur[i]) for i in active):  # type: ignore[arg-type]
            return Decision(reason="", signals={**signals, "skipped_non_finite": 1})
        if self.prev is None:
            self.prev = cur
            return Decision(signals=signals)

        ratios: list[float] = [nan] * len(ctx.blocks)
        for i in active:
            p = self.prev[i] if i < len(self.prev) else None
            ratios[i] = math.inf if not p else abs(p - cur[i]) / p  # type: ignore[operator]
        self.prev = cur
        signals["ratios"] = ratios
        if not active:
            return Decision(signals=signals)

        threshold = percentile_linear([ratios[i] for i in active], self.percentile)
        first = next(i for i in active if ratios[i] >= threshold)  # exists: max(ratios) >= any percentile
        start = ctx.frozen_prefix
        run: list[int] = []
        for b in ctx.blocks[start:]:
            if b.frozen or b.is_head:
                break
            run.append(b.index)
        freeze = [i for i in run if i < first]
        if not any(ctx.blocks[i].is_layer for i in freeze):  # the embeddings freeze with a layer, never alone
            freeze = []
        signals.update(threshold=threshold, candidates=len(run), first_unstable=first)
        reason = ""
        if freeze:
            reason = (
                f"autofreeze: block {ctx.blocks[first].name!r} (index {first}) is the first whose gradient-norm "
                f"change ratio {ratios[first]:.4g} >= the {self.percentile:g}th percentile {threshold:.4g}; blocks "
                f"before it changed less"
            )
        return Decision(freeze=freeze, reason=reason, signals=signals)

    def state_dict(self) -> dict[str, Any]:
        return {
            "interval": self.interval,
            "num_intervals": self.num_intervals,
            "stage_every": self.stage_every,
            "percentile": self.percentile,
            "prev": None if self.prev is None else list(self.prev),
            "evaluations": self.evaluations,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``prev``, the evaluation count and the interval the run evaluates at.

        The run goes on at the checkpoint's cadence, as the uninterrupted run would, also where this run's length
        (``total_steps``, changed by ``--max-steps`` or ``--epochs``) would give another: that is warned about. A
        checkpoint written before ``num_intervals`` existed recorded its fixed interval (50 by default then) as
        ``interval``; with ``interval`` None here the run goes on at that interval.

        Raises:
            ValueError: the checkpoint was written with another ``interval``, ``num_intervals`` or ``percentile``.
        """
        older = "num_intervals" not in state
        keys = ("percentile",) if older and self.interval is None else ("interval", "num_intervals", "percentile")
        for key in keys:
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"autofreeze: the checkpoint was written with {key}={state[key]!r}, this run has "
                    f"{key}={getattr(self, key)!r}; resume with the same freeze.params"
                )
        saved = state.get("stage_every", state.get("interval") if older else self.interval)
        if saved is not None:
            saved = int(saved)
            if self.interval is None and self.stage_every is not None and not self._unknown_length \
                    and saved != self.stage_every:
                warnings.warn(
                    f"autofreeze: the resumed run goes on evaluating every {saved} steps, as it started; this run's "
                    f"length would give every {self.stage_every} ({self.num_intervals} evaluations a run)",
                    stacklevel=2)
            self.stage_every = saved
            self._unknown_length = False
        prev = state.get("prev")
        self.prev = None if prev is None else [None if v is None else float(v) for v in prev]
        self.evaluations = int(state.get("evaluations", 0))

    def __repr__(self) -> str:
        every = self.interval if self.interval is not None else f"None (total_steps / {self.num_intervals})"
        return f"AutoFreeze(interval={every}, percentile={self.percentile:g})"
