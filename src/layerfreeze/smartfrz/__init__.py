"""SmartFRZ as we build it: weight recorder, scale-free window features, the attention predictor, and the offline
pipeline (collect runs, label them with CKA, train, evaluate on held-out architectures and datasets).

The online strategy is :class:`layerfreeze.strategies.smartfrz.SmartFRZ`.
"""
