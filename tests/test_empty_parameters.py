"""A model whose parameters hold no elements -- what DeepSpeed ZeRO-3 leaves outside a gather (axolotl#1687,
DeepSpeed#5041) -- is refused by name at block discovery, at ``Freezer(...)`` and at ``save_checkpoint``, and nothing
is written (issue 41). A demoted block the cache serves, whose device placeholder is empty on purpose, still saves."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from layerfreeze import EmptyParameterError, Freezer, UserError, discover_blocks, save_checkpoint
from layerfreeze.engine.demote import Demotion


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _zero3_placeholders(model: nn.Module, names: tuple[str, ...]) -> None:
    """What ZeRO-3 does to a parameter outside ``GatheredParameters``: its data a 0-element tensor, its real shape in
    ``ds_shape`` (deepspeed/runtime/zero/partition_parameters.py)."""
    for name, p in model.named_parameters():
        if name in names:
            p.ds_shape = p.shape
            p.data = torch.empty(0, dtype=p.dtype)


def test_discovery_refuses_a_zero3_placeholder_by_name_and_says_what_to_do():
    model = _model()
    blocks_before = [b.name for b in discover_blocks(model)]
    _zero3_placeholders(model, ("2.weight", "2.bias"))
    with pytest.raises(EmptyParameterError) as err:
        discover_blocks(model)
    message = str(err.value)
    assert message.startswith("discover_blocks: 2 parameter(s) of the model hold no elements: ")
    assert "2.weight (shape (0,), full shape (16, 16))" in message
    assert "2.bias (shape (0,), full shape (16,))" in message
    assert "GatheredParameters" in message and "shard_blocks" in message and "--parallel fsdp" in message
    assert err.value.names == ["2.weight", "2.bias"] and isinstance(err.value, UserError)  # the CLI: exit 2
    assert blocks_before == ["0", "2", "4"]
    with pytest.raises(EmptyParameterError, match="discover_blocks"):
        discover_blocks(model, ["0", "2", "4"])  # patterns too


def test_the_freezer_refuses_ready_made_blocks_whose_weights_are_placeholders():
    model = _model()
    blocks = discover_blocks(model)  # discovered while gathered ...
    _zero3_placeholders(model, ("0.weight",))  # ... and used after the gather ended
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(EmptyParameterError, match=r"^Freezer: 1 parameter\(s\) .*0\.weight \(shape \(0,\), full "
                                                  r"shape \(16, 8\)\)"):
        Freezer(model, optimizer, "none", blocks=blocks)
    with pytest.raises(EmptyParameterError, match="^discover_blocks"):
        Freezer(model, optimizer, "none")


def test_save_checkpoint_refuses_placeholders_and_writes_nothing(tmp_path):
    model = _model()
    with Freezer(model, torch.optim.AdamW(model.parameters()), "none") as freezer:
        save_checkpoint(tmp_path / "ok", model, freezer.optimizer, freezer)
        _zero3_placeholders(model, ("4.weight",))
        with pytest.raises(EmptyParameterError, match=r"^save_checkpoint: .*4\.weight \(shape \(0,\)"):
            save_checkpoint(tmp_path / "ckpt", model, freezer.optimizer, freezer)
        with pytest.raises(EmptyParameterError, match="^save_checkpoint"):  # a gathered state given as it is
            save_checkpoint(tmp_path / "ckpt", model, model_state=dict(model.state_dict()))
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt.tmp").exists()
    assert load_file(tmp_path / "ok" / "model.safetensors")["4.weight"].shape == (4, 16)  # the good one stays


def test_an_offloaded_demoted_block_saves_its_real_weights(tmp_path):
    model = _model().eval()
    with Freezer(model, None, "none", demote=Demotion("bfloat16", offload="cpu", directory=tmp_path / "m")) as f:
        f.freeze(0)
        f.offload_prefix(1)
        assert model[0].weight.numel() == 0  # the device placeholder of an offloaded block
        path = save_checkpoint(tmp_path / "ckpt", model, None, f)
    saved = load_file(path / "model.safetensors")
    assert saved["0.weight"].shape == (16, 8) and saved["0.weight"].dtype == torch.float32
    assert torch.equal(saved["0.weight"], model[0].weight.detach())  # float32 again after close()
