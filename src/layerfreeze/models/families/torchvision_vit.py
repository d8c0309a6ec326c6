"""torchvision vision transformers: ``VisionTransformer`` (ViT-B/16, ...) and ``SwinTransformer`` (Swin-T, ...).

ViT blocks: ``conv_proj`` (with the class token and ``encoder.pos_embedding``, parameters held directly by the
model and the encoder), ``encoder.layers.encoder_layer_<i>``, then ``head`` (``encoder.ln`` + ``heads``).
Swin blocks: ``features.<i>`` (patch embedding, stages and patch merging, in order), then ``head`` (``norm`` +
``head``). Forward split: :class:`TorchvisionViTSplit` (ViT only; Swin is refused).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from layerfreeze.models.blocks import Block, head_entry, make_blocks
from layerfreeze.models.families.generic import around_stack
from layerfreeze.models.forward_split import Batch, ModelSplit, Stage, call, exact_forward, never_imported
from layerfreeze.models.registry import register_blocks, register_split


@register_blocks("torchvision ViT / Swin", order=25)
def discover_torchvision_transformer(model: nn.Module) -> list[Block] | None:
    """The blocks of a torchvision ``VisionTransformer`` or ``SwinTransformer``, or None for another model."""
    if never_imported("torchvision"):
        return None
    try:
        from torchvision.models import SwinTransformer, VisionTransformer
    except ImportError:  # pragma: no cover - torchvision is optional
        return None
    if isinstance(model, VisionTransformer):
        return around_stack(model, "encoder.layers")
    if isinstance(model, SwinTransformer):
        entries = [(f"features.{n}", [(f"features.{n}", m)]) for n, m in model.features.named_children()]
        return make_blocks(entries + head_entry([("norm", model.norm), ("head", model.head)]), head=True)
    return None


@register_split(order=25)
class TorchvisionViTSplit(ModelSplit):
    """torchvision ``VisionTransformer``, written from ``VisionTransformer.forward`` and ``Encoder.forward``.

    Stages: ``conv_proj`` (``_process_input``: patches, flattened; then the class token prepended and
    ``encoder.pos_embedding`` added -- the block ``conv_proj`` owns both) -> ``encoder.dropout`` ->
    ``encoder.layers.encoder_layer_<i>`` -> ``encoder.ln`` -> ``heads`` on the class token. State
    ``(B, 1 + patches, hidden)``. Batch key ``pixel_values`` ``(B, 3, H, W)``.

    Raises (constructor):
        ValueError: not a ``VisionTransformer`` (and its ``Encoder``) with the standard forward.
    """

    family = "torchvision VisionTransformer"
    input_keys = ("pixel_values",)
    library = "torchvision"

    @classmethod
    def check_model(cls, model: nn.Module) -> None:
        try:
            from torchvision.models.vision_transformer import Encoder, VisionTransformer
        except ImportError:  # pragma: no cover
            raise ValueError("needs torchvision (pip install layerfreeze[vision])") from None
        if not (exact_forward(model, VisionTransformer, ("forward", "_process_input"))
                and exact_forward(model.encoder, Encoder)):
            raise ValueError(f"{type(model).__name__} is not a torchvision VisionTransformer with its standard forward")

    def _stages(self, model: nn.Module) -> list[Stage]:
        encoder = model.encoder

        def embed(x: torch.Tensor, batch: Batch, ctx: dict[str, Any]) -> torch.Tensor:
            x = model._process_input(x)
            x = torch.cat([model.class_token.expand(x.shape[0], -1, -1), x], dim=1)
            return x + encoder.pos_embedding

        stages = [Stage("conv_proj", model.conv_proj, embed),
                  Stage("encoder.dropout", encoder.dropout, call(encoder.dropout))]
        stages += [Stage(f"encoder.layers.{n}", m, call(m)) for n, m in encoder.layers.named_children()]
        stages.append(Stage("encoder.ln", encoder.ln, call(encoder.ln)))
        stages.append(Stage("heads", model.heads, lambda x, batch, ctx: model.heads(x[:, 0])))
        return stages

    def full(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(batch["pixel_values"])
