"""Crash-anywhere resume: SIGKILL a training run at N seeded random instants, resume it each time, and compare the
end with the uninterrupted run (weights, optimizer state, freeze history, per-step losses, evaluations), bitwise.

The run: a 5-block MLP on synthetic 4-class data, smartfrz deciding every step, dropout on, a checkpoint after every
step (so most kills land inside a checkpoint write or just around one). Each kill comes a random 0..``--max-delay``
seconds after the restarted process reports that training began; a kill that finds a half-written checkpoint
(``checkpoints/*.tmp``) is counted as "inside a write". Prints a table: kills, kills inside a write, resumes,
mismatches (must be 0).

    python -m benchmarks.crash_resume [--kills 100] [--seed 0] [--steps 2400] [--max-delay 0.3]
    python -m benchmarks.crash_resume --worker RUN_DIR STEPS      # one process of the run (what gets killed)
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.forkserver
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.cli import count, entry

# ---- the run that gets killed ------------------------------------------------------------------------------------


def _task() -> Any:
    from torch import nn

    from layerfreeze.train.data import GaussianBlobs
    from layerfreeze.train.tasks import Task, image_forward

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16 if i == 0 else 24, 24), nn.ReLU(), nn.Dropout(0.1))
                            for i in range(4)], nn.Linear(24, 4))
    return Task("points", model, GaussianBlobs(64, seed=1), GaussianBlobs(16, seed=2), 4, "mlp", image_forward)


def worker(run_dir: Path, steps: int, say: Any = None) -> None:
    """Start the run, or resume it when the folder holds one (as ``layerfreeze train --resume`` does); prints
    "started" when training begins and "done" at the end, each also passed to ``say``."""

    def tell(line: str) -> None:
        print(line, flush=True)
        if say is not None:
            say(line)

    from layerfreeze.runs.rundir import CONFIG_FILE, SUMMARY_FILE
    from layerfreeze.train.config import build_config
    from layerfreeze.train.trainer import Trainer

    if (run_dir / SUMMARY_FILE).is_file():
        tell("done")
        return
    cfg = build_config({
        "train": {"epochs": steps // 8, "batch_size": 8, "lr": 0.01, "eval_batch_size": 16},
        "freeze": {"strategy": "smartfrz"},
        "run": {"dir": str(run_dir), "progress": False, "tensorboard": False, "checkpoint_every_steps": 1,
                "threads": 1},
    })
    if (run_dir / CONFIG_FILE).is_file():
        cfg.run.resume = str(run_dir)
    announced = []

    def started(trainer: Any) -> None:
        if not announced:
            announced.append(True)
            tell("started")

    Trainer(cfg, task=_task(), step_callbacks=[started]).run()
    tell("done")


# ---- the harness -----------------------------------------------------------------------------------------------


#: What the server the killed processes are forked from imports once: a fresh interpreter spends ~3.5 s of CPU on
#: these (Dynamo: any optimizer's construction imports it), each of a run's 20-100 processes
PRELOAD = ["torch", "torch._dynamo", "layerfreeze.train.trainer", "benchmarks.crash_resume"]


class Process:
    """One process of the run (what gets killed): forked from a server that has imported :data:`PRELOAD`
    (``multiprocessing``'s forkserver, started with one OpenMP thread), so that it trains within ~0.1 s of its
    start. Its output goes to ``RUN_DIR.log`` beside the run; it says "started" (training began) or "done"."""

    def __init__(self, run_dir: Path, steps: int) -> None:
        context = multiprocessing.get_context("forkserver")
        if multiprocessing.forkserver._forkserver._forkserver_pid is None:
            context.set_forkserver_preload(PRELOAD)
            saved = os.environ.get("OMP_NUM_THREADS")
            os.environ["OMP_NUM_THREADS"] = "1"
            try:
                multiprocessing.forkserver.ensure_running()
            finally:
                os.environ.pop("OMP_NUM_THREADS") if saved is None else os.environ.update(OMP_NUM_THREADS=saved)
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.log = run_dir.parent / f"{run_dir.name}.log"
        self.said, told = context.Pipe(duplex=False)
        self.process = context.Process(target=_forked_worker, args=(run_dir, steps, str(self.log), told))
        self.process.start()
        told.close()

    def status(self) -> str:
        """"started" or "done", whichever the process says first; "" when it exits saying neither."""
        try:
            return self.said.recv()
        except EOFError:
            return ""

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code (negative: killed by that signal), or None while it still runs after ``timeout`` s."""
        self.process.join(timeout)
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()
        self.process.join()

    def output(self) -> str:
        return self.log.read_text()[-3000:] if self.log.is_file() else ""


def _forked_worker(run_dir: Path, steps: int, log_path: str, told: Any) -> None:
    """In the forked process: :func:`worker`, its output to ``log_path``, each status line also sent on ``told``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    torch.set_num_threads(1)
    # tqdm's default write lock is a multiprocessing semaphore, registered with the resource tracker that all forked
    # processes share: each kill would leak one, and the tracker warns of them at exit. One process writes this log
    tqdm.set_lock(threading.RLock())
    worker(run_dir, steps, say=told.send)
    sys.stdout.flush()


def start(run_dir: Path, steps: int) -> Process:
    return Process(run_dir, steps)


def finish(run_dir: Path, steps: int) -> None:
    proc = start(run_dir, steps)
    line = proc.status()
    if proc.wait(timeout=600) != 0 or line not in ("started", "done"):
        raise RuntimeError(f"the run did not finish: {proc.output()}")


def kill_and_resume(run_dir: Path, steps: int, kills: int, seed: int, max_delay_s: float) -> dict[str, int]:
    """Start the run, SIGKILL it ``kills`` times at random instants after training begins, then let it finish."""
    from layerfreeze.runs.rundir import CHECKPOINTS_DIR, SUMMARY_FILE

    rng = random.Random(seed)
    stats = {"kills": 0, "in_checkpoint_write": 0, "finished_early": 0}
    for _ in range(kills):
        proc = start(run_dir, steps)
        line = proc.status()
        if line != "started":
            proc.wait(timeout=60)
            if line == "done":
                stats["finished_early"] += 1
                break
            raise RuntimeError(f"the run failed to start: {proc.output()}")
        code = proc.wait(timeout=rng.uniform(0.0, max_delay_s))
        if code is None:
            proc.kill()
            if (run_dir / SUMMARY_FILE).is_file():  # the kill came after training ended, in the process's exit
                stats["finished_early"] += 1
                break
            stats["kills"] += 1
            stats["in_checkpoint_write"] += any((run_dir / CHECKPOINTS_DIR).glob("*.tmp"))
            continue
        if code != 0:
            raise RuntimeError(f"the run failed: {proc.output()}")
        stats["finished_early"] += 1
        break
    finish(run_dir, steps)
    return stats


def _same(a: Any, b: Any, where: str, out: list[str]) -> None:
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and torch.equal(a, b)):
            out.append(where)
    elif isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            out.append(where)
            return
        for k in a:
            _same(a[k], b[k], f"{where}/{k}", out)
    elif isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            out.append(where)
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]", out)
    elif a != b:
        out.append(where)


def mismatches(ref_dir: Path, cut_dir: Path) -> list[str]:
    """Where the killed-and-resumed run differs from the reference (empty when bitwise the same).

    Training FLOPs are the work done: equal without the activation cache; with it, a resumed run starts with a cold
    cache and recomputes the frozen prefix for the samples it had cached, so its total may only be larger.
    """
    from safetensors.torch import load_file

    from layerfreeze.runs.report import load_run
    from layerfreeze.runs.rundir import CHECKPOINT_LINK

    out: list[str] = []
    states = []
    for d in (ref_dir, cut_dir):
        states.append((load_file(d / CHECKPOINT_LINK / "model.safetensors"),
                       torch.load(d / CHECKPOINT_LINK / "state.pt", weights_only=True)))
    (ref_w, ref_s), (cut_w, cut_s) = states
    _same(ref_w, cut_w, "weights", out)
    _same(ref_s["optimizer"], cut_s["optimizer"], "optimizer", out)
    for key in ("frozen", "history", "strategy"):
        _same(ref_s["freezer"][key], cut_s["freezer"][key], f"freezer/{key}", out)
    a, b = load_run(ref_dir), load_run(cut_dir)
    if not (np.array_equal(a.step, b.step) and np.array_equal(a.loss, b.loss)):
        out.append("per-step losses")
    fields = ("epoch", "eval_loss", "eval_accuracy", "train_loss")
    if [[e[k] for k in fields] for e in a.epochs] != [[e[k] for k in fields] for e in b.epochs]:
        out.append("epoch evaluations")
    for key in ("test_accuracy", "test_loss", "steps", "frozen_blocks", "freeze_timeline", "eval_history"):
        if a.summary[key] != b.summary[key]:
            out.append(f"summary/{key}")
    cached = a.summary.get("cache", {}).get("used") or b.summary.get("cache", {}).get("used")
    if a.summary["flops_total"] != b.summary["flops_total"] and not (
            cached and b.summary["flops_total"] > a.summary["flops_total"]):
        out.append("summary/flops_total")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, metavar=("RUN_DIR", "STEPS"), help=argparse.SUPPRESS)
    parser.add_argument("--kills", type=count(0), default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=count(2), default=2400)
    parser.add_argument("--max-delay", type=float, default=0.3, help="seconds after training begins (max)")
    parser.add_argument("--out", default="runs/bench-crash-resume")
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker[0]), int(args.worker[1]))
        return
    from rich.console import Console
    from rich.table import Table

    out = Path(args.out)
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    finish(out / "reference", args.steps)
    stats = kill_and_resume(out / "killed", args.steps, args.kills, args.seed, args.max_delay)
    diff = mismatches(out / "reference", out / "killed")
    from layerfreeze.runs.report import load_run

    resumes = len(load_run(out / "killed").resumes)
    table = Table(title=f"SIGKILL at {args.kills} random instants (seed {args.seed}), {args.steps} steps, "
                        "a checkpoint after every step")
    for col in ("kills", "inside a checkpoint write", "resumes", "mismatches", "finished before all kills",
                "wall s"):
        table.add_column(col, justify="right")
    table.add_row(str(stats["kills"]), str(stats["in_checkpoint_write"]), str(resumes), str(len(diff)),
                  str(stats["finished_early"]), f"{time.perf_counter() - t0:.0f}")
    Console(width=140).print(table)
    if diff:
        print("differs in:", ", ".join(diff[:20]))
        sys.exit(1)


if __name__ == "__main__":
    raise SystemExit(entry(main))
