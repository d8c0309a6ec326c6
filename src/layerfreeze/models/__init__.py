"""A model as an ordered list of blocks, and its forward cut at a block boundary.

* :mod:`~layerfreeze.models.blocks` -- the vocabulary: :class:`Block`, patterns, tied weights, the helpers a family
  builds its blocks with (:func:`make_blocks`, :func:`module_entry`, :func:`qualified_names`, :func:`head_entry`);
* :mod:`~layerfreeze.models.forward_split` -- :class:`ModelSplit`: a model's forward replayed as stages, so the
  frozen prefix's output can be cached and fed to the first trainable block;
* :mod:`~layerfreeze.models.registry` -- :func:`register_blocks` / :func:`register_split`, what a family file
  decorates;
* :mod:`~layerfreeze.models.families` -- one file per model family (Hugging Face, torchvision, timm,
  ``nn.Sequential``, the generic fallback);
* :mod:`~layerfreeze.models.discovery` -- :func:`discover_blocks` / :func:`split_for`: the one place that asks the
  registered families;
* :mod:`~layerfreeze.models.probe` -- block outputs on a probe batch (the oracle, the SmartFRZ collector, Egeria).

Add a model family: the README's "Add your own model family", with the names imported from here.
"""

from layerfreeze.errors import BlockDiscoveryError
from layerfreeze.models.blocks import (
    Block,
    Discovery,
    describe_blocks,
    has_params,
    head_entry,
    make_blocks,
    module_entry,
    output_tensor,
    qualified_names,
    unassigned_parameters,
)
from layerfreeze.models.discovery import discover_blocks, find_blocks, split_for
from layerfreeze.models.forward_split import ModelSplit, Stage, call, exact_forward
from layerfreeze.models.probe import block_modules, eval_mode, probe_outputs
from layerfreeze.models.registry import register_blocks, register_split, unregister

__all__ = [
    "Block",
    "BlockDiscoveryError",
    "Discovery",
    "ModelSplit",
    "Stage",
    "block_modules",
    "call",
    "describe_blocks",
    "discover_blocks",
    "eval_mode",
    "exact_forward",
    "find_blocks",
    "has_params",
    "head_entry",
    "make_blocks",
    "module_entry",
    "output_tensor",
    "probe_outputs",
    "qualified_names",
    "register_blocks",
    "register_split",
    "split_for",
    "unassigned_parameters",
    "unregister",
]
