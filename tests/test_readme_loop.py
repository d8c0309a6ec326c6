"""The README's own-loop example, run as written on a tiny model, so it cannot rot: the package's default strategy
(smartfrz) with ``total_steps``, ``with Freezer(...) as freezer:``, the activation cache in two lines, and the
optimizer -> scheduler -> freezer order. Also the loop API's edges: the default strategy, the error without
``total_steps``, ``close()`` on leaving the ``with`` block, and the top-level exports."""

from __future__ import annotations

import math
import re
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import layerfreeze
from layerfreeze import DEFAULT_STRATEGY, CachedPrefix, Freezer
from tests.conftest import readme_without_setup

pytestmark = pytest.mark.usefixtures("one_thread")

README = Path(__file__).resolve().parents[1] / "README.md"


def own_loop_example() -> str:
    """The first Python block of the README's "In your own training loop" section."""
    section = README.read_text().split("## In your own training loop", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


class Blobs(Dataset):
    """Fixed Gaussian blobs ``{"pixel_values": (16,), "labels", "index"}`` (deterministic inputs)."""

    def __init__(self, n: int = 48):
        g = torch.Generator().manual_seed(1)
        self.labels = torch.randint(0, 4, (n,), generator=g)
        self.x = torch.randn(n, 16, generator=g) + self.labels[:, None].float()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"pixel_values": self.x[i], "labels": self.labels[i], "index": torch.tensor(i)}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def run_example(monkeypatch) -> dict:
    """Exec the README block as written (its own tiny model and loader); counts ``Freezer.close`` calls."""
    closed = []
    close = Freezer.close
    monkeypatch.setattr(Freezer, "close", lambda self: (closed.append(self), close(self))[1])
    namespace = {}
    exec(compile(own_loop_example(), str(README), "exec"), namespace)  # noqa: S102 - our own README
    namespace["closed"] = closed
    return namespace


def test_the_readme_own_loop_runs_as_written_with_the_default_strategy(monkeypatch):
    ns = run_example(monkeypatch)
    freezer, forward = ns["freezer"], ns["forward"]
    assert freezer.strategy.name == DEFAULT_STRATEGY == "smartfrz"
    assert ns["total_steps"] == 3 * 6 and freezer.step_count == 18 and freezer.epoch == 3
    assert ns["scheduler"].last_epoch == 18
    assert ns["closed"] == [freezer]  # leaving the with block closed it
    assert isinstance(forward, CachedPrefix) and forward.freezer is freezer and forward.disabled is None
    assert math.isfinite(ns["loss"].item())
    # every sample went through the cached forward: the full forward at depth 0, the cache beyond it
    stats = forward.stats()
    assert stats["full_forwards"] + (stats["hits"] + stats["misses"]) // 8 == 18


def test_the_readme_own_loop_serves_a_frozen_prefix_from_the_cache(monkeypatch):
    """The same code with a strategy that freezes from the start: epoch 1 fills the cache, epochs 2-3 read it."""

    class Static(Freezer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, strategy="static", strategy_params={"k": 2}, **kwargs)

    monkeypatch.setattr(layerfreeze, "Freezer", Static)
    ns = run_example(monkeypatch)
    freezer, forward = ns["freezer"], ns["forward"]
    assert freezer.frozen_prefix == 2
    assert forward.prefix_samples == 48 and forward.cache.hits == 2 * 48 and forward.full_forwards == 0
    assert forward.cache.depth == 2 and len(forward.cache) == 48


@pytest.mark.parametrize("strategy", ["smartfrz", "linear", "freezeout"])
def test_a_strategy_that_needs_the_run_length_says_to_pass_total_steps(strategy):
    model = mlp()
    optimizer = torch.optim.SGD(layerfreeze.block_param_groups(model, layerfreeze.discover_blocks(model), lr=0.1))
    args = () if strategy == DEFAULT_STRATEGY else (strategy,)
    with pytest.raises(RuntimeError, match=r"pass total_steps=<planned optimizer steps> to Freezer"):
        Freezer(model, optimizer, *args)


def test_leaving_the_with_block_stops_egerias_worker_thread():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)

    def workers():
        return [t for t in threading.enumerate() if t.name.startswith("layerfreeze-egeria")]

    with Freezer(model, optimizer, "egeria", {"interval": 2, "probe_size": 4}) as freezer:  # asynchronous
        for _ in range(6):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            freezer.step()
        assert workers()  # the reference model's evaluations run in a background thread
    assert not workers()  # close() shut the worker down


def test_the_loop_api_is_exported_at_the_top_level():
    for name in ("Freezer", "CachedPrefix", "ActivationCache", "CacheRefused", "FrozenModule", "FrozenPipeline",
                 "precompute", "PrecomputedDataset", "StabilityGuard", "block_param_groups", "discover_blocks",
                 "save_checkpoint", "load_checkpoint", "DEFAULT_STRATEGY"):
        assert name in layerfreeze.__all__ and getattr(layerfreeze, name) is not None, name
    assert set(layerfreeze.__all__) <= set(dir(layerfreeze))


class XBlobs(Blobs):
    """The same blobs under the keys a non-Hugging Face user writes: ``{"x", "labels", "index"}``, index an int."""

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.labels[i], "index": i}


def list_index_collate(items):
    """A user's collate: tensors stacked, the sample positions left a list of ints."""
    return {"x": torch.stack([it["x"] for it in items]), "labels": torch.stack([it["labels"] for it in items]),
            "index": [it["index"] for it in items]}


@pytest.mark.parametrize("collate", [None, list_index_collate], ids=["default-collate", "index-a-list"])
def test_the_readme_own_loop_with_an_nn_sequential_whose_input_is_batch_x(monkeypatch, collate):
    """Issue 32: the README loop (its setup left out) with an nn.Sequential and ``batch["x"]`` (the cache found no
    "pixel_values"); an "index" as torch's default collate makes it (a tensor) or as a list of ints."""

    class Static(Freezer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, strategy="static", strategy_params={"k": 2}, **kwargs)

    monkeypatch.setattr(layerfreeze, "Freezer", Static)
    loader = DataLoader(XBlobs(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0),
                        collate_fn=collate)
    namespace = {"model": mlp(), "loader": loader}
    exec(compile(readme_without_setup(own_loop_example()), str(README), "exec"), namespace)  # noqa: S102
    forward = namespace["forward"]
    assert forward.split.input_keys == ("x",)  # found in the first batch: its one input tensor
    assert forward.prefix_samples == 48 and forward.cache.hits == 2 * 48 and forward.full_forwards == 0
    # the cached run trains like the plain forward on the same batches: same weights at the end
    monkeypatch.setattr(layerfreeze, "CachedPrefix", lambda model, **kw: lambda batch: model(batch["x"]))
    plain = {"model": mlp(), "loader": DataLoader(XBlobs(), batch_size=8, shuffle=True,
                                                  generator=torch.Generator().manual_seed(0), collate_fn=collate)}
    exec(compile(readme_without_setup(own_loop_example()), str(README), "exec"), plain)  # noqa: S102
    for (name, a), b in zip(namespace["model"].state_dict().items(), plain["model"].state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
