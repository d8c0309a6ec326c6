"""The ControlNet trained under each placement of its frozen models, one after another, same random numbers."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from benchmarks.controlnet.config import DemoConfig
from benchmarks.controlnet.data import EdgeDataset, load_images, random_images
from benchmarks.controlnet.models import (
    LatentParameters,
    Stage1,
    build_controlnet,
    denoising_loss,
    noise_scheduler,
    stage1_models,
    step_batches,
)
from benchmarks.controlnet.report import MEMORY_CAPTION, format_memory_table, format_table, write_report
from layerfreeze.compute.frozen import FrozenDifferentiable, FrozenModule, FrozenPipeline, NonFiniteOutputError
from layerfreeze.compute.precomputed import PrecomputedDataset, precompute
from layerfreeze.runs import measure
from layerfreeze.runs.ledger import MemoryLedger
from layerfreeze.runs.ledger_buckets import DISK, Bucket


def _param_bytes(modules: dict[str, nn.Module]) -> dict[str, int]:
    """Parameter bytes per device over ``modules`` (shared parameters once)."""
    seen, out = set(), {}
    for module in modules.values():
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out[str(p.device)] = out.get(str(p.device), 0) + p.numel() * p.element_size()
    return out


class _DeviceBuckets:
    """The memory ledger's figures per device over a placement's steps (:class:`~layerfreeze.runs.ledger.
    MemoryLedger` sampling every step): each bucket's peak on each device, each device's tensor peak and, on CUDA,
    the allocator's peak (``torch.cuda.max_memory_allocated``)."""

    def __init__(self) -> None:
        self.buckets: dict[str, dict[str, int]] = {}

    def add(self, ledger: MemoryLedger) -> None:
        if ledger.last_step_sampled:
            for device, per in ledger.last.devices.items():
                mine = self.buckets.setdefault(device, {})
                for bucket, n in per.items():
                    mine[bucket] = max(mine.get(bucket, 0), int(n))

    def result(self, ledger: MemoryLedger) -> dict[str, Any]:
        """``{"devices": {device: {"buckets": {bucket: peak bytes}, "tensor_peak_bytes", "peak_allocated"}},
        "tensor_peak_bytes", "samples"}`` (``peak_allocated`` None off CUDA; the disk has no tensor peak)."""
        peaks = ledger.peaks
        devices = {}
        for device, per in sorted(self.buckets.items()):
            alloc = peaks.allocator.get(device, {})
            devices[device] = {"buckets": dict(per),
                               "tensor_peak_bytes": peaks.devices[device].bytes if device in peaks.devices else None,
                               "peak_allocated": alloc.get("peak_allocated")}
        return {"devices": devices, "tensor_peak_bytes": peaks.tensor.bytes if peaks.tensor else None,
                "samples": peaks.samples, "disk": DISK}


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
        scheduler = noise_scheduler()
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

    loader = DataLoader(source, batch_sampler=list(step_batches(len(data), cfg.batch_size, cfg.steps, cfg.seed)))
    pipe = FrozenPipeline(loader, prepare, queue_size=2, threads=cfg.pipeline_threads) if placement == "worker" \
        else None
    batches = pipe if pipe is not None else (prepare(b) for b in loader)
    scheduler = noise_scheduler()
    losses, grad_norms, step_s, nonfinite, trainer_threads = [], [], [], None, torch.get_num_threads()
    before = heldout.loss(controlnet)
    # The memory ledger over the trainer's model and optimizer, the frozen models (side_models, on their device) and
    # the precomputed outputs (the store and the prompt embeddings: cache_memory), sampling every step.
    sources: list[Any] = [m for m in (vae, text, unet) if m is not None]
    if store is not None:
        sources += [store, lambda: {Bucket.CACHE_MEMORY: {str(prompts.device): prompts.untyped_storage().nbytes()}}]
    ledger = MemoryLedger(controlnet, opt, sources=sources, every=1, device=dev)
    per_device = _DeviceBuckets()
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

            with ledger.step():
                loss = denoising_loss(latents, batch["text"], g, scheduler, predict)
                trainer_threads = torch.get_num_threads()  # the pipeline's share while it runs
                loss.backward()
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(controlnet.parameters(), 1.0)))
                opt.step()
                opt.zero_grad(set_to_none=True)
            per_device.add(ledger)
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
        ledger.close()
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
        "trainable_param_bytes": _param_bytes({"controlnet": controlnet}),
        "trainable_tensors": len(list(controlnet.parameters())),
        "ledger": per_device.result(ledger),
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
    result["memory_table"] = format_memory_table(result)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=2, default=str))
        (out / "table.md").write_text(f"{result['table']}\n\n{MEMORY_CAPTION}\n\n{result['memory_table']}\n")
        write_report(result, out / "report")
    return result
