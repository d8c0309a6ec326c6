"""The offline pipeline on damaged files and mistaken flags (faults found by a newcomer trying it): a clear exit-2
message that says what to do, nothing damaged used, nothing good overwritten, on quick recorded runs."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from layerfreeze.smartfrz.collect import collect
from layerfreeze.smartfrz.counterfactual import COUNTERFACTUAL_FILE, PARTIAL_FILE
from layerfreeze.smartfrz.recipes import RECIPES
from layerfreeze.smartfrz.runs import ACTIVATIONS_FILE, LABELS_FILE, META_FILE, WEIGHTS_FILE, PipelineError
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


def test_a_run_with_a_missing_or_foreign_file_is_named_not_left_out(runs, capsys):
    # label and train dropped such a run in silence ("trained on 3 runs" of 4, exit 0)
    assert predictor_cli(["predictor", "label", str(runs)]) == 0
    capsys.readouterr()
    meta = (runs / RUN / META_FILE).read_text()
    (runs / RUN / META_FILE).write_text((runs / RUN / LABELS_FILE).read_text())  # another file of the pipeline
    assert predictor_cli(["predictor", "label", str(runs)]) == 2
    assert f"{RUN}/{META_FILE} is not a recorded run's meta (format None): delete the run folder {RUN} and collect " \
        "it again" in _out(capsys)
    (runs / RUN / META_FILE).write_text(meta.replace('"format_version": 1', '"format_version": 2'))
    assert predictor_cli(["predictor", "label", str(runs)]) == 2
    assert "has format_version 2, which this layerfreeze does not read (it reads 1)" in _out(capsys)
    (runs / RUN / META_FILE).write_text(meta)
    (runs / RUN / WEIGHTS_FILE).unlink()
    assert predictor_cli(["predictor", "train", str(runs), "--holdout", "", "--epochs", "1",
                          "--out", str(runs.parent / "p.safetensors")]) == 2
    assert f"{RUN} is complete but has no {WEIGHTS_FILE}: delete the run folder {RUN} and collect it again" in \
        _out(capsys)
    assert (runs / RUN / "counterfactual.json").exists()
    assert predictor_cli(["predictor", "collect", "--out", str(runs), "--recipes", "mlp-digits", "--seeds", "0",
                          "--quick"]) == 0  # records it again, and drops what was derived from the old recording
    assert (runs / RUN / WEIGHTS_FILE).exists() and not (runs / RUN / LABELS_FILE).exists()
    assert not (runs / RUN / "counterfactual.json").exists()
    assert predictor_cli(["predictor", "label", str(runs / RUN)]) == 2  # one run, not the folder of runs
    assert _out(capsys).endswith(f"{runs / RUN} is one recorded run; give the folder that holds the runs, {runs}")


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


def test_collect_refuses_finished_runs_of_other_settings_before_any_work(runs, capsys):
    before = {p: p.stat().st_mtime_ns for p in runs.rglob("*")}
    seen = []
    with pytest.raises(PipelineError) as exc:  # the runs are --quick ones
        collect(runs, ["mlp-digits"], seeds=[1, 0], on_run=lambda *a: seen.append(a))
    assert str(exc.value) == (f"{runs / RUN} was collected with --quick: add --quick to resume that collection, or "
                              "collect into another --out (quick and full-size runs share their names)")
    with pytest.raises(PipelineError) as exc:  # the same run name, another rate
        collect(runs, ["mlp-digits"], seeds=[1, 0], lrs=[0.02000001], quick=True, on_run=lambda *a: seen.append(a))
    assert str(exc.value) == (f"{runs / RUN} was recorded at learning rate 0.02, not 0.02000001 (the run name keeps 6 "
                              "digits): collect into another --out, or delete that run folder to record it at "
                              "0.02000001")
    assert seen == [] and {p: p.stat().st_mtime_ns for p in runs.rglob("*")} == before  # nothing recorded
    meta = json.loads((runs / RUN / META_FILE).read_text())
    (runs / RUN / META_FILE).write_text(json.dumps({**meta, "quick": False}))
    assert predictor_cli(["predictor", "collect", "--out", str(runs), "--recipes", "mlp-digits", "--seeds", "0",
                          "--lrs", "0.02", "--quick"]) == 2
    assert _out(capsys) == (f"collecting 1 run into {runs} layerfreeze: error: {runs / RUN} was collected at full "
                            "size: drop --quick to resume that collection, or collect into another --out (quick and "
                            "full-size runs share their names)")
    (runs / RUN / META_FILE).write_text(json.dumps(meta))
    assert predictor_cli(["predictor", "collect", "--out", str(runs), "--recipes", "mlp-digits", "--seeds", "0",
                          "--quick"]) == 0
    assert _out(capsys) == (f"collecting 2 runs into {runs} {RUN}: skipped (already recorded) "
                            "mlp-digits_s0_lr0.08: skipped (already recorded) done: 0 recorded, 2 already there, "
                            "0 diverged")


@pytest.mark.parametrize("name", [WEIGHTS_FILE, ACTIVATIONS_FILE])
def test_a_truncated_tensor_file_is_named_and_collect_records_the_run_again(runs, capsys, name):
    assert predictor_cli(["predictor", "label", str(runs)]) == 0
    good = {k: v.clone() for k, v in load_file(str(runs / RUN / name)).items()}  # not a view of the mapped file
    path = runs / RUN / name
    path.write_bytes(path.read_bytes()[:1000])
    capsys.readouterr()
    argv = ["train", str(runs), "--holdout", "", "--epochs", "1", "--out", str(runs.parent / "p.safetensors")] \
        if name == WEIGHTS_FILE else ["label", str(runs)]
    assert predictor_cli(["predictor", *argv]) == 2
    assert _out(capsys) == (f"layerfreeze: error: {path} cannot be read (Error while deserializing header: incomplete "
                            f"metadata, file not fully covered): delete the run folder {RUN} and collect it again "
                            "(`layerfreeze predictor collect` skips the finished runs)")
    assert not (runs.parent / "p.safetensors").exists()
    assert predictor_cli(["predictor", "collect", "--out", str(runs), "--recipes", "mlp-digits", "--seeds", "0",
                          "--quick"]) == 0
    out = _out(capsys)
    assert out.startswith(f"collecting 2 runs into {runs} {RUN}: {name} cannot be read (Error while deserializing "
                          f"header: incomplete metadata, file not fully covered): recording it again {RUN}: complete ")
    assert out.endswith("mlp-digits_s0_lr0.08: skipped (already recorded) done: 1 recorded, 1 already there, "
                        "0 diverged")
    again = load_file(str(path))
    assert again.keys() == good.keys() and all(torch.equal(again[k], good[k]) for k in good)  # the same run
    assert not (runs / RUN / LABELS_FILE).exists()  # labels of the damaged recording gone: label again
    assert (runs / "mlp-digits_s0_lr0.08" / LABELS_FILE).exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_path_that_cannot_be_written_is_refused_before_anything_runs(runs, capsys):
    assert predictor_cli(["predictor", "label", str(runs)]) == 0
    capsys.readouterr()
    assert predictor_cli(["predictor", "train", str(runs), "--holdout", "", "--epochs", "1",
                          "--out", "/proc/x/p.safetensors"]) == 2
    assert _out(capsys) == ("layerfreeze: error: --out /proc/x/p.safetensors cannot be written (/proc is not a "
                            "writable folder); give a path under a folder you can write to")
    assert predictor_cli(["predictor", "collect", "--out", "/proc/x", "--recipes", "mlp-digits", "--seeds", "0",
                          "--quick"]) == 2
    assert _out(capsys) == ("collecting 2 runs into /proc/x layerfreeze: error: the runs folder (--out) /proc/x cannot "
                            "be written (/proc is not a writable folder); give a path under a folder you can write to")


def test_evaluate_with_no_unseen_runs_says_what_to_collect(runs, capsys):
    from layerfreeze.strategies.smartfrz.predictor import load_predictor

    trained = set(load_predictor(None)[1]["card"]["train_recipes"])
    unseen = [n for n in RECIPES if n not in trained]
    assert "mlp-digits" in trained and unseen
    assert predictor_cli(["predictor", "label", str(runs)]) == 0
    capsys.readouterr()
    assert predictor_cli(["predictor", "evaluate", str(runs)]) == 2
    assert _out(capsys) == (
        f"layerfreeze: error: no labelled runs in {runs} that the predictor was not trained on: collect and label "
        f"runs of a recipe it was not trained on ({', '.join(unseen)}: `layerfreeze predictor collect --out {runs} "
        f"--recipes {unseen[0]}`, then `layerfreeze predictor label {runs}`), or pick recipes with --recipes (their "
        "runs it did not train on count, e.g. other seeds), or evaluate leave-one-family-out with --lofo")


def test_train_help_states_where_the_predictor_goes(capsys):
    with pytest.raises(SystemExit) as exc:
        predictor_cli(["predictor", "train", "--help"])
    assert exc.value.code == 0
    assert ("--out OUT predictor file (default predictor.safetensors in the current folder; PREDICTOR_CARD.md goes "
            "beside it)") in _out(capsys)


MY_RECIPE = '''
import torch
from torch import nn

from layerfreeze.smartfrz.recipes import register_recipe
from layerfreeze.smartfrz.setup import Setup


@register_recipe("my-blobs", arch="my-mlp", dataset="blobs", mode="scratch", lrs=(0.05,), minutes=0.01,
                 description="a user's own model and data")
def my_blobs(seed, quick, cache_dir):
    g = torch.Generator().manual_seed(0)  # the data: the same for every seed
    y = torch.randint(0, 4, (320,), generator=g)
    x = torch.randn(4, 16, generator=g)[y] * 2 + torch.randn(320, 16, generator=g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    return Setup(model, {"x": x[:256]}, y[:256], {"x": x[256:288]}, test_x={"x": x[288:]}, test_y=y[288:],
                 steps=24, batch_size=16, optimizer="sgd", snapshot_every=1, act_every=3)
'''


def test_your_own_recipe_through_the_whole_pipeline(tmp_path, capsys, monkeypatch):
    # the README said "train your own SmartFRZ predictor from your own runs", but collect knew the built-in recipes
    # only; `--import` registers a user's (a .py file or a module)
    from layerfreeze.smartfrz.recipes import RECIPES

    source = tmp_path / "my_recipes.py"
    source.write_text(MY_RECIPE)
    out = tmp_path / "mine"
    try:
        assert predictor_cli(["predictor", "collect", "--import", str(source), "--import", str(source),
                              "--recipes", "my-blobs", "--seeds", "0,1", "--out", str(out)]) == 0  # twice: once
        assert "my-blobs_s0_lr0.05: complete" in _out(capsys)
        assert predictor_cli(["predictor", "label", str(out)]) == 0
        assert predictor_cli(["predictor", "train", str(out), "--holdout", "", "--epochs", "1",
                              "--out", str(tmp_path / "mine.safetensors")]) == 0
        assert "trained on 2 runs" in _out(capsys) and (tmp_path / "mine.safetensors").is_file()
    finally:
        RECIPES.unregister("my-blobs")
    monkeypatch.chdir(tmp_path)  # a module's name, from the folder the command runs in (as `python -m` finds it)
    try:
        assert predictor_cli(["predictor", "collect", "--import", "my_recipes", "--recipes", "my-blobs", "--seeds",
                              "0", "--out", str(out)]) == 0
    finally:
        RECIPES.unregister("my-blobs")
        sys.modules.pop("my_recipes", None)
    assert predictor_cli(["predictor", "collect", "--recipes", "my-blobs", "--out", str(out)]) == 2
    said = _out(capsys)
    assert "unknown recipe(s) my-blobs" in said and "(your own recipes: --import the file or module" in said
    assert predictor_cli(["predictor", "collect", "--import", str(tmp_path / "none.py"), "--out", str(out)]) == 2
    assert "--import " in _out(capsys)
    (tmp_path / "empty.py").write_text("x = 1\n")
    assert predictor_cli(["predictor", "collect", "--import", str(tmp_path / "empty.py"), "--out", str(out)]) == 2
    assert "registered no recipe: decorate a function" in _out(capsys)
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    assert predictor_cli(["predictor", "collect", "--import", str(tmp_path / "broken.py"), "--out", str(out)]) == 2
    assert "failed: ModuleNotFoundError: No module named 'not_a_module_anywhere'" in _out(capsys)


def test_train_never_writes_its_predictor_over_a_run_or_another_safetensors_file(runs, tmp_path, capsys):
    """`predictor train --out runs/RUN/weights.safetensors` replaced the run's recording with the predictor (and its
    card went among the run's files); an existing model.safetensors was overwritten in silence too."""
    from safetensors.torch import save_file

    assert predictor_cli(["predictor", "label", str(runs)]) == 0
    weights = runs / RUN / WEIGHTS_FILE
    recorded = weights.read_bytes()
    model = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(2)}, str(model), metadata={"format": "pt"})
    capsys.readouterr()
    train = ["predictor", "train", str(runs), "--holdout", "", "--epochs", "1", "--out"]
    assert predictor_cli([*train, str(weights)]) == 2
    assert _out(capsys) == (f"layerfreeze: error: --out {weights} is in the recorded run folder {runs / RUN}: the "
                            "predictor and PREDICTOR_CARD.md would go among the run's files; give a path outside "
                            "the run folders")
    assert weights.read_bytes() == recorded and not (runs / RUN / "PREDICTOR_CARD.md").exists()
    assert predictor_cli([*train, str(model)]) == 2
    assert _out(capsys) == (f"layerfreeze: error: --out {model} is a safetensors file that is not a predictor "
                            "(format 'pt') and would be overwritten: give another path, or delete it first")
    assert load_file(str(model))["w"].tolist() == [1.0, 1.0]
    damaged = tmp_path / "damaged.safetensors"  # a damaged predictor is retrained in place, as its load error says
    damaged.write_bytes(b"\x00" * 7)
    assert predictor_cli([*train, str(damaged)]) == 0
    assert predictor_cli([*train, str(damaged)]) == 0  # and a predictor over a predictor


def test_collect_into_one_recorded_run_is_refused(runs, capsys):
    """`collect --out runs/RUN` recorded a run inside a run's folder; every later command refused that folder."""
    assert predictor_cli(["predictor", "collect", "--out", str(runs / RUN), "--recipes", "mlp-digits", "--seeds",
                          "0", "--lrs", "0.02", "--quick"]) == 2
    assert _out(capsys).endswith(f"layerfreeze: error: --out {runs / RUN} is one recorded run; give the folder that "
                                 f"holds the runs, {runs}")
    assert sorted(p.name for p in (runs / RUN).iterdir() if p.is_dir()) == []


def test_label_and_train_name_the_runs_a_stopped_collection_left_unfinished(runs, tmp_path, capsys):
    """A collection killed while it recorded a run leaves its folder without meta.json: label and train used the
    finished runs alone and said nothing, so a predictor was trained on part of the collection in silence."""
    (runs / "mlp-digits_s1_lr0.02").mkdir()  # killed before its meta.json
    (runs / "mlp-digits_s1_lr0.08").mkdir()
    (runs / "mlp-digits_s1_lr0.08" / (WEIGHTS_FILE + ".tmp")).write_bytes(b"\0" * 8)
    (runs / "_pretrained").mkdir()  # a recipe's cache, not a run
    note = ("note: 2 runs not finished recording, left out: mlp-digits_s1_lr0.02, mlp-digits_s1_lr0.08 (the "
            "collection stopped: run its `layerfreeze predictor collect` command again to finish them)")
    assert predictor_cli(["predictor", "label", str(runs)]) == 0
    assert _out(capsys).startswith(note)
    assert predictor_cli(["predictor", "train", str(runs), "--holdout", "", "--epochs", "1", "--out",
                          str(tmp_path / "p.safetensors")]) == 0
    assert _out(capsys).startswith(note)
    for name in ("mlp-digits_s1_lr0.02", "mlp-digits_s1_lr0.08"):
        shutil.rmtree(runs / name)
    assert predictor_cli(["predictor", "label", str(runs)]) == 0
    assert "not finished" not in _out(capsys)


@pytest.mark.parametrize("name", [WEIGHTS_FILE, ACTIVATIONS_FILE])
def test_a_damaged_byte_that_still_parses_is_refused_and_collect_records_the_run_again(runs, tmp_path, capsys, name):
    """A flipped byte in a tensor file's data still parses: the predictor trained on the changed weight samples, and
    the labels came from the changed activations, in silence (or, where it made a NaN, a raw ValueError)."""
    assert predictor_cli(["predictor", "label", str(runs)]) == 0
    path = runs / RUN / name
    good = path.read_bytes()
    before = {k: v.clone() for k, v in load_file(str(path)).items()}
    key = "samples" if name == WEIGHTS_FILE else "act.0"
    damaged = bytearray(good)
    damaged[-4] ^= 0x01
    path.write_bytes(bytes(damaged))
    after = load_file(str(path))  # it still parses, one value changed
    assert after.keys() == before.keys() and sum(not torch.equal(before[k], after[k]) for k in before) == 1
    capsys.readouterr()
    argv = ["train", str(runs), "--holdout", "", "--epochs", "1", "--out", str(tmp_path / "p.safetensors")] \
        if name == WEIGHTS_FILE else ["label", str(runs)]
    assert predictor_cli(["predictor", *argv]) == 2
    assert _out(capsys) == (f"layerfreeze: error: {path} does not match the SHA-256 its meta.json recorded (damaged "
                            f"since it was recorded): delete the run folder {RUN} and collect it again (`layerfreeze "
                            "predictor collect` skips the finished runs)")
    assert predictor_cli(["predictor", "collect", "--out", str(runs), "--recipes", "mlp-digits", "--seeds", "0",
                          "--quick"]) == 0
    assert f"{RUN}: {name} does not match the SHA-256 its meta.json recorded (damaged since it was recorded): " \
           "recording it again" in _out(capsys)
    assert path.read_bytes() == good  # recorded again, bit for bit

    # a run recorded before the digests, with a NaN in it: named, not a raw ValueError from the CKA or the features
    meta = json.loads((runs / RUN / META_FILE).read_text())
    del meta["sha256"]
    (runs / RUN / META_FILE).write_text(json.dumps(meta))
    tensors = load_file(str(path))
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[-1] = float("nan")
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    assert predictor_cli(["predictor", *argv]) == 2
    assert _out(capsys) == (f"layerfreeze: error: {path} holds NaN or Inf in {key} (damaged): delete the run folder "
                            f"{RUN} and collect it again (`layerfreeze predictor collect` skips the finished runs)")
