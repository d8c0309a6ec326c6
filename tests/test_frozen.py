"""Frozen models beside the trained one: sequential, asynchronous pipeline and precompute give identical losses;
non-finite frozen outputs and worker errors surface with names and tracebacks."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertModel

from layerfreeze.frozen import (
    FrozenModule,
    FrozenPipeline,
    FrozenWorkerError,
    NonFiniteOutputError,
    PrecomputedDataset,
    precompute,
)


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
    assert set(names) == {"layerfreeze-frozen"}
    assert pipe._thread is None  # joined

    with pytest.raises(FrozenWorkerError, match=r"(?s)ValueError.*bad sample 5.*worker traceback.*prepare"):
        list(FrozenPipeline(range(8), prepare))

    pipe = FrozenPipeline(range(1000), lambda x: x, queue_size=2)
    for x in pipe:
        if x == 3:
            break
    pipe.close()
    assert pipe._thread is None
