"""The README's "Add your own model family" recipe, run as written: its family is found by discovery, its split
gives the model's logits through the real cache, and unregistering it leaves the built-in families as they were."""

from __future__ import annotations

import pytest
import torch

from layerfreeze import ActivationCache, CachedPrefix, Freezer, block_param_groups, find_blocks, split_for
from layerfreeze.models.registry import discoverers, splits, unregister
from tests.conftest import readme_example


def recipe_code() -> str:
    return readme_example("### Add your own model family")


@pytest.fixture
def recipe():
    before = (discoverers(), splits())
    namespace: dict = {}
    exec(compile(recipe_code(), "README.md#add-your-own-model-family", "exec"), namespace)
    yield namespace
    unregister("Tower")
    unregister(namespace["TowerSplit"])
    assert (discoverers(), splits()) == before


def test_the_readme_recipe_registers_a_family_with_its_blocks_and_split(recipe):
    torch.manual_seed(0)
    model = recipe["Tower"]()
    found = find_blocks(model)
    assert found.rule == "Tower"  # its own rule, before the generic fallback would take the floors
    assert [b.name for b in found.blocks] == ["stem", "floors.0", "floors.1", "floors.2", "roof"]
    split = split_for(model, found.blocks)
    assert isinstance(split, recipe["TowerSplit"])
    optimizer = torch.optim.SGD(block_param_groups(model, found.blocks, lr=0.1))
    freezer = Freezer(model, optimizer, "static", {"k": 2}, blocks=found.blocks)
    runner = CachedPrefix(model, found.blocks, split, ActivationCache(), freezer=freezer)
    batch = {"pixel_values": torch.randn(6, 8), "index": torch.arange(6)}
    own = model(batch["pixel_values"])
    assert torch.equal(runner(batch), own) and torch.equal(runner(batch), own)
    assert runner.cache.hits == 6


def test_without_the_recipe_the_generic_fallback_finds_the_tower(recipe):
    model = recipe["Tower"]()
    unregister("Tower")
    found = find_blocks(model)
    assert found.rule == "generic stack: floors (3 x Linear)"
    assert [b.name for b in found.blocks] == ["stem", "floors.0", "floors.1", "floors.2", "roof"]
    from layerfreeze.models.registry import register_blocks

    register_blocks("Tower", order=50)(recipe["discover_tower"])  # the fixture unregisters it again
