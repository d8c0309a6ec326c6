"""The SmartFRZ freeze predictor: single-query attention over a block's recorded weight history.

Architecture (SmartFRZ, Li et al., ICLR 2023, sec. 3.3: an attention-based predictor over the recorded history;
sizes are ours): each snapshot's feature vector (:mod:`.features`, ``(W - 1, F)``) goes through a shared snapshot
encoder (MLP F -> H -> H); the newest snapshot's encoding is the query, all snapshots' encodings are keys and
values (scaled dot-product attention, one head); the query concatenated with the attended value goes through a
classifier (MLP 2H -> H -> 1) giving the logit of "this block can be frozen now".

Windows may be shorter than the full ``window``: early in training a block has only a few snapshots, and a
block that is done early (a fine-tuned network's embeddings, the first convolutions) should not wait for 30 of them.
A predictor is trained on windows of ``min_window`` to ``window`` snapshots; in a batch, shorter windows are
left-padded and masked out of the attention (``mask``), so a padded window gives the same ``p`` as the unpadded one.

Files are safetensors with metadata: format and feature versions, window, min_window, hidden size, and the SHA-256
of the tensor bytes, so a truncated, corrupt or other-version file is refused by name, never used. A file without
``min_window`` (written before it existed) decides on full windows only.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerfreeze.errors import PredictorError
from layerfreeze.strategies.smartfrz.features import FEATURE_VERSION, NUM_FEATURES

FORMAT = "layerfreeze-smartfrz-predictor"
FORMAT_VERSION = 1
DEFAULT_PREDICTOR = Path(__file__).with_name("predictor.safetensors")


_REMEDY = " Retrain it with `layerfreeze predictor train`, or leave the predictor unset to use the shipped one."


class FreezePredictor(nn.Module):
    """p(freeze now) for a batch of blocks' feature windows.

    Args:
        hidden: Encoder width H.

    Forward: ``features`` ``(B, T, F)`` and optional ``mask`` ``(B, T)`` bool (True: a real snapshot; padding is
    on the left, so the newest snapshot ``[:, -1]`` is always real) -> logits ``(B,)``.
    """

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.hidden = hidden
        self.encoder = nn.Sequential(nn.Linear(NUM_FEATURES, hidden), nn.GELU(), nn.Linear(hidden, hidden))
        self.query = nn.Linear(hidden, hidden, bias=False)
        self.key = nn.Linear(hidden, hidden, bias=False)
        self.value = nn.Linear(hidden, hidden, bias=False)
        self.classifier = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, features: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.encoder(features)                              # (B, T, H)
        q = self.query(h[:, -1:])                               # (B, 1, H): newest snapshot
        scores = q @ self.key(h).transpose(1, 2) / self.hidden ** 0.5  # (B, 1, T)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        att = torch.softmax(scores, dim=-1)
        ctx = (att @ self.value(h))[:, 0]                       # (B, H)
        return self.classifier(torch.cat([h[:, -1], ctx], dim=-1))[:, 0]


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def save_predictor(path: str | Path, model: FreezePredictor, window: int, card: dict[str, Any] | None = None,
                   min_window: int | None = None) -> Path:
    """Write ``model`` as safetensors with versioned, checksummed metadata (``card`` is stored as JSON).

    ``window``: the most snapshots it reads; ``min_window``: the fewest it decides on (default ``window``)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    meta = {
        "format": FORMAT, "format_version": str(FORMAT_VERSION), "feature_version": str(FEATURE_VERSION),
        "window": str(window), "min_window": str(window if min_window is None else min_window),
        "hidden": str(model.hidden), "sha256": _digest(tensors),
        "card": json.dumps(card or {}),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def load_predictor(path: str | Path | None = None) -> tuple[FreezePredictor, dict[str, Any]]:
    """Load a predictor file (default: the one shipped in the package), once per process and file version.

    A file already loaded, unchanged since (same resolved path, size and modification time), is not read again:
    ``layerfreeze compare`` checks every row's strategy before training and builds it again in each row's run, and
    the predictor is read once. The model is shared between the callers, who only run it (in eval mode, no grad).

    Returns:
        ``(model in eval mode, metadata)`` with ``metadata["window"]`` and ``metadata["min_window"]`` ints
        (``min_window`` = ``window`` for a file written without it) and ``metadata["card"]`` a dict.

    Raises:
        PredictorError: the file is missing, not a safetensors predictor, truncated/corrupt (checksum), or written
            for another format or feature version. The message names the file.
    """
    path = Path(path) if path is not None else DEFAULT_PREDICTOR
    if not path.is_file():
        raise PredictorError(
            f"SmartFRZ predictor file {path} " + ("is a folder, not a file" if path.is_dir() else "does not exist")
            + ". Point it at an existing predictor file (strategy parameter `predictor`, e.g. -p predictor=PATH; "
            "`predictor evaluate --predictor PATH`), or omit it to use the one shipped with layerfreeze; train your "
            "own with `layerfreeze predictor train`."
        )
    stat = path.stat()
    model, meta = _load(path.resolve(), stat.st_size, stat.st_mtime_ns)
    return model, {**meta, "card": dict(meta["card"])}  # the metadata is the caller's to change


@functools.lru_cache(maxsize=8)
def _load(path: Path, size: int, mtime_ns: int) -> tuple[FreezePredictor, dict[str, Any]]:
    """:func:`load_predictor`'s reading and checks; ``size`` and ``mtime_ns`` key the cache (a rewritten file is
    read again)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - any parse failure means the file is unusable
        raise PredictorError(f"SmartFRZ predictor file {path} is corrupt or not a safetensors file: {exc}.{_REMEDY}"
                             ) from None
    if meta.get("format") != FORMAT:
        raise PredictorError(f"{path} is not a layerfreeze SmartFRZ predictor (format {meta.get('format')!r}): give "
                             "the file `layerfreeze predictor train --out` wrote, or leave the predictor unset to use "
                             "the shipped one")
    for key, want in (("format_version", FORMAT_VERSION), ("feature_version", FEATURE_VERSION)):
        if meta.get(key) != str(want):
            raise PredictorError(f"{path} was written with {key} {meta.get(key)!r}; this layerfreeze needs {want}. "
                                 "Retrain it with `layerfreeze predictor train`.")
    if _digest(tensors) != meta.get("sha256"):
        raise PredictorError(f"SmartFRZ predictor file {path} fails its checksum: it is corrupt.{_REMEDY}")
    try:
        hidden, window = int(meta["hidden"]), int(meta["window"])
        min_window = int(meta.get("min_window", window))
        card = json.loads(meta.get("card") or "{}")
    except (KeyError, ValueError) as exc:
        raise PredictorError(f"SmartFRZ predictor file {path} has bad metadata ({exc!r})") from None
    threshold = card.get("threshold")
    if threshold is not None and not (isinstance(threshold, (int, float)) and 0 < threshold < 1):
        raise PredictorError(f"SmartFRZ predictor file {path} has decision threshold {threshold!r} in its card; it "
                             f"must be in (0, 1).{_REMEDY}")
    if window < 3 or hidden < 1 or not 3 <= min_window <= window:
        raise PredictorError(f"SmartFRZ predictor file {path} has window {window}, min_window {min_window} (needs "
                             f"3 <= min_window <= window) / hidden {hidden}")
    # The layers' random initialisation is overwritten by the file's weights; it must not draw from the global RNG,
    # or building a smartfrz strategy (the first in a process: the model is cached) moves the training run's dropout
    # stream away from the `none` row's of the same seed, and every smartfrz-vs-none comparison carries that noise
    # on top of the freezing's effect (issue 29: 1.8 points on BBC lr x0.3 seed 0).
    with torch.random.fork_rng(devices=[]):
        model = FreezePredictor(hidden=hidden)
    try:
        model.load_state_dict(tensors)
    except RuntimeError as exc:  # torch lists every tensor on its own line: the first one says enough
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        first = next((line for line in lines[1:] if line[:1].isalpha()), lines[0] if lines else "")
        more = f" (and {len(lines) - 2} more)" if len(lines) > 2 else ""
        raise PredictorError(
            f"SmartFRZ predictor file {path} does not match the predictor architecture (its metadata says hidden "
            f"{hidden}): {first}{more}.{_REMEDY}") from None
    model.eval()
    out: dict[str, Any] = dict(meta)
    out["window"], out["min_window"] = window, min_window
    out["card"] = card
    return model, out
