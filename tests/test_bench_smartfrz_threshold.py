"""benchmarks/smartfrz_threshold.py without training: the per-threshold rows and the argument checks."""

from __future__ import annotations

import pytest

from benchmarks import suite_tasks
from layerfreeze.strategies import STRATEGIES, register_strategy
from layerfreeze.strategies.registry import unregister_strategy
from layerfreeze.train.compare import row_config
from layerfreeze.train.config import build_config
from tests.conftest import benchmark_module


@pytest.fixture(scope="module")
def sweep():
    with benchmark_module("smartfrz_threshold") as module:
        yield module


def test_each_threshold_is_a_smartfrz_row_with_that_threshold(sweep, tmp_path):
    name = sweep.row_name(0.95)
    assert name == "smartfrz-p0.95" and sweep.row_name(0.9) == "smartfrz-p0.9"
    cls = sweep.threshold_strategy(name)
    register_strategy(name)(cls)
    try:
        register_strategy(name)(sweep.threshold_strategy(name))  # the same class again: a no-op, not an error
        assert STRATEGIES[name] is cls and issubclass(cls, STRATEGIES["smartfrz"]) and cls.name == name
        spec = suite_tasks.task_spec("bbc", True)
        row = row_config(suite_tasks.base_config(spec, 0, 1), name, tmp_path, {name: {"threshold": 0.95}})
        cfg = build_config(row)
        assert cfg.freeze.strategy == name and cfg.freeze.params == {"threshold": 0.95}
        assert cls(**cfg.freeze.params).threshold == 0.95
    finally:
        unregister_strategy(name)


def test_format_steps_lists_frozen_blocks_in_forward_order(sweep):
    blocks = ["emb", "layer.0", "layer.1", "head"]
    assert sweep.format_steps({"layer.0": 9, "emb": 9, "layer.1": None}, blocks) == "emb@9, layer.0@9"
    assert sweep.format_steps({}, blocks) == "-"


@pytest.mark.parametrize(("argv", "message"), [
    (["--task", "bbc", "--thresholds", "0.9,x"], "comma-separated numbers"),
    (["--task", "bbc", "--thresholds", "0.9,1"], "probabilities in (0, 1)"),
    (["--task", "bbc", "--thresholds", "0.9", "--seeds", "0,a"], "give comma-separated seeds, integers >= 0"),
])
def test_bad_arguments_are_parser_errors_before_training(sweep, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        sweep.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
