"""The library API inside an ``accelerate.Accelerator`` loop (the README example), bf16 autocast on CPU, and fp16
autocast with a GradScaler over a frozen prefix held in half precision ("Attempting to unscale FP16 gradients"
must not happen)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402

from layerfreeze import Freezer, block_param_groups, discover_blocks  # noqa: E402

from .integration_models import Scripted, blobs, mlp  # noqa: E402


def loader():
    x, y = blobs(64)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)


@pytest.fixture
def fresh_accelerate_state():
    """accelerate's state is a process-wide singleton (an HF Trainer test before this one set it up without
    mixed precision): start from a clean one, leave a clean one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_freezer_inside_an_accelerator_loop_with_bf16_autocast(fresh_accelerate_state):
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = mlp()
    optimizer = torch.optim.AdamW(block_param_groups(model, discover_blocks(model), lr=0.05))
    freezer = Freezer(model, optimizer, Scripted({0: [("freeze", 0)], 3: [("freeze", 1)]}))
    model, optimizer, data = accelerator.prepare(model, optimizer, loader())
    first = model[0].weight.detach().clone()
    dtypes = set()
    model[4].register_forward_hook(lambda m, args, out: dtypes.add(out.dtype))
    seen = {}
    for x, y in data:
        loss = nn.functional.cross_entropy(model(x), y)  # prepare() runs the forward under bf16 autocast
        accelerator.backward(loss)
        freezer.after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        freezer.step()
        seen[freezer.step_count] = model[2].weight.detach().clone()
    assert torch.equal(first, model[0].weight)  # frozen from the start: bitwise unchanged
    assert not torch.equal(seen[1], seen[3]) and torch.equal(seen[3], seen[8])  # frozen after step 3
    assert [(h["index"], h["step"]) for h in freezer.history] == [(0, 0), (1, 3)]
    assert dtypes == {torch.bfloat16} and torch.isfinite(loss)


@pytest.mark.cuda  # fp16 autocast with a GradScaler needs CUDA
def test_fp16_grad_scaler_with_a_half_precision_frozen_prefix():
    device = torch.device("cuda")
    model = mlp().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    freezer = Freezer(model, optimizer, "static", {"k": 2})
    for block in freezer.blocks[:2]:  # frozen weights kept in half precision (memory), trainable ones in fp32
        for _, module in block.modules:
            module.half()
    frozen = model[0].weight.detach().clone()
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader():
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # raises "Attempting to unscale FP16 gradients" if a frozen fp16 weight had one
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        freezer.step()
    assert torch.equal(frozen, model[0].weight) and model[0].weight.dtype == torch.float16
    assert model[6].weight.dtype == torch.float32 and torch.isfinite(loss)


def test_an_accelerated_optimizer_gets_the_hook_on_the_optimizer_it_wraps(fresh_accelerate_state):
    # accelerate's AcceleratedOptimizer subclasses torch.optim.Optimizer without running its __init__: registering
    # the step hook on it raised AttributeError (the HF callback's Freezer held one), and inner_optimizer returned it
    from layerfreeze.engine.optim import inner_optimizer

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(5)], nn.Linear(16, 4))
    blocks = discover_blocks(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = Accelerator(cpu=True)
    model, wrapped = accelerator.prepare(model, optimizer)
    assert type(wrapped).__name__ == "AcceleratedOptimizer" and inner_optimizer(wrapped) is optimizer
    freezer = Freezer(model, wrapped, "autofreeze", {"interval": 2}, blocks=blocks)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        wrapped.step()
        wrapped.zero_grad(set_to_none=True)
        freezer.step()
    assert freezer._grad_sums.added == 0 and all(v > 0 for v in freezer.last_signals["grad_l1"][:5])
    assert len(optimizer._optimizer_step_post_hooks) == 2  # the grad_l1 sums and the LR factors' restore
    freezer.close()


def test_egeria_built_after_prepare_under_bf16_runs_its_reference_in_fp32(fresh_accelerate_state):
    # the HF Trainer's callback builds its Freezer after accelerator.prepare, which set an autocast forward on the
    # model's instance: Egeria's int8 reference copied it and failed "expected scalar type Float but found BFloat16"
    from .integration_models import TokenDataset, tiny_bert

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.DataLoader(TokenDataset(32), batch_size=8)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    assert "forward" in vars(model)  # accelerate's autocast wrapper
    freezer = Freezer(model, optimizer, "egeria", {"interval": 2, "synchronous": True})
    try:
        for batch in data:
            accelerator.backward(model(**batch).loss)
            freezer.after_backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            freezer.step()
        assert freezer.strategy.evaluations == 2 and "forward" not in vars(freezer.strategy._shadow)
    finally:
        freezer.close()


def test_the_cached_forward_under_accelerates_mixed_precision_warns_without_its_autocast(fresh_accelerate_state):
    # accelerate's bf16 wraps model.forward; the cache runs the blocks itself, so the suffix ran in float32, in
    # silence (the run differed from the uncached one from the first cached forward)
    from layerfreeze import CachedPrefix

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    freezer = Freezer(model, optimizer, "static", {"k": 1})
    model, optimizer = accelerator.prepare(model, optimizer)
    forward = CachedPrefix(model, freezer=freezer, input_key="x")
    x, _ = blobs(8)
    batch = {"x": x, "index": torch.arange(8)}
    dtypes = set()
    model[4].register_forward_hook(lambda m, args, out: dtypes.add(out.dtype))
    with pytest.warns(UserWarning, match=r"Call the cached forward under `with accelerator.autocast\(\):`"):
        forward(batch)
    assert dtypes == {torch.float32}
    with accelerator.autocast():
        forward(batch)
    assert dtypes == {torch.float32, torch.bfloat16}
    freezer.close()
