"""Issue 29's grid: does the default strategy cost accuracy at other learning rates and run lengths?

For each task (the suite's jobs and sizes, ``benchmarks.suite_tasks.SIZES``; by default ``bbc`` and
``fmnist-mobilenet``), learning-rate factor (x0.3, x1, x3 of the suite's), run length (1, 2, 4 epochs) and seed,
one :func:`layerfreeze.train.compare.compare` process trains `none` and the rows beside it (same seed, data order
and budget): `smartfrz` (the strategy's defaults: the gradient signal-to-noise gate on, ``snr_gate=0.9``;
:mod:`layerfreeze.strategies.smartfrz.snr_gate`) and `smartfrz-nogate` (the same with the gate off, the predictor
alone: the ablation). The grid made the gate SmartFRZ's default. ``--rows`` may add `smartfrz-guard` (the default
with the stability guard, ``freeze.guard``, checked 8 times a run: issue 29's safety-net question) and
`none-heldout` (`none` holding out the guard's tenth of the training data: its control), and `none-reseed` (`none`
with other dropout noise from the middle of the run on: the cell's noise floor). Each row records its wall
and train seconds and its thaws, so the guard's held-out evaluations can be costed. ``--oracle`` adds an
untimed `none` run with the CKA oracle's probe recorder per cell (``benchmarks.oracle``) and records its freeze steps
beside.

    python -m benchmarks.lr_grid                                   # the whole grid: 2 tasks x 9 cells x 3 seeds
    python -m benchmarks.lr_grid --tasks bbc --lrs 0.3 --epochs 2 --seeds 0,1,2
    python -m benchmarks.lr_grid --quick --tasks fmnist-mobilenet --lrs 1 --epochs 1 --seeds 0   # a smoke test
    python -m benchmarks.lr_grid --from-json runs/bench-lr-grid/results.json   # only the table
    python -m benchmarks.lr_grid --from-json a/results.json b/results.json --out runs/bench-lr-grid  # merged
    python -m benchmarks.lr_grid --predictor runs/p/predictor.safetensors --tasks bbc --lrs 0.3   # a candidate
    python -m benchmarks.lr_grid --variant smartfrz-t95:threshold=0.95 --rows smartfrz,smartfrz-t95   # a setting

Outputs ``OUT/results.json`` (rewritten after every cell and seed; ``--resume`` skips the ones it holds) and
``OUT/lr_grid.md``: per task and cell, `none`'s accuracy and per row the mean Δ points [worst seed], FLOPs and time
ratios, and a second table of freeze schedules (non-head blocks frozen at the end and the first freeze step, median
over seeds) for each row and the oracle. Accuracy and FLOPs do not depend on timing; time ratios need each process
to have its cores to itself (``--threads``: run two one-thread processes on two cores, e.g. one per task).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks import suite, suite_tasks  # the suite's task specs and base config: the same jobs
from benchmarks.cli import entry, seed_list
from layerfreeze.errors import PredictorError
from layerfreeze.strategies import STRATEGIES, register_strategy
from layerfreeze.strategies.smartfrz import load_predictor

#: Row name -> (strategy, params). ``smartfrz``: the default (the gradient signal-to-noise gate on, kappa 0.9 and
#: snr_noise 1.35, the values measured on issue 29's research branch); ``smartfrz-nogate``: the predictor alone.
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "smartfrz": ("smartfrz", {}),
    "smartfrz-nogate": ("smartfrz", {"snr_gate": None}),
    "smartfrz-guard": ("smartfrz", {}),
    "none-heldout": ("none", {}),
    "none-reseed": ("none", {}),
}
#: Rows that train with the stability guard (:mod:`layerfreeze.engine.guard`, ``freeze.guard``; issue 29 item 3):
#: its defaults (5% worse held-out loss, patience 1, cooldown 2, 10% of the training data held out), checked at
#: every epoch end and every ``GUARD_CHECKS``-th of the run. ``none-heldout``: `none` under the same guard, which
#: then never acts but still holds out its tenth of the data: the guard's cost apart from its thaws.
GUARD_ROWS = ("smartfrz-guard", "none-heldout")
GUARD_CHECKS = 8
#: ``none-reseed``: `none` again, its global RNG (dropout; the data order has its own seeded generator) reseeded
#: at the middle step of the run: the same initialisation, data and schedule, other dropout noise from there on. Its
#: Δ to `none` is the cell's noise floor, what a perturbation that freezes nothing moves the final accuracy (the
#: counterfactual labels' "unfrozen, other orders" null, issue 16). Measured on BBC lr x3 4 epochs (seed 0 / 2):
#: reseeding at step 104 or 150 of 208 moved `none` by -0.45 / -1.13 and +0.00 / +0.68 points.
RESEED_ROWS = ("none-reseed",)
#: Seed of the reseeded RNG is this plus the run's seed.
RESEED_BASE = 7919
#: The rows ``python -m benchmarks.lr_grid`` runs when ``--rows`` is not given (the guard row on request).
DEFAULT_ROWS = ["smartfrz", "smartfrz-nogate"]


def row_strategy(name: str) -> type:
    """Register row ``name`` (compare runs rows by strategy name) as a subclass of its strategy's class
    (:func:`benchmarks.suite.row_class`: registering it again in this process is a no-op); returns the class."""
    strategy, _ = ROWS[name]
    cls = suite.row_class(STRATEGIES[strategy], name)
    if name != strategy:
        register_strategy(name)(cls)
    return cls


def reseed_at_half(seed: int) -> Any:
    """A trainer step callback (``Trainer(step_callbacks=...)``) that reseeds the global RNG with ``RESEED_BASE +
    seed`` once, after step ``total_steps // 2``: the `none-reseed` row. It breaks the callbacks' contract (leave
    the global RNG as found) on purpose: that is the perturbation measured."""
    import torch

    def callback(trainer: Any) -> None:
        if trainer.progress["step"] == trainer.total_steps // 2:
            torch.manual_seed(RESEED_BASE + seed)

    return callback


def row_params(rows: list[str], predictor: str | None = None) -> dict[str, dict[str, Any]]:
    """Each row's strategy parameters; ``predictor`` (a file from ``layerfreeze predictor train``) replaces the
    shipped predictor in every row whose strategy is `smartfrz` (a ``--variant`` that names its own keeps it)."""
    extra = {"predictor": predictor} if predictor else {}
    return {r: {**(extra if ROWS[r][0] == "smartfrz" else {}), **ROWS[r][1]} for r in rows}


def run_cell(task: str, lr_factor: float, epochs: int, seed: int, rows: list[str], out: Path, oracle: bool,
             console: Console, quick: bool = False, threads: int | None = None,
             predictor: str | None = None) -> dict[str, Any]:
    """One seed of one cell: `none` and ``rows`` in one compare process, in ``OUT/<task>/lr<f>-ep<n>/seed<s>``
    (cleared first); ``predictor``: see :func:`row_params`. Returns the cell's record: `none`'s test accuracy (a
    fraction), per row its accuracy, FLOPs and time ratios to `none`, freeze steps (block name -> step) and
    ``stopped`` (why a diverged row stopped, or None)."""
    from layerfreeze.train.compare import compare

    spec = suite_tasks.task_spec(task, quick)
    spec = replace(spec, epochs=epochs, lr=spec.lr * lr_factor)
    base = suite_tasks.base_config(spec, seed, threads)
    folder = out / task / f"lr{lr_factor:g}-ep{epochs}" / f"seed{seed}"
    shutil.rmtree(folder, ignore_errors=True)  # this script's own folder from an earlier run
    for r in rows:
        row_strategy(r)
    overrides = {}
    if any(r in GUARD_ROWS for r in rows):  # the run length, for the guard's interval (BBC: reads the data)
        every = max(1, suite_tasks.total_steps(spec, suite_tasks.dataset_sizes(spec)[0]) // GUARD_CHECKS)
        overrides = {r: {"freeze": {"guard": {"every_steps": every}}} for r in rows if r in GUARD_ROWS}
    callbacks = {r: [reseed_at_half(seed)] for r in rows if r in RESEED_ROWS}
    none, *trained = compare(base, ["none", *rows], folder, console=console,
                             row_params=row_params(rows, predictor), row_overrides=overrides,
                             row_callbacks=callbacks)
    cell: dict[str, Any] = {"task": task, "lr_factor": lr_factor, "lr": spec.lr, "epochs": epochs, "seed": seed,
                            "quick": quick, "steps": none.get("steps"), "none_accuracy": none["test_accuracy"],
                            "none_wall_s": none.get("wall_time_s"), "none_train_s": none.get("train_time_s"),
                            "rows": {}}
    for name, r in zip(rows, trained):
        cell["rows"][name] = {"accuracy": r.get("test_accuracy"), "flops_ratio": r.get("flops_ratio"),
                              "time_ratio": r.get("time_ratio"), "freeze_steps": r.get("freeze_steps", {}),
                              "stopped": r.get("stopped"), "wall_s": r.get("wall_time_s"),
                              "train_s": r.get("train_time_s"),
                              "thaws": sum(e["action"] == "thaw" for e in r.get("freeze_timeline", []))}
    if oracle:
        cell["oracle"] = oracle_steps(base, folder, spec.pretrained)
    return cell


def oracle_steps(base: dict[str, Any], folder: Path, pretrained: bool) -> dict[str, int | None]:
    """The CKA oracle's freeze step per block (None: never) from an untimed `none` run with the probe recorder, at
    the labels' tau for the task's regime (as ``benchmarks.suite``)."""
    from benchmarks.oracle import ProbeRecorder, oracle_freeze_steps
    from layerfreeze.smartfrz.labels import tau_for
    from layerfreeze.train.compare import row_config
    from layerfreeze.train.config import build_config
    from layerfreeze.train.trainer import Trainer

    recorder = ProbeRecorder()
    Trainer(build_config(row_config(base, "none", folder / "oracle")), step_callbacks=[recorder]).run()
    tau = tau_for("finetune" if pretrained else "scratch")
    return dict(zip(recorder.blocks, oracle_freeze_steps(recorder.cka(), recorder.steps, recorder.head, tau=tau)))


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Several results files as one: the rows of every part, and one cell per (task, lr factor, epochs, seed) with
    the rows of every part that ran it (runs are deterministic, so each part's `none` of a cell is the same run;
    a part whose `none` accuracy differs is refused, as it is not the same cell).

    Raises:
        ValueError: two parts hold the same cell and seed with different `none` accuracies, were run with
            different predictors (``--predictor``), or name one ``--variant`` row with different parameters."""
    predictors = {part.get("predictor") for part in parts}
    if len(predictors) > 1:
        raise ValueError(f"the results were run with different predictors ({sorted(map(str, predictors))}): "
                         "merge the results of one predictor at a time")
    variants: dict[str, Any] = {}
    for part in parts:
        for name, params in part.get("variants", {}).items():
            if variants.setdefault(name, params) != params:
                raise ValueError(f"the variant row {name} was run with different parameters ({variants[name]} and "
                                 f"{params}): not the same row; rename one (--variant NAME:...)")
    rows = list(dict.fromkeys(r for part in parts for r in part["rows"]))
    cells: dict[tuple, dict[str, Any]] = {}
    for part in parts:
        for c in part["cells"]:
            key = (c["task"], c["lr_factor"], c["epochs"], c["seed"])
            if key not in cells:
                cells[key] = {**c, "rows": dict(c["rows"])}
                continue
            old = cells[key]
            if old["none_accuracy"] != c["none_accuracy"]:
                raise ValueError(f"{key}: two results hold this cell and seed with different `none` accuracies "
                                 f"({old['none_accuracy']} and {c['none_accuracy']}): not the same runs")
            old["rows"].update(c["rows"])
            if "oracle" in c:
                old.setdefault("oracle", c["oracle"])
    return {"rows": rows, "cells": list(cells.values()), "predictor": predictors.pop(), "variants": variants}


def _group(results: dict[str, Any]) -> dict[tuple, list[dict[str, Any]]]:
    """The cells' seeds grouped by (task, lr factor, epochs), sorted."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for c in results["cells"]:
        cells.setdefault((c["task"], c["lr_factor"], c["epochs"]), []).append(c)
    return dict(sorted(cells.items()))


def markdown(results: dict[str, Any]) -> str:
    """The grid's table: one line per (task, lr factor, epochs), its seeds averaged; per row the mean Δ accuracy
    points vs `none` [the worst seed's], the mean FLOPs and time ratios; ``-`` where no seed of the row finished.
    Then :func:`schedules`."""
    rows = results["rows"]
    head = ["task", "lr", "epochs", "steps", "seeds", "none acc %"]
    for r in rows:
        head += [f"{r} Δ pts mean [worst]", f"{r} FLOPs", f"{r} time"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (task, lr, ep), cs in _group(results).items():
        line = [task, f"x{lr:g}", str(ep), str(cs[0]["steps"]), ",".join(str(c["seed"]) for c in cs),
                f"{100 * statistics.fmean(c['none_accuracy'] for c in cs):.2f}"]
        for r in rows:
            got = [(c["rows"][r], c) for c in cs if r in c["rows"] and c["rows"][r]["accuracy"] is not None]
            if not got:
                line += ["-", "-", "-"]
                continue
            deltas = [100 * (g["accuracy"] - c["none_accuracy"]) for g, c in got]
            line += [f"{statistics.fmean(deltas):+.2f} [{min(deltas):+.2f}]",
                     f"{statistics.fmean(g['flops_ratio'] for g, _ in got):.3f}",
                     f"{statistics.fmean(g['time_ratio'] for g, _ in got):.3f}"]
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines) + "\n\n" + schedules(results)


def schedule_cell(steps: list[dict[str, int | None]]) -> str:
    """``k @ s``: over seeds (each a block -> freeze step map, None = not frozen), the median number of blocks
    frozen at the end and the median of each seed's first freeze step (``-`` when no seed froze anything)."""
    counts = [sum(v is not None for v in s.values()) for s in steps]
    firsts = [min(v for v in s.values() if v is not None) for s in steps if any(v is not None for v in s.values())]
    first = f"{statistics.median(firsts):g}" if firsts else "-"
    return f"{statistics.median(counts):g} @ {first}"


def schedules(results: dict[str, Any]) -> str:
    """Freeze schedules beside the CKA oracle's: per cell and row (and the oracle, where ``--oracle`` recorded it),
    ``k @ s`` from :func:`schedule_cell` (blocks frozen at the end of the run, and the first freeze step; medians
    over seeds). A block a row thawed again does not count (the rows' ``freeze_steps`` hold the blocks frozen at the
    end)."""
    rows = results["rows"]
    has_oracle = any("oracle" in c for c in results["cells"])
    head = ["task", "lr", "epochs", "steps", *(f"{r}: frozen @ first" for r in rows),
            *(["oracle: frozen @ first"] if has_oracle else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (task, lr, ep), cs in _group(results).items():
        line = [task, f"x{lr:g}", str(ep), str(cs[0]["steps"])]
        for r in rows:
            got = [c["rows"][r]["freeze_steps"] for c in cs if r in c["rows"]]
            line.append(schedule_cell(got) if got else "-")
        if has_oracle:
            got = [c["oracle"] for c in cs if "oracle" in c]
            line.append(schedule_cell(got) if got else "-")
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines) + "\n"


def _csv(kind):
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"comma-separated {kind.__name__} values, got {text!r}") from None

    return parse


def variant(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME:KEY=VALUE[,KEY=VALUE]`` -> ``(NAME, {KEY: VALUE})``, each value read as JSON (``null``, ``0.95``)."""
    name, sep, body = text.partition(":")
    if name and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: the row name {name!r} becomes a folder and a --rows "
                                         "entry: letters, digits, '-', '_' and '.', starting with a letter or digit")
    params: dict[str, Any] = {}
    for item in body.split(",") if body else []:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise argparse.ArgumentTypeError(f"--variant {text!r}: parameters are KEY=VALUE, got {item!r}")
        if key in params:
            raise argparse.ArgumentTypeError(f"--variant {text!r}: {key} is given twice")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            raise argparse.ArgumentTypeError(f"--variant {text!r}: {key}'s value {value!r} is not JSON "
                                             f"(a number, true/false, null or a quoted string)") from None
    if not name or not sep or not params:
        raise argparse.ArgumentTypeError(f"--variant takes NAME:KEY=VALUE[,KEY=VALUE], got {text!r}")
    return name, params


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=_csv(str), default=["bbc", "fmnist-mobilenet"],
                   help=f"from {', '.join(suite_tasks.TASKS)}")
    p.add_argument("--lrs", type=_csv(float), default=[0.3, 1.0, 3.0], help="learning-rate factors")
    p.add_argument("--epochs", type=_csv(int), default=[1, 2, 4])
    p.add_argument("--seeds", type=seed_list, default=[0, 1, 2], help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--rows", type=_csv(str), default=DEFAULT_ROWS,
                   help=f"from {', '.join(ROWS)} (default {','.join(DEFAULT_ROWS)}; `none` always runs)")
    p.add_argument("--oracle", action="store_true", help="also the CKA oracle's freeze steps (one more none run)")
    p.add_argument("--out", type=Path, default=suite.ROOT / "runs" / "bench-lr-grid")
    p.add_argument("--resume", action="store_true", help="skip the (cell, seed) results.json already holds")
    p.add_argument("--from-json", type=Path, nargs="+", help="only regenerate the table, from one results.json or "
                   "several merged (written to OUT/results.json and OUT/lr_grid.md)")
    p.add_argument("--threads", type=int, help="torch threads per run (default: torch's)")
    p.add_argument("--quick", action="store_true", help="the suite's QUICK_SIZES (a smoke test, not a measurement)")
    p.add_argument("--predictor", type=Path, help="a predictor file (`layerfreeze predictor train --out`) for the "
                   "smartfrz rows instead of the shipped one: a candidate measured on the grid before it ships")
    p.add_argument("--variant", type=variant, action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="one more `smartfrz` row named NAME with these strategy parameters (values as JSON; "
                   "repeatable), e.g. smartfrz-t95:threshold=0.95; then name it in --rows")
    args = p.parse_args(argv)
    names = [name for name, _ in args.variant]
    for name, params in args.variant:
        if names.count(name) > 1:
            p.error(f"--variant {name} is given twice; give each variant row its own name")
        # a strategy of that name, unless an earlier grid in this process registered it as a smartfrz row
        if name in ROWS or (name in STRATEGIES and not issubclass(STRATEGIES[name], STRATEGIES["smartfrz"])):
            p.error(f"--variant {name}: a row or strategy of that name exists; choose another")
        try:  # a parameter the strategy refuses fails here, before any training
            STRATEGIES["smartfrz"](**params)
        except (TypeError, ValueError) as e:
            p.error(f"--variant {name}: {e}")
        ROWS[name] = ("smartfrz", params)
    console = Console(width=160)
    if args.from_json:
        try:
            results = merge([json.loads(f.read_text()) for f in args.from_json])
        except ValueError as e:
            p.error(str(e))
        if len(args.from_json) > 1:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "results.json").write_text(json.dumps(results, indent=2))
    else:
        unknown = [r for r in args.rows if r not in ROWS]
        if unknown:
            p.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
        bad_tasks = [t for t in args.tasks if t not in suite_tasks.TASKS]
        if bad_tasks:
            p.error(f"unknown tasks {bad_tasks}; choose from {list(suite_tasks.TASKS)}")
        if any(f <= 0 for f in args.lrs) or any(e < 1 for e in args.epochs):
            p.error(f"--lrs are factors > 0 and --epochs integers >= 1, got {args.lrs} and {args.epochs}")
        predictor = None
        if args.predictor is not None:
            predictor = str(args.predictor.resolve())
            try:
                load_predictor(predictor)
            except PredictorError as e:  # before any training: a missing or corrupt file
                p.error(f"--predictor {args.predictor}: {e}")
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "results.json"
        resumed = args.resume and path.exists()
        results = json.loads(path.read_text()) if resumed else {"cells": []}
        if resumed and results.get("predictor") != predictor:
            p.error(f"--resume: {path} was run with predictor {results.get('predictor')}, not {predictor}")
        variants = {name: ROWS[name][1] for name, _ in args.variant}
        ran = results.get("variants", {})
        if resumed and any(ran[k] != v for k, v in variants.items() if k in ran):
            p.error(f"--resume: {path} ran the variants {ran}, not {variants}")
        results["rows"] = args.rows
        results["predictor"] = predictor
        results["variants"] = {**ran, **variants}
        done = {(c["task"], c["lr_factor"], c["epochs"], c["seed"]) for c in results["cells"]}
        for task in args.tasks:
            for lr in args.lrs:
                for ep in args.epochs:
                    for seed in args.seeds:
                        if (task, lr, ep, seed) in done:
                            continue
                        console.rule(f"{task} lr x{lr:g} {ep} epochs seed {seed}")
                        results["cells"].append(run_cell(task, lr, ep, seed, args.rows, args.out, args.oracle,
                                                         console, args.quick, args.threads, predictor))
                        path.write_text(json.dumps(results, indent=2))
    table = markdown(results)
    if not args.from_json or len(args.from_json) > 1:
        (args.out / "lr_grid.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main))
