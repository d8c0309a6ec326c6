"""Reading what the report shows: a run folder (metrics replayed, summary) as a :class:`Run`, a comparison's rows."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from layerfreeze.runs import rundir
from layerfreeze.runs.compare_table import add_ratios, row_result
from layerfreeze.runs.rundir import Event, finite

__all__ = ["Run", "find_row_dir", "load_compare", "load_run", "num"]


@dataclass
class Run:
    """Everything the report of one run needs, cleaned up from metrics.jsonl and summary.json."""

    run_dir: Path
    summary: dict[str, Any] | None
    summary_error: str | None
    config: dict[str, Any] | None
    # per training step (sorted by step); float arrays, NaN where a value is missing
    step: np.ndarray
    loss: np.ndarray
    step_time: np.ndarray
    time: np.ndarray  # cumulative step time at the end of each step (s)
    flops: np.ndarray  # cumulative training FLOPs at the end of each step
    peak_mem: np.ndarray  # bytes
    remeasured: np.ndarray  # bool: FLOPs were measured on this step (FlopCounterMode, slower)
    val_step: np.ndarray  # guard hold-out evaluations
    val_loss: np.ndarray
    epochs: list[dict[str, Any]]  # epoch records, sorted by epoch
    events: list[dict[str, Any]]  # events that survived resumes (freeze, thaw, flops_remeasured, checkpoint)
    interruptions: list[dict[str, Any]] = field(default_factory=list)
    resumes: list[dict[str, Any]] = field(default_factory=list)
    frozen_counts: list[Any] = field(default_factory=list)  # per step, as logged
    memory_step: np.ndarray = field(default_factory=lambda: np.zeros(0))  # steps the memory ledger sampled
    memory: list[dict[str, Any]] = field(default_factory=list)  # their ``memory`` records (LedgerSnapshot.to_record)

    # -- derived ------------------------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return self.summary is not None

    def get(self, key: str, default: Any = None) -> Any:
        return (self.summary or {}).get(key, default)

    @property
    def strategy(self) -> str:
        value = self.get("strategy") or _dig(self.config, "freeze", "strategy")
        if value == "none" and _dig(self.config, "model", "lora"):
            return "none (LoRA)"
        return str(value) if value else "?"

    @property
    def strategy_params(self) -> dict[str, Any]:
        params = self.get("strategy_params")
        if params is None:
            params = _dig(self.config, "freeze", "params")
        return dict(params or {})

    @property
    def task(self) -> str:
        return str(self.get("task") or _dig(self.config, "task") or "?")

    @property
    def model(self) -> str | None:
        value = self.get("model") or _dig(self.config, "model", "name_or_path")
        return str(value) if value else None

    @property
    def last_step(self) -> int:
        steps = [int(self.step[-1])] if len(self.step) else []
        steps += [int(e.get("step", 0)) for e in self.events if finite(e.get("step"))]
        if finite(self.get("steps")):
            steps.append(int(self.get("steps")))
        return max(steps, default=0)

    def time_at(self, steps: Any) -> np.ndarray:
        """Cumulative training time after ``steps`` completed steps (0 at step 0)."""
        return np.interp(np.asarray(steps, float), np.r_[0.0, self.step], np.r_[0.0, _fill(self.time)])

    def flops_at(self, steps: Any) -> np.ndarray:
        return np.interp(np.asarray(steps, float), np.r_[0.0, self.step], np.r_[0.0, _fill(self.flops)])

    @property
    def freeze_events(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("kind") in (Event.FREEZE, Event.THAW) and e.get("block") is not None]

    @property
    def change_steps(self) -> list[int]:
        """Steps after which the frozen set changed (0: before training), from freeze/thaw events, else from the
        logged ``frozen_count``."""
        steps = {int(e["step"]) for e in self.freeze_events if finite(e.get("step"))}
        if not steps:
            previous = None
            for s, count in zip(self.step, self.frozen_counts):
                if finite(count):
                    if previous is not None and count != previous:
                        steps.add(int(s))  # the trainer logs a step after the freezing stage that follows it
                    previous = count
        return sorted(steps)

    @property
    def blocks(self) -> list[str]:
        """Block names front to back: summary["blocks"], else whatever the records name (frozen blocks only)."""
        names = self.get("blocks")
        if names:
            return [str(b) for b in names]
        index: dict[str, float] = {}
        for e in self.freeze_events:
            name = str(e["block"])
            index.setdefault(name, float(e["index"]) if finite(e.get("index")) else math.inf)
        for rec in [*self.epochs, *self.events]:
            for name in rec.get("frozen_blocks") or []:
                index.setdefault(str(name), math.inf)
        return sorted(index, key=lambda n: (index[n], list(index).index(n)))

    def freeze_intervals(self) -> dict[str, list[tuple[int, int | None]]]:
        """Block -> [(frozen from step, thawed at step or None)], from freeze/thaw events (or the summary)."""
        timeline = [
            (int(e["step"]), str(e["block"]), str(e["kind"])) for e in self.freeze_events if finite(e.get("step"))
        ]
        if not timeline:
            timeline = [
                (int(t.get("step", 0)), str(t.get("block")), str(t.get("action", "freeze")))
                for t in self.get("freeze_timeline") or [] if t.get("block") is not None
            ]
        timeline.sort(key=lambda t: t[0])  # stable: same-step events keep their logged order
        open_since: dict[str, int] = {}
        intervals: dict[str, list[tuple[int, int | None]]] = {}
        for step, block, action in timeline:
            if action == Event.FREEZE and block not in open_since:
                open_since[block] = step
            elif action == Event.THAW and block in open_since:
                intervals.setdefault(block, []).append((open_since.pop(block), step))
        for block, start in open_since.items():
            intervals.setdefault(block, []).append((start, None))
        return intervals

    @property
    def frozen_at_end(self) -> list[str]:
        if self.summary is not None and self.get("frozen_blocks") is not None:
            return [str(b) for b in self.get("frozen_blocks")]
        return [b for b, spans in self.freeze_intervals().items() if spans and spans[-1][1] is None]


def _dig(d: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def num(value: Any) -> float:
    """A float, NaN for anything that is not a number (None, strings, bools)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def _fill(a: np.ndarray) -> np.ndarray:
    """Forward-fill NaNs (0 before the first value) so interpolation works on partially logged columns."""
    a = np.asarray(a, float).copy()
    last = 0.0
    for i, v in enumerate(a):
        if math.isfinite(v):
            last = v
        else:
            a[i] = last
    return a


def load_run(run_dir: Path) -> Run:
    """Read a run folder (``metrics.jsonl`` replayed by :func:`layerfreeze.runs.rundir.replay`, ``summary.json`` when
    there is one) into a :class:`Run`.

    Raises:
        FileNotFoundError: no ``metrics.jsonl``.
        ValueError: ``metrics.jsonl`` is malformed.
    """
    played = rundir.replay(rundir.read_metrics(run_dir))
    summary, summary_error = rundir.read_summary(run_dir)
    ordered, events = played.steps, played.events
    step = np.array([float(r["step"]) for r in ordered])
    step_time = np.array([num(r.get("step_time_s")) for r in ordered])
    cum_time = np.cumsum(np.nan_to_num(step_time, nan=0.0)) if len(ordered) else np.zeros(0)
    flops_total = np.array([num(r.get("flops_total")) for r in ordered])
    if len(ordered) and not np.isfinite(flops_total).all():
        per_step = np.array([num(r.get("flops_per_step")) for r in ordered])
        if np.isfinite(per_step).any():
            flops_total = np.where(np.isfinite(flops_total), flops_total, np.cumsum(np.nan_to_num(per_step)))
    remeasured_at = {int(e["step"]) for e in events
                     if e.get("kind") == Event.FLOPS_REMEASURED and finite(e.get("step"))}
    return Run(
        run_dir=run_dir,
        summary=summary,
        summary_error=summary_error,
        config=played.config,
        step=step,
        loss=np.array([num(r.get("loss")) for r in ordered]),
        step_time=step_time,
        time=cum_time,
        flops=flops_total,
        peak_mem=np.array([num(r.get("peak_memory_bytes")) for r in ordered]),
        remeasured=np.array([int(s) in remeasured_at for s in step], dtype=bool),
        val_step=np.array([float(r["step"]) for r in played.vals]),
        val_loss=np.array([num(r.get("val_loss")) for r in played.vals]),
        epochs=played.epochs,
        events=events,
        interruptions=played.interruptions,
        resumes=played.resumes,
        frozen_counts=[r.get("frozen_count") for r in ordered],
        memory_step=np.array([float(r["step"]) for r in ordered if isinstance(r.get("memory"), dict)]),
        memory=[r["memory"] for r in ordered if isinstance(r.get("memory"), dict)],
    )


def load_compare(compare_dir: Path) -> list[dict[str, Any]]:
    """The rows of a comparison folder's ``compare.json``, each named (``row``) and with its ratios to ``none``
    (:func:`layerfreeze.runs.compare_table.add_ratios`: compare.json is rewritten after every row, and the ratios
    appear in it only once all rows are done). A row compare.json says stopped (interrupted, diverged, not run)
    whose run folder now holds a ``summary.json`` (finished with ``layerfreeze train --resume``) is read from it.

    Raises:
        ValueError: ``compare.json`` is malformed.
    """
    rows = rundir.read_compare(compare_dir)
    for i, r in enumerate(rows):
        r.setdefault("row", r.get("strategy", "?"))
        if r.get("stopped"):  # cut (Ctrl-C, a divergence) or never run; finished since with train --resume?
            where = find_row_dir(compare_dir, r)
            summary = None if where is None else rundir.read_summary(where)[0]
            if summary is not None:
                rows[i] = row_result(r["row"], summary, bool(r.get("rotates")))
    return add_ratios(rows)


def find_row_dir(compare_dir: Path, row: dict[str, Any]) -> Path | None:
    """The row's run folder: ``compare_dir/<row>`` (how compare lays it out), else the recorded run_dir."""
    candidates = [rundir.row_dir(compare_dir, str(row.get("row")))]
    if row.get("run_dir"):
        recorded = Path(str(row["run_dir"]))
        candidates += [recorded, compare_dir / recorded.name] if recorded.is_absolute() else \
            [compare_dir / recorded.name, recorded]
    for c in candidates:
        if rundir.is_run_dir(c):
            return c
    return None
