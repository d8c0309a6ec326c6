"""A config's problems in its own words: pydantic's validation errors said on one line, each naming its key
(:func:`format_validation_error`), an unknown key with the closest valid one (:func:`suggest_key`: other trainers'
spellings, misspellings, a key of another section), and the schema's keys (:func:`config_keys`). The schema itself is
:mod:`layerfreeze.train.config`, which passes its root class in."""

from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError


def section_class(annotation: Any) -> type[BaseModel] | None:
    """The config section class an annotation holds (``GuardConfig | None`` -> ``GuardConfig``), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = section_class(arg)
            if found is not None:
                return found
    return None


def config_keys(cls: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of the schema ``cls`` (its root: :class:`~layerfreeze.train.config.Config`), dotted
    (``model.name_or_path``, ``freeze.guard.tolerance``), sections included."""
    keys = []
    for name, field in cls.model_fields.items():
        keys.append(prefix + name)
        section = section_class(field.annotation)
        if section is not None:
            keys += config_keys(section, f"{prefix}{name}.")
    return keys


#: Names users write for a key that has another name here (other trainers' spellings).
KEY_ALIASES = {
    "learning_rate": "lr", "learningrate": "lr", "num_epochs": "epochs", "num_train_epochs": "epochs",
    "n_epochs": "epochs", "batch": "batch_size", "bs": "batch_size", "per_device_train_batch_size": "batch_size",
    "eval_batch": "eval_batch_size", "per_device_eval_batch_size": "eval_batch_size", "steps": "max_steps",
    "clip": "grad_clip", "max_grad_norm": "grad_clip", "warmup": "warmup_fraction", "warmup_ratio": "warmup_fraction",
    "scheduler": "schedule", "lr_scheduler_type": "schedule", "model": "name_or_path", "name": "name_or_path",
    "path": "name_or_path", "model_name": "name_or_path", "model_name_or_path": "name_or_path",
    "output_dir": "dir", "run_dir": "dir", "parameters": "params", "strategy_params": "params",
    "max_seq_length": "max_length", "seq_len": "max_length", "rank": "r", "lora_r": "r", "lora_alpha": "alpha",
    "lora_dropout": "dropout", "target_modules": "targets", "budget": "budget_mb", "memory_mb": "budget_mb",
}


def suggest_key(loc: typing.Sequence[Any], root: type[BaseModel]) -> str | None:
    """The valid key of schema ``root`` closest to the unknown key at ``loc`` (a pydantic error location), dotted, or
    None.

    Tried in order: a known other spelling (:data:`KEY_ALIASES`: ``train.learning_rate`` -> ``train.lr``), the
    closest key of the same section by spelling (``difflib``: ``freeze.stratgy`` -> ``freeze.strategy``), a key
    of the section that has the unknown one as a word (``model.name`` -> ``model.name_or_path``), and the same key
    in another section (``train.strategy`` -> ``freeze.strategy``).
    """
    parts = [str(p) for p in loc]
    cls: type[BaseModel] | None = root
    for part in parts[:-1]:
        field = cls.model_fields.get(part) if cls is not None else None
        cls = section_class(field.annotation) if field is not None else None
    if cls is None:
        return None
    key, prefix = parts[-1], ".".join(parts[:-1] + [""])
    valid = list(cls.model_fields)
    lowered = key.lower().replace("-", "_")
    alias = KEY_ALIASES.get(lowered)
    if alias in valid:
        return prefix + alias
    close = difflib.get_close_matches(lowered, valid, n=1, cutoff=0.6)
    if close:
        return prefix + close[0]
    words = [v for v in valid if lowered in v.split("_") or v in lowered.split("_")]
    if len(words) == 1:
        return prefix + words[0]
    elsewhere = [k for k in config_keys(root) if k.rsplit(".", 1)[-1] in (lowered, alias) and k != prefix + key]
    if elsewhere:
        return elsewhere[0]
    close = difflib.get_close_matches(lowered, valid, n=1, cutoff=0.5)
    return prefix + close[0] if close else None


#: pydantic's bound errors -> the comparison they state.
_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
           "less_than": ("lt", "<")}
_WHOLE = ("int_parsing", "int_type", "int_from_float")
_NUMBER = ("float_parsing", "float_type")


def _plain_message(err: Any) -> str:
    """One pydantic error in the config's words (no "Input should be"): the bound, the choices with the closest one,
    the kind of value wanted; what it got."""
    kind, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
    if kind in _BOUNDS:
        key, op = _BOUNDS[kind]
        bound = ctx[key]
        return f"must be {op} {f'{bound:g}' if isinstance(bound, float) else bound}, got {got!r}"
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        guess = difflib.get_close_matches(str(got), choices, n=1, cutoff=0.5) or [
            c for c in choices if str(got) and c.startswith(str(got))][:1]
        hint = f" (did you mean {guess[0]!r}?)" if guess else ""
        return f"{got!r} is not one of {', '.join(choices)}{hint}"
    if kind in _WHOLE:
        return f"must be a whole number, got {got!r}"
    if kind in _NUMBER:
        return f"must be a number, got {got!r}"
    if kind == "finite_number":
        return f"must be a finite number, got {got!r}"
    if kind in ("bool_parsing", "bool_type"):
        return f"must be true or false, got {got!r}"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return (f"is a section, not a value (got {got!r}): set its keys, e.g. --set <section>.<key>=VALUE "
                "(`layerfreeze config` shows them)")
    return err["msg"]


def format_validation_error(exc: ValidationError, root: type[BaseModel], errors: list[Any] | None = None) -> str:
    """pydantic's errors validating schema ``root`` (``errors``: a selection of ``exc.errors()``, default all) in the
    config's words, on one
    line: each problem names its key (``; `` between them); an unknown key gets the closest valid one
    (:func:`suggest_key`); our own validators' messages come without pydantic's ``Value error,`` prefix, and
    pydantic's own ("Input should be ...") are said plainly (:func:`_plain_message`)."""
    lines = []
    for err in exc.errors() if errors is None else errors:
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            guess = suggest_key(err["loc"], root)
            hint = f"did you mean `{guess}`? " if guess else ""
            msg = f"unknown key ({hint}`layerfreeze config` prints every key with its default)"
        elif err["type"] in ("value_error", "assertion_error") and "error" in (err.get("ctx") or {}):
            msg = str(err["ctx"]["error"])
        else:
            msg = _plain_message(err)
        lines.append(f"{where}: {msg}" if where else msg)
    return "Invalid configuration: " + "; ".join(lines)
