"""Launch a test's ranks as real processes: gloo, a FileStore in a temp folder (no ports), a short timeout.

The ranks train on the CPU: CUDA is hidden from them (``CUDA_VISIBLE_DEVICES=""``), so a test that compares ranks
bit for bit with a one-process CPU run means the same on a GPU machine, where ``run.device: auto`` would otherwise put
each rank on a GPU (or refuse two ranks on one GPU: :func:`layerfreeze.distributed.choose_rank_device`). A test about
the GPU path passes ``cuda=True``.

Each CPU rank is a real process forked from a server that has already imported torch (with Dynamo, which any
optimizer's construction imports) and layerfreeze: ``multiprocessing``'s forkserver, started once per test session
with ``OMP_NUM_THREADS=1`` and CUDA hidden. A fresh interpreter spends ~3.5 s of CPU on those imports, two ranks at
once on CI's two cores, for each of the suite's ~60 launches. The rank then runs ``python -m module`` as the
interpreter would (:func:`_run_rank`): its own environment, output to its log, ``sys.exit``'s code as the exit code,
non-daemon threads joined and ``atexit`` run before it exits. ``cuda=True`` ranks start as fresh interpreters (a
forked process cannot use CUDA initialised before the fork), as do ``fresh=True`` ranks (a test of how a rank's process
ends: a forked rank leaves with ``os._exit``, so an abort in a C++ destructor at the interpreter's shutdown, such as
"terminate called without an active exception", cannot show in it) and every rank under
``LAYERFREEZE_TEST_FRESH_RANKS=1``."""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# this checkout's code, also when the environment's editable install points at another checkout
PYTHONPATH = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
#: What the rank server imports once (module docstring); nothing that reads the environment at import time.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "layerfreeze.train.trainer", "tests.distributed.launch"]
FRESH_RANKS_ENV = "LAYERFREEZE_TEST_FRESH_RANKS"


@dataclass
class Ranks:
    returncodes: list[int]
    outputs: list[str]
    results: list[dict | None]


def launch(spec: dict, tmp: Path, world: int = 2, timeout: float = 120, module: str = "tests.distributed.worker",
           args: list[str] | None = None, cuda: bool = False, fresh: bool = False) -> Ranks:
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
        argv = args if args is not None else [str(spec_path)]
        if cuda or fresh or os.environ.get(FRESH_RANKS_ENV):
            procs.append(_FreshRank(module, argv, env, tmp / f"rank{rank}.log"))
        else:
            process = _rank_server().Process(target=_run_rank, args=(module, argv, env, str(tmp / f"rank{rank}.log")))
            process.start()
            procs.append(process)
    codes = []
    for proc in procs:
        proc.join(timeout)
        if proc.exitcode is None:
            for p in procs:
                p.kill()
            proc.join()
            codes.append(-999)
        else:
            codes.append(proc.exitcode)
    outputs = [(tmp / f"rank{r}.log").read_text() for r in range(world)]
    results = []
    for r in range(world):
        path = tmp / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.is_file() else None)
    return Ranks(codes, outputs, results)


class _FreshRank:
    """A rank as a fresh interpreter (``python -m module``), with a ``multiprocessing.Process``'s join/kill/exitcode."""

    def __init__(self, module: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT)

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        self.proc.kill()

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()


def _rank_server() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server started (once) with one OpenMP thread, CUDA hidden and :data:`PRELOAD`
    imported: what a rank forked from it inherits (module docstring)."""
    context = multiprocessing.get_context("forkserver")
    if multiprocessing.forkserver._forkserver._forkserver_pid is None:
        context.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        os.environ.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return context


def _run_rank(module: str, argv: list[str], env: dict[str, str], log_path: str) -> None:
    """In the forked rank: what ``python -m module *argv`` in ``ROOT`` with ``env`` does, output to ``log_path``; exits
    with the code the interpreter would (0, ``sys.exit``'s, 1 after an uncaught exception's traceback)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(env)
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    sys.argv = [module, *argv]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    for thread in threading.enumerate():  # the interpreter's exit: non-daemon threads, then atexit
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
