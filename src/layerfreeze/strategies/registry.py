"""The strategy registry: ``@register_strategy("name")`` on a strategy class, and building one by name.

Every built-in strategy registers itself this way in its own file (importing :mod:`layerfreeze.strategies`
registers them all, in the order of the package's table); a user's strategy registers the same way and is then
known to everything that takes a strategy name: :class:`~layerfreeze.engine.Freezer`, :func:`create_strategy`, the
config (``freeze.strategy``), the CLI trainer and ``layerfreeze compare`` rows, in the same process. The README's
"Register your own strategy" shows one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ..registry import Registry
from .base import Strategy

S = TypeVar("S", bound=type)

#: Registered strategies: ``{name: Strategy subclass}`` in registration order (a read-only mapping).
STRATEGIES: Registry[type[Strategy]] = Registry("strategy")


class UnknownStrategyError(ValueError):
    """Raised for a strategy name that is not registered, or a parameter it does not take."""


def register_strategy(name: str) -> Callable[[S], S]:
    """Class decorator: register a :class:`~layerfreeze.strategies.Strategy` subclass under ``name``.

    Sets the class's :attr:`~layerfreeze.strategies.Strategy.name` to ``name``. The parameters of its
    ``__init__`` (keyword-able, with their defaults) are the strategy's parameters (``-p key=value``,
    ``freeze.params``).

    Raises:
        TypeError: the decorated object is not a Strategy subclass.
        ValueError: ``name`` is already registered to another class (:func:`unregister_strategy` it first).
    """

    def wrap(cls: S) -> S:
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise TypeError(f"register_strategy({name!r}) decorates a Strategy subclass, got {cls!r}")
        STRATEGIES.add(name, cls)
        cls.name = name
        return cls

    return wrap


def unregister_strategy(name: str) -> None:
    """Remove a registered strategy (tests and experiments); nothing happens for an unknown name."""
    STRATEGIES.unregister(name)


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
            f"Unknown strategy {name!r}. Available: {', '.join(sorted(STRATEGIES))}. {OWN_STRATEGY_HINT}"
        ) from None


#: How a strategy of one's own becomes known (the README's "Register your own strategy").
OWN_STRATEGY_HINT = (
    "A strategy of your own is known once the file that registers it (@register_strategy) is imported: in Python, "
    "import it before naming it; for the command line, run it from Python after the import: "
    "python -c \"import my_strategy; from layerfreeze.cli import main; raise SystemExit(main())\" train -s NAME")


def create_strategy(name: str, params: Mapping[str, Any] | None = None, /, **kwargs: Any) -> Strategy:
    """Build a registered strategy from its parameters, given as a dict (as :class:`~layerfreeze.engine.Freezer`
    and configs take them: ``create_strategy("static", {"k": 5})``) and/or as keywords
    (``create_strategy("static", k=5)``).

    Raises:
        UnknownStrategyError: unknown name, or a parameter the strategy does not take (the message lists the valid
            ones).
        TypeError: ``params`` is not a mapping, or a parameter is given both in it and as a keyword.
        ValueError: a parameter outside its range (raised by the strategy itself).
    """
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(f"create_strategy({name!r}, params): params must be a dict of the strategy's parameters, "
                        f"got {type(params).__name__}")
    both = sorted(set(params or {}) & set(kwargs))
    if both:
        raise TypeError(f"create_strategy({name!r}): {', '.join(both)} given both in the params dict and as a keyword")
    params = {**(params or {}), **kwargs}
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
