"""FreezeDDP in the user's own loop, on 2 CPU ranks with gloo: what the user changes by hand between steps."""

from __future__ import annotations

import pytest

from tests.distributed.launch import launch

pytestmark = pytest.mark.timeout(300)


def test_a_parameter_frozen_by_hand_mid_run_rebuilds_ddp_stays_frozen_through_switches_and_resumes(tmp_path):
    # lisa switches blocks 0-3 on and off every 3 steps; after step 4 the user freezes 2.0.weight by hand while
    # block 2 trains. The wrapper must be rebuilt without it: DDP's reducer still held it and waited for its gradient
    # ("Expected to have finished reduction in the prior iteration" at the next forward, after a step whose bucket was
    # never all-reduced). It stays frozen when lisa switches block 2 off and on again, and in a resumed run.
    spec = {"strategy": "lisa", "params": {"gamma": 1, "k": 3, "seed": 0}, "steps": 12, "hand_at": 4,
            "hand": "2.0.weight", "save_at": 7, "checkpoint": str(tmp_path / "ckpt")}
    ranks = launch(spec, tmp_path / "run", module="tests.distributed.own_loop_worker", timeout=120)
    assert ranks.returncodes == [0, 0], "\n".join(o[-3000:] for o in ranks.outputs)
    a, b = ranks.results
    assert a["records"] == b["records"]  # every weight, the frozen set and requires_grad equal on both ranks
    records = {r["step"]: r for r in a["records"]}
    assert not records[4]["frozen"][2] and records[4]["requires_grad"]["2.0.bias"]  # block 2 trained at 4
    assert records[6]["frozen"][2] and not records[9]["frozen"][2]  # switched off, then on again
    assert all(not records[s]["requires_grad"]["2.0.weight"] for s in range(4, 13))
    assert len({records[s]["hashes"]["2.0.weight"] for s in range(4, 13)}) == 1  # bitwise unchanged since
    assert records[10]["hashes"]["2.0.bias"] != records[9]["hashes"]["2.0.bias"]  # its block trains again
    resumed = launch({**spec, "resume": spec.pop("checkpoint"), "save_at": None}, tmp_path / "resumed",
                     module="tests.distributed.own_loop_worker", timeout=120)
    assert resumed.returncodes == [0, 0], "\n".join(o[-3000:] for o in resumed.outputs)
    assert resumed.results[0]["records"] == [records[s] for s in range(8, 13)]


def test_a_frozen_blocks_batchnorm_built_with_momentum_none_stays_in_eval_mode_and_equal_on_every_rank(tmp_path):
    # a BatchNorm built with momentum=None (a cumulative average) in a block frozen from the start kept training mode
    # (taken for update_bn's recalibration): the frozen block normalised with each batch's statistics and its running
    # ones changed at every step, on each rank its own (DDP leaves a frozen block's buffers out of its broadcasts)
    spec = {"strategy": "static", "params": {"k": 2}, "steps": 4, "batchnorm": True}
    ranks = launch(spec, tmp_path, module="tests.distributed.own_loop_worker", timeout=120)
    assert ranks.returncodes == [0, 0], "\n".join(o[-3000:] for o in ranks.outputs)
    a, b = (r["records"] for r in ranks.results)
    frozen = [k for k in a[0]["hashes"] if k.startswith(("0.", "1."))]
    assert any(k.endswith("running_mean") for k in frozen)
    for x, y in zip(a, b):
        assert x["frozen"][:2] == [True, True]
        assert {k: x["hashes"][k] for k in frozen} == {k: y["hashes"][k] for k in frozen} == \
            {k: a[0]["hashes"][k] for k in frozen}, x["step"]


def test_a_ddp_wrapper_not_rebuilt_after_a_thaw_is_caught_at_the_next_step_on_every_rank(tmp_path):
    # accelerate's prepare(model) under several processes, or one's own DistributedDataParallel, built once: a thawed
    # block's gradients were never all-reduced and the ranks drifted apart in silence (no error, different weights)
    spec = {"strategy": "gradual", "params": {"every_steps": 2}, "steps": 6, "plain_ddp": True}
    ranks = launch(spec, tmp_path / "plain", module="tests.distributed.own_loop_worker", timeout=120)
    assert ranks.returncodes == [1, 1], ranks.outputs
    for out in ranks.outputs:
        assert "RanksDivergedError: block(s) 3 were thawed" in out and "rebuild_ddp(ddp, freezer)" in out, out[-2000:]
    # what it says to do: rebuild_ddp after every step that changed the frozen set
    ranks = launch({**spec, "rebuild": True}, tmp_path / "rebuilt", module="tests.distributed.own_loop_worker",
                   timeout=120)
    assert ranks.returncodes == [0, 0], "\n".join(o[-3000:] for o in ranks.outputs)
    a, b = (r["records"] for r in ranks.results)
    assert a == b and a[-1]["frozen"] == [True, False, False, False, False]
