"""The freezing engine: strategies decide, the engine applies (:class:`Freezer`).

The folder's map: one mechanism per module, top to bottom; each imports only modules below it (the contract
``engine-layers`` in pyproject.toml). "Anyone" means code outside the engine too (names in an ``__all__``).

* ``freezer`` -- :class:`Freezer`, the facade (freeze, thaw, the floor, the loop's hooks); anyone.
* ``steps`` -- a step's bookkeeping: after_backward / step / epoch_end (integrity checks), the optimizer hook that
  sums grad_l1; only freezer.py.
* ``state`` -- the checkpointable state: state_dict / load_state_dict, STATE_VERSION; only freezer.py.
* ``freezing`` -- a block's freeze and thaw wired to the Freezer's optimizer, hooks, checks and demotion, and what
  freezing does and why; only freezer.py (PinnedBlockError: anyone).
* ``arguments`` -- a Freezer's arguments checked and its blocks and strategy resolved, before anything changes; only
  freezer.py.
* ``attach`` -- an optimizer given after the Freezer was built (attach_optimizer), checked before anything changes;
  only freezer.py.
* ``takeover`` -- a new Freezer on a model an earlier one froze (closed, or deep-copied with it): what it left frozen
  trains again; freezer.py, attach.py.
* ``stages`` -- a stage: context, admissible decisions, rank 0's shared (share_decision: anyone); freezer.py, steps.py.
* ``lr_factors`` -- per-block LRs: the strategies' LR factors, a thaw's LR and its checks; freezer.py, steps.py,
  stages.py.
* ``sharding`` -- the FSDP2 wiring: reshard, parameter checks, the mirror; freezer.py, steps.py, state.py.
* ``demote`` -- the Demoter: demoted weights, master copies, offload, hooks; freezer.py (its ``__all__``: anyone).
* ``demotion`` -- the demotion spec: Demotion, DemotedWeightsError, the casts; demote.py, freezer.py.
* ``guard`` -- :class:`StabilityGuard`, thawing a freeze that hurt validation; anyone.
* ``integrity`` -- the frozen set stays frozen (checksums), trainable blocks get gradients; anyone.
* ``mechanics`` -- the stateless freeze mechanics (:func:`frozen_parameters`, :func:`set_eval_mode`, the parameters
  frozen before the Freezer); anyone.
* ``optim`` -- the optimizer surgery: frozen parameters out of the param groups and back, one group per block; anyone.
* ``grad_signal`` -- GradientSums: the grad_l1 signal, gradients summed on the device, read once per stage; freezer.py,
  steps.py, stages.py, budget.plan.
* ``timing`` -- StepTimes: step intervals with and without a stage, for the strategies' cadence; freezer.py, steps.py.
* ``params`` -- BlockParams: each block's parameters walked once per structure change (torch's registration hooks);
  freezer.py, integrity.py.
"""

from layerfreeze.engine.freezer import Freezer, release_earlier_freezers
from layerfreeze.engine.freezing import PinnedBlockError
from layerfreeze.engine.guard import StabilityGuard
from layerfreeze.engine.integrity import (
    BlockModuleReplacedError,
    FrozenWeightsChangedError,
    RanksDivergedError,
    UnfrozenParameterError,
)
from layerfreeze.engine.mechanics import frozen_parameters, open_freezer, set_eval_mode
from layerfreeze.engine.optim import block_param_groups
from layerfreeze.engine.stages import share_decision

__all__ = [
    "BlockModuleReplacedError",
    "Freezer",
    "FrozenWeightsChangedError",
    "RanksDivergedError",
    "PinnedBlockError",
    "StabilityGuard",
    "UnfrozenParameterError",
    "block_param_groups",
    "frozen_parameters",
    "open_freezer",
    "release_earlier_freezers",
    "set_eval_mode",
    "share_decision",
]
