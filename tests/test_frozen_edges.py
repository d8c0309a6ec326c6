"""Frozen models beside the trained one, at their edges: copies to the host, gradients that must or must not flow,
inputs with NaN, a worker that dies, pipelines that overlap, weights changed after precompute."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from layerfreeze.compute.frozen import (
    FrozenDifferentiable,
    FrozenModule,
    FrozenPipeline,
    FrozenWorkerError,
    PrecomputeRefused,
)
from layerfreeze.compute.precomputed import PrecomputedDataset, precompute


class _RecordsCopies(torch.Tensor):
    """A tensor that records the destination and ``non_blocking`` of every ``.to(device, ...)``."""

    copies: list[tuple[str, bool]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device)):
            cls.copies.append((torch.device(args[1]).type, bool(kwargs.get("non_blocking", False))))
        return super().__torch_function__(func, types, args, kwargs)


def test_copies_to_the_host_block():
    # a frozen model on a GPU with the default output_device="cpu" (or one offloaded to the CPU beside a GPU trainer)
    # copied with non_blocking=True: the pinned result is returned before the copy has landed, and the cast to float32,
    # the trainer or precompute's store read it unfinished, in silence (PyTorch's "pinmem_nonblock" tutorial)
    _RecordsCopies.copies = []
    out = FrozenModule(nn.Identity())(torch.randn(2, 3).as_subclass(_RecordsCopies))
    assert [t for t, _ in _RecordsCopies.copies] == ["cpu", "cpu"]  # the input's copy, the output's
    assert not any(non_blocking for _, non_blocking in _RecordsCopies.copies)
    assert out.dtype == torch.float32


@pytest.mark.cuda
def test_a_gpu_frozen_models_output_on_the_host_is_complete():
    frozen = FrozenModule(nn.Identity(), device="cuda", dtype=torch.bfloat16)  # output_device: cpu (default)
    x = torch.ones(4096, 4096, device="cuda")
    for _ in range(20):
        assert float(frozen(x * 2).mean()) == 2.0


def test_a_frozen_module_refuses_an_input_whose_gradient_it_would_drop():
    # a perceptual loss (or a soft prompt fed to a frozen text encoder) through FrozenModule: under no_grad its term
    # gave no gradient, and the trained model trained on the other terms only, in silence
    trained, vgg = nn.Linear(3, 3), FrozenModule(nn.Linear(3, 3), name="perceptual net")
    pred = trained(torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"perceptual net: input.args\[0\] requires grad.*FrozenDifferentiable"):
        vgg(pred)
    assert not vgg(pred.detach()).requires_grad
    with torch.no_grad():
        vgg(trained(torch.randn(2, 3)))  # evaluation: nothing to drop
    differentiable = FrozenDifferentiable(nn.Linear(3, 3))
    differentiable(trained(torch.randn(2, 3))).sum().backward()
    assert trained.weight.grad is not None


def test_a_frozen_base_model_gets_no_gradient_when_a_parent_unfreezes_it():
    # ControlNet training with both models in one wrapper: wrapper.requires_grad_(True) reached the frozen UNet, and
    # every backward filled a UNet-sized gradient (an optimizer over wrapper.parameters() trained the "frozen" UNet)
    torch.manual_seed(0)
    unet, controlnet = nn.Linear(4, 4), nn.Linear(4, 4)
    unet(torch.randn(2, 4)).sum().backward()  # a gradient left from before it was frozen
    frozen = FrozenDifferentiable(unet)
    assert unet.weight.grad is None and not unet.weight.requires_grad
    wrapper = nn.ModuleDict({"unet": unet, "controlnet": controlnet})
    wrapper.requires_grad_(True)
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.1)
    before = unet.weight.clone()
    frozen(controlnet(torch.randn(2, 4))).square().sum().backward()
    optimizer.step()
    assert all(p.grad is None and not p.requires_grad for p in unet.parameters())
    assert torch.equal(unet.weight, before) and controlnet.weight.grad is not None


def test_inputs_with_missing_values_are_the_same_inputs_twice():
    # a NaN in an item (a missing value) was "random augmentation" to precompute (NaN != NaN) and, past that, every
    # such item was "not the one precompute ran the frozen models on" to PrecomputedDataset
    import numpy as np

    nan = float("nan")
    data = [{"x": torch.tensor([1.0, nan, float(i)]), "np": np.array([nan, i]), "f": nan, "index": i} for i in range(6)]
    store = precompute(data, lambda b: torch.nan_to_num(b["x"]), batch_size=4)
    assert PrecomputedDataset(data, store)[5]["features"].tolist() == [1.0, 0.0, 5.0]
    other = [{**item, "x": item["x"] + 1} for item in data]
    with pytest.raises(PrecomputeRefused, match=r"item 2 \(index 2\): its 'x' is not the one"):
        PrecomputedDataset(other, store)[2]


def _consume(pipe, seconds=10.0):
    """``list(pipe)`` in a thread: what it gave, or raised, or "hung" after ``seconds``."""
    got = []

    def run():
        try:
            got.append(list(pipe))
        except BaseException as exc:  # noqa: BLE001
            got.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return "hung" if thread.is_alive() else got[0]


def test_a_worker_that_dies_without_a_word_ends_the_iteration_with_an_error():
    # an exception whose str() raises killed the worker inside its own error report, and the trainer waited forever;
    # so did a worker thread that ended any other way without putting its end
    class Odd(Exception):
        def __str__(self):
            raise RuntimeError("no text")

    def fn(x):
        if x == 3:
            raise Odd()
        return x

    got = _consume(FrozenPipeline(range(6), fn, threads=None))
    assert isinstance(got, FrozenWorkerError)
    assert "Odd in the frozen-model worker: <str() of the Odd failed>" in str(got)
    silent = FrozenPipeline(range(6), lambda x: x, threads=None)
    silent._work = lambda batches, run: None  # the worker thread ends, nothing said
    got = _consume(silent)
    assert isinstance(got, FrozenWorkerError) and "ended without a batch" in str(got)


def test_overlapping_pipelines_give_the_trainer_its_thread_count_back():
    # two pipelines zipped (or an eval pipeline left open): each restored the count it found when it started, so the
    # one that ended last left the trainer on the other's share (one thread of two) for the rest of the run
    torch.set_num_threads(2)
    try:
        first, second = iter(FrozenPipeline(range(3), lambda x: x, threads=(1, 1))), None
        next(first)
        second = iter(FrozenPipeline(range(5), lambda x: x, threads=(1, 1)))
        next(second)
        assert list(first) == [1, 2] and torch.get_num_threads() == 1  # the other pipeline still splits the cores
        assert list(second) == [1, 2, 3, 4]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(2)


def test_a_frozen_model_whose_weights_change_after_precompute_is_not_read_stale():
    # precompute ran before the pretrained weights were loaded (or the encoder trained later on): PrecomputedDataset
    # served the outputs of weights the model no longer had, in silence
    torch.manual_seed(0)
    data = [{"x": torch.randn(3), "index": i} for i in range(8)]
    encoder = FrozenModule(nn.Linear(3, 2), name="text encoder")
    store = precompute(data, lambda b: encoder(b["x"]), batch_size=4)
    assert PrecomputedDataset(data, store)[3]["features"].shape == (2,)
    encoder.module.load_state_dict(nn.Linear(3, 2).state_dict())  # the pretrained weights, loaded too late
    with pytest.raises(PrecomputeRefused, match=r"a weight \('weight'\) of frozen model text encoder changed since "
                                                r"precompute ran it .* run precompute again"):
        PrecomputedDataset(data, store)[3]
    store = precompute(data, lambda b: encoder(b["x"]), batch_size=4)  # again, after the change: read
    assert torch.allclose(PrecomputedDataset(data, store)[3]["features"], encoder(data[3]["x"][None])[0])
    encoder.module.to(torch.float64)
    with pytest.raises(PrecomputeRefused, match="changed since precompute"):
        PrecomputedDataset(data, store)[0]
    encoder.module.to(torch.float32)
    encoder.module.bias = nn.Parameter(torch.zeros(2))  # replaced
    with pytest.raises(PrecomputeRefused, match=r"\('bias'\)"):
        PrecomputedDataset(data, store)[0]


def test_precompute_takes_a_collate_fn_for_items_of_different_lengths():
    # token ids of different lengths: precompute stacked them with torch's default collate, raised torch's "stack
    # expects each tensor to be equal size", and had no way to be given the padding collate the DataLoader uses
    data = [{"ids": torch.arange(3 + i % 3), "index": i} for i in range(6)]
    with pytest.raises(ValueError, match=r"items of a batch differ in shape .* give precompute a collate_fn"):
        precompute(data, lambda b: b["ids"].float().sum(1, keepdim=True), batch_size=4)

    def pad(items):
        ids = nn.utils.rnn.pad_sequence([item["ids"] for item in items], batch_first=True)
        return {"ids": ids, "index": torch.tensor([item["index"] for item in items])}

    store = precompute(data, lambda b: b["ids"].float().sum(1, keepdim=True), batch_size=4, collate_fn=pad)
    assert [float(PrecomputedDataset(data, store)[i]["features"]) for i in range(6)] == [3.0, 6.0, 10.0, 3.0, 6.0, 10.0]


@pytest.mark.cuda
def test_a_pipeline_on_a_cuda_side_stream_gives_what_the_frozen_model_gives_inline():
    # outputs made on the side stream are read on the trainer's: waited for (wait_event) and kept from the side
    # stream's allocations until the trainer's kernels are done with them (record_stream)
    torch.manual_seed(0)
    frozen = FrozenModule(nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64)), device="cuda",
                          output_device="cuda")
    batches = [torch.randn(512, 256) for _ in range(6)]
    inline = [frozen(b) * 2 for b in batches]
    piped = [out * 2 for out in FrozenPipeline(batches, frozen, stream=torch.cuda.Stream())]
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(inline, piped, strict=True))
