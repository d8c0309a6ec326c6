"""benchmarks/llm_device.py at a CPU size (issue 40 item 5's GPU check runs it at 1B parameters): every row trains
what its strategy trains through the public API, the numbers are finite, and the held-out text is BBC News's every
tenth article."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import benchmark_module

TINY = ["--hidden", "64", "--layers", "4", "--steps", "12", "--seq", "32", "--batch", "2", "--device", "cpu"]


def test_every_row_trains_what_its_strategy_trains_and_its_numbers_are_finite(tmp_path, one_thread):
    with benchmark_module("llm_device") as bench:
        assert bench.main([*TINY, "--data", "synthetic", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {r["row"]: r for r in results["rows"]}
    assert list(rows) == ["none", "static", "lisa", "badam", "smartfrz", "lora-r16"]
    # the tiny Llama: embeddings and LM head 32,000 x 64 each (not tied), 4 layers of attention 4 x 64 x 64, SwiGLU
    # 3 x 64 x 176 (64 x 11/4) and two norms of 64, the final norm 64
    emb, layer = 32000 * 64, 4 * 64 * 64 + 3 * 64 * 176 + 2 * 64
    assert results["model"]["parameters"] == 2 * emb + 4 * layer + 64 == rows["none"]["trainable_parameters_start"]
    blocks = 6  # embeddings, 4 layers, the head (final norm + LM head)
    assert rows["static"]["trainable_parameters_start"] == 2 * layer + 64 + emb  # k = 6 // 2: embeddings + 2 layers
    assert rows["lisa"]["trainable_parameters_start"] == 2 * emb + 2 * layer + 64  # gamma 2 of the 4 middle layers
    assert rows["badam"]["trainable_parameters_start"] == layer + 64 + emb  # one layer, and the head
    assert rows["lora-r16"]["trainable_parameters_start"] == 4 * 2 * 16 * (64 + 64)  # q and v of 4 layers, rank 16
    assert len(rows["static"]["frozen_blocks_end"]) == blocks // 2 and rows["static"]["first_freeze_step"] == 0
    for r in rows.values():
        assert r["steps"] == 12 and len(r["step_s"]) == 12 and all(s > 0 for s in r["step_s"])
        assert math.isfinite(r["ms_per_step"]) and r["ms_per_step"] > 0
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1 and math.isfinite(r["train_loss_last"])
        assert r["allocator_peak_bytes"] is None  # no allocator on a CPU
    # smartfrz stages every step of a 12-step run (its cadence derives from the run's length) and froze nothing in
    # 12 steps, so it trained exactly what none trained: the same held-out perplexity
    assert rows["smartfrz"]["stage_steps"] >= 1 and rows["smartfrz"]["first_freeze_step"] is None
    assert rows["smartfrz"]["perplexity"] == rows["none"]["perplexity"]
    assert rows["none"]["stage_steps"] == 0
    before = results["smartfrz_before_first_freeze"]
    assert before["steps"] == [3, 12] and before["ratio"] == pytest.approx(before["smartfrz_ms"] / before["none_ms"])
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {row} |" in table for row in rows) and "smartfrz before its first freeze" in table
    assert results["data"] == "synthetic" and results["model"]["vocab"] == 32000


def test_the_synthetic_text_follows_its_markov_chain():
    with benchmark_module("llm_device") as bench:
        corpus = bench.synthetic_corpus(seq=16, train_chunks=6, held_chunks=2, vocab=50)
        again = bench.synthetic_corpus(seq=16, train_chunks=6, held_chunks=2, vocab=50)
    assert corpus.train.shape == (6, 16) and corpus.held_out.shape == (2, 16)
    assert corpus.train.equal(again.train)  # seeded
    # every token has at most 8 successors
    pairs = {}
    for chunk in (*corpus.train, *corpus.held_out):
        for a, b in zip(chunk[:-1].tolist(), chunk[1:].tolist()):
            pairs.setdefault(a, set()).add(b)
    assert max(len(s) for s in pairs.values()) <= bench.SYNTHETIC_BRANCHING


@pytest.mark.assets("minilm", "bbc_news")
def test_bbc_text_holds_out_every_tenth_article():
    from layerfreeze.train.data import load_bbc_news

    with benchmark_module("llm_device") as bench:
        corpus = bench.bbc_corpus(seq=64, tokenizer_dir=None)
    assert corpus.vocab == 30522 and corpus.source == "bbc"  # MiniLM-L6's WordPiece
    assert corpus.train.shape[1] == corpus.held_out.shape[1] == 64
    n_articles = len(load_bbc_news()[0])
    assert n_articles == 2225
    # 223 of the 2,225 articles are held out: about a tenth of the chunks
    assert 0.07 < len(corpus.held_out) / (len(corpus.train) + len(corpus.held_out)) < 0.14
    assert int(corpus.train.max()) < 30522 and int(corpus.train.min()) >= 0


def test_compiled_blocks_rows_train_as_eager_ones_and_count_their_compiles(tmp_path, one_thread):
    """``--compile blocks`` (issue 42's LLM table): every block a region, keyed on its trainable set; a row's
    compiles are counted and their steps left out of its median, and the compiled rows learn what the eager ones do."""
    args = ["--hidden", "64", "--layers", "4", "--steps", "4", "--seq", "32", "--batch", "2", "--device", "cpu",
            "--data", "synthetic", "--rows", "none,static", "--lr", "3e-2", "--warmup", "1"]
    with benchmark_module("llm_device") as bench:
        assert bench.main([*args, "--out", str(tmp_path / "eager")]) == 0
        assert bench.main([*args, "--compile", "blocks", "--compile-backend", "aot_eager",
                           "--out", str(tmp_path / "blocks")]) == 0
    eager, blocks = ({r["row"]: r for r in json.loads((tmp_path / d / "results.json").read_text())["rows"]}
                     for d in ("eager", "blocks"))
    for row in ("none", "static"):
        got = blocks[row]
        # the first step compiles every region class (embeddings, decoder layer, the head's norm and LM head)
        assert got["compile_steps"][0] == 1 and got["graphs"] >= 3 and got["compile_s"] > 0
        assert got["trainable_parameters_start"] == eager[row]["trainable_parameters_start"]
        assert got["frozen_blocks_end"] == eager[row]["frozen_blocks_end"]
        # aot_eager runs the traced ops eagerly: on the CPU the same values, bit for bit
        assert got["train_loss_last"] == eager[row]["train_loss_last"]
        assert got["perplexity"] == eager[row]["perplexity"]
        assert "compile_s" not in eager[row]
    assert blocks["static"]["train_loss_last"] != blocks["none"]["train_loss_last"]  # they trained different sets
    table = (tmp_path / "blocks" / "table.md").read_text()
    assert "compile s (graphs, steps)" in table and "backend aot_eager" in table
