"""The registry of model families: who discovers a model's blocks, who splits its forward for the cache.

timm-style, like strategies and SmartFRZ recipes (:mod:`layerfreeze.registry`): a family file decorates its
discovery function with :func:`register_blocks` and its :class:`~layerfreeze.models.forward_split.ModelSplit` subclass
with :func:`register_split`; importing the file registers them. :func:`~layerfreeze.models.discovery.discover_blocks`
tries discoverers by ascending ``order`` (then registration order) and takes the first that returns blocks;
:func:`~layerfreeze.models.discovery.split_for` does the same with splits. A discoverer must return None for a model
that is not of its family, never raise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from layerfreeze.registry import Registry

Discoverer = Callable[[nn.Module], Any]
"""``(model) -> list[Block] | (list[Block], rule) | None``."""

DISCOVERERS: Registry[Discoverer] = Registry("block discoverer",
                                             "layerfreeze.models.registry.unregister({name!r})")
SPLITS: Registry[type] = Registry("forward split", "layerfreeze.models.registry.unregister(<the split class>)")
T = TypeVar("T")


def register_blocks(name: str, order: int = 500) -> Callable[[T], T]:
    """Register a block discoverer under a family ``name`` (shown by ``layerfreeze blocks``).

    Args:
        name: The family, e.g. ``"Hugging Face decoder LM"``.
        order: Lower runs first. Built in: 5 Hugging Face vision, 10 BERT-like encoders, 15 decoder LMs,
            16 encoder-decoders, 20 torchvision features+classifier, 25 torchvision ViT/Swin, 30 ResNet,
            35 timm, 40 ``nn.Sequential``, 1000 the generic fallback. Pick below a built-in family to take
            precedence over it.

    Registering it again from the same definition (a notebook cell run again) replaces it.

    Raises:
        ValueError: ``name`` is already registered to another discoverer (a family file imported twice under two
            module names, or a clash); the message says how to replace it
            (``layerfreeze.models.registry.unregister(name)``).
    """
    return DISCOVERERS.register(name, order)  # type: ignore[return-value]


def _split_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_split(order: int = 500) -> Callable[[T], T]:
    """Register a :class:`~layerfreeze.models.forward_split.ModelSplit` subclass (its ``family`` names it).

    Args:
        order: Lower is tried first by :func:`~layerfreeze.models.discovery.split_for`.
    """

    def wrap(cls: T) -> T:
        if SPLITS.name_of(cls) is None:
            SPLITS.add(_split_key(cls), cls, order)  # type: ignore[arg-type]
        return cls

    return wrap


def unregister(name_or_split: str | type) -> None:
    """Remove a discoverer (by family name) or a split class (tests and experiments)."""
    if isinstance(name_or_split, str):
        DISCOVERERS.unregister(name_or_split)
    else:
        name = SPLITS.name_of(name_or_split)
        if name is not None:
            SPLITS.unregister(name)


def discoverers() -> list[tuple[str, Discoverer]]:
    """``(family name, discoverer)`` in the order they are tried."""
    return list(DISCOVERERS.items())


def splits() -> list[type]:
    """Registered split classes in the order :func:`~layerfreeze.models.discovery.split_for` tries them."""
    return list(SPLITS.values())
