"""Config text into dicts: a YAML, TOML or JSON file, ``section.key=value`` overrides, and their merge.

Validation is not done here: :mod:`layerfreeze.train.config` turns the merged dict into a checked ``Config``.
"""

from __future__ import annotations

import copy
import json
import tomllib
from pathlib import Path
from typing import Any

import yaml

from layerfreeze.errors import ConfigError


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated recursively by ``override`` (new dict; neither input is changed)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def leaf_values(d: Any, opaque: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """``{key path: value}`` of every leaf of a nested dict: a value that is not a non-empty dict, or any value under
    a key in ``opaque`` (kept whole). A ``d`` that is not a dict is the one leaf ``()``.

    Example: ``leaf_values({"train": {"lr": 0.1}, "freeze": {"params": {"k": 2}}}, opaque=("params",))`` is
    ``{("train", "lr"): 0.1, ("freeze", "params"): {"k": 2}}``.
    """
    def walk(node: dict[str, Any], prefix: tuple[str, ...]) -> Any:
        for key, value in node.items():
            path = (*prefix, str(key))
            if isinstance(value, dict) and value and key not in opaque:
                yield from walk(value, path)
            else:
                yield path, value

    return dict(walk(d, ())) if isinstance(d, dict) else {(): d}


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader refusing a key given twice in one mapping (PyYAML keeps the last one, in silence: ``lr:
    1e-4`` then, further down, ``lr: 2e-4`` trained at 2e-4 with nothing said)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` repeats keys on purpose: merged below
                continue
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            try:
                twice = key in seen
            except TypeError:  # an unhashable key: PyYAML's own error says so
                continue
            if twice:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice in one mapping "
                                                        "(keep one)", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook`` refusing a key given twice in one object (JSON keeps the last)."""
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"the key(s) {', '.join(map(repr, twice))} are given twice in one object (keep one)")
    return dict(pairs)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a ``.yaml``/``.yml``, ``.toml`` or ``.json`` file into a dict.

    A run folder's own ``config.json`` (the record of a run: its ``run.dir`` is the file's folder) is a config to
    start a new run from: its ``run.dir`` and ``run.resume``, which name that run, are left out, so the new run gets
    its own folder (``--run-dir``, or ``runs/<task>-<strategy>-<time>``); ``--resume RUN_DIR`` continues the run
    itself.

    Raises:
        ConfigError: missing file, unknown extension, a syntax error, a key given twice in one mapping, or a top
            level that is not a mapping.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ConfigError(f"--config {path} {what}: give a YAML, TOML or JSON config file (`layerfreeze config` "
                          "prints one to start from)")
    kind = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML", ".json": "JSON"}.get(path.suffix.lower())
    if kind is None:
        raise ConfigError(f"Config file {path} must end in .yaml, .yml, .toml or .json")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"Config file {path} is not UTF-8 text ({exc.reason} at byte {exc.start}): save it as "
                          "UTF-8") from None
    try:
        if kind == "YAML":
            data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # noqa: S506 (a safe loader's subclass)
        elif kind == "TOML":
            data = tomllib.loads(text)  # refuses a key given twice itself
        else:
            data = json.loads(text, object_pairs_hook=_unique_pairs)
    except (yaml.YAMLError, tomllib.TOMLDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(f"Config file {path} is not valid {kind}: {_syntax_error(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path} must hold a mapping at the top level, got {type(data).__name__}")
    run = data.get("run")
    if kind == "JSON" and isinstance(run, dict) and run.get("dir") and same_path(run["dir"], path.parent):
        data = {**data, "run": {k: v for k, v in run.items() if k not in ("dir", "resume")}}
    return data


def _syntax_error(exc: Exception) -> str:
    """A parser's syntax error as one line: what is wrong and where (PyYAML's own message spans several lines, with
    the offending text drawn under a caret)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"{exc.problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(exc).split())


def same_path(a: Any, b: Any) -> bool:
    """Whether two paths name the same file or folder (``~`` expanded, relative ones read from here, a missing one
    compared by its absolute path); False when either is not a path (None, a number)."""
    if not (isinstance(a, (str, Path)) and isinstance(b, (str, Path))):
        return False
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return False


def parse_override(item: str) -> dict[str, Any]:
    """``"train.lr=1e-4"`` -> ``{"train": {"lr": 1e-4}}`` (the value is parsed as YAML: numbers, lists, bools).

    Raises:
        ConfigError: no ``=`` or an empty key.
    """
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"Override {item!r} must look like section.key=value, e.g. train.lr=1e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    out: dict[str, Any] = {}
    node = out
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out
