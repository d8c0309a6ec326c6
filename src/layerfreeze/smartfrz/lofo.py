"""Leave-one-family-out (LOFO) evaluation of the SmartFRZ predictor's training recipe.

Why: the card's held-out metrics (:func:`~layerfreeze.smartfrz.ship.train_and_save`) are measured on a fixed pair of
recipes (:data:`~layerfreeze.smartfrz.recipes.registry.DEFAULT_HOLDOUT`), i.e. on two architectures. SmartFRZ's claim
(Li et al., "SmartFRZ: An Efficient Training Framework using Attention-Based Layer Freezing", ICLR 2023) is that one
predictor, trained offline on some networks, serves networks it has never seen. LOFO tests that for every
architecture in the corpus: per *family* (a run's ``meta["arch"]``: mlp, cnn, vit, resnet, mobilenet_v2,
minilm-l6, bert-tiny, ...) a predictor is trained on the runs of all other families and evaluated on that family's
runs only. A family groups every recipe of one architecture (e.g. ``cnn-digits``, ``cnn-fmnist`` and the fine-tune
``cnn-fmnist-to-digits``), so no fold sees the evaluated architecture under another dataset or training mode.

Each fold is trained exactly like :func:`~layerfreeze.smartfrz.fit.train_predictor` (same
:class:`~layerfreeze.smartfrz.fit.TrainConfig`, same seed, deterministic), on the other families' runs in the order
given, and evaluated with :func:`~layerfreeze.smartfrz.fit.evaluate` (per-window precision/recall/F1 at the
threshold, freeze-step error, bias and early fraction of the prefix rule). These predictors are measurements only;
none is saved.
"""

from __future__ import annotations

import math
from typing import Any

from layerfreeze.smartfrz.fit import (
    DEFAULT_THRESHOLD,
    TrainConfig,
    counts_metrics,
    evaluate,
    label_settings,
    train_predictor,
)
from layerfreeze.smartfrz.runs import PipelineError, RunData

#: How :func:`pool_metrics` combines the folds (recorded with the results and shown in the card).
POOLING = ("windows and blocks of every fold pooled: window counts summed, then precision/recall/F1; step error, "
           "bias and early fraction over all blocks (not a mean of the per-family numbers)")


def run_family(run: RunData) -> str:
    """The run's architecture family: ``meta["arch"]`` (set by the recipe it was collected with).

    Raises:
        PipelineError: the run has no ``arch`` (recorded outside the registered recipes without one).
    """
    arch = run.meta.get("arch")
    if not arch:
        raise PipelineError(f"{run.path} has no 'arch' in its meta.json: leave-one-family-out groups runs by it "
                            "(record the run with info={'arch': ...})")
    return str(arch)


def family_folds(runs: list[RunData]) -> dict[str, tuple[list[RunData], list[RunData]]]:
    """Split ``runs`` into one fold per family.

    Returns:
        ``{family: (training runs: every run of the other families, evaluation runs: the family's runs)}``, families
        sorted by name, runs in the order of ``runs``.

    Raises:
        PipelineError: a run has no ``arch``, or the runs span fewer than two families (a fold would train on
        nothing).
    """
    families = {r.path: run_family(r) for r in runs}
    names = sorted(set(families.values()))
    if len(names) < 2:
        raise PipelineError(f"leave-one-family-out needs runs of at least two architecture families; got "
                            f"{', '.join(names) or 'none'}")
    return {f: ([r for r in runs if families[r.path] != f], [r for r in runs if families[r.path] == f])
            for f in names}


def pool_metrics(folds: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the ``overall`` metrics of :func:`~layerfreeze.smartfrz.fit.evaluate` over folds (see :data:`POOLING`).

    Args:
        folds: One metrics dict per fold (windows, tp, fp, fn, tn, blocks, freeze_step_error, freeze_step_bias,
            early_fraction).

    Returns:
        A metrics dict of the same keys: counts are the sums over folds; precision/recall/F1/accuracy come from the
        summed counts; the block metrics are the means over every block of every fold (each fold's mean weighted
        by its number of blocks; a fold without blocks adds none). NaN block metrics when no fold has a block.
    """
    out = counts_metrics(*(sum(int(m[k]) for m in folds) for k in ("tp", "fp", "fn", "tn")))
    with_blocks = [m for m in folds if m["blocks"]]
    n = sum(int(m["blocks"]) for m in with_blocks)

    def mean(key: str) -> float:
        return sum(m[key] * m["blocks"] for m in with_blocks) / n if n else math.nan

    out.update(blocks=n, freeze_step_error=mean("freeze_step_error"), freeze_step_bias=mean("freeze_step_bias"),
               early_fraction=sum(round(m["early_fraction"] * m["blocks"]) for m in with_blocks) / n if n else math.nan)
    return out


def leave_one_family_out(runs: list[RunData], config: TrainConfig | None = None,
                         threshold: float = DEFAULT_THRESHOLD) -> dict[str, Any]:
    """Train one predictor per family on the other families' runs; evaluate it on that family's runs only.

    Args:
        runs: Labelled runs (all of one labelling), of at least two families (``meta["arch"]``).
        config: Training settings of every fold (default :class:`TrainConfig`); its ``history`` and
            ``min_history`` are also the evaluation window.
        threshold: Decision threshold of the evaluation, a probability.

    Returns:
        ``{"threshold", "history", "min_history", "pooling": POOLING, "families": {family: {"recipes": [...],
        "eval_runs": [run names], "train_runs": [run names], "train_families": [...], "training": {examples,
        positives, negatives, final_train_loss, data_sha256}, "metrics": evaluate(...)["overall"]}}, "pooled":
        pool_metrics(...)}``; families sorted by name. Floats are not rounded.

    Raises:
        PipelineError: a run is unlabelled, runs were labelled differently, a run has no ``arch``, fewer than two
            families, or a fold has no labelled window to train on.
        AssertionError: a fold would be evaluated on a run it was trained on, or trained on its own family (a bug
            in the split; checked before every fold is trained).
    """
    cfg = config or TrainConfig()
    label_settings(runs)  # every run labelled, and labelled alike, before any fold trains
    families: dict[str, Any] = {}
    for family, (train_runs, eval_runs) in family_folds(runs).items():
        trained = {r.path for r in train_runs}
        leaked = sorted(r.name for r in eval_runs if r.path in trained)
        if leaked or any(run_family(r) == family for r in train_runs) or not eval_runs:
            raise AssertionError(f"fold {family!r} is not leave-one-family-out: evaluated on its training runs "
                                 f"{leaked} or trained on its own family")
        model, info = train_predictor(train_runs, cfg)
        metrics = evaluate(model, eval_runs, cfg.history, threshold, cfg.min_history)["overall"]
        families[family] = {
            "recipes": sorted({r.recipe for r in eval_runs}), "eval_runs": [r.name for r in eval_runs],
            "train_runs": [r.name for r in train_runs], "train_families": sorted({run_family(r) for r in train_runs}),
            "training": {k: info[k] for k in ("examples", "positives", "negatives", "final_train_loss",
                                              "data_sha256")},
            "metrics": metrics,
        }
    return {"threshold": threshold, "history": cfg.history, "min_history": cfg.min_history, "pooling": POOLING,
            "families": families, "pooled": pool_metrics([f["metrics"] for f in families.values()])}
