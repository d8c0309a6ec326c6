"""``smartfrz``: the learned, attention-based freezing policy.

Source: Li, Yuan, Dai, Zhang, Wang, Tang, "SmartFRZ: An Efficient Training Framework using Attention-Based Layer
Freezing", ICLR 2023 (arXiv 2401.16720): record each active layer's weights (sec. 3.2, with "layer tailoring" to a
fixed-size random sample), and at periodic freezing stages let an attention-based predictor trained offline on
representational-similarity labels decide which layers to freeze (sec. 3.3-3.4). Our sizes and encoder are our own
(see :mod:`layerfreeze.strategies.smartfrz`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from layerfreeze.errors import PredictorError
from layerfreeze.strategies.base import Decision, StageContext, Strategy, is_int, is_number
from layerfreeze.strategies.registry import register_strategy
from layerfreeze.strategies.smartfrz.features import window_features
from layerfreeze.strategies.smartfrz.predictor import load_predictor
from layerfreeze.strategies.smartfrz.recorder import WeightRecorder


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
    decision for that block and is reported in the signals (``nonfinite``).

    Args:
        predictor: Path of a predictor file; None uses the one shipped with the package.
        threshold: Decision threshold on ``p``, in (0, 1); None (default) uses the one in the predictor's card (the
            threshold its held-out metrics were measured at), else 0.5.
        snapshot_every: Steps between snapshots (and stages), an int >= 1, or None: ``max(1, round(total_steps /
            150))`` so about five windows fit in a run.
        sample_size: Sampled weights per block, int >= 8 (default 1,024).
        prefix: Only freeze a block when all earlier blocks are frozen.
        seed: Seed of the sampled positions.

    Raises:
        ValueError: a parameter outside its range, or a predictor file (given or shipped) that is missing, corrupt
            or of another version (checked here, at config time).
        RuntimeError (at the first stage): the run length is unknown (``Freezer(total_steps=...)`` not given).

    Signals: ``p_freeze`` (per block, NaN where no prediction), ``nonfinite`` (count of blocks skipped for NaN/Inf
    weights), ``window_fill`` (snapshots recorded for the front active block).
    """

    def __init__(self, predictor: str | None = None, threshold: float | None = None, snapshot_every: int | None = None,
                 sample_size: int = 1024, prefix: bool = True, seed: int = 0) -> None:
        super().__init__()
        if threshold is not None and (not is_number(threshold) or not 0 < threshold < 1):
            raise ValueError(f"smartfrz: threshold must be in (0, 1) (probability to freeze), got {threshold!r}")
        if snapshot_every is not None and (not is_int(snapshot_every) or snapshot_every < 1):
            raise ValueError(f"smartfrz: snapshot_every must be an integer >= 1 step or null, got {snapshot_every!r}")
        if not is_int(sample_size) or sample_size < 8:
            raise ValueError(f"smartfrz: sample_size must be an integer >= 8, got {sample_size!r}")
        if not isinstance(prefix, bool):
            raise ValueError(f"smartfrz: prefix must be true or false, got {prefix!r}")
        try:  # a missing/corrupt/other-version file fails here, at config time, before anything runs
            self._loaded = load_predictor(Path(predictor) if predictor is not None else None)
        except PredictorError as exc:
            raise ValueError(f"smartfrz: {exc}") from None
        self.threshold = None if threshold is None else float(threshold)
        self.snapshot_every, self.sample_size = snapshot_every, sample_size
        self.prefix, self.seed = prefix, seed
        self.model = None
        self.window = self.min_window = 0
        self.recorder = None
        self.stage_every = snapshot_every

    def attach(self, model: Any, blocks: list[Any]) -> None:
        self.model, meta = self._loaded
        self.window, self.min_window = meta["window"], meta["min_window"]
        if self.threshold is None:
            self.threshold = float(meta["card"].get("threshold", 0.5))
        self.recorder = WeightRecorder(blocks, self.sample_size, self.window, self.seed)

    def decide(self, ctx: StageContext) -> Decision:
        if ctx.event == "start":
            ctx.require_progress(self.name)  # the predictor's input includes training progress
            if self.stage_every is None:
                self.stage_every = max(1, round(ctx.total_steps / 150))
            self.recorder.snapshot([not b.frozen for b in ctx.blocks], ctx.step)
            return Decision(signals={"snapshot_every": self.stage_every})
        if ctx.event != "step":
            return Decision()
        active = [not b.frozen for b in ctx.blocks]
        self.recorder.snapshot(active, ctx.step)
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
        reason = f"smartfrz: p>={self.threshold:.2f} for {[round(probs[i], 3) for i in freeze]}" if freeze else ""
        return Decision(freeze=freeze, reason=reason, signals=signals)

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
        return {"stage_every": self.stage_every, "recorder": self.recorder.state_dict() if self.recorder else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage_every = state["stage_every"]
        if self.recorder is not None and state.get("recorder") is not None:
            self.recorder.load_state_dict(state["recorder"])

    def __repr__(self) -> str:
        return f"SmartFRZ(threshold={self.threshold}, snapshot_every={self.snapshot_every})"
