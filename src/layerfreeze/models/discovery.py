"""Block discovery and forward splits: the one place that asks the registered model families.

:func:`find_blocks` / :func:`discover_blocks` try every registered block discoverer (:mod:`layerfreeze.models.
families`, in their ``order``) and :func:`split_for` every registered :class:`~layerfreeze.models.forward_split.
ModelSplit`; this module is the only importer of the families (timm style: the family files import the registry,
:mod:`layerfreeze.models.registry`, never the reverse), so a user's family file registered the same way is seen
here too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from layerfreeze.errors import EmptyParameterError
from layerfreeze.models import families  # noqa: F401 - importing the package registers every built-in family
from layerfreeze.models.blocks import (
    Block,
    BlockDiscoveryError,
    Discovery,
    _children_summary,
    blocks_from_patterns,
    resolve_ties,
)
from layerfreeze.models.forward_split import ModelSplit, never_imported
from layerfreeze.models.registry import discoverers, splits


def _numel(p: torch.Tensor) -> int | None:
    try:
        return p.numel()
    except (RuntimeError, ValueError):  # an uninitialized (lazy) parameter: its size is not known yet
        return None


def refuse_empty_parameters(named: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """Raise :class:`~layerfreeze.errors.EmptyParameterError` when a parameter holds no elements, naming each one.

    Why: DeepSpeed ZeRO-3 replaces every parameter, outside a ``GatheredParameters`` context, by a 0-element
    placeholder (its real shape in ``ds_shape``). A freezing callback that reads the model there sees no weights at
    all (axolotl#1687: "size mismatch ... torch.Size([0])"; DeepSpeed#5041: an empty state dict saved). Without
    this check block discovery, the Freezer's checksums and ``save_checkpoint`` all pass on such a model, and the
    checkpoint holds 0-element weights, without a word.

    Args:
        named: ``(qualified name, tensor)`` pairs to check.
        where: What refuses, for the message (``"discover_blocks"``, ``"Freezer"``, ``"save_checkpoint"``).
    """
    empty = [(name, p) for name, p in named if _numel(p) == 0]
    if not empty:
        return
    shown = []
    for name, p in empty[:5]:
        full = getattr(p, "ds_shape", None)  # DeepSpeed ZeRO-3 keeps the real shape beside the placeholder
        shown.append(f"{name} (shape {tuple(p.shape)}" + (f", full shape {tuple(full)})" if full is not None else ")"))
    more = f" and {len(empty) - 5} more" if len(empty) > 5 else ""
    raise EmptyParameterError(
        f"{where}: {len(empty)} parameter(s) of the model hold no elements: {', '.join(shown)}{more}. A parameter "
        "with 0 elements is a sharded placeholder, not weights: DeepSpeed ZeRO-3 leaves every parameter so outside "
        "a gather, and nothing read or saved from it is the model. Gather the parameters first (DeepSpeed: inside "
        "`with deepspeed.zero.GatheredParameters(model.parameters())`, or ZeRO stage 2), or shard the model with "
        "FSDP2 through layerfreeze (`layerfreeze.distributed.shard_blocks`; the CLI's --parallel fsdp), which "
        "freezes sharded blocks itself", [name for name, _ in empty])


def _merge_empty_head(blocks: list[Block]) -> bool:
    """A head that owns nothing once ties are resolved (BART's ``lm_head``, tied to the shared embedding, with no
    final norm) joins the block before it, which becomes the head (named ``head``), so the head has weights to train.
    Returns whether it merged."""
    if len(blocks) < 2 or not blocks[-1].is_head or any(True for _ in blocks[-1].parameters()):
        return False
    last = blocks.pop()
    prev = blocks[-1]
    prev.name, prev.is_head = "head", True
    prev.modules, prev.params = prev.modules + last.modules, prev.params + last.params
    return True


def refuse_pattern_string(patterns: object, where: str = "") -> None:
    """Refuse block patterns given as one string, which a list or a loop would split into characters.

    Raises:
        TypeError: the message (prefixed by ``where``, the API given them) says to write a list.
    """
    if isinstance(patterns, str):
        raise TypeError(f"{where + ': ' if where else ''}blocks must be a list of module-name patterns, got the "
                        f"string {patterns!r}: write [{patterns!r}]")
    # an index or a module among them raised "object of type 'int' has no len()" from the pattern matching
    ready = bool(patterns) and all(isinstance(p, Block) for p in patterns)  # type: ignore[union-attr]
    wrong = None if ready else next(((i, p) for i, p in enumerate(patterns or ()) if not isinstance(p, str)), None)
    if wrong is not None:
        i, p = wrong
        raise TypeError(f"{where + ': ' if where else ''}blocks must be a list of module-name patterns (str), front to "
                        f"back, got {type(p).__name__} {p!r} at position {i}: name each block's module, e.g. "
                        "['stem', 'layers.*', 'head'] (`layerfreeze blocks` lists a model's blocks)")


def find_blocks(model: nn.Module, patterns: Sequence[str] | None = None) -> Discovery:
    """The model's blocks in forward order, with the rule that found them and the tied parameters.

    Tries every registered family (:mod:`layerfreeze.models.families`, in their ``order``), then the generic fallback
    (the longest ``nn.ModuleList``/``nn.Sequential`` of same-type layers). ``patterns`` skip discovery.

    Raises:
        BlockDiscoveryError: nothing could be discovered (the message names the top-level children and shows how
            to pass patterns), or a pattern matches nothing.
        EmptyParameterError: a parameter holds no elements (a sharded placeholder: :func:`refuse_empty_parameters`).
        TypeError: ``patterns`` is a string, not a list of them.
    """
    refuse_empty_parameters(model.named_parameters(), "discover_blocks")
    refuse_pattern_string(patterns)
    if patterns:
        blocks = blocks_from_patterns(model, patterns)
        return Discovery(blocks, "patterns", resolve_ties(blocks))
    for name, discover in discoverers():
        found = discover(model)
        if found:
            blocks, rule = found if isinstance(found, tuple) else (found, name)
            notes = resolve_ties(blocks)
            if _merge_empty_head(blocks):
                notes = resolve_ties(blocks)
            return Discovery(blocks, rule, notes)
    raise BlockDiscoveryError(
        f"Cannot discover the blocks of {type(model).__name__}: it is none of the known model families "
        f"({', '.join(n for n, _ in discoverers())}) and has no stack of same-type layers (an nn.ModuleList or "
        f"nn.Sequential of repeated layers); its top-level children: {_children_summary(model)}. Name the blocks "
        "front to back with module-name patterns: Freezer(model, optimizer, blocks=['stem', 'layers.*', 'head']), "
        "or model.blocks in a config (--set \"model.blocks=[stem, 'layers.*', head]\")"
    )


def discover_blocks(model: nn.Module, patterns: Sequence[str] | None = None) -> list[Block]:
    """The model's blocks in forward order; the last one is the task head.

    Args:
        model: A model of a known family (see :mod:`layerfreeze.models.families` and the README's list: Hugging Face
            encoders, decoder LMs, T5/BART, ViT/DeiT/Swin/ConvNeXt; torchvision CNNs, ViT, Swin; timm;
            ``nn.Sequential``), any model with a stack of same-type layers, or any model when ``patterns`` are given.
        patterns: Optional module-name patterns that override discovery (see :func:`blocks_from_patterns`).

    Returns:
        The blocks, ``len >= 2`` unless the model has a single parametrised module. A parameter tied across
        blocks belongs to the earliest (:func:`resolve_ties`).

    Raises:
        BlockDiscoveryError: nothing could be discovered; the message names the top-level children and shows how
            to pass patterns.
        EmptyParameterError: a parameter holds no elements (a DeepSpeed ZeRO-3 placeholder outside a gather).
    """
    return find_blocks(model, patterns).blocks


def split_for(model: nn.Module, blocks: Sequence[Block], input_key: str = "pixel_values") -> ModelSplit:
    """The split for ``model``'s family (the first registered split whose ``check_model`` accepts it).

    Args:
        model: The model.
        blocks: Its blocks (``discover_blocks(model)``).
        input_key: The batch key of the input of an ``nn.Sequential`` (see
            :class:`~layerfreeze.models.families.sequential.SequentialSplit`).

    Raises:
        ValueError: the model is none of the supported families (the message names them and why each did not
            fit), or its blocks do not line up with the family's forward.
    """
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile(model): an OptimizedModule
        raise ValueError(f"Cannot split the forward of a torch.compile'd {type(model._orig_mod).__name__} for the "
                         "activation cache: give the cache the model before compiling (model._orig_mod), and compile "
                         "its blocks instead (the CLI: --compile blocks)")
    reasons = []
    for cls in splits():
        if never_imported(cls.library):
            reasons.append(f"{cls.family}: {type(model).__name__} is not one ({cls.library} is not imported)")
            continue
        try:
            cls.check_model(model)
        except ValueError as exc:
            reasons.append(f"{cls.family}: {exc}")
            continue
        return cls.create(model, blocks, input_key)
    raise ValueError(  # one line: the CLI prints it as its error, or in its cache_off line
        f"Cannot split the forward of {type(model).__name__} for the activation cache. Supported families: "
        + "; ".join(" ".join(r.split()) for r in reasons)
        + ". Run without the cache (cache: off), or write a ModelSplit subclass for this model (README: "
        "\"Add your own model family\")."
    )
