"""Crash-anywhere resume: a run SIGKILLed at 20 seeded random instants (inside checkpoint writes too) and resumed
each time ends with the uninterrupted run's weights, optimizer state and metrics, bitwise."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from layerfreeze.report import _load_run

ROOT = Path(__file__).resolve().parents[1]
STEPS = 320
pytestmark = pytest.mark.timeout(600)


def start(run_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "tests.faults.worker", str(run_dir), str(STEPS)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_and_resume(run_dir: Path, kills: int, seed: int, max_delay_s: float) -> dict:
    """Start the run, SIGKILL it ``kills`` times at random instants after it starts training, then let it finish."""
    rng = random.Random(seed)
    stats = {"kills": 0, "in_checkpoint_write": 0, "finished_early": 0}
    for _ in range(kills):
        proc = start(run_dir)
        line = proc.stdout.readline().strip()
        if line == "done":
            stats["finished_early"] += 1
            proc.wait(timeout=60)
            break
        assert line == "started", proc.stderr.read()
        try:
            proc.wait(timeout=rng.uniform(0.0, max_delay_s))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            stats["kills"] += 1
            stats["in_checkpoint_write"] += any((run_dir / "checkpoints").glob("*.tmp"))
        else:
            assert proc.returncode == 0, proc.stderr.read()
            if "done" in proc.stdout.read():
                stats["finished_early"] += 1
                break
    proc = start(run_dir)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "done" in out, err[-3000:]
    return stats


def final_state(run_dir: Path) -> tuple[dict, dict]:
    ckpt = run_dir / "checkpoint"
    return load_file(ckpt / "model.safetensors"), torch.load(ckpt / "state.pt", weights_only=True)


def assert_same_tree(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_twenty_random_kills_resume_to_the_uninterrupted_run_bitwise(tmp_path):
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    ref = start(ref_dir)
    out, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err[-3000:]

    stats = kill_and_resume(cut_dir, kills=20, seed=0, max_delay_s=0.3)
    assert stats["kills"] == 20 and stats["finished_early"] == 0, stats
    assert stats["in_checkpoint_write"] >= 1, stats  # some kills landed inside a checkpoint write

    ref_weights, ref_state = final_state(ref_dir)
    cut_weights, cut_state = final_state(cut_dir)
    assert_same_tree(ref_weights, cut_weights, "weights")
    assert_same_tree(ref_state["optimizer"], cut_state["optimizer"], "optimizer")
    assert_same_tree(ref_state["freezer"]["frozen"], cut_state["freezer"]["frozen"], "frozen")
    assert_same_tree(ref_state["freezer"]["history"], cut_state["freezer"]["history"], "freeze history")

    a, b = _load_run(ref_dir), _load_run(cut_dir)
    assert np.array_equal(a.step, np.arange(1, STEPS + 1)) and np.array_equal(a.step, b.step)
    assert np.array_equal(a.loss, b.loss)
    assert [(e["epoch"], e["eval_loss"], e["eval_accuracy"], e["train_loss"]) for e in a.epochs] == \
        [(e["epoch"], e["eval_loss"], e["eval_accuracy"], e["train_loss"]) for e in b.epochs]
    keys = ("test_accuracy", "test_loss", "steps", "frozen_blocks", "freeze_timeline", "eval_history", "flops_total")
    assert {k: a.summary[k] for k in keys} == {k: b.summary[k] for k in keys}
    assert len(b.resumes) >= 20
