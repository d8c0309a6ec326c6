"""What AutoFreeze's per-step signal costs at least on this CPU: ways to compute per-tensor L1 gradient norms.

Issue 40 asks that no strategy add more than 0.02 ms to a step without a stage (``python -m benchmarks.step_overhead``:
9 blocks of ``Linear(32, 32)``, 18 gradient tensors, 8.9k values). AutoFreeze's signal (``grad_l1``, Liu et al.,
"AutoFreeze", 2021, sec. 3) is each block's gradient L1 norm summed over the backward passes of an interval, so every
backward reads every trainable gradient once (:mod:`layerfreeze.engine.grad_signal`). This times, on those 18 tensors
in one thread, the candidates for that read, each alone, one after another in this process:

* ``foreach_norm``: ``torch._foreach_norm(grads, 1)``, the engine's (one fused kernel on CUDA; on the CPU a loop of
  per-tensor reductions in C++);
* ``foreach_norm + stack``: the same and ``torch.stack(norms, out=row)``, what the engine queues per backward;
* ``copy to flat + abs + segment sum``: ``torch._foreach_copy_`` into views of one preallocated buffer, ``abs``,
  ``torch.segment_reduce``: three ops whatever the number of tensors, but the sums' last bits differ from the per-tensor
  norms' (another order of additions);
* ``accumulate the gradients``: ``torch._foreach_add_`` of every gradient into a buffer of their size, the public
  code's own signal (``||sum_t g_t||_1``), paid in a gradient-sized copy on the device.

Reported: the median microseconds per call over ``--repeats`` runs of ``--calls`` calls. Run it alone on the machine.

    python -m benchmarks.grad_norm_floor                 # the table, Markdown
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

#: The step_overhead model's gradients: 8 blocks of Linear(32, 32) and the Linear(32, 10) head, weight and bias each.
SHAPES = [(32, 32), (32,)] * 8 + [(10, 32), (10,)]


def candidates() -> dict[str, Callable[[], object]]:
    """The ways to read the gradients, each a no-argument callable over the same 18 tensors."""
    torch.manual_seed(0)
    grads = [torch.randn(s) for s in SHAPES]
    row = torch.empty(len(grads))
    flat = torch.empty(sum(g.numel() for g in grads))
    views, offset = [], 0
    for g in grads:
        views.append(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()
    lengths = torch.tensor([g.numel() for g in grads])
    summed = [torch.zeros_like(g) for g in grads]

    def flat_sums() -> object:
        torch._foreach_copy_(views, grads)
        return torch.segment_reduce(flat.abs(), "sum", lengths=lengths)

    return {
        "foreach_norm": lambda: torch._foreach_norm(grads, 1),
        "foreach_norm + stack": lambda: torch.stack(torch._foreach_norm(grads, 1), out=row),
        "copy to flat + abs + segment sum": flat_sums,
        "accumulate the gradients": lambda: torch._foreach_add_(summed, grads),
    }


def measure(calls: int, repeats: int) -> dict[str, float]:
    """Median microseconds per call of each candidate."""
    out = {}
    for name, fn in candidates().items():
        for _ in range(max(10, calls // 10)):  # warm up
            fn()
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            runs.append((time.perf_counter() - t0) / calls * 1e6)
        out[name] = statistics.median(runs)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    got = measure(args.calls, args.repeats)
    print(f"| way to read the {len(SHAPES)} gradients | us per backward |\n|---|---:|")
    for name, us in got.items():
        print(f"| {name} | {us:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
