"""Property-based: every invalid value of every config key (and of the CLI's numeric flags) stops before training
with exit code 2, a message naming the key, and no run folder; every valid one builds.

The schema is read from the pydantic models themselves (types, bounds, choices), so a key added later is covered.
"""

from __future__ import annotations

import math
import typing
from itertools import count
from pathlib import Path

import annotated_types as at
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from layerfreeze.cli import main
from layerfreeze.train.config import Config, build_config
from layerfreeze.train.config_file import deep_merge

#: Free-form text keys (paths, names) are checked where they are used (a missing file, an unknown strategy); a
#: memory budget is a size or a fraction as text (tests/test_budget.py checks its forms).
FREE_FORM = {"model.name_or_path", "model.blocks", "model.lora.targets", "data.path", "data.test_path",
             "data.text_column", "data.label_column", "freeze.strategy", "freeze.params", "run.dir", "run.device",
             "run.resume", "freeze.memory_budget"}
YAML_WORDS = {"yes", "no", "on", "off", "true", "false", "y", "n", "t", "f", "null", "nan", "inf", "infinity"}


def leaves(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, typing.Any]:
    out = {}
    for name, field in model.model_fields.items():
        inner = [a for a in (field.annotation, *typing.get_args(field.annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)]
        if inner:
            out.update(leaves(inner[0], f"{prefix}{name}."))
        elif f"{prefix}{name}" not in FREE_FORM:
            out[f"{prefix}{name}"] = field
    return out


FIELDS = leaves()
SECTIONS = {"model", "data", "train", "freeze", "run", "model.lora", "freeze.guard", "freeze.cache", "freeze.demote"}
#: Keys valid only beside another one: a demotion needs a dtype or an offload target to do anything.
NEEDS = {"freeze.demote.master": {"freeze": {"demote": {"dtype": "bfloat16"}}},
         "data.image_size": {"task": "fashion-mnist"}}  # read by the image tasks alone (others refuse it)


def kind(field) -> tuple[str, tuple]:
    args = typing.get_args(field.annotation)
    if typing.get_origin(field.annotation) is typing.Literal:
        return "choice", args
    choices = [a for a in args if typing.get_origin(a) is typing.Literal]  # an optional choice: Literal[...] | None
    if choices:
        return "choice", typing.get_args(choices[0])
    base = [a for a in (field.annotation, *args) if a in (int, float, bool)]
    return base[0].__name__, ()


def bounds(field) -> dict[str, float]:
    out = {}
    for m in field.metadata:
        for attr in ("ge", "gt", "le", "lt"):
            if isinstance(m, getattr(at, attr.capitalize())):
                out[attr] = getattr(m, attr)
    return out


words = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8).filter(lambda w: w not in YAML_WORDS)


@st.composite
def invalid(draw) -> tuple[str, str]:
    key = draw(st.sampled_from(sorted(FIELDS)))
    field = FIELDS[key]
    what, choices = kind(field)
    if what == "choice":
        return key, draw(words.filter(lambda w: w not in choices))
    if what == "bool":
        return key, draw(st.sampled_from(["maybe", "2", "-1", "[1]", "{a: 1}"]))
    b = bounds(field)
    options = [st.just(draw(words)), st.just("[1, 2]")]
    if what == "int":
        options.append(st.just(repr(draw(st.integers(-1000, 1000)) + 0.5)))
        if "ge" in b:
            options.append(st.integers(-10**6, int(b["ge"]) - 1).map(str))
        if "le" in b:
            options.append(st.integers(int(b["le"]) + 1, max(10**7, 10 * int(b["le"]))).map(str))
    else:
        for attr, low in (("ge", False), ("gt", True)):
            if attr in b:
                options.append(st.floats(-1e6, b[attr], exclude_max=not low, allow_nan=False).map(repr))
        for attr, high in (("le", False), ("lt", True)):
            if attr in b:
                options.append(st.floats(b[attr], max(1e7, 10.0 * b[attr]), exclude_min=not high,
                                         allow_nan=False).map(repr))
    return key, draw(st.one_of(options))


@st.composite
def valid(draw) -> tuple[str, typing.Any]:
    key = draw(st.sampled_from(sorted(FIELDS)))
    field = FIELDS[key]
    what, choices = kind(field)
    if key == "task":  # the other tasks need data.path / a model: checked by their own tests
        return key, "bbc-news"
    if what == "choice":
        return key, draw(st.sampled_from(choices))
    if what == "bool":
        return key, draw(st.booleans())
    b = bounds(field)
    if what == "int":
        low = b.get("ge", b.get("gt", -10**6 - 1) + 1)
        return key, draw(st.integers(int(low), int(b.get("le", b.get("lt", 10**6 + 1) - 1))))
    low, high = b.get("ge", b.get("gt", -1e6)), b.get("le", b.get("lt", 1e6))
    return key, draw(st.floats(low, high, exclude_min="gt" in b, exclude_max="lt" in b, allow_nan=False))


def nested(key: str, value: typing.Any) -> dict:
    out: dict = {}
    node = out
    *path, last = key.split(".")
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value
    return out


RUN = count()


@pytest.fixture(autouse=True)
def never_train(monkeypatch):
    """A value these tests think invalid but the config accepts must fail the test, not start a training run."""
    def refuse(self):
        raise AssertionError(f"a config the test thinks invalid was accepted: {self.config.model_dump()}")

    monkeypatch.setattr("layerfreeze.train.trainer.Trainer.run", refuse)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=invalid())
def test_every_invalid_value_of_every_key_is_exit_2_naming_it_and_leaves_no_run_folder(case, tmp_path, capsys):
    key, raw = case
    run_dir = tmp_path / f"r{next(RUN)}"
    assert main(["train", "--set", f"{key}={raw}", "--run-dir", str(run_dir)]) == 2, (key, raw)
    err = capsys.readouterr().err
    assert key in err, (key, raw, err)
    assert not run_dir.exists()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(section=st.sampled_from(sorted(SECTIONS)), name=words)
def test_an_unknown_key_in_any_section_is_exit_2_naming_it(section, name, tmp_path, capsys):
    if f"{section}.{name}" in FIELDS or f"{section}.{name}" in FREE_FORM or f"{section}.{name}" in SECTIONS:
        return
    assert main(["train", "--set", f"{section}.{name}=1", "--run-dir", str(tmp_path / "r")]) == 2
    assert f"{section}.{name}: unknown key" in capsys.readouterr().err


@settings(max_examples=200, deadline=None)
@given(case=valid())
def test_every_valid_value_of_every_key_builds(case):
    key, value = case
    config = build_config(deep_merge(NEEDS.get(key, {}), nested(key, value)))
    node: typing.Any = config
    for part in key.split("."):
        node = getattr(node, part)
    assert node == value or (isinstance(value, float) and math.isclose(node, value))


NUMERIC_FLAGS = {"--epochs": "train.epochs", "--batch-size": "train.batch_size", "--lr": "train.lr",
                 "--max-steps": "train.max_steps", "--limit-train": "data.limit_train",
                 "--limit-test": "data.limit_test"}  # --seed takes any integer


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(sorted(NUMERIC_FLAGS)), value=st.one_of(words, st.integers(-10**6, 0).map(str),
                                                                     st.floats(-1e6, 0, allow_nan=False).map(repr)))
def test_the_cli_numeric_flags_refuse_what_their_key_refuses(flag, value, tmp_path, capsys):
    key = NUMERIC_FLAGS[flag]
    run_dir: Path = tmp_path / f"f{next(RUN)}"
    try:
        code = main(["train", flag, value, "--run-dir", str(run_dir)])
    except SystemExit as exc:  # argparse: the flag's type (an integer flag given a word or a float)
        code = exc.code
        assert flag in capsys.readouterr().err
    else:
        assert key in capsys.readouterr().err
    assert code == 2 and not run_dir.exists(), (flag, value)
