"""benchmarks/default_job_frontier.py without training: its schedule syntax, one prefix or growing stages."""

from __future__ import annotations

import pytest

from tests.conftest import benchmark_module


@pytest.fixture(scope="module")
def frontier():
    with benchmark_module("default_job_frontier") as module:
        yield module


def test_one_prefix_and_growing_stages(frontier):
    assert frontier.parse_schedule("5@28") == [28] * 5 + [None] * 4
    assert frontier.parse_schedule("5@28+6@120") == [28] * 5 + [120] + [None] * 3
    assert frontier.parse_schedule("2@0+3@0+8@160") == [0, 0, 0] + [160] * 5 + [None]
    assert frontier.row_name("5@28+6@120") == "d5@28+d6@120"
    assert frontier.row_name("6@14") == "d6@14"


@pytest.mark.parametrize("bad, why", [
    ("9@10", "1 <= d <= 8"), ("0@10", "1 <= d <= 8"), ("5@-1", "t >= 0"), ("5", "not d@t"),
    ("5@x", "not d@t"), ("5@28+5@40", "deeper prefix"), ("5@28+6@20", "same step or later"),
])
def test_bad_schedules_are_refused(frontier, bad, why):
    with pytest.raises(ValueError, match=why):
        frontier.parse_schedule(bad)
