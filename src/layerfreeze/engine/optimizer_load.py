"""A resume whose ``optimizer.load_state_dict`` ran before ``freezer.load_state_dict``: watched, so that the loaded
optimizer state is kept on the parameters it belongs to, or the load refused with what to do.

The documented order is the Freezer's state first (it rebuilds the param groups to the saved frozen set), then the
optimizer's. ``torch.optim`` matches a loaded state to parameters by place: state ``k`` of group ``g`` goes to the
parameter now at place ``k`` of group ``g``. Loaded the other way round:

* when the saved groups have other sizes than the fresh optimizer's (the saved run had frozen or thawed blocks since
  its start stage), torch refused with "loaded state dict contains a parameter group that doesn't match the size of
  optimizer's group", which names neither the Freezer nor the order (:func:`watch`'s pre-hook says both now);
* when the sizes matched (the same frozen set, or blocks of equal size in one group), the Freezer's restore cleared
  the optimizer state it rebuilt the groups around (:func:`~layerfreeze.engine.optim.load_param_groups`): the resumed
  run went on from zero Adam moments and momentum, in silence. The post-hook records which parameter held each place
  when the state was loaded; the Freezer's restore gives each saved name the state loaded at its saved place
  (:func:`carry_over`), so the run resumes as if the documented order had been kept;
* when the optimizer's state was loaded before the Freezer was even built (model, optimizer, their states, then the
  Freezer and its state), the Freezer's start stage freed the state of what it froze and its restore cleared the
  rest: the same silent loss. What the optimizer holds when the Freezer is built is kept by parameter
  (:func:`hold`) and given back to the parameters the restored groups hold (:func:`carry_over`), until the first
  step.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from layerfreeze.engine.optim import inner_optimizer

if TYPE_CHECKING:
    import torch
    from torch import nn

    from layerfreeze.engine.freezer import Freezer


class OptimizerLoads:
    """The hooks on a Freezer's optimizer's ``load_state_dict``, and the places of its last load."""

    def __init__(self, freezer: Freezer, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        #: The parameters each group held, in order, when the optimizer's state was loaded (None: no load since the
        #: last step, or since the Freezer's own restore).
        self.places: list[list[nn.Parameter]] | None = None
        ref = weakref.ref(freezer)  # the optimizer does not keep the Freezer alive

        def before(optimizer: Any, state_dict: dict[str, Any]) -> None:
            owner = ref()
            if owner is not None and not owner.closed:
                refuse_other_sizes(optimizer, state_dict)

        def after(optimizer: Any) -> None:
            self.places = [list(g["params"]) for g in optimizer.param_groups]

        self._handles = [optimizer.register_load_state_dict_pre_hook(before),
                         optimizer.register_load_state_dict_post_hook(after)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.places = None


def refuse_other_sizes(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Refuse an optimizer state whose param groups do not fit this optimizer's, saying why a Freezer makes them
    differ and what order fits (torch's own message named neither).

    Raises:
        ValueError: another number of param groups, or of parameters in a group.
    """
    saved = state_dict.get("param_groups")
    if not isinstance(saved, list):
        return
    now = [len(g["params"]) for g in optimizer.param_groups]
    then = [len(g.get("params", ())) for g in saved]
    if now == then:
        return
    where = (f"{len(then)} param groups in the state dict, {len(now)} in this optimizer" if len(now) != len(then)
             else "; ".join(f"param group {gi} holds {b} parameters in the state dict, {a} here"
                            for gi, (a, b) in enumerate(zip(now, then)) if a != b))
    raise ValueError(
        f"optimizer.load_state_dict: the saved param groups do not fit this optimizer's ({where}). A Freezer takes "
        "frozen blocks' parameters out of the param groups, so the saved groups fit only once the saved frozen set is "
        "restored: call freezer.load_state_dict(saved_freezer_state) first, then optimizer.load_state_dict "
        "(layerfreeze.load_checkpoint does both in that order); if that was done, build the optimizer as the saved "
        "run did")


def watch(freezer: Freezer) -> None:
    """Hook the load of ``freezer``'s optimizer (a previous watch is removed; none without an optimizer, or one
    without load hooks: a framework's wrapper is looked through, :func:`~layerfreeze.engine.optim.inner_optimizer`)."""
    unwatch(freezer)
    optimizer = inner_optimizer(freezer.optimizer) if freezer.optimizer is not None else None
    if optimizer is not None and hasattr(optimizer, "register_load_state_dict_post_hook"):
        freezer._loads = OptimizerLoads(freezer, optimizer)


def unwatch(freezer: Freezer) -> None:
    """Remove :func:`watch`'s hooks (``Freezer.close``)."""
    loads = getattr(freezer, "_loads", None)
    if loads is not None:
        loads.remove()
        freezer._loads = None


def hold(freezer: Freezer) -> None:
    """Keep, by parameter, the state ``freezer``'s optimizer holds as the Freezer is built, before its start stage
    frees that of the blocks it freezes: a state loaded before the Freezer, which its restore would clear."""
    optimizer = inner_optimizer(freezer.optimizer) if freezer.optimizer is not None else None
    freezer._held = dict(optimizer.state) if optimizer is not None and len(optimizer.state) else None


def forget(freezer: Freezer) -> None:
    """An optimizer step ran (``Freezer.step``): the state is the optimizer's own from now on, held by the parameters
    themselves, not by the places of a load or as it was when the Freezer was built."""
    loads = getattr(freezer, "_loads", None)
    if loads is not None:
        loads.places = None
    freezer._held = None


def loaded_places(freezer: Freezer) -> tuple[list[list[nn.Parameter]] | None, dict[Any, Any]] | None:
    """When the optimizer's state was loaded since the last step and its groups still hold the parameters they held
    then, in the same order: those places and the state (by parameter), taken before the Freezer's restore changes
    either; else, before the first step, ``(None, the state held when the Freezer was built)`` (:func:`hold`); None
    otherwise. Each record is used once."""
    held, freezer._held = getattr(freezer, "_held", None), None
    loads = getattr(freezer, "_loads", None)
    if loads is None or loads.places is None:
        return None if held is None else (None, held)
    places, loads.places = loads.places, None
    now = [list(g["params"]) for g in loads.optimizer.param_groups]
    if len(now) != len(places) or any(len(a) != len(b) or any(p is not q for p, q in zip(a, b))
                                      for a, b in zip(now, places)):
        return None if held is None else (None, held)
    return places, dict(loads.optimizer.state)


def carry_over(optimizer: torch.optim.Optimizer,
               loaded: tuple[list[list[nn.Parameter]] | None, dict[Any, Any]] | None,
               saved: list[list[str]], by_name: dict[str, nn.Parameter]) -> None:
    """After the Freezer's restore rebuilt the param groups (``saved``: each group's parameter names at the save),
    give each saved name the state torch loaded at its place (``loaded``, :func:`loaded_places`), or each parameter the
    groups hold the state it held when the Freezer was built."""
    if loaded is None:
        return
    places, state = loaded
    if places is None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p in state:
                    optimizer.state[p] = state[p]
        return
    for group, names in zip(places, saved):
        if len(group) == len(names):
            for p, name in zip(group, names):
                if p in state and name in by_name:
                    optimizer.state[by_name[name]] = state[p]
