"""Frozen models beside the trained one: a VAE or text encoder feeding an adapter, a teacher, a reference model.

Four ways to run them, one result:

* :class:`FrozenModule` — the frozen model on its own device and dtype, under ``torch.no_grad()`` (not
  ``inference_mode``: its outputs may be saved for the trainer's backward), outputs moved back to the trainer's
  device and dtype, and non-finite outputs detected and named (a frozen fp16 VAE that overflows must not turn the
  loss into NaN silently).
* :class:`FrozenPipeline` — a background worker runs the frozen models on the next batches while the trainer trains
  on the current one: bounded queue, order kept, clean shutdown, the worker's errors re-raised in the trainer with
  their traceback. On a CPU the "other device" is another thread (PyTorch releases the GIL inside ops); on GPUs,
  another card or a side CUDA stream.
* :func:`~.precomputed.precompute` — run the frozen models once over a dataset (its items dicts
  holding ``"index"``, the item's position) and store their outputs per sample (in the
  :class:`~layerfreeze.compute.store.ActivationCache`, memory then checksummed safetensors shards); training then
  reads them (:class:`~layerfreeze.compute.precomputed.PrecomputedDataset`: each item with the output added under
  ``"features"``). Its own module, :mod:`~layerfreeze.compute.precomputed`.
* :class:`FrozenDifferentiable` — a frozen model *in the gradient path*: the base denoiser a ControlNet feeds
  (Zhang, Rao, Agrawala, "Adding Conditional Control to Text-to-Image Diffusion Models", ICCV 2023; diffusers
  ``examples/controlnet/train_controlnet.py``), where the loss backpropagates through the frozen UNet into the
  ControlNet's residuals. Its parameters are frozen, autograd is kept, it runs on its own device and dtype and the
  gradients come back to the trainer's device and dtype. It can be neither precomputed nor run ahead (its inputs
  come from the trained model): :func:`~.precomputed.precompute` refuses it with :class:`PrecomputeRefused`.

Running a frozen model elsewhere does not change the result: the same inputs give the same outputs bit for bit in
float32 on CPU (a test trains in all modes and compares every loss). Two things would break that, and are guarded:

* **The global RNG.** A frozen function that samples (a VAE's ``latent_dist.sample()``, as diffusers' scripts do)
  and runs ahead in a worker draws from the global generator in an order that depends on timing, so the trainer's
  noise changes. :class:`FrozenPipeline` runs the first batch in the caller's thread and
  :func:`~.precomputed.precompute` runs every batch with the global RNG state compared before and after: a function
  that drew from it is refused with :class:`GlobalRNGUsedError`. Return the distribution's parameters instead
  (``latent_dist.parameters``) and sample in the trainer with its own ``torch.Generator``, or sample with
  :func:`per_sample_generators` (one seeded generator per sample and epoch: the draw no longer depends on who draws
  first).
* **Threads.** On few cores a worker thread and the trainer both using every core oversubscribe them (a VAE step
  measured 0.8 s with one intra-op thread, 6-7 s with two, on 2 cores beside another job). The pipeline splits the
  cores between the two (``threads="auto"``) and reports the overlap it achieved (:meth:`FrozenPipeline.stats`).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from layerfreeze.compute.determinism import drew_from_global_random, global_random_states
from layerfreeze.runs.ledger_buckets import Bucket


class NonFiniteOutputError(FloatingPointError):
    """A frozen module produced NaN or Inf (for example a float16 VAE that overflowed)."""


class FrozenWorkerError(RuntimeError):
    """An exception raised inside the :class:`FrozenPipeline` worker; the message holds its traceback."""


class PrecomputeRefused(ValueError):
    """:func:`~.precomputed.precompute` was asked for something that cannot be stored once: an output that needs
    autograd (a :class:`FrozenDifferentiable` model, whose inputs come from the trained model)."""


class GlobalRNGUsedError(RuntimeError):
    """A frozen function drew from the global RNG (e.g. ``latent_dist.sample()``); run ahead or precomputed, that
    would change the trainer's random numbers depending on timing."""


_STATE = threading.local()  # .precomputing: inside precompute() in this thread; .ran: the FrozenModules it ran
_TRAINER_THREADS = {"lock": threading.Lock(), "pipelines": 0, "count": 0}  # the count before the first live pipeline


def _text(exc: BaseException) -> str:
    """``str(exc)``, or a stand-in when that raises (the worker's report must never fail, or the consumer waits)."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - any failure of a user's __str__
        return f"<str() of the {type(exc).__name__} failed>"


def _call_without_global_rng(fn: Callable[[Any], Any], batch: Any, where: str) -> Any:
    """``fn(batch)``, raising :class:`GlobalRNGUsedError` when it changed the global RNG state.

    Only meaningful in a thread where nothing else draws meanwhile (the caller's thread before the worker starts;
    precompute's loop).
    """
    before = global_random_states()
    out = fn(batch)
    if drew_from_global_random(before):
        raise GlobalRNGUsedError(
            f"the frozen function given to {where} drew from the global RNG (torch.randn/rand without a generator, "
            "a VAE's latent_dist.sample(), dropout in train mode). Run ahead or precomputed, that changes the "
            "trainer's random numbers depending on timing. Return the distribution's parameters instead "
            "(vae.encode(x).latent_dist.parameters) and sample in the trainer with its own torch.Generator "
            "(DiagonalGaussianDistribution(parameters).sample(generator=g)), or sample with "
            "layerfreeze.compute.frozen.per_sample_generators(...)")
    return out


def per_sample_generators(indices: Iterable[int], seed: int, epoch: int = 0,
                          device: str | torch.device = "cpu") -> list[torch.Generator]:
    """One ``torch.Generator`` per sample, seeded from ``(seed, epoch, sample index)`` only.

    Random draws made with them (diffusers' ``randn_tensor`` and ``DiagonalGaussianDistribution.sample`` take a
    list of generators, one per batch row) do not depend on which thread draws first, on the batch composition or
    on the placement: a frozen function may sample in a worker or in :func:`~.precomputed.precompute` (for one epoch)
    and give the sequential run's numbers.

    Args:
        indices: The samples' dataset indices, in batch order.
        seed: The run's seed.
        epoch: Changes the draws from epoch to epoch (a fresh sample each time the sample is seen).
        device: The generators' device.

    Returns:
        ``len(indices)`` generators.
    """
    gens = []
    for index in indices:
        digest = hashlib.blake2b(f"{seed}:{epoch}:{int(index)}".encode(), digest_size=8).digest()
        gens.append(torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1))
    return gens


@torch.no_grad()
def _all_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _named_tensors(obj: Any, prefix: str = "output") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _named_tensors(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _named_tensors(v, f"{prefix}[{i}]")


def _move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, asynchronously only towards a CUDA device (its stream orders the copy before any use there).
    A copy to the host must block: a non-blocking one returns a pinned tensor before its data has arrived, and the CPU
    (a cast, the trainer, the store) would read it unfinished, in silence."""
    return t.to(device, non_blocking=device.type == "cuda")


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
            by accident. Outputs are made contiguous (a CPU convolution returns channels-last tensors; the trained
            model's results depend on the memory format, which must not depend on where the output came from).
        name: Used in error messages (default: the class name).
        check_finite: Raise :class:`NonFiniteOutputError` naming the module and output when an output holds NaN/Inf.

    The module stays in eval mode: a ``.train()`` that reaches it (a parent module's, at the start of an epoch) is
    undone at the next call, so its dropout stays off and its BatchNorm statistics never change. Its parameters stay
    frozen the same way (a parent's ``requires_grad_(True)`` is undone at the next call) and hold no gradient (one left
    from before is dropped).

    Calling it: ``frozen(*args, **kwargs)`` takes what the module takes (tensors moved to ``device``) and returns
    its outputs (tensors, tuples, dicts, Hugging Face ``ModelOutput``) on ``output_device``. Other objects in the
    output (a diffusers ``DiagonalGaussianDistribution``) pass through unmoved and unchecked: return their tensors
    (``latent_dist.parameters``) instead.

    Raises:
        NonFiniteOutputError: an output holds NaN/Inf (with ``check_finite``), naming the module and the output.
        ValueError: an input requires grad while grad is enabled: run under ``no_grad``, the module would drop the
            gradient that a frozen model run inline passes on (use :class:`FrozenDifferentiable`, or ``.detach()``).
    """

    differentiable = False  # FrozenDifferentiable: autograd kept through the module

    def __init__(self, module: nn.Module, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 output_device: str | torch.device = "cpu", output_dtype: torch.dtype = torch.float32,
                 name: str | None = None, check_finite: bool = True) -> None:
        self.module = module.eval()
        self._freeze_parameters()
        self._all_modules = list(module.modules())  # their train flags are checked at every call
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
        t = _move(t, self.device)
        return t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t

    def ledger_tensors(self) -> list[torch.Tensor]:
        """The module's parameters and buffers (what it holds on ``device``)."""
        return [*self.module.parameters(), *self.module.buffers()]

    def ledger_bytes(self) -> dict[str, dict[str, int]]:
        """What the frozen model holds, for the memory ledger (:class:`~layerfreeze.runs.ledger.MemoryLedger`'s
        byte-source protocol): ``{"side_models": {device: bytes}}``, its parameters and buffers per device, each
        storage once (a tied weight counts once)."""
        seen: set[tuple[str, int]] = set()
        per_device: dict[str, int] = {}
        for t in self.ledger_tensors():
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if t.device.type == "meta" or key in seen:
                continue
            seen.add(key)
            per_device[key[0]] = per_device.get(key[0], 0) + storage.nbytes()
        return {Bucket.SIDE_MODELS: per_device}

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        # Contiguous: a CPU convolution returns channels-last tensors, and the trained model's kernels (so the last
        # bits of the loss) depend on the memory format: it must be the same computed here, in a worker or stored.
        t = _move(t, self.output_device).contiguous()
        return t.to(self.output_dtype) if t.is_floating_point() else t

    def _freeze_parameters(self) -> None:
        """No parameter requires grad or holds one (a gradient left from before it was frozen is memory for nothing)."""
        for p in self.module.parameters():
            p.requires_grad_(False)
            p.grad = None

    def _refuse_inputs_that_need_grad(self, args: Any, kwargs: Any) -> None:
        if self.differentiable or not torch.is_grad_enabled():
            return
        for where, t in _named_tensors({"args": args, "kwargs": kwargs}, "input"):
            if t.requires_grad:
                raise ValueError(
                    f"frozen module {self.name}: {where} requires grad, and FrozenModule runs under torch.no_grad(): "
                    "the gradient through it would be dropped in silence (inline, a frozen model passes it on). "
                    "For a model in the gradient path (a perceptual loss, a base model a ControlNet or a prompt feeds) "
                    "use FrozenDifferentiable; to drop the gradient on purpose, pass the input .detach()ed")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if any(m.training for m in self._all_modules):  # a parent's .train() reached it: frozen means eval, always
            self.module.eval()
        if any(p.requires_grad for p in self.module.parameters()):  # a parent's requires_grad_(True) reached it
            self._freeze_parameters()  # else FrozenDifferentiable's backward fills (and an optimizer steps) its weights
        self._refuse_inputs_that_need_grad(args, kwargs)
        if self.differentiable and getattr(_STATE, "precomputing", False):
            raise PrecomputeRefused(
                f"frozen model {self.name} is in the gradient path (FrozenDifferentiable): its inputs come from the "
                "trained model and the loss backpropagates through it, so its outputs cannot be precomputed. "
                "Precompute only the frozen models that feed the trained one (a VAE encoder, a text encoder)")
        if getattr(_STATE, "precomputing", False):
            _STATE.ran[id(self)] = self  # precompute watches their weights for PrecomputedDataset
        with torch.set_grad_enabled(self.differentiable and torch.is_grad_enabled()):
            args, kwargs = tree_map_only(torch.Tensor, self._in, (args, kwargs))  # containers walked by torch's pytree
            out = self.module(*args, **kwargs)
            if self.check_finite:
                for where, t in _named_tensors(out):
                    # under no_grad: the check builds no graph (isfinite's abs would save the output for backward)
                    if t.is_floating_point() and not _all_finite(t):
                        raise NonFiniteOutputError(
                            f"frozen module {self.name} produced NaN/Inf in {where} (dtype {t.dtype}). In float16 this "
                            "is usually an overflow: run it in bfloat16 or float32 (FrozenModule(dtype=...))."
                        )
            return tree_map_only(torch.Tensor, self._out, out)  # a ModelOutput keeps its class


class FrozenDifferentiable(FrozenModule):
    """A frozen model in the gradient path: parameters frozen, autograd kept, own device and dtype.

    The base denoiser a ControlNet feeds (Zhang, Rao, Agrawala, ICCV 2023; diffusers
    ``examples/controlnet/train_controlnet.py``: the UNet is ``requires_grad_(False)`` but the loss backpropagates
    through it into the ControlNet's residuals). Inputs are moved to ``device`` and floating ones cast to ``dtype``
    with differentiable copies, so the gradients reaching the trainer's tensors come back on the trainer's device in
    the trainer's dtype (float32 for a float32 ControlNet beside a bfloat16/float16 UNet: no half-precision
    gradient ever reaches the trained parameters, so ``GradScaler.unscale_`` never sees one). Outputs come back on
    ``output_device`` in ``output_dtype`` (float32), still attached to the graph. The module's own parameters get no
    gradient (only the input gradients are computed through it). Autograd follows the caller: under
    ``torch.no_grad()`` (evaluation) no graph is built.

    Same arguments as :class:`FrozenModule`.

    Raises:
        NonFiniteOutputError: an output holds NaN/Inf (with ``check_finite``).
        PrecomputeRefused: called inside :func:`~.precomputed.precompute` (its outputs depend on the trained model).
    """

    differentiable = True


class _Run:
    """One iteration of a :class:`FrozenPipeline`: its worker thread, its queue of prepared batches, its stop flag
    (each iteration its own, so a batch of an iteration left early never reaches the next one, and closing an old
    iteration never stops a new one)."""

    def __init__(self, size: int) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=size)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def put(self, item: Any) -> bool:
        """The worker's put: waits for room; False once stopped (the item is dropped)."""
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self, done: Any) -> Any:
        """The consumer's get: the next item, or ``done`` once stopped (close() called from the loop's body)."""
        while True:
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                if self.stop.is_set():
                    return done
                if self.thread is not None and not self.thread.is_alive():  # it ended without a word: never wait
                    try:
                        return self.queue.get_nowait()
                    except queue.Empty:
                        return FrozenWorkerError("the frozen-model worker thread ended without a batch, an end or an "
                                                 "error (killed, or its report failed); the iteration cannot go on")

    def close(self) -> None:
        """Stop the worker, unblock it, join it, drop what it prepared."""
        self.stop.set()
        self._drain()  # unblock a worker waiting on a full queue
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=30)
            self.thread = None
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                return


class FrozenPipeline:
    """Runs ``fn`` on the next batches in a background thread while the caller works on the current one.

    Args:
        batches: The input batches (e.g. a DataLoader over raw inputs).
        fn: ``batch -> prepared batch`` (typically calls one or more :class:`FrozenModule`).
        queue_size: Batches prepared ahead, ``>= 1`` (memory bound: that many prepared batches at most).
        stream: On CUDA, run ``fn`` on this side stream (the consumer waits for it per batch); None on CPU.
        threads: Intra-op CPU threads ``(worker, trainer)`` while the pipeline runs (PyTorch's thread count is per
            thread; the trainer's is restored when the iteration ends). ``"auto"`` (default): on CPU split the
            usable cores, the worker gets ``max(1, cores // 2)`` and the trainer the rest (at least 1), so the two
            never oversubscribe the cores; with a CUDA ``stream`` the trainer's count is kept and the worker gets
            1. ``None``: leave both unchanged.
        check_rng: Run the first batch in the caller's thread with the global RNG state compared before and after,
            and raise :class:`GlobalRNGUsedError` when ``fn`` drew from it (its draws would then depend on timing).

    Iterate over it to get ``fn(batch)`` for every batch, in order. An exception in ``fn`` is raised in the
    consumer as :class:`FrozenWorkerError` (with the worker's traceback; the first batch's, which runs in the caller's
    thread, chained to it). ``close()`` (or leaving a ``with`` block,
    or finishing the iteration) stops and joins the worker. :meth:`stats` reports the overlap achieved.

    Raises:
        ValueError: ``queue_size < 1`` or bad ``threads``.
        GlobalRNGUsedError: see ``check_rng``.
        FrozenWorkerError: ``fn`` raised in the worker.
    """

    _DONE = object()

    def __init__(self, batches: Iterable[Any], fn: Callable[[Any], Any], queue_size: int = 2,
                 stream: Any = None, threads: str | tuple[int, int] | None = "auto", check_rng: bool = True) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if threads == "auto":
            threads = self.auto_threads(cuda=stream is not None)
        elif threads is not None and (not isinstance(threads, tuple) or len(threads) != 2
                                      or not all(isinstance(n, int) and n >= 1 for n in threads)):
            raise ValueError(f"threads must be 'auto', None or (worker, trainer) counts >= 1, got {threads!r}")
        self.batches, self.fn, self.stream, self.threads, self.check_rng = batches, fn, stream, threads, check_rng
        self.queue_size = queue_size
        self._run: _Run | None = None  # the current iteration's worker, queue and stop flag
        self._worker_s = self._wait_s = 0.0
        self._batches = 0

    @staticmethod
    def auto_threads(cuda: bool = False) -> tuple[int, int]:
        """The ``threads="auto"`` split ``(worker, trainer)`` for this process's usable cores."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if cuda:
            return 1, torch.get_num_threads()
        worker = max(1, cores // 2)
        return worker, max(1, cores - worker)

    def stats(self) -> dict[str, Any]:
        """What the pipeline achieved so far.

        Returns:
            ``batches``; ``worker_s`` (seconds spent in ``fn``, worker and first batch); ``wait_s`` (seconds the
            consumer waited for a batch); ``overlap`` = ``1 - wait_s / worker_s`` clipped to [0, 1], the share of
            the frozen models' time hidden behind the trainer's (1: fully hidden; 0: none, as if sequential);
            ``threads`` (worker, trainer) or None.
        """
        overlap = max(0.0, min(1.0, 1.0 - self._wait_s / self._worker_s)) if self._worker_s > 0 else 0.0
        return {"batches": self._batches, "worker_s": self._worker_s, "wait_s": self._wait_s, "overlap": overlap,
                "threads": self.threads}

    def _prepare(self, batch: Any, check_rng: bool = False) -> tuple[Any, Any]:
        start = time.perf_counter()
        fn = (lambda b: _call_without_global_rng(self.fn, b, "FrozenPipeline")) if check_rng else self.fn
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                out = fn(batch)
            event = torch.cuda.Event()
            event.record(self.stream)
            item = (out, event)
        else:
            item = (fn(batch), None)
        self._worker_s += time.perf_counter() - start
        return item

    def _work(self, batches: Iterator[Any], run: _Run) -> None:
        try:
            if self.threads is not None:
                torch.set_num_threads(self.threads[0])
            for batch in batches:
                if run.stop.is_set():
                    return
                if not run.put(self._prepare(batch)):
                    return
            run.put(self._DONE)
        except BaseException as exc:  # noqa: BLE001 - every worker failure goes to the consumer
            run.put(FrozenWorkerError(f"{type(exc).__name__} in the frozen-model worker: {_text(exc)}\n"
                                      f"worker traceback:\n{traceback.format_exc()}"))

    def __iter__(self) -> Iterator[Any]:
        self.close()  # an earlier iteration left early (a break): its worker stops, its prepared batches are dropped
        run = self._run = _Run(self.queue_size)  # this iteration's own queue: nothing of an earlier one
        batches = iter(self.batches)  # here: a sampler's seed is drawn in the trainer's thread, at a fixed point
        with _TRAINER_THREADS["lock"]:  # the first of overlapping pipelines saves the count, the last restores it
            if _TRAINER_THREADS["pipelines"] == 0:
                _TRAINER_THREADS["count"] = torch.get_num_threads()
            _TRAINER_THREADS["pipelines"] += 1
        try:
            first = next(batches, self._DONE)
            if first is self._DONE:
                return
            if self.threads is not None:
                torch.set_num_threads(self.threads[0])  # the first batch runs here, on the worker's share
            try:
                first_item = self._prepare(first, check_rng=self.check_rng)
            except GlobalRNGUsedError:
                raise
            except Exception as exc:  # the first batch runs here: the same error type as a batch in the worker
                raise FrozenWorkerError(f"{type(exc).__name__} in the frozen-model function (the first batch, run in "
                                        f"the caller's thread): {exc}") from exc
            rest: Iterator[Any] = batches
            if self.check_rng:  # the second batch is read here too: does reading a batch draw from the global RNG?
                before = global_random_states()
                second = next(batches, self._DONE)
                if drew_from_global_random(before):
                    raise GlobalRNGUsedError(
                        "FrozenPipeline: reading a batch drew from the global random number generator (random "
                        "augmentation in the dataset?). The worker thread reads the batches, so its draws would "
                        "interleave with the trainer's by timing and no run could be repeated. Draw from a generator "
                        "of the dataset's own, or read the batches in DataLoader worker processes (num_workers > 0, "
                        "which seed their own), or pass check_rng=False to accept it")
                rest = iter(()) if second is self._DONE else itertools.chain([second], batches)
            if self.threads is not None:
                torch.set_num_threads(self.threads[1])
            run.thread = threading.Thread(target=self._work, args=(rest, run), name="layerfreeze-frozen",
                                          daemon=True)
            run.thread.start()
            item = first_item
            while True:
                if item is self._DONE:
                    return
                if isinstance(item, FrozenWorkerError):
                    raise item
                out, event = item
                if event is not None:
                    consumer = torch.cuda.current_stream()
                    consumer.wait_event(event)
                    for _, t in _named_tensors(out):  # made on the side stream, used on this one: the allocator
                        if t.is_cuda:  # must not give their memory back to the side stream while this one reads it
                            t.record_stream(consumer)
                self._batches += 1
                yield out
                start = time.perf_counter()
                item = run.get(self._DONE)
                self._wait_s += time.perf_counter() - start
        finally:
            run.close()
            with _TRAINER_THREADS["lock"]:  # another pipeline still running keeps the split
                _TRAINER_THREADS["pipelines"] -= 1
                if _TRAINER_THREADS["pipelines"] == 0:
                    torch.set_num_threads(_TRAINER_THREADS["count"])

    def close(self) -> None:
        """Stop the worker of the current iteration and wait for it (idempotent); the batches it prepared are
        dropped. Called inside the iteration's loop (an early stop), the iteration ends after the current batch."""
        if self._run is not None:
            self._run.close()

    def __enter__(self) -> FrozenPipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
