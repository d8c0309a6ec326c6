"""``layerfreeze report RUN_DIR``: a self-contained HTML page with PNG plots of a run or of a comparison.

:func:`write_report` reads what :mod:`layerfreeze.trainer` wrote (``metrics.jsonl`` through
:func:`layerfreeze.telemetry.read_metrics`, and ``summary.json``) or what :mod:`layerfreeze.compare` wrote
(``compare.json`` plus one run folder per row) and writes ``RUN_DIR/report/index.html`` with the PNGs next to it.
Plots are drawn with matplotlib's Agg canvas directly (no pyplot, no GUI backend, no browser needed); matplotlib is
the optional ``report`` extra (``pip install 'layerfreeze[report]'``).

Single run (``metrics.jsonl``):

* ``loss_vs_time.png`` -- training loss per step (light), a moving average and the eval loss at epoch ends against
  *training time*: the cumulative ``step_time_s`` of the logged steps (evaluation, checkpoints and pauses between a
  Ctrl-C and a resume are not counted, so runs compare fairly);
* ``loss_vs_flops.png`` -- the same against cumulative training FLOPs (as measured by the trainer);
* ``accuracy.png`` -- eval accuracy per epoch against training time and against FLOPs;
* ``freeze_timeline.png`` -- which block was frozen when (blocks top to bottom in forward order, epoch ends marked);
* ``step_time_memory.png`` -- step time and peak memory per step, with the steps where the frozen set changed.

A run without ``summary.json`` (interrupted, or still running) gets what its ``metrics.jsonl`` allows and a banner
saying so. A resumed run's records are read the way the trainer replays them: whatever was logged after the
checkpoint it resumed from is dropped (those steps were redone); a run that restarted from the beginning (stopped
before its first checkpoint) keeps only what it logged after the restart.

Comparison (``compare.json``): a table with the columns of ``compare.md`` plus a link to each row's own report
(generated too), ``accuracy_vs_time.png`` (test accuracy vs training time, ``none`` highlighted, rows named in a
legend by colour and marker),
``flops_ratio.png`` (FLOPs and time relative to ``none``) and ``loss_vs_time.png`` (every row's smoothed training
loss).
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import math
import os
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import telemetry as tm

__all__ = ["REPORT_DIRNAME", "write_report"]

REPORT_DIRNAME = "report"
INDEX_FILENAME = "index.html"
SUMMARY_FILENAME = "summary.json"
COMPARE_FILENAME = "compare.json"

FIGSIZE = (8.0, 4.5)
DPI = 110

# Plot file names (single run).
LOSS_VS_TIME = "loss_vs_time.png"
LOSS_VS_FLOPS = "loss_vs_flops.png"
ACCURACY = "accuracy.png"
FREEZE_TIMELINE = "freeze_timeline.png"
STEP_TIME_MEMORY = "step_time_memory.png"
# Plot file names (comparison).
ACCURACY_VS_TIME = "accuracy_vs_time.png"
FLOPS_RATIO = "flops_ratio.png"
COMPARE_LOSS = "loss_vs_time.png"

TIME_LABEL = "training time (s)  [cumulative step time; data loading and eval excluded]"
_FLOP_PREFIXES = ["", "k", "M", "G", "T", "P", "E", "Z"]
_BASELINE = "none"


# --------------------------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------------------------
def write_report(run_dir: str | Path) -> Path:
    """Write ``run_dir/report/index.html`` and its PNG plots; return the HTML file's path.

    ``run_dir`` is either a training run folder (holding ``metrics.jsonl``, written by ``layerfreeze train``) or
    a comparison folder (holding ``compare.json``, written by ``layerfreeze compare``); for a comparison every
    row's run folder gets its own report too, linked from the table. An existing report folder is overwritten
    file by file.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist or holds neither ``metrics.jsonl`` nor ``compare.json``.
        ValueError: ``metrics.jsonl`` or ``compare.json`` is malformed.
        ImportError: matplotlib is not installed (``pip install 'layerfreeze[report]'``).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"layerfreeze report: no such folder: {run_dir}")
    _require_matplotlib()
    if (run_dir / COMPARE_FILENAME).is_file():
        return _write_compare_report(run_dir)
    if (run_dir / tm.METRICS_FILENAME).is_file():
        return _write_run_report(run_dir)
    hint = ""
    subruns = sorted(p.name for p in run_dir.iterdir() if (p / tm.METRICS_FILENAME).is_file())
    if subruns:
        hint = (f" It contains run folders ({', '.join(subruns)}): pass one of them, or wait until "
                f"`layerfreeze compare` has written {COMPARE_FILENAME}.")
    raise FileNotFoundError(
        f"layerfreeze report: {run_dir} is neither a training run (no {tm.METRICS_FILENAME}) nor a comparison "
        f"(no {COMPARE_FILENAME}).{hint}"
    )


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "layerfreeze report needs matplotlib: pip install 'layerfreeze[report]'"
        ) from exc


# --------------------------------------------------------------------------------------------------------------
# Reading a run
# --------------------------------------------------------------------------------------------------------------
@dataclass
class _Run:
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
        steps += [int(e.get("step", 0)) for e in self.events if _finite(e.get("step"))]
        if _finite(self.get("steps")):
            steps.append(int(self.get("steps")))
        return max(steps, default=0)

    def time_at(self, steps: Any) -> np.ndarray:
        """Cumulative training time after ``steps`` completed steps (0 at step 0)."""
        return np.interp(np.asarray(steps, float), np.r_[0.0, self.step], np.r_[0.0, _fill(self.time)])

    def flops_at(self, steps: Any) -> np.ndarray:
        return np.interp(np.asarray(steps, float), np.r_[0.0, self.step], np.r_[0.0, _fill(self.flops)])

    @property
    def freeze_events(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("kind") in ("freeze", "thaw") and e.get("block") is not None]

    @property
    def change_steps(self) -> list[int]:
        """Steps after which the frozen set changed (0: before training), from freeze/thaw events, else from the
        logged ``frozen_count``."""
        steps = {int(e["step"]) for e in self.freeze_events if _finite(e.get("step"))}
        if not steps:
            previous = None
            for s, count in zip(self.step, self.frozen_counts):
                if _finite(count):
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
            index.setdefault(name, float(e["index"]) if _finite(e.get("index")) else math.inf)
        for rec in [*self.epochs, *self.events]:
            for name in rec.get("frozen_blocks") or []:
                index.setdefault(str(name), math.inf)
        return sorted(index, key=lambda n: (index[n], list(index).index(n)))

    def freeze_intervals(self) -> dict[str, list[tuple[int, int | None]]]:
        """Block -> [(frozen from step, thawed at step or None)], from freeze/thaw events (or the summary)."""
        timeline = [
            (int(e["step"]), str(e["block"]), str(e["kind"])) for e in self.freeze_events if _finite(e.get("step"))
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
            if action == "freeze" and block not in open_since:
                open_since[block] = step
            elif action == "thaw" and block in open_since:
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


def _finite(value: Any) -> bool:
    """A finite int or float (not a bool, not None)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _num(value: Any) -> float:
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


def _load_run(run_dir: Path) -> _Run:
    records = tm.read_metrics(run_dir)
    summary, summary_error = None, None
    path = run_dir / SUMMARY_FILENAME
    if path.is_file():
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(loaded, dict):
                summary = loaded
            else:
                summary_error = f"{SUMMARY_FILENAME} is not a JSON object"
        except (OSError, ValueError) as exc:
            summary_error = f"{SUMMARY_FILENAME} could not be read: {exc}"

    config: dict[str, Any] | None = None
    steps: dict[int, dict[str, Any]] = {}
    vals: dict[int, dict[str, Any]] = {}
    epochs: dict[int, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    interruptions: list[dict[str, Any]] = []
    resumes: list[dict[str, Any]] = []
    for rec in records:
        kind = rec.get("type")
        if kind == "config":
            if config is None and isinstance(rec.get("config"), dict):
                config = rec["config"]
        elif kind == "step" and _finite(rec.get("step")):
            if "loss" in rec:
                steps[int(rec["step"])] = rec
            elif "val_loss" in rec:
                vals[int(rec["step"])] = rec
        elif kind == "epoch" and _finite(rec.get("epoch")):
            epochs[int(rec["epoch"])] = rec
        elif kind == "event":
            if rec.get("kind") == "interrupted":
                interruptions.append(rec)
            elif rec.get("kind") == "resumed":
                resumes.append(rec)
                if _finite(rec.get("step")):
                    # Everything logged after the checkpoint this resume started from was redone: drop it.
                    cut = int(rec["step"])
                    steps = {s: r for s, r in steps.items() if s <= cut}
                    vals = {s: r for s, r in vals.items() if s <= cut}
                    epochs = {e: r for e, r in epochs.items() if _num(r.get("step")) <= cut}
                    events = [e for e in events if _num(e.get("step")) <= cut and not rec.get("from_start")]
            else:
                events.append(rec)

    ordered = [steps[s] for s in sorted(steps)]
    step = np.array([float(r["step"]) for r in ordered])
    step_time = np.array([_num(r.get("step_time_s")) for r in ordered])
    cum_time = np.cumsum(np.nan_to_num(step_time, nan=0.0)) if len(ordered) else np.zeros(0)
    flops_total = np.array([_num(r.get("flops_total")) for r in ordered])
    if len(ordered) and not np.isfinite(flops_total).all():
        per_step = np.array([_num(r.get("flops_per_step")) for r in ordered])
        if np.isfinite(per_step).any():
            flops_total = np.where(np.isfinite(flops_total), flops_total, np.cumsum(np.nan_to_num(per_step)))
    remeasured_at = {int(e["step"]) for e in events if e.get("kind") == "flops_remeasured" and _finite(e.get("step"))}
    val_order = sorted(vals)
    return _Run(
        run_dir=run_dir,
        summary=summary,
        summary_error=summary_error,
        config=config,
        step=step,
        loss=np.array([_num(r.get("loss")) for r in ordered]),
        step_time=step_time,
        time=cum_time,
        flops=flops_total,
        peak_mem=np.array([_num(r.get("peak_memory_bytes")) for r in ordered]),
        remeasured=np.array([int(s) in remeasured_at for s in step], dtype=bool),
        val_step=np.array([float(s) for s in val_order]),
        val_loss=np.array([_num(vals[s].get("val_loss")) for s in val_order]),
        epochs=[epochs[e] for e in sorted(epochs)],
        events=events,
        interruptions=interruptions,
        resumes=resumes,
        frozen_counts=[r.get("frozen_count") for r in ordered],
    )


# --------------------------------------------------------------------------------------------------------------
# Number helpers
# --------------------------------------------------------------------------------------------------------------
def _fmt_flops(x: Any) -> str:
    return tm.format_flops(x) if _finite(x) and x >= 0 else "–"


def _fmt_bytes(x: Any) -> str:
    return tm.format_bytes(x) if _finite(x) and x >= 0 else "–"


def _fmt_seconds(s: Any) -> str:
    return tm.format_seconds(s) if _finite(s) else "–"


def _fmt_pct(x: Any) -> str:
    return f"{100.0 * float(x):.2f} %" if _finite(x) else "–"


def _fmt_loss(x: Any) -> str:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return f"{float(x):.4f}" if math.isfinite(x) else str(float(x))  # "nan" / "inf" are worth showing
    return "–"


def _flop_scale(max_value: float) -> tuple[float, str]:
    """Divisor and unit (engineering prefixes) so ``max_value / divisor`` lies in [1, 1000)."""
    if not _finite(max_value) or max_value < 1000:
        return 1.0, "FLOP"
    k = min(int(math.log10(max_value) // 3), len(_FLOP_PREFIXES) - 1)
    return 10.0 ** (3 * k), f"{_FLOP_PREFIXES[k]}FLOP"


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average over ``window`` (odd) points, ignoring NaN/inf; NaN where no finite point."""
    y = np.asarray(y, float)
    ok = np.isfinite(y)
    if window <= 1 or len(y) == 0:
        return np.where(ok, y, np.nan)
    kernel = np.ones(window)
    num = np.convolve(np.where(ok, y, 0.0), kernel, mode="same")
    den = np.convolve(ok.astype(float), kernel, mode="same")
    out = np.full(len(y), np.nan)
    np.divide(num, den, out=out, where=den > 0)
    return out


def _smoothing_window(n: int) -> int:
    window = max(1, int(round(n / 25)))
    return window if window % 2 else window + 1


def _short(name: str, width: int = 34) -> str:
    """Shorten a long block name in the middle (``bert.encoder…layer.11``)."""
    if len(name) <= width:
        return name
    keep = width - 1
    return name[: keep // 2] + "…" + name[-(keep - keep // 2):]


# --------------------------------------------------------------------------------------------------------------
# Plot helpers
# --------------------------------------------------------------------------------------------------------------
def _figure(nrows: int = 1, ncols: int = 1, figsize: tuple[float, float] = FIGSIZE, **kw: Any) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3, linewidth=0.6)
    return fig, axes


def _save(fig: Any, path: Path) -> str:
    fig.savefig(path, dpi=DPI, format="png", metadata={"Software": None})
    return path.name


def _legend_below(fig: Any, axes: Any, ncol: int = 3) -> None:
    """One legend for the whole figure, under the plots (never on top of the data); duplicate labels once."""
    seen: dict[str, Any] = {}
    for ax in np.ravel(axes):
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if not label.startswith("_"):
                seen.setdefault(label, handle)
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="outside lower center", ncol=min(ncol, len(seen)),
                   fontsize=8, frameon=False)


def _loss_scale(ax: Any, *series: np.ndarray) -> None:
    """Log y when the (finite, positive) values span more than two decades."""
    values = np.concatenate([np.asarray(s, float).ravel() for s in series]) if series else np.zeros(0)
    values = values[np.isfinite(values)]
    if len(values) and values.min() > 0 and values.max() / values.min() > 100:
        ax.set_yscale("log")
        ax.set_ylabel(ax.get_ylabel() + " (log scale)")


def _mark_nonfinite(ax: Any, x: np.ndarray, y: np.ndarray) -> None:
    bad = ~np.isfinite(y)
    if bad.any():
        ax.plot(x[bad], np.full(bad.sum(), 0.97), "x", color="crimson", ms=6, mew=1.5,
                transform=ax.get_xaxis_transform(), clip_on=False,
                label=f"non-finite loss ({int(bad.sum())} step{'s' if bad.sum() != 1 else ''})")


def _mark_changes(ax: Any, xs: list[float] | np.ndarray, label: str | None = "frozen set changed") -> None:
    for i, x in enumerate(xs):
        ax.axvline(x, color="0.35", linestyle=":", linewidth=1.0, zorder=1, label=label if i == 0 else None)


def _plot_loss(ax: Any, run: _Run, x: np.ndarray, x_at: Any) -> None:
    """Training loss (raw + smoothed), eval loss at epoch ends and guard validation loss against ``x``."""
    window = _smoothing_window(len(run.loss))
    if window > 1:
        ax.plot(x, run.loss, color="C0", alpha=0.3, linewidth=0.8, label="training loss (per step)")
        ax.plot(x, _smooth(run.loss, window), color="C0", linewidth=2.0,
                label=f"training loss (moving average, {window} steps)")
    else:
        ax.plot(x, run.loss, color="C0", linewidth=1.2, marker=".", label="training loss (per step)")
    series = [run.loss]
    ep = [(float(e["step"]), _num(e.get("eval_loss"))) for e in run.epochs if _finite(e.get("step"))]
    if ep:
        steps, losses = map(np.array, zip(*ep))
        ax.plot(x_at(steps), losses, "o-", color="C1", linewidth=1.5, ms=5, label="eval loss (end of epoch)")
        series.append(losses)
    if len(run.val_step):
        ax.plot(x_at(run.val_step), run.val_loss, "s--", color="C2", ms=4, linewidth=1,
                label="validation loss (guard hold-out)")
        series.append(run.val_loss)
    changes = [s for s in run.change_steps if s > 0]
    if changes:
        _mark_changes(ax, x_at(changes))
    _mark_nonfinite(ax, x, run.loss)
    ax.set_ylabel("cross-entropy loss")
    _loss_scale(ax, *series)


def _plot_loss_vs_time(run: _Run, out: Path) -> str | None:
    if not len(run.step):
        return None
    fig, axes = _figure()
    ax = axes[0, 0]
    _plot_loss(ax, run, run.time, run.time_at)
    ax.set_xlabel(TIME_LABEL)
    ax.set_xlim(left=0)
    ax.set_title(f"Loss vs training time — {run.strategy}")
    _legend_below(fig, axes)
    return _save(fig, out / LOSS_VS_TIME)


def _plot_loss_vs_flops(run: _Run, out: Path) -> str | None:
    if not len(run.step) or not np.isfinite(run.flops).any():
        return None
    div, unit = _flop_scale(float(np.nanmax(run.flops)))
    fig, axes = _figure()
    ax = axes[0, 0]
    _plot_loss(ax, run, run.flops / div, lambda s: run.flops_at(s) / div)
    ax.set_xlabel(f"cumulative training FLOPs ({unit})  [measured with FlopCounterMode]")
    ax.set_xlim(left=0)
    ax.set_title(f"Loss vs training compute — {run.strategy}")
    _legend_below(fig, axes)
    return _save(fig, out / LOSS_VS_FLOPS)


def _plot_accuracy(run: _Run, out: Path) -> str | None:
    points = [(float(e["step"]), _num(e.get("eval_accuracy")), int(e["epoch"]))
              for e in run.epochs if _finite(e.get("step")) and _finite(e.get("eval_accuracy"))]
    if not points:
        return None
    steps, acc, epochs = (np.array(v) for v in zip(*points))
    acc = 100.0 * acc
    flops = run.flops_at(steps)
    div, unit = _flop_scale(float(np.nanmax(flops)) if len(flops) else 0.0)
    fig, axes = _figure(1, 2, figsize=(9.0, 4.5), sharey=True)
    for ax, x, label in ((axes[0, 0], run.time_at(steps), TIME_LABEL.replace("  [", "\n[")),
                         (axes[0, 1], flops / div, f"cumulative training FLOPs ({unit})")):
        ax.plot(x, acc, "o-", color="C2", linewidth=1.8, ms=6)
        if len(points) <= 12:
            for xi, yi, ei in zip(x, acc, epochs):
                ax.annotate(f"ep {ei + 1}", (xi, yi), textcoords="offset points", xytext=(-5, 5), ha="right",
                            fontsize=7, color="0.3")
        ax.set_xlabel(label)
        ax.set_xlim(left=0)
        ax.margins(x=0.08, y=0.12)
    axes[0, 0].set_ylabel("eval accuracy (%)")
    fig.suptitle(f"Eval accuracy at the end of each epoch — {run.strategy}"
                 + (f" (final {acc[-1]:.2f} %)" if math.isfinite(acc[-1]) else ""))
    return _save(fig, out / ACCURACY)


def _plot_freeze_timeline(run: _Run, out: Path) -> str | None:
    from matplotlib.patches import Patch

    blocks = run.blocks
    intervals = run.freeze_intervals()
    for name in intervals:  # blocks only the events know about (no summary): keep them visible
        if name not in blocks:
            blocks.append(name)
    if not blocks:
        return None
    end = max(run.last_step, 1)
    n = len(blocks)
    height = min(max(2.8, 0.32 * n + 1.7), 14.0)
    fig, axes = _figure(figsize=(FIGSIZE[0], height))
    ax = axes[0, 0]
    ax.grid(False)
    ax.grid(True, axis="x", alpha=0.3, linewidth=0.6)
    bar_h = 0.62
    for i, name in enumerate(blocks):
        ax.broken_barh([(0, end)], (i - bar_h / 2, bar_h), facecolors="0.9", edgecolor="none")
        spans = intervals.get(name, [])
        ax.broken_barh([(s, (e if e is not None else end) - s) for s, e in spans], (i - bar_h / 2, bar_h),
                       facecolors="C0", edgecolor="none")
        for s, e in spans:
            if e is None and s >= end:  # frozen by the last stage: a zero-width bar, so mark it
                ax.plot([end], [i], marker="<", color="C0", ms=9, clip_on=False, zorder=4)
            if e is not None:
                ax.plot([e], [i], marker="|", color="C3", ms=12, mew=2, clip_on=False)
    fontsize = 9 if n <= 16 else 7 if n <= 40 else 5
    ax.set_yticks(range(n), [_short(b) for b in blocks], fontsize=fontsize)
    ax.set_ylim(n - 0.5, -0.5)  # first block on top
    ax.set_xlim(0, end)
    ax.set_xlabel("training step")
    ax.set_ylabel("block (forward order, input at top)")
    boundaries = [(float(e["step"]), int(e["epoch"])) for e in run.epochs if _finite(e.get("step"))]
    for s, _ in boundaries:
        ax.axvline(s, color="0.4", linestyle="--", linewidth=0.9)
    if boundaries:
        top = ax.secondary_xaxis("top")
        every = max(1, math.ceil(len(boundaries) / 12))
        shown = boundaries[every - 1 :: every]
        top.set_xticks([s for s, _ in shown], [str(ep + 1) for _, ep in shown], fontsize=8)
        top.set_xlabel("end of epoch", fontsize=9)
    handles = [Patch(facecolor="C0", label="frozen"), Patch(facecolor="0.9", label="trainable")]
    if any(e is not None for spans in intervals.values() for _, e in spans):
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], marker="|", color="C3", linestyle="none", ms=10, mew=2, label="thawed"))
    if any(e is None and s >= end for spans in intervals.values() for s, e in spans):
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], marker="<", color="C0", linestyle="none", ms=8, label="frozen at the last step"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    title = f"Freeze timeline — {run.strategy}"
    if not intervals:
        title += " (no block was frozen)"
    elif not run.get("blocks"):
        title += " (frozen blocks only: no summary.json)"
    ax.set_title(title)
    return _save(fig, out / FREEZE_TIMELINE)


def _plot_step_time_memory(run: _Run, out: Path) -> str | None:
    if not len(run.step):
        return None
    has_mem = bool(np.isfinite(run.peak_mem).any())
    fig, axes = _figure(2 if has_mem else 1, 1, figsize=(FIGSIZE[0], 5.6 if has_mem else FIGSIZE[1]), sharex=True)
    ax = axes[0, 0]
    finite = run.step_time[np.isfinite(run.step_time)]
    scale, unit = (1e3, "ms") if len(finite) and float(np.median(finite)) < 0.1 else (1.0, "s")
    t = run.step_time * scale
    window = _smoothing_window(len(t))
    ax.plot(run.step, t, color="C0", alpha=0.35 if window > 1 else 1.0, linewidth=0.8, label="step time")
    if window > 1:
        ax.plot(run.step, _smooth(t, window), color="C0", linewidth=1.8, label=f"moving average ({window} steps)")
    if run.remeasured.any():
        ax.plot(run.step[run.remeasured], t[run.remeasured], "o", mfc="none", color="C3", ms=7,
                label="FLOPs measured on this step (slower)")
    # Keep a few slow steps (FLOP measurement, warm-up) from flattening the rest: cap the axis, mark what is cut.
    ordinary = t[np.isfinite(t) & ~run.remeasured]
    ax.set_ylim(bottom=0)
    if len(ordinary) >= 5:
        cap = float(np.percentile(ordinary, 95)) * 2.0
        above = np.isfinite(t) & (t > cap)
        if cap > 0 and above.any():
            ax.set_ylim(0, cap)
            ax.plot(run.step[above], np.full(int(above.sum()), 1.0), "^", color="C3", ms=6, clip_on=False,
                    transform=ax.get_xaxis_transform(), label="above the axis")
            ax.text(0.01, 0.97, f"{int(above.sum())} step{'s' if above.sum() != 1 else ''} above the axis "
                    f"(max {np.nanmax(t):.3g} {unit})", transform=ax.transAxes, va="top", fontsize=8, color="0.3")
    ax.set_ylabel(f"step time ({unit})")
    changes = [c for c in run.change_steps if c > 0]  # step 0: frozen before training, nothing to mark
    _mark_changes(ax, changes)
    ax.set_title(f"Step time and peak memory per step — {run.strategy}")
    if has_mem:
        ax2 = axes[1, 0]
        mib = run.peak_mem / 2**20
        ax2.plot(run.step, mib, color="C4", linewidth=1.5, drawstyle="steps-post", label="peak memory")
        _mark_changes(ax2, changes)
        ax2.set_ylabel("peak memory (MiB)")
        ax2.ticklabel_format(axis="y", useOffset=False, style="plain")
        ax2.set_ylim(0, float(np.nanmax(mib)) * 1.15)
    axes[-1, 0].set_xlabel("training step")
    axes[-1, 0].set_xlim(0, max(run.last_step, 1))
    _legend_below(fig, axes)
    return _save(fig, out / STEP_TIME_MEMORY)


# --------------------------------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------------------------------
_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1000px; padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 2em;
     border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
.sub { color: #666; margin-top: 0; font-size: 0.9em; word-break: break-all; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.7em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.kv th { width: 13em; font-weight: 600; } table.kv td { word-break: break-word; }
tr.baseline td { background: #fff8e1; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.88em; margin-top: 0.3em; }
.banner { padding: 0.7em 1em; border-radius: 4px; margin: 1em 0; }
.warn { background: #fff3cd; border: 1px solid #e0c36c; } .err { background: #f8d7da; border: 1px solid #e2a3aa; }
code, pre { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 0.88em; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; }
ul.timeline { padding-left: 1.2em; margin: 0; } .muted { color: #777; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _page(title: str, body: list[str]) -> str:
    stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        *body,
        f'<p class="muted"><small>Generated by <code>layerfreeze report</code> on {_e(stamp)}.</small></p>',
        "</body>",
        "</html>",
        "",
    ])


def _kv_table(rows: list[tuple[str, str]]) -> str:
    """Two-column table; values are already-escaped HTML."""
    cells = "\n".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="kv">\n{cells}\n</table>'


def _figure_html(name: str | None, alt: str, caption: str) -> str:
    if name is None:
        return ""
    return (f'<figure><img src="{_e(name)}" alt="{_e(alt)}">'
            f"<figcaption>{caption}</figcaption></figure>")


def _when(step: Any, epoch: Any) -> str:
    """``at step 0 (before training)`` / ``at step 40 (epoch 2)``; epochs counted from 1 as in the plots."""
    if not _finite(step):
        return "at an unknown step"
    if int(step) == 0:
        return "at step 0 (before training)"
    return f"at step {int(step)}" + (f" (epoch {int(epoch) + 1})" if _finite(epoch) else "")


def _timeline_html(run: _Run) -> str:
    items: list[str] = []
    events = run.freeze_events
    if events:
        for e in sorted(events, key=lambda e: _num(e.get("step"))):
            verb = "frozen" if e.get("kind") == "freeze" else "thawed"
            where = _when(e.get("step"), e.get("epoch"))
            reason = f' <span class="muted">— {_e(e["reason"])}</span>' if e.get("reason") else ""
            items.append(f"<li><code>{_e(e['block'])}</code> {verb} {_e(where)}{reason}</li>")
    else:
        for t in run.get("freeze_timeline") or []:
            verb = {"freeze": "frozen", "thaw": "thawed"}.get(str(t.get("action")), str(t.get("action")))
            where = _when(t.get("step"), t.get("epoch"))
            items.append(f"<li><code>{_e(t.get('block'))}</code> {_e(verb)} {_e(where)}</li>")
    if not items:
        return '<span class="muted">no block was frozen</span>'
    return '<ul class="timeline">' + "".join(items) + "</ul>"


def _status_banner(run: _Run) -> str:
    parts: list[str] = []
    if not run.complete:
        last = run.interruptions[-1] if run.interruptions else None
        text = ("<strong>Interrupted run</strong>: no readable <code>summary.json</code> (the run was interrupted or is still "
                "running). Everything below is rebuilt from <code>metrics.jsonl</code>")
        if last is not None:
            where = f" at step {int(last['step'])}" if _finite(last.get("step")) else ""
            error = f" ({_e(last['error'])})" if last.get("error") else ""
            ckpt = (f"; a checkpoint was written to <code>{_e(last['checkpoint'])}</code>, continue with "
                    f"<code>layerfreeze train --resume {_e(run.run_dir)}</code>") if last.get("checkpoint") else ""
            text += f"; it was interrupted{_e(where)}{error}{ckpt}"
        parts.append(f'<div class="banner warn">{text}.</div>')
    elif run.interruptions:
        parts.append(f'<div class="banner warn">This run was interrupted {len(run.interruptions)} time(s) and '
                     f"resumed {len(run.resumes)} time(s); redone steps are shown once.</div>")
    if run.summary_error:
        parts.append(f'<div class="banner err">{_e(run.summary_error)}</div>')
    bad = int((~np.isfinite(run.loss)).sum()) if len(run.loss) else 0
    if bad:
        parts.append(f'<div class="banner err">{bad} step(s) had a non-finite training loss (NaN or inf); '
                     "they are marked × on the loss plots.</div>")
    return "\n".join(parts)


def _run_summary_rows(run: _Run) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    params = run.strategy_params
    strategy = _e(run.strategy) + (f" <code>{_e(json.dumps(params))}</code>" if params else "")
    rows.append(("strategy", strategy))
    rows.append(("task", _e(run.task)))
    if run.model:
        rows.append(("model", _e(run.model)))
    rows.append(("status", "complete" if run.complete else "<strong>interrupted</strong> (incomplete)"))
    if run.complete:
        rows.append(("test accuracy", _e(_fmt_pct(run.get("test_accuracy")))))
        rows.append(("test loss", _e(_fmt_loss(run.get("test_loss")))))
    elif run.epochs:
        last = run.epochs[-1]
        rows.append((f"eval accuracy (epoch {int(last['epoch']) + 1})", _e(_fmt_pct(last.get("eval_accuracy")))))
        rows.append((f"eval loss (epoch {int(last['epoch']) + 1})", _e(_fmt_loss(last.get("eval_loss")))))
    epochs = run.get("epochs")
    epochs = int(epochs) if _finite(epochs) else len(run.epochs)
    rows.append(("epochs" if run.complete else "epochs completed", _e(epochs)))
    steps = run.get("steps")
    steps = int(steps) if _finite(steps) else (int(run.step[-1]) if len(run.step) else 0)
    rows.append(("steps", _e(f"{steps:,}")))
    if run.complete:
        rows.append(("wall time", _e(_fmt_seconds(run.get("wall_time_s")))))
    train_time = run.get("train_time_s")
    if not _finite(train_time) and len(run.time):
        train_time = float(run.time[-1])
    rows.append(("training time", _e(_fmt_seconds(train_time)) + ' <span class="muted">(sum of step times)</span>'))
    per_epoch = run.get("time_per_epoch_s") or [_num(e.get("epoch_time_s")) for e in run.epochs]
    if per_epoch:
        rows.append(("time per epoch", _e(", ".join(_fmt_seconds(t) for t in per_epoch))))
    flops_total = run.get("flops_total")
    if not _finite(flops_total) and len(run.flops):
        flops_total = float(run.flops[-1])
    rows.append(("training FLOPs", _e(_fmt_flops(flops_total))))
    first = run.get("flops_per_step_first")
    last = run.get("flops_per_step_last")
    if not _finite(first) and run.events:
        measured = [e.get("flops_per_step") for e in run.events if e.get("kind") == "flops_remeasured"]
        measured = [m for m in measured if _finite(m)]
        if measured:
            first, last = measured[0], measured[-1]
    if _finite(first):
        rows.append(("FLOPs / step (first)", _e(_fmt_flops(first))))
    if _finite(last):
        text = _fmt_flops(last)
        if _finite(first) and first > 0:
            text += f" ({100.0 * (last - first) / first:+.1f} % vs first)"
        rows.append(("FLOPs / step (last)", _e(text)))
    peak = run.get("peak_memory_bytes")
    if not _finite(peak) and np.isfinite(run.peak_mem).any():
        peak = float(np.nanmax(run.peak_mem))
    rows.append(("peak memory", _e(_fmt_bytes(peak))))
    if _finite(run.get("trainable_parameters")):
        rows.append(("trainable parameters (end)", _e(f"{int(run.get('trainable_parameters')):,}")))
    blocks = run.blocks
    frozen = run.frozen_at_end
    frozen_text = ", ".join(f"<code>{_e(b)}</code>" for b in frozen) if frozen else "none"
    if blocks and run.get("blocks"):
        frozen_text += f' <span class="muted">({len(frozen)} of {len(blocks)} blocks)</span>'
    rows.append(("frozen at the end", frozen_text))
    rows.append(("freeze timeline", _timeline_html(run)))
    return rows


def _write_run_report(run_dir: Path) -> Path:
    run = _load_run(run_dir)
    out = run_dir / REPORT_DIRNAME
    out.mkdir(parents=True, exist_ok=True)
    plots = {
        LOSS_VS_TIME: _plot_loss_vs_time(run, out),
        LOSS_VS_FLOPS: _plot_loss_vs_flops(run, out),
        ACCURACY: _plot_accuracy(run, out),
        FREEZE_TIMELINE: _plot_freeze_timeline(run, out),
        STEP_TIME_MEMORY: _plot_step_time_memory(run, out),
    }
    title = f"layerfreeze report — {run.strategy} on {run.task}"
    body = [
        f"<h1>{_e(title)}</h1>",
        f'<p class="sub">{_e(run_dir.resolve())}</p>',
        *(['<p class="sub"><a href="../../report/index.html">&larr; back to the comparison</a></p>']
          if (run_dir.parent / COMPARE_FILENAME).is_file() else []),
        _status_banner(run),
        "<h2>Summary</h2>",
        _kv_table(_run_summary_rows(run)),
        "<h2>Plots</h2>",
    ]
    if not len(run.step):
        body.append('<p class="muted">No training step was logged yet, so there is nothing to plot.</p>')
    body += [
        _figure_html(plots[LOSS_VS_TIME], "Training and eval loss against training time",
                     "Training loss per step (light), its moving average, and eval loss at the end of each epoch, "
                     "against training time: the cumulative <code>step_time_s</code> of the steps (forward, "
                     "backward, optimizer step and the strategy's freezing stage), so data loading, evaluation, "
                     "checkpoints and pauses are not counted. Dotted lines: the frozen set changed."),
        _figure_html(plots[LOSS_VS_FLOPS], "Training and eval loss against cumulative training FLOPs",
                     "The same losses against cumulative training FLOPs (forward + backward matmul/conv FLOPs, "
                     "measured with <code>FlopCounterMode</code> whenever the frozen set changes)."),
        _figure_html(plots[ACCURACY], "Eval accuracy per epoch against training time and FLOPs",
                     "Accuracy on the evaluation set at the end of each epoch."),
        _figure_html(plots[FREEZE_TIMELINE], "Freeze timeline: which block was frozen at which step",
                     "Each row is a block, first block on top. Blue: frozen; grey: trainable; red tick: thawed; "
                     "blue triangle: frozen only at the last step. "
                     "Dashed lines: epoch ends."),
        _figure_html(plots[STEP_TIME_MEMORY], "Step time and peak memory per training step",
                     "Top: wall-clock time of each training step; circled steps also measured FLOPs and are "
                     "slower. Bottom: peak memory (CUDA allocator peak on a GPU, process peak RSS on a CPU). "
                     "Dotted lines: the frozen set changed."),
    ]
    if run.config:
        body += ["<h2>Configuration</h2>",
                 f"<details><summary>config</summary><pre>{_e(json.dumps(run.config, indent=2))}</pre></details>"]
    path = out / INDEX_FILENAME
    path.write_text(_page(title, [b for b in body if b]), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------------------------
def _load_compare(compare_dir: Path) -> list[dict[str, Any]]:
    path = compare_dir / COMPARE_FILENAME
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: expected a list of row objects")
    rows = [dict(r) for r in rows]
    for r in rows:
        r.setdefault("row", r.get("strategy", "?"))
    # compare.json is rewritten after every row; the ratios appear only once all rows are done.
    base = next((r for r in rows if r["row"] == _BASELINE), None)
    for r in rows:
        if r.get("time_ratio") is None and base and _finite(r.get("train_time_s")) and _finite(base.get("train_time_s")) \
                and base["train_time_s"] > 0:
            r["time_ratio"] = r["train_time_s"] / base["train_time_s"]
        if r.get("flops_ratio") is None and base and _finite(r.get("flops_total")) and _finite(base.get("flops_total")) \
                and base["flops_total"] > 0:
            r["flops_ratio"] = r["flops_total"] / base["flops_total"]
        if r.get("accuracy_delta") is None and base and _finite(r.get("test_accuracy")) \
                and _finite(base.get("test_accuracy")):
            r["accuracy_delta"] = r["test_accuracy"] - base["test_accuracy"]
    return rows


def _row_dir(compare_dir: Path, row: dict[str, Any]) -> Path | None:
    """The row's run folder: ``compare_dir/<row>`` (how compare lays it out), else the recorded run_dir."""
    candidates = [compare_dir / str(row.get("row"))]
    if row.get("run_dir"):
        recorded = Path(str(row["run_dir"]))
        candidates += [recorded, compare_dir / recorded.name] if recorded.is_absolute() else \
            [compare_dir / recorded.name, recorded]
    for c in candidates:
        if (c / tm.METRICS_FILENAME).is_file():
            return c
    return None


def _compare_cells(r: dict[str, Any]) -> list[str]:
    """The cells of compare.md's columns (escaped), tolerant of missing values."""
    def ratio(x: Any) -> str:
        return f"{x:.3f}" if _finite(x) else "–"

    acc = f"{100 * r['test_accuracy']:.2f}" if _finite(r.get("test_accuracy")) else "–"
    delta = f"{100 * r['accuracy_delta']:+.2f}" if _finite(r.get("accuracy_delta")) else "–"
    train = f"{r['train_time_s']:.1f}" if _finite(r.get("train_time_s")) else "–"
    steps = r.get("freeze_steps") or {}
    frozen = ", ".join(f"{b}@{s}" for b, s in steps.items()) if isinstance(steps, dict) else str(steps)
    return [_e(x) for x in (r.get("row"), acc, delta, train, ratio(r.get("time_ratio")),
                            _fmt_flops(r.get("flops_total")), ratio(r.get("flops_ratio")),
                            _fmt_bytes(r.get("peak_memory_bytes")), frozen or "–")]


def _compare_headers() -> list[str]:
    try:
        from .compare import HEADERS

        return list(HEADERS)
    except ImportError:  # pragma: no cover
        return ["strategy", "test acc %", "Δ acc pts", "train s", "time ratio", "train FLOPs", "FLOPs ratio",
                "peak mem", "frozen block@step"]


#: Marker per non-baseline row of the accuracy-vs-time plot, with colours C0..C9: a point stays identifiable by its
#: shape when its neighbour covers part of it, and in greyscale prints.
_ROW_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "p", "d")


def _plot_accuracy_vs_time(rows: list[dict[str, Any]], out: Path) -> str | None:
    """One point per row; each row has its own colour and marker, named in a legend beside the plot with its
    accuracy, its accuracy difference and its time ratio to ``none``.

    Why a legend and not text beside the points: rows often sit close together (several strategies within a
    point of ``none``'s accuracy and a few percent of its time), and labels next to the points then overlap.
    """
    pts = [(float(r["train_time_s"]), 100.0 * float(r["test_accuracy"]), str(r["row"]), r) for r in rows
           if _finite(r.get("train_time_s")) and _finite(r.get("test_accuracy"))]
    if not pts:
        return None
    fig, axes = _figure(figsize=(FIGSIZE[0] + 2.6, FIGSIZE[1]))
    ax = axes[0, 0]
    base = next((p for p in pts if p[2] == _BASELINE), None)
    if base is not None:
        ax.axhline(base[1], color="0.3", linestyle="--", linewidth=0.9, zorder=1)
        ax.axvline(base[0], color="0.3", linestyle="--", linewidth=0.9, zorder=1)
        ax.scatter([base[0]], [base[1]], s=220, marker="*", color="gold", edgecolor="black", linewidth=0.9,
                   zorder=4, label=f"{_BASELINE} (nothing frozen)\n{base[1]:.2f} %, {_fmt_seconds(base[0])}")
    others = [p for p in pts if p is not base]
    for i, (x, y, name, r) in enumerate(others):
        extra = [f"{y:.2f} %"]
        if _finite(r.get("accuracy_delta")):
            extra.append(f"{100 * r['accuracy_delta']:+.2f} pts")
        if _finite(r.get("time_ratio")):
            extra.append(f"{r['time_ratio']:.2f}× time")
        ax.scatter([x], [y], s=60, marker=_ROW_MARKERS[i % len(_ROW_MARKERS)], color=f"C{i % 10}",
                   edgecolor="black", linewidth=0.6, alpha=0.9, zorder=3, label=f"{name}\n{', '.join(extra)}")
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    span_x = (max(xs) - min(xs)) or max(abs(max(xs)), 1e-9)
    span_y = (max(ys) - min(ys)) or 5.0
    ax.set_xlim(max(0.0, min(xs) - 0.08 * span_x), max(xs) + 0.08 * span_x)
    ax.set_ylim(min(ys) - 0.1 * span_y, max(ys) + 0.1 * span_y)
    ax.set_xlabel("training time (s)  [sum of step times]")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Test accuracy vs training time (up and left is better)")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=7.5, frameon=False,
               labelspacing=0.8)
    return _save(fig, out / ACCURACY_VS_TIME)


def _plot_flops_ratio(rows: list[dict[str, Any]], out: Path) -> str | None:
    names = [str(r["row"]) for r in rows]
    flops_ratio = [_num(r.get("flops_ratio")) for r in rows]
    time_ratio = [_num(r.get("time_ratio")) for r in rows]
    if not any(math.isfinite(v) for v in flops_ratio):
        # no baseline row: absolute FLOPs instead
        flops = [_num(r.get("flops_total")) for r in rows]
        if not any(math.isfinite(v) for v in flops):
            return None
        div, unit = _flop_scale(max(v for v in flops if math.isfinite(v)))
        fig, axes = _figure(figsize=(FIGSIZE[0], max(3.0, 0.45 * len(rows) + 1.5)))
        ax = axes[0, 0]
        y = np.arange(len(rows))
        ax.barh(y, np.array(flops) / div, color="C0")
        ax.set_yticks(y, names)
        ax.invert_yaxis()
        ax.set_xlabel(f"training FLOPs ({unit})")
        ax.set_title(f"Training FLOPs per strategy (no '{_BASELINE}' row to compare with)")
        return _save(fig, out / FLOPS_RATIO)
    fig, axes = _figure(figsize=(FIGSIZE[0], max(3.2, 0.55 * len(rows) + 1.6)))
    ax = axes[0, 0]
    ax.grid(False)
    ax.grid(True, axis="x", alpha=0.3, linewidth=0.6)
    y = np.arange(len(rows))
    h = 0.38
    bars_f = ax.barh(y - h / 2, np.nan_to_num(flops_ratio), h, color="C0", label="training FLOPs ratio")
    bars_t = ax.barh(y + h / 2, np.nan_to_num(time_ratio), h, color="C1", label="training time ratio")
    for bars, values in ((bars_f, flops_ratio), (bars_t, time_ratio)):
        ax.bar_label(bars, labels=[f"{v:.2f}×" if math.isfinite(v) else "–" for v in values], padding=3,
                     fontsize=8)
    ax.axvline(1.0, color="0.2", linestyle="--", linewidth=1.0)
    ax.set_yticks(y, names)
    for tick, name in zip(ax.get_yticklabels(), names):
        if name == _BASELINE:
            tick.set_fontweight("bold")
    ax.invert_yaxis()
    top = max([v for v in flops_ratio + time_ratio if math.isfinite(v)] + [1.0])
    ax.set_xlim(0, top * 1.18)
    ax.set_xlabel(f"ratio to '{_BASELINE}' (1.0 = same as training everything; lower is cheaper)")
    ax.set_title(f"Training FLOPs and time relative to '{_BASELINE}'")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=2, fontsize=8, frameon=False)
    return _save(fig, out / FLOPS_RATIO)


def _plot_compare_loss(runs: list[tuple[str, _Run]], out: Path) -> str | None:
    runs = [(name, run) for name, run in runs if len(run.step)]
    if not runs:
        return None
    fig, axes = _figure()
    ax = axes[0, 0]
    series = []
    color = 0
    for name, run in runs:
        window = _smoothing_window(len(run.loss))
        y = _smooth(run.loss, window)
        series.append(y)
        if name == _BASELINE:
            ax.plot(run.time, y, color="black", linewidth=2.2, label=f"{name} (baseline)", zorder=3)
        else:
            ax.plot(run.time, y, color=f"C{color % 10}", linewidth=1.5, label=name)
            color += 1
    ax.set_xlabel(TIME_LABEL)
    ax.set_ylabel("training loss (moving average)")
    ax.set_xlim(left=0)
    _loss_scale(ax, *series)
    ax.set_title("Training loss vs training time, all rows")
    _legend_below(fig, axes, ncol=5)
    return _save(fig, out / COMPARE_LOSS)


def _write_compare_report(compare_dir: Path) -> Path:
    rows = _load_compare(compare_dir)
    out = compare_dir / REPORT_DIRNAME
    out.mkdir(parents=True, exist_ok=True)
    links: list[str] = []
    loaded: list[tuple[str, _Run]] = []
    problems: list[str] = []
    for r in rows:
        row_dir = _row_dir(compare_dir, r)
        if row_dir is None:
            links.append('<span class="muted">no run folder</span>')
            continue
        try:
            row_report = _write_run_report(row_dir)
            loaded.append((str(r["row"]), _load_run(row_dir)))
        except (OSError, ValueError) as exc:
            problems.append(f"{r['row']}: {exc}")
            links.append('<span class="muted">report failed</span>')
            continue
        rel = os.path.relpath(row_report, out).replace(os.sep, "/")
        links.append(f'<a href="{_e(urllib.parse.quote(rel))}">report</a>')
    plots = {
        ACCURACY_VS_TIME: _plot_accuracy_vs_time(rows, out),
        FLOPS_RATIO: _plot_flops_ratio(rows, out),
        COMPARE_LOSS: _plot_compare_loss(loaded, out),
    }
    tasks = sorted({str(r.get("task")) for r in rows if r.get("task")})
    title = "layerfreeze compare" + (f" — {', '.join(tasks)}" if tasks else "")
    headers = _compare_headers() + ["run"]
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body_rows = []
    for r, link in zip(rows, links):
        cells = _compare_cells(r)
        tds = [f"<td>{cells[0]}</td>"] + [f'<td class="num">{c}</td>' for c in cells[1:-1]] + \
              [f"<td>{cells[-1]}</td>", f"<td>{link}</td>"]
        cls = ' class="baseline"' if r.get("row") == _BASELINE else ""
        body_rows.append(f"<tr{cls}>{''.join(tds)}</tr>")
    table = f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n" + "\n".join(body_rows) + "\n</tbody>\n</table>"
    notes = []
    models = sorted({str(r.get("model")) for r in rows if r.get("model")})
    if models:
        notes.append(f"model: {', '.join(f'<code>{_e(m)}</code>' for m in models)}")
    if not any(r.get("row") == _BASELINE for r in rows):
        notes.append(f"no '{_BASELINE}' row, so there are no ratios")
    incomplete = [str(r["row"]) for r in rows if r.get("test_accuracy") is None]
    body = [
        f"<h1>{_e(title)}</h1>",
        f'<p class="sub">{_e(compare_dir.resolve())}</p>',
        *(f'<p class="sub">{n}</p>' for n in notes),
        *(f'<div class="banner err">{_e(p)}</div>' for p in problems),
        *([f'<div class="banner warn">rows without a result: {_e(", ".join(incomplete))}</div>'] if incomplete else []),
        "<h2>Results</h2>",
        table,
        '<p class="muted"><small>Ratios are to the <code>none</code> row (nothing frozen); Δ acc pts is the '
        "test-accuracy difference in percentage points; <code>block@step</code> is the step each block was "
        "(last) frozen at.</small></p>",
        "<h2>Plots</h2>",
        _figure_html(plots[ACCURACY_VS_TIME], "Test accuracy against training time for each strategy",
                     "Each point is one row; the star is <code>none</code> (nothing frozen), dashed lines mark its "
                     "accuracy and time. Points up and to the left of the star are faster at equal or better "
                     "accuracy."),
        _figure_html(plots[FLOPS_RATIO], "Training FLOPs and time of each strategy relative to none",
                     "Measured training FLOPs and summed step time of each row divided by those of "
                     "<code>none</code>."),
        _figure_html(plots[COMPARE_LOSS], "Smoothed training loss of every row against training time",
                     "Moving average of each row's training loss against its own training time."),
    ]
    path = out / INDEX_FILENAME
    path.write_text(_page(title, [b for b in body if b]), encoding="utf-8")
    return path
