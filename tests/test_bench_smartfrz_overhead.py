"""benchmarks/smartfrz_overhead.py on a small real model: its timed steps go through the trainer's step as it is."""

from __future__ import annotations

import pytest

from tests.conftest import benchmark_module


@pytest.fixture(scope="module")
def overhead():
    with benchmark_module("smartfrz_overhead") as module:
        yield module


@pytest.mark.assets("fashion_mnist")
def test_measure_times_real_steps_and_a_stage_and_divides_by_the_strategy_interval(overhead, tmp_path):
    overrides = {"task": "fashion-mnist", "model": {"name_or_path": "resnet18", "pretrained": False},
                 "train": {"batch_size": 16, "epochs": 1}, "data": {"limit_train": 64, "limit_test": 16}}
    row = overhead.measure("fmnist-resnet", overrides, steps=2, every=None, out=tmp_path)
    assert row["total_steps"] == 4 and row["stage_every"] == 1  # max(1, round(4 / 150))
    assert row["blocks"] > 2 and row["step_s"] > 0 and row["stage_s"] > 0
    assert row["overhead"] == row["stage_s"] / row["step_s"]
    assert row["overhead_worst"] == row["stage_worst_s"] / row["step_s"]
    assert row["gate_s"] > 0 and row["overhead_with_gate"] == (row["stage_s"] + row["gate_s"]) / row["step_s"]
