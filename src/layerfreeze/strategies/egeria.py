"""``egeria``: freeze the front block once its *plasticity* against a quantized reference model stops changing.

Source: Yiding Wang, Decang Sun, Kai Chen, Fan Lai, Mosharaf Chowdhury, "Egeria: Efficient DNN Training with
Knowledge-Guided Layer Freezing", EuroSys 2023, arXiv 2201.06227 (sec. 3: training plasticity measured with the
semantic knowledge of a reference model; sec. 4: the reference model made on the fly by quantization and run
asynchronously on CPUs, freezing of the converged front layers). The SP loss is the similarity-preserving loss of
Tung & Mori, "Similarity-Preserving Knowledge Distillation", ICCV 2019 (eq. 1-4).

What is taken from the paper, and what is ours
----------------------------------------------
From the paper (checked against its abstract): plasticity quantifies a layer's training progress through
"semantic knowledge from a reference model"; the reference model is "generated on the fly using quantization
techniques and runs forward operations asynchronously on available CPUs"; converged *front* layers are frozen.
The body of the paper was not available to check, so the following are documented choices, not the paper's
numbers: the evaluation interval (50 steps), the reference refresh (every 10 evaluations), the tolerance (0.1,
relative change), the patience (3 evaluations) and the probe size (32 samples). Tune them per task.

How it works
------------
* **Reference model** (:mod:`~layerfreeze.strategies.egeria_reference`, which describes the int8 schemes). At
  :meth:`Egeria.attach` the model is copied to the CPU in fp32 (the *shadow*, see below) and a reference is built
  from it: a deep copy in eval mode, no grad, int8 (``nn.Linear`` by PyTorch's dynamic quantization, every other
  weight weight-only int8; weight-only everywhere when the build cannot, or with
  ``reference_quantization="weight_only"``). :attr:`Egeria.reference_report` says which scheme each tensor got
  and why, and the signals ``reference_dynamic_int8_modules`` / ``reference_weight_only_int8_tensors`` count
  them. The reference is rebuilt from the current training weights every ``refresh_every`` evaluations.
* **Probe batch.** A fixed batch captured once, from the first forward of the model in training mode (a forward
  pre-hook with kwargs, removed after the capture): detached CPU copies of the positional and keyword inputs,
  every tensor with at least one dimension cut to its first ``probe_size`` rows (dim 0 is taken to be the batch).
* **Plasticity** of each active (not frozen, not head) block = :func:`sp_loss` between the block's output on the
  probe batch in the training weights and in the reference. A block's output is the output of its last module,
  captured by the probe the oracle and the SmartFRZ collector use too (:func:`~layerfreeze.probe.probe_outputs`:
  the main tensor of a tuple, a list or a Hugging Face ``ModelOutput``, else its first tensor).
* **Off the critical path.** At an evaluation stage (every ``interval`` optimizer steps) the training thread only
  copies the current weights into the shadow (``copy_`` of every parameter and buffer: one device-to-host
  transfer of the model's size, e.g. ~90 MB for MiniLM-L6, and a synchronisation point on a GPU) and submits the
  evaluation to a single background worker thread (``ThreadPoolExecutor(max_workers=1)``). The worker runs the
  shadow and the reference forwards under ``torch.no_grad()`` in eval mode on the CPU, with forward hooks that
  capture each block's output, and computes the plasticity. The next stage picks the result up, so **decisions
  lag one evaluation** (``interval`` steps): plasticity measured on the weights of step ``t`` can freeze a block
  at step ``t + interval``. If the previous evaluation is still running at a stage, that stage submits nothing
  (it never waits; ``evaluations_skipped`` counts these). ``synchronous=True`` runs the evaluation inline and
  applies it at the same stage (no lag; deterministic, used by tests). An exception raised in the worker is
  re-raised, with its original traceback and a note, by the next stage's :meth:`Egeria.decide`.
  :meth:`Egeria.detach` (``Freezer.close()``) waits for a running evaluation, stops the worker and removes hooks.
* **Freezing rule.** Per block, the relative change ``|p_t - p_prev| / max(|p_prev|, eps)`` between consecutive
  plasticity values measured against the same reference; a block is *stable* once this change has been below
  ``tolerance`` for ``patience`` consecutive evaluations (:func:`plasticity_decision`). Only the front active
  block (the first block after the frozen prefix; never the head) may freeze, so at most one block freezes per
  evaluation, and frozen blocks always form a prefix. Every active block keeps its own count, so the next block
  can freeze at the very next evaluation if it is already stable.
* **Refresh and comparability.** A value measured against a new reference is not comparable with one measured
  against the old one (right after a refresh the plasticity falls to the quantization noise floor). So an
  evaluation that refreshes the reference also measures each active block against the *new* reference (one
  more reference forward, in the worker) and the next evaluation's change is taken against that baseline. The
  first evaluation of a run has nothing to compare with and leaves the counts unchanged.

Measured behaviour (CPU, a 4-block MLP on Gaussian blobs, interval 25, the defaults otherwise): without
BatchNorm the three hidden blocks froze at steps 150, 175 and 200, before the first refresh. With a BatchNorm
block, after the first refresh the plasticity of the converged blocks sat at the int8 noise floor (~1e-4), where
the BatchNorm running-statistics noise alone moved it by 40-200% between evaluations, so with ``tolerance=0.1``
nothing froze after that refresh. A larger ``refresh_every`` or ``tolerance`` is the knob there.

Costs: a fp32 CPU copy of the model (shadow) and an int8 reference beside it; per evaluation one weight copy on
the training thread and, in the worker, one fp32 and one int8 forward of ``probe_size`` samples (two int8
forwards at a refresh). Hooks registered on the model are not copied into the shadow or the reference (a model
that needs a forward hook to compute correctly, such as legacy ``torch.nn.utils.weight_norm``, is not supported;
use ``torch.nn.utils.parametrizations.weight_norm``).

Resume: :meth:`Egeria.state_dict` holds the counters, histories, the values each block is compared with, and
the probe batch (CPU tensors). The reference model is not saved: :meth:`Egeria.load_state_dict` rebuilds it from
the current (resumed) weights, which counts as a refresh (baselines measured on the probe batch), so a resumed run
continues the counts but compares with a reference one refresh newer than an uninterrupted run would. An
evaluation still in flight when the state is saved is not saved.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..probe import probe_outputs
from .base import Decision, StageContext, Strategy, is_int
from .egeria_reference import QUANTIZATIONS, build_reference, cpu_copy
from .registry import register_strategy

STATE_VERSION = 1

#: Smallest denominator of the relative change, so a plasticity of exactly 0 does not divide by zero.
EPS = 1e-12

#: Name prefix of the worker thread (lets users and tests find it).
THREAD_PREFIX = "layerfreeze-egeria"


# --------------------------------------------------------------------------------------------------------------
# Pure functions
# --------------------------------------------------------------------------------------------------------------


def _similarity(a: torch.Tensor) -> torch.Tensor:
    """Row-normalised Gram matrix of ``a`` flattened to ``(B, -1)``, in float64 on the CPU."""
    flat = a.detach().reshape(a.shape[0], -1).to("cpu", torch.float64)
    return F.normalize(flat @ flat.T, p=2, dim=1)


def sp_loss(a: torch.Tensor, b: torch.Tensor) -> float:
    """Similarity-preserving (SP) loss between two activations of the same ``B`` samples (Tung & Mori 2019).

    ``G = normalize_rows(A A^T)`` with ``A`` the activations flattened to ``(B, -1)``, and
    ``SP = ||G_a - G_b||_F^2 / B^2``. Only the ``B x B`` sample similarities are compared, so the trailing shapes
    of ``a`` and ``b`` may differ, and scaling either input by a constant does not change the result.

    Args:
        a: Activations ``(B, ...)``, ``B >= 1``.
        b: Activations ``(B, ...)`` of the same samples.

    Returns:
        The loss, a float in ``[0, 4]`` (0 when the two similarity structures are equal).

    Raises:
        ValueError: an input has no batch dimension, or the batch sizes differ.
    """
    if a.dim() == 0 or b.dim() == 0 or a.shape[0] == 0:
        raise ValueError(f"sp_loss needs activations of shape (B, ...) with B >= 1, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"sp_loss needs the same samples on both sides: batch {a.shape[0]} != {b.shape[0]}")
    diff = _similarity(a) - _similarity(b)
    return float((diff * diff).sum()) / a.shape[0] ** 2


def relative_change(previous: float, current: float, eps: float = EPS) -> float:
    """``|current - previous| / max(|previous|, eps)`` (NaN if either value is NaN)."""
    return abs(current - previous) / max(abs(previous), eps)


def advance_count(count: int, previous: float | None, current: float, tolerance: float) -> tuple[float, int]:
    """One step of the freezing rule: the relative change and the new count of consecutive stable evaluations.

    With no ``previous`` value (first measurement against a reference without baseline) the change is NaN and
    the count is kept. Otherwise the count grows by one when the change is below ``tolerance`` and restarts at 0
    when it is not (a NaN change, from a NaN plasticity, restarts it too).
    """
    if previous is None:
        return math.nan, count
    change = relative_change(previous, current)
    return change, (count + 1 if change < tolerance else 0)


def plasticity_decision(history: Sequence[float], tolerance: float, patience: int) -> bool:
    """Whether a block with this plasticity series (one reference, oldest first) may be frozen now.

    True when each of the last ``patience`` relative changes between consecutive values is below ``tolerance``
    (so at least ``patience + 1`` values are needed).
    """
    count, previous = 0, None
    for value in history:
        _, count = advance_count(count, previous, float(value), tolerance)
        previous = float(value)
    return count >= patience


# --------------------------------------------------------------------------------------------------------------
# Probe batch and block outputs
# --------------------------------------------------------------------------------------------------------------


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _block_outputs(model: nn.Module, names: dict[int, str], probe: tuple[Any, Any]) -> dict[int, torch.Tensor]:
    """Run ``model`` on the probe batch and return the output of each named module, by block index
    (:func:`~layerfreeze.probe.probe_outputs`)."""
    args, kwargs = _map_tensors(probe, lambda t: t.float() if t.is_floating_point() else t)  # the CPU copies are fp32
    modules = {index: model.get_submodule(name) for index, name in names.items()}
    return probe_outputs(model, modules, lambda m: m(*args, **kwargs))


@dataclass
class _Result:
    step: int
    plasticity: list[float | None]
    reference: nn.Module | None = None
    report: dict[str, Any] | None = None
    baseline: list[float | None] | None = None


def _evaluate(step: int, shadow: nn.Module, reference: nn.Module, probe: tuple[Any, Any], names: dict[int, str],
              num_blocks: int, refresh: bool, quantization: str) -> _Result:
    """The worker's job: plasticity of the named blocks, then (if ``refresh``) a new reference and baselines.

    Reads only its arguments (the shadow is not written by the training thread while an evaluation runs), so it
    is safe to run in the background.
    """
    with torch.no_grad():
        trained = _block_outputs(shadow, names, probe)
        result = _Result(step, _plasticity(trained, _block_outputs(reference, names, probe), num_blocks))
        if refresh:
            result.reference, result.report = build_reference(shadow, quantization)
            result.baseline = _plasticity(trained, _block_outputs(result.reference, names, probe), num_blocks)
    return result


def _plasticity(trained: dict[int, torch.Tensor], reference: dict[int, torch.Tensor],
                num_blocks: int) -> list[float | None]:
    """Per block index, :func:`sp_loss` between its output in the training weights and in a reference (None for
    a block missing from either)."""
    values: list[float | None] = [None] * num_blocks
    for i, out in trained.items():
        if i in reference:
            values[i] = sp_loss(out, reference[i])
    return values


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
        patience: Consecutive stable evaluations before the front block freezes, ``>= 1``.
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
        self.probe_size = _check_int("probe_size", probe_size, 1)
        if not isinstance(synchronous, bool):
            raise ValueError(f"egeria: synchronous must be True or False, got {synchronous!r}")
        self.synchronous = synchronous
        if reference_quantization not in QUANTIZATIONS:
            raise ValueError(f"egeria: reference_quantization must be one of {QUANTIZATIONS}, "
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
        }

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
        if self._shadow is not None:
            self._resize(self._num_blocks)
            self._copy_weights()
            self._reference, self.reference_report = build_reference(self._shadow, self.reference_quantization)
            self.previous = [None] * self._num_blocks
            if self._probe is not None:
                trained = _block_outputs(self._shadow, self._names, self._probe)
                self.previous = _plasticity(trained, _block_outputs(self._reference, self._names, self._probe),
                                            self._num_blocks)

    def __repr__(self) -> str:
        return (f"Egeria(interval={self.interval}, refresh_every={self.refresh_every}, tolerance={self.tolerance:g}, "
                f"patience={self.patience}, probe_size={self.probe_size}, synchronous={self.synchronous}, "
                f"reference_quantization={self.reference_quantization!r})")

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

        self._probe = (_map_tensors(tuple(args), keep), _map_tensors(dict(kwargs), keep))
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
                future.set_result(_evaluate(*args))
            except Exception as exc:
                future.set_exception(exc)
            self._pending = future
            return True
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_PREFIX)
        self._pending = self._executor.submit(_evaluate, *args)
        return True

    def _collect(self) -> _Result:
        future, step = self._pending, self._pending_step
        self._pending = None
        try:
            result: _Result = future.result()
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
