"""A training run's logging: metrics.jsonl records, TensorBoard, and the formatted end-of-run summary.

What is recorded, and where (names and record kinds: :mod:`layerfreeze.runs.rundir`):

* ``<run_dir>/metrics.jsonl``: one JSON object per line, appended and flushed
  as it is written, so a crash keeps every complete record.  Each record has a
  ``"type"`` (``"step"``, ``"epoch"``, ``"event"`` or ``"config"``) and a
  ``"time"`` (Unix time, seconds).  Read it back with
  :func:`layerfreeze.runs.rundir.read_metrics`.
* ``<run_dir>/tensorboard/``: TensorBoard event files written by
  :class:`torch.utils.tensorboard.SummaryWriter` (scalars ``train/<name>``,
  ``epoch/<name>``, ``blocks/frozen_count``, the memory ledger's ``memory/<bucket>`` in bytes; text ``events`` and
  ``config``).
* A strategy's signals as telemetry fields (:func:`signals_of`).
* The end-of-run summary table for people is :mod:`layerfreeze.runs.summary`.

What is measured (FLOPs, memory) is :mod:`layerfreeze.runs.measure`. Progress bars are not handled here; the trainer
owns them.
"""

from __future__ import annotations

import datetime as _dt
import enum
import json
import numbers
import os
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from layerfreeze.runs import rundir
from layerfreeze.runs.rundir import Event, Record

__all__ = ["NullTelemetry", "Telemetry", "signals_of"]


# --------------------------------------------------------------------------- #
# JSON helpers
# --------------------------------------------------------------------------- #
def _json_default(obj: Any) -> Any:
    """``json.dumps`` hook for values the stdlib encoder does not know."""
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu()
        return obj.item() if obj.numel() == 1 and obj.dim() == 0 else obj.tolist()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if isinstance(obj, (_dt.datetime, _dt.date)):
        return obj.isoformat()
    # numpy scalars and arrays, without importing numpy.
    if type(obj).__module__ == "numpy":
        if hasattr(obj, "tolist"):
            return obj.tolist()
    # Anything else exposing a numeric conversion (e.g. Decimal-like scalars).
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    raise TypeError(
        f"telemetry: value of type {type(obj).__qualname__} is not JSON serialisable: {obj!r}"
    )


def _dumps(record: Mapping[str, Any]) -> str:
    return json.dumps(record, default=_json_default, ensure_ascii=False)


def _as_scalar(value: Any) -> float | int | None:
    """Return ``value`` as a plain Python number if it is a numeric scalar.

    Accepts Python ints/floats, 0-d / one-element torch tensors and numpy
    scalars.  Returns None for anything else (bools, strings, lists, None).
    """
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool:
            return None
        value = value.detach().cpu().item()
        return value if isinstance(value, (int, float)) else None
    if type(value).__module__ == "numpy":
        if getattr(value, "size", None) != 1 or getattr(value, "dtype", None) is None:
            return None
        if value.dtype.kind == "b":
            return None
        item = value.item() if hasattr(value, "item") else None
        return item if isinstance(item, (int, float)) and not isinstance(item, bool) else None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


# --------------------------------------------------------------------------- #
# Telemetry
# --------------------------------------------------------------------------- #
_RESERVED = frozenset({"type", "time", "step", "epoch", "kind"})


class Telemetry:
    """Writes a run's metrics to ``metrics.jsonl`` and TensorBoard.

    Args:
        run_dir: run directory; created (with parents) if missing.
        tensorboard: also write TensorBoard event files under
            ``<run_dir>/tensorboard/``.
        resuming: a process that goes on with a run from a checkpoint: it calls :meth:`purge_from` once it knows
            the checkpoint's step (a new run's event files start with TensorBoard's start marker instead).

    ``metrics.jsonl`` is opened in append mode, so resuming a run keeps
    extending the same file.  If the file ends with an incomplete line (a
    crash in the middle of a write) that partial record is removed first, so
    appended records stay on their own lines.  Every record is flushed as it is
    written.

    Use as a context manager or call :meth:`close` (idempotent).  Logging after
    ``close`` raises ``RuntimeError``.  Values that cannot be serialised to
    JSON raise ``TypeError`` (torch tensors, numpy scalars/arrays, paths,
    dtypes, devices, enums, sets and datetimes are converted).
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, resuming: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / rundir.METRICS_FILE
        _drop_partial_last_line(self.metrics_path)
        self._fh = open(self.metrics_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._writer = None
        self.tensorboard_dir: Path | None = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard_dir = self.run_dir / rundir.TENSORBOARD_DIR
            try:  # a new run's events start with TensorBoard's start marker (its loader takes the first one as the
                # run's start and every later one as a restart: purge_from); a resumed process writes its own there
                self._writer = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=None if resuming else 0)
            except BaseException:
                self._fh.close()
                raise
        self._closed = False

    # -- plumbing ----------------------------------------------------------- #
    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Telemetry for {self.run_dir} is closed")

    @staticmethod
    def _check_names(names: Mapping[str, Any], what: str) -> None:
        clash = _RESERVED.intersection(names)
        if clash:
            raise ValueError(f"{what}: reserved field name(s) {sorted(clash)}")

    def _write(self, record: dict[str, Any]) -> None:
        line = _dumps(record)  # serialise first: a TypeError writes nothing
        self._fh.write(line + "\n")
        self._fh.flush()

    def _scalars(self, prefix: str, step: int, metrics: Mapping[str, Any]) -> None:
        if self._writer is None:
            return
        for name, value in metrics.items():
            scalar = _as_scalar(value)
            if scalar is not None:
                self._writer.add_scalar(f"{prefix}/{name}", scalar, global_step=step)

    # -- public ------------------------------------------------------------- #
    def log_step(self, step: int, **metrics: Any) -> None:
        """Record per-step metrics (e.g. ``loss``, ``lr``, ``flops``).

        Writes ``{"type": "step", "step": step, "time": <unix s>, **metrics}``.
        Numeric scalar metrics also go to TensorBoard as ``train/<name>`` at
        ``global_step=step``; None, bools, strings, lists and dicts are JSON-only, except ``memory`` (the memory
        ledger's record, :meth:`layerfreeze.runs.ledger.LedgerSnapshot.to_record`), whose buckets go to TensorBoard
        as ``memory/<bucket>``, with ``memory/tensor_total`` and ``memory/rss`` (bytes); with more than one device
        ``memory/<device>/tensor_total`` too, and on CUDA ``memory/<device>/allocated``, ``reserved``,
        ``peak_allocated``, ``peak_reserved``.

        Raises:
            ValueError: a metric is named type/time/step/epoch/kind.
            TypeError: a value is not JSON serialisable.
            RuntimeError: after :meth:`close`.
        """
        self._check_open()
        self._check_names(metrics, "log_step")
        self._write({"type": Record.STEP, "step": int(step), "time": time.time(), **metrics})
        self._scalars("train", int(step), metrics)
        if isinstance(metrics.get("memory"), Mapping):
            self._memory_scalars(int(step), metrics["memory"])

    def _memory_scalars(self, step: int, memory: Mapping[str, Any]) -> None:
        """The ledger record's bytes as ``memory/...`` TensorBoard scalars (see :meth:`log_step`)."""
        if self._writer is None:
            return
        scalars = {f"memory/{b}": n for b, n in (memory.get("buckets") or {}).items()}
        scalars["memory/tensor_total"] = memory.get("tensor_bytes")
        scalars["memory/rss"] = memory.get("rss_bytes")
        devices = [d for d in (memory.get("devices") or {}) if d != "disk"]
        if len(devices) > 1:
            for d in devices:
                scalars[f"memory/{d}/tensor_total"] = memory["devices"][d].get("tensor_bytes")
        for d, stats in (memory.get("allocator") or {}).items():
            scalars.update({f"memory/{d}/{k}": v for k, v in stats.items()})
        for tag, value in scalars.items():
            scalar = _as_scalar(value)
            if scalar is not None:
                self._writer.add_scalar(tag, scalar, global_step=step)

    def log_epoch(self, epoch: int, step: int, **metrics: Any) -> None:
        """Record end-of-epoch metrics (e.g. ``val_loss``, ``epoch_time_s``).

        Writes ``{"type": "epoch", "epoch": epoch, "step": step, "time": ..., **metrics}``;
        numeric scalars go to TensorBoard as ``epoch/<name>`` at
        ``global_step=step`` (the global training step, so epoch curves line
        up with step curves).

        Raises:
            ValueError, TypeError, RuntimeError: as :meth:`log_step`.
        """
        self._check_open()
        self._check_names(metrics, "log_epoch")
        self._write(
            {"type": Record.EPOCH, "epoch": int(epoch), "step": int(step), "time": time.time(), **metrics}
        )
        self._scalars("epoch", int(step), metrics)
        if self._writer is not None:
            self._writer.flush()

    def log_event(self, kind: str, step: int, **fields: Any) -> None:
        """Record a discrete event such as ``"freeze"``, ``"thaw"``,
        ``"flops_remeasured"``, ``"checkpoint"`` or ``"interrupted"``.

        Writes ``{"type": "event", "kind": kind, "step": step, "time": ..., **fields}``.
        In TensorBoard, ``freeze``/``thaw`` events add a line to the text tag
        ``events``, and any event carrying a numeric ``frozen_count`` field
        sets the scalar ``blocks/frozen_count`` at ``global_step=step``.

        Raises:
            ValueError: ``kind`` is empty or a field uses a reserved name
                (type/time/step/kind; ``epoch`` is allowed here).
            TypeError, RuntimeError: as :meth:`log_step`.
        """
        self._check_open()
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"log_event: kind must be a non-empty string, got {kind!r}")
        clash = (_RESERVED - {"epoch"}).intersection(fields)
        if clash:
            raise ValueError(f"log_event: reserved field name(s) {sorted(clash)}")
        self._write({"type": Record.EVENT, "kind": kind, "step": int(step), "time": time.time(), **fields})
        if self._writer is None:
            return
        if kind in (Event.FREEZE, Event.THAW):
            details = ", ".join(f"{k}={_dumps_value(v)}" for k, v in fields.items())
            text = f"step {int(step)}: **{kind}**" + (f" ({details})" if details else "")
            self._writer.add_text("events", text, global_step=int(step))
        count = _as_scalar(fields.get("frozen_count"))
        if count is not None:
            self._writer.add_scalar("blocks/frozen_count", count, global_step=int(step))
        self._writer.flush()

    def purge_from(self, step: int) -> None:
        """A resume: TensorBoard drops the values this run's earlier processes logged at ``step`` and after (a
        resume from a checkpoint at step ``s`` redoes the steps after it: ``purge_from(s + 1)``; a restart from the
        beginning: ``purge_from(0)``; each value was shown twice), as the replay rule does for ``metrics.jsonl``
        (:func:`~layerfreeze.runs.rundir.replay`). The event writer starts a new file whose first event is
        TensorBoard's restart marker (``SummaryWriter(purge_step=step)``; TensorBoard's loader drops every value,
        scalars and text alike, at or after it). No-op without TensorBoard.

        Raises:
            RuntimeError: after :meth:`close`.
        """
        self._check_open()
        if self._writer is None:
            return
        from torch.utils.tensorboard import SummaryWriter

        self._writer.close()
        self._writer = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=int(step))

    def log_config(self, config: Mapping[str, Any], step: int = 0) -> None:
        """Record the run configuration.

        Writes ``{"type": "config", "time": ..., "config": config}`` and, in
        TensorBoard, the text tag ``config`` holding the config as an indented
        JSON block, at ``step`` (a resumed process: the first step it trains, so
        a later resume from the same checkpoint purges it with the rest).

        Raises:
            TypeError: ``config`` is not a mapping or holds a value that is not
                JSON serialisable.
            RuntimeError: after :meth:`close`.
        """
        self._check_open()
        if not isinstance(config, Mapping):
            raise TypeError(f"log_config: config must be a mapping, got {type(config).__qualname__}")
        self._write({"type": Record.CONFIG, "time": time.time(), "config": dict(config)})
        if self._writer is not None:
            pretty = json.dumps(dict(config), default=_json_default, indent=2, ensure_ascii=False)
            # Indented lines render as a code block in TensorBoard's markdown.
            block = "\n".join("    " + line for line in pretty.splitlines())
            self._writer.add_text("config", block, global_step=int(step))
            self._writer.flush()

    def flush(self) -> None:
        """Flush ``metrics.jsonl`` and the TensorBoard writer (no-op once closed)."""
        if self._closed:
            return
        self._fh.flush()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close ``metrics.jsonl`` and the TensorBoard writer.

        Safe to call more than once.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._writer is not None:
                self._writer.flush()
                self._writer.close()
        finally:
            self._fh.close()

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Telemetry(run_dir={str(self.run_dir)!r}, tensorboard={self._writer is not None}, {state})"


def _dumps_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=_json_default, ensure_ascii=False)
    except TypeError:
        return repr(value)


def _drop_partial_last_line(path: Path) -> None:
    """Remove an unterminated final line (crash mid-write) from ``path``."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open(path, "rb+") as fh:
        fh.seek(-1, os.SEEK_END)
        if fh.read(1) == b"\n":
            return
        # Scan backwards for the last newline.
        chunk = 64 * 1024
        pos = size
        keep = 0
        while pos > 0:
            start = max(0, pos - chunk)
            fh.seek(start)
            data = fh.read(pos - start)
            idx = data.rfind(b"\n")
            if idx != -1:
                keep = start + idx + 1
                break
            pos = start
        fh.truncate(keep)


class NullTelemetry:
    """What ranks other than 0 log to: nothing (rank 0 writes the run's metrics, TensorBoard and summary)."""

    def _ignore(self, *args: Any, **kwargs: Any) -> None:
        return None

    log_step = log_epoch = log_event = log_config = purge_from = flush = close = _ignore


def signals_of(decision: Any) -> dict[str, Any]:
    """A stage's strategy signals for telemetry, as ``signal_<name>``: numbers, and lists of numbers per block
    (NaN where a block has no value); None when no stage ran."""
    if decision is None:
        return {}
    out = {}
    for name, value in decision.signals.items():
        if isinstance(value, (int, float)) or (isinstance(value, list) and all(
                isinstance(v, (int, float)) or v is None for v in value)):
            out[f"signal_{name}"] = value
    return out
