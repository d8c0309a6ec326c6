"""Collect training runs for the SmartFRZ predictor: train small networks to the end and record every block.

A *recipe* (:mod:`.recipes`) builds a :class:`~layerfreeze.smartfrz.setup.Setup` (model, train data, fixed probe batch,
loss, optimizer settings) from a seed; a *run* is one recipe trained with one seed and one learning rate, with the plain
loop :func:`~layerfreeze.train.loop.train_steps` (no freezing) and the shared LR schedule
(:func:`~layerfreeze.train.loop.lr_lambda`; warm-up rounded the collector's way, ``warmup_steps(...,
rounding="round")``, which the shipped predictor's runs were recorded with). While it trains we record, every
``snapshot_every`` optimizer steps (and before the first step), each block's weight sample exactly as the online
:class:`~layerfreeze.strategies.smartfrz.recorder.WeightRecorder` does (1,024 weights per block at fixed positions drawn
with seed 0, spread over the block's tensors in proportion to their sizes; smaller blocks padded), over the *whole*
trajectory, not only a last window. Every ``act_every``-th snapshot, and at the final one, each block's output on the
fixed probe batch is recorded too; :mod:`.labels` turns those into CKA labels.

On-disk format (``RUN_FORMAT_VERSION`` 1), one folder per run, ``<out>/<recipe>_s<seed>_lr<lr>/``:

``meta.json``
    ``format`` ("layerfreeze-smartfrz-run"), ``format_version``, ``status`` ("complete" or "diverged"), ``run``,
    ``recipe``, ``arch``, ``dataset``, ``mode`` ("scratch" or "finetune"), ``seed``, ``lr``, ``lr_factor`` and
    ``lr_base`` (``lr = lr_base * lr_factor``: ``collect --lr-factors``; runs recorded before issue 29 have
    neither), ``optimizer`` (name, weight
    decay, momentum, grad clip), ``schedule`` ("cosine", "linear" or "constant", after a linear warm-up of ``warmup``, a
    fraction of the run: 5% in every recipe), ``batch_size``, ``steps`` (optimizer steps), ``snapshot_every``,
    ``act_every``, ``blocks`` (names, front to back), ``block_params`` (parameter counts), ``head`` (index of the head
    block or null), ``sample_size``, ``sample_seed``, ``probe_size``, ``act_features`` (features kept per probe sample),
    ``act_dims_full`` (a block's flattened output size per probe sample before subsampling), ``losses`` (mean training
    loss between consecutive snapshots), ``test_accuracy`` (final, on a fixed test subset: the fraction of its labels
    predicted right, one label per sample for a classifier, one per token for a language model), ``quick`` (shrunk for
    tests), ``wall_seconds``, ``versions`` (python, torch, layerfreeze, ...), ``sha256`` (each tensor file's digest,
    checked whenever it is read: a damaged byte that still parses is refused, not trained on; runs recorded before
    it have none).
    A diverged run (NaN/Inf loss or weights) has ``status: "diverged"`` and ``diverged_at_step`` and no tensor
    files; it is never labelled or trained on, and is not retried (it would diverge the same way).
``weights.safetensors``
    ``samples`` ``(N_snap, L, S)`` float32: snapshot ``k`` (taken after step ``steps[k]``) of the ``S`` sampled
    weights of each of the ``L`` blocks (padding is 0); ``mask`` ``(L, S)`` uint8, 1 for a real weight, 0 for
    padding; ``steps`` ``(N_snap,)`` int64 = ``0, snapshot_every, 2 * snapshot_every, ..., steps``.
``activations.safetensors``
    ``act.<i>`` ``(N_act, P, D_i)`` float16: block ``i``'s output on the ``P`` probe samples (model in eval mode,
    no grad; :func:`~layerfreeze.models.probe.probe_outputs`: the first tensor of a tuple output), flattened per sample
    and subsampled to ``D_i <= act_features`` features at fixed positions ``pos.<i>`` ``(D_i,)`` int64 (seeded per
    block; all features when the output is small enough), clamped to the float16 range; ``act_steps`` ``(N_act,)``
    int64, the steps of snapshots ``0, act_every, 2 * act_every, ...`` and always the final one.

Files are written through temporary names and renamed; ``meta.json`` is written last, so a folder without it is an
unfinished run and is redone, and a finished one is skipped (collection resumes where it stopped), unless a tensor
file of it cannot be read (its header, checked without reading the tensors): then it is recorded again. A finished
run recorded with another ``quick`` or learning rate than the collection asks for is refused, not skipped.

Your own runs: build a :class:`~layerfreeze.smartfrz.setup.Setup` for your model and data and call :func:`record_run`,
or register a recipe with :func:`~layerfreeze.smartfrz.recipes.registry.register_recipe`; then ``layerfreeze predictor
label`` / ``train`` work on the folder as on ours.
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerfreeze._version import __version__
from layerfreeze.models.blocks import Block
from layerfreeze.models.discovery import discover_blocks
from layerfreeze.models.probe import block_modules, eval_mode, probe_outputs
from layerfreeze.runs.rundir import check_writable
from layerfreeze.smartfrz.recipes import get_recipes
from layerfreeze.smartfrz.runs import (
    ACTIVATIONS_FILE,
    COUNTERFACTUAL_FILE,
    LABELS_FILE,
    META_FILE,
    RUN_FORMAT,
    RUN_FORMAT_VERSION,
    WEIGHTS_FILE,
    PipelineError,
    file_sha256,
    is_finished,
    read_meta,
    unreadable_tensors,
    write_json_atomic,
)
from layerfreeze.smartfrz.setup import Setup, make_optimizer
from layerfreeze.strategies.smartfrz.recorder import WeightRecorder
from layerfreeze.train.loop import lr_lambda, train_steps, warmup_steps

SAMPLE_SIZE = 1024
SAMPLE_SEED = 0          # the online strategy's default seed: runs sample the positions it would sample
ACT_FEATURES = 1024
_F16_MAX = 65504.0


# --------------------------------------------------------------------------------------------------------------
# Setups
# --------------------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------------------
# Recording one run
# --------------------------------------------------------------------------------------------------------------


class _ActivationProbe:
    """Each block's output on the probe batch (:func:`~layerfreeze.models.probe.probe_outputs`), kept as a float16
    subsample of ``max_features`` features per sample at fixed, seeded positions."""

    def __init__(self, blocks: list[Block], max_features: int) -> None:
        self.max_features = max_features
        self.modules = block_modules(blocks)
        self.positions: list[torch.Tensor | None] = [None] * len(blocks)
        self.full_dims: list[int | None] = [None] * len(blocks)
        self.rows: list[list[torch.Tensor]] = [[] for _ in blocks]

    def record(self, model: nn.Module, forward: Callable[..., torch.Tensor], probe: dict[str, torch.Tensor]) -> None:
        outputs = probe_outputs(model, self.modules, lambda m: forward(m, probe))
        for i in range(len(self.rows)):
            if i not in outputs:
                raise RuntimeError(f"block {i} produced no output on the probe batch (is it used in forward?)")
            out = outputs[i].float().reshape(outputs[i].shape[0], -1)
            if self.positions[i] is None:
                d = out.shape[1]
                self.full_dims[i] = d
                if d > self.max_features:
                    g = torch.Generator().manual_seed(10_007 * (i + 1))
                    self.positions[i] = torch.randperm(d, generator=g)[: self.max_features].sort().values
                else:
                    self.positions[i] = torch.arange(d)
            self.rows[i].append(out[:, self.positions[i]].clamp(-_F16_MAX, _F16_MAX).to(torch.float16))


def _versions() -> dict[str, str]:
    import sys

    out = {"python": platform.python_version(), "torch": torch.__version__, "layerfreeze": __version__}
    for name in ("torchvision", "transformers", "sklearn"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = getattr(mod, "__version__", "?")
    return out


def batch_order(n_train: int, batch_size: int, steps: int, seed: int) -> Iterator[torch.Tensor]:
    """A run's ``steps`` batches of sample indices ``(batch_size,)``: a permutation per epoch drawn from ``seed``
    (its own generator, not the global RNG), cut into full batches (the rest of an epoch dropped)."""
    gen = torch.Generator().manual_seed(seed)
    per_epoch = n_train // batch_size
    order = torch.randperm(n_train, generator=gen)
    for step in range(1, steps + 1):
        pos = (step - 1) % per_epoch
        if pos == 0 and step > 1:
            order = torch.randperm(n_train, generator=gen)
        yield order[pos * batch_size:(pos + 1) * batch_size]


def evaluate_test(setup: Setup, model: nn.Module) -> tuple[float, float] | None:
    """``(accuracy, mean loss)`` of ``model`` on the recipe's fixed test subset, in eval mode without gradients
    (None without a test subset). Leaves every module's train/eval mode as it found it.

    Per label, not per sample: the accuracy is the number of labels whose ``argmax`` prediction is right over
    ``test_y.numel()``, and the loss the mean over labels (each batch's ``loss_fn`` mean weighted by its
    ``labels.numel()``). For a classifier (``test_y`` ``(N,)``) that is per sample, as before; for a causal LM
    (``(N, T)``) it is next-token top-1 accuracy and the mean token loss, every token of every chunk counted once.
    Samples go through ``forward`` 128 at a time (a batch's logits, ``(128, T, V)`` for an LM, must fit in memory).
    Every label counts: ``test_y`` has no ignored positions (the LM recipes cut whole chunks, no padding).
    """
    if setup.test_x is None or setup.test_y is None or len(setup.test_y) == 0:
        return None
    correct, loss_sum = 0, 0.0
    with eval_mode(model), torch.no_grad():
        for s in range(0, len(setup.test_y), 128):
            batch = {k: v[s:s + 128] for k, v in setup.test_x.items()}
            logits = setup.forward(model, batch)
            labels = setup.test_y[s:s + 128]
            correct += int((logits.argmax(-1) == labels).sum())
            loss_sum += float(setup.loss_fn(logits, labels)) * labels.numel()
    total = setup.test_y.numel()
    return correct / total, loss_sum / total


def _accuracy(setup: Setup, model: nn.Module) -> float | None:
    result = evaluate_test(setup, model)
    return None if result is None else result[0]


def run_name(recipe_name: str, seed: int, lr: float) -> str:
    return f"{recipe_name}_s{seed}_lr{lr:g}"


def check_lr_factors(factors: Sequence[float] | None) -> None:
    """Raises PipelineError unless every learning-rate factor is a finite number > 0 (None: no factors, fine)."""
    if factors is None:
        return
    bad = [f for f in factors if not (isinstance(f, (int, float)) and math.isfinite(f) and f > 0)]
    if bad or not factors:
        raise PipelineError(f"learning-rate factors (--lr-factors) must be finite numbers > 0, got "
                            f"{list(factors) if not bad else bad} (e.g. --lr-factors 0.3,1)")


def scaled_lrs(rates: Sequence[float], factors: Sequence[float] | None = None,
               recipe_name: str = "run") -> list[tuple[float, float, float]]:
    """The learning rates a recipe is collected at: each rate times each factor, deduplicated.

    Args:
        rates: The recipe's rates (its registered ``lrs``, or ``--lrs``).
        factors: Multipliers (None: ``(1,)``, the rates themselves). ``--lr-factors 0.3,1`` on a recipe registered
            at ``(0.02, 0.08)`` gives 0.006, 0.02, 0.024, 0.08 (issue 29: a corpus with "small movement because small
            learning rate" in it).
        recipe_name: For the run-name collision message.

    Returns:
        ``[(lr, factor, base rate)]`` sorted by ``lr``. Each product is rounded to 12 significant digits (so
        ``0.1 * 0.3`` is 0.03, the rate ``--lrs 0.03`` names); a rate reached twice keeps the factor nearest 1 (the
        registered rate itself when it is one).

    Raises:
        PipelineError: a factor that is not a finite number > 0, or two different rates with the same run name
            (:func:`run_name` prints 6 significant digits).
    """
    check_lr_factors(factors)
    best: dict[float, tuple[float, float, float]] = {}
    for base in rates:
        for f in (factors or (1.0,)):
            lr = float(f"{base * f:.12g}")
            cand = (lr, float(f), float(base))
            old = best.get(lr)
            if old is None or abs(math.log(cand[1])) < abs(math.log(old[1])):
                best[lr] = cand
    out = sorted(best.values())
    names: dict[str, float] = {}
    for lr, _, _ in out:
        name = run_name(recipe_name, 0, lr)
        if name in names:
            raise PipelineError(f"{recipe_name}: learning rates {names[name]!r} and {lr!r} would share the run name "
                                f"{name!r}; pick factors that give rates differing in the first 6 digits")
        names[name] = lr
    return out


def record_run(setup: Setup, out_dir: str | Path, *, lr: float, seed: int, info: dict[str, Any] | None = None,
               sample_size: int = SAMPLE_SIZE, act_features: int = ACT_FEATURES,
               progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Train ``setup`` to the end with a plain loop and write the run folder ``out_dir`` (format in the module
    docstring). The data order is drawn from ``seed``; the model is already initialised by the caller.

    Args:
        info: Extra meta keys: ``recipe`` (default: the folder name; the train/held-out split is by recipe),
            ``arch``, ``dataset``, ``mode``...
        progress: Called as ``progress(step, steps)`` after each snapshot.

    Returns:
        The written ``meta.json`` content (``status`` "complete" or "diverged").
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (META_FILE, WEIGHTS_FILE, ACTIVATIONS_FILE):
        (out_dir / name).unlink(missing_ok=True)
    t0 = time.perf_counter()
    model = setup.model
    blocks = discover_blocks(model, setup.blocks)
    every, steps = int(setup.snapshot_every), int(setup.steps)
    n_snap = steps // every + 1
    recorder = WeightRecorder(blocks, sample_size, window=max(3, n_snap), seed=SAMPLE_SEED)
    probe = _ActivationProbe(blocks, act_features)
    opt = make_optimizer(setup, model, lr)
    # the collector's warm-up rounding ("round"), not the trainer's: the shipped predictor's runs were recorded so
    warmup = warmup_steps(steps, setup.warmup, rounding="round")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps, warmup, setup.schedule))
    n_train = len(setup.train_y)
    if n_train < setup.batch_size:
        raise PipelineError(f"{n_train} training samples, fewer than one batch of {setup.batch_size}")
    act_steps: list[int] = []
    losses: list[float] = []
    meta: dict[str, Any] = {
        "format": RUN_FORMAT, "format_version": RUN_FORMAT_VERSION, "status": "running", "run": out_dir.name,
        "recipe": out_dir.name, "arch": None, "dataset": None, "mode": None, **(info or {}), "seed": seed, "lr": lr,
        "optimizer": {"name": setup.optimizer, "weight_decay": setup.weight_decay,
                      "momentum": setup.momentum if setup.optimizer == "sgd" else None, "grad_clip": setup.grad_clip},
        "schedule": setup.schedule, "warmup": setup.warmup, "batch_size": setup.batch_size, "steps": steps,
        "snapshot_every": every, "act_every": setup.act_every, "blocks": [b.name for b in blocks],
        "block_params": [b.num_parameters() for b in blocks],
        "head": next((b.index for b in blocks if b.is_head), None), "sample_size": sample_size,
        "sample_seed": SAMPLE_SEED, "probe_size": int(len(next(iter(setup.probe_x.values())))),
        "act_features": act_features, "train_size": n_train,
    }

    def snapshot(k: int, step: int) -> None:
        recorder.snapshot([True] * len(blocks))
        if k % setup.act_every == 0 or k == n_snap - 1:
            probe.record(model, setup.forward, setup.probe_x)
            act_steps.append(step)

    def loss_of(idx: torch.Tensor) -> torch.Tensor:
        return setup.loss_fn(setup.forward(model, {k: v[idx] for k, v in setup.train_x.items()}), setup.train_y[idx])

    running = [0.0, 0]  # loss sum and count since the last snapshot

    def after_step(step: int, loss: torch.Tensor) -> bool:
        """Snapshot every ``every`` steps; True (stop: diverged) when a weight is no longer finite."""
        running[0] += loss.item()
        running[1] += 1
        if step % every:
            return False
        losses.append(running[0] / running[1])
        running[:] = [0.0, 0]
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            return True
        snapshot(step // every, step)
        if progress is not None:
            progress(step, steps)
        return False

    model.train()
    snapshot(0, 0)
    stopped = train_steps(model, opt, batch_order(n_train, setup.batch_size, steps, seed), loss_of, scheduler=sched,
                          grad_clip=setup.grad_clip, on_step=after_step)
    if stopped is not None:
        return _diverged(out_dir, meta, stopped, t0)

    samples = recorder.buffers[:, :n_snap].transpose(0, 1).contiguous()       # (N_snap, L, S)
    mask = torch.stack([recorder.mask_of(i) for i in range(len(blocks))]).to(torch.uint8)
    snap_steps = torch.arange(n_snap, dtype=torch.int64) * every
    tmp_w = out_dir / (WEIGHTS_FILE + ".tmp")
    save_file({"samples": samples, "mask": mask, "steps": snap_steps}, str(tmp_w))
    tmp_w.replace(out_dir / WEIGHTS_FILE)
    acts = {f"act.{i}": torch.stack(rows).contiguous() for i, rows in enumerate(probe.rows)}
    acts.update({f"pos.{i}": p.to(torch.int64).contiguous() for i, p in enumerate(probe.positions)})
    acts["act_steps"] = torch.tensor(act_steps, dtype=torch.int64)
    tmp_a = out_dir / (ACTIVATIONS_FILE + ".tmp")
    save_file(acts, str(tmp_a))
    tmp_a.replace(out_dir / ACTIVATIONS_FILE)
    meta.update(status="complete", act_dims_full=probe.full_dims, losses=losses,
                test_accuracy=_accuracy(setup, model), wall_seconds=round(time.perf_counter() - t0, 2),
                versions=_versions(), sha256={n: file_sha256(out_dir / n) for n in (WEIGHTS_FILE, ACTIVATIONS_FILE)})
    write_json_atomic(out_dir / META_FILE, meta)
    return meta


def _diverged(out_dir: Path, meta: dict[str, Any], step: int, t0: float) -> dict[str, Any]:
    meta.update(status="diverged", diverged_at_step=step, wall_seconds=round(time.perf_counter() - t0, 2),
                versions=_versions())
    write_json_atomic(out_dir / META_FILE, meta)
    return meta


def check_reusable(run_dir: Path, quick: bool, lr: float) -> None:
    """Refuse a finished run in ``run_dir`` recorded with another ``quick`` or learning rate than ``quick`` and
    ``lr`` (a quick and a full-size run share a name, as do rates equal to 6 digits): :func:`collect` would skip it
    and mix it in silence with the runs it records. Unfinished runs and runs whose meta lacks the setting pass.

    Raises:
        PipelineError: the run was recorded with other settings (the message says what to do), or its
            ``meta.json`` is corrupt.
    """
    if not is_finished(run_dir):
        return
    meta = read_meta(run_dir)
    if meta.get("quick") is not None and bool(meta["quick"]) != quick:
        how = ("with --quick: add --quick to resume that collection" if meta["quick"] else
               "at full size: drop --quick to resume that collection")
        raise PipelineError(f"{run_dir} was collected {how}, or collect into another --out (quick and full-size runs "
                            "share their names)")
    if meta.get("lr") is not None and not math.isclose(float(meta["lr"]), lr, rel_tol=1e-9):
        raise PipelineError(f"{run_dir} was recorded at learning rate {float(meta['lr']):.12g}, not {lr:.12g} (the run "
                            "name keeps 6 digits): collect into another --out, or delete that run folder to record "
                            f"it at {lr:.12g}")


def collect(out: str | Path, recipes: list[str] | None = None, seeds: list[int] = (0, 1),
            lrs: list[float] | None = None, quick: bool = False,
            on_run: Callable[[str, str, dict[str, Any] | None], None] | None = None,
            lr_factors: Sequence[float] | None = None) -> list[dict[str, Any]]:
    """Record every (recipe, seed, learning rate) run into ``out``, skipping finished ones.

    Args:
        out: The runs folder.
        recipes: Recipe names (None: all).
        seeds: Seeds (model init and data order).
        lrs: Learning rates overriding each recipe's own pair (None: the recipe's).
        quick: Shrink every recipe to a few seconds (tests, CI).
        on_run: Called as ``on_run(run_name, "skipped" | "complete" | "diverged", meta)``; also as
            ``on_run(run_name, "redo", {"why": ...})`` before a finished run whose tensor file cannot be read
            (:func:`~layerfreeze.smartfrz.runs.unreadable_tensors`) is recorded again (its ``labels.json`` removed).
        lr_factors: Collect each rate (``lrs`` or the recipe's) times each factor (:func:`scaled_lrs`); each run's
            ``meta.json`` records ``lr``, ``lr_factor`` and ``lr_base`` (the rate it scaled). None: the rates as
            they are (``lr_factor`` 1).

    Returns:
        The meta of every run (recorded now or earlier), in order.

    Raises:
        PipelineError: ``out`` is one recorded run's folder, an unknown recipe, a bad factor (:func:`scaled_lrs`)
            or a finished run recorded with other settings (:func:`check_reusable`), before any run is recorded.
        ConfigError: ``out`` cannot be written (:func:`~layerfreeze.runs.rundir.check_writable`).
    """
    out = Path(out)
    if (out / META_FILE).is_file():  # runs recorded inside a run: every later command refused the folder
        raise PipelineError(f"--out {out} is one recorded run; give the folder that holds the runs, {out.parent}")
    chosen = get_recipes(list(recipes) if recipes else None)
    plan = {r.name: scaled_lrs(lrs or r.lrs, lr_factors, r.name) for r in chosen}  # every error before a run
    for r in chosen:
        for seed in seeds:
            for lr, _, _ in plan[r.name]:
                check_reusable(out / run_name(r.name, seed, lr), quick, lr)
    check_writable(out, "the runs folder (--out)", folder=True)
    out.mkdir(parents=True, exist_ok=True)
    metas = []
    for r in chosen:
        for seed in seeds:
            for lr, factor, base in plan[r.name]:
                name = run_name(r.name, seed, lr)
                run_dir = out / name
                if is_finished(run_dir):
                    meta = read_meta(run_dir)
                    why = unreadable_tensors(run_dir) if meta.get("status") == "complete" else None
                    if why is None:
                        metas.append(meta)
                        if on_run:
                            on_run(name, "skipped", meta)
                        continue
                    if on_run:
                        on_run(name, "redo", {"why": why})
                for derived in (LABELS_FILE, COUNTERFACTUAL_FILE):  # of an earlier, damaged or unfinished recording
                    (run_dir / derived).unlink(missing_ok=True)
                setup = r.build(seed, quick, out)
                info = {"recipe": r.name, "arch": r.arch, "dataset": r.dataset, "mode": r.mode, "quick": quick,
                        "lr_factor": factor, "lr_base": base}
                meta = record_run(setup, run_dir, lr=lr, seed=seed, info=info)
                metas.append(meta)
                if on_run:
                    on_run(name, meta["status"], meta)
    return metas
