"""Launch a test's ranks as real processes: gloo, a FileStore in a temp folder (no ports), a short timeout.

The ranks train on the CPU: CUDA is hidden from them (``CUDA_VISIBLE_DEVICES=""``), so a test that compares ranks
bit for bit with a one-process CPU run means the same on a GPU machine, where ``run.device: auto`` would otherwise put
each rank on a GPU (or refuse two ranks on one GPU: :func:`layerfreeze.distributed.choose_rank_device`). A test about
the GPU path passes ``cuda=True``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# this checkout's code, also when the environment's editable install points at another checkout
PYTHONPATH = os.pathsep.join([str(ROOT / "src"), str(ROOT)])


@dataclass
class Ranks:
    returncodes: list[int]
    outputs: list[str]
    results: list[dict | None]


def launch(spec: dict, tmp: Path, world: int = 2, timeout: float = 120, module: str = "tests.distributed.worker",
           args: list[str] | None = None, cuda: bool = False) -> Ranks:
    """Run ``python -m module`` as ``world`` ranks (on the CPU unless ``cuda``: module docstring); returns exit
    codes, combined output and each rank's JSON."""
    tmp.mkdir(parents=True, exist_ok=True)
    store = tmp / "store"
    if store.exists():
        store.unlink()
    spec = {**spec, "out": str(tmp)}
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "LAYERFREEZE_FILE_STORE": str(store), "OMP_NUM_THREADS": "1",
               # the test session's own entries after this checkout's (hidden assets: tests/conftest.py)
               "PYTHONPATH": os.pathsep.join(p for p in (PYTHONPATH, os.environ.get("PYTHONPATH", "")) if p)}
        if not cuda:
            env["CUDA_VISIBLE_DEVICES"] = ""
        log = open(tmp / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", module, *(args if args is not None else [str(spec_path)])]
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            codes.append(-999)
        log.close()
    outputs = [(tmp / f"rank{r}.log").read_text() for r in range(world)]
    results = []
    for r in range(world):
        path = tmp / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.is_file() else None)
    return Ranks(codes, outputs, results)
