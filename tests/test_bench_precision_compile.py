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
            f"{bf16['train_s']:.1f} | {ratio:.2f} | 0.0 | 0 |") in table
    assert "| bbc | none | 32-true/false |" in table
