"""Issue 43, the third newcomer run: every user error is one line (config and YAML errors, argparse's), outputs that
cannot be written and inputs that do not exist are named before anything is measured or trained, data a task does
not read is refused, and what people read says what it means (help, the budget under compare, the timeline)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from layerfreeze.cli import main
from layerfreeze.cli import parser as cli_parser
from layerfreeze.runs.compare_table import budget_note, markdown_table, rich_table
from layerfreeze.runs.summary import summary_table


def _err(capsys) -> str:
    return capsys.readouterr().err


def _one_line(err: str, start: str) -> str:
    assert err.count("\n") == 1 and err.startswith(start), err
    return err


# ---- one line per error ------------------------------------------------------------------------------------------


def test_yaml_syntax_config_values_and_unknown_flags_are_one_line_each(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: [1\n")
    assert main(["train", "--config", str(bad)]) == 2
    err = _one_line(_err(capsys), "layerfreeze: error: Config file")
    assert "is not valid YAML: expected ',' or ']', but got '<stream end>' (line 3, column 1)" in err
    values = tmp_path / "values.yaml"
    values.write_text("train:\n  epochs: 0\n  lr: abc\n")
    assert main(["train", "--config", str(values)]) == 2
    err = _one_line(_err(capsys), "layerfreeze: error: Invalid configuration: train.epochs: must be >= 1, got 0; "
                                  "train.lr: must be a number, got 'abc'")
    with pytest.raises(SystemExit) as exc:
        main(["train", "--epocs", "2"])
    assert exc.value.code == 2
    err = _one_line(_err(capsys), "layerfreeze train: error: unrecognized arguments: --epocs 2 (--epocs: did you mean "
                                  "--epochs?); layerfreeze train --help lists the options")
    with pytest.raises(SystemExit) as exc:  # argparse's own errors (a bad type) get the pointer to --help too
        main(["train", "--epochs", "two"])
    _one_line(_err(capsys), "layerfreeze train: error: argument --epochs: invalid int value: 'two'; "
                            "layerfreeze train --help lists the options")


def test_a_nan_or_infinity_in_any_float_key_is_refused_as_not_finite(tmp_path, capsys):
    # `lr: .nan` said "train.lr: must be <= 10, got nan", as if nan were too large; `inf` the same
    assert main(["train", "--lr", "nan"]) == 2
    _one_line(_err(capsys), "layerfreeze: error: Invalid configuration: train.lr: must be a finite number, got 'nan'")
    config = tmp_path / "nan.yaml"
    config.write_text("train:\n  lr: .nan\n  weight_decay: .inf\ndata: {test_fraction: -.inf}\n"
                      "freeze:\n  memory_budget: .nan\n  guard: {tolerance: .inf}\n")
    assert main(["train", "--config", str(config)]) == 2
    err = _one_line(_err(capsys), "layerfreeze: error: Invalid configuration: ")
    for key, value in (("data.test_fraction", "-inf"), ("train.lr", "nan"), ("train.weight_decay", "inf"),
                       ("freeze.guard.tolerance", "inf"), ("freeze.memory_budget", "nan")):
        assert f"{key}: must be a finite number, got {value}" in err, key
    assert "must be <=" not in err and "must be >" not in err and err.count("must be") == 5  # one error per key
    assert main(["train", "--set", "run.checkpoint_every_minutes=.inf"]) == 2
    _one_line(_err(capsys), "layerfreeze: error: Invalid configuration: run.checkpoint_every_minutes: must be a "
                            "finite number, got inf")


def test_version_and_no_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    from layerfreeze import __version__

    assert capsys.readouterr().out == f"layerfreeze {__version__}\n"
    assert main([]) == 2  # the help, and the exit code of a missing argument
    assert "COMMAND" in capsys.readouterr().out


# ---- inputs that are not there, data a task does not read ---------------------------------------------------------


def test_data_the_task_does_not_read_is_refused_and_missing_inputs_are_named(tmp_path, capsys):
    run = ["--run-dir", str(tmp_path / "r")]
    assert main(["train", "--data", "nope.csv", *run]) == 2  # bbc-news reads its installed dataset
    _one_line(_err(capsys), "layerfreeze: error: Invalid configuration: data.path is read by the text-csv, "
                            "image-folder and text-lm tasks; task 'bbc-news' trains on its installed dataset. Drop "
                            "--data")
    assert main(["train", "--task", "fashion-mnist", "--set", "data.test_path=t", *run]) == 2
    assert "data.test_path is read by the text-csv" in _err(capsys)
    assert main(["train", "--task", "text-csv", "--data", str(tmp_path / "nope.csv"), *run]) == 2
    _one_line(_err(capsys), f"layerfreeze: error: Invalid configuration: data.path {tmp_path / 'nope.csv'} does not "
                            "exist")
    assert main(["train", "--task", "text-csv", "--data", str(tmp_path), *run]) == 2  # a folder, not a CSV
    assert f"data.path {tmp_path} is a folder; text-csv reads a CSV file (columns 'text' and 'label')" in _err(capsys)
    assert main(["train", "--resume", str(tmp_path / "gone")]) == 2
    _one_line(_err(capsys), f"layerfreeze: error: --resume {tmp_path / 'gone'}: does not exist")
    assert not (tmp_path / "r").exists()


@pytest.mark.assets("minilm")
def test_an_empty_csv_or_one_with_only_a_header_says_so(tmp_path, capsys):
    # both read as "no column 'text'; columns present: []" (0 bytes) or "no data rows" (a header alone), which said
    # nothing of what to write
    data = tmp_path / "empty.csv"
    data.write_bytes(b"")
    run = ["--task", "text-csv", "--data", str(data), "--run-dir", str(tmp_path / "r")]
    assert main(["train", *run]) == 2
    _one_line(_err(capsys), f"layerfreeze: error: data file {data} is empty (0 bytes): a CSV file starts with a header "
                            "row naming its columns (text,label), then one row per sample\n")
    data.write_text("text,topic\n", encoding="utf-8")
    assert main(["train", *run, "--set", "data.label_column=topic"]) == 2
    _one_line(_err(capsys), f"layerfreeze: error: data file {data} has a header row but no data rows: add one row per "
                            "sample below it (text,topic)\n")
    assert not (tmp_path / "r").exists()


def test_an_image_folder_without_images_names_data_path_in_one_line(tmp_path, capsys):
    for name in ("cats", "dogs", "notes"):  # class folders, but no image in them (torchvision lists them all)
        (tmp_path / "imgs" / name).mkdir(parents=True)
        (tmp_path / "imgs" / name / "readme.txt").write_text("x")
    assert main(["train", "--task", "image-folder", "--data", str(tmp_path / "imgs"), "--run-dir",
                 str(tmp_path / "r")]) == 2
    _one_line(_err(capsys), f"layerfreeze: error: data.path {tmp_path / 'imgs'} is not a folder of class sub-folders "
                            "with images (3 sub-folder(s), no image in them)")


def test_a_torchvision_name_on_a_text_task_gets_the_task_to_add(capsys):
    assert main(["blocks", "--model", "resnet18"]) == 2
    assert _err(capsys).endswith("resnet18 is a torchvision model and this task reads text: add --task "
                                 "fashion-mnist (or image-folder with --data)\n")


# ---- outputs that cannot be written: refused before anything is measured ------------------------------------------


def test_unwritable_outputs_are_refused_before_measuring(tmp_path, capsys):
    started = time.perf_counter()
    assert main(["plan", "--memory", "60%", "--json", str(tmp_path)]) == 2
    _one_line(_err(capsys), f"layerfreeze: error: --json {tmp_path} is a folder; give a file path")
    assert main(["plan", "--memory", "60%", "--json", "/proc/layerfreeze/p.json"]) == 2
    _one_line(_err(capsys), "layerfreeze: error: --json /proc/layerfreeze/p.json cannot be written (/proc is not a "
                            "writable folder)")
    assert main(["train", "--run-dir", "/proc/x"]) == 2
    _one_line(_err(capsys), "layerfreeze: error: run.dir (--run-dir) /proc/x cannot be written (/proc is not a "
                            "writable folder)")
    assert time.perf_counter() - started < 60  # nothing was measured or trained (a plan measures for minutes)


# ---- what people read -------------------------------------------------------------------------------------------


def _helps(parser: argparse.ArgumentParser) -> list[str]:
    out = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _helps(sub)
    return out


def test_help_shows_no_rest_literals_and_report_names_its_file(capsys):
    helps = _helps(cli_parser.build_parser())
    assert len(helps) > 10
    assert [h.splitlines()[0] for h in helps if "``" in h] == []
    assert any("RUN_DIR/report/index.html" in h for h in helps)
    assert main(["strategies"]) == 0
    assert "``" not in capsys.readouterr().out


def _row(name: str, k: int | None) -> dict:
    row = {"row": name, "test_accuracy": 0.9, "train_time_s": 1.0, "flops_total": 1e9, "tensor_peak_bytes": 1 << 20,
           "peak_memory_bytes": 1 << 21, "freeze_steps": {}}
    if k is not None:
        row["memory_plan"] = {"budget": "60%", "k": k}
    return row


def test_a_compare_under_a_budget_says_none_runs_with_the_frozen_floor_too():
    rows = [_row("none", 3), _row("static", 3)]
    assert budget_note(rows) == "every row under the memory budget 60%: blocks 0..2 frozen from the start, none's " \
                                "row too"
    assert "Every row under the memory budget 60%: blocks 0..2 frozen" in markdown_table(rows)
    assert "blocks 0..2 frozen" in str(rich_table(rows).title)
    assert budget_note([_row("none", 0)]) == "every row under the memory budget 60%: nothing frozen from the start"
    plain = [_row("none", None), _row("static", None)]
    assert budget_note(plain) is None and rich_table(plain).title == "layerfreeze compare"
    assert "| tensor peak | tensor peak ratio |" in markdown_table(plain)


def test_the_freeze_timeline_lists_a_step_front_to_back():
    from rich.console import Console

    blocks = [f"features.{i}" for i in range(12)]
    timeline = [{"block": b, "step": 5, "epoch": 0, "action": "freeze"} for b in ("features.10", "features.2")]
    timeline.append({"block": "features.1", "step": 3, "epoch": 0, "action": "freeze"})
    console = Console(width=120, record=True)
    console.print(summary_table({"freeze_timeline": timeline, "blocks": blocks}))
    text = console.export_text()
    lines = [line for line in text.splitlines() if "frozen at step" in line]
    assert [line.split("│")[2].split()[0] for line in lines] == ["features.1", "features.2", "features.10"], lines


@pytest.mark.assets("minilm")
def test_plan_check_without_a_run_dir_leaves_no_folder(tmp_path, tiny_bert_dir, tiny_csv, capsys, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    flags = ["--task", "text-csv", "--data", str(tiny_csv), "--model", str(tiny_bert_dir), "--set",
             "model.max_length=16", "--batch-size", "8", "--max-steps", "2", "--no-progress"]
    assert main(["plan", "--memory", "60%", *flags, "--check", "2"]) == 0
    assert "check: training 2 steps under the plan in a temporary folder (removed after" in capsys.readouterr().out
    assert list(Path(tmp_path).glob("layerfreeze-plan-check-*")) == []


def test_a_classifiers_length_beyond_its_position_embeddings_is_refused_before_training(tmp_path, tiny_bert_dir,
                                                                                        tiny_csv, capsys):
    # the tiny BERT has 64 learned positions; the default model.max_length 128 failed inside the first forward with
    # "The size of tensor a (128) must match the size of tensor b (64)", a raw traceback
    args = ["train", "--task", "text-csv", "--data", str(tiny_csv), "--model", str(tiny_bert_dir), "--run-dir",
            str(tmp_path / "r"), "--no-progress", "--epochs", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "model.max_length 128 is more than the 64 positions model.name_or_path" in err
    assert "set --set model.max_length=64 or less" in err and "Traceback" not in err
    assert not (tmp_path / "r" / "checkpoints").exists()


@pytest.mark.parametrize("name, text, said", [
    ("twice.yaml", "train:\n  lr: 1.0e-4\n  epochs: 1\n  lr: 2.0e-4\n",
     "is not valid YAML: the key 'lr' is given twice in one mapping (keep one) (line 4, column 3)"),
    ("twice.json", '{"train": {"lr": 1e-4, "epochs": 1, "lr": 2e-4}}',
     "is not valid JSON: the key(s) 'lr' are given twice in one object (keep one)"),
])
def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path, capsys, name, text, said):
    # PyYAML and json keep the last value in silence: the run trained at 2e-4 where the file also said 1e-4
    path = tmp_path / name
    path.write_text(text)
    assert main(["train", "--config", str(path)]) == 2
    assert said in _one_line(_err(capsys), "layerfreeze: error: Config file")


def test_a_config_file_not_in_utf8_or_of_another_kind_is_one_line(tmp_path, capsys):
    # a UTF-16 file from an editor gave a UnicodeDecodeError traceback (exit 1); an unknown extension said "is not
    # valid None: Config file run.cfg must end in ..."
    utf16 = tmp_path / "utf16.yaml"
    utf16.write_bytes("train:\n  epochs: 1\n".encode("utf-16"))
    assert main(["train", "--config", str(utf16)]) == 2
    said = _one_line(_err(capsys), "layerfreeze: error: Config file")
    assert said.rstrip().endswith("is not UTF-8 text (invalid start byte at byte 0): save it as UTF-8")
    other = tmp_path / "run.cfg"
    other.write_text("train:\n  epochs: 1\n")
    assert main(["config", "--config", str(other)]) == 2
    said = _one_line(_err(capsys), "layerfreeze: error: Config file")
    assert said.rstrip() == f"layerfreeze: error: Config file {other} must end in .yaml, .yml, .toml or .json"


def test_yaml_merge_keys_still_load_and_an_unhashable_key_is_one_line(tmp_path, capsys):
    # the duplicate-key check constructed `<<` as a key ("could not determine a constructor for the tag ...merge")
    # and let an unhashable key out as a TypeError traceback
    from layerfreeze.train.config_file import read_config_file

    merged = tmp_path / "merged.yaml"
    merged.write_text("base: &b {lr: 1.0e-4, epochs: 2}\nmore: &m {batch_size: 8}\n"
                      "train:\n  <<: [*b, *m]\n  lr: 2.0e-4\n")
    assert read_config_file(merged)["train"] == {"lr": 2.0e-4, "epochs": 2, "batch_size": 8}
    bad = tmp_path / "unhashable.yaml"
    bad.write_text("train:\n  ? [a, b]\n  : 1\n")
    assert main(["train", "--config", str(bad)]) == 2
    said = _one_line(_err(capsys), "layerfreeze: error:")
    assert "is not valid YAML: found unhashable key (line 2, column 5)" in said


def test_the_guard_with_freezeout_is_refused_before_training(capsys):
    # the guard's thaws of blocks FreezeOut froze trained at learning rate 0 until FreezeOut froze them again: the
    # guard did nothing, and the run said so only at each thaw
    assert main(["train", "--strategy", "freezeout", "--set", "freeze.guard={}"]) == 2
    _one_line(_err(capsys), "layerfreeze: error: Invalid configuration: freeze.guard with strategy freezeout: a block "
                            "it froze has annealed its learning rate to 0")


@pytest.mark.parametrize("args, said", [
    (["--task", "fashion-mnist", "--set", "model.max_length=64"],
     "model.max_length 64 is read by the text tasks; task 'fashion-mnist' trains on images and would ignore it"),
    (["--set", "data.image_size=64"],
     "data.image_size 64 is read by the image tasks; task 'bbc-news' trains on text and would ignore it"),
])
def test_a_key_the_task_does_not_read_is_refused(args, said, capsys):
    # --set model.max_length=64 on fashion-mnist was accepted and ignored, with nothing said
    from layerfreeze.train.config_load import load_config

    assert main(["train", *args]) == 2
    _one_line(_err(capsys), f"layerfreeze: error: Invalid configuration: {said}")
    # a run saved so before the check still resumes
    saved = {"task": "fashion-mnist", "model": {"max_length": 64}, "run": {"resume": "runs/old"}}
    assert load_config(None, [saved]).model.max_length == 64
