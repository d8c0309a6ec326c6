"""Frozen models run once over a dataset, ahead of training: :func:`precompute` stores their output per sample (in an
:class:`~layerfreeze.compute.store.ActivationCache`, memory then checksummed safetensors shards) and
:class:`PrecomputedDataset` gives each item back with its stored output, after checking that the item's inputs are
the ones the output was computed from.

The fourth way to run a frozen model beside the trained one (:mod:`~layerfreeze.compute.frozen` has the three that
run it in training); it gives the same losses as the others in float32. What would make a stored output wrong is
refused: a model in the gradient path (:class:`~layerfreeze.compute.frozen.FrozenDifferentiable`), a function or a
dataset that draws from a global random number generator (one draw would be stored for good), random augmentation
(items fetched twice differ), and a store paired with another dataset than its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from layerfreeze.compute.batch_inputs import sample_indices
from layerfreeze.compute.determinism import (
    drew_from_global_random,
    first_changed_item,
    global_random_states,
    item_fingerprint,
)
from layerfreeze.compute.frozen import _STATE, FrozenModule, PrecomputeRefused, _call_without_global_rng
from layerfreeze.compute.store import ActivationCache

__all__ = ["PrecomputedDataset", "precompute"]

#: Per store: the weights of each FrozenModule its precompute ran, as ``(name, [(the dict holding the tensor, its
#: name, a weak reference to it, its version, dtype, device)])`` (weak: a replaced weight is not kept alive).
_WEIGHTS: weakref.WeakKeyDictionary[ActivationCache, list[tuple[str, list[tuple[Any, ...]]]]] = \
    weakref.WeakKeyDictionary()


def _weights(frozen: FrozenModule) -> list[tuple[Any, ...]]:
    return [(slots, name, weakref.ref(t), t._version, t.dtype, t.device)
            for module in frozen.module.modules() for slots in (module._parameters, module._buffers)
            for name, t in slots.items() if t is not None]


def _changed_weight(weights: list[tuple[Any, ...]]) -> str | None:
    """The name of the first weight replaced, modified in place (an optimizer step, ``load_state_dict``), cast or
    moved since :func:`_weights` was taken, or None. About 0.1 µs a tensor: checked at every item."""
    for slots, name, ref, version, dtype, device in weights:
        t = slots.get(name)
        if t is None or t is not ref() or t._version != version or t.dtype != dtype or t.device != device:
            return name
    return None


def precompute(dataset: Dataset, fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], batch_size: int = 32,
               store: ActivationCache | None = None, key: int = 0,
               collate_fn: Callable[[list[Any]], Any] | None = None) -> ActivationCache:
    """Run ``fn`` (the frozen models) once over ``dataset`` and store one output row per sample.

    Then train from :class:`PrecomputedDataset` ``(dataset, store)``: each item is ``dataset``'s item with the
    stored output added under ``"features"``.

    Args:
        dataset: Items are dicts of tensors (or numbers) holding ``"index"``, the item's position in ``dataset``
            (an int: ``{"pixel_values": ..., "labels": ..., "index": i}``), which is what the outputs are stored
            under (as :mod:`layerfreeze.train.data`'s datasets give them).
        fn: ``batch dict -> (B, ...) tensor``: the batch as ``collate_fn`` makes it of ``batch_size`` items
            (``batch["index"]`` a ``(B,)`` tensor), in dataset order.
        batch_size: Batch size of the pass (default 32; use the training batch size: CPU matmul kernels can round the
            last bits differently for very small batches, and equal losses across modes need equal per-sample
            outputs).
        store: Where outputs go (default: an in-memory :class:`ActivationCache`); give one with a ``directory`` to
            spill to checksummed safetensors shards.
        key: The depth key entries are stored under.
        collate_fn: Makes the batch of a list of items, as a DataLoader's (default: torch's default collate; give
            one that pads when the items' inputs differ in shape, such as token ids of different lengths). It must
            keep ``"index"`` as a ``(B,)`` tensor.

    Returns:
        The store, holding ``(index, key)`` entries.

    Raises:
        PrecomputeRefused: ``fn`` calls a :class:`FrozenDifferentiable` model or returns a tensor that requires
            grad (a model in the gradient path cannot be precomputed: its inputs come from the trained model); an
            item of the dataset differs between two fetches (random augmentation: one draw would be stored for good;
            items 0-3 are fetched twice, the global random states restored), or reading the dataset's items drew
            from a global random number generator (torch's, Python's ``random`` or NumPy's: checked at every
            batch).
        GlobalRNGUsedError: ``fn`` drew from the global RNG (a stored sample would be reused every epoch and the
            trainer's random numbers would shift): store the distribution's parameters and sample in the trainer.
        ValueError: the dataset's items are not dicts with an ``"index"``, or differ in shape and no
            ``collate_fn`` was given.
    """
    from torch.utils.data import DataLoader

    changed = first_changed_item(dataset)
    if changed is not None:
        raise PrecomputeRefused(
            f"precompute: dataset item {changed[0]}: {changed[1]!r} differs between two fetches (random augmentation "
            "in the dataset): one draw per sample would be stored and trained on in every epoch. Give precompute a "
            "dataset without the random transform (augment the stored outputs in the trainer instead), or run the "
            "frozen models in the trainer (FrozenModule, FrozenPipeline)")
    store = store if store is not None else ActivationCache()
    paths: dict[tuple[str, ...], tuple[str, ...]] = {}  # one tuple of input paths shared by the samples that have it

    def collate(items: list[Any]) -> tuple[Any, list[tuple[tuple[str, ...], torch.Tensor]]]:
        """The batch, and each item's fingerprint taken before collating (as PrecomputedDataset takes it)."""
        first = items[0]
        if not isinstance(first, dict) or "index" not in first:
            what = f"a dict with keys {', '.join(map(str, first))}" if isinstance(first, dict) else \
                type(first).__name__
            raise ValueError(f"precompute: the dataset's items must be dicts holding 'index' (the item's position, "
                             f"which the outputs are stored under), e.g. {{'pixel_values': x, 'index': i}}; an item "
                             f"is {what}")
        prints = [item_fingerprint(item) for item in items]
        try:
            batch = (collate_fn or default_collate)(items)
        except RuntimeError as exc:
            if collate_fn is not None or "equal size" not in str(exc):
                raise
            raise ValueError(f"precompute: the items of a batch differ in shape ({exc}); torch's default collate "
                             "cannot stack them: give precompute a collate_fn that pads them (the one your "
                             "DataLoader uses, e.g. transformers' DataCollatorWithPadding)") from exc
        return batch, [(paths.setdefault(names, names), rows) for names, rows in prints]

    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, generator=torch.Generator(),
                        collate_fn=collate)
    batches, first = iter(loader), 0
    _STATE.precomputing, _STATE.ran = True, {}
    try:
        while True:
            before = global_random_states()
            got = next(batches, None)
            if got is None:
                break
            batch, prints = got
            if drew_from_global_random(before):  # the two fetches above restore the states: the same draw twice
                raise PrecomputeRefused(
                    f"precompute: reading dataset items {first}-{first + len(batch['index']) - 1} drew from or "
                    "reseeded the global random number generator (torch's, Python's random or NumPy's: random "
                    "augmentation in the dataset, or a seed set per item): one draw per sample would be stored and "
                    "trained on in every epoch, and the caller's random stream changed. Give precompute a dataset "
                    "without the random transform (augment the stored outputs in the trainer instead; a dataset's "
                    "own torch.Generator is fine), or run the frozen models in the trainer (FrozenModule, "
                    "FrozenPipeline)")
            first += len(batch["index"])
            out = _call_without_global_rng(fn, batch, "precompute")
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"precompute's fn must return one (B, ...) tensor, got {type(out).__name__}")
            if out.requires_grad:
                raise PrecomputeRefused(
                    "precompute's fn returned a tensor that requires grad: something trainable or in the gradient "
                    "path is part of it, and its outputs change as training goes; precompute only frozen models "
                    "that feed the trained one")
            indices = sample_indices(batch["index"])
            store.put_batch(indices, key, out)
            for index, fingerprint in zip(indices, prints):
                store.input_fingerprints[(index, key)] = fingerprint
        _WEIGHTS[store] = [(frozen.name, _weights(frozen)) for frozen in _STATE.ran.values()]
    finally:
        _STATE.precomputing, _STATE.ran = False, {}
    store.flush()
    return store


class PrecomputedDataset(Dataset):
    """``dataset``'s items with the precomputed frozen output added under ``feature_key`` (``"features"``): item
    ``i`` is ``{**dataset[i], "features": the stored fn output of that sample}`` (one row of what :func:`precompute`'s
    ``fn`` returned), minus the keys in ``drop`` (the raw inputs the frozen model no longer needs).

    Args:
        dataset: The dataset :func:`precompute` ran over (items are dicts holding ``"index"``).
        store: What :func:`precompute` returned.
        feature_key: The key the output goes under.
        key: The depth key :func:`precompute` stored under.
        drop: Item keys to leave out.

    Each item's inputs are checked against what :func:`precompute` ran ``fn`` on for its sample (a fingerprint of
    every tensor, number and string of the item, nested ones included, but ``"index"``, taken then:
    :func:`~layerfreeze.compute.determinism.item_fingerprint`), so a store paired with another dataset of the same
    size is refused, not read. A store filled by hand (:meth:`~layerfreeze.compute.store.ActivationCache.put_batch`)
    holds no fingerprints: its items are not checked. The weights of the
    :class:`~layerfreeze.compute.frozen.FrozenModule` models that :func:`precompute` ran are checked too, at every
    item: one replaced, modified in place (``load_state_dict``, an optimizer step), cast or moved since makes the
    stored outputs stale (a model called without a ``FrozenModule``, or a change made after a DataLoader worker process
    started, is not seen).

    Raises:
        KeyError: a sample has no stored output (the store was built over another dataset, or the shard that held
            it was found corrupt and dropped: run :func:`precompute` again).
        PrecomputeRefused: an item's inputs are not those its stored output was computed from (another dataset, or
            one that changed since), or a frozen model's weights changed since precompute ran it.
    """

    def __init__(self, dataset: Dataset, store: ActivationCache, feature_key: str = "features", key: int = 0,
                 drop: tuple[str, ...] = ()) -> None:
        self.dataset, self.store, self.feature_key, self.key, self.drop = dataset, store, feature_key, key, drop

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = self.dataset[i]
        index = int(item["index"])
        out = self.store.get_batch([index], self.key)
        if out is None:
            dropped = self.store.corrupt_shards
            raise KeyError(f"no precomputed output for sample {index}: " + (
                f"{dropped} shard(s) of the store were found corrupt and dropped (warned); run precompute() again"
                if dropped else "precompute() over this dataset first"))
        self._check_inputs(i, index, item)
        self._check_weights()
        item = {k: v for k, v in item.items() if k not in self.drop}
        item[self.feature_key] = out[0]
        return item

    def _check_weights(self) -> None:
        for name, weights in _WEIGHTS.get(self.store, ()):
            changed = _changed_weight(weights)
            if changed is not None:
                raise PrecomputeRefused(
                    f"PrecomputedDataset: a weight ({changed!r}) of frozen model {name} changed since precompute ran "
                    "it (a load_state_dict, an optimizer step, a cast or a move), so the stored outputs are not what "
                    "it gives now: run precompute again after the change (load the weights before precomputing)")

    def _check_inputs(self, i: int, index: int, item: dict[str, Any]) -> None:
        found = self.store.input_fingerprints.get((index, self.key))
        if found is None:  # a store filled by hand (put_batch) holds none: nothing to check against
            return
        names, prints = item_fingerprint(item)
        stored_names, stored = found
        for j, name in enumerate(stored_names):
            if j >= len(names) or names[j] != name or not torch.equal(prints[j], stored[j]):
                differs = name
                break
        else:
            if names == stored_names:
                return
            differs = names[len(stored_names)]  # an input the sample did not have
        raise PrecomputeRefused(
            f"PrecomputedDataset: item {i} (index {index}): its {differs!r} is not the one precompute ran the "
            "frozen models on for this sample: the store was built over another dataset (one store per dataset: "
            "precompute the eval set on its own), or the dataset changed since (an edit, random augmentation); run "
            "precompute over this dataset")
