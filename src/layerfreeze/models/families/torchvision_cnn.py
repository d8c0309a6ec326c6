"""torchvision CNNs: ``features`` + ``classifier`` models (MobileNetV2, EfficientNet, ConvNeXt, DenseNet, VGG,
AlexNet, ...) and ResNet-like models; forward splits for MobileNetV2 and ResNet."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from layerfreeze.models.blocks import Block, has_params, make_blocks
from layerfreeze.models.forward_split import Batch, ModelSplit, Stage, call, exact_forward
from layerfreeze.models.registry import register_blocks, register_split


@register_blocks("torchvision features+classifier (MobileNetV2, EfficientNet, ConvNeXt, DenseNet, VGG)", order=20)
def discover_features_classifier(model: nn.Module) -> list[Block] | None:
    """``features.<i>`` (one block per child of the ``features`` ``nn.Sequential``), then ``classifier`` (the head)."""
    features, classifier = getattr(model, "features", None), getattr(model, "classifier", None)
    if not isinstance(features, nn.Sequential) or not has_params(classifier):
        return None
    entries = [(f"features.{n}", [(f"features.{n}", m)]) for n, m in features.named_children()]
    entries.append(("classifier", [("classifier", classifier)]))
    return make_blocks(entries, head=True)


@register_blocks("ResNet-like (conv1 bn1 layer1..4 fc)", order=30)
def discover_resnet(model: nn.Module) -> list[Block] | None:
    """``stem`` (``conv1`` + ``bn1``), ``layer1`` .. ``layer4``, ``fc`` (the head)."""
    needed = ("conv1", "bn1", "layer1", "layer2", "layer3", "layer4", "fc")
    if not all(isinstance(getattr(model, n, None), nn.Module) for n in needed):
        return None
    entries = [("stem", [("conv1", model.conv1), ("bn1", model.bn1)])]
    entries += [(n, [(n, getattr(model, n))]) for n in ("layer1", "layer2", "layer3", "layer4")]
    entries.append(("fc", [("fc", model.fc)]))
    return make_blocks(entries, head=True)


@register_split(order=20)
class MobileNetV2Split(ModelSplit):
    """torchvision ``MobileNetV2`` (``MobileNetV2._forward_impl``): ``features[i]``, then
    ``adaptive_avg_pool2d(x, (1, 1))``, ``flatten(x, 1)`` and ``classifier`` (the head). Input ``pixel_values``."""

    family = "torchvision MobileNetV2"
    input_keys = ("pixel_values",)
    library = "torchvision"

    @classmethod
    def check_model(cls, model: nn.Module) -> None:
        try:
            from torchvision.models import MobileNetV2
        except ImportError:  # pragma: no cover - torchvision is an optional dependency
            raise ValueError("MobileNetV2Split needs torchvision (pip install layerfreeze[vision])") from None
        if not exact_forward(model, MobileNetV2, ("forward", "_forward_impl")):
            raise ValueError(f"{type(model).__name__} is not a torchvision MobileNetV2 with its standard forward")

    def _stages(self, model: nn.Module) -> list[Stage]:
        stages = [Stage(f"features.{n}", m, call(m)) for n, m in model.features.named_children()]
        classifier = model.classifier

        def head(x: torch.Tensor, batch: Batch, ctx: dict[str, Any]) -> torch.Tensor:
            x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
            return classifier(torch.flatten(x, 1))

        return stages + [Stage("classifier", classifier, head)]

    def full(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(batch["pixel_values"])


@register_split(order=30)
class ResNetSplit(ModelSplit):
    """torchvision ``ResNet`` (``ResNet._forward_impl``): ``conv1 bn1 relu maxpool layer1..4 avgpool flatten fc``.

    The discovered ``stem`` block is ``conv1`` + ``bn1``; its boundary is after ``bn1`` (``relu`` and ``maxpool``
    run in the suffix). Input ``pixel_values``.
    """

    family = "torchvision ResNet"
    input_keys = ("pixel_values",)
    library = "torchvision"

    @classmethod
    def check_model(cls, model: nn.Module) -> None:
        try:
            from torchvision.models import ResNet
        except ImportError:  # pragma: no cover
            raise ValueError("ResNetSplit needs torchvision (pip install layerfreeze[vision])") from None
        if not exact_forward(model, ResNet, ("forward", "_forward_impl")):
            raise ValueError(f"{type(model).__name__} is not a torchvision ResNet with its standard forward")

    def _stages(self, model: nn.Module) -> list[Stage]:
        names = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool")
        stages = [Stage(n, getattr(model, n), call(getattr(model, n))) for n in names]
        stages.append(Stage("flatten", None, lambda x, batch, ctx: torch.flatten(x, 1)))
        stages.append(Stage("fc", model.fc, call(model.fc)))
        return stages

    def full(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(batch["pixel_values"])
