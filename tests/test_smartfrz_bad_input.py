"""The offline pipeline on damaged files and mistaken flags (faults found by a newcomer trying it): a clear exit-2
message that says what to do, nothing damaged used, nothing good overwritten, on quick recorded runs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from layerfreeze.smartfrz.collect import collect
from layerfreeze.smartfrz.counterfactual import COUNTERFACTUAL_FILE, PARTIAL_FILE
from layerfreeze.smartfrz.runs import LABELS_FILE, META_FILE
from tests.conftest import predictor_cli

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = "mlp-digits_s0_lr0.02"
CF = ["counterfactual", "--recipes", "mlp-digits", "--lrs", "0.02", "--quick", "--fractions", "0.5",
      "--null-orders", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("bad")
    collect(out, ["mlp-digits"], seeds=[0], lrs=[0.02, 0.08], quick=True)
    torch.set_num_threads(before)
    assert predictor_cli(["predictor", CF[0], str(out), *CF[1:]]) == 0
    return out


@pytest.fixture
def runs(corpus, tmp_path):
    out = tmp_path / "runs"
    shutil.copytree(corpus, out)
    return out


def _out(capsys) -> str:
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("damage", ["truncated", "a list", "a row without accuracy"])
def test_a_damaged_counterfactual_file_is_refused_or_recomputed_never_used(runs, capsys, damage):
    path = runs / RUN / COUNTERFACTUAL_FILE
    good = json.loads(path.read_text())
    if damage == "truncated":
        path.write_text(path.read_text()[:300])
    elif damage == "a list":
        path.write_text("[]")
    else:
        path.write_text(json.dumps({**good, "grid": [{k: v for k, v in good["grid"][0].items() if k != "accuracy"}]}))
    assert predictor_cli(["predictor", "label", str(runs)]) == 0
    labels_before = {d.name: (d / LABELS_FILE).read_text() for d in runs.iterdir()}
    capsys.readouterr()
    for argv in (["calibrate", str(runs)], ["label", str(runs), "--counterfactual"]):
        assert predictor_cli(["predictor", *argv]) == 2
        assert "delete it and recompute it with `layerfreeze predictor counterfactual`" in _out(capsys)
    # labels of every run left as they were: no half-relabelled corpus
    assert {d.name: (d / LABELS_FILE).read_text() for d in runs.iterdir()} == labels_before
    assert predictor_cli(["predictor", CF[0], str(runs), *CF[1:]]) == 0
    out = _out(capsys)
    assert "cannot be used" in out and "recomputing it" in out
    fixed = json.loads(path.read_text())
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in fixed["grid"]] == \
        [{k: v for k, v in r.items() if k != "seconds"} for r in good["grid"]]


def test_damaged_partial_rows_are_not_kept(runs, capsys):
    path = runs / RUN / COUNTERFACTUAL_FILE
    good = json.loads(path.read_text())
    path.unlink()
    partial = {"format": "layerfreeze-smartfrz-counterfactual-partial", "spec": None, "baseline": good["baseline"],
               "rows": [{"t": good["grid"][0]["t"], "depth": 1}]}
    (runs / RUN / PARTIAL_FILE).write_text(json.dumps(partial))
    assert predictor_cli(["predictor", CF[0], str(runs), *CF[1:]]) == 0
    out = _out(capsys)
    assert "damaged rows" in out and "kept from" not in out
    assert all("accuracy" in r for r in json.loads(path.read_text())["grid"])


def test_a_saved_grid_of_other_depths_is_recomputed_for_the_default_depths(runs, capsys):
    assert predictor_cli(["predictor", CF[0], str(runs), *CF[1:], "--depths", "1"]) == 0
    assert {r["depth"] for r in json.loads((runs / RUN / COUNTERFACTUAL_FILE).read_text())["grid"]} == {1}
    capsys.readouterr()
    assert predictor_cli(["predictor", CF[0], str(runs), *CF[1:]]) == 0  # the default: depths 1..3
    assert "has another grid" in _out(capsys)
    assert {r["depth"] for r in json.loads((runs / RUN / COUNTERFACTUAL_FILE).read_text())["grid"]} == {1, 2, 3}


@pytest.mark.parametrize("content,says", [("{\"tau\": 0.9", "cannot be read"), ("[1, 2]", "not a JSON object"),
                                          ("{}", "lacks tau")])
def test_damaged_labels_stop_training_before_it_starts(runs, capsys, content, says):
    assert predictor_cli(["predictor", "label", str(runs)]) == 0
    (runs / RUN / LABELS_FILE).write_text(content)
    capsys.readouterr()
    out_file = runs.parent / "p.safetensors"
    assert predictor_cli(["predictor", "train", str(runs), "--holdout", "", "--epochs", "1",
                          "--out", str(out_file)]) == 2
    out = _out(capsys)
    assert says in out and "label the runs again" in out and not out_file.exists()


def test_a_damaged_meta_file_is_named_not_skipped(runs, capsys):
    (runs / RUN / META_FILE).write_text('{"format": ')
    for argv in (["label", str(runs)], ["calibrate", str(runs)]):
        assert predictor_cli(["predictor", *argv]) == 2
        out = _out(capsys)
        assert f"{RUN}/{META_FILE} cannot be read" in out and "collect it again" in out


def test_mistaken_flags_are_usage_errors(runs, tmp_path, capsys):
    for argv in (["collect", "--out", str(tmp_path / "x"), "--recipes", "", "--quick"],
                 ["collect", "--out", str(tmp_path / "x"), "--recipes", "mlp-digits", "--seeds", "", "--quick"],
                 ["collect", "--out", str(tmp_path / "x"), "--recipes", "mlp-digits", "--lrs", "-1", "--quick"],
                 ["collect", "--out", str(tmp_path / "x"), "--recipes", "mlp-digits", "--lrs", "nan", "--quick"],
                 [CF[0], str(runs), *CF[1:6], "--fractions", ""]):
        with pytest.raises(SystemExit) as exc:
            predictor_cli(["predictor", *argv])
        assert exc.value.code == 2
    assert not (tmp_path / "x").exists()
    assert json.loads((runs / RUN / COUNTERFACTUAL_FILE).read_text())["fractions"] == [0.5]  # not overwritten
    a_file = tmp_path / "junk.safetensors"
    a_file.write_bytes(b"x")
    capsys.readouterr()
    assert predictor_cli(["predictor", "collect", "--out", str(a_file), "--recipes", "mlp-digits", "--quick"]) == 2
    assert "is a file: give a folder" in _out(capsys)
    assert predictor_cli(["predictor", "label", str(runs)]) == 0
    capsys.readouterr()
    assert predictor_cli(["predictor", "train", str(runs), "--holdout", "", "--epochs", "1",
                          "--out", str(tmp_path)]) == 2
    assert "is a folder: give the predictor's file" in _out(capsys)


def test_evaluate_names_a_recipe_typo_and_an_empty_folder(runs, tmp_path, capsys):
    assert predictor_cli(["predictor", "evaluate", str(runs), "--recipes", "mlp-digit"]) == 2
    assert "--recipes names recipes with no runs in" in _out(capsys)
    (tmp_path / "empty").mkdir()
    assert predictor_cli(["predictor", "evaluate", str(tmp_path / "empty")]) == 2
    assert "no complete runs in" in _out(capsys)


def test_labels_with_nothing_freezable_do_not_train_a_never_freezing_predictor(runs, tmp_path, capsys):
    assert predictor_cli(["predictor", "label", str(runs), "--window", "100"]) == 0  # longer than the runs
    capsys.readouterr()
    out_file = tmp_path / "p.safetensors"
    assert predictor_cli(["predictor", "train", str(runs), "--holdout", "", "--epochs", "1",
                          "--out", str(out_file)]) == 2
    assert "no run in" in _out(capsys) and not out_file.exists()


def test_evaluate_counts_a_quick_run_as_unseen_though_a_full_run_of_its_name_was_trained_on(runs, capsys):
    # the shipped predictor was trained on the full-size mlp-digits_s0_lr0.02 and _lr0.08 (450 steps); these are
    # quick runs of the same names, other runs
    assert predictor_cli(["predictor", "label", str(runs)]) == 0
    capsys.readouterr()
    assert predictor_cli(["predictor", "evaluate", str(runs), "--recipes", "mlp-digits"]) == 0
    assert "on 2 unseen runs" in _out(capsys)
