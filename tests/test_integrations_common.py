"""What the callbacks share, and the default strategy (smartfrz) through both: no hard dependency (a clear error
naming the extra), the full-form optimizer state that a framework's rebuilt optimizer loads, the snapshot that keeps
a loaded optimizer state across a freezer restore, and smartfrz running in real Lightning / HF Trainer steps."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from layerfreeze import Freezer
from layerfreeze.integrations import require
from layerfreeze.integrations.common import OptimizerSnapshot, full_optimizer_state_dict

from .integration_models import Scripted, TokenDataset, blobs, mlp, tiny_bert


def test_no_hard_dependency_and_the_error_names_the_extra():
    code = ("import sys; import layerfreeze, layerfreeze.integrations; "
            "assert 'lightning' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    with pytest.raises(ImportError, match=r"pip install layerfreeze\[lightning\]"):
        require("lightning_not_installed_here", "lightning")


def step(model, optimizer, n=2):
    x, y = blobs(16)
    for _ in range(n):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_full_form_loads_into_a_rebuilt_optimizer_and_the_snapshot_keeps_it_across_the_restore():
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    freezer = Freezer(model, optimizer, Scripted({}))
    step(model, optimizer)
    freezer.freeze(1)
    freezer.freeze(0)
    step(model, optimizer)
    freezer.thaw(1)  # appended at the end of its group: not the model's order any more
    step(model, optimizer)
    buffer = io.BytesIO()  # through a file, as in a checkpoint (in memory the two optimizers would share tensors)
    torch.save({"optimizer": full_optimizer_state_dict(freezer), "freezer": freezer.state_dict()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    full, saved = loaded["optimizer"], loaded["freezer"]
    assert len(optimizer.param_groups[0]["params"]) == 6  # the live optimizer is untouched

    # resume: the framework rebuilds the optimizer over every parameter and loads the full form into it
    model2 = mlp()
    model2.load_state_dict(model.state_dict())
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=0.01)
    optimizer2.load_state_dict(full)
    snapshot = OptimizerSnapshot(optimizer2)
    freezer2 = Freezer(model2, optimizer2, Scripted({}))
    freezer2.load_state_dict(saved)
    snapshot.restore()
    assert freezer2.frozen == freezer.frozen == [True, False, False, False]
    for p, p2 in zip(model.parameters(), model2.parameters()):
        state, state2 = optimizer.state.get(p), optimizer2.state.get(p2)
        assert (state is None) == (state2 is None)
        if state is not None:
            assert torch.equal(state["exp_avg"], state2["exp_avg"]) and torch.equal(state["step"], state2["step"])
    step(model, optimizer, 1)
    step(model2, optimizer2, 1)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)


def test_smartfrz_default_through_the_hf_trainer(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from layerfreeze.integrations.hf import LayerFreezeCallback

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=10, report_to=[],
                             use_cpu=True, disable_tqdm=True, save_strategy="no", logging_steps=5)
    trainer = Trainer(model=tiny_bert(), args=args, train_dataset=TokenDataset())
    callback = LayerFreezeCallback().attach(trainer)
    trainer.train()
    assert callback.freezer.strategy.name == "smartfrz" and callback.freezer.strategy.stage_every == 1
    # a stage every step (10 steps / 150 rounds up to 1): the head's recorder has the start snapshot + one per step
    assert callback.freezer.strategy.recorder.counts[-1] == 11
    # logged at the Trainer's logging_steps (5, 10) and at every freeze: the window as it was then
    logged = [(h["step"], h["layerfreeze/window_fill"]) for h in trainer.state.log_history
              if "layerfreeze/window_fill" in h]
    freezes = {h["step"] for h in callback.freezer.history if h["kind"] == "freeze" and h["step"] > 0}
    assert {s for s, _ in logged} == {5, 10} | freezes
    assert dict(logged)[5] == 6 and dict(logged)[10] == 11  # start + one per step


def test_smartfrz_default_through_lightning(tmp_path):
    pytest.importorskip("lightning")
    from layerfreeze.integrations.lightning import LayerFreeze

    from .test_integration_lightning import fit

    callback = LayerFreeze(submodule="net")
    fit(tmp_path, callback, max_epochs=2)
    assert callback.freezer.strategy.name == "smartfrz" and callback.freezer.step_count == 16
    assert callback.freezer.strategy.recorder.counts[-1] == 17  # the head: the start snapshot + one per step


class _CallCheckpointed(torch.nn.Sequential):
    """A layer whose ``__call__`` reads ``training`` before its hooks run, as transformers' (<= 5.17)
    ``GradientCheckpointingLayer.__call__`` does to choose a reentrant checkpoint of the whole call."""

    seen: list[bool]

    def __call__(self, *args, **kwargs):
        self.seen.append(self.training)
        if self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(super().__call__, *args, use_reentrant=True, **kwargs)
        return super().__call__(*args, **kwargs)


def test_a_frozen_block_is_in_eval_mode_before_a_wrapper_reads_training_and_checkpointed_layers_train():
    """The frameworks call ``model.train()`` every step; the Freezer puts frozen blocks back in eval mode before the
    model's forward, so a layer that decides in ``__call__`` does not checkpoint a frozen block (inside which the
    boundary's hook, with grad mode off, could not mark its output: no gradient for any layer after it)."""
    from layerfreeze.integrations.common import CheckpointBoundary

    torch.manual_seed(0)
    layers = [_CallCheckpointed(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(3)]
    for layer in layers:
        layer.seen = []
    model = torch.nn.Sequential(*layers, torch.nn.Linear(8, 2))
    freezer = Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "static", {"k": 1})
    boundary = CheckpointBoundary()
    boundary.update(freezer)
    model.train()  # what the HF Trainer does before every step
    model(torch.randn(4, 8)).sum().backward()
    assert layers[0].seen == [False] and layers[1].seen == [True]  # the frozen block: eval before its __call__
    assert layers[0][0].weight.grad is None
    assert layers[1][0].weight.grad is not None and float(layers[1][0].weight.grad.abs().sum()) > 0
    assert layers[2][0].weight.grad is not None
    boundary.close()
    freezer.close()


def test_the_logged_timeline_skips_records_that_are_not_freezes_or_thaws():
    """A warning record of the integrity check (no block) reached the callbacks' metrics, whose timeline read
    ``event["block"]``: a KeyError in the HF callback's on_step_end (issue 41)."""
    from layerfreeze.integrations.common import FreezeSession

    model = mlp()
    freezer = Freezer(model, torch.optim.SGD(model.parameters(), lr=0.1), "none")
    session = FreezeSession(freezer)
    freezer.freeze(0)
    session.events.append({"kind": "unfrozen", "message": "trainable block(s) got no gradient", "step": 1})
    out = session.metrics(None)
    assert out["layerfreeze/frozen_count"] == 1.0 and out[f"layerfreeze/frozen/{freezer.blocks[0].name}"] == 1.0
    assert not any("unfrozen" in key for key in out)
    session.close()
