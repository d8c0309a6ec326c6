"""What makes SmartFRZ's stage cheap (issue 40) gives the values of the straightforward code, bit for bit: the reader's
kept views (made again when a source's memory moves), the Adam-moment picks kept per parameter (made again when the
optimizer rebuilds its state, and not keeping dropped moments alive), the normalized z's shortcuts (rows as a slice,
an all-valid mask skipped) and the recorder's slice writes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from layerfreeze.models.discovery import discover_blocks
from layerfreeze.strategies.smartfrz.reader import Pick, StageReader
from layerfreeze.strategies.smartfrz.recorder import WeightRecorder
from layerfreeze.strategies.smartfrz.snr_gate import AdamMoments, adam_noise_floor

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_reader_follows_a_source_changed_in_place_or_replaced_and_reads_strided_sources():
    p = nn.Parameter(torch.randn(6, 5))
    strided = torch.randn(5, 6).t()  # not contiguous: reshaped (a copy) at every read
    pos = torch.tensor([0, 7, 29])
    reader = StageReader(rows=2, width=4)
    picks = [Pick(p, pos, 0, 0), Pick(strided, pos, 1, 1)]

    def expected() -> torch.Tensor:
        out = torch.zeros(2, 4)
        out[0, :3] = p.detach().reshape(-1)[pos]
        out[1, 1:] = strided.reshape(-1)[pos]
        return out

    assert torch.equal(reader.launch(picks).values, expected())
    with torch.no_grad():
        p.mul_(3.0)  # in place, as an optimizer step: the kept view sees it
        strided.add_(1.0)
    assert torch.equal(reader.launch(picks).values, expected())
    p.data = torch.randn(6, 5)  # new memory (a cast, .to(), a load): the pick's view is made again
    assert torch.equal(reader.launch(picks).values, expected())
    assert reader._gathers[id(picks[1])].flat is None  # no view kept of the strided source
    reader.launch(picks[1:])
    assert set(reader._gathers) == {id(picks[1])}  # what no read uses any more is dropped (its source with it)


def _reference_z(moments: AdamMoments, read, values, steps) -> dict[int, tuple[float, float]]:
    """:meth:`AdamMoments.z_from` as it was written before issue 40's shortcuts (advanced indexing, the mask always
    multiplied, the steps and betas read back from the tensor)."""
    rows, hyper, keep = [], [], []
    for (i, k, flags, (b1, b2, eps)), step in zip(read.blocks, steps):
        if step < 1:
            continue
        rows.append(k)
        hyper.append((step, b1, b2, eps))
        keep.append((i, flags))
    h = torch.tensor(hyper, dtype=torch.float64)
    step, b1, b2, eps = h.unbind(1)
    valid = torch.stack([moments._valid(i, flags) for i, flags in keep])
    index = torch.tensor(rows)
    m = values[read.m_row + index].double()
    v = values[read.v_row + index].double()
    u = (m / (1 - b1 ** step)[:, None]) / ((v / (1 - b2 ** step)[:, None]).sqrt() + eps[:, None])
    rms = ((u * u) * valid).sum(1).div(valid.sum(1).clamp(min=1)).sqrt()
    return {i: (r / adam_noise_floor(t, b), t)
            for (i, _), r, t, b in zip(keep, rms.tolist(), step.tolist(), b1.tolist())}


def _blocks_and_adam(steps: int = 5):
    torch.manual_seed(0)
    # block 1 is smaller than the sample (padded: a mask with False), block 3 has a frozen (state-less) bias
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2), nn.Linear(2, 16), nn.Linear(16, 8), nn.Linear(8, 3))
    model[3].bias.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    blocks = discover_blocks(model)
    groups = {id(p): g for g in opt.param_groups for p in g["params"]}

    def view(p):
        state = opt.state.get(p)
        return (state, groups[id(p)]) if state and id(p) in groups else None

    return model, blocks, opt, view


def test_z_is_the_formula_bit_for_bit_with_and_without_the_shortcuts():
    model, blocks, opt, view = _blocks_and_adam()
    recorder = WeightRecorder(blocks, sample_size=64, window=3)
    moments = AdamMoments([s.picks for s in recorder.samples], 64)
    reader = StageReader(3 * len(blocks), 64, max_scalars=len(blocks))
    del opt.state[model[1].weight], opt.state[model[1].bias]  # block 1 without moments: its rows are skipped
    for watched in ([0, 2, 3], [0, 1, 2, 3], [2, 3], [3]):
        read = moments.plan(watched, view, m_row=len(blocks), v_row=2 * len(blocks))
        got = reader.launch(read.picks, read.steps)
        z = moments.z_from(read, got.values, got.scalars)
        assert z == _reference_z(moments, read, got.values, got.scalars)
        assert set(z) == set(watched) - {1} and all(math.isfinite(v) for v, _ in z.values())
    # block 3's mask leaves out its bias (no moments), block 2's covers its 48 weights of 64: both use the mask
    assert moments._valid_rows([(3, [True, False])])[0] is not None
    assert moments._valid_rows([(0, [True, True])])[0] is None


def test_moment_picks_follow_a_rebuilt_state_and_do_not_keep_dropped_moments():
    model, blocks, opt, view = _blocks_and_adam()
    moments = AdamMoments([WeightRecorder(blocks, 64, 3).samples[i].picks for i in range(len(blocks))], 64)
    first = moments.plan([0, 2], view)
    assert moments.plan([0, 2], view).picks == first.picks  # the same Pick objects: made once
    m0 = opt.state[model[0].weight]["exp_avg"]
    assert first.picks[0].source.data_ptr() == m0.data_ptr()
    opt.state.clear()  # the optimizer rebuilds its state (a thaw, a load): new moments, new picks
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    again = moments.plan([0, 2], view)
    assert again.picks[0].source.data_ptr() == opt.state[model[0].weight]["exp_avg"].data_ptr() != m0.data_ptr()
    moments.plan([2], view)  # block 0 frozen: its moments are dropped by the optimizer, and not held here
    assert {i for i, _ in moments._made} == {2}
    moments.plan([2], None)
    assert moments._made == {}


@pytest.mark.parametrize("active, counts", [
    ([False, False, True, True, True], [2, 2, 5, 5, 5]),   # a frozen prefix, equal counts: the slice path
    ([True, False, True, True, False], [4, 1, 4, 4, 0]),   # a gap: index_put_
    ([True, True, True, True, True], [6, 5, 5, 5, 5]),     # uneven counts (a thawed block): index_put_
])
def test_record_writes_what_index_put_wrote(active, counts):
    torch.manual_seed(1)
    blocks = discover_blocks(nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)]))
    recorder = WeightRecorder(blocks, sample_size=16, window=4)
    recorder.buffers.normal_()
    recorder.counts = list(counts)
    buffers, steps = recorder.buffers.clone(), recorder.steps.clone()
    values = torch.randn(15, 16)
    recorder.record(values, active, step=17)
    rows = [i for i, on in enumerate(active) if on]
    index = (torch.tensor(rows), torch.tensor([counts[i] % 4 for i in rows]))
    buffers.index_put_(index, values[index[0]])
    steps.index_put_(index, torch.tensor(17))
    assert torch.equal(recorder.buffers, buffers) and torch.equal(recorder.steps, steps)
    assert recorder.counts == [c + on for c, on in zip(counts, active)]
