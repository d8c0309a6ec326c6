"""Counting host synchronisations on the CPU: a simulated device, and a dispatch mode counting what would wait for it.

On a GPU, reading a device tensor on the host (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``,
``torch.equal``, an op whose output shape depends on the data such as ``nonzero``, a blocking copy either way) waits for
every kernel queued before it and stops the host from running ahead (issue 40). On the CPU nothing waits, so such
reads are invisible. This module makes them visible without a GPU:

* :class:`DeviceTensor` is a wrapper tensor subclass (``torch.Tensor._make_wrapper_subclass``) that holds a CPU tensor
  and reports :data:`DEVICE` (``meta``) as its device: the model's parameters, buffers, gradients, optimizer state and
  batches live "on the device", host tensors stay plain CPU tensors, so the two can be told apart. Its
  ``__torch_dispatch__`` unwraps, runs the op on the CPU and wraps the outputs again: the values are the CPU's,
  bit for bit.
* :class:`SyncCounter` is a ``TorchDispatchMode`` that does the same for every op (factory functions asked for
  :data:`DEVICE` included) and, while :meth:`SyncCounter.window` is open, counts per kind (:data:`SYNC_KINDS`) the ops
  that would synchronise with a GPU: ``aten._local_scalar_dense`` on a device tensor (``.item()``, ``float``,
  ``bool``, ``int``), ``Tensor.tolist`` / ``Tensor.numpy`` (which refuse tensor subclasses, so they are caught a level
  above, in ``__torch_function__``), a copy from the device to the host, a blocking copy from the host to the device
  (PyTorch synchronises the stream after one), ``nonzero`` / ``masked_select`` / ``unique`` and indexing with a
  boolean mask (data-dependent shapes), ``equal``, ``is_nonzero``. A ``non_blocking`` copy to the host is counted
  apart (``to_host_async``): it is not a synchronisation (into pinned memory on a GPU).

:func:`place` moves a module's parameters and buffers onto the simulated device. A module's own ``.to(DEVICE)``
works too while a counter is active (what the trainer does with ``run.device`` patched to :data:`DEVICE`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

#: The device the wrapped tensors report.
DEVICE = torch.device("meta")
#: The kinds of host synchronisation counted (``to_host_async`` is counted too, but is not one).
SYNC_KINDS = ("item", "tolist", "numpy", "to_host", "to_device_blocking", "nonzero", "masked_select", "unique",
              "mask_index", "equal", "is_nonzero")

aten = torch.ops.aten
_DATA_DEPENDENT = {aten.nonzero: "nonzero", aten.masked_select: "masked_select", aten._unique2: "unique",
                   aten.unique_dim: "unique", aten.unique_consecutive: "unique", aten.equal: "equal",
                   aten.is_nonzero: "is_nonzero"}
_ACTIVE: list[SyncCounter] = []


class DeviceTensor(torch.Tensor):
    """A CPU tensor (``elem``) that reports :data:`DEVICE`: a tensor "on the device" of the simulated GPU."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, requires_grad: bool = False) -> DeviceTensor:
        t = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                layout=elem.layout, device=DEVICE, requires_grad=requires_grad)
        t.elem = elem
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        return f"DeviceTensor({self.elem!r})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.Tensor.tolist, torch.Tensor.numpy):  # they refuse subclasses below this level
            _note(func.__name__)
            return func(args[0].elem, *args[1:], **kwargs)
        if func in (torch.Tensor.untyped_storage, torch.Tensor.data_ptr):  # the ledger's byte counts
            return func(args[0].elem, *args[1:], **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _run(func, args, kwargs or {}, None)


def _note(kind: str) -> None:
    if _ACTIVE and _ACTIVE[-1].counting:
        _ACTIVE[-1].counts[kind] += 1


def _is_device(x: Any) -> bool:
    return isinstance(x, DeviceTensor)


def _asks_device(kwargs: dict[str, Any]) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device) == DEVICE


def _to_host(kwargs: dict[str, Any]) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu"


def _kind(func: Any, args: Any, kwargs: dict[str, Any]) -> str | None:
    """What sort of synchronisation ``func`` on these arguments is (None: none)."""
    packet = func.overloadpacket
    if func is aten._local_scalar_dense.default:
        return "item" if _is_device(args[0]) else None
    if packet in _DATA_DEPENDENT:
        return _DATA_DEPENDENT[packet] if any(map(_is_device, tree_leaves((args, kwargs)))) else None
    if packet is aten._to_copy:
        if _is_device(args[0]) and _to_host(kwargs):
            return "to_host_async" if kwargs.get("non_blocking") else "to_host"
        if not _is_device(args[0]) and _asks_device(kwargs) and not kwargs.get("non_blocking"):
            return "to_device_blocking"
        return None
    if packet is aten.copy_:
        dst, src = args[0], args[1]
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        if _is_device(src) and not _is_device(dst):
            return "to_host_async" if non_blocking else "to_host"
        if _is_device(dst) and not _is_device(src) and not non_blocking:
            return "to_device_blocking"
        return None
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
        if _is_device(args[0]) and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                       for i in indices if i is not None):
            return "mask_index"  # a device tensor indexed by a mask: the result's shape needs the mask's values
    return None


def _run(func: Any, args: Any, kwargs: dict[str, Any], counter: SyncCounter | None) -> Any:
    """Run ``func`` on the CPU tensors inside, wrapping what comes back when it is "on the device"."""
    kind = _kind(func, args, kwargs)
    if counter is not None and counter.counting and kind is not None:
        counter.counts[kind] += 1
    on_device = any(map(_is_device, tree_leaves((args, kwargs))))
    to_device = _asks_device(kwargs)
    plain_args, plain_kwargs = tree_map(lambda x: x.elem if _is_device(x) else x, (args, kwargs))
    if to_device:
        plain_kwargs = {**plain_kwargs, "device": torch.device("cpu")}
    packet = func.overloadpacket
    if packet is aten._to_copy and _to_host(kwargs):
        return func(*plain_args, **plain_kwargs)
    if packet is aten.copy_ and not _is_device(args[0]):
        func(*plain_args, **plain_kwargs)
        return args[0]
    out = func(*plain_args, **plain_kwargs)
    if not (on_device or to_device):
        return out
    schema = func._schema
    if not schema.returns:
        return None  # an in-place op on a list (torch._foreach_add_): it returns nothing
    if schema.arguments and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write:
        return args[0]  # in place: the wrapper itself
    return tree_map(lambda x: DeviceTensor(x) if isinstance(x, torch.Tensor) and not _is_device(x) else x, out)


class _DataToDevice(TorchFunctionMode):
    """``torch.tensor(data, device=DEVICE)`` (and ``as_tensor``): built on the CPU and wrapped, counted as a blocking
    copy to the device (which it is on CUDA). Needed because torch builds a ``meta`` tensor from data without
    copying it (an empty tensor), which would give the simulated device garbage."""

    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and _asks_device(kwargs):
            if self.counter.counting:
                self.counter.counts["to_device_blocking"] += 1
            return DeviceTensor(func(*args, **{**kwargs, "device": "cpu"}))
        return func(*args, **kwargs)


class SyncCounter(TorchDispatchMode):
    """Runs everything on the CPU behind :class:`DeviceTensor` and counts host synchronisations (module docstring).

    Enter it for the whole run (it also makes the factory functions asked for :data:`DEVICE` give device tensors);
    counts are taken inside :meth:`window` only.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counting = False
        self.counts: Counter[str] = Counter()

    def __enter__(self) -> SyncCounter:
        _ACTIVE.append(self)
        self._functions = _DataToDevice(self)
        self._functions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        try:
            return super().__exit__(*exc)
        finally:
            self._functions.__exit__(*exc)

    @contextlib.contextmanager
    def window(self) -> Iterator[Counter[str]]:
        """Count what runs inside; yields the window's own counter (filled when the block ends)."""
        found: Counter[str] = Counter()
        self.begin()
        try:
            yield found
        finally:
            found.update(self.end())

    def begin(self) -> None:
        """Start counting (from zero)."""
        self.counts, self.counting = Counter(), True

    def end(self) -> Counter[str]:
        """Stop counting; returns what was counted since :meth:`begin`."""
        found, self.counts, self.counting = self.counts, Counter(), False
        return found

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _run(func, args, kwargs or {}, self)


def syncs(counts: Counter[str] | dict[str, int]) -> int:
    """The number of synchronisations in ``counts`` (every kind but ``to_host_async``)."""
    return sum(counts.get(k, 0) for k in SYNC_KINDS)


def to_device(t: torch.Tensor) -> DeviceTensor:
    """``t`` on the simulated device."""
    return DeviceTensor(t.detach().clone(), requires_grad=t.requires_grad)


def place(module: nn.Module) -> nn.Module:
    """Move ``module``'s parameters and buffers onto the simulated device, in place (new Parameter objects: do it
    before building the optimizer and the Freezer). Returns ``module``."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = nn.Parameter(DeviceTensor(p.detach().clone()), requires_grad=p.requires_grad)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = DeviceTensor(b.clone())
    return module


# ------------------------------------------------------------------------------------------------------------------
# A tiny run with a Freezer, counted step by step
# ------------------------------------------------------------------------------------------------------------------

#: The tiny model's width, classes and batch.
WIDTH, CLASSES, BATCH = 8, 4, 16


def tiny_stack(blocks: int = 9, seed: int = 0) -> nn.Sequential:
    """``blocks - 1`` blocks of ``Linear(WIDTH, WIDTH)`` + ``ReLU`` and a ``Linear(WIDTH, CLASSES)`` head (the
    project's discovery finds one block per ``nn.Sequential`` child), on the CPU."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(blocks - 1)],
                         nn.Linear(WIDTH, CLASSES))


@dataclass
class StepCount:
    """The synchronisations of one training step (forward to ``Freezer.step()``, and ``epoch_end()`` at an epoch's
    end): ``staged`` when the strategy ran a stage in it."""

    step: int
    staged: bool
    counts: Counter[str] = field(default_factory=Counter)
    froze: int = 0  # blocks the step's stage froze

    @property
    def syncs(self) -> int:
        return syncs(self.counts)


def count_freezer_steps(strategy: str, params: dict[str, Any] | None = None, steps: int = 48,
                        steps_per_epoch: int = 12, seed: int = 0,
                        device: torch.device | str | None = None,
                        on_step: Callable[[int, bool], Any] | None = None) -> list[StepCount]:
    """Train :func:`tiny_stack` for ``steps`` steps (``total_steps`` = ``steps``, ``epoch_end()`` every
    ``steps_per_epoch``) with ``strategy`` in a plain loop (forward, cross-entropy, backward, ``after_backward``,
    AdamW on :func:`~layerfreeze.block_param_groups`, ``zero_grad``, ``Freezer.step``) and count each step's host
    synchronisations on the simulated device.

    Args:
        device: A real device instead (``"cuda"``): nothing is counted (every step's counts are empty); ``on_step``
            sees each step instead (the CUDA variant runs the steps without a stage under
            ``torch.cuda.set_sync_debug_mode("error")`` through it).
        on_step: ``on_step(step, staged_next)`` -> a context manager entered around each step; ``staged_next``
            says whether a stage is due at that step's ``Freezer.step()`` (by ``stage_every``) or epoch end.

    Returns:
        One :class:`StepCount` per step.
    """
    from layerfreeze import Freezer, block_param_groups  # the library under test, after the harness is defined
    from layerfreeze.models.discovery import discover_blocks

    model = tiny_stack(seed=seed)
    blocks = discover_blocks(model)
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(4)]
    simulated = device is None
    counter = SyncCounter() if simulated else None
    out: list[StepCount] = []
    with counter if counter is not None else contextlib.nullcontext():
        if simulated:
            place(model)
            data = [(to_device(x), to_device(y)) for x, y in data]
        else:
            model.to(device)
            data = [(x.to(device), y.to(device)) for x, y in data]
        optimizer = torch.optim.AdamW(block_param_groups(model, blocks, lr=1e-2), lr=1e-2)
        with Freezer(model, optimizer, strategy, params, blocks=blocks, total_steps=steps,
                     steps_per_epoch=steps_per_epoch) as freezer:
            for i in range(steps):
                x, y = data[i % len(data)]
                every = freezer.strategy.stage_every
                epoch_end = (i + 1) % steps_per_epoch == 0
                due = bool(every) and (freezer.step_count + 1) % every == 0 \
                    or (epoch_end and freezer.strategy.at_epoch_end)
                window = counter.window() if counter is not None else contextlib.nullcontext(Counter())
                around = on_step(i + 1, due) if on_step is not None else contextlib.nullcontext()
                with around, window as counts:
                    loss = nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                    freezer.after_backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    decision = freezer.step()
                    staged = decision is not None
                    if epoch_end:
                        staged = freezer.epoch_end() is not None or staged
                froze = sum(1 for r in freezer.history if r["kind"] == "freeze" and r["step"] == i + 1)
                out.append(StepCount(i + 1, staged, counts, froze))
    return out
