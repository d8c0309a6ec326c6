"""SmartFRZ: recorder, features, predictor files, the online strategy with hand-made predictors, CKA and labels,
and the offline pipeline end to end on two tiny recipes (``--quick``)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from layerfreeze.engine import Freezer
from layerfreeze.models.discovery import discover_blocks
from layerfreeze.smartfrz.labels import freezable_from_cka, linear_cka
from layerfreeze.strategies.smartfrz.features import NUM_FEATURES, window_features
from layerfreeze.strategies.smartfrz.predictor import FreezePredictor, PredictorError, load_predictor, save_predictor
from layerfreeze.strategies.smartfrz.recorder import BlockSample, WeightRecorder
from layerfreeze.strategies.smartfrz.strategy import SmartFRZ
from tests.conftest import predictor_cli

pytestmark = pytest.mark.usefixtures("one_thread")


def stack(n_hidden: int = 3, width: int = 16, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, width), nn.ReLU()]
    for _ in range(n_hidden - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


# ---------------------------------------------------------------------------------------------------- recorder


def test_sampling_counts_are_proportional_and_add_up():
    blocks = discover_blocks(nn.Sequential(nn.Linear(100, 50), nn.Linear(50, 3)))
    s = BlockSample(blocks[0], 1024, torch.Generator().manual_seed(0))
    counts = {p.numel(): len(idx) for p, idx in s.picks}
    assert sum(counts.values()) == 1024
    assert counts == {5000: round(1024 * 5000 / 5050), 50: 1024 - round(1024 * 5000 / 5050)}
    for p, idx in s.picks:  # distinct, sorted, in range
        assert idx.unique().numel() == idx.numel() and bool((idx[1:] > idx[:-1]).all()) and int(idx.max()) < p.numel()
    assert bool(s.mask.all())


def test_small_block_is_padded_and_masked():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    rec = WeightRecorder(discover_blocks(model), sample_size=64, window=3)
    rec.snapshot([True, True])
    w = rec.window_of(0)[0]
    assert int(rec.mask_of(0).sum()) == 15 and not bool(rec.mask_of(0)[15:].any())
    expected = torch.cat([model[0].weight.detach().reshape(-1), model[0].bias.detach()])
    assert torch.equal(w[:15], expected) and not bool(w[15:].any())


def test_frozen_blocks_are_not_recorded_and_ring_keeps_order():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    rec = WeightRecorder(discover_blocks(model), sample_size=8, window=3)
    for i in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(i))
        rec.snapshot([True, i < 2], step=10 * i)  # block 1 "frozen" after two snapshots
    assert rec.counts == [5, 2]
    assert rec.window_of(0)[:, 0].tolist() == [2.0, 3.0, 4.0]  # oldest first across the wrap-around
    assert rec.steps_of(0).tolist() == [20, 30, 40]
    assert rec.window_of(1)[:, 0].tolist() == [0.0, 1.0]
    assert rec.steps_of(1).tolist() == [0, 10]
    assert rec.ready(0) and not rec.ready(1)


# ---------------------------------------------------------------------------------------------------- features


def _walk(w: int = 12, s: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(s, generator=g)
    steps = torch.randn(w, s, generator=g) * 0.01 + 0.003
    return base + steps.cumsum(0)


def test_features_are_scale_free_and_order_free():
    w = _walk()
    f = window_features(w)
    assert f.shape == (w.shape[0] - 1, NUM_FEATURES) and torch.isfinite(f).all()
    # Multiplying every weight by 10 changes nothing: every feature is a ratio, a cosine or a rank statistic,
    # including the relative step log10(|d_t| / |w_t|).
    assert torch.allclose(window_features(w * 10), f, atol=1e-5)
    # The order of the sampled positions does not matter.
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(1))
    assert torch.allclose(window_features(w[:, perm]), f, atol=1e-5)
    # What is *not* invariant: moving 10x faster from the same start (a 10x learning rate) changes only the
    # relative step size (feature 8), by about log10(10) / 4 where steps are small next to the weights.
    fast = window_features(w[0] + (w - w[0]) * 10)
    others = [i for i in range(NUM_FEATURES) if i != 8]
    assert torch.allclose(fast[:, others], f[:, others], atol=1e-5)
    assert not torch.allclose(fast[:, 8], f[:, 8], atol=1e-3)
    assert float((fast[:, 8] - f[:, 8]).mean()) == pytest.approx(0.25, abs=0.03)


def test_context_features_are_depth_and_progress():
    w = _walk(w=5)
    f = window_features(w, depth=0.25, progress=torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4]))
    assert f[:, 10].tolist() == [0.25] * 4
    assert torch.allclose(f[:, 11], torch.tensor([0.1, 0.2, 0.3, 0.4]))  # progress at the end of each delta
    assert torch.equal(f[:, :10], window_features(w)[:, :10])  # context does not touch the weight features
    with pytest.raises(ValueError, match="one value per snapshot"):
        window_features(w, progress=torch.zeros(4))


def test_features_ignore_padding_and_reject_nan():
    w = _walk(s=100)
    padded = torch.cat([w, torch.zeros(w.shape[0], 28)], dim=1)
    mask = torch.arange(128) < 100
    assert torch.allclose(window_features(padded, mask), window_features(w))
    bad = w.clone()
    bad[3, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        window_features(bad)
    with pytest.raises(ValueError):
        window_features(w[:2])


# ---------------------------------------------------------------------------------------------------- predictor files


def _biased_predictor(bias: float, hidden: int = 8) -> FreezePredictor:
    torch.manual_seed(0)
    model = FreezePredictor(hidden=hidden)
    with torch.no_grad():
        model.classifier[-1].weight.zero_()
        model.classifier[-1].bias.fill_(bias)
    return model


def test_predictor_file_roundtrip_and_errors(tmp_path):
    path = save_predictor(tmp_path / "p.safetensors", _biased_predictor(2.0), window=3, card={"note": "x"})
    model, meta = load_predictor(path)
    assert meta["window"] == 3 and meta["min_window"] == 3 and meta["card"] == {"note": "x"}
    with torch.no_grad():
        p = float(torch.sigmoid(model(torch.randn(1, 2, NUM_FEATURES)))[0])
    assert p == pytest.approx(1 / (1 + math.exp(-2)))

    missing = tmp_path / "nope.safetensors"
    with pytest.raises(PredictorError, match="nope.safetensors"):
        load_predictor(missing)

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(PredictorError, match="truncated.safetensors"):
        load_predictor(truncated)

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta_raw = dict(f.metadata())
    tensors = load_file(str(path))
    old = tmp_path / "old.safetensors"
    save_file(tensors, str(old), metadata={**meta_raw, "format_version": "0"})
    with pytest.raises(PredictorError, match="old.safetensors.*format_version"):
        load_predictor(old)

    no_min = tmp_path / "no_min.safetensors"  # written before min_window existed: full windows only
    save_file(tensors, str(no_min), metadata={k: v for k, v in meta_raw.items() if k != "min_window"})
    assert load_predictor(no_min)[1]["min_window"] == 3
    bad_min = tmp_path / "bad_min.safetensors"
    save_file(tensors, str(bad_min), metadata={**meta_raw, "min_window": "4"})
    with pytest.raises(PredictorError, match="bad_min.safetensors.*min_window 4"):
        load_predictor(bad_min)

    no_hidden = tmp_path / "no_hidden.safetensors"
    save_file(tensors, str(no_hidden), metadata={k: v for k, v in meta_raw.items() if k != "hidden"})
    with pytest.raises(PredictorError, match="no_hidden.safetensors.*metadata"):
        load_predictor(no_hidden)

    tampered = tmp_path / "tampered.safetensors"
    tensors["classifier.2.bias"] = tensors["classifier.2.bias"] + 1
    save_file(tensors, str(tampered), metadata=meta_raw)
    with pytest.raises(PredictorError, match="tampered.safetensors.*checksum.*predictor train"):
        load_predictor(tampered)

    bad_card = save_predictor(tmp_path / "bad_card.safetensors", _biased_predictor(2.0), window=3,
                              card={"threshold": 1.5})  # the strategy would never freeze: refused
    with pytest.raises(PredictorError, match="bad_card.safetensors.*threshold 1.5"):
        load_predictor(bad_card)
    with pytest.raises(PredictorError, match="is a folder"):
        load_predictor(tmp_path)
    other = tmp_path / "other_hidden.safetensors"  # the metadata's hidden edited: torch's ten size mismatches
    save_file(load_file(str(path)), str(other), metadata={**meta_raw, "hidden": "64"})
    with pytest.raises(PredictorError) as caught:
        load_predictor(other)
    text = str(caught.value)
    assert "\n" not in text and "does not match the predictor architecture (its metadata says hidden 64): size " \
        "mismatch for" in text and "more). Retrain it with `layerfreeze predictor train`" in text


def test_loading_a_predictor_leaves_the_global_rng_alone(tmp_path):
    # building the network before loading its weights must not draw from the global RNG (issue 29): a smartfrz row
    # trained on another dropout stream than the `none` row of the same seed
    from layerfreeze.strategies.smartfrz.predictor import _load

    path = save_predictor(tmp_path / "p.safetensors", _biased_predictor(2.0), window=3)  # a new file: really read
    _load.cache_clear()  # the shipped one too, even when an earlier test loaded it
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    load_predictor(path)
    load_predictor()
    assert torch.equal(torch.rand(3), want)


def test_padded_window_gives_the_same_probability():
    from layerfreeze.smartfrz.fit import pad_windows

    torch.manual_seed(0)
    model = FreezePredictor(hidden=8).eval()
    short, full = torch.randn(4, NUM_FEATURES), torch.randn(9, NUM_FEATURES)
    x, mask = pad_windows([short, full], history=10)
    assert x.shape == (2, 9, NUM_FEATURES) and mask.sum(dim=1).tolist() == [4, 9] and bool(mask[0, -1])
    with torch.no_grad():
        batched = model(x, mask)
        alone = torch.stack([model(short[None])[0], model(full[None])[0]])
        unmasked = model(x)[0]
    assert torch.allclose(batched, alone, atol=1e-6)
    assert not torch.allclose(unmasked, alone[0], atol=1e-4)  # the mask matters: zeros would be attended


# ---------------------------------------------------------------------------------------------------- online strategy


def _train(model: nn.Module, freezer: Freezer, steps: int, on_step=None) -> None:
    opt = freezer.optimizer
    g = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        x = torch.randn(16, 8, generator=g)
        y = torch.randint(0, 4, (16,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        freezer.step()
        if on_step:
            on_step(step)


def _freeze_steps(freezer: Freezer) -> dict[int, int]:
    return {r["index"]: r["step"] for r in freezer.history if r["kind"] == "freeze"}


@pytest.mark.parametrize("bias, expected", [(10.0, {0: 4, 1: 4, 2: 4}), (-10.0, {})])
def test_strategy_with_constant_predictor(tmp_path, bias, expected):
    path = save_predictor(tmp_path / "p.safetensors", _biased_predictor(bias), window=3)
    model = stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, opt, strategy=SmartFRZ(predictor=str(path), snapshot_every=2), total_steps=12)
    _train(model, freezer, 12)
    # snapshots at steps 0, 2, 4: the window of 3 is full at step 4, where every non-head block freezes at once
    assert _freeze_steps(freezer) == expected
    assert not freezer.frozen[-1]


@pytest.mark.parametrize("min_window, expected", [(None, 8), (3, 4), (5, 8)])
def test_strategy_decides_from_min_window_snapshots(tmp_path, min_window, expected):
    path = save_predictor(tmp_path / "p.safetensors", _biased_predictor(10.0), window=5, min_window=min_window)
    model = stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = SmartFRZ(predictor=str(path), snapshot_every=2)
    freezer = Freezer(model, opt, strategy=strategy, total_steps=12)
    lengths: list[int] = []
    inner = strategy.model

    def spy(feats: torch.Tensor) -> torch.Tensor:
        lengths.append(feats.shape[1])
        return inner(feats)

    strategy.model = spy
    _train(model, freezer, 12)
    # snapshots after steps 0, 2, 4, 6, 8: a window of 5 is full at step 8; with min_window 3 the first decision
    # is at step 4, on the 3 snapshots there are (2 deltas)
    assert _freeze_steps(freezer) == {0: expected, 1: expected, 2: expected}
    assert lengths[0] == (min_window or 5) - 1


@pytest.mark.parametrize("prefix, expected", [(True, {0: 4, 1: 8, 2: 8}), (False, {0: 4, 2: 4, 1: 8})])
def test_strategy_prefix_rule_with_scripted_predictor(tmp_path, prefix, expected):
    path = save_predictor(tmp_path / "p.safetensors", _biased_predictor(0.0), window=3)
    model = stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = SmartFRZ(predictor=str(path), snapshot_every=2, prefix=prefix)
    freezer = Freezer(model, opt, strategy=strategy, total_steps=12)
    plan = {0: 10.0, 1: -10.0, 2: 10.0}
    asked: list[int] = []
    window_of = strategy.recorder.window_of

    def spy(i: int) -> torch.Tensor:
        asked.append(i)
        return window_of(i)

    class Scripted(nn.Module):
        def forward(self, feats: torch.Tensor) -> torch.Tensor:
            return torch.tensor([plan[asked[-1]]])

    strategy.recorder.window_of = spy
    strategy.model = Scripted()

    def on_step(step: int) -> None:
        if step == 6:
            plan[1] = 10.0  # block 1 becomes freezable: decided at the stage after step 8

    _train(model, freezer, 12, on_step)
    assert _freeze_steps(freezer) == expected
    assert 3 not in asked  # the head is never asked about


def test_strategy_feeds_depth_and_progress(tmp_path):
    path = save_predictor(tmp_path / "p.safetensors", _biased_predictor(-10.0), window=3)
    model = stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = SmartFRZ(predictor=str(path), snapshot_every=2, prefix=False)  # every block is asked
    freezer = Freezer(model, opt, strategy=strategy, total_steps=12)
    seen: list[torch.Tensor] = []

    class Spy(nn.Module):
        def forward(self, feats: torch.Tensor) -> torch.Tensor:
            seen.append(feats[0, :, 10:].clone())
            return torch.tensor([-10.0])

    strategy.model = Spy()
    _train(model, freezer, 4)
    # first full window at step 4 (snapshots after steps 0, 2, 4); 4 blocks, the head (index 3) is not asked
    assert [x[0, 0].item() for x in seen] == pytest.approx([0.0, 1 / 3, 2 / 3])
    assert all(torch.allclose(x[:, 1], torch.tensor([2 / 12, 4 / 12])) for x in seen)


def test_strategy_needs_the_run_length(tmp_path):
    path = save_predictor(tmp_path / "p.safetensors", _biased_predictor(0.0), window=3)
    model = stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="total_steps"):
        Freezer(model, opt, strategy=SmartFRZ(predictor=str(path), snapshot_every=2))


def test_replayed_prefix_rule_matches_strategy():
    from layerfreeze.smartfrz.fit import prefix_freeze_steps

    nan = math.nan
    probs = torch.tensor([[nan, nan, nan, nan], [0.9, 0.2, 0.9, nan], [0.9, 0.2, 0.9, nan],
                          [0.1, 0.8, 0.1, nan], [0.1, 0.1, 0.7, nan]])
    # block 0 freezes at snapshot 1; block 1 waits until snapshot 3 (its p); block 2 then needs p >= 0.5 again
    assert prefix_freeze_steps(probs, [0, 10, 20, 30, 40], head=3, threshold=0.5) == [10, 30, 40, None]


# ---------------------------------------------------------------------------------------------------- CKA and labels


def test_linear_cka_properties():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 12, generator=g, dtype=torch.float64)
    z = torch.randn(40, 7, generator=g, dtype=torch.float64) + x[:, :7] * 0.5
    q, _ = torch.linalg.qr(torch.randn(12, 12, generator=g, dtype=torch.float64))
    assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)
    assert linear_cka(x, x @ q) == pytest.approx(1.0, abs=1e-9)
    assert linear_cka(x @ q, z) == pytest.approx(linear_cka(x, z), abs=1e-9)
    assert linear_cka(3.7 * x + 2.0, z) == pytest.approx(linear_cka(x, z), abs=1e-9)
    assert linear_cka(x, z) == pytest.approx(linear_cka(z, x), abs=1e-12)
    assert 0.0 < linear_cka(x, z) < 1.0
    # hand example: one feature each, CKA = squared correlation; centred x = (-1, 0, 1), y = (-4, -1, 5) / 3
    assert linear_cka(torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[1.0], [2.0], [4.0]])) == pytest.approx(
        27 / 28, abs=1e-12)
    assert linear_cka(torch.ones(5, 3), torch.ones(5, 2)) == 1.0  # no variance on either side
    assert linear_cka(torch.ones(5, 3), x[:5]) == 0.0
    with pytest.raises(ValueError):
        linear_cka(x, x[:10])


def test_labelling_rule_on_crafted_series():
    cka = [
        [0.90, 0.95, 0.991, 0.995, 0.997, 1.0],      # own: t=4, 5 (t=3 still moved 0.045 in its window)
        [0.50, 0.992, 0.994, 0.996, 0.998, 0.9999],  # own: t=3.. but block 0 only from t=4
        [0.99, 0.99, 0.99, 0.99, 0.50, 1.0],         # own: t=2, 3 (blocked by block 0), then drops
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],              # the head: never
    ]
    flags = freezable_from_cka(cka, tau=0.99, delta=0.01, window=3, head=3)
    got = [[t for t, f in enumerate(row) if f] for row in flags]
    assert got == [[4, 5], [4, 5], [], []]
    nan_series = [[0.999, math.nan, 0.999, 0.999, 0.999], [1.0] * 5]
    got = [[t for t, f in enumerate(row) if f] for row in freezable_from_cka(nan_series, 0.99, 0.01, 3, head=1)]
    assert got == [[4], []]  # a window holding a NaN is never freezable


# ---------------------------------------------------------------------------------------------------- pipeline


_cli = predictor_cli


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("runs")
    assert _cli(["predictor", "collect", "--out", str(out), "--recipes", "mlp-digits,cnn-digits", "--seeds", "0",
                 "--quick"]) == 0
    assert _cli(["predictor", "label", str(out)]) == 0
    torch.set_num_threads(before)
    return out


def test_collected_run_format(quick_runs):
    from layerfreeze.smartfrz.runs import list_runs

    runs = list_runs(quick_runs)
    assert [r.name for r in runs] == ["cnn-digits_s0_lr0.02", "cnn-digits_s0_lr0.1", "mlp-digits_s0_lr0.02",
                                      "mlp-digits_s0_lr0.08"]
    meta = json.loads((runs[0] / "meta.json").read_text())
    w = load_file(str(runs[0] / "weights.safetensors"))
    a = load_file(str(runs[0] / "activations.safetensors"))
    n_snap, n_blocks = meta["steps"] // meta["snapshot_every"] + 1, len(meta["blocks"])
    assert meta["status"] == "complete" and meta["head"] == n_blocks - 1
    assert w["samples"].shape == (n_snap, n_blocks, 1024) and w["samples"].dtype == torch.float32
    assert w["mask"].shape == (n_blocks, 1024) and w["mask"].dtype == torch.uint8
    assert w["steps"].tolist() == list(range(0, meta["steps"] + 1, meta["snapshot_every"]))
    assert a["act_steps"].tolist() == list(range(0, meta["steps"] + 1, meta["act_every"] * meta["snapshot_every"]))
    for i in range(n_blocks):
        act = a[f"act.{i}"]
        assert act.dtype == torch.float16 and act.shape[:2] == (len(a["act_steps"]), meta["probe_size"])
        assert act.shape[2] == min(meta["act_features"], meta["act_dims_full"][i]) == a[f"pos.{i}"].numel()
    labels = json.loads((runs[0] / "labels.json").read_text())
    assert labels["cka"][0][-1] == pytest.approx(1.0) and not any(labels["freezable"][labels["head"]])


def test_labels_use_the_threshold_of_the_runs_training_regime(quick_runs, tmp_path):
    """A run from scratch is labelled at tau_scratch, a fine-tune at tau (labels.tau_for), and fit refuses a corpus
    labelled with two rules."""
    import shutil

    from layerfreeze.smartfrz.fit import label_settings
    from layerfreeze.smartfrz.labels import DEFAULT_TAU, DEFAULT_TAU_SCRATCH, label_run, tau_for
    from layerfreeze.smartfrz.runs import PipelineError, read_run

    assert tau_for("scratch") == DEFAULT_TAU_SCRATCH == 0.998 and tau_for("finetune") == DEFAULT_TAU == 0.9995
    assert tau_for(None) == DEFAULT_TAU  # unknown regime: the stricter one
    src = quick_runs / "cnn-digits_s0_lr0.1"
    assert json.loads((src / "meta.json").read_text())["mode"] == "scratch"
    run = tmp_path / src.name
    shutil.copytree(src, run)
    scratch = label_run(run, tau=0.9999, tau_scratch=0.5, write=False)
    assert scratch["tau_applied"] == 0.5 and (scratch["tau"], scratch["tau_scratch"]) == (0.9999, 0.5)
    expect = freezable_from_cka(scratch["cka"], 0.5, scratch["delta"], scratch["window"], scratch["head"])
    assert scratch["freezable"] == expect
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "mode": "finetune"}))
    finetune = label_run(run, tau=0.9999, tau_scratch=0.5, write=False)
    assert finetune["tau_applied"] == 0.9999 and finetune["cka"] == scratch["cka"]
    assert finetune["freezable"] == freezable_from_cka(finetune["cka"], 0.9999, finetune["delta"],
                                                       finetune["window"], finetune["head"])
    assert finetune["first_freezable_step"] != scratch["first_freezable_step"]

    label_run(run, tau_scratch=0.99)  # written: another rule than the fixture's labels
    other = read_run(quick_runs / "mlp-digits_s0_lr0.02", need_labels=True)
    assert label_settings([other]) == {"tau": DEFAULT_TAU, "tau_scratch": DEFAULT_TAU_SCRATCH, "delta": 0.01,
                                       "window": 3}
    with pytest.raises(PipelineError, match="different thresholds"):
        label_settings([other, read_run(run, need_labels=True)])


def test_collect_resumes_and_is_deterministic(quick_runs, tmp_path):
    from layerfreeze.smartfrz.collect import collect

    seen = []
    collect(quick_runs, ["mlp-digits"], seeds=[0], quick=True, on_run=lambda n, s, m: seen.append(s))
    assert seen == ["skipped", "skipped"]
    collect(tmp_path, ["mlp-digits"], seeds=[0], lrs=[0.02], quick=True)
    again = load_file(str(tmp_path / "mlp-digits_s0_lr0.02" / "weights.safetensors"))
    first = load_file(str(quick_runs / "mlp-digits_s0_lr0.02" / "weights.safetensors"))
    assert torch.equal(again["samples"], first["samples"])


def test_diverged_run_is_recorded_and_excluded(tmp_path):
    from layerfreeze.smartfrz.collect import record_run
    from layerfreeze.smartfrz.runs import list_runs
    from layerfreeze.smartfrz.setup import Setup

    calls = []

    def exploding(logits, labels):
        calls.append(1)
        return F.cross_entropy(logits, labels) * (math.nan if len(calls) >= 3 else 1.0)

    setup = Setup(stack(), {"x": torch.randn(64, 8)}, torch.randint(0, 4, (64,)), {"x": torch.randn(8, 8)},
                  loss_fn=exploding, steps=10, batch_size=16, snapshot_every=1, act_every=2)
    meta = record_run(setup, tmp_path / "bad", lr=0.1, seed=0, info={"recipe": "x"})
    assert meta["status"] == "diverged" and meta["diverged_at_step"] == 3
    assert list_runs(tmp_path) == [] and list_runs(tmp_path, include_diverged=True) == [tmp_path / "bad"]


@pytest.mark.parametrize("acc, classes, expected", [(0.104, 10, True), (0.15, 10, False), (0.74, 2, True),
                                                     (0.75, 2, False), (None, 10, False)])
def test_chance_level_run_counts_as_collapsed(acc, classes, expected):
    from layerfreeze.smartfrz.runs import collapsed

    assert collapsed({"test_accuracy": acc, "act_dims_full": [64, classes]}) is expected


def test_pipeline_train_evaluate_and_reproducible(quick_runs, tmp_path):
    from layerfreeze.smartfrz.fit import TrainConfig, evaluate, train_predictor
    from layerfreeze.smartfrz.runs import list_runs, read_run

    out = tmp_path / "predictor.safetensors"
    assert _cli(["predictor", "train", str(quick_runs), "--out", str(out), "--holdout", "cnn-digits",
                 "--history", "6", "--min-history", "4", "--epochs", "3"]) == 0
    model, meta = load_predictor(out)
    card = meta["card"]
    assert meta["window"] == 6 and meta["min_window"] == 4
    assert card["train_recipes"] == ["mlp-digits"] and card["heldout_recipes"] == ["cnn-digits"]
    assert {r["recipe"] for r in card["heldout_runs"]} == {"cnn-digits"} and len(card["train_runs"]) == 2
    overall = card["heldout_metrics"]["overall"]
    for key in ("recall", "f1", "freeze_step_error"):  # the held-out runs have freezable windows
        assert overall[key] is not None and math.isfinite(overall[key])
    # a 3-epoch predictor may never say "freeze" there: then it has no precision (None), never a made-up 0
    assert (overall["precision"] is None) == (overall["tp"] + overall["fp"] == 0)
    if overall["precision"] is not None:
        assert overall["precision"] == overall["tp"] / (overall["tp"] + overall["fp"])
    assert "layerfreeze predictor train" in card["command"] and "--seed 0" in card["command"]
    text = (tmp_path / "PREDICTOR_CARD.md").read_text()
    assert "## Held-out metrics" in text and "cnn-digits_s0_lr0.1" in text and "--history 6 --min-history 4" in text
    assert _cli(["predictor", "evaluate", str(quick_runs), "--predictor", str(out)]) == 0

    runs = [read_run(d, need_labels=True) for d in list_runs(quick_runs)]
    train = [r for r in runs if r.recipe == "mlp-digits"]
    cfg = TrainConfig(seed=0, history=6, min_history=4, epochs=3)
    m1, info1 = train_predictor(train, cfg)
    m2, info2 = train_predictor(train, cfg)
    assert info1 == info2
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), model.state_dict().values()))
    assert not torch.are_deterministic_algorithms_enabled()  # restored
    held = evaluate(m1, [r for r in runs if r.recipe == "cnn-digits"], history=6, min_history=4)
    assert held["overall"]["windows"] == overall["windows"] and held["overall"]["blocks"] == 2 * 5
    full_only = evaluate(m1, [r for r in runs if r.recipe == "cnn-digits"], history=6)
    assert full_only["overall"]["windows"] < held["overall"]["windows"]  # short windows are evaluated too

    # the trained file drives the online strategy
    model = stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, opt, strategy=SmartFRZ(predictor=str(out), snapshot_every=1), total_steps=10)
    _train(model, freezer, 10)
    assert not freezer.frozen[-1]


def test_pipeline_errors(tmp_path, quick_runs):
    assert _cli(["predictor", "label", str(tmp_path / "missing")]) == 2
    assert _cli(["predictor", "collect", "--out", str(tmp_path), "--recipes", "nope", "--quick"]) == 2
    assert _cli(["predictor", "train", str(quick_runs), "--out", str(tmp_path / "p.safetensors"),
                 "--holdout", "mlp-digits,cnn-digits", "--history", "6"]) == 2
    assert _cli(["predictor", "train", str(quick_runs), "--out", str(tmp_path / "p.safetensors"),
                 "--history", "6", "--min-history", "7"]) == 2
    assert _cli(["predictor", "train", str(quick_runs), "--out", str(tmp_path / "p.safetensors"),
                 "--history", "6", "--min-history", "4", "--holdout", "cnn-digitz"]) == 2  # a typo, not "no hold-out"
    assert not (tmp_path / "p.safetensors").exists()
    for bad in (["train", str(quick_runs), "--threshold", "1.5"], ["train", str(quick_runs), "--history", "2"],
                ["evaluate", str(quick_runs), "--threshold", "-3"], ["label", str(quick_runs), "--tau", "5"],
                ["label", str(quick_runs), "--window", "0"], ["label", str(quick_runs), "--delta", "-1"]):
        with pytest.raises(SystemExit) as exc:  # argparse usage errors, before anything runs
            _cli(["predictor", *bad])
        assert exc.value.code == 2
    assert _cli(["predictor", "evaluate", str(quick_runs), "--predictor", str(tmp_path / "none.safetensors")]) == 2


def test_missing_predictor_file_fails_before_training(tmp_path):
    """The predictor file is read where the strategy is built (once per run, before training), not by the config."""
    from layerfreeze.errors import ConfigError
    from layerfreeze.train.config import build_config
    from layerfreeze.train.setup import build_strategy

    missing = tmp_path / "nope.safetensors"
    with pytest.raises(ValueError, match="nope.safetensors does not exist"):
        SmartFRZ(predictor=str(missing))
    cfg = build_config({"freeze": {"strategy": "smartfrz", "params": {"predictor": str(missing)}}})  # names only
    with pytest.raises(ConfigError, match="freeze.params: .*nope.safetensors"):
        build_strategy(cfg)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"not a predictor")
    with pytest.raises(ConfigError, match="corrupt.safetensors is corrupt"):
        build_strategy(build_config({"freeze": {"strategy": "smartfrz", "params": {"predictor": str(corrupt)}}}))
