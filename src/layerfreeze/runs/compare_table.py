"""The comparison table of ``layerfreeze compare``: each row's ratios to the baseline row (``none``) and its cells,
shared by the terminal, ``compare.md``, the HTML report and the benchmarks, so they all show the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.table import Table

from layerfreeze.runs.rundir import finite
from layerfreeze.runs.summary import format_bytes, format_flops

#: The row every ratio is to: nothing frozen.
BASELINE = "none"


def ratios(row: dict[str, Any], base: dict[str, Any] | None) -> dict[str, float | None]:
    """A row's ``time_ratio``, ``flops_ratio`` and ``tensor_peak_ratio`` (its memory ledger's tensor peak,
    ``tensor_peak_bytes``, :mod:`layerfreeze.runs.ledger`) to the baseline row and its ``accuracy_delta`` (a
    fraction); None where a side has no value (no baseline row, a language model's accuracy, a row that has not
    run, a run without the ledger)."""
    base = base or {}

    def ratio(key: str) -> float | None:
        value, to = row.get(key), base.get(key)
        return value / to if finite(value) and finite(to) and to > 0 else None

    acc, base_acc = row.get("test_accuracy"), base.get("test_accuracy")
    return {"time_ratio": ratio("train_time_s"), "flops_ratio": ratio("flops_total"),
            "tensor_peak_ratio": ratio("tensor_peak_bytes"),
            "accuracy_delta": acc - base_acc if finite(acc) and finite(base_acc) else None}



def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give every row its :func:`ratios` to the :data:`BASELINE` row, keeping those it already has; returns
    ``rows`` (changed in place)."""
    base = next((r for r in rows if r.get("row") == BASELINE), None)
    for r in rows:
        for key, value in ratios(r, base).items():
            if r.get(key) is None:
                r[key] = value
    return rows



def table_cells(r: dict[str, Any], missing: str = "-") -> list[str]:
    """One row's cells under :data:`HEADERS` (the terminal, ``compare.md`` and the HTML report all show these),
    ``missing`` where a value is absent (a row that has not run, no baseline row)."""
    def ratio(x: Any) -> str:
        return f"{x:.3f}" if finite(x) else missing

    def amount(x: Any, fmt: Callable[[Any], str]) -> str:
        return fmt(x) if finite(x) and x >= 0 else missing

    delta = f"{100 * r['accuracy_delta']:+.2f}" if finite(r.get("accuracy_delta")) else missing
    steps = r.get("freeze_steps") or {}
    frozen = ", ".join(f"{b}@{s}" for b, s in steps.items()) if isinstance(steps, dict) else str(steps)
    if r.get("stopped"):  # a row whose training stopped (compare): why, in the last column
        frozen = f"stopped: {str(r['stopped']).split(': ')[0]}"
    return [
        str(r.get("row")), _metric(r, missing), delta,
        f"{r['train_time_s']:.1f}" if finite(r.get("train_time_s")) else missing, ratio(r.get("time_ratio")),
        amount(r.get("flops_total"), format_flops), ratio(r.get("flops_ratio")),
        amount(r.get("peak_memory_bytes"), format_bytes), amount(r.get("tensor_peak_bytes"), format_bytes),
        ratio(r.get("tensor_peak_ratio")), frozen or missing,
    ]



def _metric(r: dict[str, Any], missing: str) -> str:
    """Test accuracy in percent; a language model (text-lm) has none and shows its perplexity."""
    if not finite(r.get("test_accuracy")):
        return f"ppl {r['test_perplexity']:.2f}" if finite(r.get("test_perplexity")) else missing
    return f"{100 * r['test_accuracy']:.2f}"



#: The columns. ``peak mem``: the process's peak RSS (the CUDA allocator's peak on a GPU); ``tensor peak``: the memory
#: ledger's tensor peak (:mod:`layerfreeze.runs.ledger`) and ``peak ratio`` its ratio to ``none``.
HEADERS = ["strategy", "test acc %", "Δ acc pts", "train s", "time ratio", "train FLOPs", "FLOPs ratio",
           "peak mem", "tensor peak", "peak ratio", "frozen block@step"]



def rich_table(results: list[dict[str, Any]]) -> Table:
    """The comparison as a rich table for the terminal."""
    table = Table(title="layerfreeze compare")
    for h in HEADERS:
        table.add_column(h, justify="left" if h in ("strategy", "frozen block@step") else "right",
                         overflow="fold")
    for r in results:
        table.add_row(*table_cells(r))
    return table



def markdown_table(results: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(table_cells(r)) + " |" for r in results]
    return "\n".join(lines) + "\n"
