"""benchmarks/lightning_finetuning.py at ``--tiny`` (MiniLM-L6 on 32 BBC News articles, 2 epochs of 2 steps, every row
in a real ``lightning.Trainer``): Lightning's own ``BackboneFinetuning`` keeps the backbone bitwise unchanged through
epoch 0 (out of the optimizer, FLOPs below none's), then trains it at 0.1x the head's LR; layerfreeze static's frozen
blocks stay bitwise unchanged; every row saw the same data order; bad arguments exit 2 before anything loads."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import benchmark_module

pytest.importorskip("lightning")

#: MiniLM-L6's blocks (layerfreeze's discovery): the embeddings, 6 layers, the pretrained pooler, the new classifier.
BLOCKS = ["bert.embeddings", *(f"bert.encoder.layer.{i}" for i in range(6)), "bert.pooler", "classifier"]


@pytest.mark.assets("minilm", "bbc_news")
def test_tiny_rows_freeze_what_their_callbacks_say_and_measure_it(tmp_path, one_thread, capsys):
    with benchmark_module("lightning_finetuning") as bench:
        assert bench.main(["--tiny", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Lightning BackboneFinetuning" in out and "results.json" in out
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {r["row"]: r for r in results["rows"]}
    assert list(rows) == ["none", "backbone-finetuning", "static", "smartfrz"]
    for r in rows.values():
        assert r["blocks"] == BLOCKS and r["steps"] == 4 and r["train_s"] > 0, r["row"]
        assert 0 <= r["test_accuracy"] <= 1 and math.isfinite(r["test_loss"]) and r["flops_total"] > 0, r["row"]
        assert [e["epoch"] for e in r["epochs"]] == [0, 1], r["row"]
    # the same samples in the same order in every row (the sampler's set_epoch: another order in epoch 1)
    assert len({r["data_order_sha1"] for r in rows.values()}) == 1

    none = rows["none"]
    assert none["flops_ratio"] == none["time_ratio"] == 1.0 and none["delta_points"] == 0
    assert [e["changed"] for e in none["epochs"]] == [BLOCKS, BLOCKS] and none["flop_counted_steps"] == 1
    assert [(p["first_step"], p["last_step"], p["frozen_blocks"]) for p in none["phases"]] == [(1, 4, [])]

    # BackboneFinetuning(unfreeze_backbone_at_epoch=1): epoch 0 trains the classifier alone, the backbone is not in
    # the optimizer (LR None) and its weights are bitwise those it started with; from epoch 1 every block trains, the
    # backbone in a param group of its own at 0.1x the head's LR (Lightning's backbone_initial_ratio_lr)
    bf = rows["backbone-finetuning"]
    assert [e["changed"] for e in bf["epochs"]] == [["classifier"], BLOCKS]
    assert bf["epochs"][0]["lr"] == {**{b: [None] for b in BLOCKS[:-1]}, "classifier": [5e-5]}
    assert bf["epochs"][1]["lr"] == {**{b: [pytest.approx(5e-6)] for b in BLOCKS[:-1]}, "classifier": [5e-5]}
    frozen, thawed = bf["phases"]
    assert (frozen["first_step"], frozen["last_step"], frozen["frozen_blocks"]) == (1, 2, BLOCKS[:-1])
    assert (thawed["first_step"], thawed["last_step"], thawed["frozen_blocks"]) == (3, 4, [])
    # no backward through a frozen backbone: about a third of a full step (the forward); after the thaw, none's
    assert frozen["flops_ratio"] < 0.4 and thawed["flops_ratio"] == 1.0
    assert bf["flops_ratio"] == pytest.approx((frozen["flops_ratio"] + 1) / 2) and bf["flop_counted_steps"] == 2

    # static k=5 (the suite's): the embeddings and layers 0-3 frozen before the first step, bitwise unchanged
    static = rows["static"]
    assert static["layerfreeze_history"] == [["freeze", b, 0] for b in BLOCKS[:5]]
    assert [e["changed"] for e in static["epochs"]] == [BLOCKS[5:], BLOCKS[5:]]
    assert [(p["first_step"], p["last_step"], p["frozen_blocks"]) for p in static["phases"]] == [(1, 4, BLOCKS[:5])]
    assert all(lrs == [None] for b, lrs in static["epochs"][0]["lr"].items() if b in BLOCKS[:5])
    assert 0 < static["flops_ratio"] < 1 and static["flops_ratio"] > frozen["flops_ratio"]

    smartfrz = rows["smartfrz"]
    assert 0 < smartfrz["flops_ratio"] <= 1 and "classifier" in smartfrz["epochs"][-1]["changed"]
    # in every row, a block frozen in every step of an epoch kept its weights bitwise through it
    for r in rows.values():
        for epoch in r["epochs"]:
            steps = range(2 * epoch["epoch"] + 1, 2 * epoch["epoch"] + 3)
            frozen_all = set(BLOCKS).intersection(*(p["frozen_blocks"] for p in r["phases"]
                                                   if p["first_step"] <= steps[-1] and p["last_step"] >= steps[0]))
            assert not frozen_all & set(epoch["changed"]), (r["row"], epoch)


@pytest.mark.parametrize("argv, message", [
    (["--tiny", "--unfreeze-at", "2"], "--unfreeze-at 2: the job has 2 epochs"),
    (["--rows", "none,lightning"], "argument --rows: lightning: give comma-separated names from none, "),
    (["--static-k", "9"], "--static-k 9: MiniLM-L6 has 9 blocks"),
])
def test_bad_arguments_exit_2_with_what_to_give(argv, message, capsys):
    with benchmark_module("lightning_finetuning") as bench, pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.assets("minilm", "bbc_news")
def test_a_per_step_scheduler_breaks_backbone_finetuning_at_the_thaw_and_the_row_is_reported(tmp_path, one_thread):
    """``--schedule linear``: the LambdaLR holds one LR per param group of ``configure_optimizers``; the group that
    ``BackboneFinetuning`` adds at the thaw has none, and torch >= 2.10 zips the two with ``strict=True``."""
    torch = pytest.importorskip("torch")
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 10):
        pytest.skip("torch < 2.10 zips the scheduler's LRs with the param groups without strict=True")
    with benchmark_module("lightning_finetuning") as bench:
        argv = ["--tiny", "--rows", "backbone-finetuning,static", "--schedule", "linear", "--out", str(tmp_path)]
        assert bench.main(argv) == 1
    row, static = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["row"] == "backbone-finetuning"
    assert row["error"] == "ValueError: zip() argument 2 is shorter than argument 1"
    # LayerFreeze keeps the optimizer's param groups as they are: the same scheduler trains on
    assert static["row"] == "static" and "error" not in static and static["steps"] == 4 and static["test_accuracy"] > 0
