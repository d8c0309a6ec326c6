"""The freezing engine: strategies decide, the engine applies (:class:`Freezer`).

* :mod:`~layerfreeze.engine.freezer` -- :class:`Freezer` (freeze/thaw, stages, LR factors, checkpointable state, rank
  0's decisions shared with every rank, a floor of blocks that stay frozen: :class:`PinnedBlockError`);
* :mod:`~layerfreeze.engine.mechanics` -- the stateless mechanics it is made of (:func:`frozen_parameters`,
  :func:`set_eval_mode`);
* :mod:`~layerfreeze.engine.optim` -- the optimizer surgery: one param group per block
  (:func:`block_param_groups`), frozen parameters out of the param groups (state freed) and back;
* :mod:`~layerfreeze.engine.guard` -- :class:`StabilityGuard`, thawing a freeze that hurt validation;
* :mod:`~layerfreeze.engine.integrity` -- the frozen set stays frozen (re-wrapped parameters, checksums), every
  trainable block gets a gradient.
"""

from layerfreeze.engine.freezer import Freezer, PinnedBlockError, share_decision
from layerfreeze.engine.guard import StabilityGuard
from layerfreeze.engine.integrity import FrozenWeightsChangedError, UnfrozenParameterError
from layerfreeze.engine.mechanics import frozen_parameters, set_eval_mode
from layerfreeze.engine.optim import block_param_groups

__all__ = [
    "Freezer",
    "FrozenWeightsChangedError",
    "PinnedBlockError",
    "StabilityGuard",
    "UnfrozenParameterError",
    "block_param_groups",
    "frozen_parameters",
    "set_eval_mode",
    "share_decision",
]
