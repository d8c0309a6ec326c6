"""Host synchronisations per training step, for every registered strategy and for the CLI trainer's step (issue 40).

On a GPU, each read of a device tensor on the host waits for the device's whole queue; a step without a stage must
have none (the trainer's one loss value excepted, read without draining the queue), and a stage only what the budget
below says. Counted on the CPU on a simulated device (``tests/host_sync.py``), so it runs in CI; the CUDA variant
runs the same loop under ``torch.cuda.set_sync_debug_mode("error")`` where a GPU is present.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
import torch

from layerfreeze.strategies import STRATEGIES
from tests.host_sync import DEVICE, SyncCounter, count_freezer_steps, syncs


@dataclass(frozen=True)
class Budget:
    """Host synchronisations allowed: ``step`` on each step without a stage, ``stage`` on each step with one, plus
    the engine's frozen-weight checksum when the stage freezes blocks (one copy of each frozen parameter to the host,
    :func:`layerfreeze.engine.integrity.checksum`; ``CHECKSUM_COPIES`` per block of the tiny model). ``params``:
    what makes the strategy stage within the 48 steps (its defaults would not, or would not deterministically)."""

    step: int
    stage: int
    params: dict[str, Any] | None = None


#: Parameters per block of the tiny model (a Linear's weight and bias): the checksum's copies when one freezes.
CHECKSUM_COPIES = 2

# The budget table. Every registered strategy must have a row (a new one fails the test until it is budgeted).
BUDGET: dict[str, Budget] = {
    "none": Budget(0, 0),  # never stages
    "static": Budget(0, 0),  # freezes at the start stage (the Freezer's constructor), then never decides again
    "gradual": Budget(0, 0),  # thaws at epoch ends: a thaw reads nothing (its first backward's probe stays on device)
    "linear": Budget(0, 0),  # epoch-end stages: the schedule reads no tensor; freezes pay the checksum only
    "geometric": Budget(0, 0),  # the same
    "freezeout": Budget(0, 0),  # a stage on every step (its LR factors), reading no tensor; freezes pay the checksum
    "autofreeze": Budget(0, 1, {"interval": 8}),  # reads the gradient sums once per stage (one copy of 9 float64)
    # egeria's first step copies a probe batch to the host; each stage copies the trained weights into its CPU
    # shadow (the Egeria paper's reference runs on the CPU): one copy per parameter, 9 blocks x weight and bias
    "egeria": Budget(1, 18, {"interval": 8, "refresh_every": 2, "synchronous": True}),
    # one copy per stage: every active block's weight samples and Adam moments gathered on the device into one
    # buffer (StageReader); on CUDA it is non_blocking into pinned memory and read at the next stage (no wait), here
    # the simulated device has no events, so the plain copy counts. stage_budget=None: the simulated device is not
    # the CPU, so the cadence would be timed; the run-length one is a stage every step of this 48-step run
    "smartfrz": Budget(0, 1, {"stage_budget": None}),
    "lisa": Budget(0, 0, {"k": 8}),  # a switch reads nothing; the two layers switched off pay the checksum
    "badam": Budget(0, 0, {"k": 8}),  # the same, one layer
}


def test_every_registered_strategy_has_a_budget():
    assert set(BUDGET) == set(STRATEGIES), "budget the new strategy in BUDGET (syncs per step and per stage)"


@pytest.mark.parametrize("strategy", list(BUDGET))
def test_syncs_per_step_and_per_stage_are_within_the_budget(strategy):
    budget = BUDGET[strategy]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        steps = count_freezer_steps(strategy, budget.params)
    plain = [s for s in steps if not s.staged]
    staged = [s for s in steps if s.staged]
    over = [(s.step, dict(s.counts)) for s in plain if s.syncs > budget.step]
    assert not over, f"{strategy}: host synchronisations on steps without a stage: {over}"
    over = [(s.step, dict(s.counts)) for s in staged
            if s.syncs > budget.stage + CHECKSUM_COPIES * s.froze]
    assert not over, f"{strategy}: more host synchronisations at a stage than budgeted: {over}"
    if budget.stage:  # the budget is what it reads, not a loose bound: the reads happen
        assert max(s.syncs - CHECKSUM_COPIES * s.froze for s in staged) == budget.stage
    if strategy in ("autofreeze", "lisa", "badam", "gradual", "linear", "geometric", "freezeout", "egeria"):
        assert staged, f"{strategy} never staged in the run: the budget's params should make it stage"


def test_the_counter_sees_each_kind_of_host_read():
    """The harness itself: each read the budget is about is counted, and a non_blocking copy is not a sync."""
    from tests.host_sync import to_device

    with SyncCounter() as counter:
        t = to_device(torch.arange(6.0))
        kinds = {}
        for name, read in [("item", lambda: t.sum().item()), ("item", lambda: float(t[0])),
                           ("item", lambda: bool(t[1] > 0)), ("tolist", lambda: t.tolist()),
                           ("to_host", lambda: t.cpu()), ("nonzero", lambda: torch.nonzero(t)),
                           ("mask_index", lambda: t[t > 2]), ("equal", lambda: torch.equal(t, t)),
                           ("to_device_blocking", lambda: torch.ones(3).to(DEVICE)),
                           ("to_device_blocking", lambda: torch.tensor([1, 2], device=DEVICE)),
                           ("to_host_async", lambda: torch.empty(6).copy_(t, non_blocking=True))]:
            with counter.window() as counts:
                read()
            kinds.setdefault(name, []).append(dict(counts))
        with counter.window() as on_device:
            torch.cumsum(t * 2 + 1, 0).abs().sum()  # device work only
    assert all(c == {name: 1} for name, cs in kinds.items() for c in cs), kinds
    assert syncs(kinds["to_host_async"][0]) == 0 and syncs(kinds["nonzero"][0]) == 1
    assert not on_device


def test_the_gradient_signal_was_a_sync_per_block_and_is_none_now():
    """What the budget guards (issue 40): autofreeze's per-block ``float(sum(...))`` read 9 values per backward; the
    sums now stay on the device, and match the host sums. A Freezer without an optimizer sums at ``after_backward``;
    with one, at the optimizer's step (its pre-hook): neither synchronises."""
    from layerfreeze import Freezer
    from layerfreeze.models.discovery import discover_blocks
    from tests.host_sync import place, tiny_stack, to_device

    with SyncCounter() as counter:
        model = place(tiny_stack())
        blocks = discover_blocks(model)
        freezer = Freezer(model, None, "autofreeze", {"interval": 2}, blocks=blocks, total_steps=10)
        x = to_device(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)))
        model(x).square().sum().backward()
        with counter.window() as counts:
            freezer.after_backward()
        expected = [0.0 if b.is_head else float(sum(p.grad.abs().sum() for p in b.parameters())) for b in blocks]
        assert syncs(counts) == 0
        assert freezer._grad_sums.values() == pytest.approx(expected, rel=1e-6)
        freezer.after_backward()
        assert freezer._grad_sums.values() == pytest.approx([2 * v for v in expected], rel=1e-6)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay, and so the gradients
        freezer.attach_optimizer(optimizer)  # from now on read at its step
        with counter.window() as counts:
            freezer.after_backward()
            optimizer.step()
        assert syncs(counts) == 0
        assert freezer._grad_sums.values() == pytest.approx([3 * v for v in expected], rel=1e-6)


def _trainer_windows(tmp_path, strategy: str, params: dict, cache: str) -> list[tuple[int, dict[str, int]]]:
    """The CLI trainer on the tiny blob task with ``run.device`` on the simulated device: ``(step, counts)`` for the
    work between two step callbacks (one training step and its records; at an epoch's end, also the evaluation,
    the epoch-end stage and the checkpoint)."""
    import layerfreeze.train.setup as setup
    from layerfreeze.train.config import build_config
    from layerfreeze.train.trainer import Trainer
    from tests.conftest import blob_task

    shutil.rmtree(tmp_path / strategy, ignore_errors=True)
    cfg = build_config({"train": {"epochs": 2, "batch_size": 16, "lr": 0.01, "warmup_fraction": 0.1},
                        "freeze": {"strategy": strategy, "params": params, "cache": {"mode": cache}},
                        "run": {"dir": str(tmp_path / strategy), "progress": False}})
    counter = SyncCounter()
    windows: list[tuple[int, dict[str, int]]] = []

    def callback(trainer: Trainer) -> None:
        if counter.counting:
            windows.append((trainer.progress["step"], dict(counter.end())))
        counter.begin()

    with counter, mock.patch.object(setup.dist_, "rank_device", lambda name="auto": DEVICE), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(cfg, task=blob_task(), step_callbacks=[callback]).run()
    return windows


#: The trainer's step without a stage: the loss copied non_blocking (``to_host_async``, not a sync), nothing else.
#: With the activation cache (on by default): what it stores and reads back per step, below.
TRAINER_BUDGET = {
    "off": 0,
    # a step that stores the batch's prefix outputs (a miss) copies them to the host once, for the whole batch (was
    # one copy per sample, plus the input fingerprints read back from the device and two blocking copies of
    # positions to the device: 19 on this task); a step served from the cache reads nothing
    "auto": 1,
}


@pytest.mark.parametrize("cache", list(TRAINER_BUDGET))
def test_the_trainers_step_reads_only_its_loss(tmp_path, cache):
    windows = _trainer_windows(tmp_path, "static", {"k": 2}, cache)
    steps_per_epoch = 6  # 96 samples, batch 16
    # the windows of steps 2-6 and 8-12: step 1's starts before the run's first step, step 7's holds the epoch's end
    plain = [(s, c) for s, c in windows if (s - 1) % steps_per_epoch]
    assert len(plain) == 10
    assert all(c.get("to_host_async") == 1 for _, c in plain), plain  # the loss, copied once per step
    over = [(s, c) for s, c in plain if syncs(c) > TRAINER_BUDGET[cache]]
    assert not over, f"host synchronisations in the trainer's step (cache {cache}): {over}"
    if cache == "off":
        assert all(syncs(c) == 0 for _, c in plain)
    else:  # epoch 1 stores (a miss per sample), epoch 2 reads every sample back
        assert [syncs(c) for _, c in plain] == [1] * 5 + [0] * 5


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", list(BUDGET))
def test_steps_without_a_stage_do_not_synchronise_on_cuda(strategy):
    budget = BUDGET[strategy]
    if budget.step:
        pytest.skip(f"{strategy} has {budget.step} budgeted per step (lead updates after the rewrite)")

    def strict(step: int, due: bool) -> Any:
        if due:
            return contextlib.nullcontext()
        return _sync_debug_error()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        count_freezer_steps(strategy, budget.params, device="cuda", on_step=strict)
    torch.cuda.synchronize()


@contextlib.contextmanager
def _sync_debug_error():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
