"""Model families built from tiny random configs (nothing downloaded): discovery gives the exact blocks in forward
order, freezing the first blocks leaves them bitwise unchanged over real optimizer steps while the rest train,
tied weights belong to one block, and where the forward split is supported the activation cache's logits equal the
model's own."""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision
from torch import nn
from torch.nn import functional as F

from layerfreeze import ActivationCache, CachedPrefix, Freezer, block_param_groups, discover_blocks, find_blocks
from layerfreeze.errors import BlockDiscoveryError
from layerfreeze.models.blocks import unassigned_parameters
from layerfreeze.models.discovery import split_for
from layerfreeze.train.lm import lm_forward, next_token_loss
from tests.conftest import DEVICES

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
warnings.filterwarnings("ignore", message=".*(bos|eos|pad)_token_id.*")

VOCAB = 48
SMALL = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=VOCAB,
             max_position_embeddings=32)


# ---- the models: (builder, kind of input, expected block names, rule) -------------------------------------------

def hf(cls_name: str, config_name: str, **kw):
    return lambda: getattr(transformers, cls_name)(getattr(transformers, config_name)(**kw))


LM = ["model.embed_tokens", "model.layers.0", "model.layers.1", "head"]
ENC = lambda base: [f"{base}.embeddings", f"{base}.encoder.layer.0", f"{base}.encoder.layer.1"]  # noqa: E731
MODELS = {
    # decoder LMs
    "llama": (hf("LlamaForCausalLM", "LlamaConfig", **SMALL, num_key_value_heads=1, tie_word_embeddings=True),
              "lm", LM, "Hugging Face decoder LM"),
    "qwen2": (hf("Qwen2ForCausalLM", "Qwen2Config", **SMALL, num_key_value_heads=1), "lm", LM, None),
    "mistral": (hf("MistralForCausalLM", "MistralConfig", **SMALL, num_key_value_heads=1), "lm", LM, None),
    "gemma": (hf("GemmaForCausalLM", "GemmaConfig", **SMALL, num_key_value_heads=1, head_dim=8), "lm", LM, None),
    "phi": (hf("PhiForCausalLM", "PhiConfig", **SMALL), "lm", LM, None),
    "gpt2": (hf("GPT2LMHeadModel", "GPT2Config", n_embd=16, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=32),
             "lm", ["transformer.embeddings", "transformer.h.0", "transformer.h.1", "head"], None),
    "gpt_neox": (hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **SMALL), "lm",
                 ["gpt_neox.embed_in", "gpt_neox.layers.0", "gpt_neox.layers.1", "head"], None),
    # encoders
    "bert": (hf("BertForSequenceClassification", "BertConfig", **SMALL, num_labels=3), "text",
             ENC("bert") + ["bert.pooler", "classifier"], "Hugging Face encoder (BERT-like)"),
    "roberta": (hf("RobertaForSequenceClassification", "RobertaConfig", **SMALL, pad_token_id=1, num_labels=3),
                "text", ENC("roberta") + ["classifier"], None),
    "xlm_roberta": (hf("XLMRobertaForSequenceClassification", "XLMRobertaConfig", **SMALL, pad_token_id=1,
                       num_labels=3), "text", ENC("roberta") + ["classifier"], None),
    "electra": (hf("ElectraForSequenceClassification", "ElectraConfig", **SMALL, embedding_size=8, num_labels=3),
                "text", ENC("electra") + ["classifier"], None),
    "deberta_v2": (hf("DebertaV2ForSequenceClassification", "DebertaV2Config", **SMALL, relative_attention=True,
                      position_buckets=8, num_labels=3), "text", ENC("deberta") + ["head"], None),
    "distilbert": (hf("DistilBertForSequenceClassification", "DistilBertConfig", dim=16, n_layers=2, n_heads=2,
                      hidden_dim=32, vocab_size=VOCAB, max_position_embeddings=32, num_labels=3), "text",
                   ["distilbert.embeddings", "distilbert.transformer.layer.0", "distilbert.transformer.layer.1",
                    "head"], None),
    # encoder-decoders
    "t5": (hf("T5ForConditionalGeneration", "T5Config", d_model=16, d_ff=32, num_layers=2, num_heads=2, d_kv=8,
              vocab_size=VOCAB, decoder_start_token_id=0), "seq2seq",
           ["encoder.embeddings", "encoder.block.0", "encoder.block.1", "encoder.final_layer_norm",
            "decoder.block.0", "decoder.block.1", "head"], "Hugging Face encoder-decoder (T5, BART)"),
    "bart": (hf("BartForConditionalGeneration", "BartConfig", d_model=16, encoder_layers=2, decoder_layers=2,
                encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                vocab_size=VOCAB, max_position_embeddings=32), "seq2seq",
             ["model.encoder.embeddings", "model.encoder.layers.0", "model.encoder.layers.1",
              "model.decoder.embeddings", "model.decoder.layers.0", "head"], None),  # lm_head is tied: it joins
    # the last decoder layer, so that the head owns weights
    # Hugging Face vision
    "hf_vit": (hf("ViTForImageClassification", "ViTConfig", **SMALL, image_size=16, patch_size=8, num_labels=3),
               "image", ["vit.embeddings", "vit.layers.0", "vit.layers.1", "head"],
               "Hugging Face vision (ViT, DeiT, Swin, ConvNeXt)"),
    "hf_deit": (hf("DeiTForImageClassification", "DeiTConfig", **SMALL, image_size=16, patch_size=8, num_labels=3),
                "image", ["deit.embeddings", "deit.layers.0", "deit.layers.1", "head"], None),
    "hf_swin": (hf("SwinForImageClassification", "SwinConfig", image_size=16, patch_size=4, embed_dim=8,
                   depths=[1, 1], num_heads=[1, 2], window_size=2, num_labels=3), "image",
                ["swin.embeddings", "swin.encoder.layers.0", "swin.encoder.layers.1", "head"], None),
    "hf_convnext": (hf("ConvNextForImageClassification", "ConvNextConfig", hidden_sizes=[8, 16], depths=[1, 1],
                       num_stages=2, num_labels=3), "image",
                    ["convnext.embeddings", "convnext.encoder.stages.0", "convnext.encoder.stages.1", "head"], None),
    # torchvision transformers (small configs of the ViT-B/16 and Swin-T classes)
    "tv_vit": (lambda: torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2,
                                                            hidden_dim=16, mlp_dim=32, num_classes=3), "image",
               ["conv_proj", "encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1", "head"],
               "torchvision ViT / Swin"),
    "tv_swin": (lambda: torchvision.models.SwinTransformer(patch_size=[4, 4], embed_dim=8, depths=[1, 1],
                                                           num_heads=[1, 2], window_size=[2, 2], num_classes=3),
                "image", ["features.0", "features.1", "features.2", "features.3", "head"], None),
    # torchvision CNNs: the classes of ResNet-50, EfficientNet-B0, ConvNeXt-T and DenseNet-121, small settings
    "tv_resnet": (lambda: torchvision.models.ResNet(torchvision.models.resnet.Bottleneck, [1, 1, 1, 1], num_classes=3,
                                                    width_per_group=8), "image",
                  ["stem", "layer1", "layer2", "layer3", "layer4", "fc"], "ResNet-like (conv1 bn1 layer1..4 fc)"),
    "tv_efficientnet": (lambda: torchvision.models.EfficientNet(
        torchvision.models.efficientnet._efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.25)[0],
        dropout=0.2, num_classes=3), "image", [f"features.{i}" for i in range(9)] + ["classifier"], None),
    "tv_convnext": (lambda: torchvision.models.ConvNeXt(
        [torchvision.models.convnext.CNBlockConfig(8, 16, 1), torchvision.models.convnext.CNBlockConfig(16, None, 1)],
        num_classes=3), "image", [f"features.{i}" for i in range(4)] + ["classifier"], None),
    "tv_densenet": (lambda: torchvision.models.DenseNet(growth_rate=4, block_config=(1, 1), num_init_features=8,
                                                        num_classes=3), "image",
                    ["features.conv0", "features.norm0", "features.denseblock1", "features.transition1",
                     "features.denseblock2", "features.norm5", "classifier"],
                    "torchvision features+classifier (MobileNetV2, EfficientNet, ConvNeXt, DenseNet, VGG)"),
}

# The full-size torchvision models of the issue: discovery only (building is cheap, training them is not).
TORCHVISION = {
    "resnet50": (torchvision.models.resnet50, ["stem", "layer1", "layer2", "layer3", "layer4", "fc"]),
    "efficientnet_b0": (torchvision.models.efficientnet_b0, [f"features.{i}" for i in range(9)] + ["classifier"]),
    "convnext_tiny": (torchvision.models.convnext_tiny, [f"features.{i}" for i in range(8)] + ["classifier"]),
    "densenet121": (torchvision.models.densenet121,
                    ["features.conv0", "features.norm0", "features.denseblock1", "features.transition1",
                     "features.denseblock2", "features.transition2", "features.denseblock3", "features.transition3",
                     "features.denseblock4", "features.norm5", "classifier"]),
    "vgg11": (torchvision.models.vgg11, [f"features.{i}" for i in (0, 3, 6, 8, 11, 13, 16, 18)] + ["classifier"]),
    "swin_t": (torchvision.models.swin_t, [f"features.{i}" for i in range(8)] + ["head"]),
    "vit_b_16": (torchvision.models.vit_b_16,
                 ["conv_proj"] + [f"encoder.layers.encoder_layer_{i}" for i in range(12)] + ["head"]),
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name][0]()


def make_batch(kind: str, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "image":
        return {"pixel_values": torch.randn(4, 3, 16, 16, generator=g),
                "labels": torch.randint(0, 3, (4,), generator=g), "index": torch.arange(4)}
    ids = torch.randint(3, VOCAB, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # one padded sample
    batch = {"input_ids": ids, "attention_mask": mask, "index": torch.arange(4)}
    if kind == "lm":
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    elif kind == "text":
        batch["labels"] = torch.randint(0, 3, (4,), generator=g)
    else:  # seq2seq: a decoder target
        batch["labels"] = torch.randint(3, VOCAB, (4, 6), generator=g)
    return batch


def loss_of(model: nn.Module, kind: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if kind == "lm":
        return next_token_loss(lm_forward(model, batch), batch["labels"])
    if kind == "image":
        out = model(batch["pixel_values"])
        return F.cross_entropy(getattr(out, "logits", out), batch["labels"])
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    return model(**inputs).loss


# ---- discovery: exact names, order, rule; every parameter in a block --------------------------------------------

@pytest.mark.parametrize("name", sorted(MODELS))
def test_discovery_finds_each_familys_blocks_in_forward_order(name):
    model = build(name)
    found = find_blocks(model)
    assert [b.name for b in found.blocks] == MODELS[name][2]
    assert [b.index for b in found.blocks] == list(range(len(found.blocks)))
    assert found.blocks[-1].is_head and not any(b.is_head for b in found.blocks[:-1])
    if MODELS[name][3] is not None:
        assert found.rule == MODELS[name][3]
    assert unassigned_parameters(model, found.blocks) == []  # nothing trains outside a block


@pytest.mark.parametrize("name", sorted(TORCHVISION))
def test_discovery_of_the_full_size_torchvision_models(name):
    builder, names = TORCHVISION[name]
    model = builder(num_classes=3)
    blocks = discover_blocks(model)
    assert [b.name for b in blocks] == names
    assert unassigned_parameters(model, blocks) == []


def test_timm_models_when_timm_is_installed():
    timm = pytest.importorskip("timm")
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    vit = VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=3)
    found = find_blocks(vit)
    assert found.rule == "timm" and [b.name for b in found.blocks] == ["patch_embed", "blocks.0", "blocks.1", "head"]
    assert {n for n, _ in found.blocks[0].params} == {"cls_token", "pos_embed"}  # the first block owns them
    assert unassigned_parameters(vit, found.blocks) == []
    effnet = timm.create_model("efficientnet_b0", pretrained=False, num_classes=3)
    assert [b.name for b in discover_blocks(effnet)] == ["stem"] + [f"blocks.{i}" for i in range(7)] + ["head"]
    _check_freeze(vit, "image", k=2)


# ---- freezing the first k blocks: bitwise unchanged, the rest train ---------------------------------------------

def _check_freeze(model: nn.Module, kind: str, k: int, steps: int = 3) -> list:
    blocks = discover_blocks(model)
    optimizer = torch.optim.AdamW(block_param_groups(model, blocks, lr=1e-2, weight_decay=0.01))
    freezer = Freezer(model, optimizer, "static", {"k": k}, blocks=blocks)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    for step in range(steps):
        loss = loss_of(model, kind, make_batch(kind, seed=step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        freezer.step()
    after = dict(model.named_parameters())
    for block in blocks[:k]:
        for n, p in block.named_parameters():
            assert not p.requires_grad and torch.equal(p, before[n]), (block.name, n)
    for block in blocks[k:]:
        changed = [n for n, p in block.named_parameters() if not torch.equal(p.detach(), before[n])]
        assert changed, f"trainable block {block.name} did not change"
    assert len(after) == len(before)
    return blocks


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_frozen_prefix_stays_bitwise_unchanged_while_the_rest_trains(name):
    _check_freeze(build(name), MODELS[name][1], k=2)


# ---- tied weights ------------------------------------------------------------------------------------------------

def test_a_tied_lm_head_belongs_to_the_embeddings_and_freezes_with_them():
    model = build("llama")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    found = find_blocks(model)
    head = found.blocks[-1]
    assert head.tied == {"lm_head.weight": "model.embed_tokens"}
    assert [n for n, _ in head.named_parameters()] == ["model.norm.weight"]  # the head owns its norm only
    assert found.ties and "owned by block 'model.embed_tokens'" in found.ties[0]
    groups = block_param_groups(model, found.blocks, lr=1e-3)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))  # each parameter in one param group
    _check_freeze(model, "lm", k=1)  # the embeddings frozen: the tied LM head matrix stays bitwise the same too
    assert not model.lm_head.weight.requires_grad


def test_ties_are_detected_generally_and_the_earliest_block_owns_them():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
            self.c.weight = nn.Parameter(torch.randn(2, 4))
            self.b.weight = self.a.weight  # a tie between blocks 0 and 1

    model = Shared()
    blocks = discover_blocks(model, ["a", "b", "c"])
    assert blocks[1].tied == {"b.weight": "a"} and [n for n, _ in blocks[1].named_parameters()] == ["b.bias"]
    model.b.bias = model.a.bias  # now block b owns nothing: refused with what to do
    with pytest.raises(BlockDiscoveryError, match="only parameters tied to earlier blocks"):
        discover_blocks(model, ["a", "b", "c"])


# ---- the generic fallback --------------------------------------------------------------------------------------

class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.body = nn.Module()
        self.body.layers = nn.ModuleList([Layer() for _ in range(3)])
        self.body.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 2)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        x = self.embed(x) * self.scale
        for layer in self.body.layers:
            x = layer(x)
        return self.out(self.body.norm(x))


def test_the_generic_fallback_takes_the_longest_stack_of_same_type_layers():
    model = Custom()
    found = find_blocks(model)
    assert found.rule == "generic stack: body.layers (3 x Layer)"
    assert [b.name for b in found.blocks] == ["embed", "body.layers.0", "body.layers.1", "body.layers.2", "head"]
    assert [n for n, _ in found.blocks[0].params] == ["scale"]  # a parameter held by a parent goes first
    assert [n for n, _ in found.blocks[-1].modules] == ["body.norm", "out"]  # deepest level first
    assert unassigned_parameters(model, found.blocks) == []
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    blocks = found.blocks
    optimizer = torch.optim.SGD(block_param_groups(model, blocks, lr=0.1))
    Freezer(model, optimizer, "static", {"k": 2}, blocks=blocks)
    frozen = [p.detach().clone() for b in blocks[:2] for p in b.parameters()]
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.equal(a, p) for a, p in zip(frozen, (p for b in blocks[:2] for p in b.parameters())))


def test_a_model_without_a_stack_still_gets_the_clear_error():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))

    with pytest.raises(BlockDiscoveryError) as err:
        discover_blocks(Mixed())
    text = str(err.value)
    assert "no stack of same-type layers" in text and "body (Sequential" in text and "blocks=[" in text


# ---- the forward split through the real cache: cached logits == the model's own -------------------------------

def same_logits(device: str):
    """Equality of two forwards that run the same float32 ops on the same values. On the CPU it is exact (one thread:
    the same kernel for the same shapes). On CUDA cuBLAS picks its algorithm by a heuristic that also reads the
    operands' pointer alignment, and a cached state is a fresh allocation, so the two may sum in another order:
    float32 rounding, a few ulps, which ``assert_close``'s float32 defaults (rtol 1.3e-6, atol 1e-5) allow; a split
    that misses a mask, a position or a layer changes these logits by more than 1e-2."""
    if device == "cpu":
        return torch.equal

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        torch.testing.assert_close(a, b, rtol=1.3e-6, atol=1e-5)
        return True

    return close


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, depth", [("llama", 2), ("qwen2", 3), ("mistral", 1), ("gemma", 2), ("gpt2", 2),
                                         ("hf_vit", 2), ("hf_deit", 3), ("tv_vit", 2)])
def test_cached_and_uncached_forwards_give_the_same_logits(name, depth, device):
    model = build(name).to(device)
    kind = MODELS[name][1]
    blocks = discover_blocks(model)
    split = split_for(model, blocks)
    optimizer = torch.optim.AdamW(block_param_groups(model, blocks, lr=1e-2))
    freezer = Freezer(model, optimizer, "static", {"k": depth}, blocks=blocks)
    runner = CachedPrefix(model, blocks, split, ActivationCache(), freezer=freezer)
    model.eval()
    batch = {k: v.to(device) for k, v in make_batch(kind).items() if k != "labels"}
    if kind == "lm":
        own = lm_forward(model, batch)  # the text-lm task's forward
    else:
        out = model(batch["pixel_values"])
        own = getattr(out, "logits", out)
    same = same_logits(device)
    cold = runner(batch)  # misses: the prefix runs and is stored
    warm = runner(batch)  # hits: the prefix is read back
    assert runner.cache.hits == 4 and runner.prefix_samples == 4
    assert cold.device.type == own.device.type == device
    assert same(cold, own) and same(warm, own)
    for d in range(1, split.max_depth + 1):  # every boundary, and carrying a cached state deeper
        assert same(split.suffix(model, split.prefix(model, batch, d), batch, d), own), d
    assert same(split.extend(model, split.prefix(model, batch, 1), batch, 1, split.max_depth),
                split.prefix(model, batch, split.max_depth))


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_the_lm_splits_pass_no_kv_cache_under_the_name_the_installed_transformers_uses(name, monkeypatch):
    """transformers 5.17 names the argument ``past_key_values`` where 5.2x names it ``cache``; the split passed
    ``cache=None`` to ``create_causal_mask`` whatever the version, a TypeError on 5.17 (issue 41: every decoder LM's
    cache test failed on a GPU machine that had 5.17). Here ``masking_utils``' mask functions take 5.17's
    signature; the split's logits must still be the model's own, bit for bit."""
    import transformers.masking_utils as mu

    from layerfreeze.models.families.decoder_lm import _no_kv_cache

    def old_signature(real):
        def made(config, inputs_embeds, attention_mask, past_key_values, position_ids=None, **kw):
            assert past_key_values is None
            return real(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                        position_ids=position_ids, **_no_kv_cache(real), **kw)
        return made

    for fn in ("create_causal_mask", "create_sliding_window_causal_mask"):
        monkeypatch.setattr(mu, fn, old_signature(getattr(mu, fn)))
    assert _no_kv_cache(mu.create_causal_mask) == {"past_key_values": None}
    assert _no_kv_cache(lambda hidden, **kwargs: None) == {}
    model = build(name).eval()
    blocks = discover_blocks(model)
    split = split_for(model, blocks)
    batch = {k: v for k, v in make_batch("lm").items() if k != "labels"}
    own = lm_forward(model, batch)
    assert torch.equal(split.suffix(model, split.prefix(model, batch, 2), batch, 2), own)


@pytest.mark.parametrize("name", ["t5", "phi", "tv_swin", "hf_swin"])
def test_families_without_an_exact_split_are_refused(name):
    model = build(name)
    with pytest.raises(ValueError, match="Cannot split the forward"):
        split_for(model, discover_blocks(model))


def test_a_trainable_class_token_in_the_prefix_is_refused_by_the_cache():
    from layerfreeze.compute.cache import CacheRefused

    model = build("tv_vit")
    blocks = discover_blocks(model)
    for p in blocks[0].parameters():
        p.requires_grad_(p is model.class_token)  # conv_proj frozen by hand, the class token still training
    model.eval()
    runner = CachedPrefix(model, blocks, split_for(model, blocks), ActivationCache())
    with pytest.raises(CacheRefused, match="'class_token' in the cached prefix"):
        runner({"pixel_values": torch.randn(4, 3, 16, 16), "index": torch.arange(4)}, depth=1)


def test_a_plain_model_trains_without_importing_transformers_or_torchvision(tmp_path):
    # A family check says no to a model whose library was never imported (no object of its classes can exist) instead
    # of importing it: transformers and torchvision cost ~2.5 s of every process start on a 2-core CPU. A real
    # one-epoch Trainer run on an nn.Sequential, with the activation cache (split_for tries every family), in a fresh
    # interpreter.
    import subprocess
    import sys

    code = """
import sys
import torch
from torch import nn
from layerfreeze.models.discovery import discover_blocks, split_for
from layerfreeze.train.config import build_config
from layerfreeze.train.data import GaussianBlobs
from layerfreeze.train.tasks import Task, image_forward
from layerfreeze.train.trainer import Trainer
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
task = Task("points", model, GaussianBlobs(32, seed=1), GaussianBlobs(8, seed=2), 4, "mlp", image_forward)
cfg = build_config({"train": {"epochs": 1, "batch_size": 8},
                    "freeze": {"strategy": "smartfrz", "cache": {"mode": "on"}},
                    "run": {"dir": sys.argv[1], "progress": False, "tensorboard": False}})
trainer = Trainer(cfg, task=task)
trainer.run()
assert type(split_for(model, discover_blocks(model))).__name__ == "SequentialSplit"
print(sorted(m for m in ("transformers", "torchvision", "timm") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_a_family_whose_library_was_never_imported_says_so_in_the_split_error(monkeypatch):
    # split_for's refusal names the families it skipped and why (their library is not imported), as it names the
    # ones that checked and refused
    import sys

    from layerfreeze.models.forward_split import never_imported

    assert not never_imported("torchvision") and never_imported("no_such_package_xyz") and not never_imported(None)
    monkeypatch.delitem(sys.modules, "transformers")
    with pytest.raises(ValueError) as err:
        split_for(nn.Module(), discover_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))))
    assert "Hugging Face BertForSequenceClassification: Module is not one (transformers is not imported)" in str(
        err.value)
    assert "torchvision MobileNetV2: Module is not a torchvision MobileNetV2" in str(err.value), str(err.value)


def test_a_head_registered_before_the_stack_is_pointed_out():
    # the generic rule put a classifier defined first in __init__ into the first block: static k=1 froze it, and
    # nothing said so (the README's "never the head")
    class HeadFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.classifier = nn.Linear(16, 3)
            self.stem = nn.Linear(8, 16)
            self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
            self.norm = nn.LayerNorm(16)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.classifier(self.norm(x))

    with pytest.warns(UserWarning, match=r"generic stack layers: classifier is registered before the stack, so it "
                                         r"is part of the first block \(stem\), frozen with it, and not the head"):
        blocks = discover_blocks(HeadFirst())
    assert [b.name for b in blocks] == ["stem", "layers.0", "layers.1", "layers.2", "norm"]
