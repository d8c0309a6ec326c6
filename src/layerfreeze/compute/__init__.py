"""Frozen compute: the work a frozen part of training still costs, skipped or moved off the trainer's path.

The map, one line per module: what it holds and who may import it. The modules are listed top to bottom; inside the
folder a module imports only modules listed below it (the ``compute-layers`` contract in ``pyproject.toml``; modules
on one line of that contract import nothing from each other).

* :mod:`~layerfreeze.compute.cache` -- the cache's overview and :func:`build_cached_prefix`, the cache a run's
  ``freeze.cache`` mode (:data:`CACHE_MODES`) asks for; imported by the trainer (``layerfreeze.train``) and this face;
* :mod:`~layerfreeze.compute.precomputed` -- frozen models run once over a dataset: :func:`precompute` /
  :class:`PrecomputedDataset`; imported through this face (and by the ControlNet benchmark);
* :mod:`~layerfreeze.compute.frozen` -- frozen models beside the trained one, in training: :class:`FrozenModule`,
  :class:`FrozenDifferentiable`, :class:`FrozenPipeline`; imported by ``precomputed`` and through this face (and by
  the ControlNet benchmark);
* :mod:`~layerfreeze.compute.cached_prefix` -- :class:`CachedPrefix`: the frozen prefix's per-sample output read
  from a store instead of running the prefix, with the checks that keep it exact; imported by ``cache``, the trainer
  and this face;
* :mod:`~layerfreeze.compute.cache_policy` -- :class:`~layerfreeze.compute.cache_policy.CachePolicy`, what the cache
  keeps, and the plan of one batch's lookups; imported by ``cache``, ``cached_prefix`` and the trainer;
* :mod:`~layerfreeze.compute.determinism` -- :class:`CacheRefused`, :func:`check_deterministic`,
  :func:`check_prefix_deterministic`: what would make a cache wrong; imported by ``cache``, ``cached_prefix``, the
  trainer and the memory budget (``layerfreeze.budget``);
* :mod:`~layerfreeze.compute.batch_inputs` -- what a batch must hold for the cached forward: its input under a key
  the split reads, ``"index"`` (:func:`~layerfreeze.compute.batch_inputs.sample_indices`); imported by
  ``cached_prefix`` and ``precomputed``;
* :mod:`~layerfreeze.compute.store` -- :class:`ActivationCache`: checksummed per-sample storage, memory then
  safetensors shards (the cache and :func:`precompute` write to it); imported by ``cache``, ``cached_prefix``,
  ``precomputed``, the trainer and this face.

Outside the folder, only the layers above ``layerfreeze.compute`` in the package's ``layers`` contract may import it.
"""

from layerfreeze.compute.cache import (
    CACHE_MODES,
    CacheRefused,
    build_cached_prefix,
    check_deterministic,
    check_prefix_deterministic,
)
from layerfreeze.compute.cached_prefix import CachedPrefix
from layerfreeze.compute.frozen import (
    FrozenDifferentiable,
    FrozenModule,
    FrozenPipeline,
    FrozenWorkerError,
    GlobalRNGUsedError,
    NonFiniteOutputError,
    PrecomputeRefused,
    per_sample_generators,
)
from layerfreeze.compute.precomputed import PrecomputedDataset, precompute
from layerfreeze.compute.store import ActivationCache, CacheWriteError, auto_budget_bytes

__all__ = [
    "CACHE_MODES",
    "ActivationCache",
    "CacheRefused",
    "CacheWriteError",
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
