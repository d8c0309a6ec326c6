"""The report's PNG plots of a run and of a comparison, drawn on matplotlib's Agg canvas (no pyplot, no GUI)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from layerfreeze.runs.compare_table import BASELINE
from layerfreeze.runs.ledger_buckets import DISK, bucket_label
from layerfreeze.runs.report.read import Run, num
from layerfreeze.runs.rundir import Event, finite
from layerfreeze.runs.summary import format_seconds

FIGSIZE = (8.0, 4.5)
DPI = 110

# Plot file names (single run).
LOSS_VS_TIME = "loss_vs_time.png"
LOSS_VS_FLOPS = "loss_vs_flops.png"
ACCURACY = "accuracy.png"
FREEZE_TIMELINE = "freeze_timeline.png"
STEP_TIME_MEMORY = "step_time_memory.png"
MEMORY = "memory.png"
# Plot file names (comparison).
ACCURACY_VS_TIME = "accuracy_vs_time.png"
FLOPS_RATIO = "flops_ratio.png"
COMPARE_LOSS = "loss_vs_time.png"
MEMORY_PEAKS = "memory_peaks.png"

TIME_LABEL = "training time (s)  [cumulative step time; data loading and eval excluded]"
_FLOP_PREFIXES = ["", "k", "M", "G", "T", "P", "E", "Z"]


def _flop_scale(max_value: float) -> tuple[float, str]:
    """Divisor and unit (engineering prefixes) so ``max_value / divisor`` lies in [1, 1000)."""
    if not finite(max_value) or max_value < 1000:
        return 1.0, "FLOP"
    k = min(int(math.log10(max_value) // 3), len(_FLOP_PREFIXES) - 1)
    return 10.0 ** (3 * k), f"{_FLOP_PREFIXES[k]}FLOP"


def _byte_scale(max_value: float) -> tuple[float, str]:
    """Divisor and unit (binary prefixes) so ``max_value / divisor`` lies in [1, 1024)."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    k = 0
    while finite(max_value) and max_value >= 1024 ** (k + 1) and k < len(units) - 1:
        k += 1
    return float(1024**k), units[k]


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average over ``window`` (odd) points, ignoring NaN/inf; NaN where no finite point."""
    y = np.asarray(y, float)
    ok = np.isfinite(y)
    if window <= 1 or len(y) == 0:
        return np.where(ok, y, np.nan)
    kernel = np.ones(window)
    sums = np.convolve(np.where(ok, y, 0.0), kernel, mode="same")
    den = np.convolve(ok.astype(float), kernel, mode="same")
    out = np.full(len(y), np.nan)
    np.divide(sums, den, out=out, where=den > 0)
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


def _plot_loss(ax: Any, run: Run, x: np.ndarray, x_at: Any) -> None:
    """Training loss (raw + smoothed), eval loss at epoch ends and guard validation loss against ``x``."""
    window = _smoothing_window(len(run.loss))
    if window > 1:
        ax.plot(x, run.loss, color="C0", alpha=0.3, linewidth=0.8, label="training loss (per step)")
        ax.plot(x, _smooth(run.loss, window), color="C0", linewidth=2.0,
                label=f"training loss (moving average, {window} steps)")
    else:
        ax.plot(x, run.loss, color="C0", linewidth=1.2, marker=".", label="training loss (per step)")
    series = [run.loss]
    ep = [(float(e["step"]), num(e.get("eval_loss"))) for e in run.epochs if finite(e.get("step"))]
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


def _plot_loss_vs_time(run: Run, out: Path) -> str | None:
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


def _plot_loss_vs_flops(run: Run, out: Path) -> str | None:
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


def _plot_accuracy(run: Run, out: Path) -> str | None:
    points = [(float(e["step"]), num(e.get("eval_accuracy")), int(e["epoch"]))
              for e in run.epochs if finite(e.get("step")) and finite(e.get("eval_accuracy"))]
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


def _plot_freeze_timeline(run: Run, out: Path) -> str | None:
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
    boundaries = [(float(e["step"]), int(e["epoch"])) for e in run.epochs if finite(e.get("step"))]
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


def _plot_step_time_memory(run: Run, out: Path) -> str | None:
    if not len(run.step):
        return None
    has_mem = bool(np.isfinite(run.peak_mem).any())
    fig, axes = _figure(2 if has_mem else 1, 1, figsize=(FIGSIZE[0], 5.6 if has_mem else FIGSIZE[1]), sharex=True)
    ax = axes[0, 0]
    finite_times = run.step_time[np.isfinite(run.step_time)]
    scale, unit = (1e3, "ms") if len(finite_times) and float(np.median(finite_times)) < 0.1 else (1.0, "s")
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


def _memory_buckets(records: list[dict[str, Any]]) -> list[str]:
    """The buckets on a memory device (not the disk) that the records hold, in the ledger's order."""
    names: list[str] = []
    for rec in records:
        for d, per in (rec.get("devices") or {}).items():
            if d != DISK:
                names += [b for b in per if b != "tensor_bytes" and b not in names]
    order = list((records[0].get("buckets") or {}) if records else [])
    return sorted(names, key=lambda b: (order.index(b) if b in order else len(order), b))


def _plot_memory(run: Run, out: Path) -> str | None:
    """The memory ledger's buckets stacked over the sampled steps (their top is the tensor total), freeze and thaw
    events marked; below, the process's RSS and, on CUDA, the allocator's allocated/reserved bytes beside the tensor
    total."""
    if not len(run.memory_step):
        return None
    steps = run.memory_step
    buckets = _memory_buckets(run.memory)
    series = np.array([[num(sum(v.get(b, 0) for d, v in (rec.get("devices") or {}).items() if d != DISK))
                        for rec in run.memory] for b in buckets], dtype=float)
    total = np.array([num(rec.get("tensor_bytes")) for rec in run.memory])
    rss = np.array([num(rec.get("rss_bytes")) for rec in run.memory])
    allocated = np.array([num(sum(a.get("allocated", 0) for a in (rec.get("allocator") or {}).values()) or None)
                          for rec in run.memory])
    reserved = np.array([num(sum(a.get("reserved", 0) for a in (rec.get("allocator") or {}).values()) or None)
                         for rec in run.memory])
    disk = np.array([num((rec.get("buckets") or {}).get("cache_disk")) for rec in run.memory])
    fig, axes = _figure(2, 1, figsize=(FIGSIZE[0], 6.4), sharex=True, height_ratios=[2.2, 1])
    ax = axes[0, 0]
    div, unit = _byte_scale(float(np.nanmax(total)) if np.isfinite(total).any() else 0.0)
    ax.stackplot(steps, np.nan_to_num(series) / div, labels=[bucket_label(b) for b in buckets], step="post",
                 colors=[f"C{i % 10}" for i in range(len(buckets))], alpha=0.85)
    # a marker at each sample (a stack over one sample has no width: a short run's plot would be blank)
    marker = {"marker": "o", "ms": 4 if len(steps) <= 20 else 0, "clip_on": False}
    for i, top in enumerate(np.cumsum(np.nan_to_num(series), axis=0) / div):
        ax.plot(steps, top, linestyle="none", color=f"C{i % 10}", markeredgecolor="0.2", markeredgewidth=0.5,
                zorder=4, **marker)
    if np.isfinite(disk).any() and np.nanmax(disk) > 0:
        ax.plot(steps, disk / div, color="0.3", linestyle="--", linewidth=1.2, drawstyle="steps-post",
                label="activation cache on disk (not in the total)")
    events = [e for e in run.freeze_events if finite(e.get("step"))]
    labels: dict[tuple[float, bool], list[str]] = {}  # one label per step and kind: events at one step share it
    for e in events:
        labels.setdefault((float(e["step"]), e.get("kind") == Event.FREEZE), []).append(str(e["block"]))
    for (step, freeze), blocks in labels.items():
        color = "0.25" if freeze else "C3"
        ax.axvline(step, color=color, linestyle=":", linewidth=1.0, zorder=3)
        if len(labels) <= 12:
            names = _short(blocks[0], 18) if len(blocks) == 1 else f"{len(blocks)} blocks ({_short(blocks[0], 12)}..)"
            ax.text(step, 1.0 if freeze else 0.55, f" {'freeze' if freeze else 'thaw'} {names}", rotation=90,
                    va="top", ha="left", fontsize=6.5, color=color, transform=ax.get_xaxis_transform(), clip_on=True)
    ax.set_ylabel(f"tensor bytes ({unit})")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Memory by bucket (the memory ledger) — {run.strategy}")
    if events:
        ax.plot([], [], color="0.25", linestyle=":", label="freeze (thaw: red)")
    ax2 = axes[1, 0]
    high = [a for a in (rss, allocated, reserved, total) if np.isfinite(a).any()]
    div2, unit2 = _byte_scale(max(float(np.nanmax(a)) for a in high) if high else 0.0)
    ax2.plot(steps, total / div2, color="black", linewidth=1.5, drawstyle="steps-post", **marker, label="tensor total")
    if np.isfinite(rss).any():
        ax2.plot(steps, rss / div2, color="C4", linewidth=1.2, drawstyle="steps-post", **marker, label="process RSS")
    if np.isfinite(allocated).any():
        ax2.plot(steps, allocated / div2, color="C1", linewidth=1.2, drawstyle="steps-post", **marker,
                 label="CUDA allocated")
        ax2.plot(steps, reserved / div2, color="C1", linestyle="--", linewidth=1.0, drawstyle="steps-post", **marker,
                 label="CUDA reserved")
    ax2.set_ylabel(unit2)
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("training step (sampled steps of the ledger)")
    axes[-1, 0].set_xlim(0, max(run.last_step, 1))
    _legend_below(fig, axes, ncol=3)
    return _save(fig, out / MEMORY)


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
           if finite(r.get("train_time_s")) and finite(r.get("test_accuracy"))]
    if not pts:
        return None
    fig, axes = _figure(figsize=(FIGSIZE[0] + 2.6, FIGSIZE[1]))
    ax = axes[0, 0]
    base = next((p for p in pts if p[2] == BASELINE), None)
    if base is not None:
        ax.axhline(base[1], color="0.3", linestyle="--", linewidth=0.9, zorder=1)
        ax.axvline(base[0], color="0.3", linestyle="--", linewidth=0.9, zorder=1)
        ax.scatter([base[0]], [base[1]], s=220, marker="*", color="gold", edgecolor="black", linewidth=0.9,
                   zorder=4, label=f"{BASELINE} (nothing frozen)\n{base[1]:.2f} %, {format_seconds(base[0])}")
    others = [p for p in pts if p is not base]
    for i, (x, y, name, r) in enumerate(others):
        extra = [f"{y:.2f} %"]
        if finite(r.get("accuracy_delta")):
            extra.append(f"{100 * r['accuracy_delta']:+.2f} pts")
        if finite(r.get("time_ratio")):
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
    flops_ratio = [num(r.get("flops_ratio")) for r in rows]
    time_ratio = [num(r.get("time_ratio")) for r in rows]
    if not any(math.isfinite(v) for v in flops_ratio):
        # no baseline row: absolute FLOPs instead
        flops = [num(r.get("flops_total")) for r in rows]
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
        ax.set_title(f"Training FLOPs per strategy (no '{BASELINE}' row to compare with)")
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
        if name == BASELINE:
            tick.set_fontweight("bold")
    ax.invert_yaxis()
    top = max([v for v in flops_ratio + time_ratio if math.isfinite(v)] + [1.0])
    ax.set_xlim(0, top * 1.18)
    ax.set_xlabel(f"ratio to '{BASELINE}' (1.0 = same as training everything; lower is cheaper)")
    ax.set_title(f"Training FLOPs and time relative to '{BASELINE}'")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=2, fontsize=8, frameon=False)
    return _save(fig, out / FLOPS_RATIO)


def _plot_memory_peaks(rows: list[dict[str, Any]], out: Path) -> str | None:
    """Per row, the buckets at its tensor peak (``memory.at_tensor_peak``), stacked: the bar's length is the tensor
    peak; its ratio to ``none`` beside it."""
    rows = [r for r in rows if isinstance(r.get("memory"), dict) and r["memory"].get("at_tensor_peak")]
    if not rows:
        return None
    buckets: list[str] = []
    for r in rows:
        buckets += [b for b in r["memory"]["at_tensor_peak"] if b != "cache_disk" and b not in buckets]
    peaks = [float(sum(v for b, v in r["memory"]["at_tensor_peak"].items() if b != "cache_disk")) for r in rows]
    div, unit = _byte_scale(max(peaks))
    fig, axes = _figure(figsize=(FIGSIZE[0] + 1.0, max(3.0, 0.5 * len(rows) + 1.8)))
    ax = axes[0, 0]
    ax.grid(False)
    ax.grid(True, axis="x", alpha=0.3, linewidth=0.6)
    y = np.arange(len(rows))
    left = np.zeros(len(rows))
    for i, b in enumerate(buckets):
        width = np.array([r["memory"]["at_tensor_peak"].get(b, 0) for r in rows], dtype=float) / div
        ax.barh(y, width, left=left, color=f"C{i % 10}", label=bucket_label(b))
        left += width
    for yi, r, peak in zip(y, rows, peaks):
        ratio = r.get("tensor_peak_ratio")
        text = f" {peak / div:.3g} {unit}" + (f" ({ratio:.2f}×)" if finite(ratio) else "")
        ax.text(peak / div, yi, text, va="center", fontsize=8)
    names = [str(r.get("row")) for r in rows]
    ax.set_yticks(y, names)
    for tick, name in zip(ax.get_yticklabels(), names):
        if name == BASELINE:
            tick.set_fontweight("bold")
    ax.invert_yaxis()
    ax.set_xlim(0, max(peaks) / div * 1.3)
    ax.set_xlabel(f"tensor bytes at the run's tensor peak ({unit}); ratio to '{BASELINE}'")
    ax.set_title("Tensor peak of each row, by bucket (the memory ledger)")
    _legend_below(fig, axes, ncol=3)
    return _save(fig, out / MEMORY_PEAKS)


def _plot_compare_loss(runs: list[tuple[str, Run]], out: Path) -> str | None:
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
        if name == BASELINE:
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


def plot_run(run: Run, out: Path) -> dict[str, str | None]:
    """Every plot of one run into ``out``: file name -> the file written, None where the run has nothing to plot."""
    return {
        LOSS_VS_TIME: _plot_loss_vs_time(run, out),
        LOSS_VS_FLOPS: _plot_loss_vs_flops(run, out),
        ACCURACY: _plot_accuracy(run, out),
        FREEZE_TIMELINE: _plot_freeze_timeline(run, out),
        STEP_TIME_MEMORY: _plot_step_time_memory(run, out),
        MEMORY: _plot_memory(run, out),
    }


def plot_compare(rows: list[dict[str, Any]], runs: list[tuple[str, Run]], out: Path) -> dict[str, str | None]:
    """Every plot of a comparison into ``out`` (``runs``: each row's name and loaded run, where it has one)."""
    return {
        ACCURACY_VS_TIME: _plot_accuracy_vs_time(rows, out),
        FLOPS_RATIO: _plot_flops_ratio(rows, out),
        COMPARE_LOSS: _plot_compare_loss(runs, out),
        MEMORY_PEAKS: _plot_memory_peaks(rows, out),
    }
