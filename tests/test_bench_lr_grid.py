"""benchmarks/lr_grid.py (issue 29's grid): its rows, its table, its argument checks, and one --quick cell trained
for real (a smartfrz row that freezes nothing trains exactly as `none` does: same seed, same dropout stream)."""

from __future__ import annotations

import json

import pytest

from layerfreeze.strategies import STRATEGIES
from layerfreeze.strategies.registry import unregister_strategy
from tests.conftest import benchmark_module

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def grid():
    with benchmark_module("lr_grid") as module:
        yield module
    if "smartfrz-gate" in STRATEGIES:  # registered by the module's rows: gone with it
        unregister_strategy("smartfrz-gate")


def test_rows_are_smartfrz_without_and_with_the_gate(grid):
    assert list(grid.ROWS) == ["smartfrz", "smartfrz-gate"]
    assert grid.row_strategy("smartfrz") is STRATEGIES["smartfrz"]
    cls = grid.row_strategy("smartfrz-gate")
    assert grid.row_strategy("smartfrz-gate") is cls  # again: a no-op
    assert STRATEGIES["smartfrz-gate"] is cls and issubclass(cls, STRATEGIES["smartfrz"])
    assert STRATEGIES["smartfrz"]().snr_gate is None  # the default: off
    assert cls(**grid.ROWS["smartfrz-gate"][1]).snr_gate == 0.9


def test_table_averages_seeds_and_names_the_worst(grid):
    def cell(seed, none, acc, flops):
        return {"task": "bbc", "lr_factor": 0.3, "epochs": 2, "seed": seed, "steps": 104, "none_accuracy": none,
                "rows": {"smartfrz": {"accuracy": acc, "flops_ratio": flops, "time_ratio": flops}}}

    results = {"rows": ["smartfrz", "smartfrz-gate"],
               "cells": [cell(0, 0.80, 0.75, 0.7), cell(1, 0.70, 0.71, 0.9)]}
    lines = grid.markdown(results).splitlines()
    assert len(lines) == 3
    assert lines[2] == "| bbc | x0.3 | 2 | 104 | 0,1 | 75.00 | -2.00 [-5.00] | 0.800 | 0.800 | - | - | - |"


@pytest.mark.parametrize(("argv", "message"), [
    (["--rows", "smartfrz,nogate"], "unknown rows ['nogate']"),
    (["--tasks", "cifar"], "unknown tasks ['cifar']"),
    (["--lrs", "0.3,x"], "comma-separated float"),
    (["--epochs", "0"], "--epochs integers >= 1"),
])
def test_bad_arguments_are_parser_errors_before_training(grid, argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        grid.main([*argv, "--out", str(tmp_path)])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_quick_cell_trains_none_and_both_rows_on_one_stream(grid, tmp_path, capsys):
    from layerfreeze.strategies.smartfrz.predictor import _load

    _load.cache_clear()  # the first smartfrz row in a process reads the predictor file (issue 29's RNG bug)
    argv = ["--quick", "--tasks", "fmnist-mobilenet", "--lrs", "1", "--epochs", "1", "--seeds", "0",
            "--out", str(tmp_path)]
    assert grid.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    (cell,) = results["cells"]
    assert (cell["task"], cell["lr_factor"], cell["epochs"], cell["seed"], cell["steps"]) == (
        "fmnist-mobilenet", 1.0, 1, 0, 4)
    for name in ("smartfrz", "smartfrz-gate"):
        row = cell["rows"][name]
        # 4 steps: fewer than the predictor's 8 snapshots, nothing freezes, so the row is `none` step for step
        assert row["freeze_steps"] == {} and row["stopped"] is None
        assert row["accuracy"] == cell["none_accuracy"] and row["flops_ratio"] == 1.0
    assert "| fmnist-mobilenet | x1 | 1 | 4 | 0 |" in (tmp_path / "lr_grid.md").read_text()
