"""The frozen prefix's forward skipped: its per-sample output read from a store, and the checks that keep it right.

Why: once blocks ``0..depth-1`` are frozen (eval mode, no gradients), their output for a sample is a fixed function
of that sample's inputs. When the inputs are deterministic (no random augmentation), computing it once and reading
it back every later epoch saves the prefix's whole forward -- the only cost a frozen prefix still has. When more
blocks freeze, the cache is carried forward from the cached boundary (``extend``), not recomputed from the input.

The pieces, one module each:

* :class:`~layerfreeze.compute.cached_prefix.CachedPrefix` (:mod:`~layerfreeze.compute.cached_prefix`) -- the
  forward: cached states for hits, ``prefix`` (or ``extend`` from an older boundary) for misses, then the split's
  ``suffix`` with gradients (:mod:`layerfreeze.models.forward_split`), and the correctness rules that keep a hit from
  reusing a stale value.
* :func:`~layerfreeze.compute.determinism.check_deterministic` and
  :func:`~layerfreeze.compute.determinism.check_prefix_deterministic` -- refuse, with a clear message, what would
  make a cache wrong: random augmentation in the dataset; dropout or BatchNorm in training mode in the prefix.
* The storage, entries keyed by ``(sample index, depth)`` in memory then checksummed safetensors shards, is
  :class:`~layerfreeze.compute.store.ActivationCache` (:mod:`layerfreeze.compute.store`).
* :class:`~layerfreeze.compute.cache_policy.CachePolicy` (:mod:`~layerfreeze.compute.cache_policy`) -- what the cache
  keeps (``freeze.cache.mode: auto`` in the CLI): an entry is stored only when it will be read again under a boundary
  that has been stable long enough, and freed after its last read.
* :func:`build_cached_prefix` (here) -- the cache a run's ``freeze.cache`` mode (:data:`CACHE_MODES`) asks for.

The names of this module's ``__all__`` stay importable from here, wherever they are defined.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from layerfreeze.compute.cache_policy import CachePolicy
from layerfreeze.compute.cached_prefix import CachedPrefix, FrozenPrefixSource
from layerfreeze.compute.determinism import CacheRefused, check_deterministic, check_prefix_deterministic
from layerfreeze.compute.store import ActivationCache
from layerfreeze.errors import ConfigError
from layerfreeze.models.blocks import Block
from layerfreeze.models.discovery import split_for

__all__ = [
    "CACHE_MODES",
    "CachePolicy",
    "CacheRefused",
    "CachedPrefix",
    "FrozenPrefixSource",
    "build_cached_prefix",
    "check_deterministic",
    "check_prefix_deterministic",
]

#: What a run may ask of the cache: ``off``; ``auto`` (use it where it is exact, else train without it and say why;
#: keep only the entries that pay, :class:`CachePolicy`); ``on`` (use it, or refuse to start; store every entry).
CACHE_MODES = ("off", "auto", "on")


def build_cached_prefix(model: nn.Module, blocks: Sequence[Block], dataset: Any, *, mode: str = "auto",
                        dtype: torch.dtype | None = None, budget_bytes: int | None = None, directory: Any = None,
                        freezer: FrozenPrefixSource | None = None, input_key: str = "pixel_values",
                        on_disable: Callable[[str], None] | None = None,
                        shard_bytes: int | None = None,
                        policy: CachePolicy | None = None) -> CachedPrefix | None:
    """The frozen-prefix cache a run asks for (``freeze.cache`` in the CLI), or None to run the plain forward.

    Args:
        model / blocks: The model and its blocks.
        dataset: The training set (checked for random augmentation: :func:`check_deterministic`).
        mode: One of :data:`CACHE_MODES`. ``auto``: when the model's family has no split or the data is not
            deterministic, ``on_disable(reason)`` is called and None returned; later refusals turn the cache off
            the same way (``fallback``). ``on``: those refusals raise.
        dtype: Storage dtype of the cached states (None: as computed, float32 in a float32 run).
        budget_bytes: Memory for entries before they spill to shards (None: a quarter of the host memory
            available, :func:`~layerfreeze.compute.store.auto_budget_bytes`).
        directory: Where shards go (None: a temporary directory).
        freezer: The Freezer whose frozen prefix is served.
        input_key: The batch key of the input, for families whose forward takes one tensor (``nn.Sequential``).
        on_disable: Called with the reason whenever ``auto`` runs without the cache.
        shard_bytes: The write buffer above ``budget_bytes`` before a shard is written (None: the store's default,
            64 MiB; 0: every batch that spills is written at once, so memory never exceeds the budget by more than
            one batch: what a memory budget's plan asks, :mod:`layerfreeze.budget`).
        policy: What the cache keeps (:class:`CachePolicy`), used with ``mode="auto"`` (``on`` stores every miss).

    Raises:
        CacheRefused: ``mode="on"`` and the model or data cannot be cached (the message says why: a family without
            a split, random augmentation, a sharded model whose root FSDP2 group holds parameters).
        ValueError: an unknown ``mode``.
    """
    if mode not in CACHE_MODES:
        raise ValueError(f"cache mode must be one of {', '.join(CACHE_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    try:
        split = split_for(model, blocks, input_key=input_key)
        check_deterministic(dataset)
        cache = ActivationCache(budget_bytes, dtype, directory=directory,
                                **({} if shard_bytes is None else {"shard_bytes": shard_bytes}))
        return CachedPrefix(model, blocks, split, cache, freezer=freezer, fallback=mode == "auto",
                            on_disable=on_disable, policy=policy if mode == "auto" else None)
    except ConfigError:  # the data itself is wrong (an unreadable image, found by the check's fetches): not a reason to
        raise  # run without the cache but to stop before training, with the data's own message
    except ValueError as exc:  # CacheRefused is a ValueError; so are split_for's "no split for this family" and
        # CachedPrefix's refusal of a sharded model whose root group holds parameters
        if mode == "on":
            raise CacheRefused(str(exc)) from None
        if on_disable is not None:
            on_disable(str(exc))
        return None
