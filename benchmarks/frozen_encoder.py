"""A frozen text encoder feeding a small trainable model, three ways: sequential, asynchronous pipeline, precompute.

Frozen MiniLM-L6 (mean-pooled last hidden state, 384 features) encodes BBC News articles (128 tokens) for a
trainable MLP classifier (384 -> 256 -> 5), AdamW 1e-3, batch 32, 3 epochs, same seed and batches in every mode:

* sequential: encode each batch, then train on it;
* async: a background thread encodes the next batches while the trainer trains on the current one
  (:class:`layerfreeze.compute.frozen.FrozenPipeline`, queue of 2);
* precompute: encode the whole training set once (counted in epoch 1), then train from the stored features.

Prints per-epoch wall time, ratios to sequential, test accuracy, and whether all losses are identical.

    python -m benchmarks.frozen_encoder [--epochs 3] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.data import DataLoader, Subset

from benchmarks.cli import count, entry
from layerfreeze.compute.frozen import FrozenModule, FrozenPipeline
from layerfreeze.compute.precomputed import PrecomputedDataset, precompute
from layerfreeze.train import assets, data
from layerfreeze.train.loaders import quiet_transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=count(2), default=3,
                        help="epochs (>= 2: the table compares the later epochs with the first)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--limit", type=count(1), help="use only the first N training articles")
    parser.add_argument("--out", default="runs/bench-frozen-encoder")
    args = parser.parse_args()

    quiet_transformers()
    from transformers import AutoModel, AutoTokenizer

    texts, labels, classes = data.load_bbc_news()
    tokenizer = AutoTokenizer.from_pretrained(assets.minilm_dir(), local_files_only=True)
    full = data.TokenizedTextDataset(texts, labels, tokenizer, max_length=128)
    train_idx, test_idx = data.stratified_split(labels, 0.2, 0)
    train_set = Subset(full, train_idx[: args.limit] if args.limit else train_idx)
    test_set = Subset(full, test_idx)
    encoder = FrozenModule(AutoModel.from_pretrained(assets.minilm_dir(), local_files_only=True),
                           name="MiniLM-L6 encoder")

    def encode(batch):
        hidden = encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         token_type_ids=batch["token_type_ids"]).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return (hidden * mask).sum(1) / mask.sum(1)

    def prepared(batch):
        return {"features": encode(batch), "labels": batch["labels"]}

    results = {}
    for mode in ("sequential", "async", "precompute"):
        torch.manual_seed(0)
        head = nn.Sequential(nn.Linear(384, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, len(classes)))
        opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
        losses, epoch_s = [], []
        store = None
        for epoch in range(args.epochs):
            start = time.perf_counter()
            if mode == "precompute" and store is None:
                store = precompute(train_set, encode, batch_size=args.batch_size)
            order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(epoch)).tolist()
            sampler = [order[i:i + args.batch_size] for i in range(0, len(order), args.batch_size)]
            source = PrecomputedDataset(train_set, store) if store is not None else train_set
            loader = DataLoader(source, batch_sampler=sampler, generator=torch.Generator())
            if mode == "sequential":
                batches = (prepared(b) for b in loader)
            elif mode == "async":
                batches = FrozenPipeline(loader, prepared, queue_size=2)
            else:
                batches = loader
            head.train()
            for batch in batches:
                loss = nn.functional.cross_entropy(head(batch["features"]), batch["labels"])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
            epoch_s.append(time.perf_counter() - start)
        head.eval()
        correct = 0
        with torch.no_grad():
            for batch in DataLoader(test_set, batch_size=64, generator=torch.Generator()):
                correct += int((head(encode(batch)).argmax(-1) == batch["labels"]).sum())
        results[mode] = {"epoch_s": epoch_s, "accuracy": correct / len(test_set), "losses": losses}
        print(json.dumps({"mode": mode, "epoch_s": epoch_s, "accuracy": results[mode]["accuracy"]}), flush=True)

    seq = results["sequential"]
    table = Table(title=f"Frozen MiniLM-L6 encoder + trainable MLP on BBC News ({args.epochs} epochs)")
    for col in ("mode", "epoch 1 s", "later epochs s", "total ratio", "later ratio", "test acc", "losses = seq."):
        table.add_column(col, justify="right")
    later = lambda r: sum(r["epoch_s"][1:]) / max(1, len(r["epoch_s"]) - 1)  # noqa: E731
    for mode, r in results.items():
        table.add_row(mode, f"{r['epoch_s'][0]:.1f}", f"{later(r):.1f}",
                      f"{sum(r['epoch_s']) / sum(seq['epoch_s']):.3f}",
                      f"{later(r) / later(seq):.3f}", f"{r['accuracy']:.4f}", str(r["losses"] == seq["losses"]))
    Console(width=140).print(table)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    raise SystemExit(entry(main))
