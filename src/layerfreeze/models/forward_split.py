"""A model's forward, split at a block boundary: the frozen prefix, the trainable suffix, and the step between.

Why: with a frozen prefix (blocks ``0..depth-1``) and deterministic inputs, the prefix's output per sample never
changes, so it can be cached (:mod:`layerfreeze.compute.cache`) and the prefix's forward skipped. That needs the forward
cut in two at a block boundary, in a way that gives *the same logits* as the model's own forward. Each supported
family gets a small, explicit :class:`ModelSplit` subclass written from its library's ``forward`` (no
monkeypatching, no hooks), in its file under :mod:`layerfreeze.models.families`, registered with
:func:`~layerfreeze.models.registry.register_split`; :func:`split_for` picks the first whose ``check_model`` accepts the
model. Built in: ``nn.Sequential``; Hugging Face ``BertForSequenceClassification``; torchvision ``MobileNetV2``
and ``ResNet``; Hugging Face Llama-style decoder LMs (Llama, Gemma, Mistral, Qwen2, Qwen3) and GPT-2; Hugging Face
``ViTForImageClassification`` / ``DeiTForImageClassification``; torchvision ``VisionTransformer``.

Words. A split runs a list of *stages* (the steps of the model's forward, in order; a stage may hold no
parameters, e.g. ``relu``). Each :class:`~layerfreeze.models.blocks.Block` lines up with one or more stages. The
*boundary state* at depth ``d`` (``1 <= d <= len(blocks) - 1``) is the output of the last stage of block ``d - 1``;
parameter-free stages after it (a ReLU, a Dropout) belong to the suffix, so a stochastic module between the frozen
prefix and the first trainable block always runs live. The head block is never part of a prefix.

State shapes: ``(B, T, H)`` hidden states for transformers up to their last layer (BERT: ``(B, H)`` once the pooler
is in the prefix); ``(B, C, H, W)`` feature maps for the CNNs; whatever the children return for ``nn.Sequential``.
Attention masks, position ids and rotary embeddings are never part of the state: they are rebuilt from the batch
on every call, exactly as the model's forward builds them.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from layerfreeze.models.blocks import Block

State = torch.Tensor
"""A boundary state: one tensor whose first dimension is the batch."""

Batch = dict[str, Any]

_GOLDEN = 0.6180339887498949


@dataclass
class Stage:
    """One step of a model's forward.

    Attributes:
        name: Qualified module name in the model (``features.3``), or a descriptive name for a functional step.
        module: The module the step runs (None for a purely functional step such as ``flatten``); the determinism
            check and the trainability check look at it.
        fn: ``(state, batch, ctx) -> state``; ``ctx`` is a dict shared by the stages of one call (BERT keeps the
            attention mask it built there).
    """

    name: str
    module: nn.Module | None
    fn: Callable[[Any, Batch, dict[str, Any]], Any]


def call(module: nn.Module) -> Callable[[Any, Batch, dict[str, Any]], Any]:
    """A stage function that runs ``module`` on the state (the batch and context unused)."""
    return lambda x, batch, ctx: module(x)


def position_weights(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``(n,)`` float64 weights in ``[0.5, 1.5)``, ``w[j] = 0.5 + frac(j * 0.618...)``, the same prefix for any ``n``.

    Used by :meth:`ModelSplit.fingerprint`: a position-weighted sum changes when a sample is flipped, shifted or
    cropped (a plain sum would not notice a flip), and ``w[:k]`` does not depend on ``n``, so a fingerprint of a
    masked sequence does not depend on how far the batch is padded.
    """
    j = torch.arange(n, dtype=torch.float64, device=device)
    return 0.5 + torch.remainder(j * _GOLDEN, 1.0)


class ModelSplit(ABC):
    """A model's forward cut at a block boundary (see the module docstring for stages and boundaries).

    Args:
        model: The model (its module structure is checked against the family).
        blocks: Its blocks front to back (``discover_blocks(model)``); ``blocks[0]`` is the first block run.

    Raises:
        ValueError: the model is not of this family, or a block does not line up with the family's stages.

    The ``model`` argument of :meth:`prefix`, :meth:`extend` and :meth:`suffix` is the module the stages are taken
    from on each call (normally the same model; any model of the same architecture works).
    """

    family: ClassVar[str] = ""
    input_keys: ClassVar[tuple[str, ...]] = ()
    #: The top-level package the family's classes come from (``"transformers"``, ``"torchvision"``), or None.
    #: :func:`~layerfreeze.models.discovery.split_for` skips the family while that package was never imported: no
    #: model of its classes can exist then, and ``check_model`` need not pay its import (1-2 s at start-up).
    library: ClassVar[str | None] = None

    def __init__(self, model: nn.Module, blocks: Sequence[Block]) -> None:
        self.check_model(model)
        if len(blocks) < 2:
            raise ValueError(f"a {self.family} split needs at least 2 blocks (a prefix and a head), got {len(blocks)}")
        self.block_names = [b.name for b in blocks]
        stages = self._stages(model)
        position = {id(s.module): i for i, s in enumerate(stages) if s.module is not None}
        boundaries: list[int] = []
        last = -1
        for block in blocks:
            positions = []
            for name, module in block.modules:
                if id(module) not in position:
                    raise ValueError(
                        f"block {block.name!r} (module {name!r}) does not line up with the {self.family} forward's "
                        f"steps ({', '.join(s.name for s in stages)}); the cache needs blocks made of whole steps"
                    )
                positions.append(position[id(module)])
            if min(positions) <= last:
                raise ValueError(
                    f"block {block.name!r} runs before or inside the previous block in the {self.family} forward; "
                    "blocks must be listed front to back"
                )
            last = max(positions)
            boundaries.append(last + 1)
        self._boundaries = boundaries
        self.stage_names = [s.name for s in stages]

    @classmethod
    def create(cls, model: nn.Module, blocks: Sequence[Block], input_key: str = "pixel_values") -> ModelSplit:
        """The split of ``model`` (what :func:`split_for` calls); ``input_key`` matters only to families whose input
        key is not fixed (``nn.Sequential``)."""
        return cls(model, blocks)

    # ---- what a family defines -----------------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def check_model(cls, model: nn.Module) -> None:
        """Raise ValueError (saying why) unless ``model`` belongs to this family and uses its standard forward."""

    @abstractmethod
    def _stages(self, model: nn.Module) -> list[Stage]:
        """The model's forward as stages, in order, ending with the logits."""

    def _initial(self, batch: Batch) -> Any:
        """What the first stage receives (the model input)."""
        return batch[self.input_keys[0]]

    @abstractmethod
    def full(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Logits ``(B, num_classes)`` from the model's own forward, exactly as the task's ``forward`` calls it."""

    # ---- the split ------------------------------------------------------------------------------------------

    @property
    def max_depth(self) -> int:
        """The deepest boundary: every block but the head (``len(blocks) - 1``)."""
        return len(self.block_names) - 1

    def boundary(self, depth: int) -> int:
        """Number of stages the prefix of ``depth`` blocks runs (0 for depth 0)."""
        return 0 if depth == 0 else self._boundaries[depth - 1]

    def _check_depth(self, depth: int, what: str) -> None:
        if not (isinstance(depth, int) and 1 <= depth <= self.max_depth):
            raise ValueError(
                f"{what}: depth must be an int in 1..{self.max_depth} (blocks before the head), got {depth!r}"
            )

    def _run(self, model: nn.Module, state: Any, batch: Batch, lo: int, hi: int | None = None) -> Any:
        ctx: dict[str, Any] = {}
        for stage in self._stages(model)[lo:hi]:
            state = stage.fn(state, batch, ctx)
        return state

    def prefix(self, model: nn.Module, batch: Batch, depth: int) -> State:
        """Run blocks ``0..depth-1`` from the batch inputs, under ``torch.no_grad()``.

        Returns:
            The boundary state at ``depth`` (no autograd graph).

        Raises:
            ValueError: ``depth`` not in ``1..max_depth``.
        """
        self._check_depth(depth, "prefix")
        with torch.no_grad():
            return self._run(model, self._initial(batch), batch, 0, self.boundary(depth))

    def extend(self, model: nn.Module, state: State, batch: Batch, start: int, stop: int) -> State:
        """Run blocks ``start..stop-1`` from the boundary state at depth ``start``, under ``torch.no_grad()``.

        ``extend(prefix(x, a), x, a, b)`` equals ``prefix(x, b)``: this is how a cache at an old boundary is
        carried to a deeper one without recomputing from the input.

        Raises:
            ValueError: not ``1 <= start < stop <= max_depth``.
        """
        self._check_depth(start, "extend start")
        self._check_depth(stop, "extend stop")
        if stop <= start:
            raise ValueError(f"extend: stop ({stop}) must be deeper than start ({start})")
        with torch.no_grad():
            return self._run(model, state, batch, self.boundary(start), self.boundary(stop))

    def suffix(self, model: nn.Module, state: State, batch: Batch, depth: int) -> torch.Tensor:
        """Run blocks ``depth..`` and the head from the boundary state at ``depth``, with grad as the caller has it.

        Returns:
            Logits ``(B, num_classes)``: the same as :meth:`full` when ``state`` is ``prefix(batch, depth)``
            (bitwise in float32 with the same kernels).

        Raises:
            ValueError: ``depth`` not in ``1..max_depth``.
        """
        self._check_depth(depth, "suffix")
        return self._run(model, state, batch, self.boundary(depth))

    def prefix_modules(self, model: nn.Module, depth: int) -> list[tuple[str, nn.Module]]:
        """``(name, module)`` of every stage the prefix of ``depth`` blocks runs, including parameter-free ones.

        Why: a Dropout between two frozen blocks belongs to no block (it has no parameters), so the Freezer never
        puts it in eval mode; the determinism check must see it.
        """
        return [(s.name, s.module) for s in self._stages(model)[: self.boundary(depth)] if s.module is not None]

    def lengths(self, batch: Batch, depth: int) -> torch.Tensor | None:
        """True per-sample lengths along the state's dimension 1 (``(B,)`` int64), or None for fixed-size states.

        A cache stores each sample's state cut to its length and pads it back (with zeros) for a batch.
        """
        return None

    def padded_length(self, batch: Batch, depth: int) -> int | None:
        """The length the batch's states are padded to along dimension 1 (None for fixed-size states)."""
        return None

    def fingerprint(self, batch: Batch) -> torch.Tensor:
        """``(B, 2 * len(input_keys))`` float64: per input, the plain and the position-weighted sum per sample.

        Cheap (one pass over the inputs, on their device) and sensitive to any change of a sample's inputs --
        noise, a flip, a crop -- so a cache can check that a hit was computed from the same inputs. Not a hash:
        a change that keeps both sums (to about 1e-9 relative) goes unnoticed.
        """
        parts = []
        for key in self.input_keys:
            if key not in batch:
                continue
            x = batch[key]
            flat = x.reshape(x.shape[0], -1).to(torch.float64)
            parts += [flat.sum(1), (flat * position_weights(flat.shape[1], flat.device)).sum(1)]
        return torch.stack(parts, 1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.block_names)} blocks, {len(self.stage_names)} steps)"


def never_imported(package: str | None) -> bool:
    """True when the top-level ``package`` was never imported in this process, so no object of its classes exists
    (a model of a torchvision or transformers class imported it): a family check can say no without paying the
    package's import (transformers ~1.7 s, torchvision ~1.5 s, most of it Dynamo, on a 2-core CPU)."""
    return package is not None and package not in sys.modules


def exact_forward(model: nn.Module, base: type, names: Sequence[str] = ("forward",)) -> bool:
    """True when ``model`` is a ``base`` that does not override the methods its forward runs."""
    return isinstance(model, base) and all(getattr(type(model), n) is getattr(base, n) for n in names)


