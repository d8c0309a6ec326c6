"""Counterfactual labels (issue 16): replaying a collected run, continuing it with a frozen prefix, the noise floor,
the labels and the calibration of CKA rules against them, on quick recipes."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from layerfreeze.models.discovery import discover_blocks
from layerfreeze.smartfrz.collect import collect
from layerfreeze.smartfrz.counterfactual import (
    COUNTERFACTUAL_FILE,
    PARTIAL_FILE,
    _freeze_prefix,
    _read_partial,
    calibrate,
    counterfactual_for,
    counterfactual_labels,
    grid_depths,
    grid_steps,
    run_counterfactuals,
)
from layerfreeze.smartfrz.recipes.registry import RECIPES
from layerfreeze.smartfrz.runs import PipelineError
from tests.conftest import predictor_cli

pytestmark = pytest.mark.usefixtures("one_thread")


_cli = predictor_cli


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("cf")
    collect(out, ["mlp-digits", "cnn-digits"], seeds=[0], lrs=[0.02], quick=True)
    torch.set_num_threads(before)
    return out


def test_grid_steps_are_activation_snapshots_and_depths_never_include_the_head():
    setup = RECIPES["mlp-digits"].build(0, True, None)
    every, acts = setup.snapshot_every, setup.act_every
    ts = grid_steps(setup, [0.3, 0.6, 0.6])
    assert ts == sorted(set(ts)) and all(t % (every * acts) == 0 and 0 < t < setup.steps for t in ts)
    assert ts[0] >= 0.3 * setup.steps
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        grid_steps(setup, [0.0])
    assert grid_depths(4, head=3) == [1, 2, 3]
    assert grid_depths(20, head=19, max_depths=8)[0] == 1 and grid_depths(20, head=19, max_depths=8)[-1] == 19
    assert len(grid_depths(20, head=19, max_depths=8)) == 8


def test_freeze_prefix_stops_updates_and_drops_optimizer_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Linear(8, 2))
    blocks = discover_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    x = torch.randn(16, 4)
    model(x).sum().backward()
    opt.step()
    _freeze_prefix(model, blocks, 2, opt)
    before = [p.detach().clone() for b in blocks[:2] for p in b.parameters()]
    for _ in range(3):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    after = [p.detach() for b in blocks[:2] for p in b.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # bitwise: no update, no weight decay
    kept = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not any(id(p) in kept or p in opt.state for b in blocks[:2] for p in b.parameters())
    assert not model[1].training  # frozen BatchNorm: running statistics no longer move


def test_continuations_replay_the_run_and_continue_it_frozen(runs):
    run_dir = runs / "mlp-digits_s0_lr0.02"
    recipe = RECIPES["mlp-digits"]
    # depth 0 after the others at each grid step: the kept optimizer state must be copied, not aliased (a
    # continuation's AdamW steps used to move the moments and step count every later one started from)
    cf = run_counterfactuals(lambda: recipe.build(0, True, runs), run_dir, lr=0.02, seed=0, fractions=[0.3, 0.6],
                             depths=[3, 1, 2, 0], null_orders=1)
    assert cf["baseline"]["matches_record"]  # the replay is the recorded run, bit for bit
    ts = sorted({c["t"] for c in cf["grid"]})
    assert len(ts) == 2 and len(cf["grid"]) == 8 and len(cf["null"]) == 2
    base = cf["baseline"]
    for c in cf["grid"]:
        assert c["cost_points"] == round(100 * (base["accuracy"] - c["accuracy"]), 4)
        if c["depth"] == 0:  # nothing frozen, same batches: the restored state (weights, optimizer, LR, RNG) is exact
            assert (c["accuracy"], c["loss"]) == (base["accuracy"], base["loss"])
    deep = [c for c in cf["grid"] if c["depth"] == 3]
    assert all(c["loss"] != base["loss"] for c in deep)  # freezing everything but the head changes the result
    assert all(n["loss"] != base["loss"] for n in cf["null"])  # another data order does too
    assert json.loads((run_dir / COUNTERFACTUAL_FILE).read_text())["grid"] == cf["grid"]


class _Killed(Exception):
    pass


def _rows(cf):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in cf["grid"] + cf["null"]]


def test_a_killed_grid_resumes_from_its_partial_file_and_trains_only_what_it_lacks(runs, tmp_path):
    """A counterfactual grid of a real run is hours; a job killed near its end used to lose every continuation."""
    import shutil

    run_dir = tmp_path / "mlp-digits_s0_lr0.02"
    shutil.copytree(runs / "mlp-digits_s0_lr0.02", run_dir)
    (run_dir / COUNTERFACTUAL_FILE).unlink(missing_ok=True)
    recipe = RECIPES["mlp-digits"]
    kw = {"lr": 0.02, "seed": 0, "fractions": [0.3, 0.6], "depths": [1, 3], "null_orders": 1}
    lines: list[str] = []

    def killed_after_three(line: str) -> None:
        lines.append(line)
        if sum("t=" in x for x in lines) == 3:
            raise _Killed
    with pytest.raises(_Killed):
        run_counterfactuals(lambda: recipe.build(0, True, runs), run_dir, progress=killed_after_three, **kw)
    assert not (run_dir / COUNTERFACTUAL_FILE).exists()
    assert len(json.loads((run_dir / PARTIAL_FILE).read_text())["rows"]) == 3

    lines.clear()
    resumed = run_counterfactuals(lambda: recipe.build(0, True, runs), run_dir, progress=lines.append, **kw)
    trained = [x for x in lines if " t=" in x]
    assert len(trained) == 6 - 3 and any("3 continuations kept" in x for x in lines)
    assert not (run_dir / PARTIAL_FILE).exists()
    (run_dir / COUNTERFACTUAL_FILE).unlink()
    fresh = run_counterfactuals(lambda: recipe.build(0, True, runs), run_dir, **kw)
    assert _rows(resumed) == _rows(fresh)  # the kept rows are the rows an uninterrupted grid computes

    # a corrupt partial file, or one of another grid, is reported and not used
    (run_dir / COUNTERFACTUAL_FILE).unlink()
    (run_dir / PARTIAL_FILE).write_text('{"format": "layerfreeze-smartfrz-counterfactual-partial", "rows": [')
    lines.clear()
    again = run_counterfactuals(lambda: recipe.build(0, True, runs), run_dir, progress=lines.append, **kw)
    assert "cannot be read" in lines[0] and sum(" t=" in x for x in lines) == 6
    assert _rows(again) == _rows(fresh)
    part = {"format": "layerfreeze-smartfrz-counterfactual-partial", "rows": [], "spec": {"depths": [1, 3]},
            "baseline": {}}
    (run_dir / PARTIAL_FILE).write_text(json.dumps(part))
    lines.clear()
    assert _read_partial(run_dir / PARTIAL_FILE, {"depths": [1, 2]}, lines.append) is None
    assert "another grid" in lines[0]
    assert _read_partial(run_dir / PARTIAL_FILE, {"depths": [1, 3]}, lines.append) == part


def test_labels_judge_a_cost_against_the_unfrozen_continuations():
    cf = {"baseline": {"accuracy": 0.90}, "null": [{"t": 10, "accuracy": 0.88}, {"t": 10, "accuracy": 0.91},
                                                 {"t": 20, "accuracy": 0.92}],
          "grid": [{"t": 10, "depth": 1, "accuracy": 0.880}, {"t": 10, "depth": 2, "accuracy": 0.8785},
                   {"t": 10, "depth": 3, "accuracy": 0.8775}, {"t": 20, "depth": 1, "accuracy": 0.8985},
                   {"t": 20, "depth": 2, "accuracy": 0.897}]}
    # t=10: the floor is min(0.90, 0.88) = 0.88, margin 0.2 points -> >= 0.878; t=20: floor 0.90 -> >= 0.898
    assert counterfactual_labels(cf, eps_points=0.2) == {(10, 1): True, (10, 2): True, (10, 3): False,
                                                         (20, 1): True, (20, 2): False}
    assert counterfactual_labels(cf, eps_points=0.0)[(10, 2)] is False


def test_calibrate_scores_cka_rules_on_the_grid(runs):
    counterfactual_for(runs, ["mlp-digits", "cnn-digits"], [0], quick=True, lrs=[0.02], fractions=[0.3, 0.6],
                       null_orders=1)
    rows = calibrate(runs, taus=[0.5], windows=[1, 10_000], deltas=[1.0])
    cells = sum(len(json.loads((runs / d / COUNTERFACTUAL_FILE).read_text())["grid"])
                for d in ("mlp-digits_s0_lr0.02", "cnn-digits_s0_lr0.02"))
    loose, strict = rows
    assert loose["cells"] == strict["cells"] == cells
    # a stability window longer than the run: the rule never calls anything freezable
    assert strict["frozen_share"] == 0 and strict["recall"] == 0 and math.isnan(strict["precision"])
    assert strict["oracle_frozen"] == 0
    assert loose["frozen_share"] >= strict["frozen_share"]
    assert 0 <= loose["oracle_frozen"] <= 1


def test_cli_counterfactual_and_calibrate(runs, tmp_path, capsys):
    assert _cli(["predictor", "counterfactual", str(runs), "--recipes", "mlp-digits", "--lrs", "0.02", "--quick",
                 "--fractions", "0.3,0.6", "--null-orders", "1"]) == 0
    out = capsys.readouterr().out
    assert "mlp-digits_s0_lr0.02" in out and "yes" in out
    path = runs / "mlp-digits_s0_lr0.02" / COUNTERFACTUAL_FILE
    v1 = {k: v for k, v in json.loads(path.read_text()).items() if k != "version"}
    path.write_text(json.dumps(v1))  # a file of before the optimizer-state copy is recomputed, not reused
    assert _cli(["predictor", "counterfactual", str(runs), "--recipes", "mlp-digits", "--lrs", "0.02", "--quick",
                 "--fractions", "0.3,0.6", "--null-orders", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "was computed before version 2" in out and "recomputing it" in out
    assert json.loads(path.read_text())["version"] == 2
    assert _cli(["predictor", "calibrate", str(runs), "--taus", "0.99,0.999"]) == 0
    assert "0.999" in capsys.readouterr().out
    assert _cli(["predictor", "counterfactual", str(runs), "--recipes", "mlp-digits", "--fractions", "1.5"]) == 2
    assert _cli(["predictor", "counterfactual", str(tmp_path), "--recipes", "mlp-digits", "--quick"]) == 2
    assert "not a complete recorded run" in capsys.readouterr().out
    assert _cli(["predictor", "calibrate", str(tmp_path)]) == 2
    for bad in (["--taus", "2"], ["--windows", "0"], ["--deltas", "-1"]):
        assert _cli(["predictor", "calibrate", str(runs), *bad]) == 2
    assert "bad labelling rule values" in " ".join(capsys.readouterr().out.split())
    assert _cli(["predictor", "counterfactual", str(runs), "--recipes", "mlp-digits", "--lrs", "0.02",
                 "--fractions", "0.3"]) == 2  # collected with --quick, asked at full size
    assert "add --quick" in " ".join(capsys.readouterr().out.split())
    assert _cli(["predictor", "counterfactual", str(tmp_path / "nope"), "--recipes", "mlp-digits"]) == 2
    assert "does not exist" in " ".join(capsys.readouterr().out.split())


def test_a_run_of_another_setup_or_a_depth_reaching_the_head_is_refused(runs):
    with pytest.raises(PipelineError, match="does not match"):
        run_counterfactuals(lambda: RECIPES["cnn-digits"].build(0, True, runs), runs / "mlp-digits_s0_lr0.02",
                            lr=0.02, seed=0, fractions=[0.5])
    with pytest.raises(PipelineError, match=r"0\.\.3 blocks"):  # mlp-digits: 4 blocks, the last is the head
        run_counterfactuals(lambda: RECIPES["mlp-digits"].build(0, True, runs), runs / "mlp-digits_s0_lr0.02",
                            lr=0.02, seed=0, fractions=[0.5], depths=[4])


def test_fractions_that_all_move_to_the_run_end_are_refused_and_keep_the_runs_grid(runs, tmp_path, capsys):
    """--fractions 0.99 moved every grid step to the run's end: an empty grid was written over the run's
    counterfactual.json (its continuations lost) and the table came out empty with exit code 0."""
    import shutil

    shutil.copytree(runs / "mlp-digits_s0_lr0.02", tmp_path / "mlp-digits_s0_lr0.02")
    path = tmp_path / "mlp-digits_s0_lr0.02" / COUNTERFACTUAL_FILE
    path.unlink(missing_ok=True)
    args = ["predictor", "counterfactual", str(tmp_path), "--recipes", "mlp-digits", "--lrs", "0.02", "--quick",
            "--depths", "1", "--null-orders", "0"]
    assert _cli([*args, "--fractions", "0.5"]) == 0
    kept = path.read_bytes()
    assert [(c["t"], c["depth"]) for c in json.loads(kept)["grid"]] == [(12, 1)]
    capsys.readouterr()
    assert _cli([*args, "--fractions", "0.9,0.99"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert ("no grid step: --fractions 0.9,0.99 of 24 steps all move to the run's end; give fractions up to 0.875 "
            "(its last activation snapshot before the end, step 21)") in out
    assert path.read_bytes() == kept


def test_calibrate_leaves_out_the_nothing_frozen_cells(runs):
    """--depths 0 (the replay's check) put cells in the grid that no rule calls: calibrate read the head's CKA flags
    for them (flags[-1]) and counted each as a missed free freeze, so adding it changed every rule's recall."""
    run = "mlp-digits_s0_lr0.02"
    grid = [{"t": t, "depth": d, "accuracy": 0.5, "loss": 1.0, "cost_points": 0.0 if d < 3 else 5.0}
            for t in (6, 12, 18) for d in (1, 2, 3)]
    cf = {"run": run, "head": 3, "steps": 24, "baseline": {"accuracy": 0.5}, "null": [], "grid": grid}
    with_zero = {**cf, "grid": grid + [{"t": t, "depth": 0, "accuracy": 0.5, "loss": 1.0, "cost_points": 0.0}
                                       for t in (6, 12, 18)]}
    rules = {"taus": [0.5, 0.99], "windows": [1], "deltas": [1.0]}
    plain = calibrate(runs, counterfactuals=[cf], **rules)
    assert [r["cells"] for r in plain] == [9, 9] and plain[0]["recall"] == 1.0
    assert calibrate(runs, counterfactuals=[with_zero], **rules) == plain
    with pytest.raises(PipelineError, match=r"--deltas nan \(need >= 0\)"):
        calibrate(runs, counterfactuals=[cf], taus=[0.5], windows=[1], deltas=[float("nan")])
