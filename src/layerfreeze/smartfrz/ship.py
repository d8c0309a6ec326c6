"""Ship a predictor: train it on the labelled runs, measure it on the held-out recipes (and, optionally, leave one
architecture family out at a time), and write the weights with their card (``predictor.safetensors`` +
``PREDICTOR_CARD.md``). ``layerfreeze predictor train`` runs :func:`train_and_save`; the training itself is
:mod:`~layerfreeze.smartfrz.fit`, the LOFO evaluation :mod:`~layerfreeze.smartfrz.lofo`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from layerfreeze._version import __version__
from layerfreeze.smartfrz.card import write_card
from layerfreeze.smartfrz.cflabels import correction_summary
from layerfreeze.smartfrz.fit import (
    DEFAULT_THRESHOLD,
    TrainConfig,
    evaluate,
    label_settings,
    rounded,
    run_summary,
    split_runs,
    train_predictor,
)
from layerfreeze.smartfrz.lofo import family_folds, leave_one_family_out
from layerfreeze.smartfrz.recipes import RECIPES
from layerfreeze.smartfrz.runs import META_FILE, PipelineError, RunData
from layerfreeze.strategies.smartfrz.predictor import FORMAT, save_predictor


def lr_spread(runs: Iterable[RunData]) -> dict[str, dict[str, Any]]:
    """The learning rates of a corpus per recipe, against the recipe's registered rates (issue 29: a corpus needs
    "small movement because small learning rate" in it).

    Returns:
        ``{recipe: {"registered": [rates] or None, "lrs": [rates in the corpus, ascending], "factors": [lr / lowest
        registered rate, per lr] or None, "runs": number of runs}}``; ``registered`` and ``factors`` are None for a
        recipe recorded outside the registry (:func:`~layerfreeze.smartfrz.collect.record_run`).
    """
    by_recipe: dict[str, list[float]] = {}
    for r in runs:
        by_recipe.setdefault(r.recipe, []).append(float(r.meta["lr"]))
    out = {}
    for name, rates in by_recipe.items():
        registered = sorted(RECIPES[name].lrs) if name in RECIPES else None
        lrs = sorted(set(rates))
        out[name] = {"registered": registered, "lrs": lrs,
                     "factors": None if registered is None else [float(f"{x / registered[0]:.4g}") for x in lrs],
                     "runs": len(rates)}
    return out


def check_out(out: str | Path) -> None:
    """Refuse a predictor path that would overwrite what is not a predictor, before anything trains: a file in a
    recorded run's folder (``--out runs/x/weights.safetensors`` replaced the run's recording, and the card went
    among its files), or a readable safetensors file of something else (a model's ``model.safetensors``). A file
    that cannot be read is overwritten: a damaged predictor is retrained in place, as its load error says.

    Raises:
        PipelineError: naming the file and what to do.
    """
    from safetensors import SafetensorError, safe_open

    out = Path(out)
    if (out.parent / META_FILE).is_file():
        raise PipelineError(f"--out {out} is in the recorded run folder {out.parent}: the predictor and "
                            "PREDICTOR_CARD.md would go among the run's files; give a path outside the run folders")
    if not out.is_file():
        return
    try:
        with safe_open(str(out), framework="pt") as f:
            kind = (f.metadata() or {}).get("format")
    except (OSError, SafetensorError):
        return
    if kind != FORMAT:
        raise PipelineError(f"--out {out} is a safetensors file that is not a predictor (format {kind!r}) and would "
                            "be overwritten: give another path, or delete it first")


def train_and_save(runs: list[RunData], out: str | Path, holdout: Iterable[str], config: TrainConfig | None = None,
                   threshold: float = DEFAULT_THRESHOLD, command: str = "", card_path: str | Path | None = None,
                   lofo: bool = False, excluded: list[dict[str, Any]] | None = None) -> tuple[Path, dict[str, Any]]:
    """Split by recipe, train on the rest, evaluate on the held-out runs, save the predictor with its card.

    Args:
        runs: Labelled runs (all of one labelling).
        out: The predictor file (``.safetensors``).
        holdout: Recipes never trained on; metrics are measured on them.
        command: The command line that reproduces this file (recorded in the card).
        card_path: Where to write the Markdown card (default: ``PREDICTOR_CARD.md`` beside ``out``).
        lofo: Also run :func:`~layerfreeze.smartfrz.lofo.leave_one_family_out` on all ``runs`` (held-out recipes
            included; one extra predictor trained per architecture family, none saved) and record it in the card
            under ``"lofo"`` (None otherwise).
        excluded: The corpus's runs left out of ``runs`` (:func:`~layerfreeze.smartfrz.runs.excluded_runs`:
            diverged or collapsed), recorded in the card beside the learning-rate spread.

    Returns:
        ``(predictor path, card dict)``.

    Raises:
        PipelineError: no training runs left after the split, or runs labelled differently; with ``lofo``, also
            runs without an ``arch`` or of a single family.
    """
    cfg = config or TrainConfig()
    holdout = sorted(set(holdout))
    train_runs, held_runs = split_runs(runs, holdout)
    if not train_runs:
        raise PipelineError(f"every run belongs to a held-out recipe ({', '.join(holdout)}); nothing to train on")
    labels = {**label_settings(runs), "counterfactual": correction_summary([r.labels for r in runs])}
    if lofo:
        family_folds(runs)  # a corpus LOFO cannot split fails before anything is trained
    model, info = train_predictor(train_runs, cfg)
    metrics = None
    if held_runs:
        metrics = rounded(evaluate(model, held_runs, cfg.history, threshold, cfg.min_history))
        metrics.pop("per_run", None)
    lofo_metrics = None
    if lofo:
        lofo_metrics = rounded(leave_one_family_out(runs, cfg, threshold))
    card = {
        "name": "layerfreeze SmartFRZ freeze predictor",
        "layerfreeze_version": __version__, "torch_version": torch.__version__,
        "window": cfg.history, "min_window": cfg.min_history, "threshold": threshold, "labels": labels,
        "training": info,
        "train_recipes": sorted({r.recipe for r in train_runs}), "heldout_recipes": holdout,
        "train_runs": [run_summary(r) for r in train_runs], "heldout_runs": [run_summary(r) for r in held_runs],
        "heldout_metrics": metrics, "lofo": lofo_metrics, "lr_spread": lr_spread(runs), "command": command,
        "excluded_runs": list(excluded or []),
    }
    path = save_predictor(out, model, cfg.history, card=card, min_window=cfg.min_history)
    write_card(card, card_path or Path(out).with_name("PREDICTOR_CARD.md"))
    return path, card
