"""The process group and what every rank needs from it: joining and leaving it, small collectives (a decision, a
loss sum), each rank's share of a global batch, and a lost rank named instead of a hang.

* :func:`rank_device` picks the device this rank trains on (``cuda:LOCAL_RANK`` with a GPU per rank, else the CPU) and
  refuses two ranks on one GPU (:func:`choose_rank_device`, the decision itself, reads no state);
  :func:`init_distributed` joins the group ``torchrun`` describes (gloo on the CPU, NCCL on GPUs);
  :func:`close_distributed` leaves it when every rank is done.
* :func:`broadcast_object`, :func:`all_gather_object`, :func:`all_reduce_sum`, :func:`all_reduce_tensor`: the few
  collectives layerfreeze uses (the :class:`~layerfreeze.engine.Freezer` broadcasts rank 0's decisions with the
  first, and adds up the ranks' gradient sums under FSDP2 with the last, on the device).
* :func:`shard` and :func:`loss_scale`: each rank's interleaved share of a global batch and the weight of its summed
  loss, so DDP's averaged gradient is the global batch's mean exactly.
* :class:`RankWatchdog`: a rank that dies (OOM killer, preemption) makes the others fail inside a collective; a
  heartbeat per rank in the process group's store lets the survivors' error name the rank that stopped.

Everything runs on ``torch.distributed``; no home-made communication.
"""

from __future__ import annotations

import gc
import os
import re
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from layerfreeze.errors import ConfigError

#: Environment variable naming a FileStore path for the rendezvous (tests, no ports); else torchrun's ``env://``.
FILE_STORE_ENV = "LAYERFREEZE_FILE_STORE"
_HEARTBEAT_KEY = "layerfreeze/heartbeat/{}"


class RankLostError(RuntimeError):
    """A peer rank stopped (killed, crashed, or hung past the timeout) while this rank was training."""


# --------------------------------------------------------------------------------------------------------------
# Process group
# --------------------------------------------------------------------------------------------------------------


def is_distributed() -> bool:
    """True when a ``torch.distributed`` process group of more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def launched_world_size() -> int:
    """``WORLD_SIZE`` as set by ``torchrun`` (or a test's launcher); 1 when launched as a single process."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


def launched_main_rank() -> bool:
    """Whether this process speaks: rank 0 under torchrun (``RANK``), or the only process (no process group needed:
    what the CLI's messages before and around a run go by)."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


def choose_rank_device(requested: str, local_rank: int, local_world: int | None, cuda_count: int) -> torch.device:
    """The device one rank trains on: the decision of :func:`rank_device`, from its inputs alone (no torch.cuda call).

    ``requested`` is ``run.device``: ``cpu``; ``auto`` (CUDA when there is one, else the CPU); ``cuda`` or
    ``cuda:N``. In one process (``local_world`` 1) ``auto``/``cuda`` is ``cuda`` and ``cuda:N`` is that device.
    Under ``torchrun`` (``local_world`` ranks on this node) a CUDA rank trains on ``cuda:LOCAL_RANK``, torchrun's
    and Lightning's convention of one process per GPU; NCCL cannot run two ranks of a group on one GPU (it stops
    with "Duplicate GPU detected" or hangs), so more local ranks than CUDA devices are refused here, before any
    process group exists, as Lightning refuses more devices than the machine has. The CPU is never chosen in
    their place: a run a user launched on GPUs that silently trained on the CPU would be tens of times slower.

    Args:
        requested: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        local_rank: ``LOCAL_RANK`` (0 in one process).
        local_world: Ranks on this node (``LOCAL_WORLD_SIZE``; 1 in one process; None under a launcher that does
            not say: then only a rank whose ``LOCAL_RANK`` has no GPU is refused).
        cuda_count: CUDA devices this process sees (0 without CUDA).

    Raises:
        ConfigError: a CUDA device asked for where there is none, ``cuda:N`` beyond the devices, or fewer CUDA
            devices than ranks on this node (the message names both counts and what to do); exit code 2 in the CLI.
    """
    requested = str(requested)
    if requested == "cpu":
        return torch.device("cpu")
    if requested not in ("auto", "cuda") and not re.fullmatch(r"cuda:[0-9]+", requested):
        raise ConfigError(f"run.device must be auto, cpu or cuda[:N], got {requested!r}")
    if cuda_count <= 0:
        if requested == "auto":
            return torch.device("cpu")
        raise ConfigError(f"run.device is {requested!r} but CUDA is not available on this machine; use cpu or auto")
    if local_world == 1:
        device = torch.device("cuda" if requested == "auto" else requested)
        if device.index is not None and device.index >= cuda_count:
            raise ConfigError(f"run.device is {requested!r} but this machine has {cuda_count} CUDA device(s) "
                              f"(cuda:0 to cuda:{cuda_count - 1})")
        return device
    ranks = max(local_world or 0, local_rank + 1)
    if ranks > cuda_count:
        at_least = "" if local_world else "at least "
        raise ConfigError(
            f"run.device is {requested!r} under torchrun with {at_least}{ranks} ranks on this node, but this node has "
            f"{cuda_count} CUDA device(s): each rank needs a GPU of its own (NCCL cannot put two ranks on one "
            f"device). Launch one rank per GPU (`torchrun --nproc_per_node {cuda_count} ...`), or train every rank "
            "on the CPU with gloo (--device cpu; run.device: cpu)")
    return torch.device("cuda", local_rank)


def rank_device(requested: str = "auto") -> torch.device:
    """The device this process trains on (:func:`choose_rank_device`, from ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``
    and the CUDA devices visible). In your own torchrun loop, call it before :func:`init_distributed` and move the
    model and each batch to it; the CLI trainer does the same with ``run.device``.

    ``LOCAL_WORLD_SIZE`` is set by ``torchrun``; without it (another launcher) only the rank whose ``LOCAL_RANK``
    has no GPU is refused, and its peers stop at their first collective, naming it.

    Raises:
        ConfigError: see :func:`choose_rank_device`.
        ValueError: ``LOCAL_RANK`` or ``LOCAL_WORLD_SIZE`` is not an integer.
    """
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ["LOCAL_WORLD_SIZE"]) if os.environ.get("LOCAL_WORLD_SIZE") else None
    except ValueError:
        raise ValueError(f"LOCAL_RANK={os.environ.get('LOCAL_RANK')!r} / LOCAL_WORLD_SIZE="
                         f"{os.environ.get('LOCAL_WORLD_SIZE')!r} must be integers: launch with torchrun") from None
    if launched_world_size() <= 1:
        local_rank, local_world = 0, 1
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return choose_rank_device(requested, local_rank, local_world, cuda_count)


def init_distributed(timeout_s: float = 300.0, backend: str | None = None,
                     device: str | torch.device | None = None) -> bool:
    """Join the process group the launcher describes, if it describes one of more than one rank.

    ``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (``env://``
    rendezvous). With ``LAYERFREEZE_FILE_STORE=<path>`` the rendezvous is a ``FileStore`` at that path instead (no
    ports: what the tests use). The backend follows the device the rank trains on (:func:`rank_device` of
    ``device``): NCCL on ``cuda:LOCAL_RANK``, gloo on the CPU. Before issue 41 it was NCCL whenever CUDA was
    visible, which broke ``run.device: cpu`` (and a model left on the CPU) on any GPU machine, and put two ranks on
    one GPU where the machine had fewer GPUs than ranks. A process group that is already initialized is used as it
    is.

    Args:
        timeout_s: Seconds a collective may wait for a peer before failing (seconds; it bounds every hang).
        backend: ``"gloo"`` or ``"nccl"``; default by device.
        device: What the rank trains on, as ``run.device`` (``auto``, ``cpu``, ``cuda``) or the device
            :func:`rank_device` returned; default ``auto``.

    Returns:
        True when this process is one of several ranks.

    Raises:
        ValueError: ``RANK`` missing or not an integer while ``WORLD_SIZE`` > 1.
        ConfigError: more ranks on this node than CUDA devices for a CUDA device (:func:`choose_rank_device`).
    """
    if dist.is_initialized():
        return is_distributed()
    world = launched_world_size()
    if world <= 1:
        return False
    try:
        global_rank = int(os.environ["RANK"])
    except (KeyError, ValueError):
        raise ValueError(f"WORLD_SIZE={world} but RANK is missing or not an integer: launch with torchrun") from None
    requested = "auto" if device is None else str(device)
    if backend is None:
        backend = "nccl" if rank_device(requested).type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank_device(requested))
    timeout = timedelta(seconds=timeout_s)
    store_path = os.environ.get(FILE_STORE_ENV)
    if store_path:
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=global_rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method="env://", rank=global_rank, world_size=world, timeout=timeout)
    return True


def close_distributed() -> None:
    """Wait for every rank, then destroy the default process group; call it once per rank when the run is over.

    Why the barrier first: a gloo worker thread releases the work of a collective *after* marking it complete, and
    when that work holds tensors with Python objects (``broadcast_object_list``'s buffers, a loss tensor made in
    Python) the release takes the GIL. If the main thread has already reached interpreter shutdown by then, Python
    ends the worker thread inside a C++ destructor and the process aborts (SIGABRT, "terminate called without an
    active exception"; a run that finished cleanly exits -6). Seen here in about 1 of 150 runs of
    ``examples/ddp_own_loop.py`` on 2 CPU ranks, with the worker's stack in ``~AsyncBroadcastWork``. The barrier
    blocks every rank's main thread, GIL released, until all ranks arrive, which gives the workers the time to
    drop their last works while Python is still running; it also keeps a rank from destroying the group while a
    peer is still inside a collective (which can hang). It narrows the race, it does not close it: a worker
    starved for longer than the barrier's round trip can still be caught (destroying the group would join its
    workers, but once a DDP has been built the group outlives ``destroy_process_group``). ``gc.collect()`` then
    frees DDP wrappers dropped on a rebuild. PyTorch asks every program to call ``destroy_process_group`` before
    exit (``torch.distributed`` docs, "Shutdown").

    Call it only on the path where every rank finished (or stopped together after the same step): after a lost
    rank the barrier would wait for the timeout, so exit without it.
    """
    if dist.is_available() and dist.is_initialized():
        if is_distributed():
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def local_device(device: torch.device) -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` for a CUDA run under a launcher, else ``device`` as it is."""
    if device.type == "cuda" and is_distributed():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank (pickled; for small objects such as a freeze decision)."""
    holder = [obj if rank() == src else None]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(values: Sequence[float], device: torch.device | None = None) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (float64), e.g. ``[loss_sum, correct, count]``."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if is_distributed():
        dist.all_reduce(t)
    return t.tolist()


def all_reduce_tensor(t: torch.Tensor) -> None:
    """Sum ``t`` over all ranks, in place, on its device (no copy to the host; a no-op in one process)."""
    if is_distributed():
        dist.all_reduce(t)


def shard(indices: Sequence[int], rank_: int | None = None, world: int | None = None) -> list[int]:
    """This rank's part of a global batch: ``indices[rank::world]`` (DistributedSampler's interleaving).

    Ranks get ``ceil`` or ``floor`` of ``len / world`` samples; the trainer weights each rank's loss by its share
    (see :func:`loss_scale`) so the averaged gradient is the global batch's mean gradient exactly.
    """
    r = rank() if rank_ is None else rank_
    w = world_size() if world is None else world
    return list(indices[r::w])


def loss_scale(local_count: int, global_count: int, world: int | None = None) -> float:
    """Factor for a rank's *summed* loss so that DDP's gradient average equals the global batch mean.

    DDP averages gradients over ranks (divides their sum by ``world``); a rank's loss ``sum_i l_i * world / N``
    (``N`` samples in the global batch) therefore gives ``sum_all l_i / N``, the single-process mean, also when the
    ranks' shares differ (the last batch of an epoch).
    """
    w = world_size() if world is None else world
    return w / max(1, global_count) if local_count else 0.0


# --------------------------------------------------------------------------------------------------------------
# A lost rank
# --------------------------------------------------------------------------------------------------------------


class RankWatchdog:
    """A heartbeat per rank in the process group's store, to name the rank that stopped when a collective fails.

    A killed peer makes gloo/NCCL collectives on the survivors fail (a closed connection) or time out (the process
    group's timeout); neither error says which rank is gone. Each rank's thread writes the time into the store every
    ``interval_s`` seconds; :meth:`explain` turns a failure into :class:`RankLostError` naming the ranks whose
    heartbeat stopped.

    Args:
        interval_s: Seconds between heartbeats.
        stale_after_s: A heartbeat older than this (seconds) means the rank stopped.
    """

    def __init__(self, interval_s: float = 1.0, stale_after_s: float = 4.0) -> None:
        from torch.distributed.distributed_c10d import _get_default_store

        self.store = _get_default_store()
        self.rank = rank()
        self.world = world_size()
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="layerfreeze-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self.store.set(_HEARTBEAT_KEY.format(self.rank), repr(time.time()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone (its host died): explain() reports it
                return

    def lost_ranks(self, wait_s: float | None = None) -> list[int] | None:
        """Ranks whose heartbeat is older than ``stale_after_s``, after waiting up to ``wait_s`` for one to age
        (a rank killed a moment ago still has a fresh one); None when the store itself cannot be read."""
        deadline = time.time() + (self.stale_after_s + self.interval_s if wait_s is None else wait_s)
        while True:
            lost = []
            try:
                for r in range(self.world):
                    if r == self.rank:
                        continue
                    if time.time() - float(self.store.get(_HEARTBEAT_KEY.format(r)).decode()) > self.stale_after_s:
                        lost.append(r)
            except Exception:  # noqa: BLE001 - the store's host is gone
                return None
            if lost or time.time() >= deadline:
                return lost
            time.sleep(self.interval_s / 2)

    def explain(self, exc: BaseException) -> RankLostError | None:
        """A :class:`RankLostError` naming the lost rank(s) behind a failed collective, or None if every peer still
        beats (then ``exc`` is not a lost rank)."""
        lost = self.lost_ranks()
        if lost is None:
            return RankLostError(f"rank {self.rank}: the process group's store is unreachable (the rank hosting it, "
                                 f"usually rank 0, stopped) after: {exc}")
        if not lost:
            return None
        names = ", ".join(str(r) for r in lost)
        return RankLostError(f"rank {self.rank}: rank {names} stopped (no heartbeat for over {self.stale_after_s:.0f} "
                             f"s) while training; the error here was: {type(exc).__name__}: {str(exc)[:300]}")

    def close(self) -> None:
        """Stop the heartbeat thread."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s)
