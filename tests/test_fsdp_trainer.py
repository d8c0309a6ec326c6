"""The CLI trainer under FSDP2 (``run.parallel: fsdp``, ``--parallel fsdp``): 2 real processes, gloo.

Trainer-level runs go through :func:`tests.distributed.worker.run_trainer` (the tiny MLP task, a record of every
rank's gathered weights after every step); the last test is the user's command, ``torchrun ... -m layerfreeze train
--parallel fsdp``, on a tiny BERT, and its resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from layerfreeze.cli import main
from layerfreeze.runs import rundir
from layerfreeze.runs.rundir import read_metrics
from layerfreeze.train.config import build_config
from tests.distributed.launch import PYTHONPATH, ROOT, launch
from tests.test_distributed import assert_ranks_agree, assert_resumed_equals, one_process, spec, trainable_bytes

pytestmark = pytest.mark.timeout(300)

#: fp32 bytes of each block of the MLP (tests.distributed.worker.mlp_task): four 16/24->24 stages and the head 24->4
BLOCK_BYTES = [4 * (16 * 24 + 24)] + [4 * (24 * 24 + 24)] * 3 + [4 * (24 * 4 + 4)]
MLP_BYTES = sum(BLOCK_BYTES)


def fsdp(tmp_path, name, strategy, params=None, epochs=3, **run):
    return spec(tmp_path, name, strategy, params, epochs, parallel="fsdp", **run)


def test_fsdp_thaws_mid_run_follow_the_single_process_run_and_each_rank_records_its_shards(tmp_path):
    # gradual unfreezing: blocks 0-3 frozen at the start, one thawed every 3 steps
    a = assert_ranks_agree(launch(fsdp(tmp_path, "fsdp", "gradual", {"every_steps": 3}), tmp_path / "ranks"))
    thaws = [(h["block"], h["step"]) for h in a["history"] if h["kind"] == "thaw"]
    assert thaws == [("3", 3), ("2", 6), ("1", 9), ("0", 12)]
    ref = one_process(tmp_path, spec(tmp_path, "single-run", "gradual", {"every_steps": 3}))
    assert [(h["block"], h["step"]) for h in ref["history"] if h["kind"] == "thaw"] == thaws
    for key, value in ref["weights"].items():
        torch.testing.assert_close(torch.tensor(a["weights"][key]), torch.tensor(value), rtol=1e-5, atol=1e-6)
    assert a["summary"]["test_accuracy"] == pytest.approx(ref["summary"]["test_accuracy"], abs=1e-9)
    by_step = {x["step"]: x["hashes"] for x in a["steps"]}
    for block, thawed in (("0.", 12), ("1.", 9), ("2.", 6), ("3.", 3)):  # frozen until thawed: bitwise unchanged
        keys = [k for k in by_step[0] if k.startswith(block)]
        assert all(by_step[s][k] == by_step[0][k] for s in range(thawed + 1) for k in keys)
        assert all(by_step[thawed + 1][k] != by_step[thawed][k] for k in keys)

    # FSDP2 reduce-scatters exactly the trainable blocks' gradients (a frozen block's: nothing)
    summary = a["summary"]
    assert summary["parallel"] == "fsdp" and summary["world_size"] == 2 and "ddp_rebuilds" not in summary
    frozen_sets = [[True] * 4, [True] * 3 + [False], [True] * 2 + [False] * 2, [True] + [False] * 3, [False] * 4]
    assert [p["from_step"] for p in summary["grad_bytes_phases"]] == [1, 4, 7, 10, 13]
    assert [p["grad_bytes_per_step"] for p in summary["grad_bytes_phases"]] == [trainable_bytes(f) for f in
                                                                                frozen_sets]
    steps = [r for r in read_metrics(tmp_path / "fsdp") if r["type"] == "step" and "loss" in r]
    assert all(r["all_gather_bytes"] >= MLP_BYTES for r in steps)  # every block gathered whole in the forward

    # each rank's own record: it holds half of every parameter, and optimizer state for the trainable ones only
    ranks = [[r for r in read_metrics(rundir.rank_dir(tmp_path / "fsdp", k)) if r["type"] == "step"] for k in (0, 1)]
    assert [len(r) for r in ranks] == [18, 18]
    for r0, r1 in zip(*ranks):
        assert r0["param_bytes"] + r1["param_bytes"] == MLP_BYTES and r0["param_bytes"] == r1["param_bytes"]
        assert r0["rank"] == 0 and r1["rank"] == 1 and r0["peak_memory_bytes"] > 0 and r1["peak_memory_bytes"] > 0
        assert r0["reduce_scatter_bytes"] == r1["reduce_scatter_bytes"]
    for before, after in zip(ranks[0], ranks[0][1:]):  # a thawed block gets its state at its first update
        # AdamW: two moments (sharded like their parameter) and a 4-byte step count per trained tensor (2 a block)
        assert after["optimizer_state_bytes"] - 2 * before["trainable_param_bytes"] in [8 * n for n in range(1, 6)]
    assert ranks[0][0]["trainable_param_bytes"] == trainable_bytes([True] * 4) // 2
    assert ranks[0][-1]["trainable_param_bytes"] == MLP_BYTES // 2
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]

    # each rank's memory ledger, in its own records: the first step and the step after every thaw (and every 10th)
    sampled = [[r for r in rank if "memory" in r] for rank in ranks]
    assert [r["step"] for r in sampled[0]] == [r["step"] for r in sampled[1]] == [1, 4, 7, 10, 13]
    for rank in sampled:
        for r in rank:  # its shards' bytes: exactly half of every block (all dims even), as the rank's record says
            buckets = r["memory"]["buckets"]
            assert r["memory"]["blocks"]["params"] == [n // 2 for n in BLOCK_BYTES]
            assert buckets["params_trainable"] + buckets["params_frozen"] == r["param_bytes"] == MLP_BYTES // 2
            assert buckets["params_trainable"] == r["trainable_param_bytes"]
            assert buckets["grads"] == buckets["params_trainable"]  # a gradient shard for each trainable shard
            assert buckets["optimizer"] == r["optimizer_state_bytes"]
    main_records = [r for r in read_metrics(tmp_path / "fsdp") if r["type"] == "step" and "memory" in r]
    assert [r["memory"] for r in main_records] == [r["memory"] for r in sampled[0]]  # metrics.jsonl: rank 0's
    for k, rank in enumerate(sampled):  # the summary: each rank's own peaks
        peaks = summary["ranks"][k]["memory"]
        assert peaks["samples"] == 5
        assert peaks["tensor_peak_bytes"] == max(r["memory"]["tensor_bytes"] for r in rank)
        assert peaks["buckets"]["params_trainable"] == {"peak_bytes": MLP_BYTES // 2, "step": 13}
    assert summary["memory"] == summary["ranks"][0]["memory"]


def test_fsdp_resume_on_two_ranks_equals_the_uninterrupted_run_bitwise(tmp_path):
    # dropout on: each rank's own RNG stream comes back from the (full) checkpoint
    full = fsdp(tmp_path, "full", "gradual", {"every_steps": 3})
    full["dropout"] = 0.2
    ref = assert_ranks_agree(launch(full, tmp_path / "full-ranks"))
    cut = fsdp(tmp_path, "cut", "gradual", {"every_steps": 3})
    cut.update(dropout=0.2, interrupt_at_step=8)  # Ctrl-C on rank 0 only: both stop after step 9, checkpointed
    first = launch(cut, tmp_path / "cut-ranks")
    assert first.returncodes == [0, 0], first.outputs
    assert [r["steps"][-1]["step"] for r in first.results] == [9, 9]
    cut["config"]["run"]["resume"] = str(tmp_path / "cut")
    # a checkpoint after every step verifies the frozen weights against their checksums: block 0 stays frozen across
    # the resume (until step 12), and each rank checks its own shards against what the checkpoint holds (rank 0's
    # Freezer state)
    cut["config"]["run"]["checkpoint_every_steps"] = 1
    cut.pop("interrupt_at_step")
    resumed = assert_ranks_agree(launch(cut, tmp_path / "resumed-ranks"))
    assert_resumed_equals(resumed, ref, from_step=9)
    # each rank's ledger peaks come back from the checkpoint: the resumed run's cover the whole run (the frozen
    # parameters' peak at step 1, before the resume); the cache's buckets differ (the resumed process's starts cold)
    for mine, theirs in zip(resumed["summary"]["ranks"], ref["summary"]["ranks"]):
        assert mine["memory"]["samples"] == theirs["memory"]["samples"] and mine["memory"]["blocks"] == theirs[
            "memory"]["blocks"]
        model_buckets = ("params_trainable", "params_frozen", "buffers", "grads", "optimizer", "activations")
        assert [mine["memory"]["buckets"][b] for b in model_buckets] == [theirs["memory"]["buckets"][b]
                                                                          for b in model_buckets]
        assert mine["memory"]["buckets"]["params_frozen"]["step"] == 1


@pytest.mark.parametrize("strategy,params,guard", [
    ("autofreeze", {"interval": 2}, True),   # gradient norms of sharded gradients, the guard's sharded evaluation
    # weight samples, read from rank 0's mirror; the gate off, so the predictor is asked at every stage (with the
    # gate on it is asked only once a block's Adam step has peaked and fallen: p_freeze is NaN before)
    ("smartfrz", {"snr_gate": None}, False),
    ("egeria", {"interval": 2, "patience": 1, "probe_size": 8, "synchronous": True}, False),  # the mirror's probe
])
def test_fsdp_strategies_that_read_gradients_or_weights_decide_the_same_on_every_rank(tmp_path, strategy, params,
                                                                                       guard):
    # rank 0 decides from what it reads (the library tests, tests/test_fsdp.py, compare those signals with an
    # unsharded run's); every rank applies it at the same step
    s = fsdp(tmp_path, "fsdp", strategy, params, epochs=4)
    if guard:
        s["config"]["freeze"]["guard"] = {"tolerance": 0.01, "every_steps": 4}
    a = assert_ranks_agree(launch(s, tmp_path / "ranks"))
    records = read_metrics(tmp_path / "fsdp")
    if strategy != "smartfrz":  # smartfrz's predictor freezes nothing in 24 steps of this MLP; its signals move
        assert any(a["steps"][-1]["frozen"]), f"{strategy} froze nothing: no mid-run freeze to test"
        assert all(h["step"] > 0 for h in a["history"])
    else:
        p = [r["signal_p_freeze"][0] for r in records if r["type"] == "step" and "signal_p_freeze" in r]
        assert len({round(v, 6) for v in p if v == v}) > 3
    if guard:
        assert len([r for r in records if "val_loss" in r]) >= 4


@pytest.mark.parametrize("strategy,params", [("lisa", {"gamma": 1, "k": 3}), ("badam", {"k": 2, "order": "random"})])
def test_fsdp_rotating_strategies_switch_on_every_rank_and_each_ranks_ledger_holds_the_trained_shards_state(
        tmp_path, strategy, params):
    # the blocks that train change every few steps; every rank applies rank 0's switch, the decisions are the
    # single-process run's, and a switched-off block's optimizer state is gone from every rank (fresh state per switch)
    a = assert_ranks_agree(launch(fsdp(tmp_path, "fsdp", strategy, params), tmp_path / "ranks"))
    assert len({h["step"] for h in a["history"] if h["kind"] == "thaw"}) >= 6
    ref = one_process(tmp_path, spec(tmp_path, "single-run", strategy, params))
    assert ref["history"] == a["history"]
    for key, value in ref["weights"].items():
        torch.testing.assert_close(torch.tensor(a["weights"][key]), torch.tensor(value), rtol=1e-5, atol=1e-6)
    for k in (0, 1):
        sampled = [r for r in read_metrics(rundir.rank_dir(tmp_path / "fsdp", k)) if "memory" in r]
        assert len(sampled) >= 6
        for r in sampled:  # AdamW's two moments of each trained block's shard and a 4-byte step per tensor, no more
            blocks = r["memory"]["blocks"]
            assert blocks["optimizer"] == [0 if f else n + 8 for f, n in zip(blocks["frozen"], BLOCK_BYTES)]
            assert blocks["params"] == [n // 2 for n in BLOCK_BYTES]


def test_fsdp_prefix_cache_on_each_rank_hits_every_sample_after_epoch_one(tmp_path):
    # static k=2 and the cache on: each sample stays on one rank (index % 2), which caches its prefix output; the
    # ranks agree each step on what all of them run (a rank whose share is empty pads with a sample it never cached)
    s = fsdp(tmp_path, "on", "static", {"k": 2})
    s["config"]["freeze"]["cache"] = {"mode": "on"}
    on = assert_ranks_agree(launch(s, tmp_path / "on-ranks"))
    epochs = [r for r in read_metrics(tmp_path / "on") if r["type"] == "epoch"]
    assert [e["cache_hits"] for e in epochs] == [0, 45, 90]  # rank 0's 45 of the 90 samples, read back
    assert epochs[-1]["cache_full_forwards"] == 0
    ref = one_process(tmp_path, spec(tmp_path, "single-run", "static", {"k": 2}))
    for key, value in ref["weights"].items():  # another assignment of samples to ranks: equal up to float rounding
        torch.testing.assert_close(torch.tensor(on["weights"][key]), torch.tensor(value), rtol=1e-5, atol=1e-6)


# ---- the user's command -----------------------------------------------------------------------------------------

def checkpoints_by_step(run_dir):
    """``{step: folder}`` of the checkpoints in a run folder (the later one of a step saved twice: periodic, then at
    the epoch's end)."""
    out = {}
    for path in sorted((run_dir / rundir.CHECKPOINTS_DIR).iterdir()):
        out[int(path.name.split("-step")[1])] = path
    return out


@pytest.mark.assets("minilm")  # tiny_bert_dir: MiniLM's tokenizer
def test_torchrun_train_parallel_fsdp_freezes_thaws_and_resumes_bitwise(tmp_path, tiny_bert_dir, tiny_csv):
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    args = ["train", "--parallel", "fsdp", "--task", "text-csv", "--data", str(tiny_csv), "--model", str(tiny_bert_dir),
            "--epochs", "3", "--batch-size", "8", "--lr", "1e-3", "-s", "autofreeze", "-p", "interval=3", "-p",
            "percentile=90", "--no-progress", "--no-report", "--set", "freeze.cache.mode=on", "--set",
            "run.dist_timeout_s=60",
            "--device", "cpu",  # gloo on the CPU, also where CUDA is visible: bitwise against the CPU resume
            "--set", "model.max_length=32", "--set", "run.checkpoint_every_steps=1", "--set",
            "run.keep_checkpoints=100", "--set",
            "freeze.guard={tolerance: 0.000001, patience: 1, cooldown: 0, every_steps: 4, val_fraction: 0.2}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "layerfreeze", *args, "--run-dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["parallel"] == "fsdp" and summary["world_size"] == 2 and summary["steps"] == 12
    records = read_metrics(run_dir)
    events = [(r["kind"], r["block"], r["step"]) for r in records if r.get("kind") in ("freeze", "thaw")]
    # autofreeze (gradient norms of sharded gradients, summed over each 3-step interval, over the two encoder layers)
    # froze the first layer and the embeddings with it at step 6; the guard thawed both when the hold-out loss got
    # worse
    assert events == [("freeze", "bert.embeddings", 6), ("freeze", "bert.encoder.layer.0", 6),
                      ("thaw", "bert.encoder.layer.0", 8), ("thaw", "bert.embeddings", 8)]

    # every step's full checkpoint: the frozen blocks did not move while frozen (steps 7-8), layer 0 trained again
    # after its thaw (step 9)
    ckpts = checkpoints_by_step(run_dir)
    assert sorted(ckpts) == list(range(1, 13))
    weights = {s: load_file(p / "model.safetensors") for s, p in ckpts.items()}
    emb = [k for k in weights[6] if k.startswith("bert.embeddings.") and k.endswith("weight")]
    layer0 = [k for k in weights[6] if k.startswith("bert.encoder.layer.0.") and k.endswith("weight")]
    assert emb and all(torch.equal(weights[s][k], weights[6][k]) for s in (7, 8) for k in emb)
    assert layer0 and all(torch.equal(weights[s][k], weights[6][k]) for s in (7, 8) for k in layer0)
    assert any(not torch.equal(weights[9][k], weights[8][k]) for k in layer0)
    assert any(not torch.equal(weights[7][k], weights[6][k]) for k in weights[6] if k.startswith("classifier."))
    steps = [r for r in records if r["type"] == "step" and "loss" in r]
    assert steps[6]["reduce_scatter_bytes"] < steps[5]["reduce_scatter_bytes"]  # step 7: no gradients of the three
    epochs = [r for r in records if r["type"] == "epoch"]
    assert epochs[1]["cache_misses"] > 0  # the frozen prefix's outputs went into rank 0's cache

    # each rank's own record, every step: half of the model's bytes each (whole dims split in two)
    full_bytes = sum(t.numel() * t.element_size() for t in weights[12].values() if t.is_floating_point())
    ranks = [[r for r in read_metrics(rundir.rank_dir(run_dir, k)) if r["type"] == "step"] for k in (0, 1)]
    assert [len(r) for r in ranks] == [12, 12]
    assert all(r0["param_bytes"] + r1["param_bytes"] == full_bytes for r0, r1 in zip(*ranks))
    assert all(r["peak_memory_bytes"] > 0 for rank in ranks for r in rank)
    # each rank's memory ledger: its own shards (half of the model), their gradients and AdamW state; step 7, right
    # after the freeze at step 6, is sampled
    for rank in ranks:
        sampled = {r["step"]: r for r in rank if "memory" in r}
        assert {1, 7, 9} <= set(sampled)
        for r in sampled.values():
            buckets = r["memory"]["buckets"]
            assert buckets["params_trainable"] + buckets["params_frozen"] == r["param_bytes"] == full_bytes // 2
            assert buckets["grads"] == buckets["params_trainable"]  # a gradient shard for each trainable shard
            if r["step"] not in {step for _, _, step in events}:  # the ledger reads it before that step's stage
                assert buckets["optimizer"] == r["optimizer_state_bytes"]
        assert sampled[1]["memory"]["buckets"]["params_frozen"] == 0 < sampled[7]["memory"]["buckets"]["params_frozen"]
        assert sampled[7]["memory"]["buckets"]["grads"] < sampled[1]["memory"]["buckets"]["grads"]
    assert [r["memory"]["tensor_peak_bytes"] > 0 for r in summary["ranks"]] == [True, True]
    assert "tensor peak per rank" in proc.stdout and "rank 1: " in proc.stdout

    # resume from step 5's checkpoint (cut the copy of the run back to it) on two ranks: every later checkpoint is
    # the uninterrupted run's, bit for bit
    again = tmp_path / "again"
    shutil.copytree(run_dir, again, symlinks=True)
    (again / rundir.SUMMARY_FILE).unlink()
    for path in (again / rundir.CHECKPOINTS_DIR).iterdir():
        if int(path.name.split("-step")[1]) > 5:
            shutil.rmtree(path)
    (again / rundir.CHECKPOINT_LINK).unlink()
    ranks_run = launch({}, tmp_path / "resume-ranks", module="layerfreeze",
                       args=["train", "--resume", str(again), "--no-progress", "--no-report"], timeout=200)
    assert ranks_run.returncodes == [0, 0], "\n".join(o[-3000:] for o in ranks_run.outputs)
    resumed = checkpoints_by_step(again)
    assert sorted(resumed) == list(range(1, 13))
    for step in range(6, 13):
        mine = hashlib.sha256((resumed[step] / "model.safetensors").read_bytes()).hexdigest()
        theirs = hashlib.sha256((ckpts[step] / "model.safetensors").read_bytes()).hexdigest()
        assert mine == theirs, f"resumed run differs from the uninterrupted one at step {step}"
    assert json.loads((again / "summary.json").read_text())["test_accuracy"] == summary["test_accuracy"]


# ---- bad input ----------------------------------------------------------------------------------------------------

def test_parallel_fsdp_in_one_process_a_bad_value_and_an_unsharded_run_resumed_sharded_are_exit_2(tmp_path, capsys):
    assert main(["train", "--parallel", "fsdp", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "run.parallel is fsdp" in err and "torchrun --nproc_per_node N" in err and "--parallel ddp" in err
    assert main(["train", "--parallel", "zero3"]) == 2
    assert "run.parallel" in capsys.readouterr().err
    saved = tmp_path / "ddp-run"
    saved.mkdir()
    (saved / rundir.CONFIG_FILE).write_text(json.dumps(build_config({}).model_dump(mode="json")))
    (saved / rundir.METRICS_FILE).write_text("")
    assert main(["train", "--resume", str(saved), "--parallel", "fsdp"]) == 2
    err = capsys.readouterr().err
    assert "saved with run.parallel ddp" in err and "resume it with --parallel ddp" in err
    assert build_config({"run": {"parallel": "fsdp"}}).run.parallel == "fsdp"
    assert build_config({}).run.parallel == "ddp"


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fsdp_mixed_precision_and_compiled_blocks_thaw_on_every_rank_at_once(tmp_path, precision):
    # issue 42 under FSDP2: autocast around the sharded forward, each block's forward compiled inside FSDP2's own
    # (eager) pre-forward all-gather; gradual unfreezing thaws a block every 3 steps and it trains from its thaw
    s = fsdp(tmp_path, "fsdp", "gradual", {"every_steps": 3})
    s["config"]["train"].update(precision=precision, compile="blocks", compile_backend="aot_eager")
    a = assert_ranks_agree(launch(s, tmp_path / "ranks"))
    assert [(h["block"], h["step"]) for h in a["history"] if h["kind"] == "thaw"] == [("3", 3), ("2", 6), ("1", 9),
                                                                                       ("0", 12)]
    by_step = {x["step"]: x["hashes"] for x in a["steps"]}
    keys = [k for k in by_step[0] if k.startswith("0.")]
    assert all(by_step[13][k] != by_step[12][k] for k in keys)  # the last thawed block trained at once
    assert a["summary"]["precision"] == precision and a["summary"]["compile"]["graphs"] > 0
