"""``smartfrz``: the learned, attention-based freezing policy.

Source: Li, Yuan, Dai, Zhang, Wang, Tang, "SmartFRZ: An Efficient Training Framework using Attention-Based Layer
Freezing", ICLR 2023 (arXiv 2401.16720): record each active layer's weights (sec. 3.2, with "layer tailoring" to a
fixed-size random sample), and at periodic freezing stages let an attention-based predictor trained offline on
representational-similarity labels decide which layers to freeze (sec. 3.3-3.4). Our sizes and encoder are our own
(see :mod:`layerfreeze.strategies.smartfrz`).
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Any

import torch

from layerfreeze.errors import PredictorError
from layerfreeze.strategies.base import Decision, StageContext, Strategy, is_int, is_number
from layerfreeze.strategies.registry import register_strategy
from layerfreeze.strategies.smartfrz.features import window_features
from layerfreeze.strategies.smartfrz.predictor import load_predictor
from layerfreeze.strategies.smartfrz.reader import Read, StageReader
from layerfreeze.strategies.smartfrz.recorder import WeightRecorder
from layerfreeze.strategies.smartfrz.snr_gate import DEFAULT_KAPPA, DEFAULT_NOISE, AdamMoments, MomentsRead, SNRGate

#: Share of step time the stages may cost, amortised (issue 40: "at or under 1% of step time").
DEFAULT_STAGE_BUDGET = 0.01
#: Stages timed on the host before the cadence is checked against the budget.
COST_MIN_STAGES = 4
#: Stages at a cadence >= 2 over which a stage's wall-clock cost is measured, when its host time is over budget.
PROBE_STAGES = 8


@register_strategy("smartfrz")
class SmartFRZ(Strategy):
    """Freezes a block when the learned predictor says it has converged, front to back.

    Rule: every ``snapshot_every`` optimizer steps the weight sample of every active block is recorded (ring buffer
    of the last ``window`` snapshots); at the same stage, once a block has the predictor's ``min_window`` snapshots
    (its card; 8 for the shipped one, ~5% of a run), the predictor gives
    ``p`` = probability that it can be frozen now, from the window's features, the block's depth (index / (number
    of blocks - 1)) and the training progress of each snapshot (step / total steps; see
    :mod:`layerfreeze.strategies.smartfrz.features`). Blocks are visited front to back; a block is frozen when
    ``p >= threshold`` and, with ``prefix=True`` (default), every earlier block is frozen; the first block that is
    not frozen ends the visit (prefix rule). The head is never frozen. A window with NaN/Inf weights gives no
    decision for that block and is reported in the signals (``nonfinite``). With the gradient signal-to-noise gate
    (``snr_gate``, on by default since issue 29's grid) a block is frozen only when, besides ``p >= threshold``, its
    Adam-normalized step has stopped strengthening (:mod:`layerfreeze.strategies.smartfrz.snr_gate`): weights that
    move little because the learning rate is small look converged to the predictor, and this signal tells the two
    apart.

    Args:
        predictor: Path of a predictor file; None uses the one shipped with the package.
        threshold: Decision threshold on ``p``, in (0, 1); None (default) uses the one in the predictor's card (the
            threshold its held-out metrics were measured at), else 0.5.
        snapshot_every: Steps between snapshots (and stages), an int >= 1 (fixed), or None (default): at least
            ``max(1, round(total_steps / 150))`` so about five windows fit in a run, and more where a stage costs
            more than ``stage_budget`` of a step (see "Stage cadence" below).
        sample_size: Sampled weights per block, int >= 8 (default 1,024).
        prefix: Only freeze a block when all earlier blocks are frozen.
        seed: Seed of the sampled positions.
        snr_gate: ``kappa`` of the gradient signal-to-noise gate (:mod:`layerfreeze.strategies.smartfrz.snr_gate`;
            the signal is Adam's ``m_hat / sqrt(v_hat)``, Kingma & Ba 2015 sec. 2.1), in (0, 1], or None (off, the
            predictor alone: ``-p snr_gate=null``). Default 0.9, the value measured on issue 29's grid
            (``python -m benchmarks.lr_grid``; BENCHMARKS.md "The default at other learning rates"): a block the
            predictor would freeze waits until its smoothed Adam-normalized step has fallen to ``kappa`` times its
            peak (or is about noise and not rising), so a block still learning faster and faster (a small learning
            rate, a run far from converged) is not frozen. No effect without Adam moments (SGD, sharded FSDP state).
        snr_noise: The gate's second branch, a number > 0 or None: a block whose smoothed z (its step over Adam's
            noise floor; 1 = pure noise) is at most this and not rising may freeze; None: only the fall from the
            peak opens the gate. Default 1.35 (a mean gradient about a fifth of its noise std). Used only with
            ``snr_gate``.
        stage_budget: The share of step time the stages may cost, amortised, in (0, 1), or None: the run-length
            cadence alone (what layerfreeze did before issue 40). Default 0.01. Used only when ``snapshot_every`` is
            None and the model trains on an accelerator (CUDA, ...). On the CPU the run-length cadence is kept: a
            timed cadence depends on the machine's clock, so two runs of one seed could stage at different steps,
            and decisions on the CPU stay a function of the seed (a killed run resumes to the uninterrupted one,
            bit for bit). On the CPU a stage is ~1-3 ms against the ~1 s steps of the jobs people run there.

    Stage cadence (issue 40). A stage costs host time (the reads' launches, the features, the predictor: ~1-3 ms) and a
    step on a GPU can be ~20 ms, so staging on every step of a short run could cost more than freezing saves. With
    ``stage_budget``, on an accelerator: the first :data:`COST_MIN_STAGES` stages are timed on the host
    (``time.perf_counter``, no device sync); if their median is at most ``stage_budget`` of the step time (the Freezer's
    median interval between steps, :attr:`~layerfreeze.strategies.base.StageContext.step_seconds`), the cadence stays
    the run length's. Otherwise the host time may still be hidden behind the device's queue, so the wall-clock cost is
    measured: :data:`PROBE_STAGES` stages at a cadence of at least 2, the cost being the median step with a stage minus
    the median step without one (:attr:`~layerfreeze.strategies.base.StageContext.stage_step_seconds`), and the cadence
    becomes ``ceil(cost / (stage_budget * step))`` (at least the run length's). The cadence is part of the state (a
    resumed run keeps it) and is reported in the signals (``stage_every``, ``stage_ms``, ``step_ms``) when it is set.
    Being timed, it can differ between two runs of one seed, and a run killed before its cadence was set may resume to
    another one; ``-p stage_budget=null`` makes an accelerator's decisions independent of the clock.

    Reads without a host synchronisation (issue 40). A stage reads the weight samples and Adam's moments through a
    :class:`~layerfreeze.strategies.smartfrz.reader.StageReader`: gathered on the device, one non-blocking copy to
    the host. On an accelerator the values of a stage's read are used at the *next* stage (by then the copy is
    done), so decisions there are made on the samples up to the previous stage; on the CPU they are used at once
    and decisions are bitwise those of earlier versions. A checkpoint files a read still in flight first, so a
    resumed run decides as the uninterrupted one. The predictor is not run for a block the gate holds closed (its
    ``p_freeze`` is NaN then): the decision is the same, at less host time.

    Raises:
        ValueError: a parameter outside its range, or a predictor file (given or shipped) that is missing, corrupt
            or of another version (checked here, at config time).
        RuntimeError (at the first stage): the run length is unknown (``Freezer(total_steps=...)`` not given).

    Signals: ``p_freeze`` (per block, NaN where no prediction), ``nonfinite`` (count of blocks skipped for NaN/Inf
    weights), ``window_fill`` (snapshots recorded for the front active block); with the gate ``snr_z`` (per block,
    the smoothed normalized Adam step, NaN where none yet) and ``snr_gate`` (per block: 1 open, 0 closed, NaN no
    verdict).
    """

    def __init__(self, predictor: str | None = None, threshold: float | None = None, snapshot_every: int | None = None,
                 sample_size: int = 1024, prefix: bool = True, seed: int = 0, snr_gate: float | None = DEFAULT_KAPPA,
                 snr_noise: float | None = DEFAULT_NOISE, stage_budget: float | None = DEFAULT_STAGE_BUDGET) -> None:
        super().__init__()
        if threshold is not None and (not is_number(threshold) or not 0 < threshold < 1):
            raise ValueError(f"smartfrz: threshold must be in (0, 1) (probability to freeze), got {threshold!r}")
        if snapshot_every is not None and (not is_int(snapshot_every) or snapshot_every < 1):
            raise ValueError(f"smartfrz: snapshot_every must be an integer >= 1 step or null, got {snapshot_every!r}")
        if not is_int(sample_size) or sample_size < 8:
            raise ValueError(f"smartfrz: sample_size must be an integer >= 8, got {sample_size!r}")
        if not isinstance(prefix, bool):
            raise ValueError(f"smartfrz: prefix must be true or false, got {prefix!r}")
        if snr_gate is not None and (not is_number(snr_gate) or not 0 < snr_gate <= 1):
            raise ValueError(f"smartfrz: snr_gate must be in (0, 1] (the fall from the peak of the gradient SNR before "
                             f"a block may freeze; 0.9 measured) or null (off), got {snr_gate!r}")
        if snr_noise is not None and (not is_number(snr_noise) or snr_noise <= 0):
            raise ValueError(f"smartfrz: snr_noise must be a number > 0 (1 = pure noise; 1.35 measured) or null, got "
                             f"{snr_noise!r}")
        if stage_budget is not None and (not is_number(stage_budget) or not 0 < stage_budget < 1):
            raise ValueError(f"smartfrz: stage_budget must be in (0, 1) (the share of step time the stages may cost; "
                             f"0.01 = 1%) or null (the run-length cadence alone), got {stage_budget!r}")
        if not is_int(seed) or not -2**63 <= seed < 2**64:  # torch's manual_seed raised it at attach, unexplained
            raise ValueError(f"smartfrz: seed must be an integer (the seed of the sampled weight positions), got "
                             f"{seed!r}")
        try:  # a missing/corrupt/other-version file fails here, at config time, before anything runs
            self._loaded = load_predictor(Path(predictor) if predictor is not None else None)
        except PredictorError as exc:
            raise ValueError(f"smartfrz: {exc}") from None
        self.threshold = None if threshold is None else float(threshold)
        self.snapshot_every, self.sample_size = snapshot_every, sample_size
        self.prefix, self.seed = prefix, seed
        self.snr_gate = None if snr_gate is None else float(snr_gate)
        self.snr_noise = None if snr_noise is None else float(snr_noise)
        self.gate: SNRGate | None = None
        self._moments: AdamMoments | None = None
        self._warned_no_moments = False
        self.model = None
        self.window = self.min_window = 0
        self.recorder = None
        self.stage_every = snapshot_every
        self.stage_budget = None if stage_budget is None or snapshot_every is not None else float(stage_budget)
        self.reader: StageReader | None = None
        self._pending: tuple[Read, list[bool], int, MomentsRead | None] | None = None  # a read not yet filed
        # the cadence: "measure" (timing stages' host cost), "probe" (measuring their wall cost), "set"
        self._phase = "set" if self.stage_budget is None else "measure"
        self._base_every = 1
        self._host_seconds: deque[float] = deque(maxlen=16)
        self._probed = 0
        self._timed = False  # set at attach: the model's blocks are on an accelerator (and stage_budget is set)
        self._clock = time.perf_counter

    @property
    def reads_optimizer_state(self) -> bool:
        """The gate reads Adam's moments (under FSDP2 gathered into the mirror at each stage)."""
        return self.snr_gate is not None

    def attach(self, model: Any, blocks: list[Any]) -> None:
        self.model, meta = self._loaded
        self.window, self.min_window = meta["window"], meta["min_window"]
        if self.threshold is None:
            self.threshold = float(meta["card"].get("threshold", 0.5))
        self.recorder = WeightRecorder(blocks, self.sample_size, self.window, self.seed)
        n = len(blocks)  # a read's rows: the weights of block i in row i, its Adam moments in rows n + i and 2n + i
        self.reader = StageReader(3 * n, self.sample_size, max_scalars=n)
        self._moments = AdamMoments([s.picks for s in self.recorder.samples], self.sample_size)
        if self.snr_gate is not None:
            self.gate = SNRGate(len(blocks), kappa=self.snr_gate, noise=self.snr_noise)
        # the cadence is timed only where the model trains on an accelerator; on the CPU it is the run length's
        self._timed = self.stage_budget is not None and any(
            p.device.type != "cpu" for b in blocks for p in b.parameters())
        if not self._timed:
            self._phase = "set"

    def decide(self, ctx: StageContext) -> Decision:
        if ctx.event == "start":
            ctx.require_progress(self.name)  # the predictor's input includes training progress
            if self.stage_every is None or self._phase == "measure":
                self._base_every = max(1, round(ctx.total_steps / 150))
                if self.stage_every is None:
                    self.stage_every = self._base_every
            self._pending = None
            self.recorder.snapshot([not b.frozen for b in ctx.blocks], ctx.step)
            return Decision(signals={"snapshot_every": self.stage_every})
        if ctx.event != "step":
            return Decision()
        began = self._clock()
        self._read(ctx)
        decision = self._decide(ctx)
        self._cadence(ctx, self._clock() - began, decision.signals)
        return decision

    def _read(self, ctx: StageContext) -> None:
        """File the read launched at the previous stage (an accelerator's), launch this stage's, and on the CPU file
        it at once (module docstring: reads without a host synchronisation)."""
        if self._pending is not None:
            self._file(*self._pending)
            self._pending = None
        active = [not b.frozen for b in ctx.blocks]
        picks = self.recorder.picks(active)
        moments = None
        if self.gate is not None:
            watched = [b.index for b in ctx.blocks if not b.frozen and not b.is_head]
            moments = self._moments.plan(watched, ctx.optimizer_state, m_row=len(active), v_row=2 * len(active))
            picks += moments.picks
            self._warn_no_moments(bool(watched) and not moments.blocks)
        read = self.reader.launch(picks, moments.steps if moments is not None else [])
        if read.deferred:
            self._pending = (read, active, ctx.step, moments)
        else:
            self._file(read, active, ctx.step, moments)

    def _file(self, read: Read, active: list[bool], step: int, moments: MomentsRead | None) -> None:
        """A read's values into the recorder (weights) and the gate (Adam's z)."""
        read.settle()
        self.recorder.record(read.values, active, step)
        if moments is not None and moments.blocks:
            for i, (z, adam_step) in self._moments.z_from(moments, read.values, read.scalars).items():
                self.gate.observe(i, z, adam_step)

    def _warn_no_moments(self, none_found: bool) -> None:
        if none_found and not self._warned_no_moments:
            # the default is on, so a run whose optimizer the gate cannot read must not differ from what the user
            # reads in the docs without a word: say once that the predictor decides alone here
            self._warned_no_moments = True
            warnings.warn("smartfrz: the gradient SNR gate (snr_gate, on by default) found no Adam moments for the "
                          "blocks it watches (an optimizer without exp_avg/exp_avg_sq such as SGD, or no optimizer); "
                          "the predictor decides alone in this run. "
                          "-p snr_gate=null turns the gate off and this warning with it.", stacklevel=3)

    def _decide(self, ctx: StageContext) -> Decision:
        """The prefix visit over the recorded windows and the gate (class docstring)."""
        probs = [math.nan] * len(ctx.blocks)
        nonfinite = 0
        freeze: list[int] = []
        for b in ctx.blocks:
            if b.frozen or b.is_head:
                continue
            if not self.recorder.ready(b.index, self.min_window):
                if self.prefix:
                    break
                continue
            gate_ok = self.gate is None or self.gate.open(b.index) is not False  # None: no verdict (no Adam moments)
            if not gate_ok:  # held closed: no freeze whatever p says, so the predictor is not asked
                if self.prefix:
                    break
                continue
            try:
                probs[b.index] = self.predict(b.index, len(ctx.blocks), ctx.total_steps)
            except ValueError:
                nonfinite += 1
                if self.prefix:
                    break
                continue
            prefix_ok = all(ctx.blocks[j].frozen or j in freeze for j in range(b.index))
            if probs[b.index] >= self.threshold and (prefix_ok or not self.prefix):
                freeze.append(b.index)
            elif self.prefix:
                break
        front = next((b.index for b in ctx.blocks if not b.frozen), 0)
        signals = {"p_freeze": probs, "nonfinite": nonfinite,
                   "window_fill": min(self.recorder.counts[front], self.window)}
        if self.gate is not None:
            signals["snr_z"] = [self.gate.smoothed(i) for i in range(len(ctx.blocks))]
            signals["snr_gate"] = [math.nan if (o := self.gate.open(i)) is None else float(o)
                                   for i in range(len(ctx.blocks))]
        reason = f"smartfrz: p>={self.threshold:.2f} for {[round(probs[i], 3) for i in freeze]}" if freeze else ""
        return Decision(freeze=freeze, reason=reason, signals=signals)

    def _cadence(self, ctx: StageContext, seconds: float, signals: dict[str, Any]) -> None:
        """Set the stage cadence from what a stage costs (class docstring: "Stage cadence"); ``seconds`` is this
        stage's host time. Adds ``stage_every``/``stage_ms``/``step_ms`` to ``signals`` when it sets the cadence."""
        if self._phase == "set":
            return
        if self._phase == "measure":
            self._host_seconds.append(seconds)
            if len(self._host_seconds) < COST_MIN_STAGES:
                return
            host = statistics.median(self._host_seconds)
            step = ctx.step_seconds if ctx.step_seconds is not None else (
                None if ctx.stage_step_seconds is None else ctx.stage_step_seconds - host)
            if step is None or step <= 0:
                return  # no step time yet (or a clock that says nothing): keep measuring
            if host <= self.stage_budget * step:
                self._set_cadence(self._base_every, host, step, signals)
            else:  # over budget on the host; how much of it the device's queue hides is measured next
                self._phase, self._probed = "probe", 0
                self.stage_every = max(self._base_every, 2)
            return
        self._probed += 1  # "probe": both kinds of steps are timed by the Freezer
        if self._probed < PROBE_STAGES or ctx.step_seconds is None or ctx.stage_step_seconds is None:
            return
        cost = max(0.0, ctx.stage_step_seconds - ctx.step_seconds)
        # (less a rounding error's worth: 1 ms / (1% of 20 ms) is 5 stages, not the 6 of 5.000000000000001)
        every = max(self._base_every, math.ceil(cost / (self.stage_budget * ctx.step_seconds) - 1e-9))
        self._set_cadence(every, cost, ctx.step_seconds, signals)

    def _set_cadence(self, every: int, cost: float, step: float, signals: dict[str, Any]) -> None:
        self._phase, self.stage_every = "set", int(every)
        signals.update(stage_every=self.stage_every, stage_ms=1e3 * cost, step_ms=1e3 * step)

    def predict(self, index: int, num_blocks: int, total_steps: int) -> float:
        """``p(freeze now)`` of block ``index`` from its recorded window, its depth ``index / (num_blocks - 1)`` and
        the training progress of each snapshot (step / ``total_steps``).

        Raises:
            ValueError: the window holds NaN/Inf weights (no decision).
        """
        feats = window_features(self.recorder.window_of(index), self.recorder.mask_of(index),
                                depth=index / max(num_blocks - 1, 1),
                                progress=self.recorder.steps_of(index) / float(total_steps))
        with torch.no_grad():
            return float(torch.sigmoid(self.model(feats[None]))[0])

    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:  # a read in flight belongs to the state: filed now, as the next stage would
            self._file(*self._pending)
            self._pending = None
        state = {"stage_every": self.stage_every, "recorder": self.recorder.state_dict() if self.recorder else None}
        if self.stage_budget is not None:  # the cadence's calibration (absent: a fixed cadence, as before)
            state["cadence"] = {"phase": self._phase, "base_every": self._base_every,
                                "host_seconds": list(self._host_seconds), "probed": self._probed}
        if self.gate is not None:  # only with the gate on: a run without it saves what it saved before
            state["gate"] = self.gate.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage_every = state["stage_every"]
        self._pending = None
        if self.stage_budget is not None:
            cadence = state.get("cadence")
            if cadence is None:  # a checkpoint from before issue 40: keep its cadence
                self._phase = "set"
            else:
                self._phase, self._base_every = str(cadence["phase"]), int(cadence["base_every"])
                self._host_seconds = deque((float(x) for x in cadence["host_seconds"]), maxlen=16)
                self._probed = int(cadence["probed"])
            if not self._timed:  # a GPU run's calibration resumed on the CPU: the cadence it reached is kept
                self._phase = "set"
        if self.recorder is not None and state.get("recorder") is not None:
            self.recorder.load_state_dict(state["recorder"])
        if self.gate is not None and state.get("gate") is not None:
            self.gate.load_state_dict(state["gate"])
        elif self.gate is not None and state.get("recorder") is not None:
            # a checkpoint written without the gate (off, or layerfreeze before it was the default) resumed with it:
            # the gate has seen none of the steps before the resume, so its peaks start here; say so
            warnings.warn("smartfrz: this checkpoint was written without the gradient SNR gate (snr_gate off, or a "
                          "layerfreeze from before it was on by default); the gate starts observing at the resume, "
                          "so freezes may come later than in one uninterrupted run. Resume with -p snr_gate=null "
                          "to continue exactly as the checkpoint's run did.", stacklevel=2)

    def held_tensors(self) -> list[torch.Tensor]:
        """What SmartFRZ holds (the memory ledger's ``strategy`` bucket): the recorder's ring buffers and the
        reader's buffers and positions (on the training device: a ``(3 * blocks + 1, sample_size)`` float32 buffer
        and the positions, never a copy of a whole tensor)."""
        if self.recorder is None:
            return []
        held = [self.recorder.buffers, self.recorder.steps]
        return held + (self.reader.held_tensors() if self.reader is not None else [])

    def __repr__(self) -> str:
        return (f"SmartFRZ(threshold={self.threshold}, snapshot_every={self.snapshot_every}, snr_gate={self.snr_gate}, "
                f"stage_budget={self.stage_budget})")
