"""What a batch must hold for the cached forward: its model input under a key the split reads, and ``"index"``,
each sample's position in its dataset (the key of its cache entries).

:class:`~layerfreeze.compute.cached_prefix.CachedPrefix` checks the first with :func:`resolve_input_key` on every
call and reads the second with :func:`sample_indices`; :mod:`layerfreeze.compute.precomputed` reads ``"index"`` the
same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from layerfreeze.models.blocks import Block
from layerfreeze.models.discovery import split_for
from layerfreeze.models.forward_split import ModelSplit

__all__ = ["NOT_INPUTS", "batch_indices", "names_its_input", "resolve_input_key", "sample_indices"]

#: Batch keys that are never the model input (what :func:`resolve_input_key` skips when it looks for the input).
NOT_INPUTS = frozenset({"index", "labels", "label", "label_ids", "y", "target", "targets"})


def names_its_input(split: ModelSplit) -> bool:
    """True for a split whose input key can be named (its ``create`` takes ``input_key``: ``nn.Sequential``)."""
    return type(split).create.__func__ is not ModelSplit.create.__func__  # type: ignore[attr-defined]


def sample_indices(index: Any) -> list[int]:
    """A batch's ``"index"`` as a list of ints: a tensor (what torch's default collate makes of ints, any shape),
    a list or tuple of ints or of 0-d tensors, or a NumPy array.

    Raises:
        ValueError: something else (the message shows what it got).
    """
    if isinstance(index, torch.Tensor):
        return [int(i) for i in index.reshape(-1).tolist()]
    if isinstance(index, np.ndarray):
        return [int(i) for i in index.reshape(-1).tolist()]
    if isinstance(index, (list, tuple)) and all(
            isinstance(i, (int, np.integer)) or (isinstance(i, torch.Tensor) and i.numel() == 1) for i in index):
        return [int(i) for i in index]
    raise ValueError(f"the batch's 'index' must hold one integer sample position per sample (a tensor or a list of "
                     f"ints), got {type(index).__name__}: {index!r:.80}")


def batch_indices(batch: Mapping[str, Any], input_key: str) -> list[int]:
    """The batch's ``"index"`` (:func:`sample_indices`), one per sample of its input ``batch[input_key]``.

    Raises:
        ValueError: an ``"index"`` that is not one integer per sample, or holds another number of positions than
            the input has rows (a sample's cached output would be read for another one, or a shape error later).
    """
    indices = sample_indices(batch["index"])
    first = batch.get(input_key)
    rows = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() > 0 else None
    if rows is not None and rows != len(indices):
        raise ValueError(f"the batch's 'index' holds {len(indices)} sample positions for {rows} samples (its "
                         f"{input_key!r} has {rows} rows): give one position per sample, as the dataset's items do")
    return indices


def resolve_input_key(split: ModelSplit, model: nn.Module, blocks: Sequence[Block], batch: Any, *,
                      find: bool) -> ModelSplit:
    """Check that the split's input is in ``batch``, and return the split that reads it.

    Args:
        split: The cached forward's split (:mod:`layerfreeze.models.forward_split`).
        model, blocks: What a new split is made for when the input key is found.
        batch: The batch the cached forward was called with.
        find: Look for the input key when the split's default one is not in ``batch`` (a family that lets it be named,
            ``nn.Sequential``, on the first call): the batch's one tensor that is not in :data:`NOT_INPUTS`.

    Returns:
        ``split``, or a new split reading the key found.

    Raises:
        TypeError: ``batch`` is not a mapping (a ``(x, y)`` tuple, as a ``TensorDataset`` loader yields).
        ValueError: an input key is missing (or, to find it, the batch has none or several candidates): the message
            names the key expected, the batch's keys and ``input_key=`` to name another.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"CachedPrefix needs a dict batch (its inputs and 'index', each sample's position in its "
                        f"dataset), not a {type(batch).__name__}: have the dataset return dicts, e.g. "
                        "{'pixel_values': x, 'labels': y, 'index': i}")
    key = split.input_keys[0]
    if find and key not in batch:
        found = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and k not in NOT_INPUTS]
        if len(found) != 1:
            which = (f"several could be it ({', '.join(map(str, found))})" if found else
                     "none of them is a tensor other than the index and the labels")
            example = next((k for k in batch if k not in NOT_INPUTS), "x")
            raise ValueError(
                f"CachedPrefix: the batch has no {key!r} (the {split.family} split's default input key) and "
                f"{which}; its keys: {', '.join(map(str, batch))}. Name the input: "
                f"CachedPrefix(model, freezer=freezer, input_key={example!r})")
        split = split_for(model, blocks, input_key=found[0])
    missing = [k for k in split.input_keys[:1] if k not in batch]
    if missing:
        hint = ("Name the batch key that holds it: CachedPrefix(model, freezer=freezer, input_key=...)"
                if names_its_input(split) else
                f"The {split.family} split reads {', '.join(split.input_keys)} (the model's own input names): give "
                "the batch those keys")
        raise ValueError(f"CachedPrefix: the batch has no {missing[0]!r}, the model input the {split.family} split "
                         f"expects; its keys: {', '.join(map(str, batch))}. {hint}")
    return split
