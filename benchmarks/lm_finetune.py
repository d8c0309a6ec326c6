"""Language-model fine-tuning with nothing downloaded: ``lisa`` and ``badam`` against full fine-tuning, the freezing
strategies and LoRA, on a small Llama pretrained here.

    python -m benchmarks.lm_finetune              # the full benchmark: 3 seeds x 7 rows (see SIZES for its budget)
    python -m benchmarks.lm_finetune --quick      # reduced sizes, 1 seed: checks that it runs end to end

**Stage one** (trained once, then cached with SHA-256 checksums, as the ControlNet demo's frozen models are): a
byte-level BPE tokenizer (``tokenizers``, 2,048 tokens) and a Llama (``transformers.LlamaConfig`` /
``LlamaForCausalLM``: 16 layers of width 96, 4 heads, SwiGLU 256, embeddings tied to the LM head; 1.97M parameters)
pretrained on four of BBC News's five topics (business, entertainment, politics, sport: 1,824 articles). The
held-out topic (tech, 401 articles) is seen by neither the tokenizer nor the model. Why a tokenizer of our own and
this shape: what LISA and BAdam save is in the layers, and in the LLMs they were made for the layers are nearly all
of the weights (Llama-2-7B: 32 layers, embeddings + head 4%); MiniLM-L6's 30,522-token WordPiece at a width a CPU can
train in minutes would make the embeddings larger than all the layers. Here the embeddings are 10% of the weights,
and there are 16 layers to sample from (LISA's default trains 2 of them, 1/8; the paper's 7B setting 2 of 32).

**Stage two**: the stage-one model fine-tuned on tech (a fixed 80/20 split of its articles, texts cut into chunks
of ``seq`` tokens, one epoch over ``train_chunks`` of them) through the CLI trainer's ``text-lm`` task
(:func:`layerfreeze.train.compare.compare`, one call per seed: same data order, budget and learning-rate schedule
for every row), rows ``none`` (full fine-tuning),
``smartfrz``, ``static`` (the embeddings and the first half of the layers frozen), ``lisa`` (gamma 2, a new sample
every ``lisa_k`` steps: about 8 periods, as the paper's 122-step runs with K = 13), ``badam`` (one layer at a time,
``badam_k`` steps each: one block-epoch), ``lora-r4`` and ``lora-r16`` (peft, query and value projections; its own
learning rate). Per row, mean and standard deviation over the seeds of: the held-out perplexity (the test chunks'
mean token loss, exponentiated), the training time (steps only; those run under the FLOP counter are counted at
the mean plain step's time, :func:`uncounted_time`) and training FLOPs (``FlopCounterMode`` on real
steps, re-measured at every change of the frozen set) with their ratios to ``none``, the largest number of
parameters trainable at once (from the frozen set after every step: what gradients and Adam state scale with),
the process's peak RSS, and the memory ledger's peaks per bucket when the run's summary carries them
(:func:`ledger_cells`; ``-`` otherwise).

Results: ``OUT/results.json`` and ``OUT/table.md`` (``--markdown FILE`` also writes the table into a section of FILE),
each row's run folders under ``OUT/rows/seed<N>/``. Timings are only comparable within one run on an otherwise idle
machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.cli import entry, seed_list

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = "tech"
EOS = "<|endoftext|>"
MARK_BEGIN = "<!-- lm_finetune:begin -->"
MARK_END = "<!-- lm_finetune:end -->"
STAGE1_VERSION = 1  # bump when stage one's code changes what it trains: the cache key changes with it


@dataclass(frozen=True)
class Sizes:
    """Everything a run's numbers depend on. Stage one: ``vocab`` .. ``pretrain_lr``; stage two: the rest."""

    vocab: int = 2048
    hidden: int = 96
    layers: int = 16
    heads: int = 4
    ffn: int = 256
    seq: int = 128                   # tokens per chunk (model.max_length)
    articles: int | None = None      # articles per topic (None: all), for the test size
    pretrain_steps: int = 300
    pretrain_batch: int = 16
    pretrain_lr: float = 1e-2
    train_chunks: int = 512          # fine-tuning chunks (data.limit_train), of the held-out topic's 80%
    test_chunks: int = 128           # held-out chunks (data.limit_test), of its 20%
    epochs: int = 1
    batch: int = 8
    lr: float = 1e-3                 # fine-tuning AdamW learning rate (every row but LoRA)
    lora_lr: float = 5e-3
    lora_ranks: tuple[int, ...] = (4, 16)
    lisa_gamma: int = 2
    lisa_k: int = 8
    badam_k: int = 4
    seeds: int = 3

    @property
    def steps(self) -> int:
        """Fine-tuning optimizer steps per row."""
        return self.epochs * math.ceil(self.train_chunks / self.batch)


#: The full benchmark, sized by FLOPs (about 13 MFLOP per trained token for this model): stage one 300 steps of
#: 2,048 tokens (0.61M tokens, half an epoch: the loss leaves the unigram level, 6.55 nats, after ~120 steps at
#: learning rate 1e-2, where 3e-3 and 1e-2 were both still at 6.4 after 100 steps, and is at ~5.4 at 300), 8e12
#: FLOPs; stage two 21 rows of 64 steps of 1,024 tokens (one epoch of 512 chunks; 7.7e11 FLOPs for ``none``, less
#: for the others) and one evaluation of 16k tokens each. Measured only on a shared VM under load, one thread: at
#: load ~5, stage one in 371 s and one seed's 7 rows in 271 s (11 minutes for the whole one-seed run), so ~20
#: minutes for 3 seeds there; at load 7-9 about twice that. An idle 2-core machine with both threads should take
#: 12-15 minutes: to be confirmed there.
SIZES = Sizes()
#: ``--quick``: the same model, a fifth of the pretraining (still at the unigram level), a quarter of the
#: fine-tuning, one seed: it checks that everything runs, its numbers mean little.
QUICK = replace(SIZES, pretrain_steps=60, train_chunks=128, test_chunks=48, seeds=1, lisa_k=2, badam_k=1)
#: ``--tiny`` (the tests): a model of a few thousand parameters on 40 articles per topic; seconds.
TINY = Sizes(vocab=300, hidden=16, layers=4, heads=2, ffn=32, seq=32, articles=40, pretrain_steps=8,
             pretrain_batch=8, pretrain_lr=1e-2, train_chunks=16, test_chunks=8, epochs=1, batch=4, lr=1e-2,
             lora_lr=1e-2, lora_ranks=(2, 4), lisa_gamma=1, lisa_k=1, badam_k=1, seeds=1)


# ---- data ---------------------------------------------------------------------------------------------------------


def split_corpus(sizes: Sizes) -> tuple[list[str], list[str], list[str]]:
    """``(pretraining texts, fine-tuning texts, held-out texts)``: the four other topics' articles, then 80% / 20% of
    the held-out topic's by a fixed permutation (seed 0). ``sizes.articles`` keeps that many per topic.

    Raises:
        AssetMissingError: BBC News is not installed (``scripts/setup.sh`` installs it).
    """
    from layerfreeze.train.data import load_bbc_news

    texts, labels, classes = load_bbc_news()
    by_topic: dict[str, list[str]] = {}
    for text, label in zip(texts, labels):
        by_topic.setdefault(classes[label], []).append(text)
    if sizes.articles is not None:
        by_topic = {k: v[: sizes.articles] for k, v in by_topic.items()}
    held = by_topic.pop(HELD_OUT)
    order = torch.randperm(len(held), generator=torch.Generator().manual_seed(0)).tolist()
    cut = round(0.8 * len(held))
    pretrain = [t for topic in sorted(by_topic) for t in by_topic[topic]]
    return pretrain, [held[i] for i in sorted(order[:cut])], [held[i] for i in sorted(order[cut:])]


def write_csv(path: Path, texts: list[str]) -> None:
    """``texts`` as a one-column CSV (``text``), what the text-lm task reads."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text"])
        writer.writerows([t] for t in texts)


# ---- stage one: tokenizer and pretrained Llama, cached -----------------------------------------------------------


def train_tokenizer(texts: list[str], vocab: int) -> Any:
    """A byte-level BPE tokenizer (GPT-2's scheme: any text encodes, no unknown token) of ``vocab`` tokens trained on
    ``texts``, with ``<|endoftext|>`` as its end-of-text and padding token, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def llama_config(sizes: Sizes) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=sizes.vocab, hidden_size=sizes.hidden, intermediate_size=sizes.ffn,
                       num_hidden_layers=sizes.layers, num_attention_heads=sizes.heads,
                       num_key_value_heads=sizes.heads, max_position_embeddings=sizes.seq,
                       tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def stage1_key(sizes: Sizes) -> dict[str, Any]:
    """What stage one's result depends on (its cache folder is named by a hash of it)."""
    fields = ("vocab", "hidden", "layers", "heads", "ffn", "seq", "articles", "pretrain_steps", "pretrain_batch",
              "pretrain_lr")
    return {"sizes": {f: getattr(sizes, f) for f in fields}, "held_out": HELD_OUT, "seed": 0, "v": STAGE1_VERSION}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


CHECKSUMS = "checksums.json"
INFO = "stage1.json"


def verified(folder: Path) -> dict[str, Any] | None:
    """Stage one's info when ``folder`` holds a complete, unchanged stage one (every file's SHA-256 as recorded), else
    None."""
    try:
        sums = json.loads((folder / CHECKSUMS).read_text())
        if any(sha256(folder / name) != digest for name, digest in sums.items()) or INFO not in sums:
            return None
        return json.loads((folder / INFO).read_text())
    except (OSError, ValueError):
        return None


def pretrain(sizes: Sizes, texts: list[str], folder: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Train the tokenizer and the Llama on ``texts`` and save both into ``folder`` (a Hugging Face folder the
    text-lm task loads): AdamW (weight decay 0.1), ``pretrain_lr`` with 5% warm-up and a cosine decay, batches of
    ``pretrain_batch`` chunks from a seeded permutation (seed 0). Returns what it did (loss, tokens, seconds)."""
    from transformers import LlamaForCausalLM

    from layerfreeze.train.lm import NextTokenPrediction, lm_forward, tokenize
    from layerfreeze.train.loop import lr_lambda, warmup_steps

    start = time.perf_counter()
    tokenizer = train_tokenizer(texts, sizes.vocab)
    chunks = tokenize(texts, tokenizer, sizes.seq)
    log(f"stage 1: tokenizer of {sizes.vocab} tokens; {len(chunks)} chunks of {sizes.seq} tokens "
        f"({int(chunks.attention_mask.sum())} tokens) from {len(texts)} articles")
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(sizes))
    params = sum(p.numel() for p in model.parameters())
    log(f"stage 1: Llama, {sizes.layers} layers of width {sizes.hidden}, {params / 1e6:.2f}M parameters; "
        f"pretraining {sizes.pretrain_steps} steps of {sizes.pretrain_batch} chunks")
    optimizer = torch.optim.AdamW(model.parameters(), lr=sizes.pretrain_lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = warmup_steps(sizes.pretrain_steps, 0.05, "floor")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(sizes.pretrain_steps, warmup, "cosine"))
    objective, g = NextTokenPrediction(), torch.Generator().manual_seed(0)
    order: list[int] = []
    model.train()
    losses = []
    for step in range(sizes.pretrain_steps):
        if len(order) < sizes.pretrain_batch:
            order += torch.randperm(len(chunks), generator=g).tolist()
        idx, order = order[: sizes.pretrain_batch], order[sizes.pretrain_batch:]
        batch = {k: getattr(chunks, k)[idx] for k in ("input_ids", "attention_mask", "labels")}
        loss = objective.loss(lm_forward(model, batch), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 25 == 0 or step == sizes.pretrain_steps - 1:
            log(f"  pretrain step {step + 1}/{sizes.pretrain_steps}: loss {losses[-1]:.3f}")
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    tail = losses[-max(1, len(losses) // 10):]
    return {"key": stage1_key(sizes), "parameters": params, "loss": sum(tail) / len(tail),
            "tokens": sizes.pretrain_steps * sizes.pretrain_batch * sizes.seq, "seconds": time.perf_counter() - start}


def stage1(sizes: Sizes, texts: list[str], cache: Path, log: Callable[[str], None] = print) -> tuple[Path, dict]:
    """The pretrained model's folder: read from ``cache`` when a verified copy of this configuration is there, else
    trained (:func:`pretrain`) into a temporary folder, checksummed and moved into place. A changed configuration has
    another folder name; a file that changed on disk fails its checksum and stage one trains again.

    Returns:
        ``(folder, info)``; ``info["cached"]`` says whether it was read from the cache.
    """
    key = stage1_key(sizes)
    folder = cache / f"llama-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}"
    info = verified(folder) if folder.exists() else None
    if info is not None:
        log(f"stage 1: read from {folder} (checksums verified; pretrained in {info['seconds']:.0f} s)")
        return folder, {**info, "cached": True}
    if folder.exists():
        log(f"stage 1: {folder} is incomplete or changed (checksum mismatch): training again")
        shutil.rmtree(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    info = pretrain(sizes, texts, tmp, log)
    (tmp / INFO).write_text(json.dumps(info, indent=1))
    sums = {p.name: sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / CHECKSUMS).write_text(json.dumps(sums, indent=1))
    tmp.rename(folder)
    log(f"stage 1: saved to {folder} ({len(sums)} files, SHA-256 in {CHECKSUMS})")
    return folder, {**info, "cached": False}


# ---- stage two: the rows ------------------------------------------------------------------------------------------


def rows_of(sizes: Sizes) -> list[str]:
    return ["none", "smartfrz", "static", "lisa", "badam", *(f"lora-r{r}" for r in sizes.lora_ranks)]


def base_config(sizes: Sizes, folder: Path, data: Path, seed: int, threads: int | None) -> dict[str, Any]:
    """The text-lm config every row shares (:func:`layerfreeze.train.compare.compare` adds each row's strategy)."""
    return {
        "task": "text-lm",
        "model": {"name_or_path": str(folder), "max_length": sizes.seq},
        "data": {"path": str(data / "train.csv"), "test_path": str(data / "test.csv"),
                 "limit_train": sizes.train_chunks, "limit_test": sizes.test_chunks},
        "train": {"epochs": sizes.epochs, "batch_size": sizes.batch, "eval_batch_size": 32, "lr": sizes.lr,
                  "weight_decay": 0.01, "schedule": "cosine", "warmup_fraction": 0.1, "seed": seed},
        "run": {"progress": False, "tensorboard": False, "checkpoint": False, "threads": threads},
    }


def row_params(sizes: Sizes) -> dict[str, dict[str, Any]]:
    return {"static": {"k": 1 + sizes.layers // 2}, "lisa": {"gamma": sizes.lisa_gamma, "k": sizes.lisa_k},
            "badam": {"k": sizes.badam_k}}


#: The memory ledger's columns in the table: (header, the buckets of ``summary["memory"]``, or None for the tensor
#: peak ``summary["memory"]["tensor_peak_bytes"]``). A one-bucket column is that bucket's peak over the run; a
#: column of several buckets is their sum at the tensor peak's step (``at_tensor_peak``): the sum of two peaks
#: reached at different steps would count a block twice (``params_trainable`` peaks before a freeze,
#: ``params_frozen`` after it).
LEDGER_COLUMNS: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    ("params", ("params_trainable", "params_frozen")),
    ("grads", ("grads",)),
    ("optimizer", ("optimizer",)),
    ("activations", ("activations",)),
    ("tensor peak", None),
)


def ledger_cells(summary: dict[str, Any]) -> dict[str, int | None]:
    """The ledger's peak bytes per column of :data:`LEDGER_COLUMNS` from a run's summary, None for each when the
    summary has no ``memory`` entry (the trainer without the memory ledger) or lacks the bucket."""
    memory = summary.get("memory")
    out: dict[str, int | None] = {}
    for header, buckets in LEDGER_COLUMNS:
        value = None
        if isinstance(memory, dict):
            if buckets is None:
                value = memory.get("tensor_peak_bytes")
            elif len(buckets) == 1:
                peak = memory.get("buckets", {}).get(buckets[0], {}).get("peak_bytes")
                value = peak if isinstance(peak, int) else None
            else:
                parts = [memory.get("at_tensor_peak", {}).get(b) for b in buckets]
                value = sum(parts) if all(isinstance(p, int) for p in parts) else None
        out[header] = value
    return out


def run_seed(sizes: Sizes, folder: Path, data: Path, out: Path, seed: int, threads: int | None,
             console: Any) -> list[dict[str, Any]]:
    """One :func:`~layerfreeze.train.compare.compare` call: every row on one seed. Each result gets
    ``max_trainable`` (the most parameters trainable at once, read after every step) and ``ledger``."""
    from layerfreeze.train.compare import compare

    rows = rows_of(sizes)
    most: dict[str, int] = {}

    def tracker(row: str) -> Callable[[Any], None]:
        def track(trainer: Any) -> None:
            most[row] = max(most.get(row, 0), trainer.freezer.trainable_parameters())
        return track

    results = compare(base_config(sizes, folder, data, seed, threads), rows, out / f"seed{seed}", console=console,
                      row_params=row_params(sizes),
                      row_overrides={r: {"train": {"lr": sizes.lora_lr}} for r in rows if r.startswith("lora")},
                      row_callbacks={r: [tracker(r)] for r in rows})
    for r in results:
        r["max_trainable"] = most.get(r["row"])
        r["ledger"] = ledger_cells(r)
        if not r.get("stopped"):
            r["steps_time_s"], r["flop_counted_steps"] = uncounted_time(Path(r["run_dir"]))
    return results


def uncounted_time(run_dir: Path) -> tuple[float, int]:
    """``(training time, steps run under the FLOP counter)``: the mean time of the steps that did not run under
    ``FlopCounterMode``, times the number of steps.

    Why: the trainer measures FLOPs on the first step after every change of the frozen set, inside
    ``FlopCounterMode``, and that step's time (1.2-2.5x a plain step for this model, measured) counts in its
    ``train_time_s``. ``none`` pays it once; ``lisa`` at every period and ``badam`` at every switch, so its raw
    time would be 10-25% too high here. The raw ``train_time_s`` stays in ``results.json``.
    """
    from layerfreeze.runs.rundir import Event, read_metrics

    records = read_metrics(run_dir)
    counted = {r["step"] for r in records if r["type"] == "event" and r.get("kind") == Event.FLOPS_REMEASURED}
    steps = [r for r in records if r["type"] == "step"]
    plain = [r["step_time_s"] for r in steps if r["step"] not in counted]
    if not plain:
        return sum(r["step_time_s"] for r in steps), len(counted)
    return statistics.fmean(plain) * len(steps), len(counted)


def pretrained_perplexity(sizes: Sizes, folder: Path, data: Path) -> float:
    """The stage-one model's perplexity on the held-out chunks every row is evaluated on (no fine-tuning)."""
    from layerfreeze.train.config import build_config
    from layerfreeze.train.evaluation import evaluate
    from layerfreeze.train.tasks import build_task

    task = build_task(build_config(base_config(sizes, folder, data, 0, None)))
    return evaluate(task, task.model, torch.device("cpu"), 32)[1]


# ---- the table ----------------------------------------------------------------------------------------------------


def aggregate(per_seed: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per row, over the seeds: mean and standard deviation of the held-out perplexity, means of time, FLOPs, peak RSS,
    the largest trainable set and the ledger's columns; ratios to ``none`` per seed, then averaged."""
    rows = [r["row"] for r in per_seed[0]]
    out = []
    for row in rows:
        runs = [next(r for r in seed if r["row"] == row) for seed in per_seed]
        base = [next(r for r in seed if r["row"] == "none") for seed in per_seed]
        ok = [(r, b) for r, b in zip(runs, base) if not r.get("stopped")]
        if not ok:
            out.append({"row": row, "stopped": runs[0]["stopped"]})
            continue
        ppl = [r["test_perplexity"] for r, _ in ok]

        def mean(values: list[float | None]) -> float | None:
            values = [v for v in values if v is not None]
            return statistics.fmean(values) if values else None

        entry = {
            "row": row, "seeds": len(ok), "perplexity": statistics.fmean(ppl),
            "perplexity_sd": statistics.stdev(ppl) if len(ppl) > 1 else 0.0,
            "perplexity_vs_none": mean([r["test_perplexity"] / b["test_perplexity"] - 1 for r, b in ok]),
            "train_time_s": mean([r["steps_time_s"] for r, _ in ok]),
            "time_ratio": mean([r["steps_time_s"] / b["steps_time_s"] for r, b in ok]),
            "train_time_raw_s": mean([r["train_time_s"] for r, _ in ok]),
            "flops_total": mean([r["flops_total"] for r, _ in ok]),
            "flops_ratio": mean([r["flops_total"] / b["flops_total"] for r, b in ok]),
            "max_trainable": mean([r.get("max_trainable") for r, _ in ok]),
            "trainable_ratio": mean([r["max_trainable"] / b["max_trainable"] for r, b in ok
                                     if r.get("max_trainable") and b.get("max_trainable")]),
            "peak_rss_bytes": mean([r.get("peak_memory_bytes") for r, _ in ok]),
            "ledger": {h: mean([r["ledger"][h] for r, _ in ok]) for h, _ in LEDGER_COLUMNS},
        }
        out.append(entry)
    return out


def markdown(table: list[dict[str, Any]], pretrained: float) -> str:
    from layerfreeze.runs.summary import format_bytes, format_flops

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    def size(x: float | None) -> str:
        return "-" if x is None else format_bytes(x)

    def count(x: float) -> str:
        return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k"

    heads = ["row", "held-out ppl", "vs none", "train s", "time ratio", "train FLOPs", "FLOPs ratio",
             "max trainable", "peak RSS", *(f"{h} (ledger)" for h, _ in LEDGER_COLUMNS)]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads),
             f"| pretrained, not fine-tuned | {pretrained:.2f} |" + " |" * (len(heads) - 2)]
    for r in table:
        if r.get("stopped"):
            lines.append(f"| {r['row']} | stopped: {r['stopped']} |" + " |" * (len(heads) - 2))
            continue
        lines.append("| " + " | ".join([
            r["row"], f"{r['perplexity']:.2f} ± {r['perplexity_sd']:.2f}",
            num(None if r["perplexity_vs_none"] is None else 100 * r["perplexity_vs_none"], "+.1f") + "%",
            num(r["train_time_s"], ".1f"), num(r["time_ratio"], ".2f"),
            "-" if r["flops_total"] is None else format_flops(r["flops_total"]), num(r["flops_ratio"], ".2f"),
            "-" if r["max_trainable"] is None else f"{count(r['max_trainable'])} ({r['trainable_ratio']:.2f})",
            size(r["peak_rss_bytes"]), *(size(r["ledger"][h]) for h, _ in LEDGER_COLUMNS)]) + " |")
    return "\n".join(lines) + "\n"


# ---- main ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="reduced sizes, 1 seed (QUICK)")
    size.add_argument("--tiny", action="store_true", help="the test size: a tiny model, 40 articles per topic")
    parser.add_argument("--seeds", type=seed_list,
                        help="comma-separated seeds (default: 0,1,2; 0 with --quick or --tiny)")
    parser.add_argument("--out", default="runs/lm-finetune", help="results folder (its rows/ is replaced)")
    parser.add_argument("--cache", default="runs/lm-finetune-stage1", help="stage-one cache folder")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--markdown", help="also write the table into this Markdown file's lm_finetune section")
    parser.add_argument("--from-json", metavar="RESULTS",
                        help="print (and with --markdown write) the table from a results.json, training nothing")
    args = parser.parse_args(argv)
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        for seed in results["per_seed"]:
            for r in seed:
                r["ledger"] = ledger_cells(r)
        text = markdown(aggregate(results["per_seed"]), results["pretrained_perplexity"])
        print(text, end="")
        if args.markdown:
            from benchmarks.markdown_section import update_section

            update_section(Path(args.markdown), MARK_BEGIN, MARK_END, text, "## Language-model fine-tuning")
        return 0
    sizes = TINY if args.tiny else QUICK if args.quick else SIZES
    seeds = args.seeds if args.seeds is not None else list(range(sizes.seeds))
    sizes = replace(sizes, seeds=len(seeds))  # results.json's sizes say how many ran
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 200, soft_wrap=False)
    out = Path(args.out)

    def log(message: str) -> None:
        console.print(message, highlight=False)

    wall = time.perf_counter()
    pretrain_texts, train_texts, test_texts = split_corpus(sizes)
    folder, info = stage1(sizes, pretrain_texts, Path(args.cache), log)
    data = out / "data"
    write_csv(data / "train.csv", train_texts)
    write_csv(data / "test.csv", test_texts)
    shutil.rmtree(out / "rows", ignore_errors=True)
    pretrained = pretrained_perplexity(sizes, folder, data)
    log(f"held-out topic {HELD_OUT}: {len(train_texts)} articles to fine-tune on, {len(test_texts)} held out; "
        f"pretrained model's perplexity on them {pretrained:.2f}; {sizes.steps} steps per row")
    per_seed = [run_seed(sizes, folder, data, out / "rows", seed, args.threads, console) for seed in seeds]
    table = aggregate(per_seed)
    text = markdown(table, pretrained)
    console.print(text, highlight=False, markup=False)
    results = {"command": " ".join(["python", "-m", "benchmarks.lm_finetune", *(argv or sys.argv[1:])]),
               "sizes": asdict(sizes), "seeds": seeds, "stage1": info, "pretrained_perplexity": pretrained,
               "table": table, "per_seed": per_seed, "wall_time_s": time.perf_counter() - wall,
               "threads": torch.get_num_threads()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "table.md").write_text(text)
    if args.markdown:
        from benchmarks.markdown_section import update_section

        update_section(Path(args.markdown), MARK_BEGIN, MARK_END, text, "## Language-model fine-tuning")
    log(f"wall time {time.perf_counter() - wall:.0f} s; {out / 'table.md'}, {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main))
