"""benchmarks/device_default_job.py: the phases of a run's steps, the extra time of its FLOP-measured steps and its
stage cadence read from records; and the whole benchmark at ``--tiny`` size on the CPU (the GPU check runs it at the
default job's size on ``cuda:0``)."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import benchmark_module


def _records(times_ms: dict[int, float], measured: list[int], stages: list[int]) -> list[dict]:
    records = []
    for step, ms in times_ms.items():
        if step in measured:
            records.append({"type": "event", "kind": "flops_remeasured", "step": step})
        record = {"type": "step", "step": step, "step_time_s": ms / 1000}
        if step in stages:
            record["signal_p_freeze"] = [0.1, 0.2]
            record["signal_stage_every"] = 2
        records.append(record)
    return records


def test_step_analysis_splits_phases_at_the_first_freeze_and_the_last_change():
    # steps 1-10: 20 ms before the first freeze (after step 3), 10 ms while freezing (to step 6), 5 ms after;
    # FLOPs measured at steps 1 (warm-up), 4 and 7, each 50 ms
    times = {s: 20.0 if s <= 3 else 10.0 if s <= 6 else 5.0 for s in range(1, 11)}
    times.update({1: 200.0, 4: 50.0, 7: 50.0})
    timeline = [{"action": "freeze", "step": 3}, {"action": "freeze", "step": 5}, {"action": "thaw", "step": 6}]
    with benchmark_module("device_default_job") as bench:
        got = bench.step_analysis(_records(times, [1, 4, 7], [2, 4, 6, 8, 10]), timeline)
    assert got["first_freeze_step"] == 3 and got["last_change_step"] == 6
    assert got["steps_per_phase"] == {"before": 3, "while": 3, "after": 4}
    assert got["median_step_ms"] == pytest.approx({"before": 20.0, "while": 10.0, "after": 5.0})
    assert got["flops_steps"] == [1, 4, 7] and got["step1_ms"] == pytest.approx(200.0)
    assert got["flops_step_extra_ms"] == pytest.approx([40.0, 45.0])  # against its phase's plain median
    assert got["flops_extra_s"] == pytest.approx(0.085)
    assert got["stage_steps"] == 5 and got["stage_every_median"] == 2
    assert got["signals"] == {"p_freeze": {"steps": 5, "last": [0.1, 0.2]}, "stage_every": {"steps": 5, "last": 2}}


def test_a_run_that_never_freezes_has_all_its_steps_before_and_one_frozen_from_the_start_all_after():
    times = {s: 10.0 for s in range(1, 5)}
    with benchmark_module("device_default_job") as bench:
        never = bench.step_analysis(_records(times, [1], []), [])
        start = bench.step_analysis(_records(times, [1], []), [{"action": "freeze", "step": 0}])
    assert never["steps_per_phase"] == {"before": 4, "while": 0, "after": 0} and never["stage_steps"] == 0
    assert start["steps_per_phase"] == {"before": 0, "while": 0, "after": 4}
    assert start["median_step_ms"] == {"before": None, "while": None, "after": pytest.approx(10.0)}
    assert never["flops_extra_s"] == 0.0 and never["stage_every_median"] is None


@pytest.mark.assets("minilm", "bbc_news")
def test_tiny_default_job_every_row_read_from_its_records(tmp_path, one_thread):
    with benchmark_module("device_default_job") as bench:
        assert bench.main(["--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {r["row"]: r for r in results["rows"]}
    assert list(rows) == ["none", "smartfrz", "static", "lisa", "badam"] and results["device"] == "cpu"
    assert results["variants"] == ["auto/false"] and {r["variant"] for r in rows.values()} == {"auto/false"}
    for r in rows.values():
        assert r["steps"] == 6 and sum(r["steps_per_phase"].values()) == 6 and r["ledger_every"] == 1
        assert 0 <= r["test_accuracy"] <= 1 and r["train_time_s"] > 0 and math.isfinite(r["time_ratio"])
        assert r["ledger_tensor_peak_bytes"] > 0 and r["allocator_peak_bytes"] > 0
        assert r["allocator_over_ledger"] == pytest.approx(r["allocator_peak_bytes"] / r["ledger_tensor_peak_bytes"])
        assert r["flops_steps"][0] == 1 and r["step1_ms"] > 0
        assert r["allocated_at_start_bytes"] is None  # no CUDA allocator on the CPU
    assert rows["none"]["flops_ratio"] == 1.0 and rows["none"]["steps_per_phase"]["before"] == 6
    # static freezes at the start stage: every step is after its last change, and it needs fewer FLOPs and bytes
    assert rows["static"]["first_freeze_step"] == 0 and rows["static"]["steps_per_phase"]["after"] == 6
    assert rows["static"]["flops_ratio"] < 1 and rows["static"]["ledger_tensor_peak_bytes"] < rows["none"][
        "ledger_tensor_peak_bytes"]
    # smartfrz's stages leave their signals in the step records; none has no stage
    assert rows["smartfrz"]["stage_steps"] >= 1 and rows["smartfrz"]["signals"]
    assert rows["none"]["stage_steps"] == 0 and rows["none"]["signals"] == {}
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {row} |" in table for row in rows) and "peak RSS / ledger" in table


def test_variants_parse_and_each_rows_ratios_are_to_its_own_variants_none():
    with benchmark_module("device_default_job") as bench:
        assert bench.parse_variants("bf16-mixed/false, bf16-mixed/blocks") == [("bf16-mixed", "false"),
                                                                             ("bf16-mixed", "blocks")]
        for bad in ("bf16-mixed", "bf16-mixed/", "/blocks", "a/b,a/b"):
            with pytest.raises(ValueError, match="--variants"):
                bench.parse_variants(bad)
        rows = [{"row": "none", "variant": "bf16-mixed/false", "train_time_s": 10.0, "train_compile_s": None},
                {"row": "smartfrz", "variant": "bf16-mixed/false", "train_time_s": 8.0, "train_compile_s": None},
                {"row": "none", "variant": "bf16-mixed/blocks", "train_time_s": 30.0, "train_compile_s": 24.0},
                {"row": "smartfrz", "variant": "bf16-mixed/blocks", "train_time_s": 29.0, "train_compile_s": 25.0},
                {"row": "static", "variant": "bf16-mixed/blocks", "stopped": "diverged"}]
        bench.add_variant_ratios(rows)
    assert [r.get("train_time_without_compile_s") for r in rows] == [10.0, 8.0, 6.0, 4.0, None]
    # without compiling, to its variant's none: 8 / 10 and 4 / 6; train time to the first variant's none
    assert rows[1]["time_ratio_without_compile"] == pytest.approx(0.8)
    assert rows[3]["time_ratio_without_compile"] == pytest.approx(4 / 6)
    assert [r.get("time_ratio_to_base") for r in rows[:4]] == pytest.approx([1.0, 0.8, 3.0, 2.9])
