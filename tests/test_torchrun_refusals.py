"""Issue 43: under torchrun, what the CLI refuses is refused before training, once: rank 0 prints one line, every
rank exits with code 2, and no rank aborts ("terminate called without an active exception"). Real torch.distributed
(gloo) on 2 processes: the user's torchrun command, and the same ranks launched one by one to read each one's exit
code and output."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.distributed.launch import PYTHONPATH, ROOT, launch

pytestmark = pytest.mark.timeout(300)

REFUSALS = [
    (["--parallel", "fsdp", "--set", "freeze.demote=bfloat16"],
     "layerfreeze: error: freeze.demote does not work with run.parallel fsdp (--parallel fsdp)"),
    (["--parallel", "fsdp", "--memory-budget", "1KiB"],
     "layerfreeze: error: freeze.memory_budget (--memory-budget) is not supported under torchrun yet (each rank's "
     "shards and FSDP2's all-gathers are not planned)"),
    (["--memory-budget", "60%"],
     "layerfreeze: error: freeze.memory_budget (--memory-budget) is not supported under torchrun yet (each rank's "
     "share of the batch and DDP's gradient buckets are not planned)"),
]


def _args(tmp_path, extra):
    # a task whose model and data are not even read: the refusal comes first (the data file exists, empty: a missing
    # one is refused with the config, another error). --device cpu: on a machine with fewer GPUs than ranks the
    # ranks-and-devices refusal would come first (issue 41; tests/test_rank_device.py)
    (tmp_path / "never-read.csv").touch()
    return ["train", "--task", "text-csv", "--data", str(tmp_path / "never-read.csv"), "--model",
            str(tmp_path / "never-loaded"), "--no-progress", "--device", "cpu", "--run-dir", str(tmp_path / "run"),
            *extra]


# fsdp-demote's ranks are launched one by one below: torchrun's report is read for one refusal
@pytest.mark.parametrize("extra, line", REFUSALS[1:2], ids=["fsdp-budget"])
def test_torchrun_refusal_is_one_line_exit_2_and_no_abort(tmp_path, extra, line):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "layerfreeze", *_args(tmp_path, extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    both = proc.stdout + proc.stderr
    assert proc.returncode != 0, both[-3000:]
    errors = [x for x in both.splitlines() if "layerfreeze: error:" in x]
    assert len(errors) == 1 and errors[0].startswith(line), both[-3000:]  # one line, from rank 0 alone
    # torchrun's own report: rank 0 exited with code 2 and no rank aborted. Rank 1 exits with 2 as well (each rank's
    # own exit code: test_each_rank_exits_2_and_only_rank_0_speaks), unless torchrun stops it first: once a rank has
    # failed it sends the others SIGTERM, which on a loaded machine can reach a rank before its own exit (-15)
    codes = [int(c) for c in re.findall(r"(?m)^\s*exitcode\s*:\s*(-?\d+)", both)]  # torchrun's report
    assert 2 in codes and len(codes) == 2 and set(codes) <= {2, -15}, both[-3000:]
    assert "terminate called" not in both and "SIGABRT" not in both and "Signal 6" not in both
    assert "layerfreeze/" not in both  # no traceback through layerfreeze's code
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, line", [REFUSALS[0], REFUSALS[2]], ids=["fsdp-demote", "ddp-budget"])
def test_each_rank_exits_2_and_only_rank_0_speaks(tmp_path, extra, line):
    ranks = launch({}, tmp_path / "ranks", module="layerfreeze", args=_args(tmp_path, extra), timeout=200,
                   fresh=True)  # how each process ends is the point: no abort at its shutdown
    assert ranks.returncodes == [2, 2], ranks.outputs
    assert line in ranks.outputs[0] and ranks.outputs[0].count("layerfreeze: error:") == 1
    assert "Traceback" not in ranks.outputs[0] and "terminate called" not in ranks.outputs[0]
    assert ranks.outputs[1] == ""  # rank 1 exits quietly, with the same code
    assert not (tmp_path / "run").exists()


def test_ranks_given_different_configs_are_refused_naming_the_keys(tmp_path):
    # --lr on one rank only trained on in silence (loss 84, eval loss 1068); --batch-size on one rank hung in the
    # first collective until the timeout
    base = _args(tmp_path, ["--lr", "0.001", "--batch-size", "8"])
    other = _args(tmp_path, ["--lr", "0.5", "--batch-size", "16"])
    ranks = launch({"args": [base, other]}, tmp_path / "ranks", module="tests.distributed.per_rank_cli", timeout=200,
                   fresh=True)
    assert ranks.returncodes == [2, 2], ranks.outputs
    assert ranks.outputs[0].count("layerfreeze: error:") == 1, ranks.outputs[0]
    assert "layerfreeze: error: the ranks were given different configs: train.batch_size: 8 on rank 0, 16 on rank 1; " \
           "train.lr: 0.001 on rank 0, 0.5 on rank 1. Every rank must run the same command (the same flags and " \
           "config file)" in ranks.outputs[0]
    assert "Traceback" not in ranks.outputs[0] + ranks.outputs[1] and not (tmp_path / "run").exists()
