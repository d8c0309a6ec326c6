"""Freezing strategies, registered by name (``@register_strategy("static")``; ``create_strategy("static", k=5)``).

One file per strategy; each cites its source in its docstring. The registry is :mod:`.registry`.
"""

from __future__ import annotations

from .base import BlockView, Decision, StageContext, Strategy
from .registry import (STRATEGIES, UnknownStrategyError, create_strategy, register_strategy, strategy_parameters,
                       unregister_strategy)

# Importing each file registers its strategy (@register_strategy); this order is the registry's and the default
# rows of ``layerfreeze compare``.
from .none import NoFreezing  # noqa: E402
from .static import StaticFreezing  # noqa: E402
from .gradual import GradualUnfreezing  # noqa: E402
from .linear import LinearFreezing  # noqa: E402
from .geometric import GeometricFreezing  # noqa: E402
from .freezeout import FreezeOut  # noqa: E402
from .autofreeze import AutoFreeze  # noqa: E402
from .egeria import Egeria  # noqa: E402
from .smartfrz import SmartFRZ  # noqa: E402

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
