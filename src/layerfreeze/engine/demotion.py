"""What a demotion of frozen blocks is: its settings (:class:`Demotion`: the dtype, the offload target, where the
float32 master copy goes), its error (:class:`DemotedWeightsError`), the cast of a block's nested inputs and
outputs (:func:`cast_floating`), and what may not be cast (:func:`out_of_range`).

The spec, with no state: the :class:`~layerfreeze.engine.demote.Demoter` (:mod:`layerfreeze.engine.demote`, which
explains what demotion does and re-exports these names) holds the demoted weights, their master copies and hooks.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from layerfreeze.engine.integrity import FrozenWeightsChangedError

#: The dtypes a frozen block may be demoted to, by name.
DEMOTE_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}
#: Where an offloaded block's weights go.
OFFLOAD_TARGETS = ("cpu",)
#: Where a demoted block's float32 master copy is kept: ``memory`` (host RAM), ``disk`` (a checksummed safetensors
#: file), ``auto`` (host memory when training on an accelerator, disk when training on the CPU).
MASTER_PLACES = ("auto", "memory", "disk")


class DemotedWeightsError(FrozenWeightsChangedError):
    """A demoted block's master copy (on disk, or in memory) does not match its checksums: its float32 weights cannot
    be restored exactly. A subclass of :class:`~layerfreeze.engine.integrity.FrozenWeightsChangedError`."""


@dataclass(frozen=True)
class Demotion:
    """What to do with a frozen block's weights while it is frozen (:mod:`layerfreeze.engine.demote`).

    Attributes:
        dtype: ``"bfloat16"`` / ``"float16"`` (or the torch dtype): cast the block's floating weights when it
            freezes; None: keep their dtype.
        offload: ``"cpu"``: move the weights of the frozen prefix the cache serves to host memory
            (:meth:`~layerfreeze.engine.demote.Demoter.offload_prefix`); None: keep them on the training device.
        master: Where the float32 master copy of a demoted block goes: ``"memory"`` (host RAM), ``"disk"`` (a
            safetensors file in ``directory``, checksummed), ``"auto"`` (memory unless the block trains on the CPU).
        directory: Where master files go (a fresh sub-directory is made in it, deleted when the Demoter is closed or
            collected); None: the system temp directory.

    Raises:
        ValueError: an unknown dtype, offload target or master place, or neither ``dtype`` nor ``offload`` (nothing
            to do).
    """

    dtype: str | torch.dtype | None = None
    offload: str | None = None
    master: str = "auto"
    directory: str | Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        dtype = self.dtype
        if isinstance(dtype, torch.dtype):
            names = {v: k for k, v in DEMOTE_DTYPES.items()}
            if dtype not in names:
                raise ValueError(f"demotion dtype must be one of {', '.join(DEMOTE_DTYPES)}, got {dtype}")
            object.__setattr__(self, "dtype", names[dtype])
        elif dtype is not None and dtype not in DEMOTE_DTYPES:
            raise ValueError(f"demotion dtype must be one of {', '.join(DEMOTE_DTYPES)} (or None), got {dtype!r}")
        if self.offload is not None and self.offload not in OFFLOAD_TARGETS:
            raise ValueError(f"demotion offload must be one of {', '.join(OFFLOAD_TARGETS)} (or None), got "
                             f"{self.offload!r}")
        if self.master not in MASTER_PLACES:
            raise ValueError(f"demotion master must be one of {', '.join(MASTER_PLACES)}, got {self.master!r}")
        if self.dtype is None and self.offload is None:
            raise ValueError("a Demotion needs a dtype (bfloat16, float16), an offload target (cpu), or both")

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Demotion:
        """A Demotion from its settings as a dict (``Freezer(demote={"dtype": "bfloat16"})``, a config's
        ``freeze.demote``).

        Raises:
            TypeError: a key that is no setting, naming the settings (``{"bogus": 1}`` raised "__init__() got an
                unexpected keyword argument").
            ValueError: a bad value (:class:`Demotion`).
        """
        names = [f.name for f in fields(cls)]
        unknown = [str(k) for k in settings if k not in names]
        if unknown:
            raise TypeError(f"demote has no setting {', '.join(map(repr, unknown))}: its settings are "
                            f"{', '.join(names)}, e.g. {{'dtype': 'bfloat16'}}")
        return cls(**settings)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The demoted dtype as a torch dtype (None: not cast)."""
        return None if self.dtype is None else DEMOTE_DTYPES[str(self.dtype)]

    def to_dict(self) -> dict[str, Any]:
        """``{"dtype", "offload", "master"}`` as plain values (a checkpoint's record; what a resume must match)."""
        return {"dtype": self.dtype, "offload": self.offload, "master": self.master}


# --------------------------------------------------------------------------------------------------------------
# Casting nested inputs and outputs
# --------------------------------------------------------------------------------------------------------------


def cast_floating(obj: Any, to: torch.dtype, only: torch.dtype | None = None) -> Any:
    """``obj`` with every floating tensor in it (nested in tuples, lists, dicts) cast to ``to``; with ``only``, just
    the tensors of dtype ``only``. Other values are returned as they are; a dict subclass (a Hugging Face
    ``ModelOutput``) is updated in place, a plain dict or sequence is rebuilt."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.dtype != to and (only is None or obj.dtype == only):
            return obj.to(to)
        return obj
    if isinstance(obj, tuple):
        items = [cast_floating(o, to, only) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items) if type(obj) is tuple else obj
    if type(obj) is list:
        return [cast_floating(o, to, only) for o in obj]
    if isinstance(obj, dict):
        if type(obj) is dict:
            return {k: cast_floating(v, to, only) for k, v in obj.items()}
        for k in list(obj.keys()):
            obj[k] = cast_floating(obj[k], to, only)
        return obj
    return obj


def beyond_range(dtype: torch.dtype, params: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of ``params``' floating tensors with a finite value beyond ``dtype``'s range (:func:`out_of_range`,
    which warns; a memory plan asks this without a warning)."""
    limit = torch.finfo(dtype).max
    return [n for n, t in params if t.is_floating_point() and t.dtype != dtype
            and bool((torch.isfinite(t) & (t.detach().abs() > limit)).any())]


def out_of_range(block: str, dtype: torch.dtype, params: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """Why frozen block ``block`` is not demoted to ``dtype`` (None: it may be): a finite weight or floating buffer
    (``params``: both, a BatchNorm's ``running_var`` too) beyond ``dtype``'s range (float16's is +-65504), which the
    cast turns into inf, exactly the cast of its master copy, so no check saw it and the loss went NaN, in silence in
    the user's own loop. Warns naming the block and tensors."""
    over = beyond_range(dtype, params)
    if not over:
        return None
    limit = torch.finfo(dtype).max
    why = f"its tensors {', '.join(over)} exceed {str(dtype).removeprefix('torch.')}'s range (+-{limit:g}): demoted, " \
          "they would be inf"
    # stacklevel 5: this function, Demoter.on_freeze, freeze_block, Freezer.freeze, its caller
    warnings.warn(f"demote: frozen block {block!r} stays in float32: {why}; demote to bfloat16 (float32's range) "
                  "instead", stacklevel=5)
    return why
