"""torchvision vision transformers: ``VisionTransformer`` (ViT-B/16, ...) and ``SwinTransformer`` (Swin-T, ...).

ViT blocks: ``conv_proj`` (with the class token and ``encoder.pos_embedding``, parameters held directly by the
model and the encoder), ``encoder.layers.encoder_layer_<i>``, then ``head`` (``encoder.ln`` + ``heads``).
Swin blocks: ``features.<i>`` (patch embedding, stages and patch merging, in order), then ``head`` (``norm`` +
``head``). No forward split (the cache refuses them).
"""

from __future__ import annotations

from torch import nn

from ..blocks import Block, head_entry, make_blocks
from .generic import around_stack
from .registry import register_blocks


@register_blocks("torchvision ViT / Swin", order=25)
def discover_torchvision_transformer(model: nn.Module) -> list[Block] | None:
    """The blocks of a torchvision ``VisionTransformer`` or ``SwinTransformer``, or None for another model."""
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
