"""The ControlNet demo's sizes and placements (:class:`DemoConfig`), read by the models' stage one and the demo."""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("device", "worker", "precompute", "bf16")


@dataclass
class DemoConfig:
    """Sizes of the demo; the defaults are the full demo (about 11 minutes on 2 CPU cores).

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
