"""Egeria's reference model: an fp32 CPU copy of the training model without its hooks, quantized to int8.

Source: Wang et al., "Egeria: Efficient DNN Training with Knowledge-Guided Layer Freezing", EuroSys 2023,
arXiv 2201.06227, sec. 4: the reference model is "generated on the fly using quantization techniques". The
strategy (:mod:`layerfreeze.strategies.egeria.strategy`) keeps a :func:`cpu_copy` of the model as its shadow and builds
the reference from it with :func:`build_reference` at attach and at every refresh.

The int8 schemes. Every ``nn.Linear`` goes through PyTorch's own dynamic quantization
(``torch.ao.quantization.quantize_dynamic``: per-tensor symmetric int8 weights, activations quantized per batch at
run time). Every other weight (Conv, Embedding, norms, attention ``in_proj_weight``, Linear subclasses that dynamic
quantization skips) gets *weight-only* int8: per-tensor symmetric quantize-then-dequantize into the fp32 weight (at
most 255 distinct values per tensor, the same scheme as PyTorch's default dynamic weight observer); biases and
buffers stay fp32. If the torch build has no quantization engine or ``quantize_dynamic`` fails (it is deprecated in
favour of torchao), every weight gets the weight-only scheme, and the report says why.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)

#: What a framework leaves on a module whose ``forward`` it wrapped, as an instance attribute: accelerate's
#: ``Accelerator.prepare`` under mixed precision keeps the original as ``_original_forward`` and sets an autocast
#: ``forward`` (the HF Trainer with ``bf16=True`` does this); its hooks (``add_hook_to_module``) keep ``_old_forward``.
_WRAPPED_FORWARD = ("_original_forward", "_old_forward")

#: The reference schemes :func:`build_reference` takes.
QUANTIZATIONS = ("dynamic", "weight_only")


def cpu_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` on the CPU in fp32, eval mode, no grad, without the model's hooks.

    The tensors are copied straight to the CPU (the deep-copy memo is pre-filled), so a GPU model is never
    duplicated on the GPU; hook dictionaries are replaced by empty ones, so objects that own hooks (a Freezer,
    telemetry) are not deep-copied along with their bound methods; a ``forward`` a framework wrapped on the instance
    (:data:`_WRAPPED_FORWARD`: accelerate's autocast one) gives way to the class's own.
    """
    memo: dict[int, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        dtype = torch.float32 if t.is_floating_point() else t.dtype
        data = t.detach().to("cpu", dtype, copy=True)
        memo[id(t)] = nn.Parameter(data, requires_grad=False) if isinstance(t, nn.Parameter) else data
    for m in model.modules():
        for attr in _HOOK_DICTS:
            hooks = getattr(m, attr, None)
            if hooks is not None:
                memo[id(hooks)] = type(hooks)()
    clone = copy.deepcopy(model, memo)
    for m in clone.modules():  # the class's own forward, in fp32: an autocast one fed bf16 to the int8 layers
        if "forward" in vars(m) and any(mark in vars(m) for mark in _WRAPPED_FORWARD):
            del m.forward
            for mark in _WRAPPED_FORWARD:
                vars(m).pop(mark, None)
    clone.eval()
    clone.requires_grad_(False)
    return clone


def _dynamic_quantization_unavailable() -> str | None:
    """Why PyTorch's dynamic int8 quantization cannot be used in this build, or None if it can."""
    engines = [e for e in getattr(torch.backends.quantized, "supported_engines", []) if e != "none"]
    engine = getattr(torch.backends.quantized, "engine", "none")
    if not engines or engine in (None, "none"):
        return f"no quantization engine in this torch build (engine={engine!r}, supported={engines})"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.ao.quantization import quantize_dynamic  # noqa: F401
    except Exception as exc:  # removed in a future torch: fall back, say why
        return f"torch.ao.quantization.quantize_dynamic is not importable ({exc})"
    return None


def _fake_quantize_int8(w: torch.Tensor) -> torch.Tensor:
    """Per-tensor symmetric int8 quantize-then-dequantize: at most 255 distinct values (-127..127 times scale)."""
    scale = w.abs().max() / 127.0
    if not torch.isfinite(scale) or scale == 0:
        return w
    return torch.clamp(torch.round(w / scale), -127, 127) * scale


def build_reference(source: nn.Module, quantization: str = "dynamic") -> tuple[nn.Module, dict[str, Any]]:
    """The int8 reference model of Egeria, built from a CPU fp32 model (not changed).

    Args:
        source: A CPU fp32 model without hooks (the strategy's shadow copy).
        quantization: ``"dynamic"``: ``nn.Linear`` via ``torch.ao.quantization.quantize_dynamic`` (int8), the
            remaining weights weight-only int8; ``"weight_only"``: weight-only int8 everywhere.

    Returns:
        ``(reference, report)``: the reference (eval mode, no grad) and ``{"scheme", "dynamic_int8": [module
        names], "weight_only_int8": [parameter names], "note": fallback reason or None}``.
    """
    reference = copy.deepcopy(source)
    report: dict[str, Any] = {"scheme": quantization, "dynamic_int8": [], "weight_only_int8": [], "note": None}
    if quantization == "dynamic":
        reason = _dynamic_quantization_unavailable()
        if reason is None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    from torch.ao.quantization import quantize_dynamic

                    quantize_dynamic(reference, {nn.Linear}, dtype=torch.qint8, inplace=True)
            except Exception as exc:
                reason = f"quantize_dynamic failed ({type(exc).__name__}: {exc})"
                reference = copy.deepcopy(source)
        if reason is not None:
            report["scheme"] = "weight_only"
            report["note"] = f"weight-only int8 everywhere: {reason}"
    for name, module in reference.named_modules():
        if type(module).__module__.startswith("torch.ao.nn.quantized.dynamic"):
            report["dynamic_int8"].append(name)
        for pname, p in module.named_parameters(recurse=False):
            if "weight" in pname and p.is_floating_point():
                with torch.no_grad():
                    p.copy_(_fake_quantize_int8(p))
                report["weight_only_int8"].append(f"{name}.{pname}" if name else pname)
    reference.eval()
    reference.requires_grad_(False)
    return reference, report
