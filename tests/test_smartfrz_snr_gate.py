"""SmartFRZ's gradient signal-to-noise gate (issue 29, off by default): the noise floor, the per-block z from Adam's
moments, the gate's rule, and the strategy wiring (off: nothing changes; on: it only delays the predictor; resumable
state). The engine's optimizer-state view it reads: tests/test_engine.py."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from layerfreeze.engine import Freezer
from layerfreeze.strategies.smartfrz.predictor import save_predictor
from layerfreeze.strategies.smartfrz.snr_gate import AdamMoments, SNRGate, adam_noise_floor, block_snr
from layerfreeze.strategies.smartfrz.strategy import SmartFRZ
from tests.test_smartfrz import _biased_predictor, stack

pytestmark = pytest.mark.usefixtures("one_thread")


def test_noise_floor_is_one_at_the_first_step_and_tends_to_the_steady_state():
    assert adam_noise_floor(1, 0.9) == pytest.approx(1.0)
    assert adam_noise_floor(10_000, 0.9) == pytest.approx(math.sqrt(0.1 / 1.9), rel=1e-6)
    floors = [adam_noise_floor(t, 0.9) for t in range(1, 60)]
    assert all(a > b for a, b in zip(floors, floors[1:]))  # bias correction: larger early


def test_noise_floor_matches_adam_on_pure_noise():
    torch.manual_seed(0)
    p = nn.Parameter(torch.zeros(20_000))
    opt = torch.optim.Adam([p], lr=1e-3)
    for t in range(1, 41):
        p.grad = torch.randn(20_000)
        opt.step()
        if t in (5, 20, 40):
            z, step = block_snr([(p, torch.arange(20_000))], lambda q: (opt.state[q], opt.param_groups[0]))
            assert step == t
            assert z == pytest.approx(1.0, abs=0.08), t  # z is the RMS of m_hat/sqrt(v_hat) over its noise floor


def test_sharded_moments_give_no_verdict():
    # FSDP2 keeps Adam's moments as DTensors (a torch.Tensor subclass holding this rank's shard): not read
    p = nn.Parameter(torch.zeros(100))
    opt = torch.optim.Adam([p], lr=1e-3)
    for _ in range(30):
        p.grad = torch.ones(100)  # pure signal: m_hat / sqrt(v_hat) = 1, 1 / floor(30) ~ 4.2
        opt.step()

    class Shard(torch.Tensor):
        pass

    plain = block_snr([(p, torch.arange(100))], lambda q: (opt.state[q], opt.param_groups[0]))
    assert plain is not None and plain[0] == pytest.approx(1 / adam_noise_floor(30, 0.9)) and plain[1] == 30
    sharded = {**opt.state[p], "exp_avg": opt.state[p]["exp_avg"].as_subclass(Shard)}
    assert block_snr([(p, torch.arange(100))], lambda q: (sharded, opt.param_groups[0])) is None


def test_moments_of_several_blocks_in_one_pass_match_one_at_a_time():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.zeros(300)) for _ in range(3)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for _ in range(12):
        for k, p in enumerate(params):
            p.grad = k * torch.ones(300) + torch.randn(300)  # block 0: noise, 1-2: more and more signal
        opt.step()

    def view(q):
        return opt.state[q], opt.param_groups[0]

    picks = [[(p, torch.arange(0, 300, 3))] for p in params]
    together = AdamMoments(picks, 100).z([0, 1, 2], view)
    alone = [block_snr(picks[i], view) for i in range(3)]
    assert set(together) == {0, 1, 2}
    for i in range(3):
        assert together[i] == pytest.approx(alone[i], rel=1e-12)
    assert together[0][0] < together[1][0] < together[2][0]
    assert AdamMoments(picks, 100).z([1], None) == {}  # no optimizer: no verdict


def test_consistent_gradient_gives_z_well_above_one_and_sgd_gives_none():
    p = nn.Parameter(torch.zeros(1000))
    opt = torch.optim.Adam([p], lr=1e-3)
    for _ in range(30):
        p.grad = torch.ones(1000) + 0.1 * torch.randn(1000)
        opt.step()
    z, _ = block_snr([(p, torch.arange(1000))], lambda q: (opt.state[q], opt.param_groups[0]))
    assert z > 3.0
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(1000)
    sgd.step()
    assert block_snr([(p, torch.arange(1000))], lambda q: (sgd.state[q], sgd.param_groups[0])) is None
    assert block_snr([(p, torch.arange(1000))], None) is None


def test_gate_opens_only_after_the_smoothed_z_fell_from_its_peak():
    gate = SNRGate(1, kappa=0.9, smooth=2, burn_in=3, noise=None)
    assert gate.open(0) is None
    for step, z in enumerate([1.0, 1.0, 1.0, 1.2, 1.5, 2.0], start=1):  # steps 1-2: before the burn-in
        gate.observe(0, z, step)
        assert gate.open(0) is False  # rising after the burn-in: never open
    gate.observe(0, 1.4, 7)  # smoothed (2.0 + 1.4) / 2 = 1.7 <= 0.9 * peak 1.75? no
    assert gate.open(0) is False
    gate.observe(0, 1.2, 8)  # smoothed 1.3 <= 1.575
    assert gate.open(0) is True
    state = gate.state_dict()
    again = SNRGate(1, kappa=0.9, smooth=2, burn_in=3, noise=None)
    again.load_state_dict(state)
    assert again.open(0) is True and again.peak == gate.peak
    gate.observe(0, 3.0, 1)  # the optimizer state was rebuilt (a thaw): history restarts
    assert gate.open(0) is False and math.isnan(gate.peak[0])


def test_gate_opens_for_a_block_moving_by_noise_once_its_z_stops_rising():
    gate = SNRGate(1, kappa=0.9, smooth=2, burn_in=3, noise=1.25, rise=0.05)
    for step, z in enumerate([1.0, 1.05, 1.1, 1.15, 1.2], start=1):  # near noise but rising: not yet
        gate.observe(0, z, step)
        assert gate.open(0) is False
    for step, z in enumerate([1.2, 1.2, 1.2], start=6):  # flat at 1.2 (peak 1.2: no fall from it either)
        gate.observe(0, z, step)
    assert gate.open(0) is True
    for step, z in enumerate([1.6, 1.6, 1.6], start=9):  # above the noise level at its peak: closed
        gate.observe(0, z, step)
    assert gate.open(0) is False


def _train(model: nn.Module, freezer: Freezer, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g)
        y = (x[:, 0] > 0).long()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        freezer.step()


def test_gate_is_on_by_default_and_off_changes_nothing(tmp_path):
    path = save_predictor(tmp_path / "p.safetensors", _biased_predictor(10.0), window=3)  # p = 1 everywhere
    default = SmartFRZ(predictor=str(path))
    assert default.snr_gate == 0.9 and default.snr_noise == 1.35  # on by default since issue 29's grid
    model = stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    strategy = SmartFRZ(predictor=str(path), snapshot_every=1, snr_gate=None)
    freezer = Freezer(model, opt, strategy=strategy, total_steps=10)
    _train(model, freezer, opt, 4)
    assert strategy.gate is None and "gate" not in strategy.state_dict()  # a checkpoint holds what it held before
    assert "snr_z" not in freezer.last_signals
    assert {r["index"]: r["step"] for r in freezer.history if r["kind"] == "freeze"} == {0: 2, 1: 2, 2: 2}


def test_gate_only_delays_the_predictor(tmp_path):
    path = save_predictor(tmp_path / "p.safetensors", _biased_predictor(10.0), window=3)  # p = 1 everywhere
    steps = {}
    for gate in (None, 0.9):
        model = stack()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        strategy = SmartFRZ(predictor=str(path), snapshot_every=1, snr_gate=gate)
        freezer = Freezer(model, opt, strategy=strategy, total_steps=60)
        _train(model, freezer, opt, 60)
        steps[gate] = {r["index"]: r["step"] for r in freezer.history if r["kind"] == "freeze"}
        if gate is not None:
            assert strategy.state_dict()["gate"]["peak"][0] > 0
            assert len(freezer.last_signals["snr_z"]) == 4 and len(freezer.last_signals["snr_gate"]) == 4
    assert steps[None] == {0: 2, 1: 2, 2: 2}
    # with the gate every freeze waits until the block's z has passed its peak (never before the burn-in)
    assert all(steps[0.9].get(i, 61) > steps[None][i] for i in steps[None])


def test_snr_gate_parameter_is_checked():
    with pytest.raises(ValueError, match="snr_gate"):
        SmartFRZ(snr_gate=0.0)
    with pytest.raises(ValueError, match="snr_gate"):
        SmartFRZ(snr_gate=1.5)
    with pytest.raises(ValueError, match="snr_noise"):
        SmartFRZ(snr_gate=0.9, snr_noise=0)
    assert SmartFRZ(snr_gate=1, snr_noise=None).snr_gate == 1.0


def test_gate_resumes_to_the_uninterrupted_run(tmp_path):
    # a checkpoint taken mid-run (freezer, optimizer, model) and loaded into a fresh process's objects: the same
    # freeze steps, the same gate state (None, not NaN, where a block has no peak: equal after the round trip)
    path = save_predictor(tmp_path / "p.safetensors", _biased_predictor(10.0), window=3)

    def build():
        model = stack()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        strategy = SmartFRZ(predictor=str(path), snapshot_every=1, snr_gate=0.9)
        return model, opt, strategy, Freezer(model, opt, strategy=strategy, total_steps=60)

    def train(model, opt, freezer, g, steps):
        for _ in range(steps):
            x = torch.randn(16, 8, generator=g)
            loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            freezer.step()

    ref_model, ref_opt, ref_strategy, ref_freezer = build()
    train(ref_model, ref_opt, ref_freezer, torch.Generator().manual_seed(0), 60)
    want = {r["index"]: r["step"] for r in ref_freezer.history if r["kind"] == "freeze"}

    model, opt, _, freezer = build()
    g = torch.Generator().manual_seed(0)
    train(model, opt, freezer, g, 12)
    torch.save({"freezer": freezer.state_dict(), "opt": opt.state_dict(), "model": model.state_dict(),
                "g": g.get_state()}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    model2, opt2, strategy2, freezer2 = build()
    model2.load_state_dict(ckpt["model"])
    freezer2.load_state_dict(ckpt["freezer"])
    opt2.load_state_dict(ckpt["opt"])
    g2 = torch.Generator()
    g2.set_state(ckpt["g"])
    train(model2, opt2, freezer2, g2, 48)
    got = {r["index"]: r["step"] for r in freezer2.history if r["kind"] == "freeze"}
    assert got == want and any(s > 12 for s in want.values()), (got, want)
    assert strategy2.state_dict()["gate"] == ref_strategy.state_dict()["gate"]
    assert all(torch.equal(a, b) for a, b in zip(model2.state_dict().values(), ref_model.state_dict().values()))


def test_checkpoint_without_the_gate_resumed_with_it_says_so(tmp_path):
    # a run checkpointed with the gate off (as every run before issue 29 made it the default) and resumed with it
    # on: the gate has seen none of the earlier steps, which the user is told, with the way to resume exactly
    path = save_predictor(tmp_path / "p.safetensors", _biased_predictor(10.0), window=3)
    model = stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    old = SmartFRZ(predictor=str(path), snapshot_every=1, snr_gate=None)
    freezer = Freezer(model, opt, strategy=old, total_steps=60)
    _train(model, freezer, opt, 3)
    state = freezer.state_dict()
    assert "gate" not in old.state_dict()
    fresh = SmartFRZ(predictor=str(path), snapshot_every=1)
    m2 = stack()
    freezer2 = Freezer(m2, torch.optim.AdamW(m2.parameters(), lr=1e-2), strategy=fresh, total_steps=60)
    with pytest.warns(UserWarning, match="snr_gate=null"):
        freezer2.load_state_dict(state)
    same = SmartFRZ(predictor=str(path), snapshot_every=1, snr_gate=None)
    m3 = stack()
    freezer3 = Freezer(m3, torch.optim.AdamW(m3.parameters(), lr=1e-2), strategy=same, total_steps=60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        freezer3.load_state_dict(state)  # gate off on both sides: silent


def test_gate_without_adam_moments_says_once_that_the_predictor_decides_alone(tmp_path):
    # SGD keeps no exp_avg/exp_avg_sq: the default gate has no verdict, the freezes are the predictor's own (those of
    # snr_gate=None), and the run is told so once, not at every stage
    path = save_predictor(tmp_path / "p.safetensors", _biased_predictor(10.0), window=3)  # p = 1 everywhere
    steps = {}
    for gate in (0.9, None):
        model = stack()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        strategy = SmartFRZ(predictor=str(path), snapshot_every=1, snr_gate=gate)
        freezer = Freezer(model, opt, strategy=strategy, total_steps=10)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(model, freezer, opt, 4)
        said = [w for w in caught if "found no Adam moments" in str(w.message)]
        assert len(said) == (1 if gate else 0)
        steps[gate] = {r["index"]: r["step"] for r in freezer.history if r["kind"] == "freeze"}
    assert steps[0.9] == steps[None] == {0: 2, 1: 2, 2: 2}
