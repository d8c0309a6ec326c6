"""The ``egeria`` strategy: freeze the front block once its plasticity against a quantized reference model stops
changing (:class:`Egeria`; how it works, what is the paper's and what is ours: :mod:`layerfreeze.strategies.egeria`).

The training thread only copies weights into a CPU shadow at an evaluation stage and submits the evaluation
(:func:`~layerfreeze.strategies.egeria.plasticity.evaluate`) to one background worker thread; the next stage applies
its result.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from layerfreeze.strategies.base import Decision, StageContext, Strategy, is_int
from layerfreeze.strategies.egeria.plasticity import (
    Evaluation,
    advance_count,
    block_outputs,
    evaluate,
    plasticity_per_block,
)
from layerfreeze.strategies.egeria.reference import QUANTIZATIONS, build_reference, cpu_copy
from layerfreeze.strategies.registry import register_strategy

STATE_VERSION = 1

#: Name prefix of the worker thread (lets users and tests find it).
THREAD_PREFIX = "layerfreeze-egeria"


# --------------------------------------------------------------------------------------------------------------
# Pure functions
# --------------------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------------------
# Probe batch and block outputs
# --------------------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------------------
# The strategy
# --------------------------------------------------------------------------------------------------------------


def _check_int(name: str, value: Any, minimum: int) -> int:
    if not is_int(value) or value < minimum:
        raise ValueError(f"egeria: {name} must be an integer >= {minimum}, got {value!r}")
    return value


@register_strategy("egeria")
class Egeria(Strategy):
    """Freezes the front block when its plasticity against an int8 reference model stops changing (Egeria).

    See the module docstring for the method, the sources, the costs and what is a documented choice.

    Args:
        interval: Optimizer steps between plasticity evaluations (``stage_every``), ``>= 1``.
        refresh_every: Evaluations between rebuilds of the reference from the current weights, ``>= 1``.
        tolerance: A block is stable at an evaluation when its plasticity's relative change is below this, ``> 0``.
        patience: Consecutive stable evaluations before the front block freezes, ``>= 1``; below ``refresh_every``
            (a warning otherwise: the count restarts after each refresh, see :meth:`apply_evaluation`).
        probe_size: Samples of the first training batch kept as the fixed probe batch, ``>= 1``.
        synchronous: Run each evaluation inline at its stage (no lag, deterministic) instead of in the worker.
        reference_quantization: ``"dynamic"`` (PyTorch dynamic int8 for ``nn.Linear``, weight-only int8 for the
            other weights; weight-only everywhere if the build cannot) or ``"weight_only"``.

    Raises:
        ValueError: a parameter outside its range (the message names it and the range).
    """

    def __init__(self, interval: int = 50, refresh_every: int = 10, tolerance: float = 0.1, patience: int = 3,
                 probe_size: int = 32, synchronous: bool = False, reference_quantization: str = "dynamic") -> None:
        super().__init__()
        self.interval = _check_int("interval", interval, 1)
        self.refresh_every = _check_int("refresh_every", refresh_every, 1)
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < math.inf:
            raise ValueError(f"egeria: tolerance must be a finite number > 0 (relative change), got {tolerance!r}")
        self.tolerance = float(tolerance)
        self.patience = _check_int("patience", patience, 1)
        if self.refresh_every <= self.patience:
            warnings.warn(
                f"egeria: refresh_every={self.refresh_every} <= patience={self.patience}: the evaluation after each "
                "reference refresh is compared with the new reference's baseline (the int8 noise floor), which "
                "restarts a block's stable count unless its plasticity stays within tolerance of that floor, so a "
                f"block has at most {self.refresh_every - 1} stable evaluations between two refreshes to reach "
                f"{self.patience}, and usually nothing freezes; use refresh_every > patience (defaults: 10 and 3)",
                stacklevel=2)
        self.probe_size = _check_int("probe_size", probe_size, 1)
        if not isinstance(synchronous, bool):
            raise ValueError(f"egeria: synchronous must be True or False, got {synchronous!r}")
        self.synchronous = synchronous
        if reference_quantization not in QUANTIZATIONS:
            raise ValueError(f"egeria: reference_quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {reference_quantization!r}")
        self.reference_quantization = reference_quantization
        self.stage_every = self.interval

        # Resumable state (see state_dict).
        self.history: list[list[float]] = []
        self.counts: list[int] = []
        self.previous: list[float | None] = []
        self.evaluations = 0
        self.evaluations_skipped = 0
        self.refreshes = 0
        self._since_refresh = 0
        self._probe: tuple[tuple[Any, ...], dict[str, Any]] | None = None

        # Attached objects (not state).
        self.reference_report: dict[str, Any] = {}  # which int8 scheme each tensor got
        self._model: nn.Module | None = None
        self._names: dict[int, str] = {}
        self._num_blocks = 0
        self._shadow: nn.Module | None = None
        self._shadow_state: dict[str, torch.Tensor] = {}
        self._reference: nn.Module | None = None
        self._probe_handle: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._pending_step = 0

    # ---- public views -------------------------------------------------------------------------------------

    @property
    def probe(self) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The captured probe batch ``(args, kwargs)`` (CPU tensors), or None before the first training forward."""
        return self._probe

    @property
    def reference(self) -> nn.Module | None:
        """The current int8 reference model (CPU, eval mode); read it, do not train it."""
        return self._reference

    @property
    def worker_busy(self) -> bool:
        """True while a background evaluation is submitted and not yet picked up by a stage."""
        return self._pending is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the in-flight evaluation (if any) has finished; True if none is running after the call.

        Its result (or exception) is still picked up by the next stage.
        """
        pending = self._pending
        if pending is None:
            return True
        try:
            pending.exception(timeout=timeout)
        except TimeoutError:
            return False
        return True

    # ---- Strategy hooks -----------------------------------------------------------------------------------

    def validate(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("egeria: the model has no blocks")

    def attach(self, model: nn.Module, blocks: list[Any]) -> None:
        """Copy the model to the CPU (shadow), build the int8 reference, and hook the model to capture the probe."""
        self.detach()
        module_names = {id(m): n for n, m in model.named_modules()}
        names: dict[int, str] = {}
        for block in blocks:
            if block.is_head or not block.modules:
                continue
            last = block.modules[-1][1]
            if id(last) not in module_names:
                raise ValueError(f"egeria: block {block.name!r} is not part of the model given to the Freezer")
            names[block.index] = module_names[id(last)]
        self._model = model
        self._names = names
        self._num_blocks = len(blocks)
        self._resize(len(blocks))
        self._shadow = cpu_copy(model)
        self._shadow_state = self._shadow.state_dict()
        self._reference, self.reference_report = build_reference(self._shadow, self.reference_quantization)
        if self._probe is None:
            self._probe_handle = model.register_forward_pre_hook(self._capture_probe, with_kwargs=True)

    def detach(self) -> None:
        """Stop the worker (after the running evaluation, if any, finishes) and remove the probe hook."""
        if self._probe_handle is not None:
            self._probe_handle.remove()
            self._probe_handle = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._pending = None

    def decide(self, ctx: StageContext) -> Decision:
        """At a step stage: pick up a finished evaluation (apply the freezing rule), then submit the next one.

        Besides the per-block signals of :meth:`apply_evaluation` (present only when an evaluation was applied),
        every step stage reports ``evaluations``, ``evaluations_skipped``, ``evaluation_busy`` (1.0 when this stage
        found the worker still busy and submitted nothing), ``reference_refreshes`` and the reference's int8
        counts. Re-raises, in the training thread, an exception of the evaluation it picks up.
        """
        if ctx.event != "step":
            return Decision()
        if self._shadow is None:
            raise RuntimeError("egeria: decide() before attach(); use it through layerfreeze.Freezer")
        if len(ctx.blocks) != self._num_blocks:
            raise ValueError(f"egeria: attached to {self._num_blocks} blocks, the stage has {len(ctx.blocks)}")
        if self._probe is None:
            return Decision(signals=self._bookkeeping(busy=False))
        decision = Decision()
        if self.synchronous:
            if self._submit(ctx):
                result = self._collect()
                decision = self.apply_evaluation(result.plasticity, ctx, result.baseline, result.step)
            decision.signals.update(self._bookkeeping(busy=False))
            return decision
        if self._pending is not None and self._pending.done():
            result = self._collect()  # re-raises an exception of the worker here, in the training thread
            decision = self.apply_evaluation(result.plasticity, ctx, result.baseline, result.step)
        busy = self._pending is not None
        if busy:
            self.evaluations_skipped += 1  # never wait for the worker on the training thread
        else:
            self._submit(ctx, skip=decision.freeze)
        decision.signals.update(self._bookkeeping(busy=busy))
        return decision

    def apply_evaluation(
        self,
        plasticity: Sequence[float | None],
        ctx: StageContext,
        baseline: Sequence[float | None] | None = None,
        step: int | None = None,
    ) -> Decision:
        """Record one evaluation's plasticity per block and apply the freezing rule (used by :meth:`decide`).

        Public so the rule can be driven with crafted plasticity series.

        Args:
            plasticity: One value per block (None where not measured); values of frozen blocks and of the head
                are ignored.
            ctx: The current stage (which blocks are frozen now).
            baseline: After a reference refresh, each block's plasticity against the new reference: the next
                evaluation's change is taken against it.
            step: The step whose weights were measured (for the ``evaluation_step`` signal).

        Returns:
            A decision freezing the front active block if it has been stable for ``patience`` evaluations, with
            signals ``plasticity``, ``plasticity_change`` and ``stable_count`` (one float per block, NaN for frozen
            blocks, the head and blocks not measured).
        """
        n = len(ctx.blocks)
        if len(plasticity) != n:
            raise ValueError(f"egeria: {len(plasticity)} plasticity values for {n} blocks")
        self._resize(n)
        values, changes, counts = [math.nan] * n, [math.nan] * n, [math.nan] * n
        for view in ctx.blocks:
            i, p = view.index, plasticity[view.index]
            if view.frozen or view.is_head or p is None:
                continue
            p = float(p)
            changes[i], self.counts[i] = advance_count(self.counts[i], self.previous[i], p, self.tolerance)
            self.history[i].append(p)
            self.previous[i] = p
            values[i], counts[i] = p, float(self.counts[i])
        if baseline is not None:
            self.previous = [None if b is None else float(b) for b in baseline]
        self.evaluations += 1
        signals: dict[str, Any] = {"plasticity": values, "plasticity_change": changes, "stable_count": counts}
        if step is not None:
            signals["evaluation_step"] = float(step)
        front = ctx.frozen_prefix
        if front < n and not ctx.blocks[front].is_head and not ctx.blocks[front].frozen \
                and self.counts[front] >= self.patience and not math.isnan(counts[front]):
            name = ctx.blocks[front].name
            reason = (f"egeria: plasticity of {name} changed by less than {self.tolerance:g} (relative) for "
                      f"{self.counts[front]} evaluations")
            return Decision(freeze=[front], reason=reason, signals=signals)
        return Decision(signals=signals)

    # ---- checkpoint ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "history": [list(h) for h in self.history],
            "counts": list(self.counts),
            "previous": list(self.previous),
            "evaluations": self.evaluations,
            "evaluations_skipped": self.evaluations_skipped,
            "refreshes": self.refreshes,
            "since_refresh": self._since_refresh,
            "probe": None if self._probe is None else {"args": list(self._probe[0]), "kwargs": dict(self._probe[1])},
            # what a resume needs to compare with what this run compares with: the reference itself (rebuilt from
            # the resumed weights it would be one refresh newer) and the evaluation in flight, finished here (this
            # run picks it up at its next stage, as the resumed one does)
            "reference": None if self._reference is None else self._reference.state_dict(),
            "reference_report": dict(self.reference_report),
            "pending": self._pending_state(),
        }

    def _pending_state(self) -> dict[str, Any] | None:
        if self._pending is None:
            return None
        try:
            result: Evaluation = self._pending.result()
        except Exception:  # this run's next stage re-raises it; a resumed run evaluates again
            return None
        return {"step": self._pending_step, "plasticity": list(result.plasticity), "report": result.report,
                "baseline": None if result.baseline is None else list(result.baseline),
                "reference": None if result.reference is None else result.reference.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; when attached, rebuild the reference from the current weights (a refresh)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"egeria: state version {state.get('version')!r} != {STATE_VERSION}")
        if self._pending is not None:
            self.wait()
            self._pending = None
        self.history = [[float(v) for v in h] for h in state["history"]]
        self.counts = [int(c) for c in state["counts"]]
        self.previous = [None if v is None else float(v) for v in state["previous"]]
        self.evaluations = int(state["evaluations"])
        self.evaluations_skipped = int(state["evaluations_skipped"])
        self.refreshes = int(state["refreshes"])
        self._since_refresh = int(state["since_refresh"])
        probe = state.get("probe")
        if probe is not None:
            self._probe = (tuple(probe["args"]), dict(probe["kwargs"]))
            if self._probe_handle is not None:
                self._probe_handle.remove()
                self._probe_handle = None
        if self._shadow is None:
            return
        self._resize(self._num_blocks)
        self._copy_weights()
        self._reference, self.reference_report = build_reference(self._shadow, self.reference_quantization)
        if state.get("reference") is not None:  # the saved reference: the resumed run compares as this one did
            self._reference.load_state_dict(state["reference"])
            self.reference_report = dict(state.get("reference_report") or {})
        else:  # a state without it (older): a reference from the resumed weights counts as a refresh
            self.previous = [None] * self._num_blocks
            if self._probe is not None:
                trained = block_outputs(self._shadow, self._names, self._probe)
                self.previous = plasticity_per_block(trained, block_outputs(self._reference, self._names, self._probe),
                                                     self._num_blocks)
        pending = state.get("pending")
        if pending is not None:
            reference = None
            if pending["reference"] is not None:
                reference, _ = build_reference(self._shadow, self.reference_quantization)
                reference.load_state_dict(pending["reference"])
            self._pending, self._pending_step = Future(), int(pending["step"])
            self._pending.set_result(Evaluation(int(pending["step"]), list(pending["plasticity"]), reference,
                                                pending["report"], pending["baseline"]))

    def __repr__(self) -> str:
        return (f"Egeria(interval={self.interval}, refresh_every={self.refresh_every}, tolerance={self.tolerance:g}, "
                f"patience={self.patience}, probe_size={self.probe_size}, synchronous={self.synchronous}, "
                f"reference_quantization={self.reference_quantization!r})")

    def held_tensors(self) -> list[torch.Tensor]:
        """What Egeria holds (the memory ledger's ``strategy`` bucket), all on the host: the shadow copy of the
        model's weights, the int8 reference's tensors and the probe batch."""
        held = list(self._shadow_state.values())
        if self._reference is not None:
            held += [t for t in self._reference.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]
        if self._probe is not None:
            held += [t for part in self._probe for t in tree_flatten(part)[0] if isinstance(t, torch.Tensor)]
        return held

    # ---- internals ----------------------------------------------------------------------------------------

    def _resize(self, n: int) -> None:
        while len(self.history) < n:
            self.history.append([])
            self.counts.append(0)
            self.previous.append(None)

    def _capture_probe(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not module.training or self._probe is not None:
            return None
        n = self.probe_size

        def keep(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if t.dim() >= 1:
                t = t[:n]
            return t.to("cpu").clone()

        self._probe = (tree_map_only(torch.Tensor, keep, tuple(args)), tree_map_only(torch.Tensor, keep, dict(kwargs)))
        if self._probe_handle is not None:
            self._probe_handle.remove()
            self._probe_handle = None
        return None

    def _copy_weights(self) -> None:
        """Copy every parameter and buffer of the training model into the CPU shadow (training thread)."""
        with torch.no_grad():
            for key, value in self._model.state_dict().items():
                target = self._shadow_state.get(key)
                if target is not None:
                    target.copy_(value)

    def _submit(self, ctx: StageContext, skip: Sequence[int] = ()) -> bool:
        """Copy the weights into the shadow and start an evaluation of the active blocks (False if none)."""
        names = {i: n for i, n in self._names.items() if not ctx.blocks[i].frozen and i not in skip}
        if not names:
            return False
        self._copy_weights()
        args = (ctx.step, self._shadow, self._reference, self._probe, names, self._num_blocks,
                self._since_refresh + 1 >= self.refresh_every, self.reference_quantization)
        self._pending_step = ctx.step
        if self.synchronous:
            future: Future = Future()
            try:
                future.set_result(evaluate(*args))
            except Exception as exc:
                future.set_exception(exc)
            self._pending = future
            return True
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_PREFIX)
        self._pending = self._executor.submit(evaluate, *args)
        return True

    def _collect(self) -> Evaluation:
        future, step = self._pending, self._pending_step
        self._pending = None
        try:
            result: Evaluation = future.result()
        except Exception as exc:
            exc.add_note(f"(raised in Egeria's {'inline' if self.synchronous else 'background'} plasticity "
                         f"evaluation of the weights of step {step}; re-raised at the next freezing stage)")
            raise
        if result.reference is not None:
            self._reference = result.reference
            self.reference_report = result.report or {}
            self.refreshes += 1
            self._since_refresh = 0
        else:
            self._since_refresh += 1
        return result

    def _bookkeeping(self, busy: bool) -> dict[str, Any]:
        report = self.reference_report
        return {
            "evaluations": float(self.evaluations),
            "evaluations_skipped": float(self.evaluations_skipped),
            "evaluation_busy": 1.0 if busy else 0.0,
            "reference_refreshes": float(self.refreshes),
            "reference_dynamic_int8_modules": float(len(report.get("dynamic_int8", []))),
            "reference_weight_only_int8_tensors": float(len(report.get("weight_only_int8", []))),
        }
