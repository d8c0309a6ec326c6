"""Issue 43, the fifth newcomer run: config values said plainly (no "Input should be"), Lightning's precision names,
a seed NumPy takes, parameters that belong to their strategy, one way to set a parameter, a resume that stays in its
folder, one-line block errors, a corrupt image before training, compare's Ctrl-C and row messages, a command typo,
wrapped help and the compile line of the summary."""

from __future__ import annotations

import json

import pytest
from PIL import Image
from rich.console import Console

from layerfreeze.cli import main
from layerfreeze.cli import parser as cli_parser
from layerfreeze.errors import ConfigError
from layerfreeze.runs.summary import summary_table
from layerfreeze.train.config_file import parse_override
from layerfreeze.train.config_load import load_config
from tests.conftest import image_folder


def _one_line(capsys, start: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(start), err
    return err


# ---- config values said plainly ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("override", "said"), [
    ("train.epochs=0", "train.epochs: must be >= 1, got 0"),
    ("train.lr=-1", "train.lr: must be > 0, got -1"),
    ("train.warmup_fraction=2", "train.warmup_fraction: must be < 1, got 2"),
    ("model.max_length=0", "model.max_length: must be >= 8, got 0"),
    ("train.seed=-1", "train.seed: must be >= 0, got -1"),
    ("train.seed=99999999999", "train.seed: must be < 4294967296, got 99999999999"),
    ("task=bbc", "task: 'bbc' is not one of bbc-news, fashion-mnist, text-csv, image-folder, text-lm (did you mean "
                 "'bbc-news'?)"),
    ("train.optimizer=adam", "train.optimizer: 'adam' is not one of adamw, sgd (did you mean 'adamw'?)"),
    ("train.epochs=three", "train.epochs: must be a whole number, got 'three'"),
    ("train=3", "train: is a section, not a value (got 3): set its keys"),
])
def test_config_values_are_said_plainly(override, said):
    with pytest.raises(ConfigError) as err:
        load_config(None, [parse_override(override)])
    assert str(err.value).startswith(f"Invalid configuration: {said}") and "Input should" not in str(err.value)


@pytest.mark.parametrize(("written", "read"), [("bf16", "bf16-mixed"), ("16", "16-mixed"), ("fp16", "16-mixed"),
                                                ("32", "32-true"), ("bf16-true", "bf16-true")])
def test_lightnings_short_precision_names_are_read_as_lightning_reads_them(written, read):
    assert load_config(None, [parse_override(f"train.precision={written}")]).train.precision == read


# ---- strategy parameters ----------------------------------------------------------------------------------------


def test_a_config_files_parameters_stay_with_its_strategy(tmp_path, capsys):
    path = tmp_path / "static.yaml"
    path.write_text("freeze: {strategy: static, params: {k: 3}}\n")
    assert load_config(path).freeze.params == {"k": 3}
    lisa = load_config(path, [{"freeze": {"strategy": "lisa"}}]).freeze
    assert lisa.strategy == "lisa" and lisa.params == {}  # static's k (blocks) is not LISA's k (steps)
    assert load_config(path, [{"freeze": {"strategy": "lisa"}}, {"freeze": {"params": {"k": 7}}}]).freeze.params \
        == {"k": 7}
    assert load_config(path, [{"freeze": {"strategy": "static"}}]).freeze.params == {"k": 3}
    smart = tmp_path / "smart.yaml"
    smart.write_text("freeze: {strategy: smartfrz, params: {threshold: 0.9}}\n")
    assert main(["config", "--config", str(smart), "-s", "static"]) == 0
    assert "strategy: static" in capsys.readouterr().out


def test_a_parameter_given_by_p_and_by_set_is_refused(capsys):
    assert main(["config", "-s", "static", "-p", "k=2", "--set", "freeze.params.k=3"]) == 2
    _one_line(capsys, "layerfreeze: error: -p k=2 and --set freeze.params.k=3 set the same strategy parameter; give "
                      "it once")
    assert main(["config", "-s", "static", "-p", "k=2", "--set", "freeze.params.k=2"]) == 0
    assert "k: 2" in capsys.readouterr().out
    # -p twice with two values kept the last in silence, where -p against --set was refused
    assert main(["config", "-s", "static", "-p", "k=1", "-p", "k=2"]) == 2
    _one_line(capsys, "layerfreeze: error: -p k=1 and -p k=2 set the same key; give it once")
    assert main(["config", "--set", "train.lr=1e-3", "--set", "train.lr=2e-3"]) == 2
    _one_line(capsys, "layerfreeze: error: --set train.lr=1e-3 and --set train.lr=2e-3 set the same key; give it once")
    assert main(["compare", "--rows", "none,static", "--row-param", "static.k=1", "--row-param", "static.k=2"]) == 2
    _one_line(capsys, "layerfreeze: error: --row-param static.k=1 and --row-param static.k=2 set the same key; give "
                      "it once")


def test_a_key_given_by_its_flag_and_by_set_is_refused(capsys):
    """The --set won in silence: `--strategy static --set freeze.strategy=none` trained none, `--task fashion-mnist
    --set task=bbc-news` trained on BBC News, and plan's --memory beat `--set freeze.memory_budget`."""
    assert main(["config", "--strategy", "static", "--set", "freeze.strategy=none"]) == 2
    _one_line(capsys, "layerfreeze: error: --strategy static and --set freeze.strategy=none set the same key "
                      "(freeze.strategy); give it once")
    assert main(["blocks", "--task", "fashion-mnist", "--set", "task=bbc-news"]) == 2
    _one_line(capsys, "layerfreeze: error: --task fashion-mnist and --set task=bbc-news set the same key (task); give "
                      "it once")
    assert main(["train", "--epochs", "2", "--set", "train.epochs=3"]) == 2
    _one_line(capsys, "layerfreeze: error: --epochs 2 and --set train.epochs=3 set the same key (train.epochs); give "
                      "it once")
    assert main(["plan", "--memory", "1GB", "--set", "freeze.memory_budget=2GB"]) == 2
    _one_line(capsys, "layerfreeze: error: --memory 1GB and --set freeze.memory_budget=2GB set the same budget; give "
                      "it once (--memory)")
    assert main(["config", "-s", "static", "--set", "freeze.strategy=static"]) == 0  # the same value is no conflict
    assert "strategy: static" in capsys.readouterr().out
    assert main(["config", "--task", "fashion-mnist", "--set", "task=fashion-mnist"]) == 0
    assert "task: fashion-mnist" in capsys.readouterr().out
    import argparse

    same = argparse.Namespace(compile="true", lr="0.1", set=["train.compile=True", "train.lr=1e-1"], param=[])
    assert cli_parser.overrides_of(same, cli_parser.TRAIN_FLAGS)[-2:] == [{"train": {"compile": True}},
                                                                           {"train": {"lr": "1e-1"}}]


# ---- resume, blocks, data ---------------------------------------------------------------------------------------


def test_a_resume_stays_in_its_own_folder(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(load_config(None).model_dump(mode="json")))
    assert main(["train", "--resume", str(run), "--run-dir", str(tmp_path / "other")]) == 2
    _one_line(capsys, f"layerfreeze: error: --resume {run} goes on in that run's own folder; drop --run-dir "
                      f"{tmp_path / 'other'} (or start a new run there: --config {run / 'config.json'})")
    assert not (tmp_path / "other").exists()


@pytest.mark.assets("minilm")
def test_a_block_pattern_that_matches_nothing_is_one_line(tiny_bert_dir, tiny_csv, capsys):
    assert main(["blocks", "--task", "text-csv", "--model", str(tiny_bert_dir), "--data", str(tiny_csv), "--set",
                 "model.blocks=[foo]"]) == 2
    err = _one_line(capsys, "layerfreeze: error: Block pattern 'foo' matches no module with parameters in "
                            "BertForSequenceClassification (its top-level children: bert (BertModel, ")
    assert "e.g. 'encoder.layer.*'" in err
    # patterns that leave the embeddings out: `blocks` says so (it listed the blocks and nothing else)
    assert main(["blocks", "--task", "text-csv", "--model", str(tiny_bert_dir), "--data", str(tiny_csv), "--set",
                 'model.blocks=["bert.encoder.layer.*","bert.pooler","classifier"]']) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "not in any block: 5 trainable parameter(s) belong to no block (bert.embeddings.word_embeddings.weight, " \
        "bert.embeddings.position_embeddings.weight, bert.embeddings.token_type_embeddings.weight, ... (5 in all))" \
        in out


@pytest.mark.assets("mobilenet_v2")
def test_a_corrupt_image_stops_the_run_before_training(tmp_path, capsys):
    image_folder(tmp_path)
    (tmp_path / "imgs" / "cats" / "0.png").write_bytes(b"this is text, not a png")
    assert main(["train", "--task", "image-folder", "--data", str(tmp_path / "imgs"), "--max-steps", "1",
                 "--batch-size", "4", "--no-progress", "--run-dir", str(tmp_path / "r")]) == 2
    captured = capsys.readouterr()
    bad = tmp_path / "imgs" / "cats" / "0.png"
    assert captured.err == f"layerfreeze: error: data.path: {bad} is not a readable image (UnidentifiedImageError); " \
                           "remove or convert it\n"
    assert "cache: off" not in captured.out  # not taken for a reason to run without the cache
    assert not (tmp_path / "r").exists()  # found when the data loads, before the run folder exists


def test_an_empty_class_folder_is_named_and_a_run_folder_inside_the_data_refused(tmp_path, capsys):
    for name in ("cats", "dogs"):
        (tmp_path / "imgs" / name).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / name / "0.png")
    (tmp_path / "imgs" / "empty").mkdir()
    assert main(["train", "--task", "image-folder", "--data", str(tmp_path / "imgs"), "--run-dir",
                 str(tmp_path / "r")]) == 2
    _one_line(capsys, f"layerfreeze: error: data.path {tmp_path / 'imgs'} is not a folder of class sub-folders with "
                      "images (sub-folder(s) without an image: empty; remove them or add images)")
    (tmp_path / "imgs" / "empty").rmdir()
    assert main(["train", "--task", "image-folder", "--data", str(tmp_path / "imgs"), "--run-dir",
                 str(tmp_path / "imgs" / "run")]) == 2
    _one_line(capsys, f"layerfreeze: error: Invalid configuration: run.dir {tmp_path / 'imgs' / 'run'} is inside "
                      f"data.path {tmp_path / 'imgs'}: a run writes its checkpoints")
    assert sorted(p.name for p in (tmp_path / "imgs").iterdir()) == ["cats", "dogs"]


# ---- compare ------------------------------------------------------------------------------------------------------


def test_compare_row_messages_name_what_is_wrong(capsys):
    assert main(["compare", "--rows", "none,static", "--row-param", "lisa.gamma=3"]) == 2
    _one_line(capsys, "layerfreeze: error: --row-param 'lisa.gamma=3': lisa is not one of the rows (none, static); "
                      "add it to --rows or drop the parameter")
    assert main(["compare", "--rows", "none,static", "--row-set", "lora.train.lr=1e-3"]) == 2
    _one_line(capsys, "layerfreeze: error: --row-set 'lora.train.lr=1e-3': lora is not one of the rows (none, "
                      "static); add it to --rows or drop the setting")
    assert main(["compare", "--rows", "none,lora-r0"]) == 2
    _one_line(capsys, "layerfreeze: error: row lora-r0: a LoRA rank is at least 1 (lora-r<N>, e.g. lora-r4)")


def test_ctrl_c_during_compare_is_exit_130_with_what_to_do(tmp_path, capsys, monkeypatch):
    from layerfreeze.train import compare

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "compare", interrupted)
    assert main(["compare", "--rows", "none,static", "--run-dir", str(tmp_path / "cmp")]) == 130
    captured = capsys.readouterr()
    assert "Interrupted. " in captured.out and "lists the rows run so far, the one cut and those not run" in \
        captured.out and "a comparison itself does not resume" in captured.out
    assert captured.err == ""


# ---- the command line -----------------------------------------------------------------------------------------------


def test_a_mistyped_command_gets_the_closest_one(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["trian"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice: 'trian'" in err and "(did you mean train?)" in err


@pytest.mark.parametrize("columns", [80, 120])
def test_every_description_wraps_to_the_terminal(columns, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(columns))
    parser = cli_parser.build_parser()
    for name, sub in parser.subcommands.items():
        monkeypatch.setattr(sub, "epilog", None)  # an epilog of examples keeps its lines as written
        for line in sub.format_help().splitlines():
            assert len(line) <= columns, (name, line)


def test_the_summary_table_shows_compile_apart():
    summary = {"strategy": "smartfrz", "train_time_s": 28.7,
               "compile": {"mode": "blocks", "backend": "inductor", "regions": 9, "graphs": 11, "compile_s": 32.6}}
    console = Console(width=120, record=True)
    console.print(summary_table(summary))
    text = console.export_text()
    assert "torch.compile" in text and "blocks (inductor): 11 graphs in 9 regions, 32.60 s compiling" in text


def test_lora_set_up_lets_no_third_party_deprecation_through():
    # a newcomer's `compare --rows none,static,lora` printed transformers' two-line FutureWarning (peft 0.21 reads the
    # deprecated is_gradient_checkpointing); the LoRA set-up is silent, and the adapters are in place
    import warnings

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from layerfreeze.train.tasks import apply_lora

    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64)
    model = transformers.BertForSequenceClassification(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = apply_lora(model, load_config(overrides=[{"model": {"lora": {"r": 4}}}]))
    assert [str(w.message) for w in caught] == []
    assert any("lora_A" in name for name, _ in wrapped.named_parameters())


def test_one_sample_shares_are_found_before_the_first_step():
    from types import SimpleNamespace

    from layerfreeze.train.ranks import one_sample_share
    from layerfreeze.train.setup import epoch_batches

    def trainer(n, batch, world=1, cache=False, epochs=2, total=None):
        per_epoch = -(-n // batch)
        return SimpleNamespace(config=SimpleNamespace(train=SimpleNamespace(epochs=epochs, batch_size=batch, seed=0)),
                               train_set=list(range(n)), total_steps=total or per_epoch * epochs,
                               distributed=world > 1, world=world, runner=object() if cache else None)

    assert one_sample_share(trainer(129, 64), epoch_batches) == (3, 0)  # the epoch's last batch: 129 = 2 x 64 + 1
    assert one_sample_share(trainer(129, 64, total=2), epoch_batches) is None  # max_steps ends the run before it
    assert one_sample_share(trainer(128, 64), epoch_batches) is None
    assert one_sample_share(trainer(131, 64, world=2), epoch_batches) == (3, 1)  # 3 samples: ranks take 2 and 1
    assert one_sample_share(trainer(132, 64, world=2), epoch_batches) is None
    # the cache's split (index % world): the shares of every batch, counted as local_batches makes them
    t = trainer(200, 64, world=3, cache=True, epochs=3)
    expected = None
    for step, batch in enumerate((b for e in range(3) for b in epoch_batches(200, 64, 0, e)), 1):
        sizes = [max(1, sum(1 for i in batch if i % 3 == r)) for r in range(3)]
        if 1 in sizes:
            expected = (step, sizes.index(1))
            break
    assert expected is not None and one_sample_share(t, epoch_batches) == expected


@pytest.mark.assets("mobilenet_v2")
def test_a_batchnorm_model_with_a_last_batch_of_one_sample_is_refused_before_training(tmp_path, capsys):
    # the last batch of one sample stopped the run mid-epoch: "Expected more than 1 value per channel when training"
    image_folder(tmp_path)
    assert main(["train", "--task", "image-folder", "--data", str(tmp_path / "imgs"), "--batch-size", "5",
                 "--no-progress", "--run-dir", str(tmp_path / "r")]) == 2  # 6 training images: 5 + 1
    err = capsys.readouterr().err
    assert err == "layerfreeze: error: train.batch_size 5: step 2's batch holds one sample of the 6 training " \
                  "samples, and the model's BatchNorm layers cannot train on one (\"Expected more than 1 value per " \
                  "channel when training\"); choose another batch size (e.g. 4), or another data.limit_train\n"
    assert not (tmp_path / "r" / "checkpoints").exists()
    # a batch of 1 (every batch one sample) stopped with StopIteration: no size below it was looked at
    assert main(["train", "--task", "image-folder", "--data", str(tmp_path / "imgs"), "--batch-size", "1",
                 "--no-progress", "--run-dir", str(tmp_path / "r1")]) == 2
    assert "train.batch_size 1: step 1's batch holds one sample of the 6 training samples" in \
        capsys.readouterr().err.replace("\n", " ")
