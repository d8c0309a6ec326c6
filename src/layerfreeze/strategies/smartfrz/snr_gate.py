"""SmartFRZ's gradient signal-to-noise gate (issue 29, on by default): never freeze a block whose gradient is still
getting *more* consistent.

The strategy parameter ``snr_gate`` is ``kappa`` below (default 0.9, the value measured here; ``-p snr_gate=null``
turns the gate off). It became the default from issue 29's grid (``python -m benchmarks.lr_grid``: lr x0.3/x1/x3,
1/2/4 epochs, 3 seeds, rows `none`, `smartfrz` and `smartfrz-nogate`; BENCHMARKS.md "The default at other learning
rates").

Why: the predictor reads how little a block's weights move, and weights move little for two reasons: the block has
converged, or the learning rate is small. At lr x0.3 of the suite's BBC job (MiniLM-L6, 2 epochs; `none` ends at
76.8%, its loss near chance for the first half) the predictor freezes every block on a schedule much like lr x1's
and loses 6.5 points; the CKA labels agree with it there, so relabelling cannot fix it.

Source of the signal: Adam (Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015, Alg. 1 and
sec. 2.1, which calls ``m_hat / sqrt(v_hat)`` the signal-to-noise ratio). Per weight Adam moves by
``lr * m_hat / (sqrt(v_hat) + eps)``; ``|m_hat| / sqrt(v_hat)`` does not depend on the learning rate or the weight
scale: it is ~1 when the gradient points the same way step after step (signal) and falls to a noise floor when the
gradient is noise around zero mean. Derivation of the floor: for i.i.d. zero-mean gradients of variance s^2,
``m_t = (1 - b) sum_k b^k g_(t-k)`` (k < t) has variance ``(1 - b)^2 (1 - b^(2t)) / (1 - b^2) s^2``, ``m_hat =
m_t / (1 - b^t)`` and ``v_hat ~ s^2``, so the RMS of ``m_hat / sqrt(v_hat)`` is :func:`adam_noise_floor` (1 at the
first step, tending to ``sqrt((1 - b) / (1 + b))`` = 0.23 for beta1 = 0.9). Per block, ``z`` = RMS over the
recorder's sampled weights of ``m_hat / (sqrt(v_hat) + eps)``, divided by the floor at the block's Adam step, read
from the optimizer state at each stage (:attr:`~layerfreeze.strategies.base.StageContext.optimizer_state`; no
per-step work). ``z`` ~ 1: noise; well above 1: signal.

The rule (ours, from the measurements below, not from a paper). Measured on MiniLM-L6 / BBC News (seed 0, the
suite's sizes), ``z`` smoothed over 8 stages: at lr x1 and x3 every encoder layer's ``z`` rises to a peak in the
first third of the run and then falls (to 0.9x its peak by step 45-61 of 104 at x1, 25-47 at x3: the block
approaches an optimum given the others); at lr x0.3 it rises to the end (1.1 -> 2.0-2.8), because the run is still
learning faster and faster when it stops. Freezing such a block gives up the most productive part of its training;
the remaining blocks cannot make it up at that learning rate. So a block may be frozen only once its smoothed ``z``
has fallen to ``kappa`` (0.9) times its peak (the peak taken from Adam step ``burn_in`` on), or while it is at most
``noise`` (1.35) and not rising. The second branch is for blocks whose gradient is noise from the start:
MobileNetV2 fine-tuned on Fashion-MNIST (AdamW, batch 128) has z ~ 0.9-1.2 in every block all run long, no peak to
fall from, and freezing them costs nothing there (the predictor alone: +0.65 / -0.05 points at lr x0.3 / x1); "not
rising" keeps it from opening in the first steps of a run that is only starting to learn (BBC lr x0.3: z 1.1 -> 1.4
over steps 10-26). The gate only ever delays the predictor's decisions. Where the optimizer keeps no Adam moments
(SGD, no optimizer, sharded FSDP moments, a state the gate cannot read) the gate gives no verdict and the predictor
decides alone.

Results so far (issue 29's research branch, the suite's sizes; Δ = accuracy points vs `none`, same seed; gate off
-> on): BBC lr x0.3 2 epochs -5.78 -> +0.08 (3 seeds) at FLOPs ratio 0.766 -> 0.991 (it freezes almost nothing
there); BBC lr x1 1 epoch -1.73 -> +0.00 (3 seeds, FLOPs 0.854 -> 0.995); BBC lr x1 2 epochs -0.23 -> -0.38
(3 seeds, noise) at FLOPs 0.811 -> 0.821; MobileNetV2 lr x1 -0.18 -> +0.07 (3 seeds) at 0.893 -> 0.905; ResNet-18
-0.30 -> -0.10 at 0.925 -> 0.940 (1 seed): benchmarks/HISTORY.md "The default at other learning rates: SmartFRZ's
gradient signal-to-noise gate". The whole grid: BENCHMARKS.md.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from layerfreeze.strategies.smartfrz.reader import Pick, StageReader

#: Fall from the peak of the smoothed z before a block may freeze.
DEFAULT_KAPPA = 0.9
#: Stages averaged into the smoothed z.
DEFAULT_SMOOTH = 8
#: Adam steps before the peak is tracked (the first steps' z is bias-correction noise).
DEFAULT_BURN_IN = 8
#: Smoothed z at or under which a block counts as moving by noise (when its z is not rising): z^2 ~ (r + f^2) /
#: (f^2 (r + 1)) for a per-weight mean^2/variance r of the gradient and noise floor f (0.23), so 1.35 is r ~ 0.05,
#: a mean gradient about a fifth of its noise std. Measured (seed 0): MobileNetV2 / Fashion-MNIST's blocks sit at
#: 0.7-1.3 where the predictor freezes them (free there), 1.25 kept a block at 1.27-1.30 trainable for the rest of
#: the lr x3 run; BBC lr x0.3's layers are at 1.46-2.8 where the predictor would freeze them (-6.5 points).
DEFAULT_NOISE = 1.35
#: "Rising": the smoothed z is above (1 + this) times its value ``smooth`` stages earlier.
DEFAULT_RISE = 0.05


def adam_noise_floor(step: float, beta1: float) -> float:
    """RMS of ``m_hat / sqrt(v_hat)`` after ``step`` Adam steps on i.i.d. zero-mean gradients of constant variance
    (``v_hat`` taken as the variance): ``sqrt((1-b)^2 (1-b^(2t)) / ((1-b^t)^2 (1-b^2)))``; 1 at t = 1."""
    t = max(float(step), 1.0)
    b = float(beta1)
    if b <= 0:
        return 1.0
    return math.sqrt((1 - b) ** 2 * (1 - b ** (2 * t)) / ((1 - b ** t) ** 2 * (1 - b ** 2)))


@dataclass
class MomentsRead:
    """What one stage asked of the optimizer, kept until the read's values arrive (:meth:`AdamMoments.plan`).

    Attributes:
        picks: The reads: block ``k``'s ``exp_avg`` into row ``m_row + k``, its ``exp_avg_sq`` into ``v_row + k``.
        blocks: Per block read: ``(block index, k, per pick whether it had Adam moments, (beta1, beta2, eps))``.
        steps: Per block read, its Adam step: a number, a CPU tensor or a one-element device tensor (``fused=True``
            keeps it on the device), read as one of the read's scalars.
    """

    picks: list[Pick]
    blocks: list[tuple[int, int, list[bool], tuple[float, float, float]]]
    steps: list[torch.Tensor | float]
    m_row: int
    v_row: int


class AdamMoments:
    """Adam's moments at the recorder's sampled positions and the normalized z of every block read at one stage,
    computed in one vectorized pass on the host.

    The reads themselves go through a :class:`~layerfreeze.strategies.smartfrz.reader.StageReader` (no host
    synchronisation): :meth:`plan` says what to read, :meth:`z_from` turns the read's values into z; :meth:`z` does
    both at once (one synchronising read on an accelerator).

    Args:
        picks: Per block, the recorder's sampled positions ``[(parameter, flat positions)]``
            (:attr:`~.recorder.BlockSample.picks`).
        sample_size: Positions per block (the recorder's).
    """

    def __init__(self, picks: list[list[tuple[torch.nn.Parameter, torch.Tensor]]], sample_size: int) -> None:
        self.picks, self.sample_size = picks, sample_size
        # per block: (parameter, positions, column of its first value), and the mask of its real positions
        self._offsets: list[list[tuple[torch.nn.Parameter, torch.Tensor, int]]] = []
        self._full: list[torch.Tensor] = []
        for block in picks:
            start, offsets = 0, []
            for p, idx in block:
                offsets.append((p, idx, start))
                start += idx.numel()
            self._offsets.append(offsets)
            full = torch.zeros(sample_size, dtype=torch.bool)
            full[:start] = True
            self._full.append(full)
        self._reader: StageReader | None = None  # z()'s own reader
        # plan()'s picks per (block, parameter): the (exp_avg, exp_avg_sq, (m row, v row)) they were made for
        self._made: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, tuple[int, int], tuple[Pick, Pick]]] = {}
        self._valid_cache: dict[tuple, tuple[torch.Tensor | None, torch.Tensor]] = {}  # _valid_rows'

    def plan(self, indices: list[int], optimizer_state: Callable[[Any], Any] | None, m_row: int = 0,
             v_row: int | None = None) -> MomentsRead:
        """The reads of the blocks ``indices`` whose Adam moments the optimizer holds (host work only: no device
        tensor is read). Block ``indices[k]`` goes to rows ``m_row + k`` and ``v_row + k`` (default: right after
        the ``m`` rows). A parameter's two picks are made again only when its moments (the tensors) or rows change."""
        v_row = m_row + len(indices) if v_row is None else v_row
        read = MomentsRead([], [], [], m_row, v_row)
        if optimizer_state is None:
            self._made = {}
            return read
        made, used = self._made, []
        for k, i in enumerate(indices):
            found, flags, picks = None, [], []
            for j, (p, idx, start) in enumerate(self._offsets[i]):
                got = optimizer_state(p)
                ok = False
                if got is not None:
                    state, group = got
                    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
                    key, rows = (i, j), (m_row + k, v_row + k)
                    last = made.get(key)
                    if last is not None and last[0] is m and last[1] is v and last[2] == rows:
                        pair = last[3]  # the same moments (Adam updates them in place) into the same rows
                    elif type(m) is torch.Tensor and type(v) is torch.Tensor and m.shape == p.shape:
                        # a plain tensor of the parameter's shape (FSDP's sharded DTensors, a subclass, give no
                        # verdict)
                        pair = (Pick(m.detach(), idx, m_row + k, start), Pick(v.detach(), idx, v_row + k, start))
                        made[key] = (m, v, rows, pair)
                    else:
                        pair = None
                    if pair is not None:
                        picks += pair
                        used.append(key)
                        ok = True
                        if found is None and state.get("step") is not None and group.get("betas") is not None:
                            betas = group["betas"]
                            found = (state["step"], (float(betas[0]), float(betas[1]), float(group.get("eps", 1e-8))))
                flags.append(ok)
            if found is None:
                continue
            read.picks += picks
            read.blocks.append((i, k, flags, found[1]))
            step = found[0]
            if isinstance(step, torch.Tensor):  # a CPU tensor is read now (no sync), as StageReader.launch would
                step = float(step) if step.device.type == "cpu" else step.detach()
            read.steps.append(step if isinstance(step, torch.Tensor) else float(step))
        if len(made) > len(used):  # moments the optimizer dropped (a frozen block's) must not be kept alive here
            self._made = {key: made[key] for key in used}
        return read

    def z_from(self, read: MomentsRead, values: torch.Tensor, steps: list[float]) -> dict[int, tuple[float, float]]:
        """``{block: (z, adam_step)}`` from a settled read's ``values`` (host rows) and ``steps`` (its scalars, in
        the order of ``read.steps``), for the blocks whose Adam step is >= 1.

        Per block ``z = RMS_valid(m_hat / (sqrt(v_hat) + eps)) / adam_noise_floor(step, beta1)``, in float64, over
        the positions whose pick had moments: ``(R, sample_size)`` for the ``R`` blocks read."""
        rows, hyper, keep = [], [], []
        for (i, k, flags, (b1, b2, eps)), step in zip(read.blocks, steps):
            if step < 1:
                continue
            rows.append(k)
            hyper.append((step, b1, b2, eps))
            keep.append((i, flags))
        if not rows:
            return {}
        h = torch.tensor(hyper, dtype=torch.float64)                      # (R, 4): step, beta1, beta2, eps
        step, b1, b2, eps = h.unbind(1)  # (strided views: the same elementwise kernels as ever, bit for bit)
        valid, count = self._valid_rows(keep)
        m = _rows(values, read.m_row, rows).double()
        v = _rows(values, read.v_row, rows).double()
        u = (m / (1 - b1 ** step)[:, None]) / ((v / (1 - b2 ** step)[:, None]).sqrt() + eps[:, None])
        squares = u * u
        if valid is not None:  # (all valid: a product by True, 1.0, would change no bit)
            squares = squares * valid
        rms = squares.sum(1).div(count).sqrt()
        # the step and beta1 as given (h's float64 values are these floats)
        return {i: (r / adam_noise_floor(t, b), t) for (i, _), r, (t, b, _, _) in zip(keep, rms.tolist(), hyper)}

    def _valid_rows(self, keep: list[tuple[int, list[bool]]]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(valid, count)`` for the blocks ``keep`` (``(index, flags)``): ``(R, sample_size)`` bool (None when
        all True) and ``(R,)`` int64 positions counted (at least 1); made once per pattern of blocks and flags."""
        key = tuple((i, tuple(flags)) for i, flags in keep)
        found = self._valid_cache.get(key)
        if found is None:
            if len(self._valid_cache) > 64:  # patterns change as blocks freeze; keep a few
                self._valid_cache.clear()
            valid = torch.stack([self._valid(i, flags) for i, flags in keep])
            count = valid.sum(1).clamp(min=1)
            found = self._valid_cache[key] = (None if bool(valid.all()) else valid, count)
        return found

    def _valid(self, index: int, flags: list[bool]) -> torch.Tensor:
        """``(sample_size,)`` bool: block ``index``'s positions whose pick had Adam moments."""
        if all(flags):
            return self._full[index]
        valid = torch.zeros(self.sample_size, dtype=torch.bool)
        for ok, (_, idx, start) in zip(flags, self._offsets[index]):
            valid[start:start + idx.numel()] = ok
        return valid

    def z(self, indices: list[int], optimizer_state: Callable[[Any], Any] | None) -> dict[int, tuple[float, float]]:
        """``{block: (z, adam_step)}`` for the blocks of ``indices`` whose Adam moments could be read, read now."""
        read = self.plan(indices, optimizer_state)
        if not read.blocks:
            return {}
        if self._reader is None:
            self._reader = StageReader(2 * len(self.picks), self.sample_size, max_scalars=len(self.picks))
        got = self._reader.launch(read.picks, read.steps).settle()
        return self.z_from(read, got.values, got.scalars)


def _rows(values: torch.Tensor, first: int, rows: list[int]) -> torch.Tensor:
    """``values[first + rows]``: a slice (a view) when ``rows`` are consecutive, else an indexed copy."""
    if rows[-1] - rows[0] == len(rows) - 1 and rows == list(range(rows[0], rows[-1] + 1)):
        return values[first + rows[0]:first + rows[-1] + 1]
    return values[first + torch.tensor(rows)]


def block_snr(picks: list[tuple[torch.nn.Parameter, torch.Tensor]],
              optimizer_state: Callable[[Any], Any] | None) -> tuple[float, float] | None:
    """``(z, adam_step)`` of one block from the optimizer's Adam moments at the sampled positions ``picks`` (the
    recorder's ``[(parameter, flat positions)]``), or None when they cannot be read (no Adam moments)."""
    size = sum(idx.numel() for _, idx in picks)
    return AdamMoments([picks], max(size, 1)).z([0], optimizer_state).get(0)


class SNRGate:
    """Per block: the smoothed normalized gradient SNR and its running peak; :meth:`open` says whether a freeze
    may happen now.

    Args:
        num_blocks: Blocks of the model.
        kappa: A block may freeze once its smoothed z <= ``kappa`` * its peak, in (0, 1].
        smooth: Stages in the trailing mean.
        burn_in: Adam steps before the peak is tracked.
        noise: A block whose smoothed z is at most this and not rising may freeze too; None: only the fall from the
            peak opens the gate.
        rise: "Rising": the smoothed z above ``(1 + rise)`` times its value ``smooth`` stages earlier.
    """

    def __init__(self, num_blocks: int, kappa: float = DEFAULT_KAPPA, smooth: int = DEFAULT_SMOOTH,
                 burn_in: int = DEFAULT_BURN_IN, noise: float | None = DEFAULT_NOISE,
                 rise: float = DEFAULT_RISE) -> None:
        self.kappa, self.smooth, self.burn_in, self.noise, self.rise = kappa, smooth, burn_in, noise, rise
        self.recent: list[deque[float]] = [deque(maxlen=smooth) for _ in range(num_blocks)]
        self.trail: list[deque[float]] = [deque(maxlen=smooth + 1) for _ in range(num_blocks)]  # smoothed values
        self.peak = [math.nan] * num_blocks
        self.last_step = [0.0] * num_blocks

    def observe(self, index: int, z: float, step: float) -> None:
        """One stage's ``z`` of block ``index`` at Adam step ``step`` (a step lower than the last one seen: the
        block's optimizer state was dropped and rebuilt, e.g. after a thaw; its history restarts)."""
        if step < self.last_step[index]:
            self.recent[index].clear()
            self.trail[index].clear()
            self.peak[index] = math.nan
        self.last_step[index] = step
        if not math.isfinite(z):
            return
        self.recent[index].append(z)
        s = self.smoothed(index)
        self.trail[index].append(s)
        if step >= self.burn_in:
            self.peak[index] = s if math.isnan(self.peak[index]) else max(self.peak[index], s)

    def rising(self, index: int) -> bool:
        """True while the smoothed z is above (1 + rise) x its value ``smooth`` stages earlier (or there are not
        that many stages yet: a block just starting has not shown it is not rising)."""
        t = self.trail[index]
        return len(t) <= self.smooth or t[-1] > (1 + self.rise) * t[0]

    def smoothed(self, index: int) -> float:
        r = self.recent[index]
        return sum(r) / len(r) if r else math.nan

    def open(self, index: int) -> bool | None:
        """True: the block's smoothed z has fallen to kappa x its peak, or it is at most ``noise`` and not rising;
        False: not yet; None: no z seen."""
        if not self.recent[index]:
            return None
        if math.isnan(self.peak[index]):
            return False
        s = self.smoothed(index)
        if s <= self.kappa * self.peak[index]:
            return True
        return self.noise is not None and s <= self.noise and not self.rising(index)

    def state_dict(self) -> dict[str, Any]:
        return {"recent": [list(r) for r in self.recent], "trail": [list(t) for t in self.trail],
                "peak": [None if math.isnan(x) else x for x in self.peak],  # NaN != NaN: a resumed state compares equal
                "last_step": list(self.last_step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for r, vals in zip(self.recent, state["recent"]):
            r.clear()
            r.extend(vals)
        for t, vals in zip(self.trail, state.get("trail", [[] for _ in self.trail])):
            t.clear()
            t.extend(vals)
        self.peak = [math.nan if x is None else float(x) for x in state["peak"]]
        self.last_step = [float(x) for x in state["last_step"]]
