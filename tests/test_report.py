"""``layerfreeze report``: HTML + PNG reports of real (tiny) runs, an interrupted run and a comparison folder."""

from __future__ import annotations

import json
import math
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from rich.console import Console

pytest.importorskip("matplotlib")

from layerfreeze.runs.compare_table import freeze_steps, markdown_table  # noqa: E402
from layerfreeze.runs.report import write_report  # noqa: E402
from layerfreeze.runs.summary import format_bytes, summary_table  # noqa: E402
from layerfreeze.train.config import build_config  # noqa: E402
from layerfreeze.train.trainer import Trainer  # noqa: E402
from tests.conftest import blob_task  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RUN_PLOTS = {"loss_vs_time.png", "loss_vs_flops.png", "accuracy.png", "freeze_timeline.png", "step_time_memory.png",
             "memory.png"}


def _config(run_dir: Path, strategy: str, params: dict):
    return build_config({
        "train": {"epochs": 2, "batch_size": 16, "lr": 0.01, "warmup_fraction": 0.1},
        "freeze": {"strategy": strategy, "params": params},
        "run": {"dir": str(run_dir), "progress": False, "tensorboard": False, "checkpoint": False},
    })


@pytest.fixture(scope="module")
def compare_dir(tmp_path_factory) -> Path:
    """A comparison folder laid out like ``layerfreeze compare`` writes it: none/, static/, compare.json/.md."""
    root = tmp_path_factory.mktemp("compare")
    results = []
    for row, strategy, params in (("none", "none", {}), ("static", "static", {"k": 2})):
        summary = Trainer(_config(root / row, strategy, params), task=blob_task()).run()
        results.append({"row": row, **summary, "freeze_steps": freeze_steps(summary)})
    base = results[0]
    for r in results:
        r["time_ratio"] = r["train_time_s"] / base["train_time_s"]
        r["flops_ratio"] = r["flops_total"] / base["flops_total"]
        r["accuracy_delta"] = r["test_accuracy"] - base["test_accuracy"]
    (root / "compare.json").write_text(json.dumps(results, indent=2))
    (root / "compare.md").write_text(markdown_table(results))
    return root


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[dict[str, str | None]] = []
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs))
        elif tag == "a" and dict(attrs).get("href"):
            self.hrefs.append(dict(attrs)["href"])


def _check_page(index: Path) -> tuple[str, _Links]:
    """The page parses, and every <img> is a valid, non-trivial PNG next to it with alt text."""
    import matplotlib.image

    assert index.is_file() and index.name == "index.html"
    text = index.read_text(encoding="utf-8")
    links = _Links()
    links.feed(text)
    assert links.images, "no images in the report"
    for img in links.images:
        src = img["src"]
        assert src and not re.match(r"[a-z]+:", src) and not src.startswith("/"), f"not a relative path: {src}"
        assert img.get("alt"), f"{src} has no alt text"
        png = index.parent / src
        assert png.is_file() and png.stat().st_size > 0, f"{src} missing or empty"
        assert png.read_bytes()[:8] == PNG_SIGNATURE, f"{src} is not a PNG"
        height, width = matplotlib.image.imread(png).shape[:2]
        assert width > 100 and height > 100, f"{src} is {width}x{height}"
    return text, links


def _img_names(links: _Links) -> set[str]:
    return {img["src"] for img in links.images}


def test_single_run_report_has_every_plot_and_the_summary(compare_dir):
    run_dir = compare_dir / "static"
    summary = json.loads((run_dir / "summary.json").read_text())

    index = write_report(run_dir)

    assert index == run_dir / "report" / "index.html"
    text, links = _check_page(index)
    assert _img_names(links) == RUN_PLOTS
    assert "static" in text
    assert f"<th>precision</th><td>{summary['precision']}</td>" in text  # beside the strategy, not only in the config
    assert f"{100 * summary['test_accuracy']:.2f} %" in text
    assert "interrupted" not in text.lower()
    for block in summary["frozen_blocks"]:  # the freeze timeline list names the frozen blocks
        assert f"<code>{block}</code> frozen at step 0 (before training)" in text
    # one wording for the start stage: the CLI summary said "frozen at step 0 (epoch 1)" where this page said
    # "(before training)" (freeze_step_text gives both)
    console = Console(record=True, width=200)
    console.print(summary_table(summary))
    table = console.export_text()
    assert all(f"{block}  frozen at step 0 (before training)" in table for block in summary["frozen_blocks"])
    assert "(epoch 1)" not in table
    assert "<style>" in text and "<script" not in text  # self-contained, static
    # the memory ledger: the tensor peak and every bucket's peak
    peak = summary["memory"]["tensor_peak_bytes"]
    assert f"{format_bytes(peak)} at step {summary['memory']['tensor_peak_step']}" in text
    assert "saved activations" in text and "optimizer state" in text


def test_run_without_freezing_still_gets_a_timeline(compare_dir):
    stale = compare_dir / "none" / "report" / "an_old_plot.png"  # an earlier report's plot left in the folder
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(PNG_SIGNATURE)
    text, links = _check_page(write_report(compare_dir / "none"))
    assert _img_names(links) == RUN_PLOTS
    assert {p.name for p in stale.parent.glob("*.png")} == RUN_PLOTS  # every PNG there is one the page shows
    assert "no block was frozen" in text


def test_interrupted_run_with_nan_losses_is_reported_from_metrics_alone(compare_dir, tmp_path):
    cut = tmp_path / "cut"
    cut.mkdir()
    lines = (compare_dir / "static" / "metrics.jsonl").read_text().splitlines()
    kept, steps = [], 0
    for line in lines:
        record = json.loads(line)
        if record["type"] == "step":
            steps += 1
            if steps > 8:
                break
            if record["step"] in (3, 4):
                record["loss"] = math.nan
        kept.append(json.dumps(record))  # NaN is written as the bare token NaN, as json.dumps does in telemetry
    kept.append(json.dumps({"type": "event", "kind": "interrupted", "step": 8, "time": 0.0, "epoch": 1,
                            "error": "KeyboardInterrupt('<ctrl-c>')", "checkpoint": None}))
    (cut / "metrics.jsonl").write_text("\n".join(kept) + '\n{"type": "step", "st')  # crash mid-write

    text, links = _check_page(write_report(cut))

    assert "interrupted" in text.lower()
    assert "KeyboardInterrupt(&#x27;&lt;ctrl-c&gt;&#x27;)" in text  # escaped
    assert "2 step(s) had a non-finite training loss" in text
    assert {"loss_vs_time.png", "freeze_timeline.png", "step_time_memory.png"} <= _img_names(links)


def test_compare_report_links_every_row_report_and_plots_accuracy_vs_time(compare_dir):
    index = write_report(compare_dir)

    assert index == compare_dir / "report" / "index.html"
    text, links = _check_page(index)
    assert {"accuracy_vs_time.png", "flops_ratio.png", "memory_peaks.png"} <= _img_names(links)
    for header in ("test acc %", "FLOPs ratio", "tensor peak", "tensor peak ratio", "frozen block@step"):
        assert header in text
    results = json.loads((compare_dir / "compare.json").read_text())
    for r in results:
        assert f"<td>{r['row']}</td>" in text
        assert f"{100 * r['test_accuracy']:.2f}" in text
    targets = {os.path.normpath(index.parent / href) for href in links.hrefs}
    for row in ("none", "static"):
        row_index = compare_dir / row / "report" / "index.html"
        assert os.path.normpath(row_index) in targets
        _, row_links = _check_page(row_index)
        assert [os.path.normpath(row_index.parent / h) for h in row_links.hrefs] == [os.path.normpath(index)]


def test_missing_or_unrecognised_folder_raises_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_report(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="metrics.jsonl.*compare.json"):
        write_report(empty)


def test_a_run_with_one_ledger_sample_draws_it_and_one_label_per_freeze_step(compare_dir, tmp_path, monkeypatch):
    """A short run's memory.png: one sample has no width as a stacked area, so each sample gets a marker; the
    freezes at one step (static k=2 freezes two blocks at step 0) share one label instead of overprinting."""
    from layerfreeze.runs.report import plots
    from layerfreeze.runs.report.read import load_run

    short = tmp_path / "short"
    short.mkdir()
    kept = []
    for line in (compare_dir / "static" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["type"] == "step" and record["step"] > 1:
            break
        kept.append(line)
    (short / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    assert len(load_run(short).memory_step) == 1
    figures = {}
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figures.setdefault(path.name, fig), save(fig, path))[1])
    _, links = _check_page(write_report(short))
    assert "memory.png" in _img_names(links)
    top, bottom = figures["memory.png"].axes[:2]
    for ax in (top, bottom):  # every drawn series shows its one sample as a visible marker
        shown = [ln for ln in ax.lines if len(ln.get_xdata()) == 1 and ln.get_marker() == "o" and ln.get_markersize()]
        assert shown and all(float(ln.get_ydata()[0]) > 0 for ln in shown)
    freezes = [t.get_text() for t in top.texts if "freeze" in t.get_text()]
    assert freezes == [" freeze 2 blocks (0..)"]  # blocks 0 and 1 at step 0: one label


def test_a_report_folder_that_cannot_be_written_is_one_line_and_skipped_after_training(compare_dir, tmp_path,
                                                                                      capsys):
    """A file where report/ goes (or a read-only run folder) raised FileExistsError / IsADirectoryError /
    PermissionError as a raw traceback from `layerfreeze report`, and after a finished `train` or `compare`."""
    import argparse
    import shutil

    from layerfreeze.cli.commands import write_run_report
    from layerfreeze.cli.entry import main
    from layerfreeze.errors import ConfigError

    run = tmp_path / "run"
    shutil.copytree(compare_dir / "static", run)
    shutil.rmtree(run / "report", ignore_errors=True)
    (run / "report").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"^report: .*run/report cannot be written \(File exists\): the report "
                       r"goes into .*run/report; make it a writable folder, or copy .*run somewhere you can write"):
        write_report(run)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("layerfreeze: error: report: ") and "Traceback" not in err
    console = Console(width=200, record=True)
    write_run_report(run, argparse.Namespace(no_report=False), console)  # the end of `train`: said, not raised
    assert console.export_text().startswith("report skipped: report: ")
    (run / "report").unlink()
    (run / "report" / "index.html").mkdir(parents=True)  # the page's own path taken by a folder
    with pytest.raises(ConfigError, match=r"index\.html cannot be written \(Is a directory\)"):
        write_report(run)
    comparison = tmp_path / "comparison"
    shutil.copytree(compare_dir, comparison)
    shutil.rmtree(comparison / "report", ignore_errors=True)
    (comparison / "report").write_text("")
    with pytest.raises(ConfigError, match=r"comparison/report cannot be written"):
        write_report(comparison)
