"""The engine's guarantees, with real values: frozen weights bitwise unchanged, thawed weights train again, no
optimizer state for frozen weights, BatchNorm statistics still, no autograd graph for a frozen prefix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layerfreeze import Freezer, StrategyError, UserError, block_param_groups, discover_blocks
from layerfreeze.engine.stages import context
from layerfreeze.strategies import Decision, StageContext, Strategy

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}


def make_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
        nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.2),
        nn.Linear(16, 3),
    )


def train_steps(model, optimizer, n, freezer=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        model.train()
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if freezer is not None:
            freezer.after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if freezer is not None:
            freezer.step()


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_discovery_of_sequential_skips_parameter_free_layers():
    blocks = discover_blocks(make_net())
    assert [b.name for b in blocks] == ["0", "1", "3", "4", "6"]
    assert [b.is_head for b in blocks] == [False] * 4 + [True]


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_frozen_block_is_bitwise_unchanged_and_thaw_trains_again(opt_name):
    model = make_net()
    optimizer = OPTIMIZERS[opt_name](model.parameters())
    freezer = Freezer(model, optimizer, "none")
    train_steps(model, optimizer, 3, freezer)  # build momentum / Adam moments for every weight
    assert all(len(optimizer.state[p]) > 0 for p in model[0].parameters())

    freezer.freeze(0)
    freezer.freeze(1)  # BatchNorm block: affine weights and running statistics must stay
    frozen_before = snapshot(model[0]) | {f"bn.{k}": v for k, v in snapshot(model[1]).items()}
    head_before = snapshot(model[6])

    assert all(p.grad is None and not p.requires_grad for p in model[0].parameters())
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in in_optimizer for p in [*model[0].parameters(), *model[1].parameters()])
    assert not any(p in optimizer.state for p in [*model[0].parameters(), *model[1].parameters()])
    assert len(optimizer.param_groups) == 1

    train_steps(model, optimizer, 5, freezer, seed=2)
    frozen_after = snapshot(model[0]) | {f"bn.{k}": v for k, v in snapshot(model[1]).items()}
    for key, value in frozen_before.items():
        assert torch.equal(value, frozen_after[key]), f"frozen tensor {key} changed"
    assert frozen_after["bn.num_batches_tracked"].item() == 3
    assert not torch.equal(head_before["weight"], model[6].weight), "the head must keep training"

    freezer.thaw(0)
    freezer.thaw(1)
    assert all(p.requires_grad for p in model[0].parameters())
    train_steps(model, optimizer, 2, freezer, seed=3)
    assert not torch.equal(frozen_before["weight"], model[0].weight), "thawed weights must train again"
    assert not torch.equal(frozen_before["bn.running_mean"], model[1].running_mean)
    assert model[1].num_batches_tracked.item() == 5


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_zeroed_grads_left_in_optimizer_drift_which_is_why_we_remove_them(opt_name):
    """Control for the test above: the common fault (grad zeroed, param left in the optimizer) does move weights."""
    model = make_net()
    optimizer = OPTIMIZERS[opt_name](model.parameters())
    train_steps(model, optimizer, 3)
    before = model[0].weight.detach().clone()
    for _ in range(3):
        model(torch.randn(16, 8)).sum().backward()
        model[0].weight.grad.zero_()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    assert not torch.equal(before, model[0].weight)


def test_frozen_prefix_builds_no_graph_and_backward_stops_at_first_trainable_block():
    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, optimizer, "none")
    freezer.freeze(0)
    freezer.freeze(1)
    assert freezer.frozen_prefix == 2
    seen = {}
    model[2].register_forward_hook(lambda m, i, o: seen.setdefault("prefix_out", o))
    out = model(torch.randn(4, 8))
    assert seen["prefix_out"].grad_fn is None and not seen["prefix_out"].requires_grad
    assert out.grad_fn is not None
    out.sum().backward()
    assert model[0].weight.grad is None and model[3].weight.grad is not None


def test_bn_stays_in_eval_after_model_train_and_train_bn_keeps_it_training():
    model = make_net()
    freezer = Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "none")
    freezer.freeze(1)
    model.train()
    model(torch.randn(4, 8))
    assert not model[1].training and model[1].num_batches_tracked.item() == 0

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.2)), nn.Linear(16, 3))
    freezer = Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "none", train_bn=True)
    freezer.freeze(0)  # Linear frozen; BatchNorm keeps training (statistics and affine); Dropout goes to eval
    assert not model[0][0].weight.requires_grad
    assert model[0][1].weight.requires_grad and model[0][1].bias.requires_grad
    model.train()
    model(torch.randn(4, 8))
    assert model[0][1].training and model[0][1].num_batches_tracked.item() == 1
    assert not model[0][2].training and not model[0][0].training


def test_thaw_with_discriminative_lr_needs_one_group_per_block():
    model = make_net()
    blocks = discover_blocks(model)
    groups = block_param_groups(model, blocks, lr=1.0, lr_decay=2.6)
    assert [g["block"] for g in groups] == ["0", "1", "3", "4", "6"]
    assert [round(g["lr"], 6) for g in groups] == [round(2.6 ** -k, 6) for k in (4, 3, 2, 1, 0)]
    optimizer = torch.optim.SGD(groups, lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    freezer = Freezer(model, optimizer, "none", blocks=blocks, scheduler=scheduler)
    freezer.freeze(0)
    assert optimizer.param_groups[0]["params"] == []
    freezer.thaw(0, lr=0.25)
    assert scheduler.base_lrs[0] == 0.25
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.125 and len(optimizer.param_groups[0]["params"]) == 2

    shared = make_net()
    freezer = Freezer(shared, torch.optim.SGD(shared.parameters(), lr=1.0), "none")
    freezer.freeze(0)
    with pytest.raises(ValueError, match="block_param_groups"):
        freezer.thaw(0, lr=0.5)


class Scripted(Strategy):
    """Freezes / thaws by a fixed step table (a stand-in for a strategy fed a crafted signal)."""

    name = "scripted"

    def __init__(self, table):
        super().__init__()
        self.stage_every = 1
        self.table = table
        self.calls = 0

    def decide(self, ctx: StageContext) -> Decision:
        self.calls += 1
        freeze, thaw = self.table.get(ctx.step, ([], []))
        return Decision(freeze=list(freeze), thaw=list(thaw), reason=f"table@{ctx.step}")

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def test_freezer_applies_a_strategy_at_exact_steps_and_refuses_to_freeze_the_head():
    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, optimizer, Scripted({2: ([0, 1], []), 4: ([2], [1])}))
    train_steps(model, optimizer, 5, freezer)
    assert [(h["kind"], h["block"], h["step"]) for h in freezer.history] == [
        ("freeze", "0", 2), ("freeze", "1", 2), ("freeze", "3", 4), ("thaw", "1", 4),
    ]
    assert freezer.frozen == [True, False, True, False, False]
    freezer = Freezer(make_net(), None, Scripted({1: ([4], [])}))
    with pytest.raises(RuntimeError, match="head"):
        freezer.step()


class Attached(Scripted):
    """Scripted, counting attach/detach (what a strategy with hooks or a worker thread must have released)."""

    def __init__(self, table):
        super().__init__(table)
        self.attached = 0

    def attach(self, model, blocks):
        self.attached += 1

    def detach(self):
        self.attached -= 1


def test_a_start_stage_that_raises_releases_what_the_strategy_attached():
    strategy = Attached({0: ([4], [])})  # the start stage asks to freeze the head
    # a UserError (the CLI's one line, not a traceback), still the RuntimeError it was
    with pytest.raises(StrategyError, match=r"Strategy 'scripted' tried to freeze the head \(6\)"):
        Freezer(make_net(), None, strategy)
    assert issubclass(StrategyError, UserError) and issubclass(StrategyError, RuntimeError)
    assert strategy.calls == 1 and strategy.attached == 0


class NeedsGrads(Strategy):
    name = "needs-grads"
    signals = ("grad_l1",)

    def __init__(self):
        super().__init__()
        self.stage_every = 2
        self.seen = []

    def decide(self, ctx):
        if ctx.event == "step":
            self.seen.append(ctx.signals["grad_l1"])
        return Decision()


def test_gradient_signal_is_accumulated_and_missing_backward_is_an_error():
    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: same gradients every step
    strategy = NeedsGrads()
    freezer = Freezer(model, optimizer, strategy)
    freezer.freeze(0)
    model.eval()
    x = torch.randn(16, 8)
    for _ in range(2):
        model(x).sum().backward()
        freezer.after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        freezer.step()
    model(x).sum().backward()
    expected_head = 2 * float(sum(p.grad.abs().sum() for p in model[6].parameters()))
    assert strategy.seen[0][0] == 0.0  # frozen block: no gradient
    assert strategy.seen[0][4] == pytest.approx(expected_head, rel=1e-6)

    freezer = Freezer(make_net(), None, NeedsGrads())
    freezer.step()
    with pytest.raises(RuntimeError, match="after_backward"):
        freezer.step()


def test_stage_context_gives_a_read_only_view_of_the_optimizer_state():
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    freezer = Freezer(model, opt, strategy="none", total_steps=10)
    train_steps(model, opt, 2, freezer)
    ctx = context(freezer, "step")
    first = next(model.parameters())
    state, group = ctx.optimizer_state(first)
    assert float(state["step"]) == 2 and state["exp_avg"].shape == first.shape and group["betas"] == (0.9, 0.999)
    assert state is opt.state[first] and any(p is first for p in group["params"])
    freezer.freeze(0)
    assert context(freezer, "step").optimizer_state(first) is None  # a frozen block's parameters left the optimizer
    assert context(Freezer(make_net(), None, strategy="none"), "step").optimizer_state is None


class Timed(Strategy):
    name = "timed"

    def __init__(self):
        super().__init__()
        self.stage_every = 3
        self.at_epoch_end = False
        self.seen = []

    def decide(self, ctx):
        self.seen.append((ctx.event, ctx.step, ctx.step_seconds, ctx.stage_step_seconds))
        return Decision()


def test_stages_see_the_median_step_times_with_and_without_a_stage(monkeypatch):
    """Issue 40 item 2: the intervals between step() calls (host clock), split by whether the step staged, last 16
    of each; an epoch's end (evaluation, checkpoints) starts the measurement again."""
    import layerfreeze.engine.timing as timing

    clock = [100.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    strategy = Timed()
    freezer = Freezer(make_net(), None, strategy)
    assert strategy.seen == [("start", 0, None, None)]  # nothing measured before the first step
    for k in range(1, 7):
        clock[0] += 1.0 if k % 3 == 0 else 0.01 * k  # a stage step takes 1 s here, the others 0.01 * k
        freezer.step()
    # step 1 has no previous mark; at stage 3 only step 2 was measured, at stage 6 steps 2, 4, 5 and stage 3
    assert strategy.seen[1] == ("step", 3, pytest.approx(0.02), None)
    assert strategy.seen[2] == ("step", 6, pytest.approx(0.04), pytest.approx(1.0))
    freezer.epoch_end()
    clock[0] += 50.0  # the evaluation between epochs: not a step
    freezer.step()  # step 7: the first mark after the restart, no interval
    for k in (8, 9):
        clock[0] += 1.0 if k % 3 == 0 else 0.01 * k
        freezer.step()
    assert strategy.seen[3] == ("step", 9, pytest.approx(0.045), pytest.approx(1.0))  # median of .02 .04 .05 .08
    assert list(freezer._step_times.step) == pytest.approx([0.02, 0.04, 0.05, 0.08])
    for _ in range(10, 40):
        clock[0] += 0.5
        freezer.step()
    assert len(freezer._step_times.step) == 16 and len(freezer._step_times.stage) == 13  # the last 16 at most
    assert freezer._step_times.medians() == (pytest.approx(0.5), pytest.approx(0.5))


def test_a_block_out_of_range_or_of_the_wrong_type_is_one_clear_error_listing_the_blocks():
    # freeze(99) on a 3-block model was a bare "list index out of range"; freeze(-1) froze the head in silence.
    # On an nn.Sequential the names are the child indices ("0", "2", "4"), not the positions: the message shows both
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Freezer(model, optimizer, "none") as freezer:
        for index in (99, 3, -1):
            with pytest.raises(IndexError, match=rf"block index {index} is out of range: the model has 3 blocks, "
                                                 r"0 to 2 \(index=name: 0=0, 1=2, 2=4\)"):
                freezer.freeze(index)
        with pytest.raises(KeyError, match=r"No block named '9'; blocks \(index=name\): 0=0, 1=2, 2=4"):
            freezer.thaw("9")
        with pytest.raises(TypeError, match="index \\(int\\) or its name \\(str\\), not float"):
            freezer.freeze(1.0)
        assert freezer.frozen == [False, False, False]
        import numpy as np

        assert freezer.freeze(np.int64(1)) and freezer.freeze("0") and freezer.frozen == [True, True, False]
        with pytest.warns(UserWarning, match=r"freezing block '4' left every block frozen: nothing trains"):
            assert freezer.freeze(2)  # the head too: the next loss.backward() would raise far from its cause
        assert freezer.thaw(2) and freezer.frozen == [True, True, False]


def test_a_freezer_given_no_model_or_another_models_optimizer_says_so():
    # Freezer(model, optimizer_of_another_model) was accepted in silence: freezing removed nothing from it and the
    # model never trained; Freezer("model") was "'str' object has no attribute 'modules'"
    model, other = make_net(), make_net()
    with pytest.raises(ValueError, match=r"the optimizer holds 10 parameter tensors and none is this model's"):
        Freezer(model, torch.optim.SGD(other.parameters(), lr=0.1), "static", {"k": 1})
    with pytest.raises(TypeError, match="Freezer needs the model \\(a torch.nn.Module\\) first, not a str"):
        Freezer("model", None)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer \\(or None\\), not a list"):
        Freezer(model, list(model.parameters()))
    # an optimizer that also holds a tensor outside the model (a learnable loss weight) is the user's choice
    extra = nn.Parameter(torch.zeros(()))
    with Freezer(model, torch.optim.SGD([*model.parameters(), extra], lr=0.1), "none") as freezer:
        assert freezer.freeze(0)


def test_a_second_open_freezer_on_one_model_is_refused_until_the_first_is_closed():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    first = Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "static", {"k": 1})
    with pytest.raises(RuntimeError, match=r"this Sequential already has an open Freezer \(strategy 'static', on "
                                           r"its Sequential\).* Close the first \(freezer.close\(\)"):
        Freezer(model, None, "lisa", {"k": 2})
    assert model[1].weight.requires_grad  # refused before anything was frozen
    first.close()
    with Freezer(model, None, "static", {"k": 1}):  # the first is closed
        pass
    Freezer(model, None, "static", {"k": 1})  # so is the second, at the end of its with block
    Freezer(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), None, "static", {"k": 1})  # another model: its own



def test_a_freezer_over_the_same_parameters_is_refused_and_a_lost_one_can_be_found_and_closed():
    # a Freezer on a parent, a child or a torch.compile wrapper of a model with an open one ran two strategies over
    # the same blocks; and one dropped without close() stays at work through its hooks, with no handle left
    import layerfreeze

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))

        def forward(self, x):
            return self.net(x)

    wrapper = Wrapper()
    Freezer(wrapper.net, None, "static", {"k": 1})  # dropped without close()
    for other in (wrapper, torch.compile(wrapper.net, backend="eager")):
        with pytest.raises(RuntimeError, match=r"already has an open Freezer \(strategy 'static', on its Sequential\)"
                                               r".* layerfreeze.open_freezer\(model\).close\(\)"):
            Freezer(other, None, "lisa", {"k": 2})
    lost = layerfreeze.open_freezer(wrapper)
    assert lost is not None and lost.model is wrapper.net and lost.frozen_blocks == ["0"]
    lost.close()
    assert layerfreeze.open_freezer(wrapper) is None
    with Freezer(wrapper, None, "static", {"k": 1}) as freezer:
        assert freezer.frozen_blocks == ["net.0"]
