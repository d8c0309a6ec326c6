"""benchmarks/lr_grid.py (issue 29's grid): its rows, its table, its argument checks, and one --quick cell trained
for real (a smartfrz row that freezes nothing trains exactly as `none` does: same seed, same dropout stream)."""

from __future__ import annotations

import json

import pytest

from layerfreeze.strategies import STRATEGIES
from layerfreeze.strategies.registry import unregister_strategy
from tests.conftest import benchmark_module

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def grid():
    with benchmark_module("lr_grid") as module:
        yield module
    for row in ("smartfrz-nogate", "smartfrz-guard", "none-heldout", "none-reseed", "smartfrz-t95"):
        if row in STRATEGIES:  # registered by the module's rows: gone with it
            unregister_strategy(row)


def test_rows_are_the_default_with_the_gate_and_its_ablation_without(grid):
    assert list(grid.ROWS) == ["smartfrz", "smartfrz-nogate", "smartfrz-guard", "none-heldout", "none-reseed"]
    assert grid.DEFAULT_ROWS == ["smartfrz", "smartfrz-nogate"]
    assert grid.GUARD_ROWS == ("smartfrz-guard", "none-heldout")
    assert grid.row_strategy("smartfrz") is STRATEGIES["smartfrz"]
    cls = grid.row_strategy("smartfrz-nogate")
    assert grid.row_strategy("smartfrz-nogate") is cls  # again: a no-op
    assert STRATEGIES["smartfrz-nogate"] is cls and issubclass(cls, STRATEGIES["smartfrz"])
    assert STRATEGIES["smartfrz"]().snr_gate == 0.9  # the default: on (issue 29)
    assert cls(**grid.ROWS["smartfrz-nogate"][1]).snr_gate is None


def test_table_averages_seeds_and_names_the_worst(grid):
    def cell(seed, none, acc, flops):
        return {"task": "bbc", "lr_factor": 0.3, "epochs": 2, "seed": seed, "steps": 104, "none_accuracy": none,
                "rows": {"smartfrz": {"accuracy": acc, "flops_ratio": flops, "time_ratio": flops, "freeze_steps": {}}}}

    results = {"rows": ["smartfrz", "smartfrz-nogate"],
               "cells": [cell(0, 0.80, 0.75, 0.7), cell(1, 0.70, 0.71, 0.9)]}
    lines = grid.markdown(results).splitlines()
    assert lines[2] == "| bbc | x0.3 | 2 | 104 | 0,1 | 75.00 | -2.00 [-5.00] | 0.800 | 0.800 | - | - | - |"
    assert lines[3] == ""  # then the schedules table


def test_schedules_table_gives_medians_beside_the_oracle(grid, tmp_path, capsys):
    def cell(seed, steps, oracle):
        return {"task": "bbc", "lr_factor": 1.0, "epochs": 1, "seed": seed, "steps": 52, "none_accuracy": 0.9,
                "rows": {"smartfrz": {"accuracy": 0.9, "flops_ratio": 1.0, "time_ratio": 1.0, "freeze_steps": steps}},
                "oracle": oracle}

    cells = [cell(0, {"a": 7, "b": 30}, {"a": 6, "b": 39, "c": None}),
             cell(1, {}, {"a": 8, "b": None, "c": None}),
             cell(2, {"a": 11}, {"a": 4, "b": 40, "c": 41})]
    table = grid.schedules({"rows": ["smartfrz", "smartfrz-nogate"], "cells": cells}).splitlines()
    assert table[0] == "| task | lr | epochs | steps | smartfrz: frozen @ first | smartfrz-nogate: frozen @ first | " \
                       "oracle: frozen @ first |"
    # smartfrz: frozen counts 2, 0, 1 -> 1; first steps 7, 11 (seed 1 froze nothing) -> 9. oracle: 2, 1, 3 -> 2;
    # firsts 6, 8, 4 -> 6
    assert table[2] == "| bbc | x1 | 1 | 52 | 1 @ 9 | - | 2 @ 6 |"
    # two results files merged into one table (one process per task)
    for i, part in enumerate((cells[:1], cells[1:])):
        (tmp_path / f"{i}.json").write_text(json.dumps({"rows": ["smartfrz"], "cells": part}))
    assert grid.main(["--from-json", str(tmp_path / "0.json"), str(tmp_path / "1.json"),
                      "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert [c["seed"] for c in merged["cells"]] == [0, 1, 2]
    assert "| bbc | x1 | 1 | 52 | 1 @ 9 | 2 @ 6 |" in (tmp_path / "merged" / "lr_grid.md").read_text()


def test_merge_joins_the_rows_of_one_cell_run_in_two_processes_and_refuses_different_runs(grid, tmp_path, capsys):
    def cell(none, rows):
        return {"task": "bbc", "lr_factor": 3.0, "epochs": 4, "seed": 0, "steps": 208, "none_accuracy": none,
                "rows": rows}

    row = {"accuracy": 0.95, "flops_ratio": 0.8, "time_ratio": 0.7, "freeze_steps": {}}
    first = {"rows": ["smartfrz"], "cells": [cell(0.96, {"smartfrz": row})]}
    later = {"rows": ["none-reseed"], "cells": [cell(0.96, {"none-reseed": {**row, "accuracy": 0.955}})]}
    merged = grid.merge([first, later])
    assert merged["rows"] == ["smartfrz", "none-reseed"] and len(merged["cells"]) == 1
    assert set(merged["cells"][0]["rows"]) == {"smartfrz", "none-reseed"}
    assert "| bbc | x3 | 4 | 208 | 0 | 96.00 | -1.00 [-1.00] | 0.800 | 0.700 | -0.50 [-0.50] |" in grid.markdown(merged)
    assert first["cells"][0]["rows"] == {"smartfrz": row}  # the parts are left as they were
    other = {"rows": ["none-reseed"], "cells": [cell(0.97, {"none-reseed": row})]}
    for i, part in enumerate((first, other)):
        (tmp_path / f"{i}.json").write_text(json.dumps(part))
    with pytest.raises(SystemExit) as exc:
        grid.main(["--from-json", str(tmp_path / "0.json"), str(tmp_path / "1.json"), "--out", str(tmp_path / "m")])
    assert exc.value.code == 2 and "different `none` accuracies" in capsys.readouterr().err
    assert merged["predictor"] is None
    with pytest.raises(ValueError, match="different predictors"):  # a candidate's rows are not the shipped one's
        grid.merge([first, {**later, "predictor": "/candidate.safetensors"}])


@pytest.mark.parametrize(("argv", "message"), [
    (["--rows", "smartfrz,gate"], "unknown rows ['gate']"),
    (["--tasks", "cifar"], "unknown tasks ['cifar']"),
    (["--lrs", "0.3,x"], "comma-separated float"),
    (["--epochs", "0"], "--epochs integers >= 1"),
    (["--predictor", "no/such/predictor.safetensors"], "--predictor no/such/predictor.safetensors: SmartFRZ "
     "predictor file"),
    (["--variant", "smartfrz-t95"], "--variant takes NAME:KEY=VALUE"),
    (["--variant", "smartfrz-t95:threshold"], "parameters are KEY=VALUE, got 'threshold'"),
    (["--variant", "smartfrz-t95:threshold=high"], "threshold's value 'high' is not JSON"),
    (["--variant", "smartfrz-t95:threshold=2"], "--variant smartfrz-t95: smartfrz: threshold must be in (0, 1)"),
    (["--variant", "smartfrz-t95:thresh=0.9"], "--variant smartfrz-t95: "),
    (["--variant", "smartfrz-nogate:threshold=0.9"], "a row or strategy of that name exists"),
    (["--variant", "none:threshold=0.9"], "a row or strategy of that name exists"),
    (["--variant", "egeria:threshold=0.9"], "a row or strategy of that name exists"),
    (["--variant", "../seed1:threshold=0.9"], "the row name '../seed1' becomes a folder"),
    (["--variant", "a,b:threshold=0.9"], "the row name 'a,b' becomes a folder"),
    (["--variant", "t:threshold=0.9,threshold=0.95"], "threshold is given twice"),
    (["--variant", "t:threshold=0.9", "--variant", "t:threshold=0.95"], "--variant t is given twice"),
])
def test_bad_arguments_are_parser_errors_before_training(grid, argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        grid.main([*argv, "--out", str(tmp_path)])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_variant_is_a_smartfrz_row_with_its_parameters_recorded_and_checked_on_resume(grid, tmp_path, capsys,
                                                                                       monkeypatch):
    seen = []

    def fake_cell(task, lr, ep, seed, rows, out, oracle, console, quick, threads, predictor):
        seen.append((rows, {r: grid.row_params([r])[r] for r in rows}))
        return {"task": task, "lr_factor": lr, "epochs": ep, "seed": seed, "steps": 4, "none_accuracy": 0.5,
                "rows": {r: {"accuracy": 0.5, "flops_ratio": 1.0, "time_ratio": 1.0, "freeze_steps": {}}
                         for r in rows}}

    monkeypatch.setattr(grid, "run_cell", fake_cell)
    monkeypatch.setattr(grid, "ROWS", dict(grid.ROWS))  # the variants registered below leave with the test
    argv = ["--tasks", "bbc", "--lrs", "1", "--epochs", "1", "--seeds", "0", "--out", str(tmp_path),
            "--rows", "smartfrz,smartfrz-t95", "--variant", "smartfrz-t95:threshold=0.95,snr_gate=null"]
    assert grid.main(argv) == 0
    assert seen == [(["smartfrz", "smartfrz-t95"], {"smartfrz": {}, "smartfrz-t95": {"threshold": 0.95,
                                                                                      "snr_gate": None}})]
    assert grid.row_strategy("smartfrz-t95")(**grid.ROWS["smartfrz-t95"][1]).threshold == 0.95
    recorded = json.loads((tmp_path / "results.json").read_text())
    assert recorded["variants"] == {"smartfrz-t95": {"threshold": 0.95, "snr_gate": None}}
    monkeypatch.setattr(grid, "ROWS", {k: v for k, v in grid.ROWS.items() if k != "smartfrz-t95"})
    with pytest.raises(SystemExit) as exc:  # the same name with other parameters is another grid
        grid.main([*argv[:-1], "smartfrz-t95:threshold=0.9", "--resume", "--seeds", "0,1"])
    assert exc.value.code == 2 and "ran the variants" in capsys.readouterr().err
    assert len(seen) == 1


def test_merge_keeps_the_variants_and_refuses_one_name_with_two_settings(grid):
    def part(threshold):
        return {"rows": ["smartfrz-t"], "predictor": None, "variants": {"smartfrz-t": {"threshold": threshold}},
                "cells": [{"task": "bbc", "lr_factor": 1.0, "epochs": 1, "seed": 0, "none_accuracy": 0.5,
                           "rows": {"smartfrz-t": {"accuracy": 0.5}}}]}

    assert grid.merge([part(0.95), part(0.95)])["variants"] == {"smartfrz-t": {"threshold": 0.95}}
    with pytest.raises(ValueError, match="the variant row smartfrz-t was run with different parameters"):
        grid.merge([part(0.95), part(0.5)])


def test_a_variants_own_predictor_is_kept_beside_the_grids(grid, monkeypatch):
    monkeypatch.setitem(grid.ROWS, "smartfrz-own", ("smartfrz", {"predictor": "/B", "threshold": 0.9}))
    assert grid.row_params(["smartfrz", "smartfrz-own"], "/A") == {
        "smartfrz": {"predictor": "/A"}, "smartfrz-own": {"predictor": "/B", "threshold": 0.9}}


def test_a_candidate_predictor_goes_to_the_smartfrz_rows_only(grid):
    params = grid.row_params(["smartfrz", "smartfrz-nogate", "none-reseed"], "/p.safetensors")
    assert params == {"smartfrz": {"predictor": "/p.safetensors"},
                      "smartfrz-nogate": {"snr_gate": None, "predictor": "/p.safetensors"}, "none-reseed": {}}
    assert grid.row_params(["smartfrz-nogate"]) == {"smartfrz-nogate": {"snr_gate": None}}


def test_the_candidate_predictor_reaches_every_cell_and_a_resume_of_another_is_refused(grid, tmp_path, capsys,
                                                                                         monkeypatch):
    # run_cell's training is the quick cell's below; here what main hands it and records
    from layerfreeze.strategies.smartfrz.predictor import DEFAULT_PREDICTOR

    seen = []

    def fake_cell(task, lr, ep, seed, rows, out, oracle, console, quick, threads, predictor):
        seen.append(predictor)
        return {"task": task, "lr_factor": lr, "epochs": ep, "seed": seed, "steps": 4, "none_accuracy": 0.5,
                "rows": {r: {"accuracy": 0.5, "flops_ratio": 1.0, "time_ratio": 1.0, "freeze_steps": {}}
                         for r in rows}}

    monkeypatch.setattr(grid, "run_cell", fake_cell)
    argv = ["--tasks", "bbc", "--lrs", "1", "--epochs", "1", "--seeds", "0,1", "--out", str(tmp_path / "g"),
            "--resume", "--predictor", str(DEFAULT_PREDICTOR)]  # --resume of a file not there yet: a fresh grid
    assert grid.main(argv) == 0
    expected = str(DEFAULT_PREDICTOR.resolve())
    assert seen == [expected, expected]
    assert json.loads((tmp_path / "g" / "results.json").read_text())["predictor"] == expected
    with pytest.raises(SystemExit) as exc:  # resuming the file with the shipped predictor: not the same grid
        grid.main(argv[:-2])
    assert exc.value.code == 2 and "was run with predictor" in capsys.readouterr().err
    assert grid.main(argv) == 0 and len(seen) == 2  # the same predictor: both seeds are there, nothing runs


@pytest.mark.assets("fashion_mnist", "mobilenet_v2")
def test_quick_cell_trains_none_and_both_rows_on_one_stream(grid, tmp_path, capsys):
    from layerfreeze.strategies.smartfrz.predictor import _load

    _load.cache_clear()  # the first smartfrz row in a process reads the predictor file (issue 29's RNG bug)
    argv = ["--quick", "--tasks", "fmnist-mobilenet", "--lrs", "1", "--epochs", "1", "--seeds", "0",
            "--rows", "smartfrz,smartfrz-nogate,smartfrz-guard,none-heldout,none-reseed", "--out", str(tmp_path)]
    assert grid.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["predictor"] is None
    (cell,) = results["cells"]
    assert (cell["task"], cell["lr_factor"], cell["epochs"], cell["seed"], cell["steps"]) == (
        "fmnist-mobilenet", 1.0, 1, 0, 4)
    for name in ("smartfrz", "smartfrz-nogate"):
        row = cell["rows"][name]
        # 4 steps: fewer than the predictor's 8 snapshots, nothing freezes, so the row is `none` step for step
        assert row["freeze_steps"] == {} and row["stopped"] is None
        assert row["accuracy"] == cell["none_accuracy"] and row["flops_ratio"] == 1.0
    assert "| fmnist-mobilenet | x1 | 1 | 4 | 0 |" in (tmp_path / "lr_grid.md").read_text()
    # the guard rows: the default strategy (and its control, none) with freeze.guard checked every max(1, 4 // 8)
    # steps on a held-out tenth of the training data
    for name in ("smartfrz-guard", "none-heldout"):
        guard = cell["rows"][name]
        assert guard["stopped"] is None and guard["thaws"] == 0 and guard["freeze_steps"] == {}
        assert guard["wall_s"] > guard["train_s"] > 0
        folder = tmp_path / "fmnist-mobilenet" / "lr1-ep1" / "seed0" / name
        config = json.loads((folder / "config.json").read_text())
        assert config["freeze"]["guard"]["every_steps"] == 1 and config["freeze"]["guard"]["val_fraction"] == 0.1
        held_out = [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
        assert [r["step"] for r in held_out][:4] == [1, 2, 3, 4]  # a held-out evaluation after every step
    # 26 of the 256 samples held out: the control trains on other batches than `none` from its first step

    def losses(name):
        metrics = (tmp_path / "fmnist-mobilenet" / "lr1-ep1" / "seed0" / name / "metrics.jsonl").read_text()
        return [r["loss"] for r in map(json.loads, metrics.splitlines()) if r["type"] == "step" and "loss" in r]

    assert len(losses("none-heldout")) == len(losses("none")) == 4 and losses("none-heldout") != losses("none")
    # the noise floor: `none` to its middle step (2 of 4), then other dropout draws (MobileNetV2's classifier)
    reseed = losses("none-reseed")
    assert reseed[:2] == losses("none")[:2] and reseed[2] != losses("none")[2]
