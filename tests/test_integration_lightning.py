"""The Lightning callback in real ``Trainer.fit`` runs: frozen weights bitwise unchanged, freezes at the steps the
strategy chose, discriminative LR on thaw, a resumed run equal to the uninterrupted one (#21901, #6891), the
freeze timeline in the logger, bf16 autocast, and 2-process DDP on CPU with identical weights after a thaw
(#20340)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")
import lightning.pytorch as L  # noqa: E402

from layerfreeze import block_param_groups, discover_blocks  # noqa: E402
from layerfreeze.integrations.lightning import LayerFreeze  # noqa: E402

from .integration_models import Scripted, blobs, check_rotation, mlp, run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Module(L.LightningModule):
    """The tiny MLP; one param group per block (discriminative LRs possible), LambdaLR decay per step."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.net = mlp()
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        groups = block_param_groups(self.net, discover_blocks(self.net), lr=self.lr)
        optimizer = torch.optim.AdamW(groups, lr=self.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.01 * s))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader():
    x, y = blobs(64)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)


def fit(tmp_path, callback, max_epochs=1, ckpt_path=None, module=None, **kwargs):
    module = module or Module()
    trainer = L.Trainer(max_epochs=max_epochs, callbacks=[callback, *kwargs.pop("callbacks", [])],
                        default_root_dir=tmp_path, accelerator="cpu", devices=1, enable_progress_bar=False,
                        enable_model_summary=False, logger=kwargs.pop("logger", False), **kwargs)
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return module, trainer


def snapshot(module):
    return {n: p.detach().clone() for n, p in module.net.named_parameters()}


def test_static_freezes_before_the_optimizer_and_frozen_weights_stay_bitwise(tmp_path):
    module = Module()
    before = snapshot(module)
    callback = LayerFreeze("static", {"k": 2}, submodule="net", ledger_every=1)
    fit(tmp_path, callback, module=module)
    after = snapshot(module)
    for name in before:
        frozen = name.startswith(("0.", "2."))
        assert torch.equal(before[name], after[name]) == frozen, name
    in_optimizer = {id(p) for g in callback.freezer.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in in_optimizer for p in list(module.net[0].parameters()) + list(module.net[2].parameters()))
    assert not any(p in callback.freezer.optimizer.state for p in module.net[0].parameters())
    assert [(h["kind"], h["block"], h["step"]) for h in callback.freezer.history] == [("freeze", "0", 0),
                                                                                       ("freeze", "2", 0)]
    # the memory ledger against bytes computed by hand: mlp() is Linear(8, 16), Tanh, Linear(16, 16), Tanh,
    # Linear(16, 16), Tanh, Linear(16, 3); static k=2 freezes the first two Linear layers; batches of 8
    peaks = callback.session.ledger.peaks.summary()
    trainable, frozen = 4 * ((16 * 16 + 16) + (16 * 3 + 3)), 4 * ((8 * 16 + 16) + (16 * 16 + 16))
    at_peak = peaks["at_tensor_peak"]
    loss = 8 * 3 * 4 + 8 * 8 + 4  # cross-entropy: log_softmax's output, the int64 targets, a total weight
    assert at_peak == {"params_trainable": trainable, "params_frozen": frozen, "buffers": 0, "grads": trainable,
                       "optimizer": 2 * trainable + 4 * 4,  # AdamW: two moments, a float32 step per tensor
                       # the frozen prefix's output (Linear(16, 16)'s input) and the Tanh's output after it
                       "activations": 2 * 8 * 16 * 4 + loss}
    assert peaks["samples"] == 8 and peaks["blocks"]["activations"] == [0, 0, 8 * 16 * 4, 8 * 16 * 4]


def test_freeze_and_thaw_at_the_strategy_steps_with_the_timeline_in_the_logger(tmp_path):
    plan = {2: [("freeze", 0)], 3: [("freeze", 1)], 5: [("thaw", 1)]}
    module = Module()
    seen: dict[int, dict[str, torch.Tensor]] = {}

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen[trainer.global_step] = snapshot(pl_module)

    logger = L.loggers.CSVLogger(tmp_path, name="log")
    callback = LayerFreeze(Scripted(plan), submodule="net")
    fit(tmp_path, callback, module=module, logger=logger, callbacks=[Watch()], log_every_n_steps=1)
    assert [(h["kind"], h["index"], h["step"]) for h in callback.freezer.history] == [
        ("freeze", 0, 2), ("freeze", 1, 3), ("thaw", 1, 5)]
    # block 0 (net.0) frozen after step 2: unchanged from then on; block 1 (net.2) frozen in steps 4-5 only
    assert all(torch.equal(seen[2]["0.weight"], seen[s]["0.weight"]) for s in range(3, 9))
    assert torch.equal(seen[3]["2.weight"], seen[5]["2.weight"])
    assert not torch.equal(seen[5]["2.weight"], seen[6]["2.weight"])  # thawed: trains again
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    timeline = [(int(r["step"]), k, float(v)) for r in rows for k, v in r.items() if k.startswith("layerfreeze/frozen/")
                and v != ""]
    assert timeline == [(2, "layerfreeze/frozen/0", 1.0), (3, "layerfreeze/frozen/2", 1.0),
                        (5, "layerfreeze/frozen/2", 0.0)]


def test_gradual_thaw_gets_its_discriminative_lr_and_the_group_count_never_changes(tmp_path):
    callback = LayerFreeze("gradual", {"every_steps": 3}, submodule="net")
    module, trainer = fit(tmp_path, callback)
    groups = trainer.optimizers[0].param_groups
    assert len(groups) == 4
    assert [h["step"] for h in callback.freezer.history if h["kind"] == "thaw"] == [3, 6]
    assert groups[2]["initial_lr"] == pytest.approx(0.05 / 2.6)
    assert groups[1]["initial_lr"] == pytest.approx(0.05 / 2.6 ** 2)
    assert len(groups[0]["params"]) == 0  # block 0 still frozen after 8 steps


def test_resume_after_a_thaw_equals_the_uninterrupted_run(tmp_path):
    def run(folder, ckpt_path=None, max_epochs=3):
        torch.manual_seed(0)
        checkpoint = L.callbacks.ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_epochs=1,
                                                 filename="{epoch}")
        return fit(folder, LayerFreeze("gradual", submodule="net"), max_epochs=max_epochs, ckpt_path=ckpt_path,
                   callbacks=[checkpoint])

    full, full_trainer = run(tmp_path / "full")
    part, _ = run(tmp_path / "part", max_epochs=2)  # interrupted after epoch 2 (block 2 thawed after epoch 1)
    resumed, resumed_trainer = run(tmp_path / "resumed", ckpt_path=tmp_path / "part" / "epoch=1.ckpt")
    assert resumed.losses == full.losses[16:]
    full_freezer, resumed_freezer = full_trainer.callbacks[0].freezer, resumed_trainer.callbacks[0].freezer
    assert resumed_freezer.frozen == full_freezer.frozen == [False, False, False, False]
    assert resumed_freezer.history == full_freezer.history
    for (name, a), b in zip(full.net.state_dict().items(), resumed.net.state_dict().values()):
        assert torch.equal(a, b), name
    # the block thawed before the interruption trained on after the resume (Lightning #21901)
    assert not torch.equal(part.net[4].weight, resumed.net[4].weight)


@pytest.mark.parametrize("strategy, params", [("lisa", {"gamma": 1, "k": 3}),
                                              ("badam", {"k": 2, "order": "descending"})])
def test_rotating_strategies_train_what_they_switch_on_with_state_only_for_it(tmp_path, strategy, params):
    # the optimizer is configured after the callback's setup froze the blocks the start stage switched off
    callback = LayerFreeze(strategy, params, submodule="net")
    weights, state = {}, {}

    def blocks():
        return [[p.detach().clone() for p in b.parameters()] for b in callback.freezer.blocks]

    class Watch(L.Callback):  # listed before LayerFreeze: it sees each step before the stage after it
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            weights.setdefault(0, blocks())

        def on_train_batch_end(self, trainer, pl_module, *args):
            weights[trainer.global_step] = blocks()
            state[trainer.global_step] = {id(p) for p in callback.freezer.optimizer.state}

    module = Module()
    trainer = L.Trainer(max_epochs=2, callbacks=[Watch(), callback], default_root_dir=tmp_path, accelerator="cpu",
                        devices=1, enable_progress_bar=False, enable_model_summary=False, logger=False)
    trainer.fit(module, loader())
    assert check_rotation(callback.freezer, weights, state) >= 4
    assert len(module.losses) == 16


def test_bf16_autocast(tmp_path):
    module = Module()
    before = snapshot(module)
    callback = LayerFreeze("static", {"k": 1}, submodule="net")
    fit(tmp_path, callback, module=module, precision="bf16-mixed")
    after = snapshot(module)
    assert torch.equal(before["0.weight"], after["0.weight"])
    assert not torch.equal(before["6.weight"], after["6.weight"])
    assert all(torch.isfinite(torch.tensor(module.losses)))


def test_ddp_two_processes_identical_weights_after_freeze_and_thaw(tmp_path):
    result = run_ranks([str(ROOT / "tests" / "scripts" / "lightning_ddp.py"), str(tmp_path)], tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["hash"] == ranks[1]["hash"]
    assert ranks[0]["history"] == ranks[1]["history"] == [["freeze", 0, 2], ["freeze", 1, 3], ["thaw", 1, 5]]
    # one more rebuild before step 4's forward, for the weight frozen by hand after step 3 (tests/scripts/
    # lightning_ddp.py): DDP's reducer waited for its gradient (Lightning's "parameters that were not used")
    assert ranks[0]["rebuilds"] == 4
    assert ranks[0]["frozen_unchanged"] and ranks[0]["thawed_changed"] and ranks[0]["hand_unchanged"]


def test_a_submodule_the_lightning_module_does_not_have_is_named_with_the_option(tmp_path):
    """Issue 32: ``submodule="model"`` on a module whose network is ``self.net`` said only AttributeError."""
    with pytest.raises(ValueError, match=r"LayerFreeze\(submodule='model'\): Module has no attribute 'model'\. Name "
                                         r"the attribute that holds the network to freeze \(its child modules: net\)"):
        fit(tmp_path, LayerFreeze("static", {"k": 1}, submodule="model"))
    module, _ = fit(tmp_path / "net", LayerFreeze("static", {"k": 1}, submodule="net"))
    assert not module.net[0].weight.requires_grad and module.net[2].weight.requires_grad


def test_a_memory_budget_pins_the_planned_prefix_and_the_peak_stays_within_it(tmp_path):
    """``memory_budget=0.6``: measured at ``on_train_start`` as if nothing were frozen (static's start stage already
    froze block 0), the plan's none peak is the ledger's peak of a real ``none`` run; the plan's prefix is pinned
    before the first step, stays bitwise unchanged, and the run's tensor peak is the one predicted."""
    _, none = fit(tmp_path / "none", LayerFreeze("none", submodule="net", ledger_every=1))
    none_peak = none.callbacks[0].session.ledger.peaks.tensor.bytes
    module = Module()
    before = snapshot(module)
    callback = LayerFreeze("static", {"k": 1}, submodule="net", ledger_every=1, memory_budget=0.6)
    fit(tmp_path / "budget", callback, module=module)
    plan = callback.memory_plan
    assert plan.none_peak_bytes == none_peak and plan.budget_bytes == int(0.6 * none_peak)
    assert plan.k >= 2 and callback.freezer.floor == plan.floor
    after = snapshot(module)
    for i in range(plan.k):
        name = f"{2 * i}.weight"
        assert torch.equal(before[name], after[name]), name
    assert callback.session.ledger.peaks.tensor.bytes == plan.predicted_peak_bytes <= plan.budget_bytes
    assert len(module.losses) == 8 + 2  # the measurement's two training_step calls, then the fit's 8 steps


class _AppliedGradients(L.Callback):
    """The L1 norm per block of the gradients each update applies (Lightning calls this after the closure's backward,
    before the step), beside the ``grad_l1`` the Freezer's strategy read for that update."""

    def __init__(self, callback: LayerFreeze) -> None:
        self.callback, self.applied, self.read = callback, {}, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        blocks = self.callback.freezer.blocks
        self.applied[trainer.global_step + 1] = [sum(float(p.grad.abs().sum()) for p in b.parameters()) for b in blocks]

    def on_train_batch_end(self, trainer, pl_module, *args):
        signal = self.callback.freezer.last_signals.get("grad_l1")
        if signal is not None and trainer.global_step not in self.read:
            self.read[trainer.global_step] = list(signal)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_autofreeze_reads_the_gradients_each_update_applies_after_the_closures_backward(tmp_path, accumulate):
    # Lightning runs forward and backward inside optimizer.step(closure): a hook before the step read the previous
    # update's gradients (zeros at step 1), and with accumulate_grad_batches=2 only the first micro-batch's
    callback = LayerFreeze("autofreeze", {"interval": 1, "percentile": 0})
    spy = _AppliedGradients(callback)
    fit(tmp_path, callback, callbacks=[spy], max_steps=4, accumulate_grad_batches=accumulate)
    assert sorted(spy.read) == [1, 2, 3, 4]
    for step, read in spy.read.items():  # the head is not scored (its entry is NaN)
        assert len(read) == len(spy.applied[step]) and read[-1] != read[-1], read
        torch.testing.assert_close(torch.tensor(read[:-1]), torch.tensor(spy.applied[step][:-1]), rtol=1e-5, atol=0)


def test_the_start_stages_freezes_open_the_timeline_in_the_logger(tmp_path):
    # made in the Freezer's constructor, before the callback's session existed: they never reached the logger
    logger = L.loggers.CSVLogger(tmp_path, name="log")
    callback = LayerFreeze("static", {"k": 2}, submodule="net")
    fit(tmp_path, callback, logger=logger, log_every_n_steps=1)
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    timeline = [(int(r["step"]), k, float(v)) for r in rows for k, v in r.items() if k.startswith("layerfreeze/frozen/")
                and v != ""]
    assert timeline == [(0, "layerfreeze/frozen/0", 1.0), (0, "layerfreeze/frozen/2", 1.0)]


def test_one_callback_fits_a_second_module_and_two_callbacks_on_one_module_are_refused(tmp_path):
    # a second fit (a second phase, a notebook's re-run) kept the first fit's closed Freezer: "after_backward() after
    # close()", and the new module was never frozen
    callback = LayerFreeze("static", {"k": 1}, submodule="net")
    fit(tmp_path / "a", callback)
    second = Module()
    before = snapshot(second)
    fit(tmp_path / "b", callback, module=second)
    assert callback.freezer.model is second.net and callback.freezer.frozen_blocks == ["0"]
    after = snapshot(second)
    assert torch.equal(before["0.weight"], after["0.weight"]) and not torch.equal(before["2.weight"], after["2.weight"])
    # two callbacks on one network would step two strategies over the same blocks
    with pytest.raises(RuntimeError, match=r"already has an open Freezer \(strategy 'static', on its"):
        fit(tmp_path / "c", LayerFreeze("static", {"k": 1}), callbacks=[LayerFreeze("lisa", {"k": 2})])



def test_a_fit_that_raised_leaves_the_callback_ready_for_the_next_fit(tmp_path):
    # Lightning calls no teardown after a fit that raised: the Freezer stayed open, the next fit kept it and trained
    # the new module with nothing frozen, in silence
    class Failing(Module):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("a data error at step 3")
            return super().training_step(batch, batch_idx)

    callback = LayerFreeze("static", {"k": 1}, submodule="net")
    with pytest.raises(RuntimeError, match="a data error at step 3"):
        fit(tmp_path / "a", callback, module=Failing())
    assert callback.freezer.closed
    second = Module()
    fit(tmp_path / "b", callback, module=second)
    assert callback.freezer.model is second.net and not second.net[0].weight.requires_grad


def test_swa_s_batchnorm_epoch_is_not_a_step_of_the_freezers_run(tmp_path):
    # StochasticWeightAveraging adds an epoch of forward passes on a model with BatchNorm (no backward, no weight
    # changed) that Lightning counts as one optimizer step: the Freezer got a 25th step of a 24-step run and warned
    # "freezer.step() was called 25 times, more than total_steps=24", telling the user to fix a loop that was right
    import warnings

    from lightning.pytorch.callbacks import StochasticWeightAveraging

    module = Module()
    module.net[1] = nn.BatchNorm1d(16)
    callback = LayerFreeze("linear", submodule="net")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, trainer = fit(tmp_path, callback, max_epochs=3, module=module,
                         callbacks=[StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)])
    assert trainer.global_step == 25 and callback.freezer.total_steps == 24  # the BatchNorm epoch's one step
    assert callback.freezer.step_count == 24
    assert not [w for w in caught if "total_steps" in str(w.message)]
    assert [(h["block"], h["step"]) for h in callback.freezer.history] == [("0", 16), ("1", 24), ("2", 24), ("4", 24)]


def test_stochastic_weight_averaging_recalibrates_a_frozen_blocks_batchnorm(tmp_path):
    # Lightning's SWA resets every BatchNorm's statistics and sets momentum=None, with no train() after: the frozen
    # block's BatchNorm, in eval mode since it froze, was never run in training mode and stayed at 0 and 1
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    class BatchNormModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)),
                                     nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), nn.Linear(8, 2))

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x, y = torch.randn(64, 4) * 3 + 5, torch.randint(0, 2, (64,))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    module = BatchNormModule()
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[LayerFreeze("static", {"k": 1}, submodule="net"),
                                   StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)])
    trainer.fit(module, data)
    bn = module.net[0][1]
    with torch.no_grad():  # the frozen Linear's outputs, batch by batch: momentum=None averages their statistics
        outs = [module.net[0][0](xb) for xb, _ in data]
    torch.testing.assert_close(bn.running_mean, torch.stack([o.mean(0) for o in outs]).mean(0))
    torch.testing.assert_close(bn.running_var, torch.stack([o.var(0) for o in outs]).mean(0))
    stats = bn.running_var.clone()
    module.net.train()
    module.net(x[:16])  # SWA put the momentum back: the frozen block's BatchNorm is in eval mode again
    assert bn.momentum == 0.1 and not bn.training and torch.equal(bn.running_var, stats)
