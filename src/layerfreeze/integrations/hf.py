"""Freezing inside ``transformers.Trainer``: the :class:`LayerFreezeCallback` (``pip install layerfreeze[hf]``).

::

    from layerfreeze.integrations.hf import LayerFreezeCallback

    trainer = Trainer(model=model, args=args, train_dataset=train_set, callbacks=[LayerFreezeCallback("smartfrz")])
    trainer.train()                              # later: trainer.train(resume_from_checkpoint=True)

(``LayerFreezeCallback(...).attach(trainer)`` adds it to a Trainer built without it.) The callback needs its
Trainer, not only what the Trainer passes to callbacks (``model``, ``optimizer``, ``lr_scheduler``): under DDP it
rebuilds the Trainer's own wrapper, ``trainer.model_wrapped``, and it logs through ``trainer.log`` (into
``log_history`` and every ``report_to`` integration). A callback passed in ``callbacks=[...]`` finds it when the
Trainer first calls it (``on_init_end``, at the end of ``Trainer.__init__``; again at ``on_train_begin``): the
Trainer whose call is on the stack and whose callbacks hold this one.

Every registered strategy runs at its own cadence (steps or epoch ends). What each hook does, and the public fault
it avoids:

* ``on_train_begin`` (the Trainer has built its optimizer from the parameters that require grad, and its
  scheduler, and has not stepped): the strategy's start stage freezes its blocks; their parameters leave the
  optimizer before the first step (no state, no update, ever), and each one's param group is remembered (weight
  decay or not, as ``create_optimizer`` chose), so a thaw puts it back there: the group count and the LR
  scheduler stay right. Freezing here rather than before ``create_optimizer`` is what makes a thaw exact: a
  parameter the Trainer never saw has no group to go back to.
* ``on_pre_optimizer_step``: gradient signals (``autofreeze``); ``on_step_end`` / ``on_epoch_end``: the freezing
  stages. After a change the Trainer's own ``DistributedDataParallel`` (``trainer.model_wrapped``) is rebuilt in
  place around the trainable parameters, so mid-run freezing under ``torchrun`` needs no
  ``find_unused_parameters`` and works with gradient checkpointing (where the Trainer turns it off and a freeze
  raises "Expected to have finished reduction"), and a thaw cannot leave the ranks drifting apart (Lightning
  #20340, the same DDP fault). Signals and the freeze timeline go through ``trainer.log`` into
  ``trainer.state.log_history`` and every ``report_to`` integration (``layerfreeze/...``).
* Gradient checkpointing with a frozen prefix: the prefix's output is made to require grad, so reentrant
  checkpointing still gives the trainable layers gradients (transformers #21381, #23170).
* ``on_save``: the freezer's state (frozen set, strategy state, param-group membership) goes into the checkpoint
  folder as ``layerfreeze.pt``, and ``optimizer.pt`` is rewritten in its full form (every parameter in the group
  the Trainer built it in, in the model's order): on resume the Trainer rebuilds the optimizer and loads its state
  *before* any callback runs, from parameters that all require grad, and the full form is what loads into it
  without "a parameter group that doesn't match the size of optimizer's group" and with every Adam moment on
  its own parameter. ``on_train_begin`` of the resumed run then restores the frozen set and ``requires_grad``
  and takes the frozen parameters out again, keeping the loaded optimizer state.

Strategies that set a block's own learning rate (``gradual``'s discriminative LRs, ``freezeout``'s per-block
annealing) need one param group per block, which the Trainer's decay / no-decay groups are not (the Freezer raises
a ValueError naming :func:`layerfreeze.block_param_groups`): pass ``optimizers=(torch.optim.AdamW(
block_param_groups(model, discover_blocks(model), lr=...)), None)`` to the Trainer; its scheduler is built on top.

Why not the Trainer's stateful callbacks (``ExportableState``): they are JSON in ``trainer_state.json`` (the
SmartFRZ weight history is tensors), restored only with ``restore_callback_states_from_checkpoint=True``, and by
a *new* instance of the callback, without the trainer it was attached to. The documented mechanism is the
checkpoint folder's ``layerfreeze.pt``, found as ``<output_dir>/checkpoint-<global_step>`` (the Trainer's own
naming) or given as ``LayerFreezeCallback(resume_from=...)`` for a checkpoint that was moved.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from layerfreeze.budget.plan import MemoryPlan
from layerfreeze.engine.freezer import Freezer, release_earlier_freezers
from layerfreeze.engine.mechanics import open_freezer
from layerfreeze.engine.optim import inner_optimizer
from layerfreeze.integrations import require
from layerfreeze.integrations.common import (
    LOG_PREFIX,
    STATE_FILE,
    FreezeSession,
    OptimizerSnapshot,
    check_callback_arguments,
    full_optimizer_state_dict,
    inner_scheduler,
    is_checkpointing,
    plan_on_first_batch,
)
from layerfreeze.strategies import DEFAULT_STRATEGY, Strategy

transformers = require("transformers", "hf")

#: The Trainer's optimizer file in a checkpoint folder (``transformers.trainer.OPTIMIZER_NAME``).
OPTIMIZER_FILE = "optimizer.pt"


def _release_before_optimizer(trainer: Any, model: Any) -> None:
    """Make trainable again what an earlier Freezer left frozen on ``model`` (a first ``train()`` with another
    Trainer), when ``trainer`` will build its own optimizer: ``create_optimizer`` takes what requires grad, so those
    parameters were left out of it, and the resumed run's optimizer, built the same way, did not load the checkpoint
    (:func:`~layerfreeze.engine.release_earlier_freezers`). An optimizer given to the Trainer keeps the Freezer's
    take-over instead; a model whose Freezer is still open (a ``train()`` interrupted in a notebook) is left as it is,
    and ``train()`` refuses it, saying what to do."""
    if model is not None and getattr(trainer, "optimizer", None) is None and open_freezer(model) is None:
        release_earlier_freezers(model)


def _calling_trainer(callback: Any) -> Any:
    """The ``transformers.Trainer`` (any subclass) up the call stack whose callbacks hold ``callback``, or None.

    Why the stack: the Trainer calls its callbacks through its ``CallbackHandler`` with the model, optimizer and
    scheduler but never itself, and a callback given in ``Trainer(callbacks=[...])`` is created before the Trainer
    exists; every hook call, though, comes from a method of that Trainer (``__init__`` for ``on_init_end``,
    ``train`` for the others), so its frame holds it as ``self``.
    """
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, transformers.Trainer):
            handler = getattr(candidate, "callback_handler", None)
            if handler is not None and any(cb is callback for cb in handler.callbacks):
                return candidate
        frame = frame.f_back
    return None


class LayerFreezeCallback(transformers.TrainerCallback):
    """Runs a freezing strategy inside ``transformers.Trainer.train`` (see the module docstring for what each
    hook does and why). Pass it in ``Trainer(..., callbacks=[LayerFreezeCallback(...)])`` like any Trainer callback,
    or add it to a built Trainer with :meth:`attach`; either way it keeps the trainer (its DDP wrapper and its log).

    Args:
        strategy: A registered strategy name (default ``"smartfrz"``) or a :class:`~layerfreeze.strategies.Strategy`.
        params: The strategy's parameters (with a name only).
        blocks: Module-name patterns naming the blocks front to back; default: discovered (BERT-like models).
        train_bn: Keep BatchNorm layers of frozen blocks training.
        resume_from: Checkpoint folder to restore the freezer from when the Trainer resumes; default: the
            Trainer's ``<output_dir>/checkpoint-<global_step>``.
        ledger_every: Keep the memory ledger (:class:`~layerfreeze.runs.ledger.MemoryLedger`), sampling one optimizer
            step in ``ledger_every`` and the step after every freeze or thaw; its last sample is logged with the
            Trainer's logs as ``layerfreeze/memory/<bucket>`` (bytes), its peaks are ``callback.session.ledger.peaks``.
            None (default): no ledger.
        memory_budget: A tensor-peak budget (``"3GiB"``, ``"800MiB"``, ``0.6`` of the peak with nothing frozen; an int
            of bytes) or a ready :class:`~layerfreeze.budget.plan.MemoryPlan`. At ``on_train_begin`` two real steps on
            the first training batch (``model(**batch).loss``) measure each block's bytes
            (:func:`~layerfreeze.budget.plan.plan_memory`; the model and the random streams come back as they were),
            and the shortest frozen prefix that fits is frozen before the first step and never thawed (the Freezer's
            ``floor``); ``callback.memory_plan`` holds the plan. None (default): no budget.

    Attributes:
        freezer: The :class:`~layerfreeze.engine.Freezer` (from ``on_train_begin`` on); ``freezer.history`` is the
            freeze timeline.
        session: The :class:`~layerfreeze.integrations.common.FreezeSession`.

    Raises (at ``on_train_begin``):
        RuntimeError: the hooks were called by something other than a ``transformers.Trainer`` holding this
            callback (so there is no trainer to rebuild the DDP wrapper of and to log through), and it was not
            attached with :meth:`attach`; the callback is registered twice with the Trainer; the model has another
            open Freezer (another callback's).
        FileNotFoundError: the Trainer resumes but the checkpoint folder has no ``layerfreeze.pt`` (give
            ``resume_from``, or resume from a checkpoint written with this callback).
        BudgetError: ``memory_budget`` cannot be read or met (the message names the smallest reachable peak).
        BlockDiscoveryError, UnknownStrategyError, ValueError: as :class:`~layerfreeze.engine.Freezer`.
    """

    def __init__(self, strategy: str | Strategy = DEFAULT_STRATEGY, params: dict[str, Any] | None = None,
                 blocks: Sequence[str] | None = None, train_bn: bool = False,
                 resume_from: str | os.PathLike | None = None, ledger_every: int | None = None,
                 memory_budget: Any = None) -> None:
        check_callback_arguments("LayerFreezeCallback", strategy, params, blocks)
        self.strategy = strategy
        self.memory_budget = memory_budget
        self.memory_plan: MemoryPlan | None = None
        self.ledger_every = ledger_every
        self.params = dict(params or {})
        self.blocks = list(blocks) if blocks is not None else None
        self.train_bn = train_bn
        self.resume_from = resume_from
        self.trainer: Any = None
        self.freezer: Freezer | None = None
        self.session: FreezeSession | None = None
        self._train_state: Any = None  # the TrainerState of the train() the Freezer was built in

    def attach(self, trainer: Any) -> LayerFreezeCallback:
        """Add the callback to ``trainer`` and keep a reference to it; returns the callback."""
        self.trainer = trainer
        trainer.add_callback(self)
        _release_before_optimizer(trainer, trainer.model)
        return self

    def _find_trainer(self) -> None:
        """Keep the ``transformers.Trainer`` that is calling this hook (see the module docstring: why)."""
        trainer = _calling_trainer(self)
        if trainer is not None:
            self.trainer = trainer

    # ---- hooks ---------------------------------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Keep the Trainer being built (a callback given in ``Trainer(callbacks=[...])``); let go of what an earlier
        Freezer left frozen on its model before the Trainer builds its optimizer (:func:`_release_before_optimizer`)."""
        self._find_trainer()
        if self.trainer is not None:
            _release_before_optimizer(self.trainer, model)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, train_dataloader: Any = None, **kwargs: Any) -> None:
        """Build the Freezer (its start stage freezes now, before the first step); on resume, restore it."""
        self._find_trainer()
        if self.trainer is None:
            raise RuntimeError(
                "LayerFreezeCallback needs the transformers.Trainer it runs in (it rebuilds the Trainer's DDP wrapper, "
                "trainer.model_wrapped, and logs through trainer.log; the Trainer passes neither to callbacks), and "
                "no Trainer holding this callback is calling it: pass it in Trainer(..., callbacks=[...]) or add it "
                "with LayerFreezeCallback(...).attach(trainer)")
        if self.freezer is not None and not self.freezer.closed:
            # a train() that raised got no on_train_end: its Freezer goes; in the same train() (its TrainerState)
            # this is a second registration
            self.on_train_end(args, state, control)
            if state is self._train_state:
                raise RuntimeError(
                    "LayerFreezeCallback.on_train_begin ran twice in one train(): this callback is registered twice "
                    "with the Trainer (in Trainer(callbacks=[...]) and with .attach(trainer), or twice in the list; "
                    "transformers only warns of it, then calls it twice, which would step its strategy twice per "
                    "update). Register it once")
        self._train_state = state
        optimizer = inner_optimizer(optimizer)
        saved = self._saved_state(args, state)
        snapshot = OptimizerSnapshot(optimizer) if saved is not None else None
        steps_per_epoch = None
        if train_dataloader is not None and hasattr(train_dataloader, "__len__"):
            steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps) or None
        if self.memory_budget is not None:
            device = next(model.parameters()).device
            self.memory_plan = plan_on_first_batch(
                self.memory_budget, model, optimizer, train_dataloader, blocks=self.blocks,
                strategy=self.strategy, params=self.params,
                move=lambda batch: {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
        self.freezer = Freezer(model, optimizer, self.strategy, self.params or None, blocks=self.blocks,
                               train_bn=self.train_bn, scheduler=inner_scheduler(lr_scheduler),
                               total_steps=state.max_steps if state.max_steps > 0 else None,
                               steps_per_epoch=steps_per_epoch,
                               floor=self.memory_plan.floor if self.memory_plan is not None else None)
        if saved is not None:
            self.freezer.load_state_dict(saved["freezer"])
            snapshot.restore()
        self.session = FreezeSession(self.freezer, checkpointing=is_checkpointing(model),
                                     ddp_built_for=(False,) * len(self.freezer.blocks), ledger_every=self.ledger_every)
        if saved is not None:
            self.session.events.clear()  # the restore's own freezes are not news
        self._after_stage(None, control)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Before the step's first micro-batch: the memory ledger's step opens, and the DDP wrapper is rebuilt if a
        parameter was frozen by hand since the last stage (a user's callback after this one)."""
        self.session.sync(self.trainer.model_wrapped)
        self.session.begin_step(state.global_step + 1)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Collect gradient signals for strategies that read them (after backward and clipping, before the step)."""
        self.freezer.after_backward()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The memory ledger's step closes; the strategy's step stage, after the optimizer and scheduler steps."""
        self.session.end_step()
        self._after_stage(self.freezer.step(), control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The strategy's epoch-end stage."""
        self._after_stage(self.freezer.epoch_end(), control)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write ``layerfreeze.pt`` and the full-form ``optimizer.pt`` into the checkpoint just saved (rank 0)."""
        if not args.should_save:
            return
        folder = Path(args.output_dir) / f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        torch.save({"global_step": state.global_step, "freezer": self.freezer.state_dict()}, folder / STATE_FILE)
        if (folder / OPTIMIZER_FILE).is_file():
            torch.save(full_optimizer_state_dict(self.freezer), folder / OPTIMIZER_FILE)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Release the strategy's hooks and threads and the checkpointing hook."""
        if self.session is not None:
            self.session.close()
        elif self.freezer is not None:
            self.freezer.close()

    # ---- internals -----------------------------------------------------------------------------------------

    def _saved_state(self, args: Any, state: Any) -> dict[str, Any] | None:
        """The freezer state of the checkpoint the Trainer resumes from (None on a fresh run)."""
        if state.global_step == 0:
            return None
        folder = Path(self.resume_from) if self.resume_from is not None else (
            Path(args.output_dir) / f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        path = folder / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"The Trainer resumes at step {state.global_step}, but {path} does not exist: resume from a checkpoint "
                "written with LayerFreezeCallback, or name its folder with LayerFreezeCallback(resume_from=...)")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved["global_step"] != state.global_step:
            raise ValueError(f"{path} is from step {saved['global_step']}, the Trainer resumes at step "
                             f"{state.global_step}: give the matching checkpoint folder as resume_from")
        return saved

    def _after_stage(self, decision: Any, control: Any) -> None:
        self.session.sync(self.trainer.model_wrapped)
        metrics = self.session.metrics(decision)
        changed = any(key.startswith(f"{LOG_PREFIX}frozen/") for key in metrics)  # a freeze or thaw since the last
        # at the Trainer's logging cadence (logging_steps), and whenever the frozen set changes
        if changed or control.should_log:
            metrics.update(self.session.memory_metrics())
        if metrics and (changed or control.should_log):
            should_log = control.should_log  # trainer.log resets it: the Trainer's own log of this step must stay
            self.trainer.log(metrics)
            control.should_log = should_log
