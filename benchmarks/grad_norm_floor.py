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

Reported, in microseconds per backward:

* **warm**: the median per call over ``--repeats`` runs of ``--calls`` calls in a row on the same gradients (the
  code and the data stay in the caches);
* **after a backward**: the median, over ``--steps`` training steps of the step_overhead model (AdamW, one thread), of
  one call right after ``loss.backward()``, reading the fresh gradients (``p.grad``) included: what a step pays. It is
  the larger: the first ``.grad`` read of a gradient autograd made wraps it in a Python object, and the first call
  after the forward, the backward and the optimizer's step finds neither its code nor its data in the caches.

Run it alone on the machine.

    python -m benchmarks.grad_norm_floor                 # the table, Markdown
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.cli import count, entry

#: The step_overhead model's gradients: 8 blocks of Linear(32, 32) and the Linear(32, 10) head, weight and bias each.
SHAPES = [(32, 32), (32,)] * 8 + [(10, 32), (10,)]


def candidates() -> dict[str, Callable[[list[torch.Tensor]], object]]:
    """The ways to read the gradients, each a callable over a list of tensors of :data:`SHAPES` (with buffers of
    their own, made here)."""
    row = torch.empty(len(SHAPES))
    numels = [torch.Size(s).numel() for s in SHAPES]
    flat = torch.empty(sum(numels))
    views, offset = [], 0
    for shape, n in zip(SHAPES, numels):
        views.append(flat[offset: offset + n].view(shape))
        offset += n
    lengths = torch.tensor(numels)
    summed = [torch.zeros(s) for s in SHAPES]

    def flat_sums(grads: list[torch.Tensor]) -> object:
        torch._foreach_copy_(views, grads)
        return torch.segment_reduce(flat.abs(), "sum", lengths=lengths)

    def accumulate(grads: list[torch.Tensor]) -> list[torch.Tensor]:
        torch._foreach_add_(summed, grads)
        return summed

    return {
        "foreach_norm": lambda grads: torch._foreach_norm(grads, 1),
        "foreach_norm + stack": lambda grads: torch.stack(torch._foreach_norm(grads, 1), out=row),
        "copy to flat + abs + segment sum": flat_sums,
        "accumulate the gradients": accumulate,
    }


def measure(calls: int, repeats: int) -> dict[str, float]:
    """Median microseconds per call of each candidate, warm: calls in a row on the same gradients."""
    torch.manual_seed(0)
    grads = [torch.randn(s) for s in SHAPES]
    out = {}
    for name, fn in candidates().items():
        for _ in range(max(10, calls // 10)):  # warm up
            fn(grads)
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(grads)
            runs.append((time.perf_counter() - t0) / calls * 1e6)
        out[name] = statistics.median(runs)
    return out


def after_backward(steps: int) -> dict[str, float]:
    """Median microseconds of one call of each candidate right after a backward of the step_overhead model, reading
    the fresh gradients included; each candidate in its own run of ``steps`` AdamW steps, one after another."""
    from torch import nn

    from benchmarks.step_overhead import BATCH, CLASSES, WIDTH, tiny_model

    out = {}
    for name, fn in candidates().items():
        model = tiny_model(0)
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
                for _ in range(8)]
        times = []
        for i in range(steps):
            x, y = data[i % len(data)]
            nn.functional.cross_entropy(model(x), y).backward()
            t0 = time.perf_counter()
            fn([p.grad for p in params])
            times.append(time.perf_counter() - t0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out[name] = statistics.median(times) * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=count(1), default=2000)
    parser.add_argument("--repeats", type=count(1), default=7)
    parser.add_argument("--steps", type=count(1), default=400, help="training steps per candidate after a backward")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warm = measure(args.calls, args.repeats)
    cold = after_backward(args.steps)
    print(f"| way to read the {len(SHAPES)} gradients | us per backward, warm | us, after a backward |\n"
          "|---|---:|---:|")
    for name, us in warm.items():
        print(f"| {name} | {us:.1f} | {cold[name]:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main))
