"""The process group and what every rank needs from it: joining and leaving it, small collectives (a decision, a
loss sum), each rank's share of a global batch, and a lost rank named instead of a hang.

* :func:`init_distributed` joins the group ``torchrun`` describes (gloo on CPU, NCCL on GPU);
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
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

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


def init_distributed(timeout_s: float = 300.0, backend: str | None = None) -> bool:
    """Join the process group the launcher describes, if it describes one of more than one rank.

    ``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (``env://``
    rendezvous). With ``LAYERFREEZE_FILE_STORE=<path>`` the rendezvous is a ``FileStore`` at that path instead (no
    ports: what the tests use). The backend is NCCL when CUDA is available, else gloo. A process group that is
    already initialized is used as it is.

    Args:
        timeout_s: Seconds a collective may wait for a peer before failing (seconds; it bounds every hang).
        backend: ``"gloo"`` or ``"nccl"``; default by device.

    Returns:
        True when this process is one of several ranks.

    Raises:
        ValueError: ``RANK`` missing or not an integer while ``WORLD_SIZE`` > 1.
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
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
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
