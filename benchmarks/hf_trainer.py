"""MiniLM-L6 / BBC News through ``transformers.Trainer``: full fine-tuning (no callback) against the
:class:`~layerfreeze.integrations.hf.LayerFreezeCallback` with ``smartfrz``, same seed, data order and settings.

The settings are the CLI's default job (``layerfreeze train``, see ``layerfreeze/train/config.py`` / ``tasks.py``):
3 epochs, 128 tokens, batch 32, AdamW 5e-5, weight decay 0.01 (not on biases and LayerNorm: the Trainer's own split),
10% linear warm-up then linear decay, gradient clipping at 1.0, seed 0, the fixed stratified 80/20 split. Wall time is
``Trainer.train``'s ``train_runtime`` (every step, the callback's stages included; evaluation excluded); accuracy is
on the test split after training. Prints a table and writes the rows as JSON to ``--out``/rows.json. Run it alone on
the machine (timings beside other processes are wrong).

    python -m benchmarks.hf_trainer                                   # the measurement (about 15 min on 2 cores)
    python -m benchmarks.hf_trainer --max-steps 2 --limit-train 64 --limit-test 32   # a check that it runs
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.cli import count, entry
from layerfreeze.train.config import build_config
from layerfreeze.train.evaluation import evaluate
from layerfreeze.train.setup import resolve_device, seed_everything
from layerfreeze.train.tasks import build_task


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a batch for the model (the dataset's ``index`` is not a model input)."""
    return {k: torch.stack([item[k] for item in items]) for k in items[0] if k != "index"}


def run(strategy: str | None, args: argparse.Namespace) -> dict:
    from transformers import Trainer, TrainingArguments

    from layerfreeze.integrations.hf import LayerFreezeCallback

    config = build_config({"task": "bbc-news", "train": {"seed": args.seed},
                           "data": {"limit_train": args.limit_train, "limit_test": args.limit_test}})
    t = config.train
    seed_everything(t.seed)
    task = build_task(config)
    device = resolve_device("auto")
    training = TrainingArguments(
        output_dir=str(Path(args.out) / (strategy or "none")), num_train_epochs=t.epochs,
        max_steps=args.max_steps or -1, per_device_train_batch_size=t.batch_size, learning_rate=t.lr,
        weight_decay=t.weight_decay, warmup_steps=t.warmup_fraction, lr_scheduler_type=t.schedule,
        max_grad_norm=t.grad_clip, seed=t.seed, save_strategy="no", report_to=[], logging_steps=10,
        disable_tqdm=True, dataloader_num_workers=0, use_cpu=device.type == "cpu")
    trainer = Trainer(model=task.model, args=training, train_dataset=task.train_set, data_collator=collate)
    callback = LayerFreezeCallback(strategy).attach(trainer) if strategy else None
    output = trainer.train()
    loss, accuracy = evaluate(task, trainer.model, trainer.args.device, t.eval_batch_size)
    history = callback.freezer.history if callback else []
    return {
        "strategy": strategy or "none",
        "test_accuracy": accuracy,
        "test_loss": loss,
        "train_runtime_s": output.metrics["train_runtime"],
        "steps": trainer.state.global_step,
        "frozen_blocks": callback.freezer.frozen_blocks if callback else [],
        "freeze_timeline": [(h["block"], h["step"]) for h in history if h["kind"] == "freeze"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default="none,smartfrz",
                        help="comma-separated; 'none' is the Trainer without the callback")
    parser.add_argument("--max-steps", type=count(1), help="stop after this many steps (a quick check)")
    parser.add_argument("--limit-train", type=int)
    parser.add_argument("--limit-test", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench-hf-trainer")
    args = parser.parse_args()

    rows = []
    for name in args.strategies.split(","):
        rows.append(run(None if name == "none" else name, args))
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "rows.json").write_text(json.dumps(rows, indent=2))

    base = rows[0]
    table = Table(title=f"MiniLM-L6 / BBC News through transformers.Trainer ({base['steps']} steps, seed {args.seed})")
    for col in ("strategy", "test acc", "vs first row", "train s", "time ratio", "frozen blocks",
                "first / last freeze"):
        table.add_column(col, justify="right")
    for r in rows:
        timeline = r["freeze_timeline"]
        when = f"{timeline[0][1]} / {timeline[-1][1]}" if timeline else "-"
        table.add_row(r["strategy"], f"{100 * r['test_accuracy']:.2f}%",
                      f"{100 * (r['test_accuracy'] - base['test_accuracy']):+.2f}", f"{r['train_runtime_s']:.1f}",
                      f"{r['train_runtime_s'] / base['train_runtime_s']:.2f}x", str(len(r["frozen_blocks"])), when)
    Console().print(table)


if __name__ == "__main__":
    raise SystemExit(entry(main))
