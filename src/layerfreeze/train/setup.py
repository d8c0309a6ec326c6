"""What a training run is built from: seed, device, optimizer, LR schedule, batches, hold-out split, strategy; and
the trainer's setup, which builds a run from them.

The optimizer has one param group per block; each epoch's batches come from a fixed permutation (so a resumed run
replays them); the hold-out split is the stability guard's validation set; the strategy is checked against the
model's blocks before anything trains.

:func:`setup_trainer` (:meth:`Trainer.setup <layerfreeze.train.trainer.Trainer.setup>`) builds everything a
:class:`~layerfreeze.train.trainer.Trainer` trains with: the process group, the task and its blocks, FSDP2's
sharding, the memory budget's plan (:func:`plan_run_memory`), the Freezer, the activation cache's runner
(:func:`make_cache_runner`), the memory ledger (:func:`make_ledger`), the DDP wrapper and the run folder;
:func:`place` keeps the frozen prefix the cache serves offloaded as the frozen set changes.
"""

from __future__ import annotations

import copy
import functools
import math
import random
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from layerfreeze import distributed as dist_
from layerfreeze.budget.plan import MemoryPlan, plan_memory
from layerfreeze.checkpoint import CheckpointStore
from layerfreeze.compute.cache import build_cached_prefix
from layerfreeze.compute.cache_policy import CachePolicy
from layerfreeze.compute.cached_prefix import CachedPrefix
from layerfreeze.compute.determinism import CacheRefused, check_deterministic
from layerfreeze.compute.store import auto_budget_bytes, remove_stale_folders
from layerfreeze.engine.demote import Demotion
from layerfreeze.engine.freezer import Freezer, release_earlier_freezers
from layerfreeze.engine.guard import StabilityGuard
from layerfreeze.engine.optim import block_param_groups
from layerfreeze.errors import ConfigError
from layerfreeze.models.blocks import Block
from layerfreeze.models.discovery import discover_blocks, split_for
from layerfreeze.runs import rundir
from layerfreeze.runs import telemetry as tm
from layerfreeze.runs.ledger import MemoryLedger
from layerfreeze.runs.rundir import Event
from layerfreeze.runs.summary import format_bytes
from layerfreeze.strategies import Strategy, UnknownStrategyError, create_strategy
from layerfreeze.train.compile import CompiledRegions
from layerfreeze.train.config import COMPILE_TRUE_BYPASSED, Config
from layerfreeze.train.config_file import leaf_values
from layerfreeze.train.data import sample_keys
from layerfreeze.train.loop import lr_lambda, warmup_steps
from layerfreeze.train.precision import Precision
from layerfreeze.train.prefix_clock import PrefixClock
from layerfreeze.train.ranks import on_rebuild, one_sample_share
from layerfreeze.train.tasks import build_task

if TYPE_CHECKING:
    from layerfreeze.train.trainer import Trainer


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; for one process (the trainer under torchrun: ``rank_device``)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return dist_.choose_rank_device(name, 0, 1, count)


def no_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Biases and normalisation weights (1-D tensors) get no weight decay (the usual BERT/ResNet practice)."""
    return param.ndim <= 1


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches of one epoch: a permutation of ``range(n)`` from ``seed + epoch``, cut into batches.

    Deterministic, so a resumed run replays exactly the batches the interrupted one had left.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    return [perm[i : i + batch_size] for i in range(0, n, batch_size)]


class VisitPlan:
    """When the run visits each sample: the steps :func:`epoch_batches` gives, for the activation cache's policy
    (:class:`~layerfreeze.compute.cache.CachePolicy`: is an entry read again, and when).

    Args:
        keys: Per dataset position, the sample's cache key (:func:`sample_keys`).
        batch_size / seed / epochs: The run's (``train``).
        total_steps: The run's last step (``max_steps`` cuts the last epochs short).

    Steps are 1-based, as the trainer counts them: epoch ``e``'s batch ``b`` is step ``e * steps_per_epoch + b + 1``.
    """

    def __init__(self, keys: list[int], batch_size: int, seed: int, epochs: int, total_steps: int) -> None:
        self.keys = list(keys)
        self.batch_size, self.seed, self.epochs, self.total_steps = batch_size, seed, epochs, total_steps
        self.steps_per_epoch = math.ceil(len(self.keys) / batch_size)
        self._epochs: dict[int, dict[int, int]] = {}

    def _visits(self, epoch: int) -> dict[int, int]:
        """``{key: step}`` of one epoch (the two latest epochs asked for are kept)."""
        if epoch not in self._epochs:
            steps: dict[int, int] = {}
            for b, batch in enumerate(epoch_batches(len(self.keys), self.batch_size, self.seed, epoch)):
                step = epoch * self.steps_per_epoch + b + 1
                if step > self.total_steps:
                    break
                for pos in batch:
                    steps[self.keys[pos]] = step
            for old in [e for e in self._epochs if e < epoch - 1]:
                del self._epochs[old]
            self._epochs[epoch] = steps
        return self._epochs[epoch]

    def next_visit(self, key: int, now: int) -> int | None:
        """The step of sample ``key``'s first visit after step ``now``, or None when the run does not visit it again."""
        epoch = max(0, (now - 1) // self.steps_per_epoch)
        for e in (epoch, epoch + 1):
            if e >= self.epochs:
                return None
            step = self._visits(e).get(int(key))
            if step is not None and step > now:
                return step
        return None


def holdout(dataset: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """Split ``dataset`` into (train, validation) with a fixed permutation from ``seed``; validation gets
    ``ceil(fraction * n)`` samples (at least 1). Raises ValueError when nothing would be left to train on."""
    n = len(dataset)
    n_val = max(1, math.ceil(fraction * n))
    if n_val >= n:
        raise ConfigError(f"freeze.guard.val_fraction {fraction} leaves no training data ({n} samples)")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return Subset(dataset, sorted(perm[n_val:])), Subset(dataset, sorted(perm[:n_val]))


def build_strategy(config: Config, num_blocks: int | None = None) -> Strategy:
    """The config's strategy, built once per run (a SmartFRZ predictor file is read here), its parameter values
    checked, and with ``num_blocks`` checked against the model (``static``'s k must leave the head trainable, ...).

    Raises:
        ConfigError: an unknown strategy or parameter (``freeze.strategy: ...``), or a parameter value out of range
            or not fitting the model (``freeze.params: ...``); the message says what to change.
    """
    try:
        return create_strategy(config.freeze.strategy, config.freeze.params, num_blocks=num_blocks)
    except UnknownStrategyError as exc:
        raise ConfigError(f"freeze.strategy: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"freeze.params: {exc}") from None


def check_strategy_fits(strategy: Strategy, num_blocks: int) -> None:
    """Check a strategy built by :func:`build_strategy` without ``num_blocks`` against the model's block count.

    Raises:
        ConfigError: a parameter that does not fit the model (``freeze.params: ...``, e.g. ``static``'s k leaving no
            trainable head); the message says what to change.
    """
    try:
        strategy.validate(num_blocks)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"freeze.params: {exc}") from None


def build_optimizer(config: Config, model: nn.Module, blocks: list[Block],
                    fused: bool = False) -> torch.optim.Optimizer:
    """``train.optimizer`` (AdamW or SGD) over one param group per block (:func:`block_param_groups`: LR decayed
    by ``train.lr_decay`` per block from the head down, no weight decay for biases and norms).

    ``fused``: AdamW's fused kernel, which takes a loss scaler's ``found_inf`` on the device, so ``16-mixed`` steps
    without reading it on the host every step (a non-fused ``GradScaler.step`` does: ``found_inf.item()``)."""
    train = config.train
    groups = block_param_groups(model, blocks, train.lr, train.weight_decay, train.lr_decay,
                                no_decay=no_weight_decay)
    for group in groups:  # weights frozen before training (LoRA's base model) never enter the optimizer
        group["params"] = [p for p in group["params"] if p.requires_grad]
    if train.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=train.lr, weight_decay=train.weight_decay, fused=fused or None)
    return torch.optim.SGD(groups, lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)


def build_scheduler(config: Config, optimizer: torch.optim.Optimizer,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule of ``train``: warm-up over ``warmup_fraction`` of ``total_steps``, then ``schedule``."""
    warmup = warmup_steps(total_steps, config.train.warmup_fraction, "floor")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, warmup, config.train.schedule))


#: Batch keys that stay on the host: sample positions are bookkeeping (the activation cache looks them up), never a
#: model input, and reading them back from a GPU would be a host synchronisation every step (issue 40).
HOST_KEYS = frozenset({"index"})


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A batch's tensors on ``device`` (copied without blocking the host where it can), but for :data:`HOST_KEYS`,
    which stay where they are."""
    return {k: v if k in HOST_KEYS else v.to(device, non_blocking=True) for k, v in batch.items()}


def plan_headline(plan: MemoryPlan) -> str:
    """The memory plan in one line: the budget, what it gives up, the predicted tensor peak."""
    held = plan.chosen.buckets.get("strategy", 0)  # in the chosen prefix's prediction, not in none's peak
    return (f"memory budget {plan.budget} ({format_bytes(plan.budget_bytes)} of tensor peak; nothing frozen: "
            f"{format_bytes(plan.none_peak_bytes)}): gives up {plan.gives_up()}; predicted tensor peak "
            f"{format_bytes(plan.predicted_peak_bytes)}"
            + (f" (with the freezing strategy's own {format_bytes(held)}, which `none`'s peak has not)" if held
               else ""))


def setup_trainer(trainer: Trainer, plan_only: bool = False) -> None:
    """:meth:`Trainer.setup <layerfreeze.train.trainer.Trainer.setup>`: build everything a run trains with (process
    group, seed, task, blocks, strategy, sharding (FSDP2), optimizer, LR schedule, memory plan, Freezer, cache, DDP
    wrapper, run folder) onto ``trainer``.

    Args:
        plan_only: Stop after the memory plan (``freeze.memory_budget``: ``trainer.memory_plan``), before anything
            is written (``layerfreeze plan``).

    Raises:
        ConfigError, AssetMissingError, BlockDiscoveryError: bad config (``run.parallel: fsdp`` in one process
            too), missing asset, undiscoverable blocks.
        BudgetError: ``freeze.memory_budget`` cannot be met (before the run folder is created).
    """
    cfg = trainer.config
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    # the device first: it decides the backend (gloo on the CPU, NCCL on cuda:LOCAL_RANK), and a node with fewer GPUs
    # than ranks is refused here, exit code 2, before any rank joins a process group (issue 41)
    device = dist_.rank_device(cfg.run.device)
    trainer.distributed = dist_.init_distributed(cfg.run.dist_timeout_s,
                                                 backend="nccl" if device.type == "cuda" else "gloo")
    if cfg.run.parallel == "fsdp" and not trainer.distributed:
        raise ConfigError(
            "run.parallel is fsdp (--parallel fsdp): FSDP2 shards the model over the ranks torchrun starts, and "
            "this is one process. Launch it with `torchrun --nproc_per_node N -m layerfreeze train ...` (N >= 2), "
            "or train unsharded with --parallel ddp (which also resumes an fsdp run here: its full checkpoint "
            "loads into the unsharded model)")
    if trainer.distributed:
        check_same_config(cfg)
    trainer.fsdp = trainer.distributed and cfg.run.parallel == "fsdp"
    check_distributed_config(cfg, trainer.distributed)
    trainer.rank, trainer.world = dist_.rank(), dist_.world_size()
    trainer.is_main = trainer.rank == 0
    trainer.device = device
    trainer.watchdog = dist_.RankWatchdog() if trainer.distributed else None
    if trainer.distributed:
        torch.distributed.barrier()  # every rank has checked the run folder before rank 0 writes into it
    seed_everything(cfg.train.seed)
    # Built before the model and data load, so a bad parameter value fails in seconds, not after the load; its
    # fit to the model (static's k below the head, ...) is checked once the blocks are known.
    strategy = build_strategy(cfg)
    if trainer.task is None:
        trainer.task = build_task(cfg)
    seed_everything(cfg.train.seed)
    model = trainer.task.model
    release_earlier_freezers(model)  # a task trained before (a second run in this process): before its optimizer
    blocks = discover_blocks(model, cfg.model.blocks)  # the module and parameter objects survive .to(device)
    check_strategy_fits(strategy, len(blocks))
    tied = dist_.tied_across_blocks(blocks) if trainer.fsdp else None
    if tied is not None:  # before any collective: every rank refuses the same model at once
        raise ConfigError(tied)
    mirror = None
    if trainer.fsdp and trainer.is_main and strategy.reads_model:  # FSDP2 modules cannot be copied: before sharding
        mirror = copy.deepcopy(model).to("cpu")
    model = model.to(trainer.device)
    trainer.precision = Precision(cfg.train.precision, device)
    trainer.precision.cast_model(model)  # bf16-true: bfloat16 weights before the optimizer (and its states) exist
    if trainer.fsdp:  # one fully_shard group per block, then the root; blocks updated to the sharded parameters
        from torch.distributed.device_mesh import init_device_mesh

        dist_.shard_blocks(model, blocks, mesh=init_device_mesh(trainer.device.type, (trainer.world,)))
    # 16-mixed: the fused AdamW reads the scaler's found_inf on the device (FSDP2's sharded parameters: foreach)
    trainer.optimizer = build_optimizer(cfg, model, blocks,
                                        fused=trainer.precision.scaler is not None and not trainer.fsdp)
    trainer.train_set, trainer.val_set, trainer.guard = trainer.task.train_set, None, None
    if cfg.freeze.guard is not None:
        g = cfg.freeze.guard
        trainer.guard = StabilityGuard(g.tolerance, g.patience, g.cooldown)
        trainer.train_set, trainer.val_set = holdout(trainer.task.train_set, g.val_fraction, cfg.data.split_seed)
    trainer.batches_per_epoch = math.ceil(len(trainer.train_set) / cfg.train.batch_size)
    planned = trainer.batches_per_epoch * cfg.train.epochs
    trainer.total_steps = min(planned, cfg.train.max_steps) if cfg.train.max_steps else planned
    trainer.scheduler = build_scheduler(cfg, trainer.optimizer, trainer.total_steps)
    trainer.memory_plan = (plan_run_memory(trainer, model, blocks, announce=not plan_only)
                           if cfg.freeze.memory_budget is not None else None)
    if plan_only:
        return
    if trainer.is_main:
        try:
            trainer.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"run.dir (--run-dir) {trainer.run_dir} cannot be created ({err.strerror}); give a "
                              "folder you can write to") from None
        trainer.telemetry = tm.Telemetry(trainer.run_dir, tensorboard=cfg.run.tensorboard,
                                         resuming=bool(cfg.run.resume))
    else:
        trainer.telemetry = tm.NullTelemetry()
    if trainer.distributed:
        trainer.rank_telemetry = tm.Telemetry(rundir.rank_dir(trainer.run_dir, trainer.rank), tensorboard=False)
    demote = None
    if cfg.freeze.demote is not None:
        d = cfg.freeze.demote
        demote = Demotion(d.dtype, d.offload, d.master,
                          directory=rundir.demoted_dir(trainer.run_dir, trainer.rank if trainer.distributed else None))
    trainer.freezer = Freezer(
        model, trainer.optimizer, strategy, blocks=blocks, train_bn=cfg.freeze.train_bn, scheduler=trainer.scheduler,
        total_steps=trainer.total_steps, steps_per_epoch=trainer.batches_per_epoch, guard=trainer.guard,
        mirror=mirror, demote=demote,
        floor=trainer.memory_plan.floor if trainer.memory_plan is not None else None,
    )
    trainer.visits = VisitPlan(sample_keys(trainer.train_set), cfg.train.batch_size, cfg.train.seed,
                               cfg.train.epochs, trainer.total_steps)
    trainer.model = model
    trainer.store = CheckpointStore(trainer.run_dir, cfg.run.keep_checkpoints)
    trainer.runner = make_cache_runner(trainer, blocks)
    check_batchnorm_batches(trainer, model)
    place(trainer)
    trainer.ledger = make_ledger(trainer)
    trainer._memory_before = None  # the ledger's last sample before a freeze/thaw (a LedgerSnapshot)
    trainer._memory_changes = []  # freezes/thaws since that sample
    trainer.ddp = None
    trainer._synced_for = None
    if trainer.distributed and not trainer.fsdp:
        forward = trainer.runner if trainer.runner is not None else (lambda batch: trainer.task.forward(model, batch))
        device_ids = [trainer.device.index] if trainer.device.type == "cuda" else None
        trainer.ddp = dist_.FreezeDDP(model, trainer.freezer, forward, device_ids=device_ids,
                                      on_rebuild=functools.partial(on_rebuild, trainer))
    # last: every hook the engine attaches is in place, and copies a strategy made are of the eager model
    trainer.compiled = (CompiledRegions(model, [m for b in blocks for _, m in b.modules], cfg.train.compile,
                                        cfg.train.compile_backend) if cfg.train.compile else None)
    trainer.prefix_clock = (PrefixClock(trainer.freezer.blocks, trainer.device) if cfg.train.compile is not True
                            else None)  # the whole model compiled as one region: no prefix boundary to time
    if trainer.is_main and not cfg.run.resume:  # a resume rewrites it once its checkpoint has loaded (Trainer.run)
        rundir.write_config(trainer.run_dir, cfg.model_dump(mode="json"))


def check_batchnorm_batches(trainer: Trainer, model: nn.Module) -> None:
    """Refuse, before the first step, a run in which a BatchNorm model would train on a batch (or a rank's share) of
    one sample (:func:`~layerfreeze.train.ranks.one_sample_share`).

    Raises:
        ConfigError: naming the step and a batch size that avoids it.
    """
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return
    found = one_sample_share(trainer, epoch_batches)
    if found is None:
        return
    step, rank = found
    cfg, n = trainer.config.train, len(trainer.train_set)
    where = f"rank {rank}'s share of step {step}'s batch" if trainer.distributed else f"step {step}'s batch"
    hint = ""
    if not trainer.distributed:
        # the nearest size with no one-sample batch (a batch of 1, or 2 with n % 3 == 1, found none below it)
        near = next((b for d in range(1, n + cfg.batch_size + 2) for b in (cfg.batch_size - d, cfg.batch_size + d)
                     if b >= 2 and n % b != 1), None)
        hint = f" (e.g. {near})" if near is not None else ""
    raise ConfigError(
        f"train.batch_size {cfg.batch_size}: {where} holds one sample of the {n} training samples, and the model's "
        f"BatchNorm layers cannot train on one (\"Expected more than 1 value per channel when training\"); choose "
        f"another batch size{hint}, or another data.limit_train")


def check_same_config(cfg: Config) -> None:
    """Refuse a run whose ranks were given different configs (a collective: every rank calls it once it joined the
    process group, and every rank raises the same error).

    Why: each rank reads its own command line and config file; torchrun on several nodes, or ranks started by hand,
    can give them different ones. A different learning rate, seed or strategy on one rank trained on in silence (the
    gradients are averaged, the rest diverges), and a different batch size hung in the first collective until the
    timeout.

    Raises:
        ConfigError: naming the first keys that differ and their values on each rank.
    """
    mine = leaf_values(cfg.model_dump(mode="json"), opaque=("params",))
    every = dist_.all_gather_object(mine)
    keys = sorted({k for other in every for k in other if any(o.get(k, None) != every[0].get(k, None)
                                                              for o in every)})
    if not keys:
        return
    said = "; ".join(".".join(k) + ": " + ", ".join(f"{o.get(k)!r} on rank {r}" for r, o in enumerate(every))
                     for k in keys[:3])
    more = f" (and {len(keys) - 3} more)" if len(keys) > 3 else ""
    raise ConfigError(f"the ranks were given different configs: {said}{more}. Every rank must run the same command "
                      "(the same flags and config file)")


def check_distributed_config(cfg: Config, distributed: bool) -> None:
    """Refuse, before anything is built, what a run launched on several ranks (torchrun) cannot do: the same
    check on every rank, so every rank stops with the same error (the CLI prints rank 0's).

    Raises:
        ConfigError: ``freeze.demote`` under ``run.parallel: fsdp`` (FSDP2's parameters are DTensor shards, which
            demotion cannot cast or restore); ``freeze.memory_budget`` under torchrun (not planned per rank yet).
    """
    if not distributed:
        return
    if cfg.freeze.demote is not None and cfg.run.parallel == "fsdp":
        raise ConfigError("freeze.demote does not work with run.parallel fsdp (--parallel fsdp): FSDP2 holds every "
                          "parameter as a DTensor shard, which demotion cannot cast and restore, and a frozen block's "
                          "shards already hold no gradient or optimizer state. Leave freeze.demote out, or train "
                          "with --parallel ddp")
    if cfg.freeze.memory_budget is not None:
        what = ("each rank's shards and FSDP2's all-gathers" if cfg.run.parallel == "fsdp"
                else "each rank's share of the batch and DDP's gradient buckets")
        raise ConfigError(f"freeze.memory_budget (--memory-budget) is not supported under torchrun yet ({what} are "
                          "not planned). Leave it out here; plan in one process with `layerfreeze plan --memory "
                          "BUDGET` and freeze the prefix it prints with -s static -p k=N")


def plan_run_memory(trainer: Trainer, model: nn.Module, blocks: list, announce: bool = True) -> MemoryPlan:
    """The memory budget's plan (``freeze.memory_budget``, :func:`~layerfreeze.budget.plan.plan_memory`): two real steps
    on the first batch of epoch 1 with nothing frozen (the model, its buffers and the RNG come back as they were), the
    activation cache's bytes for the training set when the run will keep one, what the strategy itself holds (the
    ledger's ``strategy`` bucket, on a twin of it), what ``freeze.demote`` makes of the frozen prefix's weights (the
    demoted dtype, the master copies kept in host memory), and the shortest frozen prefix that fits. Runs before the
    run folder exists. ``announce``: write :func:`plan_headline` (``layerfreeze plan`` prints it itself, under its own
    header).

    Raises:
        BudgetError: no frozen prefix fits (exit code 2; the message names the smallest reachable peak).
        ConfigError: under torchrun (one process per rank: not supported yet).
    """
    cfg = trainer.config
    check_distributed_config(cfg, trainer.distributed)
    first = epoch_batches(len(trainer.train_set), cfg.train.batch_size, cfg.train.seed, 0)[0]
    loader = DataLoader(trainer.train_set, batch_sampler=[first], generator=torch.Generator())
    batch = to_device(next(iter(loader)), trainer.device)
    cache_set, cache_dtype, cache_cap = None, None, None
    cache = cfg.freeze.cache
    if cache.mode != "off" and cfg.train.compile is not True:  # compile true: no cache (make_cache_runner)
        try:
            split_for(model, blocks)
            check_deterministic(trainer.train_set)
            cache_set = trainer.train_set
        except ValueError:  # no cache in this run (auto says why when it builds the runner; on refuses there)
            pass
        cache_dtype = {"float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16}[cache.dtype]
        cache_cap = auto_budget_bytes() if cache.budget_mb is None else int(cache.budget_mb * 2**20)
    task, precision = trainer.task, trainer.precision
    d = cfg.freeze.demote  # the frozen prefix's weights at the demoted dtype, their master copies where they are kept
    demote = Demotion(d.dtype, d.offload, d.master) if d is not None else None

    def loss(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:  # the step's forward (train.precision)
        with precision.autocast():
            return task.loss(task.forward(m, precision.convert_input(b)), b)

    plan = plan_memory(model, batch, cfg.freeze.memory_budget, loss=loss,
                       optimizer=trainer.optimizer, blocks=blocks, cache_dataset=cache_set, cache_dtype=cache_dtype,
                       cache_budget_bytes=cache_cap, strategy_freezes=cfg.freeze.strategy != "none",
                       train_bn=cfg.freeze.train_bn, strategy=cfg.freeze.strategy, params=cfg.freeze.params,
                       cache_batch=precision.convert_input(batch),  # bf16-true: bfloat16 inputs, as the weights
                       demote=demote)
    if announce:
        trainer.say(plan_headline(plan))
    return plan


def make_cache_runner(trainer: Trainer, blocks: list) -> CachedPrefix | None:
    """The cached forward (``freeze.cache``, :func:`~layerfreeze.compute.cache.build_cached_prefix`), or None to
    use the task's plain forward.

    Raises:
        ConfigError: ``mode: on`` and the data or the model's family does not allow a cache.
    """
    cfg = trainer.config.freeze.cache
    if cfg.mode == "auto" and trainer.config.train.compile is True:  # mode on is refused with it (config.py)
        trainer.say(f"cache: auto, off: train.compile true compiles the model's forward, which {COMPILE_TRUE_BYPASSED}"
                    "; --compile blocks compiles each block and keeps the cache")
        return None
    freeze = trainer.config.freeze
    if cfg.mode == "on" and freeze.train_bn and (freeze.strategy != "none" or freeze.memory_budget is not None):
        # the first freeze of a block with BatchNorm stopped the run with a traceback: known before training
        bn = next((name for b in blocks if not b.is_head for top, module in b.modules
                   for name, m in module.named_modules(prefix=top) if isinstance(m, nn.modules.batchnorm._BatchNorm)),
                  None)
        if bn is not None:
            raise ConfigError(f"freeze.cache.mode is on, but freeze.train_bn true keeps the BatchNorm layers of frozen "
                              f"blocks in training mode ({bn}, ...): their outputs change with every batch and cannot "
                              "be cached. Set freeze.train_bn false, or freeze.cache.mode auto or off")
    dtype = {"float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16}[cfg.dtype]
    directory = rundir.cache_dir(trainer.run_dir, trainer.rank if trainer.distributed else None)
    freed = remove_stale_folders(directory) if directory.is_dir() else 0  # a killed process's: never read again
    if freed:
        trainer.say(f"cache: removed {format_bytes(freed)} of cache shards an earlier process of this run left in "
                    f"{directory}")
    now = functools.partial(current_step, trainer)
    policy = CachePolicy(now=now, next_visit=lambda key: trainer.visits.next_visit(key, now()),
                         boundary_since=lambda: trainer.freezer.prefix_since)
    budget_bytes = None if cfg.budget_mb is None else int(cfg.budget_mb * 2**20)
    shard_bytes = None
    plan = trainer.memory_plan
    if plan is not None and plan.cache_budget_bytes is not None:  # what the memory budget leaves the cache
        budget_bytes, shard_bytes = plan.cache_budget_bytes, 0  # no write buffer above it: spill batch by batch
    try:
        runner = build_cached_prefix(
            trainer.model, blocks, trainer.train_set, mode=cfg.mode, dtype=dtype, directory=directory,
            budget_bytes=budget_bytes, shard_bytes=shard_bytes, freezer=trainer.freezer,
            on_disable=functools.partial(cache_off, trainer), policy=policy)
    except CacheRefused as exc:
        raise ConfigError(f"freeze.cache.mode is on but the frozen prefix cannot be cached: {exc}") from None
    if runner is not None:
        if trainer.config.freeze.strategy == "none" and not trainer.freezer.floor:  # a newcomer read it as in use
            why = ("LoRA's adapters train in every block" if trainer.config.model.lora is not None
                   else "strategy none freezes no block")
            trainer.say(f"cache: {cfg.mode}, idle: {why}, so there is no frozen prefix to cache")
        else:
            trainer.say(f"cache: {cfg.mode}, frozen-prefix outputs kept in up to "
                       f"{format_bytes(runner.cache.budget_bytes)} of memory, then in checksummed shards under "
                       f"{directory}")
    return runner


def current_step(trainer: Trainer) -> int:
    """The step being computed (1-based): what the cache policy's visits are counted in."""
    return getattr(trainer, "progress", {}).get("step", 0) + 1


def cache_off(trainer: Trainer, reason: str) -> None:
    """One ``cache_off`` event and one console line: the run goes on without the cache (``mode: auto``)."""
    trainer.telemetry.log_event(Event.CACHE_OFF, getattr(trainer, "progress", {}).get("step", 0),
                                reason=reason)
    trainer.say(f"cache: off, training runs the full forward ({reason})")
    if hasattr(trainer, "freezer"):
        trainer.freezer.offload_prefix(0)  # nothing is served: offloaded weights come back


def place(trainer: Trainer) -> None:
    """Offload the frozen prefix the cache serves, bring back the rest (``freeze.demote.offload``; else no-op)."""
    served = trainer.runner is not None and trainer.runner.disabled is None
    trainer.freezer.offload_prefix(trainer.freezer.frozen_prefix if served else 0)


def make_ledger(trainer: Trainer) -> MemoryLedger | None:
    """The memory ledger over the model, its optimizer, the Freezer's blocks and the byte sources the run has (the
    cache, the demoted masters; the Freezer reports what its strategy holds), or None when ``run.ledger`` is off."""
    run = trainer.config.run
    if not run.ledger:
        return None
    sources = [s for s in (trainer.runner, trainer.freezer.demoter)
               if hasattr(s, "ledger_bytes")]
    return MemoryLedger(trainer.model, trainer.optimizer, freezer=trainer.freezer, sources=sources,
                        every=run.ledger_every, device=trainer.device)
