"""The Freezer in a user's own training loop, written the ways real loops are: resume steps in another order than
documented, a scheduler built after the Freezer, strategy parameters of the wrong type, peft's frozen base. Each test
is a fault a breaking pass found (2026-12-08) and fails before its fix."""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
from torch import nn

from layerfreeze import Freezer, block_param_groups, discover_blocks


def net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 3))


def train(model: nn.Module, optimizer, freezer: Freezer, steps: range, scheduler=None) -> None:
    for t in steps:
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        freezer.after_backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        freezer.step()


def resumed(order: str, strategy: str, params: dict, groups) -> tuple[dict, dict]:
    """Weights of a run of 6 steps and of the same run saved after 3 and resumed, loading model (m), optimizer (o)
    and Freezer (f) state in ``order``."""
    def build():
        model = net()
        optimizer = torch.optim.AdamW(groups(model), lr=1e-2)
        return model, optimizer, Freezer(model, optimizer, strategy, params, total_steps=6)

    model, optimizer, freezer = build()
    train(model, optimizer, freezer, range(3))
    saved = copy.deepcopy({"m": model.state_dict(), "o": optimizer.state_dict(), "f": freezer.state_dict()})
    train(model, optimizer, freezer, range(3, 6))
    freezer.close()
    model2, optimizer2, freezer2 = build()
    load = {"m": model2.load_state_dict, "o": optimizer2.load_state_dict, "f": freezer2.load_state_dict}
    for what in order:
        load[what](saved[what])
    train(model2, optimizer2, freezer2, range(3, 6))
    freezer2.close()
    return dict(model.named_parameters()), dict(model2.named_parameters())


@pytest.mark.parametrize("order", ["ofm", "mof"])
def test_an_optimizer_loaded_before_the_freezer_keeps_its_state(order):
    # the Freezer's restore cleared the optimizer state loaded before it: the run went on from zero Adam moments
    whole, again = resumed(order, "static", {"k": 2}, lambda m: block_param_groups(m, discover_blocks(m), lr=1e-2))
    assert all(torch.equal(whole[n], again[n]) for n in whole)


def test_an_optimizer_loaded_before_the_freezer_in_one_group_keeps_each_state_on_its_parameter():
    # one param group, badam's active block at the save (block 2) not the fresh start's (block 1), both of the same
    # size: torch gave block 1's places block 2's moments, and the restore cleared them
    whole, again = resumed("omf", "badam", {"k": 2, "seed": 0}, lambda m: m.parameters())
    assert all(torch.equal(whole[n], again[n]) for n in whole)


def test_an_optimizer_loaded_before_the_freezer_state_it_does_not_fit_says_the_order():
    model = net()
    optimizer = torch.optim.AdamW(block_param_groups(model, discover_blocks(model), lr=1e-2))
    freezer = Freezer(model, optimizer, "gradual", {"every_steps": 1}, total_steps=6)
    train(model, optimizer, freezer, range(2))  # two thaws: other group sizes than the start stage's
    saved = optimizer.state_dict()
    freezer.close()
    model2 = net()
    optimizer2 = torch.optim.AdamW(block_param_groups(model2, discover_blocks(model2), lr=1e-2))
    with Freezer(model2, optimizer2, "gradual", {"every_steps": 1}, total_steps=6):
        with pytest.raises(ValueError, match=r"param group 1 holds 2 parameters in the state dict, 0 here.*call "
                                             r"freezer\.load_state_dict\(saved_freezer_state\) first"):
            optimizer2.load_state_dict(saved)


def freezeout_run(build_scheduler_after: bool, call_after_backward: bool = True):
    model = net()
    optimizer = torch.optim.AdamW(block_param_groups(model, discover_blocks(model), lr=1e-2))
    schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 - t / 6)  # noqa: E731
    scheduler = None if build_scheduler_after else schedule(optimizer)
    freezer = Freezer(model, optimizer, "freezeout", scheduler=scheduler, total_steps=6)
    if build_scheduler_after:
        scheduler = schedule(optimizer)
    nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 0])).backward()
    if call_after_backward:
        freezer.after_backward()
    optimizer.step()
    scheduler.step()
    freezer.step()
    return [g["lr"] for g in optimizer.param_groups]


def test_a_scheduler_built_after_freezeouts_freezer_is_refused_before_the_first_step():
    # its base LRs were FreezeOut's scaled ones, and the factors applied again on top: block 0 trained at 1.95x
    # FreezeOut's LR, in silence
    assert freezeout_run(False)[0] == pytest.approx(0.01 / 0.512 * (5 / 6) * 0.5 * (1 + math.cos(math.pi * (1 / 6)
                                                                                                    / 0.512)))
    with pytest.raises(RuntimeError, match=r"an LR scheduler was built after the Freezer: it took param group 0's "
                                           r"learning rate 0\.0195312, which strategy 'freezeout' had scaled from "
                                           r"0\.01 .*Build the scheduler before the Freezer"):
        freezeout_run(True)
    with pytest.raises(RuntimeError, match="an LR scheduler was built after the Freezer"):
        freezeout_run(True, call_after_backward=False)  # a loop without after_backward: refused at its first step()


@pytest.mark.parametrize("seed", ["a", 1.5, None])
def test_a_smartfrz_seed_that_is_no_integer_is_refused_in_one_line_before_training(seed):
    # torch's manual_seed raised "manual_seed expected a long, but got str" from the strategy's attach
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=rf"^smartfrz: seed must be an integer \(the seed of the sampled weight "
                                         rf"positions\), got {re.escape(repr(seed))}$"):
        Freezer(model, optimizer, "smartfrz", {"seed": seed}, total_steps=6)
    with Freezer(model, optimizer, "smartfrz", {"seed": 3}, total_steps=6) as freezer:  # the Freezer was closed
        assert freezer.strategy.seed == 3


@pytest.mark.parametrize(("strategy", "purpose"), [("freezeout", "a learning-rate factor"),
                                                   ("gradual", "the learning rate 'gradual' gives a thawed block")])
def test_a_strategy_that_sets_learning_rates_refuses_adafactors_relative_step_before_training(strategy, purpose):
    # freezeout: a bare "TypeError: unsupported operand type(s) for *: 'NoneType' and 'float'" from the constructor;
    # gradual: its discriminative LRs were written where Adafactor(relative_step=True) never reads them, in silence
    from transformers.optimization import Adafactor

    model = net()
    groups = [dict(g, lr=None) for g in block_param_groups(model, discover_blocks(model), lr=1e-2)]
    optimizer = Adafactor(groups, lr=None)  # relative_step=True: Adafactor's own step size
    with pytest.raises(ValueError, match=rf"^Cannot give block '0' {purpose}: its param group 0 has lr=None, no "
                                         r"learning rate to scale \(Adafactor with relative_step=True"):
        Freezer(model, optimizer, strategy, total_steps=6)
    assert all(p.requires_grad for p in model.parameters())  # refused before anything froze


def factors_against_schedule(make_scheduler, after_freezer_step: bool, metrics=None):
    """Each step's LR of block 0's group under freezeout, over its factor, and the LR the same scheduler gives an
    optimizer without a Freezer after as many scheduler steps (stepped between optimizer.step() and freezer.step(),
    or after freezer.step())."""
    model = net()
    optimizer = torch.optim.SGD(block_param_groups(model, discover_blocks(model), lr=1e-2))
    reference = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1e-2)
    scheduler, schedule = make_scheduler(optimizer), make_scheduler(reference)
    freezer = Freezer(model, optimizer, "freezeout", scheduler=scheduler, total_steps=12)
    ours, theirs = [], []
    for t in range(5):
        nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 0])).backward()
        freezer.after_backward()
        optimizer.step()
        reference.step()
        optimizer.zero_grad()
        args = () if metrics is None else (metrics[t],)
        if not after_freezer_step:
            scheduler.step(*args)
            schedule.step(*args)
        freezer.step()
        ours.append(optimizer.param_groups[0]["lr"] / freezer._lr_scale[0])
        theirs.append(reference.param_groups[0]["lr"])
        if after_freezer_step:
            scheduler.step(*args)
            schedule.step(*args)
    freezer.close()
    return ours, theirs


def test_freezeout_factors_apply_once_under_a_warmup_that_derives_the_next_lr_from_the_current_one():
    # LinearLR multiplies the LR it finds: it found the scaled one and the factor applied twice, 3.6x from step 2
    warmup = lambda opt: torch.optim.lr_scheduler.SequentialLR(  # noqa: E731
        opt, [torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, total_iters=3),
              torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 - t / 12)], milestones=[3])
    ours, theirs = factors_against_schedule(warmup, after_freezer_step=False)
    assert ours == pytest.approx(theirs, rel=1e-12)
    assert theirs[:2] == pytest.approx([0.004, 0.007])


@pytest.mark.parametrize("after", [False, True])
def test_freezeout_factors_apply_once_under_reduce_lr_on_plateau(after):
    # a reduction found the scaled LR: the block went on at the reduced LR times its factor of the step before
    plateau = lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)  # noqa: E731
    ours, theirs = factors_against_schedule(plateau, after, metrics=[3.0, 2.0, 4.0, 5.0, 1.0])
    assert ours == pytest.approx(theirs, rel=1e-12)
    assert theirs[-1] == pytest.approx(0.0025)  # two reductions


def test_a_param_group_added_after_the_freezer_goes_back_into_the_optimizer_at_a_thaw():
    # the Freezer took what the optimizer held when it was built as all it would ever hold: a block whose group was
    # added after it left the optimizer at a freeze and never came back (rotations trained it once, then never)
    model = net()
    blocks = discover_blocks(model)
    groups = block_param_groups(model, blocks, lr=1e-2)
    optimizer = torch.optim.SGD([groups[0], groups[3]], lr=1e-2)  # the first block and the head
    with Freezer(model, optimizer, "none", blocks=blocks) as freezer:
        optimizer.add_param_group(groups[1])  # block 2 trains from now on (two-stage fine-tuning)
        freezer.freeze(1)
        freezer.thaw(1)
        assert [len(g["params"]) for g in optimizer.param_groups] == [2, 2, 2]
        before = model[2].weight.detach().clone()
        train(model, optimizer, freezer, range(1))
        assert not torch.equal(model[2].weight, before)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    # "object of type 'int' has no len()" from the pattern matching
    ({"blocks": [0, 2]}, TypeError, r"^blocks must be a list of module-name patterns \(str\), front to back, got int 0 "
                                    r"at position 0: name each block's module"),
    # "'dict' object has no attribute 'blocks_freeze'" from the first stage
    ({"guard": {"tolerance": 0.05}}, TypeError, r"^Freezer\(guard=\.\.\.\) must be a layerfreeze\.StabilityGuard"),
    # "'int' object is not callable" from the start stage's first freeze
    ({"on_event": 5}, TypeError, r"^Freezer\(on_event=\.\.\.\) must be a function of one record \(a dict\) or None, "
                                 r"not int 5$"),
    # bool("no") is True: refused as a request for a process group ("Freezer(distributed=True) needs ...")
    ({"distributed": "no"}, TypeError, r"^Freezer\(distributed=\.\.\.\) must be True or False, not 'no'$"),
    # bool("no") is True: BatchNorm layers of frozen blocks kept training
    ({"train_bn": "no"}, TypeError, r"^Freezer\(train_bn=\.\.\.\) must be True or False, not 'no'$"),
])
def test_a_freezer_option_of_the_wrong_type_is_refused_in_one_line_before_anything_freezes(kwargs, error, message):
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(error, match=message):
        Freezer(model, optimizer, "static", {"k": 2}, **kwargs)
    assert all(p.requires_grad for p in model.parameters())
    with Freezer(model, optimizer, "static", {"k": 2}) as freezer:  # nothing claimed the model
        assert freezer.frozen_blocks == ["0", "2"]


class Noise(nn.Module):
    """A parameter-free noise layer: samples in training mode, nothing the cache's module check knows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn_like(x) if self.training else x


@pytest.mark.parametrize("fallback", [False, True])
def test_a_prefix_that_draws_random_numbers_is_not_cached(fallback):
    # the noise between two frozen blocks was drawn once and served from the cache at every step after (the model's
    # own forward draws anew): it trained on one frozen sample of the noise, in silence
    from layerfreeze import CachedPrefix, CacheRefused

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Noise(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Freezer(model, optimizer, "static", {"k": 2}) as freezer:
        forward = CachedPrefix(model, freezer=freezer, fallback=fallback)
        batch = {"x": torch.randn(4, 8), "labels": torch.tensor([0, 1, 2, 0]), "index": torch.arange(4)}
        if not fallback:
            with pytest.raises(CacheRefused, match=r"^the frozen prefix \(depth 2\) drew random numbers as it ran"):
                forward(batch)
            return
        with pytest.warns(RuntimeWarning, match="activation cache turned off.*drew random numbers"):
            first = forward(batch)
        second = forward(batch)
        assert forward.disabled is not None and forward.stats()["hits"] == 0
        assert not torch.equal(first, second)  # fresh noise at every forward, as the model's own


def test_an_optimizer_loaded_before_the_freezer_is_built_keeps_its_state():
    # model, optimizer, their states, then the Freezer and its state: the start stage freed the state of what it froze
    # and the restore cleared the rest, so the run went on from zero Adam moments
    def build():
        model = net()
        return model, torch.optim.AdamW(block_param_groups(model, discover_blocks(model), lr=1e-2))

    model, optimizer = build()
    freezer = Freezer(model, optimizer, "linear", total_steps=8, steps_per_epoch=4)  # nothing frozen before epoch 1
    train(model, optimizer, freezer, range(2))
    saved = copy.deepcopy({"m": model.state_dict(), "o": optimizer.state_dict(), "f": freezer.state_dict()})
    train(model, optimizer, freezer, range(2, 4))
    freezer.close()
    model2, optimizer2 = build()
    model2.load_state_dict(saved["m"])
    optimizer2.load_state_dict(saved["o"])
    freezer2 = Freezer(model2, optimizer2, "linear", total_steps=8, steps_per_epoch=4)
    freezer2.load_state_dict(saved["f"])
    assert len(optimizer2.state) == 8
    train(model2, optimizer2, freezer2, range(2, 4))
    freezer2.close()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))


def test_a_thaw_under_a_one_cycle_schedule_the_freezer_was_not_given_keeps_its_lr_without_a_false_warning():
    # "its next step sets the LR back" was warned, but OneCycleLR schedules from the group's max_lr / min_lr, which
    # the thaw scales: the discriminative LR stayed
    model = net()
    optimizer = torch.optim.SGD(block_param_groups(model, discover_blocks(model), lr=1e-2))
    with Freezer(model, optimizer, "gradual", {"every_steps": 1}, total_steps=8) as freezer:
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            train(model, optimizer, freezer, range(1), scheduler)  # thaws block 2 at lr(head) / 2.6
        train(model, optimizer, freezer, range(1, 2), scheduler)
        lrs = [g["lr"] for g in optimizer.param_groups]
        assert lrs[2] == pytest.approx(lrs[3] / 2.6, rel=1e-12)


@pytest.mark.parametrize("steps_per_epoch", [3, None])
def test_a_loop_that_never_calls_epoch_end_is_warned_under_a_strategy_that_decides_only_there(steps_per_epoch):
    # gradual thaws at epoch ends: without freezer.epoch_end() it trained only the head for the whole run, in silence
    model = net()
    optimizer = torch.optim.AdamW(block_param_groups(model, discover_blocks(model), lr=1e-2))
    with Freezer(model, optimizer, "gradual", total_steps=12, steps_per_epoch=steps_per_epoch) as freezer:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(model, optimizer, freezer, range(12))
        said = [str(w.message) for w in caught if "epoch_end" in str(w.message)]
        span = "6 optimizer steps (3 per epoch)" if steps_per_epoch else "7 optimizer steps (the run has 12)"
        assert said == [f"freezer.epoch_end() has not been called for {span}: strategy 'gradual' decides only at "
                        "epoch ends, so it has made no decision since its start. Call freezer.epoch_end() after each "
                        "epoch's last step"]
        assert caught[0].filename == __file__
    model = net()  # the same loop calling epoch_end() is not warned
    optimizer = torch.optim.AdamW(block_param_groups(model, discover_blocks(model), lr=1e-2))
    with Freezer(model, optimizer, "gradual", total_steps=12, steps_per_epoch=steps_per_epoch) as freezer:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for epoch in range(4):
                train(model, optimizer, freezer, range(3 * epoch, 3 * epoch + 3))
                freezer.epoch_end()
        assert freezer.frozen_blocks == []


def test_freezeout_factors_apply_once_when_a_grad_scaler_skips_steps_under_a_warmup():
    # a skipped step ran no step hook: LinearLR found the scaled LR and took the factor in, once per skipped step
    # (two skips: 3.6x FreezeOut's LR to the warm-up's end)
    model = net()
    optimizer = torch.optim.SGD(block_param_groups(model, discover_blocks(model), lr=1e-2))
    reference = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1e-2)
    warmup = lambda opt: torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, total_iters=5)  # noqa: E731
    scheduler, schedule = warmup(optimizer), warmup(reference)
    scaler = torch.amp.GradScaler("cpu")
    freezer = Freezer(model, optimizer, "freezeout", scheduler=scheduler, total_steps=12)
    ratios = []
    for t in range(5):
        loss = nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 0]))
        scaler.scale(loss).backward()
        freezer.after_backward()
        if t < 2:
            model[6].weight.grad[0, 0] = float("inf")  # the scaler skips this step
        scaler.step(optimizer)
        scaler.update()
        reference.step()
        optimizer.zero_grad()
        scheduler.step()
        schedule.step()
        freezer.step()
        ratios.append(optimizer.param_groups[0]["lr"] / freezer._lr_scale[0] / reference.param_groups[0]["lr"])
    freezer.close()
    assert ratios == pytest.approx([1.0] * 5, rel=1e-12)


def test_freezeout_factors_apply_once_under_a_per_epoch_step_lr_stepped_after_epoch_end():
    model = net()
    optimizer = torch.optim.SGD(block_param_groups(model, discover_blocks(model), lr=1e-2))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    with Freezer(model, optimizer, "freezeout", scheduler=scheduler, total_steps=12) as freezer:
        for epoch in range(3):
            train(model, optimizer, freezer, range(2 * epoch, 2 * epoch + 2))
            assert optimizer.param_groups[3]["lr"] / freezer._lr_scale[3] == pytest.approx(0.01 * 0.5 ** epoch)
            freezer.epoch_end()
            scheduler.step()  # it multiplied the scaled LR: 0.0047, 0.0017 where the schedule says 0.005, 0.0025


def test_inputs_cast_with_the_model_after_caching_are_named_among_the_causes():
    # the refusal named augmentation, a wrong index and two datasets, none of them what happened: the user had cast
    # the model and its inputs to bfloat16 (rounding the inputs changed their fingerprint)
    from layerfreeze import CachedPrefix, CacheRefused

    model = net()
    with Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "static", {"k": 2}) as freezer:
        forward = CachedPrefix(model, freezer=freezer)
        x = torch.randn(4, 8)
        forward({"x": x, "index": torch.arange(4)})
        model.to(torch.bfloat16)
        with pytest.raises(CacheRefused, match=r"or inputs cast to another dtype since \(model\.to\(torch\.bfloat16\) "
                                               r"with its inputs: build a new CachedPrefix after the cast\)$"):
            forward({"x": x.to(torch.bfloat16), "index": torch.arange(4)})


def test_a_scheduler_that_is_no_scheduler_and_an_unknown_demote_setting_are_refused_at_construction():
    # scheduler="cosine" was kept and failed at the first thaw that sets an LR; demote={"bogus": 1} raised
    # "Demotion.__init__() got an unexpected keyword argument 'bogus'"
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"^Freezer\(scheduler=\.\.\.\) must be the LR scheduler object you step .* "
                                        r"not str 'cosine'$"):
        Freezer(model, optimizer, "none", scheduler="cosine")
    with pytest.raises(TypeError, match=r"^demote has no setting 'bogus': its settings are dtype, offload, master, "
                                        r"directory, e.g. \{'dtype': 'bfloat16'\}$"):
        Freezer(model, optimizer, "none", demote={"dtype": "bfloat16", "bogus": 1})
    assert all(p.requires_grad for p in model.parameters())  # refused before anything froze
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with Freezer(model, optimizer, "static", {"k": 1}, scheduler=scheduler, demote={"dtype": "bfloat16"}) as freezer:
        assert freezer.scheduler is scheduler and freezer.frozen_blocks == ["0"]


def test_the_cache_on_a_compiled_model_says_to_give_it_the_model_before_compiling():
    # "Cannot split the forward of OptimizedModule ... Supported families: ..." named every family and no way out
    from layerfreeze.models.discovery import split_for

    model = net()
    compiled = torch.compile(model)
    with pytest.raises(ValueError, match=r"^Cannot split the forward of a torch\.compile'd Sequential for the "
                                         r"activation cache: give the cache the model before compiling "
                                         r"\(model\._orig_mod\), and compile its blocks instead"):
        split_for(compiled, discover_blocks(model))
    assert split_for(model, discover_blocks(model)) is not None  # the model itself splits
