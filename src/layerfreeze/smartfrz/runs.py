"""Reading recorded runs (the on-disk format is documented in :mod:`layerfreeze.smartfrz.collect`).

A *runs folder* holds one sub-folder per run. A run is usable for labelling and training when its ``meta.json``
says ``"status": "complete"``; runs that diverged (``"status": "diverged"``) are listed but never used.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from layerfreeze.checkpoint import file_sha256

META_FILE = "meta.json"
WEIGHTS_FILE = "weights.safetensors"
ACTIVATIONS_FILE = "activations.safetensors"
LABELS_FILE = "labels.json"
COUNTERFACTUAL_FILE = "counterfactual.json"  # written by :mod:`layerfreeze.smartfrz.counterfactual`
RUN_FORMAT = "layerfreeze-smartfrz-run"
RUN_FORMAT_VERSION = 1


class PipelineError(ValueError):
    """Bad input to the offline pipeline (no runs, unknown recipe, unlabelled runs, a window that does not fit)."""


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON through a temporary file and a rename, so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def read_json(path: Path, fix: str, keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """A JSON object file of the pipeline, checked: it parses, is an object and has ``keys``.

    Raises:
        PipelineError: it cannot be read, does not parse, is not an object or lacks one of ``keys`` (the message
            names the file and ends with ``fix``, what to do).
    """
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PipelineError(f"{path} cannot be read ({exc}): {fix}") from None
    if not isinstance(obj, dict):
        raise PipelineError(f"{path} is not a JSON object: {fix}")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise PipelineError(f"{path} lacks {', '.join(missing)}: {fix}")
    return obj


def read_meta(run_dir: str | Path) -> dict[str, Any] | None:
    """``meta.json`` of a run folder, or None when it has none (an unfinished run).

    Raises:
        PipelineError: the file exists but is corrupt (it is written atomically, so something else damaged it): the
            run is not skipped in silence.
    """
    path = Path(run_dir) / META_FILE
    if not path.is_file():
        return None
    return read_json(path, _collect_again(run_dir))


def _collect_again(run_dir: str | Path) -> str:
    """What to do about a damaged file of a recorded run (its meta or a tensor file)."""
    return (f"delete the run folder {Path(run_dir).name} and collect it again (`layerfreeze predictor collect` "
            "skips the finished runs)")


def _damaged(run_dir: str | Path, name: str) -> str | None:
    """Why a tensor file of a run no longer holds what was recorded: its bytes differ from the ``sha256`` its
    ``meta.json`` recorded (runs recorded before it have none: not checked); None when they match."""
    meta = read_meta(run_dir) or {}
    want = (meta.get("sha256") or {}).get(name) if isinstance(meta.get("sha256"), dict) else None
    path = Path(run_dir) / name
    if want is None or not path.is_file() or file_sha256(path) == want:
        return None
    return f"{name} does not match the SHA-256 its meta.json recorded (damaged since it was recorded)"


def read_tensors(run_dir: str | Path, name: str, keys: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """A tensor file of a run folder (``weights.safetensors`` or ``activations.safetensors``), checked: its bytes
    are the recorded ones (the ``sha256`` of ``meta.json``), it reads, holds ``keys`` and no NaN or Inf (a collected
    run has none: a diverged run has no tensor files).

    Raises:
        PipelineError: it is missing, damaged (a digest that does not match, NaN or Inf in it), cannot be read
            (truncated, not a safetensors file) or lacks one of ``keys`` (the message names the file and says to
            delete the run folder and collect it again).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(run_dir) / name
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise PipelineError(f"{path} cannot be read ({exc}): {_collect_again(run_dir)}") from None
    why = _damaged(run_dir, name)  # a flipped byte that still parses was trained on, or labelled, in silence
    if why is not None:
        raise PipelineError(f"{Path(run_dir) / why}: {_collect_again(run_dir)}")
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise PipelineError(f"{path} lacks {', '.join(missing)}: {_collect_again(run_dir)}")
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:  # a run recorded before the digest, damaged: a raw ValueError from the CKA or the predictor's features
        raise PipelineError(f"{path} holds NaN or Inf in {', '.join(bad)} (damaged): {_collect_again(run_dir)}")
    return tensors


def unreadable_tensors(run_dir: str | Path) -> str | None:
    """Why a complete run's tensor files cannot be used, from their headers (no tensor is read; a truncated file
    fails there, its header's offsets run past its end) and the digests ``meta.json`` recorded (a damaged byte that
    still parses); None when both open and match.
    """
    from safetensors import SafetensorError, safe_open

    for name in (WEIGHTS_FILE, ACTIVATIONS_FILE):
        try:
            with safe_open(str(Path(run_dir) / name), framework="pt"):
                pass
        except (OSError, SafetensorError) as exc:
            return f"{name} cannot be read ({exc})"
        why = _damaged(run_dir, name)
        if why is not None:
            return why
    return None


def is_finished(run_dir: str | Path) -> bool:
    """True when a run needs no more work: complete (with both tensor files) or recorded as diverged."""
    meta = read_meta(run_dir)
    if meta is None or meta.get("format") != RUN_FORMAT:
        return False
    if meta.get("status") == "diverged":
        return True
    run_dir = Path(run_dir)
    return meta.get("status") == "complete" and (run_dir / WEIGHTS_FILE).is_file() and \
        (run_dir / ACTIVATIONS_FILE).is_file()


def collapsed(meta: dict[str, Any]) -> bool:
    """True when a complete run ended at chance level: test accuracy < 1.5 / number of classes.

    Such a run "finished" without NaN/Inf but learned nothing usable (e.g. MobileNetV2 at SGD lr 0.03: loss down,
    BatchNorm statistics wrecked, test accuracy 0.104 on 10 classes); its labels would teach the predictor that a
    broken network is converged. The number of classes is the head's output width (``act_dims_full[-1]``).
    """
    acc, dims = meta.get("test_accuracy"), meta.get("act_dims_full")
    return acc is not None and bool(dims) and dims[-1] > 1 and acc < 1.5 / dims[-1]


def list_runs(runs_dir: str | Path, include_diverged: bool = False) -> list[Path]:
    """Run folders under ``runs_dir`` (sorted by name) whose ``meta.json`` marks them complete and not
    :func:`collapsed`.

    Raises:
        PipelineError: ``runs_dir`` is not a folder.
    """
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise PipelineError(f"{runs_dir} is not a folder of recorded runs (make one with `layerfreeze predictor "
                            "collect --out DIR`)")
    if (runs_dir / META_FILE).is_file():
        raise PipelineError(f"{runs_dir} is one recorded run; give the folder that holds the runs, "
                            f"{runs_dir.parent}")
    out = []
    for d in sorted(p for p in runs_dir.iterdir() if p.is_dir()):
        _check_recording(d)
        if not is_finished(d):
            continue
        if include_diverged or _usable(read_meta(d)):
            out.append(d)
    return out


#: A run folder's name as :func:`~layerfreeze.smartfrz.collect.run_name` makes it: ``<recipe>_s<seed>_lr<lr>``.
_RUN_NAME = re.compile(r".+_s-?\d+_lr[0-9.eE+-]+")


def unfinished_runs(runs_dir: str | Path) -> list[str]:
    """The run folders under ``runs_dir`` whose recording has not finished (a collection stopped while it recorded
    them, or before: no ``meta.json`` yet), by name; every command but ``collect`` leaves them out, and label and train
    say so (they trained a predictor on part of a collection in silence)."""
    return sorted(p.name for p in Path(runs_dir).iterdir()
                  if p.is_dir() and _RUN_NAME.fullmatch(p.name) and not is_finished(p))


def _check_recording(run_dir: Path) -> None:
    """Refuse a run folder whose recording is damaged, rather than leave it out in silence: a ``meta.json`` that is
    not a recorded run's (another file of the pipeline copied over it) or is of a newer format, a complete run
    missing a tensor file. A folder without ``meta.json``, or with a run still ``running`` (a collection stopped
    before it), is unfinished: ``collect`` records it, the others skip it.

    Raises:
        PipelineError: the folder is damaged (the message names it and says what to do).
    """
    meta = read_meta(run_dir)
    if meta is None:
        return
    if meta.get("format") != RUN_FORMAT:
        raise PipelineError(f"{run_dir / META_FILE} is not a recorded run's meta (format {meta.get('format')!r}): "
                            f"{_collect_again(run_dir)}")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > RUN_FORMAT_VERSION:
        raise PipelineError(f"{run_dir / META_FILE} has format_version {version!r}, which this layerfreeze does not "
                            f"read (it reads {RUN_FORMAT_VERSION}): use the layerfreeze that wrote it, or "
                            f"{_collect_again(run_dir)}")
    if meta.get("status") == "complete":
        missing = [name for name in (WEIGHTS_FILE, ACTIVATIONS_FILE) if not (run_dir / name).is_file()]
        if missing:
            raise PipelineError(f"{run_dir} is complete but has no {' or '.join(missing)}: {_collect_again(run_dir)}")


def _usable(meta: dict[str, Any]) -> bool:
    """A finished run's meta is one the pipeline uses: complete and not :func:`collapsed`."""
    return meta["status"] == "complete" and not collapsed(meta)


def excluded_runs(runs_dir: str | Path) -> list[dict[str, Any]]:
    """The finished runs under ``runs_dir`` that :func:`list_runs` leaves out, and why: ``[{"run", "recipe",
    "lr", "seed", "why"}]`` with ``why`` "diverged at step N" or "collapsed: test accuracy X" (:func:`collapsed`).
    A card lists them, so a learning rate missing from the corpus is explained (issue 29: MobileNetV2 at its
    registered SGD rate 0.03 diverges).

    Raises:
        PipelineError: ``runs_dir`` is not a folder.
    """
    out = []
    for d in list_runs(runs_dir, include_diverged=True):
        meta = read_meta(d)
        if _usable(meta):
            continue
        why = (f"diverged at step {meta.get('diverged_at_step')}" if meta.get("status") == "diverged"
               else f"collapsed: test accuracy {meta.get('test_accuracy'):.3f}")
        out.append({"run": meta.get("run", d.name), "recipe": meta.get("recipe"), "lr": meta.get("lr"),
                    "seed": meta.get("seed"), "why": why})
    return out


@dataclass
class RunData:
    """One complete run, read back: its meta, the weight-sample trajectory and (when present) its labels.

    Attributes:
        samples: ``(N_snap, L, S)`` float32. mask: ``(L, S)`` bool. steps: ``(N_snap,)`` int64.
        labels: the parsed ``labels.json`` or None.
    """

    path: Path
    meta: dict[str, Any]
    samples: torch.Tensor
    mask: torch.Tensor
    steps: torch.Tensor
    labels: dict[str, Any] | None = field(default=None)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def recipe(self) -> str:
        return self.meta["recipe"]

    @property
    def head(self) -> int | None:
        return self.meta.get("head")

    @property
    def num_blocks(self) -> int:
        return len(self.meta["blocks"])


def read_run(run_dir: str | Path, need_labels: bool = False) -> RunData:
    """Read a complete run's weights (and labels, when present).

    Raises:
        PipelineError: the run is not complete, its ``weights.safetensors`` cannot be read (:func:`read_tensors`),
            or ``need_labels`` and it has no ``labels.json``.
    """
    run_dir = Path(run_dir)
    meta = read_meta(run_dir)
    if meta is None or meta.get("status") != "complete" or not (run_dir / WEIGHTS_FILE).is_file():
        raise PipelineError(f"{run_dir} is not a complete recorded run")
    w = read_tensors(run_dir, WEIGHTS_FILE, ("samples", "mask", "steps"))
    labels = None
    if (run_dir / LABELS_FILE).is_file():
        labels = read_json(run_dir / LABELS_FILE, f"label the runs again (`layerfreeze predictor label "
                           f"{run_dir.parent}`)", keys=("tau", "delta", "window", "freezable", "first_freezable_step"))
    elif need_labels:
        raise PipelineError(f"{run_dir} has no {LABELS_FILE}: run `layerfreeze predictor label {run_dir.parent}`")
    return RunData(run_dir, meta, w["samples"], w["mask"].bool(), w["steps"], labels)


def read_activations(run_dir: str | Path) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``([act.<i> (N_act, P, D_i) float16 per block], act_steps (N_act,) int64)`` of a complete run.

    Raises:
        PipelineError: the run is not complete, or its ``activations.safetensors`` cannot be read
            (:func:`read_tensors`).
    """
    run_dir = Path(run_dir)
    meta = read_meta(run_dir)
    if meta is None or meta.get("status") != "complete":
        raise PipelineError(f"{run_dir} is not a complete recorded run")
    keys = tuple(f"act.{i}" for i in range(len(meta["blocks"])))
    t = read_tensors(run_dir, ACTIVATIONS_FILE, (*keys, "act_steps"))
    return [t[k] for k in keys], t["act_steps"]
