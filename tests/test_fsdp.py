"""FSDP2 (per-parameter sharding) with a thaw every 3 steps and a freeze mid-run, on 2 CPU ranks with gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.distributed.launch import PYTHONPATH, ROOT, launch

pytestmark = pytest.mark.timeout(300)

# fp32 gradient bytes per block of the MLP: 16->24, three 24->24, head 24->4
BLOCK_BYTES = [4 * (16 * 24 + 24)] + [4 * (24 * 24 + 24)] * 3 + [4 * (24 * 4 + 4)]


def single_process(tmp_path, spec):
    spec = {**spec, "out": str(tmp_path)}
    tmp_path.mkdir()
    (tmp_path / "single.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "WORLD_SIZE": "1"}
    subprocess.run([sys.executable, "-m", "tests.distributed.fsdp_worker", str(tmp_path / "single.json")], cwd=ROOT,
                   env=env, check=True, timeout=120)
    return json.loads((tmp_path / "rank0.json").read_text())


def test_fsdp2_freeze_and_thaw_mid_run_ranks_identical_equal_to_one_process_and_resume(tmp_path):
    spec = {"steps": 12, "save_at": 8, "checkpoint": str(tmp_path / "ckpt")}
    ranks = launch(spec, tmp_path / "ranks", module="tests.distributed.fsdp_worker")
    assert ranks.returncodes == [0, 0], "\n".join(o[-3000:] for o in ranks.outputs)
    a, b = ranks.results
    for x, y in zip(a["records"], b["records"]):
        assert x["hashes"] == y["hashes"] and x["frozen"] == y["frozen"], x["step"]
    records = a["records"]
    # reduce-scatter carries exactly the trainable blocks' gradients: nothing for a frozen one
    for r in records:
        before = next(p for p in records if p["step"] == r["step"] - 1)["frozen"] if r["step"] > 1 else \
            [True] * 4  # gradual starts with blocks 0-3 frozen; the step's backward ran with the frozen set before
        assert r["reduce_scatter_bytes"] == sum(n for n, f in zip(BLOCK_BYTES, before + [False]) if not f), r["step"]
    # gradual thaws the top frozen block every 3 steps; the manual freeze of block 3 at 7 is undone at 9
    events = [(h["kind"], h["block"], h["step"]) for h in a["history"] if h["step"] > 0]
    assert events == [("thaw", "3", 3), ("thaw", "2", 6), ("freeze", "3", 7), ("thaw", "3", 9), ("thaw", "1", 12)]
    w = {r["step"]: r["weights"] for r in records}
    assert w[7]["3.0.weight"] == w[8]["3.0.weight"] == w[9]["3.0.weight"]  # frozen at 7: bitwise unchanged
    assert w[10]["3.0.weight"] != w[9]["3.0.weight"]  # thawed at 9: it trains again on every rank
    assert all(w[s]["0.0.weight"] == w[1]["0.0.weight"] for s in range(2, 13))  # block 0: frozen throughout
    # no optimizer state for frozen parameters: 2 tensors (weight, bias) per block that trained
    assert records[0]["optimizer_states"] == 2 and records[-1]["optimizer_states"] == 2 * 3

    ref = single_process(tmp_path / "single", {"steps": 12})
    for mine, theirs in zip(records, ref["records"]):
        assert mine["frozen"] == theirs["frozen"]
        for key, value in theirs["weights"].items():
            torch.testing.assert_close(torch.tensor(mine["weights"][key]), torch.tensor(value), rtol=1e-5, atol=1e-6)

    # the full checkpoint holds every weight (frozen ones too) and resumes to the same trajectory, bitwise
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert sorted(saved) == sorted(w[8])
    assert saved["0.0.weight"].tolist() == w[8]["0.0.weight"]  # block 0: frozen all along
    resumed = launch({"steps": 12, "resume": str(tmp_path / "ckpt"), "suffix": "-resumed"}, tmp_path / "ranks",
                     module="tests.distributed.fsdp_worker")
    assert resumed.returncodes == [0, 0], "\n".join(o[-3000:] for o in resumed.outputs)
    again = json.loads((tmp_path / "ranks" / "rank0-resumed.json").read_text())["records"]
    assert [r["step"] for r in again] == [9, 10, 11, 12]
    for r in again:
        assert r["hashes"] == next(x for x in records if x["step"] == r["step"])["hashes"], r["step"]


# ---- the shard layouts users write, with evaluation passes between freezes and thaws (issue 32) ----------------

LAYOUT_FROZEN = {**dict.fromkeys(range(3), [True, True, False, False, False]),  # static k=2
                 **dict.fromkeys((3, 4), [True, False, False, False, False]),  # block 1 thawed after step 3's eval
                 **dict.fromkeys((5, 6), [True, False, True, False, False]),  # block 2 frozen after step 5's eval
                 **dict.fromkeys((7, 8, 9), [True, False, False, False, False])}  # and thawed after step 7's


@pytest.fixture(scope="module")
def layouts_one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts-one-process")
    (tmp / "spec.json").write_text(json.dumps({"layout": "none", "out": str(tmp)}))
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "WORLD_SIZE": "1"}
    subprocess.run([sys.executable, "-m", "tests.distributed.fsdp_layouts_worker", str(tmp / "spec.json")], cwd=ROOT,
                   env=env, check=True, timeout=120)
    return json.loads((tmp / "rank0.json").read_text())


@pytest.mark.parametrize("layout", ["root", "blocks", "layers"])
def test_fsdp2_layouts_freeze_and_thaw_right_after_evaluation_passes(tmp_path, layout, layouts_one_process):
    # root: fully_shard(model) only (one group, the one that stays unsharded after a no-grad forward); blocks:
    # shard_blocks with blocks discovered before sharding; layers: fully_shard per encoder layer, then the root
    ranks = launch({"layout": layout}, tmp_path, module="tests.distributed.fsdp_layouts_worker")
    assert ranks.returncodes == [0, 0], "\n".join(o[-3000:] for o in ranks.outputs)
    a, b = ranks.results
    assert a["warnings"] == [] and b["warnings"] == []  # no parameter seen as "replaced", no block without gradient
    names = a["blocks"]
    records = a["records"]
    assert [r["step"] for r in records] == list(range(10))
    for mine, theirs in zip(records, b["records"]):
        assert mine["weights"] == theirs["weights"] and mine["eval_loss"] == theirs["eval_loss"], mine["step"]
    for r in records:
        frozen = LAYOUT_FROZEN[r["step"]]
        assert r["frozen"] == frozen, r["step"]
        # the sharded parameters (what the optimizer holds and FSDP copies requires_grad from) follow the freezes
        assert r["requires_grad"] == [[not f] * len(n) for f, n in zip(frozen, names)], r["step"]
        assert r["foreign_in_optimizer"] == 0, r["step"]  # never FSDP's unsharded parameters
        assert r["optimizer_params"] == sum(len(n) for f, n in zip(frozen, names) if not f), r["step"]
    # state_dict after the eval pass, block 2 frozen: every optimizer entry has its name
    assert a["saved_param_groups"] == [sum(len(names[i]) for i in (1, 3, 4))]

    def block(step, index):
        return {n: records[step]["weights"][n] for n in names[index]}

    assert all(block(s, 0) == block(0, 0) for s in range(10))  # frozen throughout: bitwise unchanged
    assert all(block(s, 1) == block(0, 1) for s in range(4))  # frozen until the thaw after step 3's eval
    assert all(block(s, 1) != block(s - 1, 1) for s in range(4, 10))  # then it trains at every step
    assert all(block(s, 2) != block(s - 1, 2) for s in range(1, 6))
    assert block(5, 2) == block(6, 2) == block(7, 2)  # frozen after step 5's eval: bitwise unchanged
    assert all(block(s, 2) != block(s - 1, 2) for s in range(8, 10))  # thawed after step 7's: trains again
    assert records[-1]["eval_loss"] < records[0]["eval_loss"] - 0.5
    # the same run in one process, unsharded: same trajectory
    for mine, theirs in zip(records, layouts_one_process["records"]):
        assert mine["frozen"] == theirs["frozen"]
        for key, value in theirs["weights"].items():
            torch.testing.assert_close(torch.tensor(mine["weights"][key]), torch.tensor(value), rtol=1e-5, atol=1e-6)


def test_fsdp2_freezer_refuses_blocks_found_before_sharding_and_an_optimizer_built_after_an_evaluation_pass(tmp_path):
    ranks = launch({"layout": "root", "mistakes": True}, tmp_path, module="tests.distributed.fsdp_layouts_worker")
    assert ranks.returncodes == [0, 0], "\n".join(o[-3000:] for o in ranks.outputs)
    for result in ranks.results:
        stale, unsharded = result["errors"]
        assert "pos (block embed)" in stale and "discover them after fully_shard" in stale and "shard_blocks" in stale
        assert "optimizer holds FSDP2's unsharded parameters (pos, embed.weight" in unsharded
        assert "Build the optimizer right after fully_shard" in unsharded
        # the right order works with the Freezer built after an evaluation pass: in the next step the frozen
        # blocks (embed with pos, layers.0) do not move, every other weight does
        assert result["frozen"] == ["embed", "layers.0"]
        assert not any(k.startswith(("embed.", "pos", "layers.0.")) for k in result["changed"])
        assert len(result["changed"]) == 24 - 2 - 6  # every parameter of layers.1, layers.2 and the head


# ---- strategies that read gradients or weights, on sharded parameters (issue 31, item 4) ----------------------------

def strategy_runs(tmp_path, spec):
    """The strategy worker on 2 ranks (FSDP2) and in one process (unsharded): both records."""
    ranks = launch(spec, tmp_path / "ranks", module="tests.distributed.fsdp_strategy_worker", timeout=90)
    assert ranks.returncodes == [0, 0], "\n".join(o[-3000:] for o in ranks.outputs)
    a, b = ranks.results
    for x, y in zip(a["records"], b["records"]):
        assert x["hashes"] == y["hashes"] and x["frozen"] == y["frozen"], x["step"]
    one = tmp_path / "one"
    one.mkdir()
    (one / "spec.json").write_text(json.dumps({**spec, "out": str(one)}))
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "WORLD_SIZE": "1"}
    subprocess.run([sys.executable, "-m", "tests.distributed.fsdp_strategy_worker", str(one / "spec.json")], cwd=ROOT,
                   env=env, check=True, timeout=120)
    return a, json.loads((one / "rank0.json").read_text())


def events(history):
    return [(h["kind"], h["block"], h["step"]) for h in history]


def test_fsdp2_autofreeze_sums_sharded_gradients_on_every_rank_instead_of_hanging(tmp_path):
    # autofreeze reads each block's gradient L1 norm (freezer.after_backward). Under FSDP2 a gradient is a DTensor
    # shard: rank 0 alone summing it whole was a collective rank 1 never joined, and the run hung until the process
    # group's timeout. Now every rank sums its shards and one all-reduce at the stage adds their norms up. The sharded
    # run is checkpointed after step 5, in mid-interval, and resumed: the gathered sums come back as each rank's shard,
    # so the stage at step 6 reads the uninterrupted run's signal (a lost sum would read step 6's gradient alone)
    a, ref = strategy_runs(tmp_path, {"strategy": "autofreeze", "params": {"interval": 2}, "steps": 10, "timeout": 20,
                                      "checkpoint_at": 5})
    stages = [(x, y) for x, y in zip(a["records"], ref["records"]) if x.get("signals", {}).get("grad_l1")]
    assert len(stages) == 9  # a stage every 2 steps from step 2 (last_signals stays until the next one)
    for x, y in stages:  # the whole model's gradient norms, as the unsharded run measures them
        torch.testing.assert_close(torch.tensor(x["signals"]["grad_l1"]), torch.tensor(y["signals"]["grad_l1"]),
                                   rtol=1e-5, atol=0, equal_nan=True)
    assert events(a["history"]) == events(ref["history"]) == [("freeze", "0", 6)]  # decided on the resumed sums
    by_step = {r["step"]: r["hashes"] for r in a["records"]}
    frozen = [k for k in by_step[6] if k.startswith("0.")]
    assert frozen and all(by_step[s][k] == by_step[6][k] for s in (7, 8, 9, 10) for k in frozen)  # bitwise unchanged
    assert all(by_step[10][k] != by_step[6][k] for k in by_step[6] if k.startswith(("1.", "2.", "3.", "4.")))


@pytest.mark.parametrize("strategy,params,signal", [
    ("smartfrz", {"snr_gate": None}, "p_freeze"),  # a sample of each block's weights at every stage
    # the gradient SNR gate (on by default) reads Adam's moments: each rank holds a shard of them, gathered whole
    # into the mirror at every stage as the weights are, so the gate's z is the unsharded run's
    ("smartfrz", {}, "snr_z"),
    ("egeria", {"interval": 2, "patience": 1, "probe_size": 8, "synchronous": True}, "plasticity"),  # whole copies
])
def test_fsdp2_strategies_that_read_weights_observe_a_mirror_kept_equal_to_the_sharded_model(tmp_path, strategy,
                                                                                            params, signal):
    # rank 0's strategy reads an unsharded copy (Freezer(mirror=...)) that the Freezer refreshes from the shards
    # before every stage: its signals are those of the unsharded run (a stale or partial copy would not give them)
    a, ref = strategy_runs(tmp_path, {"strategy": strategy, "params": params, "steps": 14, "timeout": 20})
    stages = [(x, y) for x, y in zip(a["records"], ref["records"]) if x.get("signals", {}).get(signal)]
    assert len(stages) >= 7
    values = [v for x, _ in stages for v in x["signals"][signal] if v == v]
    assert len(set(values)) > 5  # the signal moves as the weights train
    for x, y in stages:
        torch.testing.assert_close(torch.tensor(x["signals"][signal]), torch.tensor(y["signals"][signal]),
                                   rtol=1e-4, atol=1e-7, equal_nan=True)
    assert events(a["history"]) == events(ref["history"])


def test_fsdp2_a_strategy_that_reads_weights_without_a_mirror_is_refused_on_every_rank(tmp_path):
    ranks = launch({"strategy": "smartfrz", "steps": 4, "timeout": 20, "no_mirror": True}, tmp_path,
                   module="tests.distributed.fsdp_strategy_worker", timeout=90)
    assert ranks.returncodes == [0, 0], "\n".join(o[-3000:] for o in ranks.outputs)
    for result in ranks.results:
        assert "reads the model's weights on rank 0" in result["error"]
        assert "mirror=copy.deepcopy(model) taken before fully_shard" in result["error"]


@pytest.mark.parametrize("autocast", [False, True])
def test_fsdp2_prefix_cache_on_ranks_that_hit_and_miss_differently_equals_the_uncached_run_bitwise(tmp_path, autocast):
    # every block's forward under FSDP2 is an all-gather: a rank that hits while the other misses would skip a
    # collective the other runs (a hang, or gloo's "collective mismatch"). The ranks agree each step on what all of
    # them run; the cached run's logits and weights are then the uncached run's, bit for bit, on every step. Under
    # bfloat16 autocast too: the cache's first call (a no-grad forward of the whole model, FSDP2's root first) left
    # its casts of the unsharded weights in autocast's cache, and step 1's blocks 3 and 4 got no gradient.
    runs = {}
    for cache in (True, False):
        ranks = launch({"cache": cache, "autocast": autocast}, tmp_path / f"cache-{cache}",
                       module="tests.distributed.fsdp_cache_worker", timeout=90)
        assert ranks.returncodes == [0, 0], "\n".join(o[-3000:] for o in ranks.outputs)
        runs[cache] = ranks.results
    for on, off in zip(runs[True], runs[False]):
        for x, y in zip(on["records"], off["records"]):
            assert x["logits"] == y["logits"] and x["hashes"] == y["hashes"], x["step"]
    assert runs[True][0]["records"][-1]["hashes"] == runs[True][1]["records"][-1]["hashes"]
    # each rank's cache did what the plan says (tests/distributed/fsdp_cache_worker.py): per step, samples read
    # from the cache, computed from the inputs (the prefix), and carried from boundary 2 to 3 (extended)
    counters = [[(r["hits"], r["prefix_samples"], r["extend_samples"]) for r in result["records"]]
                for result in runs[True]]
    assert counters[0] == [(0, 8, 0), (8, 8, 0), (16, 8, 0), (16, 8, 8), (24, 8, 8), (24, 16, 8)]
    assert counters[1] == [(0, 8, 0), (0, 16, 0), (8, 16, 0), (8, 16, 8), (8, 24, 8), (16, 24, 8)]


def test_fsdp2_prefix_cache_refuses_a_model_whose_root_group_holds_the_parameters(tmp_path):
    # the cache runs the blocks one by one; only the root module's forward would gather the root group's parameters
    ranks = launch({"root_only": True}, tmp_path, module="tests.distributed.fsdp_cache_worker", timeout=90)
    assert ranks.returncodes == [0, 0], "\n".join(o[-3000:] for o in ranks.outputs)
    for result in ranks.results:
        assert "root FSDP2 group holds parameters (0.0.weight, 0.0.bias" in result["on"]  # freeze.cache: on
        assert "shard_blocks" in result["on"]
        assert result["auto_runner"] is None and result["auto"] == [result["on"]]  # auto: off, saying why


def test_fsdp2_memory_ledger_counts_each_ranks_own_shard_bytes(tmp_path):
    # blocks 0-1: 24 rows, 12 on each rank; the head: 5 rows, which FSDP2 pads to 3 on each rank
    ranks = launch({}, tmp_path, module="tests.distributed.fsdp_ledger_worker", timeout=90)
    assert ranks.returncodes == [0, 0], "\n".join(o[-3000:] for o in ranks.outputs)
    for k, result in enumerate(ranks.results):
        memory, params = result["memory"], result["params"]

        def of(block, key, params=params):
            return sum(p[key] for p in params.values() if p["block"] == block)

        assert [of(2, "local_bytes"), of(2, "padded_bytes")] == [[4 * (3 * 24 + 3)] * 2, [4 * (2 * 24 + 2),
                                                                                             4 * (3 * 24 + 3)]][k]
        blocks, buckets = memory["blocks"], memory["buckets"]
        assert blocks["frozen"] == [True, False, False]
        # the rank's own shards: exactly numel * itemsize of each local shard, half of each whole parameter
        for block in (0, 1):
            assert blocks["params"][block] == of(block, "local_bytes") == of(block, "whole_bytes") // 2
        assert blocks["params"][2] == of(2, "padded_bytes")  # what FSDP2 allocated: the padding too
        assert buckets["params_frozen"] == of(0, "local_bytes")
        assert buckets["params_trainable"] == of(1, "local_bytes") + of(2, "padded_bytes")
        whole = sum(p["whole_bytes"] for p in params.values())
        assert buckets["params_trainable"] + buckets["params_frozen"] < whole
        # gradients: one reduce-scatter output per trainable block's group, padded like its parameters; the frozen
        # block's group has none
        assert blocks["grads"] == [0, of(1, "local_bytes"), of(2, "padded_bytes")] and buckets["grads"] == sum(
            blocks["grads"])
        # AdamW: exp_avg and exp_avg_sq the size of the local shard (no padding), a 4-byte step per trained tensor
        assert blocks["optimizer"] == [0, 2 * of(1, "local_bytes") + 8, 2 * of(2, "local_bytes") + 8]
        assert buckets["optimizer"] == sum(blocks["optimizer"])
        assert result["summary"]["samples"] == 2
