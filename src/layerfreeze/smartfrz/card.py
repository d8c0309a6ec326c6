"""``PREDICTOR_CARD.md``: the predictor's card rendered as Markdown (what it was trained on, the label thresholds,
the held-out metrics, the leave-one-family-out metrics when the card has them, and the command that reproduces
it). The same card is stored as JSON inside the predictor file's metadata (``load_predictor(path)[1]["card"]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
    return str(v)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return out


def _runs_table(runs: list[dict[str, Any]]) -> list[str]:
    if not runs:
        return ["(none)"]
    return _table(["run", "recipe", "arch", "dataset", "mode", "seed", "lr", "steps", "blocks", "test acc."],
                  [[r["run"], r["recipe"], r.get("arch"), r.get("dataset"), r.get("mode"), r["seed"], f"{r['lr']:g}",
                    r["steps"], r.get("blocks"), r.get("test_accuracy")] for r in runs])


_METRIC_COLS = ["windows", "precision", "recall", "f1", "blocks", "freeze_step_error", "freeze_step_bias",
                "early_fraction"]


def _lofo_section(lofo: dict[str, Any]) -> list[str]:
    """The "Leave-one-family-out" section from ``card["lofo"]`` (see
    :func:`~layerfreeze.smartfrz.lofo.leave_one_family_out`): one row per family, the pooled row first."""
    families = lofo.get("families", {})
    lines = [
        "## Leave-one-family-out",
        "",
        "The held-out pair above is two recipes. Here every architecture family (the runs' `arch`) is held out in "
        "turn: a predictor with the training settings above is trained on every run of the other families (the "
        "held-out recipes included) and evaluated on that family's runs only, so each row is a network the "
        "predictor never saw (SmartFRZ's claim: one predictor serves unseen architectures). These predictors are "
        f"not the one shipped in this file. Same metrics and threshold ({lofo.get('threshold')}) as above. Pooled: "
        f"{lofo.get('pooling', 'windows and blocks of every fold pooled')}.",
        "",
    ]
    header = ["family", "recipes", "runs", "train runs", "windows", "precision", "recall", "F1", "blocks",
              "step error", "step bias", "early"]
    pooled = lofo.get("pooled") or {}
    rows = [["**pooled**", "", sum(len(f.get("eval_runs", [])) for f in families.values()), "",
             *[pooled.get(c) for c in _METRIC_COLS]]]
    rows += [[name, ", ".join(f.get("recipes", [])), len(f.get("eval_runs", [])), len(f.get("train_runs", [])),
              *[f.get("metrics", {}).get(c) for c in _METRIC_COLS]] for name, f in families.items()]
    return [*lines, *_table(header, rows), ""]


def _correction_lines(cf: dict[str, Any] | None) -> list[str]:
    """The Labels section's paragraph on the counterfactual correction (``card["labels"]["counterfactual"]``,
    :func:`~layerfreeze.smartfrz.cflabels.correction_summary`)."""
    if not cf:
        return ["Counterfactual correction: not used (plain CKA labels).", ""]
    share = cf["corrected"] / cf["freezable_cka"] if cf.get("freezable_cka") else 0.0
    return [
        f"Counterfactual correction: used, eps = {_fmt(cf['eps_points'])} points. "
        f"{cf['runs_with_counterfactual']} of {cf['runs']} runs (training and held-out) had a `counterfactual.json` "
        "(`layerfreeze predictor counterfactual`: the run replayed and trained on with blocks 0..d-1 frozen from "
        "step t). In those, a grid cell (t, d) that lost more than eps points beyond the unfrozen continuations "
        "removes the label of blocks d-1 and deeper at every snapshot up to step t (a freeze no later and no "
        "shorter costs at least as much); the correction only removes CKA labels, never adds one. "
        f"{cf['corrected']} of the CKA rule's {cf['freezable_cka']} freezable (block, snapshot) labels "
        f"({100 * share:.1f}%) were turned to not freezable; {cf['runs'] - cf['runs_with_counterfactual']} runs "
        "without counterfactuals keep their CKA labels. See `layerfreeze.smartfrz.cflabels`.",
        "",
    ]


def _lr_spread_section(spread: dict[str, Any], excluded: list[dict[str, Any]] | None = None) -> list[str]:
    """The "Learning-rate spread" section from ``card["lr_spread"]`` (:func:`~layerfreeze.smartfrz.ship.lr_spread`):
    per recipe, the corpus's learning rates and their factors against the recipe's lowest registered rate; then the
    recorded runs left out (``card["excluded_runs"]``), which explain a rate missing from the table."""
    rows = [[name, ", ".join(f"{x:g}" for x in s["registered"]) if s.get("registered") else "-",
             ", ".join(f"{x:g}" for x in s["lrs"]),
             ", ".join(f"x{f:g}" for f in s["factors"]) if s.get("factors") else "-", s.get("runs")]
            for name, s in spread.items()]
    lows = [f for s in spread.values() for f in (s.get("factors") or [])]
    span = f"factors from x{min(lows):g} to x{max(lows):g}" if lows else "no registered recipe"
    return ["## Learning-rate spread", "",
            "The learning rates of every run above (training and held-out), per recipe; factor = the rate over the "
            f"recipe's lowest registered rate (`collect --lr-factors` scales the registered rates). Over the corpus: "
            f"{span}.", "",
            *_table(["recipe", "registered rates", "corpus rates", "factors", "runs"], rows), "",
            *(["Recorded but not used (a diverged or collapsed run would teach the predictor that a broken network "
               "has converged): " + "; ".join(f"{e['run']} ({e['why']})" for e in excluded) + ".", ""]
              if excluded else [])]


def render_card(card: dict[str, Any]) -> str:
    """The card as Markdown text."""
    labels = card.get("labels", {})
    training = card.get("training", {})
    cfg = training.get("config", {})
    lines = [f"# {card.get('name', 'SmartFRZ freeze predictor')}", ""]
    lines += [
        "A learned freezing policy for `layerfreeze`'s `smartfrz` strategy: given the last "
        f"{card.get('min_window', card.get('window'))} to {card.get('window')} weight snapshots of a block (1,024 "
        "sampled weights, scale-free features, with the block's depth and the training progress), it gives the "
        "probability that the block can be frozen now. "
        "Trained offline on CKA labels (SmartFRZ, Li et al., ICLR 2023)"
        + (", less the freezes that measured counterfactual costs refute (issue 29)"
           if (labels.get("counterfactual") or {}).get("eps_points") is not None else "")
        + "; all metrics below are on held-out recipes (network, dataset and training-mode combinations it was never "
        "trained on).",
        "",
        f"- layerfreeze {card.get('layerfreeze_version')}, torch {card.get('torch_version')}",
        f"- window: {card.get('min_window', card.get('window'))}-{card.get('window')} snapshots (a decision needs at "
        f"least {card.get('min_window', card.get('window'))}); decision threshold: {card.get('threshold')}",
        f"- training recipes: {', '.join(card.get('train_recipes', [])) or '-'}",
        f"- held-out recipes: {', '.join(card.get('heldout_recipes', [])) or '-'}",
        "",
        "## Labels",
        "",
        f"A block is *freezable at t* when the linear CKA between its output on a fixed probe batch at t and at the "
        f"end of training is >= tau = {labels.get('tau')} (tau_scratch = "
        f"{labels.get('tau_scratch', labels.get('tau'))} for a run trained from scratch), that CKA moved by at most "
        f"delta = {labels.get('delta')} "
        f"(max - min) over the last window = {labels.get('window')} activation snapshots, and every earlier block is "
        "freezable too; the head never is. See `layerfreeze.smartfrz.labels` for why these values.",
        "",
        *_correction_lines(labels.get("counterfactual")),
        "## Training",
        "",
        f"- examples: {training.get('examples')} windows ({training.get('positives')} freezable, "
        f"{training.get('negatives')} not); class-balanced BCE (pos_weight {training.get('pos_weight')})",
        f"- FreezePredictor(hidden={cfg.get('hidden')}), AdamW lr {cfg.get('lr')}, weight decay "
        f"{cfg.get('weight_decay')}, batch {cfg.get('batch_size')}, {cfg.get('epochs')} epochs, seed {cfg.get('seed')}"
        "; one thread, deterministic algorithms",
        f"- final training loss: {_fmt(training.get('final_train_loss'), 4)}",
        f"- training data SHA-256: `{training.get('data_sha256')}`",
        "",
        "## Held-out metrics",
        "",
    ]
    metrics = card.get("heldout_metrics")
    if not metrics:
        lines += ["No held-out runs were available: this predictor is unevaluated.", ""]
    else:
        lines += [
            "Per-window decisions (`p >= threshold` vs. the label at every labelled snapshot) and freeze-step "
            "error (first step the strategy's prefix rule freezes a block vs. its first labelled freezable step, "
            "as a fraction of training; never frozen = end of training). Bias > 0: freezes later than the labels; "
            "early = fraction of blocks frozen before their label.",
            "",
        ]
        rows = [["**all held-out**", *[metrics["overall"].get(c) for c in _METRIC_COLS]]]
        rows += [[k, *[v.get(c) for c in _METRIC_COLS]] for k, v in metrics.get("per_recipe", {}).items()]
        lines += _table(["recipe", "windows", "precision", "recall", "F1", "blocks", "step error", "step bias",
                         "early"], rows)
        lines.append("")
    if card.get("lofo"):
        lines += _lofo_section(card["lofo"])
    if card.get("lr_spread"):
        lines += _lr_spread_section(card["lr_spread"], card.get("excluded_runs"))
    lines += ["## Training runs", "", *_runs_table(card.get("train_runs", [])), "",
              "## Held-out runs", "", *_runs_table(card.get("heldout_runs", [])), "",
              "## Reproduce", "",
              "Predictor training is bit-for-bit reproducible from the runs and the seed (same training-data "
              "SHA-256 above); the runs are recorded with fixed seeds (bitwise identical on the same machine and "
              "thread count).", "", "```", card.get("command") or "(not recorded)", "```", ""]
    return "\n".join(lines)


def write_card(card: dict[str, Any], path: str | Path) -> Path:
    """Write :func:`render_card` of ``card`` to ``path`` (Markdown)."""
    path = Path(path)
    path.write_text(render_card(card))
    return path
