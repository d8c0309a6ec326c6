"""The benchmark scripts' shared command line (``benchmarks.cli``): counts refused as argparse reads them, and a
user's error (bad config, unknown row, a folder that cannot be written) as one line and exit 2, where a newcomer got
tracebacks (``checkpoint_cost --repeats 0``: UnboundLocalError; ``frozen_encoder --epochs 1``: ZeroDivisionError after
training; ``suite --out /sys/nope``: PermissionError)."""

from __future__ import annotations

import sys

import pytest

from benchmarks.cli import count, entry, names
from layerfreeze.errors import ConfigError


def test_count_takes_integers_at_or_above_its_minimum():
    assert count(2)("3") == 3 and count(0)("0") == 0
    for text, minimum in (("1", 2), ("0", 1), ("-4", 0), ("2.5", 1), ("many", 1)):
        with pytest.raises(Exception, match="integer"):
            count(minimum)(text)


def test_names_takes_comma_separated_choices():
    # ddp_freeze's --rows alone took space-separated rows; "--rows none,lisa" was refused as one unknown row
    assert names(["none", "lisa", "badam"])("none, lisa,badam") == ["none", "lisa", "badam"]
    for text in ("none,lisa2", ",", ""):
        with pytest.raises(Exception, match="give comma-separated names from none, lisa, badam"):
            names(["none", "lisa", "badam"])(text)
    with pytest.raises(Exception, match="^none given twice: give each once$"):
        names(["none", "lisa", "badam"])("none,lisa,none")


def test_every_benchmark_takes_its_seeds_as_one_comma_separated_list():
    # three scripts read --seeds 3 as a count (seeds 0, 1, 2) and four as a list (seed 3 alone), in silence
    import argparse
    import importlib

    from benchmarks.cli import seed_list

    assert seed_list("3") == [3] and seed_list("0, 1,2") == [0, 1, 2]
    for text in ("a", "", "1.5", "-2"):
        with pytest.raises(argparse.ArgumentTypeError, match="give comma-separated seeds, integers >= 0"):
            seed_list(text)
    for name in ("suite", "demote_accuracy", "lm_finetune", "lr_grid", "precision_compile", "smartfrz_threshold",
                 "oracle_replay"):
        source = importlib.util.find_spec(f"benchmarks.{name}").origin
        text = open(source).read()
        assert '"--seeds", type=seed_list' in text, name


@pytest.mark.parametrize("module, args, message", [
    ("benchmarks.frozen_encoder", ["--epochs", "1"], "argument --epochs: 1 is below 2: give an integer >= 2"),
    ("benchmarks.checkpoint_cost", ["--repeats", "0"], "argument --repeats: 0 is below 1"),
    ("benchmarks.crash_resume", ["--steps", "0"], "argument --steps: 0 is below 2"),
    ("benchmarks.suite", ["--seeds", "-1"], "argument --seeds: '-1': give comma-separated seeds, integers >= 0"),
    ("benchmarks.suite", ["--seeds", "0,1,0"], "argument --seeds: seed(s) 0 given twice: give each once"),
    ("benchmarks.ddp_freeze", ["--rows", "none,lisaa"], "argument --rows: lisaa: give comma-separated names from "),
])
def test_a_benchmark_refuses_a_count_before_it_trains(module, args, message, monkeypatch, capsys):
    import importlib

    main = importlib.import_module(module).main
    monkeypatch.setattr(sys, "argv", [module.replace(".", "/") + ".py", *args])
    with pytest.raises(SystemExit) as stop:
        main(args) if module == "benchmarks.suite" else main()
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_entry_prints_a_users_error_in_one_line_and_keeps_a_bugs_traceback(monkeypatch, capsys, tmp_path):
    from benchmarks import suite

    monkeypatch.setattr(sys, "argv", ["benchmarks/suite.py"])
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert entry(lambda: suite.main(["--quick", "--tasks", "bbc", "--out", str(blocked / "sub")])) == 2
    err = capsys.readouterr().err
    assert err.startswith("benchmarks.suite: error: Not a directory: ") and str(blocked) in err
    assert len(err.strip().splitlines()) == 1

    def bad_config():
        raise ConfigError("train.epochs must be >= 1; give --epochs 1 or more")

    assert entry(bad_config) == 2
    assert capsys.readouterr().err == "benchmarks.suite: error: train.epochs must be >= 1; give --epochs 1 or more\n"
    assert entry(lambda: None) == 0 and entry(lambda: 3) == 3

    def bug():
        raise KeyError("aggregate")

    with pytest.raises(KeyError):
        entry(bug)
