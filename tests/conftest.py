"""Shared fixtures: a tiny synthetic task for trainer tests and a tiny local Hugging Face model for CLI tests;
the README's examples, to run as written."""

from __future__ import annotations

import contextlib
import csv
import importlib
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from layerfreeze.train.data import GaussianBlobs
from layerfreeze.train.tasks import Task, image_forward

README = Path(__file__).resolve().parents[1] / "README.md"


@contextlib.contextmanager
def benchmark_module(name: str):
    """``benchmarks.<name>`` imported afresh for the with block (what a benchmark registers at import, a strategy row
    say, is gone after it), then dropped from ``sys.modules``."""
    full = f"benchmarks.{name}"
    sys.modules.pop(full, None)
    try:
        yield importlib.import_module(full)
    finally:
        sys.modules.pop(full, None)


def readme_example(heading: str) -> str:
    """The one Python code block of the README section under ``heading`` (up to the next ``## `` heading)."""
    section = README.read_text(encoding="utf-8").split(heading, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    return blocks[0]


def readme_block(marker: str) -> str:
    """The first Python code block of the README after ``marker`` (a heading or the words that introduce it)."""
    text = README.read_text(encoding="utf-8")
    assert text.count(marker) == 1, marker
    found = re.search(r"```python\n(.*?)```", text.split(marker, 1)[1], re.S)
    assert found is not None, marker
    return found.group(1)


def readme_setup(block: str) -> tuple[str, str]:
    """A README block split at its ``# end of setup`` line: ``(setup, rest)``; the setup (from its ``# setup:``
    comment) builds the tiny model and data the rest uses, so the block runs as written. A test that runs the rest
    with other data execs ``imports + rest`` (``readme_without_setup``)."""
    head, sep, rest = block.partition("# end of setup\n")
    assert sep and "# setup:" in head, "the block has no marked setup"
    return head, rest


def readme_without_setup(block: str) -> str:
    """The block with its marked setup lines left out (its imports kept): for a test that brings other data."""
    head, rest = readme_setup(block)
    lines = head.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if "# setup:" in line)
    return "".join(lines[:start]) + rest


def readme_blocks() -> list[str]:
    """Every Python code block of the README, in order."""
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def predictor_cli(argv: list[str]) -> int:
    """Run ``layerfreeze predictor ...`` in this process (a wide console, so tables are not cut); the exit code."""
    import argparse

    from rich.console import Console

    from layerfreeze.smartfrz.cli import add_parser, run

    parser = argparse.ArgumentParser(prog="layerfreeze")
    add_parser(parser.add_subparsers(dest="command"))
    return run(parser.parse_args(argv), Console(width=200))


class BlobDataset(GaussianBlobs):
    """Gaussian blobs, 4 classes, 16 features, counting fetches (``on_fetch(count)`` runs before each one)."""

    def __init__(self, n: int, seed: int, on_fetch=None):
        super().__init__(n, seed)
        self.on_fetch = on_fetch
        self.fetches = 0

    def __getitem__(self, i):
        self.fetches += 1
        if self.on_fetch is not None:
            self.on_fetch(self.fetches)
        return super().__getitem__(i)


def blob_task(on_fetch=None) -> Task:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4),
    )
    return Task("blobs", model, BlobDataset(96, seed=1, on_fetch=on_fetch), BlobDataset(40, seed=2), 4, "mlp",
                image_forward)


@pytest.fixture
def one_thread():
    """One CPU thread: cheap beside other jobs, and CPU GEMM picks the same kernel for every batch of >= 4 rows."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    """A 2-layer BERT (hidden 32) saved as a local Hugging Face folder with MiniLM's tokenizer files."""
    from transformers import BertConfig, BertForSequenceClassification

    from layerfreeze.train.assets import minilm_dir

    path = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertForSequenceClassification(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir() / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_csv(tmp_path_factory) -> Path:
    """A 2-class text CSV: sports words vs. finance words, 48 rows."""
    path = tmp_path_factory.mktemp("csv") / "texts.csv"
    sport = "match goal team player coach league win score".split()
    money = "bank market shares profit economy price trade rate".split()
    g = torch.Generator().manual_seed(0)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for i in range(48):
            words = sport if i % 2 else money
            picks = torch.randint(0, len(words), (12,), generator=g).tolist()
            writer.writerow([" ".join(words[j] for j in picks), "sport" if i % 2 else "money"])
    return path
