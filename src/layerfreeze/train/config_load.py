"""A config from a file and the command line's overrides (:func:`load_config`): the file read, each override merged
over it (later ones win), and the result validated (:func:`~layerfreeze.train.config.build_config`), the file's own
values included where an override replaced them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from layerfreeze.errors import ConfigError
from layerfreeze.strategies import DEFAULT_STRATEGY
from layerfreeze.train.config import Config, build_config, validate_config
from layerfreeze.train.config_file import deep_merge, leaf_values, read_config_file
from layerfreeze.train.config_words import format_validation_error


def load_config(path: str | Path | None = None, overrides: list[dict[str, Any]] | None = None,
                inputs: bool = True) -> Config:
    """A validated :class:`Config` from an optional file (:func:`read_config_file`) plus overrides (later ones
    win); ``inputs`` as in :func:`build_config`.

    Raises:
        ConfigError: the file cannot be read, or the config is invalid (every problem, each naming its key), the
            file's own values included where an override replaces them (:func:`_check_replaced`).
    """
    data = file = read_config_file(path) if path else {}
    for override in overrides or []:
        data = deep_merge(_params_of_another_strategy_dropped(data, override), override)
    config = build_config(data, inputs=inputs)
    if path:
        _check_replaced(path, file, data, inputs)
    return config


def _check_replaced(path: str | Path, file: dict[str, Any], merged: dict[str, Any], inputs: bool) -> None:
    """Refuse a config file whose own value is invalid where the command line replaces it: ``train: 5`` with
    ``--max-steps 2``, or ``train.batch_size: 32.5`` with ``--batch-size 16``, ran with the bad value dropped in
    silence (a file is read whole: a run must not hide a broken one). The merged config is validated again with the
    file's values put back where an override replaced them, and the problems found at exactly those keys are
    reported. ``freeze.params`` is left out (parameters belong to the strategy they were written for: an override
    naming another strategy drops the file's).

    Raises:
        ConfigError: naming the file, each key and why.
    """
    now = leaf_values(merged, opaque=("params",))
    replaced = {}
    for key, value in leaf_values(file, opaque=("params",)).items():
        if key[:2] == ("freeze", "params"):
            continue
        if key in now and now[key] != value:
            replaced[key] = value  # a value the command line changed
        elif key not in now and any(k[: len(key)] == key for k in now):
            replaced[key] = value  # a section the file gave a value to
    if not replaced:
        return
    probe = copy.deepcopy(merged)
    for key, value in replaced.items():
        node = probe
        for part in key[:-1]:
            node = node[part]
        node[key[-1]] = copy.deepcopy(value)
    try:
        validate_config(probe, inputs)
    except ValidationError as exc:
        bad = [e for e in exc.errors() if tuple(str(p) for p in e["loc"]) in replaced]
        if bad:
            raise ConfigError(f"Config file {path}: " + format_validation_error(exc, Config, bad).removeprefix(
                "Invalid configuration: ") + " (the command line sets it too, but the file's value is invalid: fix "
                "or remove it)") from None


def _params_of_another_strategy_dropped(data: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``data`` without its ``freeze.params`` when ``override`` names another strategy: parameters belong to the
    strategy they were written for (a config's ``static`` ``k``, blocks to freeze, is not ``lisa``'s ``k``, steps
    between switches); the override's own parameters, and later ones, still apply."""
    new = override["freeze"].get("strategy") if isinstance(override.get("freeze"), dict) else None
    freeze = data.get("freeze")
    if new is None or not isinstance(freeze, dict) or freeze.get("strategy", DEFAULT_STRATEGY) == new:
        return data
    return {**data, "freeze": {k: v for k, v in freeze.items() if k != "params"}}
