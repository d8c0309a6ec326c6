"""The comparison table of ``layerfreeze compare``: each row's ratios to the baseline row (``none``) and its cells,
shared by the terminal, ``compare.md``, the HTML report and the benchmarks, so they all show the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.table import Table

from layerfreeze.runs.rundir import finite
from layerfreeze.runs.summary import AFTER_LAST_STEP, format_bytes, format_flops

#: The row every ratio is to: nothing frozen.
BASELINE = "none"


def freeze_steps(summary: dict[str, Any]) -> dict[str, int]:
    """Block name -> the step it was (last) frozen at, for blocks frozen at the end of the run."""
    steps: dict[str, int] = {}
    for event in summary.get("freeze_timeline", []):
        if event["action"] == "freeze":
            steps[event["block"]] = event["step"]
        else:
            steps.pop(event["block"], None)
    return steps


def rotation_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """How a rotating strategy (``lisa``, ``badam``) moved through the run, from its summary's freeze timeline:
    ``switches`` (the steps after the start at which blocks switched on), ``mean_trainable_fraction`` (the share of
    the blocks trainable during a step, averaged over the run's steps: the frozen set after step ``s``'s events is
    the one step ``s + 1`` trains) and ``most_trainable`` (the most blocks trainable at once)."""
    blocks = list(summary.get("blocks") or [])
    steps = int(summary.get("steps") or 0)
    events = sorted(summary.get("freeze_timeline") or [], key=lambda e: e["step"])
    frozen: set[str] = set()
    trainable, i = [], 0
    for step in range(1, steps + 1):
        while i < len(events) and events[i]["step"] < step:
            (frozen.add if events[i]["action"] == "freeze" else frozen.discard)(events[i]["block"])
            i += 1
        trainable.append(len(blocks) - len(frozen))
    switches = len({e["step"] for e in events if e["action"] == "thaw" and e["step"] > 0})
    mean = sum(trainable) / (len(trainable) * len(blocks)) if trainable and blocks else None
    return {"switches": switches, "mean_trainable_fraction": mean, "most_trainable": max(trainable, default=None)}


def row_result(row: str, summary: dict[str, Any], rotates: bool) -> dict[str, Any]:
    """A finished row of ``compare.json``: ``row``, the run's summary, its :func:`freeze_steps` and, for a strategy
    that ``rotates`` (``lisa``, ``badam``), its :func:`rotation_summary`."""
    return {"row": row, **summary, "freeze_steps": freeze_steps(summary),
            **({"rotation": rotation_summary(summary)} if rotates else {})}


def ratios(row: dict[str, Any], base: dict[str, Any] | None) -> dict[str, float | None]:
    """A row's ``time_ratio``, ``flops_ratio`` and ``tensor_peak_ratio`` (its memory ledger's tensor peak,
    ``tensor_peak_bytes``, :mod:`layerfreeze.runs.ledger`) to the baseline row, its ``accuracy_delta`` (a fraction)
    and, for a language model, its ``perplexity_ratio`` (test perplexity over the baseline's: below 1 is better);
    None where a side has no value (no baseline row, a language model's accuracy, a classifier's perplexity, a row
    that has not run, a run without the ledger)."""
    base = base or {}

    def ratio(key: str) -> float | None:
        value, to = row.get(key), base.get(key)
        return value / to if finite(value) and finite(to) and to > 0 else None

    acc, base_acc = row.get("test_accuracy"), base.get("test_accuracy")
    return {"time_ratio": ratio("train_time_s"), "flops_ratio": ratio("flops_total"),
            "tensor_peak_ratio": ratio("tensor_peak_bytes"), "perplexity_ratio": ratio("test_perplexity"),
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
    """One row's cells under :func:`headers` (the terminal, ``compare.md`` and the HTML report all show these),
    ``missing`` where a value is absent (a row that has not run, no baseline row). The metric's two cells follow the
    task: test accuracy in percent and its difference to the baseline in points, or (a language model) test
    perplexity and its ratio to the baseline's. The last column lists the blocks frozen at the end with their step
    (:func:`frozen_cell`: those frozen at the run's last step apart, as saving nothing), or for a rotating strategy
    (``lisa``, ``badam``: ``r["rotation"]``) how often the trained layers switched and the mean share of blocks that
    trained."""
    def ratio(x: Any) -> str:
        return f"{x:.3f}" if finite(x) else missing

    def amount(x: Any, fmt: Callable[[Any], str]) -> str:
        return fmt(x) if finite(x) and x >= 0 else missing

    if is_language_model(r):
        metric, change = f"{r['test_perplexity']:.2f}", ratio(r.get("perplexity_ratio"))
    else:
        metric = f"{100 * r['test_accuracy']:.2f}" if finite(r.get("test_accuracy")) else missing
        change = f"{100 * r['accuracy_delta']:+.2f}" if finite(r.get("accuracy_delta")) else missing
    steps = r.get("freeze_steps") or {}
    frozen = frozen_cell(steps, r.get("steps")) if isinstance(steps, dict) else str(steps)
    rotation = r.get("rotation")
    if isinstance(rotation, dict) and finite(rotation.get("mean_trainable_fraction")):
        frozen = (f"rotates: {rotation['switches']} switches, {100 * rotation['mean_trainable_fraction']:.0f}% of "
                  "blocks trainable on average")
    if r.get("stopped"):  # a row whose training stopped (compare): why, in the last column
        frozen = f"stopped: {str(r['stopped']).split(': ')[0]}"
    return [
        str(r.get("row")), metric, change,
        f"{r['train_time_s']:.1f}" if finite(r.get("train_time_s")) else missing, ratio(r.get("time_ratio")),
        amount(r.get("flops_total"), format_flops), ratio(r.get("flops_ratio")),
        amount(r.get("peak_memory_bytes"), format_bytes), amount(r.get("tensor_peak_bytes"), format_bytes),
        ratio(r.get("tensor_peak_ratio")), frozen or missing,
    ]


def frozen_cell(steps: dict[str, int], last_step: Any = None) -> str:
    """The ``frozen block@step`` cell: ``"features.0@4, features.1@8"``; blocks frozen at ``last_step`` (the run's
    steps) grouped after ``"after the last step (saved nothing): "``, since no step trained with them frozen
    (``linear`` freezes its last blocks at the final epoch end)."""
    last = int(last_step) if finite(last_step) and last_step > 0 else None
    during = ", ".join(f"{b}@{s}" for b, s in steps.items() if last is None or s < last)
    after = ", ".join(f"{b}@{s}" for b, s in steps.items() if last is not None and s >= last)
    return "; ".join(([during] if during else []) + ([f"{AFTER_LAST_STEP} (saved nothing): {after}"] if after else []))


def is_language_model(r: dict[str, Any]) -> bool:
    """Whether a row is a language model's (``text-lm``): a perplexity and no accuracy."""
    return not finite(r.get("test_accuracy")) and finite(r.get("test_perplexity"))


#: The columns. ``peak mem``: the process's peak RSS (the CUDA allocator's peak on a GPU); ``tensor peak``: the memory
#: ledger's tensor peak (:mod:`layerfreeze.runs.ledger`) and ``tensor peak ratio`` its ratio to ``none``'s.
HEADERS = ["strategy", "test acc %", "Δ acc pts", "train s", "time ratio", "train FLOPs", "FLOPs ratio",
           "peak mem", "tensor peak", "tensor peak ratio", "frozen block@step"]

#: The columns of a language model's comparison (``text-lm``): its metric is perplexity (lower is better).
LM_HEADERS = ["strategy", "test ppl", "ppl ratio", *HEADERS[3:]]


def headers(results: list[dict[str, Any]]) -> list[str]:
    """The columns of a comparison: :data:`LM_HEADERS` when its rows are a language model's (every row that ran
    has a perplexity and no accuracy), else :data:`HEADERS`."""
    ran = [r for r in results if finite(r.get("test_accuracy")) or finite(r.get("test_perplexity"))]
    return LM_HEADERS if ran and all(is_language_model(r) for r in ran) else HEADERS


def rich_table(results: list[dict[str, Any]]) -> Table:
    """The comparison as a rich table for the terminal: every column but the last (what froze when), which
    :func:`frozen_lines` gives below the table, so the table fits 120 columns (headers over two lines, numbers never
    broken)."""
    notes = [n for n in (precision_note(results), budget_note(results)) if n]
    table = Table(title="\n".join(["layerfreeze compare", *notes]), padding=(0, 1))
    for h in headers(results)[:-1]:
        words = h.split(" ")
        label = h if len(words) == 1 else " ".join(words[:-1]) + "\n" + words[-1]
        table.add_column(label, justify="left" if h == "strategy" else "right", no_wrap=True)
    for r in results:
        table.add_row(*table_cells(r)[:-1])
    return table


def precision_note(results: list[dict[str, Any]]) -> str | None:
    """How the rows ran when it is not float32 eager (``train.precision``, ``train.compile``): ``"every row under
    bf16-mixed, torch.compile blocks (its train s counts 12.3 s of compiling in all)"``; None for 32-true eager
    rows, whose table says nothing more."""
    ran = [r for r in results if r.get("precision") or r.get("compile")]
    precisions = sorted({str(r.get("precision")) for r in ran if r.get("precision")})
    compiled = [r["compile"] for r in ran if isinstance(r.get("compile"), dict)]
    if precisions in ([], ["32-true"]) and not compiled:
        return None
    parts = [f"every row under {'/'.join(precisions)}"] if precisions else []
    if compiled:
        seconds = sum(float(c.get("train_compile_s") or 0.0) for c in compiled)
        parts.append(f"torch.compile {compiled[0].get('mode')} (train s counts {seconds:.1f} s of compiling in all)")
    return ", ".join(parts)


def budget_note(results: list[dict[str, Any]]) -> str | None:
    """What a memory budget (``freeze.memory_budget``, ``compare --memory-budget``) changed in every row, ``none``
    included: the blocks its plan kept frozen from the start (``"every row under the memory budget 60%: blocks
    0..3 frozen from the start, none's row too"``); None when no row ran under a budget."""
    plans = [r["memory_plan"] for r in results if isinstance(r.get("memory_plan"), dict)]
    if not plans:
        return None
    budget, ks = plans[0].get("budget"), sorted({p.get("k", 0) for p in plans})
    frozen = ("nothing frozen from the start" if ks == [0] else
              f"blocks 0..{ks[0] - 1} frozen from the start, none's row too" if len(ks) == 1 else
              f"the first {'/'.join(map(str, ks))} blocks frozen from the start (by row), none's row too")
    return f"every row under the memory budget {budget}: {frozen}"


def frozen_lines(results: list[dict[str, Any]]) -> list[str]:
    """The table's last column (:func:`table_cells`), one line per row: ``"static: features.0@0, ..."``, or a rotating
    strategy's switches, or why a row stopped."""
    lines = []
    for r in results:
        cell = table_cells(r)[-1]
        plain = not cell.startswith(("rotates:", "stopped:"))
        lines.append(f"{r.get('row')}: " + (f"frozen block@step: {cell}" if plain else cell))
    return lines


def markdown_table(results: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table."""
    head = headers(results)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(table_cells(r)) + " |" for r in results]
    notes = "".join(f"\n{n[0].upper()}{n[1:]}.\n" for n in (precision_note(results), budget_note(results)) if n)
    return "\n".join(lines) + "\n" + notes
