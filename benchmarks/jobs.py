"""The benchmark jobs: one vocabulary of names that every benchmark script's ``--tasks`` / ``--task`` takes.

* ``default-job``: ``make demo``, ``layerfreeze train`` with no arguments (MiniLM-L6 fine-tuned on BBC News with the
  CLI's defaults: 3 epochs, 128 tokens, batch 32);
* ``bbc``: the suite's MiniLM-L6 / BBC News (``benchmarks/suite_tasks.py`` ``TASKS``: its sizes, 104 steps);
* ``fmnist-mobilenet``: MobileNetV2 (ImageNet weights) fine-tuned on Fashion-MNIST;
* ``fmnist-resnet``: ResNet-18 trained from scratch on Fashion-MNIST.

The suite's three (``bbc``, ``fmnist-mobilenet``, ``fmnist-resnet``) come with the suite's sizes and settings; a
script that measures a step rather than a run (``ledger_overhead``, ``smartfrz_overhead``, ``prefix_cache``,
``static_vs_full``) takes the same names for the same model and data (:data:`CLI_CONFIG`) at sizes of its own. The
names the scripts used before (``fmnist``, ``bbc-news``, ``fashion-mnist``) are refused with the name to use
(:data:`RENAMED`): the CLI's ``--task`` names a dataset, a job names a model, its data and how it is trained.
"""

from __future__ import annotations

import difflib
from typing import Any

from layerfreeze.errors import ConfigError

#: Every job, with what it is.
JOBS: dict[str, str] = {
    "default-job": "make demo: MiniLM-L6 fine-tuned on BBC News with the CLI's defaults (3 epochs, 128 tokens, "
                   "batch 32)",
    "bbc": "the suite's MiniLM-L6 / BBC News",
    "fmnist-mobilenet": "MobileNetV2 (ImageNet weights) fine-tuned on Fashion-MNIST",
    "fmnist-resnet": "ResNet-18 trained from scratch on Fashion-MNIST",
}

#: The CLI config (:func:`layerfreeze.train.config.build_config`'s input) naming each job's model and data; the
#: suite's own settings (learning rates, sizes) are in ``benchmarks/suite.py``.
CLI_CONFIG: dict[str, dict[str, Any]] = {
    "default-job": {"task": "bbc-news"},
    "bbc": {"task": "bbc-news"},
    "fmnist-mobilenet": {"task": "fashion-mnist", "model": {"name_or_path": "mobilenet_v2"}},
    "fmnist-resnet": {"task": "fashion-mnist", "model": {"name_or_path": "resnet18", "pretrained": False}},
}

#: Names the scripts used before, and the job each meant.
RENAMED = {"fmnist": "fmnist-mobilenet", "fashion-mnist": "fmnist-mobilenet", "bbc-news": "default-job",
           "fmnist-resnet18": "fmnist-resnet", "resnet18": "fmnist-resnet", "mobilenet": "fmnist-mobilenet"}


def parse_jobs(text: str, allowed: tuple[str, ...] | list[str] | None = None, flag: str = "--tasks") -> list[str]:
    """The jobs a comma-separated ``text`` names, each checked against ``allowed`` (default: every job).

    Raises:
        ConfigError: a name that is not a job this script runs, with the name to use (:data:`RENAMED`, or the
            closest job) and the jobs it runs (``benchmarks.cli.entry``: one line, exit 2).
    """
    allowed = list(allowed or JOBS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ConfigError(f"{flag} is empty; name jobs from: {', '.join(allowed)}")
    for name in names:
        if name not in allowed:
            guess = RENAMED.get(name) or next(iter(difflib.get_close_matches(name, allowed, n=1, cutoff=0.5)), None)
            hint = f" (did you mean {guess}? the benchmarks name their jobs {', '.join(JOBS)})" if guess else ""
            raise ConfigError(f"{flag}: unknown job {name!r}{hint}; this script runs: "
                             + "; ".join(f"{j} ({JOBS[j]})" for j in allowed))
    return names
