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
