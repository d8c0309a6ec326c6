"""A per-sample cache of the frozen prefix's output, so the prefix's forward can be skipped.

Why: once blocks ``0..depth-1`` are frozen (eval mode, no gradients), their output for a sample is a fixed function
of that sample's inputs. When the inputs are deterministic (no random augmentation), computing it once and reading
it back every later epoch saves the prefix's whole forward -- the only cost a frozen prefix still has. When more
blocks freeze, the cache is carried forward from the cached boundary (``extend``), not recomputed from the input.

The pieces:

* :class:`ActivationCache` -- storage. Entries are keyed by ``(sample index, depth)``; held in memory up to a
  budget, then written to disk as safetensors shards with a JSON index of sizes and SHA-256 checksums; optionally
  stored in float16/bfloat16; variable-length states stored trimmed to their true length.
* :class:`CachedPrefix` -- the forward: cached states for hits, ``prefix`` (or ``extend`` from an older boundary)
  for misses, then the split's ``suffix`` with gradients (:mod:`layerfreeze.forward_split`).
* :func:`check_deterministic` and :func:`check_prefix_deterministic` -- refuse, with a clear message, what would
  make a cache wrong: random augmentation in the dataset; dropout or BatchNorm in training mode in the prefix.

Correctness rules (each one guards against reusing a stale value silently):

* A hit is used only after its sample's inputs are checked against the fingerprint taken when it was cached
  (:meth:`~layerfreeze.forward_split.ModelSplit.fingerprint`); a change means random augmentation ->
  :class:`CacheRefused` (or, with ``fallback=True``, the cache turns itself off and the full forward runs).
* A prefix module that is stochastic in its current mode -> :class:`CacheRefused` (or fallback).
* A prefix block whose parameters or buffers were modified in place since they were cached (``Tensor._version``
  changed: an optimizer step after a thaw, ``load_state_dict``) invalidates every entry that went through it.
* A thaw (shallower depth) drops entries deeper than the new boundary.
* A shard file whose size, SHA-256 or per-entry CRC-32 does not match the index is dropped with a warning
  (``corrupt_shards``) and its entries are recomputed, never returned.

Equality. In float32 the cached path gives the same logits as the full forward bit for bit whenever the prefix's
kernels give a sample the same bits whatever else is in its batch. On CPU they do for batches of 4 or more rows
(tested with 1 and 2 threads); a batch of 1-3 rows (a short last batch, a few misses recomputed together) may get
another GEMM kernel and differ in the last bits, as any change of batch size would without a cache. Storing in
float16/bfloat16 rounds the state (about 1e-3 relative).

A cache holds the outputs of one model for one dataset: ``index`` must identify a sample of that dataset (never
mix train and test batches), and entries are valid only for the weights they were computed with (the disk files
are scratch, deleted by :meth:`ActivationCache.close` or when the cache is garbage collected).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import warnings
import weakref
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .blocks import Block
from .forward_split import ModelSplit, split_for

__all__ = [
    "ActivationCache",
    "CacheRefused",
    "CachedPrefix",
    "check_deterministic",
    "check_prefix_deterministic",
]

INDEX_FILE = "index.json"
INDEX_VERSION = 1
_AUGMENTATION = (
    "random augmentation in the dataset: the frozen prefix's outputs cannot be cached; "
    "set cache: off or make the transform deterministic"
)


class CacheRefused(ValueError):
    """Raised when caching the frozen prefix's output would give wrong results (the message says why)."""


# --------------------------------------------------------------------------------------------------------------
# Determinism checks
# --------------------------------------------------------------------------------------------------------------


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    """The path of the first value that differs between two fetches of an item, or None if they are equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        )
        return None if same else path
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return path or "(keys)"
        for k in a:
            found = _first_difference(a[k], b[k], k if not path else f"{path}.{k}")
            if found is not None:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return path or "(length)"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return None if np.array_equal(a, b) else path
    return None if a == b else path


def check_deterministic(dataset: Any, n: int = 4) -> None:
    """Refuse a dataset whose items differ from one fetch to the next (random augmentation).

    Fetches items ``0..n-1`` twice and compares every tensor exactly (dtype, shape, values). The global random
    states of Python, NumPy and torch are restored afterwards, so the check does not change the run's random
    stream (a run with the cache draws the same dropout masks as one without).

    Raises:
        CacheRefused: an item differs between the two fetches; the message names the item and the first key that
            differs and says "random augmentation in the dataset ...". Also when an item has no ``"index"``
            (the cache key).
    """
    count = min(n, len(dataset))
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            first = [dataset[i] for i in range(count)]
            second = [dataset[i] for i in range(count)]
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
    for i, (a, b) in enumerate(zip(first, second)):
        if isinstance(a, dict) and "index" not in a:
            raise CacheRefused(
                f"dataset items have no 'index' key (keys: {sorted(a)}); the activation cache keys entries by it"
            )
        key = _first_difference(a, b, "")
        if key is not None:
            raise CacheRefused(f"dataset item {i}: {key or 'the item'!r} differs between two fetches: {_AUGMENTATION}")


_DROPOUT = (nn.modules.dropout._DropoutNd,)
_BATCHNORM = (nn.modules.batchnorm._BatchNorm,)


def _stochastic_reason(module: nn.Module) -> str | None:
    """Why ``module`` (itself, not its children) gives a sample different outputs run to run, or None."""
    if not module.training:
        return None
    if isinstance(module, _DROPOUT) and module.p > 0:
        return f"{type(module).__name__}(p={module.p}) in training mode"
    if isinstance(module, _BATCHNORM):
        return (
            f"{type(module).__name__} in training mode (batch statistics, e.g. Freezer(train_bn=True) keeps it "
            "training)"
        )
    if isinstance(module, nn.RReLU):
        return "RReLU in training mode (random slopes)"
    return None


def check_prefix_deterministic(
    blocks: Sequence[Block], depth: int, modules: Iterable[tuple[str, nn.Module]] | None = None
) -> None:
    """Refuse a prefix that would give a sample a different output each time (so a cached one would be wrong).

    Stochastic: Dropout (any ``_DropoutNd``) with ``p > 0`` in training mode; BatchNorm in training mode (batch
    statistics: the output depends on the other samples, and running statistics keep changing -- this is what
    ``train_bn=True`` does to frozen blocks); RReLU in training mode.

    Args:
        blocks: The model's blocks; ``blocks[:depth]`` is the prefix.
        depth: Number of frozen leading blocks.
        modules: ``(name, module)`` pairs the prefix actually runs, if known
            (:meth:`~layerfreeze.forward_split.ModelSplit.prefix_modules`); they include parameter-free modules between
            blocks, which the blocks alone do not. Defaults to the modules of ``blocks[:depth]``.

    Raises:
        CacheRefused: naming the first stochastic module (qualified name, type, why).
    """
    if modules is None:
        modules = [(name, m) for block in blocks[:depth] for name, m in block.modules]
    for prefix, module in modules:
        for sub_name, sub in module.named_modules():
            reason = _stochastic_reason(sub)
            if reason is not None:
                name = f"{prefix}.{sub_name}" if sub_name else prefix
                raise CacheRefused(
                    f"module {name!r} in the frozen prefix (depth {depth}) is {reason}: its output changes from "
                    "run to run, so it cannot be cached. Put it in eval mode, freeze with train_bn=False, or set "
                    "cache: off"
                )


# --------------------------------------------------------------------------------------------------------------
# Storage
# --------------------------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    """One cached state: in memory (``tensor``) or on disk (``shard``), stored trimmed, in the storage dtype."""

    tensor: torch.Tensor | None
    shard: str | None
    compute_dtype: torch.dtype
    nbytes: int
    pending: bool = False


def _key_str(key: tuple[int, int]) -> str:
    return f"{key[0]}:{key[1]}"


def _crc32(t: torch.Tensor) -> int:
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pad_dim0(t: torch.Tensor, length: int) -> torch.Tensor:
    if t.shape[0] == length:
        return t
    if t.shape[0] > length:
        raise ValueError(f"a cached state of length {t.shape[0]} does not fit the batch's padded length {length}")
    pad = t.new_zeros((length - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad], 0)


class ActivationCache:
    """Per-sample boundary states of a frozen prefix, keyed by ``(sample index, depth)``.

    Args:
        budget_bytes: Bytes of state kept in memory (host RAM). Entries that do not fit go to a write buffer that
            is written to disk as one safetensors shard once it holds ``shard_bytes`` (so memory use can exceed the
            budget by up to ``shard_bytes``). Sizes count tensor payload only (not the few hundred bytes of Python
            objects per entry).
        dtype: Storage dtype: None keeps the computed dtype; ``torch.float16`` or ``torch.bfloat16`` halves a
            float32 cache (values are rounded; :meth:`get_batch` casts back to the dtype they were computed in).
            Non-floating states are never cast.
        directory: Where shards go: a fresh sub-directory is created in it (in the system temp directory when
            None) at the first spill, and deleted by :meth:`close` or when the cache is garbage collected.
        shard_bytes: Write-buffer size that triggers a shard write (0: one shard per :meth:`put_batch` that
            spills).

    Attributes:
        depth: The boundary depth currently cached (0: none yet); see :meth:`advance`.
        hits / misses: Per-sample lookups at a depth that found / did not find an entry.
        corrupt_shards: Shard files found corrupt (size, SHA-256 or CRC-32 mismatch, unreadable) and dropped.

    Disk format: ``shard-000001.safetensors`` ... (tensor names ``"<index>:<depth>"``) and ``index.json``::

        {"version": 1, "shards": {"shard-000001.safetensors": {"size": 1234, "sha256": "...",
            "entries": {"12:3": {"crc32": 305419896, "shape": [7, 32], "dtype": "torch.float32"}}}}}

    Reading an entry checks the file size (every read), the shard's SHA-256 (the first read of a shard and after
    its size or modification time changes) and the entry's CRC-32 (every read). Not thread-safe.

    Raises (constructor):
        ValueError: negative sizes, or a dtype other than None, float16, bfloat16.
    """

    def __init__(
        self,
        budget_bytes: int = 2**30,
        dtype: torch.dtype | None = None,
        directory: str | os.PathLike[str] | None = None,
        *,
        shard_bytes: int = 64 * 2**20,
    ) -> None:
        if budget_bytes < 0 or shard_bytes < 0:
            raise ValueError(f"budget_bytes and shard_bytes must be >= 0, got {budget_bytes} and {shard_bytes}")
        if dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be None (keep), torch.float16 or torch.bfloat16, got {dtype}")
        self.budget_bytes = int(budget_bytes)
        self.dtype = dtype
        self.directory = None if directory is None else Path(directory)
        self.shard_bytes = int(shard_bytes)
        self.depth = 0
        self.hits = 0
        self.misses = 0
        self.corrupt_shards = 0
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._depths: dict[int, set[int]] = {}
        self._resident_bytes = 0
        self._pending: list[tuple[int, int]] = []
        self._pending_bytes = 0
        self._shards: dict[str, dict[str, Any]] = {}
        self._live: dict[str, set[tuple[int, int]]] = {}
        self._verified: dict[str, tuple[int, int, int]] = {}
        self._shard_counter = 0
        self._root: Path | None = None
        self._finalizer: weakref.finalize | None = None

    # ---- sizes ---------------------------------------------------------------------------------------------

    @property
    def memory_bytes(self) -> int:
        """Bytes of state held in memory (within the budget, plus the write buffer)."""
        return self._resident_bytes + self._pending_bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of the shard files on disk (a shard is deleted when its last entry is dropped)."""
        return sum(info["size"] for info in self._shards.values())

    @property
    def size_bytes(self) -> int:
        """Total bytes of the cache: :attr:`memory_bytes` + :attr:`disk_bytes`."""
        return self.memory_bytes + self.disk_bytes

    @property
    def path(self) -> Path | None:
        """The directory holding the shards and ``index.json`` (None until the first spill)."""
        return self._root

    def shard_paths(self) -> list[Path]:
        """The shard files on disk, oldest first."""
        return [self._root / name for name in self._shards] if self._root is not None else []

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return (int(key[0]), int(key[1])) in self._entries

    def depths(self, index: int) -> list[int]:
        """The depths cached for sample ``index``, shallowest first."""
        return sorted(self._depths.get(int(index), ()))

    def stats(self) -> dict[str, int]:
        """Counters and sizes (bytes) for logs."""
        return {
            "depth": self.depth, "entries": len(self), "hits": self.hits, "misses": self.misses,
            "corrupt_shards": self.corrupt_shards, "memory_bytes": self.memory_bytes,
            "disk_bytes": self.disk_bytes, "size_bytes": self.size_bytes, "shards": len(self._shards),
        }

    # ---- writing -------------------------------------------------------------------------------------------

    def put(self, index: int, depth: int, state: torch.Tensor, length: int | None = None) -> None:
        """Store one sample's state (no batch dimension), cut to ``state[:length]`` when ``length`` is given.

        Entries of the same sample at shallower depths are dropped: a deeper entry supersedes them (this is how an
        upgraded entry replaces the old-depth one).
        """
        self._put(int(index), int(depth), state, length)
        self._maybe_flush()

    def put_batch(
        self, indices: Sequence[int] | torch.Tensor, depth: int, states: torch.Tensor,
        lengths: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        """Store ``states[i]`` (``(B, ...)``) for each sample ``indices[i]``; ``lengths[i]`` cuts dimension 1.

        Raises:
            ValueError: ``indices``/``lengths`` and ``states`` disagree on the batch size.
        """
        indices = [int(i) for i in (indices.tolist() if isinstance(indices, torch.Tensor) else indices)]
        if len(indices) != states.shape[0]:
            raise ValueError(f"{len(indices)} indices for states of batch {states.shape[0]}")
        if lengths is not None:
            lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
            if len(lengths) != len(indices):
                raise ValueError(f"{len(lengths)} lengths for {len(indices)} samples")
        states = states.detach()
        for i, index in enumerate(indices):
            self._put(index, int(depth), states[i], None if lengths is None else lengths[i])
        self._maybe_flush()

    def _put(self, index: int, depth: int, state: torch.Tensor, length: int | None) -> None:
        if length is not None:
            state = state[:length]
        compute_dtype = state.dtype
        store_dtype = self.dtype if self.dtype is not None and state.is_floating_point() else state.dtype
        tensor = state.detach().to(device="cpu", dtype=store_dtype, copy=True).contiguous()
        for d in list(self._depths.get(index, ())):
            if d <= depth:
                self.drop(index, d)
        nbytes = _nbytes(tensor)
        entry = _Entry(tensor, None, compute_dtype, nbytes)
        if self._resident_bytes + nbytes <= self.budget_bytes:
            self._resident_bytes += nbytes
        else:
            entry.pending = True
            self._pending.append((index, depth))
            self._pending_bytes += nbytes
        self._entries[(index, depth)] = entry
        self._depths.setdefault(index, set()).add(depth)

    def _maybe_flush(self) -> None:
        if self._pending and self._pending_bytes >= self.shard_bytes:
            self.flush()

    def _ensure_root(self) -> Path:
        if self._root is None:
            if self.directory is not None:
                self.directory.mkdir(parents=True, exist_ok=True)
            self._root = Path(tempfile.mkdtemp(prefix="layerfreeze-cache-", dir=self.directory))
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(self._root), True)
        return self._root

    def flush(self) -> Path | None:
        """Write the write buffer to disk as one shard (and update ``index.json``).

        Returns:
            The shard's path, or None when the buffer was empty.
        """
        keys = [k for k in dict.fromkeys(self._pending) if k in self._entries and self._entries[k].pending]
        self._pending, self._pending_bytes = [], 0
        if not keys:
            return None
        from safetensors.torch import save

        root = self._ensure_root()
        self._shard_counter += 1
        name = f"shard-{self._shard_counter:06d}.safetensors"
        tensors = {_key_str(k): self._entries[k].tensor for k in keys}
        data = save(tensors, metadata={"format": "layerfreeze-activation-cache", "version": str(INDEX_VERSION)})
        tmp = root / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, root / name)
        entries = {}
        for key, t in tensors.items():
            entries[key] = {"crc32": _crc32(t), "shape": list(t.shape), "dtype": str(t.dtype)}
        self._shards[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "entries": entries}
        self._live[name] = set(keys)
        for k in keys:
            entry = self._entries[k]
            entry.tensor, entry.shard, entry.pending = None, name, False
        self._write_index()
        return root / name

    def _write_index(self) -> None:
        if self._root is None:
            return
        index = {"version": INDEX_VERSION, "dtype": str(self.dtype), "shards": self._shards}
        tmp = self._root / f".{INDEX_FILE}.tmp"
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, self._root / INDEX_FILE)

    # ---- dropping ------------------------------------------------------------------------------------------

    def drop(self, index: int, depth: int) -> bool:
        """Forget one entry (deleting its shard file once no live entry is left in it). True if it existed."""
        key = (int(index), int(depth))
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        depths = self._depths.get(key[0])
        if depths is not None:
            depths.discard(key[1])
            if not depths:
                del self._depths[key[0]]
        if entry.shard is not None:
            live = self._live.get(entry.shard)
            if live is not None:
                live.discard(key)
                if not live:
                    self._remove_shard(entry.shard)
                    self._write_index()
        elif entry.pending:
            self._pending_bytes -= entry.nbytes
        else:
            self._resident_bytes -= entry.nbytes
        return True

    def drop_deeper_than(self, depth: int) -> int:
        """Forget every entry at a depth greater than ``depth``; returns how many."""
        stale = [k for k in self._entries if k[1] > depth]
        for k in stale:
            self.drop(*k)
        return len(stale)

    def _remove_shard(self, name: str) -> None:
        self._shards.pop(name, None)
        self._live.pop(name, None)
        self._verified.pop(name, None)
        if self._root is not None:
            try:
                (self._root / name).unlink()
            except FileNotFoundError:
                pass

    def advance(self, new_depth: int) -> None:
        """Move the cached boundary to ``new_depth``.

        Deeper (more blocks frozen): entries at older depths stay and are upgraded lazily -- a later request at the
        new depth for a sample cached at an old depth extends the old state through the newly frozen blocks
        (:class:`CachedPrefix`), and the old entry is dropped once the new one is stored.
        Shallower (a block was thawed): entries deeper than ``new_depth`` went through a block that trains again,
        so they are dropped.
        """
        if new_depth < 0:
            raise ValueError(f"depth must be >= 0, got {new_depth}")
        if new_depth < self.depth:
            self.drop_deeper_than(new_depth)
        self.depth = int(new_depth)

    def clear(self) -> None:
        """Forget every entry and delete the shard files (counters are kept)."""
        for name in list(self._shards):
            self._remove_shard(name)
        self._entries.clear()
        self._depths.clear()
        self._pending, self._pending_bytes, self._resident_bytes = [], 0, 0
        self._write_index()

    def close(self) -> None:
        """Forget everything and delete the cache's directory."""
        self.clear()
        if self._finalizer is not None:
            self._finalizer()
        self._root = None

    # ---- reading -------------------------------------------------------------------------------------------

    def lookup(
        self, indices: Sequence[int] | torch.Tensor, depth: int, count: bool = True
    ) -> list[torch.Tensor | None]:
        """Per sample: its state at ``depth`` (CPU, trimmed, in the dtype it was computed in), or None.

        Disk entries are verified (see the class docstring); a corrupt shard's entries come back as None.

        Args:
            count: Count the lookups in :attr:`hits` / :attr:`misses`.
        """
        indices = [int(i) for i in (indices.tolist() if isinstance(indices, torch.Tensor) else indices)]
        out: list[torch.Tensor | None] = [None] * len(indices)
        on_disk: dict[str, list[int]] = {}
        for pos, index in enumerate(indices):
            entry = self._entries.get((index, depth))
            if entry is None:
                continue
            if entry.tensor is not None:
                out[pos] = entry.tensor
            else:
                on_disk.setdefault(entry.shard, []).append(pos)
        for name, positions in on_disk.items():
            read = self._read_shard(name, [(indices[p], depth) for p in positions])
            if read is not None:
                for p, t in zip(positions, read):
                    out[p] = t
        for pos, index in enumerate(indices):
            t = out[pos]
            if t is not None:
                compute_dtype = self._entries[(index, depth)].compute_dtype
                out[pos] = t.to(compute_dtype) if t.dtype != compute_dtype else t
        if count:
            found = sum(t is not None for t in out)
            self.hits += found
            self.misses += len(out) - found
        return out

    def get_batch(
        self, indices: Sequence[int] | torch.Tensor, depth: int, *, pad_to: int | None = None,
        device: torch.device | str | None = None, count: bool = True,
    ) -> torch.Tensor | None:
        """The states of ``indices`` at ``depth`` as one ``(B, ...)`` tensor, or None unless all are cached.

        Trimmed states are padded back with zeros along their first dimension (the batch's dimension 1) to
        ``pad_to``, or to the longest one when their lengths differ. Cast back to the dtype they were computed in.
        """
        states = self.lookup(indices, depth, count=count)
        if any(t is None for t in states):
            return None
        if not states:
            return None
        if pad_to is None and len({t.shape for t in states}) > 1:
            pad_to = max(t.shape[0] for t in states)
        if pad_to is not None:
            states = [_pad_dim0(t, pad_to) for t in states]
        batch = torch.stack(states)  # type: ignore[arg-type]
        return batch if device is None else batch.to(device)

    def _read_shard(self, name: str, keys: list[tuple[int, int]]) -> list[torch.Tensor] | None:
        """The entries ``keys`` of shard ``name``, verified; None (and the shard dropped) if it is corrupt."""
        from safetensors import safe_open

        path = self._root / name  # type: ignore[operator]
        info = self._shards[name]
        try:
            st = path.stat()
        except FileNotFoundError:
            return self._corrupt(name, "the file is missing")
        if st.st_size != info["size"]:
            return self._corrupt(name, f"size {st.st_size} bytes, the index says {info['size']}")
        stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        if self._verified.get(name) != stamp:
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(chunk)
            if digest.hexdigest() != info["sha256"]:
                return self._corrupt(name, "SHA-256 mismatch")
            self._verified[name] = stamp
        out: list[torch.Tensor] = []
        problem = None
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in keys:
                    meta = info["entries"][_key_str(key)]
                    t = f.get_tensor(_key_str(key))
                    if list(t.shape) != meta["shape"] or str(t.dtype) != meta["dtype"] or _crc32(t) != meta["crc32"]:
                        problem = f"entry {_key_str(key)} does not match its CRC-32, shape or dtype"
                        break
                    out.append(t)
        except Exception as exc:  # a damaged header or data: safetensors raises its own error types
            problem = f"unreadable ({type(exc).__name__}: {exc})"
        return out if problem is None else self._corrupt(name, problem)

    def _corrupt(self, name: str, reason: str) -> None:
        keys = list(self._live.get(name, ()))
        for key in keys:
            self._entries.pop(key, None)
            depths = self._depths.get(key[0])
            if depths is not None:
                depths.discard(key[1])
                if not depths:
                    del self._depths[key[0]]
        path = self._root / name if self._root is not None else name
        self._remove_shard(name)
        self._write_index()
        self.corrupt_shards += 1
        warnings.warn(
            f"activation cache shard {path} is corrupt ({reason}); its {len(keys)} entries were dropped and will "
            "be recomputed",
            RuntimeWarning,
            stacklevel=4,
        )
        return None

    def __repr__(self) -> str:
        return (
            f"ActivationCache(depth={self.depth}, entries={len(self)}, size={self.size_bytes:,} bytes, "
            f"hits={self.hits}, misses={self.misses})"
        )


# --------------------------------------------------------------------------------------------------------------
# The cached forward
# --------------------------------------------------------------------------------------------------------------


def _select(batch: dict[str, Any], positions: list[int], size: int) -> dict[str, Any]:
    """The sub-batch of rows ``positions`` (tensors whose first dimension is the batch; others as they are)."""
    if positions == list(range(size)):
        return batch
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.ndim > 0 and v.shape[0] == size:
            out[k] = v[torch.tensor(positions, device=v.device)]
        else:
            out[k] = v
    return out


def _signature(block: Block) -> tuple[tuple[int, int], ...]:
    """``(id, version)`` of the block's parameters and buffers (those held outside its modules, such as a class
    token, included): changes when any is modified in place or replaced."""
    tensors = [t for _, module in block.modules for t in (*module.parameters(), *module.buffers())]
    return tuple((id(t), t._version) for t in (*tensors, *(p for _, p in block.params)))


class CachedPrefix:
    """The model's forward with the frozen prefix's output read from an :class:`ActivationCache`.

    Args:
        model: The model being trained.
        blocks: Its blocks (the Freezer's ``blocks``).
        split: How its forward splits (default :func:`~layerfreeze.forward_split.split_for`).
        cache: The storage (default: an :class:`ActivationCache` with its defaults).
        freezer: The :class:`~layerfreeze.engine.Freezer`, if any: its ``frozen_prefix`` is the default depth, a
            depth beyond it is refused, and frozen prefix blocks are put in eval mode before the check exactly as
            the Freezer's forward pre-hook does (on a hit the prefix does not run, so the hook would not).
        fallback: On a refusal (stochastic prefix, changed inputs), warn once, turn the cache off for good and run
            the full forward, instead of raising :class:`CacheRefused`.

    Counters (samples unless said): ``prefix_samples`` (computed from the input), ``extend_samples`` (carried from
    an older boundary), ``full_forwards`` (calls that ran the model's own forward: depth 0 or cache off),
    ``invalidations`` (entries dropped because a prefix block's weights changed); the cache has ``hits`` /
    ``misses``.
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[Block],
        split: ModelSplit | None = None,
        cache: ActivationCache | None = None,
        *,
        freezer: Any = None,
        fallback: bool = False,
    ) -> None:
        self.model = model
        self.blocks = list(blocks)
        self.split = split if split is not None else split_for(model, self.blocks)
        self.cache = cache if cache is not None else ActivationCache()
        self.freezer = freezer
        self.fallback = fallback
        self.disabled: str | None = None
        self.prefix_samples = 0
        self.extend_samples = 0
        self.full_forwards = 0
        self.invalidations = 0
        self._fingerprints: dict[int, torch.Tensor] = {}
        self._signatures: dict[int, tuple[tuple[int, int], ...]] = {}

    def __call__(self, batch: dict[str, Any], depth: int | None = None) -> torch.Tensor:
        return self.forward(batch, depth)

    def forward(self, batch: dict[str, Any], depth: int | None = None) -> torch.Tensor:
        """Logits ``(B, num_classes)`` for ``batch``, with blocks ``0..depth-1`` served from the cache.

        Args:
            batch: A collated batch with ``"index"`` (``(B,)`` sample positions) and the model inputs.
            depth: Frozen prefix length; default ``freezer.frozen_prefix``. Depth 0 runs the full forward.

        Raises:
            CacheRefused: a stochastic prefix module, a trainable prefix parameter, or a sample whose inputs
                changed since it was cached (unless ``fallback``).
            ValueError: no ``depth`` and no freezer; ``depth`` beyond the freezer's frozen prefix; no ``"index"``.
        """
        if depth is None:
            if self.freezer is None:
                raise ValueError("CachedPrefix.forward needs a depth when it has no freezer")
            depth = self.freezer.frozen_prefix
        depth = min(int(depth), self.split.max_depth)
        if depth == 0 or self.disabled is not None:
            self.full_forwards += 1
            return self.split.full(self.model, batch)
        if "index" not in batch:
            raise ValueError("the batch has no 'index' (sample positions); the activation cache is keyed by it")
        try:
            self._check_prefix(depth)
            self._check_weights(depth)
            if self.cache.depth != depth:
                self.cache.advance(depth)
            indices = [int(i) for i in batch["index"].tolist()]
            self._check_inputs(indices, batch)
        except CacheRefused as exc:
            if not self.fallback:
                raise
            self._turn_off(str(exc))
            self.full_forwards += 1
            return self.split.full(self.model, batch)
        state = self._states(batch, indices, depth)
        return self.split.suffix(self.model, state, batch, depth)

    # ---- checks --------------------------------------------------------------------------------------------

    def _check_prefix(self, depth: int) -> None:
        if self.freezer is not None:
            from .engine import set_eval_mode

            if self.freezer.frozen_prefix < depth:
                raise ValueError(
                    f"depth {depth} is beyond the frozen prefix ({self.freezer.frozen_prefix} blocks): a trainable "
                    "block's output cannot be cached"
                )
            for block in self.blocks[:depth]:
                for _, module in block.modules:
                    if module.training:  # what Freezer's forward pre-hook does before the block runs
                        set_eval_mode(module, self.freezer.train_bn)
        modules = self.split.prefix_modules(self.model, depth)
        try:
            check_prefix_deterministic(self.blocks, depth, modules)
        except CacheRefused as exc:
            hint = "" if self.freezer is not None else (
                " (if a Freezer froze these blocks, pass freezer= to CachedPrefix: it puts them in eval mode)"
            )
            raise CacheRefused(f"{exc}{hint}") from None
        named = [(f"{name}.{pname}", p) for name, module in modules for pname, p in module.named_parameters()]
        named += [item for block in self.blocks[:depth] for item in block.params]  # a class token, ...
        for name, p in named:
            if p.requires_grad:
                raise CacheRefused(
                    f"parameter '{name}' in the cached prefix (depth {depth}) requires grad: it trains, "
                    "so its block's output changes every step. Cache only a frozen prefix"
                )

    def _check_weights(self, depth: int) -> None:
        """Drop entries computed through a prefix block whose parameters or buffers changed since."""
        for block in self.blocks[:depth]:
            sig = _signature(block)
            old = self._signatures.get(block.index)
            if old is not None and old != sig:
                self.invalidations += self.cache.drop_deeper_than(block.index)
            self._signatures[block.index] = sig

    def _check_inputs(self, indices: list[int], batch: dict[str, Any]) -> None:
        prints = self.split.fingerprint(batch).detach().cpu()
        for pos, index in enumerate(indices):
            old = self._fingerprints.get(index)
            if old is not None and not torch.allclose(old, prints[pos], rtol=1e-9, atol=1e-9):
                raise CacheRefused(
                    f"the inputs of sample {index} changed since its prefix output was cached: {_AUGMENTATION}"
                )
        for pos, index in enumerate(indices):
            self._fingerprints[index] = prints[pos]

    def _turn_off(self, reason: str) -> None:
        self.disabled = reason
        self.cache.clear()
        warnings.warn(f"activation cache turned off, running the full forward from now on: {reason}",
                      RuntimeWarning, stacklevel=3)

    # ---- states --------------------------------------------------------------------------------------------

    def _states(self, batch: dict[str, Any], indices: list[int], depth: int) -> torch.Tensor:
        """The boundary states ``(B, ...)`` of the batch: hits from the cache, misses computed and stored."""
        size = len(indices)
        device = batch["index"].device
        pad_to = self.split.padded_length(batch, depth)
        found = self.cache.lookup(indices, depth)
        miss = [p for p, t in enumerate(found) if t is None]
        hit = [p for p, t in enumerate(found) if t is not None]
        hit_states = None
        if hit:
            rows = [found[p] for p in hit]
            if pad_to is not None:
                rows = [_pad_dim0(t, pad_to) for t in rows]  # type: ignore[arg-type]
            hit_states = torch.stack(rows).to(device)  # type: ignore[arg-type]
            if not miss:
                return hit_states
        # Misses: group by the deepest older boundary cached for the sample (0: none, run the whole prefix).
        groups: dict[int, list[int]] = {}
        for p in miss:
            older = [d for d in self.cache.depths(indices[p]) if d < depth]
            groups.setdefault(max(older, default=0), []).append(p)
        computed: list[tuple[list[int], torch.Tensor]] = []
        for start, positions in sorted(groups.items()):
            sub = _select(batch, positions, size)
            sub_indices = [indices[p] for p in positions]
            old = None
            if start > 0:
                old = self.cache.get_batch(sub_indices, start, pad_to=self.split.padded_length(sub, start),
                                           device=device, count=False)
            if old is not None:
                states = self.split.extend(self.model, old, sub, start, depth)
                self.extend_samples += len(positions)
            else:  # no older entry (or it was lost to a corrupt shard just now)
                states = self.split.prefix(self.model, sub, depth)
                self.prefix_samples += len(positions)
            self.cache.put_batch(sub_indices, depth, states, self.split.lengths(sub, depth))
            computed.append((positions, states))
        if hit_states is None and len(computed) == 1:
            return computed[0][1]
        first = computed[0][1]
        state = torch.empty((size, *first.shape[1:]), dtype=first.dtype, device=first.device)
        if hit_states is not None:
            state[torch.tensor(hit, device=state.device)] = hit_states.to(state.dtype)
        for positions, states in computed:
            state[torch.tensor(positions, device=state.device)] = states
        return state

    def stats(self) -> dict[str, Any]:
        """Counters (samples) and cache sizes (bytes), for logs."""
        return {
            **self.cache.stats(),
            "prefix_samples": self.prefix_samples,
            "extend_samples": self.extend_samples,
            "full_forwards": self.full_forwards,
            "invalidations": self.invalidations,
            "disabled": self.disabled,
        }
