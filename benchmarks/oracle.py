"""The oracle line of a benchmark: when each block *could* have been frozen, known only after a full run.

The design brief's benchmark protocol: "freeze each block at the step its CKA to the final model converges (known
only after a full run) -- the best any policy could do on that run". Here, from one ``none`` run (nothing frozen):

1. :class:`ProbeRecorder`, a trainer step callback, records each block's output on a fixed probe batch (training
   samples chosen with a fixed seed; model in eval mode, no grad) before the first step, every few steps and at the
   last step. It keeps, per block and record, a ``(P, r)`` factor ``F`` of the centred output ``Xc`` with
   ``F F^T = Xc Xc^T`` (``r <= P``): linear CKA depends on a representation only through that Gram matrix, so CKA
   on the factors is CKA on the full outputs (no feature subsampling), at ``P x P`` numbers per record.
2. :func:`cka_to_final`: per block, the linear CKA (:func:`~layerfreeze.smartfrz.labels.linear_cka`) of every
   record to the last one.
3. :func:`oracle_freeze_steps`: block ``b``'s oracle step is the first recorded step at which it is *freezable* by
   the SmartFRZ labelling rule (:func:`~layerfreeze.smartfrz.labels.freezable_from_cka`, the same thresholds):
   CKA >= ``tau`` (the labels' 0.9995 for a fine-tune, ``labels.DEFAULT_TAU``; callers pass ``labels.tau_for`` the
   regime, 0.998 from scratch), within 0.01 over the last 3 records, every earlier block freezable too, never the
   head. Freezable at step ``s`` means frozen from step ``s + 1`` on, the way a strategy's freeze at step
   ``s`` is.
4. :func:`prefix_step_flops` measures, once per frozen-prefix length ``k``, the training FLOPs of one step with
   blocks ``0..k-1`` frozen by the engine (:class:`~layerfreeze.engine.Freezer`) on a full training batch, the
   way the trainer measures them (:func:`~layerfreeze.runs.measure.measure_flops` on forward + backward);
   :func:`oracle_flops` sums the schedule's per-step FLOPs over the run.
5. :func:`schedule_gap`: how far a strategy's freeze steps are from the oracle's, as a fraction of the run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from layerfreeze.models.probe import block_modules, probe_outputs
from layerfreeze.smartfrz.labels import DEFAULT_DELTA, DEFAULT_TAU, DEFAULT_WINDOW, freezable_from_cka, linear_cka

#: Probe samples (the smartfrz collector's probe batches are of this order too).
PROBE_SIZE = 64
#: Records over a run, besides the one before the first step: the labelling thresholds were chosen on runs with
#: about 31 activation records, where a window of 3 spans 7-10% of training.
RECORDS = 32


def gram_factor(x: torch.Tensor) -> torch.Tensor:
    """A ``(P, r)`` float64 matrix ``F`` with ``F F^T = Xc Xc^T`` for ``x`` ``(P, ...)`` (flattened per sample,
    columns centred); ``r = min(P, D)``. Linear CKA of two such factors equals that of the full representations."""
    x = x.reshape(x.shape[0], -1).double()
    x = x - x.mean(dim=0, keepdim=True)
    u, s, _ = torch.linalg.svd(x, full_matrices=False)
    return u * s


class ProbeRecorder:
    """Trainer step callback (``Trainer(..., step_callbacks=[recorder])``) recording each block's output on a probe.

    Args:
        probe_size: Training samples in the probe batch (fewer if the training set is smaller).
        records: Records over the run (every ``max(1, round(total_steps / records))`` steps), plus the one before
            the first step and the one at the last step.
        seed: Seed of the probe sample choice (its own generator; the global RNG is not touched).

    After the run: ``steps`` (the recorded steps), ``factors[b][t]`` (see :func:`gram_factor`), ``blocks``
    (names), ``head`` (index of the head block or None), ``total_steps``.
    """

    def __init__(self, probe_size: int = PROBE_SIZE, records: int = RECORDS, seed: int = 0) -> None:
        if probe_size < 2 or records < 1:
            raise ValueError(f"need probe_size >= 2 and records >= 1, got {probe_size} and {records}")
        self.probe_size, self.records, self.seed = probe_size, records, seed
        self.steps: list[int] = []
        self.factors: list[list[torch.Tensor]] = []
        self.blocks: list[str] = []
        self.head: int | None = None
        self.total_steps = 0
        self._every = 1
        self._probe: dict[str, torch.Tensor] | None = None
        self._modules: dict[int, nn.Module] = {}

    def _setup(self, trainer: Any) -> None:
        blocks = trainer.freezer.blocks
        self.blocks = [b.name for b in blocks]
        self.head = next((b.index for b in blocks if b.is_head), None)
        self.total_steps = trainer.total_steps
        self._every = max(1, round(self.total_steps / self.records))
        n = len(trainer.train_set)
        g = torch.Generator().manual_seed(self.seed)
        idx = torch.randperm(n, generator=g)[: min(self.probe_size, n)].sort().values.tolist()
        loader = DataLoader(trainer.train_set, batch_sampler=[idx], generator=torch.Generator())
        self._probe = {k: v.to(trainer.device) for k, v in next(iter(loader)).items()}
        self.factors = [[] for _ in blocks]
        self._modules = block_modules(blocks)

    def __call__(self, trainer: Any) -> None:
        if self._probe is None:
            self._setup(trainer)
        step = trainer.progress["step"]
        if step % self._every and step != self.total_steps:
            return
        if self.steps and self.steps[-1] == step:
            return
        self.record(trainer.model, trainer.task.forward)
        self.steps.append(step)

    def record(self, model: nn.Module, forward: Any) -> None:
        """One record: the probe batch through ``model`` in eval mode, no grad, every module's mode restored after
        (:func:`~layerfreeze.models.probe.probe_outputs`).

        Raises:
            RuntimeError: a block produced no tensor output on the probe batch.
        """
        outputs = probe_outputs(model, self._modules, lambda m: forward(m, self._probe))
        for i, name in enumerate(self.blocks):
            if i not in outputs:
                raise RuntimeError(f"block {name} produced no output on the probe batch")
            self.factors[i].append(gram_factor(outputs[i].cpu()))

    def cka(self) -> list[list[float]]:
        """Per block, the linear CKA of every record to the last one (see :func:`cka_to_final`)."""
        return cka_to_final(self.factors)


def cka_to_final(records: Sequence[Sequence[torch.Tensor]]) -> list[list[float]]:
    """``records[b][t]``: block ``b``'s representation at record ``t``; returns ``cka[b][t]`` = linear CKA to the
    last record (NaN where a record is not finite, e.g. a diverged run)."""
    out = []
    for reps in records:
        final = reps[-1]
        row = []
        for rep in reps:
            try:
                row.append(linear_cka(rep, final))
            except ValueError:
                row.append(math.nan)
        out.append(row)
    return out


def oracle_freeze_steps(cka: list[list[float]], steps: Sequence[int], head: int | None = None,
                        tau: float = DEFAULT_TAU, delta: float = DEFAULT_DELTA,
                        window: int = DEFAULT_WINDOW) -> list[int | None]:
    """Per block, the first recorded step at which it is freezable (None: never; always None for the head).

    The rule is the SmartFRZ labels' (:func:`~layerfreeze.smartfrz.labels.freezable_from_cka`): CKA to the final
    record ``>= tau``, ``max - min <= delta`` over the last ``window`` records, and every earlier block freezable
    at that record too. So the steps never decrease front to back: the schedule freezes a growing prefix.
    """
    if any(len(row) != len(steps) for row in cka):
        raise ValueError(f"every CKA row needs one value per recorded step ({len(steps)})")
    flags = freezable_from_cka(cka, tau, delta, window, head)
    return [next((steps[t] for t, f in enumerate(row) if f), None) for row in flags]


def prefix_at(freeze_steps: Sequence[int | None], step: int) -> int:
    """Frozen-prefix length during (1-based) ``step``: leading blocks whose freeze step is before it."""
    k = 0
    while k < len(freeze_steps) and freeze_steps[k] is not None and freeze_steps[k] < step:
        k += 1
    return k


def prefixes_used(freeze_steps: Sequence[int | None], total_steps: int) -> set[int]:
    """The frozen-prefix lengths the schedule has over steps ``1..total_steps`` (what :func:`oracle_flops` needs)."""
    return {prefix_at(freeze_steps, s) for s in range(1, total_steps + 1)}


def oracle_flops(freeze_steps: Sequence[int | None], flops_per_step: Mapping[int, float], total_steps: int) -> float:
    """Training FLOPs of a run that freezes block ``b`` after step ``freeze_steps[b]``: the sum over steps
    ``1..total_steps`` of ``flops_per_step[k]``, ``k`` the frozen-prefix length during that step.

    Raises:
        KeyError: a prefix length the schedule reaches has no entry in ``flops_per_step``.
    """
    return float(sum(flops_per_step[prefix_at(freeze_steps, s)] for s in range(1, total_steps + 1)))


def schedule_gap(row_steps: Mapping[str, int], oracle_steps: Mapping[str, int | None], total_steps: int,
                 head: str | None = None) -> float:
    """Mean over the non-head blocks of ``|row step - oracle step| / total_steps``; a block never frozen (absent
    from ``row_steps``, None in ``oracle_steps``) counts as frozen at the end (``total_steps``).

    0 is the oracle's schedule; 1 is as far as possible (e.g. frozen from the start where the oracle never freezes).
    """
    names = [name for name in oracle_steps if name != head]
    if not names or total_steps <= 0:
        raise ValueError("schedule_gap needs at least one non-head block and total_steps > 0")

    def at(step: int | None) -> int:
        return total_steps if step is None else min(step, total_steps)

    return sum(abs(at(row_steps.get(n)) - at(oracle_steps[n])) for n in names) / (len(names) * total_steps)


def prefix_step_flops(config: Any, prefixes: Iterable[int]) -> dict[int, int]:
    """Training FLOPs of one step (forward + backward) with the first ``k`` blocks frozen, for each ``k``.

    Builds the config's task afresh (same model, data and blocks as its run), takes the first batch of the first
    epoch (a full batch of ``train.batch_size``, as the trainer measures on), freezes the prefix with the engine's
    :class:`~layerfreeze.engine.Freezer` (no optimizer: only ``requires_grad`` and modes matter for the count) and
    counts with :func:`~layerfreeze.runs.measure.measure_flops`. The optimizer step is left out: FlopCounterMode counts
    none of its element-wise work, so the trainer's per-step number is the same.
    """
    from layerfreeze.engine.freezer import Freezer
    from layerfreeze.models.discovery import discover_blocks
    from layerfreeze.runs.measure import measure_flops
    from layerfreeze.train.setup import epoch_batches, resolve_device, seed_everything
    from layerfreeze.train.tasks import build_task

    seed_everything(config.train.seed)
    task = build_task(config)
    device = resolve_device(config.run.device)
    model = task.model.to(device)
    blocks = discover_blocks(model, config.model.blocks)
    batch_idx = epoch_batches(len(task.train_set), config.train.batch_size, config.train.seed, 0)[0]
    loader = DataLoader(task.train_set, batch_sampler=[batch_idx], generator=torch.Generator())
    batch = {k: v.to(device) for k, v in next(iter(loader)).items()}
    model.train()
    freezer = Freezer(model, None, "none", blocks=blocks, train_bn=config.freeze.train_bn)

    def step() -> None:
        loss = nn.functional.cross_entropy(task.forward(model, batch), batch["labels"])
        loss.backward()
        model.zero_grad(set_to_none=True)

    out: dict[int, int] = {}
    try:
        for k in sorted(set(prefixes)):
            if not 0 <= k < len(blocks):
                raise ValueError(f"prefix length {k} out of range 0..{len(blocks) - 1} (the head is never frozen)")
            for i in range(k):
                freezer.freeze(i, reason="oracle")
            out[k] = measure_flops(step)[1]
    finally:
        freezer.close()
    return out
