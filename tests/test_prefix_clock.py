"""Issue 42, the frozen prefix as an inference workload: its forward builds no autograd graph, and each training
step's record carries the prefix's own forward seconds beside the rest of the step (``train/prefix_clock.py``)."""

from __future__ import annotations

import time

import pytest
import torch

from layerfreeze.runs.rundir import read_metrics
from layerfreeze.train.config import build_config
from layerfreeze.train.prefix_clock import PrefixClock
from layerfreeze.train.trainer import Trainer
from tests.conftest import blob_task

pytestmark = pytest.mark.usefixtures("one_thread")
PAUSE_S = 0.03


def _run(tmp_path, name, strategy, **train):
    task = blob_task()
    task.model[0].register_forward_hook(lambda m, a, out: time.sleep(PAUSE_S))  # a slow first block
    cfg = build_config({"train": {"epochs": 1, "batch_size": 16, "lr": 0.01, **train}, "freeze": strategy,
                        "run": {"dir": str(tmp_path / name), "progress": False}})
    summary = Trainer(cfg, task=task).run()
    hooks = [*task.model[0]._forward_pre_hooks.values(), *task.model[1]._forward_hooks.values()]
    assert not [h for h in hooks if isinstance(getattr(h, "__self__", None), PrefixClock)]  # the clock's removed
    return summary, [r for r in read_metrics(tmp_path / name) if r["type"] == "step"]


def test_each_step_with_a_frozen_prefix_records_the_prefix_forward_beside_the_rest(tmp_path):
    summary, steps = _run(tmp_path, "static", {"strategy": "static", "params": {"k": 2}})
    assert summary["frozen_blocks"] == ["0", "1"] and len(steps) == 6
    for r in steps:  # the pause is inside the prefix (block 0)
        assert PAUSE_S <= r["prefix_forward_s"] < r["step_time_s"]
        assert r["suffix_s"] == pytest.approx(r["step_time_s"] - r["prefix_forward_s"], abs=1e-9)
        assert r["suffix_s"] < r["step_time_s"] - PAUSE_S + 1e-9


def test_nothing_frozen_records_no_prefix(tmp_path):
    _, steps = _run(tmp_path, "none", {"strategy": "none"})
    assert steps and all("prefix_forward_s" not in r and "suffix_s" not in r for r in steps)


def test_a_frozen_prefix_builds_no_graph_and_saves_no_activation():
    task = blob_task()
    model = task.model
    for p in [*model[0].parameters(), *model[1].parameters()]:
        p.requires_grad_(False)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        prefix = model[1](model[0](torch.randn(8, 16)))
        assert prefix.grad_fn is None and not prefix.requires_grad and saved == []
        model[6](model[5](model[4](model[3](model[2](prefix))))).sum().backward()
    assert saved and model[0].weight.grad is None and model[4].weight.grad is not None
