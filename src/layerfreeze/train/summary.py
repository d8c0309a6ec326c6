"""The trainer's summary: what a finished (or stopped) run did, in ``summary.json``.

:func:`write_summary` gathers it from a :class:`~layerfreeze.train.trainer.Trainer` after its last step: accuracy and
loss, steps, times, FLOPs, peak memory, the freeze timeline, the checkpoints, the activation cache
(:func:`cache_summary`), demotion, the memory ledger's peaks, the memory budget's plan beside what it measured
(:func:`plan_summary`) and, distributed, each rank's record; rank 0 writes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from layerfreeze import distributed as dist_
from layerfreeze.budget.plan import MemoryPlan
from layerfreeze.runs import rundir
from layerfreeze.train.checkpointing import peak_memory

if TYPE_CHECKING:
    from layerfreeze.train.trainer import Trainer


def write_summary(trainer: Trainer, wall_time: float, cache: dict[str, Any],
                  demote: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's summary (``cache`` and ``demote``: what the cache and demotion reported before they closed),
    written to ``summary.json`` by rank 0; every rank returns it (distributed: a collective, for ``ranks``)."""
    cfg, p = trainer.config, trainer.progress
    last_eval = p["history_eval"][-1] if p["history_eval"] else {}
    timeline = [
        {"block": h["block"], "step": h["step"], "epoch": h["epoch"], "action": h["kind"]}
        for h in trainer.freezer.history
    ]
    ledger = trainer.ledger
    summary = {
        "task": cfg.task,
        "model": trainer.task.model_name,
        "strategy": cfg.freeze.strategy,
        "strategy_params": dict(cfg.freeze.params),
        "precision": trainer.precision.name,
        **({"compile": {**trainer.compiled.summary(), "train_compile_s": p["train_compile_s"]}}
           if trainer.compiled is not None else {}),
        **({"loss_scale": trainer.precision.scaler.get_scale(), "empty_steps": trainer.precision.empty_steps}
           if trainer.precision.scaler is not None else {}),
        "test_accuracy": last_eval.get("accuracy"),
        "test_loss": last_eval.get("loss"),
        **({"test_perplexity": last_eval.get("perplexity")} if trainer.task.objective.metric == "perplexity" else {}),
        "epochs": len(p["epoch_times_s"]),
        "steps": p["step"],
        "wall_time_s": wall_time,
        "train_time_s": p["train_time_s"],
        "resumed_from_step": trainer.resumed_from_step,
        "time_per_epoch_s": list(p["epoch_times_s"]),
        # [steps run, batches in a full epoch] per epoch, where every epoch of the run recorded it
        **({"epoch_steps": [list(e) for e in p["epoch_steps"]]}
           if len(p.get("epoch_steps", [])) == len(p["epoch_times_s"]) else {}),
        "flops_total": p["flops_total"],
        "flops_per_step_first": p["flops_first"],
        "flops_per_step_last": p["flops_per_step"],
        "peak_memory_bytes": peak_memory(trainer),  # a resumed run's: every process's
        "blocks": [b.name for b in trainer.freezer.blocks],
        "frozen_blocks": trainer.freezer.frozen_blocks,
        "trainable_parameters": trainer.freezer.trainable_parameters(),
        "freeze_timeline": timeline,
        "eval_history": p["history_eval"],
        "run_dir": str(trainer.run_dir),
        "world_size": trainer.world,
        "checkpoints": p.get("checkpoints", 0),
        "checkpoint_time_s": p.get("checkpoint_time_s", 0.0),
        "cache": cache,
        "demote": demote,
        "memory": ledger.summary() if ledger is not None else {"ledger": False},
        "tensor_peak_bytes": ledger.peaks.tensor.bytes if ledger and ledger.peaks.tensor else None,
    }
    if trainer.memory_plan is not None:
        summary["memory_plan"] = plan_summary(trainer.memory_plan, summary["tensor_peak_bytes"])
    if trainer.distributed:
        memory = ledger.summary() if ledger is not None else {"ledger": False}
        summary.update(parallel=cfg.run.parallel, grad_bytes_phases=p.get("comm_phases", []),
                       ranks=dist_.all_gather_object({**trainer.rank_record(), "memory": memory}))
        if trainer.ddp is not None:
            summary.update(ddp_rebuilds=trainer.ddp.rebuilds, ddp_rebuild_s=list(trainer.ddp.rebuild_seconds))
    if trainer.is_main:
        rundir.write_summary(trainer.run_dir, summary)
    return summary


def plan_summary(plan: MemoryPlan, measured: int | None) -> dict[str, Any]:
    """``summary.json``'s ``memory_plan``: the budget, what the plan froze, its predicted tensor peak beside the
    ledger's measured one (``error``: measured / predicted - 1)."""
    return {"budget": plan.budget, "budget_bytes": plan.budget_bytes, "none_peak_bytes": plan.none_peak_bytes,
            "frozen_from_start": plan.frozen_from_start, "k": plan.k,
            "predicted_peak_bytes": plan.predicted_peak_bytes, "cache_budget_bytes": plan.cache_budget_bytes,
            "measured_peak_bytes": measured,
            "error": None if not measured else measured / plan.predicted_peak_bytes - 1,
            "within_budget": None if measured is None else measured <= plan.budget_bytes}


def cache_summary(trainer: Trainer) -> dict[str, Any]:
    """What the activation cache did: lookups and saved seconds over the whole run (across resumes, see
    :func:`~layerfreeze.train.checkpointing.cache_counts`), sizes and state of this process's cache."""
    mode = trainer.config.freeze.cache.mode
    if trainer.runner is None:
        return {"mode": mode, "used": False}
    return {"mode": mode, **trainer.runner.summary(carried=getattr(trainer, "_cache_base", {}))}
