"""An LLM-sized step on one device: a Llama trained from random weights in your own loop, per strategy.

Issue 40's LLM table, written against the public API as a user's own loop would be (README, "In your own training
loop"): :func:`layerfreeze.discover_blocks`, :func:`layerfreeze.block_param_groups`, :class:`layerfreeze.Freezer`.
The model is ``transformers.LlamaForCausalLM`` from a ``LlamaConfig`` (default: hidden 2048, 16 layers of 16 heads,
SwiGLU 5632, the vocabulary of MiniLM-L6's WordPiece tokenizer, 30,522 tokens: 947M parameters, embeddings not tied
to the LM head; 953M with the synthetic text's 32,000 tokens, the size of issue 40's table), random weights (seed 0,
the same for every row), float32 weights under bfloat16 autocast, AdamW (``fused=True`` on CUDA; learning rate
``--lr`` with a linear warm-up over ``--warmup`` steps, then constant; weight decay 0.01), batch ``--batch`` x
``--seq`` tokens, ``--steps`` optimizer steps (default 200: long enough that SmartFRZ's stage cadence is that of a
real run, which it derives from the run's length).

Rows, one after another in one process (``gc.collect()`` and ``torch.cuda.empty_cache()`` between them, the
allocator's peak reset after the row's model and optimizer are built):

* ``none``: every block trains;
* ``static``: the first half of the blocks frozen (``k = len(blocks) // 2``: the embeddings and 8 of 16 layers);
* ``lisa``, ``badam``, ``smartfrz``: the strategies with their defaults (LISA: 2 middle layers, a new sample every
  20 steps; BAdam: one layer at a time, 50 steps each, ascending; SmartFRZ: the shipped predictor);
* ``lora-r16``: peft LoRA of rank 16 (alpha 32) on the attention's query and value projections, the base model
  frozen, learning rate ``--lora-lr`` (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021).

``--compile blocks`` (issue 42) compiles every row's blocks as the trainer's ``train.compile: blocks`` does
(:class:`layerfreeze.train.compile.CompiledRegions`: each block's modules a region, one compiled function per module
class, every region's graph keyed on its trainable set, the keys refreshed before a forward whenever the frozen set
changed); ``--compile-backend`` picks torch.compile's backend (``inductor``; ``aot_eager`` for a quick CPU check). Each
row then also reports the seconds it spent compiling (Dynamo's outermost compile callbacks) and the graphs it
compiled, and its median step leaves out the steps that compiled (a recompile after a freeze is a step of its own).

Per row: the median milliseconds per step (timed with CUDA events from before the forward to after
``freezer.step()``, read once at the end, so timing adds no host synchronisation; ``time.perf_counter`` on a CPU),
the first two steps left out as warm-up; for ``smartfrz`` also its median before its first freeze (the steps up to
the stage that froze a block, all steps when none froze) beside ``none``'s median over the same steps, and their
ratio (issue 40: at most 1.02); the number of steps on which the Freezer ran a stage (``freezer.step()`` returned a
decision); the allocator's peak (``torch.cuda.max_memory_allocated``; None on a CPU); the trainable parameters at the
start; and the perplexity on held-out text (the exponential of the mean token loss over up to ``--eval-batches``
batches of held-out chunks, under the same autocast).

Data (``--data``): ``bbc`` tokenizes BBC News with MiniLM-L6's tokenizer (``--tokenizer``: a folder with
``tokenizer.json``; default the installed MiniLM-L6's), every article joined by ``[SEP]`` into one stream cut into
chunks of ``--seq`` tokens; every tenth article (0, 10, 20, ...) is held out for perplexity. ``synthetic`` draws
token streams from a random first-order Markov chain (each token followed by one of 8 successors drawn at random,
seed 0): a language a model can learn, whose perplexity floor is 8. ``auto`` (the default) is ``bbc`` when BBC News
and the tokenizer are installed, else ``synthetic``.

    python -m benchmarks.llm_device --device cuda:0 --out runs/llm-device                      # the GPU check's
    python -m benchmarks.llm_device --hidden 64 --layers 4 --steps 12 --seq 32 --batch 2       # seconds, on CPU

Writes ``OUT/results.json`` and ``OUT/table.md`` after every row (a run stopped at its time limit keeps the rows it
finished), and prints the table. Times are only comparable between rows of one invocation on an otherwise idle
machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.cli import entry
from layerfreeze import Freezer, block_param_groups, discover_blocks
from layerfreeze.runs.rundir import finite
from layerfreeze.runs.summary import format_bytes

ROWS = ("none", "static", "lisa", "badam", "smartfrz", "lora-r16")
#: Steps left out of the medians: the first kernels, cuBLAS's workspace and the allocator's growth.
WARMUP_STEPS = 2
#: Successors per token of the synthetic Markov chain: its perplexity floor.
SYNTHETIC_BRANCHING = 8
SYNTHETIC_VOCAB = 32000


@dataclass
class Corpus:
    """Token chunks for training and for perplexity, each ``(n, seq)`` int64 on the CPU."""

    train: torch.Tensor
    held_out: torch.Tensor
    vocab: int
    source: str


def bbc_corpus(seq: int, tokenizer_dir: str | None) -> Corpus:
    """BBC News tokenized with MiniLM-L6's tokenizer, cut into chunks of ``seq`` tokens (see the module docstring).

    Raises:
        AssetMissingError: BBC News or MiniLM-L6 is not installed (and no ``tokenizer_dir`` was given).
    """
    from transformers import AutoTokenizer

    from layerfreeze.train.assets import minilm_dir
    from layerfreeze.train.data import load_bbc_news

    texts, _, _ = load_bbc_news()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir or str(minilm_dir()))
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    sep = tok.sep_token_id if tok.sep_token_id is not None else 0

    def chunks(keep: list[int]) -> torch.Tensor:
        stream = torch.tensor([t for i in keep for t in (*ids[i], sep)], dtype=torch.long)
        n = len(stream) // seq
        return stream[: n * seq].view(n, seq)

    held = [i for i in range(len(ids)) if i % 10 == 0]
    train = [i for i in range(len(ids)) if i % 10 != 0]
    return Corpus(chunks(train), chunks(held), len(tok), "bbc")


def synthetic_corpus(seq: int, train_chunks: int, held_chunks: int, vocab: int = SYNTHETIC_VOCAB) -> Corpus:
    """Chunks of a random first-order Markov chain over ``vocab`` tokens, ``SYNTHETIC_BRANCHING`` successors each."""
    g = torch.Generator().manual_seed(0)
    successors = torch.randint(0, vocab, (vocab, SYNTHETIC_BRANCHING), generator=g)
    n = train_chunks + held_chunks
    out = torch.empty(n, seq, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, seq):
        pick = torch.randint(0, SYNTHETIC_BRANCHING, (n,), generator=g)
        out[:, t] = successors[out[:, t - 1], pick]
    return Corpus(out[:train_chunks], out[train_chunks:], vocab, "synthetic")


def load_corpus(kind: str, seq: int, batch: int, steps: int, eval_batches: int, tokenizer_dir: str | None) -> Corpus:
    """The corpus ``--data`` names (``auto``: BBC News when it and the tokenizer are installed, else synthetic)."""
    from layerfreeze.errors import AssetMissingError

    if kind in ("bbc", "auto"):
        try:
            return bbc_corpus(seq, tokenizer_dir)
        except (AssetMissingError, OSError) as exc:
            if kind == "bbc":
                raise
            print(f"llm_device: BBC News or the tokenizer is missing ({exc}); synthetic text instead", flush=True)
    return synthetic_corpus(seq, min(steps * batch, 4096), eval_batches * batch)


def llama_config(args: argparse.Namespace, vocab: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.heads, max_position_embeddings=max(args.seq, 2048),
                       tie_word_embeddings=False, use_cache=False)


def lora_rank(row: str) -> int | None:
    return int(row.split("-r", 1)[1]) if row.startswith("lora-r") else None


def build_row(row: str, args: argparse.Namespace, config: Any, device: torch.device) -> tuple[Any, Any, Any, Any]:
    """``(model, optimizer, scheduler, freezer)`` of a row; the freezer is None for LoRA."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    with device:  # initialised on the device: seconds for 1B parameters, where the CPU would take a minute
        model = LlamaForCausalLM(config)
    model.train()
    fused = True if device.type == "cuda" else None
    warmup = max(1, args.warmup)

    def schedule(step: int) -> float:
        return min(1.0, (step + 1) / warmup)

    rank = lora_rank(row)
    if rank is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=args.lora_lr, weight_decay=0.01, fused=fused)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule), None
    blocks = discover_blocks(model)
    optimizer = torch.optim.AdamW(block_param_groups(model, blocks, lr=args.lr, weight_decay=0.01), fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)  # before the Freezer (README)
    params = {"k": len(blocks) // 2} if row == "static" else {}
    freezer = Freezer(model, optimizer, row, params, blocks=blocks, scheduler=scheduler, total_steps=args.steps)
    return model, optimizer, scheduler, freezer


@torch.no_grad()
def perplexity(model: Any, chunks: torch.Tensor, batch: int, batches: int, device: torch.device) -> float:
    """``exp`` of the mean token loss over up to ``batches`` batches of ``chunks`` (every chunk has as many tokens,
    so the mean of the batches' mean losses is the mean token loss)."""
    model.eval()
    losses = []
    for i in range(0, min(len(chunks), batch * batches), batch):
        x = chunks[i: i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            losses.append(model(input_ids=x, labels=x).loss.float())
    model.train()
    return math.exp(torch.stack(losses).mean().item()) if losses else math.nan


def compile_blocks(model: Any, freezer: Any, backend: str) -> Any:
    """The row's blocks compiled as regions (``train.compile: blocks``'s :class:`CompiledRegions`): the Freezer's
    blocks, or, for LoRA, the blocks :func:`discover_blocks` finds in the peft model (its base model's)."""
    from layerfreeze.train.compile import CompiledRegions

    blocks = freezer.blocks if freezer is not None else discover_blocks(model)
    return CompiledRegions(model, [m for b in blocks for _, m in b.modules], "blocks", backend)


def run_row(row: str, args: argparse.Namespace, config: Any, corpus: Corpus, device: torch.device) -> dict[str, Any]:
    """Train one row for ``args.steps`` steps; its numbers (see the module docstring)."""
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    wall0 = time.perf_counter()
    model, optimizer, scheduler, freezer = build_row(row, args, config, device)
    regions = compile_blocks(model, freezer, args.compile_backend) if args.compile == "blocks" else None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    order = torch.randperm(len(corpus.train), generator=torch.Generator().manual_seed(args.seed))
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    events: list[tuple[Any, Any]] = []
    seconds: list[float] = []
    losses: list[torch.Tensor] = []
    stage_steps: list[int] = []
    compile_steps: list[int] = []  # steps during which Dynamo compiled (left out of the median)
    try:
        for step in range(1, args.steps + 1):
            pick = order[torch.arange((step - 1) * args.batch, step * args.batch) % len(order)]
            x = corpus.train[pick].to(device, non_blocking=True)
            if regions is not None:
                regions.refresh(freezer.frozen if freezer is not None else ())
                compiled_before = regions.compiled_graphs()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            if freezer is not None:
                freezer.after_backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if freezer is not None and freezer.step() is not None:
                stage_steps.append(step)
            if cuda:
                end.record()
                events.append((start, end))
            else:
                seconds.append(time.perf_counter() - t0)
            if regions is not None and regions.compiled_graphs() != compiled_before:
                compile_steps.append(step)
            losses.append(loss.detach())
        if cuda:
            torch.cuda.synchronize(device)
            seconds = [s.elapsed_time(e) / 1000 for s, e in events]
        peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
        ppl = perplexity(model, corpus.held_out, args.batch, args.eval_batches, device)
        train_losses = torch.stack(losses).float().tolist()
        frozen_end = freezer.frozen_blocks if freezer is not None else []
        # the step of the stage that first froze a block (0: the start stage, before any step), from the history
        first_freeze = min((h["step"] for h in (freezer.history if freezer is not None else [])
                            if h["kind"] == "freeze"), default=None)
        compiled = ({"compile_s": regions.compile_seconds(), "graphs": regions.compiled_graphs(),
                     "compile_steps": compile_steps} if regions is not None else {})
    finally:
        if regions is not None:
            regions.close()
        if freezer is not None:
            freezer.close()
    del model, optimizer, scheduler, freezer, losses, regions
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    timed = [s for i, s in enumerate(seconds, 1) if i > WARMUP_STEPS and i not in compile_steps] or seconds
    return {
        "row": row, "steps": len(seconds), "step_s": seconds, "ms_per_step": 1000 * statistics.median(timed),
        "first_freeze_step": first_freeze, "stage_steps": len(stage_steps),
        "stage_every_median": statistics.median([b - a for a, b in zip(stage_steps, stage_steps[1:])])
        if len(stage_steps) > 1 else None,
        "allocator_peak_bytes": peak, "perplexity": ppl, "trainable_parameters_start": trainable,
        "train_loss_last": statistics.mean(train_losses[-10:]), "frozen_blocks_end": frozen_end,
        "row_wall_s": time.perf_counter() - wall0, **compiled,
    }


def before_first_freeze(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """smartfrz's median step before its first freeze beside none's over the same steps, and their ratio."""
    by = {r["row"]: r for r in rows}
    if "smartfrz" not in by or "none" not in by:
        return None
    s, n = by["smartfrz"], by["none"]
    last = s["first_freeze_step"] if s["first_freeze_step"] is not None else s["steps"]
    lo = min(WARMUP_STEPS, max(0, last - 1))
    skip = set(s.get("compile_steps", ())) | set(n.get("compile_steps", ()))  # steps that compiled, in either row
    a = [t for i, t in enumerate(s["step_s"][lo:last], lo + 1) if i not in skip]
    b = [t for i, t in enumerate(n["step_s"][lo:last], lo + 1) if i not in skip]
    if not a or not b:
        return None
    ms_s, ms_n = 1000 * statistics.median(a), 1000 * statistics.median(b)
    return {"steps": [lo + 1, last], "smartfrz_ms": ms_s, "none_ms": ms_n, "ratio": ms_s / ms_n}


def table(results: dict[str, Any]) -> str:
    rows = results["rows"]
    base = next((r for r in rows if r["row"] == "none"), None)
    compiled = results.get("compile") == "blocks"
    head = ["row", "ms/step", "ratio to none", "allocator peak", "perplexity", "trainable at start",
            "stage steps (median every)", "first freeze", "frozen at end",
            *(["compile s (graphs, steps)"] if compiled else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = r["ms_per_step"] / base["ms_per_step"] if base else None
        extra = [f"{r['compile_s']:.1f} ({r['graphs']}, {len(r['compile_steps'])})"] if compiled else []
        lines.append("| " + " | ".join([
            r["row"], f"{r['ms_per_step']:.1f}", f"{ratio:.3f}" if ratio is not None else "-",
            format_bytes(r["allocator_peak_bytes"]) if finite(r["allocator_peak_bytes"]) else "-",
            f"{r['perplexity']:.1f}" if finite(r["perplexity"]) else "-", f"{r['trainable_parameters_start']:,}",
            f"{r['stage_steps']} ({r['stage_every_median'] if r['stage_every_median'] is not None else '-'})",
            str(r["first_freeze_step"]) if r["first_freeze_step"] is not None else "-",
            str(len(r["frozen_blocks_end"])), *extra]) + " |")
    m = results["model"]
    lines += ["", f"Llama of {m['parameters']:,} parameters (hidden {m['hidden']}, {m['layers']} layers, "
                  f"{m['heads']} heads, SwiGLU {m['intermediate']}, vocab {m['vocab']}), {results['steps']} steps of "
                  f"{results['batch']} x {results['seq']} tokens, bf16 autocast, AdamW, {results['data']} text, "
                  f"device {results['device']}; medians leave out the first {WARMUP_STEPS} steps."]
    if compiled:
        lines.append(f"Blocks compiled (train.compile: blocks, backend {results['compile_backend']}); the medians also "
                     f"leave out the steps that compiled.")
    bf = results.get("smartfrz_before_first_freeze")
    if bf:
        lines.append(f"smartfrz before its first freeze (steps {bf['steps'][0]}-{bf['steps'][1]}): "
                     f"{bf['smartfrz_ms']:.1f} ms/step against none's {bf['none_ms']:.1f} (ratio {bf['ratio']:.3f}).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--intermediate", type=int, help="SwiGLU width (default: hidden x 11/4, 5632 at 2048)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rows", default=",".join(ROWS), help="none first: ratios are to it")
    parser.add_argument("--device", default="auto", help="auto (cuda:0 when there is one), cpu, cuda:N")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=10, help="steps of linear learning-rate warm-up")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--data", choices=("auto", "bbc", "synthetic"), default="auto")
    parser.add_argument("--tokenizer", help="a folder with MiniLM-L6's tokenizer (default: the installed model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", choices=("false", "blocks"), default="false",
                        help="blocks: each block compiled on its own, as train.compile: blocks (issue 42)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile's backend (aot_eager: quick)")
    parser.add_argument("--out", default="runs/llm-device")
    args = parser.parse_args(argv)
    args.intermediate = args.intermediate or args.hidden * 11 // 4
    rows = args.rows.split(",")
    bad = [r for r in rows if r not in ROWS and lora_rank(r) is None]
    if bad:
        parser.error(f"unknown rows {bad}: choose from {', '.join(ROWS)} (lora-rN for LoRA of rank N)")
    device = torch.device("cuda:0" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    corpus = load_corpus(args.data, args.seq, args.batch, args.steps, args.eval_batches, args.tokenizer)
    config = llama_config(args, corpus.vocab)
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        n_params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "model": {"parameters": n_params, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                  "intermediate": args.intermediate, "vocab": corpus.vocab},
        "steps": args.steps, "batch": args.batch, "seq": args.seq, "data": corpus.source,
        "train_chunks": len(corpus.train), "held_out_chunks": len(corpus.held_out), "device": str(device),
        "lr": args.lr, "lora_lr": args.lora_lr, "torch": torch.__version__, "compile": args.compile,
        "compile_backend": args.compile_backend if args.compile == "blocks" else None,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "rows": []}
    print(f"llm_device: Llama of {n_params:,} parameters, {corpus.source} text ({len(corpus.train)} training chunks "
          f"of {args.seq} tokens), {args.steps} steps per row on {device}", flush=True)
    for row in rows:
        got = run_row(row, args, config, corpus, device)
        results["rows"].append(got)
        results["smartfrz_before_first_freeze"] = before_first_freeze(results["rows"])
        print(f"llm_device: {row}: {got['ms_per_step']:.1f} ms/step, perplexity {got['perplexity']:.1f}, "
              f"{got['row_wall_s']:.1f} s", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))
        (out / "table.md").write_text(table(results))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main))
