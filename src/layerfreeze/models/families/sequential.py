"""``nn.Sequential``: one block per child that holds parameters (the last is the head); its split runs the
children in order."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from layerfreeze.models.blocks import Block, make_blocks
from layerfreeze.models.forward_split import Batch, ModelSplit, Stage, call, exact_forward
from layerfreeze.models.registry import register_blocks, register_split


@register_blocks("nn.Sequential", order=40)
def discover_sequential(model: nn.Module) -> list[Block] | None:
    """One block per parametrised child (named ``"0"``, ``"1"``, ...); the last is the head."""
    if not isinstance(model, nn.Sequential):
        return None
    return make_blocks([(n, [(n, m)]) for n, m in model.named_children()], head=True)


@register_split(order=40)
class SequentialSplit(ModelSplit):
    """``nn.Sequential``: the stages are its children; the input is ``batch[input_key]``.

    Args:
        input_key: The batch key holding the model input (``"pixel_values"``, as the vision tasks use).
    """

    family = "nn.Sequential"

    def __init__(self, model: nn.Module, blocks: Sequence[Block], input_key: str = "pixel_values") -> None:
        self.input_keys = (input_key,)  # type: ignore[misc]
        super().__init__(model, blocks)

    @classmethod
    def check_model(cls, model: nn.Module) -> None:
        if not exact_forward(model, nn.Sequential):
            raise ValueError(f"{type(model).__name__} is not an nn.Sequential with its standard forward")

    def _stages(self, model: nn.Module) -> list[Stage]:
        return [Stage(name, child, call(child)) for name, child in model.named_children()]

    @classmethod
    def create(cls, model: nn.Module, blocks: Sequence[Block], input_key: str = "pixel_values") -> ModelSplit:
        return cls(model, blocks, input_key)

    def full(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(batch[self.input_keys[0]])
