"""The strategy registry: ``@register_strategy("name")`` on a strategy class, and building one by name.

Every built-in strategy registers itself this way in its own file (importing :mod:`layerfreeze.strategies`
registers them all, in the order of the package's table); a user's strategy registers the same way and is then
known to everything that takes a strategy name: :class:`~layerfreeze.engine.Freezer`, :func:`create_strategy`, the
config (``freeze.strategy``), the CLI trainer and ``layerfreeze compare`` rows, in the same process. The README's
"Register your own strategy" shows one.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from layerfreeze.errors import UnknownStrategyError
from layerfreeze.registry import Registry
from layerfreeze.strategies.base import Strategy

S = TypeVar("S", bound=type)

#: Registered strategies: ``{name: Strategy subclass}`` in registration order (a read-only mapping).
STRATEGIES: Registry[type[Strategy]] = Registry("strategy", "layerfreeze.strategies.unregister_strategy({name!r})")


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
            f"Unknown strategy {name!r}{did_you_mean(name, STRATEGIES)}. Available: {', '.join(sorted(STRATEGIES))}. "
            f"{OWN_STRATEGY_HINT}"
        ) from None


def did_you_mean(name: object, known: Iterable[str]) -> str:
    """``" (did you mean 'smartfrz'?)"`` for the known name closest to a misspelt one (``difflib``), else ``""``."""
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


#: How a strategy of one's own becomes known (the README's "Register your own strategy").
OWN_STRATEGY_HINT = (
    "A strategy of your own is known once the file that registers it (@register_strategy) is imported: in Python, "
    "import it before naming it; for the command line, run it from Python after the import: "
    "python -c \"import my_strategy; from layerfreeze.cli import main; raise SystemExit(main())\" train -s NAME")


def check_strategy(name: str, params: Mapping[str, Any] | None = None) -> None:
    """Check a strategy name and its parameter names against the registry, without building it.

    What a config checks (as torchtune binds a component's arguments before instantiating it): the strategy is
    registered, every key of ``params`` is a parameter of its ``__init__``, and every required parameter is given.
    Values are checked where the strategy is built (:func:`create_strategy`), once per run.

    Raises:
        UnknownStrategyError: unknown name, a parameter the strategy does not take (the message lists the valid
            ones and the strategies that do take it), or a required one missing.
    """
    params = dict(params or {})
    _lookup(name)
    allowed = strategy_parameters(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        valid = ", ".join(f"{k}={v!r}" for k, v in allowed.items()) or "none"
        # In registration order, so the classic strategy that takes the key comes first in the example.
        owners = [o for o in STRATEGIES if o != name and set(unknown) <= set(strategy_parameters(o))]
        what = "Those are parameters" if len(unknown) > 1 else "That is a parameter"
        hint = ""
        if owners:
            among = owners[0] if len(owners) == 1 else f"{', '.join(owners[:-1])} or {owners[-1]}"
            hint = f" {what} of {among}: name the strategy (e.g. --strategy {owners[0]})."
        raise UnknownStrategyError(
            f"Strategy {name!r} has no parameter(s) {', '.join(unknown)}; valid: {valid}.{hint}")
    missing = [k for k, v in allowed.items() if v is inspect.Parameter.empty and k not in params]
    if missing:
        raise UnknownStrategyError(f"Strategy {name!r} needs the parameter(s) {', '.join(missing)}")


def check_strategy_arguments(strategy: object, params: object, where: str = "Freezer") -> None:
    """Refuse a ``strategy`` that is neither a registered name nor a :class:`Strategy` instance, and ``params`` that
    are not a mapping, naming ``where`` they were given (a Freezer, a framework callback).

    Raises:
        TypeError: the message says what to pass instead (an instance for a class, a dict for a string).
    """
    if isinstance(strategy, type) and issubclass(strategy, Strategy):
        raise TypeError(f"{where}: strategy is the class {strategy.__name__}, not a strategy: pass an instance, "
                        f"{strategy.__name__}(...), or a registered name")
    if not isinstance(strategy, (str, Strategy)):
        raise TypeError(f"{where}: strategy must be a registered name (e.g. 'static'; {', '.join(sorted(STRATEGIES))}) "
                        f"or a Strategy instance, got {type(strategy).__name__} {strategy!r}")
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(f"{where}: the strategy's parameters must be a dict such as {{'k': 2}}, got "
                        f"{type(params).__name__} {params!r}")


def create_strategy(name: str, params: Mapping[str, Any] | None = None, /, *, num_blocks: int | None = None,
                    **kwargs: Any) -> Strategy:
    """Build a registered strategy: the one path from a name to a strategy (the Freezer, the CLI trainer and
    ``layerfreeze compare`` all build through it).

    Args:
        name: A registered name (``"static"``, ``"smartfrz"``, a user's ``@register_strategy`` name).
        params: Its parameters as a dict (``{"k": 5}``, what configs and ``Freezer(..., strategy_params)`` hold).
        num_blocks: The model's number of blocks, to check the parameters against it (``static``'s ``k`` must leave
            the head trainable, ...); None skips that check.
        **kwargs: Parameters as keywords (``create_strategy("static", k=5)``); they win over ``params``.

    Raises:
        UnknownStrategyError: unknown name, or a parameter the strategy does not take (the message lists the valid
            ones).
        TypeError: ``params`` is not a mapping, or a parameter is given both in it and as a keyword.
        ValueError: a parameter outside its range, or one that does not fit ``num_blocks`` (raised by the strategy).
    """
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(f"create_strategy({name!r}, params): params must be a dict of the strategy's parameters, "
                        f"got {type(params).__name__}")
    both = sorted(set(params or {}) & set(kwargs))
    if both:
        raise TypeError(f"create_strategy({name!r}): {', '.join(both)} given both in the params dict and as a keyword")
    params = {**(params or {}), **kwargs}
    check_strategy(name, params)
    strategy = STRATEGIES[name](**params)
    if num_blocks is not None:
        strategy.validate(num_blocks)
    return strategy
