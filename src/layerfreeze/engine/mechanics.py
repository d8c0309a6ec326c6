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
