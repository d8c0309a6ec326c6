"""SmartFRZ leave-one-family-out: the folds, the pooling, the card section and the ``--lofo`` flags, on a quick
corpus of three architecture families (mlp: mlp-digits; cnn: cnn-digits and the fine-tune cnn-fmnist-to-digits;
vit: vit-fmnist), two runs per recipe (``collect --quick``)."""

from __future__ import annotations

import argparse
import io
import math

import pytest
import torch
from rich.console import Console

from layerfreeze.smartfrz import lofo as lofo_mod
from layerfreeze.smartfrz.card import render_card
from layerfreeze.smartfrz.fit import TrainConfig, evaluate, rounded, run_windows, train_predictor
from layerfreeze.smartfrz.lofo import family_folds, leave_one_family_out, pool_metrics
from layerfreeze.smartfrz.runs import PipelineError, list_runs, read_run
from layerfreeze.smartfrz.ship import train_and_save
from layerfreeze.strategies.smartfrz.predictor import load_predictor

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPES = "mlp-digits,cnn-digits,cnn-fmnist-to-digits,vit-fmnist"
CFG = TrainConfig(seed=0, history=6, min_history=4, epochs=10)
THRESHOLD = 0.5  # at 10 epochs on this corpus every fold has true and false positives at 0.5 (none at 0.85)
NON_HEAD_BLOCKS = {"mlp": 3, "cnn": 5, "vit": 3}


def _cli(args: list[str]) -> tuple[int, str]:
    from layerfreeze.smartfrz.cli import run
    from layerfreeze.smartfrz.parser import add_parser

    parser = argparse.ArgumentParser(prog="layerfreeze")
    add_parser(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    code = run(parser.parse_args(args), Console(file=out, width=400))
    return code, out.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("lofo-runs")
    assert _cli(["predictor", "collect", "--out", str(out), "--recipes", RECIPES, "--seeds", "0", "--quick"])[0] == 0
    assert _cli(["predictor", "label", str(out)])[0] == 0
    torch.set_num_threads(before)
    return out


@pytest.fixture(scope="module")
def runs(corpus):
    return [read_run(d, need_labels=True) for d in list_runs(corpus)]


@pytest.fixture(scope="module")
def result(runs):
    return leave_one_family_out(runs, CFG, THRESHOLD)


@pytest.mark.assets("fashion_mnist")  # the corpus collects cnn-fmnist-to-digits and vit-fmnist
def test_folds_hold_out_whole_families(runs, result):
    folds = family_folds(runs)
    assert list(folds) == ["cnn", "mlp", "vit"] and len(runs) == 8
    for family, (train, held) in folds.items():
        assert held and all(r.meta["arch"] == family for r in held)
        assert train and all(r.meta["arch"] != family for r in train)
        assert not {r.name for r in train} & {r.name for r in held}
        assert sorted(r.name for r in train + held) == sorted(r.name for r in runs)
        got = result["families"][family]
        assert got["eval_runs"] == [r.name for r in held] and got["train_runs"] == [r.name for r in train]
        assert family not in got["train_families"] and not set(got["eval_runs"]) & set(got["train_runs"])
    # a family is the architecture, not the recipe: the CNN fine-tune is held out with the scratch CNN
    assert result["families"]["cnn"]["recipes"] == ["cnn-digits", "cnn-fmnist-to-digits"]
    assert result["families"]["cnn"]["train_families"] == ["mlp", "vit"]
    assert [len(result["families"][f]["eval_runs"]) for f in ("cnn", "mlp", "vit")] == [4, 2, 2]


@pytest.mark.assets("fashion_mnist")  # the corpus collects cnn-fmnist-to-digits and vit-fmnist
def test_each_fold_is_an_independent_train_then_evaluate(runs, result):
    """A fold's row is exactly what training on the other families and evaluating on the family gives."""
    train = [r for r in runs if r.meta["arch"] != "mlp"]
    held = [r for r in runs if r.meta["arch"] == "mlp"]
    model, info = train_predictor(train, CFG)
    assert evaluate(model, held, CFG.history, THRESHOLD, CFG.min_history)["overall"] == \
        result["families"]["mlp"]["metrics"]
    assert info["data_sha256"] == result["families"]["mlp"]["training"]["data_sha256"]
    for family, fold in result["families"].items():
        m = fold["metrics"]
        held = [r for r in runs if r.meta["arch"] == family]
        # every labelled window of the family's runs is decided once, every non-head block scored once
        assert m["windows"] == sum(len(run_windows(r, CFG.history, CFG.min_history)[2]) for r in held) > 0
        assert m["blocks"] == NON_HEAD_BLOCKS[family] * len(held)
        assert m["tp"] > 0 and math.isfinite(m["freeze_step_error"]) and 0 < m["freeze_step_error"] < 1
    assert result["threshold"] == THRESHOLD and (result["history"], result["min_history"]) == (6, 4)


@pytest.mark.assets("fashion_mnist")  # the corpus collects cnn-fmnist-to-digits and vit-fmnist
def test_pooled_counts_are_the_sums_of_the_folds(result):
    folds = [f["metrics"] for f in result["families"].values()]
    pooled = result["pooled"]
    for key in ("windows", "tp", "fp", "fn", "tn", "blocks"):
        assert pooled[key] == sum(m[key] for m in folds)
    assert pooled["blocks"] == 4 * 5 + 2 * 3 + 2 * 3
    assert pooled["precision"] == pytest.approx(pooled["tp"] / (pooled["tp"] + pooled["fp"]))
    assert pooled["recall"] == pytest.approx(pooled["tp"] / (pooled["tp"] + pooled["fn"]))
    errors = sum(m["freeze_step_error"] * m["blocks"] for m in folds)
    assert pooled["freeze_step_error"] == pytest.approx(errors / pooled["blocks"])
    early = sum(round(m["early_fraction"] * m["blocks"]) for m in folds)
    assert pooled["early_fraction"] == pytest.approx(early / pooled["blocks"])


def test_pool_metrics_pools_windows_and_blocks_not_means():
    a = {"tp": 3, "fp": 1, "fn": 0, "tn": 6, "blocks": 2, "freeze_step_error": 0.1, "freeze_step_bias": 0.1,
         "early_fraction": 0.5}
    b = {"tp": 1, "fp": 0, "fn": 3, "tn": 0, "blocks": 6, "freeze_step_error": 0.3, "freeze_step_bias": -0.2,
         "early_fraction": 0.0}
    empty = {"tp": 0, "fp": 0, "fn": 0, "tn": 0, "blocks": 0, "freeze_step_error": math.nan,
             "freeze_step_bias": math.nan, "early_fraction": math.nan}
    p = pool_metrics([a, b, empty])
    assert (p["windows"], p["tp"], p["fp"], p["fn"], p["tn"], p["blocks"]) == (14, 4, 1, 3, 6, 8)
    assert p["precision"] == pytest.approx(0.8) and p["recall"] == pytest.approx(4 / 7)
    assert p["f1"] == pytest.approx(2 * 0.8 * (4 / 7) / (0.8 + 4 / 7))
    assert p["freeze_step_error"] == pytest.approx(0.25)  # (2 * 0.1 + 6 * 0.3) / 8, not (0.1 + 0.3) / 2
    assert p["freeze_step_bias"] == pytest.approx(-0.125) and p["early_fraction"] == pytest.approx(1 / 8)
    assert math.isnan(pool_metrics([empty])["freeze_step_error"])


def test_a_fold_that_never_says_freeze_has_no_precision_rather_than_zero():
    """Precision of zero calls is undefined: reported as None (the card and tables print "-"), while recall and F1
    are 0 (every positive missed); with neither calls nor positives all three are None."""
    blocks = {"blocks": 0, "freeze_step_error": math.nan, "freeze_step_bias": math.nan, "early_fraction": math.nan}
    never = pool_metrics([{"tp": 0, "fp": 0, "fn": 5, "tn": 3, **blocks}])
    assert never["precision"] is None and never["recall"] == 0.0 and never["f1"] == 0.0
    nothing = pool_metrics([{"tp": 0, "fp": 0, "fn": 0, "tn": 4, **blocks}])
    assert (nothing["precision"], nothing["recall"], nothing["f1"], nothing["accuracy"]) == (None, None, None, 1.0)
    from layerfreeze.smartfrz.card import _table

    assert _table(["precision", "recall"], [[never["precision"], never["recall"]]])[-1] == "| - | 0.000 |"


@pytest.mark.assets("fashion_mnist")  # the corpus collects cnn-fmnist-to-digits and vit-fmnist
def test_a_fold_never_evaluates_its_training_runs(runs, monkeypatch):
    mlp = [r for r in runs if r.meta["arch"] == "mlp"]
    others = [r for r in runs if r.meta["arch"] != "mlp"]
    monkeypatch.setattr(lofo_mod, "train_predictor", lambda *a, **k: pytest.fail("trained a leaking fold"))
    monkeypatch.setattr(lofo_mod, "family_folds", lambda rs: {"mlp": (others + mlp[:1], mlp)})
    with pytest.raises(AssertionError, match="fold 'mlp'"):
        leave_one_family_out(runs, CFG, THRESHOLD)
    monkeypatch.setattr(lofo_mod, "family_folds", lambda rs: {"mlp": (others, others[:1])})
    with pytest.raises(AssertionError, match="own family"):
        leave_one_family_out(runs, CFG, THRESHOLD)


@pytest.mark.assets("fashion_mnist")  # the corpus collects cnn-fmnist-to-digits and vit-fmnist
def test_lofo_input_errors(runs, tmp_path):
    cnn = [r for r in runs if r.meta["arch"] == "cnn"]
    with pytest.raises(PipelineError, match="at least two architecture families"):
        leave_one_family_out(cnn, CFG)
    with pytest.raises(PipelineError, match="at least two architecture families"):  # before anything is written
        train_and_save(cnn, tmp_path / "p.safetensors", ["cnn-digits"], CFG, lofo=True)
    assert not list(tmp_path.iterdir())
    nameless = read_run(runs[0].path, need_labels=True)
    nameless.meta = {**nameless.meta, "arch": None}
    with pytest.raises(PipelineError, match="no 'arch'"):
        family_folds([nameless, *runs[1:]])
    unlabelled = read_run(runs[0].path)
    unlabelled.labels = None
    with pytest.raises(PipelineError, match="no labels.json"):
        leave_one_family_out([unlabelled, *runs[1:]], CFG)


@pytest.mark.assets("fashion_mnist")  # the corpus collects cnn-fmnist-to-digits and vit-fmnist
def test_card_renders_the_section(result):
    card = {"threshold": THRESHOLD, "lofo": rounded(result), "heldout_metrics": None}
    text = render_card(card)
    section = text.split("## Leave-one-family-out", 1)[1].split("\n## ", 1)[0]
    mlp = result["families"]["mlp"]["metrics"]
    assert (f"| mlp | mlp-digits | 2 | 6 | {mlp['windows']} | {mlp['precision']:.3f} | {mlp['recall']:.3f} | "
            f"{mlp['f1']:.3f} | 6 |") in section
    assert f"| **pooled** |  | 8 |  | {result['pooled']['windows']} |" in section
    assert "| cnn | cnn-digits, cnn-fmnist-to-digits | 4 | 4 |" in section and "| vit | vit-fmnist | 2 | 6 |" in section
    assert "not a mean of the per-family numbers" in section
    assert text.index("## Held-out metrics") < text.index("## Leave-one-family-out") < text.index("## Training runs")
    assert "## Leave-one-family-out" not in render_card({**card, "lofo": None})


@pytest.mark.assets("fashion_mnist")  # the corpus collects cnn-fmnist-to-digits and vit-fmnist
def test_cli_train_and_evaluate_lofo(corpus, runs, result, tmp_path):
    out = tmp_path / "p.safetensors"
    common = ["--holdout", "vit-fmnist", "--history", "6", "--min-history", "4", "--threshold", str(THRESHOLD)]
    code, text = _cli(["predictor", "train", str(corpus), "--out", str(out), *common, "--epochs", "10", "--lofo"])
    assert code == 0 and "leave-one-family-out" in text and "cnn (4 runs)" in text
    card = load_predictor(out)[1]["card"]
    assert card["lofo"] == rounded(result)  # the same folds, bit for bit, with the train command's settings
    assert card["heldout_recipes"] == ["vit-fmnist"] and card["heldout_metrics"]["overall"]["blocks"] == 6
    assert "--holdout vit-fmnist --lofo --out" in card["command"]
    md = (tmp_path / "PREDICTOR_CARD.md").read_text()
    assert "## Held-out metrics" in md and "## Leave-one-family-out" in md and " --lofo " in md
    assert f"| **pooled** |  | 8 |  | {result['pooled']['windows']} |" in md

    code, text = _cli(["predictor", "evaluate", str(corpus), "--predictor", str(out), "--lofo"])
    assert code == 0 and "seed 0, 10 epochs, window 4-6; threshold 0.5" in text
    pooled = result["pooled"]
    row = next(line for line in text.splitlines() if "pooled" in line and "│" in line)
    assert [c.strip() for c in row.split("│")][1:7] == [
        "pooled", str(pooled["windows"]), f"{pooled['precision']:.3f}", f"{pooled['recall']:.3f}",
        f"{pooled['f1']:.3f}", str(pooled["blocks"])]
    assert _cli(["predictor", "evaluate", str(corpus), "--predictor", str(out), "--lofo",
                 "--recipes", "mlp-digits"])[0] == 2  # one family: nothing to leave out

    plain = tmp_path / "plain.safetensors"
    assert _cli(["predictor", "train", str(corpus), "--out", str(plain), *common, "--epochs", "1"])[0] == 0
    card = load_predictor(plain)[1]["card"]
    assert card["lofo"] is None and "--lofo" not in card["command"]
    assert "## Leave-one-family-out" not in (tmp_path / "PREDICTOR_CARD.md").read_text()


def test_reproduce_command_collects_each_seed_set_once():
    """A corpus holding more seeds of some recipes is reproduced by one collect line per set of seeds, in recipe
    registration order (the card's command must rebuild exactly the training runs)."""
    from types import SimpleNamespace

    from layerfreeze.smartfrz.cli import _reproduce_command
    from layerfreeze.smartfrz.recipes.registry import RECIPES

    labels = {"tau": 0.9995, "tau_scratch": 0.998, "delta": 0.01, "window": 3}

    def run(recipe: str, seed: int, lr: float):
        return SimpleNamespace(recipe=recipe, meta={"seed": seed, "lr": lr}, labels=labels)

    runs = [run(name, seed, lr) for name, seeds in (("cnn-fmnist-short", (1, 0)), ("cnn-digits", (0,)),
                                                     ("mlp-digits", (0,)))
            for seed in seeds for lr in RECIPES[name].lrs]  # every registered rate: no --lrs needed
    args = argparse.Namespace(seed=0, history=30, min_history=8, epochs=40, threshold=0.85, holdout=["cnn-digits"],
                              lofo=True, out="p.safetensors")
    lines = _reproduce_command(runs, "runs/x", args).splitlines()
    assert lines[:2] == ["layerfreeze predictor collect --out runs/x --recipes mlp-digits,cnn-digits --seeds 0",
                         "layerfreeze predictor collect --out runs/x --recipes cnn-fmnist-short --seeds 0,1"]
    assert lines[2] == "layerfreeze predictor label runs/x --tau 0.9995 --tau-scratch 0.998 --delta 0.01 --window 3"
    assert lines[3].startswith("layerfreeze predictor train runs/x --seed 0") and lines[3].endswith(
        "--holdout cnn-digits --lofo --out p.safetensors") and len(lines) == 4


def test_reproduce_command_names_each_recipes_own_rates_when_no_factor_set_explains_them():
    """A corpus whose recipes were collected at rates of their own (issue 29's: x0.3 of a recipe's lower rate only,
    one recipe missing a rate) is reproduced by one collect line per set of rates. The union of every recipe's
    rates on one line would collect every recipe at all of them (21 rates in issue 29's card)."""
    from types import SimpleNamespace

    from layerfreeze.smartfrz.cli import _reproduce_command

    labels = {"tau": 0.9995, "tau_scratch": 0.998, "delta": 0.01, "window": 3}

    def run(recipe: str, lr: float, factor: float = 1.0, seed: int = 0):
        return SimpleNamespace(recipe=recipe, meta={"seed": seed, "lr": lr, "lr_factor": factor}, labels=labels)

    runs = [run("cnn-digits", 0.006, 0.3), run("cnn-digits", 0.02), run("cnn-digits", 0.1),
            run("mlp-digits", 0.006, 0.3), run("mlp-digits", 0.02), run("mlp-digits", 0.08),
            run("cnn-fmnist-short", 0.0003, 0.3), run("cnn-fmnist-short", 0.001),
            run("vit-fmnist-short", 0.0003, 0.3, seed=0), run("vit-fmnist-short", 0.001, seed=0),
            run("vit-fmnist-short", 0.001, seed=1)]
    args = argparse.Namespace(seed=0, history=30, min_history=8, epochs=40, threshold=0.85, holdout=["cnn-digits"],
                              lofo=False, out="p.safetensors")
    lines = _reproduce_command(runs, "runs/x", args).splitlines()
    assert lines[:4] == [  # seed 1 of vit-fmnist-short has one rate only: a line of its own
        "layerfreeze predictor collect --out runs/x --recipes mlp-digits --seeds 0 --lrs 0.006,0.02,0.08",
        "layerfreeze predictor collect --out runs/x --recipes cnn-digits --seeds 0 --lrs 0.006,0.02,0.1",
        "layerfreeze predictor collect --out runs/x --recipes cnn-fmnist-short,vit-fmnist-short --seeds 0 "
        "--lrs 0.0003,0.001",
        "layerfreeze predictor collect --out runs/x --recipes vit-fmnist-short --seeds 1 --lrs 0.001"]
    assert lines[4].startswith("layerfreeze predictor label runs/x") and len(lines) == 6


def test_reproduce_command_names_rates_a_seed_lacks_and_rates_to_12_digits():
    """Registered rates but a seed with one of them only: that seed's line names its rate (a bare line would
    collect the other registered rate too). A rate of more than 6 significant digits is printed whole (``:g``
    named a nearby rate: a run of the same folder name and other weights)."""
    from types import SimpleNamespace

    from layerfreeze.smartfrz.cli import _reproduce_command

    labels = {"tau": 0.9995, "tau_scratch": 0.998, "delta": 0.01, "window": 3}

    def run(recipe: str, lr: float, seed: int = 0):
        return SimpleNamespace(recipe=recipe, meta={"seed": seed, "lr": lr, "lr_factor": 1.0}, labels=labels)

    args = argparse.Namespace(seed=0, history=30, min_history=8, epochs=40, threshold=0.85, holdout=["cnn-digits"],
                              lofo=False, out="p.safetensors")
    runs = [run("mlp-digits", 0.02), run("mlp-digits", 0.08), run("mlp-digits", 0.02, seed=1),
            run("cnn-digits", 0.02), run("cnn-digits", 0.1)]
    lines = _reproduce_command(runs, "runs/x", args).splitlines()
    assert lines[:3] == ["layerfreeze predictor collect --out runs/x --recipes mlp-digits --seeds 0 --lrs 0.02,0.08",
                         "layerfreeze predictor collect --out runs/x --recipes cnn-digits --seeds 0",
                         "layerfreeze predictor collect --out runs/x --recipes mlp-digits --seeds 1 --lrs 0.02"]
    lines = _reproduce_command([run("mlp-digits", 0.0123456789)], "runs/x", args).splitlines()
    assert lines[0] == "layerfreeze predictor collect --out runs/x --recipes mlp-digits --seeds 0 --lrs 0.0123456789"
