"""``egeria``: freeze the front block once its *plasticity* against a quantized reference model stops changing.

Source: Yiding Wang, Decang Sun, Kai Chen, Fan Lai, Mosharaf Chowdhury, "Egeria: Efficient DNN Training with
Knowledge-Guided Layer Freezing", EuroSys 2023, arXiv 2201.06227 (sec. 3: training plasticity measured with the
semantic knowledge of a reference model; sec. 4: the reference model made on the fly by quantization and run
asynchronously on CPUs, freezing of the converged front layers). The SP loss is the similarity-preserving loss of
Tung & Mori, "Similarity-Preserving Knowledge Distillation", ICCV 2019 (eq. 1-4).

What is taken from the paper, and what is ours
----------------------------------------------
From the paper (checked against its abstract): plasticity quantifies a layer's training progress through
"semantic knowledge from a reference model"; the reference model is "generated on the fly using quantization
techniques and runs forward operations asynchronously on available CPUs"; converged *front* layers are frozen.
The body of the paper was not available to check, so the following are documented choices, not the paper's
numbers: the evaluation interval (50 steps), the reference refresh (every 10 evaluations), the tolerance (0.1,
relative change), the patience (3 evaluations) and the probe size (32 samples). Tune them per task.

How it works
------------
* **Reference model** (:mod:`~layerfreeze.strategies.egeria.reference`, which describes the int8 schemes). At
  :meth:`Egeria.attach` the model is copied to the CPU in fp32 (the *shadow*, see below) and a reference is built
  from it: a deep copy in eval mode, no grad, int8 (``nn.Linear`` by PyTorch's dynamic quantization, every other
  weight weight-only int8; weight-only everywhere when the build cannot, or with
  ``reference_quantization="weight_only"``). :attr:`Egeria.reference_report` says which scheme each tensor got
  and why, and the signals ``reference_dynamic_int8_modules`` / ``reference_weight_only_int8_tensors`` count
  them. The reference is rebuilt from the current training weights every ``refresh_every`` evaluations.
* **Probe batch.** A fixed batch captured once, from the first forward of the model in training mode (a forward
  pre-hook with kwargs, removed after the capture): detached CPU copies of the positional and keyword inputs,
  every tensor with at least one dimension cut to its first ``probe_size`` rows (dim 0 is taken to be the batch).
* **Plasticity** of each active (not frozen, not head) block = :func:`sp_loss` between the block's output on the
  probe batch in the training weights and in the reference. A block's output is the output of its last module,
  captured by the probe the oracle and the SmartFRZ collector use too (:func:`~layerfreeze.models.probe.probe_outputs`:
  the main tensor of a tuple, a list or a Hugging Face ``ModelOutput``, else its first tensor).
* **Off the critical path.** At an evaluation stage (every ``interval`` optimizer steps) the training thread only
  copies the current weights into the shadow (``copy_`` of every parameter and buffer: one device-to-host
  transfer of the model's size, e.g. ~90 MB for MiniLM-L6, and a synchronisation point on a GPU) and submits the
  evaluation to a single background worker thread (``ThreadPoolExecutor(max_workers=1)``). The worker runs the
  shadow and the reference forwards under ``torch.no_grad()`` in eval mode on the CPU, with forward hooks that
  capture each block's output, and computes the plasticity. The next stage picks the result up, so **decisions
  lag one evaluation** (``interval`` steps): plasticity measured on the weights of step ``t`` can freeze a block
  at step ``t + interval``. If the previous evaluation is still running at a stage, that stage submits nothing
  (it never waits; ``evaluations_skipped`` counts these). ``synchronous=True`` runs the evaluation inline and
  applies it at the same stage (no lag; deterministic, used by tests). An exception raised in the worker is
  re-raised, with its original traceback and a note, by the next stage's :meth:`Egeria.decide`.
  :meth:`Egeria.detach` (``Freezer.close()``) waits for a running evaluation, stops the worker and removes hooks.
* **Freezing rule.** Per block, the relative change ``|p_t - p_prev| / max(|p_prev|, eps)`` between consecutive
  plasticity values measured against the same reference; a block is *stable* once this change has been below
  ``tolerance`` for ``patience`` consecutive evaluations (:func:`plasticity_decision`). Only the front active
  block (the first block after the frozen prefix; never the head) may freeze, so at most one block freezes per
  evaluation, and frozen blocks always form a prefix. Every active block keeps its own count, so the next block
  can freeze at the very next evaluation if it is already stable.
* **Refresh and comparability.** A value measured against a new reference is not comparable with one measured
  against the old one (right after a refresh the plasticity falls to the quantization noise floor). So an
  evaluation that refreshes the reference also measures each active block against the *new* reference (one
  more reference forward, in the worker) and the next evaluation's change is taken against that baseline. The
  first evaluation of a run has nothing to compare with and leaves the counts unchanged.

Measured behaviour (CPU, a 4-block MLP on Gaussian blobs, interval 25, the defaults otherwise): without
BatchNorm the three hidden blocks froze at steps 150, 175 and 200, before the first refresh. With a BatchNorm
block, after the first refresh the plasticity of the converged blocks sat at the int8 noise floor (~1e-4), where
the BatchNorm running-statistics noise alone moved it by 40-200% between evaluations, so with ``tolerance=0.1``
nothing froze after that refresh. A larger ``refresh_every`` or ``tolerance`` is the knob there.

Costs: a fp32 CPU copy of the model (shadow) and an int8 reference beside it; per evaluation one weight copy on
the training thread and, in the worker, one fp32 and one int8 forward of ``probe_size`` samples (two int8
forwards at a refresh). Hooks registered on the model are not copied into the shadow or the reference (a model
that needs a forward hook to compute correctly, such as legacy ``torch.nn.utils.weight_norm``, is not supported;
use ``torch.nn.utils.parametrizations.weight_norm``).

Resume: :meth:`Egeria.state_dict` holds the counters, histories, the values each block is compared with, the
probe batch, the int8 reference itself (its state dict, CPU tensors) and the evaluation in flight (waited for: this
run picks it up at its next stage as the resumed one does). :meth:`Egeria.load_state_dict` loads the reference into
one built from the resumed weights, so an inline (``synchronous``) run resumed anywhere decides as the uninterrupted
one, stage for stage. In the background a stage that finds the worker busy skips its evaluation, at the machine's
pace, so two runs of the same seed may differ already; a resumed one starts where the checkpoint caught it. A state
saved before the reference was kept in it (no ``reference`` key) gets a reference from the resumed weights, which
counts as a refresh.
"""

from layerfreeze.strategies.egeria.plasticity import (
    EPS,
    advance_count,
    plasticity_decision,
    relative_change,
    sp_loss,
)
from layerfreeze.strategies.egeria.reference import QUANTIZATIONS, build_reference, cpu_copy
from layerfreeze.strategies.egeria.strategy import STATE_VERSION, THREAD_PREFIX, Egeria

__all__ = [
    "EPS",
    "QUANTIZATIONS",
    "STATE_VERSION",
    "THREAD_PREFIX",
    "Egeria",
    "advance_count",
    "build_reference",
    "cpu_copy",
    "plasticity_decision",
    "relative_change",
    "sp_loss",
]
