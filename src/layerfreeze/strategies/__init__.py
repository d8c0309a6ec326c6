"""Freezing strategies, registered by name (``@register_strategy("static")``; ``create_strategy("static", k=5)``).

One file per strategy; each cites its source in its docstring. The registry is :mod:`.registry`.
"""

from __future__ import annotations

from .base import BlockView, Decision, StageContext, Strategy
from .registry import (
                       STRATEGIES,
                       UnknownStrategyError,
                       create_strategy,
                       register_strategy,
                       strategy_parameters,
                       unregister_strategy,
)

# Importing each file registers its strategy (@register_strategy); this order is the registry's and the default
# rows of ``layerfreeze compare`` (tests/test_strategies_register.py checks it), so no import sorter may change it.
# isort: off
from .none import NoFreezing
from .static import StaticFreezing
from .gradual import GradualUnfreezing
from .linear import LinearFreezing
from .geometric import GeometricFreezing
from .freezeout import FreezeOut
from .autofreeze import AutoFreeze
from .egeria import Egeria
from .smartfrz import SmartFRZ
# isort: on

#: The built-in strategies, in registration order (what ``layerfreeze compare`` runs by default).
BUILTIN_STRATEGIES: tuple[str, ...] = tuple(STRATEGIES)

#: The strategy used when none is named: the learned SmartFRZ policy (no per-network tuning; see BENCHMARKS.md).
DEFAULT_STRATEGY = "smartfrz"


__all__ = [
    "AutoFreeze",
    "BUILTIN_STRATEGIES",
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
    "register_strategy",
    "strategy_parameters",
    "unregister_strategy",
]
