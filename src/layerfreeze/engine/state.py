"""The Freezer's checkpointable state: what :meth:`~layerfreeze.engine.freezer.Freezer.state_dict` saves and how
:meth:`~layerfreeze.engine.freezer.Freezer.load_state_dict` resumes it.

The state is a plain dict (version :data:`STATE_VERSION`): the blocks' names and frozen set, the counters (step,
epoch, backward calls), the history of freezes and thaws, the strategy's name and state, the gradients summed since
the last stage (``grad_sums``: :meth:`~layerfreeze.engine.grad_signal.GradientSums.state_dict`, tensors; whole under
FSDP2 with ``full=True``), the LR factors and what they wrote (:mod:`layerfreeze.engine.lr_factors`), the stability
guard's state, the frozen-weight checksums (:mod:`layerfreeze.engine.integrity`), the demotion settings, the floor,
and, with an optimizer, each param group's parameters and each parameter's group of origin, by name. A resume
re-freezes and thaws blocks to match, rebuilds the param groups so ``optimizer.load_state_dict`` of the saved run
fits (:mod:`layerfreeze.checkpoint` calls it first), and refuses a state from another version, model, strategy or
demotion. The functions take the :class:`~layerfreeze.engine.freezer.Freezer` whose state they read or restore.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from layerfreeze.distributed import comm
from layerfreeze.engine import optimizer_load
from layerfreeze.engine.mechanics import frozen_by_user
from layerfreeze.engine.optim import load_param_groups
from layerfreeze.engine.sharding import sharded
from layerfreeze.engine.stages import prepare_grad_sums, sums_gradients

if TYPE_CHECKING:  # a Freezer's state; the Freezer calls these, never the other way round
    from torch import nn

    from layerfreeze.engine.freezer import Freezer

STATE_VERSION = 1
_OUTSIDE = "<outside the model: "


def state_dict(freezer: Freezer, full: bool = False) -> dict[str, Any]:
    """``freezer``'s state (module docstring); see :meth:`~layerfreeze.engine.freezer.Freezer.state_dict`.

    Args:
        full: Gather the gradient sums' shards whole (FSDP2; a collective: every rank calls it).
    """
    sums = freezer._grad_sums
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "blocks": [b.name for b in freezer.blocks],
        "frozen": list(freezer.frozen),
        "step": freezer.step_count,
        "epoch": freezer.epoch,
        "history": list(freezer.history),
        "strategy": {"name": freezer.strategy.name, "state": freezer.strategy.state_dict()},
        "grad_sums": sums.full_state_dict() if full else sums.state_dict(),  # copies to the host (a checkpoint)
        "backward_calls": freezer._backward_calls,
        "train_bn": freezer.train_bn,
        "lr_scale": dict(freezer._lr_scale),
        "lr_written": dict(freezer._lr_written),
        "guard": freezer.guard.state_dict() if freezer.guard is not None else None,
        "frozen_checksums": freezer.integrity.state_dict(),
        "frozen_dtypes": freezer.integrity.dtypes_state_dict(),
        "demote": freezer.demoter.spec.to_dict() if freezer.demoter is not None else None,
        "floor": freezer.floor,
        "user_frozen": user_frozen(freezer),
    }
    if freezer.optimizer is not None:
        names = {id(p): n for n, p in _named(freezer).items()}
        state["param_groups"] = [[names[id(p)] for p in g["params"]] for g in freezer.optimizer.param_groups]
        state["origin"] = {names[i]: gi for i, gi in freezer._origin.items() if i in names}
        state["outside"] = _outside(freezer)
    return state


def _outside(freezer: Freezer) -> dict[str, list[Any]]:
    """``{name: [shape, dtype]}`` of the optimizer's parameters outside the model (:func:`_named`): what a resume
    compares, since they are matched by place only."""
    return {n: [list(p.shape), str(p.dtype)] for n, p in _named(freezer).items() if n.startswith(_OUTSIDE)}


def _named(freezer: Freezer) -> dict[str, nn.Parameter]:
    """Every parameter the model or the optimizer holds, by name: the model's own names (read now: a parameter
    replaced or added since the Freezer was built has one too), and for one the optimizer holds outside the model (a
    loss's temperature, a CLIP logit scale) ``"<outside the model: param group G, #K>"``, K counting those of group G
    in order. Those never freeze, so a resumed run's optimizer, built the same way, holds them at the same places."""
    named = dict(freezer.model.named_parameters())
    if freezer.optimizer is not None:
        mine = {id(p) for p in named.values()}
        for gi, group in enumerate(freezer.optimizer.param_groups):
            outside = [p for p in group["params"] if id(p) not in mine]
            named.update((f"{_OUTSIDE}param group {gi}, #{k}>", p) for k, p in enumerate(outside))
    return named


def _held(demote: dict[str, Any] | None) -> dict[str, Any] | None:
    """A demotion's settings that decide the frozen blocks' weights: its ``master`` (memory or disk: where the
    float32 copies wait, restored bitwise either way) left out."""
    return None if demote is None else {k: v for k, v in demote.items() if k != "master"}


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
    if _held(state.get("demote")) != _held(mine):  # where the master copies wait changes no weight
        raise ValueError(f"Checkpoint was written with demote={state.get('demote')!r}, this run has "
                         f"demote={mine!r}; resume with the same demotion (freeze.demote) so frozen blocks hold "
                         "the same weights")
    sharded(freezer._fsdp)
    loaded = optimizer_load.loaded_places(freezer)  # an optimizer state loaded first: kept, not cleared (its module)
    freezer._floor |= {int(i) for i in state.get("floor", [])}
    _load_user_frozen(freezer, state.get("user_frozen", []))
    freezer._in_stage = True  # the saved frozen set, applied block by block: "nothing trains" would see it half done
    try:
        for block, frozen in zip(freezer.blocks, state["frozen"]):
            if (frozen or block.index in freezer._floor) and not freezer.frozen[block.index]:
                freezer.freeze(block.index, reason="resume")
            elif not frozen and freezer.frozen[block.index] and block.index not in freezer._floor:
                freezer.thaw(block.index, reason="resume")
    finally:
        freezer._in_stage = False
    if freezer.optimizer is not None and "param_groups" in state:
        by_name = _named(freezer)
        saved, now = state.get("outside"), _outside(freezer)
        if saved is not None and saved != now:
            raise ValueError(
                f"the optimizer's parameters outside the model (matched by param group and place) differ from the "
                f"checkpoint's: saved {saved}, this run {now}; build the optimizer as the saved run did, its outside "
                "parameters in the same groups and order")
        load_param_groups(freezer.optimizer, state["param_groups"], by_name)
        optimizer_load.carry_over(freezer.optimizer, loaded, state["param_groups"], by_name)
        freezer._origin = {id(by_name[n]): gi for n, gi in state["origin"].items()}
    freezer.integrity.load_state_dict(state.get("frozen_checksums", {}), state.get("frozen_dtypes"))
    freezer.step_count = state["step"]
    freezer.epoch = state["epoch"]
    freezer._epoch_started = freezer.step_count  # (steps.warn_missing_epoch_end: counted from here)
    freezer.history = list(state["history"])
    _load_grad_sums(freezer, state)
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


def user_frozen(freezer: Freezer) -> list[str]:
    """Names of the parameters the user has frozen now (:func:`~layerfreeze.engine.mechanics.frozen_by_user`: before
    the Freezer, by hand since, or kept as the user's from an earlier Freezer), whatever their block."""
    return sorted(n for n, p in freezer.model.named_parameters() if frozen_by_user(p))


def _load_user_frozen(freezer: Freezer, names: list[str]) -> None:
    """What the user had frozen in the saved run (before its Freezer, or by hand since) stays frozen through this
    one's thaws, and is frozen now: one frozen by hand in the middle of the run is not frozen again by the resumed
    script, which starts past that point."""
    params = dict(freezer.model.named_parameters())
    for name in names:
        if name in params:
            freezer._frozen_before.add(id(params[name]))
            params[name].requires_grad_(False)


def _load_grad_sums(freezer: Freezer, state: dict[str, Any]) -> None:
    """Restore the gradients summed since the last stage (on the ranks that sum them: rank 0, every rank under
    FSDP2). A state saved before the sums were kept as tensors (``grad_l1``, per-block floats) cannot continue the
    interval: its signal starts over, with a warning when it held anything."""
    sums = state.get("grad_sums", {})
    if "grad_sums" not in state and any(state.get("grad_l1") or []) and "grad_l1" in freezer.strategy.signals:
        warnings.warn(
            f"this checkpoint keeps the gradient signal as per-block sums of norms (written by an older layerfreeze);"
            f" {freezer.strategy.name}'s signal of the interval in progress starts over at step {state['step']}, so "
            "its next decision may differ from the uninterrupted run's", stacklevel=4)
    if sums_gradients(freezer):
        freezer._grad_sums.load_state_dict(sums)
        prepare_grad_sums(freezer)
