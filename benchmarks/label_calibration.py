"""Do CKA labels mean "freezing now costs nothing"? Counterfactual costs beside the CKA oracle (issue 16).

For every collected run with a ``counterfactual.json`` (``layerfreeze predictor counterfactual``: replay the run,
freeze blocks ``0 .. d-1`` at grid step ``t``, train to the end, measure the final test accuracy), this script
prints and writes:

1. per run, the cost grid: accuracy points lost at the end for each (t, d), beside the spread of the unfrozen
   continuations on other data orders (the noise a cost is judged against), and per depth the earliest grid step
   from which freezing is free at every later grid step (the counterfactual oracle) next to the CKA oracle's first
   freezable step (the shipped labelling rule);
2. the labelling rules ``(tau, window)`` scored against the counterfactual labels
   (:func:`layerfreeze.smartfrz.counterfactual.calibrate`): precision, recall, the cost of the freezes each rule
   calls free and the share of the run it would freeze -- the trade-off curve.

    python -m benchmarks.label_calibration runs/smartfrz
    python -m benchmarks.label_calibration runs/smartfrz --taus 0.99,0.998,0.9995 --windows 1,3,5 --eps 0.2

Outputs the section between ``<!-- labels:begin -->`` and ``<!-- labels:end -->`` of ``--markdown`` (default
BENCHMARKS.md) and ``RUNS/label_calibration.md``. It times nothing (accuracies do not depend on timing).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.cli import entry
from benchmarks.markdown_section import update_section
from layerfreeze.smartfrz.counterfactual import (
    DEFAULT_EPS_POINTS,
    calibrate,
    counterfactual_labels,
    read_counterfactuals,
)
from layerfreeze.smartfrz.labels import DEFAULT_DELTA, DEFAULT_TAU, DEFAULT_WINDOW, label_run

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- labels:begin -->", "<!-- labels:end -->"
HEADING = "## Labels against counterfactual costs (issue 16)"


def _f(v: float, fmt: str) -> str:
    return "-" if v != v else format(v, fmt)


def earliest_free(cf: dict[str, Any], free: dict[tuple[int, int], bool], depth: int) -> int | None:
    """The earliest grid step from which freezing ``depth`` is free at that and every later grid step (None:
    not free at the last grid step)."""
    ts = sorted({c["t"] for c in cf["grid"] if c["depth"] == depth})
    first = None
    for t in reversed(ts):
        if not free[(t, depth)]:
            break
        first = t
    return first


def run_section(cf: dict[str, Any], runs_dir: Path, eps: float) -> list[str]:
    free = counterfactual_labels(cf, eps)
    depths = sorted({c["depth"] for c in cf["grid"]})
    ts = sorted({c["t"] for c in cf["grid"]})
    cost = {(c["t"], c["depth"]): c["cost_points"] for c in cf["grid"]}
    nulls: dict[int, list[float]] = {}
    for n in cf.get("null", []):
        nulls.setdefault(n["t"], []).append(n["cost_points"])
    steps = cf["steps"]
    per_sample = 100 / cf["test_size"]
    lines = [f"**{cf['run']}**: {steps} steps, unfrozen test accuracy {100 * cf['baseline']['accuracy']:.2f}% "
             f"({cf['test_size']} test samples: one is {per_sample:.2f} points; replay = recorded run: "
             f"{'yes' if cf['baseline']['matches_record'] else 'no'}). Cost in points lost by freezing blocks "
             f"0..d-1 at t; * = free (no worse than the lowest unfrozen continuation, within {eps:g}).", "",
             "| t | unfrozen, other orders | " + " | ".join(f"d={d}" for d in depths) + " |",
             "|---|---|" + "---|" * len(depths)]
    for t in ts:
        null = " / ".join(f"{v:+.2f}" for v in nulls.get(t, [])) or "-"
        cells = [f"{cost[(t, d)]:+.2f}{'*' if free[(t, d)] else ''}" for d in depths]
        lines.append(f"| {t / steps:.2f} | {null} | " + " | ".join(cells) + " |")
    lab = label_run(runs_dir / cf["run"], DEFAULT_TAU, DEFAULT_DELTA, DEFAULT_WINDOW, write=False)  # the run's regime
    cka_first = lab["first_freezable_step"]
    row_cf = []
    row_cka = []
    for d in depths:
        e = earliest_free(cf, free, d)
        row_cf.append("never" if e is None else f"{e / steps:.2f}")
        s = cka_first[d - 1]
        row_cka.append("never" if s is None else f"{s / steps:.2f}")
    lines += ["", "| first freeze of depth d (fraction of the run) | " + " | ".join(f"d={d}" for d in depths) + " |",
              "|---|" + "---|" * len(depths),
              "| counterfactual: free from this grid step on | " + " | ".join(row_cf) + " |",
              f"| CKA oracle (tau {lab['tau_applied']}, window {DEFAULT_WINDOW}) | " + " | ".join(row_cka) + " |", ""]
    return lines


def rules_section(rows: list[dict[str, Any]], eps: float) -> list[str]:
    lines = [f"Labelling rules scored on every grid cell above (a cell is free as marked, margin {eps:g} points). "
             "Precision: of the cells the rule calls freezable, the share that were free; cost: mean / max points "
             "lost by those; first-freeze cost: the cost at each depth's first freezable grid step, averaged; run "
             "share frozen: per depth, the share of the run after that first step (the saving), averaged.", "",
             "| tau | window | cells | precision | recall | F1 | mean cost | max cost | first-freeze cost | "
             "run share frozen |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tau']:g} | {r['window']} | {r['cells']} | {_f(r['precision'], '.3f')} | "
                     f"{_f(r['recall'], '.3f')} | {_f(r['f1'], '.3f')} | {_f(r['mean_cost'], '+.2f')} | "
                     f"{_f(r['max_cost'], '+.2f')} | {_f(r['oracle_cost'], '+.2f')} | {r['oracle_frozen']:.3f} |")
    return lines + [""]


def markdown(runs_dir: Path, taus: list[float], windows: list[int], eps: float) -> str:
    cfs = read_counterfactuals(runs_dir)
    lines = [f"Generated by `python -m benchmarks.label_calibration {runs_dir}` from the `counterfactual.json` of "
             f"{len(cfs)} run(s) (`layerfreeze predictor counterfactual`).", ""]
    for cf in cfs:
        lines += run_section(cf, runs_dir, eps)
    lines += rules_section(calibrate(runs_dir, taus, windows, [DEFAULT_DELTA], eps, counterfactuals=cfs), eps)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs_dir", type=Path, help="collected runs with counterfactual.json files")
    p.add_argument("--taus", default="0.99,0.995,0.998,0.999,0.9995,0.9998")
    p.add_argument("--windows", default="1,3,5")
    p.add_argument("--eps", type=float, default=DEFAULT_EPS_POINTS, help="margin in accuracy points")
    p.add_argument("--markdown", default=str(ROOT / "BENCHMARKS.md"), help="file whose section is replaced ('' for "
                   "none)")
    args = p.parse_args(argv)
    taus = [float(x) for x in args.taus.split(",")]
    windows = [int(x) for x in args.windows.split(",")]
    section = markdown(args.runs_dir, taus, windows, args.eps)
    (args.runs_dir / "label_calibration.md").write_text(section)
    Console(width=200).print(section, markup=False, highlight=False)
    if args.markdown:
        update_section(Path(args.markdown), BEGIN, END, section, HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main))
