"""Freezing inside Lightning's ``Trainer.fit``: the :class:`LayerFreeze` callback (``pip install
layerfreeze[lightning]``).

::

    from layerfreeze.integrations.lightning import LayerFreeze

    trainer = lightning.Trainer(max_epochs=3, callbacks=[LayerFreeze("smartfrz")])
    trainer.fit(module)                          # later: trainer.fit(module, ckpt_path="last.ckpt")

Every registered strategy runs at its own cadence (steps or epoch ends). What each hook does, and the public fault
of Lightning's own ``BaseFinetuning`` it avoids:

* ``setup``: the strategy's start stage freezes its blocks before ``configure_optimizers`` and before the DDP
  wrapper registers the trainable parameters.
* ``load_state_dict`` (on ``fit(ckpt_path=...)``, after ``setup``, still before the optimizer and the DDP wrapper
  exist): the saved frozen set, strategy state and ``requires_grad`` come back, so a run resumed after a thaw keeps
  training the thawed blocks (Lightning #21901: ``BackboneFinetuning`` leaves the backbone frozen for good after a
  resume).
* ``on_fit_start`` (optimizer built, its state not loaded yet): frozen parameters leave the optimizer before any
  step; on resume the param groups are rebuilt by parameter name as they were saved, so Lightning's own optimizer
  restore matches them (no "loaded state dict has a different number of parameter groups", #6891, #8502). A thaw
  puts each parameter back into the param group it came from: the number of groups never changes, an LR
  scheduler keeps working, discriminative LRs (``gradual``) set the thawed block's own group.
* ``on_before_optimizer_step``: gradient signals (``autofreeze``). ``on_train_batch_end`` / ``on_train_epoch_end``:
  the freezing stages; after a change, ``strategy="ddp"``'s wrapper is rebuilt in place around the trainable
  parameters (no "Expected to have finished reduction", no silent desync after a thaw, #20340, no
  ``find_unused_parameters=True``), and the signals and the freeze timeline go to every Lightning logger
  (``layerfreeze/...``).

Build the optimizer in ``configure_optimizers`` over *all* parameters (``self.parameters()``, or
:func:`layerfreeze.block_param_groups` for one group per block): the callback takes the frozen ones out before the
first step and knows where each goes back. A parameter the optimizer never held goes back to group 0 on a thaw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from layerfreeze.budget.plan import MemoryPlan
from layerfreeze.engine.freezer import Freezer
from layerfreeze.engine.optim import inner_optimizer
from layerfreeze.integrations import require
from layerfreeze.integrations.common import (
    FreezeSession,
    check_callback_arguments,
    is_checkpointing,
    plan_on_first_batch,
)
from layerfreeze.strategies import DEFAULT_STRATEGY, Strategy

L = require("lightning.pytorch", "lightning")


class LayerFreeze(L.Callback):
    """Runs a freezing strategy inside ``Trainer.fit`` (see the module docstring for what each hook does and why).

    Args:
        strategy: A registered strategy name (default ``"smartfrz"``) or a :class:`~layerfreeze.strategies.Strategy`.
        params: The strategy's parameters (with a name only).
        blocks: Module-name patterns naming the blocks front to back (in ``submodule``); default: discovered.
        train_bn: Keep BatchNorm layers of frozen blocks training.
        submodule: Attribute of the LightningModule holding the network to freeze (e.g. ``"model"`` for a module
            that wraps a Hugging Face model as ``self.model``); default: the LightningModule itself.
        ledger_every: Keep the memory ledger (:class:`~layerfreeze.runs.ledger.MemoryLedger`), sampling one optimizer
            step in ``ledger_every`` and the step after every freeze or thaw; each sample is logged to the Trainer's
            loggers as ``layerfreeze/memory/<bucket>`` (bytes), its peaks are ``callback.session.ledger.peaks``.
            None (default): no ledger.
        memory_budget: A tensor-peak budget (``"3GiB"``, ``"800MiB"``, ``0.6`` of the peak with nothing frozen; an int
            of bytes) or a ready :class:`~layerfreeze.budget.plan.MemoryPlan`. At ``on_train_start`` (the optimizer
            and the train loader exist) two real steps on the first training batch measure each block's bytes as if
            nothing were frozen (:func:`~layerfreeze.budget.plan.plan_memory`; the model and the random streams come
            back as they were), and the shortest frozen prefix that fits is frozen before the first step and never
            thawed (:meth:`~layerfreeze.engine.Freezer.pin`); ``callback.memory_plan`` holds the plan.
        memory_loss: ``memory_loss(pl_module, batch)`` -> the scalar loss of a batch, for the measurement; default
            the LightningModule's ``training_step(batch, 0)`` (its ``loss`` when it returns a mapping) with
            ``self.log`` silenced: it runs twice more than the fit does.

    Attributes:
        freezer: The :class:`~layerfreeze.engine.Freezer` (from ``setup`` on); ``freezer.history`` is the timeline.
        session: The :class:`~layerfreeze.integrations.common.FreezeSession` (from ``on_fit_start`` on).

    Raises (at ``setup`` / ``on_fit_start``):
        BlockDiscoveryError, UnknownStrategyError, ValueError: as :class:`~layerfreeze.engine.Freezer`.
        ValueError: ``configure_optimizers`` returned more than one optimizer (one is supported).
        RuntimeError: the strategy needs the run length and the Trainer cannot estimate it (``max_epochs=-1``
            without ``max_steps``); the network has another open Freezer (another ``LayerFreeze`` callback's).
        BudgetError (at ``on_train_start``): ``memory_budget`` cannot be read or met.
    """

    def __init__(self, strategy: str | Strategy = DEFAULT_STRATEGY, params: dict[str, Any] | None = None,
                 blocks: Sequence[str] | None = None, train_bn: bool = False, submodule: str | None = None,
                 ledger_every: int | None = None, memory_budget: Any = None,
                 memory_loss: Callable[[Any, Any], torch.Tensor] | None = None) -> None:
        check_callback_arguments("LayerFreeze", strategy, params, blocks)
        self.strategy = strategy
        self.memory_budget = memory_budget
        self.memory_loss = memory_loss
        self.memory_plan: MemoryPlan | None = None
        self.ledger_every = ledger_every
        self.params = dict(params or {})
        self.blocks = list(blocks) if blocks is not None else None
        self.train_bn = train_bn
        self.submodule = submodule
        self.freezer: Freezer | None = None
        self.session: FreezeSession | None = None
        self._restored: dict[str, Any] | None = None
        self._steps_seen = 0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(strategy=getattr(self.strategy, "name", self.strategy), blocks=self.blocks,
                                        submodule=self.submodule)

    def _network(self, pl_module: Any) -> nn.Module:
        """The network to freeze: ``pl_module.<submodule>``, or the LightningModule itself.

        Raises:
            ValueError: ``submodule`` names no ``nn.Module`` attribute of the LightningModule (the message names
                the option and the module's children).
        """
        if not self.submodule:
            return pl_module
        missing = object()
        network = getattr(pl_module, self.submodule, missing)
        if isinstance(network, nn.Module):
            return network
        children = ", ".join(name for name, _ in pl_module.named_children()) or "none"
        found = "has no attribute" if network is missing else f"holds a {type(network).__name__}, not a module, in"
        raise ValueError(
            f"LayerFreeze(submodule={self.submodule!r}): {type(pl_module).__name__} {found} {self.submodule!r}. "
            f"Name the attribute that holds the network to freeze (its child modules: {children}), or leave "
            "submodule out to find the blocks in the LightningModule itself")

    # ---- before the optimizer exists -----------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Build the Freezer (its start stage freezes now, before ``configure_optimizers`` and the DDP wrapper)."""
        if stage != "fit" or (self.freezer is not None and not self.freezer.closed):
            return
        # a fit after an earlier one (a second phase, a notebook's re-run): its Freezer was closed at teardown, and
        # may hold another module: start over
        self.session, self._restored, self._steps_seen, self.memory_plan = None, None, 0, None
        total = trainer.estimated_stepping_batches
        total_steps = int(total) if math.isfinite(total) and total > 0 else None  # 0: nothing to train
        steps_per_epoch = None
        if math.isfinite(trainer.num_training_batches):
            steps_per_epoch = math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches) or None
        self.freezer = Freezer(self._network(pl_module), None, self.strategy, self.params or None,
                               blocks=self.blocks, train_bn=self.train_bn, total_steps=total_steps,
                               steps_per_epoch=steps_per_epoch)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the frozen set, strategy state and ``requires_grad`` (before the optimizer and DDP exist)."""
        if not state_dict:
            return
        self._restored = state_dict["freezer"]
        if self.freezer is not None:
            self.freezer.load_state_dict(self._restored)

    def state_dict(self) -> dict[str, Any]:
        """The freezer's state (frozen set, param-group membership by name, strategy state) for the checkpoint."""
        return {"freezer": self.freezer.state_dict()} if self.freezer is not None else {}

    # ---- the optimizer exists, its state is not loaded yet -------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Hand the freezer the optimizer and scheduler; on resume, rebuild the param groups as they were saved."""
        if len(trainer.optimizers) != 1:
            raise ValueError(f"LayerFreeze supports one optimizer; configure_optimizers returned "
                             f"{len(trainer.optimizers)}")
        configs = trainer.lr_scheduler_configs
        self.freezer.attach_optimizer(trainer.optimizers[0], configs[0].scheduler if configs else None)
        if self._restored is not None:
            self.freezer.load_state_dict(self._restored)
        self.session = FreezeSession(self.freezer, checkpointing=is_checkpointing(self._network(pl_module)),
                                     ledger_every=self.ledger_every)
        if self._restored is not None:
            self.session.events.clear()  # the restore's own freezes are not news
        self._log(trainer, None)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Count optimizer steps from here (on resume Lightning restores ``global_step`` after ``on_fit_start``);
        with a memory budget, plan on the first training batch and pin the plan's prefix."""
        self._steps_seen = trainer.global_step
        if self.memory_budget is not None:
            loss = self.memory_loss or _training_step_loss
            self.memory_plan = plan_on_first_batch(
                self.memory_budget, self._network(pl_module), inner_optimizer(trainer.optimizers[0]),
                trainer.train_dataloader, move=trainer.strategy.batch_to_device,
                loss=lambda model, batch: loss(pl_module, batch), blocks=self.freezer.blocks, unfrozen=True,
                sources=[self.freezer])
            if self.memory_plan.floor:
                self.freezer.pin(self.memory_plan.floor)
                self._after_stage(trainer, None)

    # ---- training ------------------------------------------------------------------------------------------

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Collect gradient signals for strategies that read them (after backward, before the step)."""
        if not _backward_skipped(trainer):
            self.freezer.after_backward()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Before the first micro-batch of an optimizer step: the memory ledger's step opens, and the DDP wrapper
        is rebuilt if a parameter was frozen by hand since the last stage (a user's callback after this one)."""
        self.session.sync(trainer.strategy.model)
        self.session.begin_step(trainer.global_step + 1)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After each optimizer step (not each accumulated micro-batch): the memory ledger's step closes, and the
        strategy's step stage."""
        if self._steps_seen < trainer.global_step:
            self.session.end_step()
            memory = self.session.memory_metrics() if self.session.ledger is not None and \
                self.session.ledger.last_step_sampled else {}
            if memory and trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(memory, step=trainer.global_step)
        if _backward_skipped(trainer):  # no weight changed: not a step of the strategy's run (total_steps)
            self._steps_seen = trainer.global_step
        while self._steps_seen < trainer.global_step:
            self._steps_seen += 1
            decision = self.freezer.step()
            self._after_stage(trainer, decision)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """The strategy's epoch-end stage (before ``ModelCheckpoint`` saves: Lightning runs it last)."""
        self._after_stage(trainer, self.freezer.epoch_end())

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Release the strategy's hooks and threads and the checkpointing hook."""
        if stage == "fit":
            self._release()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """A fit that raised gets no ``teardown``: release here, so a next fit (with this callback or another, on
        this module or a new one) starts from a closed Freezer."""
        self._release()

    def _release(self) -> None:
        if self.session is not None:
            self.session.close()
        elif self.freezer is not None:  # the fit stopped before on_fit_start
            self.freezer.close()

    # ---- internals -----------------------------------------------------------------------------------------

    def _after_stage(self, trainer: Any, decision: Any) -> None:
        self.session.sync(trainer.strategy.model)
        self._log(trainer, decision)

    def _log(self, trainer: Any, decision: Any) -> None:
        metrics = self.session.metrics(decision)
        if metrics and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)


def _backward_skipped(trainer: Any) -> bool:
    """Whether this epoch's steps run no backward: ``StochasticWeightAveraging``'s extra epoch on a model with
    BatchNorm, one forward pass over the data to recompute the statistics, counted by Lightning as one optimizer step
    (``global_step`` one past ``estimated_stepping_batches``). Counting it made the Freezer warn that it was called
    more than ``total_steps`` times."""
    return bool(getattr(trainer.fit_loop, "_skip_backward", False))


def _training_step_loss(pl_module: Any, batch: Any) -> torch.Tensor:
    """``pl_module.training_step(batch, 0)``'s loss, its ``self.log`` / ``self.log_dict`` calls dropped (outside the
    fit loop's step Lightning would refuse them)."""
    pl_module.log = pl_module.log_dict = lambda *args, **kwargs: None
    try:
        out = pl_module.training_step(batch, 0)
    finally:
        del pl_module.log, pl_module.log_dict
    return out["loss"] if isinstance(out, Mapping) else out
