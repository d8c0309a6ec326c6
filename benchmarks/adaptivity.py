"""Does SmartFRZ follow convergence, or only training progress? Freeze steps across learning rates and run lengths.

Issue 16: a policy that freezes at the same fraction of the run whatever the task is a schedule in disguise. On one
task (the suite's MiniLM-L6 / BBC News job, ``benchmarks.suite_tasks.SIZES["bbc"]``) this script varies the
learning rate (x0.3, x1, x3) and the run length (1, 2 and 4 epochs) and, per variant, in one process one after another:

1. an untimed ``none`` run with the oracle's :class:`~benchmarks.oracle.ProbeRecorder`: each block's oracle freeze
   step (:func:`~benchmarks.oracle.oracle_freeze_steps`, the first record where the block's CKA to its final
   output has converged by the SmartFRZ labelling rule) -- when the block *did* converge on that variant;
2. a ``smartfrz`` run (the shipped predictor, its defaults) -- when the policy froze it.

It prints, per variant and block, both freeze steps as a fraction of the run (never frozen = 1.0), and two
correlations over every (variant, non-head block) pair: of the fractions themselves, and of their *moves* against
the reference variant (``lr1-ep2``: lr x1, 2 epochs), which is the question: when the oracle's step moves, does
SmartFRZ's move the same way? A policy that reads only training progress has moves near 0 whatever the oracle does.

    python -m benchmarks.adaptivity                    # 5 variants x 2 runs (about 15 minutes alone on 2 cores)
    python -m benchmarks.adaptivity --seed 1 --out runs/bench-adaptivity
    python -m benchmarks.adaptivity --from-json runs/bench-adaptivity/results.json   # only the tables

Outputs: ``OUT/results.json`` (rewritten after every variant), ``OUT/adaptivity.md`` and the section between
``<!-- adaptivity:begin -->`` and ``<!-- adaptivity:end -->`` of ``--markdown`` (default BENCHMARKS.md).
Accuracy and freeze steps do not depend on timing, so this script may run beside other work; it times nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks import suite_tasks  # the suite's bbc task spec and base config: the same job
from benchmarks.cli import entry
from benchmarks.markdown_section import update_section

BEGIN, END = "<!-- adaptivity:begin -->", "<!-- adaptivity:end -->"
REFERENCE = "lr1-ep2"
#: name -> (learning-rate factor, epochs)
VARIANTS: dict[str, tuple[float, int]] = {
    "lr0.3-ep2": (0.3, 2),
    REFERENCE: (1.0, 2),
    "lr3-ep2": (3.0, 2),
    "lr1-ep1": (1.0, 1),
    "lr1-ep4": (1.0, 4),
}

ROOT = Path(__file__).resolve().parent.parent


def run_variant(name: str, seed: int, out: Path, threads: int | None, console: Console,
                max_steps: int | None = None) -> dict[str, Any]:
    """The oracle's and SmartFRZ's freeze steps (and accuracies) of one variant."""
    from benchmarks.oracle import ProbeRecorder, oracle_freeze_steps
    from layerfreeze.runs.compare_table import freeze_steps
    from layerfreeze.train.compare import row_config
    from layerfreeze.train.config import build_config
    from layerfreeze.train.trainer import Trainer

    factor, epochs = VARIANTS[name]
    spec = replace(suite_tasks.task_spec("bbc", quick=False), epochs=epochs)
    spec = replace(spec, lr=spec.lr * factor, max_steps=max_steps)
    base = suite_tasks.base_config(spec, seed, threads)
    folder = out / name
    console.rule(f"[bold]{name}[/] (lr {spec.lr:g}, {epochs} epochs): oracle run")
    recorder = ProbeRecorder()
    none = Trainer(build_config(row_config(base, "none", folder)), step_callbacks=[recorder]).run()
    oracle = dict(zip(recorder.blocks, oracle_freeze_steps(recorder.cka(), recorder.steps, recorder.head)))
    console.rule(f"[bold]{name}[/]: smartfrz run")
    smart = Trainer(build_config(row_config(base, "smartfrz", folder))).run()
    return {"variant": name, "lr": spec.lr, "epochs": epochs, "steps": none["steps"], "blocks": recorder.blocks,
            "head": recorder.blocks[recorder.head], "oracle": oracle, "smartfrz": freeze_steps(smart),
            "none_accuracy": none["test_accuracy"], "smartfrz_accuracy": smart["test_accuracy"],
            "smartfrz_flops_ratio": smart["flops_total"] / none["flops_total"]}


def fractions(v: dict[str, Any]) -> tuple[list[float], list[float]]:
    """(oracle, smartfrz) freeze step / run length per non-head block; never frozen = 1.0."""
    blocks = [b for b in v["blocks"] if b != v["head"]]

    def frac(step: int | None) -> float:
        return 1.0 if step is None else min(step, v["steps"]) / v["steps"]

    return [frac(v["oracle"].get(b)) for b in blocks], [frac(v["smartfrz"].get(b)) for b in blocks]


def pearson(x: list[float], y: list[float]) -> float | None:
    """Pearson's r; None when either side is constant (no variation to correlate)."""
    if len(x) < 2 or statistics.pstdev(x) == 0 or statistics.pstdev(y) == 0:
        return None
    return statistics.correlation(x, y)


def correlations(variants: list[dict[str, Any]]) -> dict[str, Any]:
    """Correlation of the fractions over every (variant, block), and of the moves against the reference variant."""
    ref = next((v for v in variants if v["variant"] == REFERENCE), None)
    fo, fs, mo, ms = [], [], [], []
    for v in variants:
        o, s = fractions(v)
        fo += o
        fs += s
        if ref is not None and v is not ref:
            ro, rs = fractions(ref)
            mo += [a - b for a, b in zip(o, ro)]
            ms += [a - b for a, b in zip(s, rs)]
    return {"fractions_r": pearson(fo, fs), "moves_r": pearson(mo, ms),
            "oracle_moves_mean_abs": statistics.fmean(map(abs, mo)) if mo else None,
            "smartfrz_moves_mean_abs": statistics.fmean(map(abs, ms)) if ms else None}


def _short(block: str) -> str:
    """``bert.encoder.layer.3`` -> ``layer.3``; ``bert.embeddings`` -> ``embeddings``."""
    parts = block.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def table_cells(variants: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    blocks = [b for b in variants[0]["blocks"] if b != variants[0]["head"]]
    header = ["variant", "steps", "acc none / smartfrz", "FLOPs"] + [_short(b) for b in blocks]
    rows = []
    for v in variants:
        o, s = fractions(v)
        acc = f"{100 * v['none_accuracy']:.2f} / {100 * v['smartfrz_accuracy']:.2f}"
        rows.append([v["variant"], str(v["steps"]), acc, f"{v['smartfrz_flops_ratio']:.3f}"]
                    + [f"{a:.2f} / {b:.2f}" for a, b in zip(s, o)])
    return header, rows


def _r(x: float | None) -> str:
    return "n/a (constant)" if x is None or math.isnan(x) else f"{x:+.2f}"


def markdown(results: dict[str, Any]) -> str:
    header, rows = table_cells(results["variants"])
    c = correlations(results["variants"])
    lines = [
        f"MiniLM-L6 / BBC News, the suite's bbc sizes, seed {results['seed']}. Each block cell: SmartFRZ's freeze "
        "step / the oracle's, as a fraction of the run (1.00: never frozen). FLOPs: SmartFRZ's training FLOPs / "
        "`none`'s. Generated by `python -m benchmarks.adaptivity`.", "",
        "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", f"- Correlation of the freeze fractions over every (variant, block): {_r(c['fractions_r'])}.",
              f"- Correlation of their moves against `{REFERENCE}`: {_r(c['moves_r'])} (mean |move|: oracle "
              f"{c['oracle_moves_mean_abs'] or 0:.3f}, SmartFRZ {c['smartfrz_moves_mean_abs'] or 0:.3f} of a run)."]
    return "\n".join(lines) + "\n"


def rich_table(results: dict[str, Any]) -> Table:
    header, rows = table_cells(results["variants"])
    table = Table(title="freeze step / run: smartfrz / oracle")
    for h in header:
        table.add_column(h)
    for r in rows:
        table.add_row(*r)
    return table


def update_markdown(path: Path, section: str) -> None:
    update_section(path, BEGIN, END, section, "## Adaptivity: freeze steps across learning rates and run lengths")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from VARIANTS")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-adaptivity")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the trainer's choice)")
    p.add_argument("--markdown", default=str(ROOT / "BENCHMARKS.md"),
                   help="Markdown file whose adaptivity section is replaced ('' for none)")
    p.add_argument("--max-steps", type=int, default=None, help="cap every run (a smoke test, not a measurement)")
    p.add_argument("--from-json", type=Path, default=None, help="only regenerate the tables from a results.json")
    args = p.parse_args(argv)
    console = Console(width=max(160, Console().width))  # the table has a column per block
    if args.from_json:
        results = json.loads(args.from_json.read_text())
    else:
        names = [n.strip() for n in args.variants.split(",")]
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
        args.out.mkdir(parents=True, exist_ok=True)
        results = {"seed": args.seed, "variants": []}
        for name in names:
            results["variants"].append(run_variant(name, args.seed, args.out, args.threads, console,
                                                  args.max_steps))
            (args.out / "results.json").write_text(json.dumps(results, indent=2))
    section = markdown(results)
    if not args.from_json:
        (args.out / "adaptivity.md").write_text(section)
    console.print(rich_table(results))
    console.print(section.split("\n\n", 2)[-1])
    if args.markdown:
        update_markdown(Path(args.markdown), section)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main))
