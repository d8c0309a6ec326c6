"""The gradient signal ``grad_l1`` (:mod:`layerfreeze.engine.grad_signal`): the pending rows of norms (issue 40's
per-step cost) give bitwise the sums of the per-backward formula they replaced, through frozen-set changes, reads, a
backward that takes the general path, and a checkpoint's reset."""

from __future__ import annotations

import torch
from torch import nn

from layerfreeze import Freezer, block_param_groups
from layerfreeze.engine import grad_signal
from layerfreeze.engine.grad_signal import PENDING_ROWS, GradientSums
from layerfreeze.engine.params import BlockParams
from layerfreeze.models.discovery import discover_blocks


def tiny(seed: int = 0) -> nn.Sequential:
    """The overhead benchmark's model, smaller: 5 blocks of Linear(16, 16) + ReLU and a Linear(16, 4) head."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(5)], nn.Linear(16, 4))


def per_backward_formula(acc: torch.Tensor, model_blocks, frozen: list[bool]) -> None:
    """What :class:`GradientSums` did on every backward before the pending rows: the norms of every trainable
    gradient, stacked, cast to float64 and index-added into the per-block float64 sums."""
    grads, owners = [], []
    for i, block in enumerate(model_blocks):
        if not frozen[i]:
            for p in block.parameters():
                grads.append(p.grad)
                owners.append(i)
    acc.index_add_(0, torch.tensor(owners), torch.stack(torch._foreach_norm(grads, 1)).to(torch.float64))


def test_pending_rows_give_the_per_backward_sums_bit_for_bit():
    model = tiny()
    blocks = discover_blocks(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sums, params = GradientSums(len(blocks)), BlockParams(blocks)
    ref = torch.zeros(len(blocks), dtype=torch.float64)
    frozen = [False] * len(blocks)
    g = torch.Generator().manual_seed(1)
    steps = 3 * PENDING_ROWS + 5  # folds when the rows are full, and a partial fold at each read
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        if step == PENDING_ROWS + 3:  # a backward with a missing gradient: the general path, after the pending rows
            model[2][0].bias.grad = None
        if step == 2 * PENDING_ROWS - 7:  # a read between stages (a checkpoint): the sums so far, then on as before
            assert sums.values() == ref.tolist()
        with torch.no_grad():
            sums.add_trainable(frozen, params)
        if step == PENDING_ROWS + 3:
            model[2][0].bias.grad = torch.zeros_like(model[2][0].bias)  # its norm is 0 in the formula too
        per_backward_formula(ref, blocks, frozen)
        if step == PENDING_ROWS + 10:  # a freeze: a new list of trainable parameters, its own rows
            frozen[0] = frozen[1] = True
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    got = sums.values()
    assert got == ref.tolist()  # bitwise: float == float
    assert all(v > 0 for v in got[2:]) and got[0] < got[2]
    sums.reset([1.0] * len(blocks))  # a checkpoint's sums: pending rows dropped, the device sums start over
    assert sums.values() == [1.0] * len(blocks)


def test_mixed_dtypes_stack_as_the_formula_did():
    # a bfloat16 and a float32 gradient: the formula's stack promoted to float32 before the cast; the rows do too
    a = nn.Parameter(torch.randn(7, 5).to(torch.bfloat16))
    b = nn.Parameter(torch.randn(11))
    sums = GradientSums(2)
    plan = grad_signal._plan([(0, [a]), (1, [b])], key=("k",))
    assert plan.dtype == torch.float32 and plan.device == torch.device("cpu")
    ref = torch.zeros(2, dtype=torch.float64)
    for k in range(PENDING_ROWS + 2):
        a.grad = torch.randn(7, 5).to(torch.bfloat16) * (k + 1)
        b.grad = torch.randn(11) / (k + 1)
        sums._add(plan, None)
        ref.index_add_(0, torch.tensor([0, 1]), torch.stack(torch._foreach_norm([a.grad, b.grad], 1)).double())
    assert sums.values() == ref.tolist()


def test_autofreeze_reads_the_formulas_sums_through_the_freezer():
    # the engine's whole path: after_backward on every step, stages every 24 steps (a fold at each read, full folds
    # in between), a freeze changing the trainable list; grad_l1 as the per-backward formula gives it, bit for bit
    model = tiny(3)
    blocks = discover_blocks(model)
    optimizer = torch.optim.AdamW(block_param_groups(model, blocks, lr=1e-2), lr=1e-2)
    freezer = Freezer(model, optimizer, "autofreeze", {"interval": 24, "percentile": 90}, blocks=blocks,
                      total_steps=200)
    g = torch.Generator().manual_seed(2)
    ref = torch.zeros(len(blocks), dtype=torch.float64)
    seen = []
    for _ in range(144):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        freezer.after_backward()
        per_backward_formula(ref, blocks, list(freezer.frozen))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        frozen_before = list(freezer.frozen)
        if freezer.step() is not None:
            got = freezer.last_signals["grad_l1"]
            want = [float("nan") if f or b.is_head else v for f, b, v in zip(frozen_before, blocks, ref.tolist())]
            assert [repr(v) for v in got] == [repr(v) for v in want]
            seen.append(sum(frozen_before))
            ref.zero_()
    assert len(seen) == 6 and any(seen), seen  # stages after a freeze were compared too
