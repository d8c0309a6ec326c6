"""benchmarks/grad_norm_floor.py: every candidate computes the per-tensor L1 norms it claims (the same values up to
the order of additions), the accumulation sums the gradients, and the table prints both timings."""

from __future__ import annotations

import torch

from tests.conftest import benchmark_module


def test_the_candidates_compute_the_l1_norms_and_the_table_prints(capsys):
    with benchmark_module("grad_norm_floor") as bench:
        ways = bench.candidates()
        torch.manual_seed(0)
        grads = [torch.randn(s) for s in bench.SHAPES]
        exact = torch.stack([g.abs().sum() for g in grads])
        assert torch.allclose(torch.stack(ways["foreach_norm"](grads)), exact, rtol=1e-5)
        assert torch.allclose(ways["foreach_norm + stack"](grads), exact, rtol=1e-5)
        assert torch.allclose(ways["copy to flat + abs + segment sum"](grads), exact, rtol=1e-5)
        ways["accumulate the gradients"](grads)
        twice = ways["accumulate the gradients"](grads)  # the sum of two backward passes of the same gradients
        assert all(torch.equal(t, 2 * g) for t, g in zip(twice, grads))
        assert bench.main(["--calls", "20", "--repeats", "1", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| way to read the 18 gradients | us per backward, warm | us, after a backward |")
    assert out.count("\n") == 6
