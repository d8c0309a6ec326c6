"""The recipes' networks: small MLPs and CNNs, a tiny ViT, a narrow ResNet, tiny GPT-2 and Llama decoders built
from configs (nothing downloaded), and the forward of a Hugging Face classifier. The installed MobileNetV2 and
MiniLM-L6 come from :mod:`layerfreeze.train.loaders`.
"""

from __future__ import annotations

import torch
from torch import nn


def hf_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of a Hugging Face sequence classifier from a tokenized batch."""
    return model(**{k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}).logits


def mlp(sizes: list[int]) -> nn.Sequential:
    """``Flatten`` then Linear-ReLU pairs; blocks are the Linear layers (the last is the head)."""
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def small_cnn(in_ch: int, widths: list[int], pools: list[bool], spatial: int, hidden: int, classes: int
              ) -> nn.Sequential:
    """One block per conv stage (Conv3x3-BN-ReLU[-MaxPool]), then a Flatten-Linear-ReLU block and the head."""
    stages: list[nn.Module] = []
    c = in_ch
    for w, pool in zip(widths, pools):
        mods: list[nn.Module] = [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU()]
        if pool:
            mods.append(nn.MaxPool2d(2))
            spatial //= 2
        stages.append(nn.Sequential(*mods))
        c = w
    stages.append(nn.Sequential(nn.Flatten(), nn.Linear(c * spatial * spatial, hidden), nn.ReLU()))
    stages.append(nn.Linear(hidden, classes))
    return nn.Sequential(*stages)


class PatchEmbed(nn.Module):
    """Non-overlapping ``patch`` x ``patch`` patches -> tokens ``(B, N, dim)`` plus learned positions."""

    def __init__(self, in_ch: int, size: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_ch, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, (size // patch) ** 2, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos


class MeanPoolHead(nn.Module):
    """LayerNorm, mean over tokens, Linear."""

    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).mean(dim=1))


def tiny_vit(size: int, patch: int, dim: int, depth: int, heads: int, classes: int) -> nn.Sequential:
    """A pre-norm ViT as an ``nn.Sequential``: patch embedding, ``depth`` encoder layers, mean-pool head."""
    layers = [nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                         norm_first=True) for _ in range(depth)]
    return nn.Sequential(PatchEmbed(1, size, patch, dim), *layers, MeanPoolHead(dim, classes))


class NarrowResNet(nn.Module):
    """A ResNet with torchvision's BasicBlock, one block per stage and narrow widths, for small images.

    Has ``conv1``, ``bn1``, ``layer1``..``layer4``, ``fc``, so :func:`~layerfreeze.models.discovery.discover_blocks`
    sees the torchvision ResNet blocks (stem, layer1..4, fc).
    """

    def __init__(self, in_ch: int = 1, widths: tuple[int, ...] = (16, 32, 64, 128), classes: int = 10) -> None:
        super().__init__()
        from torchvision.models.resnet import BasicBlock

        self.conv1 = nn.Conv2d(in_ch, widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        c = widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            down = None
            if stride != 1 or c != w:
                down = nn.Sequential(nn.Conv2d(c, w, 1, stride=stride, bias=False), nn.BatchNorm2d(w))
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(c, w, stride, down)))
            c = w
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def tiny_gpt2(vocab: int, context: int, dim: int, depth: int, heads: int) -> nn.Module:
    """A GPT-2 (``GPT2LMHeadModel`` from a config, random init; LM head tied to the token embeddings as in
    GPT-2) with dropout off: a from-scratch run that sees each token under once needs no regularisation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from layerfreeze.train.loaders import quiet_transformers

    quiet_transformers()
    cfg = GPT2Config(vocab_size=vocab, n_positions=context, n_embd=dim, n_layer=depth, n_head=heads,
                     n_inner=4 * dim, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                     eos_token_id=None, pad_token_id=None)
    return GPT2LMHeadModel(cfg)


def tiny_llama(vocab: int, context: int, dim: int, depth: int, heads: int) -> nn.Module:
    """A Llama (``LlamaForCausalLM`` from a config, random init): RMSNorm, rotary positions, SwiGLU MLP of width
    ``8/3 * dim`` rounded up to a multiple of 32, grouped-query attention (half as many key/value heads), and an
    LM head untied from the embeddings (as Llama 2/3), so the head block trains its own ``(vocab, dim)`` matrix
    where the GPT-2 recipe's head owns only its final norm."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from layerfreeze.train.loaders import quiet_transformers

    quiet_transformers()
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=-(-8 * dim // 96) * 32,
                      num_hidden_layers=depth, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      max_position_embeddings=context, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg)
