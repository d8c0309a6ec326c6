"""The demo's table (Markdown) and its HTML report with the loss-curve plot."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np

from layerfreeze.runs import summary


def _per_device(values: dict[str, int], start: dict[str, int] | None = None) -> str:
    """``cpu 1.2 GiB`` per device; with ``start``, the growth over it too: ``cpu 1.2 GiB (+80 MiB)``."""
    def cell(d: str, v: int) -> str:
        grown = f" (+{summary.format_bytes(max(0, v - start[d]))})" if start and d in start else ""
        return f"{d} {summary.format_bytes(v)}{grown}"

    return ", ".join(cell(d, v) for d, v in values.items())


TABLE_HEADERS = ("placement", "trainer threads", "max abs loss diff", "held-out loss ctrl / no ctrl", "step ms",
                 "img/s", "precompute s", "frozen params held in training", "peak memory (+ over start)", "overlap",
                 "non-finite", "loss std (last)", "grad norm mean / max")


def _headers(window: int) -> list[str]:
    return [f"loss std (last {window})" if h == "loss std (last)" else h for h in TABLE_HEADERS]


def _row_cells(r: dict[str, Any], no_control: float) -> list[str]:
    overlap = f"{r['pipeline']['overlap']:.0%}" if r.get("pipeline") else "-"
    threads = str(r["trainer_threads"])
    if r.get("pipeline") and r["pipeline"]["threads"]:
        threads += f" + worker {r['pipeline']['threads'][0]}"
    return [r["placement"], threads, "0 (identical)" if r["losses_identical"] else f"{r['max_abs_loss_diff']:.2e}",
            f"{r['heldout_control']:.4f} / {no_control:.4f}", f"{1000 * r['step_s_median']:.0f}",
            f"{r['throughput']:.0f}",
            f"{r['precompute_s']:.1f} (stored {summary.format_bytes(r['store_bytes'])})" if r["store_bytes"] else "-",
            _per_device(r["frozen_param_bytes"]), _per_device(r["peak_memory"], r.get("memory_at_start")), overlap,
            r["nonfinite"] or "none",
            f"{r['loss_std_window']:.4f}", f"{r['grad_norm_mean']:.3f} / {r['grad_norm_max']:.3f}"]


def format_table(result: dict[str, Any]) -> str:
    """The placement table as Markdown (one row per placement; ``window`` from the config)."""
    window = min(result["config"]["window"], result["config"]["steps"])  # a run shorter than the window: its steps
    lines = ["| " + " | ".join(_headers(window)) + " |", "|" + "---|" * len(TABLE_HEADERS)]
    for r in result["placements"]:
        lines.append("| " + " | ".join(_row_cells(r, result["heldout_no_control"])) + " |")
    return "\n".join(lines)


#: The per-device memory table's bucket columns (the memory ledger's buckets, :mod:`layerfreeze.runs.ledger`).
MEMORY_BUCKETS = (("ControlNet params", ("params_trainable",)), ("gradients", ("grads",)),
                  ("optimizer state", ("optimizer",)), ("saved activations", ("activations",)),
                  ("frozen models", ("side_models",)), ("precomputed", ("cache_memory", "cache_disk")),
                  ("buffers", ("buffers",)))
MEMORY_CAPTION = "Memory per device (memory ledger: each bucket's peak over the placement's steps, every step sampled):"
MEMORY_HEADERS = ("placement", "device", *(name for name, _ in MEMORY_BUCKETS), "tensor peak",
                  "CUDA peak allocated")


def memory_rows(result: dict[str, Any]) -> list[list[str]]:
    """One row per placement and device: each bucket's peak there (the memory ledger, every step sampled), the
    device's tensor peak and, on CUDA, ``torch.cuda.max_memory_allocated``."""
    rows = []
    for r in result["placements"]:
        devices = (r.get("ledger") or {}).get("devices", {})
        for device, per in devices.items():
            b = per["buckets"]
            if device == "disk" and not any(b.values()):
                continue
            cells = [r["placement"], device]
            for _, keys in MEMORY_BUCKETS:
                present = [k for k in keys if k in b]
                cells.append(" / ".join(summary.format_bytes(b[k]) for k in present) if present else "-")
            peak, alloc = per.get("tensor_peak_bytes"), per.get("peak_allocated")
            cells += [summary.format_bytes(peak) if peak is not None else "- (disk)",
                      summary.format_bytes(alloc) if alloc is not None else "-"]
            rows.append(cells)
    return rows


def format_memory_table(result: dict[str, Any]) -> str:
    """The per-device memory table as Markdown (:func:`memory_rows`)."""
    lines = ["| " + " | ".join(MEMORY_HEADERS) + " |", "|" + "---|" * len(MEMORY_HEADERS)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in memory_rows(result)])


_CSS = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0;font-size:0.85em}th,td{border:1px solid #ccc;padding:4px 8px;"
        "text-align:right}th{background:#f4f4f4}td:first-child{text-align:left}img{max-width:100%}"
        ".muted{color:#777}figcaption{font-size:0.9em;color:#555}")


def write_report(result: dict[str, Any], folder: str | Path) -> Path:
    """``folder/index.html``: the placement table and ``loss_curves.png`` (training loss per step, every
    placement, and the ControlNet gradient norm). Needs matplotlib (the ``report`` extra).

    Returns:
        The HTML file's path.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(9.0, 6.0), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_grad = fig.subplots(2, 1, sharex=True)
    styles = ["-", "--", ":", "-."]
    window = max(1, min(20, len(result["placements"][0]["losses"]) // 5))

    def smooth(y: list[float]) -> np.ndarray:  # running mean: one step's loss mostly says which timestep it drew
        return np.convolve(np.asarray(y, float), np.ones(window) / window, mode="valid")

    for i, r in enumerate(result["placements"]):
        x = np.arange(len(r["losses"]))
        ax_loss.plot(x, r["losses"], "-", lw=0.5, alpha=0.25, color=f"C{i}")
        ax_loss.plot(x[window - 1:], smooth(r["losses"]), styles[i % 4], lw=1.4, color=f"C{i}",
                     label=f"{r['placement']} (held-out with control {r['heldout_control']:.4f})")
        ax_grad.plot(x[window - 1:], smooth(r["grad_norms"]), styles[i % 4], lw=1.4, color=f"C{i}")
    ax_loss.axhline(result["heldout_no_control"], color="grey", lw=0.8,
                    label=f"held-out loss without control {result['heldout_no_control']:.4f}")
    ax_loss.set_ylabel(f"training loss (noise MSE;\nrunning mean of {window})")
    ax_grad.set_ylabel(f"ControlNet grad norm\n(running mean of {window})")
    ax_grad.set_xlabel("step")
    for ax in (ax_loss, ax_grad):
        ax.grid(True, alpha=0.3, linewidth=0.6)
    ax_loss.legend(fontsize=8, frameon=False)
    fig.savefig(folder / "loss_curves.png", format="png", metadata={"Software": None})
    cfg = result["config"]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in _headers(min(cfg["window"], cfg["steps"])))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in
                                    _row_cells(r, result["heldout_no_control"])) + "</tr>"
                   for r in result["placements"])
    page = "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        "<title>ControlNet beside frozen models</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
        "<h1>ControlNet beside a frozen VAE, text encoder and UNet</h1>",
        (f"<p>{cfg['steps']} steps of {cfg['batch_size']} per placement; trainer on {html.escape(cfg['device'])}, "
         f"frozen models on {html.escape(cfg['frozen_device'] or cfg['device'])}; seed {cfg['seed']}. Loss "
         "differences are to the first placement over every step; held-out loss is the denoising MSE on "
         f"{cfg['heldout_size']} test images with fixed noise, with the trained ControlNet's residuals and "
         "without them (the UNet alone).</p>"),
        f"<table><tr>{head}</tr>{body}</table>",
        ("<h2>Memory per device (memory ledger)</h2><p>Each bucket's peak on each device over the placement's steps "
         "(every step sampled; <code>layerfreeze.runs.ledger.MemoryLedger</code>): the trained ControlNet's "
         "parameters, gradients, optimizer state and the activations saved for backward (the frozen UNet's "
         "included: the loss backpropagates through it), the frozen models' bytes (<code>side_models</code>) and "
         "the precomputed outputs; the device's tensor peak, and on CUDA the allocator's peak.</p>"),
        "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in MEMORY_HEADERS) + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in memory_rows(result))
        + "</table>",
        ('<figure><img src="loss_curves.png" alt="training loss and ControlNet gradient norm per step">'
         "<figcaption>Training loss (each step faint, running mean bold) and ControlNet gradient norm, every "
         "placement; the lines lie on each other where training did not change.</figcaption></figure>"),
        f'<p class="muted"><small>Generated by benchmarks.controlnet in {result["total_s"]:.0f} s.</small></p>',
        "</body>", "</html>", ""])
    path = folder / "index.html"
    path.write_text(page)
    return path
