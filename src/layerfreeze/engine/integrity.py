"""Checks that a freeze stays a freeze and that training does what the frozen set says.

Three silent faults this module turns into warnings or errors (each seen in real training code):

* **A re-wrapped frozen parameter.** ``block.weight = nn.Parameter(block.weight.data)`` (dtype or quantization
  conversions, some loaders, weight tying done late) creates a new ``Parameter`` with ``requires_grad=True``: the
  frozen block silently gets gradients again and backward runs through the whole prefix. :meth:`FrozenSet.check`
  (every optimizer step, O(parameters), no tensor work) finds every frozen block's parameter that is not the object
  frozen, requires grad, or is in the optimizer, re-freezes it and warns naming it (or raises, by option).
* **A frozen weight that moved** (an in-place update outside the optimizer, a loader, a bug): a checksum of each
  frozen block (BLAKE2b of its parameters' bytes) is taken when it freezes and verified by
  :meth:`FrozenSet.verify_checksums` (the trainer calls it at every checkpoint and at the end of the run):
  :class:`FrozenWeightsChangedError` names the block and the parameter. For a demoted block
  (:mod:`layerfreeze.engine.demote`) the checksum covers what is kept, the float32 master copy a thaw restores, and
  the demoted weights in use must be exactly its cast.
* **A trainable block that gets no gradient**: after each change of the frozen set, the first backward is checked
  (:meth:`FrozenSet.check_gradients`); a trainable block none of whose parameters got a gradient is a warning naming
  it and the usual causes (an input computed under ``no_grad`` or detached; reentrant gradient checkpointing whose
  input does not require grad because the prefix before it is frozen, transformers #21381; an unused module).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


class FrozenWeightsChangedError(RuntimeError):
    """A frozen block's weights differ from their checksum taken when it froze."""


class UnfrozenParameterError(RuntimeError):
    """A frozen block's parameter was replaced or made trainable again (raised when ``on_unfrozen="error"``)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor's local data (a DTensor's shard under FSDP2), on the CPU, as raw bytes."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.detach().reshape(-1).contiguous().cpu().view(torch.uint8)


def checksum(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """``{name: BLAKE2b-128 hex digest of the tensor's bytes}`` (bitwise: any change of any element changes it)."""
    return {name: hashlib.blake2b(_local(t).numpy().tobytes(), digest_size=16).hexdigest() for name, t in named}


class FrozenSet:
    """What each frozen block froze (the parameter objects and their checksums), for the checks above.

    Args:
        on_unfrozen: ``"warn"`` (re-freeze and warn) or ``"error"`` (raise :class:`UnfrozenParameterError`).
        warn: Where warnings go: ``warn(message, record)`` (the Freezer sends them to ``warnings`` and its
            ``on_event`` callback, so the CLI logs them as events).

    Raises:
        ValueError: an unknown ``on_unfrozen``.
    """

    def __init__(self, on_unfrozen: str = "warn",
                 warn: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        if on_unfrozen not in ("warn", "error"):
            raise ValueError(f"on_unfrozen must be 'warn' or 'error', got {on_unfrozen!r}")
        self.on_unfrozen = on_unfrozen
        self._warn = warn or (lambda message, record: warnings.warn(message, stacklevel=3))
        self.params: dict[int, dict[str, nn.Parameter]] = {}  # block index -> name -> the frozen object
        self.checksums: dict[int, dict[str, str]] = {}
        self.gradients_pending = True  # check the next backward (the run starts with a new frozen set)

    def on_freeze(self, index: int, named: list[tuple[str, nn.Parameter]]) -> None:
        self.params[index] = dict(named)
        self.checksums[index] = checksum(named)
        self.gradients_pending = True

    def on_thaw(self, index: int) -> None:
        self.params.pop(index, None)
        self.checksums.pop(index, None)
        self.gradients_pending = True

    def check(self, freezer: Any) -> list[str]:
        """Re-freeze every frozen block's parameter that was replaced, made trainable or put back in the optimizer.

        Returns:
            The names of the parameters re-frozen.

        Raises:
            UnfrozenParameterError: with ``on_unfrozen="error"``.
        """
        in_optimizer = ({id(p) for g in freezer.optimizer.param_groups for p in g["params"]}
                        if freezer.optimizer is not None else set())
        fixed = []
        for index, frozen in self.params.items():
            block = freezer.blocks[index]
            for name, p in freezer.named_frozen_parameters(block):
                old = frozen.get(name)
                if old is p and not p.requires_grad and id(p) not in in_optimizer:
                    continue
                what = ("was replaced by a new Parameter" if old is not p else
                        "requires grad again" if p.requires_grad else "is back in the optimizer")
                message = (f"parameter {name!r} of frozen block {block.name!r} {what}: it would train (and "
                           "backward would run through the frozen prefix)")
                if self.on_unfrozen == "error":
                    raise UnfrozenParameterError(message + "; freeze it again after replacing it, or thaw the block")
                freezer.refreeze_parameter(p, old)
                frozen[name] = p
                fixed.append(name)
                self._warn(message + "; re-frozen", {"kind": "refrozen", "block": block.name, "parameter": name,
                                                     "cause": what})
        return fixed

    def verify_checksums(self, freezer: Any) -> None:
        """Compare every frozen block's weights with their checksum from freeze time (bitwise).

        Raises:
            FrozenWeightsChangedError: naming the block and the parameters that moved.
        """
        for index, expected in self.checksums.items():
            block = freezer.blocks[index]
            kept = getattr(freezer, "kept_frozen_parameters", freezer.named_frozen_parameters)
            now = checksum(kept(block))
            moved = sorted(n for n in expected if now.get(n) != expected[n])
            mismatched = getattr(freezer, "demotion_mismatches", lambda b: [])(block)
            if mismatched:
                raise FrozenWeightsChangedError(
                    f"demoted frozen block {block.name!r}: the weights in use ({', '.join(mismatched)}) are not the "
                    "cast of its float32 master copy: something wrote into the demoted weights")
            if moved:
                raise FrozenWeightsChangedError(
                    f"frozen block {block.name!r} changed since it froze (parameters {', '.join(moved)}): something "
                    "updated it outside the optimizer (an in-place write, a loader, a second optimizer). Its "
                    "checkpoint would not hold the weights that were trained against")

    def check_gradients(self, freezer: Any) -> list[str]:
        """After the first backward since the frozen set changed: the trainable blocks that got no gradient.

        Returns:
            Their names (each also warned about); empty when every trainable block got one or no check was due.
        """
        if not self.gradients_pending:
            return []
        self.gradients_pending = False
        missing = []
        for block in freezer.blocks:
            if freezer.frozen[block.index]:
                continue
            trainable = [p for p in block.parameters() if p.requires_grad]
            if trainable and all(p.grad is None for p in trainable):
                missing.append(block.name)
        if missing:
            prefix = freezer.frozen_prefix
            cause = ("its input was computed under no_grad or detached, the block is unused in the forward, or "
                     "reentrant gradient checkpointing (use_reentrant=True) got an input that does not require grad")
            if prefix:
                cause += (f" (the frozen prefix of {prefix} block(s) in front of it makes that input not require "
                          "grad: use use_reentrant=False or make the first trainable block's input require grad)")
            self._warn(f"trainable block(s) {', '.join(missing)} got no gradient in the first backward since the "
                       f"frozen set changed; likely cause: {cause}", {"kind": "no_gradient", "blocks": missing})
        return missing

    def state_dict(self) -> dict[str, Any]:
        return {str(i): dict(c) for i, c in self.checksums.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the saved checksums (the weights at freeze time), for blocks frozen in this run too."""
        for key, sums in state.items():
            if int(key) in self.checksums:
                self.checksums[int(key)] = dict(sums)
