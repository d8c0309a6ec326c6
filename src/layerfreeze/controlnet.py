"""A ControlNet trained beside a frozen VAE, a frozen text encoder and a frozen base denoiser, under four placements.

The question: when a ControlNet trains on one device while the frozen VAE and Transformer models run elsewhere,
does training change, and what happens to memory, speed and stability? This module answers it with real
``diffusers`` models, offline, in minutes on a CPU (and on GPUs with ``frozen_device="cuda:1"``):

* stage 1 (trained here, never downloaded, cached on disk with checksums by :func:`~layerfreeze.checkpoint.
  save_checkpoint`): a tiny ``AutoencoderKL`` on Fashion-MNIST (28x28 padded to 32x32, values in [-1, 1],
  latents ``(4, 8, 8)``), then a tiny ``UNet2DConditionModel`` (``cross_attention_dim=384``) trained to denoise
  those latents given the class name ("a photo of a sneaker") encoded by the frozen MiniLM-L6
  (:func:`layerfreeze.assets.minilm_dir`);
* stage 2: ``ControlNetModel.from_unet`` (Zhang, Rao, Agrawala, "Adding Conditional Control to Text-to-Image
  Diffusion Models", ICCV 2023; diffusers ``examples/controlnet/train_controlnet.py``) trained on an edge map
  (Sobel) of the image, with the VAE, text encoder and UNet frozen. The loss backpropagates through the frozen
  UNet (:class:`~layerfreeze.frozen.FrozenDifferentiable`) into the ControlNet's residuals.

Placements (:data:`PLACEMENTS`), same seed, same batches, same random numbers (float32 losses are then equal bit for
bit when the trainer runs with the same number of intra-op threads in every placement; the worker placement splits
the cores, and a CPU reduction over 1 thread rounds differently from one over 2, by about 1e-7):

``device``      frozen models on the trainer's device, called in the training loop (diffusers' script);
``worker``      VAE and text encoder in a :class:`~layerfreeze.frozen.FrozenPipeline` worker (on CPU the stand-in
                for another device; on GPUs, ``frozen_device``); the UNet stays in the gradient path;
``precompute``  the VAE's latent *distribution* (mean and log-variance) per image and the ten prompts' embeddings
                computed once (:func:`~layerfreeze.frozen.precompute`); the trainer samples the latents;
``bf16``        like ``device`` with the three frozen models in bfloat16 (the ControlNet stays float32).

RNG safety: the frozen VAE returns ``latent_dist.parameters``; the trainer samples the latents
(``DiagonalGaussianDistribution(parameters).sample(generator=g)``), the noise and the timesteps with its own
``torch.Generator``, so no placement changes a random number.

:func:`run_demo` returns and writes (``results.json``, ``table.md``, ``report/index.html`` with a loss-curve plot)
per placement: max |loss difference| to the first placement over every step, held-out denoising loss with and
without control, step time, throughput, one-off precompute time, parameter bytes and peak memory per device,
the pipeline's overlap, and stability (non-finite outputs named, loss std over the last window, ControlNet
gradient norm). ``benchmarks/controlnet.py`` is the command.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import html
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from . import measure, telemetry
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .frozen import (
    FrozenDifferentiable,
    FrozenModule,
    FrozenPipeline,
    NonFiniteOutputError,
    PrecomputedDataset,
    precompute,
)

__all__ = [
    "CLASS_NAMES",
    "PLACEMENTS",
    "DemoConfig",
    "EdgeDataset",
    "LatentParameters",
    "TextEncoder",
    "edge_maps",
    "format_table",
    "load_images",
    "run_demo",
    "stage1_models",
    "write_report",
]

CLASS_NAMES = ("T-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
               "ankle boot")
PLACEMENTS = ("device", "worker", "precompute", "bf16")
PROMPT_TOKENS = 12  # prompts padded to this many tokens ("[CLS] a photo of a ankle boot [SEP] [PAD]...")


@dataclass
class DemoConfig:
    """Sizes of the demo; the defaults are the full demo (about 12 minutes on 2 CPU cores).

    ``tiny=True`` is the CI size: untrained small models, random images, a random small text encoder, no assets.
    """

    steps: int = 300                  # ControlNet steps per placement
    batch_size: int = 64
    train_size: int = 6400            # ControlNet training images (the first ones of the train split)
    heldout_size: int = 1024          # held-out images (the first ones of the test split)
    vae_steps: int = 400
    unet_steps: int = 600
    stage1_size: int = 20000          # images the VAE and the UNet train on (the first ones of the train split)
    lr: float = 1e-3                  # ControlNet AdamW learning rate
    seed: int = 0
    device: str = "cpu"               # the trainer's (ControlNet's) device
    frozen_device: str | None = None  # the frozen models' device (default: the trainer's)
    placements: tuple[str, ...] = PLACEMENTS
    window: int = 50                  # loss std over the last `window` steps
    tiny: bool = False
    cache_dir: str = "runs/controlnet-stage1"
    threads: int | None = None        # intra-op threads of the trainer (None: leave)
    pipeline_threads: str | tuple[int, int] = "auto"  # FrozenPipeline(threads=...) of the worker placement

    def __post_init__(self) -> None:
        bad = [p for p in self.placements if p not in PLACEMENTS]
        if bad or not self.placements:
            raise ValueError(f"unknown placement(s) {bad}; choose from {', '.join(PLACEMENTS)}")
        for name in ("steps", "batch_size", "train_size", "heldout_size", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.train_size < self.batch_size:
            raise ValueError(f"train_size ({self.train_size}) must hold at least one batch ({self.batch_size})")


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------
def load_images(split: str, limit: int, root: str | Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST images padded from 28x28 to 32x32, as the VAE sees them.

    Args:
        split: ``"train"`` or ``"test"``.
        limit: Keep the first ``limit`` images.
        root: Folder of the IDX files (default :func:`layerfreeze.assets.fashion_mnist_dir`).

    Returns:
        ``images (N, 1, 32, 32)`` float32 in [-1, 1] (background -1) and ``labels (N,)`` int64 in 0..9.

    Raises:
        ValueError: bad ``split``; AssetMissingError: Fashion-MNIST is not installed.
    """
    from .assets import fashion_mnist_dir
    from .data import _read_idx

    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    folder = Path(root) if root is not None else fashion_mnist_dir()
    prefix = "train" if split == "train" else "t10k"
    images = _read_idx(folder / f"{prefix}-images-idx3-ubyte.gz", "images")[:limit]
    labels = _read_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", "labels")[:limit]
    x = torch.from_numpy(images.copy()).float().div(127.5).sub(1.0).unsqueeze(1)
    return F.pad(x, (2, 2, 2, 2), value=-1.0), torch.from_numpy(labels.astype(np.int64))


def random_images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` smooth random 32x32 images in [-1, 1] and labels, for the CI-sized run (no assets)."""
    g = torch.Generator().manual_seed(seed)
    x = F.interpolate(torch.rand(n, 1, 8, 8, generator=g), size=(32, 32), mode="bilinear", align_corners=False)
    return x.mul(2).sub(1), torch.randint(0, 10, (n,), generator=g)


def edge_maps(images: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """Binary edge maps (Sobel gradient magnitude above ``threshold``), the ControlNet's condition.

    Args:
        images: ``(N, 1, H, W)`` in [-1, 1].

    Returns:
        ``(N, 1, H, W)`` float32 in {0, 1}.
    """
    if images.dim() != 4 or images.shape[1] != 1:
        raise ValueError(f"images must be (N, 1, H, W), got {tuple(images.shape)}")
    kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]]).view(1, 1, 3, 3) / 4
    x = (images + 1) / 2
    gx, gy = F.conv2d(x, kx, padding=1), F.conv2d(x, kx.transpose(2, 3), padding=1)
    return ((gx**2 + gy**2).sqrt() > threshold).float()


class EdgeDataset(Dataset):
    """Items ``{"pixels": (1, 32, 32), "edges": (1, 32, 32), "labels": (), "index": ()}``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels, self.edges = images, labels, edge_maps(images)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixels": self.images[i], "edges": self.edges[i], "labels": self.labels[i],
                "index": torch.tensor(i, dtype=torch.int64)}


# ---------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------
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

    from .tasks import _quiet_transformers

    _quiet_transformers()
    if tiny:
        torch.manual_seed(0)
        bert = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=64), add_pooling_layer=False)
        ids = torch.randint(1, 64, (10, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))
        return TextEncoder(bert), ids, torch.ones_like(ids)
    from transformers import AutoModel, AutoTokenizer

    from .assets import minilm_dir

    folder = minilm_dir()
    tokens = AutoTokenizer.from_pretrained(folder, local_files_only=True)(
        [f"a photo of a {name}" for name in CLASS_NAMES], padding="max_length", max_length=PROMPT_TOKENS,
        truncation=True, return_tensors="pt")
    bert = AutoModel.from_pretrained(folder, local_files_only=True)
    return TextEncoder(bert), tokens["input_ids"], tokens["attention_mask"]


def _scheduler() -> Any:
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


def _batches(n: int, batch_size: int, steps: int, seed: int) -> Iterator[list[int]]:
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
    for step, idx in enumerate(_batches(n, 64, steps, seed)):
        loss = loss_of(idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            log(f"  {name} step {step}: loss {loss.item():.4f}")
    model.eval()
    return loss.item()


def _denoising_loss(latents: torch.Tensor, text: torch.Tensor, g: torch.Generator, scheduler: Any,
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
        g, scheduler = torch.Generator().manual_seed(cfg.seed + 2), _scheduler()

        def loss_of(idx: list[int]) -> torch.Tensor:
            latents = DiagonalGaussianDistribution(params[idx]).sample(generator=g) * scaling
            return _denoising_loss(latents, prompts[labels[idx].to(dev)], g, scheduler,
                                   lambda z, t, c: unet(z, t, encoder_hidden_states=c).sample)

        loss = _fit(unet.to(dev), loss_of, len(labels), cfg.unet_steps, 3e-4, cfg.seed + 3, "unet", log)
        unet.cpu()
        return {"key": unet_key, "loss": loss, "seconds": time.perf_counter() - start}

    unet_info = _cached(cache / f"unet-{_fingerprint(unet_key)}", unet, train_unet, log)
    unet.eval().requires_grad_(False)
    return Stage1(vae, unet, text, ids, mask, scaling, {"trained": True, "vae": vae_info, "unet": unet_info})


# ---------------------------------------------------------------------------------------------------------------
# Stage 2: the ControlNet under each placement
# ---------------------------------------------------------------------------------------------------------------
def _param_bytes(modules: dict[str, nn.Module]) -> dict[str, int]:
    """Parameter bytes per device over ``modules`` (shared parameters once)."""
    seen, out = set(), {}
    for module in modules.values():
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out[str(p.device)] = out.get(str(p.device), 0) + p.numel() * p.element_size()
    return out


def _devices(cfg: DemoConfig) -> list[str]:
    return sorted({cfg.device, cfg.frozen_device or cfg.device})


class _Heldout:
    """Fixed held-out inputs (latent samples, noise, timesteps, prompts, edges) and float32 frozen models."""

    def __init__(self, cfg: DemoConfig, stage1: Stage1, data: EdgeDataset) -> None:
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        g = torch.Generator().manual_seed(cfg.seed + 10_000)
        dev = torch.device(cfg.device)
        self.unet = FrozenDifferentiable(copy.deepcopy(stage1.unet), device=dev, output_device=dev,
                                         name="UNet (eval)")
        self.chunks = []
        vae = FrozenModule(LatentParameters(copy.deepcopy(stage1.vae)), device=dev, output_device=dev,
                           name="VAE encoder (eval)")
        text = FrozenModule(copy.deepcopy(stage1.text), device=dev, output_device=dev, name="text encoder (eval)")
        scheduler = _scheduler()
        for i in range(0, len(data), cfg.batch_size):
            b = data.labels[i:i + cfg.batch_size]
            latents = DiagonalGaussianDistribution(vae(data.images[i:i + cfg.batch_size])).sample(generator=g)
            latents = latents * stage1.scaling
            noise = torch.randn(latents.shape, generator=g).to(dev)
            t = torch.randint(0, scheduler.config.num_train_timesteps, (len(b),), generator=g).to(dev)
            self.chunks.append((scheduler.add_noise(latents, noise, t), t, noise,
                                text(stage1.prompt_ids[b], stage1.prompt_mask[b]),
                                data.edges[i:i + cfg.batch_size].to(dev)))

    @torch.no_grad()
    def loss(self, controlnet: nn.Module | None) -> float:
        """Mean denoising MSE over the held-out set, with ``controlnet``'s residuals or without (None)."""
        total, n = 0.0, 0
        for noisy, t, noise, text, edges in self.chunks:
            extra = {}
            if controlnet is not None:
                down, mid = controlnet(noisy, t, encoder_hidden_states=text, controlnet_cond=edges, return_dict=False)
                extra = {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}
            pred = self.unet(noisy, t, encoder_hidden_states=text, **extra).sample
            total += F.mse_loss(pred, noise, reduction="sum").item()
            n += noise.numel()
        return total / n


def _train_placement(placement: str, cfg: DemoConfig, stage1: Stage1, data: EdgeDataset, heldout: _Heldout,
                     log: Callable[[str], None]) -> dict[str, Any]:
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    dev = torch.device(cfg.device)
    frozen_dev = torch.device(cfg.frozen_device or cfg.device)
    dtype = torch.bfloat16 if placement == "bf16" else None
    for d in _devices(cfg):
        measure.reset_peak_memory(d)
    memory_at_start = {d: measure.current_memory_bytes(d) for d in _devices(cfg)}
    # Each placement gets its own copies (a bfloat16 cast in place would round the float32 weights for good).
    vae = FrozenModule(LatentParameters(copy.deepcopy(stage1.vae)), device=frozen_dev, dtype=dtype,
                       output_device=dev, name=f"VAE encoder ({placement})")
    text = FrozenModule(copy.deepcopy(stage1.text), device=frozen_dev, dtype=dtype, output_device=dev,
                        name=f"text encoder ({placement})")
    unet = FrozenDifferentiable(copy.deepcopy(stage1.unet), device=frozen_dev, dtype=dtype, output_device=dev,
                                name=f"UNet ({placement})")
    torch.manual_seed(cfg.seed)
    controlnet = build_controlnet(stage1.unet, cfg.tiny).to(dev).train()  # from the float32 UNet
    opt = torch.optim.AdamW(controlnet.parameters(), lr=cfg.lr)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    prompts = None
    source: Dataset = data
    precompute_s = 0.0
    store = None
    if placement == "precompute":
        start = time.perf_counter()
        store = precompute(data, lambda b: vae(b["pixels"]), batch_size=cfg.batch_size)
        with torch.no_grad():  # each prompt in a batch of the training size: CPU GEMMs round by batch size
            prompts = torch.stack([text(stage1.prompt_ids[[c] * cfg.batch_size],
                                        stage1.prompt_mask[[c] * cfg.batch_size])[0] for c in range(10)])
        precompute_s = time.perf_counter() - start
        source = PrecomputedDataset(data, store, feature_key="latent_params", drop=("pixels",))
        vae = text = None  # not needed any more: training holds only the UNet, the ControlNet and the store

    def prepare(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        labels = batch["labels"]
        if prompts is not None:
            return {"latent_params": batch["latent_params"].to(dev), "text": prompts[labels.to(dev)],
                    "edges": batch["edges"].to(dev)}
        return {"latent_params": vae(batch["pixels"]),
                "text": text(stage1.prompt_ids[labels], stage1.prompt_mask[labels]), "edges": batch["edges"].to(dev)}

    loader = DataLoader(source, batch_sampler=list(_batches(len(data), cfg.batch_size, cfg.steps, cfg.seed)))
    pipe = FrozenPipeline(loader, prepare, queue_size=2, threads=cfg.pipeline_threads) if placement == "worker" \
        else None
    batches = pipe if pipe is not None else (prepare(b) for b in loader)
    scheduler = _scheduler()
    losses, grad_norms, step_s, nonfinite, trainer_threads = [], [], [], None, torch.get_num_threads()
    before = heldout.loss(controlnet)
    start = last = time.perf_counter()
    try:
        for batch in batches:
            latents = DiagonalGaussianDistribution(batch["latent_params"]).sample(generator=g) * stage1.scaling

            def predict(noisy: torch.Tensor, t: torch.Tensor, text_states: torch.Tensor,
                        edges: torch.Tensor = batch["edges"]) -> torch.Tensor:
                down, mid = controlnet(noisy, t, encoder_hidden_states=text_states, controlnet_cond=edges,
                                       return_dict=False)
                return unet(noisy, t, encoder_hidden_states=text_states, down_block_additional_residuals=down,
                            mid_block_additional_residual=mid).sample

            loss = _denoising_loss(latents, batch["text"], g, scheduler, predict)
            trainer_threads = torch.get_num_threads()  # the pipeline's share while it runs
            loss.backward()
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(controlnet.parameters(), 1.0)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if not math.isfinite(losses[-1]) and nonfinite is None:
                nonfinite = f"loss is {losses[-1]} at step {len(losses) - 1}"
            now = time.perf_counter()
            step_s.append(now - last)
            last = now
            if len(losses) % 50 == 0:
                log(f"  {placement} step {len(losses)}: loss {losses[-1]:.4f}")
    except NonFiniteOutputError as exc:
        nonfinite = str(exc).split(". In float16")[0]
        log(f"  {placement}: stopped, {nonfinite}")
    finally:
        if pipe is not None:
            pipe.close()
    train_s = time.perf_counter() - start
    stats = pipe.stats() if pipe is not None else None
    controlnet.eval()
    modules = {"unet": unet.module, "controlnet": controlnet}
    if vae is not None:
        modules.update(vae=vae.module, text=text.module)
    warm = step_s[2:] or step_s
    result = {
        "placement": placement, "losses": losses, "grad_norms": grad_norms, "steps": len(losses),
        "heldout_control_step0": before, "heldout_control": heldout.loss(controlnet),
        "step_s_median": statistics.median(warm) if warm else float("nan"),
        "step_s_mean": statistics.fmean(warm) if warm else float("nan"), "train_s": train_s,
        "throughput": cfg.batch_size / statistics.fmean(warm) if warm else float("nan"),
        "precompute_s": precompute_s,
        "store_bytes": store.size_bytes + prompts.numel() * prompts.element_size() if store is not None else 0,
        "param_bytes": _param_bytes(modules),
        "frozen_param_bytes": _param_bytes({k: v for k, v in modules.items() if k != "controlnet"}),
        "peak_memory": {d: measure.peak_memory_bytes(d) for d in _devices(cfg)},
        "memory_at_start": memory_at_start,
        "pipeline": stats, "nonfinite": nonfinite, "trainer_threads": trainer_threads,
        "loss_std_window": statistics.pstdev(losses[-cfg.window:]) if len(losses) > 1 else float("nan"),
        "grad_norm_mean": statistics.fmean(grad_norms) if grad_norms else float("nan"),
        "grad_norm_max": max(grad_norms) if grad_norms else float("nan"),
        "controlnet_grad_dtypes": sorted({str(p.dtype) for p in controlnet.parameters()}),
    }
    if store is not None:
        store.close()
    return result


def run_demo(cfg: DemoConfig, out: str | Path | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train the ControlNet under every placement of ``cfg.placements`` and compare them.

    Args:
        cfg: Sizes and devices.
        out: Run folder for ``results.json``, ``table.md`` and ``report/index.html`` (None: write nothing).
        log: Progress lines.

    Returns:
        ``{"config", "stage1", "heldout_no_control", "placements": [per-placement dicts], "table"}``; each
        placement dict holds ``max_abs_loss_diff`` (to the first placement, over every step it ran) and the
        fields listed in the module docstring.

    Raises:
        AssetMissingError: a needed offline asset is not installed (full size).
    """
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # "modules ... should be kept in float32: []" on every bf16 cast
    threads_before = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run_demo(cfg, out, log)
    finally:
        torch.set_num_threads(threads_before)


def _run_demo(cfg: DemoConfig, out: str | Path | None, log: Callable[[str], None]) -> dict[str, Any]:
    total = time.perf_counter()
    stage1 = stage1_models(cfg, log)
    if cfg.tiny:
        train = EdgeDataset(*random_images(cfg.train_size, cfg.seed))
        held = EdgeDataset(*random_images(cfg.heldout_size, cfg.seed + 1))
    else:
        train = EdgeDataset(*load_images("train", cfg.train_size))
        held = EdgeDataset(*load_images("test", cfg.heldout_size))
    heldout = _Heldout(cfg, stage1, held)
    no_control = heldout.loss(None)
    log(f"held-out denoising loss without control: {no_control:.4f}")
    rows = []
    for placement in cfg.placements:
        log(f"stage 2: ControlNet, placement {placement!r} ({cfg.steps} steps of {cfg.batch_size})")
        rows.append(_train_placement(placement, cfg, stage1, train, heldout, log))
        log(f"  {placement}: held-out loss with control {rows[-1]['heldout_control']:.4f} "
            f"(without {no_control:.4f}); median step {rows[-1]['step_s_median']:.3f} s")
    first = rows[0]["losses"]
    for r in rows:
        n = min(len(first), len(r["losses"]))
        r["max_abs_loss_diff"] = max((abs(a - b) for a, b in zip(first[:n], r["losses"][:n])), default=float("nan"))
        r["losses_identical"] = r["losses"] == first
    result = {"config": dataclasses.asdict(cfg), "stage1": stage1.info, "heldout_no_control": no_control,
              "placements": rows, "total_s": time.perf_counter() - total,
              "threads": torch.get_num_threads()}
    result["table"] = format_table(result)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=2, default=str))
        (out / "table.md").write_text(result["table"] + "\n")
        write_report(result, out / "report")
    return result


# ---------------------------------------------------------------------------------------------------------------
# Table and report
# ---------------------------------------------------------------------------------------------------------------
def _per_device(values: dict[str, int], start: dict[str, int] | None = None) -> str:
    """``cpu 1.2 GiB`` per device; with ``start``, the growth over it too: ``cpu 1.2 GiB (+80 MiB)``."""
    def cell(d: str, v: int) -> str:
        grown = f" (+{telemetry.format_bytes(max(0, v - start[d]))})" if start and d in start else ""
        return f"{d} {telemetry.format_bytes(v)}{grown}"

    return ", ".join(cell(d, v) for d, v in values.items())


TABLE_HEADERS = ("placement", "trainer threads", "max abs loss diff", "held-out loss ctrl / no ctrl", "step ms",
                 "img/s", "precompute s", "frozen params held in training", "peak memory (+ over start)", "overlap",
                 "non-finite", "loss std (last)", "grad norm mean / max")


def _headers(window: int) -> list[str]:
    return [f"loss std (last {window})" if h == "loss std (last)" else h for h in TABLE_HEADERS]


def _row_cells(r: dict[str, Any], no_control: float) -> list[str]:
    overlap = f"{r['pipeline']['overlap']:.0%}" if r.get("pipeline") else "-"
    threads = str(r["trainer_threads"])
    if r.get("pipeline") and r["pipeline"]["threads"]:
        threads += f" + worker {r['pipeline']['threads'][0]}"
    return [r["placement"], threads, "0 (identical)" if r["losses_identical"] else f"{r['max_abs_loss_diff']:.2e}",
            f"{r['heldout_control']:.4f} / {no_control:.4f}", f"{1000 * r['step_s_median']:.0f}",
            f"{r['throughput']:.0f}",
            f"{r['precompute_s']:.1f} (stored {telemetry.format_bytes(r['store_bytes'])})" if r["store_bytes"] else "-",
            _per_device(r["frozen_param_bytes"]), _per_device(r["peak_memory"], r.get("memory_at_start")), overlap,
            r["nonfinite"] or "none",
            f"{r['loss_std_window']:.4f}", f"{r['grad_norm_mean']:.3f} / {r['grad_norm_max']:.3f}"]


def format_table(result: dict[str, Any]) -> str:
    """The placement table as Markdown (one row per placement; ``window`` from the config)."""
    lines = ["| " + " | ".join(_headers(result["config"]["window"])) + " |", "|" + "---|" * len(TABLE_HEADERS)]
    for r in result["placements"]:
        lines.append("| " + " | ".join(_row_cells(r, result["heldout_no_control"])) + " |")
    return "\n".join(lines)


_CSS = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0;font-size:0.85em}th,td{border:1px solid #ccc;padding:4px 8px;"
        "text-align:right}th{background:#f4f4f4}td:first-child{text-align:left}img{max-width:100%}"
        ".muted{color:#777}figcaption{font-size:0.9em;color:#555}")


def write_report(result: dict[str, Any], folder: str | Path) -> Path:
    """``folder/index.html``: the placement table and ``loss_curves.png`` (training loss per step, every
    placement, and the ControlNet gradient norm). Needs matplotlib (the ``report`` extra).

    Returns:
        The HTML file's path.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(9.0, 6.0), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_grad = fig.subplots(2, 1, sharex=True)
    styles = ["-", "--", ":", "-."]
    window = max(1, min(20, len(result["placements"][0]["losses"]) // 5))

    def smooth(y: list[float]) -> np.ndarray:  # running mean: one step's loss mostly says which timestep it drew
        return np.convolve(np.asarray(y, float), np.ones(window) / window, mode="valid")

    for i, r in enumerate(result["placements"]):
        x = np.arange(len(r["losses"]))
        ax_loss.plot(x, r["losses"], "-", lw=0.5, alpha=0.25, color=f"C{i}")
        ax_loss.plot(x[window - 1:], smooth(r["losses"]), styles[i % 4], lw=1.4, color=f"C{i}",
                     label=f"{r['placement']} (held-out with control {r['heldout_control']:.4f})")
        ax_grad.plot(x[window - 1:], smooth(r["grad_norms"]), styles[i % 4], lw=1.4, color=f"C{i}")
    ax_loss.axhline(result["heldout_no_control"], color="grey", lw=0.8,
                    label=f"held-out loss without control {result['heldout_no_control']:.4f}")
    ax_loss.set_ylabel(f"training loss (noise MSE;\nrunning mean of {window})")
    ax_grad.set_ylabel(f"ControlNet grad norm\n(running mean of {window})")
    ax_grad.set_xlabel("step")
    for ax in (ax_loss, ax_grad):
        ax.grid(True, alpha=0.3, linewidth=0.6)
    ax_loss.legend(fontsize=8, frameon=False)
    fig.savefig(folder / "loss_curves.png", format="png", metadata={"Software": None})
    cfg = result["config"]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in _headers(cfg["window"]))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in
                                    _row_cells(r, result["heldout_no_control"])) + "</tr>"
                   for r in result["placements"])
    page = "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        "<title>ControlNet beside frozen models</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
        "<h1>ControlNet beside a frozen VAE, text encoder and UNet</h1>",
        (f"<p>{cfg['steps']} steps of {cfg['batch_size']} per placement; trainer on {html.escape(cfg['device'])}, "
         f"frozen models on {html.escape(cfg['frozen_device'] or cfg['device'])}; seed {cfg['seed']}. Loss "
         "differences are to the first placement over every step; held-out loss is the denoising MSE on "
         f"{cfg['heldout_size']} test images with fixed noise, with the trained ControlNet's residuals and "
         "without them (the UNet alone).</p>"),
        f"<table><tr>{head}</tr>{body}</table>",
        ('<figure><img src="loss_curves.png" alt="training loss and ControlNet gradient norm per step">'
         "<figcaption>Training loss (each step faint, running mean bold) and ControlNet gradient norm, every "
         "placement; the lines lie on each other where training did not change.</figcaption></figure>"),
        f'<p class="muted"><small>Generated by layerfreeze.controlnet in {result["total_s"]:.0f} s.</small></p>',
        "</body>", "</html>", ""])
    path = folder / "index.html"
    path.write_text(page)
    return path
