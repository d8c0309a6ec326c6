"""Tests for layerfreeze.runs.measure: FLOP counting and memory."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest
import torch
from torch import nn

from layerfreeze.runs.measure import measure_flops

B, IN, HID, OUT = 8, 64, 32, 16
# One matmul (m x k) @ (k x n) costs 2*m*k*n FLOPs (a multiply and an add).
FWD_L1 = 2 * B * IN * HID  # Linear(64, 32) on a batch of 8: addmm (8x64)@(64x32) = 32768
FWD_L2 = 2 * B * HID * OUT  # Linear(32, 16) on a batch of 8: addmm (8x32)@(32x16) = 8192


def _step(model: nn.Module, x: torch.Tensor) -> Callable[[], float]:
    def fn() -> float:
        loss = model(x).square().mean()
        loss.backward()
        return float(loss.detach())

    return fn


# --------------------------------------------------------------------------- #
# measure_flops
# --------------------------------------------------------------------------- #
def test_measure_flops_linear_forward_only() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(IN, HID)
    x = torch.randn(B, IN)
    out, flops = measure_flops(lambda: lin(x))
    assert out.shape == (B, HID)
    # addmm(bias, x, W^T): the bias add is elementwise and not counted.
    assert flops == FWD_L1 == 32768


def test_measure_flops_linear_trainable() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(IN, HID)
    x = torch.randn(B, IN)  # input does not require grad
    loss, flops = measure_flops(_step(lin, x))
    assert isinstance(loss, float)
    # forward:      addmm (8x64)@(64x32)                  = 2*8*64*32 = 32768
    # weight grad:  mm grad_out^T @ x, (32x8)@(8x64)       = 2*32*8*64 = 32768
    # bias grad:    a sum over the batch (elementwise)     = not counted
    # input grad:   not computed (x does not require grad) = 0
    assert flops == 2 * FWD_L1 == 65536
    assert lin.weight.grad is not None


def test_measure_flops_linear_weight_frozen() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(IN, HID)
    lin.weight.requires_grad_(False)  # bias stays trainable so backward() runs
    x = torch.randn(B, IN)
    _, flops = measure_flops(_step(lin, x))
    # forward addmm only; backward computes just the bias grad (a reduction,
    # not counted): no weight grad, no input grad.
    assert flops == FWD_L1 == 32768
    assert lin.weight.grad is None and lin.bias.grad is not None


def test_measure_flops_frozen_prefix_drops_backward_work() -> None:
    x = torch.randn(B, IN)

    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, OUT))
    _, flops_full = measure_flops(_step(full, x))
    # forward: L1 32768 + L2 8192                               = 40960
    # L2 weight grad: (16x8)@(8x32)  = 2*16*8*32                 =  8192
    # L2 input grad:  (8x16)@(16x32) = 2*8*16*32 (L1 trainable)  =  8192
    # L1 weight grad: (32x8)@(8x64)  = 2*32*8*64                 = 32768
    # L1 input grad: none (x does not require grad)              =     0
    assert flops_full == FWD_L1 + FWD_L2 + 2 * B * OUT * HID + 2 * B * OUT * HID + 2 * HID * B * IN
    assert flops_full == 90112

    torch.manual_seed(0)
    prefix_frozen = nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, OUT))
    for p in prefix_frozen[0].parameters():
        p.requires_grad_(False)
    _, flops_frozen = measure_flops(_step(prefix_frozen, x))
    # forward: L1 32768 + L2 8192                                    = 40960
    # L2 weight grad: 2*16*8*32                                       =  8192
    # L2 input grad: none, L1's output does not require grad          =     0
    # L1 (frozen): no weight grad, no input grad                      =     0
    assert flops_frozen == FWD_L1 + FWD_L2 + 2 * OUT * B * HID == 49152
    assert flops_frozen < flops_full
    assert prefix_frozen[0].weight.grad is None and prefix_frozen[2].weight.grad is not None


def test_measure_flops_propagates_errors() -> None:
    def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        measure_flops(boom)


# --------------------------------------------------------------------------- #
# memory
# --------------------------------------------------------------------------- #
def _clear_refs_works() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


_MEMORY_PROBE = """
import json, torch
from layerfreeze.runs.measure import current_memory_bytes, peak_memory_bytes, reset_peak_memory
out = {}
reset_peak_memory("cpu")
out["before_peak"], out["before_rss"] = peak_memory_bytes("cpu"), current_memory_bytes("cpu")
t = torch.ones(50_000_000)  # 200 MB; torch.ones writes every page, so it is resident
out["rss_with"], out["peak_with"] = current_memory_bytes("cpu"), peak_memory_bytes("cpu")
del t  # a 200 MB block is mmap'ed and returned to the OS on free
reset_peak_memory("cpu")
out["peak_after_reset"], out["rss_after"] = peak_memory_bytes("cpu"), current_memory_bytes("cpu")
print(json.dumps(out))
"""


def _memory_probe() -> dict[str, int]:
    """Run the allocation in a fresh small process: in the long-lived test process earlier tests' freed memory can
    be reused, so a new 200 MB tensor need not raise RSS there."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_peak_memory_cpu_grows_with_allocation() -> None:
    m = _memory_probe()
    assert m["before_peak"] > 0 and m["before_rss"] > 0
    assert m["rss_with"] >= m["before_rss"] + 180 * 10**6
    assert m["peak_with"] >= m["rss_with"] >= m["before_peak"] + 180 * 10**6 - 50 * 10**6


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_reset_peak_memory_cpu_clears_refs() -> None:
    if not _clear_refs_works():
        pytest.skip("/proc/self/clear_refs not writable here")
    m = _memory_probe()
    assert m["peak_after_reset"] <= m["peak_with"] - 150 * 10**6
    # After a reset VmHWM restarts at the current RSS.
    assert m["peak_after_reset"] >= m["rss_after"] - 50 * 10**6


@pytest.mark.parametrize("groups", [1, 4, 32])
def test_measure_flops_conv_backward_counts_grouped_weight_gradients_per_group(groups: int) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    conv = nn.Conv2d(32, 32, 3, padding=1, groups=groups)
    x = torch.randn(4, 32, 8, 8, requires_grad=True)
    fwd = 2 * 4 * 32 * 8 * 8 * (32 // groups) * 9  # per output value: C_in / groups * 3 * 3 multiply-adds
    _, flops = measure_flops(lambda: conv(x).sum().backward())
    assert flops == 3 * fwd  # forward, input gradient, weight gradient: each one forward's worth
    conv.weight.requires_grad_(False)
    _, frozen = measure_flops(lambda: conv(x).sum().backward())
    assert frozen == 2 * fwd  # no weight gradient
    if groups == 1:  # dense convolutions: the same count as torch's own formula
        counter = FlopCounterMode(display=False)
        conv.weight.requires_grad_(True)
        with counter:
            conv(x).sum().backward()
        assert counter.get_total_flops() == flops
