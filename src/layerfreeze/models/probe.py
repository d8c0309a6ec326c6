"""Block outputs on a probe batch: one forward with hooks on the blocks' last modules, what each block hands on.

Three parts of layerfreeze look at a block's output on a fixed probe batch: the benchmark oracle
(:class:`~benchmarks.oracle.ProbeRecorder`, CKA to the final model), the SmartFRZ collector
(:func:`~layerfreeze.smartfrz.collect.record_run`, the activations its labels come from) and Egeria (plasticity
against a reference copy, :mod:`layerfreeze.strategies.egeria.strategy`). They all capture it here: a forward hook on
each block's last module keeps :func:`~layerfreeze.models.blocks.output_tensor` of what the module returns, detached,
during one forward of the probe batch in eval mode under ``torch.no_grad()``. The hooks live only for that forward, so
nothing is left on the model between probes and training steps never pay for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from layerfreeze.models.blocks import Block, output_tensor

K = TypeVar("K", bound=Hashable)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside the ``with`` block; every sub-module's own train/eval mode is put back after it
    (also when the block raises).

    Why per module, not ``model.train(was_training)``: a training model can hold modules in eval mode on purpose
    (the Freezer keeps frozen blocks' BatchNorm and dropout in eval mode); one flag for the whole model would flip
    them back to training.
    """
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield model
    finally:
        for m, mode in modes:
            m.training = mode


def block_modules(blocks: Sequence[Block]) -> dict[int, nn.Module]:
    """``{block index: the block's last module}``: the module whose output is the block's output."""
    return {b.index: b.modules[-1][1] for b in blocks if b.modules}


def first_tensor(output: Any) -> torch.Tensor | None:
    """The main tensor of a module's output (:func:`~layerfreeze.models.blocks.output_tensor`); where that is not a
    tensor (a plain dict, a tuple starting with None, an output object whose ``last_hidden_state`` is None), the
    first tensor found depth-first in its values; None if it holds no tensor."""
    main = output_tensor(output)
    if isinstance(main, torch.Tensor):
        return main
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else ()
    for value in values:
        found = first_tensor(value)
        if found is not None:
            return found
    return None


@torch.no_grad()
def probe_outputs(model: nn.Module, modules: Mapping[K, nn.Module],
                  forward: Callable[[nn.Module], Any]) -> dict[K, torch.Tensor]:
    """Each module's output during one ``forward(model)``, in eval mode, without gradient.

    Args:
        model: The model ``forward`` runs (a training model, or a copy of it such as Egeria's shadow).
        modules: ``{key: module of model}``, usually :func:`block_modules` (a block's output is its last module's).
        forward: ``forward(model)`` runs the probe batch through the model, e.g.
            ``lambda m: task.forward(m, probe_batch)``; its return value is ignored.

    Returns:
        ``{key: output}`` for every module that returned a tensor (:func:`first_tensor`), detached, on the device
        and in the dtype the module produced (shape ``(P, ...)`` for a probe batch of ``P`` samples). A module the
        forward did not run is missing; one that ran twice gives its last output.

    Every module's training mode is restored after the forward, and the hooks are removed, also when ``forward``
    raises (the exception propagates).
    """
    outputs: dict[K, torch.Tensor] = {}

    def capture(key: K) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            tensor = first_tensor(output)
            if tensor is not None:
                outputs[key] = tensor.detach()
        return hook

    handles = []
    try:
        for key, module in modules.items():
            handles.append(module.register_forward_hook(capture(key)))
        with eval_mode(model):
            forward(model)
    finally:
        for h in handles:
            h.remove()
    return outputs
