"""benchmarks/step_overhead.py on a few steps: it runs every registered strategy against none and prints its table."""

from __future__ import annotations

import json
import time

import pytest

from layerfreeze.strategies import STRATEGIES
from tests.conftest import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("step_overhead") as module:
        yield module


def test_main_prints_a_row_per_registered_strategy(bench, capsys, tmp_path, one_thread):
    assert bench.main(["--repeats", "1", "--steps", "8", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| strategy")]
    assert [r.split(" | ")[0].removeprefix("| ") for r in rows] == list(STRATEGIES)
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["strategy"] for r in results] == list(STRATEGIES)
    none = results[0]
    assert none["step_added_ms"] == 0 and none["stages"] == 0 and none["hooks_step_s"] > 0


def test_a_run_splits_its_steps_into_stages_and_steps_without_one(bench):
    # autofreeze every 4 steps over 12 steps: stages after steps 4, 8 and 12; freezeout stages on every step
    run = bench.run("autofreeze", steps=12, steps_per_epoch=12, params={"interval": 4})
    assert run["stages"] == 3 and len(run["hooks"]["step"]) == 9 and len(run["whole"]) == 12
    assert all(h > 0 for h in run["hooks"]["stage"] + run["hooks"]["step"])
    run = bench.run("freezeout", steps=6, steps_per_epoch=6)
    assert run["stages"] == 6 and run["hooks"]["step"] == []
    # linear stages at epoch ends only: 3 epochs of 2 steps
    run = bench.run("linear", steps=6, steps_per_epoch=2)
    assert run["stages"] == 3 and len(run["hooks"]["step"]) == 3


def test_rows_are_the_median_of_the_repetitions_against_none(bench, monkeypatch, one_thread):
    hooks = {"none": [[1.0, 1.0], [3.0, 3.0], [2.0, 2.0]], "static": [[1.5, 1.5], [2.5], [9.0, 9.0]]}
    calls = {"none": 0, "static": 0}

    def fake_run(name, steps, steps_per_epoch):
        step = hooks[name][calls[name]]
        calls[name] += 1
        return {"hooks": {"step": step, "stage": [4.0] if name == "static" else []}, "forward": [0.5],
                "whole": [1.0], "stages": 1 if name == "static" else 0}

    monkeypatch.setattr(bench, "run", fake_run)
    none, static = bench.measure(["static"], repeats=3)
    assert none["hooks_step_s"] == 2.0 and static["hooks_step_s"] == 2.5  # medians of [1, 3, 2] and [1.5, 2.5, 9]
    assert static["step_added_ms"] == 500.0 and static["stage_added_ms"] == 2000.0
    assert none["stage_added_ms"] is None and static["forward_added_ms"] == 0.0


def test_a_run_times_the_gradient_sums_the_freezer_makes_in_its_optimizer_hook(bench, monkeypatch):
    # AutoFreeze's sums are made in the Freezer's step post-hook: the step's hooks time must hold them (it did not
    # while the benchmark's marks sat in pre-hooks after the Freezer moved its hook to the post-step side)
    import layerfreeze.engine.steps as steps

    real = steps.sum_gradients

    def slow_sums(*args, **kwargs):
        time.sleep(0.005)
        return real(*args, **kwargs)

    monkeypatch.setattr(steps, "sum_gradients", slow_sums)
    run = bench.run("autofreeze", steps=6, steps_per_epoch=6, params={"interval": 3})
    assert len(run["hooks"]["step"]) == 4 and min(run["hooks"]["step"]) >= 0.005
