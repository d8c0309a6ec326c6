"""Every Python snippet of the README runs as written, with only the user's own model and data filled in: the ones
this module runs (frozen compute, the DDP loop on 2 ranks, Lightning, the Hugging Face Trainer, accelerate, each
with a real tiny trainer), the others by the test files named in ``RUNNERS``; and every name the README imports or
names from ``layerfreeze`` exists where it says."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

import layerfreeze
from tests.conftest import README, readme_block, readme_blocks, readme_setup

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]

#: What introduces each README snippet -> the test file that runs its text.
RUNNERS = {
    "## In your own training loop": "tests/test_readme_loop.py",
    "### Add your own model family": "tests/test_families_recipe.py",
    "## Frozen compute": "tests/test_readme_snippets.py",
    "In your own loop, three lines change": "tests/test_readme_snippets.py",
    "**Lightning**": "tests/test_readme_snippets.py",
    "**Hugging Face `Trainer`**": "tests/test_readme_snippets.py",
    "**accelerate**": "tests/test_readme_snippets.py",
    "### Register your own strategy": "tests/test_strategies_register.py",
    "## Memory: where the bytes go": "tests/test_ledger.py",
    "### Memory budgets: what to freeze to fit": "tests/test_budget.py",
}


def run(marker: str, namespace: dict) -> dict:
    """Exec the README snippet after ``marker`` as written (it builds its own tiny model and data) in
    ``namespace``; returns it."""
    exec(compile(readme_block(marker), f"{README}#{marker}", "exec"), namespace)  # noqa: S102 - our own README
    return namespace


def run_setup(setup: str) -> dict:
    """Exec a snippet's marked setup alone (see ``readme_setup``): what the snippet starts from."""
    namespace: dict = {}
    exec(compile(setup, f"{README}#setup", "exec"), namespace)  # noqa: S102 - our own README
    return namespace


def test_every_snippet_that_needs_a_model_or_data_builds_it_in_a_marked_setup():
    """Each snippet runs as written: one that uses a model or data the user brings builds a tiny one first, in
    lines marked ``# setup:`` ... ``# end of setup`` (or, Lightning's, a class marked setup)."""
    for block in readme_blocks():
        if any(name in block for name in ("model", "loader", "train_set", "batch")) and "class Tower" not in block:
            assert "# setup:" in block or "setup: your LightningModule" in block, block[:200]


def test_every_readme_snippet_is_run_by_a_test():
    assert sorted(readme_block(m) for m in RUNNERS) == sorted(readme_blocks())  # no snippet without a runner
    for marker, path in RUNNERS.items():
        text = (ROOT / path).read_text()
        heading = marker.lstrip("#* ").rstrip("*")
        assert marker in text or heading in text or "own_loop_example" in text, (marker, path)


def test_the_names_the_readme_imports_and_names_exist():
    text = README.read_text()
    for module, names in re.findall(r"^from (layerfreeze[\w.]*) import ([\w, ]+)$", text, re.M):
        imported = importlib.import_module(module)
        for name in names.split(","):
            assert hasattr(imported, name.strip()), f"from {module} import {name.strip()}"
    for dotted in set(re.findall(r"\blayerfreeze(?:\.\w+)+", text)) - {"layerfreeze.pt"}:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ModuleNotFoundError:
                continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError names what the README names wrongly
    # the loop and frozen-compute sections name the library's classes and functions bare: the package root has them
    sections = text.split("## In your own training loop")[1].split("\n## ")[0]
    sections += text.split("## Frozen compute")[1].split("\n### ")[0]
    named = set(re.findall(r"`([A-Z]\w+|[a-z_]+)\(", sections)) | set(re.findall(r"`([A-Z][A-Za-z]+)`", sections))
    modules = [importlib.import_module(f"layerfreeze.{m}") for m in (
        "compute.frozen", "compute.precomputed", "compute.cache", "compute.store", "engine", "checkpoint",
        "engine.optim", "models.blocks")]
    ours = {n for n in named if any(getattr(m, n, None) is not None and getattr(getattr(m, n), "__module__", "")
                                    .startswith("layerfreeze") for m in modules)}
    assert {"FrozenDifferentiable", "PrecomputeRefused", "GlobalRNGUsedError", "precompute", "Freezer"} <= ours
    assert sorted(n for n in ours if not hasattr(layerfreeze, n)) == []


# ---- Frozen compute ---------------------------------------------------------------------------------------------


def test_the_frozen_compute_snippet():
    torch.manual_seed(0)
    setup, _ = readme_setup(readme_block("## Frozen compute"))
    before = run_setup(setup)  # the same seed: the weights the snippet starts from
    ns = run("## Frozen compute", {})
    device, train_set, head = ns["device"], ns["train_set"], ns["head"]
    assert device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert ns["side"] == ("cuda:1" if torch.cuda.device_count() > 1 else device)
    # precompute stored one output per item; PrecomputedDataset gives it back under "features"
    assert len(ns["store"]) == len(train_set) == 40
    item = ns["PrecomputedDataset"](train_set, ns["store"])[5]
    direct = ns["embed"]({"input_ids": ns["ids"][:8]})[5]
    assert item["features"].dtype == torch.float32 and item["index"] == 5
    torch.testing.assert_close(item["features"].to(device), direct, rtol=2e-2, atol=2e-2)  # bf16, other batch
    assert not torch.equal(head.weight.detach(), before["head"].weight.detach())  # both loops trained the head
    # the gradient went through the frozen bfloat16 denoiser into the ControlNet, in float32; the denoiser got none
    controlnet, unet = ns["controlnet"], ns["unet"].module
    assert controlnet.weight.grad is not None and controlnet.weight.grad.dtype == torch.float32
    assert unet.weight.grad is None and unet.weight.dtype == torch.bfloat16
    assert torch.equal(unet.weight.float().cpu(), before["unet"].weight.detach().bfloat16().float())


# ---- torchrun / DDP ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_the_ddp_own_loop_snippet_on_two_ranks(tmp_path):
    from tests.distributed.launch import launch

    ranks = launch({}, tmp_path, module="tests.distributed.readme_ddp")
    assert ranks.returncodes == [0, 0], "\n".join(o[-3000:] for o in ranks.outputs)
    a, b = ranks.results
    assert a["hashes"] == b["hashes"]  # the ranks stayed in step
    assert a["steps"] == a["planned"] == 16 and a["strategy"] == "smartfrz" and a["rebuilds"] >= 1
    assert a["history"] == b["history"]


def test_the_ddp_own_loop_snippet_under_plain_python_says_to_use_torchrun(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match=r"run this loop under torchrun, on two or more processes: "
                                         r"torchrun --nproc_per_node 2 file.py"):
        run("In your own loop, three lines change", {})


# ---- Lightning, Hugging Face Trainer, accelerate ------------------------------------------------------------------


def test_the_lightning_snippet(tmp_path, monkeypatch):
    pytest.importorskip("lightning.pytorch")
    monkeypatch.chdir(tmp_path)  # Lightning writes lightning_logs/ here
    ns = run("**Lightning**", {})
    trainer, module = ns["trainer"], ns["module"]
    freeze = next(cb for cb in trainer.callbacks if type(cb).__name__ == "LayerFreeze")
    assert trainer.current_epoch == 3 and trainer.global_step == 24
    assert freeze.freezer.strategy.name == "smartfrz" and freeze.freezer.step_count == 24
    assert freeze.freezer.model is module.model  # submodule="model"
    assert list(tmp_path.glob("lightning_logs/version_0/checkpoints/last.ckpt"))


def test_the_hugging_face_trainer_snippet(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    monkeypatch.chdir(tmp_path)  # TrainingArguments("out", ...) writes out/
    ns = run("**Hugging Face `Trainer`**", {})
    trainer = ns["trainer"]
    callback = next(cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "LayerFreezeCallback")
    assert callback.trainer is trainer and trainer.state.global_step == 48  # 8 epochs of 48 samples, batch 8
    assert callback.freezer.strategy.name == "smartfrz" and callback.freezer.step_count == 48
    # smartfrz froze blocks mid-run (its gradient SNR gate waits for the Adam step to peak and fall: 8 epochs, not
    # 3), and each freeze reached the Trainer's log at its step (through trainer.log)
    events = [(h["step"], h["block"]) for h in callback.freezer.history]
    assert events and all(step > 0 for step, _ in events)
    logged = [(h["step"], k.removeprefix("layerfreeze/frozen/")) for h in trainer.state.log_history for k in h
              if k.startswith("layerfreeze/frozen/")]
    assert logged == events
    assert (tmp_path / "out").is_dir()


def test_the_accelerate_snippet():
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton: start and end clean
    try:
        ns = run("**accelerate**", {})
        assert ns["accelerator"].mixed_precision == "bf16"
        assert ns["freezer"].step_count == 8 and torch.isfinite(ns["loss"])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
