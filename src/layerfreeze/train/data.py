"""Datasets for the text and vision experiments.

Every dataset item is a dict of tensors, so the default collate function turns a list of items
into a dict of batched tensors:

- text: ``{"input_ids", "attention_mask", "token_type_ids" (if the tokenizer returns it),
  "labels", "index"}``; each token field is ``(max_length,)`` int64 per item.
- vision: ``{"pixel_values", "labels", "index"}``; ``pixel_values`` is ``(3, H, W)`` float32,
  normalised with the ImageNet mean and std.

``labels`` is an int64 scalar tensor (the class index) and ``index`` is an int64 scalar tensor
holding the item's position in its dataset (used as a cache key).
"""

from __future__ import annotations

import gzip
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset

from layerfreeze.errors import ConfigError
from layerfreeze.train.assets import bbc_news_dir, fashion_mnist_dir
from layerfreeze.train.csv_rows import read_csv_columns

__all__ = [
    "FASHION_MNIST_CLASSES",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageFolderDictDataset",
    "TensorImageDataset",
    "TokenizedTextDataset",
    "load_bbc_news",
    "load_fashion_mnist",
    "load_image_folder",
    "load_text_csv",
    "stratified_split",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip


# --------------------------------------------------------------------------------------- text


def _decode_article(raw: bytes) -> str:
    """Decode an article as UTF-8, falling back to cp1252 and then latin-1 (never fails)."""
    for encoding in ("utf-8", "cp1252"):
        try:
            return raw.decode(encoding)
        except UnicodeDecodeError:
            pass
    return raw.decode("latin-1")


def load_bbc_news(root: Path | None = None) -> tuple[list[str], list[int], list[str]]:
    """Read the BBC News corpus (2,225 articles, 5 classes).

    Args:
        root: folder with one sub-folder of ``*.txt`` articles per class; defaults to
            :func:`layerfreeze.train.assets.bbc_news_dir`.

    Returns:
        ``(texts, labels, class_names)``: class names are the sorted sub-folder names, labels index
        into them; articles come class by class, files sorted by name. Files are read as UTF-8,
        with a cp1252 fallback (one article, ``sports/199.txt``, is cp1252: a ``£`` sign).

    Raises:
        AssetMissingError: ``root`` is None and the corpus is not installed.
        ValueError: ``root`` holds no class folders with ``*.txt`` files.
    """
    root = bbc_news_dir() if root is None else Path(root)
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob("*.txt")))
    if not class_dirs:
        raise ValueError(f"no class folders with *.txt files in {root}")
    texts: list[str] = []
    labels: list[int] = []
    for label, class_dir in enumerate(class_dirs):
        for path in sorted(class_dir.glob("*.txt")):
            texts.append(_decode_article(path.read_bytes()))
            labels.append(label)
    return texts, labels, [p.name for p in class_dirs]


def load_text_csv(
    path: str | Path, text_column: str = "text", label_column: str = "label",
    classes: Sequence[str] | None = None,
) -> tuple[list[str], list[int], list[str]]:
    """Read a text classification CSV file (UTF-8, with a header row; :func:`read_csv_columns`).

    Labels are mapped to ``0..k-1`` in sorted order of their distinct values: numerically when
    every label is an integer, otherwise as strings. ``class_names[i]`` is the original value
    (as written in the file) of label ``i``. With ``classes`` (the training file's ``class_names``, for a test
    file) labels are mapped to those instead, so label ``i`` means the same class in both files.

    Returns:
        ``(texts, labels, class_names)``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is empty or has no data rows, a column is missing (the message lists the columns
            present), a row lacks a field or has an empty label (naming its line), or (with ``classes``) a label is
            not one of ``classes``.
    """
    path = Path(path)
    rows = [(line, text, label.strip()) for line, (text, label) in read_csv_columns(path, (text_column, label_column))]
    empty = next((line for line, _, label in rows if not label), None)
    if empty is not None:
        raise ValueError(f"{path}: line {empty} has an empty {label_column!r}; give every row its class, or remove "
                         "the row")
    if classes is None:
        raw_labels = {label for _, _, label in rows}
        try:
            class_names = sorted(raw_labels, key=int)
        except ValueError:
            class_names = sorted(raw_labels)
    else:
        class_names = list(classes)
        unknown = next(((line, label) for line, _, label in rows if label not in class_names), None)
        if unknown is not None:
            raise ValueError(f"{path}: line {unknown[0]}: class {unknown[1]!r} is not one of the training data's "
                             f"({', '.join(map(repr, class_names))}); a test set holds the classes the model is "
                             "trained on")
    to_index = {name: i for i, name in enumerate(class_names)}
    texts = [text for _, text, _ in rows]
    labels = [to_index[label] for _, _, label in rows]
    return texts, labels, class_names


def stratified_split(
    labels: Sequence[int], test_fraction: float = 0.2, seed: int = 0, names: Sequence[str] | None = None
) -> tuple[list[int], list[int]]:
    """Split sample positions into train and test sets, class by class.

    Each class with ``n`` samples puts ``round(n * test_fraction)`` of them (at least 1, at most
    ``n - 1``) in the test set, chosen by a ``numpy.random.Generator`` seeded with ``seed``; the
    same arguments always give the same split. ``names``: each label's class name, for the error message.

    Returns:
        ``(train_indices, test_indices)``: sorted, disjoint lists of ints covering
        ``range(len(labels))``.

    Raises:
        ValueError: ``test_fraction`` is not strictly between 0 and 1, or a class has fewer than
            2 samples.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    labels_array = np.asarray(labels)
    rng = np.random.default_rng(seed)
    train: list[int] = []
    test: list[int] = []
    for label in np.unique(labels_array):
        members = np.flatnonzero(labels_array == label)
        if len(members) < 2:
            name = f"class {names[int(label)]!r}" if names is not None else f"class {label}"
            raise ValueError(f"{name} has {len(members)} sample(s); need at least 2 to split")
        n_test = min(max(round(len(members) * test_fraction), 1), len(members) - 1)
        shuffled = rng.permutation(members)
        test.extend(int(i) for i in shuffled[:n_test])
        train.extend(int(i) for i in shuffled[n_test:])
    return sorted(train), sorted(test)


def sample_keys(dataset: Dataset) -> list[int]:
    """The ``"index"`` each position of ``dataset`` carries: its position in the underlying dataset (through
    ``Subset`` objects, which the hold-out split and the data limits make), which is what the task datasets put in
    ``item["index"]`` and what the activation cache keys entries by."""
    if isinstance(dataset, Subset):
        inner = sample_keys(dataset.dataset)
        return [inner[i] for i in dataset.indices]
    return list(range(len(dataset)))  # type: ignore[arg-type]


def root_dataset(dataset: Dataset) -> Dataset:
    """The dataset under ``Subset`` layers (what ``item["index"]`` counts positions of)."""
    return root_dataset(dataset.dataset) if isinstance(dataset, Subset) else dataset


class TokenizedTextDataset(Dataset):
    """Texts tokenized once, up front, to fixed length.

    Args:
        texts: the raw strings.
        labels: class index per text.
        tokenizer: a Hugging Face tokenizer (called with ``padding="max_length"``,
            ``truncation=True``, ``return_tensors="pt"``).
        max_length: tokens per text, after padding/truncation.
        num_classes: number of classes; defaults to ``max(labels) + 1``.
        encode: tokenize every text now (the default); False tokenizes none until :meth:`encode` names the
            positions a run reads (after its split and data limits: a 48-article run of BBC News tokenized 2,225).

    Items: ``{"input_ids", "attention_mask", ["token_type_ids"]}`` each ``(max_length,)`` int64,
    plus ``"labels"`` and ``"index"``, int64 scalars.

    Raises:
        ValueError: ``texts`` and ``labels`` differ in length.
    """

    def __init__(
        self,
        texts: Sequence[str],
        labels: Sequence[int],
        tokenizer: Any,
        max_length: int = 128,
        num_classes: int | None = None,
        encode: bool = True,
    ) -> None:
        if len(texts) != len(labels):
            raise ValueError(f"{len(texts)} texts but {len(labels)} labels")
        self.texts, self.tokenizer = list(texts), tokenizer
        self.encodings: dict[str, torch.Tensor] = {}
        #: per position, its row in :attr:`encodings` (-1: not tokenized)
        self.rows = torch.full((len(self.texts),), -1, dtype=torch.int64)
        self.labels = torch.as_tensor(list(labels), dtype=torch.int64)
        self.max_length = max_length
        if num_classes is None:
            num_classes = int(max(labels, default=-1)) + 1
        self.num_classes = num_classes

        if encode:
            self.encode(range(len(self.texts)))

    def encode(self, positions: Sequence[int]) -> None:
        """Tokenize the texts at ``positions`` (those already tokenized are kept): what ``encode=False`` left for
        later. The same tensors as tokenizing every text at once (each text is padded or cut to ``max_length``
        alone)."""
        wanted = torch.as_tensor(list(positions), dtype=torch.int64)
        todo = wanted[self.rows[wanted] < 0].unique().tolist()  # sorted
        if not todo:
            return
        encoded = self.tokenizer([self.texts[i] for i in todo], padding="max_length", truncation=True,
                                 max_length=self.max_length, return_tensors="pt")
        fields = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in encoded]
        start = len(next(iter(self.encodings.values()))) if self.encodings else 0
        self.encodings = {k: torch.cat([self.encodings[k], encoded[k].long()]) if self.encodings
                          else encoded[k].long() for k in fields}
        self.rows[todo] = torch.arange(start, start + len(todo))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = int(self.rows[i])
        if row < 0:  # encode=False and this position was not named to encode(): never an empty or wrong item
            raise IndexError(f"text {i} was not tokenized: call encode() with the positions the run reads")
        item = {k: v[row] for k, v in self.encodings.items()}
        item["labels"] = self.labels[i]
        item["index"] = torch.tensor(i, dtype=torch.int64)
        return item


# ------------------------------------------------------------------------------------- vision


class TensorImageDataset(Dataset):
    """Images held in memory as one tensor.

    Args:
        images: ``(N, C, H, W)`` with ``C`` 1 or 3; float32 already in model input scale, or
            uint8 (0..255, converted to float32 in [0, 1] per item).
        labels: ``(N,)`` class indices (converted to int64).
        mean, std: per-channel normalisation applied per item after expanding to 3 channels,
            ``(x - mean) / std``; None (the default) leaves values as they are.
        num_classes: defaults to ``max(labels) + 1``.

    Items: ``{"pixel_values": (3, H, W) float32, "labels": int64 scalar, "index": int64 scalar}``.
    A 1-channel image is expanded to 3 channels (a view, when no normalisation applies).

    Raises:
        ValueError: bad image shape or channel count, or image/label counts differ.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor | Sequence[int],
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        num_classes: int | None = None,
    ) -> None:
        if images.ndim != 4 or images.shape[1] not in (1, 3):
            raise ValueError(f"images must be (N, 1 or 3, H, W), got {tuple(images.shape)}")
        labels = torch.as_tensor(labels, dtype=torch.int64)
        if labels.shape != (images.shape[0],):
            raise ValueError(f"{images.shape[0]} images but labels of shape {tuple(labels.shape)}")
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std, or neither")
        self.images = images
        self.labels = labels
        self.mean = None if mean is None else torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = None if std is None else torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
        if num_classes is None:
            num_classes = int(labels.max()) + 1 if len(labels) else 0
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.images[i]
        if x.dtype == torch.uint8:
            x = x.float() / 255.0
        x = x.expand(3, *x.shape[1:])
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return {"pixel_values": x, "labels": self.labels[i], "index": torch.tensor(i, dtype=torch.int64)}


_IDX_MAGIC = {"images": 2051, "labels": 2049}  # big-endian uint32 headers: 0x0803, 0x0801


def _read_idx(path: Path, kind: str) -> np.ndarray:
    """Read a gzipped IDX file: images ``(N, 28, 28)`` uint8 or labels ``(N,)`` uint8.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: not gzip, wrong magic number, or a size that does not match its header.
    """
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        with gzip.open(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError) as err:
        raise ValueError(f"{path}: not a readable gzip file ({err})") from err
    n_dims = 3 if kind == "images" else 1
    header_size = 4 * (1 + n_dims)
    if len(raw) < header_size:
        raise ValueError(f"{path}: too short for an IDX {kind} header ({len(raw)} bytes)")
    header = np.frombuffer(raw, dtype=">u4", count=1 + n_dims)
    magic, shape = int(header[0]), tuple(int(d) for d in header[1:])
    if magic != _IDX_MAGIC[kind]:
        raise ValueError(f"{path}: bad magic number {magic}, expected {_IDX_MAGIC[kind]} for IDX {kind}")
    if kind == "images" and shape[1:] != (28, 28):
        raise ValueError(f"{path}: images are {shape[1]}x{shape[2]}, expected 28x28")
    expected = header_size + int(np.prod(shape))
    if len(raw) != expected:
        raise ValueError(f"{path}: {len(raw)} bytes, header says {expected}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header_size).reshape(shape)


def load_fashion_mnist(
    split: str = "train", size: int = 32, limit: int | None = None, root: str | Path | None = None
) -> TensorImageDataset:
    """Load Fashion-MNIST (60,000 train / 10,000 test, 10 classes) from its IDX ``.gz`` files.

    Images are resized from 28x28 to ``size`` x ``size`` (bilinear, ``align_corners=False``) and
    stored as ``(N, 1, size, size)`` uint8 (60k x 32 x 32 is 61 MB); items are expanded to 3
    channels, scaled to [0, 1] and normalised with the ImageNet mean and std.

    Args:
        split: ``"train"`` or ``"test"``.
        size: output height and width in pixels.
        limit: keep only the first ``limit`` samples (None keeps all).
        root: folder with the four IDX files; defaults to
            :func:`layerfreeze.train.assets.fashion_mnist_dir`.

    Returns:
        A :class:`TensorImageDataset` whose items hold ``pixel_values`` ``(3, size, size)``
        float32 and ``labels`` in 0..9.

    Raises:
        ValueError: unknown ``split``, bad ``size``/``limit``, or a malformed IDX file (the
            message names the file).
        AssetMissingError: ``root`` is None and the files are not installed.
        FileNotFoundError: ``root`` is given and lacks a file.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if size < 1:
        raise ValueError(f"size must be positive, got {size}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    root = fashion_mnist_dir() if root is None else Path(root)
    prefix = "train" if split == "train" else "t10k"
    images_path = root / f"{prefix}-images-idx3-ubyte.gz"
    labels_path = root / f"{prefix}-labels-idx1-ubyte.gz"
    images = _read_idx(images_path, "images")
    labels = _read_idx(labels_path, "labels")
    if len(images) != len(labels):
        raise ValueError(f"{images_path} has {len(images)} images but {labels_path} has {len(labels)} labels")
    if labels.size and labels.max() > 9:
        raise ValueError(f"{labels_path}: label {labels.max()} out of range 0..9")
    if limit is not None:
        images, labels = images[:limit], labels[:limit]

    resized = torch.empty((len(images), 1, size, size), dtype=torch.uint8)
    chunk = 5000
    for start in range(0, len(images), chunk):
        x = torch.from_numpy(images[start : start + chunk].copy()).unsqueeze(1).float()
        if size != 28:
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        resized[start : start + chunk] = x.round().clamp(0, 255).to(torch.uint8)
    return TensorImageDataset(
        resized, torch.from_numpy(labels.astype(np.int64)), IMAGENET_MEAN, IMAGENET_STD, num_classes=10
    )


def unreadable_image(key: str, path: Any, err: OSError, then: str = "") -> ConfigError:
    """The one-line error for an image file PIL cannot read (``err``: PIL.UnidentifiedImageError, a truncated
    file), naming the config ``key``, the file and what to do; ``then`` is appended to the advice."""
    return ConfigError(f"{key}: {path} is not a readable image ({type(err).__name__}); remove or convert it{then}")


class ImageFolderDictDataset(Dataset):
    """Wraps a ``(image, label)`` dataset (e.g. torchvision ``ImageFolder``) to yield dict items.

    Items: ``{"pixel_values": (3, H, W) float32, "labels": int64 scalar, "index": int64 scalar}``.
    Attributes ``classes`` and ``num_classes`` come from the wrapped dataset's ``classes``.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.classes = list(getattr(dataset, "classes", []))
        self.num_classes = len(self.classes)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """Sample ``i``.

        Raises:
            ConfigError: its file is not a readable image (named, with what to do), instead of PIL's traceback.
        """
        try:
            image, label = self.dataset[i]
        except OSError as err:  # PIL.UnidentifiedImageError, a truncated file
            samples = getattr(self.dataset, "samples", None)
            path = samples[i][0] if samples else f"sample {i}"
            raise unreadable_image("data.path", path, err, then=" (converted in place, under the same name, the run "
                                   "resumes; removed, the data changed: start a new run)") from None
        return {
            "pixel_values": image,
            "labels": torch.tensor(label, dtype=torch.int64),
            "index": torch.tensor(i, dtype=torch.int64),
        }


def class_folders(root: str | Path) -> list[str]:
    """The class sub-folders of an image folder, sorted: every sub-folder but hidden ones (``.ipynb_checkpoints``,
    ``.git``: a notebook's checkpoint folder became a class of its own)."""
    return sorted(p.name for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith("."))


def load_image_folder(root: str | Path, size: int = 32, classes: Sequence[str] | None = None) -> ImageFolderDictDataset:
    """Load an image-classification folder ``root/<class>/<image>`` with torchvision's ImageFolder.

    Images are converted to RGB, resized to ``(size, size)``, scaled to [0, 1] and normalised with
    the ImageNet mean and std. Classes are the sorted sub-folder names (:func:`class_folders`: hidden ones left
    out); with ``classes`` (the training folder's, for a test folder) labels are those classes' indices, and a class
    the test folder lacks is fine.

    Returns:
        An :class:`ImageFolderDictDataset` with ``pixel_values`` ``(3, size, size)`` float32.

    Raises:
        ImportError: torchvision is not installed (``pip install layerfreeze[vision]``).
        FileNotFoundError: ``root`` has no class folders or no images (raised by ImageFolder).
        ValueError: (with ``classes``) a sub-folder is not one of ``classes``.
    """
    try:
        from torchvision import datasets, transforms
    except ImportError as err:
        raise ImportError(
            "load_image_folder needs torchvision: pip install layerfreeze[vision]"
        ) from err

    class Folder(datasets.ImageFolder):
        def find_classes(self, directory: str | Path) -> tuple[list[str], dict[str, int]]:
            found = class_folders(directory)
            if not found:
                raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
            if classes is None:
                return found, {name: i for i, name in enumerate(found)}
            unknown = [name for name in found if name not in classes]
            if unknown:
                raise ValueError(f"{directory}: class folder(s) {', '.join(map(repr, unknown))} are not among the "
                                 f"training data's classes ({', '.join(map(repr, classes))}); a test set holds the "
                                 "classes the model is trained on")
            return list(classes), {name: i for i, name in enumerate(classes)}

    transform = transforms.Compose(
        [
            transforms.Resize((size, size)),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    return ImageFolderDictDataset(Folder(str(root), transform=transform, allow_empty=classes is not None))


class GaussianBlobs(Dataset):
    """Synthetic classification data for smoke tests, examples and benchmarks: ``classes`` Gaussian clusters.

    Centers ``(classes, dim)`` are drawn once (seed 0, scale 2); each sample is its class center plus unit noise,
    both from ``seed``. Items: ``{"pixel_values": (dim,) float32, "labels": int64, "index": int64}``, so the
    trainer's image forward and the activation cache (keyed by ``index``) take them as they are.
    """

    def __init__(self, n: int, seed: int, classes: int = 4, dim: int = 16) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, classes, (n,), generator=g)
        centers = torch.randn(classes, dim, generator=torch.Generator().manual_seed(0)) * 2
        self.x = centers[self.labels] + torch.randn(n, dim, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": self.labels[i], "index": torch.tensor(i)}
