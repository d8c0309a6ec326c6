"""What every benchmark script's command line shares: counts checked as argparse reads them, and the user's errors
as one line.

``python -m benchmarks.<name>`` ends each script with ``raise SystemExit(entry(main))``: a bad config, an unknown
strategy, a folder that cannot be written or a missing asset prints ``benchmarks.<name>: error: <what to do>`` and
exits 2, before or instead of a traceback, as ``layerfreeze``'s own CLI does. Anything else (a bug) keeps its
traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from layerfreeze.errors import UserError


def count(minimum: int = 1) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= minimum`` (steps, epochs, repeats, seeds), else argparse's one-line
    error (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}: give an integer >= {minimum}")
        return value

    return parse


def seed_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated seeds (``0,1,2``; ``0`` for one), each an integer >= 0 given once, as
    every script's ``--seeds`` takes them; else argparse's one-line error (exit 2). Some scripts took a count of seeds
    (``--seeds 3``: seeds 0, 1, 2) and others a list (the same ``--seeds 3``: seed 3 alone), in silence."""
    given = [part.strip() for part in text.split(",") if part.strip()]
    try:
        values = [int(part) for part in given]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated seeds, integers >= 0 (0,1,2 for three)")
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"seed(s) {', '.join(map(str, twice))} given twice: give each once")
    return values


def names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse ``type``: comma-separated names, each one of ``choices`` (rows, tasks), as every script's
    ``--rows`` takes them; else argparse's one-line error (exit 2)."""

    def parse(text: str) -> list[str]:
        given = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in given if name not in choices]
        if unknown or not given:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown) or repr(text)}: give comma-separated names "
                                             f"from {', '.join(choices)}")
        twice = sorted({name for name in given if given.count(name) > 1})
        if twice:  # a row given twice ran twice
            raise argparse.ArgumentTypeError(f"{', '.join(twice)} given twice: give each once")
        return given

    return parse


def entry(main: Callable[[], int | None]) -> int:
    """Run a benchmark's ``main()``; its return value is the exit code (None: 0). A :class:`UserError` (bad config,
    unknown strategy or row, missing asset) or an ``OSError`` (an output folder that cannot be made or written)
    prints one line naming the script and exits 2."""
    prog = "benchmarks." + sys.argv[0].rsplit("/", 1)[-1].removesuffix(".py") if sys.argv else "benchmarks"
    try:
        return main() or 0
    except (UserError, OSError) as exc:
        what = f"{exc.strerror}: {exc.filename}" if isinstance(exc, OSError) and exc.filename else str(exc)
        print(f"{prog}: error: {what}", file=sys.stderr)
        return 2
