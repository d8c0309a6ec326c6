"""Egeria (Wang et al., EuroSys 2023): SP loss, the freezing rule on crafted plasticity series, and the strategy
with the real Freezer (probe capture, int8 reference, background worker, errors, resume)."""

from __future__ import annotations

import copy
import io
import math
import threading
import warnings

import pytest
import torch
from torch import nn

from layerfreeze import Freezer
from layerfreeze.strategies import StageContext
from layerfreeze.strategies.base import BlockView
from layerfreeze.strategies.egeria import reference as egeria_reference
from layerfreeze.strategies.egeria.plasticity import plasticity_decision, sp_loss
from layerfreeze.strategies.egeria.reference import build_reference
from layerfreeze.strategies.egeria.reference import cpu_copy as _cpu_copy
from layerfreeze.strategies.egeria.strategy import THREAD_PREFIX, Egeria

# ---- sp_loss ---------------------------------------------------------------------------------------------------


def test_sp_loss_of_equal_activations_is_zero():
    a = torch.randn(6, 3, 4)
    assert sp_loss(a, a.clone()) == 0.0


def test_sp_loss_hand_computed_2x2():
    # A = I: G_a = I, rows already unit.  B = [[1,0],[1,0]]: G_b = [[1,1],[1,1]], rows -> [1,1]/sqrt(2).
    # G_a - G_b = [[1 - 1/sqrt2, -1/sqrt2], [-1/sqrt2, 1 - 1/sqrt2]]
    # ||.||_F^2 = 2 (1 - 1/sqrt2)^2 + 2 (1/2) = 4 - 2 sqrt2;  / B^2 = / 4  ->  1 - sqrt2 / 2 = 0.29289...
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    b = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert sp_loss(a, b) == pytest.approx(1 - math.sqrt(2) / 2, abs=1e-12)
    assert sp_loss(b, a) == pytest.approx(1 - math.sqrt(2) / 2, abs=1e-12)


def test_sp_loss_is_invariant_to_scaling_and_compares_only_sample_similarities():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 7, generator=g), torch.randn(5, 3, 2, generator=g)  # trailing shapes may differ
    base = sp_loss(a, b)
    assert base > 0
    assert sp_loss(3.5 * a, b) == pytest.approx(base, rel=1e-6)  # float32 inputs
    assert sp_loss(a.double(), 0.01 * b.double()) == pytest.approx(base, rel=1e-6)
    with pytest.raises(ValueError, match="batch"):
        sp_loss(a, torch.randn(4, 7))


# ---- the freezing rule on crafted series ----------------------------------------------------------------------

# tolerance 0.1, patience 3. Relative changes of STABLE: 0.4, 0.167, 0.04, 0.0104, 0.0021 -> counts 0, 0, 1, 2, 3,
# so the rule first holds at evaluation index 5 (the sixth value).
STABLE = [1.0, 0.6, 0.5, 0.48, 0.475, 0.474, 0.474, 0.474, 0.474, 0.474]


def test_plasticity_decision_holds_first_at_the_hand_computed_index():
    answers = [plasticity_decision(STABLE[: k + 1], tolerance=0.1, patience=3) for k in range(len(STABLE))]
    assert answers.index(True) == 5
    assert all(answers[5:])
    assert not plasticity_decision(STABLE[:6], tolerance=0.1, patience=4)   # one more stable change needed
    assert not plasticity_decision([1.0, 2.0, 1.0, 2.0, 1.0], tolerance=0.1, patience=1)
    assert plasticity_decision([0.0, 0.0], tolerance=0.1, patience=1)       # eps: 0 -> 0 is no change


def _ctx(frozen: list[bool]) -> StageContext:
    names = ["a", "b", "c", "head"]
    views = [BlockView(n, i, frozen[i], n == "head", 10) for i, n in enumerate(names)]
    return StageContext(step=0, epoch=0, event="step", blocks=views)


def test_strategy_freezes_the_front_block_at_the_exact_evaluation_one_block_per_evaluation():
    # Blocks a and b follow STABLE (both stable from evaluation 5); c alternates and never settles. Only the front
    # active block may freeze: a at evaluation 5, b (already stable, count 4) at evaluation 6, then nothing.
    strategy = Egeria(tolerance=0.1, patience=3, synchronous=True)
    frozen = [False] * 4
    freezes = []
    for e in range(len(STABLE)):
        plasticity = [STABLE[e], STABLE[e], 1.0 + (e % 2), 0.5]
        decision = strategy.apply_evaluation(plasticity, _ctx(frozen))
        assert len(decision.freeze) <= 1
        for i in decision.freeze:
            frozen[i] = True
            freezes.append((e, i))
        if e == 4:
            assert decision.signals["stable_count"][:3] == [2.0, 2.0, 0.0]
            assert math.isnan(decision.signals["stable_count"][3])  # head: never measured
    assert freezes == [(5, 0), (6, 1)]
    assert frozen == [True, True, False, False]
    last = strategy.apply_evaluation([0.474, 0.474, 1.0, 0.5], _ctx(frozen)).signals
    assert math.isnan(last["plasticity"][0]) and math.isnan(last["plasticity_change"][1])  # frozen -> NaN


def test_a_reference_refresh_compares_the_next_value_with_the_new_baseline():
    strategy = Egeria(tolerance=0.1, patience=1, synchronous=True)
    frozen = [False] * 4
    strategy.apply_evaluation([1.0, 1.0, 1.0, None], _ctx(frozen))
    # After a refresh the plasticity drops to the quantization floor (0.01); the baseline says so.
    strategy.apply_evaluation([1.0, 1.0, 1.0, None], _ctx(frozen), baseline=[0.01, 0.01, 0.01, None])
    decision = strategy.apply_evaluation([0.0101, 0.5, 0.0101, None], _ctx(frozen))
    assert decision.signals["plasticity_change"][0] == pytest.approx(0.01)
    assert decision.signals["plasticity_change"][1] == pytest.approx(49.0)
    assert decision.freeze == [0]


def test_a_refresh_every_patience_evaluations_or_sooner_freezes_nothing_and_is_warned_about():
    # a stable block (plasticity 1.0 at every evaluation) against a refresh every R evaluations: the evaluation after a
    # refresh compares 1.0 with the new reference's noise floor (1e-4) and restarts the count, so the count reaches at
    # most R - 1 (evaluations 2..R of each window)
    def first_freeze(refresh_every: int, patience: int) -> int | None:
        strategy = Egeria(refresh_every=refresh_every, tolerance=0.1, patience=patience, synchronous=True)
        frozen = [False] * 4
        for e in range(1, 31):
            refresh = e % refresh_every == 0
            decision = strategy.apply_evaluation([1.0, 1.0, 1.0, None], _ctx(frozen),
                                                 baseline=[1e-4, 1e-4, 1e-4, None] if refresh else None)
            if decision.freeze:
                return e
        return None

    with pytest.warns(UserWarning, match="refresh_every=3 <= patience=3.*usually nothing freezes"):
        assert first_freeze(3, 3) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert first_freeze(4, 3) == 4  # evaluations 2, 3, 4 are stable
        assert first_freeze(10, 3) == 4


# ---- with the real Freezer ------------------------------------------------------------------------------------


def make_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def train(model, optimizer, freezer, steps, g, batches=None):
    decisions = []
    for _ in range(steps):
        model.train()
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        if batches is not None:
            batches.append(x)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        decisions.append(freezer.step())
    return decisions


def test_synchronous_run_captures_probe_uses_int8_reference_and_freezes_a_prefix_at_exact_steps():
    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    # A huge tolerance makes every comparable change "stable", so the steps are known in advance:
    # evaluations at steps 5, 10, 15, ...; the first has nothing to compare with (count 0), then counts 1, 2 ->
    # block 0 freezes at step 15 (patience 2); blocks 1 and 2 are already stable and follow one per evaluation.
    strategy = Egeria(interval=5, refresh_every=2, tolerance=1e6, patience=2, probe_size=4, synchronous=True)
    freezer = Freezer(model, optimizer, strategy=strategy)
    assert strategy.probe is None and len(model._forward_pre_hooks) == 1

    # The reference: nn.Linear layers are PyTorch dynamic int8 modules (this build has a quantization engine).
    assert strategy.reference_report["scheme"] == "dynamic"
    assert strategy.reference_report["dynamic_int8"] == ["0", "2", "4", "6"]
    for name in ("0", "2", "4", "6"):
        module = strategy.reference.get_submodule(name)
        assert type(module).__module__.startswith("torch.ao.nn.quantized.dynamic")
        assert module.weight().dtype == torch.qint8
    assert not any(p.requires_grad for p in strategy.reference.parameters())
    assert not strategy.reference.training

    model.eval()
    model(torch.randn(16, 8))  # an eval-mode forward is not a training forward: no capture
    assert strategy.probe is None

    g, batches = torch.Generator().manual_seed(1), []
    decisions = train(model, optimizer, freezer, 40, g, batches)
    args, kwargs = strategy.probe
    assert torch.equal(args[0], batches[0][:4]) and kwargs == {}
    # the capture hook removed itself; what is left is the Freezer's own (frozen blocks back to eval mode)
    assert list(model._forward_pre_hooks.values()) == [freezer._eval_frozen_blocks]

    assert [(r["block"], r["step"]) for r in freezer.history] == [("0", 15), ("2", 20), ("4", 25)]
    assert freezer.frozen == [True, True, True, False]  # a prefix, never the head
    assert strategy.evaluations == 5 and strategy.refreshes == 2  # refreshes after evaluations 2 and 4
    for d in decisions:
        if d is not None and "plasticity" in d.signals:
            values = d.signals["plasticity"]
            assert math.isnan(values[3])
            active = [v for v, f in zip(values, freezer.frozen) if not math.isnan(v)]
            assert all(math.isfinite(v) and v >= 0 for v in active)
    first = decisions[4].signals  # step 5
    assert first["evaluation_step"] == 5.0 and all(math.isfinite(v) for v in first["plasticity"][:3])
    at_25 = decisions[24].signals["plasticity"]  # blocks 0 and 1 frozen by then: not measured
    assert math.isnan(at_25[0]) and math.isnan(at_25[1]) and math.isfinite(at_25[2])
    freezer.close()


def test_weight_only_int8_for_other_layers_and_fallback_without_engine(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 8), nn.LayerNorm(8))
    source = _cpu_copy(model)
    before = copy.deepcopy(source.state_dict())
    reference, report = build_reference(source, "dynamic")
    assert report["dynamic_int8"] == ["3"]
    assert report["weight_only_int8"] == ["0.weight", "1.weight", "4.weight"]
    for name in report["weight_only_int8"]:
        assert reference.get_parameter(name).unique().numel() <= 255  # int8 levels -127..127
    assert not torch.equal(reference.get_parameter("0.weight"), before["0.weight"])  # rounded to the int8 grid
    assert all(torch.equal(v, before[k]) for k, v in source.state_dict().items())  # source untouched
    assert reference(torch.randn(2, 2, 6, 6)).shape == (2, 8)

    monkeypatch.setattr(egeria_reference, "_dynamic_quantization_unavailable", lambda: "no engine (test)")
    reference, report = build_reference(source, "dynamic")
    assert report["scheme"] == "weight_only" and "no engine (test)" in report["note"]
    assert report["dynamic_int8"] == [] and "3.weight" in report["weight_only_int8"]
    for name in report["weight_only_int8"]:
        assert reference.get_parameter(name).unique().numel() <= 256


class NoCopy:
    def __deepcopy__(self, memo):
        raise AssertionError("the owner of a hook must not be deep-copied")

    def hook(self, module, args):
        return None


def test_copies_leave_out_the_models_hooks_and_their_owners():
    model = make_net()
    owner = NoCopy()
    model[2].register_forward_pre_hook(owner.hook)
    shadow = _cpu_copy(model)
    assert len(model[2]._forward_pre_hooks) == 1 and len(shadow[2]._forward_pre_hooks) == 0
    assert all(not p.requires_grad and p.device.type == "cpu" for p in shadow.parameters())
    assert all(torch.equal(a, b) for a, b in zip(shadow.parameters(), model.parameters()))


class TupleBlock(nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)

    def forward(self, x):
        return torch.relu(self.lin(x)), {"aux": None}


class TupleNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = TupleBlock(8, 16), TupleBlock(16, 16), nn.Linear(16, 3)

    def forward(self, x, scale=None):
        h, _ = self.a(x)
        h, _ = self.b(h * scale)
        return self.head(h)


def test_keyword_inputs_and_tuple_outputs():
    model = TupleNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    strategy = Egeria(interval=2, probe_size=3, synchronous=True, reference_quantization="weight_only")
    freezer = Freezer(model, optimizer, strategy=strategy, blocks=["a", "b", "head"])
    x, y = torch.randn(10, 8), torch.randint(0, 3, (10,))
    for _ in range(4):
        nn.functional.cross_entropy(model(x, scale=torch.tensor(2.0)), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        decision = freezer.step()
    args, kwargs = strategy.probe
    assert args[0].shape == (3, 8) and torch.equal(kwargs["scale"], torch.tensor(2.0))
    values = decision.signals["plasticity"]
    assert all(math.isfinite(v) for v in values[:2]) and math.isnan(values[2])
    assert strategy.reference_report["dynamic_int8"] == []
    freezer.close()


def _worker_threads():
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()]


def test_background_worker_lags_one_evaluation_and_close_stops_it():
    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    strategy = Egeria(interval=2, probe_size=4)
    freezer = Freezer(model, optimizer, strategy=strategy)
    g = torch.Generator().manual_seed(1)
    decisions = train(model, optimizer, freezer, 2, g)
    assert strategy.worker_busy and len(_worker_threads()) == 1
    assert "plasticity" not in decisions[-1].signals  # submitted at step 2, nothing to apply yet
    assert strategy.wait(timeout=30)
    decisions = train(model, optimizer, freezer, 2, g)
    signals = decisions[-1].signals
    assert signals["evaluation_step"] == 2.0  # measured on the weights of step 2, applied at step 4
    assert all(math.isfinite(v) for v in signals["plasticity"][:3])
    assert strategy.worker_busy  # step 4's evaluation is on its way
    freezer.close()
    assert not strategy.worker_busy and _worker_threads() == []


def test_worker_exception_surfaces_in_the_training_thread_at_the_next_stage():
    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    strategy = Egeria(interval=2, probe_size=4)
    freezer = Freezer(model, optimizer, strategy=strategy)
    g = torch.Generator().manual_seed(1)
    train(model, optimizer, freezer, 1, g)
    strategy._probe = ((torch.randn(4, 5),), {})  # wrong feature size for Linear(8, 16)
    train(model, optimizer, freezer, 1, g)  # step 2: the bad evaluation is submitted, training goes on
    assert strategy.wait(timeout=30)
    train(model, optimizer, freezer, 1, g)  # step 3: no stage
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        train(model, optimizer, freezer, 1, g)  # step 4: the stage re-raises it
    assert any("background plasticity evaluation of the weights of step 2" in n for n in info.value.__notes__)
    assert any(entry.name == "evaluate" for entry in info.traceback)  # the worker's own frames
    freezer.close()
    assert _worker_threads() == []


@pytest.mark.parametrize("synchronous", [True, False], ids=["inline", "background"])
def test_a_resume_decides_as_the_uninterrupted_run(synchronous):
    """Inline, every stage of the resumed run equals the uninterrupted run's; in the background (where a stage that
    finds the worker busy skips, at the machine's pace) the first stage after the resume applies the evaluation the
    checkpoint caught in flight, as the uninterrupted run does."""
    # the reference was rebuilt from the resumed weights (one refresh newer than the run's) and the baselines
    # measured again: a resumed Lightning run never froze where the uninterrupted one froze twice
    def egeria():
        return Egeria(interval=3, refresh_every=2, tolerance=0.5, patience=2, probe_size=4, synchronous=synchronous)

    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    strategy = egeria()
    freezer = Freezer(model, optimizer, strategy=strategy)
    train(model, optimizer, freezer, 9, torch.Generator().manual_seed(1))
    assert strategy._pending is None if synchronous else strategy._pending is not None  # in flight
    in_flight = strategy._pending_step
    buffer = io.BytesIO()
    torch.save(freezer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    after = train(model, optimizer, freezer, 12, torch.Generator().manual_seed(2))
    freezer.close()

    resumed = make_net(seed=5)
    resumed.load_state_dict(weights)
    optimizer2 = torch.optim.SGD(resumed.parameters(), lr=0.05)
    strategy2 = egeria()
    freezer2 = Freezer(resumed, optimizer2, strategy=strategy2)
    freezer2.load_state_dict(saved)
    assert torch.equal(strategy2.probe[0][0], strategy.probe[0][0])
    assert strategy2._probe_handle is None  # probe restored: no capture hook left
    again = train(resumed, optimizer2, freezer2, 12, torch.Generator().manual_seed(2))
    after, again = [d for d in after if d is not None], [d for d in again if d is not None]  # the stages'
    if not synchronous:
        assert after[0].signals["evaluation_step"] == again[0].signals["evaluation_step"] == in_flight
        assert after[0].signals["plasticity"] == again[0].signals["plasticity"]
        freezer2.close()
        return
    assert [d.freeze for d in again] == [d.freeze for d in after] and any(d.freeze for d in after)
    assert strategy.refreshes == strategy2.refreshes >= 2
    for a, b in zip(after, again):
        assert a.signals.keys() == b.signals.keys()
        for key, value in a.signals.items():
            torch.testing.assert_close(torch.tensor(b.signals[key]), torch.tensor(value), rtol=0, atol=0,
                                       equal_nan=True)
    assert strategy2.history == strategy.history and strategy2.counts == strategy.counts
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed.state_dict().values()))
    freezer2.close()


def test_a_state_without_the_reference_resumes_with_a_new_one():
    # checkpoints written before the reference was saved: rebuilt from the resumed weights, baselines measured
    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    strategy = Egeria(interval=3, refresh_every=2, tolerance=0.5, patience=50, probe_size=4, synchronous=True)
    freezer = Freezer(model, optimizer, strategy=strategy)
    train(model, optimizer, freezer, 9, torch.Generator().manual_seed(1))
    saved = freezer.state_dict()
    freezer.close()
    for key in ("reference", "reference_report", "pending"):
        del saved["strategy"]["state"][key]
    resumed = make_net(seed=5)
    resumed.load_state_dict(model.state_dict())
    optimizer2 = torch.optim.SGD(resumed.parameters(), lr=0.05)
    strategy2 = Egeria(interval=3, refresh_every=2, tolerance=0.5, patience=50, probe_size=4, synchronous=True)
    freezer2 = Freezer(resumed, optimizer2, strategy=strategy2)
    freezer2.load_state_dict(saved)
    assert strategy2.history == strategy.history and strategy2.counts == strategy.counts
    assert all(v is not None and math.isfinite(v) for v in strategy2.previous[:3])
    decision = train(resumed, optimizer2, freezer2, 3, torch.Generator().manual_seed(2))[-1]
    assert all(math.isfinite(v) for v in decision.signals["plasticity_change"][:3])
    freezer2.close()


@pytest.mark.parametrize(
    "params, name",
    [
        ({"interval": 0}, "interval"),
        ({"interval": 2.5}, "interval"),
        ({"refresh_every": 0}, "refresh_every"),
        ({"tolerance": 0.0}, "tolerance"),
        ({"tolerance": -1}, "tolerance"),
        ({"tolerance": math.inf}, "tolerance"),
        ({"patience": 0}, "patience"),
        ({"patience": True}, "patience"),
        ({"probe_size": 0}, "probe_size"),
        ({"reference_quantization": "int4"}, "reference_quantization"),
        ({"synchronous": "yes"}, "synchronous"),
    ],
)
def test_bad_parameters_raise_value_error_naming_them(params, name):
    with pytest.raises(ValueError, match=name):
        Egeria(**params)
