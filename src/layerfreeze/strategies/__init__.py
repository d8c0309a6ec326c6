"""Freezing strategies, registered by name (``@register_strategy("static")``; ``create_strategy("static", {"k": 5})``).

One file per strategy (a folder for the two with parts: :mod:`~layerfreeze.strategies.egeria`,
:mod:`~layerfreeze.strategies.smartfrz`; ``lisa`` and ``badam`` share the skeleton
:class:`~layerfreeze.strategies.base.LayerRotation`); each cites its source in its docstring. Every strategy implements
:class:`~layerfreeze.strategies.base.Strategy` (``decide(ctx) -> Decision``); :mod:`~layerfreeze.strategies.registry`
is the registry, which the strategy files import (never the reverse).
"""

from __future__ import annotations

from layerfreeze.errors import UnknownStrategyError
from layerfreeze.strategies.base import BlockView, Decision, StageContext, Strategy
from layerfreeze.strategies.registry import (
    STRATEGIES,
    check_strategy,
    create_strategy,
    register_strategy,
    strategy_parameters,
    unregister_strategy,
)

# Importing each file registers its strategy (@register_strategy); this order is the registry's and the default
# rows of ``layerfreeze compare`` (tests/test_strategies_register.py checks it), so no import sorter may change it.
# isort: off
from layerfreeze.strategies.none import NoFreezing
from layerfreeze.strategies.static import StaticFreezing
from layerfreeze.strategies.gradual import GradualUnfreezing
from layerfreeze.strategies.linear import LinearFreezing
from layerfreeze.strategies.geometric import GeometricFreezing
from layerfreeze.strategies.freezeout import FreezeOut
from layerfreeze.strategies.autofreeze import AutoFreeze
from layerfreeze.strategies.egeria.strategy import Egeria
from layerfreeze.strategies.smartfrz.strategy import SmartFRZ
from layerfreeze.strategies.lisa import LISA
from layerfreeze.strategies.badam import BAdam
# isort: on

#: The built-in strategies, in registration order (what ``layerfreeze compare`` runs by default).
BUILTIN_STRATEGIES: tuple[str, ...] = tuple(STRATEGIES)

#: The strategy used when none is named: the learned SmartFRZ policy (no per-network tuning; see BENCHMARKS.md).
DEFAULT_STRATEGY = "smartfrz"


__all__ = [
    "AutoFreeze",
    "BAdam",
    "BUILTIN_STRATEGIES",
    "BlockView",
    "Egeria",
    "FreezeOut",
    "GeometricFreezing",
    "GradualUnfreezing",
    "LISA",
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
    "check_strategy",
    "create_strategy",
    "register_strategy",
    "strategy_parameters",
    "unregister_strategy",
]
