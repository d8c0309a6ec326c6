"""``layerfreeze report RUN_DIR``: a self-contained HTML page with PNG plots of a run or of a comparison.

:func:`write_report` reads what :mod:`layerfreeze.train.trainer` wrote (``metrics.jsonl`` and ``summary.json``) or
what :mod:`layerfreeze.train.compare` wrote (``compare.json`` plus one run folder per row), through the run folder's
contract (:mod:`layerfreeze.runs.rundir`), and writes ``RUN_DIR/report/index.html`` with the PNGs next to it: reading
in :mod:`.read` (:func:`load_run`), the plots in :mod:`.plots`, the pages in :mod:`.pages`; the comparison
table's cells and ratios are :mod:`layerfreeze.train.compare`'s own.
Plots are drawn with matplotlib's Agg canvas directly (no pyplot, no GUI backend, no browser needed); matplotlib is
the optional ``report`` extra (``pip install 'layerfreeze[report]'``).

Single run (``metrics.jsonl``):

* ``loss_vs_time.png`` -- training loss per step (light), a moving average and the eval loss at epoch ends against
  *training time*: the cumulative ``step_time_s`` of the logged steps (evaluation, checkpoints and pauses between a
  Ctrl-C and a resume are not counted, so runs compare fairly);
* ``loss_vs_flops.png`` -- the same against cumulative training FLOPs (as measured by the trainer);
* ``accuracy.png`` -- eval accuracy per epoch against training time and against FLOPs;
* ``freeze_timeline.png`` -- which block was frozen when (blocks top to bottom in forward order, epoch ends marked);
* ``step_time_memory.png`` -- step time and peak memory per step, with the steps where the frozen set changed.

A run without ``summary.json`` (interrupted, or still running) gets what its ``metrics.jsonl`` allows and a banner
saying so. A resumed run's records are read the way the trainer replays them (:func:`layerfreeze.runs.rundir.replay`):
whatever was logged after the checkpoint it resumed from is dropped (those steps were redone); a run that
restarted from the beginning (stopped before its first checkpoint) keeps only what it logged after the restart.

Comparison (``compare.json``): a table with the columns of ``compare.md`` plus a link to each row's own report
(generated too), ``accuracy_vs_time.png`` (test accuracy vs training time, ``none`` highlighted, rows named in a
legend by colour and marker),
``flops_ratio.png`` (FLOPs and time relative to ``none``) and ``loss_vs_time.png`` (every row's smoothed training
loss).
"""

from __future__ import annotations

from pathlib import Path

from layerfreeze.runs import rundir
from layerfreeze.runs.report.pages import write_compare_report, write_run_report
from layerfreeze.runs.report.read import Run, load_run

__all__ = ["Run", "load_run", "write_report"]


def write_report(run_dir: str | Path) -> Path:
    """Write ``run_dir/report/index.html`` and its PNG plots; return the HTML file's path.

    ``run_dir`` is either a training run folder (holding ``metrics.jsonl``, written by ``layerfreeze train``) or
    a comparison folder (holding ``compare.json``, written by ``layerfreeze compare``); for a comparison every
    row's run folder gets its own report too, linked from the table. An existing report folder is overwritten
    file by file.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist or holds neither ``metrics.jsonl`` nor ``compare.json``.
        ValueError: ``metrics.jsonl`` or ``compare.json`` is malformed.
        ImportError: matplotlib is not installed (``pip install 'layerfreeze[report]'``).
        ConfigError: the report folder cannot be written (a read-only run folder, a file in its place).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is a file, not a run folder" if run_dir.exists() else "does not exist"
        raise FileNotFoundError(f"report: {run_dir} {what}: give a folder `layerfreeze train` or "
                                "`compare` wrote")
    _require_matplotlib()
    if rundir.is_compare_dir(run_dir):
        return write_compare_report(run_dir)
    if rundir.is_run_dir(run_dir):
        return write_run_report(run_dir)
    hint = ""
    subruns = sorted(p.name for p in run_dir.iterdir() if rundir.is_run_dir(p))
    if subruns:
        hint = (f" It contains run folders ({', '.join(subruns)}): pass one of them, or wait until "
                f"`layerfreeze compare` has written {rundir.COMPARE_JSON}.")
    raise FileNotFoundError(
        f"report: {run_dir} is neither a training run (no {rundir.METRICS_FILE}) nor a comparison "
        f"(no {rundir.COMPARE_JSON}).{hint}"
    )


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "layerfreeze report needs matplotlib: pip install 'layerfreeze[report]'"
        ) from exc
