"""The activation cache of the frozen prefix, with real values: the split forward gives the model's logits bit for
bit, training with the cache gives the same losses as without it (also across a deeper freeze, which extends the
cache from the old boundary, and with variable-length text), reduced-precision storage, disk shards with corruption
detection, and the refusals (random augmentation, stochastic prefix modules, changed inputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, default_collate

from layerfreeze import Freezer, discover_blocks
from layerfreeze.compute.cache import CacheRefused, check_deterministic, check_prefix_deterministic
from layerfreeze.compute.cached_prefix import CachedPrefix
from layerfreeze.compute.store import ActivationCache, CacheWriteError
from layerfreeze.models.discovery import split_for
from layerfreeze.models.families.bert import BertSplit
from layerfreeze.models.families.sequential import SequentialSplit
from layerfreeze.models.families.torchvision_cnn import MobileNetV2Split, ResNetSplit
from layerfreeze.train.setup import epoch_batches
from tests.conftest import DEVICES

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- models and data ---------------------------------------------------------------------------------------


def tiny_bert(attn: str = "sdpa", seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3, attn_implementation=attn)
    return BertForSequenceClassification(config)


def mlp(seed: int = 0) -> nn.Sequential:
    """Blocks 0 (Linear), 1 (BatchNorm), 3, 5, 8 (head); the Dropout sits after block 5, in the trainable part."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
        nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4),
    )


class Blobs(Dataset):
    """Fixed Gaussian blobs ``{"pixel_values": (16,), "labels", "index"}``; ``noise > 0`` adds fresh noise per fetch."""

    def __init__(self, n: int = 48, noise: float = 0.0):
        g = torch.Generator().manual_seed(1)
        self.labels = torch.randint(0, 4, (n,), generator=g)
        self.x = torch.randn(4, 16, generator=g)[self.labels] * 2 + torch.randn(n, 16, generator=g)
        self.noise = noise

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.x[i] + self.noise * torch.randn(16) if self.noise else self.x[i]
        return {"pixel_values": x, "labels": self.labels[i], "index": torch.tensor(i)}


class Texts(Dataset):
    """Token sequences of lengths 3..12, right-padded with 0 to 12, with attention masks."""

    def __init__(self, n: int = 24, length: int = 12):
        g = torch.Generator().manual_seed(2)
        self.ids = torch.randint(1, 100, (n, length), generator=g)
        self.lengths = torch.randint(3, length + 1, (n,), generator=g)
        self.mask = (torch.arange(length)[None, :] < self.lengths[:, None]).long()
        self.ids = self.ids * self.mask
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "token_type_ids": torch.zeros_like(self.ids[i]), "labels": self.labels[i], "index": torch.tensor(i)}


def collate(dataset, indices):
    return default_collate([dataset[i] for i in indices])


def frozen(model, depth, train_bn=False):
    freezer = Freezer(model, None, "none", train_bn=train_bn)
    for i in range(depth):
        freezer.freeze(i)
    return freezer


# ---- splits ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bert_split_gives_the_models_logits_exactly_at_every_depth(attn):
    model = tiny_bert(attn).eval()
    split = split_for(model, discover_blocks(model))
    assert isinstance(split, BertSplit) and split.max_depth == 5  # embeddings, 3 layers, pooler | classifier
    data = Texts(6)
    padded = collate(data, range(6))
    assert (padded["attention_mask"] == 0).any()
    unpadded = {"input_ids": padded["input_ids"][:, :3], "attention_mask": torch.ones(6, 3, dtype=torch.long)}
    for batch in (padded, unpadded):
        logits = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in batch}).logits
        for depth in range(1, split.max_depth + 1):
            state = split.prefix(model, batch, depth)
            assert not state.requires_grad
            assert torch.equal(split.suffix(model, state, batch, depth), logits), depth
            if depth > 1:
                assert torch.equal(split.extend(model, split.prefix(model, batch, 1), batch, 1, depth), state)
    assert split.prefix(model, padded, 2).shape == (6, 12, 32)
    assert split.prefix(model, padded, 5).shape == (6, 32)  # the pooler is in the prefix: no sequence any more
    assert torch.equal(split.lengths(padded, 2), data.lengths[:6])
    assert split.lengths(padded, 5) is None


def test_mobilenet_v2_resnet_and_sequential_splits_give_the_models_logits_exactly():
    x = {"pixel_values": torch.randn(2, 3, 32, 32)}
    for model, kind in ((torchvision.models.mobilenet_v2(num_classes=10), MobileNetV2Split),
                        (torchvision.models.resnet18(num_classes=10), ResNetSplit)):
        model.eval()
        split = split_for(model, discover_blocks(model))
        assert isinstance(split, kind)
        logits = model(x["pixel_values"])
        for depth in range(1, split.max_depth + 1):
            assert torch.equal(split.suffix(model, split.prefix(model, x, depth), x, depth), logits), (kind, depth)
        if kind is MobileNetV2Split:
            assert split.max_depth == 19  # features.0 .. features.18 | classifier
    model = mlp().eval()
    split = split_for(model, discover_blocks(model))
    assert isinstance(split, SequentialSplit)
    batch = {"pixel_values": torch.randn(6, 16)}
    for depth in range(1, split.max_depth + 1):
        state = split.prefix(model, batch, depth)
        assert torch.equal(split.suffix(model, state, batch, depth), model(batch["pixel_values"]))
    # The boundary is right after a block: parameter-free modules after it (ReLU, Dropout) run in the suffix.
    assert [name for name, _ in split.prefix_modules(model, 4)] == ["0", "1", "2", "3", "4", "5"]
    assert [name for name, _ in split.prefix_modules(model, 2)] == ["0", "1"]


def test_split_for_names_the_supported_families():
    class FeaturesClassifier(nn.Module):  # VGG-like: discovered as blocks, but its forward is not MobileNetV2's
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3))
            self.classifier = nn.Linear(4, 2)

    model = FeaturesClassifier()
    with pytest.raises(ValueError, match="Supported families") as err:
        split_for(model, discover_blocks(model))
    for family in ("BertForSequenceClassification", "MobileNetV2", "ResNet", "nn.Sequential"):
        assert family in str(err.value)
    assert "\n" not in str(err.value)  # one line (a Llama classifier's cache_off line spanned ten)


# ---- training with the cache == training without it -------------------------------------------------------


def train(model, dataset, cached, depth0, deeper_at, epochs=4, batch_size=8, lr=0.05, device="cpu", **cache_kwargs):
    """Train with a frozen prefix of ``depth0`` blocks, one more block frozen at epoch ``deeper_at``.

    Returns (per-step losses, CachedPrefix or None, per-epoch stats).
    """
    model = model.to(device)
    optimizer = torch.optim.SGD([p for p in model.parameters()], lr=lr, momentum=0.9)
    freezer = Freezer(model, optimizer, "none")
    for i in range(depth0):
        freezer.freeze(i)
    runner = None
    if cached:
        check_deterministic(dataset)
        runner = CachedPrefix(model, freezer.blocks, cache=ActivationCache(**cache_kwargs), freezer=freezer)
    split = split_for(model, freezer.blocks)
    losses, stats = [], []
    for epoch in range(epochs):
        if epoch == deeper_at:
            freezer.freeze(depth0)
        model.train()
        for indices in epoch_batches(len(dataset), batch_size, seed=0, epoch=epoch):
            batch = {k: v.to(device) for k, v in collate(dataset, indices).items()}
            logits = runner.forward(batch) if cached else split.full(model, batch)
            loss = F.cross_entropy(logits, batch["labels"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        if cached:
            stats.append(runner.stats())
    return torch.stack(losses), runner, stats


@pytest.mark.parametrize("device", DEVICES)
def test_training_with_the_cache_gives_the_same_losses_and_extends_from_the_old_boundary(device):
    data = Blobs(48)
    plain, _, _ = train(mlp(), data, cached=False, depth0=3, deeper_at=2, device=device)
    cached, runner, stats = train(mlp(), data, cached=True, depth0=3, deeper_at=2, device=device)
    assert plain.device.type == device
    if device == "cpu":  # one thread, the same kernels for the same shapes: bit for bit
        assert torch.equal(plain, cached), (plain - cached).abs().max()
    else:  # cuBLAS may pick another algorithm for a cached state (a fresh allocation): float32 rounding, carried
        # through 24 SGD steps; a wrong cached state (another sample's, a stale depth) changes a loss by > 1e-2
        torch.testing.assert_close(plain, cached, rtol=1e-5, atol=1e-5)
    assert plain[-1] < plain[0]  # it trains
    # epoch 0: every sample computed through blocks 0..2; epoch 1: all hits
    assert (stats[0]["prefix_samples"], stats[0]["hits"]) == (48, 0)
    assert stats[1]["hits"] == 48 and stats[1]["prefix_samples"] == 48
    # epoch 2: block 3 froze -> every sample carried from the depth-3 entry through block 3 only, never from input
    assert stats[2]["extend_samples"] == 48 and stats[2]["prefix_samples"] == 48 and stats[2]["hits"] == 48
    assert stats[2]["depth"] == 4
    assert stats[3]["hits"] == 96
    cache = runner.cache
    assert all(cache.depths(i) == [4] for i in range(48))  # old-depth entries dropped once upgraded
    assert cache.size_bytes == 48 * 32 * 4  # one (32,) float32 state per sample, in memory


def test_variable_length_text_trimmed_and_repadded_gives_the_same_losses():
    data = Texts(24)
    plain, _, _ = train(tiny_bert(), data, cached=False, depth0=2, deeper_at=2, lr=0.01)
    cached, runner, stats = train(tiny_bert(), data, cached=True, depth0=2, deeper_at=2, lr=0.01)
    assert torch.equal(plain, cached), (plain - cached).abs().max()
    assert stats[1]["hits"] == 24 and stats[2]["extend_samples"] == 24
    # each sample stored cut to its true length: sum(lengths) x hidden 32 x 4 bytes
    assert runner.cache.size_bytes == int(data.lengths.sum()) * 32 * 4
    assert runner.cache.lookup([0], 3)[0].shape == (int(data.lengths[0]), 32)


def test_float16_storage_is_close_and_half_the_size():
    data = Texts(8)
    batch = collate(data, range(8))
    model = tiny_bert().eval()
    freezer = frozen(model, 3)
    full = split_for(model, freezer.blocks).full(model, batch)
    sizes = {}
    for dtype in (None, torch.float16, torch.bfloat16):
        runner = CachedPrefix(model, freezer.blocks, cache=ActivationCache(dtype=dtype), freezer=freezer)
        first = runner.forward(batch)  # computed
        again = runner.forward(batch)  # from the cache
        assert runner.cache.hits == 8
        assert torch.equal(first, full)
        state = runner.cache.get_batch(range(8), 3, pad_to=12)
        assert state.dtype == torch.float32  # cast back to the compute dtype
        if dtype is None:
            assert torch.equal(again, full)
        else:
            assert torch.allclose(again, full, atol=1e-2) and not torch.equal(again, full)
        sizes[dtype] = runner.cache.size_bytes
    assert sizes[torch.float16] * 2 == sizes[None] == int(data.lengths[:8].sum()) * 32 * 4
    assert sizes[torch.bfloat16] == sizes[torch.float16]


# ---- disk shards ---------------------------------------------------------------------------------------------


def test_the_memory_budget_holds_the_write_buffer_too(tmp_path):
    # `freeze.cache.budget_mb=1` held 60 MiB: the default 64 MiB write buffer waited in memory above the budget
    budget, row = 64 * 2**10, 256 * 4  # 64 KiB; one sample's state: 1 KiB
    cache = ActivationCache(budget_bytes=budget, directory=tmp_path)  # the default shard_bytes, 64 MiB
    states = torch.randn(160, 256)
    for first in range(0, 160, 8):
        cache.put_batch(range(first, first + 8), 1, states[first:first + 8])
        assert cache.memory_bytes <= budget + 8 * row  # give or take one put_batch
    assert cache.memory_bytes <= budget and cache.disk_bytes > 0 and len(cache.shard_paths()) >= 4
    assert torch.equal(cache.get_batch(range(160), 1), states)  # what spilled reads back
    cache.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_disk_shards_read_back_equal_and_a_corrupt_shard_is_recomputed(tmp_path, damage):
    data = Blobs(32)
    model = mlp().eval()
    freezer = frozen(model, 3)
    cache = ActivationCache(budget_bytes=8 * 32 * 4, directory=tmp_path, shard_bytes=0)
    runner = CachedPrefix(model, freezer.blocks, cache=cache, freezer=freezer)
    split = runner.split
    batches = [collate(data, range(i, i + 8)) for i in range(0, 32, 8)]
    for batch in batches:
        runner.forward(batch)
    # the first batch fits the budget; the three others spilled, one shard each, with an index of sizes and hashes
    assert cache.memory_bytes == 8 * 32 * 4
    shards = cache.shard_paths()
    assert len(shards) == 3 and cache.disk_bytes == sum(p.stat().st_size for p in shards)
    assert cache.size_bytes == cache.memory_bytes + cache.disk_bytes
    index = json.loads((cache.path / "index.json").read_text())
    assert {p.name for p in shards} == set(index["shards"])
    assert all(len(s["sha256"]) == 64 and s["size"] > 0 for s in index["shards"].values())
    for batch in batches:
        expected = split.prefix(model, batch, 3)
        assert torch.equal(cache.get_batch(batch["index"], 3), expected)
    # damage the shard holding samples 8..15
    target = cache.path / next(n for n, s in index["shards"].items() if "8:3" in s["entries"])
    raw = bytearray(target.read_bytes())
    if damage == "flip":
        raw[-40] ^= 0xFF
        target.write_bytes(bytes(raw))
    else:
        target.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.warns(RuntimeWarning, match="corrupt"):
        assert cache.get_batch(batches[1]["index"], 3) is None  # never garbage
    assert cache.corrupt_shards == 1 and not target.exists()
    assert all(cache.depths(i) == [] for i in range(8, 16))
    before = runner.prefix_samples
    logits = runner.forward(batches[1])  # recomputed and stored again
    assert runner.prefix_samples == before + 8
    assert torch.equal(logits, split.full(model, batches[1]))
    assert torch.equal(cache.get_batch(batches[1]["index"], 3), split.prefix(model, batches[1], 3))
    assert torch.equal(cache.get_batch(batches[2]["index"], 3), split.prefix(model, batches[2], 3))  # others intact
    assert cache.corrupt_shards == 1
    path = cache.path
    cache.close()
    assert not path.exists()


def test_a_cache_folder_deleted_during_the_run_is_made_again_and_its_entries_computed_again(tmp_path):
    # a temp-folder cleaner removed the spill folder: the next shard write raised a raw FileNotFoundError mid-epoch
    import shutil

    data = Blobs(32)
    model = mlp().eval()
    freezer = frozen(model, 3)
    cache = ActivationCache(budget_bytes=0, directory=tmp_path, shard_bytes=0)
    runner = CachedPrefix(model, freezer.blocks, cache=cache, freezer=freezer)
    batches = [collate(data, range(i, i + 8)) for i in range(0, 32, 8)]
    runner.forward(batches[0])
    shutil.rmtree(cache.path)
    with pytest.warns(RuntimeWarning, match="was deleted during the run and was made again"):
        runner.forward(batches[1])  # spills into the folder made again
    with pytest.warns(RuntimeWarning, match="the file is missing"):
        logits = runner.forward(batches[0])  # its shard went with the folder: computed again, not garbage
    assert torch.equal(logits, runner.split.full(model, batches[0]))
    assert torch.equal(cache.get_batch(batches[1]["index"], 3), runner.split.prefix(model, batches[1], 3))
    cache.close()


# ---- refusals and stale entries ----------------------------------------------------------------------------


def test_random_augmentation_is_refused_without_touching_the_random_stream():
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    with pytest.raises(CacheRefused, match="random augmentation in the dataset") as err:
        check_deterministic(Blobs(8, noise=0.1))
    assert "pixel_values" in str(err.value) and "cache: off" in str(err.value)
    check_deterministic(Blobs(8))  # deterministic: accepted
    assert torch.equal(torch.rand(3), expected)


def _full_disk(cache, path):
    """Make the cache's next shard write hit a full disk, for real: its temporary file is a link to /dev/full."""
    path.mkdir(parents=True, exist_ok=True)
    (path / f".shard-{cache._shard_counter + 1:06d}.safetensors.tmp").symlink_to("/dev/full")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_keeps_the_entries_in_memory_and_a_fallback_cache_turns_itself_off(tmp_path):
    # a full disk under the cache's shards ended a run with three chained tracebacks, in mode auto too
    data, model = Blobs(32), mlp().eval()
    freezer = frozen(model, 3)
    batches = [collate(data, range(i, i + 8)) for i in range(0, 32, 8)]
    cache = ActivationCache(budget_bytes=0, directory=tmp_path, shard_bytes=0)  # every batch spills at once
    cache.put_batch(range(8), 1, torch.ones(8, 4))  # makes the folder
    _full_disk(cache, cache.path)
    with pytest.raises(CacheWriteError, match=r"could not write to .*No space left on device\. Free space there"):
        cache.put_batch(range(8, 16), 1, torch.full((8, 4), 2.0))
    assert torch.equal(cache.get_batch(range(8, 16), 1), torch.full((8, 4), 2.0))  # kept, in memory
    assert not (cache.path / ".shard-000002.safetensors.tmp").exists()  # no half-written file left
    cache.close()

    runner = CachedPrefix(model, freezer.blocks, freezer=freezer, fallback=True,
                          cache=ActivationCache(budget_bytes=0, directory=tmp_path / "fb", shard_bytes=0))
    runner.forward(batches[0])
    folder = runner.cache.path
    _full_disk(runner.cache, folder)
    with pytest.warns(RuntimeWarning, match="activation cache turned off.*No space left on device") as caught:
        logits = runner.forward(batches[1])
    assert "turn itself off" not in str(caught[0].message)  # it did: no advice to let it
    assert torch.equal(logits, model(batches[1]["pixel_values"])) and runner.disabled and not folder.exists()
    assert torch.equal(runner.forward(batches[2]), model(batches[2]["pixel_values"]))  # the full forward from now on
    runner = CachedPrefix(model, freezer.blocks, freezer=freezer,
                          cache=ActivationCache(budget_bytes=0, directory=tmp_path / "on", shard_bytes=0))
    runner.forward(batches[0])
    _full_disk(runner.cache, runner.cache.path)
    with pytest.raises(CacheWriteError, match="let it turn itself off"):  # mode on: the run stops, saying why
        runner.forward(batches[1])


def test_changed_inputs_of_a_cached_sample_are_refused_or_fall_back():
    model = mlp().eval()
    freezer = frozen(model, 3)
    batch = collate(Blobs(8), range(8))
    runner = CachedPrefix(model, freezer.blocks, freezer=freezer)
    runner.forward(batch)
    for changed in (batch["pixel_values"] + 1e-3 * torch.randn(8, 16), batch["pixel_values"].flip(-1)):
        with pytest.raises(CacheRefused, match="inputs of sample 0 changed.*random augmentation"):
            runner.forward({**batch, "pixel_values": changed})
    runner = CachedPrefix(model, freezer.blocks, freezer=freezer, fallback=True)
    runner.forward(batch)
    flipped = {**batch, "pixel_values": batch["pixel_values"].flip(-1)}
    with pytest.warns(RuntimeWarning, match="turned off"):
        logits = runner.forward(flipped)
    assert torch.equal(logits, model(flipped["pixel_values"])) and runner.disabled and len(runner.cache) == 0


def test_stochastic_modules_in_the_prefix_are_refused_by_name():
    batch = collate(Blobs(8), range(8))
    # a Dropout between two frozen blocks belongs to no block, so the Freezer leaves it training
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    freezer = frozen(model, 2)
    model.train()
    with pytest.raises(CacheRefused, match=r"module '1' .*Dropout\(p=0.5\) in training mode"):
        CachedPrefix(model, freezer.blocks, freezer=freezer).forward(batch)
    runner = CachedPrefix(model, freezer.blocks, freezer=freezer, fallback=True)
    with pytest.warns(RuntimeWarning, match="turned off"):
        torch.manual_seed(5)
        logits = runner.forward(batch)
    torch.manual_seed(5)
    assert torch.equal(logits, model(batch["pixel_values"])) and runner.full_forwards == 1
    # train_bn=True keeps BatchNorm of frozen blocks training: batch statistics
    model = mlp()
    freezer = frozen(model, 3, train_bn=True)
    model.train()
    with pytest.raises(CacheRefused, match=r"module '1' .*BatchNorm1d in training mode"):
        CachedPrefix(model, freezer.blocks, freezer=freezer).forward(batch)
    # without a freezer nothing puts frozen blocks in eval mode: BERT's embedding dropout is named
    bert = tiny_bert().train()
    with pytest.raises(CacheRefused, match=r"bert\.embeddings\.dropout"):
        check_prefix_deterministic(discover_blocks(bert), 1)
    check_prefix_deterministic(discover_blocks(bert.eval()), 1)


def test_changed_prefix_weights_and_thaws_invalidate_entries():
    model = mlp().eval()
    freezer = frozen(model, 3)
    batch = collate(Blobs(8), range(8))
    runner = CachedPrefix(model, freezer.blocks, freezer=freezer)
    runner.forward(batch)
    with torch.no_grad():
        model[3].weight.mul_(1.5)  # a frozen block modified in place (e.g. a checkpoint loaded into it)
    assert torch.equal(runner.forward(batch), model(batch["pixel_values"]))
    assert runner.invalidations == 8 and runner.prefix_samples == 16
    freezer.thaw(2)  # depth 3 -> 2: entries through block 2 are stale
    freezer.thaw(1)
    assert freezer.frozen_prefix == 1
    runner.forward(batch)
    assert runner.cache.depth == 1 and all(runner.cache.depths(i) == [1] for i in range(8))
    with pytest.raises(ValueError, match="beyond the frozen prefix"):
        runner.forward(batch, depth=3)


def test_a_cast_prefix_invalidates_its_entries_and_a_forward_under_another_autocast_runs_the_full_model():
    # Module.to(dtype) changes no tensor version: the float32 entries were served to the float64 model (a raw dtype
    # error on a fully cached batch). Entries filled under bfloat16 autocast were served to a float32 evaluation (up
    # to 9.5e-4 off on a half-cached batch, in silence; a raw dtype error on a fully cached one).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))  # no buffers
    freezer = frozen(model, 2)
    batch = collate(Blobs(8), range(8))
    runner = CachedPrefix(model, freezer.blocks, freezer=freezer)
    runner.forward(batch)
    model.to(torch.float64)
    batch64 = {**batch, "pixel_values": batch["pixel_values"].double()}
    assert torch.equal(runner.forward(batch64), model(batch64["pixel_values"]))
    assert runner.invalidations == 8 and runner.prefix_samples == 16

    model = mlp().eval()
    freezer = frozen(model, 3)

    model = mlp().eval()
    freezer = frozen(model, 3)
    runner = CachedPrefix(model, freezer.blocks, freezer=freezer)
    data = Blobs(16)
    batch, rest = collate(data, range(8)), collate(data, range(8, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        runner.forward(batch)  # samples 0..7 cached in bfloat16 precision
    assert runner.precision == (True, torch.bfloat16)
    mixed = collate(data, [*range(4), *range(8, 12)])  # 4 cached samples, 4 new
    with pytest.warns(UserWarning, match="this forward runs without autocast, but the cache was filled under autocast "
                                         "torch.bfloat16"):
        assert torch.equal(runner.forward(mixed), model(mixed["pixel_values"]))
    assert torch.equal(runner.forward(batch), model(batch["pixel_values"]))  # every sample cached
    assert runner.full_forwards == 2 and runner.cache.hits == 0 and runner.prefix_samples == 8
    with torch.autocast("cpu", dtype=torch.bfloat16):
        runner.forward(rest)
        runner.forward(batch)  # still served under the precision it was filled under
    assert runner.cache.hits == 8


def test_auto_budget_is_a_quarter_of_the_available_host_memory(monkeypatch):
    from types import SimpleNamespace

    from layerfreeze.compute import store

    monkeypatch.setattr(store.psutil, "virtual_memory", lambda: SimpleNamespace(available=8 * 2**30))
    assert store.auto_budget_bytes() == 2 * 2**30
    assert ActivationCache().budget_bytes == 2 * 2**30  # the default budget
    assert ActivationCache(budget_bytes=5).budget_bytes == 5
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
        store.auto_budget_bytes(0)
    from layerfreeze.train.config import build_config

    assert build_config({}).freeze.cache.mode == "auto" and build_config({}).freeze.cache.budget_mb is None


def test_the_input_key_of_an_nn_sequential_is_named_found_or_asked_for():
    """Issue 32: a non-Hugging Face model's input under another key than "pixel_values"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    freezer = Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "static", {"k": 1})
    x = torch.randn(6, 4)
    expected = model(x)
    named = CachedPrefix(model, freezer=freezer, input_key="features")
    assert torch.equal(named({"features": x, "index": torch.arange(6)}), expected)
    found = CachedPrefix(model, freezer=freezer)  # the batch's one tensor besides the index and the labels
    assert torch.equal(found({"x": x, "labels": torch.zeros(6, dtype=torch.long), "index": list(range(6))}),
                       expected)
    assert found.split.input_keys == ("x",) and found.cache.misses == 6
    assert torch.equal(found({"x": x, "index": (torch.arange(6)[:, None])}), expected) and found.cache.hits == 6
    with pytest.raises(ValueError, match=r"no 'pixel_values' .* several could be it \(x, mask\); its keys: x, "
                                         r"mask, index\. Name the input: CachedPrefix\(model, freezer=freezer, "
                                         r"input_key='x'\)"):
        CachedPrefix(model, freezer=freezer)({"x": x, "mask": x, "index": torch.arange(6)})
    with pytest.raises(ValueError, match=r"the batch has no 'features', the model input the nn.Sequential split "
                                         r"expects; its keys: x, index\. Name the batch key .* input_key=\.\.\."):
        named({"x": x, "index": torch.arange(6)})
    with pytest.raises(ValueError, match=r"the batch has no 'index' \(each sample's position"):
        found({"x": x})
    fallback = CachedPrefix(model, freezer=freezer, fallback=True)  # falls back, as for its other refusals
    with pytest.warns(RuntimeWarning, match=r"activation cache turned off.*the batch has no 'index'"):
        assert torch.equal(fallback({"x": x}), expected)
    assert fallback.disabled and torch.equal(fallback({"x": x, "index": torch.arange(6)}), expected)
    with pytest.raises(ValueError, match="one integer sample position per sample"):
        found({"x": x, "index": ["a"] * 6})
    # a TensorDataset's (x, y) batch: one line saying what to return, not "'tuple' object has no attribute 'items'"
    with pytest.raises(TypeError, match=r"CachedPrefix needs a dict batch .* not a tuple: have the dataset return "
                                        r"dicts"):
        CachedPrefix(model, freezer=freezer)((x, torch.zeros(6, dtype=torch.long)))


def test_a_fixed_input_family_names_its_keys_and_refuses_input_key():
    model = tiny_bert()
    freezer = Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "static", {"k": 1})
    with pytest.raises(ValueError, match=r"input_key='x'\): the Hugging Face BertForSequenceClassification split "
                                         r"reads the batch keys input_ids, token_type_ids, attention_mask, which are "
                                         r"fixed"):
        CachedPrefix(model, freezer=freezer, input_key="x")
    with pytest.raises(ValueError, match=r"the batch has no 'input_ids', the model input the Hugging Face "
                                         r"BertForSequenceClassification split expects; its keys: tokens, index"):
        CachedPrefix(model, freezer=freezer)({"tokens": torch.zeros(2, 4, dtype=torch.long), "index": [0, 1]})


def test_changed_inputs_name_every_likely_cause_not_only_augmentation():
    # an "index" that was the position within the batch was blamed on "random augmentation in the dataset"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    freezer = Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "static", {"k": 1})
    forward = CachedPrefix(model, freezer=freezer, input_key="x")
    forward({"x": torch.randn(4, 4), "index": torch.arange(4)})
    with pytest.raises(CacheRefused) as err:
        forward({"x": torch.randn(4, 4), "index": torch.arange(4)})  # the next batch, the same positions
    said = str(err.value)
    assert said.startswith("the inputs of sample 0 changed since its prefix output was cached. The cache keys each "
                           "sample by its 'index'")
    assert "random augmentation" in said and "a position within the batch" in said and "two datasets" in said


def test_a_refused_tuple_batch_keeps_the_input_key_search_and_a_short_index_is_named():
    # a (x, y) tuple batch was refused after the input-key search had been switched off: the next, right batch
    # ({"x": ...}) was refused for lacking 'pixel_values'; an 'index' shorter than the batch failed with a shape error
    # a call later
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "static", {"k": 1}) as freezer:
        runner = CachedPrefix(model, freezer=freezer)
        x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
        with pytest.raises(TypeError, match="needs a dict batch"):
            runner((x, y))
        assert runner({"x": x, "labels": y, "index": torch.arange(4)}).shape == (4, 2)
        with pytest.raises(ValueError, match=r"'index' holds 3 sample positions for 4 samples \(its 'x' has 4 rows"):
            runner({"x": x, "labels": y, "index": torch.arange(3)})
