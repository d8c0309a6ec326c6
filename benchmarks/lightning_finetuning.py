"""Lightning's own finetuning callback beside layerfreeze's, in the same ``lightning.Trainer``: MiniLM-L6 fine-tuned on
BBC News (the suite's ``bbc`` job: 2 epochs, 104 steps, 32 tokens, batch 16, AdamW 5e-5, weight decay 0.01 but not on
biases and norms, gradient clipping 1.0), one LightningModule, every row one after another in this process, on the CPU,
same seed, same initial weights (a new classifier head drawn once from the seed) and same data order (the CLI
trainer's per-epoch permutation, :func:`layerfreeze.train.setup.epoch_batches`, through the sampler's ``set_epoch``).

Rows:

* ``none``: no callback, every weight trains;
* ``backbone-finetuning``: ``lightning.pytorch.callbacks.BackboneFinetuning``, Lightning's own callback, unmodified,
  with ``unfreeze_backbone_at_epoch=1`` (``--unfreeze-at``; the job has 2 epochs) and Lightning's defaults otherwise
  (``backbone_initial_ratio_lr=0.1``, ``lambda_func`` doubling the backbone's LR each later epoch up to the head's,
  ``should_align=True``, ``train_bn=True``). The LightningModule's ``backbone`` is the pretrained encoder
  (``model.bert``: embeddings, the 6 layers, the pooler); the head is the new ``classifier``. As Lightning's docs ask,
  ``configure_optimizers`` takes the parameters that require grad: the head alone; at the start of epoch 1 the callback
  sets ``requires_grad`` back and adds the backbone as a new param group at 0.1 x the head's LR then (with AdamW's
  default weight decay on every backbone tensor, LayerNorms and biases included: ``add_param_group``'s defaults);
* ``static``: ``layerfreeze.integrations.lightning.LayerFreeze("static", {"k": 5})`` (the suite's k: the embeddings
  and layers 0-3 frozen before the first step, never thawed);
* ``smartfrz``: ``LayerFreeze("smartfrz")``, the library's default strategy.

The layerfreeze rows build the optimizer over all parameters, as the ``LayerFreeze`` docs ask (the callback takes the
frozen ones out before the first step); the network it freezes is ``submodule="model"``.

Measured per row: test accuracy (the task's fixed 20% test split, after training), its difference from ``none`` in
points; training FLOPs (:class:`~layerfreeze.runs.flops.TotalFlopCounter`, the counter of
:func:`~layerfreeze.runs.measure.measure_flops`, on real training steps inside ``fit``: the first step of every
distinct set of parameters that require grad is counted, from the step's first hook to its last one before the
freezing callbacks' stages, and that count stands for every step with the same set, as the CLI trainer does) and
their ratio to ``none``'s; training seconds (``on_train_start`` to ``on_train_end``: every step, the callbacks' own
work and the counted steps' counter overhead included, evaluation excluded) and their ratio; which blocks were frozen
at which steps, the learning rate each block had at each epoch's first step, and which blocks' weights changed
(bitwise) in each epoch.

``--schedule linear`` adds the CLI's LR schedule (10% warm-up, then linear decay, per step; a ``LambdaLR``). With it,
``BackboneFinetuning``'s ``add_param_group`` leaves the scheduler one LR short of the optimizer's groups; torch >= 2.10
zips them with ``strict=True`` and the next scheduler step raises: that row is reported as failed with its error (the
others still run; the exit code is 1). The default, ``constant``, trains every row at a constant LR.

Prints a rich table and writes ``OUT/results.json``. Run it alone on the machine (timings beside other processes are
wrong); about 4 minutes on 2 CPU cores.

    python -m benchmarks.lightning_finetuning                      # the measurement (4 rows, 104 steps each)
    python -m benchmarks.lightning_finetuning --tiny               # a check that it runs (4 steps a row)
    python -m benchmarks.lightning_finetuning --rows none,backbone-finetuning --schedule linear
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import re
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import BackboneFinetuning
from rich.console import Console
from rich.table import Table
from rich.text import Text
from torch import nn
from torch.utils.data import DataLoader, Sampler

from benchmarks.cli import count, entry, names
from benchmarks.machine import machine, machine_line, versions
from benchmarks.suite_tasks import task_spec
from layerfreeze.errors import UserError
from layerfreeze.integrations.lightning import LayerFreeze
from layerfreeze.models.discovery import discover_blocks
from layerfreeze.runs.flops import TotalFlopCounter
from layerfreeze.train.config import build_config
from layerfreeze.train.evaluation import evaluate
from layerfreeze.train.loop import lr_lambda, warmup_steps
from layerfreeze.train.setup import epoch_batches, no_weight_decay, seed_everything
from layerfreeze.train.tasks import Task, build_task, text_forward

#: The packages whose versions results.json records.
VERSIONS = ("torch", "lightning", "transformers", "layerfreeze")
#: The rows, in the order they run; ``none`` first (the others' ratios are taken against it).
ROWS = ("none", "backbone-finetuning", "static", "smartfrz")
LABELS = {"none": "none", "backbone-finetuning": "Lightning BackboneFinetuning", "static": "layerfreeze static",
          "smartfrz": "layerfreeze smartfrz"}


@dataclass(frozen=True)
class Sizes:
    """What one run trains on: the suite's ``bbc`` sizes, or ``--tiny``'s."""

    epochs: int
    limit_train: int | None
    limit_test: int | None
    max_length: int
    batch_size: int
    lr: float
    weight_decay: float
    static_k: int


def sizes(tiny: bool) -> Sizes:
    """The suite's ``bbc`` job (``benchmarks/suite.py``: 832 training articles, 2 epochs of 52 steps), or ``--tiny``:
    32 training and 32 test articles, 2 epochs of 2 steps."""
    spec = task_spec("bbc", quick=False)
    full = Sizes(spec.epochs, spec.limit_train, spec.limit_test, spec.max_length, spec.batch_size, spec.lr,
                 spec.weight_decay, spec.static_k)
    return replace(full, limit_train=32, limit_test=32) if tiny else full


# ---- the data, the module, the callbacks ---------------------------------------------------------------------------

class EpochOrder(Sampler[int]):
    """The CLI trainer's data order: epoch ``e`` visits the permutation :func:`epoch_batches` draws from
    ``seed * 1_000_003 + e``; Lightning calls :meth:`set_epoch` before each epoch."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.batch_size, self.seed, self.epoch = n, batch_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter([i for batch in epoch_batches(self.n, self.batch_size, self.seed, self.epoch) for i in batch])

    def __len__(self) -> int:
        return self.n


def train_loader(task: Task, batch_size: int, seed: int) -> DataLoader:
    return DataLoader(task.train_set, batch_size=batch_size, sampler=EpochOrder(len(task.train_set), batch_size, seed),
                      num_workers=0)


class Classifier(L.LightningModule):
    """The Hugging Face sequence classifier, trained with cross-entropy; ``backbone`` is its pretrained base model
    (what ``BackboneFinetuning`` freezes), the rest (``classifier``) is the head.

    Args:
        model: The network (``self.model``).
        lr / weight_decay: AdamW's; no weight decay on biases and norms (1-D tensors).
        trainable_only: ``configure_optimizers`` takes only the parameters that require grad (Lightning's finetuning
            callbacks ask for it); else all of them (layerfreeze's ``LayerFreeze`` asks for it).
        schedule: ``constant``, or ``linear`` (10% warm-up, linear decay; stepped every optimizer step).
    """

    def __init__(self, model: nn.Module, lr: float, weight_decay: float, trainable_only: bool, schedule: str) -> None:
        super().__init__()
        self.model = model
        self.lr, self.weight_decay, self.trainable_only, self.schedule = lr, weight_decay, trainable_only, schedule

    @property
    def backbone(self) -> nn.Module:
        """The pretrained encoder (``model.bert``): a property, so that its modules are not registered twice."""
        return self.model.base_model

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(text_forward(self.model, batch), batch["labels"])

    def configure_optimizers(self) -> Any:
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad or not self.trainable_only]
        groups = [{"params": [p for n, p in named if not no_weight_decay(n, p)], "weight_decay": self.weight_decay},
                  {"params": [p for n, p in named if no_weight_decay(n, p)], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=self.lr, weight_decay=self.weight_decay)
        if self.schedule == "constant":
            return optimizer
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(total, warmup_steps(total, 0.1, "floor"), self.schedule))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Meter(L.Callback):
    """What a fit did, read from its hooks; listed first, so that on every hook it runs before the freezing callback.

    * per step: the set of parameters that require grad (and the batch size), the samples' indices;
    * training FLOPs: the first step of each distinct set is counted with :class:`TotalFlopCounter`, from
      ``on_train_batch_start`` (before the forward) to ``on_train_batch_end`` (after the optimizer step, before the
      freezing callback's stage);
    * per epoch: the LR of each block's parameters at the epoch's first step (after ``BackboneFinetuning``'s
      ``on_train_epoch_start``), and which blocks' weights changed bitwise from that step to the epoch's end;
    * ``train_s``: ``on_train_start`` to ``on_train_end``.
    """

    def __init__(self, model: nn.Module) -> None:
        self.blocks = discover_blocks(model)
        self.params = [list(b.parameters()) for b in self.blocks]
        self.steps: list[tuple[tuple[bool, ...], int]] = []
        self.flops: dict[tuple[tuple[bool, ...], int], int] = {}
        self.order = hashlib.sha1()
        self.epochs: list[dict[str, Any]] = []
        self.counter: TotalFlopCounter | None = None
        self.counting: tuple[tuple[bool, ...], int] | None = None
        self.snapshot: list[list[torch.Tensor]] = []
        self.t0 = self.t_step = self.train_s = 0.0
        self.step_s: list[float] = []

    def key(self, batch: dict[str, torch.Tensor]) -> tuple[tuple[bool, ...], int]:
        return tuple(p.requires_grad for ps in self.params for p in ps), len(batch["labels"])

    def frozen_blocks(self, key: tuple[tuple[bool, ...], int]) -> list[str]:
        """The blocks none of whose parameters required grad in a step of this key."""
        flags, out, i = key[0], [], 0
        for block, ps in zip(self.blocks, self.params):
            if not any(flags[i: i + len(ps)]):
                out.append(block.name)
            i += len(ps)
        return out

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.t0 = time.perf_counter()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:  # the epoch's callbacks ran: its LRs, and the weights it starts from
            lr_of = {id(p): g["lr"] for g in trainer.optimizers[0].param_groups for p in g["params"]}
            self.epochs.append({"epoch": trainer.current_epoch, "lr": {
                b.name: sorted({lr_of.get(id(p)) for p in ps}, key=lambda v: (v is None, v or 0.0))
                for b, ps in zip(self.blocks, self.params)}})
            self.snapshot = [[p.detach().clone() for p in ps] for ps in self.params]
        self.t_step = time.perf_counter()
        key = self.key(batch)
        self.steps.append(key)
        self.order.update(batch["index"].cpu().numpy().tobytes())
        if key not in self.flops:
            self.counter, self.counting = TotalFlopCounter(), key
            self.counter.__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.flops[self.counting] = int(self.counter.get_total_flops())
            self.counter = None
        self.step_s.append(time.perf_counter() - self.t_step)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.epochs[-1]["changed"] = [b.name for b, ps, before in zip(self.blocks, self.params, self.snapshot)
                                      if any(not torch.equal(p.detach(), q) for p, q in zip(ps, before))]
        self.snapshot = []

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.train_s = time.perf_counter() - self.t0

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.counter is not None:  # a fit that raised mid-step: take the counter's mode off the stack
            self.counter.__exit__(None, None, None)
            self.counter = None


# ---- one row -------------------------------------------------------------------------------------------------------

def callback_for(row: str, args: argparse.Namespace, size: Sizes) -> L.Callback | None:
    if row == "backbone-finetuning":
        return BackboneFinetuning(unfreeze_backbone_at_epoch=args.unfreeze_at)
    if row == "static":
        return LayerFreeze("static", {"k": args.static_k or size.static_k}, submodule="model")
    if row == "smartfrz":
        return LayerFreeze("smartfrz", submodule="model")
    return None


def make_trainer(folder: Path, **kwargs: Any) -> L.Trainer:
    """A CPU Trainer: gradient clipping 1.0, nothing logged, checkpointed or validated."""
    return L.Trainer(accelerator="cpu", devices=1, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     use_distributed_sampler=False, default_root_dir=str(folder), **kwargs)


def warm_up(task: Task, initial: nn.Module, size: Sizes, args: argparse.Namespace) -> None:
    """Three steps of ``none``, discarded: the process's first steps (allocator, kernels' first calls) are slower,
    and would count against the first row only."""
    module = Classifier(copy.deepcopy(initial).train(), size.lr, size.weight_decay, trainable_only=False,
                        schedule="constant")
    make_trainer(args.out / "warm-up", max_steps=3).fit(module, train_loader(task, size.batch_size, args.seed))


def fit_row(row: str, task: Task, initial: nn.Module, args: argparse.Namespace, size: Sizes, out: Path) -> dict:
    """Train a fresh copy of the initial network with the row's callback; evaluate it; what the Meter saw."""
    seed_everything(args.seed)
    model = copy.deepcopy(initial).train()  # from_pretrained gives eval mode, which Lightning's fit keeps: no dropout
    module = Classifier(model, size.lr, size.weight_decay, trainable_only=row == "backbone-finetuning",
                        schedule=args.schedule)
    meter = Meter(model)
    callback = callback_for(row, args, size)
    trainer = make_trainer(out / row, max_epochs=size.epochs,
                           callbacks=[meter] + ([callback] if callback is not None else []))
    seed_everything(args.seed)  # dropout draws the same numbers in every row
    trainer.fit(module, train_loader(task, size.batch_size, args.seed))
    loss, accuracy = evaluate(task, model, torch.device("cpu"), 64)
    history = []
    if isinstance(callback, LayerFreeze):
        history = [[h["kind"], h["block"], h["step"]] for h in callback.freezer.history]
    return {"row": row, "label": LABELS[row], "test_accuracy": accuracy, "test_loss": loss,
            "steps": len(meter.steps), "train_s": meter.train_s, "meter": meter, "layerfreeze_history": history}


def phases(meter: Meter, reference: dict[int, int] | None) -> list[dict[str, Any]]:
    """Consecutive steps with the same trainable set: their frozen blocks, FLOPs per step and (against
    ``reference``, ``none``'s FLOPs per step by batch size) the ratio."""
    out: list[dict[str, Any]] = []
    for step, key in enumerate(meter.steps, 1):
        frozen = meter.frozen_blocks(key)
        if out and out[-1]["frozen_blocks"] == frozen and out[-1]["_key"][0] == key[0]:
            out[-1]["last_step"] = step
            out[-1]["flops"] += meter.flops[key]
            out[-1]["none_flops"] = (out[-1]["none_flops"] + reference[key[1]]) if reference else None
            continue
        out.append({"first_step": step, "last_step": step, "frozen_blocks": frozen, "_key": key,
                    "flops": meter.flops[key], "none_flops": reference[key[1]] if reference else None})
    for p in out:
        p.pop("_key")
        p["flops_ratio"] = p["flops"] / p.pop("none_flops") if reference else None
    return out


def summarize(raw: dict[str, Any], base: dict[str, Any] | None, reference: dict[int, int] | None) -> dict[str, Any]:
    meter: Meter = raw.pop("meter")
    flops = sum(meter.flops[k] for k in meter.steps)
    raw["flops_total"] = flops
    if base is None and raw["row"] == "none":
        base = raw  # its own reference: ratios 1, difference 0
    raw.update({
        "flop_counted_steps": len(meter.flops),
        "flops_ratio": flops / base["flops_total"] if base else None,
        "time_ratio": raw["train_s"] / base["train_s"] if base else None,
        "delta_points": 100 * (raw["test_accuracy"] - base["test_accuracy"]) if base else None,
        "blocks": [b.name for b in meter.blocks], "phases": phases(meter, reference), "epochs": meter.epochs,
        "data_order_sha1": meter.order.hexdigest(), "step_s_median": statistics.median(meter.step_s),
        "step_s": [round(t, 4) for t in meter.step_s]})
    return raw


# ---- the table -----------------------------------------------------------------------------------------------------

def short(name: str) -> str:
    """``bert.encoder.layer.3`` -> ``layer.3``, ``bert.embeddings`` -> ``embeddings``."""
    found = re.search(r"layers?\.\d+$", name)
    return found.group(0) if found else name.rsplit(".", 1)[-1]


def span(names: list[str], blocks: list[str]) -> str:
    """Block names as ranges of consecutive blocks: ``embeddings..layer.3``, ``all``, ``none``."""
    if not names:
        return "none"
    if names == blocks:
        return "all"
    index = sorted(blocks.index(n) for n in names)
    runs: list[list[int]] = []
    for i in index:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(short(blocks[r[0]]) + (f"..{short(blocks[r[-1]])}" if len(r) > 1 else "") for r in runs)


def lr_text(epoch: dict[str, Any], blocks: list[str]) -> str:
    """``embeddings..pooler 5e-06, classifier 5e-05``; blocks outside the optimizer are left out."""
    by_lr: dict[float, list[str]] = {}
    for name in blocks:
        for lr in epoch["lr"][name]:
            if lr is not None:
                by_lr.setdefault(lr, []).append(name)
    return ", ".join(f"{span(names, blocks)} {lr:.0e}" for lr, names in by_lr.items()) or "-"


def table(rows: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for col in ("row", "test acc", "vs none", "train FLOPs", "train s", "time", "frozen (steps)",
                "LR at epoch start", "weights changed"):
        t.add_column(col, justify="right" if col in ("test acc", "vs none", "train FLOPs", "train s", "time")
                     else "left")
    for r in rows:
        if "error" in r:
            t.add_row(r["label"], "failed", "", "", "", "", Text(r["error"][:300]), "", "")
            continue
        blocks = r["blocks"]

        def ratio(v: float | None, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        frozen = "; ".join(f"{p['first_step']}-{p['last_step']}: {span(p['frozen_blocks'], blocks)}"
                           + (f" ({p['flops_ratio']:.2f}x)" if p["flops_ratio"] is not None and p["frozen_blocks"]
                              else "") for p in r["phases"])
        lrs = "; ".join(f"e{e['epoch']}: {lr_text(e, blocks)}" for e in r["epochs"])
        changed = "; ".join(f"e{e['epoch']}: {span(e.get('changed', []), blocks)}" for e in r["epochs"])
        t.add_row(r["label"], f"{100 * r['test_accuracy']:.2f}%", ratio(r["delta_points"], "+.2f"),
                  ratio(r["flops_ratio"], ".3f") + ("x" if r["flops_ratio"] is not None else ""),
                  f"{r['train_s']:.1f}", ratio(r["time_ratio"], ".2f") + ("x" if r["time_ratio"] is not None else ""),
                  frozen, lrs, changed)
    return t


def notes(args: argparse.Namespace, size: Sizes) -> list[str]:
    return [
        f"backbone-finetuning: lightning.pytorch.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch="
        f"{args.unfreeze_at}), unmodified, Lightning's defaults otherwise (backbone_initial_ratio_lr=0.1, lambda_func "
        "x2 per later epoch capped at the head's LR, train_bn=True): the backbone (model.bert: embeddings, layers, "
        f"pooler) frozen in epochs 0..{args.unfreeze_at - 1}, then added to the optimizer as a new param group at 0.1x "
        "the head's LR (weight decay on every backbone tensor: add_param_group's defaults); configure_optimizers "
        "takes the parameters that require grad (the head), as Lightning's docs ask",
        f"static: LayerFreeze('static', {{'k': {args.static_k or size.static_k}}}, submodule='model'); smartfrz: "
        "LayerFreeze('smartfrz', submodule='model'); their optimizer over all parameters, as LayerFreeze's docs ask",
        "train FLOPs: TotalFlopCounter (FlopCounterMode's count: matmuls and attention; elementwise work and the "
        "optimizer's update count 0) on the first real step of each distinct trainable set, times its steps; the ratio "
        "in 'frozen (steps)' is that phase's FLOPs per step over none's",
        "train s: on_train_start to on_train_end of Trainer.fit (the callbacks' work and the counted steps' counter "
        "overhead included; evaluation excluded); 'weights changed': blocks whose weights differ bitwise between the "
        "epoch's first step and its end",
        f"LR schedule: {args.schedule}" + (" (10% warm-up, linear decay, per step)" if args.schedule == "linear"
                                           else "") + "; gradient clipping 1.0; AdamW weight decay "
        f"{size.weight_decay:g} (not on biases and norms, except where noted)",
    ]


# ---- main ----------------------------------------------------------------------------------------------------------

def parse_rows(text: str) -> list[str]:
    """``--rows``: comma-separated rows (:func:`benchmarks.cli.names`), in :data:`ROWS`' order, none first: the
    ratios are against it."""
    given = names(list(ROWS))(text)
    return [r for r in ROWS if r in given]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.lightning_finetuning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=parse_rows, default=list(ROWS), help=f"comma-separated, from {', '.join(ROWS)}")
    parser.add_argument("--tiny", action="store_true", help="32 training and 32 test articles: 4 steps a row (a check)")
    parser.add_argument("--unfreeze-at", type=count(1), default=1,
                        help="BackboneFinetuning's unfreeze_backbone_at_epoch (below the job's 2 epochs)")
    parser.add_argument("--static-k", type=count(1), help="static's k (default: the suite's, 5)")
    parser.add_argument("--schedule", choices=("constant", "linear"), default="constant")
    parser.add_argument("--seed", type=count(0), default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-lightning-finetuning"))
    args = parser.parse_args(argv)
    size = sizes(args.tiny)
    if args.unfreeze_at >= size.epochs:
        parser.error(f"--unfreeze-at {args.unfreeze_at}: the job has {size.epochs} epochs (0..{size.epochs - 1}); "
                     "give an epoch the backbone can still train in")
    if args.static_k is not None and args.static_k >= 9:
        parser.error(f"--static-k {args.static_k}: MiniLM-L6 has 9 blocks and the head must train; give 1..8")
    args.out.mkdir(parents=True, exist_ok=True)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")  # lightning on torch 2.14

    config = build_config({"task": "bbc-news", "model": {"max_length": size.max_length},
                           "train": {"seed": args.seed, "batch_size": size.batch_size, "epochs": size.epochs},
                           "data": {"limit_train": size.limit_train, "limit_test": size.limit_test}})
    seed_everything(args.seed)
    task = build_task(config)  # MiniLM-L6 from the local asset, a new classifier drawn from the seed
    initial = copy.deepcopy(task.model)
    console = Console(width=None if sys.stdout.isatty() else 200)  # a log file gets the table unwrapped
    console.rule("[bold]warm-up[/] (3 steps, discarded)")
    warm_up(task, initial, size, args)
    rows: list[dict[str, Any]] = []
    base: dict[str, Any] | None = None
    reference: dict[int, int] | None = None
    failed = False
    for row in args.rows:
        console.rule(f"[bold]{LABELS[row]}[/]")
        try:
            raw = fit_row(row, task, initial, args, size, args.out)
        except UserError:
            raise
        except Exception as exc:  # reported in the table and the exit code; the other rows still run
            traceback.print_exc()
            rows.append({"row": row, "label": LABELS[row], "error": f"{type(exc).__name__}: {exc}"})
            failed = True
            continue
        if row == "none":
            reference = {k[1]: f for k, f in raw["meter"].flops.items() if all(k[0])}
        rows.append(summarize(raw, base, reference))
        if row == "none":
            base = rows[-1]
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("epochs", "blocks", "phases", "step_s")}),
              flush=True)
    steps = base["steps"] if base else next((r["steps"] for r in rows if "steps" in r), 0)
    title = (f"MiniLM-L6 / BBC News in lightning.Trainer: {size.epochs} epochs, {steps} steps, batch "
             f"{size.batch_size}, {size.max_length} tokens, AdamW {size.lr:g}, seed {args.seed}"
             + (" (--tiny)" if args.tiny else ""))
    results = {"benchmark": "lightning_finetuning", "title": title, "tiny": args.tiny,
               "settings": {**asdict(size), "unfreeze_backbone_at_epoch": args.unfreeze_at,
                            "static_k": args.static_k or size.static_k, "schedule": args.schedule, "seed": args.seed,
                            "grad_clip": 1.0, "test_samples": len(task.test_set),
                            "train_samples": len(task.train_set)},
               "notes": notes(args, size), "machine": machine(), "versions": versions(VERSIONS), "rows": rows}
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    console.print(table(rows, title))
    for line in results["notes"]:
        console.print(f"- {line}")
    console.print(f"- machine: {machine_line(results['machine'])}; torch {results['versions'].get('torch')}, "
                  f"lightning {results['versions'].get('lightning')}")
    console.print(f"- written: {args.out / 'results.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(entry(main))
