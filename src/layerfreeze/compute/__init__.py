"""Frozen compute: the work a frozen part of training still costs, skipped or moved off the trainer's path.

* :mod:`~layerfreeze.compute.cache` -- :class:`CachedPrefix`: the frozen prefix's per-sample output read from a
  store instead of running the prefix (with the checks that keep it exact), and :func:`build_cached_prefix`, what
  a run's ``freeze.cache`` mode builds;
* :mod:`~layerfreeze.compute.store` -- :class:`ActivationCache`: checksummed per-sample storage, memory then
  safetensors shards (the cache and :func:`precompute` write to it);
* :mod:`~layerfreeze.compute.frozen` -- frozen models beside the trained one: :class:`FrozenModule`,
  :class:`FrozenDifferentiable`, :class:`FrozenPipeline`, :func:`precompute` / :class:`PrecomputedDataset`.
"""

from layerfreeze.compute.cache import (
    CACHE_MODES,
    CachedPrefix,
    CacheRefused,
    build_cached_prefix,
    check_deterministic,
    check_prefix_deterministic,
)
from layerfreeze.compute.frozen import (
    FrozenDifferentiable,
    FrozenModule,
    FrozenPipeline,
    FrozenWorkerError,
    GlobalRNGUsedError,
    NonFiniteOutputError,
    PrecomputedDataset,
    PrecomputeRefused,
    per_sample_generators,
    precompute,
)
from layerfreeze.compute.store import ActivationCache, auto_budget_bytes

__all__ = [
    "CACHE_MODES",
    "ActivationCache",
    "CacheRefused",
    "CachedPrefix",
    "FrozenDifferentiable",
    "FrozenModule",
    "FrozenPipeline",
    "FrozenWorkerError",
    "GlobalRNGUsedError",
    "NonFiniteOutputError",
    "PrecomputeRefused",
    "PrecomputedDataset",
    "auto_budget_bytes",
    "build_cached_prefix",
    "check_deterministic",
    "check_prefix_deterministic",
    "per_sample_generators",
    "precompute",
]
