"""Measurement of a training step: its FLOPs (``FlopCounterMode``'s count) and the memory it takes.

* Training FLOPs measured with :func:`measure_flops` (:class:`torch.utils.flop_counter.FlopCounterMode`'s count,
  taken by :class:`~layerfreeze.runs.flops.TotalFlopCounter`).
* Peak memory: :func:`reset_peak_memory` / :func:`peak_memory_bytes`
  (CUDA allocator statistics on CUDA, process peak RSS otherwise); memory in use: :func:`current_memory_bytes`;
  what an earlier run in the same process left behind: :func:`release_garbage`.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from typing import TypeVar

import psutil
import torch

from layerfreeze.runs.flops import TotalFlopCounter

__all__ = ["current_memory_bytes", "measure_flops", "peak_memory_bytes", "release_garbage", "reset_peak_memory"]

T = TypeVar("T")

_PROC_STATUS = "/proc/self/status"
_PROC_CLEAR_REFS = "/proc/self/clear_refs"


# --------------------------------------------------------------------------- #
# FLOPs
# --------------------------------------------------------------------------- #
def measure_flops(fn: Callable[[], T]) -> tuple[T, int]:
    """Run ``fn()`` once and count the floating-point operations it executes.

    ``fn`` should be a real training step (forward + backward, optionally the
    optimizer step).  The count is the one
    ``torch.utils.flop_counter.FlopCounterMode(display=False)`` gives: the
    FLOPs of the matmul / convolution / attention ops that are *actually
    dispatched* (one multiply-add = 2 FLOPs).  Consequently backward work that
    autograd skips for frozen blocks is not counted: a frozen block computes no
    weight gradients, and blocks before the first trainable block compute no
    input gradients either, so freezing a prefix of the network lowers the
    count.  Elementwise ops (activations, norms, bias-gradient reductions,
    optimizer updates) are not counted, so the number is a lower bound on the
    true arithmetic, dominated in practice by the matmuls/convs.

    Convolution backward is counted with
    :func:`~layerfreeze.runs.flops.conv_backward_flops` (torch's formula,
    except that the weight gradient of a grouped convolution is divided by
    ``groups``: torch counts it as a dense convolution).

    The counter is :class:`~layerfreeze.runs.flops.TotalFlopCounter`: torch's
    ``FlopCounterMode`` and its formula registry, keeping the total only (no
    per-module attribution, whose module hooks run on every module call and in
    backward) and trying an op's decomposition only where one exists and can
    count (``FlopCounterMode`` tries one for every op). Equal counts, as ints,
    on transformer and convolutional training steps, frozen or not, in float32
    and under bfloat16 autocast (``tests/test_flops_counter.py``); a cheaper
    counted step (``python -m benchmarks.flops_overhead``). The step still
    runs on its own device, every op through one Python dispatch call: on a
    GPU the counted step is bound by the host, not by the kernels (see
    :mod:`layerfreeze.runs.flops`).

    Args:
        fn: zero-argument callable to run.

    Returns:
        ``(result, flops)``: whatever ``fn`` returned and the total FLOPs
        counted (an ``int``).

    Raises:
        Whatever ``fn`` raises; it is not caught.
    """
    counter = TotalFlopCounter()
    with counter:
        result = fn()
    return result, int(counter.get_total_flops())


# --------------------------------------------------------------------------- #
# Memory
# --------------------------------------------------------------------------- #
def _as_device(device: torch.device | str) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def _read_vm_hwm() -> int | None:
    """Peak resident set size of this process from /proc (bytes), or None."""
    try:
        with open(_PROC_STATUS, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    # "VmHWM:     1764 kB"
                    parts = line.split()
                    return int(parts[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _ru_maxrss_bytes() -> int:
    import resource

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux/BSD report kilobytes; macOS reports bytes.
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


def release_garbage() -> None:
    """Free what unreachable objects still hold: ``gc.collect()``, then the CUDA caching allocator's unused blocks
    (``torch.cuda.empty_cache()``, only where CUDA is initialized).

    Why (issue 40): a finished run's trainer, model, optimizer and Freezer refer to each other (hooks, callbacks,
    bound methods), so ``del`` does not free them; only the cyclic garbage collector does, whenever it next runs a
    full pass. Measured on the CPU with ``gc.disable()``: after a tiny ``Trainer.run()`` and ``del trainer``, its
    model, optimizer and Freezer are all alive until ``gc.collect()``. On the GPU, ``layerfreeze compare``'s
    second row (smartfrz) peaked 261 MiB above the first (none) from its first step, before any freeze: three
    copies of the default job's 86.7 MiB of trainable weights, i.e. the first row's weights and its two AdamW
    moments, still allocated (to be confirmed by the GPU check, ``scripts/gpu_check.sh``). A run calls this before
    it builds anything and resets the peak after, so each run's peak is its own.
    """
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def reset_peak_memory(device: torch.device | str) -> None:
    """Reset the peak-memory counter read by :func:`peak_memory_bytes`.

    * CUDA devices: ``torch.cuda.reset_peak_memory_stats(device)``.
    * Any other device (CPU, ...): best effort reset of the process's peak
      RSS by writing ``"5"`` to ``/proc/self/clear_refs`` (Linux resets
      ``VmHWM`` to the current RSS that way).  If the file is absent or not
      writable (non-Linux, restricted containers) the ``OSError`` is ignored
      and the peak keeps covering the whole process lifetime.

    Raises:
        RuntimeError: from ``torch.cuda`` if a CUDA device is given but CUDA
            is not available.
    """
    dev = _as_device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        return
    try:
        with open(_PROC_CLEAR_REFS, "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        pass


def peak_memory_bytes(device: torch.device | str) -> int:
    """Peak memory in bytes since the last :func:`reset_peak_memory`.

    * CUDA devices: ``torch.cuda.max_memory_allocated(device)`` (tensor
      memory held by PyTorch's caching allocator, not the reserved pool).
    * Any other device: the process's peak resident set size, ``VmHWM`` from
      ``/proc/self/status``; where /proc is not available,
      ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (peak over the whole
      process lifetime, never reset).

    Raises:
        RuntimeError: from ``torch.cuda`` if a CUDA device is given but CUDA
            is not available.
    """
    dev = _as_device(device)
    if dev.type == "cuda":
        return int(torch.cuda.max_memory_allocated(dev))
    hwm = _read_vm_hwm()
    if hwm is not None:
        return hwm
    return _ru_maxrss_bytes()


def current_memory_bytes(device: torch.device | str) -> int:
    """Memory in use now, in bytes.

    CUDA devices: ``torch.cuda.memory_allocated(device)``; any other device:
    the process's resident set size (``psutil.Process().memory_info().rss``).

    Raises:
        RuntimeError: from ``torch.cuda`` if a CUDA device is given but CUDA
            is not available.
    """
    dev = _as_device(device)
    if dev.type == "cuda":
        return int(torch.cuda.memory_allocated(dev))
    return int(psutil.Process(os.getpid()).memory_info().rss)
