"""SmartFRZ's stage on the GPU path (issue 40): one read per stage without a host sync (the reader), reads used a
stage late where they are deferred, a checkpoint that files a read in flight, the stage cadence set by what a stage
costs, the predictor skipped where the gate is closed, and what the strategy holds in the ledger's bucket."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from layerfreeze.checkpoint import load_checkpoint, save_checkpoint
from layerfreeze.engine import Freezer
from layerfreeze.models.discovery import discover_blocks
from layerfreeze.runs.ledger import MemoryLedger
from layerfreeze.strategies.base import BlockView, StageContext
from layerfreeze.strategies.smartfrz.predictor import save_predictor
from layerfreeze.strategies.smartfrz.reader import Pick, StageReader
from layerfreeze.strategies.smartfrz.strategy import COST_MIN_STAGES, PROBE_STAGES, SmartFRZ
from tests.test_smartfrz import _biased_predictor, stack

pytestmark = pytest.mark.usefixtures("one_thread")



# ---------------------------------------------------------------------------------------------------- the reader


def test_cpu_read_is_index_select_of_each_pick_and_zero_elsewhere():
    a, b = torch.randn(5, 7), torch.randn(40).to(torch.bfloat16)
    pa, pb = torch.tensor([0, 3, 34]), torch.tensor([1, 2])
    reader = StageReader(rows=3, width=6, max_scalars=2)
    read = reader.launch([Pick(a, pa, 0, 1), Pick(b, pb, 2, 4)], [torch.tensor(7.0), 3])
    assert not read.deferred and read.ready
    expected = torch.zeros(3, 6)
    expected[0, 1:4] = a.reshape(-1)[pa]
    expected[2, 4:6] = b[pb].float()
    assert torch.equal(read.settle().values, expected)
    assert read.scalars == [7.0, 3.0]
    # the next read starts from zeros, not from the last one's values
    assert not reader.launch([Pick(a, pa, 1, 0)]).values[0].any()


def test_reader_refuses_what_does_not_fit():
    reader = StageReader(rows=2, width=4, max_scalars=1)
    with pytest.raises(ValueError, match="does not fit"):
        reader.launch([Pick(torch.zeros(10), torch.arange(5), 0, 0)])
    with pytest.raises(ValueError, match="at most 1"):
        reader.launch([], [1.0, 2.0])
    with pytest.raises(ValueError, match="rows and width"):
        StageReader(rows=0, width=4)


@pytest.mark.cuda
def test_cuda_read_never_synchronises_and_equals_the_cpu_read():
    torch.manual_seed(0)
    w = torch.randn(300, 200)
    pos = torch.randperm(w.numel())[:64].sort().values
    step = torch.tensor(12.0)
    cpu = StageReader(2, 64, max_scalars=1).launch([Pick(w, pos, 1, 0)], [step]).settle()
    reader = StageReader(2, 64, max_scalars=1)
    wd, sd = w.cuda(), step.cuda()
    reader.launch([Pick(wd, pos, 1, 0)], [sd])  # positions moved to the device once, outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        read = reader.launch([Pick(wd, pos, 1, 0)], [sd])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert read.deferred
    read.settle()
    assert torch.equal(read.values, cpu.values) and read.scalars == [12.0]


# ---------------------------------------------------------------------------------------------------- deferred reads


def _adam_run(tmp_path, steps: int, *, defer: bool, bias: float = -10.0, snapshot_every: int = 1,
              stop_at: int | None = None, resume_from: Path | None = None):
    """A tiny stack trained with AdamW under SmartFRZ (a predictor that never / always freezes)."""
    path = tmp_path / f"p{bias}.safetensors"
    if not path.exists():
        save_predictor(path, _biased_predictor(bias), window=4)
    model = stack()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    strategy = SmartFRZ(predictor=str(path), snapshot_every=snapshot_every)
    freezer = Freezer(model, opt, strategy=strategy, total_steps=steps)
    strategy.reader.defer = defer
    first = 1
    if resume_from is not None:
        first = load_checkpoint(resume_from, model, opt, freezer)["step"] + 1
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(steps)]
    for step in range(first, (stop_at or steps) + 1):
        x, y = batches[step - 1]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        freezer.step()
    if stop_at is None:
        return freezer, strategy, None
    # the checkpoint files the read in flight into the recorder and the gate
    return freezer, strategy, save_checkpoint(tmp_path / "ckpt", model, opt, freezer, extra={"step": stop_at})


def test_deferred_reads_are_filed_one_stage_late(tmp_path):
    _, now, _ = _adam_run(tmp_path, 10, defer=False)
    _, late, _ = _adam_run(tmp_path, 10, defer=True)
    # nothing freezes (p ~ 0), so both runs train the same weights; the deferred one has filed one snapshot less
    assert now.recorder.counts == [11, 11, 11, 11] and late.recorder.counts == [10, 10, 10, 10]
    assert torch.equal(now.recorder.window_of(0)[:-1], late.recorder.window_of(0)[-3:])
    assert torch.equal(now.recorder.steps_of(1)[:-1], late.recorder.steps_of(1)[-3:])
    # the gate saw the same z values, one fewer
    assert len(now.gate.recent[1]) == 8 and list(late.gate.recent[1])[1:] == list(now.gate.recent[1])[:-1]
    assert late._pending is not None


def test_a_checkpoint_files_the_read_in_flight_and_the_resumed_run_decides_as_the_uninterrupted_one(tmp_path):
    whole, _, _ = _adam_run(tmp_path, 60, defer=True, bias=10.0)
    _, _, saved = _adam_run(tmp_path, 60, defer=True, bias=10.0, stop_at=13)
    resumed, _, _ = _adam_run(tmp_path, 60, defer=True, bias=10.0, resume_from=saved)
    freezes = [(r["index"], r["step"]) for r in whole.history if r["kind"] == "freeze"]
    assert freezes  # the predictor says freeze: the gate decides when
    assert [(r["index"], r["step"]) for r in resumed.history if r["kind"] == "freeze"] == freezes


def test_on_the_cpu_decisions_are_those_of_a_read_filed_at_once(tmp_path):
    """The CPU path files each read at its own stage: the recorder holds this stage's sample (bitwise the
    parameters' values at the sampled positions)."""
    _, strategy, _ = _adam_run(tmp_path, 6, defer=False)
    model_blocks = strategy.recorder.samples
    last = strategy.recorder.window_of(2)[-1]
    start = 0
    for p, idx in model_blocks[2].picks:
        assert torch.equal(last[start:start + idx.numel()], p.detach().reshape(-1)[idx])
        start += idx.numel()


# ---------------------------------------------------------------------------------------------------- the gate


def test_the_predictor_is_not_asked_for_a_block_the_gate_holds_closed(tmp_path):
    path = save_predictor(tmp_path / "p.safetensors", _biased_predictor(10.0), window=4)
    model = stack()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    strategy = SmartFRZ(predictor=str(path), snapshot_every=1)
    freezer = Freezer(model, opt, strategy=strategy, total_steps=40)
    asked: list[int] = []
    inner = strategy.predict

    def spy(index, *args):
        asked.append(index)
        return inner(index, *args)

    strategy.predict = spy
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(16, 8, generator=g)), torch.randint(0, 4, (16,), generator=g)).backward()
        opt.step()
        freezer.step()
    # after 6 Adam steps no block is past the gate's burn-in (8): closed everywhere, so no prediction and no freeze
    assert strategy.gate.open(0) is False and asked == []
    assert math.isnan(freezer.last_signals["p_freeze"][0]) and not any(freezer.frozen)


# ---------------------------------------------------------------------------------------------------- the cadence


class _Clock:
    """Two calls per stage (its start and its end): they are ``stage_cost`` seconds apart."""

    def __init__(self) -> None:
        self.now, self.stage_cost, self.calls = 0.0, 0.0, 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:
            self.now += self.stage_cost
        return self.now


def _contexts(blocks, total: int):
    views = [BlockView(b.name, b.index, False, b.is_head, 1) for b in blocks]
    return lambda step, **kw: StageContext(step=step, epoch=0, event="step" if step else "start", blocks=views,
                                           total_steps=total, **kw)


def _cadence_strategy(tmp_path, **params):
    path = tmp_path / "never.safetensors"
    save_predictor(path, _biased_predictor(-10.0), window=4)
    strategy = SmartFRZ(predictor=str(path), snr_gate=None, **params)
    model = stack()
    blocks = discover_blocks(model)
    strategy.attach(model, blocks)
    clock = _Clock()
    strategy._clock = clock
    if strategy.stage_budget is not None:  # timed, as on an accelerator (this stack is on the CPU)
        strategy._timed, strategy._phase = True, "measure"
    return strategy, clock, _contexts(blocks, 300)


def test_a_stage_within_budget_keeps_the_run_length_cadence(tmp_path):
    strategy, clock, ctx = _cadence_strategy(tmp_path)
    strategy.decide(ctx(0))
    assert strategy.stage_every == 2  # round(300 / 150)
    clock.stage_cost = 0.004  # 4 ms of host time against 1 s steps: 0.4%
    signals = [strategy.decide(ctx(2 * k, step_seconds=1.0)).signals for k in range(1, COST_MIN_STAGES + 1)]
    assert strategy.stage_every == 2 and strategy._phase == "set"
    assert signals[-1]["stage_every"] == 2 and signals[-1]["stage_ms"] == pytest.approx(4.0)
    assert all("stage_every" not in s for s in signals[:-1])


def test_an_expensive_stage_is_probed_and_the_cadence_keeps_it_at_one_percent(tmp_path):
    strategy, clock, ctx = _cadence_strategy(tmp_path)
    strategy.decide(ctx(0))
    clock.stage_cost = 0.003  # 3 ms of host time against 20 ms steps: 15%, over the 1% budget
    step = 2
    for _ in range(COST_MIN_STAGES):
        strategy.decide(ctx(step, stage_step_seconds=0.023))
        step += strategy.stage_every
    assert strategy._phase == "probe" and strategy.stage_every == 2
    # the device's queue hides part of the host time: a stage costs 1 ms of wall clock
    for _ in range(PROBE_STAGES):
        last = strategy.decide(ctx(step, step_seconds=0.020, stage_step_seconds=0.021)).signals
        step += strategy.stage_every
    assert strategy._phase == "set" and strategy.stage_every == 5  # ceil(1 ms / (1% of 20 ms))
    assert last["stage_every"] == 5 and last["stage_ms"] == pytest.approx(1.0) and last["step_ms"] == pytest.approx(20)
    # the cadence is state: a resumed strategy keeps it
    other, _, _ = _cadence_strategy(tmp_path)
    other.load_state_dict(strategy.state_dict())
    assert other.stage_every == 5 and other._phase == "set"


def test_a_hidden_stage_returns_to_the_run_length_cadence(tmp_path):
    strategy, clock, ctx = _cadence_strategy(tmp_path)
    strategy.decide(ctx(0))
    clock.stage_cost = 0.003
    step = 2
    for _ in range(COST_MIN_STAGES + PROBE_STAGES):
        strategy.decide(ctx(step, step_seconds=0.020, stage_step_seconds=0.0199))  # no wall cost at all
        step += strategy.stage_every
    assert strategy._phase == "set" and strategy.stage_every == 2


def test_on_the_cpu_the_cadence_is_the_run_lengths_whatever_the_clock_says(tmp_path):
    # a model on the CPU: decisions must not depend on this machine's timings (a resumed run is the uninterrupted one)
    path = tmp_path / "never.safetensors"
    save_predictor(path, _biased_predictor(-10.0), window=4)
    strategy = SmartFRZ(predictor=str(path), snr_gate=None)
    model = stack()
    strategy.attach(model, discover_blocks(model))
    clock = _Clock()
    strategy._clock, clock.stage_cost = clock, 0.5  # half a second of host time a stage, against 1 ms steps
    ctx = _contexts(discover_blocks(model), 300)
    strategy.decide(ctx(0))
    for k in range(1, 20):
        strategy.decide(ctx(2 * k, step_seconds=0.001, stage_step_seconds=0.5))
    assert strategy._phase == "set" and strategy.stage_every == 2  # round(300 / 150)
    assert strategy.state_dict()["cadence"]["host_seconds"] == []  # nothing timed: every run saves the same state
    # a GPU run's calibration, resumed on the CPU: the cadence it reached is kept, no more timing
    gpu_state = {**strategy.state_dict(), "stage_every": 5,
                 "cadence": {"phase": "probe", "base_every": 2, "host_seconds": [0.003] * 4, "probed": 3}}
    strategy.load_state_dict(gpu_state)
    assert strategy._phase == "set" and strategy.stage_every == 5


@pytest.mark.parametrize("params", [{"snapshot_every": 1}, {"stage_budget": None}])
def test_a_fixed_cadence_is_never_changed(tmp_path, params):
    strategy, clock, ctx = _cadence_strategy(tmp_path, **params)
    strategy.decide(ctx(0))
    every = strategy.stage_every
    clock.stage_cost = 0.5
    for k in range(1, 20):
        strategy.decide(ctx(k * every, step_seconds=0.001, stage_step_seconds=0.5))
    assert strategy.stage_every == every and strategy._phase == "set"
    assert "cadence" not in strategy.state_dict()


@pytest.mark.parametrize("budget", [0, 1, -0.1, "x", True])
def test_a_bad_stage_budget_is_refused(budget):
    with pytest.raises(ValueError, match="stage_budget must be in"):
        SmartFRZ(stage_budget=budget)


# ---------------------------------------------------------------------------------------------------- the ledger


def test_the_ledger_counts_what_smartfrz_holds_in_the_strategy_bucket(tmp_path):
    model = stack()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    strategy = SmartFRZ(snapshot_every=1)
    freezer = Freezer(model, opt, strategy=strategy, total_steps=8)
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in strategy.held_tensors()}
    n = len(freezer.blocks)
    # the ring buffers (blocks x window x sample_size float32, int64 steps) and the reader's (3 blocks) rows
    assert sum(held.values()) >= 4 * n * strategy.window * 1024 + 8 * n * strategy.window + 4 * 3 * n * 1024
    ledger = MemoryLedger(model, opt, freezer=freezer, sources=[strategy])
    with ledger.step(1):
        F.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 4, (4,))).backward()
        opt.step()
    assert ledger.last.devices["cpu"]["strategy"] == sum(held.values())


def test_egeria_reports_its_shadow_copy_and_reference_in_the_strategy_bucket():
    from layerfreeze.strategies.registry import create_strategy

    model = stack(width=64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    strategy = create_strategy("egeria", {"interval": 2, "synchronous": True})
    Freezer(model, opt, strategy=strategy, total_steps=8)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    report = strategy.ledger_bytes()
    assert set(report) == {"strategy"} and set(report["strategy"]) == {"cpu"}
    # the float32 shadow (every weight once) plus the int8 reference's tensors
    assert report["strategy"]["cpu"] > weights
    assert create_strategy("static", {"k": 1}).ledger_bytes() == {}  # a strategy that holds nothing reports nothing
