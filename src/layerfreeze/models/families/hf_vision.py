"""Hugging Face vision models: ViT, DeiT, Swin, ConvNeXt (and others shaped like them), and the forward split of
``ViTForImageClassification`` / ``DeiTForImageClassification``.

Blocks: ``<base>.embeddings``, one per layer or stage (``vit.layers.<i>``; Swin ``swin.encoder.layers.<i>``;
ConvNeXt ``convnext.encoder.stages.<i>``), then the head: the final ``layernorm`` with the ``classifier`` (named
``head``). Recognised by ``main_input_name == "pixel_values"`` on a model whose ``base_model`` has
``embeddings``; tried before the BERT-like family, which would otherwise take Swin for an encoder.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from layerfreeze.models.blocks import Block, qualified_names
from layerfreeze.models.families.bert import bidirectional_mask
from layerfreeze.models.families.generic import around_stack
from layerfreeze.models.forward_split import Batch, ModelSplit, Stage, call, exact_forward
from layerfreeze.models.registry import register_blocks, register_split

_STACKS = ("layers", "encoder.layers", "encoder.stages", "encoder.layer")


@register_blocks("Hugging Face vision (ViT, DeiT, Swin, ConvNeXt)", order=5)
def discover_hf_vision(model: nn.Module) -> list[Block] | None:
    """The blocks of a Hugging Face vision model (see the module docstring), or None for another model."""
    base = getattr(model, "base_model", None)
    if getattr(model, "main_input_name", None) != "pixel_values" or not isinstance(base, nn.Module):
        return None
    if not isinstance(getattr(base, "embeddings", None), nn.Module):
        return None
    base_name = qualified_names(model)[id(base)]
    for stack in _STACKS:
        path = f"{base_name}.{stack}" if base_name else stack
        try:
            model.get_submodule(path)
        except AttributeError:
            continue
        return around_stack(model, path, head=base is not model)
    return None


def _vit_classes() -> list[tuple[type, type, str]]:
    from transformers import DeiTForImageClassification, DeiTModel, ViTForImageClassification, ViTModel

    return [(ViTForImageClassification, ViTModel, "vit"), (DeiTForImageClassification, DeiTModel, "deit")]


@register_split(order=5)
class ViTSplit(ModelSplit):
    """Hugging Face ``ViTForImageClassification`` / ``DeiTForImageClassification``, written from ``ViTModel.forward``
    (transformers 5).

    Stages: ``embeddings(pixel_values)`` (patches, class token, position embeddings) -> ``layers[i](hidden, mask)``
    (the mask is ``create_bidirectional_mask`` without an attention mask, as the model makes it) -> ``layernorm`` ->
    ``classifier(hidden[:, 0])``. State ``(B, 1 + patches, H)``. Batch key ``pixel_values`` (cast to the patch
    projection's dtype as the model does).

    Raises (constructor):
        ValueError: not one of these classes with its standard forward, or a model with a pooler.
    """

    family = "Hugging Face ViTForImageClassification / DeiTForImageClassification"
    input_keys = ("pixel_values",)
    library = "transformers"

    @classmethod
    def check_model(cls, model: nn.Module) -> None:
        try:
            classes = _vit_classes()
        except ImportError:  # pragma: no cover
            raise ValueError("needs transformers (pip install layerfreeze[text])") from None
        for head_cls, base_cls, attr in classes:
            if exact_forward(model, head_cls) and exact_forward(getattr(model, attr), base_cls):
                if getattr(model, attr).pooler is not None:
                    raise ValueError("the ViT split does not support a pooler")
                return
        raise ValueError(f"{type(model).__name__} is not a ViT/DeiTForImageClassification with its standard forward")

    def _stages(self, model: nn.Module) -> list[Stage]:
        names = qualified_names(model)
        base = model.base_model

        def embed(_: Any, batch: Batch, ctx: dict[str, Any]) -> torch.Tensor:
            pixels = batch["pixel_values"]
            dtype = base.embeddings.patch_embeddings.projection.weight.dtype
            return base.embeddings(pixels.to(dtype) if pixels.dtype != dtype else pixels)

        def layer_fn(layer: nn.Module) -> Any:
            def run(hidden: torch.Tensor, batch: Batch, ctx: dict[str, Any]) -> torch.Tensor:
                if "mask" not in ctx:
                    ctx["mask"] = bidirectional_mask(base, hidden, None)
                return layer(hidden, ctx["mask"])

            return run

        def classify(hidden: torch.Tensor, batch: Batch, ctx: dict[str, Any]) -> torch.Tensor:
            return model.classifier(hidden[:, 0, :])

        stages = [Stage(names[id(base.embeddings)], base.embeddings, embed)]
        stages += [Stage(names[id(layer)], layer, layer_fn(layer)) for layer in base.layers]
        stages.append(Stage(names[id(base.layernorm)], base.layernorm, call(base.layernorm)))
        stages.append(Stage(names[id(model.classifier)], model.classifier, classify))
        return stages

    def _initial(self, batch: Batch) -> Any:
        return None

    def full(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(pixel_values=batch["pixel_values"]).logits
