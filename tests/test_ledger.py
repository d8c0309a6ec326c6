"""The memory ledger against bytes computed by hand: parameters, gradients, AdamW state and the saved activations of
Linear+ReLU+Linear, before and after a freeze; byte sources (the cache, a frozen side model); the CLI trainer's
records, summary, TensorBoard scalars and the compare table's tensor-peak column (the report's memory plot and rows:
tests/test_report.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from layerfreeze import ActivationCache, CachedPrefix, Freezer, FrozenDifferentiable
from layerfreeze.runs.compare_table import add_ratios, markdown_table, table_cells
from layerfreeze.runs.ledger import MemoryLedger
from layerfreeze.runs.ledger_records import LedgerPeaks, LedgerSnapshot, memory_change
from layerfreeze.runs.rundir import read_metrics
from layerfreeze.train.config import build_config
from layerfreeze.train.trainer import Trainer
from tests.conftest import DEVICES, blob_task

pytestmark = pytest.mark.usefixtures("one_thread")

F32 = 4  # bytes per float32
B = 32  # batch


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))  # blocks "0" and "2" (the head)


def _step(model, optimizer, ledger, x, loss=lambda out: out.sum()):
    with ledger.step():
        loss(model(x)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return ledger.last


def _step_counters_on(optimizer) -> str:
    """Where torch keeps AdamW's ``step`` counters: on the host for a CUDA parameter unless ``capturable`` or ``fused``
    (torch.optim.adam's ``_init_group``), on the parameter's device otherwise."""
    (where,) = {str(s["step"].device) for s in optimizer.state.values()}
    return where


@pytest.mark.parametrize("device", DEVICES)
def test_ledger_matches_bytes_computed_by_hand_before_and_after_a_freeze(device):
    # on CUDA the same bytes (the kernels save the same tensors), split by device: AdamW's step counters on the host
    model = _mlp().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(B, 8).to(device)
    with Freezer(model, optimizer, "none") as freezer, MemoryLedger(model, optimizer, freezer=freezer) as ledger:
        before = _step(model, optimizer, ledger, x)
        freezer.freeze(0)
        after = _step(model, optimizer, ledger, x)

    p0 = (16 * 8 + 16) * F32  # Linear(8, 16): weight + bias = 576 bytes
    p1 = (4 * 16 + 4) * F32  # Linear(16, 4): 272 bytes
    adam0 = 2 * p0 + 2 * F32  # AdamW: exp_avg and exp_avg_sq per parameter, and a float32 `step` per parameter
    adam1 = 2 * p1 + 2 * F32
    x_bytes = B * 8 * F32  # Linear(8, 16) saves its input for its weight gradient
    relu_bytes = B * 16 * F32  # ReLU saves its output; Linear(16, 4) saves the same storage as its input (once)
    assert before.block_names == ["0", "2"] and before.blocks_frozen == [False, False]
    assert before.buckets == {"params_trainable": p0 + p1, "params_frozen": 0, "buffers": 0, "grads": p0 + p1,
                              "optimizer": adam0 + adam1, "activations": x_bytes + relu_bytes}
    assert before.blocks == {"params": [p0, p1], "grads": [p0, p1], "optimizer": [adam0, adam1],
                             "activations": [x_bytes, relu_bytes]}  # the ReLU between them counts for the next block
    assert before.activations_outside == 0  # .sum() saves nothing
    assert before.params_dtype == {"trainable": {"float32": p0 + p1}}
    assert before.tensor_bytes == 2 * (p0 + p1) + adam0 + adam1 + x_bytes + relu_bytes == 6480
    assert before.rss_bytes > 0
    if device == "cpu":
        assert list(before.devices) == ["cpu"] and before.allocator == {}
    else:
        on = str(next(model.parameters()).device)
        steps = 4 * F32  # four parameters, a float32 counter each
        host = steps if _step_counters_on(optimizer) == "cpu" else 0
        assert before.devices[on]["optimizer"] == adam0 + adam1 - host
        assert before.devices.get("cpu", {}).get("optimizer", 0) == host
        assert sum(before.devices[on].values()) == 6480 - host and on in before.allocator

    # frozen: block 0's gradients and AdamW state are freed, and the frozen prefix saves nothing (its input gone);
    # Linear(16, 4) still saves its input, the frozen prefix's output
    assert after.blocks_frozen == [True, False]
    assert after.buckets == {"params_trainable": p1, "params_frozen": p0, "buffers": 0, "grads": p1,
                             "optimizer": adam1, "activations": relu_bytes}
    assert after.blocks == {"params": [p0, p1], "grads": [0, p1], "optimizer": [0, adam1],
                            "activations": [0, relu_bytes]}
    assert memory_change(before, after) == {"params_trainable": p0, "params_frozen": -p0, "buffers": 0, "grads": p0,
                                            "optimizer": adam0, "activations": x_bytes,
                                            "tensor_bytes": p0 + adam0 + x_bytes}
    peaks = ledger.peaks.summary()
    assert peaks["samples"] == 2 and peaks["tensor_peak_bytes"] == 6480 and peaks["tensor_peak_step"] == 1
    assert peaks["buckets"]["params_frozen"] == {"peak_bytes": p0, "step": 2}
    assert peaks["blocks"]["activations"] == [x_bytes, relu_bytes]


@pytest.mark.parametrize("device", DEVICES)
def test_the_loss_counts_outside_the_blocks_and_gradient_accumulation_counts_one_forward(device):
    model = _mlp().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: no optimizer bytes
    x, y = torch.randn(B, 8).to(device), torch.randint(0, 4, (B,)).to(device)
    with Freezer(model, optimizer, "none") as freezer:
        ledger = MemoryLedger(model, optimizer, blocks=freezer.blocks)
        snap = _step(model, optimizer, ledger, x, lambda out: F.cross_entropy(out, y))
    # cross_entropy = log_softmax (saves its (B, 4) output) + nll_loss (the same output, the target, a total weight)
    outside = B * 4 * F32 + B * 8 + F32
    assert snap.activations_outside == outside
    assert snap.blocks["activations"] == [B * 8 * F32, B * 16 * F32]
    assert snap.buckets["activations"] == B * 8 * F32 + B * 16 * F32 + outside
    assert snap.buckets["optimizer"] == 0 and snap.blocks_frozen == []  # blocks without a freezer
    ledger.close()

    ledger = MemoryLedger(model, optimizer)  # no blocks: no per-block figures, every activation outside them
    snap = _step(model, optimizer, ledger, x)
    assert snap.blocks == {} and snap.block_names == [] and snap.activations_outside == B * 8 * F32 + B * 16 * F32

    with ledger.step():  # two micro-batches, one optimizer step: the first forward's tensors are freed by its backward
        for half in (x[:16], x[16:]):
            model(half).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    # each half is a view of x: saving it keeps all of x's storage alive, which is what it counts
    assert ledger.last.buckets["activations"] == B * 8 * F32 + 16 * 16 * F32
    ledger.close()


def test_a_storage_a_parameter_gave_up_since_the_last_sample_counts_when_an_activation_reuses_it():
    """The ledger leaves out saved tensors whose storage is a parameter's or a buffer's. It took that set at the end of
    the previous sample; a demotion, a thaw's restore or a LISA switch frees weight storages in between, the allocator
    gives their addresses to the next step's activations, and those were dropped. Here the storage a weight gave up
    is the next step's input (the same address, deterministically)."""
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    width = 8 * 16  # Linear(8, 16)'s weight holds 16 x 8 floats: one input of batch 16
    with MemoryLedger(model, optimizer) as ledger:
        first = _step(model, optimizer, ledger, torch.randn(16, 8))
        old = model[0].weight.data
        model[0].weight.data = old.clone()  # the weight moves to a new storage (a demotion's cast, a restore)
        second = _step(model, optimizer, ledger, old.view(16, 8))  # its old storage is now an activation
    # Linear(8, 16) saves its input, the ReLU its output (the head's Linear saves it too)
    assert first.buckets["activations"] == second.buckets["activations"] == width * F32 + 16 * 16 * F32


def test_identical_steps_under_lisa_with_demotion_count_the_same_activations():
    """LR 0, the same batch: every step saves the same tensors, whatever blocks LISA switched on and demotion cast."""
    torch.manual_seed(0)
    w = 64
    model = nn.Sequential(*[nn.Sequential(nn.Linear(w, w), nn.GELU()) for _ in range(6)], nn.Linear(w, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = torch.randn(w, w), torch.randint(0, 4, (w,))
    figures = []
    with Freezer(model, optimizer, "lisa", {"k": 1, "gamma": 1},
                 demote={"dtype": "bfloat16", "master": "memory"}) as freezer, \
            MemoryLedger(model, optimizer, freezer=freezer) as ledger:
        for _ in range(20):
            figures.append(_step(model, optimizer, ledger, x, lambda out: F.cross_entropy(out, y)).buckets[
                "activations"])
            freezer.step()
    # the embeddings and the middle block switched on: Linear's input and GELU's input; the 4 middle blocks switched
    # off (frozen, demoted, backward runs through them): GELU's bfloat16 input; the head's input; cross-entropy's
    # log-softmax output, int64 targets and total weight
    assert figures == [2 * 2 * w * w * F32 + 4 * w * w * 2 + w * w * F32 + w * 4 * F32 + w * 8 + F32] * 20


def test_cadence_request_and_peaks_state():
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    ledger = MemoryLedger(model, optimizer, every=3)
    x = torch.randn(B, 8)
    sampled = []
    for step in range(1, 8):
        if step == 4:
            ledger.request()  # the next step is sampled whatever the cadence
        _step(model, optimizer, ledger, x)
        sampled.append(ledger.last_step_sampled)
    assert sampled == [True, False, True, True, False, True, False]  # step 1, every 3rd, and the requested 5th
    assert [ledger.peaks.samples, ledger.steps] == [4, 7]
    state = json.loads(json.dumps(ledger.peaks.state_dict()))  # a checkpoint holds it as plain data
    restored = LedgerPeaks()
    restored.load_state_dict(state)
    assert restored.summary() == ledger.peaks.summary()
    record = ledger.last.to_record()
    assert LedgerSnapshot.from_record(json.loads(json.dumps(record)), step=6).to_record() == record
    ledger.close()
    with pytest.raises(RuntimeError, match="closed"):
        ledger.begin()
    with pytest.raises(ValueError, match="every must be >= 1"):
        MemoryLedger(model, every=0)


def test_byte_sources_the_cache_and_a_frozen_model_in_the_gradient_path():
    torch.manual_seed(0)
    trained = nn.Linear(8, 16)
    side = FrozenDifferentiable(nn.Linear(16, 4))  # in the gradient path: its weight is saved, never an activation
    cache = ActivationCache(budget_bytes=4 * 3 * 16 * F32)  # a write buffer of a quarter: 3 entries of 16 floats
    cache.put_batch(list(range(11)), 1, torch.randn(11, 16))  # 9 entries fit the rest, 2 wait in the write buffer
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    ledger = MemoryLedger(trained, optimizer, sources=[side, cache, lambda: {"replay": 100}])
    with ledger.step():
        side(trained(torch.randn(B, 8))).sum().backward()
        optimizer.step()
    snap = ledger.last
    assert snap.buckets["side_models"] == (16 * 4 + 4) * F32
    assert snap.buckets["activations"] == B * 8 * F32  # only the trained Linear's input
    assert snap.buckets["cache_memory"] == 11 * 16 * F32 and snap.buckets["cache_disk"] == 0
    assert snap.buckets["replay"] == 100 and snap.devices["cpu"]["replay"] == 100  # a plain int: the ledger's device
    cache.flush()  # the write buffer goes to a shard on disk: disk bytes, not in the tensor total
    disk = ledger.sample()
    assert disk.buckets["cache_memory"] == 9 * 16 * F32 and disk.devices["disk"]["cache_disk"] == cache.disk_bytes > 0
    assert disk.tensor_bytes == sum(n for b, n in disk.buckets.items() if b != "cache_disk")
    ledger.add_source(lambda: {"bad": -1})
    with pytest.raises(ValueError, match="bytes must be ints >= 0"):
        ledger.sample()
    ledger.close()
    # a typo of a bucket made a bucket of its own, which held the bytes the named one missed
    typo = MemoryLedger(trained, optimizer, sources=[lambda: {"cache_memroy": 5}])
    with pytest.raises(ValueError, match="reported bucket 'cache_memroy': did you mean 'cache_memory'"):
        typo.sample()
    typo.close()
    cache.close()


def test_a_cached_prefix_and_its_cache_given_both_are_counted_once():
    # the README lists both as byte sources; given both, the cache's bytes were counted twice
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    freezer = Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "static", {"k": 1})
    forward = CachedPrefix(model, freezer=freezer, input_key="x")
    forward({"x": torch.randn(6, 4), "index": torch.arange(6)})
    alone = MemoryLedger(model, sources=[forward]).sample().buckets["cache_memory"]
    for sources in ([forward, forward.cache], [forward.cache, forward], [forward, forward]):
        ledger = MemoryLedger(model, sources=sources)
        assert ledger.sources == [forward] and ledger.sample().buckets["cache_memory"] == alone > 0
        ledger.close()


# ---- the CLI trainer -----------------------------------------------------------------------------------------------


def _config(tmp_path, name, strategy, params=None, **run):
    return build_config({
        "train": {"epochs": 2, "batch_size": 16, "lr": 0.01, "warmup_fraction": 0.1},
        "freeze": {"strategy": strategy, "params": params or {}},
        "run": {"dir": str(tmp_path / name), "progress": False, "checkpoint": False, "ledger_every": 1, **run},
    })


def test_trainer_records_summary_tensorboard_report_and_compare_column(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    none = Trainer(_config(tmp_path, "none", "none"), task=blob_task()).run()
    static = Trainer(_config(tmp_path, "static", "static", {"k": 2}), task=blob_task()).run()
    Trainer(build_config({  # freezes block 0 after epoch 1 (and 1 after epoch 2): the ledger shows what it gave back
        "train": {"epochs": 3, "batch_size": 16, "lr": 0.01}, "freeze": {"strategy": "geometric"},
        "run": {"dir": str(tmp_path / "geo"), "progress": False, "checkpoint": False, "ledger_every": 4,
                "tensorboard": False}}), task=blob_task()).run()
    off = Trainer(_config(tmp_path, "off", "none", ledger=False, tensorboard=False), task=blob_task()).run()
    default = Trainer(build_config({"train": {"epochs": 2, "batch_size": 16}, "freeze": {"strategy": "none"},
                                    "run": {"dir": str(tmp_path / "default"), "progress": False, "checkpoint": False,
                                            "tensorboard": False}}), task=blob_task()).run()

    # The blob model: Linear(16, 32), BatchNorm1d(32), ReLU, Dropout, Linear(32, 32), ReLU, Linear(32, 4); static
    # k=2 freezes the Linear and the BatchNorm
    lin0, bn, lin4, lin6 = (16 * 32 + 32) * F32, 2 * 32 * F32, (32 * 32 + 32) * F32, (32 * 4 + 4) * F32
    buffers = 2 * 32 * F32 + 8  # running mean and var, num_batches_tracked (int64)
    step = next(r for r in read_metrics(tmp_path / "static") if r["type"] == "step" and r["step"] == 2)
    mem = step["memory"]
    loss_bytes = 16 * 4 * F32 + 16 * 8 + F32  # log_softmax output, target, total weight
    # the prefix's output (cached from step 1: a (16, 32) state) is Linear(32, 32)'s input; the ReLU after it
    # saves its output, Linear(32, 4)'s input
    assert {b: mem["buckets"][b] for b in ("params_trainable", "params_frozen", "buffers", "grads", "optimizer",
                                           "activations")} == {
        "params_trainable": lin4 + lin6, "params_frozen": lin0 + bn, "buffers": buffers, "grads": lin4 + lin6,
        "optimizer": 2 * (lin4 + lin6) + 4 * F32, "activations": 2 * 16 * 32 * F32 + loss_bytes}
    assert mem["blocks"]["names"] == ["0", "1", "4", "6"] and mem["blocks"]["frozen"] == [True, True, False, False]
    assert mem["blocks"]["activations"] == [0, 0, 16 * 32 * F32, 16 * 32 * F32]
    assert mem["activations_outside"] == loss_bytes
    assert mem["buckets"]["cache_memory"] == 2 * 16 * (32 * F32 + 2 * 8)  # 2 batches' states and input fingerprints

    memory = static["memory"]
    assert memory["ledger"] is True and memory["every"] == 1 and memory["samples"] == 12
    assert static["tensor_peak_bytes"] == memory["tensor_peak_bytes"] == sum(
        v for b, v in memory["at_tensor_peak"].items() if b != "cache_disk")
    assert memory["buckets"]["cache_memory"] == {"peak_bytes": 6 * 16 * (32 * F32 + 2 * 8), "step": 6}  # epoch 1
    assert none["memory"]["buckets"]["grads"]["peak_bytes"] == lin0 + bn + lin4 + lin6
    # static's peak holds the cache's host copy of the prefix's outputs (13,824 bytes at epoch 1's end); what
    # freezing gives back is the rest. With the cache, static is below none on the CPU by 912 bytes only, and only
    # because the CPU's dropout keeps a float32 mask (2,048 bytes) where CUDA's fused native_dropout keeps a bool
    # one (512): on CUDA none's peak is 1,536 bytes lower (39,404 against static's 40,028, the issue-41 failure)
    assert static["tensor_peak_bytes"] - memory["at_tensor_peak"]["cache_memory"] < none["tensor_peak_bytes"]
    assert memory["at_tensor_peak"]["cache_memory"] == 6 * 16 * (32 * F32 + 2 * 8)
    assert off["memory"] == {"ledger": False} and off["tensor_peak_bytes"] is None
    assert (default["memory"]["every"], default["memory"]["samples"]) == (10, 2)  # the CLI's cadence: steps 1, 10
    assert all("memory" not in r for r in read_metrics(tmp_path / "off"))

    records = read_metrics(tmp_path / "geo")
    freeze = next(r for r in records if r.get("kind") == "freeze")
    assert freeze["step"] == 6 and freeze["block"] == "0"
    assert freeze["held_bytes"] == {"params": lin0, "grads": lin0, "optimizer": 2 * lin0 + 2 * F32,
                                    "activations": 16 * 16 * F32}  # what block 0 held at the last sample (step 4)
    event = next(r for r in records if r.get("kind") == "memory")
    assert (event["step"], event["before_step"], event["changes"]) == (7, 4, [{"kind": "freeze", "block": "0"}])
    returned = event["returned_bytes"]
    assert (returned["grads"], returned["optimizer"], returned["activations"]) == (lin0, 2 * lin0 + 2 * F32,
                                                                                   16 * 16 * F32)
    sampled = [r["step"] for r in records if r["type"] == "step" and "memory" in r]
    assert sampled == [1, 4, 7, 8, 12, 13, 16]  # every 4th, the first, and the ones after the freezes (6, 12)

    acc = EventAccumulator(str(tmp_path / "static" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"memory/grads", "memory/activations", "memory/tensor_total", "memory/rss"} <= tags
    assert [e.value for e in acc.Scalars("memory/grads")][:1] == [lin4 + lin6]

    # compare: a tensor-peak column and its ratio to none
    rows = add_ratios([{"row": "none", **none}, {"row": "static", **static}, {"row": "off", **off}])
    assert rows[0]["tensor_peak_ratio"] == 1.0
    assert rows[1]["tensor_peak_ratio"] == static["tensor_peak_bytes"] / none["tensor_peak_bytes"] < 1
    cells = [table_cells(r) for r in rows]
    assert [c[8:10] for c in cells][2] == ["-", "-"]  # no ledger: no tensor peak
    assert cells[1][9] == f"{rows[1]['tensor_peak_ratio']:.3f}"
    assert "| tensor peak | tensor peak ratio |" in markdown_table(rows)


def test_readme_memory_where_the_bytes_go_snippet(capsys):
    """README "## Memory: where the bytes go": the loop runs as written (its own tiny model and loader of dicts)."""
    from tests.conftest import readme_block

    ns = {}
    exec(compile(readme_block("## Memory: where the bytes go"), "README.md", "exec"), ns)  # noqa: S102
    assert ns["model"][0].weight.shape == (16, 8) and ns["loader"][0]["x"].shape == (B, 8)  # the bytes below
    peaks = ns["peaks"]
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and printed[-1].startswith(f"{peaks['tensor_peak_bytes']} ")  # steps 1, 10; the peaks
    p1 = (4 * 16 + 4) * F32  # static k=1: only Linear(16, 4) trains
    assert peaks["samples"] == 2  # steps 1 and 10
    assert peaks["buckets"]["grads"]["peak_bytes"] == p1
    assert peaks["buckets"]["optimizer"]["peak_bytes"] == 2 * p1 + 2 * F32
    assert peaks["blocks"]["activations"] == [0, B * 16 * F32]  # the frozen prefix's output, the head's input


@pytest.mark.cuda
@pytest.mark.parametrize("options, step_on", [({}, "cpu"), ({"foreach": False}, "cpu"),
                                              ({"capturable": True}, "cuda:0"), ({"fused": True}, "cuda:0")])
def test_on_cuda_bytes_per_device_beside_the_allocator(options, step_on):
    """Each AdamW state tensor counts on the device it lives on. torch keeps the ``step`` counter of a CUDA parameter
    on the CPU (a 0-dim float32) unless the optimizer is capturable or fused: by default the moments are on the GPU and
    the 4 counters (16 bytes) in host memory. The test expected them on cuda:0 (issue 41: 1696 != 1712): a wrong
    expectation, the ledger counted where the bytes are (scripts/gpu_ledger_check.sh)."""
    from layerfreeze import FrozenModule

    device = torch.device("cuda:0")
    side_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    model = _mlp().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **options)
    side = FrozenModule(nn.Linear(4, 2), device=side_device, output_device=device)
    x = torch.randn(B, 8, device=device)
    with Freezer(model, optimizer, "none") as freezer, \
            MemoryLedger(model, optimizer, freezer=freezer, sources=[side]) as ledger:
        snap = _step(model, optimizer, ledger, x, lambda out: out.sum() + side(out.detach()).sum())
    assert {str(s["step"].device) for s in optimizer.state.values()} == {step_on}  # torch's placement, documented
    p, moments, steps = (16 * 8 + 16 + 4 * 16 + 4) * F32, 2 * (16 * 8 + 16 + 4 * 16 + 4) * F32, 4 * F32
    on = snap.devices["cuda:0"]
    assert (on["params_trainable"], on["grads"], on["activations"]) == (p, p, 3072)
    assert on["optimizer"] == moments + (steps if step_on == "cuda:0" else 0)
    assert snap.devices.get("cpu", {}).get("optimizer", 0) == (steps if step_on == "cpu" else 0)
    assert snap.buckets["optimizer"] == moments + steps
    assert snap.devices[side_device]["side_models"] == (4 * 2 + 2) * F32
    stats = snap.allocator["cuda:0"]
    assert stats["allocated"] >= p + on["optimizer"] and stats["peak_allocated"] >= stats["allocated"]
    assert stats["reserved"] >= stats["allocated"] and side_device in snap.allocator
