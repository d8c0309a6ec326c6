"""benchmarks/oracle_replay.py without training: the fixed oracle schedule and the FLOPs-by-threshold table."""

from __future__ import annotations

import pytest

from layerfreeze.strategies.base import BlockView, StageContext
from tests.conftest import benchmark_module


@pytest.fixture(scope="module")
def replay():
    with benchmark_module("oracle_replay") as module:
        yield module


def _ctx(step, frozen):
    blocks = [BlockView(f"b{i}", i, i in frozen, i == 3, 10) for i in range(4)]
    return StageContext(step=step, epoch=0, event="step", blocks=blocks, total_steps=10)


def test_schedule_freezes_each_block_at_its_step_and_never_the_head(replay):
    s = replay.OracleSchedule([2, 2, 5, 0])  # a step for the head is ignored
    assert s.decide(_ctx(1, set())).freeze == []
    assert s.decide(_ctx(2, set())).freeze == [0, 1]
    assert s.decide(_ctx(4, {0, 1})).freeze == []
    assert s.decide(_ctx(5, {0, 1})).freeze == [2]
    assert replay.OracleSchedule([3, None, None, None]).decide(_ctx(9, {0})).freeze == []
    with pytest.raises(ValueError, match="3 freeze steps for 4 blocks"):
        replay.OracleSchedule([1, 2, 3]).decide(_ctx(1, set()))


def _task(measured):
    # block 0 converges from record 1 on (CKA 0.999), block 1 only at CKA 0.95 from record 1; head last
    cka = [[0.5, 0.999, 0.999, 0.999, 1.0], [0.2, 0.95, 0.95, 0.95, 1.0], [0.1, 0.2, 0.3, 0.4, 1.0]]
    oracle = {"cka": cka, "record_steps": [0, 10, 20, 30, 40], "flops_per_step_by_prefix": measured}
    return {"blocks": ["b0", "b1", "head"], "head": "head", "total_steps": 40, "seeds": [{"seed": 0, "oracle": oracle}]}


def test_flops_by_threshold(replay):
    # window 3 -> freezable from record 3 (step 30); block 1 only when tau <= 0.95
    (strict, [r_strict]), (loose, [r_loose]) = replay.flops_at_taus(_task({"0": 3.0, "1": 2.0, "2": 1.0}),
                                                                    [0.998, 0.9])
    assert (strict, loose) == (0.998, 0.9)
    assert r_strict == pytest.approx((30 * 3.0 + 10 * 2.0) / (40 * 3.0))  # block 0 frozen after step 30
    assert r_loose == pytest.approx((30 * 3.0 + 10 * 1.0) / (40 * 3.0))  # blocks 0 and 1 frozen after step 30
    # an unmeasured prefix takes the nearest shallower measured one (an upper bound)
    [(_, [r_bound])] = replay.flops_at_taus(_task({"0": 3.0, "1": 2.0}), [0.9])
    assert r_bound == pytest.approx(r_strict)


def test_schedule_at_a_threshold_or_the_stored_one(replay):
    task = _task({"0": 3.0})
    oracle = {**task["seeds"][0]["oracle"], "freeze_steps": {"b0": 7, "b1": None, "head": None}}
    assert replay.schedule_at_tau(task, oracle, None) == [7, None, None]  # the suite's own schedule
    assert replay.schedule_at_tau(task, oracle, 0.998) == [30, None, None]
    assert replay.schedule_at_tau(task, oracle, 0.9) == [30, 30, None]  # block 1 only below its CKA of 0.95
    # at 0.9999 block 0 only matches itself at the final record (CKA 1.0, window range 0.001 <= delta 0.01)
    assert replay.schedule_at_tau(task, oracle, 0.9999) == [40, None, None]


def test_rows_per_threshold_are_registered_once_and_named_by_tau(replay):
    assert [replay.row_name(t) for t in (None, 0.998, 0.9995)] == ["oracle", "oracle-tau0.998", "oracle-tau0.9995"]
    cls = replay.oracle_strategy("oracle-tau0.9995")
    assert cls is replay.oracle_strategy("oracle-tau0.9995") and issubclass(cls, replay.OracleSchedule)
    assert cls.name == "oracle-tau0.9995" and replay.oracle_strategy("oracle") is replay.OracleSchedule
    assert replay.format_schedule([3, None, 9], ["a", "b", "c"]) == "a@3, c@9"
    assert replay.format_schedule([None, None], ["a", "b"]) == "-"


def test_bad_thresholds_fail_before_anything_runs(replay, tmp_path, capsys):
    results = tmp_path / "results.json"
    task = _task({"0": 3.0})
    task["seeds"][0]["oracle"]["freeze_steps"] = {}
    task["title"] = "t"
    results.write_text(__import__("json").dumps({"tasks": {"bbc": task}, "meta": {"sizes": {"bbc": {}}}}))
    with pytest.raises(SystemExit) as exc:
        replay.main([str(results), "--task", "bbc", "--train-taus", "0.998,1.5"])
    assert exc.value.code == 2 and "--train-taus are CKA thresholds in (0, 1]" in capsys.readouterr().err
