"""benchmarks/precision.py (issue 42): one --quick BBC run per precision trained for real, and its table."""

from __future__ import annotations

import json

import pytest

from tests.conftest import benchmark_module

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.assets("minilm", "bbc_news")
def test_a_quick_run_per_precision_and_the_table_against_32_true(tmp_path, capsys):
    with benchmark_module("precision") as bench:
        assert bench.main(["--quick", "--seeds", "0", "--rows", "none", "--precisions", "32-true,bf16-mixed",
                           "--threads", "1", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    runs = results["bbc"]["none"]
    assert runs["32-true"]["0"]["precision"] == "32-true" and runs["bf16-mixed"]["0"]["precision"] == "bf16-mixed"
    table = (tmp_path / "precision.md").read_text()
    delta = 100 * (runs["bf16-mixed"]["0"]["accuracy"] - runs["32-true"]["0"]["accuracy"])
    acc = 100 * runs["bf16-mixed"]["0"]["accuracy"]
    assert f"| bbc | none | bf16-mixed | {acc:.2f} | {delta:+.2f} ({delta:+.2f})" in table
    assert "| bbc | none | 32-true |" in table and "| - |" in table
