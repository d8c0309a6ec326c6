"""Replace one generated section of a Markdown file (BENCHMARKS.md) between its begin and end markers."""

from __future__ import annotations

from pathlib import Path


def update_section(path: Path, begin: str, end: str, section: str, heading: str) -> None:
    """Write ``section`` between the markers ``begin`` and ``end`` of ``path``; a file without them gets
    ``heading`` and the markers appended first. The text around the markers is kept as it is."""
    text = path.read_text()
    if begin not in text:
        text += f"\n{heading}\n\n{begin}\n{end}\n"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{section}{end}{tail}")
