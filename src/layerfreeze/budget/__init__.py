"""Memory budgets: what to freeze to fit in N bytes, measured before training and kept while it runs.

* :mod:`~layerfreeze.budget.parse` -- a budget as written (``"3GiB"``, ``"800MiB"``, ``"0.6"`` of the tensor peak
  with nothing frozen): :func:`parse_budget`, :class:`Budget`;
* :mod:`~layerfreeze.budget.measure` -- each block's bytes in every bucket from a few real steps
  (:func:`measure_blocks`), and what the activation cache would hold (:func:`measure_cache`);
* :mod:`~layerfreeze.budget.plan` -- each frozen prefix's predicted tensor peak and the shortest that fits
  (:func:`plan_memory`, :func:`plan_prefix`, :class:`MemoryPlan`).

The engine keeps a plan: ``Freezer(..., floor=plan.floor)`` freezes the prefix before the first step and refuses
to thaw it (:class:`~layerfreeze.engine.Freezer`). ``layerfreeze plan --memory 3GiB`` and ``layerfreeze train
--memory-budget 3GiB`` are the CLI's way in; the Lightning and Hugging Face callbacks take ``memory_budget=``.
"""

from layerfreeze.budget.measure import BlockBytes, CacheBytes, default_loss, measure_blocks, measure_cache
from layerfreeze.budget.parse import Budget, parse_budget
from layerfreeze.budget.plan import MemoryPlan, PrefixCost, plan_memory, plan_prefix
from layerfreeze.errors import BudgetError

__all__ = [
    "BlockBytes",
    "Budget",
    "BudgetError",
    "CacheBytes",
    "MemoryPlan",
    "PrefixCost",
    "default_loss",
    "measure_blocks",
    "measure_cache",
    "parse_budget",
    "plan_memory",
    "plan_prefix",
]
