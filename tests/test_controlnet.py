"""The ControlNet demo at CI size (untrained tiny diffusers models, random images, a few steps per placement):
every placement's losses equal the first's where they must, the trainable model stays float32, the table and the
report are written."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("diffusers")

from benchmarks.controlnet import PLACEMENTS, DemoConfig, edge_maps, run_demo


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("controlnet")
    # One trainer thread everywhere: a CPU reduction rounds differently on 1 and on 2 threads (about 1e-7), and
    # the worker placement splits the cores; with equal thread counts the placements must agree bit for bit.
    cfg = DemoConfig(tiny=True, steps=4, batch_size=8, train_size=24, heldout_size=16, window=3, threads=1,
                     pipeline_threads=(1, 1))
    return run_demo(cfg, out=out, log=lambda message: None), out


def test_placements_give_the_same_losses(result):
    res, _ = result
    rows = {r["placement"]: r for r in res["placements"]}
    assert list(rows) == list(PLACEMENTS)
    assert all(r["steps"] == 4 and len(r["losses"]) == 4 for r in rows.values())
    for placement in ("worker", "precompute"):  # float32 frozen models elsewhere / stored: bit for bit
        assert rows[placement]["losses"] == rows["device"]["losses"], placement
        assert rows[placement]["heldout_control"] == rows["device"]["heldout_control"]
    assert 0 < rows["bf16"]["max_abs_loss_diff"] < 1e-2  # bfloat16 frozen models: close, not equal
    for r in rows.values():
        assert r["nonfinite"] is None and all(math.isfinite(x) for x in r["losses"] + r["grad_norms"])
        assert r["controlnet_grad_dtypes"] == ["torch.float32"]
        # the ControlNet's zero convolutions: before training, control changes nothing
        assert r["heldout_control_step0"] == pytest.approx(res["heldout_no_control"], abs=1e-6)
    assert rows["precompute"]["precompute_s"] > 0 and rows["precompute"]["store_bytes"] > 0
    assert rows["worker"]["pipeline"]["batches"] == 4 and 0 <= rows["worker"]["pipeline"]["overlap"] <= 1
    assert sum(rows["bf16"]["frozen_param_bytes"].values()) < sum(rows["device"]["frozen_param_bytes"].values())


def test_the_ledger_reports_each_device_the_trainers_buckets_and_the_frozen_models_bytes(result):
    """Per placement and device, the memory ledger's peaks: the ControlNet's parameters and gradients are its
    float32 bytes, AdamW's state two moments and a float32 step per tensor, the frozen models' bytes are their
    parameters and buffers (bfloat16: half of float32's), and only the precomputed placement holds a store."""
    res, _ = result
    rows = {r["placement"]: r for r in res["placements"]}
    for name, r in rows.items():
        ledger = r["ledger"]
        assert ledger["samples"] == 4 and list(ledger["devices"]) == ["cpu"] + (["disk"] if name == "precompute"
                                                                             else []), name
        cpu = ledger["devices"]["cpu"]
        b = cpu["buckets"]
        trained = r["trainable_param_bytes"]["cpu"]
        assert b["params_trainable"] == b["grads"] == trained and b["params_frozen"] == 0, name
        assert b["optimizer"] == 2 * trained + 4 * r["trainable_tensors"], name
        assert b["activations"] > 0, name  # the ControlNet's and the frozen UNet's (the gradient flows through it)
        assert b["side_models"] >= r["frozen_param_bytes"]["cpu"], name  # parameters and buffers
        # one memory device: its tensor peak is the run's; no larger than its buckets' peaks (maybe other steps')
        assert cpu["tensor_peak_bytes"] == ledger["tensor_peak_bytes"] <= sum(b.values()), name
        assert cpu["tensor_peak_bytes"] >= trained * 4 + b["side_models"], name  # params, grads, 2 moments
        assert cpu["peak_allocated"] is None  # no CUDA here
    side = {name: r["ledger"]["devices"]["cpu"]["buckets"]["side_models"] for name, r in rows.items()}
    assert side["device"] == side["worker"] and side["precompute"] < side["device"]  # only the UNet is kept
    # bfloat16 halves every frozen parameter (integer buffers such as position ids stay as they are)
    assert side["device"] - side["bf16"] >= rows["device"]["frozen_param_bytes"]["cpu"] // 2 > 0
    pre = rows["precompute"]["ledger"]["devices"]
    assert pre["cpu"]["buckets"]["cache_memory"] == rows["precompute"]["store_bytes"] > 0
    assert all("cache_memory" not in r["ledger"]["devices"]["cpu"]["buckets"] for n, r in rows.items()
               if n != "precompute")
    lines = res["memory_table"].splitlines()
    assert len(lines) == 2 + len(PLACEMENTS) and lines[2].startswith("| device | cpu |")


def test_table_results_and_report_are_written(result):
    _, out = result
    table = (out / "table.md").read_text()
    placements, memory = table.split("\n\nMemory per device", 1)
    assert placements.count("\n") == 1 + len(PLACEMENTS) and "0 (identical)" in placements
    assert memory.count("| cpu |") == len(PLACEMENTS) and "frozen models" in memory
    saved = json.loads((out / "results.json").read_text())
    assert [r["placement"] for r in saved["placements"]] == list(PLACEMENTS)
    page = (out / "report" / "index.html").read_text()
    assert "loss_curves.png" in page and "precompute" in page and "Memory per device" in page
    assert (out / "report" / "loss_curves.png").stat().st_size > 1000


def test_bad_config_and_edges():
    with pytest.raises(ValueError, match="unknown placement"):
        DemoConfig(placements=("gpu",))
    with pytest.raises(ValueError, match="train_size"):
        DemoConfig(train_size=4, batch_size=8)
    import torch

    x = -torch.ones(1, 1, 8, 8)
    x[..., 2:6, 2:6] = 1.0
    edges = edge_maps(x)
    assert edges.sum() > 0 and edges[..., 0, 0] == 0 and set(edges.unique().tolist()) <= {0.0, 1.0}
    with pytest.raises(ValueError, match=r"\(N, 1, H, W\)"):
        edge_maps(torch.zeros(2, 3, 8, 8))


def test_stage1_cache_is_checksummed_and_retrains_when_corrupt(tmp_path):
    import torch
    from torch import nn

    from benchmarks.controlnet.models import _cached

    calls, logs = [], []

    def train():
        calls.append(1)
        with torch.no_grad():
            model.weight.fill_(0.5)
        return {"scaling": 2.0}

    model = nn.Linear(3, 2)
    path = tmp_path / "vae-key"
    assert _cached(path, model, train, logs.append) == {"scaling": 2.0} and len(calls) == 1
    fresh = nn.Linear(3, 2)
    assert _cached(path, fresh, train, logs.append) == {"scaling": 2.0} and len(calls) == 1  # loaded, not trained
    assert torch.equal(fresh.weight, torch.full((2, 3), 0.5))
    weights = path / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    assert _cached(path, nn.Linear(3, 2), train, logs.append) == {"scaling": 2.0} and len(calls) == 2
    assert any("unusable" in line and "SHA-256" in line for line in logs)


@pytest.mark.parametrize("flags, said", [
    (["--placements", "foo"], "unknown placement(s) ['foo']; choose from device, worker, precompute, bf16"),
    (["--frozen-device", "banana"], "--frozen-device 'banana' is not a device"),
    (["--pipeline-threads", "3"], "--pipeline-threads '3': give auto or WORKER,TRAINER"),
])
def test_the_demos_bad_options_are_one_line_before_anything_trains(flags, said, capsys):
    # raw tracebacks, --frozen-device only after stage 1 and the held-out evaluation
    from benchmarks.controlnet.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--tiny", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"python -m benchmarks.controlnet: error: {said}" in err and "Traceback" not in err


def test_the_tables_loss_window_is_never_longer_than_the_run(result):
    # `--tiny --steps 6` printed "loss std (last 50)" over a 6-step run
    from benchmarks.controlnet.report import format_table

    res, _ = result
    assert "| loss std (last 3) |" in format_table(res)  # window 3 of 4 steps
    longer = {**res, "config": {**res["config"], "window": 50}}
    assert "| loss std (last 4) |" in format_table(longer)
