"""``layerfreeze`` CLI: bad input fails before training with exit code 2; real runs on the offline assets; Ctrl-C
in a real process and ``--resume``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from layerfreeze.cli import main
from layerfreeze.errors import ConfigError
from layerfreeze.runs.rundir import read_metrics
from layerfreeze.train.config import build_config
from layerfreeze.train.config_file import parse_override
from layerfreeze.train.config_load import load_config


def test_unknown_strategy_is_exit_2_listing_the_available_ones(tmp_path, capsys):
    assert main(["train", "--strategy", "nope", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "Unknown strategy 'nope'" in err and "static" in err and "none" in err
    assert not (tmp_path / "r").exists()


def test_unknown_strategy_parameter_and_bad_values(tmp_path, capsys):
    assert main(["train", "-s", "static", "-p", "depth=3"]) == 2
    assert "no parameter(s) depth" in capsys.readouterr().err
    assert main(["train", "-s", "static", "-p", "k=-1"]) == 2
    assert "k must be an integer >= 0" in capsys.readouterr().err
    assert main(["train", "-p", "k=3"]) == 2  # the default strategy (smartfrz) has no k
    err = capsys.readouterr().err
    assert "That is a parameter of static, lisa or badam: name the strategy (e.g. --strategy static)" in err
    assert main(["train", "--lr", "-1"]) == 2
    assert "train.lr" in capsys.readouterr().err


def test_bad_config_key_names_the_key(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("task: bbc-news\ntrain:\n  epochs: 2\n  learning_rate: 0.1\n")
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "train.learning_rate: unknown key" in err
    toml = tmp_path / "run.toml"
    toml.write_text('task = "fashion-mnist"\n[freeze]\nstrategy = "none"\n')
    cfg = load_config(toml)
    assert cfg.task == "fashion-mnist" and cfg.train.lr == 1e-3 and cfg.freeze.params == {}
    with pytest.raises(ConfigError, match="text-csv' needs data.path"):
        load_config(None, [{"task": "text-csv"}])


def test_default_strategy_is_smartfrz_and_task_presets_follow_the_strategy():
    default = build_config({})
    assert default.freeze.strategy == "smartfrz" and default.freeze.params == {}
    assert build_config({"freeze": {"strategy": "static"}}).freeze.params == {"k": 5}
    image = build_config({"task": "fashion-mnist", "freeze": {"strategy": "static"}})
    assert image.freeze.params == {"k": 10} and image.train.lr == 1e-3 and image.model.name_or_path == "mobilenet_v2"
    assert build_config({"freeze": {"strategy": "static", "params": {"k": 2}}}).freeze.params == {"k": 2}
    assert build_config({"task": "fashion-mnist", "freeze": {"strategy": "none"}}).freeze.params == {}


def test_cache_mode_on_off_unquoted_in_yaml_and_set(tmp_path):
    # YAML 1.1 reads unquoted on/off as booleans; the README writes `freeze.cache: {mode: on}`
    path = tmp_path / "run.yaml"
    path.write_text("freeze:\n  cache: {mode: on}\n")
    assert load_config(path).freeze.cache.mode == "on"
    assert load_config(path, [parse_override("freeze.cache.mode=off")]).freeze.cache.mode == "off"
    assert load_config(None, [parse_override("freeze.cache.mode=auto")]).freeze.cache.mode == "auto"
    with pytest.raises(ConfigError, match="freeze.cache.mode"):
        load_config(None, [parse_override("freeze.cache.mode=yes please")])


def test_missing_asset_names_the_install_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LAYERFREEZE_FASHION_MNIST_DIR", str(tmp_path))
    assert main(["train", "--task", "fashion-mnist", "--run-dir", str(tmp_path / "r")]) == 2
    assert "apt-get install dataset-fashion-mnist" in capsys.readouterr().err


@pytest.mark.assets("minilm")
def test_static_k_reaching_the_head_and_bad_block_pattern_fail_before_training(tmp_path, tiny_bert_dir, tiny_csv,
                                                                                capsys):
    base = ["train", "--task", "text-csv", "--data", str(tiny_csv), "--model", str(tiny_bert_dir), "--no-progress",
            "--set", "model.max_length=16"]  # the tiny BERT has 64 positions
    assert main([*base, "-s", "static", "-p", "k=5", "--run-dir", str(tmp_path / "a")]) == 2
    assert "would freeze the head" in capsys.readouterr().err
    assert main([*base, "--set", "model.blocks=[nothing.here]", "--run-dir", str(tmp_path / "b")]) == 2
    assert "'nothing.here' matches no module" in capsys.readouterr().err
    assert not (tmp_path / "a" / "metrics.jsonl").exists()


@pytest.mark.assets("minilm", "bbc_news")
def test_bbc_news_minilm_short_real_run(tmp_path, capsys):
    """Two real optimizer steps of MiniLM-L6 on BBC News with the default strategy (SmartFRZ), end to end: its
    recorder snapshots every block, and with fewer than ``min_window`` snapshots nothing is frozen."""
    run = tmp_path / "bbc"
    assert main(["train", "--max-steps", "2", "--limit-test", "32", "--run-dir", str(run), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "test accuracy" in out and "smartfrz" in out
    summary = json.loads((run / "summary.json").read_text())
    assert json.loads((run / "config.json").read_text())["freeze"] == {
        "strategy": "smartfrz", "params": {}, "train_bn": False, "guard": None,
        "cache": {"mode": "auto", "dtype": "float32", "budget_mb": None}, "demote": None,
            "memory_budget": None}
    assert summary["frozen_blocks"] == []
    assert summary["steps"] == 2 and summary["flops_per_step_first"] > 1e10
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.assets("fashion_mnist", "mobilenet_v2")
def test_fashion_mnist_mobilenet_v2_short_real_run(tmp_path, capsys):
    run = tmp_path / "fm"
    args = ["train", "--task", "fashion-mnist", "--strategy", "static", "--epochs", "1", "--limit-train", "256",
            "--limit-test", "128", "--run-dir", str(run), "--no-progress"]  # static: the task's preset k=10
    assert main(args) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["blocks"][-1] == "classifier" and len(summary["blocks"]) == 20
    assert summary["frozen_blocks"] == [f"features.{i}" for i in range(10)]
    assert "freeze timeline" in capsys.readouterr().out


def _cli(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "layerfreeze.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


@pytest.mark.assets("minilm")
def test_ctrl_c_or_sigterm_in_a_real_process_then_resume_equals_the_uninterrupted_run(tmp_path, tiny_bert_dir,
                                                                                     tiny_csv):
    # SIGTERM (kill, docker stop, a SLURM preemption) is answered as Ctrl-C is: the step ends, a checkpoint is written
    # and the resume is exact (before: the default action, no checkpoint since the last periodic one). One
    # uninterrupted run is the reference of both
    common = ["train", "--task", "text-csv", "--data", str(tiny_csv), "--model", str(tiny_bert_dir),
              "--epochs", "2", "--batch-size", "4", "--lr", "1e-3", "-s", "static", "-p", "k=1",
              "--no-progress", "--set", "model.max_length=32", "--set", "run.threads=1"]
    ref = _cli(*common, "--run-dir", str(tmp_path / "ref"))
    signals = {"ctrl-c": (signal.SIGINT, 130, "Interrupted."), "sigterm": (signal.SIGTERM, 143, "Stopped by SIGTERM.")}
    cuts = {name: _cli(*common, "--run-dir", str(tmp_path / name)) for name in signals}
    deadline = time.time() + 120
    waiting = dict(cuts)
    while waiting and time.time() < deadline:  # signal each run once it is a few steps into epoch 1
        for name, cut in list(waiting.items()):
            metrics = tmp_path / name / "metrics.jsonl"
            if metrics.exists() and sum('"type": "step"' in line for line in metrics.read_text().splitlines()) >= 3:
                cut.send_signal(signals[name][0])
                del waiting[name]
        time.sleep(0.05)
    assert not waiting, f"{list(waiting)} did not reach step 3 in 120 s"
    resumed = {}
    for name, cut in cuts.items():
        _, code, said = signals[name]
        out, _ = cut.communicate(timeout=120)
        assert cut.returncode == code, out
        cut_dir = tmp_path / name
        assert f"{said} A checkpoint is in" in out and f"layerfreeze train --resume {cut_dir}" in out
        stopped_at = max(r["step"] for r in read_metrics(cut_dir) if r["type"] == "step")
        assert stopped_at < 20  # 2 epochs of 10 steps (38 train rows / 4)
        resumed[name] = _cli("train", "--resume", str(cut_dir))
    ref_out, _ = ref.communicate(timeout=180)
    assert ref.returncode == 0, ref_out
    a = load_file(tmp_path / "ref" / "checkpoint" / "model.safetensors")
    for name, proc in resumed.items():
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out
        b = load_file(tmp_path / name / "checkpoint" / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), name
        assert json.loads((tmp_path / name / "summary.json").read_text())["steps"] == 20


def test_help_and_strategies_list(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    assert "--resume" in capsys.readouterr().out
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    assert "smartfrz  (default)" in out and "k=1" in out
    assert "seed=0, snr_gate=0.9, snr_noise=1.35" in out  # the gradient SNR gate: on by default (issue 29)
    assert "lisa  params: gamma=2, k=20, seed=None" in out
    assert "badam  params: k=50, order='ascending', start_block=None, include_embedding=False, seed=None" in out


@pytest.mark.assets("minilm")
def test_csv_without_the_label_column_is_exit_2_naming_the_setting(tmp_path, tiny_bert_dir, capsys):
    path = tmp_path / "texts.csv"
    path.write_text("text,category\nhello world,a\nbye world,b\n")
    args = ["train", "--task", "text-csv", "--data", str(path), "--model", str(tiny_bert_dir),
            "--run-dir", str(tmp_path / "r")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "no column 'label'" in err and "data.label_column" in err


def test_resume_refuses_finished_corrupt_and_restrategized_runs(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{not json")
    assert main(["train", "--resume", str(run)]) == 2
    assert "is not a saved layerfreeze config" in capsys.readouterr().err
    (run / "config.json").write_text(json.dumps(load_config(None, [{"freeze": {"strategy": "static"}}])
                                                .model_dump(mode="json")))
    assert main(["train", "--resume", str(run), "-s", "none"]) == 2
    assert "the run's strategy is 'static'; a resumed run keeps it" in capsys.readouterr().err
    (run / "summary.json").write_text("{}")
    assert main(["train", "--resume", str(run)]) == 2
    assert "this run already finished" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "summary.json"]  # nothing written


@pytest.mark.assets("minilm")
def test_too_small_or_one_class_data_is_a_config_error(tmp_path, tiny_bert_dir, capsys):
    one, two = tmp_path / "one.csv", tmp_path / "two.csv"
    one.write_text("text,label\n" + "".join(f"goal match {i},sport\n" for i in range(6)))
    two.write_text("text,label\ngoal match,sport\nbank profit,money\n")
    base = ["train", "--task", "text-csv", "--model", str(tiny_bert_dir), "--no-progress", "--set",
            "model.max_length=16"]  # the tiny BERT has 64 positions
    assert main([*base, "--data", str(one), "--run-dir", str(tmp_path / "a")]) == 2
    assert "has 1 class(es) (sport); a classifier needs at least 2" in capsys.readouterr().err
    assert main([*base, "--data", str(two), "--run-dir", str(tmp_path / "b")]) == 2
    assert "cannot split the data into train and test: class 'money' has 1 sample(s)" in capsys.readouterr().err


# ---- issue 32: config typos get a suggestion, `layerfreeze config`, the run folder named only once it exists -----


def test_a_mistyped_config_key_suggests_the_closest_valid_one(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  name: x\ntrain:\n  learning_rate: 0.1\nfreeze:\n  stratgy: static\n  guard:\n"
                    "    tolerence: 0.1\nstrategy: static\n")
    assert main(["train", "--config", str(path), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "model.name: unknown key (did you mean `model.name_or_path`?" in err
    assert "train.learning_rate: unknown key (did you mean `train.lr`?" in err
    assert "freeze.stratgy: unknown key (did you mean `freeze.strategy`?" in err
    assert "freeze.guard.tolerence: unknown key (did you mean `freeze.guard.tolerance`?" in err
    assert "strategy: unknown key (did you mean `freeze.strategy`?" in err  # a key of another section
    assert err.count("`layerfreeze config` prints every key with its default") == 5
    assert not (tmp_path / "r").exists()


def test_layerfreeze_config_prints_every_key_with_its_default_as_a_config_file(tmp_path, capsys):
    import yaml

    from layerfreeze.train.config import Config
    from layerfreeze.train.config_words import config_keys

    assert main(["config"]) == 0
    text = capsys.readouterr().out
    assert "  max_length: 128  # tokens per text sample" in text and "  strategy: smartfrz" in text
    assert "  guard: null  # " in text and "tolerance: 0.05" in text  # an optional section shows its keys
    for key in config_keys(Config):  # every key of the schema is named, optional sections' keys in their comment
        assert f"{key.rsplit('.', 1)[-1]}:" in text, key
    loaded = yaml.safe_load(text)
    assert loaded["train"]["lr"] == 5e-5 and loaded["freeze"]["cache"] == {"mode": "auto", "dtype": "float32",
                                                                         "budget_mb": None}
    assert build_config(loaded) == build_config({})  # the printed file is the default config
    # with a task and a strategy: the presets filled in; the output is a config file train reads back
    assert main(["config", "--task", "fashion-mnist", "-s", "static", "--set", "freeze.guard.patience=2"]) == 0
    path = tmp_path / "run.yaml"
    path.write_text(capsys.readouterr().out)
    config = load_config(path)
    assert config.model.name_or_path == "mobilenet_v2" and config.train.lr == 1e-3
    assert config.freeze.params == {"k": 10} and config.freeze.guard.patience == 2
    # the preset is written as the task's, not as the user's: the same file with another model takes the strategy's
    # own defaults, as the flags would (static's k: 5 for MiniLM-L6 was refused for a 3-block model)
    assert "params: {}  # the task's preset for its default model, {k: 10}, applies" in path.read_text()
    other = load_config(path, [{"model": {"name_or_path": "resnet18"}}])
    assert other.freeze.params == {}
    assert main(["config", "--set", "train.epoch=2"]) == 2
    assert "did you mean `train.epochs`?" in capsys.readouterr().err


def test_unknown_strategy_says_how_a_strategy_of_ones_own_becomes_known(tmp_path, capsys):
    assert main(["train", "-s", "every-n", "-p", "n=3", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "Unknown strategy 'every-n'" in err and "@register_strategy" in err
    assert 'python -c "import my_strategy; from layerfreeze.cli import main; raise SystemExit(main())" train' in err


def test_a_train_that_fails_before_training_names_no_run_folder(tmp_path, capsys):
    run = tmp_path / "never"
    assert main(["train", "--task", "text-csv", "--data", str(tmp_path / "missing.csv"), "--run-dir", str(run),
                 "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert "missing.csv" in err and not run.exists()
    assert str(run) not in out and "run dir" not in out


@pytest.mark.assets("minilm")
def test_a_run_names_its_run_folder_once_it_exists(tmp_path, tiny_bert_dir, tiny_csv, capsys):
    run = tmp_path / "run"
    assert main(["train", "--task", "text-csv", "--data", str(tiny_csv), "--model", str(tiny_bert_dir),
                 "--max-steps", "1", "--epochs", "1", "--no-progress", "--no-report", "--no-tensorboard",
                 "--no-ledger", "--set", "model.max_length=16", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"run dir {run}" in out and run.is_dir()
    assert json.loads((run / "summary.json").read_text())["memory"] == {"ledger": False}  # --no-ledger


def test_a_bad_parameter_value_fails_before_the_model_and_data_load(monkeypatch, tmp_path, capsys):
    # a newcomer waited 21 s (MiniLM-L6 and BBC News loading) for "k must be an integer": the strategy is built first
    import layerfreeze.train.setup as setup_module

    def no_load(config):
        raise AssertionError("the task was built before the strategy's parameters were checked")

    monkeypatch.setattr(setup_module, "build_task", no_load)
    assert main(["train", "-s", "static", "-p", "k=banana", "--run-dir", str(tmp_path / "r")]) == 2
    assert "freeze.params: static: k must be an integer >= 0" in capsys.readouterr().err
