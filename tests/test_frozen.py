"""Frozen models beside the trained one: sequential, asynchronous pipeline and precompute give identical losses;
non-finite frozen outputs and worker errors surface with names and tracebacks."""

from __future__ import annotations

import random
import re
import threading
import time

import numpy
import pytest
import torch
from torch import nn
from transformers import BertConfig, BertModel

from layerfreeze.compute.frozen import (
    FrozenDifferentiable,
    FrozenModule,
    FrozenPipeline,
    FrozenWorkerError,
    GlobalRNGUsedError,
    NonFiniteOutputError,
    PrecomputeRefused,
    per_sample_generators,
)
from layerfreeze.compute.precomputed import PrecomputedDataset, precompute


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=40):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 100, (n, 12), generator=g)
        self.mask = torch.ones(n, 12, dtype=torch.long)
        self.mask[::3, 8:] = 0
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i],
                "index": torch.tensor(i)}


def encoder() -> FrozenModule:
    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=64), add_pooling_layer=False)
    return FrozenModule(bert, name="text encoder")


def encode(frozen: FrozenModule, batch) -> torch.Tensor:
    """Mean-pooled last hidden state ``(B, 32)``."""
    hidden = frozen(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return (hidden * mask).sum(1) / mask.sum(1)


def train(mode: str) -> list[float]:
    frozen, data = encoder(), Tokens()
    torch.manual_seed(1)
    head = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    losses = []
    store = precompute(data, lambda b: encode(frozen, b), batch_size=8) if mode == "precompute" else None
    for epoch in range(3):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch)).tolist()
        loader = torch.utils.data.DataLoader(PrecomputedDataset(data, store) if store else data,
                                             batch_sampler=[order[i:i + 8] for i in range(0, len(order), 8)])
        if mode == "sequential":
            batches = ({"features": encode(frozen, b), "labels": b["labels"]} for b in loader)
        elif mode == "async":
            batches = FrozenPipeline(loader, lambda b: {"features": encode(frozen, b), "labels": b["labels"]})
        else:
            batches = loader
        for batch in batches:
            loss = nn.functional.cross_entropy(head(batch["features"]), batch["labels"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


def test_sequential_async_and_precompute_give_identical_losses():
    sequential = train("sequential")
    assert len(sequential) == 15
    assert train("async") == sequential
    assert train("precompute") == sequential


def test_frozen_module_runs_without_grad_and_returns_float32():
    frozen = encoder()
    frozen.dtype = torch.bfloat16
    frozen.module.to(torch.bfloat16)
    batch = Tokens()[0]
    out = frozen(input_ids=batch["input_ids"][None], attention_mask=batch["attention_mask"][None])
    assert out.last_hidden_state.dtype == torch.float32 and not out.last_hidden_state.requires_grad
    assert not any(p.requires_grad for p in frozen.module.parameters()) and not frozen.module.training


def test_float16_overflow_is_named():
    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, z):
            return self.proj(z) * 60000.0  # fine in float32, overflows float16's 65504

    frozen = FrozenModule(Decoder(), dtype=torch.float16, name="vae decoder")
    with pytest.raises(NonFiniteOutputError, match="vae decoder produced NaN/Inf in output"):
        frozen(torch.full((2, 4), 3.0))
    assert torch.isfinite(FrozenModule(Decoder(), name="fp32")(torch.full((2, 4), 3.0))).all()


def test_pipeline_runs_in_another_thread_keeps_order_and_surfaces_worker_errors():
    names = []

    def prepare(x):
        names.append(threading.current_thread().name)
        if x == 5:
            raise ValueError("bad sample 5")
        return x * 10

    pipe = FrozenPipeline(range(5), prepare, queue_size=1)
    assert list(pipe) == [0, 10, 20, 30, 40]
    assert names[0] == threading.current_thread().name  # the first batch runs here, with the global RNG checked
    assert set(names[1:]) == {"layerfreeze-frozen"}
    assert pipe._run.thread is None  # joined

    with pytest.raises(FrozenWorkerError, match=r"(?s)ValueError.*bad sample 5.*worker traceback.*prepare"):
        list(FrozenPipeline(range(8), prepare))
    with pytest.raises(FrozenWorkerError, match=r"ValueError in the frozen-model function \(the first batch"):
        list(FrozenPipeline(range(5, 8), prepare))  # the first batch runs in this thread: the same error type

    pipe = FrozenPipeline(range(1000), lambda x: x, queue_size=2)
    for x in pipe:
        if x == 3:
            break
    pipe.close()
    assert pipe._run.thread is None


# --- frozen models in the gradient path, RNG safety, threads ----------------------------------------------------


def _trainable_and_frozen(dtype=None):
    torch.manual_seed(0)
    trainable = nn.Linear(6, 8)
    frozen_net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    return trainable, frozen_net, FrozenDifferentiable(frozen_net, dtype=dtype, name="base denoiser")


def test_frozen_differentiable_keeps_the_graph_and_returns_float32_gradients():
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    trainable, net, frozen = _trainable_and_frozen()
    reference = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    reference.load_state_dict(net.state_dict())
    trainable_ref = nn.Linear(6, 8)
    trainable_ref.load_state_dict(trainable.state_dict())
    frozen(trainable(x)).square().mean().backward()
    reference(trainable_ref(x)).square().mean().backward()
    assert torch.equal(trainable.weight.grad, trainable_ref.weight.grad)  # float32: the same gradient, bit for bit
    assert all(p.grad is None and not p.requires_grad for p in net.parameters()) and not net.training

    trainable_bf, net_bf, frozen_bf = _trainable_and_frozen(torch.bfloat16)
    out = frozen_bf(trainable_bf(x))
    assert out.dtype == torch.float32 and out.requires_grad
    assert next(net_bf.parameters()).dtype == torch.bfloat16
    out.square().mean().backward()
    grad = trainable_bf.weight.grad
    assert grad.dtype == torch.float32 and torch.isfinite(grad).all()  # the trainable model stays float32
    assert torch.allclose(grad, trainable_ref.weight.grad, rtol=0.05, atol=1e-3)
    with torch.no_grad():
        assert not frozen_bf(trainable_bf(x)).requires_grad  # evaluation: no graph


def test_half_precision_frozen_model_never_gives_the_scaler_half_gradients():
    """A bfloat16 frozen model beside a float32 trainable one, through GradScaler (CPU): every gradient the
    scaler unscales is float32, so "Attempting to unscale FP16 gradients" cannot happen."""
    trainable, _, frozen = _trainable_and_frozen(torch.bfloat16)
    opt = torch.optim.SGD(trainable.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(5, 6)
    scaler.scale(frozen(trainable(x)).square().mean()).backward()
    assert {p.grad.dtype for p in trainable.parameters()} == {torch.float32}
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


@pytest.mark.cuda
def test_float16_frozen_model_beside_float32_trainable_under_cuda_grad_scaler():
    torch.manual_seed(0)
    trainable = nn.Linear(6, 8).cuda()
    frozen = FrozenDifferentiable(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)), device="cuda",
                                  dtype=torch.float16, output_device="cuda")
    opt = torch.optim.AdamW(trainable.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(3):
        scaler.scale(frozen(trainable(torch.randn(5, 6, device="cuda"))).square().mean()).backward()
        scaler.unscale_(opt)  # raises "Attempting to unscale FP16 gradients." if a float16 gradient got here
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert {p.dtype for p in trainable.parameters()} == {torch.float32}


def test_precompute_refuses_a_model_in_the_gradient_path():
    data = Tokens(8)
    _, _, frozen = _trainable_and_frozen()
    with pytest.raises(PrecomputeRefused, match="base denoiser is in the gradient path"):
        precompute(data, lambda b: frozen(torch.randn(len(b["index"]), 8, generator=torch.Generator())),
                   batch_size=4)
    trainable = nn.Linear(12, 3)
    with pytest.raises(PrecomputeRefused, match="requires grad"):
        precompute(data, lambda b: trainable(b["input_ids"].float()), batch_size=4)


def test_frozen_functions_that_draw_from_the_global_rng_are_refused():
    data = Tokens(8)
    with pytest.raises(GlobalRNGUsedError, match="latent_dist.parameters"):
        precompute(data, lambda b: torch.randn(len(b["index"]), 3), batch_size=4)
    with pytest.raises(GlobalRNGUsedError, match="FrozenPipeline"):
        list(FrozenPipeline(range(4), lambda x: torch.rand(1) + x))
    assert len(list(FrozenPipeline(range(4), lambda x: torch.rand(1) + x, check_rng=False))) == 4


class Encoder(nn.Module):
    """A stand-in VAE encoder: returns the latent distribution's mean and log-variance ``(B, 2, 4)``."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(12, 8)

    def forward(self, x):
        return self.net(x).view(-1, 2, 4)


def _train_vae_style(mode: str, sample_in: str, slow_trainer_s: float = 0.0) -> list[float]:
    """A trainer beside a frozen encoder whose latents are *sampled*: in the trainer with its own generator
    (``sample_in="trainer"``) or in the frozen function with per-sample generators (``"frozen"``)."""
    torch.manual_seed(0)
    frozen = FrozenModule(Encoder(), name="vae encoder")
    torch.manual_seed(1)
    head = nn.Linear(4, 3)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    data = Tokens(32)
    g = torch.Generator().manual_seed(2)
    losses = []

    def prepare(batch, epoch):
        params = frozen(batch["input_ids"].float() / 100)
        if sample_in == "frozen":
            gens = per_sample_generators(batch["index"].tolist(), seed=3, epoch=epoch)
            eps = torch.stack([torch.randn(4, generator=gen) for gen in gens])
            return {"latents": params[:, 0] + params[:, 1].mul(0.5).exp() * eps, "labels": batch["labels"]}
        return {"params": params, "labels": batch["labels"]}

    store = precompute(data, lambda b: frozen(b["input_ids"].float() / 100), batch_size=8) \
        if mode == "precompute" else None
    for epoch in range(2):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch)).tolist()
        loader = torch.utils.data.DataLoader(PrecomputedDataset(data, store, feature_key="params") if store else data,
                                             batch_sampler=[order[i:i + 8] for i in range(0, len(order), 8)])
        if mode == "sequential":
            batches = (prepare(b, epoch) for b in loader)
        elif mode == "async":
            batches = FrozenPipeline(loader, lambda b, e=epoch: prepare(b, e), queue_size=3)
        else:
            batches = ({"params": b["params"], "labels": b["labels"]} for b in loader)
        for batch in batches:
            if "latents" in batch:
                latents = batch["latents"]
            else:
                params = batch["params"]
                latents = params[:, 0] + params[:, 1].mul(0.5).exp() * torch.randn(params[:, 0].shape, generator=g)
            noise = torch.randn(latents.shape)  # the trainer's own draws from the global RNG
            loss = nn.functional.cross_entropy(head(latents + 0.1 * noise), batch["labels"])
            time.sleep(slow_trainer_s)  # a trainer slower than the worker: the worker runs ahead
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


def test_sampling_frozen_functions_give_the_sequential_losses_whatever_the_timing():
    torch.manual_seed(5)
    sequential = _train_vae_style("sequential", "trainer")
    assert len(sequential) == 8
    torch.manual_seed(5)
    assert _train_vae_style("async", "trainer", slow_trainer_s=0.02) == sequential
    torch.manual_seed(5)
    assert _train_vae_style("precompute", "trainer") == sequential
    torch.manual_seed(5)
    per_sample = _train_vae_style("sequential", "frozen")
    torch.manual_seed(5)
    assert _train_vae_style("async", "frozen", slow_trainer_s=0.02) == per_sample


def test_per_sample_generators_depend_on_seed_epoch_and_index_only():
    a = [torch.randn(3, generator=g) for g in per_sample_generators([4, 7], seed=1, epoch=0)]
    b = [torch.randn(3, generator=g) for g in per_sample_generators([7, 4], seed=1, epoch=0)]
    c = [torch.randn(3, generator=g) for g in per_sample_generators([4], seed=1, epoch=1)]
    assert torch.equal(a[0], b[1]) and torch.equal(a[1], b[0]) and not torch.equal(a[0], c[0])


def test_pipeline_splits_threads_and_reports_overlap():
    seen = []
    before = torch.get_num_threads()
    pipe = FrozenPipeline(range(6), lambda x: seen.append((threading.current_thread().name,
                                                           torch.get_num_threads())) or x, threads=(1, 1))
    trainer_threads = []
    for _ in pipe:
        trainer_threads.append(torch.get_num_threads())
        time.sleep(0.01)
    assert {n for _, n in seen} == {1} and set(trainer_threads) == {1}
    assert torch.get_num_threads() == before  # restored
    stats = pipe.stats()
    assert stats["batches"] == 6 and 0.0 <= stats["overlap"] <= 1.0 and stats["threads"] == (1, 1)
    worker, trainer = FrozenPipeline.auto_threads()
    assert worker >= 1 and trainer >= 1
    with pytest.raises(ValueError, match="threads"):
        FrozenPipeline(range(2), lambda x: x, threads=(0, 1))


def test_float16_vae_overflow_is_detected_and_named():
    diffusers = pytest.importorskip("diffusers")
    from benchmarks.controlnet.models import LatentParameters, _vae_config

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(**_vae_config(tiny=True))
    x = torch.full((1, 1, 32, 32), 1.0)
    assert torch.isfinite(FrozenModule(LatentParameters(vae))(x)).all()
    with torch.no_grad():
        vae.encoder.conv_in.weight.mul_(1e6)  # activations beyond float16's 65504, as an fp16 SD VAE's do
    with pytest.raises(NonFiniteOutputError, match="VAE encoder produced NaN/Inf"):
        FrozenModule(LatentParameters(vae), dtype=torch.float16, name="VAE encoder")(x)


def test_precompute_as_the_readme_writes_it_and_what_precomputed_dataset_returns():
    """Issue 32: ``precompute(dataset, fn)`` (no batch size) over items holding an int "index"; each item of
    PrecomputedDataset is the dataset's item plus fn's output row under "features"."""

    class IntIndex(Tokens):
        def __getitem__(self, i):
            return {**super().__getitem__(i), "index": i}

    frozen, data = encoder(), IntIndex(40)
    store = precompute(data, lambda b: encode(frozen, b))
    full = encode(frozen, {"input_ids": data.ids, "attention_mask": data.mask})
    item = PrecomputedDataset(data, store, drop=("input_ids",))[7]
    assert sorted(item) == ["attention_mask", "features", "index", "labels"] and item["index"] == 7
    torch.testing.assert_close(item["features"], full[7], rtol=1e-5, atol=1e-6)
    assert len(store) == 40
    with pytest.raises(ValueError, match=r"items must be dicts holding 'index' .* an item is a dict with keys "
                                         r"input_ids, attention_mask, labels"):
        precompute([{k: v for k, v in data[i].items() if k != "index"} for i in range(4)], lambda b: b["labels"])


def test_a_pipeline_left_early_starts_the_next_iteration_clean_and_close_in_the_loop_ends_it():
    # a batch the worker put while close() drained reached the next iteration (a sample trained twice in an epoch);
    # close() inside the loop hung the next get forever
    from torch.utils.data import DataLoader

    pipe = FrozenPipeline(DataLoader(list(range(40)), batch_size=4), lambda b: b, queue_size=2)
    for _ in range(10):
        seen = []
        for step, batch in enumerate(pipe):
            seen.append(batch.tolist())
            if step == 2:
                time.sleep(0.05)  # the worker fills the queue, and waits on it
                break
        assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    got = []
    t0 = time.monotonic()
    for step, batch in enumerate(pipe):
        got.append(int(batch[0]))
        if step == 2:
            pipe.close()  # an early-stop handler
    assert got == [0, 4, 8] and time.monotonic() - t0 < 10 and pipe._run.thread is None


def test_a_pipeline_whose_batches_draw_from_the_global_rng_is_refused():
    # random augmentation read in the worker thread: the trainer's own draws depended on timing, in silence
    from torch.utils.data import DataLoader, Dataset

    class Augmented(Dataset):
        def __init__(self, generator=None):
            self.generator = generator

        def __len__(self):
            return 16

        def __getitem__(self, i):
            return torch.rand(2, generator=self.generator) + i

    with pytest.raises(GlobalRNGUsedError, match="reading a batch drew from the global random number generator"):
        list(FrozenPipeline(DataLoader(Augmented(), batch_size=4), lambda b: b))
    own = FrozenPipeline(DataLoader(Augmented(torch.Generator().manual_seed(0)), batch_size=4, shuffle=True,
                                    generator=torch.Generator().manual_seed(1)), lambda b: b)
    assert len(list(own)) == 4  # a generator of its own: accepted
    assert len(list(FrozenPipeline(DataLoader(Augmented(), batch_size=4), lambda b: b, check_rng=False))) == 4


def test_a_frozen_module_stays_in_eval_mode_when_a_parent_trains():
    # a distillation wrapper's .train() turned the teacher's dropout back on and let its BatchNorm statistics move
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4))
    frozen = FrozenModule(teacher)
    wrapper = nn.ModuleDict({"teacher": teacher, "student": nn.Linear(8, 4)})
    stats = teacher[1].running_mean.clone()
    wrapper.train()
    x = torch.randn(6, 8)
    assert torch.equal(frozen(x), frozen(x)) and torch.equal(teacher[1].running_mean, stats)
    assert not any(m.training for m in teacher.modules()) and wrapper["student"].training
    differentiable = FrozenDifferentiable(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)))
    inner = differentiable.module[1].running_var.clone()
    differentiable.module.train()
    differentiable(torch.randn(6, 8, requires_grad=True)).sum().backward()
    assert torch.equal(differentiable.module[1].running_var, inner)


def test_precompute_refuses_random_augmentation_and_a_corrupt_store_names_the_cause(tmp_path):
    # one draw per sample would be stored and trained on in every epoch, in silence; the global RNG is left as it was
    class Augmented(Tokens):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            return {**item, "input_ids": torch.roll(item["input_ids"], int(torch.randint(0, 12, ())))}

    frozen = encoder()
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with pytest.raises(PrecomputeRefused, match=r"item 0: 'input_ids' differs between two fetches \(random "
                                                r"augmentation.*FrozenPipeline"):
        precompute(Augmented(8), lambda b: encode(frozen, b), batch_size=4)
    assert torch.equal(torch.get_rng_state(), before)
    # a shard on disk that no longer matches its checksum: dropped with a warning, then a KeyError saying so
    from layerfreeze.compute.store import ActivationCache

    data = Tokens(8)
    store = precompute(data, lambda b: encode(frozen, b), batch_size=4,
                       store=ActivationCache(budget_bytes=0, directory=tmp_path, shard_bytes=0))
    shard = next(tmp_path.rglob("shard-*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match="precomputed again"), \
            pytest.raises(KeyError, match="found corrupt and dropped .* run precompute\\(\\) again"):
        [PrecomputedDataset(data, store)[i] for i in range(8)]


class Noisy(Tokens):
    """Random augmentation past the items precompute fetches twice (0-3): ``draw`` adds noise from a global RNG."""

    def __init__(self, draw):
        super().__init__(16)
        self.draw = draw

    def __getitem__(self, i):
        item = super().__getitem__(i)
        if i >= 4:
            item["input_ids"] = item["input_ids"] + self.draw()
        return item


@pytest.mark.parametrize("draw", [lambda: torch.randint(0, 2, (12,)), lambda: int(random.random() < 0.5),
                                  lambda: int(numpy.random.rand() < 0.5)], ids=["torch", "python", "numpy"])
def test_precompute_refuses_a_dataset_that_draws_from_a_global_rng_past_its_first_items(draw):
    # items 0-3 are fetched twice with the random states restored (the same draw twice): a dataset augmenting with
    # torch's, Python's or NumPy's global RNG was stored with one draw per sample, trained on every epoch, in silence
    frozen = encoder()
    with pytest.raises(PrecomputeRefused, match=r"reading dataset items 4-7 drew from or reseeded the global random "
                                                r"number generator \(torch's, Python's random or NumPy's"):
        precompute(Noisy(draw), lambda b: encode(frozen, b), batch_size=4)
    store = precompute(Noisy(lambda: 0), lambda b: encode(frozen, b), batch_size=4)  # no draw: stored
    assert len(store) == 16


def test_a_precomputed_store_paired_with_another_dataset_is_refused_not_read():
    # PrecomputedDataset(other_dataset, store) of the same size returned the first dataset's features for the other's
    # items; each item's inputs are now checked against what fn ran on for that sample
    frozen, data = encoder(), Tokens(16)
    store = precompute(data, lambda b: encode(frozen, b), batch_size=4)
    assert all(PrecomputedDataset(data, store)[i]["index"] == i for i in range(16))  # its own dataset: read
    other = Tokens(16)
    other.ids = other.ids.flip(0)  # the same size and keys, other samples
    with pytest.raises(PrecomputeRefused, match=r"item 0 \(index 0\): its 'input_ids' is not the one precompute "
                                                r"ran the frozen models on for this sample"):
        PrecomputedDataset(other, store)[0]
    other = Tokens(16)
    other.ids[5, 3] += 1  # one token of one sample
    assert PrecomputedDataset(other, store)[4]["index"] == 4
    with pytest.raises(PrecomputeRefused, match=r"item 5 \(index 5\)"):
        PrecomputedDataset(other, store)[5]


class Nested(torch.utils.data.Dataset):
    """Items with nested inputs, a list of views and a string: ``shift`` changes every sample's inputs."""

    def __init__(self, shift=0.0, text="doc"):
        self.x = torch.randn(8, 6, generator=torch.Generator().manual_seed(3)) + shift
        self.text = text

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"inputs": {"pixel_values": self.x[i]}, "views": [self.x[i], self.x[i].flip(0)],
                "text": f"{self.text} {i}", "index": i}


def test_nested_inputs_strings_and_an_item_without_tensors_are_fingerprinted_too():
    # only the item's top-level tensors were fingerprinted: a store paired with another dataset of nested inputs,
    # lists or strings returned the first dataset's features; an item with no top-level tensor crashed precompute
    store = precompute(Nested(), lambda b: b["inputs"]["pixel_values"].sum(1, keepdim=True), batch_size=4)
    assert PrecomputedDataset(Nested(), store)[5]["features"].shape == (1,)
    for other, path in ((Nested(shift=1.0), "inputs.pixel_values"), (Nested(text="page"), "text")):
        with pytest.raises(PrecomputeRefused, match=rf"item 5 \(index 5\): its '{re.escape(path)}' is not the one"):
            PrecomputedDataset(other, store)[5]
    texts = [{"text": f"doc {i}", "index": i} for i in range(6)]  # no tensor but the index
    store = precompute(texts, lambda b: torch.tensor([[float(len(t))] for t in b["text"]]), batch_size=4)
    assert float(PrecomputedDataset(texts, store)[3]["features"]) == 5.0
    with pytest.raises(PrecomputeRefused, match=r"its 'text' is not the one"):
        PrecomputedDataset([{**t, "text": t["text"].upper()} for t in texts], store)[3]


def test_a_dataset_that_seeds_the_global_rng_per_item_is_refused_saying_so():
    class Seeded(Tokens):
        def __getitem__(self, i):
            torch.manual_seed(i)  # deterministic per item, but the caller's random stream is not left as it was
            return super().__getitem__(i)

    frozen = encoder()
    with pytest.raises(PrecomputeRefused, match=r"drew from or reseeded .* or a seed set per item"):
        precompute(Seeded(16), lambda b: encode(frozen, b), batch_size=4)
