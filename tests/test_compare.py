"""``layerfreeze compare`` on a tiny local BERT and CSV: same budget per row, ratios to ``none``, a LoRA row."""

from __future__ import annotations

import json

import pytest

from layerfreeze.cli import main


@pytest.mark.assets
def test_compare_rows_share_budget_and_report_ratios(tmp_path, tiny_bert_dir, tiny_csv, capsys):
    run = tmp_path / "cmp"
    args = ["compare", "--rows", "none,static,lora", "--task", "text-csv", "--data", str(tiny_csv),
            "--model", str(tiny_bert_dir), "--epochs", "1", "--batch-size", "8", "--lr", "1e-3",
            "--set", "model.max_length=32", "--set", "freeze.params.k=2", "--run-dir", str(run), "--no-progress"]
    assert main(args) == 0
    rows = {r["row"]: r for r in json.loads((run / "compare.json").read_text())}
    assert list(rows) == ["none", "static", "lora"]
    assert {r["steps"] for r in rows.values()} == {5}  # 38 training rows / 8, same for every row
    assert rows["none"]["time_ratio"] == 1.0 and rows["none"]["flops_ratio"] == 1.0
    assert rows["static"]["frozen_blocks"] == ["bert.embeddings", "bert.encoder.layer.0"]
    assert rows["static"]["freeze_steps"] == {"bert.embeddings": 0, "bert.encoder.layer.0": 0}
    assert rows["static"]["flops_ratio"] < 1.0
    # LoRA: only adapters (rank 8 on query and value of 2 layers, hidden 32) and the head copy train
    lora_params = 2 * 2 * (32 * 8 + 8 * 32)
    head = 32 * 32 + 32 + 32 * 2 + 2  # pooler is frozen; modules_to_save copies the classifier
    assert rows["lora"]["trainable_parameters"] == lora_params + 32 * 2 + 2
    assert rows["lora"]["trainable_parameters"] < head + lora_params
    table = (run / "compare.md").read_text()
    assert table.startswith("| strategy | test acc %") and "| lora |" in table
    assert "FLOPs ratio" in capsys.readouterr().out


def test_compare_rejects_unknown_rows_before_running(tmp_path, capsys):
    assert main(["compare", "--rows", "none,nope", "--run-dir", str(tmp_path / "x")]) == 2
    assert "Unknown row(s) nope" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
