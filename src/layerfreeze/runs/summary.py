"""A run for people: FLOPs, bytes and durations formatted (:func:`format_flops`, :func:`format_bytes`,
:func:`format_seconds`), and the end-of-run summary table rendered with ``rich`` (:func:`summary_table`,
:func:`print_summary`) from a run's ``summary.json`` dict. The comparison table, the HTML report and the
benchmarks format with the same functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from layerfreeze.runs.ledger_buckets import DISK, bucket_label

__all__ = ["AFTER_LAST_STEP", "format_bytes", "format_flops", "format_seconds", "freeze_step_text", "memory_lines",
           "print_summary", "rank_memory_lines", "summary_table"]


def _scaled(value: float, base: float, units: list[str]) -> tuple[str, str]:
    """Pick a unit so the mantissa is in [1, base); 2 decimals below 10, else 1."""
    idx = 0
    while value >= base and idx < len(units) - 1:
        value /= base
        idx += 1
    text = f"{value:.2f}" if value < 10 else f"{value:.1f}"
    # Rounding may reach the next unit (999.96 -> "1000.0").
    if float(text) >= base and idx < len(units) - 1:
        value /= base
        idx += 1
        text = f"{value:.2f}"
    return text, units[idx]


_FLOP_UNITS = ["kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP", "ZFLOP", "YFLOP"]
_BYTE_UNITS = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"]


def format_flops(n: float) -> str:
    """Format a FLOP count with SI (power-of-1000) units.

    Below 1000: the integer count, ``"512 FLOP"``.  Otherwise 2 decimals when
    the mantissa is below 10 and 1 decimal up to 999.9:
    ``format_flops(1.234e15) == "1.23 PFLOP"``,
    ``format_flops(4.567e14) == "456.7 TFLOP"``.

    Raises:
        ValueError: ``n`` is negative, NaN or infinite.
    """
    n = float(n)
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"format_flops: expected a finite non-negative count, got {n!r}")
    if round(n) < 1000:
        return f"{n:.0f} FLOP"
    text, unit = _scaled(n / 1000.0, 1000.0, _FLOP_UNITS)
    return f"{text} {unit}"


def format_bytes(n: int) -> str:
    """Format a byte count with binary (power-of-1024) units.

    Below 1024: ``"512 B"``.  Otherwise 2 decimals when the mantissa is below
    10 and 1 decimal up to 1023.9: ``format_bytes(3 * 2**29) == "1.50 GiB"``,
    ``format_bytes(200 * 2**20) == "200.0 MiB"``.

    Raises:
        ValueError: ``n`` is negative, NaN or infinite.
    """
    n = float(n)
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"format_bytes: expected a finite non-negative size, got {n!r}")
    if n < 1024:
        return f"{n:.0f} B"
    text, unit = _scaled(n / 1024.0, 1024.0, _BYTE_UNITS)
    return f"{text} {unit}"


def wall_time_label(resumed_from_step: Any) -> str:
    """The summary's label of ``wall_time_s``: a resumed run's is the last process's, from the step it resumed at
    (its train time sums every process's steps, so the two differ)."""
    if resumed_from_step is None:
        return "wall time"
    return f"wall time (this process, from step {int(resumed_from_step):,})"


def format_seconds(s: float) -> str:
    """A duration in seconds as ``"42.50 s"`` below a minute, ``"2m 05.0s"`` below an hour, else ``"1h 02m 03s"``."""
    s = float(s)
    if s < 60:
        return f"{s:.2f} s"
    if s < 3600:
        m, rest = divmod(s, 60)
        return f"{int(m)}m {rest:04.1f}s"
    h, rest = divmod(int(round(s)), 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h {m:02d}m {sec:02d}s"


def partial_mark(steps: Sequence[int] | None) -> str:
    """``" (partial: 20 of 52 steps)"`` for an epoch's ``[steps run, batches in a full epoch]`` that ran fewer than
    its batches; ``""`` for a full one or None (not recorded)."""
    return f" (partial: {steps[0]} of {steps[1]} steps)" if steps and steps[0] < steps[1] else ""


def epoch_times_text(times: Sequence[float], steps: Sequence[Sequence[int]] | None = None) -> str:
    """``time per epoch`` as the summary and the report show it: the mean over the full epochs, then each epoch.

    Args:
        times: Each epoch's training seconds (``summary.json``'s ``time_per_epoch_s``).
        steps: Each epoch's ``[steps run, batches in a full epoch]`` (``epoch_steps``), if recorded: an epoch cut
            short (``train.max_steps``) is marked partial and left out of the mean, which would otherwise understate
            an epoch's time.

    Returns:
        ``"mean 12.30 s  [12.10, 12.50] s"``; with a partial epoch ``"mean 12.30 s over 2 full epochs  [12.10, 12.50,
        3.20 (partial: 20 of 52 steps)] s"``; more than ten epochs as min/max; ``"-"`` for none.
    """
    values = [float(t) for t in times]
    if not values:
        return "-"
    runs = [(int(s[0]), int(s[1])) for s in steps] if steps is not None and len(steps) == len(values) else []
    partial = {i for i, (ran, of) in enumerate(runs) if ran < of}
    full = [t for i, t in enumerate(values) if i not in partial]
    if not full:  # one epoch, cut short
        return ", ".join(f"{t:.2f} s{partial_mark(r)}" for t, r in zip(values, runs))
    mean = sum(full) / len(full)
    head = f"mean {mean:.2f} s" + (f" over {len(full)} full epoch{'s' * (len(full) != 1)}" if partial else "")
    if len(values) <= 10:
        listed = ", ".join(f"{t:.2f}{partial_mark(runs[i]) if runs else ''}" for i, t in enumerate(values))
        return f"{head}  [{listed}] s"
    cut = "".join(f"; epoch {i + 1} partial: {values[i]:.2f} s, {runs[i][0]} of {runs[i][1]} steps"
                  for i in sorted(partial))
    return f"{head}  (min {min(full):.2f}, max {max(full):.2f}, {len(values)} epochs{cut})"


#: What a freeze at the run's last step is marked with: it came after the last optimizer step and saved nothing.
AFTER_LAST_STEP = "after the last step"


def freeze_step_text(step: int, epoch: int | None = None, last_step: int | None = None) -> str:
    """When a block froze or thawed, as the run summary and the report say it: ``"step 0 (before training)"`` (the
    start stage, before the first optimizer step, whatever epoch it is filed under), else ``"step 40 (epoch 2)"``
    (``epoch`` counted from 0 as the files count it, shown from 1 as the progress bar counts) or ``"step 40"`` when
    the epoch is unknown; at ``last_step`` (the run's steps, if given) ``"step 52 (epoch 2, after the last step)"``,
    so a freeze that trained no step frozen does not read as a saving. ``step``: optimizer steps done when it
    happened."""
    step = int(step)
    if step == 0:
        return "step 0 (before training)"
    notes = ([f"epoch {int(epoch) + 1}"] if epoch is not None else []) + (
        [AFTER_LAST_STEP] if last_step is not None and step >= int(last_step) else [])
    return f"step {step}" + (f" ({', '.join(notes)})" if notes else "")


def _format_timeline(timeline: list[Mapping[str, Any]], blocks: list[str] | None = None,
                     last_step: int | None = None) -> str:
    """One line per freeze or thaw, by step, and within a step front to back (the order of ``blocks``, the model's
    block order; events of a block not in it keep their recorded order); those at ``last_step`` (the run's steps)
    marked as after the last step (:func:`freeze_step_text`)."""
    position = {name: i for i, name in enumerate(blocks or [])}
    rows = sorted(timeline, key=lambda e: (int(e.get("step", 0)), position.get(str(e.get("block")), len(position))))
    width = max((len(str(e.get("block", ""))) for e in rows), default=0)
    lines = []
    for entry in rows:
        block = str(entry.get("block", "?"))
        action = str(entry.get("action", "freeze"))
        verb = {"freeze": "frozen", "thaw": "thawed"}.get(action, action)
        when = freeze_step_text(entry.get("step", 0), entry.get("epoch"), last_step)
        lines.append(f"{block.ljust(width)}  {verb} at {when}")
    return "\n".join(lines)


def summary_table(summary: Mapping[str, Any], title: str = "layerfreeze run") -> Table:
    """Build a two-column ``rich`` table summarising a run.

    Recognised keys of ``summary`` (all optional; absent or None keys are
    left out, unknown keys are ignored): ``strategy``, ``model``, ``task``,
    ``test_accuracy`` (fraction in 0..1, shown as a percentage with 2
    decimals), ``test_perplexity`` (language models), ``test_loss``, ``epochs``, ``steps``, ``wall_time_s``,
    ``train_time_s`` (seconds), ``time_per_epoch_s`` (list of seconds; ``epoch_steps`` marks an epoch cut short,
    :func:`epoch_times_text`),
    ``flops_total``, ``flops_per_step_first``, ``flops_per_step_last``
    (FLOPs), ``peak_memory_bytes`` (bytes), ``memory`` (the memory ledger's peaks, :func:`memory_lines`; in a
    distributed run rank 0's, and each rank's tensor peak from ``ranks``, :func:`rank_memory_lines`),
    ``world_size`` (FLOPs are rank 0's), ``resumed_from_step`` (wall time is then this process's),
    ``memory_plan`` (``freeze.memory_budget``: budget, predicted and measured tensor peak),
    ``cache`` (the trainer's activation-cache summary), ``demote`` (:func:`_format_demote`) and
    ``freeze_timeline`` (list of
    ``{"block", "step", "epoch", "action"}``; rendered one line per entry as
    ``"<block>  frozen at step N (epoch E)"``, blocks frozen from the start
    having step 0, ``"frozen at step 0 (before training)"``, those at the run's last ``steps`` marked
    ``"after the last step"``: :func:`freeze_step_text`).
    """
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric", style="cyan", no_wrap=True)
    table.add_column("value", overflow="fold")

    def get(key: str) -> Any:
        return summary.get(key)

    for key in ("strategy", "model", "task", "precision"):
        if get(key) is not None:
            table.add_row(key, str(get(key)))
    if get("test_accuracy") is not None:
        table.add_row("test accuracy", f"{100.0 * float(get('test_accuracy')):.2f}%")
    if get("test_perplexity") is not None:
        table.add_row("test perplexity", f"{float(get('test_perplexity')):.2f}")
    if get("test_loss") is not None:
        table.add_row("test loss", f"{float(get('test_loss')):.4f}")
    for key in ("epochs", "steps"):
        if get(key) is not None:
            table.add_row(key, f"{int(get(key)):,}")
    resumed = get("resumed_from_step")
    if get("wall_time_s") is not None:  # this process's; train time sums every process of a resumed run
        table.add_row(wall_time_label(resumed), format_seconds(get("wall_time_s")))
    if get("train_time_s") is not None:
        table.add_row("train time" if resumed is None else "train time (whole run)",
                      format_seconds(get("train_time_s")))
    compiled = get("compile")
    if compiled:  # train time counts every step, compiling included: the compile seconds said apart
        in_steps = compiled.get("train_compile_s")
        steps = "" if in_steps is None else f" ({format_seconds(in_steps)} of it in training steps)"
        table.add_row("torch.compile", f"{compiled['mode']} ({compiled['backend']}): {compiled['graphs']} graphs in "
                      f"{compiled['regions']} regions, {format_seconds(compiled['compile_s'])} compiling{steps}")
    if get("time_per_epoch_s") is not None:
        table.add_row("time per epoch", epoch_times_text(list(get("time_per_epoch_s")), get("epoch_steps")))
    if get("flops_total") is not None:
        table.add_row("training FLOPs", format_flops(get("flops_total")))
    first, last = get("flops_per_step_first"), get("flops_per_step_last")
    # counted on rank 0, on its share of the global batch
    each = " per rank" if (get("world_size") or 1) > 1 else ""
    if first is not None:
        table.add_row(f"FLOPs/step{each} (first)", format_flops(first))
    if last is not None:
        text = format_flops(last)
        if first is not None and float(first) > 0:
            change = 100.0 * (float(last) - float(first)) / float(first)
            text += f" ({change:+.1f}% vs first)"
        table.add_row(f"FLOPs/step{each} (last)", text)
    if get("peak_memory_bytes") is not None:
        table.add_row("peak memory", format_bytes(get("peak_memory_bytes")))
    if get("memory") is not None:
        lines = memory_lines(get("memory"))
        per_rank = rank_memory_lines(get("ranks") or [])
        table.add_row("tensor peak (rank 0)" if per_rank else "tensor peak", lines[0])
        if per_rank:
            table.add_row("tensor peak per rank", "\n".join(per_rank))
        if len(lines) > 1:
            table.add_row("memory by bucket (peak, rank 0)" if per_rank else "memory by bucket (peak)",
                          "\n".join(lines[1:]))
    plan = get("memory_plan")
    if plan and plan.get("predicted_peak_bytes") is not None:
        text = (f"{format_bytes(plan['budget_bytes'])}: predicted peak {format_bytes(plan['predicted_peak_bytes'])}, "
                f"{plan.get('k', 0)} block(s) frozen from the start")
        if plan.get("measured_peak_bytes") is not None:
            text += (f"\nmeasured {format_bytes(plan['measured_peak_bytes'])} ({100 * plan['error']:+.1f}%), "
                     + ("within the budget" if plan.get("within_budget") else "OVER the budget"))
        table.add_row("memory budget", text)
    if get("cache") is not None:
        table.add_row("activation cache", _format_cache(get("cache")))
    if get("demote"):
        table.add_row("demotion", _format_demote(get("demote")))
    timeline = get("freeze_timeline")
    if timeline:
        table.add_section()
        table.add_row("freeze timeline", _format_timeline(list(timeline), get("blocks"), get("steps")))
    return table


def memory_lines(memory: Mapping[str, Any]) -> list[str]:
    """The summary's ``memory`` entry (:meth:`layerfreeze.runs.ledger.MemoryLedger.summary`) for people: first the
    tensor peak (``"45.2 MiB at step 12"``, per device when there are several), then one line per bucket with its
    peak and the step it was reached at; ``["off"]`` when the ledger was off."""
    if memory.get("ledger") is False:
        return ["off (run.ledger: false)"]
    peak = memory.get("tensor_peak_bytes")
    if peak is None:
        return ["-"]
    head = f"{format_bytes(peak)} at step {memory.get('tensor_peak_step')}"
    devices = {d: v for d, v in (memory.get("devices") or {}).items() if d != DISK}
    if len(devices) > 1:
        head += " (" + ", ".join(f"{d} {format_bytes(v['tensor_peak_bytes'])}" for d, v in devices.items()) + ")"
    buckets = memory.get("buckets") or {}
    width = max((len(bucket_label(b)) for b in buckets), default=0)
    lines = [head]
    for bucket, p in buckets.items():
        lines.append(f"{bucket_label(bucket).ljust(width)}  {format_bytes(p['peak_bytes']):>10}  (step {p['step']})")
    return lines


def rank_memory_lines(ranks: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per rank of a distributed run's summary (``ranks``, each with its own ledger's ``memory``):
    ``"rank 1: 45.2 MiB at step 12"``, what that rank's tensors peaked at (under FSDP2 its shards of the parameters,
    gradients and optimizer state); empty when the ranks carry no ledger."""
    lines = []
    for r in ranks:
        memory = r.get("memory") or {}
        if memory.get("tensor_peak_bytes") is None:
            return []
        lines.append(f"rank {r.get('rank')}: {format_bytes(memory['tensor_peak_bytes'])} at step "
                     f"{memory.get('tensor_peak_step')}")
    return lines


def _format_cache(c: Mapping[str, Any]) -> str:
    """The summary's ``cache`` entry in one line: lookups, seconds saved, and the bytes it holds at the end of the run
    (the ``auto`` policy frees an entry after its last read, so often 0 B; the peak is the ``memory by bucket``
    row)."""
    if c.get("disabled"):
        return f"off during the run ({c['disabled']})"
    if not c.get("used", False):
        return "off" if c.get("mode") == "off" else "off (see the cache_off event)"
    if not c.get("hits") and not c.get("misses"):  # on all run, but no block froze in front of the trained ones
        # the mode the user set (auto, the default, or on), not "on": auto is what they have
        return f"{c.get('mode') or 'on'}, idle: no frozen prefix to cache all run (0 lookups)"
    rate = "-" if c.get("hit_rate") is None else f"{100 * c['hit_rate']:.0f}%"
    disk = f" + {format_bytes(c['disk_bytes'])} on disk" if c.get("disk_bytes") else ""
    freed = f" ({c['policy_freed']:,} entries freed once no longer needed)" if c.get("policy_freed") else ""
    # the prefix outputs it holds at the end, said so: the ledger's "activation cache (memory)" row is its peak (with
    # the inputs' fingerprints), and "12.0 MiB (step 10)" there beside "0 B in memory" here read as a contradiction
    return (f"{c['hits']:,} hits ({rate}), ~{format_seconds(c['saved_seconds'])} of prefix forward saved; at the end "
            f"{format_bytes(c['memory_bytes'])} of prefix outputs in memory{disk}{freed}")


def _format_demote(d: Mapping[str, Any]) -> str:
    """The summary's ``demote`` entry (:meth:`~layerfreeze.engine.demote.Demoter.summary`) for people: what was cast
    or offloaded, and where the float32 master copies were kept: on disk they are scratch files in the run folder's
    ``demoted/``, deleted at the end, when every demoted block gets its float32 weights back."""
    what = " + ".join(x for x in (d.get("dtype"), f"offload to {d['offload']}" if d.get("offload") else None) if x)
    blocks = d.get("demoted_blocks") or []
    text = f"{what or 'on'}: {len(blocks)} block(s) demoted at the end"
    places = d.get("master_places") or []
    if "disk" in places:
        where = d.get("master_dir") or "a temporary folder"
        text += (f"; float32 master copies on disk in {where} during the run (deleted at the end, the blocks given "
                 "their float32 weights back)")
    if "memory" in places:
        text += "; float32 master copies in host memory"
    if d.get("skipped"):
        text += f"; not demoted: {', '.join(d['skipped'])}"
    return text


def print_summary(summary: Mapping[str, Any], console: Console | None = None) -> None:
    """Print :func:`summary_table` of ``summary`` to ``console`` (a new
    ``rich.console.Console`` on stdout if None)."""
    (console or Console()).print(summary_table(summary))
