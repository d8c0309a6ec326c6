"""layerfreeze: make training cheaper by freezing parts of the network as it trains.

The pieces, one module per concern:

* :mod:`layerfreeze.blocks` — a model as an ordered list of blocks (discovery, patterns);
* :mod:`layerfreeze.engine` — the mechanics (freeze, thaw, optimizer surgery) and :class:`Freezer`;
* :mod:`layerfreeze.strategies` — the policies, one file each, registered by name;
* :mod:`layerfreeze.checkpoint` — resumable checkpoints carrying the freeze state;
* :mod:`layerfreeze.telemetry` — metrics.jsonl, TensorBoard, measured FLOPs, memory, the summary table;
* :mod:`layerfreeze.integrations` — Lightning and Hugging Face Trainer callbacks (extras ``lightning``, ``hf``);
* :mod:`layerfreeze.trainer`, :mod:`layerfreeze.config`, :mod:`layerfreeze.cli` — the ``layerfreeze train`` CLI.
"""

from .blocks import Block, BlockDiscoveryError, describe_blocks, discover_blocks
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .engine import Freezer, block_param_groups
from .strategies import Decision, StageContext, Strategy, UnknownStrategyError, create_strategy

__version__ = "0.1.0"

__all__ = [
    "Block",
    "BlockDiscoveryError",
    "CheckpointError",
    "Decision",
    "Freezer",
    "StageContext",
    "Strategy",
    "UnknownStrategyError",
    "block_param_groups",
    "create_strategy",
    "describe_blocks",
    "discover_blocks",
    "load_checkpoint",
    "save_checkpoint",
]
