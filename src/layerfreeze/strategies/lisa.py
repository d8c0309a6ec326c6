"""``lisa``: Layerwise Importance Sampled AdamW: the embeddings and the head always train, plus ``gamma`` middle
layers sampled at random every ``k`` steps.

Source: R. Pan, X. Liu, S. Diao, R. Pi, J. Zhang, C. Han, T. Zhang, "LISA: Layerwise Importance Sampling for
Memory-Efficient Large Language Model Fine-Tuning", NeurIPS 2024, arXiv:2403.17919, sec. 3.2, Algorithm 1; the
reference implementation, LMFlow (``src/lmflow/pipeline/utils/lisa_trainer.py``, and the earlier
``DynamicLayerActivationCallback`` of ``finetuner.py``), whose ``lisa_activated_layers`` / ``lisa_interval_steps``
are ``gamma`` / ``k`` here.
"""

from __future__ import annotations

from typing import Any

from layerfreeze.strategies.base import LayerRotation, StageContext, is_int
from layerfreeze.strategies.registry import register_strategy


@register_strategy("lisa")
class LISA(LayerRotation):
    """LISA: every ``k`` steps, ``gamma`` middle layers sampled uniformly train; embeddings and head always train.

    Algorithm 1 of the paper (sec. 3.2), for ``i = 0 .. T/K - 1``: freeze every layer except the embedding and the
    language-modelling head; sample ``gamma`` of the intermediate layers uniformly without replacement and unfreeze
    them; run AdamW for ``K`` iterations. Here, with blocks ``0..L-1`` (block 0 the embeddings, block ``L-1`` the
    head, blocks ``1..L-2`` the middle layers; see :class:`~layerfreeze.strategies.base.LayerRotation`):

    * Start stage: sample ``gamma`` of the middle layers; freeze the others.
    * Every ``k`` optimizer steps (a step stage): every trainable middle layer switches off (the engine frees its
      optimizer state) and a new sample of ``gamma`` switches on with fresh AdamW state, a layer sampled again
      included: each period runs AdamW anew on its set, as Algorithm 1 does and as LMFlow's ``LISATrainer`` does
      (it rebuilds the optimizer at every switch and carries over the state of the always-trainable parameters
      only, ``LISA_PARAM_GROUPS_KEEP_STATE_IDX``). The embeddings and the head keep their state all run.
    * The sample comes from the strategy's own generator (``seed``), whose state the checkpoint keeps.

    Defaults: ``gamma=2``, ``k=20``: LMFlow's ``lisa_activated_layers`` / ``lisa_interval_steps`` defaults (also
    ms-swift's ``lisa_step_interval``); "E+H+2L" is the setting of the paper's memory table, and its ablation
    varies the period K from 13 to 122 steps. For a model whose middle is not transformer layers, the middle is
    still blocks ``1..L-2`` (a BERT classifier's pooler is one of them).

    **Not a prefix freeze.** The embeddings train, so backward runs through every layer down to them: a frozen
    middle layer saves its weight gradients (their FLOPs, about a third of a layer's training FLOPs, which
    ``FlopCounterMode`` shows), its gradient memory and its optimizer state, not its backward or its saved
    activations. The frozen prefix is empty, so the activation cache serves nothing (it runs the full forward at
    depth 0). What the paper's memory claim rests on is that a switched-off layer's optimizer state is freed: the
    public implementation never freed it (LMFlow#768: an 8B run measured LISA at 52 GB against LoRA's 35 GB);
    the engine frees it at every switch. A callback that froze layers before the Trainer built its optimizer
    trained nothing it switched on (LMFlow#726): the engine puts a switched-on block back in its own param group
    (one the optimizer never held goes to group 0) and the callbacks freeze after the optimizer exists; and it warns
    when a switched-on block that got gradients was left unchanged by the next optimizer step (what DeepSpeed#5639
    did under ZeRO-3, where a layer switched on after ``deepspeed.initialize`` was never updated).

    Args:
        gamma: Middle layers trained at a time, an int in ``1 .. L-2``.
        k: Optimizer steps per sampling period, an int ``>= 1``.
        seed: Seed of the sampling generator; None: ``torch.initial_seed()`` (the run's seed).

    Raises:
        ValueError: a parameter outside its range; a model with fewer than 3 blocks or ``gamma > L - 2``
            (:meth:`validate`, at the start stage and when the strategy is built for a model).
    """

    trains_first_block = True  # the embeddings: no frozen prefix of its own, nothing for the activation cache

    def __init__(self, gamma: int = 2, k: int = 20, seed: int | None = None) -> None:
        if not is_int(gamma) or gamma < 1:
            raise ValueError(f"lisa: gamma must be an integer >= 1 (middle layers trained at a time), got {gamma!r}")
        super().__init__(k, seed)
        self.gamma = gamma
        self.active: list[int] = []

    def validate(self, num_blocks: int) -> None:
        """Raise ValueError when the model has no middle layers or fewer than ``gamma``."""
        middle = num_blocks - 2
        if middle < 1:
            raise ValueError(f"lisa: the model has {num_blocks} block(s); LISA needs embeddings, at least one middle "
                             "layer and a head (3 blocks or more, see `layerfreeze blocks`)")
        if self.gamma > middle:
            raise ValueError(f"lisa: gamma={self.gamma} but this model has {middle} middle layer(s) (blocks 1.."
                             f"{num_blocks - 2} of {num_blocks}); set gamma to at most {middle}")

    def _sample(self, num_blocks: int) -> list[int]:
        return sorted(self.rng.sample(self.middle(num_blocks), self.gamma))

    def _signals(self, num_blocks: int) -> dict[str, Any]:
        on = {0, num_blocks - 1, *self.active}
        return {"trainable": [1.0 if i in on else 0.0 for i in range(num_blocks)]}

    def start(self, ctx: StageContext) -> tuple[list[int], list[int], dict[str, Any], str]:
        n = len(ctx.blocks)
        self.active = self._sample(n)
        off = [i for i in self.middle(n) if i not in self.active]
        return off, [0, *self.active], self._signals(n), f"lisa: layers {self.active} sampled"

    def switch(self, ctx: StageContext) -> tuple[list[int], list[int], dict[str, Any], str]:
        n = len(ctx.blocks)
        off = [i for i in self.middle(n) if not ctx.blocks[i].frozen]
        self.active = self._sample(n)
        return off, list(self.active), self._signals(n), f"lisa: period {self.switches}, layers {self.active}"

    def state_dict(self) -> dict[str, Any]:
        return {**self.rotation_state(), "gamma": self.gamma, "active": list(self.active)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_rotation_state(state)
        self.active = [int(i) for i in state.get("active", [])]

    def __repr__(self) -> str:
        return f"LISA(gamma={self.gamma}, k={self.k}, seed={self.seed})"
