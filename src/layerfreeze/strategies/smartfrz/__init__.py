"""SmartFRZ, the default strategy, at run time: the weight recorder, the scale-free window features, the attention
predictor with its shipped weights (``predictor.safetensors``, its card ``PREDICTOR_CARD.md``) and the strategy.

Source: Li, Yuan, Dai, Zhang, Wang, Tang, "SmartFRZ: An Efficient Training Framework using Attention-Based Layer
Freezing", ICLR 2023 (arXiv 2401.16720). The offline pipeline that trains the predictor (collect runs, label them,
train, evaluate on held-out architectures) is :mod:`layerfreeze.smartfrz`; it imports this package, never the
reverse.

* :mod:`~layerfreeze.strategies.smartfrz.recorder` -- a fixed random sample of each block's weights, recorded;
* :mod:`~layerfreeze.strategies.smartfrz.features` -- the predictor's input, per snapshot of a window;
* :mod:`~layerfreeze.strategies.smartfrz.predictor` -- the attention network, its file format and loading;
* :mod:`~layerfreeze.strategies.smartfrz.snr_gate` -- the gradient signal-to-noise gate (issue 29; on by default);
* :mod:`~layerfreeze.strategies.smartfrz.strategy` -- :class:`SmartFRZ`.
"""

from layerfreeze.strategies.smartfrz.features import FEATURE_VERSION, NUM_FEATURES, window_features
from layerfreeze.strategies.smartfrz.predictor import DEFAULT_PREDICTOR, FreezePredictor, load_predictor
from layerfreeze.strategies.smartfrz.recorder import WeightRecorder
from layerfreeze.strategies.smartfrz.strategy import SmartFRZ

__all__ = [
    "DEFAULT_PREDICTOR",
    "FEATURE_VERSION",
    "NUM_FEATURES",
    "FreezePredictor",
    "SmartFRZ",
    "WeightRecorder",
    "load_predictor",
    "window_features",
]
