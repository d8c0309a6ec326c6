"""Issue 43, the fourth newcomer run: a resume says what the command line changes and refuses what a run keeps
(before anything is written), paths say what they are, a corrupt image is named in one line, Ctrl-C in
``plan --check`` is exit 130 without a traceback, and ``train.compile`` / bare-integer budgets get one clear line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.transforms import ToTensor

from layerfreeze.cli import main
from layerfreeze.cli.commands import resume_changes
from layerfreeze.errors import ConfigError
from layerfreeze.train.config_load import load_config
from layerfreeze.train.data import ImageFolderDictDataset


def _one_line(capsys, start: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(start), err
    return err


def _text_csv(tiny_bert_dir: Path, tiny_csv: Path, run_dir: Path, **train) -> dict:
    return load_config(None, [{"task": "text-csv", "model": {"name_or_path": str(tiny_bert_dir), "max_length": 16},
                               "data": {"path": str(tiny_csv)}, "freeze": {"strategy": "none"},
                               "train": {"batch_size": 8, "max_steps": 2, "lr": 1e-3, **train},
                               "run": {"dir": str(run_dir), "progress": False, "tensorboard": False}}]
                       ).model_dump(mode="json")


# ---- resume: what changes, what a run keeps -----------------------------------------------------------------------


def test_resume_changes_lists_each_change_and_refuses_what_the_run_trains_on(tmp_path, tiny_bert_dir, tiny_csv):
    saved = _text_csv(tiny_bert_dir, tiny_csv, tmp_path / "r")
    changed = json.loads(json.dumps(saved))
    changed["train"].update(epochs=5, max_steps=4)
    changed["run"]["ledger"] = True  # run.* is where the run is written, not what it trains: not listed
    assert resume_changes(tmp_path / "r", saved, changed) == [
        "train.epochs 3 -> 5 (from the command line)", "train.max_steps 2 -> 4 (from the command line)"]
    assert resume_changes(tmp_path / "r", saved, saved) == []
    # a strategy parameter set where the run had none, and taken away: refused, named as it is (the message read
    # "freeze.params {} -> None" for -p num_intervals=5)
    params = json.loads(json.dumps(saved))
    params["freeze"]["params"] = {"num_intervals": 5}
    for before, after, shown in ((saved, params, "None -> 5"), (params, saved, "5 -> None")):
        with pytest.raises(ConfigError, match=f"keeps what it trains and on what \\(freeze.params.num_intervals "
                                              f"{shown}\\)"):
            resume_changes(tmp_path / "r", before, after)
    for key, value, shown in (("batch_size", 4, "train.batch_size 8 -> 4"), ("seed", 1, "train.seed 0 -> 1")):
        other = json.loads(json.dumps(saved))
        other["train"][key] = value
        with pytest.raises(ConfigError, match=f"a resumed run keeps what it trains and on what \\({shown}\\)"):
            resume_changes(tmp_path / "r", saved, other)
    # the optimizer's settings: the checkpoint's optimizer state brought back the old lr / weight decay over a new one
    # (announced, then ignored), and sgd over an AdamW state failed the first step with KeyError 'momentum'
    for key, value, shown in (("lr", 0.5, "train.lr 0.001 -> 0.5"), ("weight_decay", 50.0, "train.weight_decay"),
                              ("optimizer", "sgd", "train.optimizer 'adamw' -> 'sgd'"),
                              ("momentum", 0.5, "train.momentum 0.9 -> 0.5"), ("lr_decay", 2.0, "train.lr_decay")):
        other = json.loads(json.dumps(saved))
        other["train"][key] = value
        with pytest.raises(ConfigError, match=f"a resumed run keeps its optimizer and the optimizer's settings "
                                              f"\\(the checkpoint's optimizer state brings them back\\) \\({shown}"):
            resume_changes(tmp_path / "r", saved, other)
    other = json.loads(json.dumps(saved))
    other["data"]["path"] = str(tmp_path / "other.csv")
    with pytest.raises(ConfigError, match="data.path"):
        resume_changes(tmp_path / "r", saved, other)
    # how the frozen blocks are held: `--resume RUN --memory-budget 50%` froze the budget's prefix over blocks the
    # checkpoint had trained, stopped at the checksum check blaming "something outside the optimizer", and had already
    # written the budget into config.json (every later plain resume failed the same way); a demotion set or changed
    # was refused late, saying nothing in the folder could be resumed
    for section, value, shown in (("memory_budget", "50%", "freeze.memory_budget None -> '50%'"),
                                  ("demote", {"dtype": "bfloat16"}, "freeze.demote.dtype None -> 'bfloat16'")):
        other = json.loads(json.dumps(saved))
        other["freeze"][section] = value
        with pytest.raises(ConfigError, match=rf"a resumed run keeps how its frozen blocks are held .* \({shown}"):
            resume_changes(tmp_path / "r", saved, other)
        with pytest.raises(ConfigError, match=rf"\({shown.split(' ')[0]} .* -> None"):
            resume_changes(tmp_path / "r", other, saved)  # taken away
    budgeted, same = (json.loads(json.dumps(saved)) for _ in range(2))
    budgeted["freeze"]["memory_budget"], same["freeze"]["memory_budget"] = "0.6", "60%"  # one budget, two spellings
    assert resume_changes(tmp_path / "r", budgeted, same) == []


@pytest.mark.assets("minilm")
def test_a_refused_resume_writes_nothing_and_an_allowed_change_is_printed_and_kept(tmp_path, tiny_bert_dir, tiny_csv,
                                                                                    capsys):
    run = tmp_path / "r"
    run.mkdir()  # a run stopped before its first checkpoint: its config.json alone
    (run / "config.json").write_text(json.dumps(_text_csv(tiny_bert_dir, tiny_csv, run)))
    before = (run / "config.json").read_bytes()
    assert main(["train", "--resume", str(run), "--batch-size", "4"]) == 2
    _one_line(capsys, f"layerfreeze: error: --resume {run}: a resumed run keeps what it trains and on what "
                      "(train.batch_size 8 -> 4); drop those flags, or start a new run")
    assert (run / "config.json").read_bytes() == before and [p.name for p in run.iterdir()] == ["config.json"]

    assert main(["train", "--resume", str(run), "--max-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "resume: train.max_steps 2 -> 3 (from the command line)" in out
    assert "has no checkpoint yet (the run stopped before its first one): starting it again" in out
    assert json.loads((run / "config.json").read_text())["train"]["max_steps"] == 3
    assert json.loads((run / "summary.json").read_text())["steps"] == 3


# ---- paths say what they are ----------------------------------------------------------------------------------------


def test_config_resume_report_and_model_paths_say_what_they_are(tmp_path, tiny_csv, capsys):
    folder, file = tmp_path / "folder", tmp_path / "file.txt"
    folder.mkdir()
    file.write_text("x")
    assert main(["train", "--config", str(folder)]) == 2
    _one_line(capsys, f"layerfreeze: error: --config {folder} is a folder: give a YAML, TOML or JSON config file")
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    _one_line(capsys, f"layerfreeze: error: --config {tmp_path / 'nope.yaml'} does not exist")
    assert main(["train", "--resume", str(file)]) == 2
    _one_line(capsys, f"layerfreeze: error: --resume {file}: is a file (give the run folder `layerfreeze train` wrote")
    assert main(["train", "--resume", str(folder)]) == 2
    _one_line(capsys, f"layerfreeze: error: --resume {folder}: not a layerfreeze run folder (no config.json)")
    assert main(["report", str(tmp_path / "nope")]) == 2
    _one_line(capsys, f"layerfreeze: error: report: {tmp_path / 'nope'} does not exist: give a folder "
                      "`layerfreeze train`")
    assert main(["train", "--task", "text-csv", "--data", str(tiny_csv), "--model", str(tmp_path / "nope")]) == 2
    _one_line(capsys, f"layerfreeze: error: model.name_or_path {tmp_path / 'nope'} does not exist: give a local "
                      "Hugging Face model folder")
    assert main(["train", "--task", "text-csv", "--data", str(tiny_csv), "--model", str(file)]) == 2
    _one_line(capsys, f"layerfreeze: error: model.name_or_path {file} is a file")


def test_a_corrupt_image_is_named_in_one_config_error(tmp_path):
    for name in ("cats", "dogs"):
        (tmp_path / name).mkdir()
        Image.new("RGB", (8, 8), (10, 20, 30)).save(tmp_path / name / "ok.png")
    (tmp_path / "dogs" / "broken.png").write_bytes(b"not a png at all")
    data = ImageFolderDictDataset(ImageFolder(str(tmp_path), transform=ToTensor()))
    assert data[0]["pixel_values"].shape == (3, 8, 8) and int(data[0]["labels"]) == 0
    broken = next(i for i, (path, _) in enumerate(data.dataset.samples) if path.endswith("broken.png"))
    with pytest.raises(ConfigError, match=r"data.path: .*broken\.png is not a readable image "
                                          r"\(UnidentifiedImageError\); remove or convert it \(converted in place, "
                                          r"under the same name, the run resumes; removed, the data changed: start a "
                                          r"new run\)"):
        data[broken]


# ---- plan --check interrupted, one-line config values ---------------------------------------------------------------


@pytest.mark.assets("minilm")
def test_ctrl_c_in_plan_check_is_exit_130_and_one_line(tmp_path, tiny_bert_dir, tiny_csv, capsys, monkeypatch):
    from layerfreeze.train.trainer import Trainer

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "run", interrupted)
    flags = ["--task", "text-csv", "--data", str(tiny_csv), "--model", str(tiny_bert_dir), "--set",
             "model.max_length=16", "--batch-size", "8", "--max-steps", "2", "--no-progress"]
    assert main(["plan", "--memory", "60%", *flags, "--check", "2"]) == 130
    captured = capsys.readouterr()
    assert "check: interrupted; the plan above stands (no check figures)" in captured.out
    assert captured.err == "" and "Traceback" not in captured.out


def test_compile_and_bare_integer_budgets_get_one_clear_line(capsys):
    assert main(["config", "--set", "train.compile=maybe"]) == 2
    _one_line(capsys, "layerfreeze: error: Invalid configuration: train.compile: 'maybe': use false (eager), blocks "
                      "(each block compiled on its own) or true (the whole model)")
    assert main(["config", "--set", "freeze.memory_budget=60"]) == 2
    err = _one_line(capsys, "layerfreeze: error: Invalid configuration: freeze.memory_budget: memory budget 60: a "
                            "bare number is read as bytes")
    assert "write 60% for a share of the peak with nothing frozen, a size such as 60MiB or 60GiB" in err
    assert main(["config", "--set", "train.compile=blocks", "--set", "freeze.memory_budget=60%"]) == 0
    out = capsys.readouterr().out  # the accepted values load and are printed as given
    assert "compile: blocks" in out and "memory_budget: 60%" in out


# ---- strategy parameters: checked by `config` as by `train`, listed readably; the Freezer's run length ------------


def test_config_checks_strategy_values_and_strategies_lists_short_floats(capsys):
    assert main(["config", "-s", "static", "-p", "k=abc"]) == 2
    _one_line(capsys, "layerfreeze: error: freeze.params: static: k must be an integer >= 0 (number of leading "
                      "blocks to freeze), got 'abc'")
    assert main(["config", "-s", "smartfrz", "-p", "threshold=2"]) == 2
    _one_line(capsys, "layerfreeze: error: freeze.params: smartfrz: threshold must be in (0, 1)")
    assert main(["config", "-s", "static", "-p", "k=3"]) == 0
    assert "k: 3" in capsys.readouterr().out
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    assert "geometric  params: alpha=0.333333\n" in out and "0.3333333333" not in out


@pytest.mark.parametrize("value", ["100", 0, -5, True, 1.5])
def test_the_freezer_refuses_a_run_length_that_is_not_a_whole_number_of_steps(value):
    import torch

    from layerfreeze import Freezer

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    for name in ("total_steps", "steps_per_epoch"):
        with pytest.raises(ValueError, match=rf"Freezer\({name}={value!r}\): give a whole number of optimizer "
                                             r"steps >= 1 \(e.g. epochs \* len\(train_loader\)\), or leave it out"):
            Freezer(model, strategy="linear", **{name: value})


def test_the_freezer_takes_a_numpy_integer_run_length_as_an_int():
    import numpy as np
    import torch

    from layerfreeze import Freezer

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    freezer = Freezer(model, strategy="linear", total_steps=np.int64(40), steps_per_epoch=np.int32(10))
    assert type(freezer.total_steps) is int and freezer.total_steps == 40 and freezer.steps_per_epoch == 10


@pytest.mark.assets("minilm")
def test_a_resume_runs_from_any_folder_and_its_first_step_takes_the_new_schedules_lr(tmp_path, tiny_bert_dir,
                                                                                      tiny_csv, capsys, monkeypatch):
    # config.json kept data.path as typed ("texts.csv"): the resume from any other folder failed, "data.path
    # texts.csv does not exist", and --data with its full path was refused as a change. The resume onto a longer
    # run rebuilt the schedule, but its first step ran at the LR the old plan had saved (0 past its end: the step
    # changed nothing); and each step's record logged the next step's LR (the curve one step early, ending at 0)
    from safetensors.torch import load_file

    from layerfreeze.runs.rundir import read_metrics

    monkeypatch.chdir(tiny_csv.parent)
    run = tmp_path / "r"
    args = ["train", "--task", "text-csv", "--model", str(tiny_bert_dir), "--data", tiny_csv.name, "--strategy",
            "none", "--max-steps", "1", "--lr", "1e-3", "--batch-size", "8", "--set", "model.max_length=16",
            "--no-progress", "--run-dir", str(run)]
    assert main(args) == 0
    assert json.loads((run / "config.json").read_text())["data"]["path"] == str(tiny_csv.resolve())
    (run / "summary.json").unlink()  # as a run killed after its last checkpoint
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", str(run), "--max-steps", "2", "--no-progress"]) == 0
    lrs = [r["lr"] for r in read_metrics(run) if r.get("type") == "step"]
    assert lrs == [1e-3, 1e-3 * (1 - 1 / 2)]  # warm-up 0; linear: the run's first step at 1e-3, then the new plan's
    first, second = (load_file(next((run / "checkpoints").glob(f"*-step00000000{s}")) / "model.safetensors")
                     for s in (1, 2))
    assert any(not first[k].equal(second[k]) for k in first)  # the resumed step trained
    # a run saved before paths were kept absolute, resumed from another folder: what to do, then --data works
    capsys.readouterr()
    (run / "summary.json").unlink()
    saved = json.loads((run / "config.json").read_text())
    saved["data"]["path"] = tiny_csv.name
    saved["model"]["name_or_path"] = tiny_bert_dir.name
    (run / "config.json").write_text(json.dumps(saved))
    assert main(["train", "--resume", str(run), "--max-steps", "3", "--no-progress"]) == 2
    _one_line(capsys, f"layerfreeze: error: --resume {run}: its data.path 'texts.csv' is relative to the folder the "
                      f"run was started in, and {tmp_path} has no texts.csv: run the resume from that folder, or give "
                      "--data with its path from here")
    assert main(["train", "--resume", str(run), "--max-steps", "3", "--no-progress", "--data", str(tiny_csv)]) == 2
    _one_line(capsys, f"layerfreeze: error: --resume {run}: its model.name_or_path '{tiny_bert_dir.name}' is relative")
    assert main(["train", "--resume", str(run), "--max-steps", "3", "--no-progress", "--data", str(tiny_csv),
                 "--model", str(tiny_bert_dir)]) == 0
    assert [r["step"] for r in read_metrics(run) if r.get("type") == "step"] == [1, 2, 3]


@pytest.mark.assets("minilm")
def test_a_resume_onto_a_longer_run_gives_freezeouts_factors_for_the_new_length(tmp_path, tiny_bert_dir, tiny_csv):
    # the first resumed step multiplied the new schedule's LR by the factors FreezeOut had computed for the old length
    # (0.0004 where a run of the new length ran 0.00068): the restored factors are computed again
    from layerfreeze.runs.rundir import read_metrics

    common = ["--task", "text-csv", "--model", str(tiny_bert_dir), "--data", str(tiny_csv), "--strategy",
              "freezeout", "--batch-size", "8", "--limit-train", "32", "--limit-test", "8", "--lr", "1e-3", "--set",
              "model.max_length=16", "--no-progress", "--no-tensorboard", "--no-report"]
    assert main(["train", *common, "--epochs", "2", "--run-dir", str(tmp_path / "straight")]) == 0
    assert main(["train", *common, "--epochs", "1", "--run-dir", str(tmp_path / "cut")]) == 0
    (tmp_path / "cut" / "summary.json").unlink()  # as a run killed after its last checkpoint, at step 4
    assert main(["train", "--resume", str(tmp_path / "cut"), "--epochs", "2", "--no-progress"]) == 0
    straight, resumed = ({r["step"]: r["lr"] for r in read_metrics(tmp_path / name) if r.get("type") == "step"}
                         for name in ("straight", "cut"))
    assert sorted(resumed) == list(range(1, 9)) and resumed[4] != straight[4]  # the cut run's own plan until step 4
    assert [resumed[s] for s in range(5, 9)] == [straight[s] for s in range(5, 9)]


def test_an_architecture_name_stays_a_name_beside_a_folder_of_that_name(tmp_path, monkeypatch, tiny_csv):
    # model.name_or_path was made absolute whenever a folder of that name was here: "Unknown vision model
    # '/.../resnet18'"; a text task's model folder given relative is kept absolute
    monkeypatch.chdir(tmp_path)
    (tmp_path / "resnet18").mkdir()
    (tmp_path / "my-bert").mkdir()
    image = load_config(None, [{"task": "fashion-mnist", "model": {"name_or_path": "resnet18"}}])
    text = load_config(None, [{"task": "text-csv", "model": {"name_or_path": "my-bert"},
                               "data": {"path": str(tiny_csv)}}])
    assert image.model.name_or_path == "resnet18" and text.model.name_or_path == str(tmp_path / "my-bert")


def test_the_printed_paths_are_the_run_folders_own_and_paste_into_a_shell(tmp_path, tiny_bert_dir, tiny_csv, capsys):
    """A run folder named `[lr=1] a`: rich read `[lr=1]` as a style tag and printed `metrics: runs/ a/metrics.jsonl`
    and `report: runs/ a/report/...`; the space left `tensorboard --logdir` and `train --resume` lines that do not
    paste into a shell."""
    import shlex

    from layerfreeze.cli import main

    run = tmp_path / "[lr=1] a"
    assert main(["train", "--task", "text-csv", "--model", str(tiny_bert_dir), "--data", str(tiny_csv), "-s", "none",
                 "--max-steps", "1", "--batch-size", "8", "--set", "model.max_length=16", "--no-progress",
                 "--no-tensorboard", "--run-dir", str(run)]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith(("metrics: ", "report: "))]
    metrics, logdir = lines[0].removeprefix("metrics: ").split("   TensorBoard: ")
    assert shlex.split(metrics) == [str(run / "metrics.jsonl")]
    assert shlex.split(logdir) == ["tensorboard", "--logdir", str(run)]
    assert shlex.split(lines[1].removeprefix("report: ")) == [str(run / "report" / "index.html")]
    assert main(["report", str(run)]) == 0
    assert shlex.split(capsys.readouterr().out.removeprefix("report: ")) == [str(run / "report" / "index.html")]
