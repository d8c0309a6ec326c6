"""Model families: one file per family, each registering how to find its blocks and (where supported) how to
split its forward for the activation cache.

==========================  ========================================================  =====================
file                        models                                                    forward split (cache)
==========================  ========================================================  =====================
``hf_vision.py``            Hugging Face ViT, DeiT, Swin, ConvNeXt                    ViT, DeiT
``bert.py``                 BERT, RoBERTa, DistilBERT, DeBERTa, ELECTRA, XLM-R, ...   BertForSequenceClass.
``decoder_lm.py``           Llama, Mistral, Qwen2/3, Gemma, Phi, GPT-2, GPT-NeoX      Llama/Mistral/Qwen, GPT-2
``encoder_decoder.py``      T5, BART (and their kin)                                  --
``torchvision_cnn.py``      MobileNetV2, EfficientNet, ConvNeXt, DenseNet, VGG,        MobileNetV2, ResNet
                            ResNet
``torchvision_vit.py``      torchvision ViT, Swin                                     ViT
``timm_models.py``          timm models (when timm is installed)                      --
``sequential.py``           ``nn.Sequential``                                         yes
``generic.py``              fallback: the longest stack of same-type layers           --
==========================  ========================================================  =====================

Add a family: write a file with a discoverer decorated by :func:`~layerfreeze.models.registry.register_blocks`
(and optionally a :class:`~layerfreeze.models.forward_split.ModelSplit` subclass decorated by
:func:`~layerfreeze.models.registry.register_split`) and import it before discovery runs; the README's "Add your own
model family" shows one. Only :mod:`layerfreeze.models.discovery` imports this package.
"""

# Importing each file registers its family (registration order: alphabetical; each family's `order` decides).
from layerfreeze.models.families import (  # noqa: F401
    bert,
    decoder_lm,
    encoder_decoder,
    generic,
    hf_vision,
    sequential,
    timm_models,
    torchvision_cnn,
    torchvision_vit,
)
