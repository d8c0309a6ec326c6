"""The benchmark suite (issue 6): three tasks, every strategy plus ``none`` and a LoRA row, several seeds, and the
oracle line, written as JSON and as a generated Markdown section of BENCHMARKS.md.

Per task and seed, one ``layerfreeze.train.compare`` run: every row one after another in this process, ``none`` first,
same seed, data order and budget. Ratios (time, FLOPs) and accuracy differences are taken row by row against that
seed's ``none`` run, then averaged over seeds. The oracle (``benchmarks.oracle``) comes from a second, untimed
``none`` run of the same seed (the same trajectory; recording in the timed row would slow it): each block's output
on a fixed probe batch is recorded every few steps, the oracle freezes a block at the first record where its CKA
to the final output has converged (the SmartFRZ labelling rule), and its FLOPs are integrated from per-prefix step
FLOPs measured once. Each row's distance to it: the mean |freeze step - oracle step| over the
non-head blocks as a fraction of the run (never frozen = the end), and its FLOPs ratio minus the oracle's.

    python -m benchmarks.suite                         # the whole suite (sizes: SIZES below), 3 seeds
    python -m benchmarks.suite --quick                 # a few minutes: tiny sizes, 1 seed; OUT/suite.md only
    python -m benchmarks.suite --tasks bbc --seeds 0 --rows none,static,lora
    python -m benchmarks.suite --from-json runs/bench-suite/results.json --markdown BENCHMARKS.md   # regenerate
    python -m benchmarks.suite --resume --tasks fmnist-resnet   # run only the seeds results.json lacks

Outputs: ``OUT/results.json`` (raw rows per task and seed, the oracle, the aggregates, machine and versions; rewritten
after every seed), ``OUT/suite.md`` (the generated section), the section between ``<!-- suite:begin -->`` and
``<!-- suite:end -->`` in ``--markdown FILE`` (only when given: ``--markdown BENCHMARKS.md`` replaces the published
section, hand-written notes in it included), one rich
table per task on the terminal, and every row's run folder under ``OUT/<task>/seed<N>/``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.cli import entry, seed_list
from benchmarks.jobs import parse_jobs
from benchmarks.machine import machine, machine_line, versions
from benchmarks.suite_tasks import (
    QUICK_SIZES,
    SIZE_FIELDS,
    SIZES,
    TASKS,
    TaskSpec,
    base_config,
    dataset_sizes,
    row_settings,
    task_spec,
    total_steps,
)

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- suite:begin -->", "<!-- suite:end -->"

# ----------------------------------------------------------------------------------------------------------------
# Pairing and aggregation (pure functions; tests/test_bench_suite.py)
# ----------------------------------------------------------------------------------------------------------------
def pair_rows(rows: list[dict[str, Any]], oracle: dict[str, Any] | None, steps: int,
              head: str | None) -> list[dict[str, Any]]:
    """One seed's compare rows against that seed's ``none`` row (and oracle): accuracy difference, time and FLOPs
    ratios, and the gap to the oracle (None for LoRA, which freezes no blocks, or without an oracle)."""
    from benchmarks.oracle import schedule_gap
    from layerfreeze.runs.compare_table import BASELINE, ratios

    base = next(r for r in rows if r["row"] == BASELINE)
    out = []
    for r in rows:
        if r.get("stopped"):  # its training stopped (a non-finite loss): no result to pair, absent from this seed
            continue
        p = {
            "row": r["row"],
            "test_accuracy": r["test_accuracy"],
            **ratios(r, base),
            "peak_memory_bytes": r["peak_memory_bytes"],
            "freeze_steps": dict(r["freeze_steps"]),
            "step_gap": None,
            "flops_gap": None,
        }
        if oracle is not None and r["row"] != "lora":
            p["step_gap"] = schedule_gap(r["freeze_steps"], oracle["freeze_steps"], steps, head)
            p["flops_gap"] = p["flops_ratio"] - oracle["flops_ratio"]
        out.append(p)
    return out


def stats(values: list[float]) -> dict[str, float]:
    """Mean, min and max."""
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def _mean_or_none(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _steps_by_block(per_seed: list[dict[str, int | None]], blocks: list[str]) -> tuple[dict, dict, dict]:
    """Per block frozen in at least one seed: steps per seed (None: not frozen), the median over the seeds where
    it froze, and in how many seeds it froze."""
    steps, median, count = {}, {}, {}
    for b in blocks:
        values = [s.get(b) for s in per_seed]
        frozen = [v for v in values if v is not None]
        if frozen:
            steps[b], median[b], count[b] = values, statistics.median(frozen), len(frozen)
    return steps, median, count


def aggregate(paired: list[list[dict[str, Any]]], oracles: list[dict[str, Any] | None],
              blocks: list[str]) -> dict[str, Any]:
    """Rows over seeds (``paired[seed]`` from :func:`pair_rows`, rows in the first seed's order) and the oracle."""
    rows = []
    for name in [r["row"] for r in paired[0]]:
        seeds = [next(r for r in seed if r["row"] == name) for seed in paired if any(r["row"] == name for r in seed)]
        steps, median, count = _steps_by_block([r["freeze_steps"] for r in seeds], blocks)
        rows.append({
            "row": name,
            "seeds": len(seeds),
            "test_accuracy": stats([r["test_accuracy"] for r in seeds]),
            "accuracy_delta": statistics.fmean(r["accuracy_delta"] for r in seeds),
            "time_ratio": stats([r["time_ratio"] for r in seeds]),
            "flops_ratio": statistics.fmean(r["flops_ratio"] for r in seeds),
            "peak_memory_bytes": statistics.fmean(r["peak_memory_bytes"] for r in seeds),
            "freeze_steps": steps,
            "freeze_step_median": median,
            "frozen_in_seeds": count,
            "step_gap": _mean_or_none([r["step_gap"] for r in seeds]),
            "flops_gap": _mean_or_none([r["flops_gap"] for r in seeds]),
        })
    out: dict[str, Any] = {"rows": rows, "oracle": None}
    oracles = [o for o in oracles if o is not None]
    if oracles:
        steps, median, count = _steps_by_block([o["freeze_steps"] for o in oracles], blocks)
        out["oracle"] = {"seeds": len(oracles), "flops_ratio": stats([o["flops_ratio"] for o in oracles]),
                         "freeze_steps": steps, "freeze_step_median": median, "frozen_in_seeds": count}
    return out


# ----------------------------------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------------------------------
def _span(first: str, last: str) -> str:
    """``bert.encoder.layer.0`` .. ``bert.encoder.layer.3`` -> ``bert.encoder.layer.0-3``."""
    if first == last:
        return first
    a, _, i = first.rpartition(".")
    b, _, j = last.rpartition(".")
    if a and a == b and i.isdigit() and j.isdigit():
        return f"{a}.{i}-{j}"
    return f"{first}..{last}"


def format_frozen(median: dict[str, float], count: dict[str, int], seeds: int, blocks: list[str]) -> str:
    """``block@median step`` for every block frozen at the end of a run, consecutive blocks with the same label
    merged (``features.0-9@0``); ``(k/n)`` when a block froze in only ``k`` of ``n`` seeds."""
    labels = []
    for b in blocks:
        if b not in median:
            labels.append((b, None))
            continue
        label = f"@{median[b]:g}" + (f" ({count[b]}/{seeds})" if count[b] < seeds else "")
        labels.append((b, label))
    parts, i = [], 0
    while i < len(labels):
        b, label = labels[i]
        j = i
        while label is not None and j + 1 < len(labels) and labels[j + 1][1] == label:
            j += 1
        if label is not None:
            parts.append(_span(b, labels[j][0]) + label)
        i = j + 1
    return ", ".join(parts) or "-"


def _bytes(n: float) -> str:
    from layerfreeze.runs.summary import format_bytes

    return format_bytes(int(n))


HEADERS = ["row", "test acc % mean [min, max]", "Δ pts vs none", "time ratio mean [min, max]", "FLOPs ratio",
           "peak mem", "frozen block@step (median)", "gap to oracle (steps, FLOPs)"]


def table_cells(agg: dict[str, Any], blocks: list[str]) -> list[list[str]]:
    """The rows of one task's table (the oracle last), as strings."""
    cells = []
    for r in agg["rows"]:
        acc, tr = r["test_accuracy"], r["time_ratio"]
        gap = "-" if r["step_gap"] is None else f"{r['step_gap']:.2f}, {r['flops_gap']:+.3f}"
        cells.append([
            r["row"],
            f"{100 * acc['mean']:.2f} [{100 * acc['min']:.2f}, {100 * acc['max']:.2f}]",
            f"{100 * r['accuracy_delta']:+.2f}",
            f"{tr['mean']:.3f} [{tr['min']:.3f}, {tr['max']:.3f}]",
            f"{r['flops_ratio']:.3f}",
            _bytes(r["peak_memory_bytes"]),
            format_frozen(r["freeze_step_median"], r["frozen_in_seeds"], r["seeds"], blocks),
            gap,
        ])
    o = agg.get("oracle")
    if o is not None:
        fr = o["flops_ratio"]
        flops = f"{fr['mean']:.3f}" + (f" [{fr['min']:.3f}, {fr['max']:.3f}]" if o["seeds"] > 1 else "")
        cells.append(["oracle", "n/a", "n/a", "n/a", flops, "-",
                      format_frozen(o["freeze_step_median"], o["frozen_in_seeds"], o["seeds"], blocks), "0, +0.000"])
    return cells


def markdown_table(agg: dict[str, Any], blocks: list[str]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in table_cells(agg, blocks)]
    return "\n".join(lines) + "\n"


def rich_table(title: str, agg: dict[str, Any], blocks: list[str]) -> Table:
    table = Table(title=title)
    for h in HEADERS:
        table.add_column(h, justify="left" if h.startswith(("row", "frozen")) else "right", overflow="fold")
    for row in table_cells(agg, blocks):
        table.add_row(*row)
    return table


def _task_settings(t: dict[str, Any]) -> str:
    s = t["spec"]
    parts = [f"{s['epochs']} epoch{'s' if s['epochs'] != 1 else ''} ({t['total_steps']} steps"
             + (f", max_steps {s['max_steps']}" if s.get("max_steps") else "") + ")",
             f"{t['n_train']:,} train / {t['n_test']:,} test samples"]
    if s.get("max_length"):
        parts.append(f"{s['max_length']} tokens")
    parts += [f"batch {s['batch_size']}", f"{'AdamW' if s['optimizer'] == 'adamw' else 'SGD'} {s['lr']:g}"
              f" (weight decay {s['weight_decay']:g})", "pretrained" if s["pretrained"] else "from scratch",
              f"seeds {', '.join(str(x['seed']) for x in t['seeds'])}"]
    return ", ".join(parts)


HOW_TO_READ = """
How the numbers are made:
- Per task and seed one `compare` run: every row in one process, `none` first, the same seed, data order and step
  budget. Each task starts with a discarded 3-step warm-up run, so `none` does not pay the process's one-time costs.
- Time is training time: forward, backward, optimizer step and the strategy's own work; data loading and evaluation
  excluded. FLOPs are measured training FLOPs (`FlopCounterMode` on real steps, re-measured when the frozen set
  changes). Peak memory is the process's peak RSS during the row (CPU) or CUDA's peak allocation.
- Wall time on this 2-core VM drifts in phases of tens of seconds that no row causes: a loop copying 256 MiB
  alternates between ~0.11 and ~0.16 s per 10 copies, and memory-bound MobileNetV2 steps follow it (the same
  full-training step takes 0.27 s in one phase and 0.53 s in the next). Two rows that compute the same thing
  (`none` and `linear`, which freezes only at the last step) measured 0.53x to 1.40x of each other over six runs,
  so MobileNetV2's time ratios carry about +-40% noise per seed: read its speed from the FLOPs ratio. MiniLM-L6
  (matmul-bound) is steady.
- Ratios and Δ pts are taken against the same seed's `none` run, then averaged over seeds; [min, max] over seeds.
- `frozen block@step`: the median step (over the seeds where it froze) at which each block was frozen for the rest
  of the run; (k/n): frozen in k of n seeds.
- Oracle: from a second, untimed `none` run of each seed (same seed: the same trajectory; the timed row is not
  instrumented), each block's output on 64 fixed training samples recorded ~33 times; a block freezes at the first
  record where its linear CKA to its final output is >= TAU (TAU_SCRATCH on a task trained from scratch) and stable
  within DELTA over WINDOW records, with every earlier block frozen too (the SmartFRZ labelling rule). Its FLOPs sum
  per-prefix step FLOPs measured once. Gap to oracle: mean |freeze step - oracle step| over the non-head blocks as a
  fraction of the run (never frozen = the end), and the row's FLOPs ratio minus the oracle's.
"""


def how_to_read() -> str:
    """:data:`HOW_TO_READ` with the oracle's labelling thresholds (``layerfreeze.smartfrz.labels``) filled in."""
    from layerfreeze.smartfrz.labels import DEFAULT_DELTA, DEFAULT_TAU, DEFAULT_TAU_SCRATCH, DEFAULT_WINDOW

    text = HOW_TO_READ.strip().replace("WINDOW", str(DEFAULT_WINDOW))
    text = text.replace("TAU_SCRATCH", str(DEFAULT_TAU_SCRATCH))
    return text.replace("TAU", str(DEFAULT_TAU)).replace("DELTA", str(DEFAULT_DELTA))


def markdown_section(results: dict[str, Any]) -> str:
    """The generated BENCHMARKS.md section (between the markers), from ``results.json`` alone."""
    m = results["meta"]
    v = m["versions"]
    versions = ", ".join(f"{k} {v[k]}" for k in ("python", "torch", "torchvision", "transformers", "peft",
                                                  "layerfreeze") if v.get(k))
    commit = v.get("git_commit", "unknown") + (" + local changes" if v.get("git_dirty") else "")
    lines = [BEGIN, ""]
    if m.get("quick"):
        lines += ["> **Quick mode** (`--quick`): tiny sizes, a smoke test of the suite, not a measurement.", ""]
    lines += [
        "## Benchmark suite: every strategy, the LoRA row and the oracle on three tasks",
        "",
        "Generated by `python -m benchmarks.suite` from its `results.json`; regenerate this section without rerunning "
        "with `python -m benchmarks.suite --from-json OUT/results.json`.",
        "",
        f"- Command: `{m['command']}`",
        f"- Date: {m['date']}; suite wall time {m['wall_time_s'] / 60:.1f} min",
        f"- Machine: {machine_line(m['machine'])}",
        f"- Versions: {versions}; commit {commit}",
        *[f"- Resumed: `{r['command']}` on {r['date']}, commit {r['versions'].get('git_commit', 'unknown')}, "
          f"{machine_line(r['machine'])}; ran {r['ran']}" for r in m.get("resumed", [])],
        "",
        how_to_read(),
    ]
    for t in results["tasks"].values():
        if not t.get("aggregate"):
            continue
        lines += ["", f"### {t['title']}", "", _task_settings(t) + ".", "",
                  markdown_table(t["aggregate"], t["blocks"]).rstrip("\n")]
        if t.get("notes"):
            lines += [""] + [f"- {n}" for n in t["notes"]]
    lines += ["", END]
    return "\n".join(lines) + "\n"


def update_markdown(text: str, section: str) -> str:
    """``text`` with the part between the markers (markers included) replaced by ``section``; without markers,
    ``section`` goes right after the first ``# `` title line (or at the very top)."""
    if BEGIN in text and END in text and text.index(BEGIN) < text.index(END):
        start, end = text.index(BEGIN), text.index(END) + len(END)
        return text[:start] + section.rstrip("\n") + text[end:]
    lines = text.splitlines(keepends=True)
    if lines and lines[0].startswith("# "):
        return lines[0] + "\n" + section + ("\n" + "".join(lines[1:]).lstrip("\n") if len(lines) > 1 else "")
    return section + ("\n" + text if text else "")


# ----------------------------------------------------------------------------------------------------------------
# Rows trained beside `none` on the suite's jobs (benchmarks/oracle_replay.py, benchmarks/smartfrz_threshold.py)
# ----------------------------------------------------------------------------------------------------------------
_ROW_CLASSES: dict[tuple[type, str], type] = {}


def row_class(base: type, name: str) -> type:
    """A subclass of strategy class ``base`` to register as compare row ``name`` (``base`` itself when ``name`` is
    its own name): one class per (base, name), so that registering it again in the same process is a no-op (the
    registry refuses a second object under a taken name)."""
    if name == getattr(base, "name", None):
        return base
    if (base, name) not in _ROW_CLASSES:
        _ROW_CLASSES[base, name] = type(base.__name__, (base,), {"name": name})
    return _ROW_CLASSES[base, name]


def train_beside_none(spec: TaskSpec, seed: int, cache: bool, rows: list[str], row_params: dict[str, dict[str, Any]],
                      run_dir: Path, console: Console) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One seed of the suite's job ``spec`` in one :func:`layerfreeze.train.compare.compare` process: `none`, then
    ``rows`` (their strategy parameters in ``row_params``), the activation cache on for every row when ``cache``.
    Clears ``run_dir`` first (the calling script's own folders from an earlier run). Returns ``(none, [row results in
    the order of rows])``, with their ratios to `none`."""
    from layerfreeze.train.compare import compare

    base = base_config(spec, seed, None)
    if cache:
        base["freeze"] = {"cache": {"mode": "auto"}}
    shutil.rmtree(run_dir, ignore_errors=True)
    none, *trained = compare(base, ["none", *rows], run_dir, console=console, row_params=row_params)
    return none, trained


def beside_none_table(title: str, acc_header: str, trained: list[tuple[int, str, dict[str, Any], dict[str, Any],
                                                                        str]]) -> Table:
    """One line per ``(seed, row name, that seed's none result, the row's result, its frozen blocks as text)``
    (compare results, with their ratios to `none`), then per row the mean over its seeds of Δ pts, time and FLOPs
    ratios."""
    table = Table(title=title)
    for h in ("seed", "row", "none acc %", acc_header, "Δ pts", "time ratio", "FLOPs ratio", "frozen block@step"):
        table.add_column(h, justify="right")
    by_row: dict[str, list[dict[str, Any]]] = {}
    for seed, name, none, r, frozen in trained:
        by_row.setdefault(name, []).append(r)
        table.add_row(str(seed), name, f"{100 * none['test_accuracy']:.2f}", f"{100 * r['test_accuracy']:.2f}",
                      f"{100 * r['accuracy_delta']:+.2f}", f"{r['time_ratio']:.3f}", f"{r['flops_ratio']:.3f}", frozen)
    for name, rs in by_row.items():
        table.add_row("mean", name, "", "", f"{100 * statistics.fmean(r['accuracy_delta'] for r in rs):+.2f}",
                      f"{statistics.fmean(r['time_ratio'] for r in rs):.3f}",
                      f"{statistics.fmean(r['flops_ratio'] for r in rs):.3f}", "")
    return table


# ----------------------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------------------
def warm_up(base: dict[str, Any], run_dir: Path) -> None:
    """A discarded 3-step ``none`` run: the first run in a process pays one-time costs (allocator, kernel setup)
    that would otherwise inflate the ``none`` row's time, the denominator of every time ratio."""
    from layerfreeze.train.compare import row_config
    from layerfreeze.train.config import build_config
    from layerfreeze.train.config_file import deep_merge
    from layerfreeze.train.trainer import Trainer

    cfg = deep_merge(row_config(base, "none", run_dir.parent), {"run": {"dir": str(run_dir)},
                     "train": {"max_steps": 3}, "data": {"limit_test": 32}})
    Trainer(build_config(cfg)).run()


def run_oracle(recorder: Any, none_row: dict[str, Any], none_config: Any, pretrained: bool) -> dict[str, Any]:
    """The oracle of one seed from its ``none`` run's probe records, at the labels' tau for the task's regime
    (:func:`layerfreeze.smartfrz.labels.tau_for`)."""
    from benchmarks.oracle import oracle_flops, oracle_freeze_steps, prefix_step_flops, prefixes_used
    from layerfreeze.smartfrz.labels import tau_for

    steps = none_row["steps"]
    cka = recorder.cka()
    tau = tau_for("finetune" if pretrained else "scratch")
    frozen = oracle_freeze_steps(cka, recorder.steps, recorder.head, tau=tau)
    flops = prefix_step_flops(none_config, prefixes_used(frozen, steps) | {0})
    total = oracle_flops(frozen, flops, steps)
    return {
        "freeze_steps": dict(zip(recorder.blocks, frozen)),
        "tau": tau,
        "flops_total": total,
        "flops_ratio": total / (flops[0] * steps),
        "flops_per_step_by_prefix": {str(k): v for k, v in sorted(flops.items())},
        "flops_check": flops[0] / none_row["flops_per_step_first"],  # 1.0: same count as the trainer's
        "record_steps": recorder.steps,
        "cka": [[round(v, 6) for v in row] for row in cka],
    }


def task_settings(spec: TaskSpec, rows: list[str]) -> dict[str, Any]:
    """What a task's seeds are run with (sizes, rows, row parameters, notes), computed without training: the part of
    results.json that two runs must share for ``--resume`` to put their seeds in one table."""
    n_train, n_test = dataset_sizes(spec)
    steps = total_steps(spec, n_train)
    notes = []
    task_rows = list(rows)
    if "lora" in task_rows and spec.lora_lr is None:
        task_rows.remove("lora")
    if spec.lora_note and ("lora" in rows):
        notes.append(spec.lora_note)
    row_params, row_overrides = row_settings(spec, steps)
    if "autofreeze" in task_rows or "egeria" in task_rows:
        notes.append(f"AutoFreeze evaluates every {max(1, steps // 10)} steps (10 times per run, its default, as its "
                     f"public code); Egeria every {row_params['egeria']['interval']} steps (about 8 times per run); "
                     f"static freezes the first {spec.static_k} blocks; other strategies use their defaults.")
    # Through JSON, so that a fresh dict compares equal to one read back from results.json (tuples become lists).
    return json.loads(json.dumps({"title": spec.title, "spec": asdict(spec), "n_train": n_train, "n_test": n_test,
                                  "total_steps": steps, "rows": task_rows, "row_params": row_params,
                                  "row_overrides": row_overrides, "notes": notes}))


def resume_mismatch(stored: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """The settings (keys of :func:`task_settings`) in which a stored task differs from this command's; empty: its
    seeds can be kept."""
    return [k for k, v in settings.items() if stored.get(k) != v]


def run_task(key: str, spec: TaskSpec, rows: list[str], seeds: list[int], out: Path, threads: int | None,
             console: Console, result: dict[str, Any], save: Any, here: str) -> list[int]:
    """The seeds of one task that ``result`` (part of results.json) does not hold yet, saving after each seed;
    returns the seeds it ran. ``result`` holds seeds only when resumed, with the same :func:`task_settings`.
    ``here``: this run's :func:`machine_line`, recorded with each seed."""
    from benchmarks.oracle import ProbeRecorder
    from layerfreeze.train.compare import compare, row_config
    from layerfreeze.train.config import build_config
    from layerfreeze.train.trainer import Trainer

    settings = task_settings(spec, rows)
    kept = result.get("seeds", [])
    result.update(settings)
    result["seeds"] = kept
    todo = [seed for seed in seeds if seed not in {s["seed"] for s in kept}]
    if not kept:
        shutil.rmtree(out / key, ignore_errors=True)  # this task's run folders from an earlier suite run
    if not todo:
        console.print(f"[bold]{key}[/]: seeds {', '.join(map(str, seeds))} already in results.json (resumed)")
        return []
    task_rows, steps = settings["rows"], settings["total_steps"]
    row_params, row_overrides = settings["row_params"], settings["row_overrides"]
    console.rule(f"[bold]{key}[/]: warm-up (3 steps, discarded)")
    shutil.rmtree(out / key / "warmup", ignore_errors=True)  # kept by a resumed task's earlier run
    warm_up(base_config(spec, todo[0], threads), out / key / "warmup")
    for seed in todo:
        t0 = time.perf_counter()
        console.rule(f"[bold]{key}[/]: seed {seed} ({len(task_rows)} rows, {steps} steps each)")
        base = base_config(spec, seed, threads)
        run_dir = out / key / f"seed{seed}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a seed an interrupted run left half done
        raw = compare(base, task_rows, run_dir, console=console, row_params=row_params,
                      row_overrides=row_overrides)
        none_row = next(r for r in raw if r["row"] == "none")
        # The oracle's probe records come from a second, untimed `none` run (same seed: the same trajectory), not
        # from the timed row: on MobileNetV2 the records (eval-mode probe forwards and an SVD per block every ~5
        # steps) slowed the training steps that followed them to twice their time, inflating the denominator of
        # every time ratio (measured: `none` 49.5 s against 38.2 s for `linear`, which does the same work).
        console.print("[bold]oracle[/]: an untimed `none` run recording the probe batch")
        recorder = ProbeRecorder()
        none_config = build_config(row_config(base, "none", run_dir / "oracle"))
        Trainer(none_config, step_callbacks=[recorder]).run()
        oracle = run_oracle(recorder, none_row, none_config, spec.pretrained)
        result["blocks"], result["head"] = recorder.blocks, recorder.blocks[recorder.head]
        result["seeds"].append({"seed": seed, "rows": raw, "oracle": oracle,
                                "paired": pair_rows(raw, oracle, none_row["steps"], result["head"]),
                                "wall_time_s": time.perf_counter() - t0, "machine": here,
                                "date": dt.datetime.now().astimezone().isoformat(timespec="seconds")})
        result["seeds"].sort(key=lambda s: s["seed"])
        result["aggregate"] = aggregate([s["paired"] for s in result["seeds"]],
                                        [s["oracle"] for s in result["seeds"]], result["blocks"])
        save()
    n = len(result["seeds"])
    console.print(rich_table(f"{spec.title} ({n} seed{'s' if n > 1 else ''})", result["aggregate"], result["blocks"]))
    for note in settings["notes"]:
        console.print(f"  - {note}", highlight=False)
    return todo


def write_outputs(results: dict[str, Any], out: Path, markdown: str | None, console: Console) -> None:
    section = markdown_section(results)
    (out / "suite.md").write_text(section)
    if markdown:
        path = Path(markdown)
        path.write_text(update_markdown(path.read_text() if path.exists() else "", section))
        console.print(f"Markdown section: {path}")
    console.print(f"Markdown: {out / 'suite.md'}")


def read_for_resume(path: Path, tasks: list[str], rows: list[str], quick: bool,
                    parser: argparse.ArgumentParser) -> dict[str, Any]:
    """results.json to continue (``--resume``); every refusal is a parser error, before anything trains.

    Raises:
        SystemExit: (through ``parser.error``) no readable results.json at ``path``, a quick run resumed as a full
            one or the reverse, or a task stored with other settings or rows than this command's.
    """
    try:
        results = json.loads(path.read_text())
        results["tasks"], results["meta"]["seeds"], results["meta"]["wall_time_s"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        parser.error(f"--resume: no results.json of this script to continue at {path} ({exc}); run without "
                     "--resume, or give the --out of the run to continue")
    if bool(results["meta"].get("quick")) != quick:
        parser.error(f"--resume: {path} is a {'quick' if results['meta'].get('quick') else 'full'} run; resume it "
                     f"{'with' if results['meta'].get('quick') else 'without'} --quick")
    for key in tasks:
        stored = results["tasks"].get(key)
        if stored and stored.get("seeds"):
            diff = resume_mismatch(stored, task_settings(task_spec(key, quick), rows))
            if diff:
                parser.error(f"--resume: task {key} in {path} was run with other {', '.join(diff)}; its seeds "
                             "cannot share a table with this command's. Use another --out, or the same --rows")
    return results


def main(argv: list[str] | None = None) -> int:
    from layerfreeze.strategies import STRATEGIES
    from layerfreeze.train.compare import DEFAULT_ROWS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (QUICK_SIZES), seed 0 unless --seeds")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {', '.join(TASKS)}")
    parser.add_argument("--seeds", type=seed_list, help="comma-separated seeds (default 0,1,2; 0 with --quick)")
    parser.add_argument("--rows", help="comma-separated rows (default: every registered strategy and lora; none "
                        "is always run, first)")
    parser.add_argument("--out", default="runs/bench-suite", help="results folder (default runs/bench-suite)")
    parser.add_argument("--markdown", help="file whose suite section is (re)written, e.g. BENCHMARKS.md (default: "
                        "none, so a reproduction does not overwrite the published tables; OUT/suite.md is always "
                        "written)")
    parser.add_argument("--threads", type=int, help="torch threads per run (default: torch's)")
    parser.add_argument("--resume", action="store_true", help="keep the seeds OUT/results.json already holds and "
                        "run only the missing ones (same tasks' settings and rows, else an error before training)")
    parser.add_argument("--from-json", metavar="RESULTS", help="only regenerate the Markdown (and tables) from a "
                        "results.json")
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 180, soft_wrap=False)
    markdown = args.markdown or None

    if args.from_json:
        try:
            results = json.loads(Path(args.from_json).read_text())
            results["tasks"], results["meta"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parser.error(f"--from-json {args.from_json}: not a results.json written by this script ({exc})")
        for t in results["tasks"].values():
            if t.get("aggregate"):
                console.print(rich_table(t["title"], t["aggregate"], t["blocks"]))
        write_outputs(results, Path(args.from_json).parent, markdown, console)
        return 0

    tasks = parse_jobs(args.tasks, tuple(TASKS))
    rows = [r.strip() for r in args.rows.split(",")] if args.rows else \
        [r for r in DEFAULT_ROWS if r in STRATEGIES or r == "lora"]
    unknown_rows = [r for r in rows if r not in STRATEGIES and r != "lora"]
    if unknown_rows:
        parser.error(f"unknown row(s) {', '.join(unknown_rows)} (known: {', '.join(sorted(STRATEGIES))}, lora)")
    rows = ["none"] + [r for r in rows if r != "none"]
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    out = Path(args.out)
    args_given = argv if argv is not None else sys.argv[1:]
    run_info = {"command": " ".join(["python", "-m", "benchmarks.suite", *args_given]),
                "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine(),
                "versions": versions()}
    sizes = {k: dict(zip(SIZE_FIELDS, (QUICK_SIZES if args.quick else SIZES)[k])) for k in tasks}
    if args.resume:
        results = read_for_resume(out / "results.json", tasks, rows, args.quick, parser)
        results["meta"].setdefault("resumed", []).append(dict(run_info, ran=""))
        results["meta"]["seeds"] = sorted(set(results["meta"]["seeds"]) | set(seeds))
        results["meta"].setdefault("sizes", {}).update(sizes)
    else:
        results = {"meta": {**run_info, "quick": args.quick, "seeds": seeds, "wall_time_s": 0.0, "sizes": sizes},
                   "tasks": {}}
    out.mkdir(parents=True, exist_ok=True)
    start, earlier = time.perf_counter(), results["meta"]["wall_time_s"]

    def save() -> None:
        results["meta"]["wall_time_s"] = earlier + time.perf_counter() - start
        (out / "results.json").write_text(json.dumps(results, indent=1))

    ran = []
    for key in tasks:
        done = run_task(key, task_spec(key, args.quick), rows, seeds, out, args.threads, console,
                        results["tasks"].setdefault(key, {}), save, machine_line(run_info["machine"]))
        if done:
            ran.append(f"{key} seed{'s' if len(done) > 1 else ''} {', '.join(map(str, done))}")
        if args.resume:
            results["meta"]["resumed"][-1]["ran"] = "; ".join(ran) or "nothing (every seed was there)"
        save()
    console.rule("suite done")
    for t in results["tasks"].values():
        console.print(rich_table(t["title"], t["aggregate"], t["blocks"]))
    console.print(f"wall time {results['meta']['wall_time_s'] / 60:.1f} min; results: {out / 'results.json'}")
    write_outputs(results, out, markdown, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main))
