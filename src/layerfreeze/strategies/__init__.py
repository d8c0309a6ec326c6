"""Freezing strategies, registered by name (``create_strategy("static", k=5)``).

One file per strategy; each cites its source in its docstring.
"""

from __future__ import annotations

import inspect
from typing import Any

from .base import BlockView, Decision, StageContext, Strategy
from .autofreeze import AutoFreeze
from .egeria import Egeria
from .freezeout import FreezeOut
from .geometric import GeometricFreezing
from .gradual import GradualUnfreezing
from .linear import LinearFreezing
from .none import NoFreezing
from .smartfrz import SmartFRZ
from .static import StaticFreezing

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (NoFreezing, StaticFreezing, GradualUnfreezing, LinearFreezing, GeometricFreezing, FreezeOut,
                AutoFreeze, Egeria, SmartFRZ)
}

#: The strategy used when none is named: the learned SmartFRZ policy (no per-network tuning; see BENCHMARKS.md).
DEFAULT_STRATEGY = "smartfrz"


class UnknownStrategyError(ValueError):
    """Raised for a strategy name that is not registered, or a parameter it does not take."""


def strategy_parameters(name: str) -> dict[str, Any]:
    """The parameters strategy ``name`` accepts, with their defaults (``inspect.Parameter.empty`` if required)."""
    cls = _lookup(name)
    sig = inspect.signature(cls.__init__)
    return {p.name: p.default for p in list(sig.parameters.values())[1:] if p.kind is p.POSITIONAL_OR_KEYWORD}


def _lookup(name: str) -> type[Strategy]:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise UnknownStrategyError(
            f"Unknown strategy {name!r}. Available: {', '.join(sorted(STRATEGIES))}."
        ) from None


def create_strategy(name: str, **params: Any) -> Strategy:
    """Build a registered strategy.

    Raises:
        UnknownStrategyError: unknown name, or a parameter the strategy does not take (the message lists the valid
            ones).
        ValueError: a parameter outside its range (raised by the strategy itself).
    """
    cls = _lookup(name)
    allowed = strategy_parameters(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        valid = ", ".join(f"{k}={v!r}" for k, v in allowed.items()) or "none"
        owners = sorted(o for o in STRATEGIES if o != name and set(unknown) <= set(strategy_parameters(o)))
        what = "Those are parameters" if len(unknown) > 1 else "That is a parameter"
        hint = f" {what} of {' and '.join(owners)}: name the strategy (--strategy {owners[0]})." if owners else ""
        raise UnknownStrategyError(
            f"Strategy {name!r} has no parameter(s) {', '.join(unknown)}; valid: {valid}.{hint}")
    return cls(**params)


__all__ = [
    "AutoFreeze",
    "BlockView",
    "Egeria",
    "FreezeOut",
    "GeometricFreezing",
    "GradualUnfreezing",
    "LinearFreezing",
    "DEFAULT_STRATEGY",
    "Decision",
    "NoFreezing",
    "STRATEGIES",
    "SmartFRZ",
    "StageContext",
    "StaticFreezing",
    "Strategy",
    "UnknownStrategyError",
    "create_strategy",
    "strategy_parameters",
]
