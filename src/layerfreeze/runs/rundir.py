"""The run folder's contract: its layout, the records of ``metrics.jsonl``, and how a resumed run is read back.

Every writer (:mod:`~layerfreeze.train.trainer`, :mod:`~layerfreeze.runs.telemetry`, :mod:`~layerfreeze.checkpoint`,
:mod:`~layerfreeze.train.compare`, :mod:`~layerfreeze.cli`) and every reader (:mod:`~layerfreeze.runs.report`,
:mod:`~layerfreeze.train.compare`) takes the names below from here.

A training run folder::

    config.json        the validated config, written when the run starts: its presence marks a run
    metrics.jsonl      one JSON record per line, appended and flushed as written (see below)
    tensorboard/       TensorBoard event files
    checkpoints/       NNNNNN-stepSSSSSSSSS/ checkpoint folders (the last run.keep_checkpoints)
    checkpoint         a symbolic link to the newest checkpoint
    cache/[rankN/]     the frozen-prefix cache's shards (freeze.cache)
    ranks/rankN/       distributed runs: rank N's own metrics.jsonl (step records of what each rank holds and
                       sends: peak memory, parameter and optimizer-state bytes, collective bytes; see the trainer)
    summary.json       written when the run ends: its presence marks a finished run
    report/            index.html and its PNGs (``layerfreeze report``)

A comparison folder (``layerfreeze compare``): ``compare.json`` (one row object per run, rewritten after every
run), ``compare.md``, one run folder per row (``<row>/``) and ``report/``.

Records of ``metrics.jsonl``: each has a ``type`` (:class:`Record`) and a ``time`` (Unix seconds). ``step``
records carry a ``step`` and either the training step's metrics (``loss``, ``lr``, ``step_time_s``, ...) or the
stability guard's hold-out evaluation (``val_loss``, ``val_<metric>``); ``epoch`` records an ``epoch``, the
``step`` it ended at and its evaluation; ``config`` records the ``config``; ``event`` records a ``kind``
(:class:`Event`) and a ``step``. A training step record the memory ledger sampled carries ``memory``: the ledger's
bytes per bucket, device and block (:meth:`layerfreeze.runs.ledger.LedgerSnapshot.to_record`).

The replay rule (:func:`replay`): a resumed run appends to the same ``metrics.jsonl``, and its ``resumed`` event
names the step of the checkpoint it continued from. Whatever was logged after that step was redone, so it is
dropped; a run that restarted from the beginning (``from_start``: stopped before its first checkpoint) keeps only
what it logged after the restart. A record logged again for the same step (or epoch) replaces the earlier one.
"""

from __future__ import annotations

import enum
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerfreeze.errors import ConfigError, RunFileError

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_LINK = "checkpoint"
CACHE_DIR = "cache"
RANKS_DIR = "ranks"
DEMOTED_DIR = "demoted"
SUMMARY_FILE = "summary.json"
REPORT_DIR = "report"
REPORT_INDEX = "index.html"
COMPARE_JSON = "compare.json"
COMPARE_MD = "compare.md"


class Record(enum.StrEnum):
    """The ``type`` of a ``metrics.jsonl`` record."""

    STEP = "step"
    EPOCH = "epoch"
    EVENT = "event"
    CONFIG = "config"


class Event(enum.StrEnum):
    """The ``kind`` of an ``event`` record, and what it means."""

    FREEZE = "freeze"  # a block was frozen (block, index, epoch, reason)
    THAW = "thaw"  # a block was thawed (block, index, epoch, reason)
    STAGE = "stage"  # an epoch-end freezing stage's strategy signals (signal_<name>)
    FLOPS_REMEASURED = "flops_remeasured"  # FLOPs per step measured on this step (flops_per_step, frozen_blocks)
    CHECKPOINT = "checkpoint"  # a checkpoint was written (reason, path, checkpoint_s)
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # resume fell back past an unusable checkpoint (reason)
    INTERRUPTED = "interrupted"  # the run stopped on an exception or Ctrl-C (error, checkpoint)
    RESUMED = "resumed"  # the run continued from a checkpoint (path), or restarted (from_start)
    CACHE_OFF = "cache_off"  # the frozen-prefix cache was refused (reason)
    DDP_REBUILD = "ddp_rebuild"  # distributed: FreezeDDP was rebuilt after a freeze/thaw
    # the ledger's first sample after a freeze/thaw: returned_bytes per bucket, returned_devices per device and
    # bucket, params_dtype after (changes, before_step)
    MEMORY = "memory"


def cache_dir(run_dir: Path, rank: int | None = None) -> Path:
    """Where the frozen-prefix cache of a run keeps its shards (one folder per rank when distributed)."""
    return run_dir / CACHE_DIR / (f"rank{rank}" if rank is not None else "")


def rank_dir(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` of a distributed run writes its own records (a ``metrics.jsonl`` of step records, read
    with :func:`read_metrics` like a run's, the replay rule included)."""
    return run_dir / RANKS_DIR / f"rank{rank}"


def demoted_dir(run_dir: Path, rank: int | None = None) -> Path:
    """Where the float32 master copies of a run's demoted frozen blocks go when kept on disk (scratch, deleted when the
    run ends; one folder per rank when distributed)."""
    return run_dir / DEMOTED_DIR / (f"rank{rank}" if rank is not None else "")


def row_dir(compare_dir: Path, row: str) -> Path:
    """The run folder of one row of a comparison."""
    return compare_dir / row


def is_run_dir(path: Path) -> bool:
    """``path`` holds a training run's records (finished or not)."""
    return (path / METRICS_FILE).is_file()


def is_compare_dir(path: Path) -> bool:
    """``path`` holds a comparison (``compare.json``)."""
    return (path / COMPARE_JSON).is_file()


def check_run_dir(run_dir: Path, resuming: bool = False) -> None:
    """Refuse a run folder that would mix two runs: one that already holds a run (its ``config.json``) when not
    resuming it, a finished run (its ``summary.json``) when resuming it, a path that is a file, or one that cannot
    be written (checked on the folder, or the nearest folder above it that exists, before anything trains).

    Raises:
        ConfigError: with what to do instead.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run dir {run_dir} is a file, not a folder; pick another --run-dir")
    check_writable(run_dir, "run.dir (--run-dir)", folder=True)
    if resuming and (run_dir / SUMMARY_FILE).is_file():
        raise ConfigError(f"run dir {run_dir}: this run already finished (it has a summary.json); nothing to resume. "
                          "Start a new run with another --run-dir")
    if not resuming and (run_dir / SUMMARY_FILE).is_file():
        raise ConfigError(f"run dir {run_dir} already holds a finished run; pick another --run-dir (or remove that "
                          "folder)")
    if not resuming and (run_dir / CONFIG_FILE).is_file():
        raise ConfigError(f"run dir {run_dir} already holds a run; continue it with `layerfreeze train --resume "
                          f"{run_dir}` or pick another --run-dir")


def check_writable(path: Path, setting: str, folder: bool = False) -> None:
    """Refuse, before anything is measured or trained, an output path that cannot be written: a folder in its place
    (for a file), or no write permission on the nearest existing folder at or above it (``/proc/x``, a read-only
    mount). A missing folder above is fine: it is created.

    Raises:
        ConfigError: naming ``setting`` and what to do.
    """
    path = Path(path)
    if not folder and path.is_dir():
        raise ConfigError(f"{setting} {path} is a folder; give a file path")
    existing = path if folder and path.is_dir() else path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK) or _pseudo_fs(existing):
        raise ConfigError(f"{setting} {path} cannot be written ({existing} is not a writable folder); give a path "
                          "under a folder you can write to")


def _pseudo_fs(folder: Path) -> bool:
    """``folder`` is in the kernel's /proc or /sys (root may "write" there, yet nothing can be created)."""
    parts = folder.resolve().parts
    return len(parts) > 1 and parts[1] in ("proc", "sys")


def write_config(run_dir: Path, config: dict[str, Any]) -> None:
    """Write the run's validated config (``config.json``)."""
    (run_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2))


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """Write ``summary.json`` so a kill leaves no file or the whole one, never half of one."""
    path = run_dir / SUMMARY_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(summary, indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_summary(run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(summary, None)``; ``(None, None)`` for a run without ``summary.json`` (interrupted or still running);
    ``(None, why)`` when the file is there but unreadable or not a JSON object."""
    path = run_dir / SUMMARY_FILE
    if not path.is_file():
        return None, None
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"{SUMMARY_FILE} could not be read: {exc}"
    if not isinstance(loaded, dict):
        return None, f"{SUMMARY_FILE} is not a JSON object"
    return loaded, None


def write_compare(compare_dir: Path, rows: list[dict[str, Any]], markdown: str | None = None) -> None:
    """Write ``compare.json`` (and ``compare.md`` when given); ``compare_dir`` is made if missing (a comparison cut
    before its first row made it)."""
    compare_dir.mkdir(parents=True, exist_ok=True)
    (compare_dir / COMPARE_JSON).write_text(json.dumps(rows, indent=2))
    if markdown is not None:
        (compare_dir / COMPARE_MD).write_text(markdown)


def read_compare(compare_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``compare.json``, as written (the ratios appear only once every row has run).

    Raises:
        FileNotFoundError: no ``compare.json``.
        RunFileError (a ValueError): it is not valid JSON, or not a list of objects each with a ``"row"`` name.
    """
    path = compare_dir / COMPARE_JSON
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise RunFileError(f"{path}: not valid JSON ({exc}): it is not the file `layerfreeze compare` writes; run the "
                           "comparison again into a new folder") from exc
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("row"), str) for r in rows):
        raise RunFileError(f"{path}: expected a list of row objects, each with its 'row' name, as `layerfreeze "
                           "compare` writes")
    return [dict(r) for r in rows]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Parse ``metrics.jsonl`` into a list of records, in file order (no replay: a resumed run's redone steps appear
    twice, the killed attempt's and the resumed one's; :func:`replay` of this list gives each once).

    Args:
        run_dir: the run directory (or the path of the ``.jsonl`` file itself).

    Blank lines are skipped.  A final line that is the start of a JSON object
    (``{...`` cut short) is taken to be a record truncated by a crash and is
    skipped silently.

    Raises:
        FileNotFoundError: no metrics file.
        RunFileError (a ValueError): a line other than the last is not valid JSON, the last is
            neither valid JSON nor the start of an object (another file's
            content, not a crash's cut), or a line is not a JSON object with a
            ``"type"``; the message names the file and line number.
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = fh.read().split("\n")
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    records: list[dict[str, Any]] = []
    for pos, (lineno, line) in enumerate(numbered):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if pos == len(numbered) - 1 and line.lstrip().startswith("{"):
                break  # truncated final record
            raise RunFileError(f"{path}: line {lineno} is not valid JSON ({err.msg}): not a record a run writes, "
                               "nor one a crash cut short") from err
        if not isinstance(record, dict):
            raise RunFileError(f"{path}: line {lineno} is not a JSON object, as every record a run writes is")
        if not isinstance(record.get("type"), str):
            raise RunFileError(f"{path}: line {lineno} has no 'type' (step, epoch, event, config), as every record a "
                               "run writes has: it is another file's content")
        records.append(record)
    return records


def finite(value: Any) -> bool:
    """A record value that is a finite number (not a bool, not None, not NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _step_of(record: dict[str, Any]) -> float:
    value = record.get("step")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


@dataclass
class Replay:
    """A run's records as the run itself lived them (:func:`replay`): redone steps once, in order."""

    config: dict[str, Any] | None = None  # the first config record's config
    steps: list[dict[str, Any]] = field(default_factory=list)  # training step records, by step
    vals: list[dict[str, Any]] = field(default_factory=list)  # stability-guard hold-out evaluations, by step
    epochs: list[dict[str, Any]] = field(default_factory=list)  # epoch records, by epoch
    events: list[dict[str, Any]] = field(default_factory=list)  # events that survived, in order (not the two below)
    interruptions: list[dict[str, Any]] = field(default_factory=list)  # every interrupted event
    resumes: list[dict[str, Any]] = field(default_factory=list)  # every resumed event


def replay(records: list[dict[str, Any]]) -> Replay:
    """Apply the replay rule (module docstring) to ``records`` in file order (from :func:`read_metrics`)."""
    out = Replay()
    steps: dict[int, dict[str, Any]] = {}
    vals: dict[int, dict[str, Any]] = {}
    epochs: dict[int, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    for rec in records:
        kind = rec.get("type")
        if kind == Record.CONFIG:
            if out.config is None and isinstance(rec.get("config"), dict):
                out.config = rec["config"]
        elif kind == Record.STEP and finite(rec.get("step")):
            if "loss" in rec:
                steps[int(rec["step"])] = rec
            elif "val_loss" in rec:
                vals[int(rec["step"])] = rec
        elif kind == Record.EPOCH and finite(rec.get("epoch")):
            epochs[int(rec["epoch"])] = rec
        elif kind == Record.EVENT:
            if rec.get("kind") == Event.INTERRUPTED:
                out.interruptions.append(rec)
            elif rec.get("kind") == Event.RESUMED:
                out.resumes.append(rec)
                if finite(rec.get("step")):
                    # Everything logged after the checkpoint this resume started from was redone: drop it.
                    cut = int(rec["step"])
                    steps = {s: r for s, r in steps.items() if s <= cut}
                    vals = {s: r for s, r in vals.items() if s <= cut}
                    epochs = {e: r for e, r in epochs.items() if _step_of(r) <= cut}
                    events = [e for e in events if _step_of(e) <= cut and not rec.get("from_start")]
            else:
                events.append(rec)
    out.steps = [steps[s] for s in sorted(steps)]
    out.vals = [vals[s] for s in sorted(vals)]
    out.epochs = [epochs[e] for e in sorted(epochs)]
    out.events = events
    return out
