"""The Freezer over what the user set up before it: their LR schedule, their frozen layers, their optimizer, their
own strategy. Each test is a defect a library user found (a newcomer's API pass, 2026-12-06) and fails before."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from layerfreeze import Freezer, block_param_groups, discover_blocks, release_earlier_freezers
from layerfreeze.strategies import Decision, Strategy


def net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def train(model: nn.Module, optimizer, freezer: Freezer, steps: int, scheduler=None, after=None) -> None:
    g = torch.Generator().manual_seed(1)
    for t in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        freezer.after_backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        freezer.step()
        if after is not None:
            after(t)


@pytest.mark.parametrize("lr_decay", [1.0, 2.0])
def test_a_thaw_during_warmup_keeps_the_schedules_factor(lr_decay):
    # gradual set a thawed group's lr to its base (0.1): the step after the thaw ran at 5x the warmup's LR
    model = net()
    optimizer = torch.optim.SGD(block_param_groups(model, discover_blocks(model), lr=0.1, lr_decay=lr_decay))
    warmup = lambda t: min(1.0, t / 10)  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    seen = []

    def check(t):
        factor = warmup(scheduler.last_epoch)
        for gi, group in enumerate(optimizer.param_groups):
            assert group["lr"] == pytest.approx(scheduler.base_lrs[gi] * factor), (t, gi)
            assert group["initial_lr"] == pytest.approx(scheduler.base_lrs[gi])
        seen.append(list(freezer.frozen))

    with Freezer(model, optimizer, "gradual", {"every_steps": 2, "lr_decay": lr_decay},
                 scheduler=scheduler) as freezer:
        train(model, optimizer, freezer, 6, scheduler, check)
    assert seen[0] == [True, True, False] and seen[1] == [True, False, False] and seen[3] == [False] * 3
    # the thawed blocks' bases: the head's over lr_decay per block (ULMFiT), as gradual asked
    assert scheduler.base_lrs[:3] == pytest.approx([0.1 / lr_decay**2, 0.1 / lr_decay, 0.1])


def test_a_thaw_under_one_cycle_scales_the_groups_cycle():
    # OneCycleLR schedules from each group's max_lr: the thaw's lr lasted one step, then the block ran at the head's
    model = net()
    optimizer = torch.optim.SGD(block_param_groups(model, discover_blocks(model), lr=0.1), lr=0.1)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=40)
    ratios = []
    with Freezer(model, optimizer, "gradual", {"every_steps": 2, "lr_decay": 2.6}, scheduler=scheduler) as freezer:
        train(model, optimizer, freezer, 8, scheduler,
              lambda t: ratios.append(optimizer.param_groups[1]["lr"] / optimizer.param_groups[2]["lr"]))
    assert optimizer.param_groups[1]["max_lr"] == pytest.approx(0.1 / 2.6)
    assert optimizer.param_groups[0]["max_lr"] == pytest.approx(0.1 / 2.6**2)
    assert ratios[2:] == pytest.approx([1 / 2.6] * 6)  # block 1 thawed after step 2, and keeps its ratio


def test_steps_past_total_steps_warn_once():
    # freezeout's LRs were 0 from total_steps on: training stopped in silence (an accelerate loop counting
    # micro-batches gets there halfway through the run)
    model = net()
    optimizer = torch.optim.SGD(block_param_groups(model, discover_blocks(model), lr=0.1))
    with Freezer(model, optimizer, "freezeout", total_steps=3) as freezer:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            train(model, optimizer, freezer, 3)
        with pytest.warns(UserWarning, match=r"freezer.step\(\) was called 4 times, more than total_steps=3") as got:
            train(model, optimizer, freezer, 3)
    assert len([w for w in got if "total_steps" in str(w.message)]) == 1


def test_layers_frozen_before_the_freezer_stay_frozen_through_its_freezes_and_thaws():
    # a thaw set requires_grad on the user's own frozen layer and put it into param group 0: it trained
    model = net()
    model[0].requires_grad_(False)
    model[2].weight.requires_grad_(False)  # half a block, as peft leaves a base weight beside its adapter
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW([{"params": [model[2].bias]}, {"params": model[4].parameters()}], lr=1e-2)
    held = [id(p) for g in optimizer.param_groups for p in g["params"]]
    with Freezer(model, optimizer, "none") as freezer:
        assert freezer.freeze(0) and freezer.freeze(1)
        train(model, optimizer, freezer, 2)
        assert freezer.thaw(0) and freezer.thaw(1)
        train(model, optimizer, freezer, 2)
        assert freezer.frozen == [False, False, False]
        assert [p.requires_grad for p in model.parameters()] == [False, False, False, True, True, True]
    for key in ("0.weight", "0.bias", "2.weight"):
        assert torch.equal(model.state_dict()[key], before[key]), key
    assert not torch.equal(model[2].bias, before["2.bias"])
    assert sorted(id(p) for g in optimizer.param_groups for p in g["params"]) == sorted(held)


def test_a_block_the_optimizer_never_held_is_not_added_by_a_thaw_and_cannot_get_an_lr():
    model = net()
    optimizer = torch.optim.SGD(model[4].parameters(), lr=0.1)  # the head alone
    with Freezer(model, optimizer, "none") as freezer:
        freezer.freeze(0)
        with pytest.raises(ValueError, match="none of its parameters is in a param group of the optimizer"):
            freezer.thaw(0, lr=0.05)
        assert freezer.frozen[0] and not model[0].weight.requires_grad  # refused before anything changed
        assert freezer.thaw(0) and model[0].weight.requires_grad
        assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in model[4].parameters()}


def test_a_refused_thaw_lr_leaves_the_block_frozen():
    # thaw(0, lr=0.0) raised after the block was thawed, with no record in the history
    model = net()
    optimizer = torch.optim.SGD(block_param_groups(model, discover_blocks(model), lr=0.1))
    with Freezer(model, optimizer, "none") as freezer:
        freezer.freeze(0)
        for lr in (0.0, -1.0, math.nan):
            with pytest.raises(ValueError, match="lr > 0"):
                freezer.thaw(0, lr=lr)
        assert freezer.frozen == [True, False, False] and not model[0].weight.requires_grad
        assert [h["kind"] for h in freezer.history] == ["freeze"]
        assert freezer.thaw(0, lr=0.05) and optimizer.param_groups[0]["lr"] == 0.05


def test_gradual_over_one_shared_param_group_is_refused_when_the_freezer_is_built():
    # it failed at its first thaw, an epoch into the run
    model = net()
    with pytest.raises(ValueError, match=r"Cannot give block '0' the learning rate 'gradual' gives a thawed block: "
                                         r"param group 0 also holds other blocks' parameters"):
        Freezer(model, torch.optim.AdamW(model.parameters()), "gradual")
    with pytest.raises(ValueError, match="param group 0 also holds other blocks' parameters"):
        Freezer(model, torch.optim.AdamW(model.parameters()), "gradual", {"lr_decay": 1.0})  # the head's LR, then
    Freezer(model, torch.optim.AdamW(block_param_groups(model, discover_blocks(model), lr=0.1)), "gradual").close()


class _Says(Strategy):
    name = "says"

    def __init__(self, decision):
        super().__init__()
        self.stage_every, self.decision = 1, decision

    def decide(self, ctx):
        return self.decision


@pytest.mark.parametrize("decision, error, shown", [
    (Decision(freeze=[3]), IndexError, r"Decision.freeze holds block index 3, out of range: the model has 3 blocks"),
    (Decision(freeze=[-1]), IndexError, r"Decision.freeze holds block index -1, out of range"),
    (Decision(thaw=["0"]), TypeError, r"Decision.thaw holds block indices \(int\), got '0'"),
    (None, TypeError, r"decide\(\) must return a layerfreeze.strategies.Decision .* got NoneType"),
])
def test_a_custom_strategys_bad_decision_names_the_strategy(decision, error, shown):
    # raw IndexError / TypeError / AttributeError from inside the engine; -1 was read as the head
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Freezer(model, optimizer, _Says(Decision())) as freezer:
        freezer.strategy.decision = decision
        with pytest.raises(error, match=f"strategy 'says': {shown}"):
            train(model, optimizer, freezer, 1)


def test_a_block_pattern_whose_modules_an_earlier_one_took_says_so():
    # 'st*' matched 'stem', already a block: the message said it "matches no module with parameters"
    from layerfreeze.errors import BlockDiscoveryError

    model = nn.Sequential()
    model.add_module("stem", nn.Linear(4, 4))
    model.add_module("head", nn.Linear(4, 2))
    with pytest.raises(BlockDiscoveryError, match=r"'st\*' matches only modules an earlier pattern already made "
                                                  r"blocks \(stem\)"):
        discover_blocks(model, ["stem", "st*", "head"])


def test_a_second_freezer_on_the_model_thaws_what_the_first_one_froze():
    # a second fit on the same model (its first Freezer closed with blocks frozen): those are not the user's
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Freezer(model, optimizer, "none") as first:
        first.freeze(0)
    assert not model[0].weight.requires_grad
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"block\(s\) 0 were left frozen by an earlier Freezer"):
        second = Freezer(model, optimizer, "none")
    with second:
        assert model[0].weight.requires_grad and model[0].bias.requires_grad
        assert second.freeze(0) and second.thaw(0)
        assert model[0].weight.requires_grad and model[0].bias.requires_grad


@pytest.mark.parametrize("optimizer_of", ["all", "trainable"])
def test_a_second_freezer_trains_what_the_first_left_frozen_in_training_mode(optimizer_of):
    # the second Freezer reported block 0 trainable while it stayed frozen and never trained, in silence; and the
    # first Freezer's eval-mode hooks, left on the model, kept a block the second thawed in eval mode (BatchNorm
    # statistics frozen, dropout off) in a block that trained
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)),
                          nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 3))
    blocks = ["0", "1", "2"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    with Freezer(model, optimizer, "static", {"k": 1}, blocks=blocks) as first:
        train(model, optimizer, first, 2)
    # a framework's optimizer over what is trainable now (the HF Trainer's), or over everything
    params = model.parameters() if optimizer_of == "all" else [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    weight, mean = model[0][0].weight.detach().clone(), model[0][1].running_mean.clone()
    with pytest.warns(UserWarning, match="left frozen by an earlier Freezer"):
        second = Freezer(model, optimizer, "none", blocks=blocks)
    with second:
        assert second.frozen == [False, False, False]
        modes = []
        model[0][2].register_forward_pre_hook(lambda m, a: modes.append(m.training))
        train(model, optimizer, second, 2)
    assert modes == [True, True]  # the first Freezer's hooks are gone: block 0 trains in training mode
    assert not torch.equal(weight, model[0][0].weight) and not torch.equal(mean, model[0][1].running_mean)


def test_block_patterns_listed_back_to_front_warn_before_the_head_is_frozen():
    # ["head", "layers.*", "stem"] made 'head' block 0 and 'stem' the head: static k=1 froze the classifier and
    # trained everything else, in silence
    model = nn.Sequential()
    model.add_module("stem", nn.Linear(4, 8))
    model.add_module("layers", nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    model.add_module("head", nn.Linear(8, 2))
    with pytest.warns(UserWarning, match=r"'layers.0' is a block after 'head', but the model registers it before "
                                         r"it\. Blocks are front to back") as caught:
        blocks = discover_blocks(model, ["head", "layers.*", "stem"])
    assert [b.name for b in blocks] == ["head", "layers.0", "layers.1", "stem"] and len(caught) == 1
    assert caught[0].filename == __file__  # the warning points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [b.name for b in discover_blocks(model, ["stem", "layers.*", "head"])][-1] == "head"


def test_a_closed_freezer_refuses_to_freeze_thaw_or_step():
    # after close() a freeze demoted a block to bfloat16 that nothing restored again
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Freezer(model, optimizer, "none", demote={"dtype": "bfloat16"}) as freezer:
        freezer.freeze(0)
    freezer.close()  # twice is fine
    assert next(model[0].parameters()).dtype == torch.float32  # given back at close
    for call in (lambda: freezer.freeze(1), lambda: freezer.thaw(0), freezer.step, freezer.epoch_end,
                 freezer.after_backward):
        with pytest.raises(RuntimeError, match=r"Freezer\.\w+\(\) after close\(\)"):
            call()
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_trainable_parameters_outside_every_block_are_named(capsys):
    # blocks given as patterns left a top-level input scale out: it trained all run, the frozen prefix's backward
    # still ran for it, and nothing said so (the cache's refusal named a symptom)
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))
            self.stem, self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.body(self.stem(x * self.scale)).relu())

    model = Scaled()
    with pytest.warns(UserWarning, match=r"Freezer: 1 trainable parameter\(s\) belong to no block \(scale\): nothing "
                                         r"freezes them"):
        Freezer(model, None, "static", {"k": 1}, blocks=["stem", "body", "head"]).close()
    model.scale.requires_grad_(False)  # frozen by the user: nothing to say of it
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*belong to no block")
        Freezer(model, None, "static", {"k": 1}, blocks=["stem", "body", "head"]).close()


def test_a_thawed_block_with_sparse_gradients_is_checked_and_trains():
    # the check that a thawed block is updated reshaped its gradient: a sparse one (nn.Embedding(sparse=True))
    # raised "reshape is not implemented for sparse tensors" at the first backward after the thaw
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.mid, self.head = nn.Embedding(20, 4, sparse=True), nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.head(torch.tanh(self.mid(self.emb(x).mean(1))))

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, optimizer, "none", blocks=["emb", "mid", "head"])

    def step():
        model(torch.randint(0, 20, (3, 5))).sum().backward()
        freezer.after_backward()
        optimizer.step()
        optimizer.zero_grad()
        freezer.step()

    step()
    freezer.freeze(0)
    step()
    frozen = model.emb.weight.detach().clone()
    freezer.thaw(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "thawed block was not updated" either
        step()
        step()
    assert not torch.equal(frozen, model.emb.weight)
    freezer.close()


def test_block_keys_and_thaw_learning_rates_that_would_train_wrongly_are_refused():
    model = net()
    optimizer = torch.optim.AdamW(block_param_groups(model, discover_blocks(model), lr=0.05))
    with Freezer(model, optimizer, "static", {"k": 1}) as freezer:
        with pytest.raises(TypeError, match="not bool"):
            freezer.freeze(True)  # True is the int 1: it froze block 1
        with pytest.raises(ValueError, match=r"a finite lr > 0 \(got lr=inf\)"):
            freezer.thaw(0, lr=math.inf)  # the block's weights were non-finite after one step
        assert freezer.frozen == [True, False, False]


def test_a_thaw_lr_with_a_scheduler_the_freezer_was_not_given_warns():
    # the scheduler's next step set the LR back to its own schedule: thaw(lr=0.001) lasted no step, in silence
    model = net()
    optimizer = torch.optim.AdamW(block_param_groups(model, discover_blocks(model), lr=0.05))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with Freezer(model, optimizer, "static", {"k": 1}) as freezer:
        with pytest.warns(UserWarning, match=r"an LR scheduler over this optimizer .* was not given to the Freezer"):
            freezer.thaw(0, lr=0.001)
    model = net()
    optimizer = torch.optim.AdamW(block_param_groups(model, discover_blocks(model), lr=0.05))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with Freezer(model, optimizer, "static", {"k": 1}, scheduler=scheduler) as freezer:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            freezer.thaw(0, lr=0.001)
        train(model, optimizer, freezer, 1, scheduler=scheduler)
        assert optimizer.param_groups[0]["lr"] == 0.001


def test_a_refused_attach_optimizer_leaves_the_freezer_and_the_optimizer_as_they_were():
    # gradual needs a param group per block; a refused optimizer was half attached: the Freezer held it and the
    # frozen blocks' parameters had left it
    model = net()
    with Freezer(model, None, "gradual") as freezer:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)  # one group for every block
        held = list(optimizer.param_groups[0]["params"])
        with pytest.raises(ValueError, match="param group 0 also holds other blocks' parameters"):
            freezer.attach_optimizer(optimizer)
        assert freezer.optimizer is None and optimizer.param_groups[0]["params"] == held
        optimizer = torch.optim.AdamW(block_param_groups(model, freezer.blocks, lr=0.05))
        freezer.attach_optimizer(optimizer)
        assert freezer.optimizer is optimizer


def test_a_reused_optimizer_gets_what_the_first_freezer_took_out_back_in_its_own_param_groups():
    # a Trainer's second train() reuses its optimizer: the taken-back biases and LayerNorm went into group 0 and
    # trained with weight decay 0.1 (HF's no-decay group is group 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 2))
    decay = [model[0].weight, model[2].weight, model[3].weight]
    no_decay = [model[0].bias, model[1].weight, model[1].bias, model[2].bias, model[3].bias]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    with Freezer(model, optimizer, "static", {"k": 2}):
        assert len(optimizer.param_groups[1]["params"]) == 2
    with pytest.warns(UserWarning, match="left frozen by an earlier Freezer"), Freezer(model, optimizer, "none"):
        assert [set(map(id, g["params"])) for g in optimizer.param_groups] == [set(map(id, decay)),
                                                                              set(map(id, no_decay))]


def test_a_deep_copy_of_a_frozen_model_trains_under_a_new_freezer():
    # copy.deepcopy drops the parameters' marks and copies the Freezer's eval hooks bound to a copy of it: the copy's
    # frozen blocks were reported trainable, never trained, and stayed in eval mode
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Linear(8, 2))
    model[2].bias.requires_grad_(False)  # the user's own: stays frozen
    with Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "static", {"k": 2}):
        copied = copy.deepcopy(model)
    optimizer = torch.optim.SGD([p for p in copied.parameters() if p.requires_grad], lr=0.1)
    with pytest.warns(UserWarning, match=r"block\(s\) 0, 2 were left frozen by an earlier Freezer"):
        freezer = Freezer(copied, optimizer, "none")
    with freezer:
        assert [p.requires_grad for p in copied.parameters()] == [True, True, True, False, True, True]
        before = copied[0].weight.detach().clone()
        copied.train()
        copied(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        assert copied[1].training and not torch.equal(before, copied[0].weight)
    assert not model[0].weight.requires_grad  # the original stays as the first Freezer left it


def test_a_copy_of_a_model_with_frozen_blocks_carries_what_it_froze_not_the_freezers_optimizer_or_strategy():
    # the copy's hooks copied the whole Freezer: Egeria's worker thread made copy.deepcopy and AveragedModel (EMA)
    # raise "cannot pickle '_queue.SimpleQueue'" once a block froze, and every copy held the optimizer's state again
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    with Freezer(model, optimizer, "egeria", total_steps=20) as freezer:
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()  # Adam state for every parameter
        assert freezer.freeze(0)
        ema = torch.optim.swa_utils.AveragedModel(model)
        copied = copy.deepcopy(model)
        for each in (ema.module, copied):
            owners = {id(h.__self__): h.__self__ for h in each[0]._forward_pre_hooks.values()}
            (carried,) = owners.values()
            assert carried is not freezer and carried.closed and carried.optimizer is None
            assert carried.frozen == [True, False, False] and carried.model is each
            each.train()
            each(torch.randn(5, 4))
            assert not each[0].training and each[2].training  # the copy's frozen block still runs in eval mode
    with pytest.warns(UserWarning, match=r"block\(s\) 0 were left frozen by an earlier Freezer"):
        with Freezer(copied, torch.optim.SGD(copied.parameters(), lr=0.1), "none") as again:
            assert again.frozen == [False, False, False] and copied[0].weight.requires_grad


def test_a_saved_model_with_frozen_blocks_carries_what_it_froze_and_loads_under_a_new_freezer(tmp_path):
    # torch.save(model) pickled the Freezer its hooks are bound to, whole: the model's file held the optimizer and its
    # Adam state and the strategy, and the loaded model's hooks were bound to an open Freezer with a stray optimizer
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Linear(8, 2))
    model[2].bias.requires_grad_(False)  # the user's own: stays frozen after the load too
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with Freezer(model, optimizer, "egeria", total_steps=20) as freezer:
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        assert freezer.freeze(0)
        torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    (carried,) = {id(h.__self__): h.__self__ for h in loaded[0]._forward_pre_hooks.values()}.values()
    assert carried.closed and carried.optimizer is None and carried.model is loaded and carried.frozen[0]
    assert not hasattr(carried, "strategy") and torch.equal(loaded[0].weight, model[0].weight)
    loaded.train()
    loaded(torch.randn(5, 4))
    assert not loaded[0].training and loaded[2].training  # the loaded model's frozen block still runs in eval mode
    with pytest.warns(UserWarning, match=r"block\(s\) 0 were left frozen by an earlier Freezer"):
        again = Freezer(loaded, torch.optim.SGD([p for p in loaded.parameters() if p.requires_grad], lr=0.1), "none")
    with again:
        assert [p.requires_grad for p in loaded.parameters()] == [True, True, True, False, True, True]


def test_a_freezer_on_a_submodule_leaves_the_earlier_freezers_hold_on_the_rest():
    # taking over removed every hook of the earlier Freezer: the frozen stem outside the new model ran BatchNorm in
    # training mode and its running statistics drifted
    torch.manual_seed(0)
    stem, body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model = nn.Sequential(stem, body, nn.Linear(8, 2))
    with Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "static", {"k": 2}, blocks=["0", "1", "2"]):
        pass
    with pytest.warns(UserWarning, match=r"block\(s\) 0, 1 were left frozen"):
        second = Freezer(body, torch.optim.SGD(body.parameters(), lr=0.1), "none", blocks=["0", "1"])
    mean = stem[1].running_mean.clone()
    model.train()
    model(torch.randn(6, 4) * 5 + 3)
    assert torch.equal(mean, stem[1].running_mean) and not stem[1].training
    assert not any(p.requires_grad for p in stem.parameters()) and all(p.requires_grad for p in body.parameters())
    second.close()


def test_a_refused_freezer_takes_nothing_over():
    model = net()
    with Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "static", {"k": 2}):
        pass
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(RuntimeError, match="total_steps"):
        Freezer(model, optimizer, "linear")
    assert [p.requires_grad for p in model.parameters()] == [False] * 4 + [True] * 2
    assert len(optimizer.param_groups[0]["params"]) == 2
    with pytest.warns(UserWarning, match="left frozen by an earlier Freezer"):
        Freezer(model, optimizer, "none").close()
    assert len(optimizer.param_groups[0]["params"]) == 6


def test_a_thaw_lr_follows_a_sequential_lr_schedule():
    # SequentialLR keeps no base_lrs of its own: the thaw's lr was lost at the next step (0.1, 0.05, ... in place of
    # 0.7, 0.35, ...), the warning for a scheduler not given to the Freezer not firing since one was given
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(block_param_groups(model, discover_blocks(model), lr=0.1))
    warm = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, decay], milestones=[2])
    with Freezer(model, optimizer, "static", {"k": 2}, scheduler=scheduler) as freezer:
        freezer.thaw(0, lr=0.7)
        lrs = []
        for _ in range(4):
            optimizer.step()
            scheduler.step()
            lrs.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[3]["lr"]))
    assert lrs == [(0.7, 0.1), (0.35, 0.05), (0.35, 0.05), (0.35, 0.05)]


def test_a_thaw_lr_under_reduce_lr_on_plateau_keeps_the_reductions_made_so_far():
    # ReduceLROnPlateau keeps no base LR: after four halvings, thaw(lr=0.5) gave the block 0.5 itself, 40x the head's
    # 0.0125 where LambdaLR's same halvings gave the 5x its base says; it survives a resume with the optimizer's state
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(block_param_groups(model, discover_blocks(model), lr=0.1))
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    with Freezer(model, optimizer, "static", {"k": 2}, scheduler=scheduler) as freezer:
        for step in range(5):
            optimizer.step()
            scheduler.step(1.0 + step)  # worse every time: halved from the second step on
        assert optimizer.param_groups[2]["lr"] == 0.1 / 16
        saved = optimizer.state_dict()
        assert freezer.thaw(1, lr=0.5)
        assert optimizer.param_groups[1]["lr"] == 0.5 / 16
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(block_param_groups(model, discover_blocks(model), lr=0.1))
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    with Freezer(model, optimizer, "static", {"k": 2}, scheduler=scheduler) as freezer:
        optimizer.load_state_dict(saved)  # the resumed run: its LRs are the reduced ones
        assert freezer.thaw(1, lr=0.5)
        assert optimizer.param_groups[1]["lr"] == 0.5 / 16


def test_a_block_the_new_strategy_freezes_again_thaws_into_its_group_and_trains_in_training_mode():
    # the earlier Freezer's hooks stayed on a block the new start stage froze again: thawed later, it trained in eval
    # mode (BatchNorm statistics fixed, dropout off), in the weight-decay group, or (a deep copy) not at all
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)), nn.Linear(8, 8),
                          nn.Linear(8, 2))
    decay = [model[0][0].weight, model[1].weight, model[2].weight]
    no_decay = [model[0][0].bias, model[0][1].weight, model[0][1].bias, model[1].bias, model[2].bias]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    for _ in range(2):  # three Freezers in a row: static, static (block 0 frozen again), then a thaw
        with Freezer(model, optimizer, "static", {"k": 1}):
            pass
    with Freezer(model, optimizer, "static", {"k": 1}) as third:
        third.thaw(0)
        assert [set(map(id, g["params"])) for g in optimizer.param_groups] == [set(map(id, decay)),
                                                                              set(map(id, no_decay))]
        mean = model[0][1].running_mean.clone()
        model.train()
        model(torch.randn(16, 4) * 3 + 2)
        assert model[0][1].training and model[0][2].training and not torch.equal(mean, model[0][1].running_mean)
    copied = copy.deepcopy(model)  # blocks 0 frozen by the third Freezer, carried into the copy
    optimizer = torch.optim.SGD(copied.parameters(), lr=0.1)
    with Freezer(copied, optimizer, "static", {"k": 1}) as freezer:
        freezer.thaw(0)
        assert copied[0][0].weight.requires_grad


def test_a_floor_holding_the_head_freezes_nothing():
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="the floor cannot hold the head"):
        Freezer(model, optimizer, "none", floor=[0, 2])
    assert all(p.requires_grad for p in model.parameters()) and len(optimizer.param_groups[0]["params"]) == 6
    assert not model[0]._forward_pre_hooks


def test_what_a_new_freezer_cannot_take_over_is_refused_and_a_partly_refrozen_block_trains_in_training_mode():
    # a Freezer on a submodule of a block an earlier Freezer froze reported it trainable while it stayed frozen; a
    # block of the earlier Freezer frozen again only in part kept its other part in eval mode
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), nn.Linear(8, 8))
    model = nn.Sequential(nn.Sequential(backbone, nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))),
                          nn.Linear(8, 2))
    with Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "static", {"k": 1}, blocks=["0", "1"]):
        pass
    optimizer = torch.optim.SGD(backbone.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="block '0', frozen by an earlier Freezer on a larger model, reaches outside"):
        Freezer(backbone, optimizer, "none")
    model.train()
    with pytest.warns(UserWarning, match=r"block\(s\) 0.1 were left frozen"):
        second = Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "static", {"k": 1},
                         blocks=["0.0", "0.1", "1"])  # block 0.0 frozen again, 0.1 trains
    with second:
        bn = model[0][1][1]
        mean = bn.running_mean.clone()
        model(torch.randn(16, 4) * 3 + 2)
        assert bn.training and not torch.equal(mean, bn.running_mean) and not model[0][0][0][1].training


def test_gradual_after_an_earlier_freezer_with_the_same_per_block_optimizer():
    # a Trainer's second train() with gradual: refused, as block 0's parameters had left the reused optimizer
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(block_param_groups(model, discover_blocks(model), 0.1), lr=0.1)
    with Freezer(model, optimizer, "static", {"k": 2}):
        pass
    with Freezer(model, optimizer, "gradual", total_steps=40) as freezer:
        assert freezer.frozen == [True, True, True, False]
        freezer.thaw(0, lr=0.05)
        assert optimizer.param_groups[0]["params"] == [model[0].weight, model[0].bias]


def _normed_stack():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(4 if i == 0 else 8, 8), nn.LayerNorm(8)) for i in range(3)),
                         nn.Linear(8, 2))


def _no_decay(name, p):
    return name.endswith("bias") or p.ndim == 1


def _left_frozen_by_static(model, k=2):
    with Freezer(model, torch.optim.AdamW(model.parameters()), "static", {"k": k}):
        pass


@pytest.mark.parametrize("strategy", ["none", "gradual"])
def test_taken_back_blocks_go_to_their_own_block_groups_in_an_optimizer_built_over_what_requires_grad(strategy):
    # the CLI's build_optimizer after an earlier run: every taken-back parameter went to group 0 (block 0's decay
    # group: block 1's weights at block 0's LR, every bias and norm under weight decay), and gradual was refused
    # ("none of its parameters is in a param group") for an optimizer built from block_param_groups
    model = _normed_stack()
    _left_frozen_by_static(model)
    groups = block_param_groups(model, discover_blocks(model), lr=0.1, weight_decay=0.1, lr_decay=2.0,
                                no_decay=_no_decay)
    for g in groups:
        g["params"] = [p for p in g["params"] if p.requires_grad]
    optimizer = torch.optim.AdamW(groups, lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        freezer = Freezer(model, optimizer, strategy, total_steps=40)
    # none trains them again (and says so); gradual's start stage froze them again, its thaws train them
    assert [str(w.message)[:44] for w in caught] == (["Freezer: block(s) 0, 1 were left frozen by a"]
                                                     if strategy == "none" else [])
    with freezer:
        for block in range(3):
            freezer.thaw(block)  # gradual's start froze them again: its thaw puts them where none's take-over does
        expected = [[model[b][0].weight] if i % 2 == 0 else [model[b][0].bias, model[b][1].weight, model[b][1].bias]
                    for b in range(3) for i in range(2)] + [[model[3].weight], [model[3].bias]]
        assert [g["params"] for g in optimizer.param_groups] == expected
        assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0] * 4


def test_taken_back_biases_and_norms_join_the_no_decay_group_of_a_two_group_optimizer():
    # the HF Trainer's groups (decay, no decay), built over what requires grad: the taken-back LayerNorm and biases
    # were put under weight decay, and the resumed Trainer's optimizer did not load the checkpoint
    model = _normed_stack()
    _left_frozen_by_static(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for n, p in named if not _no_decay(n, p)], "weight_decay": 0.1},
                                   {"params": [p for n, p in named if _no_decay(n, p)], "weight_decay": 0.0}])
    with pytest.warns(UserWarning, match="left frozen"), Freezer(model, optimizer, "none"):
        names = {id(p): n for n, p in model.named_parameters()}
        held = [sorted(names[id(p)] for p in g["params"]) for g in optimizer.param_groups]
    everything = dict(model.named_parameters())
    assert held == [sorted(n for n, p in everything.items() if not _no_decay(n, p)),
                    sorted(n for n, p in everything.items() if _no_decay(n, p))]


def test_release_earlier_freezers_before_the_optimizer_keeps_the_users_frozen_parameters():
    model = _normed_stack()
    model[1][1].weight.requires_grad_(False)  # the user's own freeze, before any Freezer
    _left_frozen_by_static(model, k=3)
    model.train()
    model(torch.randn(2, 4))  # the frozen blocks' eval-mode hooks run
    assert not model[0][0].weight.requires_grad and not model[0][1].training
    with pytest.warns(UserWarning, match=r"block\(s\) 0, 1, 2 were left frozen .* trainable again before the "
                                         "optimizer is built"):
        released = release_earlier_freezers(model)
    assert released == ["0", "1", "2"]
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["1.1.weight"]
    model(torch.randn(2, 4))
    assert all(m.training for m in model.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left to take over
        assert release_earlier_freezers(model) == []
        with Freezer(model, torch.optim.AdamW(p for p in model.parameters() if p.requires_grad), "none") as freezer:
            assert freezer.frozen == [False] * 4


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l0, self.l1, self.l2, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.l2(self.l1(self.l0(x).relu()).relu()).relu())


def _trainable(model):
    return sorted({n.split(".")[0] for n, p in model.named_parameters() if p.requires_grad})


def test_what_the_user_set_trainable_since_an_earlier_freezer_is_what_trains():
    # the user froze everything after a first run, then made the head trainable: the next Freezer gave back the
    # blocks the first had frozen, and put them into the user's head-only optimizer (they trained); a block the user
    # made trainable again (l1) was recorded as the user's frozen one, so a freeze and thaw left it frozen for good
    blocks = ["l0", "l1", "l2", "head"]
    for unfrozen, trains, kept in (("head", ["head"], "l0, l1"), ("l1", ["l1"], "l0")):
        model = _Stack()
        with Freezer(model, torch.optim.AdamW(model.parameters()), "static", {"k": 2}, blocks=blocks):
            pass
        model.requires_grad_(False)
        getattr(model, unfrozen).requires_grad_(True)
        optimizer = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)
        with pytest.warns(UserWarning, match=rf"block\(s\) {kept} were left frozen by an earlier Freezer on this "
                                             "model, and other parameters were frozen since"):
            freezer = Freezer(model, optimizer, "none", blocks=blocks)
        with freezer:
            assert _trainable(model) == trains and len(optimizer.param_groups[0]["params"]) == 2
            freezer.freeze(unfrozen if unfrozen != "head" else "l2")
            freezer.thaw(unfrozen if unfrozen != "head" else "l2")
            assert _trainable(model) == trains


def test_a_stage_never_leaves_nothing_to_train_and_a_hand_freeze_that_does_warns():
    # peft's LoRA freezes the head: a strategy that froze every block before it left nothing training, and the next
    # loss.backward() raised torch's "element 0 of tensors does not require grad" in the middle of the run
    model = net()
    model[4].requires_grad_(False)  # the head holds nothing to train
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = model[2].weight.detach().clone()
    with pytest.warns(UserWarning, match="strategy 'static' asked to freeze 2, which would have left nothing to train"):
        freezer = Freezer(model, optimizer, "static", {"k": 2})
    with freezer:
        assert freezer.frozen == [True, False, False]
        train(model, optimizer, freezer, 3)
        assert not torch.equal(model[2].weight, before)
        with pytest.warns(UserWarning, match="freezing block '2' left no trainable parameter in the blocks not frozen: "
                                             "nothing trains"):
            assert freezer.freeze(1)
        assert freezer.thaw(1)


def test_a_parameter_frozen_by_hand_mid_run_stays_frozen_through_thaws_and_a_resume():
    # a rotating strategy's switch-on (a thaw) made a bias the user had frozen by hand mid-run train again, in silence
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Freezer(model, optimizer, "none") as freezer:
        train(model, optimizer, freezer, 1)
        model[2].bias.requires_grad_(False)  # by hand, while its block trains
        assert freezer.state_dict()["user_frozen"] == ["2.bias"]  # saved before any freeze of its block too
        assert freezer.freeze(1) and freezer.thaw(1)
        assert [p.requires_grad for p in model.parameters()] == [True, True, True, False, True, True]
        kept = model[2].bias.detach().clone()
        train(model, optimizer, freezer, 2)
        assert torch.equal(model[2].bias, kept)
        assert freezer.freeze(1)
        state = freezer.state_dict()
    resumed = net()  # the resumed script starts past the hand freeze
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    with Freezer(resumed, optimizer, "none") as freezer:
        freezer.load_state_dict(state)
        assert freezer.thaw(1)
        assert [p.requires_grad for p in resumed.parameters()] == [True, True, True, False, True, True]


def deep(seed: int = 0, head_frozen: bool = True) -> nn.Sequential:
    """Four blocks and a head that holds nothing to train (peft LoRA freezes the head)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    model[8].requires_grad_(not head_frozen)
    return model


def test_a_floor_or_a_parameter_outside_the_blocks_is_counted_when_a_stage_keeps_one_block_training():
    # keep_one_training counted a thaw the floor then refused: badam's switch froze the last block with adapters and
    # loss.backward() raised at step 1; a trainable parameter outside every block was not counted: static k=2 was cut
    # to k=1 with a false "nothing to train" warning
    model = deep()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the floor's refusal and the kept block are warned about
        freezer = Freezer(model, optimizer, "badam", {"k": 1}, floor=[2])
    with freezer, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, optimizer, freezer, 4)  # raised "element 0 of tensors does not require grad"
        assert freezer.trainable_parameters() > 0

    model = net()
    model.scale = nn.Parameter(torch.ones(()))  # outside every block, trains
    model[4].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Freezer(model, optimizer, "static", {"k": 2}) as freezer:
            assert freezer.frozen == [True, True, False]
    assert not [w for w in seen if "nothing to train" in str(w.message)]


def test_a_resume_applies_the_saved_frozen_set_without_a_false_nothing_trains_warning():
    # load_state_dict froze the saved blocks one by one, outside a stage: with a head that holds nothing to train it
    # warned "nothing trains ... loss.backward() raises" before thawing the block that trains
    def make():
        model = deep()
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    model, optimizer = make()
    with Freezer(model, optimizer, "badam", {"k": 1}) as freezer:
        train(model, optimizer, freezer, 2)
        state = freezer.state_dict()
    model, optimizer = make()
    with Freezer(model, optimizer, "badam", {"k": 1}) as freezer, warnings.catch_warnings():
        warnings.simplefilter("error")
        freezer.load_state_dict(state)
        assert freezer.frozen == state["frozen"]


def test_a_parameter_the_user_made_trainable_again_trains_through_thaws_and_a_resume():
    # the set of the user's frozen parameters only grew: one frozen before the Freezer and made trainable by hand
    # stayed frozen after a freeze and thaw of its block, and a resume froze it
    model = net()
    model[2].weight.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Freezer(model, optimizer, "none") as freezer:
        model[2].weight.requires_grad_(True)  # by hand: it trains from now on
        assert freezer.freeze(1) and freezer.thaw(1)
        assert model[2].weight.requires_grad
        state = freezer.state_dict()
    assert state["user_frozen"] == []
    resumed = net()
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    with Freezer(resumed, optimizer, "none") as freezer:
        freezer.load_state_dict(state)
        assert resumed[2].weight.requires_grad


def test_update_bn_recalibrates_a_frozen_blocks_batchnorm_in_an_averaged_copy():
    # torch.optim.swa_utils.update_bn (and Lightning's StochasticWeightAveraging) reset every BatchNorm's statistics
    # and average them anew in training mode, with momentum=None: the Freezer's hooks put the frozen block back in
    # eval mode, its statistics stayed 0 and 1, and the averaged model's output was wrong
    import copy

    from torch.optim.swa_utils import AveragedModel, update_bn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)),
                          nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), nn.Linear(8, 2))
    data = [torch.randn(16, 4) * 3 + 5 for _ in range(4)]
    reference = AveragedModel(copy.deepcopy(model))  # no Freezer: update_bn recomputes every BatchNorm
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with Freezer(model, optimizer, "static", {"k": 1}) as freezer:
        assert freezer.frozen_blocks == ["0"]
        ema = AveragedModel(model)
        update_bn(data, ema)
        update_bn(data, reference)
        bn, ref = ema.module[0][1], reference.module[0][1]
        assert torch.equal(bn.running_mean, ref.running_mean) and torch.equal(bn.running_var, ref.running_var)
        assert not torch.equal(bn.running_var, torch.ones(8))  # was reset and left at 1
        model.train()
        model(data[0])
        assert not model[0][1].training and model[0][1].momentum == 0.1  # as usual: the frozen block in eval


def test_a_frozen_blocks_batchnorm_built_with_momentum_none_goes_to_eval_mode():
    # momentum=None set by the user (a cumulative average), not by update_bn: the frozen block kept training mode,
    # normalised with each batch's statistics, and its running statistics changed at every step
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=None)), nn.Linear(8, 2))
    with Freezer(model, torch.optim.SGD(model.parameters(), lr=0.01), "static", {"k": 1}):
        model.train()
        before = model[0][1].running_mean.clone()
        model(torch.randn(16, 4) + 3)
        assert not model[0][1].training and torch.equal(model[0][1].running_mean, before)


def test_a_parameter_made_trainable_by_hand_while_its_block_is_frozen_trains_once_the_block_thaws():
    # frozen by hand while its block trained, then made trainable again while the block was frozen: the check
    # re-froze it ("requires grad again") and it stayed frozen for good, through the thaw and a resume
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Freezer(model, optimizer, "none") as freezer:
        model[2].bias.requires_grad_(False)
        assert freezer.freeze(1)
        model[2].bias.requires_grad_(True)
        with pytest.warns(UserWarning, match=r"'2.bias' of frozen block '2' requires grad again: .*; re-frozen until "
                                             r"its block thaws"):
            train(model, optimizer, freezer, 1)
        assert not model[2].bias.requires_grad and freezer.state_dict()["user_frozen"] == []
        assert freezer.thaw(1)
        assert model[2].bias.requires_grad


def test_a_block_kept_training_at_freezeouts_factor_0_says_its_steps_change_nothing():
    # the warning said the block "keeps training" while FreezeOut's factor for it was 0: the run's last steps paid
    # a backward and updated nothing
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    model[4].requires_grad_(False)
    optimizer = torch.optim.SGD(block_param_groups(model, discover_blocks(model), lr=0.1))
    with Freezer(model, optimizer, "freezeout", total_steps=6) as freezer:
        with pytest.warns(UserWarning, match=r"2 keeps training at the learning-rate factor 0 the strategy gives it "
                                             r"\(its schedule has ended\): its steps change nothing"):
            train(model, optimizer, freezer, 6)
        assert freezer.frozen == [True, False, False]

