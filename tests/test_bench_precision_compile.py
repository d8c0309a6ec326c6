"""benchmarks/precision_compile.py (issue 42): --quick BBC runs per precision and compile mode trained for real,
and its table against the eager float32 run."""

from __future__ import annotations

import json

import pytest

from tests.conftest import benchmark_module

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.assets("minilm", "bbc_news")
def test_quick_runs_per_variant_and_the_table_against_eager_32_true(tmp_path):
    with benchmark_module("precision_compile") as bench:
        assert bench.main(["--quick", "--seeds", "0", "--rows", "none", "--precisions", "32-true,bf16-mixed",
                           "--compiles", "false", "--threads", "1", "--out", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "results.json").read_text())["bbc"]["none"]
    base, bf16 = runs["32-true/false"]["0"], runs["bf16-mixed/false"]["0"]
    assert base["precision"] == "32-true" and bf16["precision"] == "bf16-mixed"
    assert base["graphs"] == bf16["graphs"] == 0
    table = (tmp_path / "precision_compile.md").read_text()
    delta = 100 * (bf16["accuracy"] - base["accuracy"])
    ratio = bf16["train_s"] / base["train_s"]
    assert (f"| bbc | none | bf16-mixed/false | {100 * bf16['accuracy']:.2f} | {delta:+.2f} ({delta:+.2f}) | "
            f"{bf16['train_s']:.1f} | {ratio:.2f} | 0.0 (0.0) | {bf16['train_s']:.1f} | {ratio:.2f} | 0 |") in table
    assert "| bbc | none | 32-true/false |" in table


@pytest.mark.assets("minilm", "bbc_news")
def test_the_default_job_runs_with_the_cli_defaults_at_its_quick_size(tmp_path):
    with benchmark_module("precision_compile") as bench:
        assert bench.main(["--tasks", "default-job", "--quick", "--seeds", "0", "--rows", "none", "--precisions",
                           "32-true", "--compiles", "false", "--threads", "1", "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "results.json").read_text())["default-job"]["none"]["32-true/false"]["0"]
    config = json.loads((tmp_path / "default-job-none-32-true-false-s0" / "config.json").read_text())
    assert config["task"] == "bbc-news" and config["model"]["max_length"] == 64  # memory_table's quick size
    assert config["data"]["limit_train"] == 256 and config["train"]["lr"] == 5e-5  # the CLI's default lr
    assert 0.0 <= run["accuracy"] <= 1.0 and run["graphs"] == 0
    assert "| default-job | none | 32-true/false |" in (tmp_path / "precision_compile.md").read_text()
