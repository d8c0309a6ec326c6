"""Stability guard: a freeze followed by a worse validation metric is undone, with a cool-down."""

from __future__ import annotations

import pytest
import torch

from layerfreeze import Freezer
from layerfreeze.engine.guard import StabilityGuard
from tests.test_engine import Scripted, make_net


def test_guard_thaws_the_latest_frozen_block_after_patience_worse_evaluations():
    model = make_net()
    guard = StabilityGuard(tolerance=0.05, patience=2, cooldown=1)
    # strategy: freeze block 0 at step 1, block 1 at step 2, and asks to re-freeze block 1 at steps 3 and 4
    freezer = Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      Scripted({1: ([0], []), 2: ([1], []), 3: ([1], []), 4: ([1], [])}), guard=guard)
    assert freezer.report_metric(1.00) is None          # before any freeze: the reference value
    freezer.step()
    freezer.step()                                      # blocks 0 and 1 frozen after the 1.00 measurement
    assert freezer.frozen[:2] == [True, True]
    assert freezer.report_metric(1.04) is None          # within 5 %: fine
    assert freezer.report_metric(1.06) is None          # worse, 1 of 2
    assert freezer.report_metric(1.07) == 1             # worse twice in a row -> thaw the most recent (block 1)
    assert freezer.frozen[:2] == [True, False]
    assert freezer.history[-1]["kind"] == "thaw" and freezer.history[-1]["reason"].startswith("guard: metric 1.07")
    freezer.step()                                      # step 3: cooling down (1 evaluation + this one)
    assert not freezer.frozen[1]
    assert freezer.report_metric(1.0) is None           # cool-down ends
    freezer.step()                                      # step 4: the strategy may freeze block 1 again
    assert freezer.frozen[1]


def test_guard_uses_max_mode_and_counts_nan_as_worse():
    guard = StabilityGuard(tolerance=0.01, patience=1, cooldown=0, mode="max")
    guard.observe(0.90, [False, False])
    guard.on_freeze(0)
    assert guard.observe(0.895, [True, False]) is None   # within 1 % of 0.90
    assert guard.observe(0.88, [True, False]) == 0
    guard.on_freeze(1)
    assert guard.observe(float("nan"), [False, True]) == 1


def test_guard_bad_parameters():
    with pytest.raises(ValueError, match="tolerance"):
        StabilityGuard(tolerance=0)
    with pytest.raises(ValueError, match="patience"):
        StabilityGuard(patience=0)
    with pytest.raises(ValueError, match="mode"):
        StabilityGuard(mode="up")


def test_the_guards_thaw_of_its_last_watched_block_names_the_reference_value():
    # the thaw's reason read the reference after the guard had cleared it: "metric 1.2 worse than nan before the freeze"
    model = make_net()
    freezer = Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), Scripted({1: ([0], [])}),
                      guard=StabilityGuard(tolerance=0.05, patience=1, cooldown=1))
    assert freezer.report_metric(1.0) is None
    freezer.step()
    assert freezer.report_metric(1.2) == 0
    assert freezer.history[-1]["reason"] == "guard: metric 1.2 worse than 1 before the freeze"


def test_a_guard_with_freezeout_is_warned_of_at_construction():
    # its thaws train the block at LR 0 until FreezeOut freezes it again: the guard cannot undo FreezeOut's freezes
    model = make_net()
    with pytest.warns(UserWarning, match=r"a stability guard with strategy 'freezeout', which anneals a block's "
                                         r"learning rate to 0 before it freezes it"):
        Freezer(model, None, "freezeout", total_steps=10, guard=StabilityGuard()).close()
