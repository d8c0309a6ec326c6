"""Counterfactual-corrected labels (issue 29): CKA labels that a measured freeze cost can veto.

The CKA rule (:mod:`.labels`) calls block ``b`` freezable at snapshot ``s`` when its representation is close to the
final one. At a small learning rate every block moves little, so CKA to the end is high early, yet freezing then
can still cost accuracy (MiniLM-L6 / BBC News at lr x0.3: the predictor trained on CKA labels lost 6.5 points).
:mod:`.counterfactual` measures that cost directly: for grid steps ``t_1 < ... < t_K`` and prefix depths ``d`` it
trains the run on with blocks ``0 .. d-1`` frozen from ``t`` and compares the final test accuracy with the unfrozen
continuations (:func:`~layerfreeze.smartfrz.counterfactual.counterfactual_labels`: ``(t, d)`` *costs nothing* when
it loses at most ``eps_points`` beyond the lowest unfrozen continuation).

The correction, per run that has a ``counterfactual.json`` (:func:`correct_freezable`), rests on two assumptions
about a freeze's cost: freezing *earlier* is never cheaper (the frozen prefix misses more updates), and freezing a
*longer* prefix is never cheaper (more blocks miss them). Labelling block ``b`` freezable at snapshot ``s`` says that
freezing the prefix ``0 .. b`` (depth ``b + 1``, the prefix rule of :mod:`.labels`) at step ``s`` costs nothing. A
grid cell ``(t, d)`` that costs something therefore proves a cost for every freeze that is no later and no shorter:

1. A costly cell ``(t, d)`` (``d >= 1``) removes the label of every block ``b >= d - 1`` at every snapshot
   ``s <= t``. This is the only inference the two assumptions allow in this direction; a costly cell says nothing
   about a later snapshot (it may be cheaper) or a shorter prefix.
2. A cell that costs nothing removes nothing, and the counterfactual never adds a label CKA did not give: "free at
   ``(t, d)``" would have to be carried to other steps against the same assumptions (a grid of six steps is too
   coarse to place a freeze between its cells), and the continuations are lower bounds on a schedule's cost
   (:mod:`.counterfactual`). So where CKA and the counterfactual disagree, the label takes the counterfactual's side
   only when it says "not free"; snapshots after the last grid step keep their CKA labels.
3. The prefix rule holds by construction (a veto of block ``b`` vetoes every deeper block) and is applied again.

Runs without a ``counterfactual.json`` keep their CKA labels exactly. Every run labelled in this mode records
``"counterfactual": {"eps_points", "available", "corrected", "cells", "replay_matches_record", "fractions",
"null_orders", "depths"}`` in its ``labels.json`` (``available``: the run had a counterfactual file; ``corrected``:
the ``(block, snapshot)`` labels turned from freezable to not, the prefix rule's included; ``replay_matches_record``:
the counterfactual's unfrozen replay reached the recorded accuracy, so its costs are of the recorded trajectory; the
last four only with a file); ``first_freezable_step`` is recomputed from the corrected
flags (same meaning: the first snapshot at which the block is freezable).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from layerfreeze.smartfrz.counterfactual import (
    COUNTERFACTUAL_FILE,
    DEFAULT_EPS_POINTS,
    counterfactual_labels,
    load_counterfactual,
)
from layerfreeze.smartfrz.labels import (
    DEFAULT_DELTA,
    DEFAULT_TAU,
    DEFAULT_TAU_SCRATCH,
    DEFAULT_WINDOW,
    label_run,
)
from layerfreeze.smartfrz.runs import LABELS_FILE, PipelineError, list_runs, write_json_atomic


def correct_freezable(freezable: Sequence[Sequence[bool]], act_steps: Sequence[int],
                      cheap: Mapping[tuple[int, int], bool]) -> tuple[list[list[bool]], int]:
    """Correct a ``(L blocks, N_act)`` table of CKA labels with counterfactual costs (rules in the module docstring).

    Args:
        freezable: ``freezable[b][a]``: block ``b`` freezable at activation snapshot ``a`` by the CKA rule (already
            prefix-closed, as :func:`~layerfreeze.smartfrz.labels.freezable_from_cka` returns it).
        act_steps: ``(N_act,)`` the optimizer step of each activation snapshot.
        cheap: ``{(t, depth): freezing blocks 0..depth-1 at step t costs nothing}``
            (:func:`~layerfreeze.smartfrz.counterfactual.counterfactual_labels`); depth-0 cells are ignored.

    Returns:
        ``(corrected flags, number of (block, snapshot) labels turned from True to False)``; the input is not
        modified. Never turns a False into True.
    """
    costly = [(t, d) for (t, d), free in cheap.items() if d >= 1 and free is False]
    out = [list(map(bool, row)) for row in freezable]
    for t, d in costly:
        for b in range(d - 1, len(out)):
            for a, s in enumerate(act_steps):
                if s <= t:
                    out[b][a] = False
    for a in range(len(act_steps)):  # the prefix rule again
        closed = True
        for b in range(len(out)):
            closed = closed and out[b][a]
            out[b][a] = closed
    corrected = sum(bool(x) and not y for row, new in zip(freezable, out) for x, y in zip(row, new))
    return out, corrected


def read_counterfactual(run_dir: str | Path) -> dict[str, Any] | None:
    """A run folder's ``counterfactual.json``, or None when it has none.

    Raises:
        PipelineError: the file is not a counterfactual file of the current version, or belongs to another run.
    """
    path = Path(run_dir) / COUNTERFACTUAL_FILE
    if not path.is_file():
        return None
    cf = load_counterfactual(path)
    if cf.get("run") != Path(run_dir).name:
        raise PipelineError(f"{path} is the counterfactual of run {cf.get('run')!r}, not of {Path(run_dir).name!r} "
                            f"(recompute it with `layerfreeze predictor counterfactual`)")
    return cf


def label_run_corrected(run_dir: str | Path, tau: float = DEFAULT_TAU, delta: float = DEFAULT_DELTA,
                        window: int = DEFAULT_WINDOW, tau_scratch: float = DEFAULT_TAU_SCRATCH,
                        eps_points: float = DEFAULT_EPS_POINTS, write: bool = True) -> dict[str, Any]:
    """:func:`~layerfreeze.smartfrz.labels.label_run` (CKA labels) corrected by the run's ``counterfactual.json``
    when it has one (:func:`correct_freezable`); writes ``labels.json``.

    Args:
        eps_points: Accuracy points (0-100 scale) a freeze may lose beyond the unfrozen continuations and still
            cost nothing (:func:`~layerfreeze.smartfrz.counterfactual.counterfactual_labels`).

    Returns:
        The labels of :func:`~layerfreeze.smartfrz.labels.label_run` with corrected ``freezable`` and
        ``first_freezable_step`` and a ``"counterfactual"`` entry (module docstring).

    Raises:
        PipelineError: ``eps_points < 0``, a counterfactual file of another run or of another run length.
    """
    if not eps_points >= 0:
        raise PipelineError(f"eps_points must be >= 0 accuracy points, got {eps_points}")
    lab = label_run(run_dir, tau, delta, window, write=False, tau_scratch=tau_scratch)
    cf = read_counterfactual(run_dir)
    info: dict[str, Any] = {"eps_points": eps_points, "available": cf is not None, "corrected": 0, "cells": 0}
    if cf is not None:
        if int(cf["steps"]) != int(lab["steps"]):
            raise PipelineError(f"{Path(run_dir) / COUNTERFACTUAL_FILE} is of a {cf['steps']}-step run, the run has "
                                f"{lab['steps']} steps (recompute it with `layerfreeze predictor counterfactual`)")
        flags, corrected = correct_freezable(lab["freezable"], lab["act_steps"], counterfactual_labels(cf, eps_points))
        lab["freezable"] = flags
        lab["first_freezable_step"] = [next((lab["act_steps"][a] for a, f in enumerate(row) if f), None)
                                       for row in flags]
        info.update(corrected=corrected, cells=len(cf["grid"]),
                    replay_matches_record=bool(cf.get("baseline", {}).get("matches_record")),
                    fractions=cf.get("fractions"),
                    null_orders=cf.get("null_orders", len(cf.get("null", []))),
                    depths=sorted({c["depth"] for c in cf["grid"]}))
    lab["counterfactual"] = info
    if write:
        write_json_atomic(Path(run_dir) / LABELS_FILE, lab)
    return lab


def label_runs_corrected(runs_dir: str | Path, tau: float = DEFAULT_TAU, delta: float = DEFAULT_DELTA,
                         window: int = DEFAULT_WINDOW, tau_scratch: float = DEFAULT_TAU_SCRATCH,
                         eps_points: float = DEFAULT_EPS_POINTS) -> list[dict[str, Any]]:
    """:func:`label_run_corrected` for every complete run under ``runs_dir`` (rewrites each ``labels.json``).

    Every run is labelled before any ``labels.json`` is written, so a bad counterfactual file in one run leaves the
    corpus's labels as they were, not half of them relabelled.
    """
    labels = [(d, label_run_corrected(d, tau, delta, window, tau_scratch, eps_points, write=False))
              for d in list_runs(runs_dir)]
    for d, lab in labels:
        write_json_atomic(Path(d) / LABELS_FILE, lab)
    return [lab for _, lab in labels]


def correction_summary(labels: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """What the counterfactual correction did over a corpus's labels (one ``labels.json`` content per run).

    Returns:
        None when no run was labelled with the correction, else ``{"eps_points", "runs", "runs_with_counterfactual",
        "corrected", "freezable_cka", "freezable"}``: labels turned from freezable to not (``corrected``) out of the
        CKA rule's freezable ``(block, snapshot)`` labels (``freezable_cka``), ``freezable`` what is left.

    Raises:
        PipelineError: the runs were labelled with different ``eps_points`` (or some without the correction).
    """
    infos = [lab.get("counterfactual") for lab in labels]
    if all(i is None for i in infos):
        return None
    eps = {None if i is None else i["eps_points"] for i in infos}
    if len(eps) != 1:
        raise PipelineError(f"runs were labelled with different counterfactual corrections (eps points "
                            f"{sorted(eps, key=str)}); relabel them together with `layerfreeze predictor label "
                            "RUNS_DIR --counterfactual`")
    freezable = sum(sum(map(bool, row)) for lab in labels for row in lab["freezable"])
    corrected = sum(i["corrected"] for i in infos)
    return {"eps_points": eps.pop(), "runs": len(infos), "runs_with_counterfactual": sum(i["available"] for i in infos),
            "corrected": corrected, "freezable_cka": freezable + corrected, "freezable": freezable}
