"""The trainer's numeric precision (``train.precision``, ``--precision``), in PyTorch Lightning's names (issue 42).

* ``32-true``: float32 weights and compute (the CPU's default).
* ``bf16-mixed``: float32 master weights, the forward and loss under ``torch.autocast(dtype=torch.bfloat16)``; no
  loss scaling (bfloat16 has float32's exponent range). The default on a CUDA device that supports bfloat16
  (``auto``), as Lightning's and the Hugging Face Trainer's users write it (``precision="bf16-mixed"``,
  ``bf16=True``).
* ``16-mixed``: float32 master weights, autocast to float16, and a ``torch.amp.GradScaler`` (Micikevicius et al.
  2018, "Mixed Precision Training", sec. 3.2: loss scaling). Freezing never confuses the scaler: only trainable
  parameters get gradients, so a frozen block demoted to float16 (``freeze.demote``) is never unscaled (the fault of
  salesforce/LAVIS#279, "Attempting to unscale FP16 gradients", comes from an fp16 parameter *with* a gradient), a
  thawed demoted block trains on the float32 weights the thaw restores, and a step where nothing has a gradient skips
  the optimizer and the scaler's update instead of failing "No inf checks were recorded for this optimizer"
  (accelerate#1990). The scaler's state is in the checkpoint (:meth:`Precision.state_dict`), so a resume continues
  with the same loss scale.
* ``bf16-true``: the weights themselves in bfloat16 (:meth:`Precision.cast_model`, before the optimizer is built), so
  AdamW keeps its states in bfloat16 too; no autocast.

A step under :class:`Precision` is ``with p.autocast(): loss = ...``, ``p.backward(loss)``, then :meth:`Precision.step`
(unscale when scaling, clip, optimizer and scheduler step, gradients dropped). Evaluation runs under the same
autocast.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from layerfreeze.errors import ConfigError
from layerfreeze.train.loop import apply_step, step_scheduler

#: The precisions ``train.precision`` takes (``auto`` picks one of them per device: :func:`resolve_precision`).
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


def resolve_precision(name: str, device: torch.device) -> str:
    """The precision ``name`` means on ``device``: ``auto`` is ``bf16-mixed`` on a CUDA device that supports
    bfloat16 and ``32-true`` elsewhere (the CPU: its bfloat16 kernels are slower than float32 on most CPUs without
    AMX, and the figures of BENCHMARKS.md are float32); another name is itself.

    Raises:
        ConfigError: an unknown name, or ``16-mixed`` on a device without float16 autocast.
    """
    if name == "auto":
        return "bf16-mixed" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "32-true"
    if name not in PRECISIONS:
        raise ConfigError(f"train.precision {name!r}: use auto, {', '.join(PRECISIONS)}")
    return name


class Precision:
    """Autocast, loss scaling and the optimizer step of one precision (module docstring).

    Args:
        name: One of :data:`PRECISIONS` (resolve ``auto`` first: :func:`resolve_precision`).
        device: The training device; autocast and the scaler run on its type.
    """

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = resolve_precision(name, device)
        self.device_type = device.type
        if self.name == "16-mixed" and device.type == "cpu":
            # Lightning replaces it with bf16-mixed on the CPU (with a warning); here it runs as asked (the tests
            # check it on the CPU), and says what it costs
            warnings.warn("train.precision 16-mixed on the CPU: float16 autocast runs there, but slower than 32-true "
                          "(most CPUs have no fast float16 kernels) and its loss scaling buys nothing; use "
                          "--precision bf16-mixed or 32-true on the CPU", stacklevel=2)
        #: The dtype autocast computes in (None: no autocast).
        self.compute_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.name)
        #: The weights' dtype when it is not float32 (``bf16-true``).
        self.param_dtype = torch.bfloat16 if self.name == "bf16-true" else None
        self.scaler = torch.amp.GradScaler(device.type) if self.name == "16-mixed" else None
        #: ``16-mixed``: steps where no parameter had a gradient, so neither the optimizer nor the scale moved (the
        #: scaler's own skips, on an inf/NaN gradient, are not counted: reading them is a host synchronisation).
        self.empty_steps = 0

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context of a forward and its loss: ``torch.autocast`` in the compute dtype, or nothing."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def cast_model(self, model: nn.Module) -> nn.Module:
        """``bf16-true``: the model's floating-point parameters and buffers in bfloat16 (in place); else unchanged."""
        if self.param_dtype is not None:
            model.to(self.param_dtype)
        return model

    def convert_input(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``bf16-true``: the batch's floating-point tensors (pixel values) in bfloat16, as the weights are (token ids,
        masks and labels keep their integer dtype); else the batch as it is."""
        if self.param_dtype is None:
            return batch
        return {k: v.to(self.param_dtype) if v.is_floating_point() else v for k, v in batch.items()}

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the loss scaled first under ``16-mixed``."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None,
             grad_clip: float | None, params: Iterable[nn.Parameter]) -> None:
        """:func:`~layerfreeze.train.loop.apply_step` (clip, optimizer and scheduler step, gradients dropped); under
        ``16-mixed`` the gradients are unscaled before the clip, the scaler steps the optimizer (skipping it on an
        inf or NaN gradient) and updates the scale. With no gradient at all (everything frozen this step) the
        optimizer and the scale are left as they are and the scheduler steps.

        ``params`` are the parameters whose gradients are clipped, in the caller's order.
        """
        if self.scaler is not None and not (params := list(params)):  # GradScaler.step: no inf check to read
            self.empty_steps += 1
            if scheduler is not None:
                step_scheduler(scheduler, quiet=True)
            optimizer.zero_grad(set_to_none=True)
            return
        apply_step(optimizer, scheduler, grad_clip, params, self.scaler)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the name and, under ``16-mixed``, the scaler's state (its scale and growth
        tracker)."""
        return {"name": self.name, "empty_steps": self.empty_steps,
                **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> str | None:
        """Continue from a checkpoint's :meth:`state_dict`. A checkpoint of another precision (``auto`` resolved on
        another device: a GPU's bf16-mixed run resumed on the CPU) still loads, its weights being float32 (or cast
        by :meth:`cast_model`); the scaler starts afresh then.

        Returns:
            None, or a line saying that the precision changed (for the run's log).
        """
        self.empty_steps = int(state.get("empty_steps", 0))
        saved = state.get("name", self.name)
        if saved != self.name:
            return (f"the checkpoint was trained under train.precision {saved}; this run continues under "
                    f"{self.name}")
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        return None
