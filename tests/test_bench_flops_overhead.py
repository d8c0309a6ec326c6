"""benchmarks/flops_overhead.py on a small real model: the trainer's step timed normal, under FlopCounterMode and
under TotalFlopCounter, interleaved, with the two counts equal."""

from __future__ import annotations

import pytest

from tests.conftest import benchmark_module


@pytest.fixture(scope="module")
def overhead():
    with benchmark_module("flops_overhead") as module:
        yield module


def test_measure_times_each_mode_and_both_counters_agree(overhead, tmp_path):
    overrides = {"task": "fashion-mnist", "model": {"name_or_path": "resnet18", "pretrained": False},
                 "train": {"batch_size": 8, "epochs": 1}, "data": {"limit_train": 16, "limit_test": 8}}
    row = overhead.measure("fmnist-resnet", overrides, steps=2, out=tmp_path)
    assert row["batch_size"] == 8 and row["steps_per_mode"] == 2 and row["device"] == "cpu"
    assert set(row["step_s"]) == {"normal", "FlopCounterMode", "TotalFlopCounter"}
    assert all(s > 0 for s in row["step_s"].values())
    # ResNet-18's step dispatches hundreds of ops: forward, backward, clipping and AdamW per parameter tensor
    assert row["ops_per_step"] > 300
    # torchvision's ResNet-18 (10 classes) on 8 images of 3x32x32, nothing frozen: forward 592,265,216 FLOPs,
    # backward twice that less the first convolution's input gradient (measure_flops on the bare model)
    assert row["flops_per_step"] == 1_738_260_480
    for mode in ("FlopCounterMode", "TotalFlopCounter"):
        over = row["step_s"][mode] - row["step_s"]["normal"]
        assert row["overhead_s"][mode] == over
        assert row["overhead_per_op_us"][mode] == pytest.approx(1e6 * over / row["ops_per_step"])
