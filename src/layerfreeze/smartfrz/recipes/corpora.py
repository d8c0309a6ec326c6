"""The recipes' datasets, all installed offline: scikit-learn's digits, Fashion-MNIST, BBC News with MiniLM-L6's
tokenizer (its topics, or its text as next-token chunks). Each is cached per process and split into fixed subsets
(train, probe batch, test) that do not depend on the run's seed.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FMNIST_MEAN, FMNIST_STD = 0.2860, 0.3530


def split_probe_test(x: dict[str, torch.Tensor], y: torch.Tensor, probe: int, test: int
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """Held-out samples in a fixed shuffled order (seed 0; splits are often sorted by class): the first ``probe``
    are the probe batch, the next ``test`` the accuracy subset."""
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    p = {k: v[order[:probe]] for k, v in x.items()}
    t = {k: v[order[probe:probe + test]] for k, v in x.items()}
    return p, t, y[order[probe:probe + test]]


@functools.lru_cache(maxsize=2)
def digits(size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes; no download), a fixed stratified 80/20
    split, standardised with the train mean/std; ``size`` != 8 resizes (bilinear) for the fine-tune recipe."""
    from sklearn.datasets import load_digits

    from layerfreeze.train.data import stratified_split

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0
    if size != 8:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    y = torch.tensor(d.target, dtype=torch.int64)
    tr, te = stratified_split(y.tolist(), 0.2, seed=0)
    mean, std = x[tr].mean(), x[tr].std()
    x = (x - mean) / std
    return x[tr], y[tr], x[te], y[te]


@functools.lru_cache(maxsize=4)
def fmnist(size: int, n_train: int, n_test: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fashion-MNIST subsets as ``(N, 1, size, size)`` uint8 (the first ``n_train`` / ``n_test`` images)."""
    from layerfreeze.train.data import load_fashion_mnist

    tr = load_fashion_mnist("train", size=size, limit=n_train)
    te = load_fashion_mnist("test", size=size, limit=n_test)
    return tr.images, tr.labels, te.images, te.labels


def gray(x: torch.Tensor) -> torch.Tensor:
    return (x.float() / 255.0 - FMNIST_MEAN) / FMNIST_STD


def imagenet_rgb(x: torch.Tensor) -> torch.Tensor:
    from layerfreeze.train.data import IMAGENET_MEAN, IMAGENET_STD

    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (x.float().div(255.0).expand(-1, 3, -1, -1) - mean) / std


def bbc_split(labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Article indices ``(train, test)`` of the fixed stratified 80/20 split of :mod:`layerfreeze.train.tasks` (seed 0),
    the train side in a seeded order (the split is sorted by class; the order mixes them). Shared by the
    classification and the language-model recipes, so both see the same articles on each side."""
    from layerfreeze.train.data import stratified_split

    tr, te = stratified_split(labels, 0.2, seed=0)
    return torch.tensor(tr)[torch.randperm(len(tr), generator=torch.Generator().manual_seed(0))], torch.tensor(te)


@functools.lru_cache(maxsize=2)
def bbc(max_length: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """BBC News tokenized with MiniLM-L6's tokenizer to ``max_length``; the fixed stratified 80/20 split of
    :mod:`layerfreeze.train.tasks` (seed 0)."""
    from transformers import AutoTokenizer

    from layerfreeze.train.assets import minilm_dir
    from layerfreeze.train.data import load_bbc_news
    from layerfreeze.train.loaders import quiet_transformers

    quiet_transformers()
    texts, labels, _ = load_bbc_news()
    tok = AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)
    enc = tok(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    x = {k: enc[k].long() for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}
    y = torch.tensor(labels, dtype=torch.int64)
    tr_t, te_t = bbc_split(labels)
    return {k: v[tr_t] for k, v in x.items()}, y[tr_t], {k: v[te_t] for k, v in x.items()}, y[te_t]


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position: ``logits`` ``(B, T, V)``, ``labels`` ``(B, T)`` already
    shifted (``labels[b, t]`` is the token after input ``t``, :func:`bbc_lm`), so position ``t``'s logits are
    scored against ``labels[:, t]``; computed in float32."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


@functools.lru_cache(maxsize=1)
def bbc_token_streams() -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(train stream, held-out stream, tokenizer vocabulary size)`` of :func:`bbc_lm`: MiniLM-L6 token ids
    ``(n,)`` int64, every article followed by ``[SEP]``. Cached apart from the chunking, so recipes at another
    context or vocabulary (quick mode, tests) tokenize the 2,225 articles only once per process."""
    from transformers import AutoTokenizer

    from layerfreeze.train.assets import minilm_dir
    from layerfreeze.train.data import load_bbc_news
    from layerfreeze.train.loaders import quiet_transformers

    quiet_transformers()
    texts, labels, _ = load_bbc_news()
    tok = AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)
    tr, te = (idx.tolist() for idx in bbc_split(labels))
    # articles run past the tokenizer's 512-token model length: nothing here feeds them to MiniLM, so say nothing
    tok.model_max_length = 1 << 30

    def stream(idx: list[int]) -> torch.Tensor:
        ids = tok([texts[i] for i in idx], add_special_tokens=False)["input_ids"]
        return torch.tensor([t for article in ids for t in (*article, tok.sep_token_id)], dtype=torch.int64)

    return stream(tr), stream(te), len(tok)


@functools.lru_cache(maxsize=2)
def bbc_lm(context: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """BBC News as next-token chunks for the causal-LM recipes: ``(train inputs, train labels, held-out inputs,
    held-out labels)``, each ``(N, context)`` int64 in ``[0, vocab)``; ``labels[n, t]`` is the token after
    ``inputs[n, t]`` in the stream.

    Each side of :func:`bbc`'s fixed stratified 80/20 split (seed 0; the train articles in its seeded order, so
    topics mix) is tokenized with MiniLM-L6's WordPiece tokenizer without special tokens, every article followed
    by ``[SEP]`` (a document boundary, as GPT-2's end-of-text), and concatenated: 869,384 train tokens (1,781
    articles) and 211,379 held-out (444). The stream is cut into consecutive chunks of ``context`` tokens, the
    labels being the stream shifted by one (the target of a chunk's last position is the first token of the next
    chunk), so every position of every chunk is a prediction and no padding or ignored label is needed; the tail
    that does not fill a chunk is dropped (13,584 train and 3,302 held-out chunks at 64).

    Vocabulary: MiniLM's ids are mapped to ``vocab`` ids, 0 for ``[UNK]`` and ``1 .. vocab - 1`` for the train
    stream's most frequent tokens, most frequent first (ties by tokenizer id); every other token, train or
    held-out, becomes 0. Why: an LM's head computes ``(B, T, vocab)`` logits; at MiniLM's 30,522 that is ~5x
    the cost of the four 128-wide layers, and a run would not fit a few minutes on 2 CPU cores. 8,191 tokens
    cover 96.3% of the train stream (``[UNK]`` is 3.7% of the train targets and 4.5% of the held-out ones, the
    most frequent token, ``the``, 4.9%); at 4,096 ``[UNK]`` would be the most frequent target (9.9%), and
    predicting it would inflate the accuracy.
    """
    train, held, tokenizer_vocab = bbc_token_streams()
    counts = torch.bincount(train, minlength=tokenizer_vocab)
    order = torch.sort(counts, descending=True, stable=True).indices
    keep = order[: vocab - 1][counts[order[: vocab - 1]] > 0]
    remap = torch.zeros(tokenizer_vocab, dtype=torch.int64)
    remap[keep] = torch.arange(1, len(keep) + 1)

    def chunks(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = remap[s]
        n = (len(s) - 1) // context
        return s[: n * context].view(n, context), s[1: n * context + 1].view(n, context)

    return (*chunks(train), *chunks(held))
