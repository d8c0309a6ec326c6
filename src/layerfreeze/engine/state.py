"""The Freezer's checkpointable state: what :meth:`~layerfreeze.engine.freezer.Freezer.state_dict` saves and how
:meth:`~layerfreeze.engine.freezer.Freezer.load_state_dict` resumes it.

The state is a plain dict (version :data:`STATE_VERSION`): the blocks' names and frozen set, the counters (step,
epoch, backward calls), the history of freezes and thaws, the strategy's name and state, the gradient signals summed
since the last stage, the LR factors and what they wrote (:mod:`layerfreeze.engine.lr_factors`), the stability
guard's state, the frozen-weight checksums (:mod:`layerfreeze.engine.integrity`), the demotion settings, the floor,
and, with an optimizer, each param group's parameters and each parameter's group of origin, by name. A resume
re-freezes and thaws blocks to match, rebuilds the param groups so ``optimizer.load_state_dict`` of the saved run
fits (:mod:`layerfreeze.checkpoint` calls it first), and refuses a state from another version, model, strategy or
demotion. The functions take the :class:`~layerfreeze.engine.freezer.Freezer` whose state they read or restore.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from layerfreeze.distributed import comm
from layerfreeze.engine.optim import load_param_groups
from layerfreeze.engine.sharding import sharded

if TYPE_CHECKING:  # a Freezer's state; the Freezer calls these, never the other way round
    from layerfreeze.engine.freezer import Freezer

STATE_VERSION = 1


def state_dict(freezer: Freezer) -> dict[str, Any]:
    """``freezer``'s state (module docstring); see :meth:`~layerfreeze.engine.freezer.Freezer.state_dict`."""
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "blocks": [b.name for b in freezer.blocks],
        "frozen": list(freezer.frozen),
        "step": freezer.step_count,
        "epoch": freezer.epoch,
        "history": list(freezer.history),
        "strategy": {"name": freezer.strategy.name, "state": freezer.strategy.state_dict()},
        "grad_l1": freezer._grad_sums.values(),  # a copy to the host (a checkpoint)
        "backward_calls": freezer._backward_calls,
        "train_bn": freezer.train_bn,
        "lr_scale": dict(freezer._lr_scale),
        "lr_written": dict(freezer._lr_written),
        "guard": freezer.guard.state_dict() if freezer.guard is not None else None,
        "frozen_checksums": freezer.integrity.state_dict(),
        "demote": freezer.demoter.spec.to_dict() if freezer.demoter is not None else None,
        "floor": freezer.floor,
    }
    if freezer.optimizer is not None:
        state["param_groups"] = [[freezer._names[id(p)] for p in g["params"]]
                                 for g in freezer.optimizer.param_groups]
        state["origin"] = {freezer._names[i]: gi for i, gi in freezer._origin.items() if i in freezer._names}
    return state


def load_state_dict(freezer: Freezer, state: dict[str, Any]) -> None:
    """Restore :func:`state_dict` into ``freezer``; see :meth:`~layerfreeze.engine.freezer.Freezer.load_state_dict`.

    Raises:
        ValueError: the state is from another version, another set of blocks, another strategy, another demotion,
            or an optimizer with a different number of param groups.
    """
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"Freezer state version {state.get('version')!r} != {STATE_VERSION}; cannot resume it")
    names = [b.name for b in freezer.blocks]
    if state["blocks"] != names:
        raise ValueError(f"Checkpoint blocks {state['blocks']} do not match this model's blocks {names}")
    if state["strategy"]["name"] != freezer.strategy.name:
        raise ValueError(
            f"Checkpoint was written by strategy {state['strategy']['name']!r}, this run uses "
            f"{freezer.strategy.name!r}; resume with the same strategy"
        )
    freezer.train_bn = state.get("train_bn", freezer.train_bn)
    mine = freezer.demoter.spec.to_dict() if freezer.demoter is not None else None
    if state.get("demote") != mine:
        raise ValueError(f"Checkpoint was written with demote={state.get('demote')!r}, this run has "
                         f"demote={mine!r}; resume with the same demotion (freeze.demote) so frozen blocks hold "
                         "the same weights")
    sharded(freezer._fsdp)
    freezer._floor |= {int(i) for i in state.get("floor", [])}
    for block, frozen in zip(freezer.blocks, state["frozen"]):
        if (frozen or block.index in freezer._floor) and not freezer.frozen[block.index]:
            freezer.freeze(block.index, reason="resume")
        elif not frozen and freezer.frozen[block.index] and block.index not in freezer._floor:
            freezer.thaw(block.index, reason="resume")
    if freezer.optimizer is not None and "param_groups" in state:
        by_name = dict(freezer.model.named_parameters())
        load_param_groups(freezer.optimizer, state["param_groups"], by_name)
        freezer._origin = {id(by_name[n]): gi for n, gi in state["origin"].items()}
    freezer.integrity.load_state_dict(state.get("frozen_checksums", {}))
    freezer.step_count = state["step"]
    freezer.epoch = state["epoch"]
    freezer.history = list(state["history"])
    freezer._grad_sums.reset(state["grad_l1"])
    freezer._backward_calls = state["backward_calls"]
    freezer._lr_scale = {int(k): v for k, v in state["lr_scale"].items()}
    freezer._lr_written = {int(k): tuple(v) for k, v in state["lr_written"].items()}
    freezer._step_times.restart()
    if freezer._mirror is not None:  # the strategy's state may be rebuilt from the weights (egeria): the loaded ones
        freezer._mirror.refresh()
    if freezer.decides:
        freezer.strategy.load_state_dict(state["strategy"]["state"])
    if freezer.guard is not None and state.get("guard") is not None:
        freezer.guard.load_state_dict(state["guard"])
    if freezer.distributed:  # the stage cadence may come from the strategy's state (smartfrz): take rank 0's
        freezer.strategy.stage_every, freezer.strategy.at_epoch_end = comm.broadcast_object(
            (freezer.strategy.stage_every, freezer.strategy.at_epoch_end))
