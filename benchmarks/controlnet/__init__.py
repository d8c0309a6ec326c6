"""A ControlNet trained beside a frozen VAE, a frozen text encoder and a frozen base denoiser, under four placements.

The question: when a ControlNet trains on one device while the frozen VAE and Transformer models run elsewhere,
does training change, and what happens to memory, speed and stability? This module answers it with real
``diffusers`` models, offline, in minutes on a CPU (and on GPUs with ``frozen_device="cuda:1"``):

* stage 1 (trained here, never downloaded, cached on disk with checksums by :func:`~layerfreeze.checkpoint.
  save_checkpoint`): a tiny ``AutoencoderKL`` on Fashion-MNIST (28x28 padded to 32x32, values in [-1, 1],
  latents ``(4, 8, 8)``), then a tiny ``UNet2DConditionModel`` (``cross_attention_dim=384``) trained to denoise
  those latents given the class name ("a photo of a sneaker") encoded by the frozen MiniLM-L6
  (:func:`layerfreeze.train.assets.minilm_dir`);
* stage 2: ``ControlNetModel.from_unet`` (Zhang, Rao, Agrawala, "Adding Conditional Control to Text-to-Image
  Diffusion Models", ICCV 2023; diffusers ``examples/controlnet/train_controlnet.py``) trained on an edge map
  (Sobel) of the image, with the VAE, text encoder and UNet frozen. The loss backpropagates through the frozen
  UNet (:class:`~layerfreeze.compute.frozen.FrozenDifferentiable`) into the ControlNet's residuals.

Placements (:data:`PLACEMENTS`), same seed, same batches, same random numbers (float32 losses are then equal bit for
bit when the trainer runs with the same number of intra-op threads in every placement; the worker placement splits
the cores, and a CPU reduction over 1 thread rounds differently from one over 2, by about 1e-7):

``device``      frozen models on the trainer's device, called in the training loop (diffusers' script);
``worker``      VAE and text encoder in a :class:`~layerfreeze.compute.frozen.FrozenPipeline` worker (on CPU the
                stand-in for another device; on GPUs, ``frozen_device``); the UNet stays in the gradient path;
``precompute``  the VAE's latent *distribution* (mean and log-variance) per image and the ten prompts' embeddings
                computed once (:func:`~layerfreeze.compute.precomputed.precompute`); the trainer samples the latents;
``bf16``        like ``device`` with the three frozen models in bfloat16 (the ControlNet stays float32).

RNG safety: the frozen VAE returns ``latent_dist.parameters``; the trainer samples the latents
(``DiagonalGaussianDistribution(parameters).sample(generator=g)``), the noise and the timesteps with its own
``torch.Generator``, so no placement changes a random number.

:func:`run_demo` returns and writes (``results.json``, ``table.md``, ``report/index.html`` with a loss-curve plot)
per placement: max |loss difference| to the first placement over every step, held-out denoising loss with and
without control, step time, throughput, one-off precompute time, parameter bytes and peak memory per device,
the pipeline's overlap, and stability (non-finite outputs named, loss std over the last window, ControlNet
gradient norm). ``python -m benchmarks.controlnet`` is the command.
"""

from benchmarks.controlnet.config import PLACEMENTS, DemoConfig
from benchmarks.controlnet.data import CLASS_NAMES, EdgeDataset, edge_maps, load_images
from benchmarks.controlnet.demo import run_demo
from benchmarks.controlnet.models import LatentParameters, TextEncoder, stage1_models
from benchmarks.controlnet.report import format_table, write_report

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
