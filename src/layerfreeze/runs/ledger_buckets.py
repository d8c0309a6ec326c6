"""The memory ledger's buckets: their names, labels and order, the device name of bytes on disk, and what a byte
source reports. The ledger (:class:`~layerfreeze.runs.ledger.MemoryLedger`) counts a training step's memory in the
buckets PyTorch's memory snapshot and DeepSpeed's memory estimators talk about:

==================== ===================================================================================================
bucket               what it counts (bytes of tensor storage, each storage once)
==================== ===================================================================================================
``params_trainable`` the model's parameters that require grad (also split by dtype: ``params_dtype``)
``params_frozen``    the model's parameters that do not
``buffers``          the model's buffers (BatchNorm running statistics, position ids, ...)
``grads``            the parameters' ``.grad`` tensors
``optimizer``        every tensor in ``optimizer.state`` (Adam/AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``)
``activations``      tensors autograd saved for backward during the forward (through
                     :class:`torch.autograd.graph.saved_tensors_hooks`), parameters and buffers left out
``cache_memory``     the frozen-prefix activation cache in host memory (a byte source, see below)
``cache_disk``       the cache's shards on disk (device ``"disk"``: not memory, never in the tensor total)
``side_models``      frozen models beside the trained one (``FrozenModule``, ``FrozenDifferentiable``)
``params_master``    float32 master copies of demoted frozen blocks (host memory, or ``"disk"``; a byte source:
                     :class:`~layerfreeze.engine.demote.Demoter`)
``params_offloaded`` frozen blocks' parameters moved off the training device (host memory; the same byte source)
``strategy``         what the freezing strategy itself holds (recorder buffers, copies, reference models; a byte
                     source: :meth:`~layerfreeze.strategies.base.Strategy.ledger_bytes`)
``autocast_casts``   under autocast (``train.precision`` bf16-mixed / 16-mixed): the compute-dtype copies of trainable
                     weights that autocast caches for the forward and the backward holds (saved tensors whose
                     ``grad_fn`` casts a parameter), counted apart from ``activations``
==================== ===================================================================================================

plus, beside them, the CUDA caching allocator's figures and the process's resident set size
(:class:`~layerfreeze.runs.ledger_records.LedgerSnapshot`). ``params``, ``grads``, ``optimizer`` and ``activations``
are also counted per block (:data:`BLOCK_BUCKETS`). How each bucket is counted:
:mod:`~layerfreeze.runs.ledger_counting`; when in a step it is read: :mod:`~layerfreeze.runs.ledger`.

**Byte sources.** Objects that hold memory the ledger cannot find from the model and the optimizer report it
themselves (:class:`ByteSource`): ``{bucket: bytes}`` or ``{bucket: {device: bytes}}`` (:data:`DISK` for bytes on
disk); a source's own bucket names are kept as they are, after the ones above (:func:`_bucket_order`).

**Stability.** The bucket names (:class:`Bucket`) are what the trainer writes and what tables, the report and a memory
planner read: buckets may be added, none changes its meaning.

Imports nothing of layerfreeze: every module that reports or reads bytes per bucket may import it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Protocol

__all__ = [
    "BLOCK_BUCKETS",
    "BUCKET_LABELS",
    "DISK",
    "MODEL_BUCKETS",
    "Bucket",
    "ByteSource",
    "bucket_label",
]


class Bucket(enum.StrEnum):
    """The ledger's buckets (see the module docstring); byte sources may add buckets of their own names."""

    PARAMS_TRAINABLE = "params_trainable"
    PARAMS_FROZEN = "params_frozen"
    BUFFERS = "buffers"
    GRADS = "grads"
    OPTIMIZER = "optimizer"
    ACTIVATIONS = "activations"
    CACHE_MEMORY = "cache_memory"
    CACHE_DISK = "cache_disk"
    SIDE_MODELS = "side_models"
    PARAMS_MASTER = "params_master"
    PARAMS_OFFLOADED = "params_offloaded"
    STRATEGY = "strategy"
    AUTOCAST = "autocast_casts"


#: What each bucket is called in tables and plots.
BUCKET_LABELS: dict[str, str] = {
    Bucket.PARAMS_TRAINABLE: "parameters, trainable",
    Bucket.PARAMS_FROZEN: "parameters, frozen",
    Bucket.BUFFERS: "buffers",
    Bucket.GRADS: "gradients",
    Bucket.OPTIMIZER: "optimizer state",
    Bucket.ACTIVATIONS: "saved activations",
    Bucket.CACHE_MEMORY: "activation cache (memory)",
    Bucket.CACHE_DISK: "activation cache (disk)",
    Bucket.SIDE_MODELS: "frozen side models",
    Bucket.PARAMS_MASTER: "master copies (demoted)",
    Bucket.PARAMS_OFFLOADED: "parameters, offloaded",
    Bucket.STRATEGY: "freezing strategy",
    Bucket.AUTOCAST: "autocast weight casts",
}


def bucket_label(bucket: str) -> str:
    """A bucket's name for people (:data:`BUCKET_LABELS`; a byte source's own bucket keeps its name)."""
    return BUCKET_LABELS.get(bucket, bucket)


#: The buckets counted per block (``params`` = trainable + frozen parameters of the block).
BLOCK_BUCKETS = ("params", "grads", "optimizer", "activations")

#: The device name of bytes on disk: reported, never part of a tensor total.
DISK = "disk"

#: The model's own buckets, in the order tables show them (byte sources' buckets follow).
MODEL_BUCKETS = (Bucket.PARAMS_TRAINABLE, Bucket.PARAMS_FROZEN, Bucket.BUFFERS, Bucket.GRADS, Bucket.OPTIMIZER,
                 Bucket.ACTIVATIONS)


class ByteSource(Protocol):
    """What the ledger asks of an object that holds memory: its bytes per bucket (and, optionally, per device).

    ``ledger_bytes()`` returns ``{bucket: bytes}`` or ``{bucket: {device: bytes}}``, bytes as non-negative ints,
    devices as ``str(torch.device)`` (``"cpu"``, ``"cuda:1"``) or :data:`DISK`. Optionally ``ledger_tensors()``
    returns the tensors it holds (never counted as saved activations).
    """

    def ledger_bytes(self) -> Mapping[str, int | Mapping[str, int]]:
        ...


def _bucket_order(names: Iterable[str]) -> list[str]:
    """The model's buckets first in :data:`MODEL_BUCKETS` order, then the cache's, then others by name."""
    rank = {b.value: i for i, b in enumerate(Bucket)}
    return sorted(set(names), key=lambda b: (rank.get(b, len(rank)), b))
