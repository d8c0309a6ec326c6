"""Tests for layerfreeze.runs.telemetry (metrics files, TensorBoard, summary) and reading metrics back (rundir)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from rich.console import Console

from layerfreeze.runs.rundir import read_metrics
from layerfreeze.runs.summary import format_bytes, format_flops, print_summary, summary_table
from layerfreeze.runs.telemetry import Telemetry


# --------------------------------------------------------------------------- #
# Telemetry files
# --------------------------------------------------------------------------- #
def _scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_telemetry_writes_jsonl_and_tensorboard(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r1"
    with Telemetry(run) as tel:
        tel.log_config({"lr": 1e-3, "out": Path("/tmp/x"), "blocks": ["a", "b"]})
        tel.log_step(1, loss=torch.tensor(2.5), lr=np.float32(0.5), frozen=["a"], note=None)
        tel.log_step(2, loss=1.5, lr=0.25, tokens=np.int64(64))
        tel.log_event("freeze", 2, blocks=["a"], frozen_count=1)
        tel.log_event("checkpoint", 2, path=run / "ckpt.pt")
        tel.log_epoch(0, 2, val_loss=1.25, val_acc=torch.tensor(0.75, dtype=torch.float64))
    assert tel.closed
    tel.close()  # idempotent

    recs = read_metrics(run)
    assert [r["type"] for r in recs] == ["config", "step", "step", "event", "event", "epoch"]
    cfg, s1, s2, ev_freeze, ev_ckpt, ep = recs
    assert cfg["config"] == {"lr": 1e-3, "out": "/tmp/x", "blocks": ["a", "b"]}
    assert s1["step"] == 1 and s1["loss"] == 2.5 and s1["lr"] == 0.5
    assert s1["frozen"] == ["a"] and s1["note"] is None
    assert s2["tokens"] == 64 and isinstance(s2["tokens"], int)
    assert ev_freeze == {**ev_freeze, "kind": "freeze", "step": 2, "blocks": ["a"], "frozen_count": 1}
    assert ev_ckpt["kind"] == "checkpoint" and ev_ckpt["path"] == str(run / "ckpt.pt")
    assert ep["epoch"] == 0 and ep["step"] == 2 and ep["val_acc"] == 0.75
    times = [r["time"] for r in recs]
    assert times == sorted(times) and all(t > 1.6e9 for t in times)

    tb_dir = run / "tensorboard"
    assert any(p.name.startswith("events.out.tfevents") for p in tb_dir.iterdir())
    scalars = _scalars(tb_dir)
    assert scalars["train/loss"] == [(1, 2.5), (2, 1.5)]
    assert scalars["train/lr"] == [(1, 0.5), (2, 0.25)]
    assert scalars["train/tokens"] == [(2, 64.0)]
    assert scalars["epoch/val_loss"] == [(2, 1.25)]
    assert scalars["epoch/val_acc"] == [(2, 0.75)]
    assert scalars["blocks/frozen_count"] == [(2, 1.0)]
    # non-numeric / None metrics are JSON-only
    assert "train/frozen" not in scalars and "train/note" not in scalars

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    tensor_tags = acc.Tags()["tensors"]
    assert any(t.startswith("events") for t in tensor_tags)
    assert any(t.startswith("config") for t in tensor_tags)


def test_telemetry_rejects_bad_input_and_closed(tmp_path: Path) -> None:
    tel = Telemetry(tmp_path, tensorboard=False)
    assert not (tmp_path / "tensorboard").exists()
    with pytest.raises(ValueError, match="reserved"):
        tel.log_step(1, time=3.0)
    with pytest.raises(TypeError, match="not JSON serialisable"):
        tel.log_step(1, obj=object())
    tel.log_step(3, loss=0.5)
    tel.close()
    with pytest.raises(RuntimeError, match="closed"):
        tel.log_step(4, loss=0.5)
    # The rejected calls wrote nothing.
    assert [(r["type"], r["step"]) for r in read_metrics(tmp_path)] == [("step", 3)]


def test_read_metrics_truncated_last_line_and_corrupt_middle(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"type": "step", "step": i, "loss": 1.0 / i}) for i in (1, 2)]
    path.write_text("\n".join(good) + '\n{"type": "step", "st')  # crash mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert [r["step"] for r in read_metrics(path)] == [1, 2]  # file path accepted too

    path.write_text(good[0] + "\n{not json\n" + good[1] + "\n")
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(tmp_path)

    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "missing")


def test_telemetry_resume_after_crash_drops_partial_record(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"type": "step", "step": 1}) + '\n{"type": "st')
    with Telemetry(tmp_path, tensorboard=False) as tel:
        tel.log_step(2, loss=0.1)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert path.read_text().count("\n") == 2


# --------------------------------------------------------------------------- #
# formatting and summary
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 FLOP"),
        (999, "999 FLOP"),
        (1000, "1.00 kFLOP"),
        (65536, "65.5 kFLOP"),
        (1.234e15, "1.23 PFLOP"),
        (4.567e14, "456.7 TFLOP"),
        (999.96e12, "1.00 PFLOP"),
        (2.5e21, "2.50 ZFLOP"),
    ],
)
def test_format_flops(n: float, text: str) -> None:
    assert format_flops(n) == text


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (200 * 2**20, "200.0 MiB"),
        (3 * 2**29, "1.50 GiB"),
        (2**40 - 1, "1.00 TiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_format_rejects_negative() -> None:
    with pytest.raises(ValueError):
        format_flops(-1)
    with pytest.raises(ValueError):
        format_bytes(float("nan"))


def _render(table) -> str:
    console = Console(record=True, width=120)
    console.print(table)
    return console.export_text()


def test_summary_table_renders() -> None:
    summary = {
        "strategy": "autofreeze",
        "model": "minilm-l6",
        "task": "bbc-news",
        "test_accuracy": 0.97531,
        "test_loss": 0.08123,
        "epochs": 3,
        "steps": 1200,
        "wall_time_s": 125.0,
        "train_time_s": 42.5,
        "time_per_epoch_s": [14.0, 14.5, 14.0],
        "flops_total": 1.234e15,
        "flops_per_step_first": 4.0e12,
        "flops_per_step_last": 2.5e12,
        "peak_memory_bytes": 3 * 2**29,
        "freeze_timeline": [
            {"block": "layer.1", "step": 400, "epoch": 1, "action": "freeze"},
            {"block": "embeddings", "step": 0, "epoch": 0, "action": "freeze"},
            {"block": "layer.1", "step": 900, "epoch": 2, "action": "thaw"},
        ],
    }
    text = _render(summary_table(summary, title="my run"))
    for expected in (
        "my run",
        "autofreeze",
        "minilm-l6",
        "bbc-news",
        "97.53%",
        "0.0812",
        "1,200",
        "2m 05.0s",
        "42.50 s",
        "mean 14.17 s",
        "1.23 PFLOP",
        "4.00 TFLOP",
        "2.50 TFLOP (-37.5% vs first)",
        "1.50 GiB",
        "embeddings  frozen at step 0 (before training)",  # the start stage, in the report's words
        "layer.1     frozen at step 400 (epoch 2)",
        "layer.1     thawed at step 900 (epoch 3)",
    ):
        assert expected in text, expected
    # timeline sorted by step
    assert text.index("embeddings  frozen") < text.index("layer.1     frozen") < text.index("thawed")


def test_summary_table_marks_what_froze_after_the_last_step() -> None:
    # linear froze its last blocks at the final epoch end, step 16 of 16: "frozen at step 16 (epoch 2)" read as a
    # saving, though no step trained with them frozen
    summary = {"steps": 16, "blocks": ["features.0", "features.1", "features.2"], "freeze_timeline": [
        {"block": "features.0", "step": 8, "epoch": 0, "action": "freeze"},
        {"block": "features.1", "step": 16, "epoch": 1, "action": "freeze"},
        {"block": "features.2", "step": 16, "epoch": 1, "action": "freeze"}]}
    text = _render(summary_table(summary))
    cells = [line.split("│")[-2].strip() for line in text.splitlines() if line.count("│") == 3]
    assert "features.0  frozen at step 8 (epoch 1)" in cells  # before the last step: unmarked
    assert "features.1  frozen at step 16 (epoch 2, after the last step)" in text
    assert "features.2  frozen at step 16 (epoch 2, after the last step)" in text
    assert text.count("after the last step") == 2


def test_summary_table_shows_only_present_keys() -> None:
    text = _render(summary_table({"test_accuracy": 0.5, "steps": None}))
    assert "50.00%" in text
    assert "steps" not in text and "peak memory" not in text and "freeze timeline" not in text

    console = Console(record=True, width=120)
    print_summary({"strategy": "none", "peak_memory_bytes": 200 * 2**20}, console=console)
    out = console.export_text()
    assert "layerfreeze run" in out and "none" in out and "200.0 MiB" in out


def test_summary_table_of_a_distributed_run_names_each_ranks_tensor_peak() -> None:
    def memory(peak: int, step: int) -> dict:
        return {"ledger": True, "tensor_peak_bytes": peak, "tensor_peak_step": step,
                "buckets": {"params_trainable": {"peak_bytes": peak // 2, "step": step}}}

    summary = {"memory": memory(3 * 2**20, 7),
               "ranks": [{"rank": 0, "memory": memory(3 * 2**20, 7)}, {"rank": 1, "memory": memory(2**20, 9)}]}
    text = _render(summary_table(summary))
    assert "tensor peak (rank 0)" in text and "memory by bucket (peak, rank 0)" in text
    assert "tensor peak per rank" in text
    assert "rank 0: 3.00 MiB at step 7" in text and "rank 1: 1.00 MiB at step 9" in text
    # a ledger off on the ranks, or one process: the plain rows
    off = _render(summary_table({"memory": memory(2**20, 1), "ranks": [{"rank": 0}, {"rank": 1}]}))
    assert "per rank" not in off and "tensor peak " in off and "(rank 0)" not in off


def test_summary_table_says_what_a_resumed_distributed_budgeted_run_counts() -> None:
    # a newcomer read "wall time 1m 31.9s, train time 1m 49.3s" after a resume, and FSDP's per-rank FLOPs unlabelled
    plan = {"budget_bytes": 3 * 2**20, "predicted_peak_bytes": 2 * 2**20, "k": 2, "measured_peak_bytes": 2**21 - 2**14,
            "error": -2**14 / 2**21, "within_budget": True}
    text = _render(summary_table({"wall_time_s": 91.9, "train_time_s": 109.3, "resumed_from_step": 2,
                                  "world_size": 2, "flops_per_step_first": 3.3e10, "memory_plan": plan}))
    assert "wall time (this process, from step 2)" in text and "train time (whole run)" in text
    assert "FLOPs/step per rank (first)" in text
    assert "predicted peak 2.00 MiB" in text and "(-0.8%)" in text and "within the budget" in text
    plain = _render(summary_table({"wall_time_s": 1.0, "train_time_s": 0.5, "flops_per_step_first": 1e9}))
    assert "wall time " in plain and "from step" not in plain and "FLOPs/step (first)" in plain


def test_summary_table_says_the_cache_was_idle_when_no_prefix_ran_through_it() -> None:
    # a `none` row's cache is on all run (mode auto) but never looked anything up: "0 hits (-), 0 B ..., ~0 s saved"
    # read like a cache that ran and missed, beside a log that said it was idle
    idle = {"mode": "auto", "used": True, "disabled": None, "hits": 0, "misses": 0, "hit_rate": None,
            "memory_bytes": 0, "disk_bytes": 0, "saved_seconds": 0.0}
    assert "auto, idle: no frozen prefix to cache all run (0 lookups)" in _render(summary_table({"cache": idle}))
    # the mode the run had: "on" under freeze.cache.mode auto (the default) named a setting the user never made
    assert "on, idle" not in _render(summary_table({"cache": idle}))
    assert "on, idle: no frozen prefix" in _render(summary_table({"cache": {**idle, "mode": "on"}}))
    ran = {**idle, "hits": 96, "misses": 32, "hit_rate": 0.75, "memory_bytes": 2**20, "saved_seconds": 3.0}
    text = _render(summary_table({"cache": ran}))
    assert "96 hits (75%), ~3.00 s of prefix forward saved; at the end 1.00 MiB of prefix outputs in memory" in text
    assert "idle" not in text and "freed" not in text


def test_summary_table_says_the_cache_bytes_are_the_end_s_beside_the_ledger_s_peak() -> None:
    # a static run's table showed "activation cache (memory)  12.0 MiB  (step 10)" (the ledger's peak) beside
    # "192 hits (50%), 0 B of prefix outputs in memory" (what the cache held at the end, after the auto policy freed
    # every entry after its last read): two figures for one cache, neither saying which moment it was
    summary = {"cache": {"mode": "auto", "used": True, "disabled": None, "hits": 192, "misses": 192, "hit_rate": 0.5,
                         "memory_bytes": 0, "disk_bytes": 0, "saved_seconds": 0.5, "policy_freed": 192},
               "memory": {"tensor_peak_bytes": 40 * 2**20, "tensor_peak_step": 10,
                          "buckets": {"cache_memory": {"peak_bytes": 12 * 2**20, "step": 10}}}}
    console = Console(record=True, width=200)
    console.print(summary_table(summary))
    text = " ".join(console.export_text().split())
    assert "memory by bucket (peak) │ activation cache (memory) 12.0 MiB (step 10)" in text
    assert ("192 hits (50%), ~0.50 s of prefix forward saved; at the end 0 B of prefix outputs in memory (192 entries "
            "freed once no longer needed)") in text


def _tensorboard(path: Path) -> dict[str, list[tuple[int, Any]]]:
    """Every tag's (step, value) as TensorBoard's own loader reads them (the plugin accumulator: scalars and text
    alike are tensors there, and its first start marker is the run's start, every later one a restart)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(path))
    events.Reload()
    out = {}
    for tag in events.Tags()["tensors"]:
        out[tag] = [(e.step, tensor_util.make_ndarray(e.tensor_proto).tolist()) for e in events.Tensors(tag)]
    return out


def test_a_resume_purges_what_tensorboard_got_after_the_checkpoint(tmp_path: Path) -> None:
    # after a SIGKILL at step 6 and a resume from the checkpoint at step 4, TensorBoard showed steps 5 and 6 twice
    # (metrics.jsonl's replay rule already dropped the first ones); TensorBoard's own loader also ignored the first
    # resume (a run's first start marker is its start: the original writer wrote none) and the freeze text stayed
    killed = Telemetry(tmp_path)
    killed.log_config({"a": 1})
    for step in range(1, 7):
        killed.log_step(step, loss=float(step))
    killed.log_event("freeze", 6, block="1", frozen_count=2)
    killed.flush()  # a SIGKILL: nothing closes it
    with Telemetry(tmp_path, resuming=True) as resumed:
        resumed.purge_from(5)  # the checkpoint was at step 4
        resumed.log_config({"a": 2}, step=5)
        for step in (5, 6, 7):
            resumed.log_step(step, loss=10.0 * step)
    shown = _tensorboard(tmp_path / "tensorboard")
    assert shown["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0), (6, 60.0), (7, 70.0)]
    assert "blocks/frozen_count" not in shown or shown["blocks/frozen_count"] == []
    assert not shown.get("events/text_summary") and [s for s, _ in shown["config/text_summary"]] == [0, 5]
    with Telemetry(tmp_path, resuming=True) as again:  # stopped before its first checkpoint: from the beginning
        again.purge_from(0)
        again.log_step(1, loss=100.0)
    assert _tensorboard(tmp_path / "tensorboard")["train/loss"] == [(1, 100.0)]
    killed.close()
