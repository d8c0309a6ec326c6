"""``layerfreeze compare``: several strategies on one task, same seed, data order and budget, one after another
in one process, with a table of test accuracy, wall time and FLOPs (and their ratios to ``none``), peak memory and
the step each block froze. A LoRA row (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021,
through the ``peft`` library) shows the parameter-efficient alternative on the same budget.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from layerfreeze.distributed.comm import launched_main_rank
from layerfreeze.errors import ConfigError
from layerfreeze.runs import rundir
from layerfreeze.runs.compare_table import (
    add_ratios,
    frozen_lines,
    markdown_table,
    rich_table,
    row_result,
)
from layerfreeze.strategies import BUILTIN_STRATEGIES, DEFAULT_STRATEGY
from layerfreeze.train.config import build_config
from layerfreeze.train.config_file import deep_merge

#: Rows of a default comparison, in order: the built-in strategies in registration order (``none`` first), then
#: ``lora``, not a freezing strategy but a row of its own. A registered strategy of your own can be named as a row.
DEFAULT_ROWS = (*BUILTIN_STRATEGIES, "lora")

#: The rank of the ``lora`` row; a row ``lora-r<N>`` (``lora-r4``, ``lora-r16``) is LoRA of rank N.
LORA_RANK = 8


def lora_rank(row: str) -> int | None:
    """The LoRA rank a comparison row names: :data:`LORA_RANK` for ``lora``, ``N`` for ``lora-r<N>`` (an integer
    ``>= 1``, no leading zero); None for any other row (a strategy's)."""
    if row == "lora":
        return LORA_RANK
    found = re.fullmatch(r"lora-r([1-9][0-9]*)", row)
    return int(found.group(1)) if found else None


def unknown_rows(rows: list[str]) -> list[str]:
    """The rows that are neither a registered strategy nor a LoRA row (``lora``, ``lora-r<N>``)."""
    from layerfreeze.strategies import STRATEGIES

    return [r for r in rows if r not in STRATEGIES and lora_rank(r) is None]


def row_config(base: dict[str, Any], row: str, run_dir: Path,
               row_params: dict[str, dict[str, Any]] | None = None,
               row_overrides: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The config dict of one row: the base config with the row's strategy (or LoRA) and its own run folder.

    ``freeze.params`` of the base apply only to the row of the base's strategy (the default strategy when the base
    names none); other rows run with their strategy's defaults (and the task preset). A LoRA row (``lora``,
    ``lora-r<N>``: :func:`lora_rank`) trains with strategy ``none`` and ``model.lora.r`` set to its rank.
    ``row_params`` maps a row to parameters of its own (``{"autofreeze": {"interval": 20}}``), applied last.
    ``row_overrides`` maps a row to config keys of its own, merged over everything else (``{"lora": {"train":
    {"lr": 1e-3}}}``: LoRA wants a larger learning rate than full fine-tuning).
    """
    cfg = deep_merge(base, {"run": {"dir": str(rundir.row_dir(run_dir, row)), "resume": None}})
    freeze = cfg.setdefault("freeze", {})
    base_strategy = freeze.get("strategy", DEFAULT_STRATEGY)
    params = freeze.get("params", {}) if base_strategy == row else {}
    rank = lora_rank(row)
    if rank is not None:
        freeze["strategy"], freeze["params"] = "none", {}
        cfg = deep_merge(cfg, {"model": {"lora": {"r": rank}}})
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
    from layerfreeze.models.discovery import discover_blocks
    from layerfreeze.strategies import STRATEGIES, Strategy
    from layerfreeze.train.setup import build_strategy
    from layerfreeze.train.tasks import build_model

    counts: dict[str, int] = {}
    for row, cfg in configs:
        if lora_rank(row) is not None or STRATEGIES[cfg.freeze.strategy].validate is Strategy.validate:
            continue  # nothing to check against the blocks: don't build the model for it
        key = json.dumps([cfg.task, cfg.model.model_dump(mode="json"), cfg.data.model_dump(mode="json")],
                         sort_keys=True)
        if key not in counts:
            counts[key] = len(discover_blocks(build_model(cfg)[0], cfg.model.blocks))
        try:
            build_strategy(cfg, counts[key])
        except ConfigError as exc:
            raise ConfigError(f"row {row}: {exc}; set this row's parameter with -p {row}.NAME=VALUE (`layerfreeze "
                              "strategies` lists them)") from None


@contextlib.contextmanager
def _interrupts() -> Iterator[list[int]]:
    """While a comparison runs: a Ctrl-C is recorded (the list yielded) and raised as usual. Between two rows Python
    may raise it inside a weakref callback or a ``__del__``, where it is printed and dropped ("Exception ignored
    in ..."), and the comparison ran every row left; the record makes the loop stop before the next row. Inside a
    row the trainer's own handler answers it (it stops after the step and checkpoints). Outside the main thread
    (no signal handlers there) nothing is installed."""
    interrupted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return

    def on_sigint(signum: int, frame: Any) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def _rotates(strategy: str) -> bool:
    """Whether a registered strategy rotates which layers train (a :class:`~layerfreeze.strategies.base.
    LayerRotation`: ``lisa``, ``badam``), so a comparison summarizes its rotation rather than its freeze steps."""
    from layerfreeze.strategies import STRATEGIES
    from layerfreeze.strategies.base import LayerRotation

    cls = STRATEGIES.get(strategy)
    return isinstance(cls, type) and issubclass(cls, LayerRotation)


def compare(base: dict[str, Any], rows: list[str], run_dir: str | Path, console: Console | None = None,
            row_params: dict[str, dict[str, Any]] | None = None,
            row_overrides: dict[str, dict[str, Any]] | None = None,
            row_callbacks: dict[str, list[Callable[[Any], None]]] | None = None) -> list[dict[str, Any]]:
    """Run every row and return one result dict per row (also written to ``run_dir/compare.json`` and ``.md``):
    the row's summary, ``freeze_steps`` (:func:`~layerfreeze.runs.compare_table.freeze_steps`), for a rotating
    strategy ``rotation`` (:func:`~layerfreeze.runs.compare_table.rotation_summary`), and its ratios to the ``none``
    row (:func:`~layerfreeze.runs.compare_table.ratios`).

    Args:
        base: A user config dict (validated per row); ``freeze.params`` apply to the row of the same strategy.
        rows: Strategy names, ``"lora"`` for the LoRA row (rank 8), ``"lora-r<N>"`` for LoRA of rank N; ``"none"``
            should come first (ratios are to it).
        row_params: Per-row strategy parameters, e.g. ``{"autofreeze": {"interval": 20}}``.
        row_overrides: Per-row config keys, e.g. ``{"lora": {"train": {"lr": 1e-3}}}`` (see :func:`row_config`).
        row_callbacks: Per-row trainer ``step_callbacks`` (see :class:`~layerfreeze.train.trainer.Trainer`).

    A row whose training stops with a :class:`~layerfreeze.train.step.DivergenceError` (a non-finite loss, or a loss
    at chance level for ``run.divergence_window_steps`` steps) does not end the comparison: its result is
    ``{"row", "stopped": <the error's message>, "run_dir"}`` (no accuracy, time or FLOPs; the table says why), its
    run folder keeps what the trainer wrote (metrics, and the checkpoint to resume unless ``run.checkpoint`` is off),
    and the next row runs. A Ctrl-C (or SIGTERM) ends the comparison: the interrupted row (``"stopped":
    "interrupted ..."``) and the rows not run (``"stopped": "not run ..."``) are written to ``compare.json`` and the
    table before the interrupt is re-raised; a row finished later with ``layerfreeze train --resume`` is read from its
    run folder by the report (:func:`~layerfreeze.runs.report.read.load_compare`).

    Raises:
        ConfigError: a row named twice, or a row's config is invalid (checked for every row before the first run
            starts).
    """
    from layerfreeze.train.step import DivergenceError
    from layerfreeze.train.trainer import Trainer

    console = console or Console()
    if not launched_main_rank():  # under torchrun rank 0 alone speaks
        console = Console(quiet=True)
    run_dir = Path(run_dir)
    twice = sorted({r for r in rows if list(rows).count(r) > 1})
    if twice:
        raise ConfigError(f"rows: {', '.join(twice)} named more than once (--rows); each row runs once, in a run "
                          "folder named after it. Name each row once; to compare one strategy under other settings, "
                          "run another compare")
    configs = [(row, _row_build(row, row_config(base, row, run_dir, row_params, row_overrides)))
               for row in rows]  # validate first
    for row, _ in configs:
        try:
            rundir.check_run_dir(rundir.row_dir(run_dir, row))
        except ConfigError as exc:
            raise ConfigError(f"row {row}: {exc}") from None
    _check_block_params(configs)
    results: list[dict[str, Any]] = []
    with _interrupts() as interrupted:
        for at, (row, config) in enumerate(configs):
            rotates, started, done = _rotates(config.freeze.strategy), False, False
            try:
                if interrupted:  # a Ctrl-C between rows that landed where Python drops exceptions (a weakref callback)
                    raise KeyboardInterrupt
                console.print(f"[bold]compare[/]: {row} ({len(results) + 1}/{len(configs)})")
                started = True
                summary = Trainer(config, step_callbacks=(row_callbacks or {}).get(row)).run()
                results.append(row_result(row, summary, rotates))
                done = True
                rundir.write_compare(run_dir, results)
            except DivergenceError as exc:
                console.print(f"[bold yellow]compare[/]: row {row} stopped, the next row runs: {escape(str(exc))}",
                              highlight=False)
                results.append({"row": row, "stopped": str(exc), "run_dir": str(config.run.dir), "rotates": rotates})
                rundir.write_compare(run_dir, results)
                continue
            except KeyboardInterrupt:  # the table says which rows ran, which was cut and which never started
                if started and not done:
                    results.append({"row": row, "stopped": "interrupted: finish it with layerfreeze train --resume "
                                    f"{config.run.dir}", "run_dir": str(config.run.dir), "rotates": rotates})
                results += [{"row": r, "stopped": "not run: the comparison was interrupted before it",
                             "run_dir": str(c.run.dir), "rotates": _rotates(c.freeze.strategy)}
                            for r, c in configs[at + int(started):]]
                add_ratios(results)
                rundir.write_compare(run_dir, results, markdown_table(results))
                raise
    add_ratios(results)
    rundir.write_compare(run_dir, results, markdown_table(results))
    console.print(rich_table(results))
    for line in frozen_lines(results):
        console.print(line, highlight=False)
    return results


