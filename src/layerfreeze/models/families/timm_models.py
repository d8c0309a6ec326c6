"""timm models (when ``timm`` is installed; ``pip install layerfreeze[timm]``): ViT/DeiT (``blocks``), ConvNeXt /
RegNet-like (``stages``), Swin (``layers``), EfficientNet/MobileNet (``blocks``).

Blocks: what runs before the stack (``patch_embed`` with ``cls_token`` / ``pos_embed``, or ``conv_stem`` + ``bn1``:
``stem``), one block per element of the stack (``blocks.<i>``, ``stages.<i>``), then the head (the final
norm / ``conv_head`` with ``head`` / ``classifier``: ``head``). A timm model of a shape another family knows
(ResNet's ``layer1..4``) is found by that family first. No forward split.
"""

from __future__ import annotations

from torch import nn

from layerfreeze.models.blocks import Block
from layerfreeze.models.families.generic import around_stack
from layerfreeze.models.registry import register_blocks

_STACKS = ("blocks", "stages", "layers")


@register_blocks("timm", order=35)
def discover_timm(model: nn.Module) -> list[Block] | None:
    """The blocks of a timm model (see the module docstring), or None for another model."""
    if not type(model).__module__.startswith("timm."):
        return None
    for name in _STACKS:
        if isinstance(getattr(model, name, None), (nn.ModuleList, nn.Sequential)):
            return around_stack(model, name)
    return None
