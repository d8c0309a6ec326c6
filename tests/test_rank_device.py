"""Which device each rank trains on, and the backend that follows (issue 41): a GPU per rank under torchrun, the
CPU without CUDA, and a node with fewer GPUs than ranks refused before any process group exists, naming both counts
and what to do. The decision (:func:`choose_rank_device`) is a pure function; the machine's CUDA devices are
simulated by monkeypatching ``torch.cuda`` where the env-reading wrappers are tested. The real thing on a GPU
machine: ``test_two_ranks_on_the_gpus_of_this_machine`` (``pytest -m cuda``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from layerfreeze.distributed import comm
from layerfreeze.distributed.comm import choose_rank_device, init_distributed, rank_device
from layerfreeze.errors import ConfigError, UserError
from layerfreeze.train.config import build_config
from layerfreeze.train.setup import resolve_device
from layerfreeze.train.trainer import Trainer
from tests.conftest import blob_task


@pytest.mark.parametrize("requested, local_rank, local_world, gpus, expected", [
    ("cpu", 1, 2, 8, "cpu"),  # the CPU when asked, GPUs or not
    ("auto", 0, 1, 0, "cpu"),  # no CUDA: the CPU
    ("auto", 1, 2, 0, "cpu"),  # two ranks on a CPU machine: gloo
    ("auto", 0, 1, 1, "cuda"),  # one process: the current CUDA device
    ("cuda:1", 0, 1, 2, "cuda:1"),
    ("auto", 0, 2, 2, "cuda:0"),  # torchrun: one GPU per rank, LOCAL_RANK's
    ("auto", 1, 2, 2, "cuda:1"),
    ("cuda", 3, 4, 8, "cuda:3"),  # more GPUs than ranks: the first ones
])
def test_each_rank_gets_its_own_device(requested, local_rank, local_world, gpus, expected):
    assert choose_rank_device(requested, local_rank, local_world, gpus) == torch.device(expected)


@pytest.mark.parametrize("requested", ["auto", "cuda"])
@pytest.mark.parametrize("local_rank", [0, 1])
def test_two_ranks_on_one_gpu_are_refused_on_every_rank_naming_the_counts_and_what_to_do(requested, local_rank):
    with pytest.raises(ConfigError) as err:
        choose_rank_device(requested, local_rank, 2, 1)
    message = str(err.value)
    assert "2 ranks on this node" in message and "1 CUDA device(s)" in message
    assert "torchrun --nproc_per_node 1" in message and "--device cpu" in message
    assert isinstance(err.value, UserError)  # the CLI prints it and exits 2


def test_a_cuda_device_where_there_is_none_or_beyond_the_devices_is_refused():
    with pytest.raises(ConfigError, match="CUDA is not available on this machine; use cpu or auto"):
        choose_rank_device("cuda", 0, 1, 0)
    with pytest.raises(ConfigError, match=r"'cuda:2' but this machine has 2 CUDA device\(s\)"):
        choose_rank_device("cuda:2", 0, 1, 2)
    with pytest.raises(ConfigError, match="must be auto, cpu or cuda"):
        choose_rank_device("tpu", 0, 1, 0)
    for bad in ("cuda:abc", "cudax", "cuda:-1", "cuda:"):  # a malformed device, not "CUDA is not available"
        with pytest.raises(ConfigError, match=f"must be auto, cpu or cuda\\[:N\\], got '{bad}'"):
            choose_rank_device(bad, 0, 1, 0)


def _machine(monkeypatch, gpus: int, world: int, local_rank: int = 0, local_world: int | None = None) -> None:
    """Simulate ``gpus`` CUDA devices and torchrun's variables for one of ``world`` ranks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))


def test_rank_device_reads_torchrun_and_the_visible_gpus(monkeypatch):
    _machine(monkeypatch, gpus=2, world=2, local_rank=1, local_world=2)
    assert rank_device() == torch.device("cuda:1") and rank_device("cpu") == torch.device("cpu")
    _machine(monkeypatch, gpus=1, world=2, local_rank=0, local_world=2)
    with pytest.raises(ConfigError, match="2 ranks on this node, but this node has 1 CUDA"):
        rank_device()  # rank 0 has a GPU, but its peer would share it: both refuse
    _machine(monkeypatch, gpus=1, world=2, local_rank=0)  # another launcher: no LOCAL_WORLD_SIZE
    assert rank_device() == torch.device("cuda:0")  # rank 0 cannot know; rank 1 refuses, and 0 names it lost
    _machine(monkeypatch, gpus=1, world=2, local_rank=1)
    with pytest.raises(ConfigError, match="at least 2 ranks on this node"):
        rank_device()
    _machine(monkeypatch, gpus=1, world=1)  # one process: torchrun's variables of a 1-rank run mean nothing
    assert rank_device() == torch.device("cuda") == resolve_device("auto")


def test_init_distributed_picks_the_backend_of_the_device_and_joins_nothing_it_refuses(monkeypatch, tmp_path):
    joined = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.append(backend))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: joined.append(str(device)))
    monkeypatch.setenv(comm.FILE_STORE_ENV, "")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")

    _machine(monkeypatch, gpus=1, world=2, local_rank=1, local_world=2)
    with pytest.raises(ConfigError, match="each rank needs a GPU of its own"):
        init_distributed()  # before this issue: NCCL, cuda.set_device(1) on a 1-GPU machine
    assert joined == []
    assert init_distributed(device="cpu") and joined == ["gloo"]  # a CPU run on a GPU machine: gloo, no set_device
    joined.clear()
    _machine(monkeypatch, gpus=2, world=2, local_rank=1, local_world=2)
    assert init_distributed() and joined == ["cuda:1", "nccl"]
    joined.clear()
    _machine(monkeypatch, gpus=0, world=2, local_rank=1, local_world=2)
    assert init_distributed() and joined == ["gloo"]


def test_the_trainer_refuses_two_ranks_on_one_gpu_before_joining_a_process_group(monkeypatch, tmp_path):
    joined = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.append(backend))
    _machine(monkeypatch, gpus=1, world=2, local_rank=0, local_world=2)
    config = build_config({"train": {"epochs": 1, "batch_size": 16}, "freeze": {"strategy": "none"},
                           "run": {"dir": str(tmp_path / "run"), "progress": False}})
    with pytest.raises(ConfigError, match="2 ranks on this node, but this node has 1 CUDA device"):
        Trainer(config, task=blob_task()).run()
    assert joined == [] and not (tmp_path / "run").exists()  # nothing joined, nothing written


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_two_ranks_on_the_gpus_of_this_machine(tmp_path):
    """``run.device: auto`` on 2 ranks where CUDA is visible: with 2 GPUs or more each rank trains on its own (NCCL)
    and they agree; with 1 both stop at once with the refusal, none hangs."""
    from tests.distributed.launch import launch
    from tests.test_distributed import spec

    s = spec(tmp_path, "gpus", "static", {"k": 2}, epochs=1, device="auto")
    ranks = launch(s, tmp_path / "ranks", cuda=True, timeout=240)
    if torch.cuda.device_count() >= 2:
        assert ranks.returncodes == [0, 0], "\n".join(o[-2000:] for o in ranks.outputs)
        a, b = ranks.results
        assert a["steps"][-1]["hashes"] == b["steps"][-1]["hashes"]
    else:
        assert all(code not in (0, -999) for code in ranks.returncodes), ranks.returncodes
        assert all("each rank needs a GPU of its own" in out for out in ranks.outputs), ranks.outputs
