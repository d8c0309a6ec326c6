"""A checksummed per-sample tensor store: memory up to a budget, then safetensors shards on disk.

Used for the frozen prefix's boundary states (:class:`~layerfreeze.compute.cache.CachedPrefix`) and for the outputs of
frozen models computed once (:func:`~layerfreeze.compute.precomputed.precompute`). Entries are keyed by ``(sample index,
key)`` -- the key is the boundary depth for the prefix cache, any fixed integer for precomputed outputs. Entries are
held in host memory up to a budget, then written as safetensors shards with a JSON index of sizes, SHA-256 and per-entry
CRC-32 checksums; a shard that does not match them is dropped with a warning and its entries read as missing (never
returned). Optionally stored in float16/bfloat16; variable-length states stored trimmed to their true length.

The disk files are scratch: deleted by :meth:`ActivationCache.close` or when the store is garbage collected.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from layerfreeze.runs.ledger_buckets import DISK, Bucket

__all__ = ["ActivationCache", "pad_dim0"]

INDEX_FILE = "index.json"
#: The name a cache's own folder starts with, in its ``directory`` (what :func:`remove_stale_folders` removes).
FOLDER_PREFIX = "layerfreeze-cache-"
INDEX_VERSION = 1

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


def pad_dim0(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` (``(n, ...)``, ``n <= length``) padded with zeros along dimension 0 to ``(length, ...)``.

    Raises:
        ValueError: ``n > length`` (the state does not fit the batch's padded length).
    """
    if t.shape[0] == length:
        return t
    if t.shape[0] > length:
        raise ValueError(f"a cached state of length {t.shape[0]} does not fit the batch's padded length {length}")
    pad = t.new_zeros((length - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad], 0)


#: Share of the host memory available at a cache's creation that an automatic budget takes (auto_budget_bytes).
AUTO_BUDGET_FRACTION = 0.25


def auto_budget_bytes(fraction: float = AUTO_BUDGET_FRACTION) -> int:
    """A memory budget for a cache: ``fraction`` of the host memory available now, in bytes.

    The cache keeps its entries in host RAM whatever device trains (states are moved to the device per batch), so
    host memory is what bounds it; what does not fit spills to checksummed shards on disk. Available memory
    (``psutil.virtual_memory().available``: free plus reclaimable page cache) rather than total, so a machine that
    is already busy gets a smaller cache instead of swapping.

    Raises:
        ValueError: ``fraction`` not in (0, 1].
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return int(psutil.virtual_memory().available * fraction)


def remove_stale_folders(directory: str | os.PathLike[str]) -> int:
    """Delete the cache folders left in ``directory`` by processes that ended without closing their cache (a
    SIGKILL, a crash): a cache is never read by another process, so they only take disk space. Call it before this
    process's cache makes its own folder there; only folders named as caches make theirs are touched.

    Returns:
        The bytes freed.
    """
    freed = 0
    for stale in Path(directory).glob(f"{FOLDER_PREFIX}*"):
        if stale.is_dir() and not stale.is_symlink():
            freed += sum(f.stat().st_size for f in stale.rglob("*") if f.is_file() and not f.is_symlink())
            shutil.rmtree(stale, ignore_errors=True)
    return freed


class CacheWriteError(OSError):
    """The activation cache could not write to its folder (a full disk, a quota, a folder that went read-only); the
    entries that were to be written stay in memory, and the message says what to do (:attr:`reason`: what happened,
    without the advice). A prefix cache with ``fallback`` turns itself off on it
    (:class:`~layerfreeze.compute.cached_prefix.CachedPrefix`)."""

    reason: str = ""


class ActivationCache:
    """Per-sample tensors keyed by ``(sample index, depth)``: a frozen prefix's boundary states, precomputed outputs.

    Args:
        budget_bytes: Bytes of state kept in memory (host RAM), the write buffer included; None (default):
            :func:`auto_budget_bytes`, a quarter of the host memory available at construction. Entries beyond
            ``budget_bytes`` minus the write buffer go to the write buffer, which is written to disk as one
            safetensors shard once it holds ``min(shard_bytes, budget_bytes // 4)`` (so memory use stays within the
            budget, give or take one :meth:`put_batch`'s states). Sizes count tensor payload only (not the few
            hundred bytes of Python objects per entry).
        dtype: Storage dtype: None keeps the computed dtype; ``torch.float16`` or ``torch.bfloat16`` halves a
            float32 cache (values are rounded; :meth:`get_batch` casts back to the dtype they were computed in).
            Non-floating states are never cast.
        directory: Where shards go: a fresh sub-directory is created in it (in the system temp directory when
            None) at the first spill, and deleted by :meth:`close` or when the cache is garbage collected.
        shard_bytes: Write-buffer size that triggers a shard write, at most a quarter of the budget (0: one shard
            per :meth:`put_batch` that spills).

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
        budget_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        directory: str | os.PathLike[str] | None = None,
        *,
        shard_bytes: int = 64 * 2**20,
    ) -> None:
        if budget_bytes is None:
            budget_bytes = auto_budget_bytes()
        if budget_bytes < 0 or shard_bytes < 0:
            raise ValueError(f"budget_bytes and shard_bytes must be >= 0, got {budget_bytes} and {shard_bytes}")
        if dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be None (keep), torch.float16 or torch.bfloat16, got {dtype}")
        self.budget_bytes = int(budget_bytes)
        self.dtype = dtype
        self.directory = None if directory is None else Path(directory)
        self.shard_bytes = int(shard_bytes)
        # the write buffer is part of the budget: a budget of 1 MiB held up to 65 MiB with the default buffer
        self._buffer_bytes = min(self.shard_bytes, self.budget_bytes // 4)
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
        #: ``(index, depth) -> (input names, (len(names), 2) float64)``: the fingerprints of the inputs an entry was
        #: computed from, where its writer gave them (:func:`~layerfreeze.compute.precomputed.precompute`); a reader
        #: checks a sample's inputs against them (:class:`~layerfreeze.compute.precomputed.PrecomputedDataset`).
        self.input_fingerprints: dict[tuple[int, int], tuple[tuple[str, ...], torch.Tensor]] = {}

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

    def indices(self) -> list[int]:
        """The sample indices that have at least one entry."""
        return list(self._depths)

    def depths(self, index: int) -> list[int]:
        """The depths cached for sample ``index``, shallowest first."""
        return sorted(self._depths.get(int(index), ()))

    def ledger_bytes(self) -> dict[str, dict[str, int]]:
        """What the cache holds, for the memory ledger (:class:`~layerfreeze.runs.ledger.MemoryLedger`'s byte-source
        protocol): ``{"cache_memory": {"cpu": memory_bytes}, "cache_disk": {"disk": disk_bytes}}`` (entries are kept
        in host memory whatever device trains; sizes as :attr:`memory_bytes` and :attr:`disk_bytes`)."""
        return {Bucket.CACHE_MEMORY: {"cpu": self.memory_bytes}, Bucket.CACHE_DISK: {DISK: self.disk_bytes}}

    def stats(self) -> dict[str, int]:
        """Counters and sizes (bytes) for logs."""
        return {
            "depth": self.depth, "entries": len(self), "hits": self.hits, "misses": self.misses,
            "budget_bytes": self.budget_bytes,
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
        states = states.detach().to("cpu")  # one copy to the host for the batch (each row's would synchronise)
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
        if self._resident_bytes + nbytes <= self.budget_bytes - self._buffer_bytes:
            self._resident_bytes += nbytes
        else:
            entry.pending = True
            self._pending.append((index, depth))
            self._pending_bytes += nbytes
        self._entries[(index, depth)] = entry
        self._depths.setdefault(index, set()).add(depth)

    def _maybe_flush(self) -> None:
        if self._pending and self._pending_bytes >= self._buffer_bytes:
            self.flush()

    def _ensure_root(self) -> Path:
        if self._root is None:
            if self.directory is not None:
                self.directory.mkdir(parents=True, exist_ok=True)
            self._root = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=self.directory))
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(self._root), True)
        elif not self._root.is_dir():  # deleted during the run (a temp-folder cleaner, by hand)
            self._root.mkdir(parents=True)
            warnings.warn(f"the activation cache's folder {self._root} was deleted during the run and was made again; "
                          "the entries its shards held are read as missing (computed again by a prefix cache)",
                          RuntimeWarning, stacklevel=4)
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
        try:
            tmp.write_bytes(data)
            os.replace(tmp, root / name)
        except OSError as exc:  # the entries stay in memory, in the write buffer, as they were
            tmp.unlink(missing_ok=True)
            self._pending = keys
            self._pending_bytes = sum(self._entries[k].nbytes for k in keys)
            raise self._write_error(exc) from exc
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
        self._ensure_root()
        index = {"version": INDEX_VERSION, "dtype": str(self.dtype), "shards": self._shards}
        tmp = self._root / f".{INDEX_FILE}.tmp"
        try:
            tmp.write_text(json.dumps(index, indent=1))
            os.replace(tmp, self._root / INDEX_FILE)
        except OSError as exc:  # index.json describes the shards for people; what is in memory is already right
            tmp.unlink(missing_ok=True)
            raise self._write_error(exc) from exc

    def _write_error(self, exc: OSError) -> CacheWriteError:
        reason = f"the activation cache could not write to {self._root}: {exc.strerror or exc}"
        error = CacheWriteError(
            exc.errno, f"{reason}. Free space there, or give the cache more memory (freeze.cache.budget_mb; "
            "ActivationCache(budget_bytes=...)) or another directory, or let it turn itself off (freeze.cache.mode "
            "auto; CachedPrefix(fallback=True))")
        error.reason = reason
        return error

    # ---- dropping ------------------------------------------------------------------------------------------

    def drop(self, index: int, depth: int) -> bool:
        """Forget one entry (deleting its shard file once no live entry is left in it). True if it existed."""
        key = (int(index), int(depth))
        entry = self._entries.pop(key, None)
        self.input_fingerprints.pop(key, None)
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
        self.input_fingerprints.clear()
        self._pending, self._pending_bytes, self._resident_bytes = [], 0, 0
        self._write_index()

    def close(self) -> None:
        """Forget everything and delete the cache's directory."""
        try:
            self.clear()
        except CacheWriteError:  # the empty index.json could not be written: the folder goes anyway
            pass
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
            states = [pad_dim0(t, pad_to) for t in states]
        batch = torch.stack(states)  # type: ignore[arg-type]
        return batch if device is None else batch.to(device, non_blocking=True)  # a blocking copy would sync a GPU

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
            f"activation cache shard {path} is corrupt ({reason}); its {len(keys)} entries were dropped (a prefix "
            "cache computes them again; outputs stored by precompute() must be precomputed again)",
            RuntimeWarning,
            stacklevel=4,
        )
        return None

    def __repr__(self) -> str:
        return (
            f"ActivationCache(depth={self.depth}, entries={len(self)}, size={self.size_bytes:,} bytes, "
            f"hits={self.hits}, misses={self.misses})"
        )
