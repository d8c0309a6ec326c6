"""The run configuration as a YAML file people edit (:func:`config_yaml`, what ``layerfreeze config`` prints): every
key with its value and what it means. Imported by the CLI only."""

from __future__ import annotations

import copy
import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from layerfreeze.train.config import Config, build_config
from layerfreeze.train.config_words import section_class
from layerfreeze.train.presets import strategy_preset


def _yaml_value(value: Any) -> str:
    """One value as inline YAML (``128``, ``null``, ``[a, b]``, ``{k: 5}``, ``'on'``)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False).strip()
    return text.removesuffix("\n...").strip()


#: What each section and each key without a ``description`` means, for :func:`config_yaml` (one line each).
KEY_NOTES: dict[str, str] = {
    "task": "what to train on; its preset fills in the model and training keys you do not set",
    "model": "which network to train",
    "model.name_or_path": "local Hugging Face folder (text tasks; null: the installed MiniLM-L6), or mobilenet_v2 / "
                          "resnet18 (image tasks)",
    "model.blocks": "module-name patterns naming the blocks front to back (null: discovered)",
    "model.pretrained": "image tasks: start from the installed ImageNet weights (null: when the model has them)",
    "model.lora": "LoRA adapters (peft) instead of full training",
    "model.lora.r": "adapter rank",
    "model.lora.alpha": "adapter scaling numerator (alpha / r)",
    "model.lora.dropout": "dropout on the adapters' input",
    "model.lora.targets": "module names to wrap (null: attention query/value, or every dense convolution)",
    "data": "where the data comes from",
    "data.path": "text-csv: a CSV file; image-folder: a folder of class sub-folders; text-lm: a text or CSV file",
    "data.test_path": "a separate test file (null: a seeded test_fraction of data.path)",
    "data.text_column": "CSV column holding the text",
    "data.label_column": "CSV column holding the label",
    "data.test_fraction": "share held out for testing when there is no test_path",
    "data.split_seed": "seed of the train/test split",
    "data.image_size": "image side in pixels",
    "train": "optimisation",
    "train.epochs": "passes over the training data",
    "train.batch_size": "samples per optimizer step (the global batch under torchrun)",
    "train.eval_batch_size": "samples per evaluation batch",
    "train.lr": "every block's learning rate (the head's when lr_decay > 1 gives earlier blocks smaller ones)",
    "train.lr_decay": "each earlier block's LR is this many times smaller (ULMFiT: 2.6; 1: one LR)",
    "train.weight_decay": "decoupled weight decay (AdamW) / L2 (SGD)",
    "train.momentum": "SGD momentum",
    "train.warmup_fraction": "share of the steps with a linear LR warm-up",
    "train.grad_clip": "max global gradient norm (null: no clipping)",
    "train.seed": "seed of weights, data order and dropout",
    "freeze": "the freezing strategy, the stability guard, the activation cache and the demotion of frozen blocks",
    "freeze.strategy": "a registered strategy (`layerfreeze strategies` lists them)",
    "freeze.params": "the strategy's parameters, e.g. {k: 5} for static",
    "freeze.train_bn": "keep BatchNorm layers of frozen blocks training",
    "freeze.guard": "thaw the latest frozen block when validation loss worsens",
    "freeze.guard.tolerance": "allowed relative worsening of the validation loss after a freeze",
    "freeze.guard.patience": "consecutive worse evaluations before the thaw",
    "freeze.guard.cooldown": "evaluations the thawed block stays trainable",
    "freeze.guard.val_fraction": "share of the training data held out for the guard's validation loss",
    "freeze.guard.every_steps": "also evaluate every N steps (null: at epoch ends only)",
    "freeze.cache": "frozen-prefix activation cache: skip the frozen prefix's forward",
    "freeze.memory_budget": "tensor-peak budget (3GiB, 800MiB, or 0.6 of the peak with nothing frozen): the shortest "
                            "frozen prefix that fits is frozen from the start and never thawed (null: none)",
    "freeze.cache.mode": "auto: use it when the data and model allow it (else say why and train without), and keep "
                         "only entries read again under a stable boundary; on: store every miss",
    "freeze.cache.dtype": "storage precision",
    "freeze.demote": "demote frozen blocks: cast their weights and/or move the cached prefix's weights off the device",
    "freeze.demote.dtype": "cast a block's weights to it when it freezes (float32 restored exactly at a thaw)",
    "freeze.demote.offload": "move the weights of the frozen prefix the cache serves to host memory",
    "freeze.demote.master": "where a demoted block's float32 master copy is kept (auto: memory on GPU, disk on CPU)",
    "run": "where results go and how the run behaves",
    "run.dir": "run folder (null: runs/<task>-<strategy>-<time>)",
    "run.device": "auto, cpu, cuda or cuda:N",
    "run.threads": "CPU threads (null: PyTorch's default)",
    "run.progress": "progress bar",
    "run.tensorboard": "TensorBoard event files",
    "run.checkpoint": "write resumable checkpoints",
    "run.resume": "a run folder to continue (what --resume sets)",
    "run.parallel": "under torchrun, each rank holds the whole model (ddp) or a shard of every parameter (fsdp: "
                    "FSDP2, refused in one process)",
    "run.ledger": "the memory ledger: bytes per bucket (parameters, gradients, optimizer state, saved activations, "
                  "cache) in metrics.jsonl, TensorBoard and the summary",
}


def _yaml_lines(section: BaseModel, indent: str, prefix: str) -> list[str]:
    lines = []
    for name, field in type(section).model_fields.items():
        key, value = prefix + name, getattr(section, name)
        note = field.description or KEY_NOTES.get(key, "")
        if isinstance(value, BaseModel):
            lines.append(f"{indent}{name}:" + (f"  # {note}" if note else ""))
            lines += _yaml_lines(value, indent + "  ", key + ".")
            continue
        cls = section_class(field.annotation)
        if cls is not None:  # an optional section that is off: its keys with their defaults, to turn it on
            example = getattr(cls, "EXAMPLE", None) or cls().model_dump(mode="json")
            note = f"{note}; off (null), or set, e.g. {name}: {_yaml_value(example)}"
        elif typing.get_origin(field.annotation) is Literal:
            choices = ", ".join(str(c) for c in typing.get_args(field.annotation))
            note = f"{note} ({choices})" if note else f"one of {choices}"
        lines.append(f"{indent}{name}: {_yaml_value(copy.deepcopy(value))}" + (f"  # {note}" if note else ""))
    return lines


def config_yaml(config: Config | None = None, preset_as_comment: bool = False) -> str:
    """``config`` (default: the default one) as a YAML config file: every key with its value, one per line, with what it
    means as a comment; an optional section that is off (``freeze.guard``, ``model.lora``) shows its keys with their
    defaults in its comment. Loading the text back (:func:`~layerfreeze.train.config_load.load_config`) gives the same
    config. ``layerfreeze config`` prints it.

    ``preset_as_comment``: strategy parameters that are the task's preset for its default model
    (:func:`~layerfreeze.train.presets.strategy_preset`) are written as ``params: {}`` with the preset in the comment:
    loaded back they apply to that model as before, and another ``--model`` gets the strategy's own defaults (a
    preset written as the user's own, ``static``'s ``k: 5`` for MiniLM-L6, was refused for a 3-block model)."""
    config = config if config is not None else build_config({})
    head = ["# layerfreeze run configuration: every key, with its value (the defaults, unless set).",
            "# Use as `layerfreeze train --config FILE` (keep only the keys you change), or set one key with",
            "# `--set section.key=value`."]
    lines = _yaml_lines(config, "", "")
    preset = strategy_preset(config.task, config.freeze.strategy, config.model.name_or_path)
    if preset_as_comment and preset and config.freeze.params == preset:
        at = next(i for i, line in enumerate(lines) if line.startswith("  params: "))
        lines[at] = (f"  params: {{}}  # the task's preset for its default model, {_yaml_value(preset)}, applies "
                     "(another model.name_or_path: the strategy's own defaults); set values here to override")
    return "\n".join(head + lines) + "\n"
