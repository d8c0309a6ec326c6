"""The tree is the map: one folder per concept, imports that run one way, old paths kept for one release.

``lint-imports`` (run by ``make test``) checks the layers written in ``pyproject.toml``; these tests check what a
contract cannot say: no import circle between any two modules (function-level imports counted, ``TYPE_CHECKING``
ones not), at most 12 modules directly in the package, the README importing only from the package root or a concept
package, and the old import paths still working, with a ``DeprecationWarning``, to the same objects.
"""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from pathlib import Path

import grimp
import pytest

import layerfreeze
from layerfreeze import _compat

SRC = Path(layerfreeze.__file__).parent
README = Path(__file__).resolve().parents[1] / "README.md"

#: The concept packages (and the modules that stand alone at the top): where the README may import from.
FACES = {"layerfreeze", "layerfreeze.models", "layerfreeze.engine", "layerfreeze.strategies", "layerfreeze.compute",
         "layerfreeze.distributed", "layerfreeze.runs", "layerfreeze.train", "layerfreeze.integrations",
         "layerfreeze.smartfrz", "layerfreeze.checkpoint", "layerfreeze.errors", "layerfreeze.budget"}


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), module level."""
    modules = sorted(graph.modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for m in modules:
        if m not in index:
            visit(m)
    return found


def test_no_import_circle_between_modules():
    graph = grimp.build_graph("layerfreeze", exclude_type_checking_imports=True)
    assert len(graph.modules) > 80  # the whole package was read
    # a package's __init__ importing its own modules is its face, not a circle: drop those arrows
    for importer in list(graph.modules):
        for imported in list(graph.find_modules_directly_imported_by(importer)):
            if imported.startswith(importer + "."):
                graph.remove_import(importer=importer, imported=imported)
    assert _cycles(graph) == []


def test_at_most_twelve_modules_directly_in_the_package():
    top = sorted(p.name for p in SRC.glob("*.py"))
    assert len(top) <= 12, top
    concepts = sorted(p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert concepts == ["budget", "cli", "compute", "distributed", "engine", "integrations", "models", "runs",
                        "smartfrz", "strategies", "train"]


def test_the_readme_imports_only_from_the_root_or_a_concept_package():
    code = "\n".join(re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S))
    imported = set(re.findall(r"^\s*from (layerfreeze[\w.]*) import", code, re.M))
    assert imported, "the README imports nothing from layerfreeze?"
    leaves = sorted(m for m in imported if m not in FACES and not m.startswith("layerfreeze.integrations."))
    assert leaves == [], f"README imports from leaf modules: {leaves}"


@pytest.mark.parametrize("old", sorted(_compat.MOVED))
def test_an_old_import_path_warns_and_gives_the_same_objects(old):
    name = f"layerfreeze.{old}"
    targets = [importlib.import_module(f"layerfreeze.{t}") for t in _compat.MOVED[old]]
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    assert any(issubclass(w.category, DeprecationWarning) and f"layerfreeze.{_compat.MOVED[old][0]}" in
               str(w.message) for w in caught), [str(w.message) for w in caught]
    for target in targets:  # every public name the old module's places hold is reachable through it
        for attr in [a for a in dir(target) if not a.startswith("_")][:50]:
            assert getattr(module, attr) is getattr(target, attr), (old, attr)


def test_old_paths_the_readme_used_to_show_still_work():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from layerfreeze.blocks import discover_blocks, make_blocks, module_entry, qualified_names
        from layerfreeze.cache import CachedPrefix
        from layerfreeze.families import register_blocks, register_split
        from layerfreeze.forward_split import ModelSplit, Stage, call, split_for
        from layerfreeze.frozen import FrozenDifferentiable, precompute
        from layerfreeze.fsdp import load_full_checkpoint, save_full_checkpoint, shard_blocks
        from layerfreeze.rundir import read_metrics
        from layerfreeze.trainer import Trainer
    assert discover_blocks is layerfreeze.discover_blocks and make_blocks is layerfreeze.make_blocks
    assert module_entry is layerfreeze.module_entry and qualified_names is layerfreeze.qualified_names
    assert CachedPrefix is layerfreeze.CachedPrefix and FrozenDifferentiable is layerfreeze.FrozenDifferentiable
    assert precompute is layerfreeze.precompute  # moved on to compute.precomputed
    star: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec("from layerfreeze.frozen import *", star)  # noqa: S102 -- the old module's names, from both places
    assert {"FrozenModule", "FrozenPipeline", "FrozenDifferentiable", "precompute", "PrecomputedDataset"} <= set(star)
    import layerfreeze.compute.precomputed as module  # the module, not the function of the same name

    assert module.PrecomputedDataset is layerfreeze.PrecomputedDataset
    assert register_blocks is layerfreeze.register_blocks and register_split is layerfreeze.register_split
    assert (ModelSplit, Stage, call, split_for) == (layerfreeze.ModelSplit, layerfreeze.Stage, layerfreeze.call,
                                                    layerfreeze.split_for)
    assert (save_full_checkpoint, load_full_checkpoint, shard_blocks) == (
        layerfreeze.save_full_checkpoint, layerfreeze.load_full_checkpoint, layerfreeze.shard_blocks)
    from layerfreeze.runs.rundir import read_metrics as new_read_metrics
    from layerfreeze.train.trainer import Trainer as NewTrainer

    assert read_metrics is new_read_metrics and Trainer is NewTrainer
    # names the package root never had stay unknown, with the usual error
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("layerfreeze.no_such_module")


def test_every_public_name_of_the_root_is_importable():
    for name in layerfreeze.__all__:
        assert getattr(layerfreeze, name) is not None, name
