"""Models from local files: a Hugging Face sequence classifier or causal LM from its folder, a torchvision
classifier with the installed ImageNet weights. Never a hub download (:func:`quiet_transformers` sets the offline
switches before transformers is imported); every failure is a :class:`~layerfreeze.errors.ConfigError` or
:class:`~layerfreeze.errors.AssetMissingError` that says what to install or set.

The tasks (:mod:`layerfreeze.train.tasks`, :mod:`layerfreeze.train.lm`), the SmartFRZ recipes and the benchmarks
load their models through these functions.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerfreeze.errors import ConfigError
from layerfreeze.train import assets


def quiet_transformers() -> None:
    """Keep transformers offline (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``, unless already set) and quiet (errors
    only, no progress bars); call it before loading anything with transformers."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _not_a_model_folder(path: Path) -> None:
    """Refuse ``model.name_or_path`` that is not a local Hugging Face folder, saying what it is instead.

    Raises:
        ConfigError: always.
    """
    what = ("does not exist" if not path.exists() else "is a file" if not path.is_dir()
            else "is a folder without config.json")
    raise ConfigError(f"model.name_or_path {path} {what}: give a local Hugging Face model folder (what "
                      "save_pretrained writes: config.json, weights, tokenizer); models are never downloaded")


def load_text_model(path: str | Path, num_labels: int) -> tuple[nn.Module, Any]:
    """A sequence classifier and its tokenizer from a local Hugging Face folder (never a hub download).

    Raises:
        ConfigError: the folder does not exist or holds no model.
    """
    quiet_transformers()
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        if str(path) in VISION_MODELS:
            raise ConfigError(f"model.name_or_path {path} is a torchvision model and this task reads text: add "
                              "--task fashion-mnist (or image-folder with --data)")
        _not_a_model_folder(path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    saved = getattr(config, "num_labels", None)
    if saved != num_labels and any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
        warnings.warn(f"model.name_or_path {path}: its classification head has {saved} labels and the data "
                      f"{num_labels}: a new head of {num_labels} is trained in its place", stacklevel=2)
    # a classifier folder of another label count gets a new head (from_pretrained raised on the size mismatch)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels, local_files_only=True,
                                                               ignore_mismatched_sizes=True)
    if tokenizer.pad_token is None:  # GPT-2's: a batch of texts is padded, and the classifier finds each one's end
        if tokenizer.eos_token is None:
            raise ConfigError(f"model.name_or_path {path}: its tokenizer has neither a padding nor an end-of-text "
                              "token, and a batch of texts needs one to pad with; add one to the tokenizer")
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model.config, "pad_token_id", None) is None:
        # a decoder classifier (GPT-2, Llama) reads the logits at each text's last token, found by the padding token;
        # without one it refused any batch of more than one text
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


#: The torchvision architectures the image tasks build (``model.name_or_path``).
VISION_MODELS = ("mobilenet_v2", "resnet18")


def load_vision_model(name: str, num_classes: int, pretrained: bool | None = None) -> nn.Module:
    """A torchvision classifier with a new ``num_classes`` head.

    ``mobilenet_v2`` loads the installed ImageNet weights when ``pretrained`` (None: yes); ``resnet18`` is from
    scratch (None or False: it has no offline weights).

    Raises:
        ConfigError: unknown architecture, or ``pretrained`` for one without offline weights.
        AssetMissingError: the MobileNetV2 weights are not installed.
    """
    import torchvision

    if pretrained is None:  # the weights a model has offline
        pretrained = name == "mobilenet_v2"
    if name == "mobilenet_v2":
        model = torchvision.models.mobilenet_v2(num_classes=1000)
        if pretrained:
            state = torch.load(assets.mobilenet_v2_weights(), map_location="cpu", weights_only=True)
            model.load_state_dict(state)
        model.classifier[1] = nn.Linear(model.last_channel, num_classes)
        return model
    if name == "resnet18":
        if pretrained:
            raise ConfigError("model.pretrained is true but resnet18 has no offline pretrained weights; leave "
                              "model.pretrained out (or --set model.pretrained=false): it trains from scratch")
        return torchvision.models.resnet18(num_classes=num_classes)
    raise ConfigError(f"Unknown vision model {name!r}; use {' or '.join(VISION_MODELS)}")


def load_causal_lm(path: str | Path | None) -> tuple[nn.Module, Any]:
    """A causal LM and its tokenizer from a local Hugging Face folder (never a hub download).

    Raises:
        ConfigError: no folder given, or it holds no model (no ``config.json``) or no tokenizer.
    """
    if not path:
        raise ConfigError("task text-lm needs model.name_or_path (--model): a local Hugging Face causal LM folder. "
                          "No decoder LM weights install offline; save one with save_pretrained (model + tokenizer)")
    path = Path(path)
    if not (path / "config.json").is_file():
        _not_a_model_folder(path)
    quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.name_or_path {path}: cannot load its tokenizer ({exc})") from None
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return model, tokenizer
