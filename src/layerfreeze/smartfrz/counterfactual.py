"""Counterfactual labels: what freezing a prefix at step ``t`` costs in final accuracy, measured by training it.

The CKA label (:mod:`.labels`) says a block's representation is close to its final one; what a user cares about is
whether freezing it *then* costs anything at the end. For a collected run (a recipe, seed and learning rate, which
the collector trains deterministically) this module replays the run and, at each grid step ``t`` (one of the run's
activation snapshots, so the CKA label exists there), keeps the whole training state (weights, optimizer, LR
schedule, global RNG); from it, for each prefix depth ``d`` (blocks ``0 .. d-1`` frozen), it trains on to the end
with those blocks frozen the way the engine freezes them (``requires_grad`` off, eval mode, their optimizer state
dropped: :func:`~layerfreeze.engine.frozen_parameters`, :func:`~layerfreeze.engine.set_eval_mode`,
:func:`~layerfreeze.engine.optim.remove_from_optimizer`), on the same batches, and evaluates on the recipe's test
subset. The *cost* of freezing ``d`` at ``t`` is the unfrozen run's final test accuracy minus the continuation's, in
points (and the same for the test loss). These are the "counterfactual continuations" of issue 16; the oracle of the
benchmark protocol (OVERVIEW: freeze each block when its CKA to the final model converges) is checked against them
by :func:`calibrate`.

One continuation freezes one prefix at one step; the oracle's schedule freezes a longer prefix at each of its
steps, with the shorter one already frozen since earlier. A continuation is therefore a lower bound on the cost of
the same freeze inside a schedule whose earlier freezes also cost something; the labels are per decision, as the
predictor's are.

File ``<run_dir>/counterfactual.json`` (written atomically): ``format`` "layerfreeze-smartfrz-counterfactual",
``version`` (:data:`COUNTERFACTUAL_VERSION`), ``run``, ``recipe``, ``seed``, ``lr``, ``steps``, ``blocks``,
``head``, ``baseline`` (``accuracy``, ``loss`` of the replayed unfrozen run; ``matches_record``: its accuracy
equals the run's recorded ``test_accuracy``, i.e. the replay followed the recorded trajectory), ``test_size``,
``grid``: one row per continuation ``{"t", "depth", "accuracy", "loss", "cost_points", "cost_loss", "seconds"}``
(``seconds``: wall-clock seconds of the continuation); ``null``: the same rows for the unfrozen continuations on
other data orders (``depth`` 0, with their ``order_seed``), the noise floor.

While a grid runs, every finished continuation is also kept in ``<run_dir>/counterfactual.partial.json`` (written
atomically after each one; removed when ``counterfactual.json`` is written), so a killed job loses one continuation,
not the run's grid: the next call replays the run and, when the replay ends on the same baseline (bit for bit) and
the grid is the same, trains only the continuations the partial file lacks. A partial file of another grid or
another replay, or one that cannot be read, is reported and not used.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from layerfreeze.engine.mechanics import frozen_parameters, set_eval_mode
from layerfreeze.engine.optim import remove_from_optimizer
from layerfreeze.models.discovery import discover_blocks
from layerfreeze.smartfrz.collect import batch_order, evaluate_test, run_name, scaled_lrs
from layerfreeze.smartfrz.labels import freezable_from_cka, label_run
from layerfreeze.smartfrz.recipes import get_recipes
from layerfreeze.smartfrz.runs import COUNTERFACTUAL_FILE, PipelineError, read_json, read_meta, write_json_atomic
from layerfreeze.smartfrz.setup import Setup, make_optimizer
from layerfreeze.train.loop import lr_lambda, train_steps, warmup_steps

COUNTERFACTUAL_FORMAT = "layerfreeze-smartfrz-counterfactual"
#: 2: every continuation starts from a copy of the kept optimizer state. Version 1 files (no ``version``) were
#: computed with the state aliased: each continuation after the first at a grid step started from the AdamW moments
#: and step count the previous one ended with, so their costs (all but the first depth at each step) are wrong.
COUNTERFACTUAL_VERSION = 2
PARTIAL_FILE = "counterfactual.partial.json"
RECOMPUTE_HINT = "delete it and recompute it with `layerfreeze predictor counterfactual`"
PARTIAL_FORMAT = "layerfreeze-smartfrz-counterfactual-partial"
#: Grid steps as fractions of the run; each is moved to the run's first activation snapshot at or after it.
DEFAULT_FRACTIONS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75)
#: Most prefix depths per run: all non-head depths up to this many, else this many spread evenly (always the
#: shallowest and the deepest).
MAX_DEPTHS = 8
#: A freeze "costs nothing" when it loses at most this many points of final test accuracy. The issue's target for
#: the oracle schedule is 0.2 points on the suite tasks; on the collector's test subsets (500-1,000 samples) one
#: sample is 0.1-0.2 points, so the margin is one or two samples.
DEFAULT_EPS_POINTS = 0.2
#: Unfrozen continuations on other data orders per grid step (:func:`run_counterfactuals`).
DEFAULT_NULL_ORDERS = 2
_NULL_SEED_BASE = 90_000


def act_steps_of(setup: Setup) -> list[int]:
    """The steps of a run's activation snapshots (as :func:`~layerfreeze.smartfrz.collect.record_run` takes
    them: every ``act_every``-th weight snapshot from step 0, and the final step)."""
    every, steps = int(setup.snapshot_every), int(setup.steps)
    n_snap = steps // every + 1
    return [k * every for k in range(n_snap) if k % setup.act_every == 0 or k == n_snap - 1]


def check_fractions(fractions: Sequence[float]) -> None:
    """Raises PipelineError (a ValueError) unless there is a grid fraction and every one is in (0, 1)."""
    if not fractions:
        raise PipelineError("no grid fractions (--fractions): give at least one, each in (0, 1)")
    bad = [f for f in fractions if not 0 < f < 1]
    if bad:
        raise PipelineError(f"grid fractions (--fractions) must each be in (0, 1), got {bad}")


def grid_steps(setup: Setup, fractions: Sequence[float]) -> list[int]:
    """Each fraction of the run moved to the first activation snapshot at or after it (0 < step < end; duplicates
    dropped).

    Raises:
        PipelineError: a fraction outside (0, 1) (:func:`check_fractions`).
    """
    check_fractions(fractions)
    acts = act_steps_of(setup)
    out: list[int] = []
    for f in sorted(fractions):
        t = next((s for s in acts if s >= f * setup.steps), None)
        if t is not None and 0 < t < setup.steps and t not in out:
            out.append(t)
    return out


def grid_depths(n_blocks: int, head: int | None, max_depths: int = MAX_DEPTHS) -> list[int]:
    """Prefix depths to try: ``1 .. n_trainable`` (a prefix never includes the head), at most ``max_depths`` of them
    spread evenly."""
    deepest = n_blocks - 1 if head == n_blocks - 1 else n_blocks
    depths = list(range(1, deepest + 1))
    if len(depths) <= max_depths:
        return depths
    picks = {round(1 + i * (deepest - 1) / (max_depths - 1)) for i in range(max_depths)}
    return sorted(picks)


def _freeze_prefix(model: torch.nn.Module, blocks: list, depth: int, optimizer: torch.optim.Optimizer) -> None:
    """Freeze blocks ``0 .. depth-1`` as :class:`~layerfreeze.engine.Freezer` does (no BatchNorm exception): the
    optimizer must lose their state, or AdamW/SGD would keep applying momentum and weight decay to them."""
    params = [p for b in blocks[:depth] for p in frozen_parameters(b)]
    for p in params:
        p.requires_grad_(False)
        p.grad = None
    remove_from_optimizer(optimizer, params)
    for b in blocks[:depth]:
        for _, module in b.modules:
            set_eval_mode(module)


def check_counterfactual(cf: dict[str, Any], path: Path) -> dict[str, Any]:
    """``cf`` (the content of ``path``) when it is an intact counterfactual file of the current version.

    Raises:
        PipelineError: not a counterfactual file; one of version 1 (its costs are wrong: see
            :data:`COUNTERFACTUAL_VERSION`); or damaged (a row without its numbers, no baseline accuracy, no step
            count).
    """
    if cf.get("format") != COUNTERFACTUAL_FORMAT:
        raise PipelineError(f"{path}: not a {COUNTERFACTUAL_FORMAT} file")
    if cf.get("version") != COUNTERFACTUAL_VERSION:
        raise PipelineError(f"{path} was computed before version {COUNTERFACTUAL_VERSION} (a continuation started "
                            f"from the optimizer state the previous one had moved, so its costs are wrong): "
                            f"{RECOMPUTE_HINT}")
    bad = _bad_rows(cf.get("grid"), "grid") or _bad_rows(cf.get("null"), "null")
    base = cf.get("baseline")
    if bad is None and not (isinstance(base, dict) and _is_number(base.get("accuracy"))):
        bad = "its baseline has no accuracy"
    if bad is None and not isinstance(cf.get("steps"), int):
        bad = "it has no step count"
    if bad is not None:
        raise PipelineError(f"{path} is damaged ({bad}): {RECOMPUTE_HINT}")
    return cf


def load_counterfactual(path: Path) -> dict[str, Any]:
    """The content of a ``counterfactual.json``, checked (:func:`check_counterfactual`).

    Raises:
        PipelineError: it cannot be read or parsed, or fails :func:`check_counterfactual`.
    """
    return check_counterfactual(read_json(path, RECOMPUTE_HINT), path)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _bad_rows(rows: Any, what: str) -> str | None:
    """Why ``rows`` is not a list of continuation rows (``t``, ``depth`` integers; ``accuracy``, ``loss``,
    ``cost_points`` numbers), or None."""
    if not isinstance(rows, list):
        return f"no {what} rows"
    for r in rows:
        if not (isinstance(r, dict) and all(isinstance(r.get(k), int) for k in ("t", "depth"))
                and all(_is_number(r.get(k)) for k in ("accuracy", "loss", "cost_points"))):
            return f"a {what} row without t, depth, accuracy, loss or cost_points: {str(r)[:80]}"
    return None


def _read_partial(path: Path, spec: dict[str, Any],
                  progress: Callable[[str], None] | None) -> dict[str, Any] | None:
    """The partial file's content when it holds rows of the same grid (``spec``), else None (reported)."""
    if not path.is_file():
        return None
    try:
        old = read_json(path, "")
        ok = (old.get("format") == PARTIAL_FORMAT and _bad_rows(old.get("rows"), "") is None
              and isinstance(old.get("baseline"), dict))
    except PipelineError:
        ok = False
    if not ok:
        why = "cannot be read (corrupt, damaged rows, or not a partial counterfactual file)"
    elif old.get("spec") != spec:
        why = "is of another grid or learning rate"
    else:
        return old
    if progress is not None:
        progress(f"{path}: {why}: not used, the grid starts over")
    return None


def run_counterfactuals(setup_fn: Callable[[], Setup], run_dir: str | Path, *, lr: float, seed: int,
                        fractions: Sequence[float] = DEFAULT_FRACTIONS, depths: Sequence[int] | None = None,
                        null_orders: int = DEFAULT_NULL_ORDERS,
                        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Replay a recorded run and train every (grid step, prefix depth) continuation; write ``counterfactual.json``.

    Args:
        setup_fn: Builds the run's :class:`~layerfreeze.smartfrz.setup.Setup` afresh (the recipe's build with the
            run's seed: it seeds the model's initialisation and the global RNG, as when the run was recorded).
        run_dir: The recorded run's folder (its ``meta.json`` names the run; the result is written there).
        lr / seed: The run's learning rate and data-order seed.
        fractions: Grid steps as fractions of the run (:func:`grid_steps`).
        depths: Prefix depths (default :func:`grid_depths`).
        null_orders: At each grid step, this many continuations with nothing frozen on other data orders (the rest
            of the run reshuffled from another seed): how much the final accuracy moves when the trajectory is
            perturbed without freezing anything, the noise a freeze's cost is judged against.
        progress: Called with a line after each continuation.

    Returns:
        The written content (format in the module docstring).

    Raises:
        PipelineError: the run folder has no complete run, the setup does not match it, a depth would freeze the
            head, the setup has no test subset, or the replay diverges.
    """
    run_dir = Path(run_dir)
    meta = read_meta(run_dir)
    if meta is None or meta.get("status") != "complete":
        raise PipelineError(f"{run_dir}: not a complete recorded run (collect it first)")
    setup = setup_fn()
    model = setup.model
    blocks = discover_blocks(model, setup.blocks)
    head = next((b.index for b in blocks if b.is_head), None)
    if [b.name for b in blocks] != meta["blocks"] or int(setup.steps) != int(meta["steps"]):
        hint = ""
        if meta.get("quick") is not None:
            hint = (" (the run was collected with --quick: add --quick)" if meta["quick"]
                    else " (the run was collected at full size: drop --quick)")
        raise PipelineError(f"{run_dir}: the recipe's setup does not match the recorded run (blocks or steps "
                            f"differ){hint}")
    steps = int(setup.steps)
    ts = grid_steps(setup, fractions)
    if not ts:  # an empty grid was written over the run's counterfactual.json, and the table came out empty (exit 0)
        inner = [s for s in act_steps_of(setup) if 0 < s < steps]
        fix = (f"give fractions up to {inner[-1] / steps:.3g} (its last activation snapshot before the end, step "
               f"{inner[-1]})" if inner else "this run has no activation snapshot between its start and its end")
        raise PipelineError(f"{run_dir}: no grid step: --fractions {','.join(f'{f:g}' for f in fractions)} of "
                            f"{steps} steps all move to the run's end; {fix}")
    ds = list(depths) if depths is not None else grid_depths(len(blocks), head)
    deepest = grid_depths(len(blocks), head, max_depths=len(blocks))[-1]
    bad = [d for d in ds if not 0 <= d <= deepest]
    if bad:
        raise PipelineError(f"{run_dir}: prefix depths {bad} out of range: this run has {len(blocks)} blocks, so a "
                            f"prefix that leaves the head training has 0..{deepest} blocks")
    n_train = len(setup.train_y)
    spec = {"run": meta["run"], "lr": lr, "seed": seed, "steps": steps, "ts": ts, "depths": ds,
            "null_orders": null_orders}
    partial_path = run_dir / PARTIAL_FILE
    partial = _read_partial(partial_path, spec, progress)

    def loss_of(idx: torch.Tensor) -> torch.Tensor:
        return setup.loss_fn(setup.forward(model, {k: v[idx] for k, v in setup.train_x.items()}), setup.train_y[idx])

    def fresh(opt_state: dict | None = None, sched_state: dict | None = None):
        opt = make_optimizer(setup, model, lr)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(steps, warmup_steps(steps, setup.warmup, rounding="round"), setup.schedule))
        if opt_state is not None:
            # a copy: Optimizer.load_state_dict keeps the given tensors when dtype and device already match
            # (``Tensor.to`` returns self), so AdamW's moments and step count would be updated in place and every
            # later continuation from this grid step would start from where the previous one ended
            opt.load_state_dict(copy.deepcopy(opt_state))
            sched.load_state_dict(copy.deepcopy(sched_state))
        return opt, sched

    # 1. the replay: the unfrozen run, keeping the state at each grid step
    states: dict[int, dict[str, Any]] = {}
    opt, sched = fresh()

    def keep(step: int, loss: torch.Tensor) -> bool:
        if step in ts:
            states[step] = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                            "sched": copy.deepcopy(sched.state_dict()), "rng": torch.get_rng_state()}
        return False

    model.train()
    if train_steps(model, opt, batch_order(n_train, setup.batch_size, steps, seed), loss_of, scheduler=sched,
                   grad_clip=setup.grad_clip, on_step=keep) is not None:
        raise PipelineError(f"{run_dir}: the replay diverged (the recorded run did not)")
    baseline = evaluate_test(setup, model)
    if baseline is None:
        raise PipelineError(f"{run_dir}: the recipe has no test subset to measure a cost on")
    base_acc, base_loss = baseline
    recorded = meta.get("test_accuracy")
    done: dict[tuple[int, int, int | None], dict[str, Any]] = {}
    if partial is not None:
        if partial.get("baseline") == {"accuracy": base_acc, "loss": base_loss}:
            done = {(r["t"], r["depth"], r.get("order_seed")): r for r in partial["rows"]}
            if progress is not None:
                progress(f"{meta['run']}: {len(done)} continuations kept from {partial_path.name}")
        elif progress is not None:
            progress(f"{partial_path}: its rows continue another replay (baseline {partial.get('baseline')}, this "
                     f"replay's {base_acc}, {base_loss}): not used, the grid starts over")

    def save_partial() -> None:
        write_json_atomic(partial_path, {"format": PARTIAL_FORMAT, "spec": spec,
                                         "baseline": {"accuracy": base_acc, "loss": base_loss},
                                         "rows": list(done.values())})

    # 2. the continuations: every depth on the run's own batches, and depth 0 (nothing frozen) on other orders
    def continue_from(t: int, depth: int, order_seed: int | None) -> dict[str, Any]:
        if (t, depth, order_seed) in done:
            return done[(t, depth, order_seed)]
        t0 = time.perf_counter()
        for p in model.parameters():
            p.requires_grad_(True)
        model.load_state_dict(states[t]["model"])
        model.train()
        opt, sched = fresh(states[t]["opt"], states[t]["sched"])
        _freeze_prefix(model, blocks, depth, opt)
        torch.set_rng_state(states[t]["rng"])
        if order_seed is None:
            rest = itertools.islice(batch_order(n_train, setup.batch_size, steps, seed), t, None)
        else:
            rest = batch_order(n_train, setup.batch_size, steps - t, order_seed)
        stopped = train_steps(model, opt, rest, loss_of, scheduler=sched, grad_clip=setup.grad_clip)
        acc, loss = evaluate_test(setup, model) if stopped is None else (float("nan"), float("nan"))
        row = {"t": t, "depth": depth, "accuracy": acc, "loss": loss,
               "cost_points": round(100 * (base_acc - acc), 4), "cost_loss": loss - base_loss,
               "seconds": round(time.perf_counter() - t0, 2)}
        if order_seed is not None:
            row["order_seed"] = order_seed
        done[(t, depth, order_seed)] = row
        save_partial()
        if progress is not None:
            what = f"depth={depth}" if order_seed is None else f"nothing frozen, data order {order_seed}"
            progress(f"{meta['run']}: t={t}/{steps} {what}: acc {acc:.4f} (cost {row['cost_points']:+.2f} points), "
                     f"loss {loss:.4f}, {row['seconds']:.1f}s")
        return row

    grid = [continue_from(t, d, None) for t in ts for d in ds]
    null = [continue_from(t, 0, _NULL_SEED_BASE + seed * 100 + j) for t in ts for j in range(null_orders)]
    for p in model.parameters():
        p.requires_grad_(True)
    out = {"format": COUNTERFACTUAL_FORMAT, "version": COUNTERFACTUAL_VERSION, "run": meta["run"],
           "recipe": meta.get("recipe"), "seed": seed,
           "lr": lr, "steps": steps, "blocks": meta["blocks"], "head": head, "test_size": len(setup.test_y),
           "baseline": {"accuracy": base_acc, "loss": base_loss,
                        "matches_record": recorded is not None and abs(recorded - base_acc) < 1e-12},
           "fractions": list(fractions), "null_orders": null_orders, "grid": grid, "null": null}
    write_json_atomic(run_dir / COUNTERFACTUAL_FILE, out)
    partial_path.unlink(missing_ok=True)
    return out


def counterfactual_for(runs_dir: str | Path, recipe_names: Sequence[str], seeds: Sequence[int], *, quick: bool = False,
                       fractions: Sequence[float] = DEFAULT_FRACTIONS, lrs: Sequence[float] | None = None,
                       depths: Sequence[int] | None = None, null_orders: int = DEFAULT_NULL_ORDERS,
                       progress: Callable[[str], None] | None = None,
                       lr_factors: Sequence[float] | None = None) -> list[dict[str, Any]]:
    """:func:`run_counterfactuals` for every collected (recipe, seed, learning rate) run in ``runs_dir``; runs that
    already have a ``counterfactual.json`` with the same grid (fractions, depths, null orders) are skipped (so an
    interrupted job resumes).

    The runs are named as :func:`~layerfreeze.smartfrz.collect.collect` named them: each rate (``lrs`` or the
    recipe's) times each of ``lr_factors`` (:func:`~layerfreeze.smartfrz.collect.scaled_lrs`); a run is replayed at
    the learning rate its ``meta.json`` records (bit for bit the rate it was trained at).

    Raises:
        PipelineError: a fraction outside (0, 1) or a bad factor, the runs folder is missing, or a named run was not
            collected.
    """

    check_fractions(fractions)  # before a run is replayed
    plan = {r.name: scaled_lrs(lrs or r.lrs, lr_factors, r.name) for r in get_recipes(list(recipe_names))}
    if not Path(runs_dir).is_dir():
        raise PipelineError(f"{runs_dir} does not exist: collect the runs first (`layerfreeze predictor collect --out "
                            f"{runs_dir} --recipes {','.join(recipe_names)}`)")
    out = []
    for recipe in get_recipes(list(recipe_names)):
        for seed in seeds:
            for lr, _, _ in plan[recipe.name]:
                run_dir = Path(runs_dir) / run_name(recipe.name, seed, lr)
                recorded = read_meta(run_dir)
                if recorded is not None and recorded.get("lr") is not None:
                    lr = float(recorded["lr"])
                done = run_dir / COUNTERFACTUAL_FILE
                if done.is_file():
                    try:
                        old = load_counterfactual(done)
                    except PipelineError as exc:  # damaged or of an old version: recomputed, not used
                        old = {"damaged": str(exc)}
                    wanted = sorted(depths) if depths is not None else (
                        grid_depths(len(recorded["blocks"]), recorded.get("head")) if recorded else None)
                    same = (old.get("version") == COUNTERFACTUAL_VERSION and old.get("fractions") == list(fractions)
                            and old.get("null_orders") == null_orders
                            and sorted({c["depth"] for c in old["grid"]}) == wanted)
                    if same:
                        out.append(old)
                        continue
                    if progress is not None:
                        why = (f"has another grid (fractions {old.get('fractions')}, null orders "
                               f"{old.get('null_orders')}, depths {sorted({c['depth'] for c in old['grid']})})"
                               if old.get("version") == COUNTERFACTUAL_VERSION else
                               f"cannot be used ({old['damaged']})")
                        progress(f"{run_dir.name}: its {COUNTERFACTUAL_FILE} {why}: recomputing it, the new grid "
                                 "replaces it")
                out.append(run_counterfactuals(lambda r=recipe, s=seed: r.build(s, quick, Path(runs_dir)), run_dir,
                                               lr=lr, seed=seed, fractions=fractions, depths=depths,
                                               null_orders=null_orders, progress=progress))
    return out


def read_counterfactuals(runs_dir: str | Path) -> list[dict[str, Any]]:
    """Every ``counterfactual.json`` under ``runs_dir`` (one level down), sorted by run name.

    Raises:
        PipelineError: a file that is not a counterfactual file of the current version.
    """
    out = []
    for path in sorted(Path(runs_dir).glob(f"*/{COUNTERFACTUAL_FILE}")):
        out.append(load_counterfactual(path))
    return out


def counterfactual_labels(cf: dict[str, Any], eps_points: float = DEFAULT_EPS_POINTS) -> dict[tuple[int, int], bool]:
    """``{(t, depth): freezing costs nothing}`` for one run's counterfactuals.

    Freezing ``depth`` at ``t`` costs nothing when its continuation's final test accuracy is at least the lowest
    an unfrozen run reached from the same state (the run itself, and its ``null`` continuations on other data
    orders from ``t``) minus ``eps_points`` points: no worse than training on unfrozen with another data order
    would have done, within the margin.
    """
    floor_at: dict[int, float] = {}
    for row in cf.get("null", []):
        floor_at[row["t"]] = min(floor_at.get(row["t"], 1.0), row["accuracy"])
    base = cf["baseline"]["accuracy"]
    return {(c["t"], c["depth"]): c["accuracy"] >= min(base, floor_at.get(c["t"], base)) - eps_points / 100 - 1e-12
            for c in cf["grid"]}


def calibrate(runs_dir: str | Path, taus: Sequence[float], windows: Sequence[int], deltas: Sequence[float],
              eps_points: float = DEFAULT_EPS_POINTS,
              counterfactuals: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Score CKA labelling rules against the counterfactual labels of every run with a ``counterfactual.json``.

    A grid cell (run, ``t``, ``d``) is *counterfactually freezable* by :func:`counterfactual_labels` (no worse
    than the unfrozen continuations, within ``eps_points``); the CKA rule ``(tau, window, delta)`` calls it
    freezable when block ``d - 1`` is freezable at the activation snapshot of step ``t``
    (:func:`~layerfreeze.smartfrz.labels.freezable_from_cka`: that includes every earlier block).

    Args:
        counterfactuals: The runs' counterfactuals when the caller has read them already
            (:func:`read_counterfactuals` of ``runs_dir``); default: read here.

    Returns:
        One row per rule, sorted by ``tau, window, delta``: ``tau``, ``window``, ``delta``, ``cells``,
        ``precision`` (of the rule's "freezable" calls, the share that cost at most ``eps_points``), ``recall``,
        ``f1``, ``mean_cost`` / ``max_cost`` (points lost by the continuations the rule calls freezable: what
        following the rule at the grid's steps costs), ``frozen_share`` (share of the grid's cells the rule
        freezes: what it saves, 0..1), ``oracle_cost`` (per run and depth, the cost at the rule's first freezable
        grid step, averaged over those that freeze at all) and ``oracle_frozen`` (mean over runs and depths of the
        share of the run the depth is frozen for, from its first freezable grid step; 0 when never).

    Raises:
        PipelineError: a rule value out of range (checked first), or no run under ``runs_dir`` has counterfactuals.
    """
    bad = ([f"--taus {t:g} (need 0 < tau <= 1)" for t in taus if not 0 < t <= 1]
           + [f"--windows {w} (need >= 1)" for w in windows if w < 1]
           + [f"--deltas {d:g} (need >= 0)" for d in deltas if not d >= 0])  # not <: NaN scored every rule 0
    if bad:
        raise PipelineError("bad labelling rule values: " + ", ".join(bad))
    cfs = read_counterfactuals(runs_dir) if counterfactuals is None else counterfactuals
    if not cfs:
        raise PipelineError(f"{runs_dir}: no {COUNTERFACTUAL_FILE} (run `layerfreeze predictor counterfactual` first)")
    tables = []
    for cf in cfs:
        lab = label_run(Path(runs_dir) / cf["run"], write=False)
        col = {s: i for i, s in enumerate(lab["act_steps"])}
        tables.append((cf, lab["cka"], col, counterfactual_labels(cf, eps_points)))
    return [_score_rule(tables, tau, window, delta) for tau in taus for window in windows for delta in deltas]


def _score_rule(tables: list[tuple[dict[str, Any], list[list[float]], dict[int, int], dict[tuple[int, int], bool]]],
                tau: float, window: int, delta: float) -> dict[str, Any]:
    """One row of :func:`calibrate`: the rule ``(tau, window, delta)`` over every run's ``(counterfactuals, CKA
    table, column of each activation step, counterfactual labels)``."""
    tp = fp = fn = n = 0
    costs: list[float] = []
    first_costs: list[float] = []
    frozen_for: list[float] = []
    for cf, cka, col, cheap_at in tables:
        flags = freezable_from_cka(cka, tau, delta, window, cf["head"])
        by_depth: dict[int, list[dict[str, Any]]] = {}
        for cell in cf["grid"]:
            if cell["depth"] < 1:  # nothing frozen (--depths 0, the replay's check): no rule's call; flags[-1] is
                continue           # the head's, so each such cell counted as a missed free freeze (recall fell)
            by_depth.setdefault(cell["depth"], []).append(cell)
            n += 1
            rule = flags[cell["depth"] - 1][col[cell["t"]]]
            cheap = cheap_at[(cell["t"], cell["depth"])]
            tp += rule and cheap
            fp += rule and not cheap
            fn += (not rule) and cheap
            if rule:
                costs.append(cell["cost_points"])
        for cells in by_depth.values():
            first = next((c for c in sorted(cells, key=lambda c: c["t"]) if flags[c["depth"] - 1][col[c["t"]]]), None)
            frozen_for.append(0.0 if first is None else 1 - first["t"] / cf["steps"])
            if first is not None:
                first_costs.append(first["cost_points"])
    precision = tp / (tp + fp) if tp + fp else float("nan")
    recall = tp / (tp + fn) if tp + fn else float("nan")
    f1 = 2 * precision * recall / (precision + recall) if tp else 0.0
    return {"tau": tau, "window": window, "delta": delta, "cells": n, "precision": precision, "recall": recall,
            "f1": f1, "mean_cost": sum(costs) / len(costs) if costs else float("nan"),
            "max_cost": max(costs) if costs else float("nan"), "frozen_share": len(costs) / n if n else 0.0,
            "oracle_cost": sum(first_costs) / len(first_costs) if first_costs else float("nan"),
            "oracle_frozen": sum(frozen_for) / len(frozen_for) if frozen_for else 0.0}
