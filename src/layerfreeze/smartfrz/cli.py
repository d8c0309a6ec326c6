"""``layerfreeze predictor collect | label | train | evaluate | counterfactual | calibrate``: the offline SmartFRZ
pipeline's commands. Their arguments, and examples of each, are in :mod:`layerfreeze.smartfrz.parser`.

Exit codes: 0 success, 2 bad input (no runs, unknown recipe, unlabelled runs, bad predictor file).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from layerfreeze.errors import ConfigError
from layerfreeze.smartfrz.fit import DEFAULT_THRESHOLD, TrainConfig
from layerfreeze.smartfrz.labels import label_rule
from layerfreeze.smartfrz.recipes import DEFAULT_HOLDOUT, RECIPES, get_recipes, import_recipes
from layerfreeze.smartfrz.runs import PipelineError
from layerfreeze.strategies.smartfrz.predictor import PredictorError


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    """Run a ``predictor`` sub-command; returns the exit code."""
    console = console or Console()
    commands = {"collect": _collect, "label": _label, "train": _train, "evaluate": _evaluate,
                "counterfactual": _counterfactual, "calibrate": _calibrate}
    try:
        import_recipes(getattr(args, "imports", []))
        return commands[args.predictor_command](args, console)
    except (PipelineError, PredictorError, ConfigError) as exc:
        console.print(f"[bold red]layerfreeze: error:[/] {escape(str(exc))}", highlight=False)
        return 2


def _collect(args: argparse.Namespace, console: Console) -> int:
    from layerfreeze.smartfrz.collect import collect

    recipes = get_recipes(args.recipes)
    if args.list:
        table = Table(title="SmartFRZ collection recipes")
        for col in ("recipe", "arch", "dataset", "mode", "lrs", "min/run", "held out"):
            table.add_column(col, no_wrap=col == "recipe")
        for r in recipes:
            table.add_row(r.name, r.arch, r.dataset, r.mode, ", ".join(f"{x:g}" for x in r.lrs), f"{r.minutes:g}",
                          "yes" if r.name in DEFAULT_HOLDOUT else "")
        console.print(table)
        for r in recipes:
            console.print(f"  [bold]{r.name}[/]: {r.description}")
        return 0
    from layerfreeze.smartfrz.collect import scaled_lrs

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise PipelineError(f"--out {args.out} is a file: give a folder for the runs (made if missing)")
    plan = {r.name: scaled_lrs(args.lrs or r.lrs, args.lr_factors, r.name) for r in recipes}
    n_runs = sum(len(args.seeds) * len(plan[r.name]) for r in recipes)
    est = sum(len(args.seeds) * len(plan[r.name]) * r.minutes for r in recipes)
    runs = f"{n_runs} run{'s' * (n_runs != 1)}"
    console.print(f"collecting {runs} into {escape(str(args.out))}" + ("" if args.quick else f" (~{est:.0f} min)"))
    from layerfreeze.smartfrz.runs import collapsed

    done = {"complete": 0, "diverged": 0, "skipped": 0, "redo": 0}

    def on_run(name: str, status: str, meta: dict[str, Any] | None) -> None:
        done[status] += 1
        if status == "redo":
            status, extra = f"{meta['why']}:", "recording it again"
        elif status == "skipped":
            extra = "(already recorded" + ("; diverged: excluded)" if meta.get("status") == "diverged" else ")")
        elif status == "complete":
            acc = meta.get("test_accuracy")
            extra = f"{meta['wall_seconds']:.0f}s" + (f", test acc {acc:.3f}" if acc is not None else "")
            if collapsed(meta):
                extra += " (chance level: collapsed, excluded)"
        else:  # diverged
            extra = f"at step {meta.get('diverged_at_step')}: excluded"
        console.print(f"  {name}: {status} {extra}")

    collect(args.out, [r.name for r in recipes], args.seeds, args.lrs, args.quick, on_run=on_run,
            lr_factors=args.lr_factors)
    console.print(f"done: {done['complete']} recorded, {done['skipped']} already there, {done['diverged']} diverged")
    return 0


def _note_unfinished(runs_dir: str, console: Console) -> None:
    """Say which run folders of a stopped collection the command leaves out (label and train used the finished runs
    alone, in silence)."""
    from layerfreeze.smartfrz.runs import unfinished_runs

    left = unfinished_runs(runs_dir)
    if left:
        console.print(f"note: {len(left)} run{'s' * (len(left) != 1)} not finished recording, left out: "
                      f"{escape(', '.join(left))} (the collection stopped: run its `layerfreeze predictor collect` "
                      "command again to finish them)", highlight=False)


def _label(args: argparse.Namespace, console: Console) -> int:
    from layerfreeze.smartfrz.cflabels import label_run_corrected
    from layerfreeze.smartfrz.labels import label_run
    from layerfreeze.smartfrz.runs import list_runs

    runs = list_runs(args.runs_dir)
    if not runs:
        raise PipelineError(f"no complete runs in {args.runs_dir}")
    _note_unfinished(args.runs_dir, console)
    mode = (f"; corrected by counterfactual costs, eps {args.eps_points:g} points" if args.counterfactual else "")
    table = Table(title=f"CKA labels (tau {args.tau}, from scratch {args.tau_scratch}, delta {args.delta}, window "
                        f"{args.window}{mode}): first freezable "
                        "step per block, fraction of training")
    table.add_column("run")
    table.add_column("first freezable (front to back; - never; head omitted)")
    if args.counterfactual:
        table.add_column("corrected", justify="right")
    with_cf = corrected = 0
    for d in runs:
        if args.counterfactual:
            lab = label_run_corrected(d, args.tau, args.delta, args.window, args.tau_scratch, args.eps_points)
        else:
            lab = label_run(d, args.tau, args.delta, args.window, tau_scratch=args.tau_scratch)
        firsts = [("-" if s is None else f"{s / lab['steps']:.2f}") for i, s in enumerate(lab["first_freezable_step"])
                  if i != lab["head"]]
        row = [d.name, " ".join(firsts)]
        if args.counterfactual:
            info = lab["counterfactual"]
            with_cf += info["available"]
            corrected += info["corrected"]
            row.append(str(info["corrected"]) if info["available"] else "no counterfactual")
            if info["available"] and not info["replay_matches_record"]:
                console.print(f"note: {d.name}'s counterfactual replay did not reach the recorded accuracy (another "
                              "machine or thread count?): its costs are of a nearby trajectory", highlight=False)
        table.add_row(*row)
    console.print(table)
    if args.counterfactual:
        console.print(f"counterfactual correction (eps {args.eps_points:g} points): {with_cf} of {len(runs)} runs "
                      f"had a counterfactual.json, {corrected} (block, snapshot) labels turned from freezable to not; "
                      f"{len(runs) - with_cf} runs without one kept their CKA labels", highlight=False)
    return 0


def _reproduce_command(runs: list[Any], runs_dir: str, args: argparse.Namespace) -> str:
    recipes = sorted({r.recipe for r in runs}, key=lambda n: list(RECIPES).index(n) if n in RECIPES else 999)
    from layerfreeze.smartfrz.collect import scaled_lrs

    default_lrs = all(float(r.meta["lr"]) in RECIPES[r.recipe].lrs for r in runs if r.recipe in RECIPES)
    factors = sorted({float(r.meta.get("lr_factor", 1.0)) for r in runs})
    rates = {name: {} for name in recipes}  # recipe -> seed -> its rates
    for r in runs:
        rates[r.recipe].setdefault(int(r.meta["seed"]), set()).add(float(r.meta["lr"]))
    scaled = not default_lrs and all(r.recipe in RECIPES for r in runs) and all(
        set().union(*rates[name].values()) == {lr for lr, _, _ in scaled_lrs(RECIPES[name].lrs, factors, name)}
        and len({frozenset(v) for v in rates[name].values()}) == 1 for name in recipes)

    def lines_of(name: str) -> list[tuple[tuple[int, ...], str]]:
        """``(seeds, rate flag)`` per collect line the recipe needs: one for all its seeds, or one per seed when
        its seeds were collected at different rates (the union on one line would collect runs it does not hold).
        Rates are printed to 12 significant digits, as :func:`~layerfreeze.smartfrz.collect.scaled_lrs` rounds
        them (``:g``'s 6 would name a nearby rate: a run of the same folder name and other weights)."""
        seeds = tuple(sorted(rates[name]))
        every_seed_registered = name in RECIPES and all(v == set(RECIPES[name].lrs) for v in rates[name].values())
        if (default_lrs and every_seed_registered) or scaled:
            flag = f" --lr-factors {','.join(f'{x:g}' for x in factors)}" if scaled else ""
            return [(seeds, flag)]
        flags = {s: f" --lrs {','.join(f'{x:.12g}' for x in sorted(rates[name][s]))}" for s in seeds}
        if len(set(flags.values())) == 1:
            return [(seeds, flags[seeds[0]])]
        return [((s,), flags[s]) for s in seeds]
    quick = any(r.meta.get("quick") for r in runs)
    lab = label_rule(runs[0].labels)
    q = shlex.quote
    if not all(r.recipe in RECIPES for r in runs):
        collect = "# some runs were recorded outside the registered recipes (layerfreeze.smartfrz.collect.record_run)"
    else:  # one collect line per set of seeds and rates (a corpus may hold more seeds or rates of some recipes)
        keys = {name: lines_of(name) for name in recipes}
        order = [k for name in recipes for k in keys[name]]
        collect = "\n".join(
            f"layerfreeze predictor collect --out {q(runs_dir)} "
            f"--recipes {','.join(n for n in recipes if key in keys[n])} --seeds {','.join(map(str, key[0]))}"
            + key[1] + (" --quick" if quick else "")
            for key in sorted(set(order), key=lambda k: (k[0], order.index(k))))
    label = (f"layerfreeze predictor label {q(runs_dir)} --tau {lab['tau']} "
             f"--tau-scratch {lab['tau_scratch']} --delta {lab['delta']} "
             f"--window {lab['window']}")
    if lab.get("counterfactual_eps") is not None:
        label += f" --counterfactual --eps-points {lab['counterfactual_eps']:g}"
        label = "\n".join([*_counterfactual_commands(runs, runs_dir, quick), label])
    train = (f"layerfreeze predictor train {q(runs_dir)} --seed {args.seed} --history {args.history} "
             f"--min-history {args.min_history} --epochs {args.epochs} --threshold {args.threshold} "
             f"--holdout {q(','.join(args.holdout))}" + (" --lofo" if getattr(args, "lofo", False) else "")
             + f" --out {q(str(args.out))}")
    return f"{collect}\n{label}\n{train}"


def _counterfactual_commands(runs: list[Any], runs_dir: str, quick: bool) -> list[str]:
    """The ``predictor counterfactual`` lines that computed the runs' ``counterfactual.json`` (as their corrected
    labels record the grid): one per recipe, seed and grid, naming the learning rates."""
    groups: dict[tuple, list[float]] = {}
    for r in runs:
        info = (r.labels or {}).get("counterfactual") or {}
        if not info.get("available"):
            continue
        key = (r.recipe, int(r.meta["seed"]), tuple(info.get("fractions") or ()), info.get("null_orders"),
               tuple(info.get("depths") or ()))
        groups.setdefault(key, []).append(float(r.meta["lr"]))
    q = shlex.quote
    lines = []
    for (recipe, seed, fractions, null_orders, depths), rates in sorted(groups.items(), key=str):
        lines.append(f"layerfreeze predictor counterfactual {q(runs_dir)} --recipes {recipe} --seeds {seed} "
                     f"--lrs {','.join(f'{x:g}' for x in sorted(rates))}"
                     + (f" --fractions {','.join(f'{f:g}' for f in fractions)}" if fractions else "")
                     + ("" if null_orders is None else f" --null-orders {null_orders}")
                     + (f" --depths {','.join(map(str, depths))}" if depths else "")
                     + (" --quick" if quick else ""))
    return lines


def _metrics_table(title: str, rows: list[tuple[str, dict[str, Any]]], first: str = "recipe",
                   note: str = "") -> Table:
    """A rich table of :func:`~layerfreeze.smartfrz.fit.evaluate` metrics dicts, one ``(name, metrics)`` a row."""
    table = Table(title=title, caption="win: labelled windows; prec/rec/F1: per-window decisions; err: mean "
                  "|freeze step - labelled step| / steps; bias: signed (> 0 later); early: blocks frozen before label"
                  + (f"; {note}" if note else ""))
    for col in (first, "win", "prec", "rec", "F1", "blocks", "err", "bias", "early"):
        if col == first:
            table.add_column(col, overflow="fold")
        else:
            table.add_column(col, justify="right", no_wrap=True, min_width=6 if col in ("bias", "blocks") else 5)

    def row(name: str, m: dict[str, Any]) -> None:
        def f(v: Any) -> str:
            return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
        table.add_row(name, *(f(m.get(k)) for k in ("windows", "precision", "recall", "f1", "blocks",
                                                     "freeze_step_error", "freeze_step_bias", "early_fraction")))

    for name, m in rows:
        row(name, m)
    return table


def _recipe_rows(metrics: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [*metrics.get("per_recipe", {}).items(), ("[bold]all[/]", metrics["overall"])]


def _lofo_table(title: str, lofo: dict[str, Any]) -> Table:
    rows = [(f"{name} ({len(f['eval_runs'])} run{'' if len(f['eval_runs']) == 1 else 's'})", f["metrics"])
            for name, f in lofo["families"].items()]
    return _metrics_table(title, [*rows, ("[bold]pooled[/]", lofo["pooled"])], first="family",
                          note="pooled: " + lofo["pooling"])


def _train(args: argparse.Namespace, console: Console) -> int:
    from layerfreeze.runs.rundir import check_writable
    from layerfreeze.smartfrz.runs import excluded_runs, list_runs, read_run
    from layerfreeze.smartfrz.ship import check_out, train_and_save

    if Path(args.out).is_dir() or str(args.out).endswith(("/", "\\")):
        raise PipelineError(f"--out {args.out} is a folder: give the predictor's file, e.g. "
                            f"{Path(args.out) / 'predictor.safetensors'} (PREDICTOR_CARD.md goes beside it)")
    check_writable(Path(args.out), "--out")  # before anything trains
    check_out(args.out)
    runs = [read_run(d, need_labels=True) for d in list_runs(args.runs_dir)]
    if not runs:
        raise PipelineError(f"no complete runs in {args.runs_dir}")
    _note_unfinished(args.runs_dir, console)
    if args.min_history > args.history:
        raise PipelineError(f"--min-history {args.min_history} is larger than --history {args.history}: a decision "
                            "cannot need more snapshots than the window holds")
    unknown = sorted(set(args.holdout) - {r.recipe for r in runs})
    if unknown:
        raise PipelineError(f"--holdout names recipes with no runs in {args.runs_dir}: {', '.join(unknown)} (its "
                            f"recipes: {', '.join(sorted({r.recipe for r in runs}))}; --holdout '' holds out none)")
    if not any(any(map(bool, row)) for r in runs for row in r.labels["freezable"]):
        raise PipelineError(f"no run in {args.runs_dir} has a freezable label, so the predictor would learn never to "
                            "freeze: relabel with a shorter --window or a lower --tau (`layerfreeze predictor label "
                            f"{args.runs_dir}`)")
    cfg = TrainConfig(seed=args.seed, history=args.history, min_history=args.min_history, epochs=args.epochs)
    command = _reproduce_command(runs, str(args.runs_dir), args)
    path, card = train_and_save(runs, args.out, args.holdout, cfg, args.threshold, command=command, lofo=args.lofo,
                                excluded=excluded_runs(args.runs_dir))
    info = card["training"]
    console.print(f"trained on {len(card['train_runs'])} runs ({', '.join(card['train_recipes'])}): "
                  f"{info['examples']} windows, {info['positives']} freezable; final loss {info['final_train_loss']}")
    if card["heldout_metrics"]:
        console.print(_metrics_table(f"held out: {', '.join(card['heldout_recipes'])}",
                                     _recipe_rows(card["heldout_metrics"])))
    else:
        console.print("[yellow]no held-out runs: the predictor is unevaluated[/]")
    if card["lofo"]:
        console.print(_lofo_table("leave-one-family-out (one predictor per family, trained on the others; not "
                                  "saved)", card["lofo"]))
    console.print(f"predictor: {escape(str(path))}\ncard: {escape(str(Path(path).with_name('PREDICTOR_CARD.md')))}")
    return 0


def _note_labels(runs: list[Any], card: dict[str, Any], console: Console) -> None:
    """Warn (once) when the runs were labelled with other thresholds than the predictor's training runs."""
    trained_labels = card.get("labels")
    if trained_labels:
        want = label_rule(trained_labels)
        for r in runs:
            got = label_rule(r.labels)
            if got != want:
                console.print(f"[yellow]note:[/] {r.name} is labelled with {got}; the predictor was trained on "
                              f"labels {want}")
                break


def _evaluate(args: argparse.Namespace, console: Console) -> int:
    from layerfreeze.smartfrz.fit import evaluate
    from layerfreeze.smartfrz.runs import list_runs, read_meta, read_run
    from layerfreeze.strategies.smartfrz.predictor import load_predictor

    runs_dirs = list_runs(args.runs_dir)  # a bad folder is reported before the predictor is loaded
    if not runs_dirs:
        raise PipelineError(f"no complete runs in {args.runs_dir} (a folder made by `layerfreeze predictor collect "
                            "--out DIR`, then labelled with `layerfreeze predictor label DIR`)")
    metas = {d: read_meta(d) for d in runs_dirs}
    if args.recipes:
        present = {m["recipe"] for m in metas.values()}
        missing = sorted(set(args.recipes) - present)
        if missing:
            raise PipelineError(f"--recipes names recipes with no runs in {args.runs_dir}: {', '.join(missing)} "
                                f"(its recipes: {', '.join(sorted(present))})")
    model, meta = load_predictor(args.predictor)
    card = meta.get("card") or {}
    threshold = args.threshold if args.threshold is not None else card.get("threshold", DEFAULT_THRESHOLD)
    if args.lofo:
        return _evaluate_lofo(args, console, [read_run(d, need_labels=True) for d in runs_dirs], meta, threshold)
    # a run is one the predictor saw when its name and length match the card's (a --quick run shares its name with
    # the full-size one, and is another run)
    trained_runs = {r["run"]: r.get("steps") for r in card.get("train_runs", [])}
    trained_recipes = set(card.get("train_recipes", []))
    runs = [read_run(d, need_labels=True) for d in runs_dirs
            if d.name not in trained_runs or trained_runs[d.name] not in (None, metas[d].get("steps"))]
    if args.recipes:
        seen = sorted(set(args.recipes) & trained_recipes)
        if seen:
            console.print(f"[yellow]note:[/] the predictor was trained on other runs of {', '.join(seen)}")
        runs = [r for r in runs if r.recipe in set(args.recipes)]
    else:
        runs = [r for r in runs if r.recipe not in trained_recipes]
    if not runs:
        unseen, q = [n for n in RECIPES if n not in trained_recipes] or ["NAME"], shlex.quote(str(args.runs_dir))
        raise PipelineError(
            f"no labelled runs{' of ' + ','.join(args.recipes) if args.recipes else ''} in {args.runs_dir} that the "
            f"predictor was not trained on: collect and label runs of a recipe it was not trained on "
            f"({', '.join(unseen)}: `layerfreeze predictor collect --out {q} --recipes {unseen[0]}`, then `layerfreeze "
            f"predictor label {q}`), or pick recipes with --recipes (their runs it did not train on count, e.g. other "
            "seeds), or evaluate leave-one-family-out with --lofo")
    _note_labels(runs, card, console)
    metrics = evaluate(model, runs, meta["window"], threshold, meta["min_window"])
    console.print(_metrics_table(f"{args.predictor or 'shipped predictor'} on {len(runs)} unseen runs "
                                 f"(threshold {threshold})", _recipe_rows(metrics)))
    return 0


def _evaluate_lofo(args: argparse.Namespace, console: Console, runs: list[Any], meta: dict[str, Any],
                   threshold: float) -> int:
    """``evaluate --lofo``: leave-one-family-out with the predictor file's training settings (its weights unused).

    The settings are the card's ``training.config`` (a file without one: the defaults, with the file's window and
    minimum window); every labelled run in RUNS_DIR takes part, or those of ``--recipes``.
    """
    from dataclasses import fields

    from layerfreeze.smartfrz.lofo import leave_one_family_out

    card = meta.get("card") or {}
    known = {f.name for f in fields(TrainConfig)}
    saved = {k: v for k, v in (card.get("training") or {}).get("config", {}).items() if k in known}
    cfg = TrainConfig(**{"history": meta["window"], "min_history": meta["min_window"], **saved})
    if args.recipes:
        unknown = sorted(set(args.recipes) - {r.recipe for r in runs})
        if unknown:
            raise PipelineError(f"--recipes names recipes with no runs in {args.runs_dir}: {', '.join(unknown)}")
        runs = [r for r in runs if r.recipe in set(args.recipes)]
    if not runs:
        raise PipelineError(f"no labelled runs in {args.runs_dir}")
    _note_labels(runs, card, console)
    lofo = leave_one_family_out(runs, cfg, threshold)
    console.print(_lofo_table(f"leave-one-family-out on {len(runs)} runs: per family, a predictor trained on the "
                              f"others with {args.predictor or 'the shipped predictor'}'s settings (seed {cfg.seed}, "
                              f"{cfg.epochs} epochs, window {cfg.min_history}-{cfg.history}; threshold {threshold})",
                              lofo))
    return 0


def _counterfactual(args: argparse.Namespace, console: Console) -> int:
    from layerfreeze.smartfrz.counterfactual import counterfactual_for

    results = counterfactual_for(args.runs_dir, args.recipes, args.seeds, quick=args.quick, fractions=args.fractions,
                                 lrs=args.lrs, depths=args.depths, null_orders=args.null_orders,
                                 progress=lambda line: console.print(f"  {line}", highlight=False),
                                 lr_factors=args.lr_factors)
    table = Table(title="Counterfactual cost of freezing blocks 0..d-1 at step t (accuracy points lost at the end; "
                        "null: unfrozen continuations on other data orders)")
    depths = sorted({c["depth"] for cf in results for c in cf["grid"]})
    for col in ("run", "baseline acc", "replay = record", "t (fraction)", "null", *[f"d={d}" for d in depths]):
        table.add_column(col)
    for cf in results:
        nulls: dict[int, list[float]] = {}
        for row in cf["null"]:
            nulls.setdefault(row["t"], []).append(row["cost_points"])
        cells: dict[tuple[int, int], float] = {(c["t"], c["depth"]): c["cost_points"] for c in cf["grid"]}
        for t in sorted({c["t"] for c in cf["grid"]}):
            table.add_row(cf["run"], f"{cf['baseline']['accuracy']:.4f}",
                          "yes" if cf["baseline"]["matches_record"] else "NO", f"{t} ({t / cf['steps']:.2f})",
                          " ".join(f"{v:+.2f}" for v in nulls.get(t, [])),
                          *[("" if (t, d) not in cells else f"{cells[(t, d)]:+.2f}") for d in depths])
    console.print(table)
    return 0


def _calibrate(args: argparse.Namespace, console: Console) -> int:
    from layerfreeze.smartfrz.counterfactual import calibrate, read_counterfactuals

    cfs = read_counterfactuals(args.runs_dir)
    rows = calibrate(args.runs_dir, args.taus, args.windows, args.deltas, args.eps, counterfactuals=cfs)
    for cf in cfs:
        if not cf.get("null"):
            console.print(f"note: {cf['run']} has no unfrozen continuations on other data orders (--null-orders 0): "
                          "its cells are judged against the run itself only", highlight=False)
    table = Table(title=f"CKA labelling rules against counterfactual costs (a freeze is free when it loses at most "
                        f"{args.eps:g} points beyond the unfrozen continuations)")
    for col in ("tau", "window", "delta", "cells", "precision", "recall", "F1", "mean cost", "max cost",
                "cells frozen", "first-freeze cost", "run share frozen"):
        table.add_column(col, justify="right")

    def f(v: float, fmt: str = ".3f") -> str:
        return "-" if v != v else format(v, fmt)

    for r in rows:
        table.add_row(f"{r['tau']:g}", str(r["window"]), f"{r['delta']:g}", str(r["cells"]), f(r["precision"]),
                      f(r["recall"]), f(r["f1"]), f(r["mean_cost"], "+.2f"), f(r["max_cost"], "+.2f"),
                      f(r["frozen_share"]), f(r["oracle_cost"], "+.2f"), f(r["oracle_frozen"]))
    console.print(table)
    return 0
