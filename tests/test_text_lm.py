"""``layerfreeze train --task text-lm`` end to end on a tiny random Llama folder written here with save_pretrained
(with an offline word-level tokenizer): the default strategy, the cache, perplexity in the summary; and the data
pieces (chunks, shifted loss)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from layerfreeze.cli import main
from layerfreeze.runs.rundir import read_metrics
from layerfreeze.train.lm import TokenChunks, next_token_loss

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "the cat dog sat ran on a mat log and then slept ate fish bone".split()


VOCAB = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]", *WORDS])}


def save_tokenizer(path):
    """A word-level tokenizer built offline (``tokenizers``), saved as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                eos_token="[EOS]")
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A 2-layer Llama (hidden 16, tied embeddings) and a word-level tokenizer, saved as a local HF folder."""
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tokenizer(path)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
                                      eos_token_id=2, bos_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory):
    """A 2-layer GPT-2 (hidden 16, tied embeddings, dropout 0.1) with the same tokenizer."""
    path = tmp_path_factory.mktemp("tiny-gpt2")
    save_tokenizer(path)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(VOCAB), n_embd=16, n_layer=2, n_head=2, n_positions=64,
                                     pad_token_id=0, eos_token_id=2, bos_token_id=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (9,), generator=g).tolist()) for _ in range(40)]
    path = tmp_path_factory.mktemp("text") / "story.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _train(tmp_path, model_dir, data, name, *extra):
    run = tmp_path / name
    args = ["train", "--task", "text-lm", "--model", str(model_dir), "--data", str(data), "--epochs", "2",
            "--batch-size", "8", "--lr", "3e-3", "--run-dir", str(run), "--no-progress", "--no-tensorboard",
            "--no-report", "--set", "model.max_length=16", "--set", "run.device=cpu", *extra]
    assert main(args) == 0
    return json.loads((run / "summary.json").read_text()), run


def test_text_lm_trains_a_local_llama_with_the_default_strategy_and_prints_perplexity(tmp_path, tiny_llama_dir,
                                                                                      story, capsys):
    summary, run = _train(tmp_path, tiny_llama_dir, story, "default")
    out = capsys.readouterr().out
    assert "test perplexity" in out and "smartfrz" in out
    assert summary["strategy"] == "smartfrz" and summary["task"] == "text-lm"
    assert summary["blocks"] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "head"]
    assert summary["test_accuracy"] is None and math.isfinite(summary["test_perplexity"])
    assert summary["test_perplexity"] == pytest.approx(math.exp(summary["test_loss"]))
    first, last = summary["eval_history"][0], summary["eval_history"][-1]
    assert last["perplexity"] < first["perplexity"]  # it learns (uniform would be ~18)
    assert summary["steps"] > 0 and summary["flops_total"] > 0


@pytest.mark.parametrize("folder, frozen", [("tiny_llama_dir", ["model.embed_tokens", "model.layers.0"]),
                                            ("tiny_gpt2_dir", ["transformer.embeddings", "transformer.h.0"])])
def test_text_lm_with_the_cache_gives_the_same_run_as_without(tmp_path, folder, frozen, story, request):
    """static k=2 (embeddings + layer 0 frozen): with ``freeze.cache.mode=on`` the second epoch reads the frozen
    prefix's output back, and the run is the same as without the cache, loss for loss (GPT-2: with dropout in
    the trainable layers, the same masks drawn)."""
    model_dir = request.getfixturevalue(folder)
    plain, plain_dir = _train(tmp_path, model_dir, story, "plain", "-s", "static", "-p", "k=2")
    cached, cached_dir = _train(tmp_path, model_dir, story, "cached", "-s", "static", "-p", "k=2",
                                "--set", "freeze.cache.mode=on")
    assert cached["frozen_blocks"] == frozen
    epochs = [r for r in read_metrics(cached_dir / "metrics.jsonl") if r["type"] == "epoch"]
    assert epochs[-1]["cache_hits"] > 0
    losses = lambda d: [r["loss"] for r in read_metrics(d / "metrics.jsonl") if r["type"] == "step"]  # noqa: E731
    assert losses(cached_dir) == losses(plain_dir)
    assert cached["test_perplexity"] == plain["test_perplexity"]


def test_the_cache_under_the_rotating_strategies_on_a_llama(tmp_path, tiny_llama_dir, story):
    """badam, two epochs per layer over 6 epochs (layer 0, 1, then 0 again): the frozen prefix below the active
    layer is served from the cache, an output computed before a layer under the boundary trained again never is;
    the run equals the one without the cache, loss for loss. lisa trains the embeddings: the cache serves nothing."""
    args = ["-s", "badam", "-p", "k=6", "--epochs", "6"]
    plain, plain_dir = _train(tmp_path, tiny_llama_dir, story, "plain", *args)
    cached, cached_dir = _train(tmp_path, tiny_llama_dir, story, "cached", *args, "--set", "freeze.cache.mode=on")
    thaws = [h["block"] for h in cached["freeze_timeline"] if h["action"] == "thaw"]
    assert thaws[:2] == ["model.layers.1", "model.layers.0"]
    assert cached["cache"]["hits"] > 0
    losses = lambda d: [r["loss"] for r in read_metrics(d / "metrics.jsonl") if r["type"] == "step"]  # noqa: E731
    assert losses(cached_dir) == losses(plain_dir)
    assert cached["test_perplexity"] == plain["test_perplexity"]
    lisa, _ = _train(tmp_path, tiny_llama_dir, story, "lisa", "-s", "lisa", "-p", "gamma=1", "-p", "k=2",
                     "--set", "freeze.cache.mode=on")
    assert lisa["cache"]["hits"] == lisa["cache"]["misses"] == 0 and math.isfinite(lisa["test_perplexity"])


def test_text_lm_with_the_default_strategy_and_the_cache(tmp_path, tiny_llama_dir, story):
    summary, _ = _train(tmp_path, tiny_llama_dir, story, "both", "--set", "freeze.cache.mode=on")
    assert summary["strategy"] == "smartfrz" and math.isfinite(summary["test_perplexity"])


def test_blocks_command_shows_the_rule_and_the_tie(tiny_llama_dir, story, capsys):
    assert main(["blocks", "--task", "text-lm", "--model", str(tiny_llama_dir), "--data", str(story)]) == 0
    out = capsys.readouterr().out
    assert "rule: Hugging Face decoder LM" in out and "model.layers.1" in out
    assert "tied: lm_head.weight is tied to model.embed_tokens.weight" in out


def test_text_lm_bad_input_is_exit_2(tmp_path, tiny_llama_dir, story, capsys):
    assert main(["train", "--task", "text-lm", "--data", str(story)]) == 2
    assert "needs model.name_or_path" in capsys.readouterr().err
    assert main(["train", "--task", "text-lm", "--model", str(tmp_path), "--data", str(story)]) == 2
    assert "is a folder without config.json" in capsys.readouterr().err
    csv = tmp_path / "t.csv"
    csv.write_text("body\nthe cat sat\n", encoding="utf-8")
    assert main(["train", "--task", "text-lm", "--model", str(tiny_llama_dir), "--data", str(csv)]) == 2
    assert "no column 'text'" in capsys.readouterr().err


def test_chunks_and_the_shifted_loss():
    chunks = TokenChunks(list(range(3, 13)), length=4, pad_id=0)  # 10 tokens -> 3 chunks, the last padded
    assert len(chunks) == 3
    last = chunks[2]
    assert last["input_ids"].tolist() == [11, 12, 0, 0] and last["attention_mask"].tolist() == [1, 1, 0, 0]
    assert last["labels"].tolist() == [11, 12, -100, -100]
    logits = torch.full((1, 4, 16), -1e4)
    for t, nxt in enumerate([12, 0, 0]):
        logits[0, t, nxt] = 0.0  # position t predicts token t + 1 exactly
    assert next_token_loss(logits, last["labels"][None]).item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="no tokens"):
        TokenChunks([], 4, 0)


def test_lora_targets_of_decoder_lms_and_a_compare_row_of_an_lm(tiny_llama_dir, tiny_gpt2_dir):
    from layerfreeze.runs.compare_table import markdown_table
    from layerfreeze.train.tasks import default_lora_targets

    llama = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, local_files_only=True)
    gpt2 = transformers.AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir, local_files_only=True)
    assert default_lora_targets(llama) == ["q_proj", "v_proj"] and default_lora_targets(gpt2) == ["c_attn"]
    row = {"row": "none", "test_accuracy": None, "test_perplexity": 17.79, "accuracy_delta": None,
           "train_time_s": 1.0, "time_ratio": 1.0, "flops_total": 1e6, "flops_ratio": 1.0,
           "peak_memory_bytes": 2**20, "freeze_steps": {}}
    table = markdown_table([row])  # the columns follow the task's metric: perplexity (issue 43)
    assert table.startswith("| strategy | test ppl | ppl ratio |") and "| none | 17.79 | - |" in table


# ---- issue 43: what text-lm would train wrongly, refused before training; compare's columns follow perplexity ----


def test_a_length_beyond_gpt2s_positions_and_an_encoder_are_refused_before_training(tmp_path, tiny_gpt2_dir, story,
                                                                                     capsys):
    run = tmp_path / "r"
    args = ["train", "--task", "text-lm", "--data", str(story), "--run-dir", str(run), "--no-progress"]
    assert main([*args, "--model", str(tiny_gpt2_dir)]) == 2  # the default model.max_length 128, n_positions 64
    err = capsys.readouterr().err
    assert "model.max_length 128 is more than the 64 positions model.name_or_path" in err
    assert "set --set model.max_length=64 or less" in err and "IndexError" not in err
    encoder = tmp_path / "encoder"
    save_tokenizer(encoder)
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(vocab_size=len(VOCAB), hidden_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=32,
                                                   max_position_embeddings=64)).save_pretrained(encoder)
    assert main([*args, "--model", str(encoder), "--set", "model.max_length=16"]) == 2
    err = capsys.readouterr().err
    assert f"model.name_or_path {encoder} is not a causal language model" in err
    assert "(BertModel, loaded as BertLMHeadModel)" in err and "use --task text-csv" in err
    assert not run.exists()  # nothing trained


def test_compare_on_a_language_model_shows_perplexity_and_its_ratio(tmp_path, tiny_llama_dir, story, capsys):
    run = tmp_path / "cmp"
    assert main(["compare", "--task", "text-lm", "--model", str(tiny_llama_dir), "--data", str(story), "--rows",
                 "none,static", "-p", "static.k=2", "--epochs", "1", "--batch-size", "8", "--lr", "3e-3",
                 "--set", "model.max_length=16", "--set", "run.device=cpu", "--run-dir", str(run), "--no-progress",
                 "--no-report"]) == 0
    rows = {r["row"]: r for r in json.loads((run / "compare.json").read_text())}
    none, static = rows["none"], rows["static"]
    assert static["perplexity_ratio"] == pytest.approx(static["test_perplexity"] / none["test_perplexity"])
    assert none["perplexity_ratio"] == 1.0 and static["accuracy_delta"] is None
    table = (run / "compare.md").read_text()
    assert table.startswith("| strategy | test ppl | ppl ratio |")
    assert f"| static | {static['test_perplexity']:.2f} | {static['perplexity_ratio']:.3f} |" in table
    out = capsys.readouterr().out
    assert "ppl" in out and "acc" not in out.split("layerfreeze compare")[-1].split("table:")[0]


def test_fsdp2_refuses_tied_embeddings_on_every_rank_before_sharding(tmp_path, tiny_llama_dir, story):
    # fully_shard raised "Parameter 'lm_head.weight' is shared with a parameter already managed by another FSDP
    # group" on both ranks (smartfrz: "the mirror has no parameter lm_head.weight") as raw tracebacks
    from layerfreeze import discover_blocks
    from layerfreeze.distributed import shard_blocks
    from tests.distributed.launch import launch

    model = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    said = ("FSDP2 (run.parallel: fsdp) shards each block in a group of its own, and lm_head.weight in block 'head' "
            "is tied to a parameter of block 'model.embed_tokens': a parameter cannot be in two groups. Untie the "
            "weights (tie_word_embeddings=False in the model's config, then save it) or train with DDP (drop "
            "--parallel fsdp)")
    with pytest.raises(ValueError) as caught:
        shard_blocks(model, discover_blocks(model))  # refused before it needs a process group
    assert str(caught.value) == said
    args = ["train", "--task", "text-lm", "--model", str(tiny_llama_dir), "--data", str(story), "--epochs", "1",
            "--batch-size", "8", "--set", "model.max_length=16", "--device", "cpu", "--no-progress",
            "--parallel", "fsdp", "--run-dir", str(tmp_path / "run")]
    ranks = launch({}, tmp_path / "ranks", module="layerfreeze", args=args, timeout=200, fresh=True)
    assert ranks.returncodes == [2, 2], ranks.outputs
    assert ranks.outputs[0].count("layerfreeze: error:") == 1 and f"layerfreeze: error: {said}" in ranks.outputs[0]
    assert "Traceback" not in ranks.outputs[0] + ranks.outputs[1]


def test_a_decoder_and_a_classifier_of_another_label_count_load_as_text_csv_classifiers(tmp_path, tiny_bert_dir):
    # GPT-2 / Llama folders as text-csv classifiers failed at step 1: "Cannot handle batch sizes > 1 if no padding
    # token is defined"; a saved 2-label classifier for 3 classes raised transformers' size-mismatch error
    from tokenizers import Tokenizer, models, pre_tokenizers

    from layerfreeze.train.loaders import load_text_model

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]"
                                         ).save_pretrained(tmp_path)  # GPT-2's way: no padding token
    config = transformers.GPT2Config(vocab_size=len(VOCAB), n_embd=16, n_layer=2, n_head=2, n_positions=64,
                                     eos_token_id=2, bos_token_id=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    model, tokenizer = load_text_model(tmp_path, num_labels=3)
    batch = tokenizer(["the cat sat", "a dog ran on the mat"], padding=True, return_tensors="pt")
    assert model(**batch).logits.shape == (2, 3) and model.config.pad_token_id == tokenizer.eos_token_id == 2
    with pytest.warns(UserWarning, match=r"its classification head has 2 labels and the data 3: a new head of 3"):
        model, _ = load_text_model(tiny_bert_dir, num_labels=3)  # a BertForSequenceClassification of 2 labels
    assert model.classifier.out_features == 3
