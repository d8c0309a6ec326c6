"""``gradual``: gradual unfreezing with discriminative learning rates (ULMFiT).

Source: Howard & Ruder, "Universal Language Model Fine-tuning for Text Classification", ACL 2018:
sec. 3.2 (discriminative fine-tuning, ``eta^{l-1} = eta^l / 2.6``) and sec. 3.3 (gradual unfreezing: "we first
unfreeze the last layer and fine-tune all unfrozen layers for one epoch. We then unfreeze the next lower frozen
layer and repeat").

fastai's ``Learner.fine_tune`` (``fastai/callback/schedule.py``) is a different recipe, which this strategy does not
reproduce: the head alone for ``freeze_epochs`` (one-cycle), then every layer group thawed at once, the base LR
halved, with LRs spread geometrically over the groups from ``base_lr / lr_mult`` to ``base_lr`` (``lr_mult = 100``,
not 2.6 per block). Here one block thaws per stage, each ``lr_decay`` times below the block above it.
"""

from __future__ import annotations

from typing import Any

from layerfreeze.strategies.base import Decision, StageContext, Strategy, is_int, is_number
from layerfreeze.strategies.registry import register_strategy


@register_strategy("gradual")
class GradualUnfreezing(Strategy):
    """Starts with only the head trainable, then thaws one block per stage, top-down, with a discriminative LR.

    Rule (blocks ``0..L-1`` in forward order, block ``L-1`` the head):

    * Start stage: freeze blocks ``0..L-2``; only the head trains.
    * Each later stage: thaw the highest block that is still frozen (``L-2``, then ``L-3``, ... down to ``0``);
      one block per stage, nothing more once every block trains. A stage is the end of every ``every_epochs``-th
      epoch (epochs completed ``ctx.epoch + 1`` divisible by ``every_epochs``) or, when ``every_steps`` is given,
      every ``every_steps`` optimizer steps instead (exactly one of the two schedules is active).
    * Discriminative learning rate (ULMFiT eq. in sec. 3.2, ``eta^{l-1} = eta^l / lr_decay``): the thawed block
      ``l`` gets ``head_lr / lr_decay ** (L - 1 - l)``, with ``head_lr = ctx.block_lrs[-1]`` (the head's base LR).
      Without an optimizer (``ctx.block_lrs`` is None) or when the head has no param group, blocks thaw with the
      learning rate their param groups already have. Setting a block's LR needs one param group per block (build
      the optimizer with :func:`layerfreeze.block_param_groups`); the engine raises otherwise.

    The strategy never freezes after the start stage. Telemetry signals: ``stage`` (stages run so far),
    ``thawed_index`` and ``thaw_lr`` (the block thawed at this stage), ``trainable_from`` (lowest trainable block
    after the stage), ``head_lr`` and ``target_lrs`` (the discriminative LR of every block, head included).

    Args:
        every_epochs: Epochs between stages, an int ``>= 1`` (default 1, ULMFiT's one block per epoch).
        every_steps: Optimizer steps between stages, an int ``>= 1``, or None (default) to use ``every_epochs``.
            Give one of the two: ``every_steps`` with a non-default ``every_epochs`` is an error.
        lr_decay: Factor between consecutive blocks' learning rates, a finite float ``>= 1`` (default 2.6, ULMFiT;
            1.0 gives every thawed block the head's LR).

    Raises:
        ValueError: a parameter outside its range, or both schedules given.
    """

    def __init__(self, every_epochs: int = 1, every_steps: int | None = None, lr_decay: float = 2.6) -> None:
        super().__init__()
        if not is_int(every_epochs) or every_epochs < 1:
            raise ValueError(f"gradual: every_epochs must be an integer >= 1 (epochs between thaws), got "
                             f"{every_epochs!r}")
        if every_steps is not None and (not is_int(every_steps) or every_steps < 1):
            raise ValueError(f"gradual: every_steps must be an integer >= 1 (optimizer steps between thaws) or None, "
                             f"got {every_steps!r}")
        if every_steps is not None and every_epochs != 1:
            raise ValueError(f"gradual: give every_epochs or every_steps, not both (got every_epochs={every_epochs}, "
                             f"every_steps={every_steps}); set every_steps=None to thaw every {every_epochs} epochs")
        if not is_number(lr_decay) \
                or lr_decay < 1:
            raise ValueError(f"gradual: lr_decay must be a finite number >= 1 (ratio between consecutive blocks' "
                             f"learning rates; ULMFiT uses 2.6), got {lr_decay!r}")
        self.every_epochs = every_epochs
        self.every_steps = every_steps
        self.lr_decay = float(lr_decay)
        self.thaw_lrs = True  # every thaw sets the block's LR (the head's, with lr_decay 1)
        self.stage_every = every_steps
        self.at_epoch_end = every_steps is None
        self.stages = 0

    def _is_stage(self, ctx: StageContext) -> bool:
        if self.every_steps is not None:
            return ctx.event == "step" and ctx.step > 0 and ctx.step % self.every_steps == 0
        return ctx.event == "epoch_end" and (ctx.epoch + 1) % self.every_epochs == 0

    def decide(self, ctx: StageContext) -> Decision:
        last = len(ctx.blocks) - 1
        head_lr = ctx.block_lrs[-1] if ctx.block_lrs else None
        signals: dict[str, Any] = {}
        if head_lr is not None:
            signals["head_lr"] = head_lr
            signals["target_lrs"] = [head_lr / self.lr_decay ** (last - i) for i in range(last + 1)]
        if ctx.event == "start":
            self.stages = 0
            signals.update(stage=0, trainable_from=last)
            return Decision(freeze=[i for i in range(last) if not ctx.blocks[i].frozen],
                            reason="gradual: only the head trains at the start", signals=signals)
        if not self._is_stage(ctx):
            return Decision()
        self.stages += 1
        signals["stage"] = self.stages
        frozen = [b.index for b in ctx.blocks[:last] if b.frozen]
        if not frozen:
            signals["trainable_from"] = 0
            return Decision(signals=signals)
        index = frozen[-1]
        thaw_lr: dict[int, float] = {}
        if head_lr is not None:
            thaw_lr[index] = head_lr / self.lr_decay ** (last - index)
            signals["thaw_lr"] = thaw_lr[index]
        signals["thawed_index"] = index
        still_frozen = set(frozen[:-1])
        signals["trainable_from"] = min(i for i in range(last + 1) if i not in still_frozen)
        lr_text = f" at lr {thaw_lr[index]:.4g}" if thaw_lr else ""
        return Decision(thaw=[index], thaw_lr=thaw_lr, signals=signals,
                        reason=f"gradual: stage {self.stages} thaws block {index}{lr_text}")

    def state_dict(self) -> dict[str, Any]:
        return {"stages": self.stages, "every_epochs": self.every_epochs, "every_steps": self.every_steps,
                "lr_decay": self.lr_decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stages = int(state.get("stages", 0))

    def __repr__(self) -> str:
        return (f"GradualUnfreezing(every_epochs={self.every_epochs}, every_steps={self.every_steps}, "
                f"lr_decay={self.lr_decay})")
