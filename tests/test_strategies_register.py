"""The README's "Register your own strategy" example, run as written: the registered strategy trains through the
Freezer in a plain loop, through create_strategy, the config and the CLI trainer, is listed by ``layerfreeze
strategies``, and unregistering it leaves the built-in strategies as they were."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from layerfreeze import Freezer
from layerfreeze.cli import main
from layerfreeze.errors import ConfigError
from layerfreeze.strategies import (
    BUILTIN_STRATEGIES,
    STRATEGIES,
    Strategy,
    UnknownStrategyError,
    create_strategy,
    register_strategy,
    unregister_strategy,
)
from layerfreeze.train.compare import DEFAULT_ROWS
from layerfreeze.train.config import build_config
from layerfreeze.train.setup import build_strategy
from layerfreeze.train.trainer import Trainer
from tests.conftest import blob_task, readme_example


def example_code() -> str:
    return readme_example("### Register your own strategy")


@pytest.fixture
def example():
    before = dict(STRATEGIES)
    namespace: dict = {}
    exec(compile(example_code(), "README.md#register-your-own-strategy", "exec"), namespace)
    yield namespace
    unregister_strategy("every-n")
    assert dict(STRATEGIES) == before


def test_the_builtin_strategies_are_registered_in_the_tables_order():
    assert BUILTIN_STRATEGIES == ("none", "static", "gradual", "linear", "geometric", "freezeout", "autofreeze",
                                  "egeria", "smartfrz", "lisa", "badam")
    assert DEFAULT_ROWS == (*BUILTIN_STRATEGIES, "lora")
    assert all(STRATEGIES[name].name == name for name in BUILTIN_STRATEGIES)


def test_the_readme_strategy_trains_through_the_freezer(example):
    cls = example["FreezeEveryN"]
    assert STRATEGIES["every-n"] is cls and cls.name == "every-n"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with_weights = {k: v.clone() for k, v in model.state_dict().items()}
    freezer = Freezer(model, optimizer, "every-n", {"n": 3})
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    for _ in range(10):
        nn.functional.cross_entropy(model(x), y).backward()
        freezer.after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        freezer.step()
    freezer.close()
    assert [(r["block"], r["step"]) for r in freezer.history] == [("0", 3), ("2", 6), ("4", 9)]
    assert freezer.frozen == [True, True, True, False]  # never the head
    assert not torch.equal(model[0].weight, with_weights["0.weight"])  # it trained before it froze
    assert isinstance(create_strategy("every-n", n=2), cls) and isinstance(create_strategy("every-n"), Strategy)
    with pytest.raises(UnknownStrategyError, match="no parameter"):
        create_strategy("every-n", k=2)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        create_strategy("every-n", n=0)


def test_the_readme_strategy_passes_the_config_and_trains_in_the_cli_trainer(example, tmp_path, one_thread):
    cfg = build_config({"train": {"epochs": 2, "batch_size": 16, "lr": 0.01},
                        "freeze": {"strategy": "every-n", "params": {"n": 4}},
                        "run": {"dir": str(tmp_path / "r"), "progress": False, "tensorboard": False,
                                "checkpoint": False}})
    summary = Trainer(cfg, task=blob_task()).run()
    assert [(e["block"], e["step"]) for e in summary["freeze_timeline"]] == [("0", 4), ("1", 8), ("4", 12)]
    with pytest.raises(ConfigError, match="freeze.params: every-n: n must be an integer"):  # values: where it is built
        build_strategy(build_config({"freeze": {"strategy": "every-n", "params": {"n": "2"}}}))
    with pytest.raises(ConfigError, match="has no parameter"):  # names: in the config already
        build_config({"freeze": {"strategy": "every-n", "params": {"k": 2}}})


@pytest.mark.assets("minilm")  # tiny_bert_dir: MiniLM's tokenizer
def test_the_readme_strategy_through_the_layerfreeze_command(example, tmp_path, tiny_bert_dir, tiny_csv, capsys):
    assert main(["strategies"]) == 0
    assert "every-n" in capsys.readouterr().out
    run = tmp_path / "run"
    assert main(["train", "--task", "text-csv", "--data", str(tiny_csv), "--model", str(tiny_bert_dir),
                 "--epochs", "1", "--batch-size", "8", "-s", "every-n", "-p", "n=2", "--no-progress",
                 "--set", "model.max_length=16", "--set", "run.threads=1", "--run-dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    froze = [(e["block"], e["step"]) for e in summary["freeze_timeline"] if e["action"] == "freeze"]
    assert froze and [s for _, s in froze] == list(range(2, 2 * len(froze) + 1, 2))


def test_a_name_is_registered_once_and_only_strategies_register():
    with pytest.raises(ValueError, match="already registered"):
        register_strategy("static")(type("OtherStatic", (Strategy,), {}))
    with pytest.raises(TypeError, match="Strategy subclass"):
        register_strategy("not-a-strategy")(object)
    assert "not-a-strategy" not in STRATEGIES


def test_create_strategy_takes_the_params_dict_as_freezer_does_and_keywords(example):
    cls = example["FreezeEveryN"]
    from_dict = create_strategy("every-n", {"n": 3})  # what Freezer(model, optimizer, "every-n", {"n": 3}) takes
    assert isinstance(from_dict, cls) and from_dict.n == 3 and from_dict.stage_every == 3
    assert create_strategy("every-n", n=4).n == 4 and create_strategy("every-n", {}).n == 10
    assert create_strategy("static", {"k": 2}).k == 2
    with pytest.raises(UnknownStrategyError, match="no parameter"):
        create_strategy("every-n", {"k": 2})
    with pytest.raises(TypeError, match="n given both in the params dict and as a keyword"):
        create_strategy("every-n", {"n": 3}, n=4)
    with pytest.raises(TypeError, match="params must be a dict"):
        create_strategy("every-n", 3)
