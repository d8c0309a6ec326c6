"""Crash-anywhere resume: a run SIGKILLed at 20 seeded random instants (inside checkpoint writes too) and resumed
each time ends with the uninterrupted run's weights, optimizer state, freeze history and metrics, bitwise, with the
activation cache on (the default) (``benchmarks/crash_resume.py`` runs the same harness with 100 kills)."""

from __future__ import annotations

import pytest

from benchmarks import crash_resume as crash  # by its name: the processes it forks import their worker from it

STEPS = 800  # room for 20 kills: each process trains 0-0.3 s (about 0-40 steps here) before its kill
pytestmark = pytest.mark.timeout(600)


def test_twenty_random_kills_resume_to_the_uninterrupted_run_bitwise(tmp_path):
    ref = crash.start(tmp_path / "ref", STEPS)  # the uninterrupted run, on the other core while the kills go on
    stats = crash.kill_and_resume(tmp_path / "cut", STEPS, kills=20, seed=0, max_delay_s=0.3)
    assert ref.wait(timeout=600) == 0 and (tmp_path / "ref" / "summary.json").is_file(), ref.output()
    assert stats["kills"] == 20 and stats["finished_early"] == 0, stats
    assert stats["in_checkpoint_write"] >= 1, stats  # some kills landed inside a checkpoint write
    assert crash.mismatches(tmp_path / "ref", tmp_path / "cut") == []
    from layerfreeze.runs.report import load_run

    assert len(load_run(tmp_path / "cut").resumes) >= 20
    # the default activation cache served the frozen prefix in both runs (a resumed run starts it cold; misses are
    # computed at the batch's shape, so the states are the uninterrupted run's bit for bit)
    ref, cut = (load_run(tmp_path / run).summary["cache"] for run in ("ref", "cut"))
    assert ref["used"] and cut["used"] and ref["hits"] > 0, (ref, cut)
    # the summary counts the whole run across resumes: the same lookups, no more hits (each resume starts cold;
    # fewer when a kill came after the prefix was cached)
    assert cut["hits"] + cut["misses"] == ref["hits"] + ref["misses"], (ref, cut)
    assert 0 < cut["hits"] <= ref["hits"], (ref, cut)


def test_the_comparison_sees_a_different_run(tmp_path):
    # the harness can fail: a run of another length differs in weights and losses
    crash.finish(tmp_path / "a", 16)
    crash.finish(tmp_path / "b", 24)
    diff = crash.mismatches(tmp_path / "a", tmp_path / "b")
    assert "weights/4.weight" in diff and "per-step losses" in diff
