"""The recipe registry: ``@register_recipe(name, ...)`` on a function ``(seed, quick, cache_dir) -> Setup``, and the
recipes by name. The recipe files (:mod:`~layerfreeze.smartfrz.recipes.rounds`) import this module, never the
reverse (the registry style of every layerfreeze registry, :mod:`layerfreeze.registry`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from layerfreeze.registry import Registry
from layerfreeze.smartfrz.runs import PipelineError
from layerfreeze.smartfrz.setup import Setup


@dataclass(frozen=True)
class Recipe:
    """A registered collection recipe. ``build(seed, quick, cache_dir) -> Setup``; ``minutes``: estimated
    wall-clock minutes of one full-size run on a 2-core CPU (measured from a few steps, see the card)."""

    name: str
    arch: str
    dataset: str
    mode: str
    lrs: tuple[float, ...]
    minutes: float
    build: Callable[[int, bool, Path], Setup] = field(compare=False)
    description: str = ""


#: Registered recipes, ``{name: Recipe}`` in registration order (the order ``collect`` records them in).
RECIPES: Registry[Recipe] = Registry("recipe")


def register_recipe(name: str, *, arch: str, dataset: str, mode: str, lrs: tuple[float, ...], minutes: float,
                    description: str = "") -> Callable[[Callable[[int, bool, Path], Setup]],
                                                       Callable[[int, bool, Path], Setup]]:
    """Decorator: register ``fn(seed, quick, cache_dir) -> Setup`` as recipe ``name``.

    Args:
        arch / dataset: Recorded in each run's ``meta.json`` (the predictor card groups runs by them).
        mode: ``"scratch"`` or ``"finetune"``.
        lrs: The learning rates ``collect`` records the recipe with (one run per seed and rate).
        minutes: Estimated wall-clock minutes of one full-size run on a 2-core CPU.

    Raises:
        ValueError: ``mode`` is neither, or ``name`` is already registered.
    """
    if mode not in ("scratch", "finetune"):
        raise ValueError(f"mode must be 'scratch' or 'finetune', got {mode!r}")

    def deco(fn: Callable[[int, bool, Path], Setup]) -> Callable[[int, bool, Path], Setup]:
        RECIPES.add(name, Recipe(name, arch, dataset, mode, tuple(lrs), minutes, fn, description))
        return fn

    return deco


def get_recipes(names: list[str] | None) -> list[Recipe]:
    """Recipes by name (all, in registration order, for None).

    Raises:
        PipelineError: an unknown name (the message lists the known ones).
    """
    if not names:
        return list(RECIPES.values())
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise PipelineError(f"unknown recipe(s) {', '.join(unknown)}; known: {', '.join(RECIPES)} (your own recipes: "
                            "--import the file or module that registers them)")
    return [RECIPES[n] for n in names]


#: Held out from predictor training by default: an unseen architecture family (ResNet, residual CNN) and a text
#: transformer trained from scratch (BERT-tiny on BBC News). MiniLM-L6 and MobileNetV2 fine-tunes are in the training
#: set: a predictor trained on scratch-trained networks only (version 1, and version 2 with these two held out) froze
#: every MiniLM layer at its first full window on BBC News (91.9% and 90.5% test accuracy against 98.0% and 96.9%
#: without freezing): under Adam every layer of a fine-tuned transformer moves its weights alike, and only runs of
#: fine-tuned transformers show that the deep layers' representations still change.
DEFAULT_HOLDOUT = ("resnet-fmnist", "tinybert-bbc")


def import_recipes(sources: list[str]) -> list[str]:
    """Import the modules that register a user's own recipes (``@register_recipe``), so the pipeline's commands
    know them by name (``layerfreeze predictor collect --import my_recipes.py --recipes my-recipe``): each source is
    a path to a ``.py`` file or an importable module's dotted name.

    Returns:
        The names of the recipes the sources registered, in registration order.

    Raises:
        PipelineError: a source cannot be found or fails to import (its error named), or registers no recipe.
    """
    added: list[str] = []
    for source in dict.fromkeys(sources):  # a source given twice is imported once
        before = set(RECIPES)
        try:
            if source.endswith(".py"):
                path = Path(source)
                if not path.is_file():
                    raise PipelineError(f"--import {source}: no such file (a .py file that registers recipes with "
                                        "@register_recipe, or a module's dotted name)")
                name = f"layerfreeze_recipes_{path.stem}"
                spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
                sys.modules[name] = module  # a dataclass or pickle in it looks its module up by name
                spec.loader.exec_module(module)  # type: ignore[union-attr]
            else:  # from the folder the command runs in too, as `python -m` would (a console script does not)
                sys.path.insert(0, os.getcwd())
                try:
                    importlib.import_module(source)
                finally:
                    sys.path.remove(os.getcwd())
        except PipelineError:
            raise
        except Exception as exc:  # the user's module: whatever it raises is named, in one line
            raise PipelineError(f"--import {source} failed: {type(exc).__name__}: {exc}") from exc
        new = [n for n in RECIPES if n not in before]
        if not new:
            raise PipelineError(f"--import {source} registered no recipe: decorate a function (seed, quick, cache_dir) "
                                "-> Setup with @layerfreeze.smartfrz.recipes.register_recipe(name, arch=..., "
                                "dataset=..., mode=..., lrs=..., minutes=...)")
        added += new
    return added
