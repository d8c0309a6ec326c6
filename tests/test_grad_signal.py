"""The gradient signal ``grad_l1`` (:mod:`layerfreeze.engine.grad_signal`): AutoFreeze's public code's own signal, the
L1 norm of each parameter's gradient summed over the interval (``grad_tensor_dict[name] += param.grad``, then
``torch.norm(..., p=1)`` at the evaluation), kept as running sums on the device (issue 40: one ``_foreach_add_`` a
backward); through frozen-set changes, a missing gradient, low-precision weights, a checkpoint in mid-interval, the
memory ledger and a memory plan."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

from layerfreeze import Freezer, MemoryLedger, block_param_groups
from layerfreeze.engine.grad_signal import GradientSums
from layerfreeze.engine.params import BlockParams
from layerfreeze.models.discovery import discover_blocks


def tiny(seed: int = 0) -> nn.Sequential:
    """The overhead benchmark's model, smaller: 5 blocks of Linear(16, 16) + ReLU and a Linear(16, 4) head."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(5)], nn.Linear(16, 4))


class PublicCode:
    """AutoFreeze's public code's accumulation (``freeze_intermediate_e2e_lr.py``, written again here as the test's
    reference): a float32 zero tensor per trainable parameter, ``+= param.grad`` after every backward, and at the
    evaluation each layer's sum of ``torch.norm(acc, p=1).item()``, the accumulators then zeroed."""

    def __init__(self, blocks) -> None:
        self.blocks = blocks
        self.acc = {id(p): torch.zeros_like(p, dtype=torch.float32) for b in blocks for p in b.parameters()}

    def add(self, frozen: list[bool]) -> None:
        for i, b in enumerate(self.blocks):
            for p in b.parameters():
                if not frozen[i] and p.grad is not None:
                    self.acc[id(p)] += p.grad

    def values(self, frozen: list[bool]) -> list[float]:
        return [0.0 if frozen[i] else sum(torch.norm(self.acc[id(p)], p=1).item() for p in b.parameters())
                for i, b in enumerate(self.blocks)]

    def reset(self) -> None:
        for t in self.acc.values():
            t.zero_()


def backward(model: nn.Module, g: torch.Generator) -> None:
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    nn.functional.cross_entropy(model(x), y).backward()


def test_the_sums_are_the_public_codes_signal_through_freezes_a_missing_gradient_and_a_checkpoint():
    model = tiny()
    blocks = discover_blocks(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sums, params, ref = GradientSums(len(blocks)), BlockParams(blocks), PublicCode(blocks)
    frozen = [False] * len(blocks)
    g = torch.Generator().manual_seed(1)
    resumed = None
    per_backward = [0.0] * len(blocks)  # the engine's former signal: the sum of each backward's L1 norms
    for step in range(40):
        backward(model, g)
        if step == 7:  # a trainable parameter without a gradient this backward: skipped, the rest added
            model[2][0].bias.grad = None
        with torch.no_grad():
            sums.add_trainable(frozen, params)
            if resumed is not None:
                resumed.add_trainable(frozen, params)
        ref.add(frozen)
        for i, b in enumerate(blocks):
            per_backward[i] += 0.0 if frozen[i] else sum(p.grad.abs().sum().item() for p in b.parameters()
                                                         if p.grad is not None)
        if step == 11:  # a freeze: blocks 0 and 1 leave the sums (their memory with them)
            frozen[0] = frozen[1] = True
        if step == 23:  # a checkpoint in mid-interval, through torch.save: a fresh GradientSums goes on from it
            buffer = io.BytesIO()
            torch.save(sums.state_dict(), buffer)
            buffer.seek(0)
            resumed = GradientSums(len(blocks))
            resumed.load_state_dict(torch.load(buffer, weights_only=True))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    want = ref.values(frozen)
    got = sums.values()
    assert got == pytest.approx(want, rel=1e-6) and all(v > 0 for v in got[2:])
    assert got[:2] == [0.0, 0.0] and len(sums.held_tensors()) == 2 * (len(blocks) - 2)
    assert resumed.values() == got  # bitwise: the same sums in the same order
    # not the sum of per-backward norms: gradients that change sign within the interval cancel in the sum
    assert all(got[i] < 0.9 * per_backward[i] for i in range(2, len(blocks)))
    sums.reset()  # nothing added since: NaN, so AutoFreeze skips the stage (every step of it skipped by a scaler)
    assert all(v != v for v in sums.values())


def test_low_precision_weights_are_summed_in_float32():
    a = nn.Parameter(torch.randn(7, 5).to(torch.bfloat16))
    b = nn.Parameter(torch.randn(11, dtype=torch.float64))

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Module(), nn.Module()
            self.a.w, self.b.w = a, b

    blocks = discover_blocks(Two(), ["a", "b"])
    sums = GradientSums(2)
    ref = [torch.zeros(7, 5), torch.zeros(11, dtype=torch.float64)]
    for k in range(300):  # 300 bfloat16 gradients of 0.01: a bfloat16 sum would stall at 2
        a.grad = torch.full((7, 5), 0.01, dtype=torch.bfloat16)
        b.grad = torch.randn(11, dtype=torch.float64) / (k + 1)
        sums.add_trainable([False, False], BlockParams(blocks))
        ref[0] += a.grad
        ref[1] += b.grad
    assert [t.dtype for t in sums.held_tensors()] == [torch.float32, torch.float64]
    assert sums.values() == pytest.approx([ref[0].abs().sum().item(), ref[1].abs().sum().item()], rel=1e-7)
    assert sums.values()[0] == pytest.approx(35 * 300 * 0.01, rel=1e-3)


def run_autofreeze(steps: int, stop: int | None = None, state: dict | None = None):
    """AutoFreeze through the Freezer on the tiny model (stages every 6 steps): ``(grad_l1 of each stage, history,
    freezer)``; ``stop``: return the Freezer's state after that many steps instead; ``state``: resume from it."""
    model = tiny(3)
    blocks = discover_blocks(model)
    optimizer = torch.optim.AdamW(block_param_groups(model, blocks, lr=1e-2), lr=1e-2)
    freezer = Freezer(model, optimizer, "autofreeze", {"interval": 6, "percentile": 90}, blocks=blocks,
                      total_steps=200)
    g = torch.Generator().manual_seed(2)
    first = 0
    if state is not None:
        model.load_state_dict(state["model"])
        freezer.load_state_dict(state["freezer"])
        optimizer.load_state_dict(state["optimizer"])
        g.set_state(state["rng"])
        first = freezer.step_count
    stages = []
    for step in range(first, steps):
        if step == stop:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "freezer": freezer.state_dict(),
                        "optimizer": optimizer.state_dict(), "rng": g.get_state()}, buffer)
            buffer.seek(0)
            return torch.load(buffer, weights_only=True)
        backward(model, g)
        freezer.after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if freezer.step() is not None:
            stages.append(list(freezer.last_signals["grad_l1"]))
    return stages, list(freezer.history), freezer


def test_autofreeze_resumed_in_mid_interval_reads_the_uninterrupted_runs_signal_bit_for_bit():
    stages, history, freezer = run_autofreeze(48)
    assert any(h["kind"] == "freeze" for h in history), "autofreeze froze nothing: no freeze to cross"
    state = run_autofreeze(48, stop=27)  # 3 steps into the 5th interval, after a freeze
    assert state["freezer"]["grad_sums"] and all(t.device.type == "cpu" for t in state["freezer"]["grad_sums"].values())
    later, history_b, _ = run_autofreeze(48, state=state)
    assert [repr(v) for s in later for v in s] == [repr(v) for s in stages[-len(later):] for v in s]
    assert [(h["block"], h["step"]) for h in history_b] == [(h["block"], h["step"]) for h in history]
    # the Freezer reports the sums in the memory ledger's strategy bucket: a float32 copy of the trainable weights
    # but the head's (AutoFreeze never scores the head: Strategy.head_signals)
    trainable = sum(p.numel() for i, b in enumerate(freezer.blocks) if not freezer.frozen[i] and not b.is_head
                    for p in b.parameters())
    assert freezer.ledger_bytes() == {"strategy": {"cpu": 4 * trainable}}


def test_a_checkpoint_of_an_older_layerfreeze_starts_the_interval_over_and_says_so():
    state = run_autofreeze(48, stop=27)
    old = copy.deepcopy(state)
    del old["freezer"]["grad_sums"]
    old["freezer"]["grad_l1"] = [1.5] * 6
    with pytest.warns(UserWarning, match="starts over at step 27"):
        run_autofreeze(30, state=old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_autofreeze(30, state=state)


def test_the_memory_ledger_counts_the_sums_once_in_the_strategy_bucket():
    model = tiny()
    blocks = discover_blocks(model)
    optimizer = torch.optim.SGD(block_param_groups(model, blocks, lr=0.1), lr=0.1)
    freezer = Freezer(model, optimizer, "autofreeze", {"interval": 4}, blocks=blocks)
    weights = 4 * sum(p.numel() for p in model[:-1].parameters())  # the head left out
    for sources in ([], [freezer.strategy]):  # the strategy given too (as before the Freezer reported it): once
        ledger = MemoryLedger(model, optimizer, freezer=freezer, sources=sources)
        with ledger.step():
            backward(model, torch.Generator().manual_seed(0))
            freezer.after_backward()
            optimizer.step()
        assert ledger.last.buckets["strategy"] == weights  # allocated when the Freezer started
        ledger.close()
        optimizer.zero_grad(set_to_none=True)


def test_a_sum_of_another_shape_is_refused_when_loaded():
    model = tiny()
    blocks = discover_blocks(model)
    sums = GradientSums(len(blocks))
    sums.load_state_dict({"0.0": torch.zeros(8, 16)})  # half of block 0's weight: one rank's shard of it
    with pytest.raises(ValueError, match="save_full_checkpoint"):
        sums.prepare([False] * len(blocks), BlockParams(blocks))
    with pytest.raises(ValueError, match="'block.position'"):
        sums.load_state_dict({"0.weight": torch.zeros(16, 16)})


def accumulated_run(micro: int, scaler: torch.amp.GradScaler | None = None, overflow_at: int | None = None,
                    fused: bool = False):
    """AutoFreeze (interval 4) through the Freezer on the tiny model, ``micro`` backward passes per update with
    ``after_backward`` after each (as the README's loop), under ``scaler`` if given; ``overflow_at``: an inf gradient
    at that update (the scaler skips it). Returns the stages' grad_l1 and the reference: each update's final,
    unscaled gradients summed once, for the updates the optimizer made. ``fused``: a fused AdamW, which the scaler
    steps on an overflow too (handing it ``found_inf``)."""
    model = tiny(4)
    blocks = discover_blocks(model)
    optimizer = torch.optim.AdamW(block_param_groups(model, blocks, lr=1e-2), lr=1e-2, fused=fused or None)
    freezer = Freezer(model, optimizer, "autofreeze", {"interval": 4, "percentile": 0}, blocks=blocks)
    ref, stages, refs = PublicCode(blocks), [], []
    g = torch.Generator().manual_seed(5)
    for update in range(12):
        for _ in range(micro):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y) / micro
            (scaler.scale(loss) if scaler is not None else loss).backward()
            freezer.after_backward()
        if update == overflow_at:
            model[1][0].weight.grad[0, 0] = float("inf")
        if scaler is not None:
            scaler.unscale_(optimizer)
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):
            ref.add([False] * len(blocks))
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if freezer.step() is not None:
            stages.append(freezer.last_signals["grad_l1"][:5])
            refs.append(ref.values([False] * len(blocks))[:5])
            ref.reset()
    return stages, refs


def test_gradient_accumulation_and_a_grad_scaler_sum_each_updates_unscaled_gradients_once():
    # after_backward after each micro-batch added the running .grad each time (earlier micro-batches counted again);
    # a scaled gradient was summed 1024 times too large, and an overflow the scaler skipped put inf in the interval
    # (with a fused optimizer too, which the scaler steps on an overflow, saying so in found_inf)
    for kwargs in ({"micro": 3}, {"micro": 2, "scaler": torch.amp.GradScaler("cpu", init_scale=1024.0)},
                   {"micro": 1, "scaler": torch.amp.GradScaler("cpu", init_scale=1024.0), "overflow_at": 5},
                   {"micro": 1, "scaler": torch.amp.GradScaler("cpu", init_scale=1024.0), "overflow_at": 5,
                    "fused": True}):
        stages, refs = accumulated_run(**kwargs)
        assert len(stages) == 3
        for got, want in zip(stages, refs):
            assert got == pytest.approx(want, rel=1e-5), kwargs


@pytest.mark.cuda
def test_sums_follow_the_model_to_the_gpu_when_it_moves_after_the_freezer_was_built():
    # accelerate's prepare() (and model.to("cuda")) moves a model the Freezer was built on: the sums made on the CPU
    # met CUDA gradients at the first step; they now follow them there, and the signal is the one built on the GPU
    def run(move_after: bool):
        model = tiny(6) if move_after else tiny(6).cuda()
        blocks = discover_blocks(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        freezer = Freezer(model, optimizer, "autofreeze", {"interval": 3}, blocks=blocks)
        model.cuda()
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=g).cuda(), torch.randint(0, 4, (8,), generator=g).cuda()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            freezer.step()
        assert {t.device.type for t in freezer._grad_sums.held_tensors()} == {"cuda"}
        return freezer.last_signals["grad_l1"]

    assert run(move_after=True) == pytest.approx(run(move_after=False), rel=1e-6, nan_ok=True)


def test_close_frees_the_sums_and_removes_the_optimizer_hook():
    # a Freezer left alive after its `with` block kept a float32 copy of every trainable weight on the device
    model = tiny()
    blocks = discover_blocks(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, optimizer, "autofreeze", {"interval": 4}, blocks=blocks)
    assert freezer.ledger_bytes()["strategy"]["cpu"] == 4 * sum(p.numel() for p in model[:-1].parameters())
    # the gradient sums' post-hook and the LR factors' pre- and post-hooks (engine.steps.hook_optimizer)
    assert len(optimizer._optimizer_step_post_hooks) == 2 and len(optimizer._optimizer_step_pre_hooks) == 1
    freezer.close()
    assert freezer.ledger_bytes() == {}
    assert len(optimizer._optimizer_step_post_hooks) == len(optimizer._optimizer_step_pre_hooks) == 0

