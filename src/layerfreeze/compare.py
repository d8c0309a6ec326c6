"""``layerfreeze compare``: several strategies on one task, same seed, data order and budget, one after another
in one process, with a table of test accuracy, wall time and FLOPs (and their ratios to ``none``), peak memory and
the step each block froze. A LoRA row (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021,
through the ``peft`` library) shows the parameter-efficient alternative on the same budget.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from . import rundir
from .config import ConfigError, build_config, deep_merge
from .rundir import finite
from .strategies import BUILTIN_STRATEGIES, DEFAULT_STRATEGY
from .telemetry import format_bytes, format_flops

#: The row every ratio is to: nothing frozen.
BASELINE = "none"

#: Rows of a default comparison, in order: the built-in strategies in registration order (``none`` first), then
#: ``lora``, not a freezing strategy but a row of its own. A registered strategy of your own can be named as a row.
DEFAULT_ROWS = (*BUILTIN_STRATEGIES, "lora")


def row_config(base: dict[str, Any], row: str, run_dir: Path,
               row_params: dict[str, dict[str, Any]] | None = None,
               row_overrides: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The config dict of one row: the base config with the row's strategy (or LoRA) and its own run folder.

    ``freeze.params`` of the base apply only to the row of the base's strategy (the default strategy when the base
    names none); other rows run with their strategy's defaults (and the task preset). ``row_params`` maps a row
    to parameters of its own (``{"autofreeze": {"interval": 20}}``), applied last. ``row_overrides`` maps a row
    to config keys of its own, merged over everything else (``{"lora": {"train": {"lr": 1e-3}}}``: LoRA wants a
    larger learning rate than full fine-tuning).
    """
    cfg = deep_merge(base, {"run": {"dir": str(rundir.row_dir(run_dir, row)), "resume": None}})
    freeze = cfg.setdefault("freeze", {})
    base_strategy = freeze.get("strategy", DEFAULT_STRATEGY)
    params = freeze.get("params", {}) if base_strategy == row else {}
    if row == "lora":
        freeze["strategy"], freeze["params"] = "none", {}
        cfg = deep_merge(cfg, {"model": {"lora": {"r": 8}}})
    else:
        freeze["strategy"], freeze["params"] = row, {**params, **(row_params or {}).get(row, {})}
    return deep_merge(cfg, (row_overrides or {}).get(row, {}))


def _row_build(row: str, cfg: dict[str, Any]) -> Any:
    """``build_config`` of one row, its error naming the row (``row lora: Invalid configuration: ...``)."""
    try:
        return build_config(cfg)
    except ConfigError as exc:
        raise ConfigError(f"row {row}: {exc}") from None


def _check_block_params(configs: list[tuple[str, Any]]) -> None:
    """Check the strategy parameters that depend on the model's blocks (``static``'s k) for every row before the
    first row trains: the model is built once per distinct task/model/data config to count its blocks.

    Raises:
        ConfigError: naming the row and what to change.
    """
    from .blocks import discover_blocks
    from .strategies import STRATEGIES, Strategy
    from .tasks import build_task
    from .train_setup import build_strategy

    counts: dict[str, int] = {}
    for row, cfg in configs:
        if row == "lora" or STRATEGIES[cfg.freeze.strategy].validate is Strategy.validate:
            continue  # nothing to check against the blocks: don't build the model for it
        key = json.dumps([cfg.task, cfg.model.model_dump(mode="json"), cfg.data.model_dump(mode="json")],
                         sort_keys=True)
        if key not in counts:
            counts[key] = len(discover_blocks(build_task(cfg).model, cfg.model.blocks))
        try:
            build_strategy(cfg, counts[key])
        except ConfigError as exc:
            raise ConfigError(f"row {row}: {exc}") from None


def freeze_steps(summary: dict[str, Any]) -> dict[str, int]:
    """Block name -> the step it was (last) frozen at, for blocks frozen at the end of the run."""
    steps: dict[str, int] = {}
    for event in summary.get("freeze_timeline", []):
        if event["action"] == "freeze":
            steps[event["block"]] = event["step"]
        else:
            steps.pop(event["block"], None)
    return steps


def compare(base: dict[str, Any], rows: list[str], run_dir: str | Path, console: Console | None = None,
            row_params: dict[str, dict[str, Any]] | None = None,
            row_overrides: dict[str, dict[str, Any]] | None = None,
            row_callbacks: dict[str, list[Callable[[Any], None]]] | None = None) -> list[dict[str, Any]]:
    """Run every row and return one result dict per row (also written to ``run_dir/compare.json`` and ``.md``).

    Args:
        base: A user config dict (validated per row); ``freeze.params`` apply to the row of the same strategy.
        rows: Strategy names, ``"lora"`` for the LoRA row; ``"none"`` should come first (ratios are to it).
        row_params: Per-row strategy parameters, e.g. ``{"autofreeze": {"interval": 20}}``.
        row_overrides: Per-row config keys, e.g. ``{"lora": {"train": {"lr": 1e-3}}}`` (see :func:`row_config`).
        row_callbacks: Per-row trainer ``step_callbacks`` (see :class:`~layerfreeze.trainer.Trainer`).

    A row whose training stops with a :class:`~layerfreeze.trainer.DivergenceError` (a non-finite loss, or a loss
    at chance level for ``run.divergence_window_steps`` steps) does not end the comparison: its result is
    ``{"row", "stopped": <the error's message>, "run_dir"}`` (no accuracy, time or FLOPs; the table says why), its
    run folder keeps what the trainer wrote (metrics, and the checkpoint to resume unless ``run.checkpoint`` is off),
    and the next row runs.

    Raises:
        ConfigError: a row's config is invalid (checked for every row before the first run starts).
    """
    from .trainer import DivergenceError, Trainer

    console = console or Console()
    run_dir = Path(run_dir)
    configs = [(row, _row_build(row, row_config(base, row, run_dir, row_params, row_overrides)))
               for row in rows]  # validate first
    for row, _ in configs:
        try:
            rundir.check_run_dir(rundir.row_dir(run_dir, row))
        except ConfigError as exc:
            raise ConfigError(f"row {row}: {exc}") from None
    _check_block_params(configs)
    results = []
    for row, config in configs:
        console.print(f"[bold]compare[/]: {row} ({len(results) + 1}/{len(configs)})")
        try:
            summary = Trainer(config, step_callbacks=(row_callbacks or {}).get(row)).run()
        except DivergenceError as exc:
            console.print(f"[bold yellow]compare[/]: row {row} stopped, the next row runs: {exc}", highlight=False)
            results.append({"row": row, "stopped": str(exc), "run_dir": str(config.run.dir)})
            rundir.write_compare(run_dir, results)
            continue
        results.append({"row": row, **summary, "freeze_steps": freeze_steps(summary)})
        rundir.write_compare(run_dir, results)
    add_ratios(results)
    rundir.write_compare(run_dir, results, markdown_table(results))
    console.print(rich_table(results))
    return results


def ratios(row: dict[str, Any], base: dict[str, Any] | None) -> dict[str, float | None]:
    """A row's ``time_ratio`` and ``flops_ratio`` to the baseline row and its ``accuracy_delta`` (a fraction);
    None where a side has no value (no baseline row, a language model's accuracy, a row that has not run)."""
    base = base or {}

    def ratio(key: str) -> float | None:
        value, to = row.get(key), base.get(key)
        return value / to if finite(value) and finite(to) and to > 0 else None

    acc, base_acc = row.get("test_accuracy"), base.get("test_accuracy")
    return {"time_ratio": ratio("train_time_s"), "flops_ratio": ratio("flops_total"),
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
        amount(r.get("peak_memory_bytes"), format_bytes), frozen or missing,
    ]


def _metric(r: dict[str, Any], missing: str) -> str:
    """Test accuracy in percent; a language model (text-lm) has none and shows its perplexity."""
    if not finite(r.get("test_accuracy")):
        return f"ppl {r['test_perplexity']:.2f}" if finite(r.get("test_perplexity")) else missing
    return f"{100 * r['test_accuracy']:.2f}"


HEADERS = ["strategy", "test acc %", "Δ acc pts", "train s", "time ratio", "train FLOPs", "FLOPs ratio",
           "peak mem", "frozen block@step"]


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
