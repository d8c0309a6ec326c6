"""layerfreeze: make training cheaper by freezing parts of the network as it trains.

One folder per concept; imports run one way, from the top of this list to the bottom (``lint-imports`` checks it,
the contract is in ``pyproject.toml``):

* :mod:`layerfreeze.cli` -- the ``layerfreeze`` command;
* :mod:`layerfreeze.smartfrz` -- the SmartFRZ predictor's offline pipeline (research code: it imports the library,
  the library never imports it);
* :mod:`layerfreeze.train` -- the CLI trainer: config, tasks, data, the train/eval loop, ``compare``;
  :mod:`layerfreeze.integrations` -- the Lightning and Hugging Face Trainer callbacks;
* :mod:`layerfreeze.checkpoint` -- resumable checkpoints carrying the freeze state (full ones of a sharded model too);
  :mod:`layerfreeze.budget` -- memory budgets: each block's bytes measured, the frozen prefix that fits
  (:func:`plan_memory`);
* :mod:`layerfreeze.engine` -- :class:`Freezer`: the freeze/thaw mechanics, optimizer surgery, the stability
  guard, integrity checks; :mod:`layerfreeze.compute` -- frozen compute: the prefix cache, frozen models beside
  the trained one;
* :mod:`layerfreeze.strategies` -- the policies, one file each, registered by name (SmartFRZ's runtime included);
* :mod:`layerfreeze.distributed` -- process group, DDP rebuilt around the trainable part, FSDP2;
* :mod:`layerfreeze.models` -- a model as blocks, its forward split, one file per model family;
* :mod:`layerfreeze.runs` -- the run folder, telemetry, measurements (the memory ledger, :class:`MemoryLedger`),
  tables, the HTML report;
* :mod:`layerfreeze.registry`, :mod:`layerfreeze.errors` -- the decorator registries, the errors a user acts on.

The names below are the library's public API; the README imports only from here and from the concept packages.
Old module paths (``layerfreeze.blocks``, ``layerfreeze.trainer``, ...) still import, with a ``DeprecationWarning``
(:mod:`layerfreeze._compat`).
"""

from layerfreeze import _compat
from layerfreeze._version import __version__

# Memory budgets: what to freeze to fit.
from layerfreeze.budget import MemoryPlan, parse_budget, plan_memory

# Checkpoints.
from layerfreeze.checkpoint import load_checkpoint, load_full_checkpoint, save_checkpoint, save_full_checkpoint

# Frozen compute: the prefix cache and frozen models beside the trained one.
from layerfreeze.compute import (
    ActivationCache,
    CachedPrefix,
    CacheRefused,
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

# Several ranks.
from layerfreeze.distributed import FreezeDDP, close_distributed, init_distributed, shard_blocks

# The engine: freeze and thaw, in any loop.
from layerfreeze.engine import Freezer, StabilityGuard, block_param_groups, open_freezer, release_earlier_freezers

# Errors a user acts on.
from layerfreeze.errors import (
    AssetMissingError,
    BlockDiscoveryError,
    BudgetError,
    CheckpointError,
    ConfigError,
    EmptyParameterError,
    PredictorError,
    RunFileError,
    StrategyError,
    UnknownStrategyError,
    UserError,
)

# Models as blocks.
from layerfreeze.models import (
    Block,
    ModelSplit,
    Stage,
    call,
    describe_blocks,
    discover_blocks,
    find_blocks,
    make_blocks,
    module_entry,
    qualified_names,
    register_blocks,
    register_split,
    split_for,
)

# Where the memory goes.
from layerfreeze.runs.ledger import MemoryLedger

# The policies.
from layerfreeze.strategies import (
    DEFAULT_STRATEGY,
    Decision,
    StageContext,
    Strategy,
    create_strategy,
    register_strategy,
)

_compat.install()

__all__ = [
    "DEFAULT_STRATEGY",
    "ActivationCache",
    "AssetMissingError",
    "Block",
    "BlockDiscoveryError",
    "BudgetError",
    "CacheRefused",
    "CachedPrefix",
    "CheckpointError",
    "ConfigError",
    "EmptyParameterError",
    "StrategyError",
    "Decision",
    "FreezeDDP",
    "Freezer",
    "FrozenDifferentiable",
    "FrozenModule",
    "FrozenPipeline",
    "GlobalRNGUsedError",
    "MemoryLedger",
    "MemoryPlan",
    "ModelSplit",
    "NonFiniteOutputError",
    "PrecomputeRefused",
    "PrecomputedDataset",
    "PredictorError",
    "RunFileError",
    "StabilityGuard",
    "Stage",
    "StageContext",
    "Strategy",
    "UnknownStrategyError",
    "UserError",
    "__version__",
    "block_param_groups",
    "open_freezer",
    "call",
    "close_distributed",
    "create_strategy",
    "describe_blocks",
    "discover_blocks",
    "find_blocks",
    "init_distributed",
    "load_checkpoint",
    "load_full_checkpoint",
    "make_blocks",
    "module_entry",
    "parse_budget",
    "per_sample_generators",
    "plan_memory",
    "precompute",
    "qualified_names",
    "register_blocks",
    "register_split",
    "register_strategy",
    "release_earlier_freezers",
    "save_checkpoint",
    "save_full_checkpoint",
    "shard_blocks",
    "split_for",
]
