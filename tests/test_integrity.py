"""Nothing lost, nothing silent: a frozen set that stays frozen, trainable blocks that get gradients, loud
divergence, and checkpoints that survive a kill at any point. Each test reproduces a fault that went unnoticed
before (named in the test) and shows what happens now."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as grad_checkpoint

from layerfreeze import CheckpointError, Freezer
from layerfreeze.checkpoint import CheckpointStore
from layerfreeze.engine.integrity import FrozenWeightsChangedError, UnfrozenParameterError
from layerfreeze.runs.rundir import read_metrics
from layerfreeze.train.step import DivergenceError
from layerfreeze.train.trainer import Trainer
from tests.conftest import BlobDataset, blob_task
from tests.test_trainer import config


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def train_steps(model, optimizer, freezer, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        freezer.after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        freezer.step()


def test_a_rewrapped_frozen_parameter_is_refrozen_with_a_warning_naming_it():
    # before: `module.weight = nn.Parameter(module.weight.data)` came back with requires_grad=True and the frozen
    # block trained again, in silence
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    freezer = Freezer(model, optimizer, "static", {"k": 1})
    train_steps(model, optimizer, freezer, 2)
    model[0].weight = nn.Parameter(model[0].weight.data)  # what dtype conversions and some loaders do
    assert model[0].weight.requires_grad
    with pytest.warns(UserWarning, match=r"parameter '0.weight' of frozen block '0' was replaced"):
        train_steps(model, optimizer, freezer, 1, seed=1)
    assert not model[0].weight.requires_grad
    before = model[0].weight.detach().clone()
    train_steps(model, optimizer, freezer, 3, seed=2)
    assert torch.equal(model[0].weight, before) and model[0].weight.grad is None
    assert all(p is not model[0].weight for g in optimizer.param_groups for p in g["params"])
    freezer.verify_frozen_weights()  # same values: the checksum still holds

    strict = Freezer(mlp(), None, "static", {"k": 1}, on_unfrozen="error")
    strict.model[0].bias.requires_grad_(True)
    with pytest.raises(UnfrozenParameterError, match="'0.bias' of frozen block '0' requires grad again"):
        strict.step()


def test_a_frozen_weight_that_moved_is_an_error_naming_the_block_and_no_checkpoint_holds_it(tmp_path):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, optimizer, "static", {"k": 2})
    train_steps(model, optimizer, freezer, 2)
    freezer.verify_frozen_weights()
    with torch.no_grad():
        model[2].bias[3] += 1e-3  # an update outside the optimizer
    with pytest.raises(FrozenWeightsChangedError, match=r"frozen block '2' changed since it froze \(parameters 2.bias"):
        freezer.verify_frozen_weights()

    def nudge(trainer):  # in the CLI trainer: caught at the next checkpoint (the epoch end), nothing written
        if trainer.progress["step"] == 3:
            with torch.no_grad():
                trainer.model[0].weight.mul_(1.0001)

    with pytest.raises(FrozenWeightsChangedError, match="frozen block '0'"):
        Trainer(config(tmp_path, "moved"), task=blob_task(), step_callbacks=[nudge]).run()
    assert not (tmp_path / "moved" / "checkpoints").exists()
    assert not (tmp_path / "moved" / "summary.json").exists()


def test_frozen_weights_cast_after_the_freezer_was_built_get_their_checksum_again_and_checkpoints_go_on(tmp_path):
    # model.to(torch.float64) after the Freezer (lossless): every later checkpoint was refused with "something updated
    # it outside the optimizer", and the run could not be saved again
    from layerfreeze import load_checkpoint, save_checkpoint

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Freezer(model, optimizer, "static", {"k": 2}) as freezer:
        frozen = model[0].weight.detach().clone()
        model.to(torch.float64)
        with pytest.warns(UserWarning, match=r"frozen block '0': 0.bias, 0.weight were cast \(float32 -> float64\) "
                                             r"since it froze \(a model.to\(dtype\) after the Freezer was built\)"):
            freezer.verify_frozen_weights()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # taken again: said once
            freezer.verify_frozen_weights()
            save_checkpoint(tmp_path / "ck", model, optimizer, freezer)
        assert torch.equal(model[0].weight, frozen.double())
        with torch.no_grad():
            model[2].bias[3] += 1e-3  # a value that moved is still an error
        with pytest.raises(FrozenWeightsChangedError, match=r"frozen block '2' changed since it froze"):
            freezer.verify_frozen_weights()
    resumed = mlp().double()
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1)
    with Freezer(resumed, optimizer, "static", {"k": 2}) as freezer:
        load_checkpoint(tmp_path / "ck", resumed, optimizer, freezer)
        assert torch.equal(resumed[0].weight, frozen.double())
    # a float32 checkpoint resumed into a model cast before its Freezer (as the warning advises): the saved float32
    # checksums replaced this run's, and every later checkpoint was refused
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Freezer(model, optimizer, "static", {"k": 2}) as freezer:
        save_checkpoint(tmp_path / "ck32", model, optimizer, freezer)
    resumed = mlp().double()
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1)
    with Freezer(resumed, optimizer, "static", {"k": 2}) as freezer, warnings.catch_warnings():
        warnings.simplefilter("error")
        load_checkpoint(tmp_path / "ck32", resumed, optimizer, freezer)
        freezer.verify_frozen_weights()
        save_checkpoint(tmp_path / "ck64", resumed, optimizer, freezer)


class Detach(nn.Module):
    def forward(self, x):
        return x.detach()


def test_a_trainable_block_without_gradient_is_named_after_each_change_of_the_frozen_set():
    # a detached input: block 0 trains in name only
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Detach(), nn.Linear(16, 3))
    freezer = Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "none")
    with pytest.warns(UserWarning, match=r"block\(s\) 0 got no gradient"):
        train_steps(model, freezer.optimizer, freezer, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked once per frozen set, not every step
        train_steps(model, freezer.optimizer, freezer, 2)


class Checkpointed(nn.Module):
    """Embeddings, then two layers run with reentrant gradient checkpointing (transformers #21381)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = grad_checkpoint(layer, h, use_reentrant=True)
        return self.head(h)


def test_reentrant_checkpointing_behind_a_frozen_prefix_is_named_with_its_cause():
    model = Checkpointed()
    freezer = Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "static", {"k": 1},
                      blocks=["embed", "layers.*", "head"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_steps(model, freezer.optimizer, freezer, 1)
    messages = [str(w.message) for w in caught if "got no gradient" in str(w.message)]
    assert len(messages) == 1 and "layers.0, layers.1" in messages[0] and "use_reentrant=False" in messages[0]


def test_a_loss_stuck_at_chance_stops_the_run_with_a_checkpoint(tmp_path):
    # before: a run that learns nothing (labels unrelated to the inputs) trained to the end without a word
    task = blob_task()
    task.train_set.labels = torch.randint(0, 4, (96,), generator=torch.Generator().manual_seed(5))
    cfg = config(tmp_path, "stuck", freeze={"strategy": "none"}, epochs=40, lr=1e-4)
    cfg.run.divergence_window_steps = 30
    with pytest.raises(DivergenceError, match=r"at chance level for 30 steps .* ln\(4\)"):
        Trainer(cfg, task=task).run()
    records = read_metrics(tmp_path / "stuck")
    steps = [r["step"] for r in records if r["type"] == "step"]
    assert 30 <= max(steps) < 40 * 6
    assert any(r.get("kind") == "checkpoint" and r["reason"] == "DivergenceError" for r in records)


def test_with_the_guard_a_stuck_loss_thaws_the_latest_frozen_block_first(tmp_path):
    task = blob_task()
    task.train_set.labels = torch.randint(0, 4, (96,), generator=torch.Generator().manual_seed(5))
    cfg = config(tmp_path, "guarded", freeze={"strategy": "static", "params": {"k": 2},
                                              "guard": {"tolerance": 10.0}}, epochs=60, lr=1e-4)
    cfg.run.divergence_window_steps = 20
    with pytest.raises(DivergenceError):
        Trainer(cfg, task=task).run()
    thaws = [r for r in read_metrics(tmp_path / "guarded") if r.get("kind") == "thaw"]
    assert [t["block"] for t in thaws] == ["1", "0"] and all("chance level" in t["reason"] for t in thaws)


def test_a_non_finite_loss_stops_before_it_reaches_the_weights(tmp_path):
    class Exploding(BlobDataset):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            if self.fetches > 40:
                item["pixel_values"] = torch.full_like(item["pixel_values"], float("inf"))
            return item

    task = blob_task()
    task.train_set = Exploding(96, seed=1)
    with pytest.raises(DivergenceError, match="the training loss is nan at step 3"):
        Trainer(config(tmp_path, "nan", epochs=3), task=task).run()
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "nan" / "checkpoint" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_the_store_keeps_the_last_two_and_falls_back_past_a_corrupt_or_half_written_one(tmp_path):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, optimizer, "static", {"k": 1})
    store = CheckpointStore(tmp_path, keep=2)
    for step in (1, 2, 3):
        train_steps(model, optimizer, freezer, 1, seed=step)
        store.save(step, model, optimizer, freezer, extra={"step": step})
    assert [p.name for p in store.entries()] == ["000003-step000000003", "000002-step000000002"]
    assert os.readlink(tmp_path / "checkpoint") == "checkpoints/000003-step000000003"
    # a kill mid-write leaves a .tmp folder (ignored, removed by the next save) and never touches the finished ones;
    # before, a kill between the two renames of save_checkpoint left no checkpoint at all
    shutil.copytree(store.entries()[0], store.dir / "000004-step000000004.tmp")
    weights = store.entries()[0] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # and the newest finished one corrupt
    with pytest.warns(UserWarning, match="000003-step000000003 is unusable .*SHA-256.* falling back"):
        path, extra = store.load_latest(mlp(), None, None)
    assert path.name == "000002-step000000002" and extra == {"step": 2}
    (store.entries()[1] / "state.pt").unlink()
    with pytest.raises(CheckpointError, match="no usable checkpoint"), pytest.warns(UserWarning):
        store.load_latest(mlp())


def test_a_run_killed_before_its_first_checkpoint_starts_again_from_the_beginning(tmp_path, capsys):
    reference = Trainer(config(tmp_path, "ref"), task=blob_task()).run()
    run_dir = tmp_path / "cut"
    Trainer(config(tmp_path, "cut"), task=blob_task()).run()
    # what a SIGKILL in the first epoch leaves: the run folder with its config and metrics, no checkpoint yet
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "checkpoint").unlink()
    (run_dir / "summary.json").unlink()
    resumed = config(tmp_path, "cut")
    resumed.run.resume = str(run_dir)
    capsys.readouterr()
    summary = Trainer(resumed, task=blob_task()).run()
    said = capsys.readouterr()
    assert "has no checkpoint yet" in said.out + said.err
    assert summary["test_accuracy"] == reference["test_accuracy"] and summary["steps"] == reference["steps"]
    assert summary["freeze_timeline"] == reference["freeze_timeline"]
    from layerfreeze.runs.report import load_run

    run = load_run(run_dir)  # the report keeps only the restarted run's records
    assert list(run.step) == list(range(1, 13))
    assert [e["kind"] for e in run.events if e["kind"] == "freeze"] == ["freeze", "freeze"]


def test_periodic_checkpoints_cost_is_reported(tmp_path):
    cfg = config(tmp_path, "every")
    cfg.run.checkpoint_every_steps = 4
    summary = Trainer(cfg, task=blob_task()).run()
    reasons = [r["reason"] for r in read_metrics(tmp_path / "every") if r.get("kind") == "checkpoint"]
    assert reasons == ["periodic", "epoch_end", "periodic", "periodic", "epoch_end"]  # steps 4, 6, 8, 12, 12
    assert summary["checkpoints"] == 5 and summary["checkpoint_time_s"] > 0
    assert len(list((tmp_path / "every" / "checkpoints").iterdir())) == 2


def test_the_frozen_set_check_walks_only_when_something_could_have_changed():
    # issue 40: the check runs after every step; walking every frozen block's parameters each time was the engine's
    # per-step cost. It walks again after a freeze or thaw, any parameter/module registration, a change of the
    # optimizer's parameter count, or a frozen parameter that requires grad again; otherwise it is skipped
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    freezer = Freezer(model, optimizer, "static", {"k": 2})
    train_steps(model, optimizer, freezer, 1)
    walks = freezer.integrity.full_checks
    train_steps(model, optimizer, freezer, 3, seed=1)
    assert freezer.integrity.full_checks == walks  # nothing changed: no walk
    model[2].bias.requires_grad_(True)
    with pytest.warns(UserWarning, match=r"'2.bias' of frozen block '2' requires grad again"):
        freezer.step()
    assert freezer.integrity.full_checks == walks + 1 and not model[2].bias.requires_grad
    optimizer.add_param_group({"params": [model[0].weight]})  # a frozen parameter back in the optimizer
    with pytest.warns(UserWarning, match=r"'0.weight' of frozen block '0' is back in the optimizer"):
        freezer.step()
    assert all(p is not model[0].weight for g in optimizer.param_groups for p in g["params"])
    model[4].weight = nn.Parameter(model[4].weight.detach().clone())  # a registration anywhere: walk once
    freezer.step()
    freezer.step()
    assert freezer.integrity.full_checks == walks + 3
    freezer.thaw(1)
    freezer.step()
    assert freezer.integrity.full_checks == walks + 4


def test_block_parameter_lists_are_walked_again_after_a_registration():
    from layerfreeze.engine.params import BlockParams, structure_version
    from layerfreeze.models.discovery import discover_blocks

    model = mlp()
    params = BlockParams(discover_blocks(model))
    first = params.of(0)
    assert first == [model[0].weight, model[0].bias] and params.of(0) is first  # kept
    before = structure_version()
    model[0].weight = nn.Parameter(torch.zeros(16, 8))
    assert structure_version() > before
    assert params.of(0) == [model[0].weight, model[0].bias] and params.of(0) is not first
    walking = BlockParams(params.blocks, cache=False)  # FSDP2's choice: a new walk every call
    assert walking.of(0) == params.of(0) and walking.of(0) is not walking.of(0) and walking.version() is None


def test_a_replaced_frozen_parameter_is_checksummed_anew_so_checkpoints_go_on(tmp_path):
    # the re-frozen replacement kept the old parameter's checksum: every later checkpoint was refused as "a frozen
    # weight that moved", while training went on
    from layerfreeze import save_checkpoint
    from layerfreeze.engine import FrozenWeightsChangedError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    freezer = Freezer(model, optimizer, "static", {"k": 1})

    def step():
        model(torch.randn(4, 4)).square().mean().backward()
        freezer.after_backward()
        optimizer.step()
        optimizer.zero_grad()
        freezer.step()

    step()
    model[0].weight = nn.Parameter(torch.randn(8, 4))  # loaded or resized weights
    with pytest.warns(UserWarning, match="was replaced by a new Parameter"):
        step()
    save_checkpoint(tmp_path / "ck", model, optimizer, freezer)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the replacement is guarded as the original was
    with pytest.raises(FrozenWeightsChangedError):
        save_checkpoint(tmp_path / "ck2", model, optimizer, freezer)
    freezer.close()


@pytest.mark.parametrize("which", [0, 2])  # a frozen block, a trainable one
def test_a_block_module_replaced_after_the_freezer_was_built_is_refused_at_the_next_step(which):
    # model[0] = nn.Linear(...) in a frozen block trained while the block was reported frozen (the Freezer held the
    # old module); in a trainable one the new weights were in no param group and would never train or freeze
    from layerfreeze.engine import BlockModuleReplacedError

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, optimizer, "static", {"k": 1})
    train_steps(model, optimizer, freezer, 2)
    model[which] = nn.Linear(*reversed(model[which].weight.shape))
    with pytest.raises(BlockModuleReplacedError, match=rf"^{which} \(block '{which}'\) is no longer in the model: "
                                                       "it was replaced after the Freezer was built"):
        train_steps(model, optimizer, freezer, 1)
    freezer.close()


def test_a_block_module_wrapped_in_place_is_still_found():
    # activation checkpointing's wrapper replaces the module in its parent but runs it (and its hooks): not refused
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, optimizer, "static", {"k": 1})
    train_steps(model, optimizer, freezer, 1)
    frozen = model[0].weight.detach().clone()
    model[2] = checkpoint_wrapper(model[2])
    train_steps(model, optimizer, freezer, 2)
    assert torch.equal(model[0].weight, frozen) and freezer.frozen_blocks == ["0"]
    freezer.close()
