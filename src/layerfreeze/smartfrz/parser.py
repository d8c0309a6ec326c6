"""The ``layerfreeze predictor`` sub-commands' arguments: :func:`add_parser` adds ``collect | label | train |
evaluate | counterfactual | calibrate`` with their options, checked as they are read (a bad number or list is
argparse's one-line error, exit 2). The commands themselves are in :mod:`layerfreeze.smartfrz.cli`.

::

    layerfreeze predictor collect --out runs/smartfrz            # all recipes, seeds 0,1, both learning rates
    layerfreeze predictor label runs/smartfrz                     # CKA labels (labels.json per run)
    layerfreeze predictor train runs/smartfrz --out predictor.safetensors   # + PREDICTOR_CARD.md beside it
    layerfreeze predictor evaluate runs/smartfrz --predictor predictor.safetensors
    layerfreeze predictor train runs/smartfrz --lofo              # + leave-one-family-out metrics in the card
    layerfreeze predictor counterfactual runs/smartfrz --recipes mlp-digits   # what freezing at t really costs
    layerfreeze predictor calibrate runs/smartfrz                 # CKA rules against those costs
    layerfreeze predictor label runs/smartfrz --counterfactual    # CKA labels those costs do not contradict
    layerfreeze predictor collect --out runs/smartfrz --lr-factors 0.3,1   # + every recipe at x0.3 of its rates
    layerfreeze predictor collect --out runs/mine --import my_recipes.py --recipes my-model   # your own runs

Then ``freeze.params.predictor: predictor.safetensors`` (or ``SmartFRZ(predictor=...)``) uses it.

Exit codes: 0 success, 2 bad input (no runs, unknown recipe, unlabelled runs, bad predictor file).
"""

from __future__ import annotations

import argparse
from typing import Any

from layerfreeze.smartfrz.counterfactual import DEFAULT_EPS_POINTS, DEFAULT_FRACTIONS, DEFAULT_NULL_ORDERS, MAX_DEPTHS
from layerfreeze.smartfrz.fit import DEFAULT_HISTORY, DEFAULT_MIN_HISTORY, DEFAULT_THRESHOLD, TrainConfig
from layerfreeze.smartfrz.labels import DEFAULT_DELTA, DEFAULT_TAU, DEFAULT_TAU_SCRATCH, DEFAULT_WINDOW
from layerfreeze.smartfrz.recipes import DEFAULT_HOLDOUT, RECIPES

DEFAULT_RUNS_DIR = "runs/smartfrz"


def _csv(kind: type, allow_empty: bool = False, positive: bool = False) -> Any:
    """argparse type of a comma-separated list of ``kind``: at least one value unless ``allow_empty`` (an empty
    ``--recipes ''`` would otherwise mean "every recipe"), each finite and > 0 when ``positive``."""
    def parse(text: str) -> list[Any]:
        try:
            out = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {kind.__name__}, got {text!r}") from None
        if not out and not allow_empty:
            raise argparse.ArgumentTypeError(f"expected at least one {kind.__name__} value, got {text!r}")
        bad = [x for x in out if positive and not (0 < x < float("inf"))]
        if bad:
            raise argparse.ArgumentTypeError(f"each value must be a finite number > 0, got {', '.join(map(str, bad))}")
        return out
    return parse


def _number(kind: type, low: float, high: float | None = None, low_open: bool = False, high_open: bool = False
            ) -> Any:
    """argparse type: a ``kind`` in [low, high] (open ends where asked); a bad value is a usage error (exit 2)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        ok = (value > low if low_open else value >= low) and (
            high is None or (value < high if high_open else value <= high))
        if not ok:
            end = "inf)" if high is None else f"{high:g}{')' if high_open else ']'}"
            span = f"{'(' if low_open else '['}{low:g}, {end}"
            raise argparse.ArgumentTypeError(f"must be in {span}, got {text}")
        return value
    return parse


_PROBABILITY = _number(float, 0, 1, low_open=True, high_open=True)


#: argparse type of ``--lr-factors``: comma-separated finite numbers > 0 (a usage error, exit 2, otherwise).
_factors = _csv(float, positive=True)


_LR_FACTORS_HELP = ("multiply each learning rate (--lrs or each recipe's own) by each of these factors, duplicates "
                    "dropped, e.g. 0.3,1 adds x0.3 of every rate; each run's meta.json records lr_factor")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``predictor`` and its sub-commands to the main CLI's sub-parsers."""
    p = subparsers.add_parser(
        "predictor", help="collect runs, label them with CKA, train and evaluate the SmartFRZ predictor",
        description="The offline SmartFRZ pipeline: collect -> label -> train (-> evaluate);\n"
        "counterfactual (after collect) trains each run on from grid steps with a frozen\n"
        "prefix, and calibrate scores labelling rules (tau, window, delta) against those\n"
        "costs, to choose label's --tau / --window / --delta.",
        epilog=__doc__.split("::", 1)[1].split("Exit codes")[0].replace("``", "`"),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="predictor_command", metavar="SUBCOMMAND", required=True)

    c = sub.add_parser("collect", help="train the recipes to the end, recording weights and probe activations")
    c.add_argument("--out", default=DEFAULT_RUNS_DIR, help=f"runs folder (default {DEFAULT_RUNS_DIR}); finished runs "
                   "are skipped, so an interrupted collection resumes")
    c.add_argument("--recipes", type=_csv(str), help=f"comma-separated recipes (default all: {', '.join(RECIPES)})")
    c.add_argument("--seeds", type=_csv(int), default=[0, 1], help="comma-separated seeds (default 0,1)")
    c.add_argument("--lrs", type=_csv(float, positive=True), help="learning rates overriding each recipe's own "
                   "pair")
    c.add_argument("--lr-factors", type=_factors, help=_LR_FACTORS_HELP)
    c.add_argument("--quick", action="store_true", help="shrink every recipe to a few seconds (tests, CI)")
    c.add_argument("--list", action="store_true", help="list the recipes and exit")

    lab = sub.add_parser("label", help="CKA labels: when each block of each run became freezable")
    lab.add_argument("runs_dir", metavar="RUNS_DIR",
                     help="the runs folder of `predictor collect --out` (labels.json goes into each run)")
    lab.add_argument("--tau", type=_number(float, 0, 1, low_open=True), default=DEFAULT_TAU,
                     help=f"CKA to the final state, in (0, 1], for fine-tuned runs (default {DEFAULT_TAU})")
    lab.add_argument("--tau-scratch", type=_number(float, 0, 1, low_open=True), default=DEFAULT_TAU_SCRATCH,
                     help=f"the same for runs trained from scratch (default {DEFAULT_TAU_SCRATCH})")
    lab.add_argument("--delta", type=_number(float, 0), default=DEFAULT_DELTA,
                     help=f"max CKA change over the window (default {DEFAULT_DELTA})")
    lab.add_argument("--window", type=_number(int, 1), default=DEFAULT_WINDOW,
                     help=f"activation snapshots in the stability window (default {DEFAULT_WINDOW})")
    lab.add_argument("--counterfactual", action="store_true",
                     help="correct the CKA labels of every run that has a counterfactual.json (`predictor "
                     "counterfactual`): a grid cell (t, d) that costs accuracy removes the label of blocks d-1 and "
                     "deeper at every snapshot up to t (an earlier or longer freeze costs at least as much); runs "
                     "without one keep their CKA labels (layerfreeze.smartfrz.cflabels)")
    lab.add_argument("--eps-points", type=_number(float, 0), default=DEFAULT_EPS_POINTS,
                     help="with --counterfactual: accuracy points a freeze may lose beyond the unfrozen continuations "
                     f"and still cost nothing (default {DEFAULT_EPS_POINTS})")

    t = sub.add_parser("train", help="fit the predictor on the non-held-out runs; evaluate on the held-out ones")
    t.add_argument("runs_dir", metavar="RUNS_DIR", help="the labelled runs folder (`predictor label RUNS_DIR` first)")
    t.add_argument("--out", default="predictor.safetensors", help="predictor file (default predictor.safetensors in "
                   "the current folder; PREDICTOR_CARD.md goes beside it)")
    t.add_argument("--seed", type=int, default=0, help="seed of initialisation and batches (default 0)")
    t.add_argument("--holdout", type=_csv(str, allow_empty=True), default=list(DEFAULT_HOLDOUT),
                   help=f"recipes never trained on (default {','.join(DEFAULT_HOLDOUT)}; '' for none)")
    t.add_argument("--history", type=_number(int, 3), default=DEFAULT_HISTORY,
                   help=f"weight snapshots in the predictor's window, >= 3 (default {DEFAULT_HISTORY})")
    t.add_argument("--min-history", type=_number(int, 3), default=DEFAULT_MIN_HISTORY,
                   help=f"fewest weight snapshots a decision is made on, 3..--history (default {DEFAULT_MIN_HISTORY})")
    t.add_argument("--epochs", type=_number(int, 1), default=TrainConfig.epochs,
                   help=f"training epochs (default {TrainConfig.epochs})")
    t.add_argument("--threshold", type=_PROBABILITY, default=DEFAULT_THRESHOLD,
                   help=f"decision threshold in (0, 1) for the held-out metrics; stored in the card, it is the "
                   f"strategy's default threshold (default {DEFAULT_THRESHOLD})")
    t.add_argument("--lofo", action="store_true", help="also evaluate leave-one-family-out on all runs (held-out "
                   "recipes included): per architecture family, train a predictor with these settings on the other "
                   "families and evaluate it on that family; adds a section to the card (one extra training per "
                   "family)")

    e = sub.add_parser("evaluate", help="precision/recall/F1 and freeze-step error on runs the predictor never saw")
    e.add_argument("runs_dir", metavar="RUNS_DIR", help="the labelled runs folder (`predictor label RUNS_DIR` first)")
    e.add_argument("--predictor", help="predictor file (default: the one shipped with layerfreeze)")
    e.add_argument("--threshold", type=_PROBABILITY, help="decision threshold in (0, 1) (default: the card's, "
                   f"else {DEFAULT_THRESHOLD})")
    e.add_argument("--recipes", type=_csv(str), help="only these recipes (default: every recipe the predictor was "
                   "not trained on)")
    e.add_argument("--lofo", action="store_true", help="leave-one-family-out instead: per architecture family, "
                   "train a fresh predictor with the --predictor file's training settings (its card) on the other "
                   "families' runs in RUNS_DIR and evaluate it on that family; the file's own weights are not used. "
                   "Trains one predictor per family; --recipes picks the runs taking part (default all)")

    cf = sub.add_parser("counterfactual", help="what freezing a prefix at step t costs: replay collected runs and "
                        "train on with blocks 0..d-1 frozen, for a grid of (t, d)")
    cf.add_argument("runs_dir", metavar="RUNS_DIR", help="the collected runs (counterfactual.json goes into each; a "
                    "killed job resumes from each run's counterfactual.partial.json, finished runs are skipped)")
    cf.add_argument("--recipes", type=_csv(str), required=True, help="comma-separated recipes (collected in RUNS_DIR)")
    cf.add_argument("--seeds", type=_csv(int), default=[0], help="comma-separated seeds (default 0)")
    cf.add_argument("--lrs", type=_csv(float, positive=True), help="learning rates (default each recipe's own "
                    "pair)")
    cf.add_argument("--lr-factors", type=_factors, help="the runs collected with `collect --lr-factors`: "
                    + _LR_FACTORS_HELP.split(", e.g.")[0])
    cf.add_argument("--fractions", type=_csv(float), default=list(DEFAULT_FRACTIONS),
                    help="grid steps as fractions of the run, each in (0, 1), moved to the next activation snapshot "
                    f"(default {','.join(f'{f:g}' for f in DEFAULT_FRACTIONS)})")
    cf.add_argument("--depths", type=_csv(int),
                    help=f"prefix depths, each 0 (nothing frozen: checks the replay) up to the number of non-head "
                    f"blocks (default all non-head depths, at most {MAX_DEPTHS} spread evenly)")
    cf.add_argument("--null-orders", type=_number(int, 0), default=DEFAULT_NULL_ORDERS,
                    help="unfrozen continuations on other data orders per grid step: the noise a cost is judged "
                    f"against (default {DEFAULT_NULL_ORDERS})")
    cf.add_argument("--quick", action="store_true", help="the recipes shrunk as `collect --quick` recorded them")

    cal = sub.add_parser("calibrate", help="score CKA labelling rules (tau, window, delta) against the "
                         "counterfactual costs: precision, recall, the cost and the savings of following each")
    cal.add_argument("runs_dir", metavar="RUNS_DIR",
                     help="the runs folder with counterfactual.json files (`predictor counterfactual RUNS_DIR` first)")
    cal.add_argument("--taus", type=_csv(float), default=[0.99, 0.995, 0.998, 0.999, 0.9995],
                     help="CKA thresholds (default 0.99,0.995,0.998,0.999,0.9995)")
    cal.add_argument("--windows", type=_csv(int), default=[DEFAULT_WINDOW],
                     help=f"stability windows, in activation snapshots (default {DEFAULT_WINDOW})")
    cal.add_argument("--deltas", type=_csv(float), default=[DEFAULT_DELTA],
                     help="comma-separated largest CKA changes a rule allows over its stability window (max - min of "
                     "a block's CKA to its final state, CKA being unitless in [0, 1]; label's --delta), each >= 0; "
                     f"every --taus / --windows / --deltas combination is scored (default {DEFAULT_DELTA})")
    cal.add_argument("--eps", type=_number(float, 0), default=DEFAULT_EPS_POINTS,
                     help="accuracy points a freeze may lose beyond the unfrozen continuations' lowest and still "
                     f"count as costing nothing (default {DEFAULT_EPS_POINTS})")
    for command in (c, e, cf):  # the commands that build or name recipes know a user's own too
        command.add_argument("--import", dest="imports", action="append", default=[], metavar="FILE_OR_MODULE",
                             help="a .py file or module that registers your own recipes with @register_recipe "
                             "(layerfreeze.smartfrz.recipes); repeatable")
    for action in sub._choices_actions:  # each sub-command's --help opens with what it does
        command = sub.choices[action.dest]
        if command.description is None and action.help:
            command.description = action.help[0].upper() + action.help[1:] + "."
    return p
