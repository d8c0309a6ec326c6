"""FreezeOut (schedule + per-block LR factors) and AutoFreeze (gradient-norm test), driven through the real Freezer
or fed crafted StageContexts, checked against hand computations."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from layerfreeze import Freezer, block_param_groups
from layerfreeze.models.discovery import discover_blocks
from layerfreeze.strategies.autofreeze import AutoFreeze, percentile_linear
from layerfreeze.strategies.base import BlockView, StageContext
from layerfreeze.strategies.freezeout import FreezeOut


def linear_stack(n_blocks: int = 5, width: int = 3, seed: int = 0) -> nn.Sequential:
    """``n_blocks`` Linear layers (blocks "0", "2", ... ; the last is the head) with ReLUs between them."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(n_blocks):
        layers.append(nn.Linear(width, width))
        if i < n_blocks - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def make_run(strategy, n_blocks: int = 5, total_steps: int | None = 100, seed: int = 0):
    model = linear_stack(n_blocks, seed=seed)
    blocks = discover_blocks(model)
    optimizer = torch.optim.SGD(block_param_groups(model, blocks, lr=1.0), lr=1.0)
    freezer = Freezer(model, optimizer, strategy, blocks=blocks, total_steps=total_steps)
    return model, optimizer, freezer


def block_lrs(freezer: Freezer, optimizer) -> list[float]:
    """The LR of each block's param group (the groups from block_param_groups carry the block name)."""
    by_name = {g["block"]: g["lr"] for g in optimizer.param_groups}
    return [by_name[b.name] for b in freezer.blocks]


def real_step(model, optimizer, freezer, g: torch.Generator, after_backward: bool = True):
    x, y = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    if after_backward:
        freezer.after_backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return freezer.step()


def freeze_steps(freezer: Freezer) -> dict[int, int]:
    return {r["index"]: r["step"] for r in freezer.history if r["kind"] == "freeze"}


# ------------------------------------------------------------------------------------------------------------------
# FreezeOut
# ------------------------------------------------------------------------------------------------------------------

# Hand computation, L = 5 blocks, t0 = 0.8, cubic: t_i = (0.8 + 0.2 * i / 4) ** 3
T_I = [0.8**3, 0.85**3, 0.9**3, 0.95**3, 1.0]  # 0.512, 0.614125, 0.729, 0.857375, 1
# freeze step = first step s with s / 100 >= t_i: 51.2 -> 52, 61.4125 -> 62, 72.9 -> 73, 85.7375 -> 86; head never
FREEZE_STEP = {0: 52, 1: 62, 2: 73, 3: 86}


def test_freezeout_t_i_and_freeze_steps_match_hand_computation():
    assert FreezeOut().t_i(5) == pytest.approx([0.512, 0.614125, 0.729, 0.857375, 1.0])
    assert {i: math.ceil(t * 100) for i, t in enumerate(T_I[:-1])} == FREEZE_STEP
    model, optimizer, freezer = make_run(FreezeOut(), total_steps=100)
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        real_step(model, optimizer, freezer, g)
    assert freeze_steps(freezer) == FREEZE_STEP
    assert freezer.frozen == [True, True, True, True, False]  # the head is never frozen
    for i in range(4):  # a frozen block's parameters have left the optimizer
        group = next(gr for gr in optimizer.param_groups if gr["block"] == freezer.blocks[i].name)
        assert group["params"] == []


def test_freezeout_lr_factors_applied_to_param_groups():
    model, optimizer, freezer = make_run(FreezeOut(), total_steps=100)
    # start stage: t = 0, factor_i = 1 / t_i (scale_lr), recorded in the signals
    assert freezer.last_signals["t_i"] == pytest.approx(T_I)
    assert freezer.last_signals["factors"] == pytest.approx([1 / t for t in T_I])
    g = torch.Generator().manual_seed(0)
    seen = {}
    for _ in range(99):
        real_step(model, optimizer, freezer, g)
        seen[freezer.step_count] = block_lrs(freezer, optimizer)
    # after step 30 (t = 0.3), no scheduler, base lr 1.0: lr_i = 0.5 * (1 + cos(pi * 0.3 / t_i)) / t_i
    expected_30 = [0.5 * (1 + math.cos(math.pi * 0.3 / t)) / t for t in T_I]
    assert seen[30] == pytest.approx(expected_30, rel=1e-12)
    assert expected_30[0] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.3 / 0.512)) / 0.512)
    # not compounded across steps: step 31 is again base lr * its own factor
    assert seen[31] == pytest.approx([0.5 * (1 + math.cos(math.pi * 0.31 / t)) / t for t in T_I], rel=1e-12)
    # step 51: block 0 is at t = 0.51 < 0.512, a tiny but positive factor; step 52 freezes it
    assert seen[51][0] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.51 / 0.512)) / 0.512, rel=1e-9)
    assert 0 < seen[51][0] < 1e-3
    # the head anneals over the whole run: after step 99, 0.5 * (1 + cos(0.99 pi))
    assert seen[99][4] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.99)), rel=1e-9)
    assert freezer.last_signals["progress"] == pytest.approx(0.99)


def test_freezeout_variants_on_crafted_contexts():
    def ctx(step, frozen=(False,) * 5):
        blocks = [BlockView(str(i), i, frozen[i], i == 4, 10) for i in range(5)]
        return StageContext(step=step, epoch=0, event="step", blocks=blocks, total_steps=100)

    lin = FreezeOut(t0=0.5, scaling="linear", scale_lr=False)
    assert lin.t_i(5) == pytest.approx([0.5, 0.625, 0.75, 0.875, 1.0])
    d = lin.decide(ctx(50))
    assert d.freeze == [0] and d.lr_scale[0] == 0.0  # its cosine has reached zero
    assert d.lr_scale[1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5 / 0.625)))  # unscaled
    sq = FreezeOut(t0=0.5, scaling="squared")
    assert sq.t_i(5) == pytest.approx([0.25, 0.390625, 0.5625, 0.765625, 1.0])
    d = sq.decide(ctx(40, frozen=(True, False, False, False, False)))
    assert d.freeze == [1] and 0 not in d.lr_scale  # already-frozen blocks are left alone
    assert d.lr_scale[2] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.4 / 0.5625)) / 0.5625)
    # t0 = 1: every block anneals with the head over the whole run; they reach t_i = 1 only at the very end
    d = FreezeOut(t0=1.0).decide(ctx(99))
    assert d.freeze == [] and all(v == pytest.approx(0.5 * (1 + math.cos(0.99 * math.pi))) for v in d.lr_scale.values())
    d = FreezeOut(t0=1.0).decide(ctx(100))
    assert d.freeze == [0, 1, 2, 3] and d.lr_scale[4] == 0.0
    assert FreezeOut().t_i(1) == [1.0]


def test_freezeout_needs_total_steps():
    with pytest.raises(RuntimeError, match="total_steps"):
        make_run(FreezeOut(), total_steps=None)


@pytest.mark.parametrize("kwargs,param", [
    ({"t0": 0.0}, "t0"), ({"t0": -0.1}, "t0"), ({"t0": 1.5}, "t0"), ({"t0": float("nan")}, "t0"),
    ({"t0": True}, "t0"), ({"t0": "0.8"}, "t0"), ({"scaling": "cube"}, "scaling"), ({"scale_lr": "yes"}, "scale_lr"),
])
def test_freezeout_bad_parameters(kwargs, param):
    with pytest.raises(ValueError, match=param):
        FreezeOut(**kwargs)


def test_freezeout_resume_gives_same_later_decisions_and_lrs():
    def run(resume_at: int | None):
        model, optimizer, freezer = make_run(FreezeOut(), total_steps=100)
        g = torch.Generator().manual_seed(0)
        lrs = {}
        for _ in range(100):
            if resume_at is not None and freezer.step_count == resume_at:
                state = copy.deepcopy((freezer.state_dict(), model.state_dict(), optimizer.state_dict()))
                model, optimizer, freezer = make_run(FreezeOut(), total_steps=100, seed=1)
                model.load_state_dict(state[1])
                freezer.load_state_dict(state[0])
                optimizer.load_state_dict(state[2])
            real_step(model, optimizer, freezer, g)
            lrs[freezer.step_count] = block_lrs(freezer, optimizer)
        return freeze_steps(freezer), lrs, [p.detach().clone() for p in model.parameters()]

    steps_a, lrs_a, params_a = run(None)
    steps_b, lrs_b, params_b = run(40)
    assert steps_a == steps_b == FREEZE_STEP
    assert lrs_a == lrs_b
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    with pytest.raises(ValueError, match="t0"):
        FreezeOut(t0=0.7).load_state_dict(FreezeOut().state_dict())


# ------------------------------------------------------------------------------------------------------------------
# AutoFreeze
# ------------------------------------------------------------------------------------------------------------------


def af_ctx(step: int, grad: list[float], frozen: list[bool] | None = None) -> StageContext:
    n = len(grad)
    frozen = frozen or [False] * n
    blocks = [BlockView(str(i), i, frozen[i], i == n - 1, 10) for i in range(n)]
    return StageContext(step=step, epoch=0, event="step", blocks=blocks, signals={"grad_l1": list(grad)})


# A crafted series for 6 blocks (5 candidates + head, whose value is ignored), one list per stage.
SERIES = [
    [10.0, 10.0, 10.0, 10.0, 10.0, 99.0],  # stage 1: stored as prev, no decision
    [9.0, 5.0, 9.5, 2.0, 8.0, 1.0],  # ratios .1 .5 .05 .8 .2 -> median .2 -> first >= .2 is block 1 -> freeze [0]
    [0.0, 4.5, 9.5, 1.0, 8.0, 1.0],  # ratios (1..4) .1 0 .5 0 -> sorted 0 0 .1 .5 -> h=1.5 -> .05 -> first: 1 -> none
    [0.0, 4.5, 9.0, 1.0, 4.0, 1.0],  # ratios 0 .5/9.5 0 .5 -> sorted 0 0 .0526 .5 -> .0263 -> first: 2 -> freeze [1]
]


def test_autofreeze_ratios_and_percentile_decisions_on_crafted_series():
    s = AutoFreeze(interval=50)
    frozen = [False] * 6
    d1 = s.decide(af_ctx(50, SERIES[0], frozen))
    assert d1.freeze == [] and "ratios" not in d1.signals

    d2 = s.decide(af_ctx(100, SERIES[1], frozen))
    assert d2.signals["ratios"][:5] == pytest.approx([0.1, 0.5, 0.05, 0.8, 0.2])
    assert math.isnan(d2.signals["ratios"][5])  # the head has no ratio
    assert d2.signals["threshold"] == pytest.approx(0.2)
    assert d2.signals["threshold"] == pytest.approx(np.percentile([0.1, 0.5, 0.05, 0.8, 0.2], 50))
    assert d2.signals["first_unstable"] == 1 and d2.freeze == [0]
    frozen[0] = True

    d3 = s.decide(af_ctx(150, SERIES[2], frozen))
    assert d3.signals["ratios"][1:5] == pytest.approx([0.1, 0.0, 0.5, 0.0])
    assert d3.signals["threshold"] == pytest.approx(0.05)  # linear interpolation between 0 and 0.1
    assert d3.freeze == []

    d4 = s.decide(af_ctx(200, SERIES[3], frozen))
    r2 = 0.5 / 9.5
    assert d4.signals["ratios"][1:5] == pytest.approx([0.0, r2, 0.0, 0.5])
    assert d4.signals["threshold"] == pytest.approx(r2 / 2)
    assert d4.signals["threshold"] == pytest.approx(np.percentile([0.0, r2, 0.0, 0.5], 50))
    assert d4.freeze == [1] and d4.signals["candidates"] == 4


def test_autofreeze_scores_only_the_stacks_layers_and_freezes_the_embeddings_with_a_layer():
    # the public code scores only the encoder layers: the embeddings and BERT's pooler were scored too, so the
    # embeddings froze alone (BENCHMARKS' bert.embeddings@26) and the pooler could be what alone still trained
    def ctx(step, grad, frozen=None):
        frozen = frozen or [False] * 7
        blocks = [BlockView(str(i), i, frozen[i], i == 6, 10, is_layer=1 <= i <= 4) for i in range(7)]
        return StageContext(step=step, epoch=0, event="step", blocks=blocks, signals={"grad_l1": list(grad)})

    # the helper's measured ratios: embeddings 3.23, layers 6.66 6.34 6.63 6.67, pooler 2.81
    prev = [1.0] * 6 + [1.0]
    cur = [4.23, 7.66, 7.34, 7.63, 7.67, 3.81, 1.0]
    s = AutoFreeze()
    s.decide(ctx(50, prev))
    d = s.decide(ctx(100, cur))
    assert d.signals["threshold"] == pytest.approx(np.percentile([6.66, 6.34, 6.63, 6.67], 50))
    assert math.isnan(d.signals["ratios"][0]) and math.isnan(d.signals["ratios"][5])
    assert d.signals["first_unstable"] == 1 and d.freeze == []  # was [0]: the embeddings alone
    # the embeddings above the layers' median: they no longer hold the layers back; they freeze with layers 1, 2
    s = AutoFreeze()
    s.decide(ctx(50, prev))
    d = s.decide(ctx(100, [9.0, 1.1, 1.2, 5.0, 6.0, 1.0, 1.0]))  # layer ratios .1 .2 4 5 -> median 2.1
    assert d.signals["first_unstable"] == 3 and d.freeze == [0, 1, 2]
    # the last layer unstable, everything else stable: the pooler (block 5) never freezes
    s = AutoFreeze(percentile=100)
    s.decide(ctx(50, prev))
    d = s.decide(ctx(100, [1.0, 1.0, 1.0, 1.0, 9.0, 1.0, 1.0]))
    assert d.freeze == [0, 1, 2, 3]


def test_autofreeze_freezes_several_blocks_at_once_and_percentile_parameter():
    prev, cur = [1.0, 1.0, 1.0, 1.0, 5.0], [0.99, 0.98, 0.1, 0.2, 5.0]  # ratios .01 .02 .9 .8
    s = AutoFreeze()
    s.decide(af_ctx(50, prev))
    d = s.decide(af_ctx(100, cur))
    assert d.signals["threshold"] == pytest.approx((0.02 + 0.8) / 2)  # median of .01 .02 .8 .9
    assert d.freeze == [0, 1]
    # percentile 100: threshold = the largest ratio (block 2, 0.9) -> freeze [0, 1]; percentile 0: never freezes
    for q, expected in ((100, [0, 1]), (0, []), (25, [0])):
        s = AutoFreeze(percentile=q)
        s.decide(af_ctx(50, prev))
        d = s.decide(af_ctx(100, cur))
        assert d.signals["threshold"] == pytest.approx(np.percentile([0.01, 0.02, 0.9, 0.8], q))
        assert d.freeze == expected


def test_autofreeze_zero_previous_value_is_inf_and_percentile_handles_inf():
    s = AutoFreeze()
    s.decide(af_ctx(50, [0.0, 5.0, 5.0, 5.0, 1.0]))
    d = s.decide(af_ctx(100, [1.0, 4.0, 5.0, 5.0, 1.0]))
    assert d.signals["ratios"][:4] == [math.inf, pytest.approx(0.2), 0.0, 0.0]
    assert d.signals["threshold"] == pytest.approx(0.1)
    assert d.signals["first_unstable"] == 0 and d.freeze == []  # an inf ratio blocks freezing at and after it
    assert percentile_linear([math.inf, math.inf, 1.0], 50) == math.inf  # numpy would give NaN here
    assert percentile_linear([0.0, 0.2, math.inf], 100) == math.inf
    assert percentile_linear([3.0], 50) == 3.0


def test_autofreeze_only_the_run_after_the_frozen_prefix_is_candidate():
    # block 2 was frozen by hand: candidates are blocks 0 and 1; the first unstable block is 3, so both freeze
    frozen = [False, False, True, False, False]
    s = AutoFreeze()
    s.decide(af_ctx(50, [1.0, 1.0, 0.0, 1.0, 1.0], frozen))
    d = s.decide(af_ctx(100, [1.0, 0.99, 0.0, 0.5, 1.0], frozen))  # ratios 0 .01 - .5 -> median .01 -> first: 1
    assert d.freeze == [0] and d.signals["candidates"] == 2
    s = AutoFreeze(percentile=100)
    s.decide(af_ctx(50, [1.0, 1.0, 0.0, 1.0, 1.0], frozen))
    d = s.decide(af_ctx(100, [1.0, 0.99, 0.0, 0.5, 1.0], frozen))  # threshold .5 -> first: 3 -> the whole run
    assert d.freeze == [0, 1]


def test_autofreeze_non_finite_signal_skips_the_stage():
    s = AutoFreeze()
    s.decide(af_ctx(50, [1.0, 1.0, 1.0, 1.0]))
    d = s.decide(af_ctx(100, [0.1, float("nan"), 1.0, 1.0]))
    assert d.freeze == [] and d.signals["skipped_non_finite"] == 1
    assert s.prev[:3] == [1.0, 1.0, 1.0]  # kept


def set_grads(model: nn.Module, freezer: Freezer, values: list[float]) -> None:
    """Give every parameter of each active block a constant gradient ``values[i]``."""
    for block, v in zip(freezer.blocks, values):
        for p in block.parameters():
            if p.requires_grad:
                p.grad = torch.full_like(p, v)


# per-step gradient value of each block at each stage (interval 2): block L1 = 2 * v * 12 parameters, so the
# ratios are those of v: stage 2: .1 .5 .05 .8 -> median .3 -> first: 1 -> freeze 0 at step 4;
# stage 3: (1..3) .1 0 .5 -> median .1 -> first: 1 -> none; stage 4: 0 .0526 .5 -> median .0526 -> first: 2 ->
# freeze 1 at step 8
GRAD_SERIES = [
    [1.0, 1.0, 1.0, 1.0, 1.0],
    [0.9, 0.5, 0.95, 0.2, 1.0],
    [0.9, 0.45, 0.95, 0.1, 1.0],
    [0.9, 0.45, 0.9, 0.05, 1.0],
]


def drive_autofreeze(freezer, model, optimizer, stages):
    for values in stages:
        for _ in range(freezer.strategy.stage_every):
            set_grads(model, freezer, values)
            freezer.after_backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            freezer.step()


def test_autofreeze_through_the_freezer_with_crafted_gradients():
    model, optimizer, freezer = make_run(AutoFreeze(interval=2), total_steps=None)
    drive_autofreeze(freezer, model, optimizer, GRAD_SERIES[:2])
    assert freezer.last_signals["grad_l1"][:4] == pytest.approx([2 * v * 12 for v in GRAD_SERIES[1][:4]])
    assert freezer.last_signals["threshold"] == pytest.approx(0.3)
    drive_autofreeze(freezer, model, optimizer, GRAD_SERIES[2:])
    assert freeze_steps(freezer) == {0: 4, 1: 8}
    assert freezer.frozen == [True, True, False, False, False]


def test_autofreeze_keeps_gradient_sums_only_for_the_stacks_layers_of_a_bert():
    from transformers import BertConfig, BertForSequenceClassification

    from layerfreeze.models.blocks import stack_layers

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=3,
                                                     num_attention_heads=2, intermediate_size=32))
    blocks = discover_blocks(model)
    assert stack_layers(blocks) == [False, True, True, True, False, False]  # embeddings, 3 layers, pooler, head
    # an encoder-decoder: both stacks and what lies between them (the decoder could never freeze with the encoder
    # alone as the stack); torchvision's Swin, stages alternating with patch merging: every non-head block
    import torchvision
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=3,
                                             num_decoder_layers=3, num_heads=2))
    assert [b.name for b, layer in zip(discover_blocks(t5), stack_layers(discover_blocks(t5))) if not layer] == [
        "encoder.embeddings", "head"]
    swin = discover_blocks(torchvision.models.swin_t(num_classes=3))
    assert stack_layers(swin) == [not b.is_head for b in swin]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Freezer(model, optimizer, "autofreeze", total_steps=20) as freezer:
        ids = torch.randint(0, 64, (4, 8))
        model(input_ids=ids, labels=torch.tensor([0, 1, 0, 1])).loss.backward()
        optimizer.step()
        held = {i for i in range(6) if freezer._grad_sums.of_block(i)}
        assert held == {1, 2, 3}  # no float32 copy of the embeddings' gradients (the largest block), the pooler's
        assert sum(t.numel() for i in held for t in freezer._grad_sums.of_block(i)) == sum(
            p.numel() for b in blocks[1:4] for p in b.parameters())


@pytest.mark.parametrize("total_steps,num_intervals,every", [(20, 10, 2), (25, 10, 2), (8, 4, 2), (5, 10, 1),
                                                               (1000, 10, 100)])
def test_autofreeze_evaluates_num_intervals_times_a_run_as_its_public_code(total_steps, num_intervals, every):
    # the public code: grad_eval_step = int(total_steps / num_intervals), num_intervals = 10 by default
    model, optimizer, freezer = make_run(AutoFreeze(num_intervals=num_intervals), total_steps=total_steps)
    assert freezer.strategy.stage_every == every
    if every == 2:  # the crafted series at interval 2 freezes block 0 after stage 2 and block 1 after stage 4
        drive_autofreeze(freezer, model, optimizer, GRAD_SERIES)
        assert freeze_steps(freezer) == {0: 4, 1: 8}


@pytest.mark.parametrize("n_blocks, pinned", [(2, [0]), (3, [0, 1]), (1, [])])
def test_autofreeze_with_only_the_head_trainable_trains_on(n_blocks, pinned):
    # a memory budget's floor over every block but the head left no gradient to sum: torch._foreach_add_ raised
    # "Tensor list must have at least one tensor" at the first update
    model, optimizer, freezer = make_run(AutoFreeze(interval=2), n_blocks=n_blocks, total_steps=10)
    freezer.pin(pinned)
    head = [p.detach().clone() for p in freezer.blocks[-1].parameters()]
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        real_step(model, optimizer, freezer, g)
    assert freezer.frozen == [True] * (n_blocks - 1) + [False] and freeze_steps(freezer) == dict.fromkeys(pinned, 0)
    assert any(not torch.equal(a, b) for a, b in zip(head, freezer.blocks[-1].parameters()))


def test_autofreeze_without_the_run_length_evaluates_every_50_steps_and_says_so():
    model, optimizer, freezer = make_run(AutoFreeze(), total_steps=None)
    assert freezer.strategy.stage_every == 50
    with pytest.warns(UserWarning, match="run length is unknown.*every 50 steps.*total_steps.*max_steps"):
        for _ in range(50):  # said at the first evaluation, once
            real_step(model, optimizer, freezer, torch.Generator().manual_seed(0))
    assert freezer.last_signals["interval"] == 50
    _, _, freezer = make_run(AutoFreeze(interval=7), total_steps=None)  # an explicit interval: no warning
    assert freezer.strategy.stage_every == 7


def test_autofreeze_resumes_at_the_interval_its_run_used():
    model, optimizer, freezer = make_run(AutoFreeze(), total_steps=20)
    drive_autofreeze(freezer, model, optimizer, GRAD_SERIES[:2])
    saved = copy.deepcopy((freezer.state_dict(), model.state_dict(), optimizer.state_dict()))
    model, optimizer, freezer = make_run(AutoFreeze(), total_steps=60, seed=1)  # a longer run: 6 steps apart
    assert freezer.strategy.stage_every == 6
    freezer.load_state_dict(saved[0])
    model.load_state_dict(saved[1])
    optimizer.load_state_dict(saved[2])
    assert freezer.strategy.stage_every == 2  # the run goes on as it started
    drive_autofreeze(freezer, model, optimizer, GRAD_SERIES[2:])
    assert freeze_steps(freezer) == {0: 4, 1: 8}
    # a checkpoint written before num_intervals existed recorded the fixed interval it ran at (50 then); the run goes
    # on at it, and its next checkpoint resumes again without -p interval=50
    old = AutoFreeze()
    old.load_state_dict({"interval": 50, "percentile": 50.0, "prev": None, "evaluations": 3})
    assert (old.interval, old.stage_every, old.evaluations) == (None, 50, 3)
    again = AutoFreeze()
    again.load_state_dict(old.state_dict())
    assert (again.interval, again.stage_every, again.evaluations) == (None, 50, 3)
    with pytest.raises(ValueError, match="num_intervals"):
        AutoFreeze(num_intervals=5).load_state_dict(AutoFreeze().state_dict())
    with pytest.raises(ValueError, match="interval"):  # an older checkpoint's interval against an explicit other one
        AutoFreeze(interval=7).load_state_dict({"interval": 50, "percentile": 50.0, "prev": None, "evaluations": 3})


def test_autofreeze_says_when_a_resume_keeps_a_cadence_this_runs_length_would_not_give():
    model, optimizer, freezer = make_run(AutoFreeze(), total_steps=20)  # every 2 steps
    drive_autofreeze(freezer, model, optimizer, GRAD_SERIES[:1])
    state = copy.deepcopy(freezer.state_dict())
    _, _, longer = make_run(AutoFreeze(), total_steps=60)
    with pytest.warns(UserWarning, match="goes on evaluating every 2 steps, as it started; this run's length would "
                                         "give every 6"):
        longer.load_state_dict(state)
    assert longer.strategy.stage_every == 2
    with warnings.catch_warnings():  # without a run length: the checkpoint's cadence, and no warning about 50
        warnings.simplefilter("error")
        model, optimizer, unknown = make_run(AutoFreeze(), total_steps=None)
        unknown.load_state_dict(state)
        drive_autofreeze(unknown, model, optimizer, GRAD_SERIES[1:2])
    assert unknown.strategy.stage_every == 2 and unknown.last_signals["interval"] == 2


def test_autofreeze_reads_the_gradients_at_the_optimizers_step_and_without_an_optimizer_needs_after_backward():
    signals = []
    for after_backward in (True, False):  # the Freezer's optimizer pre-hook reads them: after_backward adds nothing
        model, optimizer, freezer = make_run(AutoFreeze(interval=2), total_steps=None)
        g = torch.Generator().manual_seed(0)
        for _ in range(4):
            real_step(model, optimizer, freezer, g, after_backward=after_backward)
        signals.append(freezer.last_signals["grad_l1"])
    assert [repr(v) for v in signals[0]] == [repr(v) for v in signals[1]] and any(v > 0 for v in signals[0][:4])
    model = linear_stack(5)
    freezer = Freezer(model, None, AutoFreeze(interval=2), blocks=discover_blocks(model))
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        nn.functional.mse_loss(model(torch.randn(4, 3, generator=g)), torch.randn(4, 3, generator=g)).backward()
        model.zero_grad(set_to_none=True)
        if freezer.step_count == 1:
            with pytest.raises(RuntimeError, match="after_backward.* no optimizer"):
                freezer.step()
        else:
            freezer.step()


@pytest.mark.parametrize("kwargs,param", [
    ({"interval": 0}, "interval"), ({"interval": 2.5}, "interval"), ({"interval": True}, "interval"),
    ({"num_intervals": 0}, "num_intervals"), ({"num_intervals": 1.5}, "num_intervals"),
    ({"interval": 5, "num_intervals": 3}, "not both"),
    ({"percentile": -1}, "percentile"), ({"percentile": 100.5}, "percentile"),
    ({"percentile": float("nan")}, "percentile"), ({"percentile": "50"}, "percentile"),
])
def test_autofreeze_bad_parameters(kwargs, param):
    with pytest.raises(ValueError, match=param):
        AutoFreeze(**kwargs)


def test_autofreeze_state_dict_round_trip():
    a = AutoFreeze()
    frozen = [False] * 6
    for k, grad in enumerate(SERIES[:2]):
        for i in a.decide(af_ctx(50 * (k + 1), grad, frozen)).freeze:
            frozen[i] = True
    state = copy.deepcopy(a.state_dict())
    later_a = [a.decide(af_ctx(50 * (k + 3), grad, frozen)) for k, grad in enumerate(SERIES[2:])]
    b = AutoFreeze()
    b.load_state_dict(state)
    later_b = [b.decide(af_ctx(50 * (k + 3), grad, frozen)) for k, grad in enumerate(SERIES[2:])]
    assert [d.freeze for d in later_a] == [d.freeze for d in later_b] == [[], [1]]
    assert [d.signals["ratios"][:5] for d in later_a] == [d.signals["ratios"][:5] for d in later_b]
    with pytest.raises(ValueError, match="percentile"):
        AutoFreeze(percentile=40).load_state_dict(state)

    # through the Freezer: stop after stage 2 (step 4), resume on a fresh model / optimizer / freezer
    model, optimizer, freezer = make_run(AutoFreeze(interval=2), total_steps=None)
    drive_autofreeze(freezer, model, optimizer, GRAD_SERIES[:2])
    saved = copy.deepcopy((freezer.state_dict(), model.state_dict(), optimizer.state_dict()))
    model, optimizer, freezer = make_run(AutoFreeze(interval=2), total_steps=None, seed=1)
    model.load_state_dict(saved[1])
    freezer.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[2])
    drive_autofreeze(freezer, model, optimizer, GRAD_SERIES[2:])
    assert freeze_steps(freezer) == {0: 4, 1: 8}


def test_a_hand_thaw_of_a_block_freezeout_froze_warns_that_it_trains_at_lr_0():
    # freezer.thaw(i) of a block past its t_i trained it at learning rate 0 (its factor stays 0, also under thaw's
    # lr=) until freezeout froze it again, with nothing said
    model, optimizer, freezer = make_run(FreezeOut(), total_steps=100)
    g = torch.Generator().manual_seed(0)
    while not freezer.frozen[0]:
        real_step(model, optimizer, freezer, g)
    weights = [p.detach().clone() for p in freezer.blocks[0].parameters()]
    for lr in (None, 0.5):
        said = r"learning rate 0, whatever lr= says, until" if lr else r"learning rate 0 until the strategy"
        with pytest.warns(UserWarning, match=r"^Freezer.thaw: block 0 thaws with the learning-rate factor 0 that "
                                             rf"strategy 'freezeout' gives it .* {said}"):
            freezer.thaw(0, lr=lr)
        real_step(model, optimizer, freezer, g)
        assert all(torch.equal(a, b) for a, b in zip(weights, freezer.blocks[0].parameters()))  # what it says
        assert freezer.frozen[0]  # frozen again at the next stage
