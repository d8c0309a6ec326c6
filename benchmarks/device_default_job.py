"""The default job on one device, rows one after another in one process: where the time and the memory go.

The default job is what ``layerfreeze train`` runs with the embedded default config (``layerfreeze config``: MiniLM-L6
on BBC News, 3 epochs of batch 32 at 128 tokens, 168 steps). Each row (``none``, ``smartfrz``, ``static``, ``lisa``,
``badam`` by default) trains through the CLI's own comparison (:func:`layerfreeze.train.compare.compare`: same seed,
data order and budget, one :class:`~layerfreeze.train.trainer.Trainer` per row), on ``--device`` (``cuda:0`` on the
GPU machine; ``auto``: the trainer's choice). Before each row trains, a step callback collects the garbage the last
row left (``gc.collect()``, ``torch.cuda.empty_cache()``) and resets the allocator's peak
(``torch.cuda.reset_peak_memory_stats``), so every row's peak is its own (issue 40 item 5).

Per row, read from the run's ``summary.json`` and ``metrics.jsonl`` (:mod:`layerfreeze.runs.rundir`):

* test accuracy (%), training seconds (the sum of the step times, evaluation and checkpoints excluded) and their
  time ratio to ``none``, and the FLOPs ratio (``FlopCounterMode`` counts on real steps, re-measured at each change
  of the frozen set);
* the allocator peak (the summary's ``peak_memory_bytes``: ``torch.cuda.max_memory_allocated`` on a GPU, peak RSS
  on a CPU) beside the memory ledger's tensor peak on the training device (``memory.devices[<device>]``, the ledger
  sampling every ``run.ledger_every`` steps: the default job's 10 unless ``--ledger-every``), and their ratio
  (issue 40 wants it within 2% on CUDA);
* the median step time (ms) per phase of the run: *before* the first freeze (steps ``1..f``, where ``f`` is the step
  of the first freeze in the run's freeze timeline; a freeze at step 0, before any step, leaves this phase empty),
  *while* freezing (steps ``f+1..l``, ``l`` the step of the last freeze or thaw) and *after* the last change
  (steps ``l+1..``); a row that never freezes has all its steps *before*;
* the extra time of the steps that re-measure FLOPs (those a ``flops_remeasured`` event names): each such step's
  time minus the median of the plain steps of its phase, summed over the run; step 1 is measured in every row and
  also carries the warm-up (first kernels, allocator growth), so it is reported apart;
* the strategy's signals in the step records (``signal_<name>``, :func:`layerfreeze.runs.telemetry.signals_of`): the
  steps that carry one are the steps that ran a stage, so their count and median spacing are the stage cadence.

``--variants`` (issue 42) runs the rows once per ``precision/compile`` pair (``train.precision`` / ``train.compile``;
default ``auto/false``, the default job as it is: the device's precision, eager), each variant's rows in a comparison
of their own (``OUT/runs/<precision>-<compile>/``), so each row's time and FLOPs ratios are to the ``none`` row of its
variant.
With more than one variant, or a compiled one, the tables name each row's variant and add the seconds the row spent
compiling in its steps (the summary's ``compile.train_compile_s``), its train time without them and that time's ratio
to its variant's ``none`` (issue 42's done-when compares ``bf16-mixed`` + ``compile: blocks`` rows that way), and the
ratio of its train time to the first variant's ``none``.

    python -m benchmarks.device_default_job --device cuda:0 --out runs/device-default-job   # the GPU check's
    python -m benchmarks.device_default_job --device cuda:0 --rows none,smartfrz,static,lisa \
        --variants bf16-mixed/false,bf16-mixed/blocks --out runs/precision-compile     # the GPU check's, issue 42
    python -m benchmarks.device_default_job --tiny --out /tmp/ddj      # 6 steps of 8 x 16 tokens: seconds, on CPU

Writes ``OUT/results.json`` (every number above, per row), ``OUT/table.md`` (the two tables as Markdown) and the
run folders under ``OUT/runs/``; prints the tables. Times are only comparable between rows of one invocation on an
otherwise idle machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from benchmarks.cli import entry
from layerfreeze.runs import rundir
from layerfreeze.runs.rundir import Event, finite
from layerfreeze.runs.summary import format_bytes
from layerfreeze.train.compare import compare
from layerfreeze.train.config_file import deep_merge, parse_override

ROWS = ("none", "smartfrz", "static", "lisa", "badam")
#: The variant the default job runs as it is: the device's default precision (bf16-mixed on a CUDA GPU with
#: bfloat16, 32-true elsewhere), eager.
BASE_VARIANT = "auto/false"


def parse_variants(text: str) -> list[tuple[str, str]]:
    """``"bf16-mixed/false,bf16-mixed/blocks"`` -> ``[("bf16-mixed", "false"), ("bf16-mixed", "blocks")]``.

    Raises:
        ValueError: an item is not ``precision/compile``, or one is named twice.
    """
    out: list[tuple[str, str]] = []
    for item in text.split(","):
        precision, sep, mode = item.strip().partition("/")
        if not sep or not precision or not mode:
            raise ValueError(f"--variants: {item!r} is not PRECISION/COMPILE (e.g. bf16-mixed/blocks)")
        if (precision, mode) in out:
            raise ValueError(f"--variants: {item!r} is named twice")
        out.append((precision, mode))
    return out


PHASES = ("before", "while", "after")
#: ``--tiny``: one epoch of 48 articles in batches of 8 at 16 tokens (6 steps), 8 test articles; the ledger samples
#: every step. Seconds on a CPU: it checks that everything runs and is read, its numbers mean nothing.
TINY = {"train": {"epochs": 1, "batch_size": 8}, "model": {"max_length": 16},
        "data": {"limit_train": 48, "limit_test": 8},
        "run": {"checkpoint": False, "tensorboard": False, "ledger_every": 1}}


def base_config(device: str | None, seed: int, tiny: bool, ledger_every: int | None,
                sets: list[str]) -> dict[str, Any]:
    """The default job's config dict: the embedded defaults, with the seed, no progress bar, the device and
    ``--set`` keys (``--tiny``'s sizes under them)."""
    base: dict[str, Any] = {"task": "bbc-news", "train": {"seed": seed}, "run": {"progress": False}}
    if tiny:
        base = deep_merge(base, TINY)
    if device:
        base = deep_merge(base, {"run": {"device": device}})
    if ledger_every is not None:
        base = deep_merge(base, {"run": {"ledger_every": ledger_every}})
    for item in sets:
        base = deep_merge(base, parse_override(item))
    return base


def fresh_row_callback(record: dict[str, Any]) -> Any:
    """A trainer step callback that, on its first call (before the row's first step, after its setup), collects the
    garbage of the rows before it, empties the CUDA cache and resets the allocator's peak; it notes in ``record``
    the bytes allocated then (``allocated_at_start_bytes``: the row's model, optimizer and data on the device)."""

    def callback(trainer: Any) -> None:
        if trainer.progress["step"] != 0 or "allocated_at_start_bytes" in record:
            return
        gc.collect()
        device = torch.device(trainer.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        record["device"] = str(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            record["allocated_at_start_bytes"] = int(torch.cuda.memory_allocated(device))
        else:
            record["allocated_at_start_bytes"] = None

    return callback


def median_ms(values: list[float]) -> float | None:
    return 1000 * statistics.median(values) if values else None


def phase_of(step: int, first: int | None, last: int | None) -> str:
    """``before`` / ``while`` / ``after`` of a step, given the steps of the first freeze and the last change."""
    if first is None or step <= first:
        return "before"
    return "while" if step <= last else "after"


def step_analysis(records: list[dict[str, Any]], timeline: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-phase medians, the FLOP-measured steps' extra time and the stage cadence of one run's records.

    Args:
        records: the run's ``metrics.jsonl`` records, in file order.
        timeline: the summary's ``freeze_timeline`` (``{"action": "freeze"|"thaw", "step", ...}``).
    """
    steps = {r["step"]: r for r in records if r.get("type") == "step" and finite(r.get("step_time_s"))}
    measured = sorted({r["step"] for r in records
                       if r.get("type") == "event" and r.get("kind") == Event.FLOPS_REMEASURED})
    freezes = [e["step"] for e in timeline if e.get("action") == "freeze"]
    changes = [e["step"] for e in timeline]
    first = min(freezes) if freezes else None
    last = max(changes) if changes else None
    plain: dict[str, list[float]] = {p: [] for p in PHASES}
    for s, r in steps.items():
        if s not in measured:
            plain[phase_of(s, first, last)].append(r["step_time_s"])
    medians = {p: median_ms(v) for p, v in plain.items()}
    extra_ms = []
    for s in measured:
        if s == 1 or s not in steps:
            continue
        ref = medians[phase_of(s, first, last)] or median_ms([t for v in plain.values() for t in v])
        if ref is not None:
            extra_ms.append(1000 * steps[s]["step_time_s"] - ref)
    step1 = steps.get(1, {}).get("step_time_s")
    stage_steps = sorted(s for s, r in steps.items() if any(k.startswith("signal_") for k in r))
    gaps = [b - a for a, b in zip(stage_steps, stage_steps[1:])]
    signals: dict[str, Any] = {}
    for s in stage_steps:
        for k, v in steps[s].items():
            if k.startswith("signal_"):
                entry = signals.setdefault(k[len("signal_"):], {"steps": 0, "last": None})
                entry["steps"] += 1
                entry["last"] = v
    for r in records:  # epoch-end stages (and a start stage, where the trainer logs one) as events
        if r.get("type") == "event" and r.get("kind") == Event.STAGE:
            for k, v in r.items():
                if k.startswith("signal_"):
                    signals.setdefault(k[len("signal_"):], {"steps": 0, "last": None})["event_last"] = v
    return {
        "first_freeze_step": first, "last_change_step": last,
        "steps_per_phase": {p: len(v) + sum(1 for s in measured if s in steps and phase_of(s, first, last) == p)
                            for p, v in plain.items()},
        "median_step_ms": medians,
        "median_step_ms_all": median_ms([t for v in plain.values() for t in v]),
        "flops_steps": measured,
        "flops_step_extra_ms": extra_ms,
        "flops_extra_s": sum(extra_ms) / 1000 if extra_ms else 0.0,
        "step1_ms": 1000 * step1 if finite(step1) else None,
        "stage_steps": len(stage_steps),
        "stage_every_median": statistics.median(gaps) if gaps else None,
        "signals": signals,
    }


def row_result(r: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """One row's numbers (see the module docstring) from its compare result and its run folder."""
    if r.get("stopped"):
        return {"row": r["row"], "stopped": r["stopped"]}
    run_dir = Path(r["run_dir"])
    summary = json.loads((run_dir / rundir.SUMMARY_FILE).read_text()) if (run_dir / rundir.SUMMARY_FILE).is_file() \
        else r
    memory = summary.get("memory") or {}
    device = extra.get("device") or ""
    on_device = (memory.get("devices") or {}).get(device) or {}
    ledger_peak = on_device.get("tensor_peak_bytes", summary.get("tensor_peak_bytes"))
    alloc = summary.get("peak_memory_bytes")
    allocator = (memory.get("allocator") or {}).get(device) or {}
    analysis = step_analysis(rundir.read_metrics(run_dir), summary.get("freeze_timeline") or [])
    return {
        "row": r["row"], "test_accuracy": r.get("test_accuracy"), "steps": r.get("steps"),
        "train_time_s": r.get("train_time_s"), "time_ratio": r.get("time_ratio"),
        "flops_total": r.get("flops_total"), "flops_ratio": r.get("flops_ratio"),
        "allocator_peak_bytes": alloc, "ledger_tensor_peak_bytes": ledger_peak,
        "allocator_over_ledger": alloc / ledger_peak if finite(alloc) and finite(ledger_peak) and ledger_peak else None,
        "ledger_allocator_peak_allocated": allocator.get("peak_allocated"),
        "allocated_at_start_bytes": extra.get("allocated_at_start_bytes"),
        "frozen_blocks": r.get("frozen_blocks"), "freeze_steps": r.get("freeze_steps"),
        "ledger_every": memory.get("every"), "run_dir": str(run_dir),
        "train_compile_s": (summary.get("compile") or {}).get("train_compile_s"),
        **analysis,
    }


def add_variant_ratios(rows: list[dict[str, Any]]) -> None:
    """Per row: the train time without the seconds compiling in steps, its ratio to the same variant's ``none``
    (``time_ratio_without_compile``), and the train time's ratio to the first variant's ``none``
    (``time_ratio_to_base``)."""
    live = [r for r in rows if not r.get("stopped")]
    for r in live:
        t = r.get("train_time_s")
        r["train_time_without_compile_s"] = t - (r.get("train_compile_s") or 0.0) if finite(t) else None
    nones = {r["variant"]: r for r in live if r["row"] == "none"}
    base = nones.get(rows[0]["variant"]) if rows else None
    for r in live:
        t, mine = r.get("train_time_s"), r["train_time_without_compile_s"]
        ref_t = nones[r["variant"]]["train_time_without_compile_s"] if r["variant"] in nones else None
        r["time_ratio_without_compile"] = mine / ref_t if finite(mine) and finite(ref_t) and ref_t else None
        base_t = base.get("train_time_s") if base else None
        r["time_ratio_to_base"] = t / base_t if finite(t) and finite(base_t) and base_t else None


def _num(x: Any, fmt: str = "{:.1f}") -> str:
    return fmt.format(x) if finite(x) else "-"


def _label(r: dict[str, Any], variants: bool) -> str:
    return f"{r['row']} ({r['variant']})" if variants else r["row"]


def tables(rows: list[dict[str, Any]], device: str) -> str:
    """The two Markdown tables: time and memory per row; per-phase step medians, FLOP-measured steps, stages. With
    several variants or a compiled one, each row is named with its variant and the compile columns are added."""
    variants = len({r.get("variant", BASE_VARIANT) for r in rows}) > 1 or any(
        r.get("variant", BASE_VARIANT).split("/")[1] != "false" for r in rows)
    mem_word = "allocator peak" if device.startswith("cuda") else "peak RSS"
    head = ["row", "test acc %", "train s", "time ratio", "FLOPs ratio", mem_word, "ledger tensor peak",
            f"{mem_word} / ledger"]
    if variants:
        head += ["compiling in steps s", "time ratio without compiling", "time ratio to first none"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("stopped"):
            lines.append(f"| {_label(r, variants)} | stopped: {r['stopped']} |" + " |" * (len(head) - 2))
            continue
        acc = r.get("test_accuracy")
        extra = [_num(r.get("train_compile_s")), _num(r.get("time_ratio_without_compile"), "{:.3f}"),
                 _num(r.get("time_ratio_to_base"), "{:.3f}")] if variants else []
        lines.append("| " + " | ".join([
            _label(r, variants), _num(100 * acc if finite(acc) else None, "{:.2f}"), _num(r["train_time_s"]),
            _num(r["time_ratio"], "{:.3f}"), _num(r["flops_ratio"], "{:.3f}"),
            format_bytes(r["allocator_peak_bytes"]) if finite(r["allocator_peak_bytes"]) else "-",
            format_bytes(r["ledger_tensor_peak_bytes"]) if finite(r["ledger_tensor_peak_bytes"]) else "-",
            _num(r["allocator_over_ledger"], "{:.3f}"), *extra]) + " |")
    head2 = ["row", "first freeze / last change (step)", "median step ms: before", "while", "after", "step 1 ms",
             "FLOP-measured steps (extra s)", "stage steps (median every)", "signals"]
    lines += ["", "| " + " | ".join(head2) + " |", "|" + "---|" * len(head2)]
    for r in rows:
        if r.get("stopped"):
            continue
        med = r["median_step_ms"]
        n = r["steps_per_phase"]
        lines.append("| " + " | ".join([
            _label(r, variants), f"{r['first_freeze_step'] if r['first_freeze_step'] is not None else '-'} / "
                      f"{r['last_change_step'] if r['last_change_step'] is not None else '-'}",
            *(f"{_num(med[p])} ({n[p]})" for p in PHASES), _num(r["step1_ms"]),
            f"{len(r['flops_steps'])} ({r['flops_extra_s']:+.2f})",
            f"{r['stage_steps']} ({_num(r['stage_every_median'], '{:g}')})",
            ", ".join(sorted(r["signals"])) or "-"]) + " |")
    lines.append("")
    lines.append(f"Steps in each phase in parentheses; FLOP-measured steps other than step 1 (which also warms up), "
                 f"extra seconds against the median plain step of their phase. Device {device}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help="strategies, none first (ratios are to it)")
    parser.add_argument("--device", help="run.device: auto, cpu, cuda:N (default: the config's, auto)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ledger-every", type=int, help="run.ledger_every (default: the default job's, 10)")
    parser.add_argument("--tiny", action="store_true", help="6 steps of 8 x 16 tokens (the test's size)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config key for every row")
    parser.add_argument("--variants", metavar="PRECISION/COMPILE,...",
                        help="train.precision/train.compile pairs, each a comparison of the rows (issue 42), e.g. "
                             "bf16-mixed/false,bf16-mixed/blocks (default: the config's, auto/false)")
    parser.add_argument("--out", default="runs/device-default-job")
    args = parser.parse_args(argv)
    out = Path(args.out)
    rows = args.rows.split(",")
    try:
        variants: list[tuple[str, str] | None] = parse_variants(args.variants) if args.variants else [None]
    except ValueError as exc:
        parser.error(str(exc))
    base = base_config(args.device, args.seed, args.tiny, args.ledger_every, args.set)
    console = Console(width=200)
    results: dict[str, Any] = {"rows": [], "device": args.device or "auto", "tiny": args.tiny, "set": args.set,
                               "variants": [], "torch": torch.__version__,
                               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    out.mkdir(parents=True, exist_ok=True)
    for variant in variants:
        if variant is None:  # the config's own (--set may name them)
            cfg, runs = base, out / "runs"
            train = base.get("train", {})
            name = f"{train.get('precision', 'auto')}/{str(train.get('compile', False)).lower()}"
        else:
            precision, mode = variant
            name, runs = f"{precision}/{mode}", out / "runs" / f"{precision}-{mode}"
            cfg = deep_merge(base, {"train": {"precision": precision, "compile": parse_override(f"c={mode}")["c"]}})
        results["variants"].append(name)
        extra: dict[str, dict[str, Any]] = {row: {} for row in rows}
        callbacks = {row: [fresh_row_callback(extra[row])] for row in rows}
        got = compare(cfg, rows, runs, console=console, row_callbacks=callbacks)
        results["device"] = next((e["device"] for e in extra.values() if e.get("device")), results["device"])
        results["rows"] += [{**row_result(r, extra[r["row"]]), "variant": name} for r in got]
        add_variant_ratios(results["rows"])
        (out / "results.json").write_text(json.dumps(results, indent=2))  # after every variant
        (out / "table.md").write_text(tables(results["rows"], results["device"]))
    md = tables(results["rows"], results["device"])
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main))
