"""The benchmark oracle: CKA on Gram factors, the freeze-step rule, FLOPs integration, schedule gap, the recorder."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.oracle import (
    ProbeRecorder,
    gram_factor,
    oracle_flops,
    oracle_freeze_steps,
    prefix_at,
    prefix_step_flops,
    prefixes_used,
    schedule_gap,
)
from layerfreeze.smartfrz.labels import linear_cka
from layerfreeze.train.config import build_config
from layerfreeze.train.trainer import Trainer
from tests.conftest import DEVICES, blob_task


@pytest.mark.parametrize("d1,d2", [(5, 7), (300, 40)])
def test_cka_on_gram_factors_equals_cka_on_the_full_representations(d1, d2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, d1, generator=g)
    y = x[:, :1].repeat(1, d2) + torch.randn(16, d2, generator=g)
    fx, fy = gram_factor(x), gram_factor(y)
    assert fx.shape == (16, min(16, d1))
    assert abs(linear_cka(fx, fy) - linear_cka(x, y)) < 1e-10
    assert abs(linear_cka(gram_factor(x.reshape(16, -1, 1)), fx) - 1.0) < 1e-12


def test_oracle_step_is_the_first_converged_record_with_every_earlier_block_converged():
    steps = [0, 10, 20, 30, 40, 50]
    cka = [
        [0.50, 0.995, 0.996, 0.997, 0.999, 1.0],  # window of 3 within 0.01 from record 3 (0.995..0.997)
        [0.90, 0.970, 0.991, 0.995, 0.996, 1.0],  # record 3's window spans 0.970..0.995: too wide; record 4 ok
        [0.99, 0.995, 0.999, 0.999, 0.999, 1.0],  # converged from record 2, but block 1 only from record 4
        [0.10, 0.200, 0.300, 0.400, 0.500, 1.0],  # head: never
    ]
    assert oracle_freeze_steps(cka, steps, head=3, tau=0.99) == [30, 40, 40, None]
    # tau 0.998: block 0 from record 4, block 1 only at the last record
    assert oracle_freeze_steps(cka, steps, head=3, tau=0.998) == [40, 50, 50, None]
    # the default tau (labels.DEFAULT_TAU = 0.9995): block 0's 0.999 at record 4 no longer passes
    assert oracle_freeze_steps(cka, steps, head=3) == [50, 50, 50, None]
    # a block that never converges keeps every later block unfrozen
    cka[1] = [0.90, 0.95, 0.96, 0.97, 0.98, 0.985]
    assert oracle_freeze_steps(cka, steps, head=3, tau=0.99) == [30, None, None, None]
    # a dip below tau at record 4 does not undo the freeze at record 3: the first freezable record counts
    cka[0] = [0.50, 0.995, 0.996, 0.997, 0.985, 1.0]
    assert oracle_freeze_steps(cka, steps, head=3, tau=0.99)[0] == 30
    # NaN (a diverged record) is never freezable
    assert oracle_freeze_steps([[math.nan, 1.0, 1.0, 1.0]], [0, 1, 2, 3]) == [3]
    with pytest.raises(ValueError, match="one value per recorded step"):
        oracle_freeze_steps([[1.0, 1.0]], [0, 1, 2])


def test_oracle_flops_integrates_the_frozen_prefix_per_step():
    freeze_steps = [0, 3, None, None]  # block 0 frozen from step 1, block 1 from step 4, the rest never
    flops = {0: 100, 1: 70, 2: 50}
    assert [prefix_at(freeze_steps, s) for s in range(1, 7)] == [1, 1, 1, 2, 2, 2]
    assert prefixes_used(freeze_steps, 6) == {1, 2}
    assert oracle_flops(freeze_steps, flops, 6) == 3 * 70 + 3 * 50
    assert oracle_flops([None, None], flops, 6) == 600  # nothing frozen: the none run
    assert oracle_flops([6, None], flops, 6) == 600  # frozen at the last step saves nothing
    with pytest.raises(KeyError):
        oracle_flops([0, 0, 0], flops, 2)


def test_schedule_gap_counts_never_frozen_as_the_end():
    oracle = {"a": 2, "b": None, "c": 4, "head": None}
    assert schedule_gap({"a": 0, "b": 5}, oracle, 10, head="head") == (2 + 5 + 6) / 30
    assert schedule_gap({"a": 2, "c": 4}, oracle, 10, head="head") == 0.0
    assert schedule_gap({}, {"a": 0}, 10) == 1.0


def test_probe_recorder_records_at_start_every_few_steps_and_at_the_end(tmp_path, one_thread):
    cfg = build_config({"train": {"epochs": 2, "batch_size": 16, "lr": 0.01}, "freeze": {"strategy": "none"},
                        "run": {"dir": str(tmp_path / "r"), "progress": False, "tensorboard": False,
                                "checkpoint": False}})
    recorder = ProbeRecorder(probe_size=8, records=4)
    trainer = Trainer(cfg, task=blob_task(), step_callbacks=[recorder])
    trainer.run()
    assert recorder.steps == [0, 3, 6, 9, 12] and recorder.total_steps == 12
    assert recorder.blocks == ["0", "1", "4", "6"] and recorder.head == 3
    assert [len(f) for f in recorder.factors] == [5] * 4 and recorder.factors[0][0].shape == (8, 8)
    cka = recorder.cka()
    assert all(row[-1] == pytest.approx(1.0) for row in cka) and all(0 <= v <= 1 for row in cka for v in row)
    assert not any(m._forward_hooks for m in trainer.model.modules())  # the probe's hooks live only in a record


@pytest.mark.assets("fashion_mnist")
@pytest.mark.parametrize("device", DEVICES)
def test_prefix_step_flops_match_what_the_trainer_measures(tmp_path, one_thread, device):
    def cfg(strategy, params=None):
        return build_config({
            "task": "fashion-mnist", "model": {"name_or_path": "resnet18", "pretrained": False},
            "data": {"limit_train": 8, "limit_test": 4},
            "train": {"batch_size": 4, "max_steps": 1, "epochs": 1},
            "freeze": {"strategy": strategy, "params": params or {}},
            "run": {"dir": str(tmp_path / strategy), "progress": False, "tensorboard": False, "checkpoint": False,
                    "device": device}})

    flops = prefix_step_flops(cfg("none"), [0, 3])
    assert flops[0] == Trainer(cfg("none")).run()["flops_per_step_first"]
    assert flops[3] == Trainer(cfg("static", {"k": 3})).run()["flops_per_step_first"] < flops[0]
    with pytest.raises(ValueError, match="out of range"):
        prefix_step_flops(cfg("none"), [6])  # 6 blocks: freezing all would freeze the head
