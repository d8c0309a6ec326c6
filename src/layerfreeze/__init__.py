"""layerfreeze: make training cheaper by freezing parts of the network as it trains.

The pieces, one module per concern:

* :mod:`layerfreeze.blocks` — a model as an ordered list of blocks (discovery, patterns, tied weights);
* :mod:`layerfreeze.families` — one file per model family: how to find its blocks and split its forward;
* :mod:`layerfreeze.forward_split` and :mod:`layerfreeze.cache` — the frozen prefix's forward cut off and cached;
* :mod:`layerfreeze.store` — the checksummed per-sample store (memory, then safetensors shards) the cache and
  :func:`precompute` write to;
* :mod:`layerfreeze.frozen` — frozen models beside the trained one (:class:`FrozenModule`, :class:`FrozenPipeline`,
  :func:`precompute`), or in the gradient path (:class:`FrozenDifferentiable`);
* :mod:`layerfreeze.engine` — the freeze/thaw mechanics and :class:`Freezer`; :mod:`layerfreeze.optim` — the
  optimizer surgery it does (param groups per block, frozen parameters out of the optimizer and back);
* :mod:`layerfreeze.guard` — :class:`StabilityGuard`, thawing a freeze that hurt validation;
* :mod:`layerfreeze.strategies` — the policies, one file each, registered by name;
* :mod:`layerfreeze.checkpoint` — resumable checkpoints carrying the freeze state;
* :mod:`layerfreeze.rundir` — the run folder's layout and records; :mod:`layerfreeze.telemetry` — metrics.jsonl,
  TensorBoard, the summary table; :mod:`layerfreeze.measure` — measured FLOPs, memory;
  :mod:`layerfreeze.report` — the HTML report;
* :mod:`layerfreeze.integrations` — Lightning and Hugging Face Trainer callbacks (extras ``lightning``, ``hf``);
* :mod:`layerfreeze.trainer`, :mod:`layerfreeze.config`, :mod:`layerfreeze.cli` — the ``layerfreeze train`` CLI.
"""

from .blocks import Block, BlockDiscoveryError, describe_blocks, discover_blocks, find_blocks
from .cache import CachedPrefix, CacheRefused
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .engine import Freezer
from .families import register_blocks, register_split
from .forward_split import ModelSplit, split_for
from .frozen import (
    FrozenDifferentiable,
    FrozenModule,
    FrozenPipeline,
    GlobalRNGUsedError,
    NonFiniteOutputError,
    PrecomputedDataset,
    PrecomputeRefused,
    per_sample_generators,
    precompute,
)
from .guard import StabilityGuard
from .optim import block_param_groups
from .store import ActivationCache
from .strategies import DEFAULT_STRATEGY, Decision, StageContext, Strategy, UnknownStrategyError, create_strategy

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_STRATEGY",
    "ActivationCache",
    "Block",
    "BlockDiscoveryError",
    "CacheRefused",
    "CachedPrefix",
    "CheckpointError",
    "Decision",
    "Freezer",
    "FrozenDifferentiable",
    "FrozenModule",
    "FrozenPipeline",
    "GlobalRNGUsedError",
    "ModelSplit",
    "NonFiniteOutputError",
    "PrecomputeRefused",
    "PrecomputedDataset",
    "StabilityGuard",
    "StageContext",
    "Strategy",
    "UnknownStrategyError",
    "block_param_groups",
    "create_strategy",
    "describe_blocks",
    "discover_blocks",
    "find_blocks",
    "load_checkpoint",
    "per_sample_generators",
    "precompute",
    "register_blocks",
    "register_split",
    "save_checkpoint",
    "split_for",
]
