"""The run folder's contract: the replay rule for resumed runs, and the folders a run refuses."""

from __future__ import annotations

import pytest

from layerfreeze.errors import ConfigError, RunFileError
from layerfreeze.runs.rundir import (
    CONFIG_FILE,
    SUMMARY_FILE,
    Event,
    Record,
    check_run_dir,
    read_metrics,
    replay,
    row_dir,
)
from layerfreeze.runs.telemetry import Telemetry


def _step(step: int, loss: float) -> dict:
    return {"type": Record.STEP, "step": step, "loss": loss}


def test_replay_drops_what_a_resume_redid_and_keeps_the_redone_records():
    records = [
        {"type": Record.CONFIG, "config": {"task": "a"}},
        {"type": Record.EVENT, "kind": Event.FREEZE, "step": 0, "block": "b0"},
        _step(1, 1.0), _step(2, 0.9),
        {"type": Record.EPOCH, "epoch": 0, "step": 2, "eval_loss": 0.8},
        _step(3, 0.7), {"type": Record.STEP, "step": 3, "val_loss": 0.75},
        {"type": Record.EVENT, "kind": Event.FREEZE, "step": 3, "block": "b1"},
        {"type": Record.EVENT, "kind": Event.INTERRUPTED, "step": 3},
        {"type": Record.EVENT, "kind": Event.RESUMED, "step": 2},  # continued from the checkpoint at step 2
        _step(3, 0.6),
        {"type": Record.CONFIG, "config": {"task": "b"}},
    ]
    played = replay(records)
    assert played.config == {"task": "a"}
    assert [(r["step"], r["loss"]) for r in played.steps] == [(1, 1.0), (2, 0.9), (3, 0.6)]
    assert played.vals == [] and [e["epoch"] for e in played.epochs] == [0]
    assert [e["block"] for e in played.events] == ["b0"]  # the freeze at step 3 was redone (and not logged again)
    assert len(played.interruptions) == 1 and len(played.resumes) == 1


def test_replay_of_a_restart_from_the_beginning_keeps_only_the_restart():
    records = [
        {"type": Record.EVENT, "kind": Event.FREEZE, "step": 0, "block": "b0"},
        _step(1, 1.0),
        {"type": Record.EVENT, "kind": Event.RESUMED, "step": 0, "from_start": True},
        {"type": Record.EVENT, "kind": Event.FREEZE, "step": 0, "block": "b0"},
        _step(1, 0.5),
    ]
    played = replay(records)
    assert [r["loss"] for r in played.steps] == [0.5]
    assert [e["block"] for e in played.events] == ["b0"]  # once: the restart's own


def test_records_written_by_telemetry_read_back_with_the_contracts_kinds(tmp_path):
    with Telemetry(tmp_path, tensorboard=False) as tel:
        tel.log_event(Event.RESUMED, 0, from_start=True)
        tel.log_step(1, loss=0.5)
    records = read_metrics(tmp_path)
    assert [(r["type"], r.get("kind")) for r in records] == [("event", "resumed"), ("step", None)]
    assert replay(records).resumes[0]["from_start"] is True


def test_check_run_dir_refuses_mixing_two_runs(tmp_path):
    check_run_dir(tmp_path / "new")
    run = row_dir(tmp_path, "none")
    run.mkdir()
    (run / CONFIG_FILE).write_text("{}")
    with pytest.raises(ConfigError, match="already holds a run"):
        check_run_dir(run)
    check_run_dir(run, resuming=True)
    (run / SUMMARY_FILE).write_text("{}")
    with pytest.raises(ConfigError, match="already finished"):
        check_run_dir(run, resuming=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        check_run_dir(tmp_path / "file")


def test_a_crash_cut_last_record_is_skipped_but_another_files_content_is_refused(tmp_path):
    # a metrics.jsonl holding one line of something else read as an interrupted run with 0 steps
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "step", "step": 1, "loss": 0.5}\n{"type": "step", "st')  # SIGKILL mid-write
    assert read_metrics(tmp_path) == [{"type": "step", "step": 1, "loss": 0.5}]
    path.write_text('{"type": "st')
    assert read_metrics(tmp_path) == []
    for other in ("step,loss\n1,0.5", "PK\x03\x04 not json", "hello", '{"name": "some-package", "version": "1.0"}'):
        path.write_text(other)
        with pytest.raises(RunFileError, match=r"metrics.jsonl: line \d (is not valid JSON|has no 'type')"):
            read_metrics(tmp_path)


def test_the_report_of_a_damaged_metrics_file_is_one_line(tmp_path):
    # `layerfreeze report RUN` printed a 40-line traceback for a metrics.jsonl that was another file
    import subprocess
    import sys

    (tmp_path / "metrics.jsonl").write_text("step,loss\n1,0.5\n")
    done = subprocess.run([sys.executable, "-m", "layerfreeze", "report", str(tmp_path)], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("layerfreeze: error:") and "line 1 is not valid JSON" in done.stderr


def test_a_compare_json_of_something_else_is_refused(tmp_path):
    # '[{"x": 1}]' made an empty comparison report
    from layerfreeze.runs.rundir import COMPARE_JSON, read_compare

    for other in ('[{"x": 1}]', '{"row": "none"}', '[1, 2]'):
        (tmp_path / COMPARE_JSON).write_text(other)
        with pytest.raises(RunFileError, match="expected a list of row objects, each with its 'row' name"):
            read_compare(tmp_path)
    (tmp_path / COMPARE_JSON).write_text('[{"row": "none", "stopped": "not run"}]')
    assert read_compare(tmp_path) == [{"row": "none", "stopped": "not run"}]
