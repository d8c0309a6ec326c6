"""A training run that may be SIGKILLed at any instant: ``python -m tests.faults.worker RUN_DIR STEPS``.

Starts the run, or resumes it when the folder already holds one (as ``layerfreeze train --resume`` would), with a
checkpoint after every step, dropout on (RNG state matters) and smartfrz deciding every step (its recorder is part
of the checkpoint). Prints ``started`` once training is about to take its first step, then ``done``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from layerfreeze.config import build_config
from layerfreeze.tasks import Task, image_forward
from layerfreeze.trainer import CONFIG_FILE, SUMMARY_FILE, Trainer
from tests.distributed.worker import Points


def task() -> Task:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16 if i == 0 else 24, 24), nn.ReLU(), nn.Dropout(0.1))
                            for i in range(4)], nn.Linear(24, 4))
    return Task("points", model, Points(64, seed=1), Points(16, seed=2), 4, "mlp", image_forward)


def config(run_dir: Path, steps: int, every: int | None = 1):
    return build_config({
        "train": {"epochs": steps // 8, "batch_size": 8, "lr": 0.01, "eval_batch_size": 16},
        "freeze": {"strategy": "smartfrz"},
        "run": {"dir": str(run_dir), "progress": False, "tensorboard": False, "checkpoint_every_steps": every,
                "threads": 1},
    })


def main() -> None:
    run_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
    if (run_dir / SUMMARY_FILE).is_file():
        print("done", flush=True)
        return
    cfg = config(run_dir, steps)
    if (run_dir / CONFIG_FILE).is_file():
        cfg.run.resume = str(run_dir)

    def started(trainer):
        if not getattr(trainer, "_announced", False):
            trainer._announced = True
            print("started", flush=True)

    Trainer(cfg, task=task(), step_callbacks=[started]).run()
    print("done", flush=True)


if __name__ == "__main__":
    main()
