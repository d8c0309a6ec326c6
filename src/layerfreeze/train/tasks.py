"""Tasks for the CLI trainer: a model, a train and a test dataset, and how a batch becomes logits.

Built-in tasks use only the offline assets (:mod:`layerfreeze.train.assets`); nothing is fetched from a model hub:

* ``bbc-news``: MiniLM-L6 (or another local Hugging Face encoder folder) fine-tuned on BBC News, 5 topics, a fixed
  stratified 80/20 split.
* ``text-csv``: the same on the user's CSV (``data.path``, optional ``data.test_path``).
* ``fashion-mnist``: MobileNetV2 with ImageNet weights fine-tuned on Fashion-MNIST at 32x32, 3 channels.
* ``image-folder``: the same on the user's folder of class sub-folders.
* ``text-lm``: a local causal LM folder (GPT-2, Llama, ...) trained on next-token prediction over a text file or a
  CSV column (:mod:`layerfreeze.train.lm`); perplexity is its eval metric.

A task's *objective* says how logits become a loss and an eval metric (:class:`Classification`: cross-entropy and
accuracy; :class:`~layerfreeze.train.lm.NextTokenPrediction`: shifted cross-entropy and perplexity).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn
from torch.utils.data import Dataset, Subset

from layerfreeze.errors import ConfigError
from layerfreeze.train import assets, data
from layerfreeze.train.config import Config
from layerfreeze.train.lm import NextTokenPrediction, check_causal_lm, check_max_length, lm_datasets, lm_forward
from layerfreeze.train.loaders import load_causal_lm, load_text_model, load_vision_model


class Classification:
    """The objective of a classifier: cross-entropy on ``batch["labels"]`` ``(B,)`` against logits ``(B, C)``;
    accuracy as the eval metric."""

    metric = "accuracy"

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over the batch (a scalar with grad)."""
        return nn.functional.cross_entropy(logits, batch["labels"])

    def sample_losses(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``(B,)`` cross-entropy per sample (their mean is :meth:`loss`; data-parallel training sums shares)."""
        return nn.functional.cross_entropy(logits, batch["labels"], reduction="none")

    def sums(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[float, float, int]:
        """``(summed loss, correct predictions, samples)`` of a batch."""
        labels = batch["labels"]
        total = float(nn.functional.cross_entropy(logits, labels, reduction="sum"))
        return total, float((logits.argmax(-1) == labels).sum()), len(labels)

    def finish(self, loss_sum: float, metric_sum: float, count: int) -> tuple[float, float]:
        """``(mean loss, accuracy in [0, 1])``."""
        return loss_sum / max(1, count), metric_sum / max(1, count)


@dataclass
class Task:
    """What the trainer needs to know about a task.

    Attributes:
        name: Task name for reports.
        model: The network; ``forward(model, batch)`` turns a batch dict into logits ``(batch, num_classes)``.
        train_set / test_set: Datasets whose items are dicts of tensors with a ``"labels"`` key.
        num_classes: Number of classes (the vocabulary size for a language model).
        model_name: For reports (a path or an architecture name).
        forward: ``(model, batch) -> logits``.
        objective: Loss and eval metric (:class:`Classification` unless set).
    """

    name: str
    model: nn.Module
    train_set: Dataset
    test_set: Dataset
    num_classes: int
    model_name: str
    forward: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    objective: Any = field(default_factory=Classification)

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The training loss (a scalar with grad) of a batch's logits."""
        return self.objective.loss(logits, batch)


def text_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits ``(B, C)`` of a Hugging Face sequence classifier from a tokenized batch."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in batch}
    return model(**inputs).logits


def image_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits ``(B, C)`` of an image classifier from ``pixel_values`` ``(B, 3, H, W)``."""
    return model(batch["pixel_values"])


def _limit(dataset: Dataset, limit: int | None, seed: int, key: str) -> Dataset:
    """A seeded random subset of ``limit`` samples (in dataset order), or ``dataset`` when no limit applies.

    Random, not the first ``limit``: some datasets are stored sorted by class (BBC News), and a prefix would keep
    only the first classes.

    Warns:
        UserWarning: ``limit`` (the config's ``key``) is above the split's size: the whole split is used.
    """
    if limit and limit > len(dataset):
        warnings.warn(f"{key} {limit} is above the {len(dataset)} samples of its split: all {len(dataset)} are used",
                      stacklevel=2)
    if not limit or limit >= len(dataset):
        return dataset
    keep = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:limit].sort().values
    return Subset(dataset, keep.tolist())


def default_lora_targets(model: nn.Module) -> list[str]:
    """LoRA's modules when the config names none: the attention query and value projections of a transformer, as in
    Hu et al. 2021, sec. 4.2 (``query``/``value`` in BERT-like models, ``q_proj``/``v_proj`` in Llama-like decoders
    and BART, ``q``/``v`` in T5; the fused ``c_attn`` of GPT-2 and ``query_key_value`` of GPT-NeoX), else every
    ``Conv2d`` with ``groups == 1`` (a depthwise convolution has no low-rank form): MobileNetV2's stem, 1x1
    expand/project and last convs."""
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for pair in (["query", "value"], ["q_proj", "v_proj"], ["q", "v"]):
        if names.issuperset(pair):
            return pair
    fused = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()} & {"c_attn", "query_key_value"}
    if fused:
        return sorted(fused)
    return [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and m.groups == 1]


def apply_lora(model: nn.Module, cfg: Config) -> nn.Module:
    """Wrap ``model`` with LoRA adapters (``peft``): base weights frozen, adapters and the task head trained.

    Raises:
        ConfigError: peft is not installed, or no module matches ``model.lora.targets``.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("model.lora needs the peft library: pip install layerfreeze[lora]") from None
    lora = cfg.model.lora
    targets = lora.targets if lora.targets is not None else default_lora_targets(model)
    head = [n for n, m in model.named_children() if n in ("classifier", "fc", "head", "score")]
    try:
        with warnings.catch_warnings():  # peft 0.21 reads transformers 5's deprecated attribute: noise, not ours
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            peft_model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                          target_modules=targets, modules_to_save=head))
    except ValueError as exc:
        raise ConfigError(f"model.lora.targets {targets}: {exc}") from None
    return peft_model.base_model.model  # the original model class, now holding LoRA layers


def _image_folder(path: str, size: int, key: str, classes: list[str] | None = None) -> data.ImageFolderDictDataset:
    """:func:`data.load_image_folder`, its "no class folder / no image" errors (torchvision's, which list every
    sub-folder) as one line naming ``key``.

    Raises:
        ConfigError: ``path`` has no class sub-folder, or no image in them (naming the sub-folders without one), a
            file whose header PIL cannot read (``Image.open``, a few dozen microseconds a file), or (with
            ``classes``, the training folder's) a class sub-folder that is not one of them.
    """
    try:
        dataset = data.load_image_folder(path, size=size, classes=classes)
    except ValueError as exc:
        raise ConfigError(f"{key} {exc}") from None
    except FileNotFoundError:
        from torchvision.datasets.folder import IMG_EXTENSIONS  # here: torchvision's import costs ~1 s (Dynamo)

        folders = data.class_folders(path)
        empty = [name for name in folders if not any(f.suffix.lower() in IMG_EXTENSIONS
                                                     for f in (Path(path) / name).rglob("*"))]
        what = (f"{len(folders)} sub-folder(s), no image in them" if len(empty) == len(folders)
                else f"sub-folder(s) without an image: {', '.join(empty)}; remove them or add images")
        raise ConfigError(f"{key} {path} is not a folder of class sub-folders with images ({what}): image-folder "
                          "reads <folder>/<class>/<image>.jpg|.png|...") from None
    for file, _ in getattr(dataset.dataset, "samples", []):  # the headers only: an unreadable file fails here,
        try:  # before training, not when a batch first reads it
            Image.open(file).close()
        except OSError as err:
            raise data.unreadable_image(key, file, err) from None
    return dataset


def _split(dataset: Dataset, labels: list[int], cfg: Config, classes: list[str]) -> tuple[Dataset, Dataset]:
    try:
        train_idx, test_idx = data.stratified_split(labels, cfg.data.test_fraction, cfg.data.split_seed, classes)
    except ValueError as exc:
        raise ConfigError(f"cannot split the data into train and test: {exc}; add samples, or give a separate test "
                          "set with --set data.test_path=...") from None
    return Subset(dataset, train_idx), Subset(dataset, test_idx)


def _check_classes(classes: list[str], path: str | None) -> None:
    """A classifier needs two classes; one means a wrong label column or folder (before a model is built for it)."""
    if len(classes) < 2:
        raise ConfigError(f"data.path {path} has {len(classes)} class(es) ({', '.join(map(str, classes))}); a "
                          "classifier needs at least 2 (check the label column or the class sub-folders)")


def _read_csv(path: str, cfg: Config, classes: list[str] | None = None) -> tuple[list[str], list[int], list[str]]:
    try:
        return data.load_text_csv(path, cfg.data.text_column, cfg.data.label_column, classes)
    except ValueError as exc:  # a missing column: say which setting names it; undecodable text: the encoding
        msg = str(exc) if str(exc).startswith(str(path)) else f"{path}: {exc}"
        if "no column" in msg:
            msg += ". Name the columns with --set data.text_column=... / data.label_column=..."
        elif isinstance(exc, UnicodeDecodeError):
            msg += ". Save the file as UTF-8"
        raise ConfigError(f"data file {msg}") from None


def build_task(cfg: Config) -> Task:
    """Build the model and datasets a config describes.

    Raises:
        AssetMissingError: a built-in asset is not installed (the message gives the install command).
        ConfigError: a user path that does not exist or does not fit the task.
    """
    torch.manual_seed(cfg.train.seed)  # new heads are initialised from the run's seed
    objective: Any = Classification()
    if cfg.task == "text-lm":
        model, tokenizer = load_causal_lm(cfg.model.name_or_path)
        check_causal_lm(model, cfg.model.name_or_path, cfg.model.max_length)
        train_set, test_set = lm_datasets(cfg, tokenizer)
        classes = [None] * int(model.config.get_text_config().vocab_size)
        forward, model_name, objective = lm_forward, str(cfg.model.name_or_path), NextTokenPrediction()
    elif cfg.task in ("bbc-news", "text-csv"):
        if cfg.task == "bbc-news":
            texts, labels, classes = data.load_bbc_news()
        else:
            if not Path(cfg.data.path).is_file():
                raise ConfigError(f"data.path {cfg.data.path} is a folder; text-csv reads a CSV file (columns "
                                  f"{cfg.data.text_column!r} and {cfg.data.label_column!r})")
            texts, labels, classes = _read_csv(cfg.data.path, cfg)
            _check_classes(classes, cfg.data.path)
        model_path = cfg.model.name_or_path or str(assets.minilm_dir())
        model, tokenizer = load_text_model(model_path, num_labels=len(classes))
        check_max_length(model, model_path, cfg.model.max_length)
        full = data.TokenizedTextDataset(texts, labels, tokenizer, cfg.model.max_length, encode=False)
        if cfg.data.test_path:
            t_texts, t_labels, _ = _read_csv(cfg.data.test_path, cfg, classes)  # label i: the training file's class i
            test_set = data.TokenizedTextDataset(t_texts, t_labels, tokenizer, cfg.model.max_length, encode=False)
            train_set = full
        else:
            train_set, test_set = _split(full, labels, cfg, classes)
        forward, model_name = text_forward, model_path
    else:
        if cfg.task == "fashion-mnist":
            size = cfg.data.image_size
            train_set = data.load_fashion_mnist("train", size=size, limit=cfg.data.limit_train)
            test_set = data.load_fashion_mnist("test", size=size, limit=cfg.data.limit_test)
            classes = list(data.FASHION_MNIST_CLASSES)
        else:
            if not Path(cfg.data.path).is_dir():
                raise ConfigError(f"data.path {cfg.data.path} is not a folder of class sub-folders")
            full = _image_folder(cfg.data.path, cfg.data.image_size, "data.path")
            classes = list(full.classes)
            _check_classes(classes, cfg.data.path)
            if cfg.data.test_path:
                train_set, test_set = full, _image_folder(cfg.data.test_path, cfg.data.image_size, "data.test_path",
                                                          classes)
            else:
                train_set, test_set = _split(full, [y for _, y in full.dataset.samples], cfg, classes)
        name = cfg.model.name_or_path or "mobilenet_v2"
        model = load_vision_model(name, len(classes), cfg.model.pretrained)
        forward, model_name = image_forward, name
    train_set = _limit(train_set, cfg.data.limit_train, cfg.data.split_seed, "data.limit_train")
    test_set = _limit(test_set, cfg.data.limit_test, cfg.data.split_seed + 1, "data.limit_test")
    for split in (train_set, test_set):  # a text classifier tokenizes only the texts the run reads
        root = data.root_dataset(split)
        if isinstance(root, data.TokenizedTextDataset):
            root.encode(data.sample_keys(split))
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg)
    return Task(
        name=cfg.task,
        model=model,
        train_set=train_set,
        test_set=test_set,
        num_classes=len(classes),
        model_name=model_name,
        forward=forward,
        objective=objective,
    )


def build_model(cfg: Config) -> tuple[nn.Module, str]:
    """The model a config trains and its name, without its data (``layerfreeze blocks``; block counts for
    ``compare``'s checks): the class count comes from the data when ``data.path`` is given and cheap to read (a
    text CSV's label column, an image folder's sub-folders), else a placeholder of 2, which changes only the size of
    the head's last layer, never the blocks.

    Raises:
        AssetMissingError: a built-in asset is not installed.
        ConfigError: a model that cannot be loaded, or (text-lm) that is not a causal LM
            (:func:`~layerfreeze.train.lm.check_causal_lm`; ``model.max_length`` is a run's, not checked here).
    """
    torch.manual_seed(cfg.train.seed)
    if cfg.task == "text-lm":
        model, _ = load_causal_lm(cfg.model.name_or_path)
        check_causal_lm(model, cfg.model.name_or_path)
        name = str(cfg.model.name_or_path)
    elif cfg.task in ("bbc-news", "text-csv"):
        classes = 5  # BBC News's topics
        if cfg.task == "text-csv":
            classes = len(_read_csv(cfg.data.path, cfg)[2]) if cfg.data.path and Path(cfg.data.path).is_file() else 2
        name = cfg.model.name_or_path or str(assets.minilm_dir())
        model, _ = load_text_model(name, num_labels=max(2, classes))
    else:
        classes = len(data.FASHION_MNIST_CLASSES)
        if cfg.task == "image-folder":
            folder = Path(cfg.data.path) if cfg.data.path else None
            classes = len(data.class_folders(folder)) if folder and folder.is_dir() else 2
        name = cfg.model.name_or_path or "mobilenet_v2"
        model = load_vision_model(name, max(2, classes), cfg.model.pretrained)
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg)
    return model, name
