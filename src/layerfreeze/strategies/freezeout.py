"""``freezeout``: every block anneals its own learning rate to zero on a cosine and freezes when it gets there.

Source: A. Brock, T. Lim, J. M. Ritchie, N. Weston, "FreezeOut: Accelerate Training by Progressively Freezing
Layers", arXiv:1706.04983, 2017, sec. 2-3, and the authors' public code (github.com/ajbrock/FreezeOut: ``utils.py``
``scale_fn``; ``densenet.py`` / ``WRN.py`` ``__init__`` and ``update_lr``).
"""

from __future__ import annotations

import math
from typing import Any

from layerfreeze.strategies.base import Decision, StageContext, Strategy, is_number
from layerfreeze.strategies.registry import register_strategy

#: How ``t_i`` is scaled after the linear spacing (``scale_fn`` in the public code).
SCALINGS: dict[str, int] = {"linear": 1, "squared": 2, "cubic": 3}


@register_strategy("freezeout")
class FreezeOut(Strategy):
    """FreezeOut: per-block cosine learning-rate annealing to zero at ``t_i``, then the block is frozen.

    The rule (paper sec. 2-3; the public code's ``lr_ratio``, ``max_j`` and ``update_lr``). Let ``L`` be the number
    of blocks, the head included as the last one (index ``L - 1``), and ``t = ctx.progress = step / total_steps``
    the fraction of training done (``step`` = optimizer steps completed).

    * Block ``i`` stops at ``t_i = s(t0 + (1 - t0) * i / (L - 1))`` with ``s(x) = x`` (``"linear"``), ``x**2``
      (``"squared"``) or ``x**3`` (``"cubic"``, the default). ``t0`` is given *before* scaling (default 0.8, so the
      first block stops at ``0.8**3 = 0.512``). The head gets ``t_{L-1} = s(1) = 1``: it anneals until the end of
      training and is never frozen. ``t_i`` increases with ``i``, so the frozen blocks always form a prefix.
    * While ``t < t_i`` block ``i``'s learning rate is ``lr_i * factor_i(t)`` with
      ``factor_i(t) = 0.5 * (1 + cos(pi * t / t_i))``, times ``1 / t_i`` when ``scale_lr`` (the paper's "scaled"
      variants: a block trained for a shorter time starts from a larger learning rate, so every block travels about
      the same total distance). The public code sets ``lr = (lr0 / t_i) / 2 * (1 + cos(pi * j / max_j))`` before
      iteration ``j`` with ``max_j = t_i * total iterations``; the author's README notes that the paper's formula
      misses this ``1/2``.
    * Block ``i`` (not the head) is frozen at the first stage with ``t >= t_i``. The public code freezes after
      ``j > max_j``; the extra iteration it runs at ``j == max_j`` has a learning rate of exactly 0 (cos(pi) = -1),
      so it changes no weight: both give the same parameters.

    Timing with the engine: the stage after step ``s`` (``ctx.step = s``) computes ``factor_i(s / total_steps)``,
    and the engine applies it right after that stage, so it is the learning rate of the next optimizer step (the
    public code's iteration ``j = s``). ``stage_every = 1``: a stage follows every optimizer step, plus the start
    stage; every stage emits ``lr_scale`` for every active block (so resuming restores the exact factors); a
    block that reaches ``t_i`` gets factor 0.0 together with the freeze. If something else keeps it trainable
    (the engine's stability guard skips a freeze while a block cools down after a guard thaw), it therefore trains
    at learning rate 0: FreezeOut has no schedule left for it, and it is frozen at the next stage the guard allows.

    Composition with the trainer's scheduler: the engine *multiplies* each factor into the block's scheduled
    learning rate (``lr = base_lr * schedule(step) * factor_i(t)``, not compounded). FreezeOut in the paper replaces
    the global schedule, so for a faithful FreezeOut use a constant schedule without warm-up
    (``train.schedule: constant``, ``train.warmup_fraction: 0``); with the default linear/cosine decay every block's
    LR is the product of the two curves (lower than FreezeOut's). In a user loop without a scheduler the factor
    multiplies the param group's own LR. The factors need one param group per block: build the optimizer from
    :func:`layerfreeze.block_param_groups` (the engine raises ValueError otherwise, and without an optimizer).
    The engine applies the start stage's factors (``1 / t_i`` with ``scale_lr``) in the Freezer's constructor, so
    the first optimizer step already runs at FreezeOut's learning rates (create the LR scheduler before the Freezer).

    Args:
        t0: When the first block stops, as a fraction of training *before* scaling; ``0 < t0 <= 1`` (1: every
            block anneals over the whole run and freezes only at its very end). Default 0.8.
        scaling: ``"cubic"`` (default), ``"squared"`` or ``"linear"``: the power applied to the linearly spaced
            ``t_i``.
        scale_lr: Multiply block ``i``'s initial learning rate by ``1 / t_i``. Default True.

    Raises:
        ValueError: a parameter outside its range (see Args).
        RuntimeError: at a stage, the run length is unknown (``Freezer(..., total_steps=N)`` is required).

    Signals: ``progress`` (t), ``t_i`` (list per block), ``factors`` (the factor of each block at this stage; 0.0
    for frozen blocks), ``active`` (number of trainable blocks).
    """

    anneals_to_zero = True  # a block's factor is 0 from its t_i on

    def __init__(self, t0: float = 0.8, scaling: str = "cubic", scale_lr: bool = True) -> None:
        super().__init__()
        if not is_number(t0) or not 0 < t0 <= 1:
            raise ValueError(
                f"freezeout: t0 must be a number in (0, 1] (when the first block stops, before scaling), got {t0!r}"
            )
        if scaling not in SCALINGS:
            raise ValueError(
                f"freezeout: scaling must be one of {', '.join(repr(s) for s in SCALINGS)}, got {scaling!r}"
            )
        if not isinstance(scale_lr, bool):
            raise ValueError(f"freezeout: scale_lr must be true or false, got {scale_lr!r}")
        self.t0 = float(t0)
        self.scaling = scaling
        self.scale_lr = scale_lr
        self.stage_every = 1

    # ---- the schedule ----------------------------------------------------------------------------------------

    def t_i(self, num_blocks: int) -> list[float]:
        """``t_i`` of each of ``num_blocks`` blocks (the last one, the head, gets 1.0)."""
        if num_blocks == 1:
            return [1.0]
        power = SCALINGS[self.scaling]
        return [(self.t0 + (1.0 - self.t0) * i / (num_blocks - 1)) ** power for i in range(num_blocks)]

    def factor(self, t: float, t_i: float) -> float:
        """The LR factor of a block with stop point ``t_i`` at progress ``t`` (0.0 from ``t >= t_i`` on)."""
        if t >= t_i:
            return 0.0
        f = 0.5 * (1.0 + math.cos(math.pi * t / t_i))
        return f / t_i if self.scale_lr else f

    def validate(self, num_blocks: int) -> None:
        """FreezeOut works with any number of blocks (one block: the head alone, annealed to the end)."""
        if num_blocks < 1:
            raise ValueError(f"freezeout: the model has no blocks (got {num_blocks})")

    # ---- the stage -------------------------------------------------------------------------------------------

    def decide(self, ctx: StageContext) -> Decision:
        t = ctx.require_progress(self.name)  # places each block's stop point t_i
        ts = self.t_i(len(ctx.blocks))
        freeze: list[int] = []
        lr_scale: dict[int, float] = {}
        factors: list[float] = []
        for block, t_i in zip(ctx.blocks, ts):
            if block.frozen:
                factors.append(0.0)
                continue
            f = self.factor(t, t_i)
            factors.append(f)
            lr_scale[block.index] = f  # 0.0 from t_i on; the head reaches 0.0 at t = 1
            if t >= t_i and not block.is_head:
                freeze.append(block.index)
        reason = ""
        if freeze:
            reason = (
                f"freezeout: t={t:.4f} reached t_i of block(s) "
                + ", ".join(f"{i} ({ts[i]:.4f})" for i in freeze)
            )
        return Decision(
            freeze=freeze,
            reason=reason,
            lr_scale=lr_scale,
            signals={
                "progress": t,
                "t_i": ts,
                "factors": factors,
                "active": sum(1 for b in ctx.blocks if not b.frozen) - len(freeze),
            },
        )

    # ---- state -----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """FreezeOut's schedule is a function of ``step / total_steps`` alone; the state records its parameters."""
        return {"t0": self.t0, "scaling": self.scaling, "scale_lr": self.scale_lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check that the checkpoint used the same schedule (a different one would jump the learning rates).

        Raises:
            ValueError: the checkpoint's ``t0``, ``scaling`` or ``scale_lr`` differ from this strategy's.
        """
        mine = self.state_dict()
        diff = {k: (state[k], v) for k, v in mine.items() if k in state and state[k] != v}
        if diff:
            detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"freezeout: the checkpoint was written with other parameters ({detail}); resume with "
                             "the same freeze.params")

    def __repr__(self) -> str:
        return f"FreezeOut(t0={self.t0}, scaling={self.scaling!r}, scale_lr={self.scale_lr})"
