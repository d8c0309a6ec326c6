"""Scale-free features of a block's weight-sample window: the predictor's input.

The window is ``(W, S)``: ``W`` snapshots (oldest first) of ``S`` sampled weights. From the ``W - 1`` deltas
``d_t = w_t - w_{t-1}`` each snapshot gets ``NUM_FEATURES`` numbers that do not depend on the block's weight scale
or on the learning rate's absolute size (ratios and cosines only), and do not depend on the order of the sampled
positions (statistics over positions), so one predictor serves any block of any network:

0. ``mean|d_t| / s`` with ``s`` = mean ``|d|`` over the whole window (movement now vs. in the window);
1. ``std(d_t) / s``;
2. ``|mean(d_t)| / s`` (coherent drift of the block);
3. ``cos(d_t, d_{t-1})`` (direction persistence; 0 for the first delta);
4. ``cos(d_t, w_newest - w_oldest)`` (alignment with the window's overall displacement);
5. median of ``|d_t| / s``; 6. 90th percentile of ``|d_t| / s``;
7. ``||w_t - w_newest|| / (||w_newest - w_oldest|| + eps)`` (how far from where the block is now);
8. ``log10(||d_t|| / ||w_t||) / 4`` (relative step size: an absolute, scale-free speed);
9. ``t / (W - 1)`` (position in the window);
10. the block's depth: its index / (number of blocks - 1), 0 for the first block, 1 for the head;
11. training progress at snapshot ``t``: its step / the run's total optimizer steps.

Features 10-11 are context (version 2): the weight dynamics of a block alone do not say how far its representation
still has to travel. In a fine-tuned transformer every encoder layer moves its weights alike under Adam (the
per-weight step is about the learning rate), while CKA to the final representation says the first layers are done
at ~10% of training and the last at ~65% (MiniLM-L6 on BBC News, our recorded runs): depth and progress carry that.

This encoder is our choice: SmartFRZ (Li et al., ICLR 2023) describes an attention-based predictor over the recorded
history of sampled weights but its exact encoder is not public in a form we can read.
"""

from __future__ import annotations

import torch

NUM_FEATURES = 12
FEATURE_VERSION = 2
_EPS = 1e-12


def window_features(window: torch.Tensor, mask: torch.Tensor | None = None, depth: float = 0.0,
                    progress: torch.Tensor | None = None) -> torch.Tensor:
    """Features of one block's window.

    Args:
        window: ``(W, S)`` float, oldest snapshot first, ``W >= 3``.
        mask: ``(S,)`` bool, True for real weights (padding excluded); default all.
        depth: The block's index / (number of blocks - 1), in [0, 1].
        progress: ``(W,)`` step of each snapshot / total optimizer steps of the run; default zeros.

    Returns:
        ``(W - 1, NUM_FEATURES)`` float32.

    Raises:
        ValueError: ``W < 3``, or the window holds NaN/Inf (no decision can be made from it).
    """
    if window.ndim != 2 or window.shape[0] < 3:
        raise ValueError(f"window must be (W >= 3, S), got {tuple(window.shape)}")
    w = window.float() if mask is None else window.float()[:, mask]
    if not torch.isfinite(w).all():
        raise ValueError("window holds NaN or Inf weights")
    d = w[1:] - w[:-1]                                           # (W-1, S)
    s = d.abs().mean() + _EPS
    ad = d.abs() / s
    total = w[-1] - w[0]
    n = d.shape[0]
    cos_prev = torch.zeros(n)
    cos_prev[1:] = torch.nn.functional.cosine_similarity(d[1:], d[:-1], dim=1, eps=_EPS)
    cos_total = torch.nn.functional.cosine_similarity(d, total.expand_as(d), dim=1, eps=_EPS)
    q = torch.quantile(ad, torch.tensor([0.5, 0.9]), dim=1)      # (2, W-1)
    dist_now = (w[1:] - w[-1]).norm(dim=1) / (total.norm() + _EPS)
    rel_step = torch.log10(d.norm(dim=1) / (w[1:].norm(dim=1) + _EPS) + _EPS) / 4
    pos = torch.arange(1, n + 1, dtype=torch.float32) / n
    prog = torch.zeros(n) if progress is None else torch.as_tensor(progress, dtype=torch.float32)[1:]
    if prog.shape != (n,):
        raise ValueError(f"progress must have one value per snapshot ({n + 1}), got {tuple(progress.shape)}")
    feats = torch.stack([
        ad.mean(dim=1), (d.std(dim=1) / s), d.mean(dim=1).abs() / s, cos_prev, cos_total,
        q[0], q[1], dist_now, rel_step, pos, torch.full((n,), float(depth)), prog,
    ], dim=1)
    return feats.float()
