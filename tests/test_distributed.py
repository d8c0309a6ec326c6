"""Data-parallel training with freezing that changes mid-run: 2 real processes, gloo, a FileStore (no ports).

Each test launches its ranks with :func:`tests.distributed.launch.launch`; every rank records the SHA-256 of every
weight after every step, its frozen set and its freeze history (``tests/distributed/worker.py``).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from layerfreeze.runs.rundir import read_metrics
from tests.distributed.launch import launch
from tests.distributed.worker import run_trainer

pytestmark = pytest.mark.timeout(300)


def spec(tmp_path, name, strategy, params=None, epochs=3, **run):
    """A run of the MLP task on the CPU (``run.device: cpu``): the ranks (gloo) are compared bit for bit with one
    process, which must train on the CPU too, also where a GPU is visible."""
    run = {"device": "cpu", **run}
    return {"config": {
        "train": {"epochs": epochs, "batch_size": 16, "lr": 0.01, "warmup_fraction": 0.0, "weight_decay": 0.0},
        "freeze": {"strategy": strategy, "params": params or {}},
        "run": {"dir": str(tmp_path / name), "progress": False, "dist_timeout_s": 30, **run},
    }}


def one_process(tmp_path, s):
    """The same run in this process (no process group): the reference trajectory."""
    out = tmp_path / "single"
    out.mkdir()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_trainer(s, 0, out / "rank0.json")
    finally:
        torch.set_num_threads(before)
    return json.loads((out / "rank0.json").read_text())


def assert_resumed_equals(resumed, ref, from_step):
    """A resumed run (rank 0's result) starts at ``from_step`` and equals the uninterrupted ``ref`` step by step
    (weight hashes), in its evaluation history and final accuracy."""
    assert resumed["steps"][0]["step"] == from_step
    by_step = {x["step"]: x["hashes"] for x in ref["steps"]}
    for x in resumed["steps"]:
        assert x["hashes"] == by_step[x["step"]], f"resumed run differs from the uninterrupted one at {x['step']}"
    assert resumed["history"] == ref["history"]
    assert resumed["summary"]["test_accuracy"] == ref["summary"]["test_accuracy"]


def assert_ranks_agree(ranks):
    assert ranks.returncodes == [0, 0], "\n".join(o[-2000:] for o in ranks.outputs)
    a, b = ranks.results
    assert len(a["steps"]) == len(b["steps"]) > 1
    for x, y in zip(a["steps"], b["steps"]):
        assert x["step"] == y["step"] and x["frozen"] == y["frozen"], x["step"]
        assert x["hashes"] == y["hashes"], f"weights differ across ranks after step {x['step']}"
    assert a["history"] == b["history"]
    return a


def trainable_bytes(frozen: list[bool]) -> int:
    """fp32 gradient bytes of the MLP's trainable blocks (16->24, 3 x 24->24, head 24->4)."""
    sizes = [16 * 24 + 24, 24 * 24 + 24, 24 * 24 + 24, 24 * 24 + 24, 24 * 4 + 4]
    return 4 * sum(n for n, f in zip(sizes, frozen + [False]) if not f)


def test_thaws_mid_run_keep_ranks_identical_and_follow_the_single_process_run(tmp_path):
    # gradual unfreezing: 4 blocks frozen at the start, one thawed every 3 steps (a thaw is what silently desyncs
    # plain DDP: the thawed parameters were never registered with its reducer)
    s = spec(tmp_path, "ddp", "gradual", {"every_steps": 3})
    a = assert_ranks_agree(launch(s, tmp_path / "ranks"))
    thaws = [(h["block"], h["step"]) for h in a["history"] if h["kind"] == "thaw"]
    assert thaws == [("3", 3), ("2", 6), ("1", 9), ("0", 12)]

    ref = one_process(tmp_path, spec(tmp_path, "single-run", "gradual", {"every_steps": 3}))
    assert [(h["block"], h["step"]) for h in ref["history"] if h["kind"] == "thaw"] == thaws
    for key, value in ref["weights"].items():
        torch.testing.assert_close(torch.tensor(a["weights"][key]), torch.tensor(value), rtol=1e-5, atol=1e-6)
    assert a["summary"]["test_accuracy"] == pytest.approx(ref["summary"]["test_accuracy"], abs=1e-9)

    # gradient bytes all-reduced per step follow the trainable parameters exactly; one rebuild per change
    phases = a["summary"]["grad_bytes_phases"]
    assert [p["from_step"] for p in phases] == [1, 4, 7, 10, 13]
    frozen_sets = [[True] * 4, [True] * 3 + [False], [True] * 2 + [False] * 2, [True] + [False] * 3, [False] * 4]
    assert [p["grad_bytes_per_step"] for p in phases] == [trainable_bytes(f) for f in frozen_sets]
    assert a["summary"]["ddp_rebuilds"] == 5 and len(a["summary"]["ddp_rebuild_s"]) == 5
    records = read_metrics(tmp_path / "ddp")
    assert sum(r.get("kind") == "ddp_rebuild" for r in records) == 5
    steps = [r for r in records if r["type"] == "step"]
    assert all(r["world_size"] == 2 and r["grad_bytes_allreduced"] > 0 for r in steps)


@pytest.mark.parametrize("strategy,params,guard", [
    ("autofreeze", {"interval": 2}, True),   # gradient norms, and the stability guard's validation loss
    ("smartfrz", {}, False),                 # its weight history and attention predictor
    ("egeria", {"interval": 2, "patience": 1, "probe_size": 8}, False),  # a background thread: lands at any step
    ("freezeout", {}, False),                # per-block LR factors every step, then freezes
])
def test_every_strategy_freezes_the_same_blocks_at_the_same_step_on_every_rank(tmp_path, strategy, params, guard):
    # rank 0 decides and broadcasts: whatever the strategy reads, the frozen sets and the weights stay identical
    s = spec(tmp_path, "ddp", strategy, params, epochs=4)
    if guard:
        s["config"]["freeze"]["guard"] = {"tolerance": 0.01, "every_steps": 4}
    a = assert_ranks_agree(launch(s, tmp_path / "ranks"))
    frozen_at_end = a["steps"][-1]["frozen"]
    if strategy in ("autofreeze", "freezeout", "egeria"):
        assert any(frozen_at_end), f"{strategy} froze nothing: the test would not exercise a mid-run freeze"
        assert all(h["step"] > 0 for h in a["history"])
    # one rebuild per change of the frozen set that another step follows: DDP is rebuilt lazily, before the next
    # forward, so a freeze decided at the last step costs none
    frozen = [s["frozen"] for s in a["steps"]]
    changes = sum(1 for x, y in zip(frozen[:-2], frozen[1:-1]) if x != y)
    assert a["summary"]["ddp_rebuilds"] == 1 + changes
    if guard:
        vals = [r for r in read_metrics(tmp_path / "ddp") if "val_loss" in r]
        assert len(vals) >= 4  # the guard evaluated (sharded, all-reduced) at every_steps and each epoch end


@pytest.mark.parametrize("strategy,params", [("lisa", {"gamma": 1, "k": 3}), ("badam", {"k": 2, "order": "random"})])
def test_rotating_strategies_switch_on_every_rank_at_once_with_one_rebuild_per_switch(tmp_path, strategy, params):
    # the layers that train change every few steps (and a thawed block must be all-reduced from its first step):
    # rank 0 samples, every rank applies, the wrapper is rebuilt per change, the weights stay identical
    s = spec(tmp_path, "ddp", strategy, params)
    a = assert_ranks_agree(launch(s, tmp_path / "ranks"))
    frozen = [x["frozen"] for x in a["steps"]]
    changes = sum(1 for x, y in zip(frozen[:-2], frozen[1:-1]) if x != y)
    switches = {h["step"] for h in a["history"] if h["kind"] == "thaw"}
    assert len(switches) >= 6 and changes >= 4
    assert a["summary"]["ddp_rebuilds"] == 1 + changes
    assert sum(r.get("kind") == "ddp_rebuild" for r in read_metrics(tmp_path / "ddp")) == 1 + changes
    # the same decisions as the single-process run (the strategy's own generator, seeded by the run's seed)
    ref = one_process(tmp_path, spec(tmp_path, "single-run", strategy, params))
    assert ref["history"] == a["history"]
    for key, value in ref["weights"].items():
        torch.testing.assert_close(torch.tensor(a["weights"][key]), torch.tensor(value), rtol=1e-5, atol=1e-6)


def test_the_prefix_cache_on_each_rank_hits_every_sample_after_epoch_one_and_keeps_the_trajectory(tmp_path):
    # static k=2: blocks 0-1 frozen from the start; with the cache each sample stays on one rank (index % 2), so
    # every rank finds all of its samples in its own cache from epoch 2 on
    off = assert_ranks_agree(launch(spec(tmp_path, "off", "static", {"k": 2}), tmp_path / "off-ranks"))
    on_spec = spec(tmp_path, "on", "static", {"k": 2})
    on_spec["config"]["freeze"]["cache"] = {"mode": "on"}
    on = assert_ranks_agree(launch(on_spec, tmp_path / "on-ranks"))
    epochs = [r for r in read_metrics(tmp_path / "on") if r["type"] == "epoch"]
    assert [e["cache_hits"] for e in epochs] == [0, 45, 90]  # rank 0 holds its 45 of 90 samples, read back
    assert epochs[-1]["cache_full_forwards"] == 0
    # another assignment of samples to ranks than without the cache: the same run up to float rounding
    for key, value in off["weights"].items():
        torch.testing.assert_close(torch.tensor(on["weights"][key]), torch.tensor(value), rtol=1e-5, atol=1e-6)


def test_resume_on_two_ranks_equals_the_uninterrupted_two_rank_run(tmp_path):
    # dropout on: each rank's own RNG stream must come back from the checkpoint
    full = spec(tmp_path, "full", "gradual", {"every_steps": 3})
    full["dropout"] = 0.2
    ref = assert_ranks_agree(launch(full, tmp_path / "full-ranks"))

    cut = spec(tmp_path, "cut", "gradual", {"every_steps": 3})
    # Ctrl-C on rank 0 only, after step 8's all-reduce: every rank learns of it in step 9's, and stops after it
    cut.update(dropout=0.2, interrupt_at_step=8)
    first = launch(cut, tmp_path / "cut-ranks")
    assert first.returncodes == [0, 0], first.outputs
    assert all(r["interrupted"] for r in first.results)
    assert [r["steps"][-1]["step"] for r in first.results] == [9, 9]

    cut["config"]["run"]["resume"] = str(tmp_path / "cut")
    cut.pop("interrupt_at_step")
    resumed = assert_ranks_agree(launch(cut, tmp_path / "resumed-ranks"))
    assert_resumed_equals(resumed, ref, from_step=9)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_batchnorm_blocks_frozen_mid_run_agree_on_every_rank_and_a_resume_equals_the_run(tmp_path, parallel):
    # each rank's forward updates BatchNorm statistics with its own share; a block frozen after a step left the
    # broadcasts with each rank's own, ran a different frozen prefix on each rank, and a resume (every rank on rank
    # 0's) did not equal the uninterrupted run
    def make(name):
        s = spec(tmp_path, name, "freezeout", {"t0": 0.3}, epochs=2,  # freezes after steps, mid-epoch
                 **({"parallel": "fsdp"} if parallel == "fsdp" else {}))
        s["batchnorm"] = True
        return s

    full = launch(make("full"), tmp_path / "full-ranks")
    assert full.returncodes == [0, 0], "\n".join(o[-2000:] for o in full.outputs)
    ref = full.results[0]
    frozen_at = {x["step"]: sum(x["frozen"]) for x in ref["steps"]}
    first = min(s for s, n in frozen_at.items() if n)
    assert 0 < first < 8 and frozen_at[8] >= 1  # frozen after some steps, before the interruption
    final_frozen = ref["steps"][-1]["frozen"]
    for i, f in enumerate(final_frozen):  # a frozen block's statistics: the same on both ranks
        for key in ("running_mean", "running_var"):
            name = f"{i}.1.{key}"
            if f:
                assert full.results[0]["weights"][name] == full.results[1]["weights"][name], name

    cut = make("cut")
    cut["interrupt_at_step"] = 8
    stopped = launch(cut, tmp_path / "cut-ranks")
    assert stopped.returncodes == [0, 0], stopped.outputs
    cut["config"]["run"]["resume"] = str(tmp_path / "cut")
    cut.pop("interrupt_at_step")
    resumed = launch(cut, tmp_path / "resumed-ranks")
    assert resumed.returncodes == [0, 0], "\n".join(o[-2000:] for o in resumed.outputs)
    assert_resumed_equals(resumed.results[0], ref, from_step=9)


def test_a_killed_rank_stops_the_other_with_its_name_and_the_last_checkpoint_resumes(tmp_path):
    s = spec(tmp_path, "run", "gradual", {"every_steps": 3})
    s["kill_at_step"] = 8  # rank 1 is SIGKILLed after step 8 (the epoch-1 checkpoint was written at step 6)
    t0 = time.monotonic()
    ranks = launch(s, tmp_path / "ranks", timeout=90)
    elapsed = time.monotonic() - t0
    assert ranks.returncodes[1] == -9
    assert ranks.returncodes[0] not in (0, -999), ranks.outputs[0][-3000:]
    assert "RankLostError" in ranks.outputs[0] and "rank 1 stopped" in ranks.outputs[0], ranks.outputs[0][-3000:]
    assert elapsed < 60
    s.pop("kill_at_step")
    s["config"]["run"]["resume"] = str(tmp_path / "run")
    resumed = assert_ranks_agree(launch(s, tmp_path / "resumed"))
    assert resumed["steps"][0]["step"] == 6 and resumed["summary"]["steps"] == 18


def test_the_readme_own_loop_example_runs_on_two_ranks(tmp_path):
    # the example as a user runs it (DistributedSampler, FreezeDDP); autofreeze every 8 steps freezes mid-run
    ranks = launch({}, tmp_path, module="examples.ddp_own_loop",
                   args=["--strategy", "autofreeze", "-p", "interval=8", "--epochs", "3", "--save", str(tmp_path)])
    assert ranks.returncodes == [0, 0], "\n".join(o[-2000:] for o in ranks.outputs)
    assert "freeze block 0" in ranks.outputs[0], ranks.outputs[0]
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    counts = ranks.outputs[0].split("per step: first ")[1].split(" DDP")[0]
    first, last = (int(part.replace("last ", "").replace(",", "")) for part in counts.split(";")[0].split(", "))
    assert last < first


def test_the_own_loop_examples_bad_input_is_one_line_on_each_rank(tmp_path):
    # an unknown strategy or --device cuda without a GPU was a raw traceback on each rank
    for args, said in ((["--strategy", "nope"], "Unknown strategy 'nope'"),
                       (["--strategy", "static", "-p", "k=-1"], "static: k must be")):
        ranks = launch({}, tmp_path / args[1], module="examples.ddp_own_loop", args=args, fresh=True)
        assert ranks.returncodes == [2, 2], ranks.outputs
        assert all(said in out and "Traceback" not in out for out in ranks.outputs), ranks.outputs


@pytest.mark.assets("minilm")  # tiny_bert_dir: MiniLM's tokenizer
def test_torchrun_runs_the_cli_with_the_default_strategy_and_the_cache(tmp_path, tiny_bert_dir, tiny_csv):
    # the user's command: torchrun ... -m layerfreeze train (standalone rendezvous on a free local port)
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "layerfreeze", "train", "--task", "text-csv", "--data", str(tiny_csv), "--model", str(tiny_bert_dir),
           "--epochs", "2", "--batch-size", "8", "--no-progress", "--no-report", "--run-dir", str(run_dir),
           "--set", "freeze.cache.mode=auto", "--set", "run.dist_timeout_s=60", "--set", "model.max_length=32",
           "--device", "cpu",  # gloo on the CPU, also on a GPU machine (NCCL was picked whenever CUDA was visible)
           # the gradient SNR gate off: it holds a freeze until a block's Adam step has peaked and fallen, longer
           # than this 10-step run (tests/test_smartfrz_snr_gate.py); the predictor alone freezes mid-run here
           "-p", "snr_gate=null"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("layerfreeze run") == 1  # the summary table, from rank 0 only
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "smartfrz" and summary["steps"] == 10
    records = read_metrics(run_dir)
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 11))
    freezes = [r for r in records if r.get("kind") == "freeze"]
    assert freezes and all(r["step"] > 0 for r in freezes)  # smartfrz froze mid-run (rank 0 decided)
    rebuilds = [r for r in records if r.get("kind") == "ddp_rebuild"]
    assert len(rebuilds) == 1 + len({r["step"] for r in freezes})
    assert rebuilds[-1]["trainable_parameters"] < rebuilds[0]["trainable_parameters"]
    last_epoch = [r for r in records if r["type"] == "epoch"][-1]
    assert last_epoch["cache_prefix_samples"] > 0  # the frozen prefix ran outside autograd, into rank 0's cache


def test_demoted_blocks_under_ddp_switch_on_every_rank_and_the_ranks_stay_identical(tmp_path):
    # lisa on 2 ranks with frozen blocks demoted to bfloat16: each switch casts the blocks that switch off and gives
    # the float32 master back to those that switch on, on every rank, before DDP is rebuilt around the trainable part
    s = spec(tmp_path, "ddp", "lisa", {"gamma": 1, "k": 3})
    s["config"]["freeze"]["demote"] = {"dtype": "bfloat16", "master": "memory"}
    a = assert_ranks_agree(launch(s, tmp_path / "ranks"))
    assert a["summary"]["demote"]["dtype"] == "bfloat16" and not a["summary"]["demote"]["skipped"]
    assert sum(h["kind"] == "freeze" and h.get("demoted") == "bfloat16" for h in a["history"]) >= 6
    # the same decisions as the single-process demoted run, and the same weights up to the all-reduce's rounding
    ref = one_process(tmp_path, {"config": {**s["config"], "run": {**s["config"]["run"],
                                                                   "dir": str(tmp_path / "single-run")}}})
    assert ref["history"] == a["history"]
    for key, value in ref["weights"].items():
        torch.testing.assert_close(torch.tensor(a["weights"][key]), torch.tensor(value), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_and_compiled_blocks_under_ddp_keep_the_ranks_identical_through_freezes(tmp_path, precision):
    # issue 42: autocast and the compiled regions inside DDP's forward, a frozen set that changes mid-run (static
    # from the start, then FreezeOut's schedule), every rank's weights the same after every step
    s = spec(tmp_path, "ddp", "freezeout", epochs=3)
    s["config"]["train"].update(precision=precision, compile="blocks", compile_backend="aot_eager")
    a = assert_ranks_agree(launch(s, tmp_path / "ranks"))
    assert any(a["steps"][-1]["frozen"])  # a freeze happened under compile, on both ranks at once
    summary = a["summary"]
    assert summary["precision"] == precision and summary["compile"]["graphs"] > 0
