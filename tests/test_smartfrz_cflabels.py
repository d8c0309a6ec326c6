"""Issue 29: CKA labels corrected by counterfactual costs, collection over learning-rate factors, and the card's
Labels and Learning-rate spread sections, on the quick mlp-digits recipe."""

from __future__ import annotations

import json
import shutil

import pytest

from layerfreeze.smartfrz.cflabels import correct_freezable, correction_summary, label_run_corrected
from layerfreeze.smartfrz.collect import collect, scaled_lrs
from layerfreeze.smartfrz.counterfactual import COUNTERFACTUAL_FILE, counterfactual_labels
from layerfreeze.smartfrz.labels import label_run
from layerfreeze.smartfrz.runs import LABELS_FILE, PipelineError
from tests.conftest import predictor_cli

pytestmark = pytest.mark.usefixtures("one_thread")

_cli = predictor_cli
T, F = True, False


# ------------------------------------------------------------------------------------------------ the correction

STEPS = [0, 10, 20, 30, 40, 50]
CKA = [[T, T, T, T, T, T],   # block 0
       [F, T, T, T, T, T],   # block 1
       [F, F, T, T, T, T],   # block 2
       [F, F, F, F, F, F]]   # block 3, the head


def test_a_costly_cell_vetoes_every_freeze_no_later_and_no_shorter():
    # grid steps 20 and 40, depths 1 and 3
    cheap = {(20, 1): F, (40, 1): T, (20, 3): T, (40, 3): F}
    flags, corrected = correct_freezable(CKA, STEPS, cheap)
    # (20, 1) costs: freezing block 0 (or a longer prefix) at or before step 20 costs at least as much -> every
    # block's label at 0, 10, 20 goes. (40, 3) costs: blocks 2 and deeper at or before 40 -> block 2 at 30, 40.
    # (40, 1) free and (20, 3) free remove nothing; step 50, after the last grid step, keeps every CKA label.
    assert flags == [[F, F, F, T, T, T], [F, F, F, T, T, T], [F, F, F, F, F, T], [F] * 6]
    assert corrected == 3 + 2 + 3
    assert CKA[0] == [T] * 6  # the input is not modified


def test_a_costly_cell_says_nothing_about_a_shorter_prefix_or_a_later_step():
    flags, corrected = correct_freezable(CKA, STEPS, {(40, 3): F})  # only depth 3 measured, costly at 40
    assert flags == [CKA[0], CKA[1], [F, F, F, F, F, T], CKA[3]]  # blocks 0, 1 untouched; block 2 after 40 too
    assert corrected == 3
    flags, corrected = correct_freezable(CKA, STEPS, {(20, 1): T, (40, 1): F})  # the shallowest prefix costs at 40
    assert flags == [[F, F, F, F, F, T], [F, F, F, F, F, T], [F, F, F, F, F, T], [F] * 6]
    assert corrected == 5 + 4 + 3


def test_the_counterfactual_never_adds_a_freezable_label():
    every_cell_free = {(t, d): T for t in (20, 40) for d in (1, 2, 3)}
    assert correct_freezable(CKA, STEPS, every_cell_free) == (CKA, 0)
    nothing_cka = [[F] * 6 for _ in CKA]
    assert correct_freezable(nothing_cka, STEPS, every_cell_free) == (nothing_cka, 0)
    assert correct_freezable(CKA, STEPS, {}) == (CKA, 0)  # no grid: nothing to correct
    # depth-0 cells (the replay check) say nothing about any block
    assert correct_freezable(CKA, STEPS, {(20, 0): F}) == (CKA, 0)


def test_correction_summary_counts_and_refuses_mixed_corpora():
    a = {"freezable": [[T, F], [F, F]], "counterfactual": {"eps_points": 0.2, "available": True, "corrected": 3}}
    b = {"freezable": [[T, T], [T, F]], "counterfactual": {"eps_points": 0.2, "available": False, "corrected": 0}}
    assert correction_summary([a, b]) == {"eps_points": 0.2, "runs": 2, "runs_with_counterfactual": 1,
                                          "corrected": 3, "freezable_cka": 7, "freezable": 4}
    assert correction_summary([{"freezable": [[T]]}]) is None
    with pytest.raises(PipelineError, match="different counterfactual corrections"):
        correction_summary([a, {"freezable": [[T]]}])


# ------------------------------------------------------------------------------------------------ on real runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """mlp-digits (registered at 0.02, 0.08) collected at x0.3 and x1 of both rates, quick, seed 0; the x0.3 run
    of 0.02 with its counterfactuals."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("lr")
    assert _cli(["predictor", "collect", "--out", str(out), "--recipes", "mlp-digits", "--seeds", "0",
                 "--lr-factors", "0.3,1", "--quick"]) == 0
    assert _cli(["predictor", "counterfactual", str(out), "--recipes", "mlp-digits", "--lrs", "0.02",
                 "--lr-factors", "0.3", "--quick", "--fractions", "0.3,0.6", "--null-orders", "1"]) == 0
    torch.set_num_threads(before)
    return out


def test_lr_factors_collect_every_registered_rate_times_every_factor(runs):
    names = sorted(p.name for p in runs.iterdir())
    assert names == ["mlp-digits_s0_lr0.006", "mlp-digits_s0_lr0.02", "mlp-digits_s0_lr0.024",
                     "mlp-digits_s0_lr0.08"]
    metas = {n: json.loads((runs / n / "meta.json").read_text()) for n in names}
    assert {n: (m["lr"], m["lr_factor"], m["lr_base"]) for n, m in metas.items()} == {
        "mlp-digits_s0_lr0.006": (0.006, 0.3, 0.02), "mlp-digits_s0_lr0.02": (0.02, 1.0, 0.02),
        "mlp-digits_s0_lr0.024": (0.024, 0.3, 0.08), "mlp-digits_s0_lr0.08": (0.08, 1.0, 0.08)}
    assert all(m["status"] == "complete" for m in metas.values())
    # a factor-scaled run is replayable: the counterfactual's unfrozen replay reproduced the recorded accuracy
    cf = json.loads((runs / "mlp-digits_s0_lr0.006" / COUNTERFACTUAL_FILE).read_text())
    assert cf["lr"] == 0.006 and cf["baseline"]["matches_record"]


def test_scaled_lrs_deduplicates_and_rounds():
    # 0.02 x 4 = 0.08 x 1: kept once, with the factor nearest 1 (the registered rate itself)
    assert scaled_lrs([0.02, 0.08], [1, 4]) == [(0.02, 1.0, 0.02), (0.08, 1.0, 0.08), (0.32, 4.0, 0.08)]
    assert scaled_lrs([0.1], [0.3]) == [(0.03, 0.3, 0.1)]  # 0.1 * 0.3 = 0.030000000000000002 unrounded
    assert scaled_lrs([0.02, 0.08]) == [(0.02, 1.0, 0.02), (0.08, 1.0, 0.08)]
    with pytest.raises(PipelineError, match="share the run name"):
        scaled_lrs([0.1], [1, 1.0000001])


@pytest.mark.parametrize("bad", ["0", "-0.3", "abc", "0.3,nan", "inf", ","])
def test_a_bad_lr_factor_is_a_usage_error_before_anything_runs(bad, tmp_path):
    with pytest.raises(SystemExit) as exc:
        _cli(["predictor", "collect", "--out", str(tmp_path / "runs"), "--recipes", "mlp-digits", "--quick",
              "--lr-factors", bad])
    assert exc.value.code == 2
    assert not (tmp_path / "runs").exists()


def test_a_bad_lr_factor_in_the_library_fails_before_any_run(tmp_path):
    for bad in ([0.3, 0.0], [-1.0], [float("nan")], []):
        with pytest.raises(PipelineError, match="lr-factors"):
            collect(tmp_path / "runs", ["mlp-digits"], seeds=[0], quick=True, lr_factors=bad)
    assert not (tmp_path / "runs").exists()


def test_a_run_without_counterfactuals_keeps_its_cka_labels_exactly(runs, tmp_path):
    run = tmp_path / "mlp-digits_s0_lr0.02"
    shutil.copytree(runs / "mlp-digits_s0_lr0.02", run)
    plain = label_run(run, tau_scratch=0.5, write=False)
    corrected = label_run_corrected(run, tau_scratch=0.5, eps_points=0.0, write=False)
    assert any(any(row) for row in plain["freezable"])  # there are labels the correction could have removed
    assert corrected["freezable"] == plain["freezable"] and corrected["cka"] == plain["cka"]
    assert corrected["first_freezable_step"] == plain["first_freezable_step"]
    assert corrected["counterfactual"] == {"eps_points": 0.0, "available": False, "corrected": 0, "cells": 0}


def test_cli_label_counterfactual_end_to_end(runs, tmp_path, capsys):
    corpus = tmp_path / "runs"
    shutil.copytree(runs, corpus)
    assert _cli(["predictor", "label", str(corpus), "--counterfactual", "--eps-points", "0", "--tau-scratch",
                 "0.5"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    run = corpus / "mlp-digits_s0_lr0.006"
    lab = json.loads((run / LABELS_FILE).read_text())
    plain = label_run(run, tau_scratch=0.5, write=False)
    cf = json.loads((run / COUNTERFACTUAL_FILE).read_text())
    want, n = correct_freezable(plain["freezable"], plain["act_steps"], counterfactual_labels(cf, 0.0))
    assert lab["freezable"] == want and lab["counterfactual"]["corrected"] == n
    assert lab["first_freezable_step"] == [next((plain["act_steps"][a] for a, f in enumerate(row) if f), None)
                                           for row in want]
    assert lab["counterfactual"]["available"] and lab["counterfactual"]["cells"] == len(cf["grid"])
    assert lab["counterfactual"]["replay_matches_record"] and "did not reach" not in out
    assert f"1 of 4 runs had a counterfactual.json, {n} (block, snapshot) labels turned" in out
    assert "3 runs without one kept their CKA labels" in out and out.count("no counterfactual") == 3
    for other in ("mlp-digits_s0_lr0.02", "mlp-digits_s0_lr0.024", "mlp-digits_s0_lr0.08"):
        got = json.loads((corpus / other / LABELS_FILE).read_text())
        assert got["freezable"] == label_run(corpus / other, tau_scratch=0.5, write=False)["freezable"]

    # every grid cell losing everything: every label at or before the last grid step goes; after it, CKA's stay
    cf["grid"] = [{**c, "accuracy": 0.0} for c in cf["grid"]]
    cf["baseline"] = {**cf["baseline"], "matches_record": False}
    (run / COUNTERFACTUAL_FILE).write_text(json.dumps(cf))
    assert _cli(["predictor", "label", str(corpus), "--counterfactual", "--tau-scratch", "0.5"]) == 0
    assert "mlp-digits_s0_lr0.006's counterfactual replay did not reach" in " ".join(capsys.readouterr().out.split())
    lab = json.loads((run / LABELS_FILE).read_text())
    last = max(c["t"] for c in cf["grid"])
    after = [a for a, s in enumerate(plain["act_steps"]) if s > last]
    assert lab["freezable"] == [[f and a in after for a, f in enumerate(row)] for row in plain["freezable"]]
    gone = sum(f for row in plain["freezable"] for a, f in enumerate(row) if a not in after)
    assert lab["counterfactual"]["corrected"] == gone > 0
    assert lab["counterfactual"]["eps_points"] == 0.2  # the default

    (run / COUNTERFACTUAL_FILE).write_text(json.dumps({**cf, "run": "another"}))
    assert _cli(["predictor", "label", str(corpus), "--counterfactual"]) == 2
    assert "not of 'mlp-digits_s0_lr0.006'" in " ".join(capsys.readouterr().out.split())
    v1 = {k: v for k, v in cf.items() if k != "version"}  # computed before the optimizer-state copy: costs wrong
    (run / COUNTERFACTUAL_FILE).write_text(json.dumps(v1))
    assert _cli(["predictor", "label", str(corpus), "--counterfactual"]) == 2
    assert "recompute it with `layerfreeze predictor counterfactual`" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        _cli(["predictor", "label", str(corpus), "--counterfactual", "--eps-points", "-1"])


def test_the_card_reports_the_corrected_labels_and_the_lr_spread(runs, tmp_path):
    corpus = tmp_path / "runs"
    shutil.copytree(runs, corpus)
    assert _cli(["predictor", "label", str(corpus), "--counterfactual", "--eps-points", "0", "--tau-scratch",
                 "0.5"]) == 0
    n = json.loads((corpus / "mlp-digits_s0_lr0.006" / LABELS_FILE).read_text())["counterfactual"]["corrected"]
    cka = sum(sum(map(sum, label_run(d, tau_scratch=0.5, write=False)["freezable"])) for d in corpus.iterdir())
    # two recorded runs the corpus leaves out, a diverged one and one that ended at chance level: the card says why
    meta = json.loads((corpus / "mlp-digits_s0_lr0.02" / "meta.json").read_text())
    (corpus / "mlp-digits_s0_lr0.5").mkdir()
    (corpus / "mlp-digits_s0_lr0.5" / "meta.json").write_text(json.dumps(
        {**meta, "run": "mlp-digits_s0_lr0.5", "lr": 0.5, "status": "diverged", "diverged_at_step": 7}))
    shutil.copytree(corpus / "mlp-digits_s0_lr0.02", corpus / "mlp-digits_s1_lr0.02")
    (corpus / "mlp-digits_s1_lr0.02" / "meta.json").write_text(json.dumps(
        {**meta, "run": "mlp-digits_s1_lr0.02", "seed": 1, "test_accuracy": 0.1}))
    out = tmp_path / "p.safetensors"
    assert _cli(["predictor", "train", str(corpus), "--out", str(out), "--holdout", "", "--history", "4",
                 "--min-history", "3", "--epochs", "1"]) == 0
    text = " ".join((tmp_path / "PREDICTOR_CARD.md").read_text().split())
    assert "Counterfactual correction: used, eps = 0.000 points. 1 of 4 runs" in text
    assert f"{n} of the CKA rule's {cka} freezable (block, snapshot) labels" in text
    assert "## Learning-rate spread" in text and "factors from x0.3 to x4" in text
    assert "| mlp-digits | 0.02, 0.08 | 0.006, 0.02, 0.024, 0.08 | x0.3, x1, x1.2, x4 | 4 |" in text
    assert ("Recorded but not used (a diverged or collapsed run would teach the predictor that a broken network has "
            "converged): mlp-digits_s0_lr0.5 (diverged at step 7); mlp-digits_s1_lr0.02 (collapsed: test accuracy "
            "0.100).") in text
    # the reproduce commands: the factor collection, the counterfactual grid and the corrected labelling
    assert "--lr-factors 0.3,1 --quick" in text
    assert ("layerfreeze predictor counterfactual " + str(corpus) + " --recipes mlp-digits --seeds 0 --lrs 0.006 "
            "--fractions 0.3,0.6 --null-orders 1 --depths 1,2,3 --quick") in text
    assert "--window 3 --counterfactual --eps-points 0" in text

    # plain CKA labels: the card says so, and a corpus mixing both is refused
    assert _cli(["predictor", "label", str(corpus)]) == 0
    assert _cli(["predictor", "train", str(corpus), "--out", str(out), "--holdout", "", "--history", "4",
                 "--min-history", "3", "--epochs", "1"]) == 0
    assert "Counterfactual correction: not used" in (tmp_path / "PREDICTOR_CARD.md").read_text()
    label_run_corrected(corpus / "mlp-digits_s0_lr0.006")
    assert _cli(["predictor", "train", str(corpus), "--out", str(out), "--holdout", "", "--history", "4",
                 "--min-history", "3", "--epochs", "1"]) == 2
