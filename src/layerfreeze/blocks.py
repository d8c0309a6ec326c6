"""A model seen as an ordered list of blocks, front to back.

A *block* is one freezable unit (embeddings, ``encoder.layer.3``, ``features.7``, the classifier). Freezing a
*frozen prefix* (blocks ``0..k-1``) is what saves backward compute, so the order of blocks is forward order.

Discovery knows three families and the plain ``nn.Sequential``:

* Hugging Face BERT-like encoders (``model.base_model`` with ``embeddings``, ``encoder.layer[i]`` and an optional
  ``pooler``), followed by the task head (every other top-level child that holds parameters, e.g. ``classifier``).
* torchvision MobileNetV2-like models (``features`` as an ``nn.Sequential`` and a ``classifier``): one block per
  feature stage, then the classifier.
* torchvision ResNet-like models: ``stem`` (``conv1`` + ``bn1``), ``layer1`` .. ``layer4``, ``fc``.
* ``nn.Sequential``: one block per child that holds parameters.

Anything else needs module-name patterns (:func:`blocks_from_patterns`). Parameter-free modules (ReLU, pooling,
dropout) are never blocks: there is nothing in them to freeze, and a frozen prefix around them stays graph-free.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


class BlockDiscoveryError(ValueError):
    """Raised when a model's blocks cannot be discovered or the given patterns do not describe it."""


@dataclass(eq=False)
class Block:
    """One freezable unit of a model.

    Attributes:
        name: Stable name used in configs, checkpoints and telemetry (a module path such as ``bert.encoder.layer.3``,
            or ``stem`` for a block made of several modules).
        index: Position in forward order, 0-based.
        modules: ``(qualified_name, module)`` pairs the block is made of (usually one).
        is_head: True for the task head (the last block); strategies never freeze the head.
    """

    name: str
    index: int
    modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    is_head: bool = False

    def parameters(self) -> Iterator[nn.Parameter]:
        """The block's parameters, each once."""
        seen: set[int] = set()
        for _, module in self.modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(qualified name in the model, parameter)`` pairs, each parameter once."""
        seen: set[int] = set()
        for prefix, module in self.modules:
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{prefix}.{name}" if prefix else name), p

    def num_parameters(self) -> int:
        """Number of scalar parameters (elements) in the block."""
        return sum(p.numel() for p in self.parameters())

    def __repr__(self) -> str:
        head = ", head" if self.is_head else ""
        return f"Block({self.index}: {self.name}, {self.num_parameters():,} params{head})"


def output_tensor(output: Any) -> torch.Tensor:
    """The main tensor of a block's forward output: the first element of (nested) tuples/lists, a Hugging Face
    output's ``last_hidden_state``, or the tensor itself (e.g. what a forward hook on a block's last module sees)."""
    while isinstance(output, (tuple, list)):
        output = output[0]
    if hasattr(output, "last_hidden_state"):
        output = output.last_hidden_state
    return output


def _has_params(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())


def _finish(model: nn.Module, entries: list[tuple[str, list[tuple[str, nn.Module]]]], head: bool) -> list[Block]:
    entries = [(n, mods) for n, mods in entries if any(_has_params(m) for _, m in mods)]
    blocks = [Block(name=n, index=i, modules=mods) for i, (n, mods) in enumerate(entries)]
    if head and blocks:
        blocks[-1].is_head = True
    return blocks


def _discover_hf_encoder(model: nn.Module) -> list[Block] | None:
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module):
        return None
    encoder = getattr(base, "encoder", None)
    layers = getattr(encoder, "layer", None) or getattr(encoder, "layers", None)
    embeddings = getattr(base, "embeddings", None)
    if not isinstance(layers, (nn.ModuleList, nn.Sequential)) or embeddings is None:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    base_name = names[id(base)]

    def qual(m: nn.Module) -> str:
        return names[id(m)]

    entries = [(qual(embeddings), [(qual(embeddings), embeddings)])]
    entries += [(qual(layer), [(qual(layer), layer)]) for layer in layers]
    pooler = getattr(base, "pooler", None)
    if _has_params(pooler):
        entries.append((qual(pooler), [(qual(pooler), pooler)]))
    if base is model:
        return _finish(model, entries, head=False)
    head_mods = [(n, m) for n, m in model.named_children() if n != base_name and _has_params(m)]
    if head_mods:
        name = head_mods[0][0] if len(head_mods) == 1 else "head"
        entries.append((name, head_mods))
    return _finish(model, entries, head=bool(head_mods))


def _discover_features_classifier(model: nn.Module) -> list[Block] | None:
    features, classifier = getattr(model, "features", None), getattr(model, "classifier", None)
    if not isinstance(features, nn.Sequential) or not _has_params(classifier):
        return None
    entries = [(f"features.{n}", [(f"features.{n}", m)]) for n, m in features.named_children()]
    entries.append(("classifier", [("classifier", classifier)]))
    return _finish(model, entries, head=True)


def _discover_resnet(model: nn.Module) -> list[Block] | None:
    needed = ("conv1", "bn1", "layer1", "layer2", "layer3", "layer4", "fc")
    if not all(isinstance(getattr(model, n, None), nn.Module) for n in needed):
        return None
    entries = [("stem", [("conv1", model.conv1), ("bn1", model.bn1)])]
    entries += [(n, [(n, getattr(model, n))]) for n in ("layer1", "layer2", "layer3", "layer4")]
    entries.append(("fc", [("fc", model.fc)]))
    return _finish(model, entries, head=True)


def _discover_sequential(model: nn.Module) -> list[Block] | None:
    if not isinstance(model, nn.Sequential):
        return None
    return _finish(model, [(n, [(n, m)]) for n, m in model.named_children()], head=True)


_DISCOVERERS = (_discover_hf_encoder, _discover_features_classifier, _discover_resnet, _discover_sequential)


def _children_summary(model: nn.Module) -> str:
    rows = [
        f"  {name} ({type(m).__name__}, {sum(p.numel() for p in m.parameters()):,} params)"
        for name, m in model.named_children()
    ]
    return "\n".join(rows) if rows else "  (none)"


def blocks_from_patterns(model: nn.Module, patterns: Sequence[str], head: bool = True) -> list[Block]:
    """Blocks from module-name patterns (``fnmatch`` syntax, matched against ``model.named_modules()`` names).

    Each pattern contributes, in ``named_modules`` order, every matching module that holds parameters and is not
    inside a module already matched (so ``encoder.layer.*`` gives one block per layer, not one per sub-module).
    Blocks are ordered by pattern, so list the patterns front to back.

    Args:
        model: The model.
        patterns: e.g. ``["embed", "layers.*", "head"]``.
        head: Mark the last block as the task head (never frozen by strategies).

    Raises:
        BlockDiscoveryError: a pattern matches nothing (the message lists the top-level children).
    """
    matched: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for pattern in patterns:
        hits = 0
        for name, module in model.named_modules():
            if not name or not fnmatch.fnmatchcase(name, pattern) or not _has_params(module):
                continue
            if any(name == t or name.startswith(t + ".") or t.startswith(name + ".") for t in taken):
                continue
            taken.append(name)
            matched.append((name, module))
            hits += 1
        if hits == 0:
            raise BlockDiscoveryError(
                f"Block pattern {pattern!r} matches no module with parameters in {type(model).__name__}. "
                f"Its top-level children are:\n{_children_summary(model)}\n"
                "Patterns use fnmatch syntax on module names from model.named_modules(), e.g. 'encoder.layer.*'."
            )
    return _finish(model, [(n, [(n, m)]) for n, m in matched], head=head)


def discover_blocks(model: nn.Module, patterns: Sequence[str] | None = None) -> list[Block]:
    """The model's blocks in forward order; the last one is the task head.

    Args:
        model: A Hugging Face BERT-like model, a torchvision MobileNetV2/ResNet-like model, an ``nn.Sequential``,
            or any model when ``patterns`` are given.
        patterns: Optional module-name patterns that override discovery (see :func:`blocks_from_patterns`).

    Returns:
        The blocks, ``len >= 2`` unless the model has a single parametrised module.

    Raises:
        BlockDiscoveryError: nothing could be discovered; the message names the top-level children and shows how
            to pass patterns.
    """
    if patterns:
        blocks = blocks_from_patterns(model, patterns)
    else:
        blocks = None
        for discover in _DISCOVERERS:
            blocks = discover(model)
            if blocks:
                break
        if not blocks:
            raise BlockDiscoveryError(
                f"Cannot discover the blocks of {type(model).__name__}: it is not a Hugging Face BERT-like encoder, "
                f"a torchvision MobileNetV2/ResNet-like model or an nn.Sequential. Its top-level children are:\n"
                f"{_children_summary(model)}\n"
                "Name the blocks front to back with module-name patterns, for example\n"
                "  Freezer(model, optimizer, blocks=['stem', 'layers.*', 'head'])\n"
                "or in a config file:\n  model:\n    blocks: ['stem', 'layers.*', 'head']"
            )
    _check_disjoint(blocks)
    return blocks


def _check_disjoint(blocks: list[Block]) -> None:
    owner: dict[int, str] = {}
    for block in blocks:
        for p in block.parameters():
            if id(p) in owner:
                raise BlockDiscoveryError(
                    f"Blocks {owner[id(p)]!r} and {block.name!r} share parameters (tied weights?). A parameter must "
                    "belong to one block; pass patterns that keep tied modules in the same block."
                )
            owner[id(p)] = block.name


def unassigned_parameters(model: nn.Module, blocks: Sequence[Block]) -> list[str]:
    """Names of model parameters that belong to no block (they are never frozen)."""
    owned = {id(p) for b in blocks for p in b.parameters()}
    return [n for n, p in model.named_parameters() if id(p) not in owned]


def describe_blocks(blocks: Sequence[Block]) -> str:
    """One line per block: index, name, parameter count, head marker."""
    return "\n".join(
        f"{b.index:>3}  {b.name:<32} {b.num_parameters():>12,}{'  (head)' if b.is_head else ''}" for b in blocks
    )
