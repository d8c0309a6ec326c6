"""``lisa`` and ``badam``: the layers that train rotate. What the papers prescribe (which blocks, how often, in which
order, fresh Adam state on every switch) and what the engine must give them: optimizer state only for the blocks
trainable now, every switched-on block trained, frozen blocks bitwise unchanged while frozen, the FLOPs of a
non-prefix freeze, a warning when the optimizer does not update what was switched on (DeepSpeed#5639), exact resume
across a switch in the CLI trainer, and an activation cache that serves only a truly frozen prefix."""

from __future__ import annotations

import json
import warnings
from collections import Counter

import pytest
import torch
from torch import nn

from layerfreeze import Freezer
from layerfreeze.errors import ConfigError
from layerfreeze.runs.measure import measure_flops
from layerfreeze.strategies import LISA, BAdam, create_strategy
from layerfreeze.train.config import build_config
from layerfreeze.train.data import GaussianBlobs
from layerfreeze.train.setup import build_strategy
from layerfreeze.train.tasks import Task, image_forward
from layerfreeze.train.trainer import Trainer

LAYERS = 4  # middle layers of the test model: blocks 0 (input layer), 1-4 (middle), 5 (head)


def model(seed: int = 0) -> nn.Sequential:
    """Six blocks: Linear(8, 16), four Linear(16, 16) + Tanh, the head Linear(16, 3)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), *[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(LAYERS)],
                         nn.Linear(16, 3))


def params_of(freezer: Freezer, indices) -> set[int]:
    return {id(p) for i in indices for p in freezer.blocks[i].parameters()}


def trainable(freezer: Freezer) -> list[int]:
    return [i for i, f in enumerate(freezer.frozen) if not f]


def train_loop(strategy: str, params: dict, steps: int, optimizer_cls=torch.optim.AdamW, seed: int = 0):
    """``steps`` AdamW steps on random data with a Freezer; after each step, the block weights, the frozen set, the
    blocks that have optimizer state, and each param's Adam step count."""
    net = model(seed)
    optimizer = optimizer_cls(net.parameters(), lr=1e-2)
    freezer = Freezer(net, optimizer, strategy, params)
    g = torch.Generator().manual_seed(1)
    record = [{"frozen": list(freezer.frozen), "weights": weights(freezer), "state": set(), "steps": {}}]
    for _ in range(steps):
        x = torch.randn(8, 8, generator=g)
        net(x).pow(2).mean().backward()
        freezer.after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stepped = {id(p) for p in optimizer.state}
        adam_steps = {i: [int(optimizer.state[p]["step"]) for p in b.parameters() if p in optimizer.state]
                      for i, b in enumerate(freezer.blocks)}
        during = list(record[-1]["frozen"])
        freezer.step()
        record.append({"frozen": list(freezer.frozen), "frozen_during": during, "weights": weights(freezer),
                       "state_after_step": stepped, "state": {id(p) for p in optimizer.state}, "steps": adam_steps})
    return freezer, optimizer, record


def weights(freezer: Freezer) -> list[list[torch.Tensor]]:
    return [[p.detach().clone() for p in b.parameters()] for b in freezer.blocks]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


CASES = [
    ("lisa", {"gamma": 2, "k": 3}),
    ("lisa", {"gamma": 1, "k": 1}),
    ("badam", {"k": 2}),
    ("badam", {"k": 3, "order": "descending"}),
    ("badam", {"k": 2, "order": "random", "include_embedding": True}),
]


@pytest.mark.parametrize("strategy, params", CASES)
def test_state_only_for_trainable_blocks_fresh_on_switch_and_frozen_blocks_bitwise(strategy, params):
    freezer, optimizer, record = train_loop(strategy, params, steps=24)
    switches = [t for t in range(1, len(record)) if record[t]["frozen"] != record[t - 1]["frozen"]]
    assert len(switches) >= 4  # the run exercises several switches
    thaws = [(h["index"], h["step"]) for h in freezer.history if h["kind"] == "thaw"]
    for t in range(1, len(record)):
        r, before = record[t], record[t - 1]
        on = [i for i, f in enumerate(r["frozen_during"]) if not f]
        # after the optimizer step: state exists for exactly the blocks that trained in it
        assert r["state_after_step"] == params_of(freezer, on), t
        # after the stage: only for blocks trainable now, none for a block that just switched on
        now = [i for i, f in enumerate(r["frozen"]) if not f]
        assert r["state"] <= params_of(freezer, now), t
        assert not r["state"] & params_of(freezer, [i for i, s in thaws if s == t]), t
        for i, (w, w0) in enumerate(zip(r["weights"], before["weights"])):
            # a frozen block is bitwise what it was; a trainable one (a switched-on one included) changed
            assert same(w, w0) == r["frozen_during"][i], (t, i)
            if i in on:  # fresh state: the Adam step count restarted when the block last switched on
                since = max([s for j, s in thaws if j == i and s < t], default=0)
                assert r["steps"][i] == [t - since] * 2, (t, i)


def test_a_block_sampled_again_restarts_its_adam_state_the_embeddings_and_head_never_do():
    freezer, optimizer, record = train_loop("lisa", {"gamma": 3, "k": 2}, steps=8)  # 3 of 4: repeats are certain
    head, first = len(freezer.blocks) - 1, 0
    assert record[-1]["steps"][head] == [8, 8] and record[-1]["steps"][first] == [8, 8]
    # every middle block trainable in the last period restarted at the switch after step 6
    for i in range(1, 1 + LAYERS):
        if not record[-1]["frozen_during"][i]:
            assert record[-1]["steps"][i] == [2, 2], i
    history = [(h["kind"], h["index"], h["step"]) for h in freezer.history]
    resampled = [i for (kind, i, step) in history if kind == "thaw" and step == 6
                 and ("freeze", i, 6) in history]
    assert resampled, "with gamma 3 of 4 a layer is sampled in two periods in a row"


def test_lisa_keeps_embeddings_and_head_trainable_and_samples_gamma_layers_uniformly():
    net = model()
    freezer = Freezer(net, None, "lisa", {"gamma": 2, "k": 1, "seed": 3})
    counts: Counter[int] = Counter()
    for _ in range(400):
        on = trainable(freezer)
        assert on[0] == 0 and on[-1] == 5 and len(on) == 2 + 2
        counts.update(on[1:-1])
        freezer.step()
    # 400 periods x 2 of 4 layers: 200 per layer expected; binomial sd ~10
    assert sorted(counts) == [1, 2, 3, 4] and all(160 < c < 240 for c in counts.values()), counts


def test_lisa_samples_are_the_seeds_and_seed_none_is_the_runs_seed():
    def samples(run_seed=None, **params):
        net = model()  # seeds torch with 0
        if run_seed is not None:
            torch.manual_seed(run_seed)
        freezer = Freezer(net, None, "lisa", {"gamma": 2, "k": 1, **params})
        out = []
        for _ in range(10):
            out.append(tuple(trainable(freezer)))
            freezer.step()
        return out

    assert samples(seed=1) == samples(seed=1) != samples(seed=2)
    torch.manual_seed(7)
    assert LISA().seed == 7 and samples(run_seed=7) == samples(seed=7) != samples(run_seed=8)
    net = model()
    state = torch.get_rng_state()
    freezer = Freezer(net, None, "lisa", {"gamma": 2, "k": 1, "seed": 1})
    for _ in range(10):
        freezer.step()
    assert torch.equal(state, torch.get_rng_state())  # the global generator is never drawn from


def badam_actives(steps: int, **params) -> list[int]:
    freezer = Freezer(model(), None, "badam", {"k": 1, **params})
    out = []
    for _ in range(steps):
        on = trainable(freezer)
        assert on[-1] == 5 and len(on) == 2  # the active block and the head
        out.append(on[0])
        freezer.step()
    return out


def test_badam_orders_start_block_and_embeddings():
    assert badam_actives(9) == [1, 2, 3, 4, 1, 2, 3, 4, 1]
    assert badam_actives(9, order="descending") == [4, 3, 2, 1, 4, 3, 2, 1, 4]
    assert badam_actives(6, start_block=2) == [3, 4, 1, 2, 3, 4]
    assert badam_actives(6, include_embedding=True) == [0, 1, 2, 3, 4, 0]
    shuffled = badam_actives(20, order="random", seed=5)
    for epoch in range(5):  # random reshuffling: every block once per block-epoch
        assert sorted(shuffled[4 * epoch: 4 * epoch + 4]) == [1, 2, 3, 4], shuffled
    assert shuffled != badam_actives(20, order="random", seed=6)
    assert badam_actives(20, order="random", seed=5) == shuffled
    assert BAdam().k == 50 and BAdam().order == "ascending" and not BAdam().include_embedding
    assert LISA().gamma == 2 and LISA().k == 20


def test_badam_switches_every_k_steps_with_the_active_block_in_the_signals():
    freezer = Freezer(model(), None, "badam", {"k": 3})
    seen = []
    for _ in range(9):
        decision = freezer.step()
        if decision is not None:
            seen.append((freezer.step_count, decision.freeze, decision.thaw, decision.signals["active_block"]))
    assert seen == [(3, [1], [2], 2), (6, [2], [3], 3), (9, [3], [4], 4)]


def linear_flops(batch: int, shapes: list[tuple[int, int]], wgrad: set[int], igrad: set[int]) -> int:
    """Forward, weight-gradient and input-gradient matmul FLOPs of a stack of Linear layers (2 per multiply-add)."""
    cost = [2 * batch * i * o for i, o in shapes]
    return sum(cost) + sum(cost[j] for j in wgrad) + sum(cost[j] for j in igrad)


def test_flops_show_that_a_frozen_layer_above_a_trainable_one_still_runs_backward():
    shapes = [(8, 16)] + [(16, 16)] * LAYERS + [(16, 3)]
    x = torch.randn(8, 8)

    def step_flops(freezer):
        def step():
            freezer.model(x).pow(2).mean().backward()
        return measure_flops(step)[1]

    lisa = Freezer(model(), None, "lisa", {"gamma": 2, "seed": 0})
    on = set(trainable(lisa))
    # the embeddings (block 0) train: every block above them computes its input gradient, only trainable ones
    # their weight gradients
    assert step_flops(lisa) == linear_flops(8, shapes, wgrad=on, igrad=set(range(1, 6)))
    badam = Freezer(model(), None, "badam", {"start_block": 1})  # block 2 active, 0-1 a frozen prefix
    assert trainable(badam) == [2, 5]
    assert step_flops(badam) == linear_flops(8, shapes, wgrad={2, 5}, igrad={3, 4, 5})
    full = Freezer(model(), None, "none")
    assert step_flops(full) == linear_flops(8, shapes, wgrad=set(range(6)), igrad=set(range(1, 6)))


class CapturedOptimizer(torch.optim.SGD):
    """Updates only the parameters it was built with, whatever its param groups hold later: an optimizer with its
    own copy of the parameter list (DeepSpeed ZeRO-3's flat partitions, DeepSpeed#5639)."""

    def __init__(self, params, lr):
        params = list(params)
        super().__init__(params, lr=lr)
        self.captured = params

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.captured:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.defaults["lr"])


@pytest.mark.parametrize("fused", [False, True])
def test_no_warning_when_the_optimizer_updates_what_was_switched_on(fused):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_loop("badam", {"k": 2}, steps=8, optimizer_cls=lambda p, lr: torch.optim.AdamW(p, lr=lr, fused=fused))


def test_a_switched_on_block_the_optimizer_does_not_update_is_named():
    net = model()
    freezer = Freezer(net, None, "badam", {"k": 2})  # block 1 active: the optimizer is built after the freeze
    optimizer = CapturedOptimizer([p for p in net.parameters() if p.requires_grad], lr=0.1)
    freezer.attach_optimizer(optimizer)
    events = []
    freezer.on_event = events.append
    with pytest.warns(UserWarning, match=r"block\(s\) 2 were switched on and got gradients, but the optimizer step"):
        for _ in range(3):
            net(torch.randn(4, 8)).sum().backward()
            freezer.after_backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            freezer.step()
    assert [e["blocks"] for e in events if e["kind"] == "not_updated"] == [["2"]]


@pytest.mark.parametrize("cls, kwargs, match", [
    (LISA, {"gamma": 0}, "gamma must be an integer >= 1"),
    (LISA, {"gamma": 1.5}, "gamma must be an integer >= 1"),
    (LISA, {"k": 0}, "k must be an integer >= 1"),
    (LISA, {"k": True}, "k must be an integer >= 1"),
    (LISA, {"seed": "a"}, "seed must be an integer or None"),
    (BAdam, {"k": -1}, "k must be an integer >= 1"),
    (BAdam, {"order": "sideways"}, "order must be one of ascending, descending, random"),
    (BAdam, {"start_block": -1}, "start_block must be an integer >= 0"),
    (BAdam, {"include_embedding": "yes"}, "include_embedding must be true or false"),
])
def test_bad_parameters_are_rejected_with_a_message_naming_them(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_parameters_that_do_not_fit_the_model_are_refused_before_training():
    with pytest.raises(ValueError, match=r"gamma=5 but this model has 4 middle layer\(s\)"):
        create_strategy("lisa", {"gamma": 5}, num_blocks=6)
    with pytest.raises(ValueError, match="LISA needs embeddings, at least one middle layer and a head"):
        create_strategy("lisa", {"gamma": 1}, num_blocks=2)
    with pytest.raises(ValueError, match=r"start_block=4 but the rotation has 4 block\(s\)"):
        Freezer(model(), None, "badam", {"start_block": 4})
    with pytest.raises(ValueError, match="set include_embedding=true"):
        create_strategy("badam", {}, num_blocks=2)
    create_strategy("badam", {"include_embedding": True}, num_blocks=2)
    cfg = build_config({"freeze": {"strategy": "lisa", "params": {"gamma": 9}}})
    with pytest.raises(ConfigError, match="freeze.params: lisa: gamma=9"):
        build_strategy(cfg, 9)


def test_a_state_round_trip_through_json_continues_the_same_samples():
    for name, params in [("lisa", {"gamma": 2, "k": 1}), ("badam", {"k": 1, "order": "random"})]:
        full = Freezer(model(), None, name, params)
        part = Freezer(model(), None, name, params)
        for _ in range(5):
            full.step()
            part.step()
        resumed = Freezer(model(), None, name, params)
        resumed.load_state_dict(json.loads(json.dumps(part.state_dict())))
        for _ in range(12):
            full.step()
            resumed.step()
            assert resumed.frozen == full.frozen
        assert resumed.strategy.state_dict() == full.strategy.state_dict()


# ---- the CLI trainer ------------------------------------------------------------------------------------------------


def task() -> Task:
    net = nn.Sequential(nn.Linear(16, 24), *[nn.Sequential(nn.Linear(24, 24), nn.ReLU()) for _ in range(3)],
                        nn.Linear(24, 4))
    torch.manual_seed(0)
    for p in net.parameters():
        nn.init.normal_(p, std=0.2)
    return Task("blobs", net, GaussianBlobs(96, seed=1), GaussianBlobs(32, seed=2), 4, "mlp", image_forward)


def trainer_config(tmp_path, name, strategy, params, cache="off", **run):
    return build_config({
        "train": {"epochs": 3, "batch_size": 16, "lr": 0.01, "warmup_fraction": 0.0},
        "freeze": {"strategy": strategy, "params": params, "cache": {"mode": cache}},
        "run": {"dir": str(tmp_path / name), "progress": False, "tensorboard": False, **run},
    })


@pytest.mark.parametrize("strategy, params", [("lisa", {"gamma": 1, "k": 4}),
                                              ("badam", {"k": 4, "order": "random"})])
def test_resume_from_a_checkpoint_between_switches_equals_the_uninterrupted_run(tmp_path, one_thread, strategy, params):
    # 18 steps, switches after steps 4, 8, 12, 16; the checkpoint of step 10 is mid-period, two switches ahead
    ref = Trainer(trainer_config(tmp_path, "ref", strategy, params, checkpoint_every_steps=5, keep_checkpoints=10),
                  task=task())
    ref.run()
    checkpoint = next((tmp_path / "ref" / "checkpoints").glob("*-step000000010"))
    cfg = trainer_config(tmp_path, "resumed", strategy, params)
    cfg.run.resume = str(checkpoint)
    resumed = Trainer(cfg, task=task())
    summary = resumed.run()
    assert summary["steps"] == 18
    assert resumed.freezer.history == ref.freezer.history
    assert sum(h["kind"] == "thaw" and h["step"] > 10 for h in ref.freezer.history) >= 2
    for (name, a), b in zip(ref.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed.freezer.strategy.state_dict() == ref.freezer.strategy.state_dict()


def test_the_cache_serves_nothing_under_lisa_the_embeddings_train(tmp_path, one_thread):
    trainer = Trainer(trainer_config(tmp_path, "lisa", "lisa", {"gamma": 1, "k": 4}, cache="on"), task=task())
    summary = trainer.run()
    assert summary["cache"]["used"] and summary["cache"]["hits"] == summary["cache"]["misses"] == 0
    runner = trainer.runner  # the frozen prefix is empty all run: every step ran the model's own forward
    assert runner.full_forwards == 18 and runner.prefix_samples == runner.extend_samples == 0


def test_the_cache_under_badam_follows_the_moving_prefix_without_stale_outputs(tmp_path, one_thread):
    # ascending, 12 steps (two epochs) per block, 8 epochs: the frozen prefix is block 0, then 0-1, then 0-2, then 0
    # again (the rotation wraps: block 1 trains again, so every entry that went through it must go), then 0-1
    runs = {}
    for cache in ("off", "on"):
        cfg = trainer_config(tmp_path, cache, "badam", {"k": 12}, cache=cache)
        cfg.train.epochs = 8
        runs[cache] = Trainer(cfg, task=task())
        runs[cache].summary = runs[cache].run()
    on = runs["on"]
    assert [h["index"] for h in on.freezer.history if h["kind"] == "thaw"] == [2, 3, 1, 2]
    # the second epoch of each block is served from the cache; extended from the older boundary when it moved up
    assert on.summary["cache"]["hits"] == 4 * 96 and on.runner.extend_samples > 0
    for (name, a), b in zip(runs["off"].model.state_dict().items(), on.model.state_dict().values()):
        assert torch.equal(a, b), name
