"""The demo's models: the tiny diffusers VAE, UNet and ControlNet, the frozen text encoder, stage-1 training
cached on disk with checksums."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.controlnet.config import DemoConfig
from benchmarks.controlnet.data import CLASS_NAMES, load_images
from layerfreeze.checkpoint import load_checkpoint, save_checkpoint
from layerfreeze.errors import CheckpointError

PROMPT_TOKENS = 12  # prompts padded to this many tokens ("[CLS] a photo of a ankle boot [SEP] [PAD]...")


def _vae_config(tiny: bool) -> dict[str, Any]:
    widths = (8, 16, 16) if tiny else (16, 32, 32)
    return {"in_channels": 1, "out_channels": 1, "down_block_types": ["DownEncoderBlock2D"] * 3,
            "up_block_types": ["UpDecoderBlock2D"] * 3, "block_out_channels": list(widths), "layers_per_block": 1,
            "latent_channels": 4, "norm_num_groups": 8, "sample_size": 32}


def _unet_config(tiny: bool, text_dim: int) -> dict[str, Any]:
    return {"sample_size": 8, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
            "block_out_channels": [16, 32] if tiny else [32, 64],
            "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
            "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "cross_attention_dim": text_dim,
            "attention_head_dim": 8, "norm_num_groups": 8 if tiny else 16}


def build_controlnet(unet: nn.Module, tiny: bool) -> nn.Module:
    """``ControlNetModel.from_unet(unet)`` for a one-channel 32x32 edge map (two stride-2 steps to the 8x8 latents).

    Its zero convolutions start at zero, so at step 0 the UNet with control is the UNet without.
    """
    from diffusers import ControlNetModel

    return ControlNetModel.from_unet(unet, conditioning_channels=1,
                                     conditioning_embedding_out_channels=(8, 8, 16) if tiny else (16, 16, 32))


class LatentParameters(nn.Module):
    """The VAE's latent distribution, not a sample: ``vae.encode(x).latent_dist.parameters``.

    Input ``(B, 1, 32, 32)`` in [-1, 1]; output ``(B, 8, 8, 8)``: mean (channels 0-3) and log-variance (4-7) of
    diffusers' ``DiagonalGaussianDistribution``. Returning the parameters keeps the frozen function free of the
    global RNG (so it can run in a worker or be precomputed); the trainer samples with its own generator.
    """

    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.vae.encode(pixels).latent_dist.parameters


class TextEncoder(nn.Module):
    """A BERT's last hidden state ``(B, L, D)`` for token ids ``(B, L)`` (MiniLM-L6: D = 384)."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def text_encoder_and_prompts(tiny: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The frozen text encoder and the ten class prompts' token ids and attention masks ``(10, 12)``.

    Full size: MiniLM-L6 from its offline package, prompts "a photo of a <class name>". Tiny: a random 1-layer
    BERT of width 32 and random token ids.

    Raises:
        AssetMissingError: MiniLM-L6 is not installed (full size).
    """
    from transformers import BertConfig, BertModel

    from layerfreeze.train.loaders import quiet_transformers

    quiet_transformers()
    if tiny:
        torch.manual_seed(0)
        bert = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=64), add_pooling_layer=False)
        ids = torch.randint(1, 64, (10, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))
        return TextEncoder(bert), ids, torch.ones_like(ids)
    from transformers import AutoModel, AutoTokenizer

    from layerfreeze.train.assets import minilm_dir

    folder = minilm_dir()
    tokens = AutoTokenizer.from_pretrained(folder, local_files_only=True)(
        [f"a photo of a {name}" for name in CLASS_NAMES], padding="max_length", max_length=PROMPT_TOKENS,
        truncation=True, return_tensors="pt")
    bert = AutoModel.from_pretrained(folder, local_files_only=True)
    return TextEncoder(bert), tokens["input_ids"], tokens["attention_mask"]


def noise_scheduler() -> Any:
    """The DDPM noise schedule of the demo (1,000 steps, diffusers' defaults: linear betas 1e-4 to 0.02)."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(num_train_timesteps=1000)


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _cached(path: Path, model: nn.Module, train: Callable[[], dict[str, Any]], log: Callable[[str], None]
            ) -> dict[str, Any]:
    """Load ``model`` from checkpoint folder ``path`` (SHA-256 verified) or ``train()`` it and save it there."""
    if path.exists():
        try:
            return load_checkpoint(path, model, restore_rng=False)
        except CheckpointError as exc:
            log(f"stage-1 cache {path} unusable ({exc}); training again")
    extra = train()
    save_checkpoint(path, model, extra=extra)
    return extra


def step_batches(n: int, batch_size: int, steps: int, seed: int) -> Iterator[list[int]]:
    """``steps`` batches of indices, epochs of a seeded permutation (the last partial batch of an epoch dropped)."""
    epoch, done = 0, 0
    while True:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
        for i in range(0, n - batch_size + 1, batch_size):
            if done == steps:
                return
            yield order[i:i + batch_size]
            done += 1
        epoch += 1


def _fit(model: nn.Module, loss_of: Callable[[list[int]], torch.Tensor], n: int, steps: int, lr: float, seed: int,
         name: str, log: Callable[[str], None]) -> float:
    """Train ``model`` with AdamW on ``steps`` seeded batches of 64 of ``n`` indices; eval mode after; last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step, idx in enumerate(step_batches(n, 64, steps, seed)):
        loss = loss_of(idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            log(f"  {name} step {step}: loss {loss.item():.4f}")
    model.eval()
    return loss.item()


def denoising_loss(latents: torch.Tensor, text: torch.Tensor, g: torch.Generator, scheduler: Any,
                    predict: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Epsilon-prediction DDPM loss: noise and timesteps drawn from ``g`` (CPU), ``predict(noisy, t, text)``."""
    noise = torch.randn(latents.shape, generator=g).to(latents.device)
    t = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), generator=g).to(latents.device)
    return F.mse_loss(predict(scheduler.add_noise(latents, noise, t), t, text), noise)


@dataclass
class Stage1:
    """The frozen models and what they were trained on."""

    vae: nn.Module
    unet: nn.Module
    text: nn.Module
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    scaling: float
    info: dict[str, Any] = field(default_factory=dict)


def stage1_models(cfg: DemoConfig, log: Callable[[str], None] = print) -> Stage1:
    """Train (or load from ``cfg.cache_dir``) the frozen VAE and UNet; load the frozen text encoder.

    Tiny config: untrained models (nothing cached). Full config: the VAE trains ``vae_steps`` steps (AdamW 1e-3,
    batch 64, MSE reconstruction + 1e-4 x KL), its latent scaling factor is 1 / std of the latent means; the UNet
    trains ``unet_steps`` steps (AdamW 3e-4, batch 64) on the latents of the same images with their class prompts.
    Both are saved as checkpoint folders (safetensors + SHA-256) under a name made of their configuration, so a
    changed configuration trains again and a corrupt file is detected, not loaded.

    Raises:
        AssetMissingError: Fashion-MNIST or MiniLM-L6 is not installed (full size).
    """
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    text, ids, mask = text_encoder_and_prompts(cfg.tiny)
    text.eval().requires_grad_(False)
    text_dim = text.bert.config.hidden_size
    torch.manual_seed(cfg.seed)
    vae = AutoencoderKL(**_vae_config(cfg.tiny))
    unet = UNet2DConditionModel(**_unet_config(cfg.tiny, text_dim))
    if cfg.tiny:
        return Stage1(vae.eval().requires_grad_(False), unet.eval().requires_grad_(False), text, ids, mask, 1.0,
                      {"trained": False})
    images, labels = load_images("train", cfg.stage1_size)
    dev = torch.device(cfg.device)  # stage 1 trains on the trainer's device; the cache holds CPU weights
    vae_key = {"vae": _vae_config(False), "steps": cfg.vae_steps, "n": len(labels), "seed": cfg.seed, "v": 1}
    cache = Path(cfg.cache_dir)

    def train_vae() -> dict[str, Any]:
        log(f"stage 1: training the VAE ({cfg.vae_steps} steps of 64 images)")
        start, g = time.perf_counter(), torch.Generator().manual_seed(cfg.seed)

        def loss_of(idx: list[int]) -> torch.Tensor:
            x = images[idx].to(dev)
            posterior = vae.encode(x).latent_dist
            recon = vae.decode(posterior.sample(generator=g)).sample
            return F.mse_loss(recon, x) + 1e-4 * posterior.kl().mean() / x[0].numel()

        loss = _fit(vae.to(dev), loss_of, len(labels), cfg.vae_steps, 1e-3, cfg.seed + 1, "vae", log)
        with torch.no_grad():
            means = torch.cat([vae.encode(images[i:i + 256].to(dev)).latent_dist.mean
                               for i in range(0, min(4096, len(labels)), 256)])
        vae.cpu()
        return {"key": vae_key, "scaling": float(1 / means.std()), "loss": loss,
                "seconds": time.perf_counter() - start}

    vae_info = _cached(cache / f"vae-{_fingerprint(vae_key)}", vae, train_vae, log)
    vae.eval().requires_grad_(False)
    scaling = vae_info["scaling"]
    unet_key = {"unet": _unet_config(False, text_dim), "vae": vae_key, "steps": cfg.unet_steps, "v": 1}

    def train_unet() -> dict[str, Any]:
        log(f"stage 1: training the UNet ({cfg.unet_steps} steps of 64 latents)")
        start = time.perf_counter()
        with torch.no_grad():
            vae.to(dev)
            params = torch.cat([vae.encode(images[i:i + 256].to(dev)).latent_dist.parameters
                                for i in range(0, len(labels), 256)])
            prompts = text.to(dev)(ids.to(dev), mask.to(dev))
            vae.cpu(), text.cpu()
        g, scheduler = torch.Generator().manual_seed(cfg.seed + 2), noise_scheduler()

        def loss_of(idx: list[int]) -> torch.Tensor:
            latents = DiagonalGaussianDistribution(params[idx]).sample(generator=g) * scaling
            return denoising_loss(latents, prompts[labels[idx].to(dev)], g, scheduler,
                                   lambda z, t, c: unet(z, t, encoder_hidden_states=c).sample)

        loss = _fit(unet.to(dev), loss_of, len(labels), cfg.unet_steps, 3e-4, cfg.seed + 3, "unet", log)
        unet.cpu()
        return {"key": unet_key, "loss": loss, "seconds": time.perf_counter() - start}

    unet_info = _cached(cache / f"unet-{_fingerprint(unet_key)}", unet, train_unet, log)
    unet.eval().requires_grad_(False)
    return Stage1(vae, unet, text, ids, mask, scaling, {"trained": True, "vae": vae_info, "unet": unet_info})
