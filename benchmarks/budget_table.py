"""Memory budgets on the default job: the plan's predicted tensor peak against the one a full run measures.

Issue 31, item 3's check. On the default job (``layerfreeze train`` with no arguments: MiniLM-L6 on BBC News, 3
epochs, 128 tokens, batch 32, the default strategy), through the CLI as a user runs it:

1. ``layerfreeze train --strategy none``: ``none``'s tensor peak (the memory ledger's, sampling every step:
   ``run.ledger_every=1``; :mod:`layerfreeze.runs.ledger`) and its test accuracy;
2. for budgets of 80%, 60% and 40% of that peak (``--fractions``; given in bytes): ``layerfreeze plan --memory B``
   (two real steps on the first batch with nothing frozen; the shortest frozen prefix whose predicted peak fits,
   :func:`layerfreeze.budget.plan_memory`), then ``layerfreeze train --memory-budget B`` (the plan applied: the
   prefix frozen from the start, never thawed; the strategy may freeze more), and the run's measured tensor peak
   beside the predicted one (``summary.json``'s ``memory_plan``), the error (measured / predicted - 1) and accuracy;
3. ``layerfreeze plan`` with a budget nothing meets (1% of ``none``'s peak: less than the parameters alone): its exit
   code (2) and message (the smallest reachable peak).

    python -m benchmarks.budget_table                              # the full default job (4 full runs)
    python -m benchmarks.budget_table --markdown BENCHMARKS.md     # and the table into BENCHMARKS.md's section
    python -m benchmarks.budget_table --quick                      # 1 epoch of 48 samples, 16 tokens, batch 8

Writes ``OUT/results.json``, ``OUT/table.md``, each run's folder under ``OUT/runs/`` and its CLI output in
``OUT/logs/``. Bytes are exact and do not depend on the machine's load; no times are reported.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from benchmarks.cli import entry
from layerfreeze import cli
from layerfreeze.runs.summary import format_bytes

MARK_BEGIN = "<!-- budget_table:begin -->"
MARK_END = "<!-- budget_table:end -->"
#: The budgets tried, as fractions of ``none``'s measured tensor peak (issue 31, item 3).
FRACTIONS = (0.8, 0.6, 0.4)
#: A budget nothing meets: 1% of ``none``'s peak is less than the model's parameters alone.
IMPOSSIBLE = 0.01
#: ``--quick``: the default job on a few samples (a check that the script runs end to end, seconds on a tiny model).
QUICK = ["--epochs", "1", "--batch-size", "8", "--limit-train", "48", "--limit-test", "32",
         "--set", "model.max_length=16"]


def job_flags(args: argparse.Namespace) -> list[str]:
    """The CLI flags of every run and plan: the default job (``--quick``: smaller), the seed, ``--set`` extras."""
    flags = ["--seed", str(args.seed), "--set", "run.ledger_every=1"]
    if args.model:
        flags += ["--model", args.model]
    if args.strategy:
        flags += ["--strategy", args.strategy]
    if args.threads:
        flags += ["--set", f"run.threads={args.threads}"]
    if args.device:
        flags += ["--device", args.device]
    if args.quick:
        flags += QUICK
    for item in args.set:
        flags += ["--set", item]
    return flags


def run_cli(argv: list[str], log: Path) -> tuple[int, str, str]:
    """``layerfreeze ARGV`` in this process; ``(exit code, stdout, stderr)``, both also written to ``log``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"$ layerfreeze {' '.join(argv)}\n{out.getvalue()}\n--- stderr ---\n{err.getvalue()}"
                   f"\nexit code {code}\n")
    return code, out.getvalue(), err.getvalue()


def train(name: str, flags: list[str], out: Path) -> dict[str, Any]:
    """``layerfreeze train FLAGS`` into ``OUT/runs/NAME``; its ``summary.json``.

    Raises:
        RuntimeError: the run exited non-zero (the message names its log).
    """
    run_dir = out / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    log = out / "logs" / f"{name}.log"
    code, _, err = run_cli(["train", *flags, "--run-dir", str(run_dir), "--no-progress", "--no-tensorboard",
                            "--no-report", "--set", "run.checkpoint=false"], log)
    if code != 0:
        raise RuntimeError(f"layerfreeze train ({name}) exited {code}: {err.strip()[-600:]} (log: {log})")
    return json.loads((run_dir / "summary.json").read_text())


def plan(name: str, budget: str, flags: list[str], out: Path) -> tuple[int, dict[str, Any] | None, str]:
    """``layerfreeze plan --memory BUDGET FLAGS --json``; ``(exit code, the plan or None, stderr)``."""
    path = out / "plans" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    code, _, err = run_cli(["plan", "--memory", budget, *flags, "--json", str(path)], out / "logs" / f"plan-{name}.log")
    return code, json.loads(path.read_text()) if code == 0 else None, err


def measure(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Every run and plan of the table; the results (plain data)."""
    flags = job_flags(args)
    none = train("none", [*flags, "--strategy", "none"], out)  # the last --strategy wins
    peak = int(none["tensor_peak_bytes"])
    rows = []
    for fraction in args.fractions:
        budget = f"{int(fraction * peak)}B"
        name = f"budget-{round(100 * fraction)}"
        code, planned, err = plan(name, budget, flags, out)
        row: dict[str, Any] = {"fraction": fraction, "budget": budget, "budget_bytes": int(fraction * peak)}
        if code != 0:
            row.update(plan_exit_code=code, plan_error=err.strip())
            rows.append(row)
            continue
        summary = train(name, [*flags, "--memory-budget", budget], out)
        got = summary["memory_plan"]
        row.update(
            k=planned["k"], frozen_from_start=planned["frozen_from_start"], blocks=len(planned["block_names"]),
            plan_predicted_bytes=planned["predicted_peak_bytes"], predicted_bytes=got["predicted_peak_bytes"],
            measured_bytes=got["measured_peak_bytes"], error=got["error"], within_budget=got["within_budget"],
            none_peak_first_batch=planned["none_peak_bytes"], frozen_at_end=summary["frozen_blocks"],
            strategy=summary["strategy"], test_accuracy=summary["test_accuracy"], steps=summary["steps"])
        rows.append(row)
    impossible = f"{max(1, int(IMPOSSIBLE * peak))}B"
    code, _, err = plan("impossible", impossible, flags, out)
    return {"command": " ".join(["python", "-m", "benchmarks.budget_table", *args.argv]), "flags": flags,
            "none": {"tensor_peak_bytes": peak, "test_accuracy": none["test_accuracy"], "steps": none["steps"],
                     "model": none["model"], "task": none["task"]},
            "rows": rows, "impossible": {"budget": impossible, "exit_code": code, "message": " ".join(err.split())}}


def markdown(results: dict[str, Any]) -> str:
    """The table (Markdown) and the impossible budget's message."""
    none = results["none"]
    head = ["budget", "frozen from the start", "frozen at the end", "predicted peak", "measured peak", "error",
            "within budget", "test acc %"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             f"| none (no budget) | 0 | 0 | - | {format_bytes(none['tensor_peak_bytes'])} | - | - | "
             f"{100 * none['test_accuracy']:.2f} |"]
    for r in results["rows"]:
        budget = f"{100 * r['fraction']:.0f}% = {format_bytes(r['budget_bytes'])}"
        if "plan_error" in r:
            lines.append(f"| {budget} | plan refused (exit {r['plan_exit_code']}) | - | - | - | - | - | - |")
            continue
        frozen = ", ".join(r["frozen_from_start"]) if r["k"] <= 3 else (
            f"{r['frozen_from_start'][0]} .. {r['frozen_from_start'][-1]}")
        acc = r["test_accuracy"]
        lines.append(
            f"| {budget} | {r['k']} of {r['blocks']}" + (f" ({frozen})" if r["k"] else "") + f" | "
            f"{len(r['frozen_at_end'])} | {format_bytes(r['predicted_bytes'])} | {format_bytes(r['measured_bytes'])} | "
            f"{100 * r['error']:+.2f}% | {'yes' if r['within_budget'] else 'no'} | "
            + (f"{100 * acc:.2f}" if acc is not None else "-") + " |")
    imp = results["impossible"]
    return ("\n".join(lines) + "\n\n"
            f"Impossible budget ({imp['budget']}, 1% of none's peak): `layerfreeze plan` exit code "
            f"{imp['exit_code']}: {imp['message']}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 epoch of 48 samples, 16 tokens, batch 8")
    parser.add_argument("--fractions", default=",".join(f"{f:g}" for f in FRACTIONS),
                        help="budgets as fractions of none's tensor peak, comma-separated")
    parser.add_argument("--model", help="a local Hugging Face model folder instead of MiniLM-L6 (a quick check)")
    parser.add_argument("--strategy", help="the budget runs' strategy (default: the CLI's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="run.threads (default: torch's)")
    parser.add_argument("--device", help="run.device (auto, cpu, cuda:N)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config key for every run")
    parser.add_argument("--out", default="runs/bench-budget")
    parser.add_argument("--markdown", help="also write the table into this Markdown file's budget_table section")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args.fractions = [float(f) for f in args.fractions.split(",")]
    except ValueError:
        parser.error(f"--fractions {args.fractions!r}: comma-separated numbers in (0, 1], e.g. 0.8,0.6,0.4")
    if not all(0 < f <= 1 for f in args.fractions):
        parser.error(f"--fractions {args.fractions}: each in (0, 1]")
    out = Path(args.out)
    results = measure(args, out)
    text = markdown(results)
    print(text)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(text)
    if args.markdown:
        from benchmarks.markdown_section import update_section

        update_section(Path(args.markdown), MARK_BEGIN, MARK_END, text, "## Memory budgets: predicted vs measured")
    print(f"results: {out / 'results.json'}, {out / 'table.md'}; logs: {out / 'logs'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main))
