"""benchmarks/suite.py without training: pairing per seed, aggregation over seeds, the Markdown section."""

from __future__ import annotations

import json

import pytest

from benchmarks import machine as machine_info
from benchmarks import suite_tasks
from tests.conftest import benchmark_module

GIB = 2**30
BLOCKS = ["embeddings", "layer.0", "layer.1", "head"]


@pytest.fixture(scope="module")
def suite():
    with benchmark_module("suite") as module:
        yield module


def _row(row, acc, time, flops, mem, frozen=None):
    return {"row": row, "test_accuracy": acc, "train_time_s": time, "flops_total": flops, "peak_memory_bytes": mem,
            "freeze_steps": frozen or {}}


SEED_ROWS = [
    [_row("none", 0.90, 100.0, 1000, 2 * GIB), _row("static", 0.88, 50.0, 600, 1.5 * GIB, {"embeddings": 0,
     "layer.0": 0}), _row("lora", 0.80, 70.0, 700, 2 * GIB)],
    [_row("none", 0.92, 200.0, 1000, 2 * GIB), _row("static", 0.86, 80.0, 600, 1.5 * GIB, {"embeddings": 0,
     "layer.0": 0}), _row("lora", 0.84, 150.0, 700, 2 * GIB)],
]
ORACLES = [
    {"freeze_steps": {"embeddings": 20, "layer.0": 40, "layer.1": None, "head": None}, "flops_ratio": 0.7},
    {"freeze_steps": {"embeddings": 30, "layer.0": None, "layer.1": None, "head": None}, "flops_ratio": 0.8},
]


def _aggregate(suite):
    paired = [suite.pair_rows(rows, oracle, 100, "head") for rows, oracle in zip(SEED_ROWS, ORACLES)]
    return paired, suite.aggregate(paired, ORACLES, BLOCKS)


def test_pairs_each_seed_with_its_own_none_run(suite):
    paired, _ = _aggregate(suite)
    static0, static1 = paired[0][1], paired[1][1]
    assert static0["time_ratio"] == 0.5 and static1["time_ratio"] == 0.4  # each seed's own none time
    assert static0["flops_ratio"] == 0.6 and static0["accuracy_delta"] == pytest.approx(-0.02)
    assert static0["step_gap"] == pytest.approx((20 + 40 + 0) / 300)  # layer.1: never frozen by either
    assert static1["step_gap"] == pytest.approx((30 + 100 + 0) / 300)  # layer.0: oracle never = the end
    assert static0["flops_gap"] == pytest.approx(-0.1) and static1["flops_gap"] == pytest.approx(-0.2)
    assert paired[0][0]["step_gap"] == pytest.approx((80 + 60) / 300)  # none freezes nothing
    assert paired[0][2]["step_gap"] is None and paired[0][2]["flops_gap"] is None  # lora freezes no blocks


def test_aggregates_mean_min_max_over_seeds(suite):
    _, agg = _aggregate(suite)
    none, static, lora = agg["rows"]
    assert [r["row"] for r in agg["rows"]] == ["none", "static", "lora"] and static["seeds"] == 2
    assert static["test_accuracy"] == pytest.approx({"mean": 0.87, "min": 0.86, "max": 0.88})
    assert static["accuracy_delta"] == pytest.approx(-0.04)
    assert static["time_ratio"] == pytest.approx({"mean": 0.45, "min": 0.4, "max": 0.5})
    assert lora["time_ratio"] == pytest.approx({"mean": 0.725, "min": 0.7, "max": 0.75})
    assert static["flops_ratio"] == pytest.approx(0.6) and static["peak_memory_bytes"] == 1.5 * GIB
    assert static["freeze_steps"] == {"embeddings": [0, 0], "layer.0": [0, 0]}
    assert static["freeze_step_median"] == {"embeddings": 0, "layer.0": 0}
    assert static["step_gap"] == pytest.approx((60 / 300 + 130 / 300) / 2)
    assert static["flops_gap"] == pytest.approx(-0.15)
    assert none["step_gap"] == pytest.approx((140 / 300 + 70 / 300) / 2) and none["flops_gap"] == pytest.approx(0.25)
    assert lora["step_gap"] is None and none["freeze_steps"] == {}
    oracle = agg["oracle"]
    assert oracle["flops_ratio"] == pytest.approx({"mean": 0.75, "min": 0.7, "max": 0.8})
    assert oracle["freeze_steps"] == {"embeddings": [20, 30], "layer.0": [40, None]}
    assert oracle["freeze_step_median"] == {"embeddings": 25, "layer.0": 40}
    assert oracle["frozen_in_seeds"] == {"embeddings": 2, "layer.0": 1}


def test_format_frozen_merges_consecutive_blocks_with_the_same_step(suite):
    blocks = ["f.0", "f.1", "f.2", "f.3", "f.4", "classifier"]
    median = {"f.0": 0, "f.1": 0, "f.2": 0, "f.3": 5, "f.4": 7.5}
    count = {"f.0": 2, "f.1": 2, "f.2": 2, "f.3": 1, "f.4": 2}
    assert suite.format_frozen(median, count, 2, blocks) == "f.0-2@0, f.3@5 (1/2), f.4@7.5"
    assert suite.format_frozen({}, {}, 3, blocks) == "-"
    assert suite.format_frozen({"a": 1, "b.0": 1}, {"a": 1, "b.0": 1}, 1, ["a", "b.0"]) == "a..b.0@1"


def _results(suite):
    _, agg = _aggregate(suite)
    return {
        "meta": {"command": "python -m benchmarks.suite --tasks bbc", "date": "2026-11-29T12:00:00+00:00",
                 "quick": False, "wall_time_s": 1800.0,
                 "machine": {"cpu": "AMD EPYC", "cores": 2, "ram_gib": 23.5, "device": "cpu"},
                 "versions": {"python": "3.11.7", "torch": "2.14.1", "layerfreeze": "0.1.0", "git_commit": "abc1234",
                              "git_dirty": False}},
        "tasks": {"bbc": {
            "title": "MiniLM-L6 fine-tuned on BBC News", "n_train": 1781, "n_test": 444, "total_steps": 100,
            "spec": {"epochs": 2, "max_steps": None, "max_length": 64, "batch_size": 32, "optimizer": "adamw",
                     "lr": 5e-5, "weight_decay": 0.01, "pretrained": True},
            "seeds": [{"seed": 0}, {"seed": 1}], "blocks": BLOCKS, "aggregate": agg,
            "notes": ["LoRA at its own learning rate."]}},
    }


def test_markdown_section_holds_machine_versions_command_and_exact_table(suite):
    text = suite.markdown_section(_results(suite))
    assert text.startswith(suite.BEGIN + "\n") and text.rstrip().endswith(suite.END)
    assert "- Command: `python -m benchmarks.suite --tasks bbc`" in text
    assert "- Date: 2026-11-29T12:00:00+00:00; suite wall time 30.0 min" in text
    assert "- Machine: AMD EPYC, 2 cores, 23.5 GiB RAM, device cpu" in text
    assert "- Versions: python 3.11.7, torch 2.14.1, layerfreeze 0.1.0; commit abc1234" in text
    assert "### MiniLM-L6 fine-tuned on BBC News\n\n2 epochs (100 steps), 1,781 train / 444 test samples, 64 tokens, " \
           "batch 32, AdamW 5e-05 (weight decay 0.01), pretrained, seeds 0, 1.\n" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table == [
        "| row | test acc % mean [min, max] | Δ pts vs none | time ratio mean [min, max] | FLOPs ratio | peak mem "
        "| frozen block@step (median) | gap to oracle (steps, FLOPs) |",
        "| none | 91.00 [90.00, 92.00] | +0.00 | 1.000 [1.000, 1.000] | 1.000 | 2.00 GiB | - | 0.35, +0.250 |",
        "| static | 87.00 [86.00, 88.00] | -4.00 | 0.450 [0.400, 0.500] | 0.600 | 1.50 GiB | embeddings..layer.0@0 "
        "| 0.32, -0.150 |",
        "| lora | 82.00 [80.00, 84.00] | -9.00 | 0.725 [0.700, 0.750] | 0.700 | 2.00 GiB | - | - |",
        "| oracle | n/a | n/a | n/a | 0.750 [0.700, 0.800] | - | embeddings@25, layer.0@40 (1/2) | 0, +0.000 |",
    ]
    assert "- LoRA at its own learning rate." in text and "Quick mode" not in text


def test_update_markdown_replaces_between_markers_or_inserts_after_the_title(suite):
    section = f"{suite.BEGIN}\nnew\n{suite.END}\n"
    doc = "# Benchmarks\n\nIntro.\n\n## Older table\n"
    once = suite.update_markdown(doc, section)
    assert once == f"# Benchmarks\n\n{suite.BEGIN}\nnew\n{suite.END}\n\nIntro.\n\n## Older table\n"
    again = suite.update_markdown(once, f"{suite.BEGIN}\nnewer\n{suite.END}\n")
    assert again == once.replace("\nnew\n", "\nnewer\n")
    assert suite.update_markdown("", section) == section


def test_from_json_regenerates_the_markdown_without_running(suite, tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps(_results(suite)))
    md = tmp_path / "BENCH.md"
    md.write_text("# Benchmarks\n\nKept.\n")
    assert suite.main(["--from-json", str(tmp_path / "results.json"), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\n" + suite.BEGIN) and text.endswith("Kept.\n")
    assert "| static | 87.00 [86.00, 88.00]" in text
    assert (tmp_path / "suite.md").read_text() == suite.markdown_section(_results(suite))
    assert "oracle" in capsys.readouterr().out


def test_every_row_runs_to_its_end_even_one_that_learns_nothing(suite):
    """gradual on BBC sits at chance level for its whole 104-step run: the suite measures that row, so its config
    turns off the trainer's stop for a stuck loss (which raised and ended the whole suite), and the config is valid."""
    from layerfreeze.train.config import build_config

    cfg = suite_tasks.base_config(suite_tasks.task_spec("bbc", False), 0, 1)
    assert cfg["run"]["divergence_window_steps"] is None
    assert build_config({**cfg, "freeze": {"strategy": "gradual"}}).run.divergence_window_steps is None


def _stored_for_resume(suite, rows, seeds):
    """A results.json whose BBC task was run with this checkout's settings for ``rows`` and holds ``seeds``."""
    results = _results(suite)
    results["meta"]["seeds"] = list(seeds)
    task = results["tasks"]["bbc"]
    task.update(suite.task_settings(suite_tasks.task_spec("bbc", False), rows))
    task["seeds"] = [{"seed": s} for s in seeds]
    return results


@pytest.mark.assets("bbc_news")  # the BBC split's sizes
def test_resume_refuses_other_rows_a_quick_run_or_no_results_before_training(suite, tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps(_stored_for_resume(suite, ["none", "static", "lora"], [0])))
    with pytest.raises(SystemExit):
        suite.main(["--resume", "--out", str(tmp_path), "--tasks", "bbc", "--rows", "none,static"])
    assert "task bbc in" in (err := capsys.readouterr().err) and "other rows" in err and "same --rows" in err
    with pytest.raises(SystemExit):
        suite.main(["--resume", "--quick", "--out", str(tmp_path), "--tasks", "bbc", "--rows", "none,static,lora"])
    assert "is a full run; resume it without --quick" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        suite.main(["--resume", "--out", str(tmp_path / "none-here"), "--tasks", "bbc"])
    assert "no results.json of this script to continue" in capsys.readouterr().err
    assert not (tmp_path / "bbc").exists()  # nothing trained


@pytest.mark.assets("bbc_news")  # the BBC split's sizes
def test_resume_keeps_the_stored_seeds_and_runs_only_missing_ones(suite, tmp_path):
    """Every seed asked for is stored: nothing trains (no run folder), the seeds and their table are kept as they
    were, and the section says what the resumed command ran."""
    stored = _stored_for_resume(suite, ["none", "static", "lora"], [0, 1])
    (tmp_path / "results.json").write_text(json.dumps(stored))
    md = tmp_path / "BENCH.md"
    assert suite.main(["--resume", "--out", str(tmp_path), "--tasks", "bbc", "--seeds", "0,1", "--rows",
                       "none,static,lora", "--markdown", str(md)]) == 0
    after = json.loads((tmp_path / "results.json").read_text())
    assert after["tasks"]["bbc"]["seeds"] == stored["tasks"]["bbc"]["seeds"]
    assert after["tasks"]["bbc"]["aggregate"] == stored["tasks"]["bbc"]["aggregate"]
    assert after["meta"]["wall_time_s"] >= 1800.0 and after["meta"]["command"] == stored["meta"]["command"]
    resumed = after["meta"]["resumed"]
    assert len(resumed) == 1 and resumed[0]["ran"] == "nothing (every seed was there)"
    assert not (tmp_path / "bbc").exists()
    line = next(x for x in md.read_text().splitlines() if x.startswith("- Resumed: "))
    assert line.startswith("- Resumed: `python -m benchmarks.suite --resume --out ") and line.endswith(
        "; ran nothing (every seed was there)") and "cores" in line


def test_machine_line_names_the_cpu_family_and_simd_flags_when_recorded(suite):
    old = {"cpu": "AMD EPYC", "cores": 2, "ram_gib": 23.5, "device": "cpu"}
    assert machine_info.machine_line(old) == "AMD EPYC, 2 cores, 23.5 GiB RAM, device cpu"
    new = {**old, "cpu_family_model": "25/1", "cpu_simd": ["avx", "avx2", "fma"]}
    assert (machine_info.machine_line(new)
            == "AMD EPYC (family/model 25/1; avx, avx2, fma), 2 cores, 23.5 GiB RAM, device cpu")
    here = machine_info.machine()
    assert set(here["cpu_simd"]) <= set(machine_info.SIMD_FLAGS) and here["cores"] >= 1


def test_beside_none_table_lists_each_seed_then_the_mean_per_row(suite):
    none = {"test_accuracy": 0.9}
    a0 = {"test_accuracy": 0.91, "accuracy_delta": 0.01, "time_ratio": 0.5, "flops_ratio": 0.6}
    a1 = {"test_accuracy": 0.87, "accuracy_delta": -0.03, "time_ratio": 0.7, "flops_ratio": 0.8}
    b0 = {"test_accuracy": 0.9, "accuracy_delta": 0.0, "time_ratio": 1.0, "flops_ratio": 1.0}
    table = suite.beside_none_table("t", "acc %", [(0, "a", none, a0, "x@1"), (0, "b", none, b0, "-"),
                                                   (1, "a", none, a1, "x@2")])
    cols = {c.header: list(c._cells) for c in table.columns}
    assert cols["acc %"][:3] == ["91.00", "90.00", "87.00"] and cols["frozen block@step"][:3] == ["x@1", "-", "x@2"]
    assert cols["seed"][3:] == ["mean", "mean"] and cols["row"][3:] == ["a", "b"]
    assert cols["Δ pts"][3:] == ["-1.00", "+0.00"] and cols["time ratio"][3] == "0.600"
    assert cols["FLOPs ratio"][3] == "0.700"


def test_row_class_is_one_subclass_per_name_and_the_base_under_its_own_name(suite):
    from layerfreeze.strategies.static import StaticFreezing as Static

    cls = suite.row_class(Static, "static-k3")
    assert cls is suite.row_class(Static, "static-k3") and issubclass(cls, Static) and cls.name == "static-k3"
    assert suite.row_class(Static, Static.name) is Static and Static.name == "static"
