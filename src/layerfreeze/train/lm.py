"""The ``text-lm`` task: next-token prediction on a text file or a CSV column, with a local causal LM.

Nothing is downloaded: the model is a local Hugging Face folder (``config.json`` + weights + tokenizer files) given
as ``model.name_or_path``; no decoder LM's weights install offline here, so bring your own folder (any
``AutoModelForCausalLM``: GPT-2, Llama, Qwen2, ...), or write a small random one with ``save_pretrained``.

Data: the texts are tokenized (no special tokens; the end-of-text token, when the tokenizer has one, between
texts), concatenated and cut into chunks of ``model.max_length`` tokens, as GPT-style pre-training does. The last
chunk is padded (``attention_mask`` 0, label -100). Loss: mean cross-entropy of each position's prediction of the
next token over a chunk's real tokens, averaged over the chunks of a batch (so a data-parallel run, which sums
per-chunk losses across ranks, follows the single-process one); eval metric: perplexity, ``exp`` of the mean
token loss over all the test chunks' tokens.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from layerfreeze.errors import ConfigError
from layerfreeze.train.csv_rows import read_csv_columns

IGNORE = -100
"""Label of a position that is not a real next token (padding)."""


def lm_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits ``(B, T, vocab)`` of a Hugging Face causal LM from ``input_ids`` / ``attention_mask`` ``(B, T)``."""
    return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False).logits


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits[:, t]`` (``(B, T, V)``) against ``labels[:, t + 1]`` (``(B, T)``, -100 ignored)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE, reduction=reduction)


class NextTokenPrediction:
    """The objective of a causal LM: :func:`next_token_loss`, and perplexity as the eval metric."""

    metric = "perplexity"

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The mean of :meth:`sample_losses` (a scalar with grad)."""
        return self.sample_losses(logits, batch).mean()

    def sample_losses(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``(B,)`` mean next-token loss of each chunk over its predicted tokens (0 for a chunk with none)."""
        labels = batch["labels"]
        per_token = next_token_loss(logits, labels, reduction="none").view(labels.shape[0], -1)
        count = (labels[:, 1:] != IGNORE).sum(1).clamp(min=1)
        return per_token.sum(1) / count

    def sums(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[float, float, int]:
        """``(summed token loss, 0, predicted tokens)`` of a batch."""
        total = float(next_token_loss(logits, batch["labels"], reduction="sum"))
        return total, 0.0, int((batch["labels"][:, 1:] != IGNORE).sum())

    def finish(self, loss_sum: float, metric_sum: float, count: int) -> tuple[float, float]:
        """``(mean token loss, perplexity)``; perplexity is capped at ``exp(50)`` so a diverged run stays finite."""
        mean = loss_sum / max(1, count)
        return mean, math.exp(min(mean, 50.0))


def position_limit(model: nn.Module) -> int | None:
    """The most positions a Hugging Face model can embed: the rows of its learned position embedding (GPT-2's
    ``wpe``, ``n_positions`` rows; an ``nn.Embedding`` other than the token embedding with as many rows as the
    config's ``max_position_embeddings``), or None when it has none (rotary or relative positions, as Llama's: those
    run past ``max_position_embeddings``, which only says what the model was trained on)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return None
    tokens = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    learned = any(isinstance(m, nn.Embedding) and m is not tokens and m.num_embeddings == limit
                  for m in model.modules())
    return limit if learned else None


def check_max_length(model: nn.Module, path: Any, max_length: int | None) -> int | None:
    """Refuse a ``model.max_length`` above the positions the model has learned embeddings for
    (:func:`position_limit`): a longer sequence fails inside the first forward (GPT-2: ``IndexError``; BERT: "The size
    of tensor a (128) must match the size of tensor b (64)"), for ``text-lm`` and the text classifiers alike.

    Returns:
        The limit (:func:`position_limit`; None: the model has no learned position table).

    Raises:
        ConfigError: naming ``model.max_length``, the limit and the setting to use.
    """
    limit = position_limit(model)
    if limit is not None and max_length is not None and max_length > limit:
        raise ConfigError(f"model.max_length {max_length} is more than the {limit} positions model.name_or_path "
                          f"{path} has learned embeddings for (max_position_embeddings / n_positions in its "
                          f"config.json); set --set model.max_length={limit} or less")
    return limit


def check_causal_lm(model: nn.Module, path: Any, max_length: int | None = None) -> None:
    """Refuse, before training, a model ``text-lm`` would train wrongly or not at all.

    * A model that is not causal: next-token prediction trains a model to predict token ``t + 1`` from tokens
      ``0..t``; an encoder (BERT, MiniLM: ``AutoModelForCausalLM`` loads it as ``BertLMHeadModel``) sees every token
      at every position and learns to copy. Checked on the model itself: its logits at the first positions of a
      short sequence must not change when a later token does (one forward of 8 tokens, twice, under ``no_grad``
      in eval mode; the train/eval mode comes back as it was).
    * ``max_length`` (when given) above the positions the model has learned embeddings for (:func:`position_limit`):
      GPT-2's position embedding has ``n_positions`` rows, and a longer chunk fails inside the first forward with
      ``IndexError``.

    Raises:
        ConfigError: naming the setting (``model.name_or_path``, ``model.max_length``) and what to set.
    """
    config = getattr(model, "config", None)
    limit = check_max_length(model, path, max_length)
    vocab = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "vocab_size", 0) \
        if config is not None else 0
    if not vocab or vocab < 3:
        return
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, int(vocab), (1, min(8, limit or 8)), generator=g)
    changed = ids.clone()
    changed[0, -1] = 1 + (int(ids[0, -1]) % (int(vocab) - 1))  # another token at the last position
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            a = model(input_ids=ids, use_cache=False).logits[0, :-1]
            b = model(input_ids=changed, use_cache=False).logits[0, :-1]
    finally:
        model.train(was_training)
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
        kind = ", ".join(getattr(config, "architectures", None) or [type(model).__name__])
        raise ConfigError(f"model.name_or_path {path} is not a causal language model: its predictions at a position "
                          f"change with the tokens after it ({kind}, loaded as {type(model).__name__}), so "
                          "next-token training would teach it to copy. text-lm needs a decoder (GPT-2, Llama, Qwen2, "
                          "...); for an encoder such as MiniLM use --task text-csv (classification)")


class TokenChunks(Dataset):
    """Fixed-length chunks of a token stream.

    Items: ``input_ids`` and ``attention_mask`` ``(T,)`` int64, ``labels`` ``(T,)`` (the input ids, -100 where
    padded), ``index`` (int64 scalar).

    Raises:
        ValueError: ``length < 2`` or no tokens at all.
    """

    def __init__(self, ids: list[int], length: int, pad_id: int) -> None:
        if length < 2:
            raise ValueError(f"chunk length must be >= 2, got {length}")
        if not ids:
            raise ValueError("no tokens: the text is empty")
        n = math.ceil(len(ids) / length)
        flat = torch.full((n * length,), pad_id, dtype=torch.int64)
        flat[: len(ids)] = torch.tensor(ids, dtype=torch.int64)
        self.input_ids = flat.view(n, length)
        self.attention_mask = torch.zeros_like(self.input_ids)
        self.attention_mask.view(-1)[: len(ids)] = 1
        self.labels = self.input_ids.masked_fill(self.attention_mask == 0, IGNORE)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.labels[i],
                "index": torch.tensor(i)}


def read_texts(path: str | Path, column: str = "text") -> list[str]:
    """The texts of a ``.csv`` file's ``column`` (UTF-8, header row), or of any other file as one text (UTF-8).

    Raises:
        ConfigError: the file does not exist, is not UTF-8, has no such column, or holds no text.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"data.path {path} is not a file (text-lm reads a text file or a CSV column)")
    try:
        if path.suffix.lower() == ".csv":
            texts = [text for _, (text,) in read_csv_columns(path, (column,))]
        else:
            texts = [path.read_text(encoding="utf-8")]
    except UnicodeDecodeError:
        raise ConfigError(f"data file {path} is not UTF-8 text; save it as UTF-8") from None
    except ValueError as exc:  # a missing column (named with the ones present), a short row (its line)
        hint = ". Name it with --set data.text_column=..." if "no column" in str(exc) else ""
        raise ConfigError(f"data file {exc}{hint}") from None
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ConfigError(f"data file {path} holds no text")
    return texts


def tokenize(texts: list[str], tokenizer: Any, length: int) -> TokenChunks:
    """:class:`TokenChunks` of ``texts``, the end-of-text token between them when the tokenizer has one."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for row in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids += list(row) + ([eos] if eos is not None else [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    return TokenChunks(ids, length, pad)


def lm_datasets(cfg: Any, tokenizer: Any) -> tuple[Dataset, Dataset]:
    """Train and test chunks: ``data.test_path`` when given, else a seeded ``data.test_fraction`` of the chunks.

    Raises:
        ConfigError: bad files, or too little text for both a train and a test chunk.
    """
    from torch.utils.data import Subset

    length = cfg.model.max_length
    full = tokenize(read_texts(cfg.data.path, cfg.data.text_column), tokenizer, length)
    if cfg.data.test_path:
        return full, tokenize(read_texts(cfg.data.test_path, cfg.data.text_column), tokenizer, length)
    n_test = max(1, round(cfg.data.test_fraction * len(full)))
    if n_test >= len(full):
        raise ConfigError(f"data.path {cfg.data.path} gives {len(full)} chunk(s) of {length} tokens: too few for a "
                          "train and a test split; add text, lower model.max_length or give data.test_path")
    perm = torch.randperm(len(full), generator=torch.Generator().manual_seed(cfg.data.split_seed)).tolist()
    return Subset(full, sorted(perm[n_test:])), Subset(full, sorted(perm[:n_test]))
