"""The CLI trainer on a tiny synthetic task: telemetry files, measured FLOPs, Ctrl-C and exact resume."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from layerfreeze import BlockDiscoveryError
from layerfreeze.errors import ConfigError
from layerfreeze.runs.rundir import read_metrics, replay
from layerfreeze.train.config import build_config
from layerfreeze.train.trainer import Trainer
from tests.conftest import DEVICES, blob_task


def config(tmp_path, name, freeze=None, device="auto", **train):
    return build_config({
        "train": {"epochs": 2, "batch_size": 16, "lr": 0.01, "warmup_fraction": 0.1, **train},
        "freeze": freeze or {"strategy": "static", "params": {"k": 2}},
        "run": {"dir": str(tmp_path / name), "progress": False, "device": device},
    })


def test_run_writes_metrics_tensorboard_summary_and_flops_drop_with_frozen_prefix(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary = Trainer(config(tmp_path, "static"), task=blob_task()).run()
    full = Trainer(build_config({
        "train": {"epochs": 2, "batch_size": 16, "lr": 0.01},
        "freeze": {"strategy": "none"},
        "run": {"dir": str(tmp_path / "none"), "progress": False},
    }), task=blob_task()).run()

    assert summary["steps"] == 12 and summary["epochs"] == 2  # 96 samples / 16, two epochs
    assert summary["frozen_blocks"] == ["0", "1"]
    assert summary["trainable_parameters"] == 32 * 32 + 32 + 32 * 4 + 4
    # batch 16: full = fwd (2*16*(16*32+32*32+32*4)) + weight grads of all three + input grads of the last two
    fwd = 2 * 16 * (16 * 32 + 32 * 32 + 32 * 4)
    assert full["flops_per_step_first"] == fwd + fwd + 2 * 16 * (32 * 32 + 32 * 4)
    # static k=2: Linear(16,32) and the BN block frozen -> backward only for the last two Linear layers'
    # weights and the input grad of the last one
    assert summary["flops_per_step_first"] == fwd + 2 * 16 * (32 * 32 + 32 * 4) + 2 * 16 * 32 * 4
    # the cache (on by default) serves the frozen prefix's output from epoch 2 on: its forward, Linear(16, 32), is
    # then skipped too
    assert summary["flops_total"] == 12 * summary["flops_per_step_first"] - 6 * 2 * 16 * 16 * 32
    assert full["flops_total"] == 12 * full["flops_per_step_first"]  # nothing frozen, nothing cached
    assert summary["test_accuracy"] > 0.9 and full["test_accuracy"] > 0.9

    records = read_metrics(tmp_path / "static")
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert all(r["step_time_s"] > 0 and r["samples_per_s"] > 0 and r["peak_memory_bytes"] > 0 for r in steps)
    events = [(r["kind"], r.get("block")) for r in records if r["type"] == "event"]
    assert events[:2] == [("freeze", "0"), ("freeze", "1")]
    assert ("flops_remeasured", None) in events
    epochs = [r for r in records if r["type"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [0, 1] and all(0 <= r["eval_accuracy"] <= 1 for r in epochs)

    acc = EventAccumulator(str(tmp_path / "static" / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 13))
    assert [e.step for e in acc.Scalars("epoch/eval_accuracy")] == [6, 12]
    assert (tmp_path / "static" / "summary.json").is_file()


def test_ctrl_c_leaves_a_checkpoint_and_resume_matches_the_uninterrupted_run(tmp_path, capsys):
    ref_summary = Trainer(config(tmp_path, "ref"), task=blob_task()).run()

    def press_ctrl_c(fetches):
        # while loading the 9th batch (3rd of epoch 2); the cache's determinism check reads 2 x 4 samples first
        if fetches == 16 * 8 + 3 + 2 * 4:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        Trainer(config(tmp_path, "cut"), task=blob_task(press_ctrl_c)).run()
    kinds = [r.get("kind") for r in read_metrics(tmp_path / "cut")]
    assert "interrupted" in kinds
    assert max(r["step"] for r in read_metrics(tmp_path / "cut") if r["type"] == "step") == 9

    killed = tmp_path / "cut" / "cache" / "layerfreeze-cache-killed"  # what a SIGKILLed process's cache leaves
    killed.mkdir(parents=True)
    (killed / "shard-000001.safetensors").write_bytes(bytes(1000))
    resumed = config(tmp_path, "cut")
    resumed.run.resume = str(tmp_path / "cut")
    summary = Trainer(resumed, task=blob_task()).run()
    assert summary["steps"] == 12
    assert summary["resumed_from_step"] == 9 and ref_summary["resumed_from_step"] is None
    out = capsys.readouterr().out
    assert "resumed from" in out and not killed.exists()
    assert "cache: removed 1000 B of cache shards an earlier process of this run left in" in out
    # the cache's lookups in the last epoch record are the whole run's, as the summary's (they restarted from 0)
    last = replay(read_metrics(tmp_path / "cut")).epochs[-1]
    assert (last["cache_hits"], last["cache_misses"]) == (summary["cache"]["hits"], summary["cache"]["misses"])
    assert summary["cache"]["hits"] > 0
    from layerfreeze.runs.report import write_report

    page = write_report(tmp_path / "cut").read_text()  # its wall time is this process's, beside the whole run's
    assert "wall time (this process, from step 9)" in page and "wall time (this process" not in \
        write_report(tmp_path / "ref").read_text()
    # the memory ledger's peaks cover the whole run: sampled at steps 1 (before the cut, kept in the checkpoint) and 10
    assert summary["memory"]["samples"] == ref_summary["memory"]["samples"] == 2
    for bucket in ("params_trainable", "params_frozen", "grads", "optimizer", "activations"):
        assert summary["memory"]["buckets"][bucket] == ref_summary["memory"]["buckets"][bucket], bucket
    ref = load_file(tmp_path / "ref" / "checkpoint" / "model.safetensors")
    got = load_file(tmp_path / "cut" / "checkpoint" / "model.safetensors")
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key


def test_exception_in_the_loop_also_checkpoints(tmp_path):
    def fail(fetches):
        if fetches == 40:
            raise OSError("disk went away")

    with pytest.raises(OSError):
        Trainer(config(tmp_path, "crash"), task=blob_task(fail)).run()
    assert (tmp_path / "crash" / "checkpoint" / "state.pt").is_file()
    events = [r for r in read_metrics(tmp_path / "crash") if r.get("kind") == "interrupted"]
    assert "disk went away" in events[0]["error"]


def test_model_without_discoverable_blocks_and_head_reaching_k_fail_before_training(tmp_path):
    task = blob_task()

    class Opaque(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.body, self.out = inner[:6], inner[6]

        def forward(self, x):
            return self.out(self.body(x))

    task.model = Opaque(task.model)
    with pytest.raises(BlockDiscoveryError, match=r"body \(Sequential"):
        Trainer(config(tmp_path, "opaque"), task=task).run()
    cfg = config(tmp_path, "patterns")
    cfg.model.blocks = ["body.0", "body.1", "body.4", "out"]
    assert Trainer(cfg, task=task).run()["frozen_blocks"] == ["body.0", "body.1"]

    cfg = config(tmp_path, "too-far")
    cfg.freeze.params = {"k": 4}
    with pytest.raises(ConfigError, match="would freeze the head"):
        Trainer(cfg, task=blob_task()).run()
    assert not (tmp_path / "too-far" / "metrics.jsonl").exists()


def test_guard_holds_out_validation_data_and_reports_val_loss(tmp_path):
    cfg = config(tmp_path, "guard")
    cfg.freeze.guard = {"tolerance": 0.05, "every_steps": 2, "val_fraction": 0.1}
    summary = Trainer(cfg, task=blob_task()).run()
    assert summary["steps"] == 12  # 96 - ceil(9.6) = 86 training samples -> 6 batches of 16 per epoch
    val = [r for r in read_metrics(tmp_path / "guard") if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4, 6, 6, 8, 10, 12, 12]  # every 2 steps and at each epoch end
    assert all(r["val_loss"] > 0 for r in val)


def test_a_guard_thaw_is_a_line_of_the_runs_output(tmp_path, capsys):
    # random labels: the training loss falls as the trainable blocks memorise, the held-out loss rises, and the guard
    # thaws the frozen prefix back one block at a time; each thaw is said on the console, not only in metrics.jsonl
    task = blob_task()
    task.train_set.labels = torch.randint(0, 4, (96,), generator=torch.Generator().manual_seed(5))
    cfg = config(tmp_path, "guard-says", freeze={"strategy": "static", "params": {"k": 2},
                                                 "guard": {"tolerance": 0.01, "every_steps": 2, "cooldown": 100}},
                 epochs=8, lr=0.05)
    cfg.run.divergence_window_steps = None
    Trainer(cfg, task=task).run()
    thaws = [r for r in read_metrics(tmp_path / "guard-says") if r.get("kind") == "thaw"]
    assert [t["block"] for t in thaws] == ["1", "0"] and all(t["reason"].startswith("guard:") for t in thaws)
    out = capsys.readouterr().out
    for t in thaws:
        assert (f"stability guard: thawed {t['block']} at step {t['step']} (held-out "
                f"{t['reason'].removeprefix('guard: ')})") in out


def test_the_cache_line_of_a_none_run_says_it_is_idle(tmp_path, capsys):
    # a newcomer read "kept in up to 5.4 GiB" on compare's `none` row as the cache in use; none freezes no block
    Trainer(config(tmp_path, "none", freeze={"strategy": "none"}, epochs=1), task=blob_task()).run()
    out = capsys.readouterr().out
    assert "cache: auto, idle: strategy none freezes no block, so there is no frozen prefix to cache" in out
    assert "kept in up to" not in out


def test_frozen_prefix_cache_is_on_by_default_gives_the_same_losses_and_skips_prefix_flops(tmp_path, capsys):
    cfg = config(tmp_path, "plain", epochs=3)
    cfg.freeze.cache = {"mode": "off"}
    plain = Trainer(cfg, task=blob_task()).run()
    assert plain["cache"] == {"mode": "off", "used": False}
    cached = Trainer(config(tmp_path, "cached", epochs=3), task=blob_task()).run()  # freeze.cache: the default
    assert "cache: auto, frozen-prefix outputs kept in up to" in capsys.readouterr().out
    losses = lambda name: [r["loss"] for r in read_metrics(tmp_path / name) if r["type"] == "step"]  # noqa: E731
    assert losses("plain") == losses("cached")  # exact in float32
    epochs = [r for r in read_metrics(tmp_path / "cached") if r["type"] == "epoch"]
    assert [e["cache_hits"] for e in epochs] == [0, 96, 192]  # every sample cached in epoch 1, read back after
    # one (32,) float32 state per training sample; `auto` frees each at its last read (epoch 3), `on` keeps them
    assert [e["cache_size_bytes"] for e in epochs] == [96 * 32 * 4, 96 * 32 * 4, 0]
    assert epochs[-1]["cache_policy_freed"] == 96 and epochs[-1]["cache_policy_skipped_last"] == 0
    # with the prefix's forward skipped, the measured FLOPs of a step lose Linear(16, 32)'s forward
    assert cached["flops_per_step_last"] == plain["flops_per_step_last"] - 2 * 16 * 16 * 32
    c = cached["cache"]
    assert (c["mode"], c["used"], c["disabled"], c["hits"], c["misses"]) == ("auto", True, None, 192, 96)
    assert c["hit_rate"] == 2 / 3 and c["memory_bytes"] == 0 and c["disk_bytes"] == 0
    assert c["saved_seconds"] > 0 and c["budget_bytes"] > 0
    on = config(tmp_path, "budget", epochs=3)
    on.freeze.cache = {"mode": "on", "budget_mb": 0.001}  # an explicit budget: 1,048 bytes
    assert Trainer(on, task=blob_task()).run()["cache"]["budget_bytes"] == 1048
    assert losses("budget") == losses("plain")


def test_cache_refuses_random_augmentation(tmp_path):
    task = blob_task()
    noisy = task.train_set
    original = type(noisy).__getitem__

    class Noisy(type(noisy)):
        def __getitem__(self, i):
            item = original(self, i)
            return {**item, "pixel_values": item["pixel_values"] + 0.1 * torch.randn(16)}

    noisy.__class__ = Noisy
    cfg = config(tmp_path, "noisy")
    cfg.freeze.cache = {"mode": "on"}
    with pytest.raises(ConfigError, match="random augmentation"):
        Trainer(cfg, task=task).run()
    summary = Trainer(config(tmp_path, "noisy-auto"), task=task).run()  # the default mode: auto
    off = [r for r in read_metrics(tmp_path / "noisy-auto") if r.get("kind") == "cache_off"]
    assert len(off) == 1 and off[0]["step"] == 0 and "random augmentation" in off[0]["reason"]
    assert summary["cache"] == {"mode": "auto", "used": False}
    assert summary["steps"] == 12


def test_cache_turned_off_mid_run_logs_one_event_and_keeps_training(tmp_path, capsys):
    """Inputs that change after the determinism check (here: from the third epoch on) are caught by the cache's
    per-sample fingerprints; ``auto`` logs one event at that step, warns, and trains on with the full forward."""
    task = blob_task()
    data = task.train_set
    original = type(data).__getitem__
    calls = {"n": 0}

    class Drifting(type(data)):
        def __getitem__(self, i):
            calls["n"] += 1
            item = original(self, i)
            late = calls["n"] > 2 * len(data) + 64  # past the check's reads and two epochs
            return {**item, "pixel_values": item["pixel_values"] + (1.0 if late else 0.0)}

    data.__class__ = Drifting
    with pytest.warns(RuntimeWarning, match="activation cache turned off"):
        summary = Trainer(config(tmp_path, "drift", epochs=3), task=task).run()
    off = [r for r in read_metrics(tmp_path / "drift") if r.get("kind") == "cache_off"]
    assert len(off) == 1 and off[0]["step"] > 12 and "inputs of sample" in off[0]["reason"]
    assert summary["cache"]["used"] is False and "inputs of sample" in summary["cache"]["disabled"]
    assert summary["steps"] == 18
    assert "cache: off, training runs the full forward" in capsys.readouterr().out


def test_strategy_signals_reach_metrics_at_their_stages(tmp_path):
    cfg = config(tmp_path, "freezeout", freeze={"strategy": "freezeout"}, epochs=1)
    Trainer(cfg, task=blob_task()).run()
    steps = [r for r in read_metrics(tmp_path / "freezeout") if r["type"] == "step"]
    assert all(len(r["signal_t_i"]) == 4 for r in steps)  # FreezeOut has a stage after every step
    assert steps[0]["signal_t_i"][0] == pytest.approx(0.8 ** 3)
    cfg = config(tmp_path, "geometric", freeze={"strategy": "geometric"}, epochs=2)
    Trainer(cfg, task=blob_task()).run()
    stages = [r for r in read_metrics(tmp_path / "geometric") if r.get("kind") == "stage"]
    assert [s["signal_target_frozen"] for s in stages] == [1, 2]  # ceil(3 * (1 - (2/3)^T)) for T = 1, 2


@pytest.mark.parametrize("device", DEVICES)
def test_step_callbacks_run_before_the_first_step_and_after_every_step_without_changing_the_run(tmp_path, device):
    seen, devices = [], set()

    def probe(trainer):  # what the benchmark oracle does: an eval-mode forward on a few samples, modes restored
        seen.append(trainer.progress["step"])
        devices.add(next(trainer.model.parameters()).device.type)
        modes = [m.training for m in trainer.model.modules()]
        trainer.model.eval()
        with torch.no_grad():  # the samples on the run's device (the test fed CPU tensors to a CUDA model)
            trainer.model(torch.stack([trainer.train_set[i]["pixel_values"] for i in range(4)]).to(trainer.device))
        for m, mode in zip(trainer.model.modules(), modes):
            m.training = mode

    none = {"strategy": "none"}
    plain = Trainer(config(tmp_path, "plain", none, device=device), task=blob_task()).run()
    hooked = Trainer(config(tmp_path, "hooked", none, device=device), task=blob_task(), step_callbacks=[probe]).run()
    assert devices == {device}
    assert seen == list(range(0, 13))  # start, then after each of the 12 steps
    assert hooked["test_loss"] == plain["test_loss"] and hooked["test_accuracy"] == plain["test_accuracy"]


def test_a_resume_on_other_data_is_refused_before_it_trains(tmp_path):
    from tests.conftest import BlobDataset

    def press_ctrl_c(fetches):
        if fetches == 16 * 3 + 3 + 2 * 4:  # while loading the 4th batch
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        Trainer(config(tmp_path, "cut"), task=blob_task(press_ctrl_c)).run()
    steps_before = [r for r in read_metrics(tmp_path / "cut") if r["type"] == "step"]
    resumed = config(tmp_path, "cut")
    resumed.run.resume = str(tmp_path / "cut")
    fewer = blob_task()
    fewer.train_set = BlobDataset(80, seed=1)  # a file removed from the data folder since the checkpoint
    with pytest.raises(ConfigError, match=r"the data changed since the checkpoint \(train samples 96 then, 80 now\); "
                                          "a resumed run needs the data it was trained on"):
        Trainer(resumed, task=fewer).run()
    assert [r for r in read_metrics(tmp_path / "cut") if r["type"] == "step"] == steps_before  # nothing trained
    assert Trainer(resumed, task=blob_task()).run()["steps"] == 12  # the same data resumes


def test_a_run_folder_holding_a_run_is_refused_unless_resumed(tmp_path):
    Trainer(config(tmp_path, "r", max_steps=1), task=blob_task()).run()
    before = (tmp_path / "r" / "summary.json").read_bytes()
    # a finished run: no --resume suggested (it would answer "nothing to resume")
    with pytest.raises(ConfigError, match="already holds a finished run; pick another --run-dir"):
        Trainer(config(tmp_path, "r"), task=blob_task())
    assert (tmp_path / "r" / "summary.json").read_bytes() == before  # nothing overwritten
    (tmp_path / "r" / "summary.json").unlink()  # an interrupted one: continue it
    with pytest.raises(ConfigError, match="already holds a run; continue it with `layerfreeze train --resume"):
        Trainer(config(tmp_path, "r"), task=blob_task())
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        Trainer(config(tmp_path, "file"), task=blob_task())


def test_a_run_frees_what_an_earlier_run_in_the_process_left_before_it_builds_anything(tmp_path):
    """A finished trainer's model, optimizer and Freezer refer to each other, so ``del`` does not free them; only
    the cyclic collector does. ``compare`` runs its rows one after another in one process: without
    ``measure.release_garbage`` the second row's peak counted the first row's weights and Adam moments (+261 MiB on
    an H200, issue 40). With the collector off, as it may be for a while between its passes, the earlier run's
    objects must be gone when the next run builds its model."""
    import gc
    import weakref

    first = Trainer(config(tmp_path, "first"), task=blob_task())
    first.run()
    refs = [weakref.ref(first.model), weakref.ref(first.optimizer), weakref.ref(first.freezer)]
    seen: list[list[bool]] = []
    gc.disable()
    try:
        del first
        assert all(r() is not None for r in refs)  # the cycle: still alive after del
        second = Trainer(config(tmp_path, "second"), task=blob_task(),
                         step_callbacks=[lambda trainer: seen.append([r() is not None for r in refs])])
        second.run()
    finally:
        gc.enable()
    assert seen[0] == [False, False, False]  # the callbacks run first before step 1, after the build


def test_a_resume_past_the_configs_end_is_refused_before_anything_is_written(tmp_path):
    # `--resume RUN --max-steps 50` on a run at step 80 trained nothing, said nothing, and wrote a summary of a run
    # that "ended" at 50
    Trainer(config(tmp_path, "r", max_steps=6), task=blob_task()).run()
    run = tmp_path / "r"
    (run / "summary.json").unlink()  # an interrupted run, at step 6
    saved, records = (run / "config.json").read_bytes(), (run / "metrics.jsonl").read_bytes()
    cfg = config(tmp_path, "r", max_steps=4)
    cfg.run.resume = str(run)
    with pytest.raises(ConfigError, match=r"the run is at step 6, past this config's end at step 4 \(train.epochs 2, "
                                          r"train.max_steps 4\); resume with a larger --epochs / --max-steps"):
        Trainer(cfg, task=blob_task()).run()
    assert (run / "config.json").read_bytes() == saved and not (run / "summary.json").exists()
    assert (run / "metrics.jsonl").read_bytes() == records  # no config record of a run that never started
    cfg = config(tmp_path, "r", max_steps=6)  # at its own end: the run finishes (its last evaluation, the summary)
    cfg.run.resume = str(run)
    assert Trainer(cfg, task=blob_task()).run()["steps"] == 6


def test_cache_on_with_train_bn_is_refused_before_training(tmp_path):
    # the first freeze of a block with BatchNorm stopped the run with a traceback (CacheRefused), a checkpoint later
    cfg = config(tmp_path, "bn", freeze={"strategy": "static", "params": {"k": 2}, "train_bn": True,
                                         "cache": {"mode": "on"}})
    with pytest.raises(ConfigError, match=r"freeze.train_bn true keeps the BatchNorm layers of frozen blocks in "
                                          r"training mode \(1, \.\.\.\).*Set freeze.train_bn false, or "
                                          r"freeze.cache.mode auto or off"):
        Trainer(cfg, task=blob_task()).run()
    assert (tmp_path / "bn" / "metrics.jsonl").read_text() == ""  # not one step
    budget = config(tmp_path, "budget", freeze={"strategy": "none", "memory_budget": "0.6", "train_bn": True,
                                                "cache": {"mode": "on"}})  # the budget's prefix freezes at the start
    with pytest.raises(ConfigError, match=r"freeze.train_bn true keeps the BatchNorm layers of frozen blocks"):
        Trainer(budget, task=blob_task()).run()
    for bad in ("inf", "nan", "1e12"):  # inf crashed: "cannot convert float infinity to integer"
        with pytest.raises(ConfigError, match="freeze.cache.budget_mb: (must be a finite number, got|must be <=)"):
            config(tmp_path, "x", freeze={"strategy": "none", "cache": {"budget_mb": float(bad)}})
    cfg.freeze.cache.mode = "auto"  # auto: trains, without the cache once the BatchNorm block freezes
    assert Trainer(cfg, task=blob_task()).run()["cache"]["used"] is False


def test_an_epoch_cut_short_by_max_steps_is_marked_partial_and_left_out_of_the_mean(tmp_path):
    # "time per epoch" averaged a 2-step last epoch in with the full 6-step ones, understating an epoch's time
    from rich.console import Console

    from layerfreeze.runs.report import write_report
    from layerfreeze.runs.summary import summary_table

    summary = Trainer(config(tmp_path, "r", max_steps=8), task=blob_task()).run()  # 96 samples / 16: 6 steps an epoch
    assert summary["epoch_steps"] == [[6, 6], [2, 6]]
    first, last = summary["time_per_epoch_s"]
    console = Console(width=200, record=True)
    console.print(summary_table(summary))
    text = console.export_text()
    assert f"mean {first:.2f} s over 1 full epoch  [{first:.2f}, {last:.2f} (partial: 2 of 6 steps)] s" in text
    page = write_report(tmp_path / "r").read_text(encoding="utf-8")
    assert "(partial: 2 of 6 steps)" in page


def test_the_progress_bar_counts_the_epochs_max_steps_leaves(tmp_path, capsys):
    # `--max-steps 1` on a 2- or 3-epoch run showed "epoch 1/3": the bar counted train.epochs, not what the run did
    cfg = config(tmp_path, "one", max_steps=1, epochs=3)  # 96 samples / 16: 6 steps an epoch
    cfg.run.progress = True
    Trainer(cfg, task=blob_task()).run()
    bar = capsys.readouterr().err
    assert "epoch 1/1" in bar and "/3" not in bar and "epoch 2/" not in bar
    cfg = config(tmp_path, "eight", max_steps=8, epochs=3)  # 6 steps, then 2 of the second epoch
    cfg.run.progress = True
    Trainer(cfg, task=blob_task()).run()
    bar = capsys.readouterr().err
    assert "epoch 1/2" in bar and "epoch 2/2" in bar and "/3" not in bar
    cfg = config(tmp_path, "all", epochs=2)  # no max_steps: every epoch
    cfg.run.progress = True
    Trainer(cfg, task=blob_task()).run()
    assert "epoch 2/2" in capsys.readouterr().err


def test_a_second_run_on_the_same_task_builds_its_optimizer_over_every_block(tmp_path):
    # the CLI trainer run twice in one process on one model: build_optimizer took only what required grad after the
    # first run's static k=2, and the take-over put both blocks into block 0's decay group (weight decay on the
    # BatchNorm, block 1's weights at block 0's learning rate)
    import warnings

    from layerfreeze.train.setup import build_optimizer

    task = blob_task()
    Trainer(config(tmp_path, "first", weight_decay=0.1, lr_decay=2.0), task=task).run()
    second = Trainer(config(tmp_path, "second", {"strategy": "none"}, weight_decay=0.1, lr_decay=2.0), task=task)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second.run()
    assert [str(w.message)[:53] for w in caught if "earlier" in str(w.message)] == [
        "Freezer: block(s) 0, 1 were left frozen by an earlier"]
    fresh = build_optimizer(second.config, task.model, second.freezer.blocks)
    assert [[id(p) for p in g["params"]] for g in second.optimizer.param_groups] == \
           [[id(p) for p in g["params"]] for g in fresh.param_groups]
    assert [(g["weight_decay"], g["block"]) for g in second.optimizer.param_groups] == \
           [(g["weight_decay"], g["block"]) for g in fresh.param_groups]


def test_a_resumed_runs_peak_memory_covers_the_steps_before_the_resume(tmp_path, monkeypatch):
    """The summary's peak memory (compare's `peak mem`, the report's) was the last process's alone: a run that peaked
    before it was cut and resumed reported a lower peak than its own step records, while its tensor peak (the
    ledger's) covered the whole run. The first process's peak is its real one plus 64 GiB (a process RSS cannot be
    made to peak on cue inside a test session that already holds more than a spike would add)."""
    from layerfreeze.runs import measure

    real = measure.peak_memory_bytes
    monkeypatch.setattr(measure, "peak_memory_bytes", lambda device: real(device) + 64 * 2**30)

    def ctrl_c(fetches):
        if fetches == 16 * 4 + 3:  # while loading the 5th batch
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        Trainer(config(tmp_path, "cut", {"strategy": "none"}), task=blob_task(ctrl_c)).run()
    before = max(r["peak_memory_bytes"] for r in read_metrics(tmp_path / "cut") if r["type"] == "step")
    monkeypatch.setattr(measure, "peak_memory_bytes", real)  # the resumed process: its own peak, far lower
    resumed = config(tmp_path, "cut", {"strategy": "none"})
    resumed.run.resume = str(tmp_path / "cut")
    summary = Trainer(resumed, task=blob_task()).run()
    assert summary["resumed_from_step"] == 4
    after = [r["peak_memory_bytes"] for r in replay(read_metrics(tmp_path / "cut")).steps if r["step"] > 4]
    assert before > 64 * 2**30 > max(after)
    assert summary["peak_memory_bytes"] >= before
