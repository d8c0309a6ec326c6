"""``train.precision`` (issue 42): bf16/fp16 autocast with float32 master weights, bfloat16 weights, a GradScaler that
freezing never confuses, and a resume under each precision equal to the uninterrupted run (bitwise on the CPU)."""

from __future__ import annotations

import os
import signal
import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from layerfreeze import Freezer
from layerfreeze.engine.demote import Demotion
from layerfreeze.train.config import build_config
from layerfreeze.train.precision import Precision, resolve_precision
from layerfreeze.train.trainer import Trainer
from tests.conftest import blob_task

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


def _config(tmp_path, name, precision, freeze=None, **train):
    return build_config({
        "train": {"epochs": 2, "batch_size": 16, "lr": 0.01, "warmup_fraction": 0.1, "precision": precision, **train},
        "freeze": freeze or {"strategy": "static", "params": {"k": 2}},
        "run": {"dir": str(tmp_path / name), "progress": False, "device": "cpu"},
    })


def _head_dtypes(task) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    task.model[-1].register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    return seen


@pytest.mark.parametrize(("precision", "compute", "weights"), [
    ("auto", torch.float32, torch.float32),  # auto on the CPU is 32-true
    ("32-true", torch.float32, torch.float32),
    ("bf16-mixed", torch.bfloat16, torch.float32),
    ("16-mixed", torch.float16, torch.float32),
    ("bf16-true", torch.bfloat16, torch.bfloat16),
])
def test_each_precision_computes_in_its_dtype_keeps_its_weights_and_learns(tmp_path, precision, compute, weights):
    task = blob_task()
    seen = _head_dtypes(task)
    summary = Trainer(_config(tmp_path, precision, precision), task=task).run()
    assert summary["precision"] == resolve_precision(precision, CPU)
    assert set(seen) == {compute}  # training steps and evaluations alike
    assert {p.dtype for p in task.model.parameters()} == {weights}
    assert summary["frozen_blocks"] == ["0", "1"] and summary["test_accuracy"] > 0.9


def test_16_mixed_a_step_with_nothing_trainable_does_not_fail_the_scaler():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    plain = torch.amp.GradScaler("cpu")
    plain.scale(model(torch.ones(1, 4)).sum().detach())  # a loss without a graph: no parameter gets a gradient
    plain.unscale_(optimizer)  # what a bare GradScaler does then (accelerate#1990)
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        plain.step(optimizer)
    precision = Precision("16-mixed", CPU)
    before = [p.detach().clone() for p in model.parameters()]
    scale = precision.scaler.get_scale()
    precision.step(optimizer, scheduler, 1.0, [])
    assert precision.empty_steps == 1 and precision.scaler.get_scale() == scale
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scheduler.last_epoch == 1 and optimizer.state == {}  # the schedule goes on; Adam took no step
    with precision.autocast():  # and the next step with a gradient goes through the scaler
        loss = model(torch.ones(3, 4)).float().square().mean()
    precision.backward(loss)
    precision.step(optimizer, scheduler, 1.0, list(model.parameters()))
    assert not torch.equal(before[0], model.weight) and model.weight.grad is None


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts reads of a tensor's value on the host (``.item()``, ``float(t)``: ``aten._local_scalar_dense``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _scaled_step_reads(optimizer: torch.optim.Optimizer, model: nn.Module) -> int:
    precision = Precision("16-mixed", CPU)
    with precision.autocast():
        loss = model(torch.ones(3, 4)).float().square().mean()
    precision.backward(loss)
    with _HostReads() as reads:
        precision.step(optimizer, None, None, list(model.parameters()))
    return reads.count


def test_16_mixed_trains_with_the_fused_adamw_and_its_step_reads_nothing_on_the_host(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    # found_inf.item() (a sync on a GPU), and each parameter's step count (a CPU tensor there, so no sync)
    assert _scaled_step_reads(torch.optim.AdamW(model.parameters(), lr=0.1), model) == 1 + 2
    assert _scaled_step_reads(torch.optim.AdamW(model.parameters(), lr=0.1, fused=True), model) == 0
    trainer = Trainer(_config(tmp_path, "fp16", "16-mixed"), task=blob_task())
    trainer.setup()
    assert trainer.optimizer.defaults["fused"] is True
    plain = Trainer(_config(tmp_path, "fp32", "32-true"), task=blob_task())
    plain.setup()
    assert not plain.optimizer.defaults["fused"]  # float32 keeps AdamW's default (foreach)


def test_16_mixed_thaw_of_a_block_demoted_to_float16_trains_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    precision = Precision("16-mixed", CPU)
    g = torch.Generator().manual_seed(1)

    def step():
        with precision.autocast():
            loss = model(torch.randn(8, 8, generator=g)).float().square().mean()
        precision.backward(loss)
        precision.step(optimizer, None, 1.0, [p for p in model.parameters() if p.grad is not None])

    with Freezer(model, optimizer, "none", demote=Demotion("float16")) as freezer:
        step()
        freezer.freeze(0)
        assert model[0].weight.dtype == torch.float16 and not model[0].weight.requires_grad
        step()  # an fp16 frozen block, no gradient, nothing unscaled
        at_thaw = model[0].weight.detach().clone()
        freezer.thaw(0)
        assert model[0].weight.dtype == torch.float32 and model[0].weight.requires_grad
        with precision.autocast():
            loss = model(torch.randn(8, 8, generator=g)).float().square().mean()
        precision.backward(loss)
        assert model[0].weight.grad is not None and model[0].weight.grad.dtype == torch.float32
        precision.step(optimizer, None, 1.0, [p for p in model.parameters() if p.grad is not None])
        assert not torch.equal(model[0].weight.detach(), at_thaw.float())  # the thawed block trained


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_a_resume_under_each_precision_equals_the_uninterrupted_run(tmp_path, precision, monkeypatch):
    if precision == "16-mixed":  # a loss scale fp16 gradients overflow at: the scaler backs off in the first steps,
        init = torch.amp.GradScaler.__init__  # so a resume that forgot the scale would skip steps again

        def huge(self, *args, **kw):
            init(self, *args, **{**kw, "init_scale": 2.0**40})

        monkeypatch.setattr(torch.amp.GradScaler, "__init__", huge)
    ref = Trainer(_config(tmp_path, "ref", precision), task=blob_task()).run()

    def press_ctrl_c(fetches):  # while loading the 3rd batch of epoch 2 (the cache's check reads 2 x 4 samples)
        if fetches == 16 * 8 + 3 + 2 * 4:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        Trainer(_config(tmp_path, "cut", precision), task=blob_task(press_ctrl_c)).run()
    resumed = _config(tmp_path, "cut", precision)
    resumed.run.resume = str(tmp_path / "cut")
    got = Trainer(resumed, task=blob_task()).run()
    assert got["resumed_from_step"] == 9 and got["steps"] == ref["steps"] == 12
    if precision == "16-mixed":
        assert ref["loss_scale"] < 2.0**40 and got["loss_scale"] == ref["loss_scale"]
    a = load_file(tmp_path / "ref" / "checkpoint" / "model.safetensors")
    b = load_file(tmp_path / "cut" / "checkpoint" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ref["test_accuracy"] == got["test_accuracy"]


@pytest.mark.parametrize("saved, now", [("32-true", "bf16-true"), ("bf16-true", "32-true")])
def test_a_resume_that_would_cast_frozen_blocks_is_refused_before_anything_is_written(tmp_path, saved, now):
    # it stopped at the first checksum check, "frozen block changed since it froze ... something updated it outside
    # the optimizer", with the new precision already in config.json: every later --resume failed the same way
    from layerfreeze.errors import ConfigError

    def press_ctrl_c(fetches):
        if fetches == 16 * 4 + 3:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        Trainer(_config(tmp_path, "cut", saved), task=blob_task(press_ctrl_c)).run()
    config = (tmp_path / "cut" / "config.json").read_text()
    resumed = _config(tmp_path, "cut", now)
    resumed.run.resume = str(tmp_path / "cut")
    with pytest.raises(ConfigError, match=rf"trained under train.precision {saved} and has frozen blocks \(0, 1\); "
                                          rf"{now} would cast their weights.* resume with --precision {saved}"):
        Trainer(resumed, task=blob_task()).run()
    assert (tmp_path / "cut" / "config.json").read_text() == config
    resumed = _config(tmp_path, "cut", saved)  # as the message says
    resumed.run.resume = str(tmp_path / "cut")
    assert Trainer(resumed, task=blob_task()).run()["steps"] == 12


def test_a_resume_into_or_out_of_16_mixed_is_refused(tmp_path):
    # from 32-true it crashed in Adam ("Expected grad_scale and found_inf to be None": the saved param groups are not
    # fused), after config.json and a checkpoint were rewritten: the run could not be resumed any more
    from layerfreeze.errors import ConfigError

    def press_ctrl_c(fetches):
        if fetches == 16 * 4 + 3:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        Trainer(_config(tmp_path, "cut", "32-true", {"strategy": "none"}), task=blob_task(press_ctrl_c)).run()
    resumed = _config(tmp_path, "cut", "16-mixed", {"strategy": "none"})
    resumed.run.resume = str(tmp_path / "cut")
    with pytest.raises(ConfigError, match=r"trained under train.precision 32-true; 16-mixed steps the optimizer .* "
                                          r"resume with --precision 32-true"):
        Trainer(resumed, task=blob_task()).run()


def test_an_unknown_precision_is_refused_with_the_names():
    from layerfreeze.errors import ConfigError

    with pytest.raises(ConfigError, match="train.precision"):
        build_config({"train": {"precision": "fp8"}})


def test_16_mixed_on_the_cpu_runs_and_says_what_it_costs():
    # it ran ~7x slower than 32-true on the 2-core CPU in silence (Lightning switches it to bf16-mixed there)
    with pytest.warns(UserWarning, match="16-mixed on the CPU: float16 autocast runs there, but slower than 32-true"):
        assert Precision("16-mixed", CPU).scaler is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Precision("bf16-mixed", CPU)


def test_the_cli_takes_precision_on_train_plan_and_compare(tmp_path, capsys):
    from layerfreeze.cli import main

    for command in (["train"], ["plan", "--memory", "60%"], ["compare"]):
        assert main([*command, "--precision", "fp8", "--run-dir", str(tmp_path / command[0])]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert "train.precision: 'fp8' is not one of auto, 32-true, bf16-mixed, 16-mixed, bf16-true" in err
        assert not (tmp_path / command[0]).exists()
    assert main(["config", "--set", "train.precision=bf16-mixed"]) == 0
    assert "precision: bf16-mixed" in capsys.readouterr().out


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_the_activation_cache_under_a_precision_gives_the_same_run_as_without(tmp_path, precision):
    from layerfreeze.runs.rundir import read_metrics

    plain = _config(tmp_path, "plain", precision, epochs=3)
    plain.freeze.cache = {"mode": "off"}
    Trainer(plain, task=blob_task()).run()
    cached = Trainer(_config(tmp_path, "cached", precision, epochs=3), task=blob_task()).run()
    assert cached["cache"]["hits"] == 192  # the prefix's outputs served from the cache in epochs 2 and 3

    def losses(name):
        return [r["loss"] for r in read_metrics(tmp_path / name) if r["type"] == "step"]

    assert losses("plain") == losses("cached")


def test_the_ledger_counts_autocasts_weight_casts_in_a_bucket_of_their_own():
    from layerfreeze.runs.ledger import MemoryLedger

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)
    seen = {}
    for name, precision in (("32-true", Precision("32-true", CPU)), ("bf16-mixed", Precision("bf16-mixed", CPU))):
        ledger = MemoryLedger(model, optimizer, every=1)
        with ledger.step(1):
            with precision.autocast():
                loss = model(x).float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        seen[name] = ledger.last.devices["cpu"]
        ledger.close()
    assert "autocast_casts" not in seen["32-true"]
    # the backward holds the bfloat16 copy of the second Linear's weight (its input needs grad; the first one's does
    # not, so its weight's copy is not saved): 256 x 10 x 2 bytes, no longer counted as an activation
    assert seen["bf16-mixed"]["autocast_casts"] == 256 * 10 * 2
    # activations: the first Linear's input (32 x 64) and the ReLU's output, which is the second Linear's input
    # (32 x 256, one storage), in bfloat16 under autocast, and the float32 logits the loss squares (32 x 10)
    assert seen["bf16-mixed"]["activations"] == 2 * (32 * 64 + 32 * 256) + 4 * 32 * 10
    assert seen["32-true"]["activations"] == 4 * (32 * 64 + 32 * 256 + 32 * 10)
