"""The freeze/thaw mechanics on one block, as stateless helpers (Lightning's ``BaseFinetuning.freeze`` /
``make_trainable`` style); :class:`~layerfreeze.engine.freezer.Freezer` wires them to a model, an optimizer
(:mod:`~layerfreeze.engine.optim`) and a strategy.
"""

from __future__ import annotations

from torch import nn

from layerfreeze.models.blocks import Block

_NORM_TYPES = (nn.modules.batchnorm._BatchNorm,)


def frozen_parameters(block: Block, train_bn: bool = False) -> list[nn.Parameter]:
    """The parameters that freezing ``block`` stops training (BatchNorm affine ones stay if ``train_bn``)."""
    if not train_bn:
        return list(block.parameters())
    keep = {id(p) for _, m in block.modules for sub in m.modules() if isinstance(sub, _NORM_TYPES)
            for p in sub.parameters(recurse=False)}
    return [p for p in block.parameters() if id(p) not in keep]


def set_eval_mode(module: nn.Module, train_bn: bool = False) -> None:
    """Put ``module`` and its sub-modules in eval mode (BatchNorm layers excepted when ``train_bn``)."""
    for sub in module.modules():
        sub.training = bool(train_bn and isinstance(sub, _NORM_TYPES) and sub.training)


def frozen_blocks_to_eval(blocks: list[Block], frozen: list[bool], train_bn: bool = False) -> None:
    """Put every frozen block (``frozen[i]``) back in eval mode, before any block is called (the Freezer runs it
    from a pre-hook on the whole model, in training mode).

    Why not the blocks' own pre-hooks alone: they run inside the block's ``__call__``, after a wrapper that reads
    ``module.training`` there has decided. transformers up to 5.17 at least checkpoints a training-mode layer's
    whole ``__call__`` (``GradientCheckpointingLayer``), so after the HF Trainer's ``model.train()`` a frozen
    layer ran under a reentrant checkpoint, where the checkpointing boundary's hook (grad mode off there) could not
    mark its output, and no checkpointed layer after it got a gradient (issue 41, transformers #21381's fault
    again; found with transformers 5.17). One pass over the frozen blocks.
    """
    for index, is_frozen in enumerate(frozen):
        if is_frozen:
            for _, module in blocks[index].modules:
                if module.training:
                    set_eval_mode(module, train_bn)
