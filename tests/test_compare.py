"""``layerfreeze compare`` on a tiny local BERT and CSV: same budget per row, ratios to ``none``, a LoRA row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerfreeze.cli import main
from layerfreeze.train.compare import compare, lora_rank, row_config, unknown_rows


@pytest.mark.assets("minilm")
def test_compare_rows_share_budget_and_report_ratios(tmp_path, tiny_bert_dir, tiny_csv, capsys):
    run = tmp_path / "cmp"
    args = ["compare", "--rows", "none,static,lisa,badam,lora", "--task", "text-csv", "--data", str(tiny_csv),
            "--model", str(tiny_bert_dir), "--epochs", "1", "--batch-size", "8", "--lr", "1e-3",
            "--set", "model.max_length=32", "--row-param", "static.k=2", "--run-dir", str(run), "--no-progress",
            "--row-set", "lora.train.lr=2e-3"]
    assert main(args) == 0
    rows = {r["row"]: r for r in json.loads((run / "compare.json").read_text())}
    assert list(rows) == ["none", "static", "lisa", "badam", "lora"]
    assert {r["steps"] for r in rows.values()} == {5}  # 38 training rows / 8, same for every row
    # blocks: embeddings, layer 0, layer 1, pooler (the middle: 1-3), classifier. lisa: 2 of the 3 middle blocks
    # train (one period of 20 steps); badam ascending: layer 0 trains, every other non-head block is frozen
    assert len(rows["lisa"]["frozen_blocks"]) == 1 and rows["lisa"]["frozen_blocks"][0] != "bert.embeddings"
    assert rows["badam"]["frozen_blocks"] == ["bert.embeddings", "bert.encoder.layer.1", "bert.pooler"]
    assert rows["badam"]["flops_ratio"] < rows["lisa"]["flops_ratio"] < 1.0
    assert rows["none"]["time_ratio"] == 1.0 and rows["none"]["flops_ratio"] == 1.0
    assert rows["static"]["frozen_blocks"] == ["bert.embeddings", "bert.encoder.layer.0"]
    assert rows["static"]["freeze_steps"] == {"bert.embeddings": 0, "bert.encoder.layer.0": 0}
    assert rows["static"]["flops_ratio"] < 1.0
    # the memory ledger's tensor peak: the frozen embeddings (30522 x 32) keep no gradient and no AdamW state
    assert rows["none"]["tensor_peak_ratio"] == 1.0 and rows["static"]["tensor_peak_ratio"] < 0.5
    # LoRA: only adapters (rank 8 on query and value of 2 layers, hidden 32) and the head copy train
    lora_params = 2 * 2 * (32 * 8 + 8 * 32)
    head = 32 * 32 + 32 + 32 * 2 + 2  # pooler is frozen; modules_to_save copies the classifier
    assert rows["lora"]["trainable_parameters"] == lora_params + 32 * 2 + 2
    assert rows["lora"]["trainable_parameters"] < head + lora_params
    lrs = {row: json.loads((run / row / "config.json").read_text())["train"]["lr"] for row in rows}
    assert lrs == {"none": 1e-3, "static": 1e-3, "lisa": 1e-3, "badam": 1e-3, "lora": 2e-3}  # only its row
    table = (run / "compare.md").read_text()
    assert table.startswith("| strategy | test acc %") and "| lora |" in table and "| tensor peak |" in table
    # issue 43: the terminal table fits 120 columns (what froze when comes below it, one line per row), and a
    # rotating strategy is summarized by its switches and its mean trainable share, not by block@step entries
    out = capsys.readouterr().out
    drawn = [line for line in out.splitlines() if line[:1] in "┏┃┡│└"]
    assert drawn and max(map(len, drawn)) <= 120 and "FLOPs" in out and "…" not in out
    assert rows["lisa"]["rotation"] == {"switches": 0, "mean_trainable_fraction": 0.8, "most_trainable": 4}
    assert rows["badam"]["rotation"] == {"switches": 0, "mean_trainable_fraction": 0.4, "most_trainable": 2}
    assert "rotation" not in rows["static"]
    assert "lisa: rotates: 0 switches, 80% of blocks trainable on average" in out
    assert "static: frozen block@step: bert.embeddings@0, bert.encoder.layer.0@0" in out
    # the lora row's idle cache is LoRA's (it said "strategy none freezes no block")
    assert "cache: auto, idle: LoRA's adapters train in every block, so there is no frozen prefix to cache" in out


@pytest.mark.assets("minilm")
def test_compare_checks_every_rows_blocks_and_folder_before_the_first_row(tmp_path, tiny_bert_dir, tiny_csv, capsys):
    base = ["compare", "--rows", "none,static", "--task", "text-csv", "--data", str(tiny_csv), "--model",
            str(tiny_bert_dir), "--max-steps", "1", "--no-progress", "--no-report", "--run-dir", str(tmp_path / "c")]
    assert main([*base, "--row-param", "static.k=99"]) == 2
    assert "row static: freeze.params: static: k=99 would freeze the head" in capsys.readouterr().err
    assert not (tmp_path / "c" / "none").exists()  # `none` did not train first
    (tmp_path / "c" / "static").mkdir(parents=True)
    (tmp_path / "c" / "static" / "config.json").write_text("{}")
    assert main(base) == 2
    assert "row static: run dir" in capsys.readouterr().err and not (tmp_path / "c" / "none").exists()


def test_compare_rejects_unknown_rows_before_running(tmp_path, capsys):
    assert main(["compare", "--rows", "none,nope", "--run-dir", str(tmp_path / "x")]) == 2
    assert "Unknown row(s) nope" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_row_config_applies_row_params_and_row_overrides_to_their_row_only(tmp_path):
    base = {"task": "bbc-news", "train": {"lr": 5e-5, "epochs": 2},
            "freeze": {"strategy": "static", "params": {"k": 3}}}
    params = {"autofreeze": {"interval": 7}}
    overrides = {"lora": {"train": {"lr": 1e-3}, "model": {"lora": {"targets": ["query"]}}},
                 "static": {"train": {"epochs": 1}}}
    lora = row_config(base, "lora", tmp_path, params, overrides)
    assert lora["train"] == {"lr": 1e-3, "epochs": 2}
    assert lora["model"]["lora"] == {"r": 8, "targets": ["query"]}
    assert lora["freeze"] == {"strategy": "none", "params": {}}
    static = row_config(base, "static", tmp_path, params, overrides)
    assert static["train"] == {"lr": 5e-5, "epochs": 1} and static["freeze"]["params"] == {"k": 3}
    auto = row_config(base, "autofreeze", tmp_path, params, overrides)
    assert auto["train"] == base["train"] and auto["freeze"]["params"] == {"interval": 7}
    assert auto["run"]["dir"] == str(tmp_path / "autofreeze")
    assert base["train"] == {"lr": 5e-5, "epochs": 2}  # the base is not changed


def test_lora_rows_of_any_rank():
    assert [lora_rank(r) for r in ("lora", "lora-r4", "lora-r16", "lora-r0", "lora-r04", "lora-4", "lisa")] == \
        [8, 4, 16, None, None, None, None]
    assert unknown_rows(["none", "lisa", "badam", "lora-r2", "lora-rx", "nope"]) == ["lora-rx", "nope"]
    cfg = row_config({"task": "bbc-news"}, "lora-r2", Path("runs/x"),
                     row_overrides={"lora-r2": {"train": {"lr": 1e-3}}})
    assert cfg["model"]["lora"] == {"r": 2} and cfg["freeze"]["strategy"] == "none" and cfg["train"]["lr"] == 1e-3
    assert cfg["run"]["dir"].endswith("lora-r2")


def test_compare_names_the_lora_rows_when_a_row_is_unknown(tmp_path, capsys):
    assert main(["compare", "--rows", "none,lora-rx", "--run-dir", str(tmp_path / "x")]) == 2
    assert "Unknown row(s) lora-rx" in (err := capsys.readouterr().err) and "lora-r<N> (rank N)" in err


def test_compare_rejects_a_row_set_for_a_row_it_does_not_run(tmp_path, capsys):
    assert main(["compare", "--rows", "none,static", "--row-set", "lora.train.lr=1e-3",
                 "--run-dir", str(tmp_path / "x")]) == 2
    assert "--row-set" in capsys.readouterr().err


def test_lora_default_targets_follow_the_model():
    import torchvision
    from torch import nn

    from layerfreeze.train.tasks import default_lora_targets

    mobilenet = torchvision.models.mobilenet_v2(num_classes=10)
    targets = default_lora_targets(mobilenet)
    convs = {n: m for n, m in mobilenet.named_modules() if isinstance(m, nn.Conv2d)}
    assert targets and all(convs[n].groups == 1 for n in targets)
    assert len(targets) == sum(m.groups == 1 for m in convs.values()) < len(convs)  # depthwise convs left out

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.query, self.key, self.value = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    assert default_lora_targets(nn.Sequential(Attention(), nn.Conv2d(1, 1, 1))) == ["query", "value"]


def test_a_bad_row_setting_names_the_row(tmp_path):
    from layerfreeze.errors import ConfigError

    with pytest.raises(ConfigError, match=r"(?s)row lora: .*train\.nope"):
        compare({"task": "bbc-news"}, ["none", "lora"], tmp_path, row_overrides={"lora": {"train": {"nope": 1}}})


@pytest.mark.assets("minilm")
def test_a_row_that_learns_nothing_is_reported_and_the_next_row_runs(tmp_path, tiny_bert_dir, tiny_csv, capsys):
    """With a learning rate of 1e-9 static's loss stays at its start, ln 2 on this 2-class task, and the stop for a
    loss at chance level (window 3 steps here) ends that row: compare records why, still trains the row after it,
    writes the table, and exits 1 (not every row finished)."""
    run = tmp_path / "cmp"
    args = ["compare", "--rows", "none,static,freezeout", "--task", "text-csv", "--data", str(tiny_csv),
            "--model", str(tiny_bert_dir), "--epochs", "1", "--batch-size", "8", "--set", "model.max_length=32",
            "--row-param", "static.k=2", "--row-set", "static.train.lr=1e-9",
            "--row-set", "static.run.divergence_window_steps=3", "--run-dir", str(run), "--no-progress", "--no-report"]
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "rows stopped before their end: static" in captured.err
    rows = {r["row"]: r for r in json.loads((run / "compare.json").read_text())}
    assert list(rows) == ["none", "static", "freezeout"]
    assert "has been at chance level for 3 steps" in rows["static"]["stopped"]
    assert "test_accuracy" not in rows["static"] and rows["freezeout"]["steps"] == 5
    assert rows["freezeout"]["time_ratio"] > 0  # the rows after it still get their ratios to none
    assert (run / "static" / "checkpoint").exists()  # the stopped row's run folder keeps its checkpoint
    line = next(ln for ln in (run / "compare.md").read_text().splitlines() if ln.startswith("| static |"))
    assert "stopped: the training loss has been at chance level for 3 steps" in line


def test_the_table_says_the_precision_and_compile_its_rows_ran_under():
    # a bf16-mixed or compiled comparison read like a float32 eager one, its train s holding the compile seconds
    from layerfreeze.runs.compare_table import markdown_table, precision_note, rich_table

    def row(name, precision="32-true", compiled=None):
        return {"row": name, "precision": precision, "test_accuracy": 0.5, "train_time_s": 10.0, "flops_total": 1e9,
                **({"compile": compiled} if compiled else {})}

    assert precision_note([row("none"), row("static")]) is None
    assert "Every row under" not in markdown_table([row("none"), row("static")])
    blocks = {"mode": "blocks", "backend": "inductor", "graphs": 4, "train_compile_s": 6.0}
    rows = [row("none", "bf16-mixed", blocks), row("static", "bf16-mixed", blocks)]
    note = "every row under bf16-mixed, torch.compile blocks (train s counts 12.0 s of compiling in all)"
    assert precision_note(rows) == note
    assert f"\nE{note[1:]}.\n" in markdown_table(rows)
    assert note in str(rich_table(rows).title)


def test_the_table_sets_apart_blocks_frozen_at_the_last_step():
    # `compare --rows none,static,linear --epochs 2` (16 steps): linear's cell read "features.0@16, ...,
    # features.18@16", 19 blocks frozen at the last epoch end, after the last optimizer step: it looked like a saving
    from layerfreeze.runs.compare_table import frozen_lines, markdown_table, table_cells

    linear = {"row": "linear", "test_accuracy": 0.5, "train_time_s": 10.0, "steps": 16,
              "freeze_steps": {"features.0": 8, "features.1": 16, "features.2": 16}}
    assert table_cells(linear)[-1] == "features.0@8; after the last step (saved nothing): features.1@16, features.2@16"
    only_last = {**linear, "freeze_steps": {"features.0": 16, "features.1": 16}}
    assert table_cells(only_last)[-1] == "after the last step (saved nothing): features.0@16, features.1@16"
    assert frozen_lines([only_last]) == [
        "linear: frozen block@step: after the last step (saved nothing): features.0@16, features.1@16"]
    static = {"row": "static", "test_accuracy": 0.5, "steps": 16, "freeze_steps": {"features.0": 0, "features.1": 0}}
    assert table_cells(static)[-1] == "features.0@0, features.1@0"  # frozen before training: a saving all run
    assert "| features.0@0, features.1@0 |" in markdown_table([static])
    no_steps = {**linear, "steps": None}  # an older compare.json without the run's steps: as before
    assert table_cells(no_steps)[-1] == "features.0@8, features.1@16, features.2@16"


@pytest.mark.assets("minilm")
def test_an_interrupted_comparison_says_which_rows_ran_and_a_row_finished_later_is_reported(tmp_path, tiny_bert_dir,
                                                                                            tiny_csv):
    # Ctrl-C in row 2 of 3 left compare.json with row 1 alone, nothing saying the comparison was cut; after the row
    # was finished with `train --resume`, `layerfreeze report` still left it out
    import os
    import signal

    from layerfreeze.runs.report.read import load_compare

    run = tmp_path / "cmp"
    base = {"task": "text-csv", "data": {"path": str(tiny_csv)},
            "model": {"name_or_path": str(tiny_bert_dir), "max_length": 32},
            "train": {"epochs": 1, "batch_size": 8}, "run": {"progress": False}}

    def ctrl_c_after_step_2(trainer):
        if trainer.progress["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        compare(base, ["none", "static", "freezeout"], run, row_callbacks={"static": [ctrl_c_after_step_2]})
    rows = {r["row"]: r for r in json.loads((run / "compare.json").read_text())}
    assert list(rows) == ["none", "static", "freezeout"] and rows["none"]["steps"] == 5
    assert rows["static"]["stopped"] == f"interrupted: finish it with layerfreeze train --resume {run / 'static'}"
    assert rows["freezeout"]["stopped"] == "not run: the comparison was interrupted before it"
    table = (run / "compare.md").read_text()
    assert "stopped: interrupted" in table and "stopped: not run" in table
    assert main(["train", "--resume", str(run / "static"), "--no-report"]) == 0
    rows = {r["row"]: r for r in load_compare(run)}
    assert rows["static"]["steps"] == 5 and "stopped" not in rows["static"] and rows["static"]["flops_ratio"] < 1
    assert rows["static"]["freeze_steps"] == {"bert.embeddings": 0}  # static's k for a 2-layer model
    assert rows["freezeout"]["stopped"].startswith("not run")
    # the report writes compare.json and compare.md again: they kept "stopped: interrupted" for the finished row
    assert main(["report", str(run)]) == 0
    written = {r["row"]: r for r in json.loads((run / "compare.json").read_text())}
    assert written["static"] == rows["static"] and written["freezeout"]["stopped"].startswith("not run")
    table = (run / "compare.md").read_text()
    assert "stopped: interrupted" not in table and "stopped: not run" in table and "| static |" in table


@pytest.mark.assets("minilm")
def test_a_ctrl_c_python_drops_between_two_rows_still_stops_the_comparison(tmp_path, tiny_bert_dir, tiny_csv):
    # a Ctrl-C between rows was raised inside a garbage collector's callback, printed as "Exception ignored" and
    # dropped: the comparison ran every row left and exited 0
    import gc
    import os
    import signal

    class CtrlCWhenCollected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs here, inside __del__, where Python drops it

    def leave_a_cycle(trainer):
        if trainer.progress["step"] == 0:
            bomb = CtrlCWhenCollected()
            bomb.cycle = bomb  # collected by the next row's gc.collect(), before its trainer takes Ctrl-C itself

    run = tmp_path / "cmp"
    base = {"task": "text-csv", "data": {"path": str(tiny_csv)},
            "model": {"name_or_path": str(tiny_bert_dir), "max_length": 32},
            "train": {"epochs": 1, "batch_size": 8}, "run": {"progress": False}}
    gc.collect()
    gc.disable()  # collected only by the gc.collect() a row starts with (Trainer.run: measure.release_garbage)
    try:
        with pytest.raises(KeyboardInterrupt):
            compare(base, ["none", "static", "freezeout"], run, row_callbacks={"none": [leave_a_cycle]})
    finally:
        gc.enable()
    rows = {r["row"]: r for r in json.loads((run / "compare.json").read_text())}
    assert rows["none"]["steps"] == 5 and rows["static"]["steps"] == 5  # the Ctrl-C fell in static's set-up
    assert rows["freezeout"]["stopped"] == "not run: the comparison was interrupted before it"
