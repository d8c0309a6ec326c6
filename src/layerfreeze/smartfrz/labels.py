"""CKA labels for the SmartFRZ predictor: when could each block of a recorded run have been frozen?

For every block and every recorded activation snapshot ``t`` we compute the linear CKA (Kornblith, Norouzi, Lee,
Hinton, "Similarity of Neural Network Representations Revisited", ICML 2019) between the block's output on the fixed
probe batch at ``t`` and at the end of training. Block ``b`` is *freezable at t* when

1. ``CKA_b(t) >= tau``: its representation is already close to the final one (``tau`` for a fine-tuned network,
   ``tau_scratch`` for one trained from scratch: the run's ``mode`` in its ``meta.json``);
2. ``max - min`` of ``CKA_b`` over the last ``window`` activation snapshots (ending at ``t``) is ``<= delta``: it
   has stopped changing (a block still climbing towards 1 quickly is not done yet);
3. every earlier block is freezable at ``t`` (a frozen prefix is what saves backward compute; freezing block ``b``
   while ``b - 1`` trains would also change ``b``'s input);
4. it is not the head (the head is never frozen).

Chosen thresholds (``DEFAULT_TAU``, ``DEFAULT_DELTA``, ``DEFAULT_WINDOW``) and why: see the constants below.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from layerfreeze.smartfrz.runs import (
    LABELS_FILE,
    PipelineError,
    list_runs,
    read_activations,
    read_meta,
    write_json_atomic,
)

#: CKA to the final representation a block must reach. Chosen from the recorded curves of the digits runs (MLP,
#: CNN, and the Fashion-MNIST CNN fine-tuned on digits, two learning rates each, seed 0; the sensitivity numbers
#: below are from those six runs). Every curve rises fast, wobbles, then creeps to 1. At 0.95 flat-but-distant
#: plateaus pass: the MLP's first block at lr 0.02 sits at 0.959, 0.960, 0.963 at 7% of training and only reaches
#: 0.99 at 20%; the CNN's block 3 at lr 0.1 sits at 0.944, 0.949, 0.950 at 23% and reaches 0.99 at 40%. 0.99 is
#: past the knee of every curve. Raised to 0.998 after measuring what the labels cost in accuracy: on MiniLM-L6 /
#: BBC News (the benchmark suite's task, 104 steps) the oracle schedule at tau 0.99 (each block frozen at its first
#: freezable record) lost 1.8 and 2.5 points against no freezing (seeds 0, 1); at 0.995 0.7 and 2.3; at 0.998 0.0
#: and 1.4, at 0.56x of the time. The front blocks that carry most of the savings (embeddings, first layers, CKA
#: >= 0.999 from the start) are labelled as early as before; 0.998 mostly moves the middle and last blocks later.
#: Checked against counterfactual costs (:mod:`.counterfactual`, HISTORY.md "Labels against counterfactual
#: costs"): over 193 (run, step, prefix) continuations of 8 runs, following 0.998 costs +0.18 points per prefix at
#: its first freezable grid step (0.995: +0.23 for a quarter more of the run frozen; 0.999: +0.15 for a fifth less).
#: Those continuations had an optimizer-state bug (fixed in 33e02da, 2026-12-04); recomputed over 206 continuations
#: of 8 runs (MiniLM at 1.5e-4 in place of BERT-tiny): 0.998 costs +0.19 per prefix at a precision of 0.75, 0.9995
#: +0.14 at 0.79 for 33% of the run frozen per depth.
#: Raised to 0.9995 (issue 16) after training the oracle's own schedule on the benchmark suite's three tasks (3
#: seeds each, activation cache on; HISTORY.md "The CKA oracle's own schedule trained ..."): at 0.998 it lost
#: 0.53 points on MiniLM-L6 / BBC News and 0.90 on MobileNetV2 / Fashion-MNIST, more than the predictor trained on
#: its labels did; at 0.9995 it lost 0.30 / gained 0.05 / lost 0.20 (BBC / MobileNetV2 / ResNet-18) for 0.77 / 0.86
#: / 0.94 of full training's FLOPs instead of 0.70 / 0.78 / 0.90. On the counterfactual grid 0.9995 has the highest
#: precision of the thresholds tried (0.79 recomputed, 0.91 before the fix; first-freeze cost +0.14) for 33% of the
#: run frozen per depth (0.998: 47%).
DEFAULT_TAU = 0.9995
#: ``tau`` for a run trained from scratch (``mode: scratch``; issue 16). A network trained from random weights keeps
#: changing its first blocks' representation long after freezing them costs nothing: its later blocks adapt to
#: whatever the frozen prefix computes. On the counterfactual grid (HISTORY.md "Labels against counterfactual
#: costs") freezing the from-scratch CNN's prefix was free at 0.07-0.37 of the run while CKA >= 0.998 allowed it only
#: at 0.20-0.73, whereas on the fine-tuned CNN CKA >= 0.998 came too early (0.23-0.63 against 0.37-0.77). Recomputed
#: after the optimizer-state fix (33e02da): from scratch, free at 0.07-0.37 against CKA >= 0.998 at 0.27-0.63; the
#: fine-tuned CNN, free at 0.07-0.77 against CKA >= 0.9995 at 0.33-0.73 (no longer consistently early). Trained for
#: real on the suite's ResNet-18 (from scratch, 3 seeds, HISTORY.md "One tau per training regime"), the oracle's
#: schedule at 0.998 gained 0.20 points at 0.898 of the FLOPs, at 0.999 it lost 0.38 at 0.922, and at 0.9995 it lost
#: 0.20 at 0.943; on the two fine-tuned tasks 0.998 lost 0.53 and 0.90 points (so ``DEFAULT_TAU`` stays 0.9995).
DEFAULT_TAU_SCRATCH = 0.998
#: Largest CKA change (max - min) allowed over the window (chosen at tau 0.99; at 0.998 it rarely binds). With
#: tau = 0.99 it rejects blocks that just passed tau
#: while still rising steeply (0.970 -> 0.985 -> 0.991); 0.005 would also reject the 0.005-0.01 wiggles that stay
#: after the knee (it delayed labels by up to 10% of training), 0.02 let still-rising windows through (labels up to
#: 7% earlier).
DEFAULT_DELTA = 0.01
#: Activation snapshots in the stability window: 3 of the ~31 per run (every 5th of ~150 weight snapshots) span
#: ~7-10% of training; 2 is a single difference (noise-sensitive), 4 delayed the labels by another 0-7%.
DEFAULT_WINDOW = 3


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA between two representations of the same ``P`` samples (Kornblith et al. 2019, eq. 5).

    ``CKA = ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F)`` with ``Xc``, ``Yc`` the column-centred ``(P, D)``
    matrices; computed in float64 through the ``P x P`` Gram matrices. Invariant to orthogonal transforms and
    isotropic scaling of either side, and to adding a constant; 1 for identical inputs.

    Args:
        x: ``(P, D1)`` (more dims are flattened per sample). y: ``(P, D2)``.

    Returns:
        A value in [0, 1]. When a side has no variance (e.g. a dead layer): 1.0 if both have none, else 0.0.

    Raises:
        ValueError: different sample counts, fewer than 2 samples, or NaN/Inf values.
    """
    if x.shape[0] != y.shape[0] or x.shape[0] < 2:
        raise ValueError(f"linear_cka needs the same P >= 2 samples on both sides, got {x.shape[0]} and {y.shape[0]}")
    x = x.reshape(x.shape[0], -1).double()
    y = y.reshape(y.shape[0], -1).double()
    if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
        raise ValueError("linear_cka: NaN or Inf in the representations")
    x = x - x.mean(dim=0, keepdim=True)
    y = y - y.mean(dim=0, keepdim=True)
    kx, ky = x @ x.T, y @ y.T
    nx, ny = kx.norm(), ky.norm()
    scale = max(float(x.abs().max()), float(y.abs().max()), 1e-300)
    tiny = (1e-12 * scale) ** 2 * x.shape[0]
    if nx <= tiny or ny <= tiny:
        return 1.0 if (nx <= tiny and ny <= tiny) else 0.0
    return float(((kx * ky).sum() / (nx * ny)).clamp(0.0, 1.0))


def freezable_from_cka(cka: list[list[float]], tau: float, delta: float, window: int,
                       head: int | None = None) -> list[list[bool]]:
    """The labelling rule on a ``(L blocks, N_act)`` table of CKA-to-final values (see the module docstring).

    A NaN CKA is never freezable. Fewer than ``window`` snapshots so far: not freezable.
    """
    if not 0 < tau <= 1 or delta < 0 or window < 1:
        raise ValueError(f"need 0 < tau <= 1, delta >= 0, window >= 1; got tau={tau}, delta={delta}, window={window}")
    n_blocks = len(cka)
    n = len(cka[0]) if n_blocks else 0
    own = [[False] * n for _ in range(n_blocks)]
    for b in range(n_blocks):
        if b == head:
            continue
        for t in range(window - 1, n):
            w = cka[b][t - window + 1:t + 1]
            if any(math.isnan(v) for v in w):
                continue
            own[b][t] = cka[b][t] >= tau and max(w) - min(w) <= delta
    out = [[False] * n for _ in range(n_blocks)]
    for t in range(n):
        for b in range(n_blocks):
            if not own[b][t]:
                break
            out[b][t] = True
    return out


def tau_for(mode: str | None, tau: float = DEFAULT_TAU, tau_scratch: float = DEFAULT_TAU_SCRATCH) -> float:
    """The CKA threshold of a run trained in ``mode`` (``"scratch"`` -> ``tau_scratch``; ``"finetune"`` or unknown
    -> ``tau``: the stricter one where the regime is not known)."""
    return tau_scratch if mode == "scratch" else tau


def label_rule(labels: dict[str, Any]) -> dict[str, Any]:
    """The rule ``{"tau", "tau_scratch", "delta", "window"}`` a ``labels.json`` (or a predictor card's ``labels``)
    was written with; labels written before ``tau_scratch`` existed used ``tau`` for both regimes. Labels corrected
    by counterfactual costs (:mod:`.cflabels`) add ``"counterfactual_eps"`` (their ``eps_points``), so a corpus
    mixing corrected and plain CKA labels is told apart."""
    rule = {"tau": labels["tau"], "tau_scratch": labels.get("tau_scratch", labels["tau"]), "delta": labels["delta"],
            "window": labels["window"]}
    if labels.get("counterfactual_eps") is not None:  # a card's labels (label_settings)
        rule["counterfactual_eps"] = labels["counterfactual_eps"]
    elif labels.get("counterfactual") is not None:  # a labels.json written by cflabels
        rule["counterfactual_eps"] = labels["counterfactual"]["eps_points"]
    return rule


def label_run(run_dir: str | Path, tau: float = DEFAULT_TAU, delta: float = DEFAULT_DELTA,
              window: int = DEFAULT_WINDOW, write: bool = True,
              tau_scratch: float = DEFAULT_TAU_SCRATCH) -> dict[str, Any]:
    """Label one complete run and write ``<run_dir>/labels.json``.

    The CKA threshold is :func:`tau_for` the run's ``meta["mode"]``: ``tau_scratch`` for a run from scratch, else
    ``tau``.

    Returns (and writes) ``{"tau", "tau_scratch", "tau_applied", "delta", "window", "run", "steps", "act_steps",
    "blocks", "head", "cka": [[per act snapshot] per block], "freezable": [[bool] per block],
    "first_freezable_step": [int|None]}`` where ``first_freezable_step[b]`` is the step of the first activation
    snapshot at which block ``b`` is freezable (None: never, counted as the end of training by the evaluation).
    """
    run_dir = Path(run_dir)
    meta = read_meta(run_dir)
    if meta is None:
        raise PipelineError(f"{run_dir} is not a recorded run (no meta.json): collect it first")
    applied = tau_for(meta.get("mode"), tau, tau_scratch)
    acts, act_steps = read_activations(run_dir)
    head = meta.get("head")
    cka = []
    for a in acts:
        final = a[-1].float()
        cka.append([linear_cka(a[t].float(), final) for t in range(a.shape[0])])
    flags = freezable_from_cka(cka, applied, delta, window, head)
    steps = act_steps.tolist()
    first = [next((steps[t] for t, f in enumerate(row) if f), None) for row in flags]
    out = {"tau": tau, "tau_scratch": tau_scratch, "tau_applied": applied, "delta": delta, "window": window,
           "run": run_dir.name, "steps": meta["steps"],
           "act_steps": steps, "blocks": meta["blocks"], "head": head,
           "cka": [[round(v, 6) for v in row] for row in cka], "freezable": flags, "first_freezable_step": first}
    if write:
        write_json_atomic(run_dir / LABELS_FILE, out)
    return out


def label_runs(runs_dir: str | Path, tau: float = DEFAULT_TAU, delta: float = DEFAULT_DELTA,
               window: int = DEFAULT_WINDOW, tau_scratch: float = DEFAULT_TAU_SCRATCH) -> list[dict[str, Any]]:
    """Label every complete run under ``runs_dir`` (rewrites ``labels.json``; cheap next to collecting)."""
    return [label_run(d, tau, delta, window, tau_scratch=tau_scratch) for d in list_runs(runs_dir)]
