"""One rank of a test's data-parallel run: ``python -m tests.distributed.worker SPEC.json``.

The launcher (:func:`tests.distributed.launch.launch`) sets RANK, WORLD_SIZE and LAYERFREEZE_FILE_STORE. The spec
says what to train (the CLI trainer on a tiny MLP task, or the README's own-loop example) and where this rank writes
its record: per step, the SHA-256 of every weight and the frozen set; at the end, the final weights and the freeze
history (whole weights: under ``run.parallel: fsdp`` every rank gathers them). ``kill_at_step`` makes this rank
SIGKILL itself after that step (a lost rank).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

from layerfreeze.train.data import GaussianBlobs
from layerfreeze.train.tasks import Task, image_forward


def mlp_task(dropout: float = 0.0, batchnorm: bool = False) -> Task:
    """Five blocks (four Linear+ReLU stages and the head), no BatchNorm: data parallel equals one process.
    ``batchnorm``: a ``BatchNorm1d`` after each stage's Linear (each rank's statistics are of its own share)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    width = 16
    for _ in range(4):
        norm = [nn.BatchNorm1d(24)] if batchnorm else []
        layers.append(nn.Sequential(nn.Linear(width, 24), *norm, nn.ReLU(), nn.Dropout(dropout)))
        width = 24
    layers.append(nn.Linear(width, 4))
    return Task("points", nn.Sequential(*layers), GaussianBlobs(90, seed=1), GaussianBlobs(30, seed=2), 4, "mlp",
                image_forward)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with whole tensors (a collective for a sharded model: every rank gathers each one)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.state_dict().items()}


def weight_hashes(model: nn.Module) -> dict[str, str]:
    return {k: hashlib.sha256(v.cpu().contiguous().numpy().tobytes()).hexdigest()
            for k, v in full_state(model).items()}


def run_trainer(spec: dict, rank: int, out: Path) -> None:
    from layerfreeze.distributed import close_distributed
    from layerfreeze.train.config import build_config
    from layerfreeze.train.trainer import Trainer

    steps: list[dict] = []

    def record(trainer):  # after every step (and once before the first)
        steps.append({"step": trainer.progress["step"], "frozen": list(trainer.freezer.frozen),
                      "hashes": weight_hashes(trainer.model)})
        if spec.get("kill_at_step") == trainer.progress["step"] and rank == spec.get("kill_rank", 1):
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.get("interrupt_at_step") == trainer.progress["step"] and rank == 0:
            os.kill(os.getpid(), signal.SIGINT)  # only rank 0's "terminal": the stop must still be collective

    config = build_config(spec["config"])
    trainer = Trainer(config, task=mlp_task(spec.get("dropout", 0.0), spec.get("batchnorm", False)),
                      step_callbacks=[record])
    result: dict = {"rank": rank}
    try:
        result["summary"] = trainer.run()
    except KeyboardInterrupt:
        result["interrupted"] = True
    result["steps"] = steps
    result["history"] = trainer.freezer.history
    result["weights"] = {k: v.tolist() for k, v in full_state(trainer.model).items()}
    out.write_text(json.dumps(result))
    if "summary" in result or trainer.stopped_together:  # finished, or every rank stopped after the same step
        close_distributed()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    out = Path(spec["out"]) / f"rank{rank}.json"
    run_trainer(spec, rank, out)


if __name__ == "__main__":
    main()
