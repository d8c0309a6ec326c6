"""DistributedDataParallel around a model whose frozen set changes: the wrapper re-initialized around the
trainable parameters on every freeze or thaw, in place.

Why (the public faults it removes): ``DistributedDataParallel`` registers for all-reduce only the parameters that
require grad *when it is built* (``torch/nn/parallel/distributed.py``, ``_build_params_for_reducer``). A freeze
after that leaves the reducer waiting for gradients that never come ("Expected to have finished reduction in the
prior iteration", mmdetection #9899); ``find_unused_parameters=True`` hides it at the price of a graph traversal
every step and still all-reduces the frozen buckets. A thaw after that is worse: the thawed parameters' gradients
are never all-reduced and the ranks drift apart with no error (Lightning #20340). So the wrapper is rebuilt whenever
the freezer's frozen set changes (the answer of PipeTransformer, He et al. ICML 2021, ``dp/auto_dp.py``): the new
reducer holds exactly the trainable parameters, frozen parameters and the buffers of frozen blocks are excluded from
it and from DDP's state broadcasts, the old reducer's autograd hooks are released with it, and the optimizer is
untouched (the same ``Parameter`` objects, so Adam's state of every still-trainable parameter is kept).
``find_unused_parameters`` stays off. A frozen prefix builds no autograd graph (its parameters do not require
grad), so it contributes nothing to backward or to communication.

One mechanism: :func:`rebuild_ddp` re-initializes a ``DistributedDataParallel`` object in place, with the settings
it was built with. :class:`FreezeDDP` (your own loop, the CLI trainer) builds its wrapper once and rebuilds it with
it; the Lightning and Hugging Face callbacks (:mod:`layerfreeze.integrations`) rebuild the framework's own wrapper
with it, because the framework keeps references to that object where no callback can replace them.

Gradient bytes all-reduced per step are counted by a DDP communication hook (:class:`GradientBytes`) around
PyTorch's own ``allreduce_hook``: the count is what DDP actually sends, so a freeze shows up as fewer bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from layerfreeze.distributed.comm import is_distributed


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
    directly or through the activation cache (:class:`~layerfreeze.compute.cache.CachedPrefix`), whose prefix then never
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
    (Frozen parameters are; a frozen block's buffers are made so once, when the block freezes:
    :func:`sync_frozen_buffers`.)
    """
    names = [n for n, p in wrapper.named_parameters() if not p.requires_grad]
    if freezer.train_bn:  # frozen blocks' BatchNorm layers keep training: their statistics must stay in sync
        return names
    frozen_buffers = {id(b) for block, f in zip(freezer.blocks, freezer.frozen) if f
                      for _, m in block.modules for b in m.buffers()}
    names += [n for n, b in wrapper.named_buffers() if id(b) in frozen_buffers]
    return names


def trainable_flags(module: nn.Module) -> tuple[bool, ...]:
    """Whether each parameter of ``module`` requires grad, in order: what a DDP reducer is built around.

    Why not the Freezer's frozen set alone: a parameter the user freezes by hand (``requires_grad_(False)``) while its
    block trains leaves the frozen set as it was, and a reducer that still holds it waits for its gradient ("Expected
    to have finished reduction in the prior iteration" at the next forward; the bucket holding it is never
    all-reduced, so the ranks step apart first). A wrapper is rebuilt when these flags change too.
    """
    return tuple(p.requires_grad for p in module.parameters())


def wrapper_key(freezer: Any, module: nn.Module) -> tuple[tuple[bool, ...], int, tuple[bool, ...]]:
    """What a DDP wrapper of ``module`` is built for, compared before each forward (:class:`FreezeDDP`, the
    framework callbacks' ``FreezeSession``): a change of any part means a rebuild (:func:`rebuild_ddp`). The frozen
    set; the thaws of demoted blocks (``dtype_restores``: each replaced its parameters' gradient accumulators, the
    frozen set the same); which parameters require grad (:func:`trainable_flags`)."""
    return tuple(freezer.frozen), getattr(freezer, "dtype_restores", 0), trainable_flags(module)


def sync_frozen_buffers(module: nn.Module, freezer: Any, process_group: Any = None) -> int:
    """Give every rank the first rank's values of the buffers of the frozen blocks (BatchNorm running statistics),
    before DDP leaves them out of its broadcasts (:func:`frozen_state_names`); returns the number of buffers sent.
    Called at each build of the wrapper: blocks frozen earlier are sent again (equal already; a few statistics per
    block, at a freeze or thaw).

    Why: DDP broadcasts rank 0's buffers before each forward, and each rank's forward then updates them with its own
    share of the batch. A block frozen after a step kept each rank's own statistics of that last forward, and, left
    out of the broadcasts from then on, ran a different frozen prefix on each rank for the rest of the run; the
    checkpoint holds rank 0's, so a resumed run (every rank on rank 0's) did not equal the uninterrupted one. Frozen
    blocks run in eval mode, so after this one broadcast their statistics stay equal on every rank. Nothing is sent
    under ``freeze.train_bn`` (those buffers are never left out).

    Collective: every rank calls it at the same point, with the same frozen set.
    """
    import torch.distributed as dist

    names = set(frozen_state_names(module, freezer))
    buffers = [b for n, b in module.named_buffers() if n in names]
    if not buffers:
        return 0
    group = process_group if process_group is not None else dist.group.WORLD
    src = dist.get_global_rank(group, 0)
    nccl = dist.get_backend(group) == "nccl"
    for b in buffers:
        if nccl and b.device.type != "cuda":  # a demoted block's buffer on the host: NCCL sends device memory
            staged = b.to(torch.device("cuda", torch.cuda.current_device()))
            dist.broadcast(staged, src, group=group)
            b.copy_(staged)
        else:
            dist.broadcast(b, src, group=group)
    return len(buffers)


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
            task's ``forward(model, batch)`` bound to the model, or a :class:`~layerfreeze.compute.cache.CachedPrefix`.
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
        self._built: tuple[Any, ...] | None = None  # the wrapper_key the wrapper was built for
        self.rebuilds = 0
        self.rebuild_seconds: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.sync()
        return self.ddp(*args, **kwargs)

    @property
    def built_for(self) -> tuple[bool, ...] | None:
        """The frozen set (one bool per block) the current wrapper was built for."""
        return None if self._built is None else self._built[0]

    def sync(self) -> bool:
        """Rebuild the wrapper if the frozen set changed since it was built, or which parameters require grad (one
        frozen by hand: :func:`trainable_flags`); True if it rebuilt.

        Collective: every rank must call it at the same point (it is called before each forward, and freeze
        decisions are the same on every rank).
        """
        key = wrapper_key(self.freezer, self.wrapper)
        if key == self._built and self.ddp is not None:
            return False
        t0 = time.perf_counter()
        if self.ddp is None:
            sync_frozen_buffers(self.wrapper, self.freezer, self.ddp_kwargs.get("process_group"))
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                self.wrapper, frozen_state_names(self.wrapper, self.freezer))
            self.ddp = nn.parallel.DistributedDataParallel(self.wrapper, **self.ddp_kwargs)
        else:
            rebuild_ddp(self.ddp, self.freezer, **self.ddp_kwargs)
        if self.bytes is not None:
            self.ddp.register_comm_hook(None, self.bytes.hook)
        seconds = time.perf_counter() - t0
        self._built = key
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


def rebuild_ddp(ddp: nn.parallel.DistributedDataParallel, freezer: Any, **overrides: Any) -> None:
    """Re-initialize ``ddp`` in place so its reducer holds exactly the parameters that require grad now.

    Why in place: the framework keeps references to its wrapper where no callback can replace them (the HF
    Trainer's ``_inner_training_loop`` passes it as a local variable to every epoch; accelerate keeps it in its
    list of prepared models), so the same object must get the new reducer. DDP registers for all-reduce only the
    parameters that require grad when it is built (``_build_params_for_reducer``): a freeze after that leaves the
    reducer waiting ("Expected to have finished reduction in the prior iteration"; hidden by
    ``find_unused_parameters=True`` at the price of a graph traversal every step, and raised anyway when the
    Trainer turns it off for gradient checkpointing), a thaw leaves the thawed gradients never averaged, so the
    ranks drift apart silently (Lightning #20340). The old reducer (and its autograd hooks) goes with the
    re-initialization; the wrapper's settings (buckets, ``find_unused_parameters``, ``static_graph``, process group)
    are kept; the module's state is broadcast from rank 0 again (frozen parameters and buffers excluded); the
    optimizer is untouched (the same ``Parameter`` objects). A communication hook registered on the old wrapper is
    not carried over (register it again).

    Args:
        ddp: The wrapper to re-initialize.
        freezer: The model's :class:`~layerfreeze.engine.Freezer` (its blocks, frozen set and ``train_bn``).
        **overrides: ``DistributedDataParallel`` arguments to use instead of those read back from ``ddp`` (what a
            caller that built the wrapper itself passed, e.g. :class:`FreezeDDP`'s ``ddp_kwargs``).

    Collective: every rank must call it at the same point (decisions are rank 0's on every rank, see the Freezer).
    """
    cls = nn.parallel.DistributedDataParallel
    default_buckets = getattr(ddp, "bucket_bytes_cap_default", False)  # built with bucket_cap_mb=None: keep its
    # small first bucket (a number, even 25, would make the first bucket as large as the others)
    kwargs = dict(device_ids=ddp.device_ids, output_device=ddp.output_device, dim=ddp.dim,
                  process_group=ddp.process_group,
                  bucket_cap_mb=None if default_buckets else ddp.bucket_bytes_cap / 2**20,
                  find_unused_parameters=ddp.find_unused_parameters,
                  gradient_as_bucket_view=ddp.gradient_as_bucket_view, static_graph=ddp.static_graph)
    if hasattr(ddp, "forward_sync_buffers"):  # torch >= 2.13 renamed broadcast_buffers
        kwargs["forward_sync_buffers"] = ddp.forward_sync_buffers
    else:
        kwargs["broadcast_buffers"] = ddp.broadcast_buffers
    for name in ("mixed_precision", "skip_all_reduce_unused_params"):  # settings newer torch versions keep
        if hasattr(ddp, name):
            kwargs[name] = getattr(ddp, name)
    kwargs.update(overrides)
    module = ddp.module
    sync_frozen_buffers(module, freezer, kwargs.get("process_group"))  # before DDP leaves them out
    cls._set_params_and_buffers_to_ignore_for_model(module, frozen_state_names(module, freezer))
    ddp.reducer = None  # drop the old reducer (its autograd hooks) before the new one registers its own
    ddp.logger = None
    cls.__init__(ddp, module, **kwargs)
