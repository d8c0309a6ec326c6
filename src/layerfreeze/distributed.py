"""Data-parallel training whose frozen set changes mid-run: one decision for all ranks, a DDP wrapper rebuilt
around the trainable parameters on every change, per-rank data shards, and a lost rank named, not a hang.

Why each part exists (the public faults it removes):

* ``DistributedDataParallel`` registers for all-reduce only the parameters that require grad *when it is built*
  (``torch/nn/parallel/distributed.py``, ``_build_params_for_reducer``). A freeze after that leaves the reducer
  waiting for gradients that never come ("Expected to have finished reduction in the prior iteration",
  mmdetection #9899); ``find_unused_parameters=True`` hides it at the price of a graph traversal every step and
  still all-reduces the frozen buckets. A thaw after that is worse: the thawed parameters' gradients are never
  all-reduced and the ranks drift apart with no error (Lightning #20340). :class:`FreezeDDP` therefore rebuilds the
  wrapper whenever the freezer's frozen set changes (the answer of PipeTransformer, He et al. ICML 2021,
  ``dp/auto_dp.py``): the new reducer holds exactly the trainable parameters, frozen parameters and the buffers of
  frozen blocks are excluded from it and from DDP's state broadcasts, the old reducer's autograd hooks are
  released with it, and the optimizer is untouched (the same ``Parameter`` objects, so Adam's state of every
  still-trainable parameter is kept). ``find_unused_parameters`` stays off. A frozen prefix builds no autograd graph
  (its parameters do not require grad), so it contributes nothing to backward or to communication.
* Freeze decisions must be the same on every rank at the same step, whatever the strategy (a signal that differs
  across ranks, a background thread that finishes at a different step, a probe batch): the :class:`~layerfreeze.
  engine.Freezer` runs the strategy on rank 0 only and broadcasts each decision (:func:`broadcast_object`).
* Gradient bytes all-reduced per step are counted by a DDP communication hook (:class:`GradientBytes`) around
  PyTorch's own ``allreduce_hook``: the count is what DDP actually sends, so a freeze shows up as fewer bytes.
* A rank that dies (OOM killer, preemption) makes the others fail inside a collective; :class:`RankWatchdog` keeps
  a heartbeat per rank in the process group's store, so the survivors' error names the rank that stopped.

Everything runs on ``torch.distributed`` (gloo on CPU, NCCL on GPU); no home-made communication.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .strategies import Decision, Strategy

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


def share_decision(strategy: Strategy, decision: Decision, error: str | None = None) -> Decision:
    """Rank 0's freeze decision (and the strategy's stage cadence) on every rank; a collective.

    Why: strategies read signals that can differ across ranks (a background thread finishing at another step,
    float noise in a local statistic); applying rank 0's decision everywhere keeps the frozen sets, and so the
    DDP wrappers and the weights, identical. Only rank 0 runs the strategy; its ``decision`` and ``error``
    (the strategy's exception as text, or None) are what count, the other ranks' arguments are ignored. The
    decision's signals stay on rank 0, which logs them; ``strategy.stage_every`` / ``at_epoch_end`` take rank 0's
    values on every rank (smartfrz sets its cadence at the start stage).

    Returns:
        ``decision`` on rank 0; on the other ranks a :class:`~layerfreeze.strategies.Decision` with rank 0's
        freezes, thaws, reason, thaw LRs and LR factors (no signals).

    Raises:
        RuntimeError: on the other ranks, when the strategy failed on rank 0 (the message carries its error);
            rank 0 gets ``decision`` back and re-raises its own exception.
    """
    payload = None
    if rank() == 0:
        payload = {"error": error, "freeze": list(decision.freeze), "thaw": list(decision.thaw),
                   "reason": decision.reason, "thaw_lr": dict(decision.thaw_lr),
                   "lr_scale": dict(decision.lr_scale), "stage_every": strategy.stage_every,
                   "at_epoch_end": strategy.at_epoch_end}
    payload = broadcast_object(payload)
    if payload["error"] is not None:
        if rank() == 0:
            return decision
        raise RuntimeError(f"the freezing strategy failed on rank 0: {payload['error']}")
    strategy.stage_every, strategy.at_epoch_end = payload["stage_every"], payload["at_epoch_end"]
    if rank() == 0:
        return decision
    return Decision(freeze=payload["freeze"], thaw=payload["thaw"], reason=payload["reason"],
                    thaw_lr=payload["thaw_lr"], lr_scale=payload["lr_scale"])


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
# DDP around the trainable part
# --------------------------------------------------------------------------------------------------------------


class GradientBytes:
    """A DDP communication hook that counts the bytes of every gradient bucket it all-reduces.

    It wraps PyTorch's ``default_hooks.allreduce_hook`` (same arithmetic as DDP without a hook: sum, then divide by
    the world size), so what it counts is what is sent. ``take()`` returns the bytes since the last call.
    """

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        self.total = 0
        self._since = 0

    def hook(self, state, bucket):  # noqa: ANN001, ANN201 - DDP checks the annotations (a string would fail)
        """Count ``bucket``'s bytes, then all-reduce it as DDP's default does (returns the future)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        buffer = bucket.buffer()
        nbytes = buffer.numel() * buffer.element_size()
        self.total += nbytes
        self._since += nbytes
        return allreduce_hook(self.process_group, bucket)

    def take(self) -> int:
        """Bytes all-reduced since the previous ``take()``."""
        n, self._since = self._since, 0
        return n


class _Forward(nn.Module):
    """The module DDP wraps: the whole model, with its forward given as a function of the batch.

    Going through DDP's ``forward`` is what arms the reducer for the next backward; the function may run the model
    directly or through the activation cache (:class:`~layerfreeze.cache.CachedPrefix`), whose prefix then never
    runs at all.
    """

    def __init__(self, model: nn.Module, forward: Callable[..., Any] | None) -> None:
        super().__init__()
        self.model = model
        self._fn = forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs) if self._fn is not None else self.model(*args, **kwargs)


def frozen_state_names(wrapper: nn.Module, freezer: Any) -> list[str]:
    """Names (in ``wrapper``) of parameters that do not require grad and of the buffers inside frozen blocks (kept
    with ``train_bn``, where those blocks' BatchNorm statistics still change).

    Why: DDP broadcasts every registered parameter and buffer from rank 0 when it is built and every buffer before
    each forward (``broadcast_buffers``); frozen state is the same on every rank already, so sending it is waste.
    """
    names = [n for n, p in wrapper.named_parameters() if not p.requires_grad]
    if freezer.train_bn:  # frozen blocks' BatchNorm layers keep training: their statistics must stay in sync
        return names
    frozen_buffers = {id(b) for block, f in zip(freezer.blocks, freezer.frozen) if f
                      for _, m in block.modules for b in m.buffers()}
    names += [n for n, b in wrapper.named_buffers() if id(b) in frozen_buffers]
    return names


class FreezeDDP:
    """``DistributedDataParallel`` over a model's trainable parameters, rebuilt when the frozen set changes.

    Call it like the model (or like ``forward``); before each call it checks the freezer's frozen set and, if it
    changed since the wrapper was built (or on the first call), builds a new DDP around the trainable parameters
    (see the module docstring for why). Use it in place of ``DistributedDataParallel(model)``::

        freezer = Freezer(model, optimizer, "smartfrz", total_steps=steps)   # decisions come from rank 0
        ddp = FreezeDDP(model, freezer)
        for batch in loader:                                                 # each rank its shard
            loss = loss_fn(ddp(batch["x"]), batch["y"]); loss.backward()
            optimizer.step(); optimizer.zero_grad(set_to_none=True); freezer.step()

    Args:
        model: The model (on this rank's device). Its parameters must be identical on every rank (DDP's
            construction broadcasts rank 0's trainable ones anyway).
        freezer: The model's :class:`~layerfreeze.engine.Freezer`.
        forward: Optional ``forward(*args, **kwargs)`` to run inside DDP instead of ``model(...)``, e.g. a
            task's ``forward(model, batch)`` bound to the model, or a :class:`~layerfreeze.cache.CachedPrefix`.
        count_bytes: Register :class:`GradientBytes` as the communication hook (``bytes_per_step()``).
        on_rebuild: Called with ``{"seconds", "trainable_tensors", "trainable_parameters", "frozen_blocks",
            "step"}`` after each build.
        **ddp_kwargs: Passed to ``DistributedDataParallel`` (``device_ids``, ``bucket_cap_mb``, ...).
            ``find_unused_parameters`` is refused: it is what this class makes unnecessary.

    Attributes:
        rebuilds: Number of builds so far (the first one included); ``rebuild_seconds``: the time of each (s).

    Raises:
        RuntimeError: no process group of more than one rank is initialized.
        ValueError: ``find_unused_parameters`` given.
    """

    def __init__(self, model: nn.Module, freezer: Any, forward: Callable[..., Any] | None = None, *,
                 count_bytes: bool = True, on_rebuild: Callable[[dict[str, Any]], None] | None = None,
                 **ddp_kwargs: Any) -> None:
        if not is_distributed():
            raise RuntimeError("FreezeDDP needs an initialized torch.distributed process group of more than one rank "
                               "(launch with torchrun; layerfreeze.distributed.init_distributed() joins it)")
        if ddp_kwargs.get("find_unused_parameters"):
            raise ValueError("FreezeDDP rebuilds DDP around the trainable parameters on every freeze/thaw; "
                             "find_unused_parameters=True is not needed (and costs a graph traversal every step)")
        self.model = model
        self.freezer = freezer
        self.wrapper = _Forward(model, forward)
        self.ddp_kwargs = ddp_kwargs
        self.bytes = GradientBytes() if count_bytes else None
        self.on_rebuild = on_rebuild
        self.ddp: nn.parallel.DistributedDataParallel | None = None
        self._built_for: tuple[bool, ...] | None = None
        self.rebuilds = 0
        self.rebuild_seconds: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.sync()
        return self.ddp(*args, **kwargs)

    @property
    def built_for(self) -> tuple[bool, ...] | None:
        """The frozen set (one bool per block) the current wrapper was built for."""
        return self._built_for

    def sync(self) -> bool:
        """Rebuild the wrapper if the frozen set changed since it was built; True if it rebuilt.

        Collective: every rank must call it at the same point (it is called before each forward, and freeze
        decisions are the same on every rank).
        """
        frozen = tuple(self.freezer.frozen)
        if frozen == self._built_for and self.ddp is not None:
            return False
        t0 = time.perf_counter()
        self.ddp = None  # drop the old reducer first: its autograd hooks go with it
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            self.wrapper, frozen_state_names(self.wrapper, self.freezer))
        self.ddp = nn.parallel.DistributedDataParallel(self.wrapper, **self.ddp_kwargs)
        if self.bytes is not None:
            self.ddp.register_comm_hook(None, self.bytes.hook)
        seconds = time.perf_counter() - t0
        self._built_for = frozen
        self.rebuilds += 1
        self.rebuild_seconds.append(seconds)
        if self.on_rebuild is not None:
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            self.on_rebuild({"seconds": seconds, "trainable_tensors": len(trainable),
                             "trainable_parameters": sum(p.numel() for p in trainable),
                             "frozen_blocks": list(self.freezer.frozen_blocks), "step": self.freezer.step_count})
        return True

    def bytes_per_step(self) -> int | None:
        """Gradient bytes all-reduced since the previous call (None without ``count_bytes``)."""
        return None if self.bytes is None else self.bytes.take()


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
