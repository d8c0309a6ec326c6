"""benchmarks/budget_table.py at its CI size (``--quick`` on a 2-layer BERT): none's run, three budgets planned and
trained through the CLI, the measured tensor peak within the budget and within 10% of the predicted one, and the
impossible budget's exit code and message."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import benchmark_module


def _tiny_bert_for_bbc(path):
    """A 2-layer BERT (hidden 32) with BBC News's 5 labels, as a local Hugging Face folder with MiniLM's tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification

    from layerfreeze.train.assets import minilm_dir

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=5)
    BertForSequenceClassification(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir() / name, path / name)
    return path


@pytest.mark.assets("minilm", "bbc_news")
def test_quick_table_plans_trains_and_refuses_the_impossible_budget(tmp_path, one_thread):
    tiny_bert_dir = _tiny_bert_for_bbc(tmp_path / "tiny-bert")
    md = tmp_path / "BENCH.md"
    md.write_text("# bench\n")
    with benchmark_module("budget_table") as bench:
        assert bench.main(["--quick", "--model", str(tiny_bert_dir), "--out", str(tmp_path / "out"),
                           "--markdown", str(md)]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    peak = results["none"]["tensor_peak_bytes"]
    assert peak > 0 and 0 <= results["none"]["test_accuracy"] <= 1
    assert [r["fraction"] for r in results["rows"]] == [0.8, 0.6, 0.4]
    for r in results["rows"]:
        assert r["budget_bytes"] == int(r["fraction"] * peak)
        assert r["plan_predicted_bytes"] == r["predicted_bytes"]  # `plan` and `train` measure the same first batch
        assert r["k"] >= 1 and r["frozen_from_start"] == ["bert.embeddings", "bert.encoder.layer.0",
                                                          "bert.encoder.layer.1"][: r["k"]]
        assert set(r["frozen_from_start"]) <= set(r["frozen_at_end"])  # the floor was never thawed
        assert r["predicted_bytes"] <= r["budget_bytes"] and r["within_budget"]
        assert r["measured_bytes"] <= r["budget_bytes"] and abs(r["error"]) <= 0.10
        assert r["none_peak_first_batch"] == peak  # every batch is padded to the same length: one peak
    ks = [r["k"] for r in results["rows"]]
    assert ks == sorted(ks)  # a tighter budget never freezes less
    impossible = results["impossible"]
    assert impossible["exit_code"] == 2 and "no frozen set fits a memory budget" in impossible["message"]
    assert "smallest tensor peak reachable" in impossible["message"]
    text = md.read_text()
    assert bench.MARK_BEGIN in text and "| none (no budget) |" in text and "| 40% = " in text
    assert "exit code 2" in text
