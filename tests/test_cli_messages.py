"""Issue 43, the second newcomer run: what a user tries after the README's snippets gets one clear line and exit
code 2 before anything trains, tables people read fit 120 columns, every option has help text."""

from __future__ import annotations

import argparse
import json
import re
import warnings
from pathlib import Path

import pytest

import layerfreeze
from layerfreeze.budget.parse import parse_budget
from layerfreeze.cli import commands as cli_commands
from layerfreeze.cli import entry as cli_entry
from layerfreeze.cli import main
from layerfreeze.cli import parser as cli_parser
from layerfreeze.errors import ConfigError
from layerfreeze.runs.rundir import read_metrics
from layerfreeze.train.config import build_config
from layerfreeze.train.config_file import parse_override
from layerfreeze.train.config_load import load_config

README = Path(__file__).resolve().parents[1] / "README.md"


def _err(capsys) -> str:
    return capsys.readouterr().err


# ---- every subcommand and option has help text (issue 43: "what to build") --------------------------------------


def _walk(parser: argparse.ArgumentParser, path: list[str]) -> list[str]:
    """Every subcommand without help or description and every option without help, as ``"cmd sub: --option"``."""
    missing = []
    if path and not parser.description:
        missing.append(f"{' '.join(path)}: no description")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {a.dest for a in action._choices_actions if a.help}
            for name, sub in action.choices.items():
                if name not in helped:
                    missing.append(f"{' '.join([*path, name])}: no help in its parent's list")
                missing += _walk(sub, [*path, name])
        elif not isinstance(action, argparse._HelpAction) and not action.help:
            missing.append(f"{' '.join(path)}: {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_subcommand_and_option_has_help_text(capsys):
    parser = cli_parser.build_parser()
    assert _walk(parser, []) == []
    commands = set(parser.subcommands)
    assert {"train", "compare", "plan", "blocks", "report", "predictor", "config", "strategies", "assets"} <= commands
    for command in ("strategies", "assets"):  # they had no description
        with pytest.raises(SystemExit) as exc:
            main([command, "--help"])
        assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "List every registered freezing strategy" in out and "Check which offline assets are installed" in out


def _option_help(parser: argparse.ArgumentParser, flag: str) -> str:
    return next(a.help for a in parser._actions if flag in a.option_strings)


def test_help_gives_defaults_and_says_what_lr_deltas_and_the_predictor_steps_are():
    # a newcomer's reading of --help: --seed and --max-steps without their defaults, --lr "of the head" though with
    # lr_decay 1 (the default) every block has it, calibrate --deltas "default 0.01" and nothing else, `predictor`
    # naming 4 of its 6 steps, and two lists of budget forms (train's without 2.5GB, plan's with it)
    parser = cli_parser.build_parser()
    for command in ("train", "compare", "plan"):
        sub = parser.subcommands[command]
        assert _option_help(sub, "--seed").endswith("(default 0)")
        assert "(default: none, the run's epochs decide)" in _option_help(sub, "--max-steps")
        lr = _option_help(sub, "--lr")
        assert lr.startswith("learning rate of every block, the head's when train.lr_decay > 1") and "of the head" \
            not in lr
    forms = ("3GiB, 800MiB, 2.5GB, 1000000B; binary KiB/MiB/GiB/TiB, decimal kB/MB/GB/TB, or B for bytes), or a "
             "fraction of the tensor peak with nothing frozen (0.6, or 60%%)")
    for command, flag in (("train", "--memory-budget"), ("compare", "--memory-budget"), ("plan", "--memory")):
        assert f"tensor-peak budget: a size with a unit ({forms}" in _option_help(parser.subcommands[command], flag)
    for form in ("3GiB", "800MiB", "2.5GB", "1000000B", "0.6", "60%"):  # each listed form is one parse_budget reads
        parse_budget(form)
    predictor = parser.subcommands["predictor"]
    text = " ".join(predictor.format_help().split())
    assert "collect -> label -> train (-> evaluate); counterfactual (after collect)" in text
    assert "calibrate scores labelling rules (tau, window, delta)" in text
    calibrate = next(a for a in predictor._actions if isinstance(a, argparse._SubParsersAction)).choices["calibrate"]
    deltas = _option_help(calibrate, "--deltas")
    assert deltas.startswith("comma-separated largest CKA changes a rule allows over its stability window (max - min "
                             "of a block's CKA to its final state, CKA being unitless in [0, 1]")
    assert deltas.endswith("(default 0.01)")
    from layerfreeze.train.config import TrainConfig
    from layerfreeze.train.config_yaml import config_yaml

    assert "lr`` is every block's learning rate with ``lr_decay`` 1" in TrainConfig.__doc__
    assert "# every block's learning rate (the head's when lr_decay > 1" in config_yaml(build_config({}))


# ---- item 9: budgets -------------------------------------------------------------------------------------------


def test_budget_messages_say_what_was_meant_without_pydantics_prefix(tmp_path, capsys):
    assert main(["plan", "--memory", "60"]) == 2
    err = _err(capsys)
    assert "freeze.memory_budget: memory budget '60'" in err
    assert "did you mean 60% of it, or a size such as 60GiB?" in err
    assert "Value error" not in err and "60MiB" not in err
    assert main(["plan", "--memory", "1000000000"]) == 2  # the CLI reads a string: bytes take the unit B
    assert "did you mean 1000000000B, that is 953.7 MiB? a size in bytes takes the unit B" in _err(capsys)
    assert main(["train", "--memory-budget", "1000000000", "--run-dir", str(tmp_path / "r")]) == 2  # train the same
    assert "did you mean 1000000000B" in _err(capsys) and not (tmp_path / "r").exists()
    assert main(["plan", "--memory=-1GiB"]) == 2
    assert "memory budget '-1GiB': a budget must be positive" in _err(capsys)
    with pytest.raises(SystemExit) as exc:  # argparse reads -1GiB as an option: say how to write it
        main(["plan", "--memory", "-1GiB"])
    assert exc.value.code == 2
    err = _err(capsys)
    assert "layerfreeze plan: error: argument --memory/-m: expected one argument (a value that starts with '-' is " \
           "written --memory=VALUE" in err


def test_compare_takes_a_memory_budget_and_an_unknown_option_is_named_in_its_subcommand(tmp_path, capsys):
    assert main(["compare", "--rows", "none", "--memory-budget", "60", "--run-dir", str(tmp_path / "c")]) == 2
    assert "row none: Invalid configuration: freeze.memory_budget: memory budget '60'" in _err(capsys)
    assert not (tmp_path / "c").exists()
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--memory-budgt", "1GiB"])
    assert exc.value.code == 2
    err = _err(capsys)
    assert err.count("\n") == 1  # one line, no usage block; it names the subcommand and its --help
    assert err.startswith("layerfreeze compare: error: unrecognized arguments: --memory-budgt 1GiB (--memory-budgt: "
                          "did you mean --memory-budget?); layerfreeze compare --help lists the options")


def test_under_torchrun_the_budget_refusal_names_the_parallel_mode():
    from layerfreeze.train.setup import check_distributed_config

    fsdp = build_config({"freeze": {"memory_budget": "3GiB"}, "run": {"parallel": "fsdp"}})
    with pytest.raises(ConfigError) as err:
        check_distributed_config(fsdp, distributed=True)
    assert "each rank's shards and FSDP2's all-gathers" in str(err.value) and "DDP" not in str(err.value)
    with pytest.raises(ConfigError, match="DDP's gradient buckets"):
        check_distributed_config(build_config({"freeze": {"memory_budget": "3GiB"}}), distributed=True)
    check_distributed_config(fsdp, distributed=False)  # one process: the budget is planned


def test_plan_under_torchrun_says_to_run_it_in_one_process(capsys, monkeypatch):
    # it said "freeze.memory_budget (--memory-budget) is not supported under torchrun": train's flag, not plan's
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["plan", "--memory", "60%"]) == 2
    assert _err(capsys) == "layerfreeze: error: layerfreeze plan measures the run in one process and makes no plan " \
                           "per rank yet: run it without torchrun (its --memory budget is then one process's)\n"


def test_a_messages_without_a_key_reads_without_top_level(capsys):
    assert main(["train", "--task", "text-csv"]) == 2
    assert _err(capsys) == ("layerfreeze: error: Invalid configuration: task 'text-csv' needs data.path: a CSV "
                            "file (--data)\n")


# ---- items 10, 4: names and rows ---------------------------------------------------------------------------------


def test_a_misspelt_strategy_or_row_gets_the_closest_name(tmp_path, capsys):
    assert main(["train", "-s", "smartfz", "--run-dir", str(tmp_path / "r")]) == 2
    assert "Unknown strategy 'smartfz' (did you mean 'smartfrz'?)" in _err(capsys)
    assert main(["compare", "--rows", "none,statc", "--run-dir", str(tmp_path / "c")]) == 2
    assert "Unknown row(s) statc (did you mean 'static'?)" in _err(capsys)
    assert not (tmp_path / "r").exists() and not (tmp_path / "c").exists()


def test_a_row_named_twice_is_refused_before_anything_trains(tmp_path, capsys, monkeypatch):
    import layerfreeze.train.trainer as trainer_module

    def never(*args, **kwargs):
        raise AssertionError("a row trained before the rows were checked")

    monkeypatch.setattr(trainer_module.Trainer, "run", never)
    assert main(["compare", "--rows", "none,static,none", "--run-dir", str(tmp_path / "c")]) == 2
    assert "rows: none named more than once (--rows); each row runs once" in _err(capsys)
    assert not (tmp_path / "c").exists()


# ---- items 12, 13, 14, 22: config -------------------------------------------------------------------------------


def test_cache_short_form_as_the_readme_writes_it(tmp_path):
    # the README's `freeze.cache: on` was refused with "freeze.cache: is a section, not a value (got True)": YAML
    # reads an unquoted on as True, which the user never wrote
    path = tmp_path / "cache.yaml"
    path.write_text("freeze:\n  cache: on\n")
    assert load_config(path, []).freeze.cache.mode == "on"
    assert load_config(None, [parse_override("freeze.cache=off")]).freeze.cache.mode == "off"
    assert load_config(None, [parse_override("freeze.cache=auto")]).freeze.cache.mode == "auto"
    with pytest.raises(ConfigError, match=r"freeze.cache.mode: 'maybe' is not one of off, on, auto"):
        load_config(None, [parse_override("freeze.cache=maybe")])


def test_demote_short_form_and_how_to_write_it():
    assert load_config(None, [parse_override("freeze.demote=bfloat16")]).freeze.demote.dtype == "bfloat16"
    assert load_config(None, [parse_override("freeze.demote=cpu")]).freeze.demote.offload == "cpu"
    with pytest.raises(ConfigError) as err:
        load_config(None, [parse_override("freeze.demote=int8")])
    assert "freeze.demote: 'int8': write a dtype (bfloat16 or float16)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, [parse_override("freeze.guard=3")])
    assert "freeze.guard: is a section, not a value (got 3): set its keys" in str(err.value)


def test_a_files_own_bad_value_is_refused_where_the_command_line_replaces_it(tmp_path, capsys):
    # `train: 5` with --max-steps 2, and `batch_size: 32.5` with --batch-size, ran with the file's value dropped in
    # silence; `"epochs": true` trained one epoch (pydantic reads true as 1)
    bad = tmp_path / "k.yaml"
    for text, shown in (("train: 5\n", "train: is a section, not a value (got 5)"),
                        ("train: {batch_size: 32.5}\n", "train.batch_size: must be a whole number, got 32.5")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=rf"Config file {bad}: {re.escape(shown)}.* \(the command line sets it "
                                              r"too, but the file's value is invalid: fix or remove it\)"):
            load_config(bad, [{"train": {"max_steps": 2, "batch_size": 8}}])
    assert main(["train", "-c", str(bad), "--batch-size", "8", "--max-steps", "2"]) == 2
    assert "train.batch_size: must be a whole number, got 32.5" in capsys.readouterr().err
    bad.write_text("")  # an empty file: nothing of its own to check (the check indexed an empty key path)
    assert load_config(bad, [{"train": {"max_steps": 2}}]).train.max_steps == 2
    bad.write_text("train: {batch_size: 16, lr: 0.5}\nfreeze: {strategy: static, params: {k: 99}}\n")
    config = load_config(bad, [{"train": {"batch_size": 8}, "freeze": {"strategy": "none"}}])  # good values, replaced
    assert (config.train.batch_size, config.train.lr, config.freeze.strategy) == (8, 0.5, "none")
    for key, value in (("epochs", True), ("lr", False), ("max_steps", True), ("grad_clip", True)):
        with pytest.raises(ConfigError, match=f"train.{key}: must be a number, not {str(value).lower()}"):
            build_config({"train": {key: value}})
    assert build_config({"train": {"compile": True}, "run": {"progress": False}}).train.compile is True


def test_config_prints_a_task_that_needs_data_without_it(capsys):
    assert main(["config", "--task", "text-lm"]) == 0
    assert "task: text-lm" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="needs data.path"):  # a run still needs it
        load_config(None, [{"task": "text-lm", "model": {"name_or_path": "x"}}])


def test_a_runs_config_json_is_a_config_for_a_new_run(tmp_path, capsys):
    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    saved = build_config({"task": "fashion-mnist", "freeze": {"strategy": "static"},
                          "run": {"dir": str(run), "resume": str(run)}}).model_dump(mode="json")
    (run / "config.json").write_text(json.dumps(saved))
    config = load_config(run / "config.json")
    assert config.run.dir is None and config.run.resume is None  # the new run gets its own folder
    assert config.task == "fashion-mnist" and config.freeze.params == {"k": 10} and config.train.lr == 1e-3
    other = tmp_path / "elsewhere.json"  # any other JSON config keeps its run.dir
    other.write_text(json.dumps({"run": {"dir": str(tmp_path / "mine")}}))
    assert load_config(other).run.dir == str(tmp_path / "mine")
    assert main(["config", "--config", str(run / "config.json")]) == 0
    assert "  dir: null" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{nope")
    assert main(["config", "--config", str(tmp_path / "bad.json")]) == 2
    assert "is not valid JSON" in _err(capsys)


def test_a_strategy_preset_sized_for_the_tasks_model_does_not_reach_another_model():
    mobilenet = build_config({"task": "fashion-mnist", "freeze": {"strategy": "static"}})
    assert mobilenet.model.name_or_path == "mobilenet_v2" and mobilenet.freeze.params == {"k": 10}
    resnet = build_config({"task": "fashion-mnist", "model": {"name_or_path": "resnet18", "pretrained": False},
                           "freeze": {"strategy": "static"}})
    assert resnet.freeze.params == {}  # static's own k=1: fits the 6 blocks of a ResNet-18
    assert build_config({"task": "bbc-news", "model": {"name_or_path": "/my/bert"},
                         "freeze": {"strategy": "static"}}).freeze.params == {}
    assert build_config({"freeze": {"strategy": "static"}}).freeze.params == {"k": 5}  # MiniLM-L6: its preset


def test_compare_rows_on_resnet18_pass_the_block_check_and_a_bad_k_names_the_flag(tmp_path):
    from layerfreeze.train.compare import _check_block_params, row_config

    base = {"task": "fashion-mnist", "model": {"name_or_path": "resnet18"}}  # from scratch: it has no weights here
    configs = [(row, build_config(row_config(base, row, tmp_path))) for row in ("none", "static")]
    _check_block_params(configs)  # the task's default rows on another model: no k=10 applied (the exit 2)
    bad = [("static", build_config(row_config({**base, "freeze": {"strategy": "static", "params": {"k": 10}}},
                                              "static", tmp_path)))]
    with pytest.raises(ConfigError) as err:
        _check_block_params(bad)
    assert "row static: freeze.params: static: k=10 would freeze the head; this model has 6 blocks" in str(err.value)
    assert "set this row's parameter with -p static.NAME=VALUE" in str(err.value)
    with pytest.raises(ConfigError, match="model.pretrained is true but resnet18 has no offline pretrained weights"):
        _check_block_params([("static", build_config(row_config(
            {"task": "fashion-mnist", "model": {"name_or_path": "resnet18", "pretrained": True}}, "static",
            tmp_path)))])


# ---- item 11: a model family registered twice ------------------------------------------------------------------


def test_a_family_registered_again_from_the_same_definition_replaces_it_and_another_is_named():
    from layerfreeze.models import registry

    source = "from layerfreeze.models import register_blocks\n@register_blocks('Tower43', order=50)\n" \
             "def discover_tower(model):\n    return None\n"
    first, again = {"__name__": "notebook"}, {"__name__": "notebook"}
    try:
        exec(source, first)
        exec(source, again)  # the notebook cell run again
        assert registry.DISCOVERERS["Tower43"] is again["discover_tower"]
        assert [n for n in registry.DISCOVERERS if n == "Tower43"] == ["Tower43"]
        with pytest.raises(ValueError) as err:
            exec(source, {"__name__": "other_module"})
        message = str(err.value)
        assert "a block discoverer named 'Tower43' is already registered (notebook.discover_tower)" in message
        assert "to replace it, call layerfreeze.models.registry.unregister('Tower43') first" in message
    finally:
        registry.unregister("Tower43")


# ---- item 18: the library's warnings, one line for people ----------------------------------------------------


def test_the_librarys_warnings_print_as_one_line_and_others_as_python_prints_them(monkeypatch, capsys):
    inside = str(Path(layerfreeze.__file__).parent / "train" / "trainer.py")

    def run(args, console):
        warnings.warn_explicit("strategy 'lisa' asked to thaw layer.1, in the Freezer's floor: they stay frozen",
                               UserWarning, inside, 235)
        warnings.warn_explicit("something of torch's", UserWarning, "/somewhere/torch/nn/module.py", 7)
        return 0

    monkeypatch.setattr(cli_entry, "_run", run)
    with pytest.warns(UserWarning, match="something of torch's") as seen:  # Python's own path (pytest records it)
        assert main(["strategies"]) == 0
    err = _err(capsys)
    assert err == ("layerfreeze: warning: strategy 'lisa' asked to thaw layer.1, in the Freezer's floor: they stay "
                   "frozen\n")
    assert [str(w.message) for w in seen] == ["something of torch's"]


# ---- item 6: the ledger's records read back ------------------------------------------------------------------


def test_a_ledger_snapshot_reads_a_whole_step_record_back_with_its_step():
    import torch
    from torch import nn

    from layerfreeze import MemoryLedger
    from layerfreeze.runs.ledger import LedgerSnapshot

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    with MemoryLedger(model, optimizer) as ledger:
        with ledger.step():
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
    memory = json.loads(json.dumps(ledger.last.to_record()))
    record = {"type": "step", "step": 7, "loss": 0.5, "memory": memory}
    snap = LedgerSnapshot.from_record(record)
    assert snap.step == 7 and snap.to_record() == memory and snap.buckets["optimizer"] > 0
    assert LedgerSnapshot.from_record(memory, step=3).step == 3
    with pytest.raises(ValueError, match="step 8's record holds no memory ledger sample"):
        LedgerSnapshot.from_record({"type": "step", "step": 8, "loss": 0.4})


# ---- items 2, 3, 7, 8, 13, 15, 19 on a tiny BERT --------------------------------------------------------------


@pytest.mark.assets("minilm")  # tiny_bert_dir: MiniLM's tokenizer
def test_blocks_of_a_text_csv_model_need_no_data(tiny_bert_dir, tiny_csv, capsys):
    assert main(["blocks", "--task", "text-csv", "--model", str(tiny_bert_dir)]) == 0
    out = capsys.readouterr().out
    assert "5 blocks" in out and "bert.encoder.layer.1" in out and "classifier" in out
    # the head's size is the placeholder's, which the table showed as the model's: said so
    assert "head: sized here for 2 classes (no --data to read the classes from" in out
    assert main(["blocks", "--task", "text-csv", "--model", str(tiny_bert_dir), "--data", str(tiny_csv)]) == 0
    assert "head: sized here" not in capsys.readouterr().out


@pytest.mark.assets("minilm")
def test_plan_check_beyond_the_run_says_so_and_the_table_fits_120_columns(tmp_path, tiny_bert_dir, tiny_csv, capsys):
    flags = ["--task", "text-csv", "--data", str(tiny_csv), "--model", str(tiny_bert_dir), "--set",
             "model.max_length=16", "--batch-size", "8", "--max-steps", "2", "--no-progress"]
    assert main(["plan", "--memory", "60%", *flags, "--check", "20", "--run-dir", str(tmp_path / "check")]) == 0
    out = capsys.readouterr().out
    assert ("check: --check 20 is more than the run's 2 steps (train.max_steps 2, of 3 epoch(s) of 5); checking all 2"
            in out)
    assert "check: training 2 steps under the plan" in out
    assert json.loads((tmp_path / "check" / "summary.json").read_text())["steps"] == 2
    drawn = [line for line in out.splitlines() if line[:1] in "┏┃┡│└"]
    assert drawn and max(map(len, drawn)) <= 120
    head = next(line for line in drawn if "frozen up to" in line)
    assert "gives back" in head and "cache (all samples)" not in out
    k0 = next(line for line in drawn if line.startswith("│ 0 "))
    assert k0.split("│")[3].strip() == "-"  # nothing frozen gives nothing back
    assert "k=0 has one when the strategy freezes later" in out


@pytest.mark.assets("minilm")
def test_a_run_that_fails_while_it_is_set_up_prints_its_error_alone(tmp_path, tiny_bert_dir, tiny_csv, capsys):
    # the run header ("layerfreeze text-csv | strategy static ...") came before the one-line error of a k out of range
    flags = ["--task", "text-csv", "--data", str(tiny_csv), "--model", str(tiny_bert_dir), "--set",
             "model.max_length=16", "--batch-size", "8", "--max-steps", "1", "--no-progress", "-s", "static"]
    assert main(["train", *flags, "-p", "k=100", "--run-dir", str(tmp_path / "bad")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("layerfreeze: error: freeze.params: static: k=100 would")
    assert main(["train", *flags, "-p", "k=1", "--run-dir", str(tmp_path / "good")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("layerfreeze text-csv | strategy static") and lines[1].startswith("cache: auto")
    assert lines[2] == f"run dir {tmp_path / 'good'}"


@pytest.mark.assets("minilm")
def test_a_demoted_run_names_demotion_up_front_and_where_its_master_copies_went(tmp_path, tiny_bert_dir, tiny_csv,
                                                                               capsys):
    run = tmp_path / "run"
    assert main(["train", "--task", "text-csv", "--data", str(tiny_csv), "--model", str(tiny_bert_dir), "-s",
                 "static", "-p", "k=2", "--set", "freeze.demote=bfloat16", "--set", "model.max_length=16",
                 "--batch-size", "8", "--max-steps", "2", "--no-progress", "--no-report", "--no-tensorboard",
                 "--set", "run.device=cpu", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("layerfreeze text-csv | strategy static {'k': 2} | demote bfloat16 (float32 "
                                   "master copies: auto)")
    flat = " ".join(out.replace("│", " ").split())  # the table folds long values over lines
    assert f"bfloat16: 2 block(s) demoted at the end; float32 master copies on disk in {run / 'demoted'}" in flat
    assert "during the run (deleted at the end, the blocks given their float32 weights back)" in flat
    assert not any((run / "demoted").rglob("*.safetensors"))  # deleted, as the line says
    summary = json.loads((run / "summary.json").read_text())
    assert summary["demote"]["master_places"] == ["disk"]
    # item 8: metrics.jsonl counts epochs from 0, what people read from 1 (the README says so)
    freeze = next(r for r in read_metrics(run) if r.get("kind") == "freeze")
    assert freeze["epoch"] == 0 and "bert.embeddings" in out and "frozen at step 0 (before training)" in out
    assert "The files count epochs from 0, as Python does" in " ".join(README.read_text(encoding="utf-8").split())


def test_run_header_names_the_ranks_sharding_and_budget():
    config = build_config({"freeze": {"strategy": "static", "memory_budget": "60%"}, "run": {"parallel": "fsdp"}})
    assert cli_commands.run_header(config, world=2) == (
        "[bold]layerfreeze[/] bbc-news | strategy static {'k': 5} | 2 ranks, "
        "FSDP2 (each holds a shard) | memory budget 60%")


def test_messages_that_hold_brackets_print_as_they_are(tmp_path, capsys, monkeypatch):
    # a surviving rank's RankLostError carries gloo's "[/__w/pytorch/.../pair.cc:561]": rich read it as a closing
    # markup tag and raised MarkupError, hiding the lost rank and the resume command; a value with "[/b]" too
    from layerfreeze.distributed.comm import RankLostError
    from layerfreeze.train.trainer import Trainer

    assert main(["train", "--set", "train.optimizer=a[/b]", "--run-dir", str(tmp_path / "bad")]) == 2
    assert _err(capsys) == "layerfreeze: error: Invalid configuration: train.optimizer: 'a[/b]' is not one of " \
                           "adamw, sgd\n"

    def lost(self):
        raise RankLostError("rank 1 stopped: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] "
                            "Connection closed by peer")

    monkeypatch.setattr(Trainer, "run", lost)
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--no-progress"]) == 1
    err = _err(capsys)
    assert err.startswith("layerfreeze: error: rank 1 stopped: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/"
                          "tcp/pair.cc:561] Connection closed by peer\nThe last complete checkpoint in "), err
    assert f"is resumable: layerfreeze train --resume {tmp_path / 'run'}" in err
