"""A step's FLOPs: :class:`torch.utils.flop_counter.FlopCounterMode`'s counts, totals only, at a lower cost.

* :func:`conv_backward_flops` -- ``aten.convolution_backward``'s count with grouped weight gradients per group;
  :func:`cpu_attention_flops` / :func:`cpu_attention_backward_flops` -- CPU's fused attention, which torch's
  registry leaves at 0; :data:`FLOP_FORMULAS` -- the formulas layerfreeze puts over torch's registry (the
  ``custom_mapping``).
* :class:`TotalFlopCounter` -- a ``FlopCounterMode`` that keeps the total and nothing else: the same formulas
  (``torch.utils.flop_counter.flop_registry`` plus :data:`FLOP_FORMULAS`), the same ops counted, the same
  decompositions where a decomposition can dispatch a counted op; no per-module attribution.

Why not ``FlopCounterMode`` itself (torch 2.14, ``torch/utils/flop_counter.py``): it attributes every count to every
module running, through a :class:`~torch.utils.module_tracker.ModuleTracker` (global forward pre- and post-hooks on
every module call, and a multi-gradient hook on every module's inputs and outputs, run in backward), and for every op
that reaches it (an ``OpOverload``, never in its registry, which is keyed by ``OpOverloadPacket``) it re-enters itself
and calls ``func.decompose``, which for almost every op then finds no decomposition. It also runs
``aten.native_batch_norm`` (a CPU batch norm) through its Python decomposition (``torch._decomp``): a dozen elementwise
ops in place of one kernel, which count nothing. :class:`TotalFlopCounter` keeps torch's dispatch mode (its handling
of higher-order ops is inherited) and its formulas, adds every count to the total only, and tries a decomposition only
for an op that has one (:func:`_decomposes`, the same test ``decompose`` makes), except the batch norm's.

Measured (``python -m benchmarks.flops_overhead --threads 1 --steps 9 --batch-size 8 --max-length 32``, the trainer's
step, nothing frozen, on a 2-core CPU shared with other jobs, so indicative): MiniLM-L6, 2,201 ops per step: normal
357 ms, under ``FlopCounterMode`` +92 ms (42 us per op), under :class:`TotalFlopCounter` +30 ms (14 us per op);
MobileNetV2, 2,111 ops: normal 52 ms, +80 ms (38 us per op) against +32 ms (15 us per op). In a second comparison
(MiniLM-L6, batch 2, a plain forward/backward/AdamW loop, 1,927 ops) a dispatch mode that only passes each op on
added 9.0 us per op, :class:`TotalFlopCounter` 9.4 and ``FlopCounterMode`` 32: what is left is that floor, one
Python ``__torch_dispatch__`` per op of the step (forward, backward, clipping, optimizer). A meta-device copy of the
model would pay the same per-op Python dispatch on the host (and meta kernels, many of them Python) on top of the real
step, and it would have to copy the optimizer and the trainer's per-step state; it is not cheaper on a CPU and not
simpler anywhere.

On CUDA (read from torch's code, not measured here): the counting costs host time only. The formulas read shapes and
no op of the counter synchronises the device. The kernels are a normal step's: nothing decomposes in a transformer's
step (attention dispatches ``_scaled_dot_product_{flash,efficient,cudnn}_attention``, counted, with no
decomposition), and a CUDA batch norm dispatches ``cudnn_batch_norm`` (``_batch_norm_impl_index`` picks cuDNN for a
CUDA input), which has none either; only a batch norm that falls back to ``native_batch_norm`` ran decomposed kernels
under ``FlopCounterMode``. So a counted step is slow on a GPU because the host, which normally runs ahead of the GPU,
now spends tens of microseconds per op in Python: the default job's step dispatches ~1,100 ops on CUDA (forward and
backward 861 ops, AdamW and clipping foreach), so ``FlopCounterMode``'s ~40 us per op (on this CPU) gives ~45 ms of
host time per step, the order of the 35-105 ms the issue measured over a ~25 ms step; :class:`TotalFlopCounter`'s
~14 us per op, ~15 ms (an estimate, to be measured on the GPU with the benchmark above).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import flop_counter as _fc
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

__all__ = [
    "FLOP_FORMULAS",
    "TotalFlopCounter",
    "conv_backward_flops",
    "cpu_attention_backward_flops",
    "cpu_attention_flops",
]

aten = torch.ops.aten


def conv_backward_flops(grad_out_shape: Any, x_shape: Any, w_shape: Any, _bias: Any, _stride: Any,
                        _padding: Any, _dilation: Any, transposed: bool, _output_padding: Any, groups: int,
                        output_mask: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``aten.convolution_backward``: torch's formula with the weight gradient of a grouped convolution
    divided by ``groups``.

    Why: torch's ``conv_backward_flop`` (2.x) computes the weight gradient's count as a convolution of all input
    channels with all output channels, ignoring groups, while each output channel only sees ``C_in / groups``
    input channels. A depthwise convolution (``groups = channels``) had its weight gradient counted ``channels``
    times too large: MobileNetV2's backward came out at 19x its forward, and freezing its depthwise convs looked
    like a far larger saving than it is. The input gradient's count already uses the grouped weight shape.
    """

    def t(shape: Any) -> list[int]:
        return [shape[1], shape[0], *shape[2:]]

    flops = 0
    if output_mask[0]:  # grad_input as a transposed convolution of grad_output with the weight
        flops += conv_flop_count(list(grad_out_shape), list(w_shape), list(out_shape[0]), not transposed)
    if output_mask[1]:  # grad_weight as a convolution of the input with grad_output, per group
        a, b = (grad_out_shape, x_shape) if transposed else (x_shape, grad_out_shape)
        flops += conv_flop_count(t(a), t(b), t(out_shape[1]), transposed=False) // max(1, groups)
    return flops


def cpu_attention_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None,
                        **kwargs: Any) -> int:
    """FLOPs of ``aten._scaled_dot_product_flash_attention_for_cpu``, CPU's fused attention: torch's count for the
    fused attention kernels it registers (``sdpa_flop_count``: ``Q K^T`` and ``softmax(.) V``, ``4 B H S_q S_k D``).

    Why: torch's registry (2.14) counts the CUDA kernels (flash, memory-efficient, cuDNN) but not this one, so on a CPU
    the attention of a layer in eval mode (a frozen layer; any layer of a model without attention dropout, such as
    Llama) counted 0, while a training-mode layer with attention dropout takes the decomposed path, whose ``bmm`` s
    count. A frozen MiniLM-L6 layer's attention at 128 tokens went missing (201 MFLOP per layer at batch 8), so
    freezing looked a little cheaper on the CPU than it is, and than the same step counted on a GPU.
    """
    return _fc.sdpa_flop_count(query_shape, key_shape, value_shape)


def cpu_attention_backward_flops(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                                 out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``aten._scaled_dot_product_flash_attention_for_cpu_backward``: torch's ``sdpa_backward_flop_count``
    (the scores recomputed, and the gradients of ``Q``, ``K`` and ``V``), as for the CUDA kernels
    (:func:`cpu_attention_flops` says why)."""
    return _fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


#: The formulas layerfreeze puts over torch's registry (``FlopCounterMode(custom_mapping=...)``).
FLOP_FORMULAS: dict[Any, Any] = {aten.convolution_backward: conv_backward_flops}
for _op, _formula in (("_scaled_dot_product_flash_attention_for_cpu", cpu_attention_flops),
                      ("_scaled_dot_product_flash_attention_for_cpu_backward", cpu_attention_backward_flops)):
    if hasattr(aten, _op) and getattr(aten, _op) not in _fc.flop_registry:  # a later torch may count it itself
        FLOP_FORMULAS[getattr(aten, _op)] = _formula

# FlopCounterMode's dispatch returns NotImplemented for these metadata queries (so that subclasses with their own
# sizes and strides, such as nested tensors, answer them): torch 2.14's _FlopCounterMode.__torch_dispatch__.
_METADATA_OPS = frozenset({
    aten.sym_is_contiguous.default, aten.is_contiguous.default, aten.is_contiguous.memory_format,
    aten.is_strides_like_format.default, aten.is_non_overlapping_and_dense.default, aten.size.default,
    aten.sym_size.default, aten.stride.default, aten.sym_stride.default, aten.storage_offset.default,
    aten.sym_storage_offset.default, aten.numel.default, aten.sym_numel.default, aten.dim.default,
    torch.ops.prim.layout.default,
})

# Ops that FlopCounterMode decomposes whose decomposition dispatches no op of the registry, so that running the op's
# own kernel counts the same (0) and costs less. native_batch_norm: torch._decomp.decompositions'
# native_batch_norm_decomposition (registered as its CompositeImplicitAutograd Python kernel) is var_mean, rsqrt,
# sub, mul, add and the running statistics' copies: a CPU batch norm in training ran a dozen ops in its place.
_ZERO_FLOP_DECOMPOSITIONS = frozenset({aten.native_batch_norm.default})

_IMPLICIT = torch._C.DispatchKey.CompositeImplicitAutograd
_has_implicit_kernel: dict[Any, bool] = {}  # OpOverload -> has a C++ CompositeImplicitAutograd kernel


def _decomposes(func: Any) -> bool:
    """Whether ``func.decompose`` would run a decomposition (else it returns NotImplemented): a Python
    CompositeImplicitAutograd kernel (looked up each time: ``py_impl`` may add one) or a C++ one (cached: the
    dispatcher's registrations for an op are made when its library loads)."""
    if _IMPLICIT in func.py_kernels:
        return True
    known = _has_implicit_kernel.get(func)
    if known is None:
        known = _has_implicit_kernel[func] = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _IMPLICIT)
    return known


_BaseMode: Any = getattr(_fc, "_FlopCounterMode", None)  # torch >= 2.5: the mode apart from the counter


if _BaseMode is not None:
    class _TotalsDispatch(_BaseMode):  # type: ignore[misc, valid-type]
        """torch's ``_FlopCounterMode`` (its higher-order-op handling, ``cond``'s upper bound, Triton kernels,
        is inherited as is) with a shorter path for ordinary ops: a decomposition is tried only where one exists
        and can count, without re-entering the mode for every op."""

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs if kwargs else {}
            if func in _METADATA_OPS:
                return NotImplemented
            if isinstance(func, torch._ops.HigherOrderOperator):
                return self._handle_higher_order_ops(func, types, args, kwargs)
            if (func not in _ZERO_FLOP_DECOMPOSITIONS and func is not torch.ops.prim.device.default
                    and _decomposes(func)):
                with self:
                    r = func.decompose(*args, **kwargs)
                    if r is not NotImplemented:
                        return r
            out = func(*args, **kwargs)
            return self.counter._count_flops(func._overloadpacket, out, args, kwargs)


class TotalFlopCounter(FlopCounterMode):
    """:class:`~torch.utils.flop_counter.FlopCounterMode` with layerfreeze's :data:`FLOP_FORMULAS`, that counts the
    total only (``get_total_flops()``, FLOPs; ``get_flop_counts()`` has the ``"Global"`` row only).

    The same count as ``FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)``, whose ``"Global"`` row (the
    total) gets every counted op (its module tracker's ``parents`` always holds ``"Global"``); see the module
    docstring for what is left out and why. On torch < 2.5, whose ``FlopCounterMode`` is the dispatch mode itself,
    this is ``FlopCounterMode`` unchanged. Not reentrant, as ``FlopCounterMode``.
    """

    def __init__(self) -> None:
        super().__init__(display=False, custom_mapping=FLOP_FORMULAS)

    if _BaseMode is not None:
        def __enter__(self) -> TotalFlopCounter:
            self.flop_counts.clear()
            self.mode = _TotalsDispatch(self)
            self.mode.__enter__()
            return self

        def __exit__(self, *args: Any) -> Any:
            mode, self.mode = self.mode, None  # break the cycle, as FlopCounterMode does
            return mode.__exit__(*args)

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            formula = self.flop_registry.get(func_packet)
            if formula is not None:
                self.flop_counts["Global"][func_packet] += formula(*args, **kwargs, out_val=out)
            return out
