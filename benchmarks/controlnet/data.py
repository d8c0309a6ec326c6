"""The demo's data: Fashion-MNIST images padded to 32x32, their class names, Sobel edge maps as the condition."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

CLASS_NAMES = ("T-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
               "ankle boot")


def load_images(split: str, limit: int, root: str | Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST images padded from 28x28 to 32x32, as the VAE sees them.

    Args:
        split: ``"train"`` or ``"test"``.
        limit: Keep the first ``limit`` images.
        root: Folder of the IDX files (default :func:`layerfreeze.train.assets.fashion_mnist_dir`).

    Returns:
        ``images (N, 1, 32, 32)`` float32 in [-1, 1] (background -1) and ``labels (N,)`` int64 in 0..9.

    Raises:
        ValueError: bad ``split``; AssetMissingError: Fashion-MNIST is not installed.
    """
    from layerfreeze.train.assets import fashion_mnist_dir
    from layerfreeze.train.data import _read_idx

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
