"""Schedule-based strategies (gradual, linear, geometric) driven through the real Freezer: the exact step and epoch at
which each block freezes or thaws, checked against hand computations written here with exact fractions."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch
from torch import nn

from layerfreeze import Freezer, block_param_groups, discover_blocks
from layerfreeze.strategies.geometric import GeometricFreezing
from layerfreeze.strategies.gradual import GradualUnfreezing
from layerfreeze.strategies.linear import LinearFreezing

HEAD_LR = 0.1


def make_net(num_blocks: int = 8) -> nn.Sequential:
    """``num_blocks`` Linear layers; the last one is the head. 8 blocks -> 7 non-head blocks."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(num_blocks)])


def make_freezer(strategy, num_blocks=8, epochs=10, steps_per_epoch=3, optimizer=True, total_steps="auto",
                 scheduler=False):
    model = make_net(num_blocks)
    opt = sched = None
    if optimizer:
        opt = torch.optim.SGD(block_param_groups(model, discover_blocks(model), lr=HEAD_LR), lr=HEAD_LR)
        if scheduler:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    total = epochs * steps_per_epoch if total_steps == "auto" else total_steps
    freezer = Freezer(model, opt, strategy, total_steps=total, steps_per_epoch=steps_per_epoch, scheduler=sched)
    return freezer, model, opt, sched


def run(freezer, epochs, steps_per_epoch, start_epoch=0, start_batch=0):
    """Simulate the training loop (no backward needed: these strategies look only at the clock).

    Returns the signals of every stage that ran, as ``(event, step, signals)``."""
    stages = []
    for epoch in range(start_epoch, epochs):
        for _ in range(start_batch if epoch == start_epoch else 0, steps_per_epoch):
            decision = freezer.step()
            if decision is not None:
                stages.append(("step", freezer.step_count, decision.signals))
        decision = freezer.epoch_end()
        if decision is not None:
            stages.append(("epoch_end", freezer.step_count, decision.signals))
    return stages


def events(freezer, kind):
    """``(block index, step, epoch)`` of each freeze or thaw the Freezer recorded, in order."""
    return [(r["index"], r["step"], r["epoch"]) for r in freezer.history if r["kind"] == kind]


# ---- gradual -----------------------------------------------------------------------------------------------------


def test_gradual_starts_with_only_the_head_and_thaws_one_block_per_epoch_top_down_with_ulmfit_lrs():
    spe, epochs = 3, 9
    freezer, model, opt, _ = make_freezer(GradualUnfreezing(), epochs=epochs, steps_per_epoch=spe)
    # Start stage: blocks 0..6 frozen at step 0, only the head (block 7) trains.
    assert events(freezer, "freeze") == [(i, 0, 0) for i in range(7)]
    assert [p.requires_grad for p in model.parameters()] == [False] * 14 + [True] * 2
    run(freezer, epochs, spe)
    # Hand computation: at the end of epoch e (0-based, e = 0..6) block 6 - e thaws, at step 3 * (e + 1), with
    # lr = head lr / 2.6 ** (7 - (6 - e)) = 0.1 / 2.6 ** (e + 1). Epochs 7 and 8 have nothing left to thaw.
    expected = [(6 - e, spe * (e + 1), e) for e in range(7)]
    assert events(freezer, "thaw") == expected
    thaws = [r for r in freezer.history if r["kind"] == "thaw"]
    assert [r["lr"] for r in thaws] == [0.1 / 2.6 ** (e + 1) for e in range(7)]
    assert not any(freezer.frozen)
    # The optimizer holds the discriminative LRs: block l at 0.1 / 2.6 ** (7 - l), the head unchanged.
    group_lrs = [g["lr"] for g in opt.param_groups if g["block"] != "(unassigned)"]
    assert group_lrs == [0.1 / 2.6 ** (7 - i) for i in range(7)] + [0.1]
    assert freezer.last_signals["stage"] == 9 and "thawed_index" not in freezer.last_signals


def test_gradual_every_two_epochs_and_the_signals_it_reports():
    spe, epochs = 2, 6
    freezer, _, _, _ = make_freezer(GradualUnfreezing(every_epochs=2, lr_decay=2.0), epochs=epochs,
                                    steps_per_epoch=spe)
    stages = run(freezer, epochs, spe)
    # Stages only after epochs 2, 4, 6 (0-based epochs 1, 3, 5): blocks 6, 5, 4, lr 0.1 / 2 ** 1, 2, 3.
    assert events(freezer, "thaw") == [(6, 4, 1), (5, 8, 3), (4, 12, 5)]
    assert [r["lr"] for r in freezer.history if r["kind"] == "thaw"] == [0.1 / 2, 0.1 / 4, 0.1 / 8]
    assert [s[2]["stage"] for s in stages if s[2]] == [1, 2, 3]
    last = stages[-1][2]
    assert last["thawed_index"] == 4 and last["thaw_lr"] == 0.1 / 8 and last["trainable_from"] == 4
    assert last["head_lr"] == 0.1 and last["target_lrs"] == [0.1 / 2 ** (7 - i) for i in range(8)]
    assert freezer.frozen == [True] * 4 + [False] * 4


def test_gradual_every_steps_ignores_epoch_ends():
    spe, epochs = 3, 4
    strategy = GradualUnfreezing(every_steps=5)
    assert strategy.stage_every == 5 and strategy.at_epoch_end is False
    freezer, _, _, _ = make_freezer(strategy, epochs=epochs, steps_per_epoch=spe)
    run(freezer, epochs, spe)
    # Steps 5 and 10 (epochs 1 and 3 of 0-based counting: step 5 is in epoch 1, step 10 in epoch 3).
    assert events(freezer, "thaw") == [(6, 5, 1), (5, 10, 3)]
    assert [r["lr"] for r in freezer.history if r["kind"] == "thaw"] == [0.1 / 2.6, 0.1 / 2.6 ** 2]


def test_gradual_without_optimizer_thaws_without_lr():
    freezer, _, _, _ = make_freezer(GradualUnfreezing(), epochs=2, steps_per_epoch=1, optimizer=False)
    run(freezer, 2, 1)
    thaws = [r for r in freezer.history if r["kind"] == "thaw"]
    assert [(r["index"], r["epoch"]) for r in thaws] == [(6, 0), (5, 1)]
    assert all("lr" not in r for r in thaws)


def test_gradual_uses_the_heads_base_lr_not_the_scheduled_one():
    # LambdaLR halves every LR (current head lr 0.05); the thaw LR derives from the head's initial_lr (0.1), and the
    # scheduler's base LR of the thawed block is updated so the schedule applies on top of it.
    freezer, _, opt, sched = make_freezer(GradualUnfreezing(), epochs=1, steps_per_epoch=2, scheduler=True)
    assert opt.param_groups[7]["lr"] == 0.05
    run(freezer, 1, 2)
    assert events(freezer, "thaw") == [(6, 2, 0)]
    assert freezer.history[-1]["lr"] == 0.1 / 2.6
    assert sched.base_lrs[6] == 0.1 / 2.6 and opt.param_groups[6]["initial_lr"] == 0.1 / 2.6


# ---- linear (Composer LayerFreezing) -------------------------------------------------------------------------------


def linear_hand(count, epochs, freeze_start, freeze_level):
    """Blocks frozen after each epoch E = 1..epochs: int(freeze_level * (t - start) / (1 - start) * count)."""
    out = []
    for done in range(1, epochs + 1):
        t = Fraction(done, epochs)
        frac = Fraction(0) if t <= freeze_start else freeze_level * (t - freeze_start) / (1 - freeze_start)
        out.append(min(count, math.floor(frac * count)))
    return out


def freeze_epochs_from_targets(targets, spe):
    """Expected ``(index, step, epoch)`` freeze events for a prefix that grows to ``targets[e]`` after epoch e."""
    expected, done = [], 0
    for e, target in enumerate(targets):
        expected += [(i, spe * (e + 1), e) for i in range(done, target)]
        done = max(done, target)
    return expected


def test_linear_defaults_over_ten_epochs_freeze_1_2_4_5_7_blocks_after_epochs_6_to_10():
    spe, epochs = 4, 10
    freezer, _, _, _ = make_freezer(LinearFreezing(), epochs=epochs, steps_per_epoch=spe)
    assert events(freezer, "freeze") == []
    stages = run(freezer, epochs, spe)
    # Hand: t = E/10; E <= 5 -> 0; E = 6..10 -> floor(7 * (E - 5) / 5) = floor(1.4, 2.8, 4.2, 5.6, 7.0).
    targets = [0, 0, 0, 0, 0, 1, 2, 4, 5, 7]
    assert linear_hand(7, epochs, Fraction(1, 2), Fraction(1)) == targets
    assert events(freezer, "freeze") == [
        (0, 24, 5), (1, 28, 6), (2, 32, 7), (3, 32, 7), (4, 36, 8), (5, 40, 9), (6, 40, 9),
    ]
    assert events(freezer, "freeze") == freeze_epochs_from_targets(targets, spe)
    assert events(freezer, "thaw") == []
    assert freezer.frozen == [True] * 7 + [False]  # never the head
    assert [s[2]["target_frozen"] for s in stages] == targets
    assert stages[7][2]["t"] == 0.8 and stages[7][2]["count"] == 7


@pytest.mark.parametrize("num_blocks, epochs, start, level", [
    (8, 5, Fraction(1, 5), Fraction(1, 2)),  # 0.2 / 0.5: targets 0, 0, 1, 2, 3
    (11, 10, Fraction(1, 2), Fraction(1)),   # 10 non-head blocks: exact 2 at t=0.6 (floats say 1.9999999999999996)
    (8, 4, Fraction(0), Fraction(1)),        # from the start: 1, 3, 5, 7
])
def test_linear_other_parameters_match_the_hand_schedule(num_blocks, epochs, start, level):
    spe = 2
    freezer, _, _, _ = make_freezer(LinearFreezing(float(start), float(level)), num_blocks=num_blocks,
                                    epochs=epochs, steps_per_epoch=spe)
    run(freezer, epochs, spe)
    targets = linear_hand(num_blocks - 1, epochs, start, level)
    assert events(freezer, "freeze") == freeze_epochs_from_targets(targets, spe)
    assert not freezer.frozen[-1]


def test_linear_without_total_steps_is_a_clear_error():
    with pytest.raises(RuntimeError, match="total_steps"):
        make_freezer(LinearFreezing(), total_steps=None)


# ---- geometric (PipeTransformer) ---------------------------------------------------------------------------------


def geometric_hand(count, epochs, alpha):
    return [min(count, math.ceil(count * (1 - (1 - alpha) ** t))) for t in range(1, epochs + 1)]


def test_geometric_alpha_third_with_seven_blocks_freezes_3_4_5_6_7_rounding_up_as_the_authors_code():
    spe, epochs = 2, 8
    freezer, _, _, _ = make_freezer(GeometricFreezing(), epochs=epochs, steps_per_epoch=spe)
    stages = run(freezer, epochs, spe)
    # Hand: ceil(7 * (1 - (2/3)^T)) (PipeTransformer's auto_freeze.py rounds up): T=1: 7/3 = 2.33 -> 3;
    # T=2: 35/9 = 3.89 -> 4; T=3: 133/27 = 4.93 -> 5; T=4: 455/81 = 5.62 -> 6; T=5: 1477/243 = 6.08 -> 7 = L;
    # T=6..8: 6.39, 6.59, 6.73 -> 7. The head (block 7) trains on.
    targets = [3, 4, 5, 6, 7, 7, 7, 7]
    assert geometric_hand(7, epochs, Fraction(1, 3)) == targets
    assert events(freezer, "freeze") == [(0, 2, 0), (1, 2, 0), (2, 2, 0), (3, 4, 1), (4, 6, 2), (5, 8, 3),
                                         (6, 10, 4)]
    assert events(freezer, "thaw") == []
    assert freezer.frozen == [True] * 7 + [False]
    assert [s[2]["target_frozen"] for s in stages] == targets
    assert stages[0][2]["frozen_real"] == pytest.approx(7 / 3)


@pytest.mark.parametrize("num_blocks, alpha", [
    (10, Fraction(1, 3)),  # 9 non-head blocks: T=1 is exactly 3 (floats: 2.9999999999999996), T=2 exactly 5
    (8, Fraction(1)),      # alpha = 1: everything but the head after the first epoch
    (8, Fraction(1, 2)),   # 3.5, 5.25, 6.125, 6.5625, ... -> 4, 6, 7, 7, ...
    (11, Fraction(1, 10)), # 1, 1.9, 2.71, 3.439, ... -> 1, 2, 3, 4, ...: T=1 exactly 1
])
def test_geometric_other_parameters_match_the_hand_schedule(num_blocks, alpha):
    spe, epochs = 1, 6
    freezer, _, _, _ = make_freezer(GeometricFreezing(float(alpha)), num_blocks=num_blocks, epochs=epochs,
                                    steps_per_epoch=spe)
    run(freezer, epochs, spe)
    targets = geometric_hand(num_blocks - 1, epochs, alpha)
    assert events(freezer, "freeze") == freeze_epochs_from_targets(targets, spe)
    assert not freezer.frozen[-1]


def test_geometric_needs_no_total_steps():
    freezer, _, _, _ = make_freezer(GeometricFreezing(), total_steps=None, steps_per_epoch=None)
    run(freezer, 1, 2)
    assert freezer.frozen_prefix == 3  # ceil(7 / 3)


# ---- parameters ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls, kwargs, match", [
    (GradualUnfreezing, {"every_epochs": 0}, "every_epochs must be an integer >= 1"),
    (GradualUnfreezing, {"every_epochs": 1.5}, "every_epochs must be an integer >= 1"),
    (GradualUnfreezing, {"every_epochs": True}, "every_epochs must be an integer >= 1"),
    (GradualUnfreezing, {"every_steps": 0}, "every_steps must be an integer >= 1"),
    (GradualUnfreezing, {"every_steps": 2.0}, "every_steps must be an integer >= 1"),
    (GradualUnfreezing, {"every_epochs": 2, "every_steps": 10}, "not both"),
    (GradualUnfreezing, {"lr_decay": 0.5}, "lr_decay must be a finite number >= 1"),
    (GradualUnfreezing, {"lr_decay": float("inf")}, "lr_decay must be a finite number >= 1"),
    (LinearFreezing, {"freeze_start": 1.0}, r"freeze_start must be a number in \[0, 1\)"),
    (LinearFreezing, {"freeze_start": -0.1}, r"freeze_start must be a number in \[0, 1\)"),
    (LinearFreezing, {"freeze_start": "0.5"}, r"freeze_start must be a number in \[0, 1\)"),
    (LinearFreezing, {"freeze_level": 0.0}, r"freeze_level must be a number in \(0, 1\]"),
    (LinearFreezing, {"freeze_level": 1.5}, r"freeze_level must be a number in \(0, 1\]"),
    (LinearFreezing, {"freeze_level": float("nan")}, r"freeze_level must be a number in \(0, 1\]"),
    (GeometricFreezing, {"alpha": 0.0}, r"alpha must be a number in \(0, 1\]"),
    (GeometricFreezing, {"alpha": 1.01}, r"alpha must be a number in \(0, 1\]"),
    (GeometricFreezing, {"alpha": float("nan")}, r"alpha must be a number in \(0, 1\]"),
])
def test_bad_parameters_are_rejected_with_a_message_naming_them(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_defaults_and_names():
    g, lin, geo = GradualUnfreezing(), LinearFreezing(), GeometricFreezing()
    assert (g.name, g.every_epochs, g.every_steps, g.lr_decay, g.at_epoch_end, g.stage_every) == \
        ("gradual", 1, None, 2.6, True, None)
    assert (lin.name, lin.freeze_start, lin.freeze_level, lin.at_epoch_end) == ("linear", 0.5, 1.0, True)
    assert (geo.name, geo.alpha, geo.at_epoch_end) == ("geometric", 1 / 3, True)


# ---- resume --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("factory, epochs, spe, split", [
    (GradualUnfreezing, 9, 3, (3, 1)),                          # resume in the middle of epoch 3
    (lambda: GradualUnfreezing(every_steps=4), 6, 3, (2, 2)),   # step schedule, resume mid-epoch
    (LinearFreezing, 10, 4, (7, 0)),                            # resume at the start of epoch 7
    (GeometricFreezing, 8, 2, (2, 1)),
])
def test_a_strategy_restored_mid_run_makes_the_same_later_decisions(factory, epochs, spe, split):
    full, _, full_opt, _ = make_freezer(factory(), epochs=epochs, steps_per_epoch=spe)
    full_stages = run(full, epochs, spe)

    first, _, first_opt, _ = make_freezer(factory(), epochs=epochs, steps_per_epoch=spe)
    epoch, batch = split
    first_stages = run(first, epoch, spe)
    for _ in range(batch):
        decision = first.step()
        if decision is not None:
            first_stages.append(("step", first.step_count, decision.signals))
    saved = json.loads(json.dumps(first.state_dict()))  # plain values only, as a checkpoint would store them
    saved_opt = first_opt.state_dict()

    resumed, _, resumed_opt, _ = make_freezer(factory(), epochs=epochs, steps_per_epoch=spe)
    resumed.load_state_dict(saved)
    resumed_opt.load_state_dict(saved_opt)
    later = run(resumed, epochs, spe, start_epoch=epoch, start_batch=batch)

    assert first_stages + later == full_stages  # same stages, same signals (counters restored)
    assert resumed.history == full.history
    assert resumed.frozen == full.frozen
    assert [g["lr"] for g in resumed_opt.param_groups] == [g["lr"] for g in full_opt.param_groups]
    assert resumed.strategy.state_dict() == full.strategy.state_dict()
