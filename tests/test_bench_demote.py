"""benchmarks/memory_table.py's demoted rows and benchmarks/demote_accuracy.py, at their tiny sizes (3 steps of
MobileNetV2 on Fashion-MNIST): real runs, the bytes exact (a bfloat16 frozen prefix holds half the float32 bytes)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import benchmark_module

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.assets("fashion_mnist", "mobilenet_v2")
def test_memory_table_adds_a_demoted_row_per_freezing_strategy(tmp_path, capsys):
    with benchmark_module("memory_table") as memory_table:
        memory_table.main(["--tasks", "fmnist-mobilenet", "--size", "tiny", "--rows", "none,static", "--demote",
                           "bfloat16", "--threads", "1", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {r["row"]: r for r in results["tasks"]["fmnist-mobilenet"]}
    assert list(rows) == ["none", "static", "static+bf16"] and results["demote"] == "bfloat16"
    peak = lambda row, bucket: rows[row]["memory"]["buckets"].get(bucket, {}).get("peak_bytes", 0)  # noqa: E731
    assert peak("none", "params_frozen") == 0
    assert peak("static+bf16", "params_frozen") * 2 == peak("static", "params_frozen") > 0  # static k=10, bfloat16
    assert peak("static+bf16", "params_master") > peak("static", "params_frozen")  # float32 weights + BN statistics
    assert len(rows["static+bf16"]["demote"]["demoted_blocks"]) == 10 and rows["static"]["demote"] is None
    assert (tmp_path / "fmnist-mobilenet-demote" / "static").is_dir()
    out = capsys.readouterr().out
    assert "static+bf16" in out and "master copies (demoted)" in (tmp_path / "memory.md").read_text()


@pytest.mark.assets("fashion_mnist", "mobilenet_v2")
def test_demote_accuracy_pairs_each_row_with_its_demoted_run(tmp_path):
    with benchmark_module("demote_accuracy") as demote_accuracy:
        # on the CPU: master: auto keeps the float32 master copies on disk there, which the tensor peak below needs
        # (on a GPU they go to host memory and count in the peak beside the device's bytes)
        results = demote_accuracy.main(["--tasks", "fmnist-mobilenet", "--size", "tiny", "--seeds", "0",
                                        "--rows", "static", "--threads", "1", "--out", str(tmp_path),
                                        "--device", "cpu"])
        with pytest.raises(SystemExit):
            demote_accuracy.main(["--rows", "none,static", "--out", str(tmp_path / "x")])
    agg = results["tasks"]["fmnist-mobilenet"]["rows"]["static"]
    seed = results["tasks"]["fmnist-mobilenet"]["per_seed"][0]
    assert seed["plain"]["static"]["demote"] is None and seed["demoted"]["static"]["demote"]["dtype"] == "bfloat16"
    assert agg["seeds"] == 1 and agg["stopped"] == 0
    assert agg["params_frozen_demoted"] * 2 == agg["params_frozen_plain"] > 0
    assert agg["tensor_peak_bytes_demoted"] < agg["tensor_peak_bytes_plain"]  # the master copy is on disk (CPU run)
    plain, demoted = seed["plain"]["static"]["test_accuracy"], seed["demoted"]["static"]["test_accuracy"]
    assert agg["delta_pts"]["mean"] == pytest.approx(100 * (demoted - plain))
    assert json.loads((tmp_path / "results.json").read_text())["demote"]["dtype"] == "bfloat16"
    assert "| static | 1 |" in (tmp_path / "demote.md").read_text()
