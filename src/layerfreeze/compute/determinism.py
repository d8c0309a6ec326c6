"""What would make a cached frozen-prefix output wrong, refused with a message that says why: random augmentation in
the dataset (:func:`check_deterministic`), a module of the prefix that is stochastic in its current mode
(:func:`check_prefix_deterministic`: dropout, BatchNorm in training mode), or any module that draws random numbers
as the prefix runs (:func:`refuse_random_draws`). :class:`CacheRefused` is what the
activation cache (:mod:`~layerfreeze.compute.cache`) raises, or turns itself off on, with ``fallback``. And a forward
under another autocast precision than the cache was filled under (:func:`precision_key`, :func:`precision_warning`),
which runs the full model.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from layerfreeze.models.blocks import Block

#: Why a dataset with random augmentation cannot be cached (part of the refusal's message).
AUGMENTATION = (
    "random augmentation in the dataset: the frozen prefix's outputs cannot be cached; "
    "set cache: off or make the transform deterministic"
)
#: Why a sample's inputs can differ from those its cached prefix output was computed on (the cache keys by "index").
CHANGED_INPUTS = (
    "the inputs of sample {index} changed since its prefix output was cached. The cache keys each sample by its "
    "'index', so this is one of: random augmentation in the dataset (make the transform deterministic, or set cache: "
    "off); an 'index' that is not the sample's own (a position within the batch: give each item its position in the "
    "dataset); two datasets through one CachedPrefix (evaluate with the model's own forward, or another "
    "CachedPrefix); or inputs cast to another dtype since (model.to(torch.bfloat16) with its inputs: build a new "
    "CachedPrefix after the cast)"
)


class CacheRefused(ValueError):
    """Raised when caching the frozen prefix's output would give wrong results (the message says why)."""


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, with NaN equal to NaN where both hold one (an input with a missing value is the same input
    twice; ``torch.equal`` called it changed)."""
    if torch.equal(a, b):
        return True
    if a.shape != b.shape or not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    """The path of the first value that differs between two fetches of an item, or None if they are equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype and a.shape == b.shape and same_values(a, b)
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
        floating = all(isinstance(v, np.ndarray) and v.dtype.kind in "fc" for v in (a, b))
        return None if np.array_equal(a, b, equal_nan=floating) else path
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:  # NaN, both times
        return None
    return None if a == b else path


def global_random_states() -> tuple[Any, ...]:
    """The global random states a dataset or a frozen function could draw from: torch's CPU generator and, once CUDA
    is initialized, every CUDA device's (never initializing CUDA), Python's ``random`` and NumPy's legacy global
    generator (:func:`drew_from_global_random` compares two)."""
    states: list[Any] = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += list(torch.cuda.get_rng_state_all())
    return tuple(states), random.getstate(), np.random.get_state()


def drew_from_global_random(before: tuple[Any, ...]) -> bool:
    """Whether any global random state changed since ``before`` (:func:`global_random_states`)."""
    (torch_before, py_before, np_before), (torch_now, py_now, np_now) = before, global_random_states()
    if len(torch_before) != len(torch_now) or any(not torch.equal(a, b) for a, b in zip(torch_before, torch_now)):
        return True
    # NumPy's state: (name, (624,) uint32 keys, position, has_gauss, cached_gaussian)
    return (py_before != py_now or not np.array_equal(np_before[1], np_now[1])
            or (np_before[0], *np_before[2:]) != (np_now[0], *np_now[2:]))


def input_fingerprint(value: Any) -> torch.Tensor:
    """``(2,)`` float64: the plain and the position-weighted sum of ``value`` (a tensor or a number, any shape, read
    flat on the host), as :meth:`~layerfreeze.models.forward_split.ModelSplit.fingerprint` takes them per sample: a
    change of noise, a flip, a crop or another sample changes it. NaN and infinities are read as large constants (a
    NaN made both sums NaN: a missing value hid every other change, and equal inputs never compared equal). Not a
    hash."""
    from layerfreeze.models.forward_split import position_weights

    flat = torch.as_tensor(value).detach().reshape(-1).to("cpu", torch.float64)
    flat = torch.nan_to_num(flat, nan=1e4 + 0.5, posinf=1e8 + 0.25, neginf=-1e8 - 0.25)
    return torch.stack([flat.sum(), (flat * position_weights(flat.numel())).sum()])


def item_fingerprint(item: Any) -> tuple[tuple[str, ...], torch.Tensor]:
    """The fingerprint of a dataset item's inputs, for checking later that a stored output belongs to them:
    ``(paths, (len(paths), 2) float64)``, one row per leaf of the item but its top-level ``"index"`` -- tensors,
    numbers and NumPy arrays (:func:`input_fingerprint`), strings and bytes (their CRC-32 and length), None -- found
    in dicts, lists and tuples at any depth, named by path (``"inputs.pixel_values"``, ``"views[1]"``, ``"text"``).
    Leaves of other types are left out. Not a hash: see :func:`input_fingerprint`."""
    paths: list[str] = []
    rows: list[torch.Tensor] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if not (path == "" and k == "index"):
                    walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(value, (list, tuple)):
            for j, v in enumerate(value):
                walk(v, f"{path}[{j}]")
        elif isinstance(value, (str, bytes)):
            raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
            paths.append(path)
            rows.append(torch.tensor([float(zlib.crc32(raw)), float(len(raw))], dtype=torch.float64))
        elif value is None:
            paths.append(path)
            rows.append(torch.tensor([0.0, -1.0], dtype=torch.float64))
        elif isinstance(value, (torch.Tensor, np.ndarray, np.generic, bool, int, float)):
            paths.append(path)
            rows.append(input_fingerprint(value))

    walk(item, "")
    return tuple(paths), torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)


def _two_fetches(dataset: Any, n: int) -> tuple[list[Any], list[Any]]:
    """Items ``0..n-1`` fetched twice, the global random states of Python, NumPy and torch restored afterwards (the
    check does not change the run's random stream: a run with the cache draws the same dropout masks as one
    without)."""
    count = min(n, len(dataset))
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            return [dataset[i] for i in range(count)], [dataset[i] for i in range(count)]
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def first_changed_item(dataset: Any, n: int = 4) -> tuple[int, str] | None:
    """The first of items ``0..n-1`` that differs between two fetches (random augmentation), as ``(item, the first
    key that differs)``, or None when they are all equal. Every tensor is compared exactly (dtype, shape, values; NaN
    equal to NaN)."""
    for i, (a, b) in enumerate(zip(*_two_fetches(dataset, n))):
        key = _first_difference(a, b, "")
        if key is not None:
            return i, key or "the item"
    return None


def check_deterministic(dataset: Any, n: int = 4) -> None:
    """Refuse a dataset whose items differ from one fetch to the next (random augmentation): items ``0..n-1`` are
    fetched twice and compared exactly (:func:`first_changed_item`).

    Raises:
        CacheRefused: an item differs between the two fetches; the message names the item and the first key that
            differs and says "random augmentation in the dataset ...". Also when an item has no ``"index"``
            (the cache key).
    """
    first, second = _two_fetches(dataset, n)
    for i, (a, b) in enumerate(zip(first, second)):
        if isinstance(a, dict) and "index" not in a:
            raise CacheRefused(
                f"dataset items have no 'index' key (keys: {sorted(a)}); the activation cache keys entries by it"
            )
        key = _first_difference(a, b, "")
        if key is not None:
            raise CacheRefused(f"dataset item {i}: {key or 'the item'!r} differs between two fetches: {AUGMENTATION}")


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
            (:meth:`~layerfreeze.models.forward_split.ModelSplit.prefix_modules`); they include parameter-free modules
            between blocks, which the blocks alone do not. Defaults to the modules of ``blocks[:depth]``.

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


@contextmanager
def refuse_random_draws(depth: int) -> Iterator[None]:
    """Run the frozen prefix for the activation cache, refusing what it computed when it drew from the global random
    number generators (:func:`drew_from_global_random`): a module that samples in training mode which
    :func:`check_prefix_deterministic` does not know (a noise layer between a ``nn.Sequential``'s blocks, functional
    dropout, stochastic depth) gave the cache one draw per sample, served at every later step where the model's own
    forward draws anew: it trained on one frozen sample of the noise, in silence.

    Raises:
        CacheRefused: saying what to do.
    """
    before = global_random_states()
    yield
    if drew_from_global_random(before):
        raise CacheRefused(
            f"the frozen prefix (depth {depth}) drew random numbers as it ran (a module in training mode that samples: "
            "noise, functional dropout, stochastic depth): its output changes from run to run, so it cannot be cached. "
            "Put that module in eval mode, or set cache: off")


def precision_key(device: torch.device) -> tuple[bool, torch.dtype | None]:
    """The autocast state a forward on ``device`` runs under: ``(enabled, dtype)`` (dtype None when off; off on a
    device type autocast does not know, such as ``meta``)."""
    try:
        enabled = torch.is_autocast_enabled(device.type)
    except RuntimeError:  # "unknown device type for autocast"
        return False, None
    return enabled, (torch.get_autocast_dtype(device.type) if enabled else None)


def precision_warning(model: nn.Module, key: tuple[bool, torch.dtype | None],
                      filled: tuple[bool, torch.dtype | None]) -> str | None:
    """Why a cached forward under autocast state ``key`` (:func:`precision_key`) is not what it should be, or None:
    the cache was filled under another (``filled``: its states were computed, and rounded, in that precision, so this
    forward runs the full model), or ``model.forward`` carries accelerate's mixed-precision autocast, which the cached
    forward skips (it calls the blocks), so the blocks run in float32."""
    if not key[0] and "_original_forward" in vars(model):
        return ("activation cache: the model's forward runs under an autocast that accelerate put around it "
                "(mixed_precision), but the cached forward calls its blocks, not model.forward, so they run in "
                "float32. Call the cached forward under `with accelerator.autocast():`")
    if key == filled:
        return None
    said = {False: "without autocast"}
    return (f"activation cache: this forward runs {said.get(key[0], f'under autocast {key[1]}')}, but the cache was "
            f"filled {said.get(filled[0], f'under autocast {filled[1]}')}; its states are not this forward's, so such "
            "forwards run the full model (the cache still serves the precision it was filled under). Run every forward "
            "through the cache under one precision (the training's autocast), or evaluate with the model's own forward")
