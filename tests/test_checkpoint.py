"""Freeze state is part of the checkpoint: a resumed run follows the uninterrupted one bitwise (CPU, same seed)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from torch import nn

from layerfreeze import CheckpointError, Freezer, block_param_groups, discover_blocks, load_checkpoint, save_checkpoint
from tests.test_engine import Scripted, make_net

# freeze blocks 0,1 at step 3; thaw 1 and freeze 2 at step 6; thaw everything at step 9
TABLE = {3: ([0, 1], []), 6: ([2], [1]), 9: ([], [0, 2])}


def build(opt_name: str):
    model = make_net(seed=0)
    blocks = discover_blocks(model)
    groups = block_param_groups(model, blocks, lr=0.05, weight_decay=0.1, lr_decay=2.6)
    if opt_name == "sgd":
        optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
    freezer = Freezer(model, optimizer, Scripted(TABLE), blocks=blocks, scheduler=scheduler)
    return model, optimizer, scheduler, freezer


def run(model, optimizer, scheduler, freezer, start: int, stop: int):
    data = torch.Generator().manual_seed(123)
    batches = [(torch.randn(16, 8, generator=data), torch.randint(0, 3, (16,), generator=data)) for _ in range(12)]
    for step in range(start, stop):
        x, y = batches[step]
        model.train()
        loss = nn.functional.cross_entropy(model(x), y)  # dropout draws from the global RNG
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        freezer.step()


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("stop_at", [4, 7])  # inside a frozen phase, and after a thaw
def test_resume_is_bitwise_identical_to_uninterrupted_run(tmp_path, opt_name, stop_at):
    torch.manual_seed(7)
    reference = build(opt_name)
    run(*reference, 0, 12)

    torch.manual_seed(7)
    first = build(opt_name)
    run(*first, 0, stop_at)
    save_checkpoint(tmp_path / "ckpt", *first[:2], freezer=first[3], scheduler=first[2], extra={"step": stop_at})
    torch.manual_seed(999)  # the resumed process starts from another RNG state
    resumed = build(opt_name)
    extra = load_checkpoint(tmp_path / "ckpt", resumed[0], resumed[1], freezer=resumed[3], scheduler=resumed[2])
    assert extra == {"step": stop_at}
    assert resumed[3].frozen == first[3].frozen
    assert [p.requires_grad for p in resumed[0].parameters()] == [p.requires_grad for p in first[0].parameters()]
    run(*resumed, stop_at, 12)

    for (name, a), b in zip(reference[0].state_dict().items(), resumed[0].state_dict().values()):
        assert torch.equal(a, b), f"{name} differs after resume"
    assert resumed[3].history == reference[3].history
    assert resumed[3].frozen == reference[3].frozen == [False] * 5


def test_corrupt_or_incomplete_checkpoint_is_detected(tmp_path):
    model, optimizer, scheduler, freezer = build("adamw")
    run(model, optimizer, scheduler, freezer, 0, 4)
    path = save_checkpoint(tmp_path / "ckpt", model, optimizer, freezer, scheduler)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(path, *build("adamw")[:2])
    (path / "state.pt").unlink()
    with pytest.raises(CheckpointError, match="state.pt is missing"):
        load_checkpoint(path, *build("adamw")[:2])


def test_a_flipped_byte_in_the_state_file_is_detected_before_it_is_unpickled(tmp_path):
    # state.pt (optimizer state, RNG, freeze state) had no checksum: three flipped bytes in the optimizer's moments
    # resumed in silence, and the run went on from wrong values
    model, optimizer, scheduler, freezer = build("adamw")
    run(model, optimizer, scheduler, freezer, 0, 4)
    path = save_checkpoint(tmp_path / "ckpt", model, optimizer, freezer, scheduler)
    state_file, digest = path / "state.pt", path / "state.pt.sha256"
    assert digest.read_text() == f"{hashlib.sha256(state_file.read_bytes()).hexdigest()}  state.pt\n"
    good = state_file.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01
    state_file.write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match=r"state.pt does not match its recorded SHA-256 \(state.pt.sha256\)"):
        load_checkpoint(path, *build("adamw")[:2])
    state_file.write_bytes(good)
    digest.unlink()
    with pytest.raises(CheckpointError, match="incomplete: state.pt.sha256 is missing"):
        load_checkpoint(path, *build("adamw")[:2])
    # a format-1 checkpoint (written before the digest existed) still loads; an unreadable state file names no
    # weights_only=False advice (torch's, for files one trusts)
    state = torch.load(state_file, weights_only=True)
    torch.save({**state, "format_version": 1}, state_file)
    resumed = build("adamw")
    load_checkpoint(path, resumed[0], resumed[1], freezer=resumed[3], scheduler=resumed[2])
    for a, b in zip(model.state_dict().values(), resumed[0].state_dict().values()):
        assert torch.equal(a, b)
    torch.save({**state, "format_version": 1, "evil": Path("x")}, state_file)
    with pytest.raises(CheckpointError, match=r"unreadable \(torch.load\(weights_only=True\) refused it\)") as info:
        load_checkpoint(path, *build("adamw")[:2])
    assert "weights_only=False" not in str(info.value)


def test_checkpoint_from_other_blocks_is_refused(tmp_path):
    model, optimizer, scheduler, freezer = build("sgd")
    path = save_checkpoint(tmp_path / "ckpt", model, optimizer, freezer, scheduler)
    other = make_net()
    other_freezer = Freezer(other, torch.optim.SGD(other.parameters(), lr=0.1), "none", blocks=["0", "1", "6"])
    with pytest.raises(CheckpointError, match="blocks"):
        load_checkpoint(path, other, other_freezer.optimizer, freezer=other_freezer)


@pytest.mark.timeout(300)
def test_a_full_fsdp2_checkpoint_loads_into_an_unsharded_model_and_trains_on(tmp_path):
    """A folder written by ``layerfreeze.checkpoint.save_full_checkpoint`` on 2 sharded ranks, read by
    ``load_checkpoint`` into a plain model: weights (frozen ones too), frozen set and optimizer state (by parameter
    name) restored, and the next step gives the weights the sharded ranks reached (so every Adam moment is on its own
    parameter)."""
    from tests.distributed.fsdp_full_checkpoint import batch
    from tests.distributed.launch import launch
    from tests.distributed.worker import mlp_task

    ckpt = tmp_path / "full"
    ranks = launch({"save_at": 3, "checkpoint": str(ckpt)}, tmp_path / "ranks",
                   module="tests.distributed.fsdp_full_checkpoint")
    assert ranks.returncodes == [0, 0], "\n".join(o[-3000:] for o in ranks.outputs)
    task = mlp_task()
    model = task.model
    torch.manual_seed(1)
    for p in model.parameters():  # nothing of the initial weights may survive the load
        p.data.normal_()
    optimizer = torch.optim.AdamW(block_param_groups(model, discover_blocks(model), lr=0.01), lr=0.01)
    freezer = Freezer(model, optimizer, "gradual", {"every_steps": 2})
    assert load_checkpoint(ckpt, model, optimizer, freezer) == {"step": 3}
    from safetensors.torch import load_file

    saved = load_file(ckpt / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert freezer.frozen == [True, True, True, False, False] and freezer.step_count == 3  # block 3 thawed at 2
    trainable = {id(p) for b in freezer.blocks[3:] for _, p in b.named_parameters()}
    assert {id(p) for p in optimizer.state} == trainable  # moments for the trainable blocks only, on their params
    steps = {id(p): 1 for _, p in freezer.blocks[3].named_parameters()}  # thawed after step 2, trained step 3
    steps.update({id(p): 3 for _, p in freezer.blocks[4].named_parameters()})  # the head: steps 1-3
    assert {id(p): int(st["step"]) for p, st in optimizer.state.items()} == steps
    x, y = batch(task, 3)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    freezer.step()
    reference = ranks.results[0]
    assert "this model is sharded: load it with layerfreeze.load_full_checkpoint" in reference["refused"]
    assert freezer.frozen == reference["frozen"] == [True, True, False, False, False]  # the thaw at step 4
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, torch.tensor(reference["weights"][key]), rtol=1e-5, atol=1e-6)


def test_a_checkpoint_path_that_does_not_exist_or_is_a_file_says_so(tmp_path):
    # it said "is incomplete: model.safetensors is missing", which sends one looking for a damaged checkpoint
    model = make_net()
    with pytest.raises(CheckpointError, match=r"nope does not exist \(a checkpoint is the folder save_checkpoint"):
        load_checkpoint(tmp_path / "nope", model)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="file is a file, not a checkpoint folder"):
        load_checkpoint(tmp_path / "file", model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="is incomplete: model.safetensors is missing"):
        load_checkpoint(tmp_path / "empty", model)


def test_another_optimizer_class_or_a_missing_freezer_is_named_when_loading(tmp_path):
    # an AdamW state loaded into an SGD without complaint, and its first step() raised KeyError: 'momentum'; a
    # checkpoint of a Freezer loaded without one said only torch's "parameter group that doesn't match"
    model, optimizer, scheduler, freezer = build("adamw")
    run(model, optimizer, scheduler, freezer, 0, 4)
    freezer.freeze(0)  # its parameters leave the optimizer's groups
    path = save_checkpoint(tmp_path / "ckpt", model, optimizer, freezer, scheduler)
    other = build("sgd")
    with pytest.raises(CheckpointError, match="holds the state of a AdamW optimizer; this one is a SGD"):
        load_checkpoint(path, other[0], other[1], freezer=other[3])
    fresh = build("adamw")
    with pytest.raises(CheckpointError, match="it was saved with a Freezer, .* pass freezer="):
        load_checkpoint(path, fresh[0], fresh[1])
    load_checkpoint(path, fresh[0], fresh[1], freezer=fresh[3], scheduler=fresh[2])
    assert fresh[3].frozen[0]


def test_an_optimizer_holding_a_parameter_outside_the_model_checkpoints_and_resumes_exactly(tmp_path):
    # a CLIP-style temperature in the loss, in the optimizer but not in the model: the first checkpoint raised a bare
    # KeyError (the Freezer's state named the optimizer's parameters by their model names)
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
        temperature = nn.Parameter(torch.ones(()))
        optimizer = torch.optim.AdamW([{"params": model.parameters()}, {"params": [temperature], "lr": 0.05}],
                                      lr=0.1)
        return model, temperature, optimizer, Freezer(model, optimizer, "static", {"k": 1})

    def train(model, temperature, optimizer, freezer, start, stop):
        for t in range(start, stop):
            g = torch.Generator().manual_seed(t)
            loss = (model(torch.randn(4, 6, generator=g)) * temperature).square().mean()
            loss.backward()
            freezer.after_backward()
            optimizer.step()
            optimizer.zero_grad()
            freezer.step()

    model, temperature, optimizer, freezer = build()
    train(model, temperature, optimizer, freezer, 0, 3)
    save_checkpoint(tmp_path / "ck", model, optimizer, freezer)
    kept = temperature.detach().clone()  # the loss's own parameter is the user's to save, as any outside the model
    resumed, temperature2, optimizer2, freezer2 = build()
    load_checkpoint(tmp_path / "ck", resumed, optimizer2, freezer2)
    with torch.no_grad():
        temperature2.copy_(kept)
    assert optimizer2.param_groups[1]["params"] == [temperature2] and temperature2 in optimizer2.state
    train(resumed, temperature2, optimizer2, freezer2, 3, 6)
    uninterrupted, temperature3, optimizer3, freezer3 = build()
    train(uninterrupted, temperature3, optimizer3, freezer3, 0, 6)
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), uninterrupted.state_dict().values()))
    assert torch.equal(temperature2, temperature3)


def test_save_checkpoint_refuses_a_frozen_weight_that_moved(tmp_path):
    # in your own loop a frozen weight changed in place was checkpointed without a word (the CLI trainer verified)
    from layerfreeze.engine import FrozenWeightsChangedError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Freezer(model, optimizer, "static", {"k": 1}) as freezer:
        save_checkpoint(tmp_path / "ok", model, optimizer, freezer)
        with torch.no_grad():
            model[0].weight.add_(1e-3)
        with pytest.raises(FrozenWeightsChangedError, match="'0'"):
            save_checkpoint(tmp_path / "ck", model, optimizer, freezer)
        assert not (tmp_path / "ck").exists() and not (tmp_path / "ck.tmp").exists()


def test_an_outside_parameter_of_another_shape_is_refused_at_load(tmp_path):
    # outside parameters are matched by param group and place: one of another shape loaded without a word and the
    # first optimizer step failed with a size mismatch
    def build(shape):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        scale = nn.Parameter(torch.ones(shape))
        optimizer = torch.optim.AdamW([{"params": model.parameters()}, {"params": [scale]}], lr=0.1)
        return model, scale, optimizer, Freezer(model, optimizer, "static", {"k": 1})

    model, scale, optimizer, freezer = build((3,))
    (model(torch.randn(2, 4)) * scale).sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path / "ck", model, optimizer, freezer)
    model2, _, optimizer2, freezer2 = build((5,))
    with pytest.raises(CheckpointError, match=r"outside the model .* saved .*\[3\].* this run .*\[5\]"):
        load_checkpoint(tmp_path / "ck", model2, optimizer2, freezer2)
