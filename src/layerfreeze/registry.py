"""Registries filled by decorators, timm style: strategies, model families and SmartFRZ recipes all register this way.

A :class:`Registry` holds the named objects of one kind and is read as a mapping from name to object, in ``order``
then registration order. Each kind has its decorator:

* :func:`~layerfreeze.strategies.register_strategy` (``@register_strategy("static")`` on a
  :class:`~layerfreeze.strategies.Strategy` subclass), read by ``create_strategy``, the config, the CLI and
  ``layerfreeze compare``;
* :func:`~layerfreeze.models.registry.register_blocks` / :func:`~layerfreeze.models.registry.register_split` (a model
  family's block discoverer and forward split), read by block discovery and the activation cache;
* :func:`~layerfreeze.smartfrz.recipes.registry.register_recipe` (a SmartFRZ collection recipe), read by
  ``layerfreeze predictor collect``.

Importing the file that holds a decorated object registers it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Named objects of one kind: ``registry[name]``, ``name in registry``, iteration in lookup order.

    Args:
        kind: What is registered, for messages (``"strategy"``, ``"block discoverer"``).
    """

    def __init__(self, kind: str, replace_hint: str = "") -> None:
        self.kind = kind
        self.replace_hint = replace_hint
        self._entries: list[tuple[int, int, str, T]] = []
        self._counter = itertools.count()

    def add(self, name: str, obj: T, order: int = 500) -> T:
        """Register ``obj`` under ``name`` and return it.

        Registering the same object again is a no-op; registering a new definition of the same thing (an object
        with the same module and qualified name as the registered one: a notebook cell run again,
        ``importlib.reload``) replaces it in place, keeping its place in the lookup order.

        Args:
            name: The key it is looked up by.
            obj: What is registered.
            order: Lower comes first when the registry is iterated (then registration order).

        Raises:
            ValueError: ``name`` is already registered to another object (the message names both and how to
                replace it).
        """
        for i, (o_order, count, n, o) in enumerate(self._entries):
            if n == name:
                if o is obj:
                    return obj
                if _definition(o) is not None and _definition(o) == _definition(obj):
                    self._entries[i] = (o_order, count, n, obj)
                    return obj
                how = self.replace_hint.format(name=name) if self.replace_hint else f"unregister({name!r})"
                held = _definition(o) or repr(o)
                raise ValueError(f"a {self.kind} named {name!r} is already registered ({held}); "
                                 f"to replace it, call {how} first, or register {_definition(obj) or 'yours'} "
                                 "under another name")
        self._entries.append((order, next(self._counter), name, obj))
        self._entries.sort(key=lambda e: (e[0], e[1]))
        return obj

    def register(self, name: str, order: int = 500) -> Callable[[T], T]:
        """Decorator form of :meth:`add`: ``@registry.register("name")`` registers and returns what it decorates."""

        def wrap(obj: T) -> T:
            return self.add(name, obj, order)

        return wrap

    def unregister(self, name: str) -> None:
        """Remove ``name`` (nothing happens if it is not registered)."""
        self._entries[:] = [e for e in self._entries if e[2] != name]

    def name_of(self, obj: object) -> str | None:
        """The name ``obj`` is registered under, or None."""
        return next((n for _, _, n, o in self._entries if o is obj), None)

    def __getitem__(self, name: str) -> T:
        for _, _, n, obj in self._entries:
            if n == name:
                return obj
        raise KeyError(f"unknown {self.kind} {name!r}; registered: {', '.join(self) or 'none'}")

    def __iter__(self) -> Iterator[str]:
        return iter([n for _, _, n, _ in self._entries])

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self)})"


def _definition(obj: object) -> str | None:
    """``module.qualname`` of a function or class (what identifies one definition across re-runs), else None."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if isinstance(module, str) and isinstance(qualname, str) else None
