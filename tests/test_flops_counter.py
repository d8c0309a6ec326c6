"""The FLOP counter of :func:`~layerfreeze.runs.measure.measure_flops` (:class:`~layerfreeze.runs.flops.
TotalFlopCounter`) gives the count ``FlopCounterMode`` gives (with layerfreeze's convolution-backward formula), equal
as ints, on whole training steps (forward, backward, clipping, AdamW step) of a tiny BERT, GPT-2 and Llama and of
torchvision's MobileNetV2 (depthwise convolutions) and ResNet-18, with none and with a prefix of blocks frozen, in
float32 and under bfloat16 autocast, on the CPU and on CUDA where one is visible (issue 41: the counts are taken at
dispatch, so a CUDA step counts what a CPU step counts): every FLOP figure measured before it stays the same (issue 40
item 4)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from layerfreeze import discover_blocks
from layerfreeze.runs.flops import FLOP_FORMULAS, TotalFlopCounter
from layerfreeze.runs.measure import measure_flops
from tests.conftest import DEVICES

transformers = pytest.importorskip("transformers")
torchvision = pytest.importorskip("torchvision")
pytestmark = pytest.mark.usefixtures("one_thread")
warnings.filterwarnings("ignore", message=".*(bos|eos|pad)_token_id.*")

VOCAB, SEQ, BATCH = 48, 16, 4


def _text_batch(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[0, SEQ // 2:] = 0  # one padded row: the attention mask is used
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def _bert(tiny_bert_dir, device: str) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    model = transformers.BertForSequenceClassification.from_pretrained(tiny_bert_dir)
    batch, labels = _text_batch(device), torch.tensor([0, 1, 1, 0], device=device)  # the saved head has 2 classes
    return model, lambda m: F.cross_entropy(m(**batch).logits, labels)


def _decoder(name: str, device: str) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    if name == "gpt2":
        config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=32)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                          num_key_value_heads=1, intermediate_size=32, vocab_size=VOCAB,
                                          max_position_embeddings=32, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    batch = _text_batch(device)
    return model, lambda m: m(**batch, labels=batch["input_ids"]).loss


def _vision(name: str, device: str) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    model = getattr(torchvision.models, name)(weights=None, num_classes=10)
    g = torch.Generator().manual_seed(0)
    x, labels = torch.randn(BATCH, 3, 32, 32, generator=g).to(device), torch.tensor([0, 3, 5, 9], device=device)
    return model, lambda m: F.cross_entropy(m(x), labels)


def _build(name: str, tiny_bert_dir, device: str = "cpu",
           ) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    """The model (on ``device``) and its loss on a fixed batch (on ``device``)."""
    torch.manual_seed(0)
    if name == "bert":
        model, loss_fn = _bert(tiny_bert_dir, device)
    elif name in ("gpt2", "llama"):
        model, loss_fn = _decoder(name, device)
    else:
        model, loss_fn = _vision(name, device)
    return model.to(device), loss_fn


def _train_step(model: torch.nn.Module, loss_fn, optimizer: torch.optim.Optimizer, autocast: bool):
    """One training step as the trainer runs it: forward and loss (under autocast if asked), backward, clipping,
    optimizer step."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        device_type = next(model.parameters()).device.type
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return float(loss.detach())

    return step


def _torch_count(step) -> int:
    counter = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
    with counter:
        step()
    return int(counter.get_total_flops())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "mobilenet_v2", "resnet18"])
def test_counts_equal_flop_counter_mode_on_training_steps(name: str, autocast: bool, device: str,
                                                          tiny_bert_dir) -> None:
    model, loss_fn = _build(name, tiny_bert_dir, device)
    model.train()
    blocks = discover_blocks(model)
    counts = {}
    for frozen in (0, len(blocks) // 2):  # none frozen, then the first half of the blocks
        for block in blocks[:frozen]:
            for p in block.parameters():
                p.requires_grad_(False)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        step = _train_step(model, loss_fn, optimizer, autocast)
        step()  # the optimizer's state exists from here on, as on every step the trainer measures
        expected = _torch_count(step)
        loss, flops = measure_flops(step)
        assert isinstance(flops, int) and isinstance(loss, float)
        assert flops == expected > 0
        assert _torch_count(step) == expected  # the count does not depend on which step is counted
        counts[frozen] = flops
    # freezing a prefix removes its weight and input gradients from the count
    assert counts[len(blocks) // 2] < counts[0]


def test_decomposed_ops_are_counted_as_flop_counter_mode_counts_them() -> None:
    """Under inference mode ``aten.linear`` (a CompositeImplicitAutograd op) reaches the counter undecomposed: both
    counters decompose it into ``t`` + ``addmm`` and count the addmm, 2 * 4 * 8 * 16 = 1024 FLOPs. A batch norm in
    training runs its own kernel under TotalFlopCounter (its Python decomposition counts nothing): the count, the
    output and the running statistics are those of FlopCounterMode's decomposed run."""
    torch.manual_seed(0)
    linear, x = torch.nn.Linear(8, 16), torch.randn(4, 8)
    with torch.inference_mode():
        reference = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
        with reference:
            linear(x)
        counter = TotalFlopCounter()
        with counter:
            linear(x)
    assert counter.get_total_flops() == reference.get_total_flops() == 2 * 4 * 8 * 16
    assert counter.get_flop_counts() == {"Global": {torch.ops.aten.addmm: 1024}}

    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, bias=False), torch.nn.BatchNorm2d(4))
    images = torch.randn(2, 3, 8, 8)
    twin = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, bias=False), torch.nn.BatchNorm2d(4))
    twin.load_state_dict(conv.state_dict())
    reference = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
    with reference:
        expected_out = twin(images)
    counter = TotalFlopCounter()
    with counter:
        out = conv(images)
    # the convolution only: 2 * (2 * 4 * 6 * 6 outputs) * (3 * 3 * 3 multiply-adds each) = 15552
    assert counter.get_total_flops() == reference.get_total_flops() == 2 * (2 * 4 * 6 * 6) * 27 == 15552
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(conv[1].running_var, twin[1].running_var, rtol=1e-6, atol=1e-7)


def test_a_frozen_layers_fused_cpu_attention_is_counted(tiny_bert_dir) -> None:
    # torch's registry leaves CPU's fused attention (_scaled_dot_product_flash_attention_for_cpu) at 0: the attention
    # of a frozen (eval-mode) layer, or of any layer of a model without attention dropout, went uncounted on a CPU,
    # while a training-mode layer with attention dropout (the decomposed path) was counted
    batch = _text_batch("cpu")
    counts = {}
    for impl in ("sdpa", "eager"):  # the fused kernel against explicit matmuls
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification.from_pretrained(tiny_bert_dir, attn_implementation=impl)
        model.eval()
        with torch.no_grad(), TotalFlopCounter() as counter:
            model(**batch)
        counts[impl] = counter.get_total_flops()
    assert counts["sdpa"] == counts["eager"] > 0
    q = torch.randn(2, 3, SEQ, 8, requires_grad=True)
    with TotalFlopCounter() as counter:
        F.scaled_dot_product_attention(q, q, q).sum().backward()
    # forward: Q K^T and P V; backward as torch counts its CUDA kernels: the scores again, then dV, dP, dQ, dK
    assert counter.get_total_flops() == (2 + 5) * 2 * 2 * 3 * SEQ * SEQ * 8
