"""The language-model fine-tuning benchmark at its CI size (``--tiny``: a Llama of 15k parameters on 40 articles per
topic): every row runs through the CLI trainer, the trainable sets are what each strategy trains, stage one is cached
with checksums and trained again (to the same bytes) when a file changed, and the ledger's columns fill in when a
summary carries the ledger."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import benchmark_module


@pytest.mark.assets("bbc_news")
def test_every_row_runs_and_trains_what_its_strategy_trains(tmp_path, one_thread, capsys):
    with benchmark_module("lm_finetune") as bench:
        assert bench.main(["--tiny", "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache")]) == 0
        results = json.loads((tmp_path / "out" / "results.json").read_text())
        rows = {r["row"]: r for r in results["table"]}
        assert list(rows) == ["none", "smartfrz", "static", "lisa", "badam", "lora-r2", "lora-r4"]
        assert all(math.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in rows.values())
        assert results["stage1"]["cached"] is False and math.isfinite(results["pretrained_perplexity"])
        # the tiny Llama: embeddings 300 x 16 (tied to the LM head), 4 layers of 2,592, the final norm 16
        emb, layer, norm = 300 * 16, 4 * 16 * 16 + 3 * 16 * 32 + 2 * 16, 16
        assert rows["none"]["max_trainable"] == emb + 4 * layer + norm
        assert rows["static"]["max_trainable"] == 2 * layer + norm    # embeddings + 2 layers frozen
        assert rows["lisa"]["max_trainable"] == emb + 1 * layer + norm  # gamma 1
        assert rows["badam"]["max_trainable"] == layer + norm           # one layer at a time
        assert rows["lora-r2"]["max_trainable"] == 4 * 2 * 2 * (16 + 16)  # q and v of 4 layers, rank 2
        assert rows["lora-r4"]["max_trainable"] == 4 * 2 * 4 * (16 + 16)
        # a frozen block saves its weight gradients: every row but the learned one (which froze nothing in 4 steps)
        # needs fewer FLOPs than full fine-tuning; BAdam's frozen embeddings also stop backward below its layer
        assert rows["none"]["flops_ratio"] == 1.0
        assert all(rows[r]["flops_ratio"] < 1 for r in ("static", "lisa", "badam", "lora-r2", "lora-r4"))
        assert rows["badam"]["flops_ratio"] < rows["lisa"]["flops_ratio"]
        seed0 = {r["row"]: r for r in results["per_seed"][0]}
        # FLOPs are counted again after every change of the frozen set: once for none, at most every step for lisa
        # (a new sample after every step, k 1; the same layer drawn again is no change)
        assert seed0["none"]["flop_counted_steps"] == 1 and 1 < seed0["lisa"]["flop_counted_steps"] <= 4
        # the memory ledger's peaks, per row: what each trains is what its gradients and optimizer state hold
        assert all(isinstance(v, (int, float)) and v > 0 for r in rows.values() for v in r["ledger"].values())
        state = {r: rows[r]["ledger"]["grads"] + rows[r]["ledger"]["optimizer"] for r in rows}
        assert state["badam"] < state["lisa"] < state["none"] and state["lora-r2"] < state["lora-r4"] < state["none"]
        # AdamW keeps two float32 moments per trainable weight, the gradient one more: 12 bytes a weight (+ steps)
        assert state["none"] >= 12 * rows["none"]["max_trainable"]
        # every row holds the same float32 parameters whatever it freezes (the ledger counts a tied weight once)
        assert {rows[r]["ledger"]["params"] for r in ("none", "smartfrz", "static", "lisa", "badam")} == {
            4 * rows["none"]["max_trainable"]}
        table = (tmp_path / "out" / "table.md").read_text()
        assert "| pretrained, not fine-tuned |" in table and "| badam |" in table
        # --from-json prints the same table again, training nothing
        assert bench.main(["--from-json", str(tmp_path / "out" / "results.json")]) == 0
        assert capsys.readouterr().out.endswith(table)

        # stage one again: read from the cache; with a changed file, trained again to the very same bytes
        pretrain_texts = bench.split_corpus(bench.TINY)[0]
        folder, info = bench.stage1(bench.TINY, pretrain_texts, tmp_path / "cache", log=lambda m: None)
        assert info["cached"] is True
        sums = json.loads((folder / bench.CHECKSUMS).read_text())
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-8] + bytes(8))
        assert bench.verified(folder) is None
        folder2, info2 = bench.stage1(bench.TINY, pretrain_texts, tmp_path / "cache", log=lambda m: None)
        assert folder2 == folder and info2["cached"] is False
        assert json.loads((folder / bench.CHECKSUMS).read_text()).items() >= {
            k: v for k, v in sums.items() if k != bench.INFO}.items()


def test_the_ledger_columns_read_the_summarys_memory_entry():
    with benchmark_module("lm_finetune") as bench:
        assert bench.ledger_cells({"test_perplexity": 3.0}) == {h: None for h, _ in bench.LEDGER_COLUMNS}
        # 500 bytes of parameters, all trainable at step 0, 300 of them frozen from step 5: the params column is
        # their sum at the tensor peak's step (500), not the sum of the two buckets' peaks (800)
        memory = {"buckets": {"params_trainable": {"peak_bytes": 500, "step": 0},
                              "params_frozen": {"peak_bytes": 300, "step": 5},
                              "grads": {"peak_bytes": 400, "step": 1}, "optimizer": {"peak_bytes": 800, "step": 1},
                              "activations": {"peak_bytes": 1000, "step": 1}},
                  "tensor_peak_bytes": 2700, "tensor_peak_step": 1,
                  "at_tensor_peak": {"params_trainable": 500, "params_frozen": 0, "grads": 400, "optimizer": 800,
                                     "activations": 1000}}
        assert bench.ledger_cells({"memory": memory}) == {"params": 500, "grads": 400, "optimizer": 800,
                                                          "activations": 1000, "tensor peak": 2700}
        del memory["buckets"]["grads"]
        assert bench.ledger_cells({"memory": memory})["grads"] is None
