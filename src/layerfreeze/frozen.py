"""Frozen models beside the trained one: a VAE or text encoder feeding an adapter, a teacher, a reference model.

Three ways to run them, one result:

* :class:`FrozenModule` — the frozen model on its own device and dtype, under ``torch.no_grad()`` (not
  ``inference_mode``: its outputs may be saved for the trainer's backward), outputs moved back to the trainer's
  device and dtype, and non-finite outputs detected and named (a frozen fp16 VAE that overflows must not turn the
  loss into NaN silently).
* :class:`FrozenPipeline` — a background worker runs the frozen models on the next batches while the trainer trains
  on the current one: bounded queue, order kept, clean shutdown, the worker's errors re-raised in the trainer with
  their traceback. On a CPU the "other device" is another thread (PyTorch releases the GIL inside ops); on GPUs,
  another card or a side CUDA stream.
* :func:`precompute` — run the frozen models once over a dataset and store their outputs per sample (in the
  :class:`~layerfreeze.store.ActivationCache`, memory then checksummed safetensors shards); training then reads
  them (:class:`PrecomputedDataset`).

Running a frozen model elsewhere does not change the result: the same inputs give the same outputs bit for bit in
float32 on CPU (a test trains in all three modes and compares every loss).
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from .store import ActivationCache


class NonFiniteOutputError(FloatingPointError):
    """A frozen module produced NaN or Inf (for example a float16 VAE that overflowed)."""


class FrozenWorkerError(RuntimeError):
    """An exception raised inside the :class:`FrozenPipeline` worker; the message holds its traceback."""


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):  # includes Hugging Face ModelOutput
        return type(obj)(**{k: _map(v, fn) for k, v in obj.items()}) if hasattr(obj, "to_tuple") else \
            {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


def _named_tensors(obj: Any, prefix: str = "output") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _named_tensors(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _named_tensors(v, f"{prefix}[{i}]")


class FrozenModule:
    """A frozen model on a chosen device and dtype, run under ``torch.no_grad()``.

    Args:
        module: The model; it is put in eval mode, its parameters stop requiring grad, and it is moved to
            ``device``/``dtype``.
        device: Where it runs (default: where it is).
        dtype: Its floating-point dtype (e.g. ``torch.float16``/``bfloat16``; default: unchanged). Floating inputs
            are cast to it.
        output_device: Where outputs go (the trainer's device; default CPU).
        output_dtype: Floating outputs are cast to it (default float32), so the trainer never sees half precision
            by accident.
        name: Used in error messages (default: the class name).
        check_finite: Raise :class:`NonFiniteOutputError` naming the module and output when an output holds NaN/Inf.

    Calling it: ``frozen(*args, **kwargs)`` takes what the module takes (tensors moved to ``device``) and returns
    its outputs (tensors, tuples, dicts, Hugging Face ``ModelOutput``) on ``output_device``.
    """

    def __init__(self, module: nn.Module, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 output_device: str | torch.device = "cpu", output_dtype: torch.dtype = torch.float32,
                 name: str | None = None, check_finite: bool = True) -> None:
        self.module = module.eval().requires_grad_(False)
        if device is not None or dtype is not None:
            self.module.to(device=device, dtype=dtype)
        first = next(module.parameters(), None)
        self.device = torch.device(device) if device is not None else (first.device if first is not None
                                                                           else torch.device("cpu"))
        self.dtype = dtype
        self.output_device = torch.device(output_device)
        self.output_dtype = output_dtype
        self.name = name or type(module).__name__
        self.check_finite = check_finite

    def _in(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device, non_blocking=True)
        return t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.output_device, non_blocking=True)
        return t.to(self.output_dtype) if t.is_floating_point() else t

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            out = self.module(*_map(args, self._in), **_map(kwargs, self._in))
            if self.check_finite:
                for where, t in _named_tensors(out):
                    if t.is_floating_point() and not torch.isfinite(t).all():
                        raise NonFiniteOutputError(
                            f"frozen module {self.name} produced NaN/Inf in {where} (dtype {t.dtype}). In float16 this "
                            "is usually an overflow: run it in bfloat16 or float32 (FrozenModule(dtype=...))."
                        )
            return _map(out, self._out)


class FrozenPipeline:
    """Runs ``fn`` on the next batches in a background thread while the caller works on the current one.

    Args:
        batches: The input batches (e.g. a DataLoader over raw inputs).
        fn: ``batch -> prepared batch`` (typically calls one or more :class:`FrozenModule`).
        queue_size: Batches prepared ahead, ``>= 1`` (memory bound: that many prepared batches at most).
        stream: On CUDA, run ``fn`` on this side stream (the consumer waits for it per batch); None on CPU.

    Iterate over it to get ``fn(batch)`` for every batch, in order. An exception in the worker is raised in the
    consumer as :class:`FrozenWorkerError` with the worker's traceback. ``close()`` (or leaving a ``with`` block,
    or finishing the iteration) stops and joins the worker.
    """

    _DONE = object()

    def __init__(self, batches: Iterable[Any], fn: Callable[[Any], Any], queue_size: int = 2,
                 stream: Any = None) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self.batches, self.fn, self.stream = batches, fn, stream
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        try:
            for batch in self.batches:
                if self._stop.is_set():
                    return
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        out = self.fn(batch)
                    event = torch.cuda.Event()
                    event.record(self.stream)
                    item = (out, event)
                else:
                    item = (self.fn(batch), None)
                if not self._put(item):
                    return
            self._put(self._DONE)
        except BaseException as exc:  # noqa: BLE001 - every worker failure goes to the consumer
            self._put(FrozenWorkerError(f"{type(exc).__name__} in the frozen-model worker: {exc}\n"
                                        f"worker traceback:\n{traceback.format_exc()}"))

    def __iter__(self) -> Iterator[Any]:
        self._stop.clear()
        self._thread = threading.Thread(target=self._work, name="layerfreeze-frozen", daemon=True)
        self._thread.start()
        try:
            while True:
                item = self._queue.get()
                if item is self._DONE:
                    return
                if isinstance(item, FrozenWorkerError):
                    raise item
                out, event = item
                if event is not None:
                    torch.cuda.current_stream().wait_event(event)
                yield out
        finally:
            self.close()

    def close(self) -> None:
        """Stop the worker and wait for it (idempotent)."""
        self._stop.set()
        while True:  # unblock a worker waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def __enter__(self) -> FrozenPipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def precompute(dataset: Dataset, fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], batch_size: int,
               store: ActivationCache | None = None, key: int = 0) -> ActivationCache:
    """Run ``fn`` (the frozen models) once over ``dataset`` and store one output row per sample.

    Args:
        dataset: Items are dicts with an ``"index"`` key (see :mod:`layerfreeze.data`).
        fn: ``batch dict -> (B, ...) tensor``.
        batch_size: Batch size of the pass (use the training batch size: CPU matmul kernels can round the last
            bits differently for very small batches, and equal losses across modes need equal per-sample outputs).
        store: Where outputs go (default: an in-memory :class:`ActivationCache`); give one with a ``directory`` to
            spill to checksummed safetensors shards.
        key: The depth key entries are stored under.

    Returns:
        The store, holding ``(index, key)`` entries.
    """
    from torch.utils.data import DataLoader

    store = store if store is not None else ActivationCache()
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, generator=torch.Generator())
    for batch in loader:
        store.put_batch(batch["index"].tolist(), key, fn(batch))
    store.flush()
    return store


class PrecomputedDataset(Dataset):
    """``dataset``'s items with the precomputed frozen output added under ``feature_key``.

    Raises:
        KeyError: a sample has no stored output (the store was built over another dataset).
    """

    def __init__(self, dataset: Dataset, store: ActivationCache, feature_key: str = "features", key: int = 0,
                 drop: tuple[str, ...] = ()) -> None:
        self.dataset, self.store, self.feature_key, self.key, self.drop = dataset, store, feature_key, key, drop

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = self.dataset[i]
        index = int(item["index"])
        out = self.store.get_batch([index], self.key)
        if out is None:
            raise KeyError(f"no precomputed output for sample {index}; precompute() over this dataset first")
        item = {k: v for k, v in item.items() if k not in self.drop}
        item[self.feature_key] = out[0]
        return item
