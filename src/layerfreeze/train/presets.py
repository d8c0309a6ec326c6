"""What a task changes from the config's defaults unless the user sets it (:data:`TASK_PRESETS`), and the parameters
a strategy gets on a task's model (:data:`STRATEGY_PRESETS`, :func:`strategy_preset`); filled in by
:func:`~layerfreeze.train.config.build_config` before it validates."""

from __future__ import annotations

from typing import Any

#: What each task changes from the config's defaults (:mod:`layerfreeze.train.config`), unless the user sets it.
TASK_PRESETS: dict[str, dict[str, Any]] = {
    "fashion-mnist": {
        "model": {"name_or_path": "mobilenet_v2"},
        "train": {"lr": 1e-3, "epochs": 2, "batch_size": 128, "eval_batch_size": 256, "weight_decay": 1e-4},
    },
    "image-folder": {
        "model": {"name_or_path": "mobilenet_v2"},
        "train": {"lr": 1e-3, "batch_size": 64, "eval_batch_size": 128, "weight_decay": 1e-4},
    },
}

#: Per task, the parameters a strategy gets unless the user sets them: the ``k`` a practitioner would pick for
#: ``static`` on the task's model (MiniLM-L6: embeddings + the first 4 of 6 encoder layers; MobileNetV2 at 32x32:
#: stem + the first 9 inverted-residual stages); ``badam``'s steps per block on the default job, where BAdam's
#: default (50, sized for runs of thousands of steps) would train 4 of its 7 middle blocks once in 168 steps: 12
#: gives every block two turns (168 / (2 x 7)).
STRATEGY_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "bbc-news": {"static": {"k": 5}, "badam": {"k": 12}},
    "text-csv": {"static": {"k": 5}},
    "fashion-mnist": {"static": {"k": 10}},
    "image-folder": {"static": {"k": 10}},
}

#: The model each task's :data:`STRATEGY_PRESETS` were sized for (``model.name_or_path``; None: the installed
#: MiniLM-L6, the text tasks' default). With another model (``--model resnet18``: 6 blocks, where ``static``'s k=10
#: would freeze the head) the strategy's own defaults apply; set them with ``-p`` (``compare``: ``-p static.k=3``).
PRESET_MODELS: dict[str, tuple[str | None, ...]] = {
    "bbc-news": (None,), "text-csv": (None,), "fashion-mnist": ("mobilenet_v2",), "image-folder": ("mobilenet_v2",),
}


def strategy_preset(task: Any, strategy: Any, model: Any) -> dict[str, Any] | None:
    """The parameters :data:`STRATEGY_PRESETS` gives ``strategy`` on ``task`` with ``model``
    (``model.name_or_path``), or None: a preset sized for the task's default model (:data:`PRESET_MODELS`) does not
    apply to another model, which gets the strategy's own defaults."""
    if not (isinstance(task, str) and isinstance(strategy, str)):
        return None
    params = STRATEGY_PRESETS.get(task, {}).get(strategy)
    if params and model not in PRESET_MODELS.get(task, (None,)):
        return None
    return params
