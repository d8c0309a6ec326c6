# Two entry points from a fresh clone: `make demo` (the default job) and `make test` (the test suite).
.PHONY: demo test setup

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/layerfreeze train

test: setup
	.venv/bin/ruff check src tests benchmarks examples
	.venv/bin/lint-imports
	LAYERFREEZE_REQUIRE_ASSETS=1 .venv/bin/python -m pytest -q
