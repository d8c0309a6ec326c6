"""Issue 43: the benchmark scripts share one vocabulary of job names (benchmarks/jobs.py), ``memory_table --size``
applies to every job, and its tables cut no header or row name."""

from __future__ import annotations

import pytest
from rich.console import Console

from benchmarks.jobs import JOBS, parse_jobs
from layerfreeze.errors import ConfigError
from tests.conftest import benchmark_module


def test_every_script_takes_the_same_job_names_and_refuses_the_old_ones():
    assert parse_jobs("default-job,fmnist-mobilenet") == ["default-job", "fmnist-mobilenet"]
    renamed = (("fmnist", "fmnist-mobilenet"), ("bbc-news", "default-job"), ("fashion-mnist", "fmnist-mobilenet"))
    for old, new in renamed:
        with pytest.raises(ConfigError) as exc:  # benchmarks.cli.entry: one line, exit 2
            parse_jobs(old, ("default-job", "fmnist-mobilenet"))
        assert f"unknown job {old!r} (did you mean {new}?" in str(exc.value)
    for name in ("memory_table", "ledger_overhead", "smartfrz_overhead", "demote_accuracy", "suite"):
        with benchmark_module(name) as module:
            jobs = set(getattr(module, "JOBS", None) or module.TASKS)
        assert jobs <= set(JOBS), (name, jobs - set(JOBS))


def test_memory_table_size_applies_to_the_default_job_and_its_headers_are_whole():
    with benchmark_module("memory_table") as memory_table:
        tiny, _, _ = memory_table.task_config("default-job", "tiny", 0, 1)
        suite, _, _ = memory_table.task_config("default-job", "suite", 0, 1)
        head = ["row", "test acc %", "parameters, trainable", "static+bf16 peak", "master copies (demoted)"]
        cells = [["static+bf16+offload", "97.52", "86.7 MiB", "1.23 GiB", "-"]]
        table = memory_table.rich_table("t", head, cells)
    assert tiny["train"]["max_steps"] == 3 and tiny["data"]["limit_train"] == 96 and "max_steps" not in suite["train"]
    console = Console(width=80, record=True)
    console.print(table)
    text = console.export_text()
    assert "…" not in text and "static+bf16+offload" in text and "parameters," in text and "trainable" in text
    with pytest.raises(ConfigError, match="did you mean fmnist-mobilenet"):
        with benchmark_module("memory_table") as memory_table:
            memory_table.main(["--tasks", "fmnist", "--size", "tiny"])
