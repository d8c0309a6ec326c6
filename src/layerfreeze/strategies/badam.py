"""``badam``: block coordinate descent with Adam: one block trains for ``k`` steps with fresh Adam state, then the
next.

Source: Q. Luo, H. Yu, X. Li, "BAdam: A Memory Efficient Full Parameter Optimization Method for Large Language
Models", NeurIPS 2024, arXiv:2404.02827, sec. 2 (Algorithm 1); the reference implementation, Ledzy/BAdam
``src/badam/block_optim.py`` (``BlockOptimizer``: ``switch_block_every``, ``switch_mode``, ``start_block``,
``include_embedding``, ``include_lm_head``), and LLaMA-Factory's integration (``badam_switch_interval``,
``badam_switch_mode``, ``badam_start_block``).
"""

from __future__ import annotations

from typing import Any

from layerfreeze.strategies.base import LayerRotation, StageContext, is_int
from layerfreeze.strategies.registry import register_strategy

ORDERS = ("ascending", "descending", "random")


@register_strategy("badam")
class BAdam(LayerRotation):
    """BAdam: the middle layers train one at a time, ``k`` Adam steps each, in a fixed or reshuffled order.

    Algorithm 1 of the paper: the parameters are partitioned into ``D`` blocks; each block-epoch visits the blocks
    in an order ``pi`` (deterministic, or a random reshuffling per block-epoch) and runs ``K`` Adam steps on the
    active block alone, its first and second moments starting from zero (``BlockOptimizer.switch_trainable_params``
    clears the optimizer state at every switch). The reference partition (``infer_param_groups``) is one block per
    transformer layer; the embeddings are one more block only with ``include_embedding=True`` and "the LM head and
    the others" only with ``include_lm_head=True``, both False by default, so by default they never train. Here,
    with blocks ``0..L-1`` (block 0 the embeddings, blocks ``1..L-2`` the middle layers, block ``L-1`` the head):

    * The rotation is blocks ``1..L-2``, with block 0 in front of them when ``include_embedding``; every block
      outside it but the head is frozen for the whole run.
    * Start stage: the first block of the order trains (``start_block``: that position of the rotation instead);
      every other rotation block is frozen.
    * Every ``k`` optimizer steps (a step stage): the active block switches off (the engine frees its Adam state)
      and the next one switches on with fresh state, also when it is the same block (a rotation of one, or a
      reshuffle that ends and starts with it): the state is cleared on every switch, as in ``BlockOptimizer``.
      The switches fall at steps ``k, 2k, ...``; ``BlockOptimizer`` switches when ``(global_step + 1) % k == 0``
      after counting the step, so its first block trains ``k - 1`` steps and every switch comes one step earlier.
      ``ascending``: rotation positions 0, 1, ..., D-1, 0, ...; ``descending``: D-1, ..., 0, D-1, ...; ``random``:
      a permutation of the positions per block-epoch, taken from its end (``torch.randperm(D).tolist()`` then
      ``.pop()`` in ``BlockOptimizer``), from the strategy's own generator (``seed``), whose state the checkpoint
      keeps.
    * **The head keeps training** (one deviation): the engine never freezes the head (a classifier's new head must
      train), where BAdam's default freezes it too; it is what BAdam's ``active_modules`` (always-trainable
      modules) would give. With embeddings tied to the LM head (Llama 3.2, the LM benchmark's model) the LM head
      matrix belongs to the embeddings and stays frozen, so the head trains its final norm only. The head's Adam
      state carries across switches, where ``BlockOptimizer.switch_trainable_params`` clears the whole optimizer
      state, ``active_modules`` included: the head is trained as one block of an ordinary Adam run.

    Defaults: ``k=50`` (``switch_block_every`` of ``BlockOptimizer`` and LLaMA-Factory's ``badam_switch_interval``),
    ``order="ascending"`` (the BAdam README's example and LLaMA-Factory's ``badam_switch_mode``; the
    ``BlockOptimizer`` class itself defaults to ``"descending"``), ``start_block=None``, ``include_embedding=False``.

    **Not a prefix freeze.** Blocks below the active one (the frozen embeddings, the layers before it) form a frozen
    prefix: no backward, no saved activations, and the activation cache may serve their output (entries computed
    before a block below the boundary trained again are dropped: the cache watches the prefix's weights). The
    layers above the active one are frozen but still run backward (the gradient flows through them): they save
    their weight gradients and optimizer state only. ``FlopCounterMode`` shows both, so a step costs more the lower
    the active block. Faults of other implementations it avoids: optimizer state left behind for switched-off
    blocks (LMFlow#768, the same fault in LISA's code), a block switched on that the optimizer does not hold
    (LMFlow#726; DeepSpeed#5639, where a block switched on after ``deepspeed.initialize`` under ZeRO-3 was never
    updated): a switched-on block goes back into its own param group, and the engine warns when one that got
    gradients is left unchanged by the next optimizer step.

    Args:
        k: Optimizer steps per block, an int ``>= 1``.
        order: ``"ascending"``, ``"descending"`` or ``"random"`` (BAdam's ``switch_mode``).
        start_block: Position in the rotation of the first active block (BAdam's ``start_block``), or None.
        include_embedding: Put block 0 (the embeddings) in the rotation instead of freezing it for the run.
        seed: Seed of the ``random`` order's generator; None: ``torch.initial_seed()`` (the run's seed).

    Raises:
        ValueError: a parameter outside its range; an empty rotation or ``start_block`` beyond it
            (:meth:`validate`).
    """

    def __init__(self, k: int = 50, order: str = "ascending", start_block: int | None = None,
                 include_embedding: bool = False, seed: int | None = None) -> None:
        if order not in ORDERS:
            raise ValueError(f"badam: order must be one of {', '.join(ORDERS)} (BAdam's switch_mode), got {order!r}")
        if start_block is not None and (not is_int(start_block) or start_block < 0):
            raise ValueError(f"badam: start_block must be an integer >= 0 (a position in the rotation) or None, got "
                             f"{start_block!r}")
        if not isinstance(include_embedding, bool):
            raise ValueError(f"badam: include_embedding must be true or false, got {include_embedding!r}")
        super().__init__(k, seed)
        self.order = order
        self.start_block = start_block
        self.include_embedding = include_embedding
        self.position: int | None = None  # position in the rotation of the active block
        self.pending: list[int] = []  # random order: the positions this block-epoch has left (taken from the end)

    def rotation(self, num_blocks: int) -> list[int]:
        """The blocks that take turns: the middle layers, after the embeddings with ``include_embedding``."""
        return ([0] if self.include_embedding else []) + self.middle(num_blocks)

    def validate(self, num_blocks: int) -> None:
        """Raise ValueError when the rotation is empty or ``start_block`` lies beyond it."""
        size = len(self.rotation(num_blocks))
        if size < 1:
            raise ValueError(f"badam: the model has {num_blocks} block(s) and no middle layer to train (blocks "
                             "1..L-2); set include_embedding=true or use a model with more blocks")
        if self.start_block is not None and self.start_block >= size:
            raise ValueError(f"badam: start_block={self.start_block} but the rotation has {size} block(s) (positions "
                             f"0..{size - 1})")

    def _next_position(self, size: int) -> int:
        if self.order == "random":
            if not self.pending:
                self.pending = list(range(size))
                self.rng.shuffle(self.pending)
            return self.pending.pop()
        assert self.position is not None
        return (self.position + (1 if self.order == "ascending" else -1)) % size

    def _signals(self, rotation: list[int]) -> dict[str, Any]:
        assert self.position is not None
        return {"active_block": rotation[self.position], "block_epoch": self.switches // len(rotation)}

    def start(self, ctx: StageContext) -> tuple[list[int], list[int], dict[str, Any], str]:
        n = len(ctx.blocks)
        rotation = self.rotation(n)
        self.pending = []
        if self.start_block is not None:
            self.position = self.start_block
        elif self.order == "random":
            self.position = self._next_position(len(rotation))
        else:
            self.position = 0 if self.order == "ascending" else len(rotation) - 1
        active = rotation[self.position]
        off = [i for i in range(n - 1) if i != active]
        return off, [active], self._signals(rotation), f"badam: block {active} ({self.order})"

    def switch(self, ctx: StageContext) -> tuple[list[int], list[int], dict[str, Any], str]:
        rotation = self.rotation(len(ctx.blocks))
        assert self.position is not None
        old = rotation[self.position]
        self.position = self._next_position(len(rotation))
        new = rotation[self.position]
        return [old], [new], self._signals(rotation), f"badam: switch {self.switches}, block {old} -> {new}"

    def state_dict(self) -> dict[str, Any]:
        return {**self.rotation_state(), "order": self.order, "start_block": self.start_block,
                "include_embedding": self.include_embedding, "position": self.position, "pending": list(self.pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_rotation_state(state)
        position = state.get("position")
        self.position = None if position is None else int(position)
        self.pending = [int(i) for i in state.get("pending", [])]

    def __repr__(self) -> str:
        return (f"BAdam(k={self.k}, order={self.order!r}, start_block={self.start_block}, "
                f"include_embedding={self.include_embedding}, seed={self.seed})")
