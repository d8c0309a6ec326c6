"""The registry of model families: who discovers a model's blocks, who splits its forward for the cache.

timm-style: a family file decorates its discovery function with :func:`register_blocks` and its
:class:`~layerfreeze.forward_split.ModelSplit` subclass with :func:`register_split`; importing the file registers
them. :func:`~layerfreeze.blocks.discover_blocks` tries discoverers by ascending ``order`` (then registration
order) and takes the first that returns blocks; :func:`~layerfreeze.forward_split.split_for` does the same with
splits. A discoverer must return None for a model that is not of its family, never raise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

Discoverer = Callable[[nn.Module], Any]
"""``(model) -> list[Block] | (list[Block], rule) | None``."""

_DISCOVERERS: list[tuple[int, int, str, Discoverer]] = []
_SPLITS: list[tuple[int, int, type]] = []
T = TypeVar("T")


def register_blocks(name: str, order: int = 500) -> Callable[[T], T]:
    """Register a block discoverer under a family ``name`` (shown by ``layerfreeze blocks``).

    Args:
        name: The family, e.g. ``"Hugging Face decoder LM"``.
        order: Lower runs first. Built in: 5 Hugging Face vision, 10 BERT-like encoders, 15 decoder LMs,
            16 encoder-decoders, 20 torchvision features+classifier, 25 torchvision ViT/Swin, 30 ResNet,
            35 timm, 40 ``nn.Sequential``, 1000 the generic fallback. Pick below a built-in family to take
            precedence over it.

    Raises:
        ValueError: ``name`` is already registered (a family file imported twice under two names, or a clash).
    """

    def wrap(fn: T) -> T:
        if any(n == name for _, _, n, _ in _DISCOVERERS):
            raise ValueError(f"a block discoverer named {name!r} is already registered")
        _DISCOVERERS.append((order, len(_DISCOVERERS), name, fn))  # type: ignore[arg-type]
        _DISCOVERERS.sort(key=lambda t: (t[0], t[1]))
        return fn

    return wrap


def register_split(order: int = 500) -> Callable[[T], T]:
    """Register a :class:`~layerfreeze.forward_split.ModelSplit` subclass (its ``family`` names it).

    Args:
        order: Lower is tried first by :func:`~layerfreeze.forward_split.split_for`.
    """

    def wrap(cls: T) -> T:
        if not any(c is cls for _, _, c in _SPLITS):
            _SPLITS.append((order, len(_SPLITS), cls))  # type: ignore[arg-type]
            _SPLITS.sort(key=lambda t: (t[0], t[1]))
        return cls

    return wrap


def unregister(name_or_split: str | type) -> None:
    """Remove a discoverer (by family name) or a split class (tests and experiments)."""
    _DISCOVERERS[:] = [t for t in _DISCOVERERS if t[2] != name_or_split]
    _SPLITS[:] = [t for t in _SPLITS if t[2] is not name_or_split]


def discoverers() -> list[tuple[str, Discoverer]]:
    """``(family name, discoverer)`` in the order they are tried."""
    return [(name, fn) for _, _, name, fn in _DISCOVERERS]


def splits() -> list[type]:
    """Registered split classes in the order :func:`~layerfreeze.forward_split.split_for` tries them."""
    return [cls for _, _, cls in _SPLITS]
