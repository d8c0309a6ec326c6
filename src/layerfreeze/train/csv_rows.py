"""Reading a user's CSV file: the rows' values of the columns a task names, each with its line, or one clear error
(:func:`read_csv_columns`); used by the text-classification data (:mod:`~layerfreeze.train.data`) and the language
model's corpus (:mod:`~layerfreeze.train.lm`)."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CSV_FIELD_LIMIT", "read_csv_columns"]

#: The largest CSV field read: the csv module's default limit, 128 KiB, is less than a long article or a corpus in one
#: cell (it raised ``_csv.Error: field larger than field limit``).
CSV_FIELD_LIMIT = 2**31 - 1


def read_csv_columns(path: str | Path, columns: Sequence[str]) -> list[tuple[int, list[str]]]:
    """The values of ``columns`` in every data row of a CSV file (UTF-8, a BOM allowed, a header row, at least one
    data row), each row with its line number: ``[(line, [value per column])]``. Fields of any length are read
    (:data:`CSV_FIELD_LIMIT`).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        UnicodeDecodeError: the file is not UTF-8.
        ValueError: the file is empty (0 bytes, or no header row), has a header but no data rows, a column is
            missing (the message lists the columns present), or a row has fewer fields than the header (it names the
            line: a missing comma or quote).
    """
    path = Path(path)
    header = ",".join(columns)
    before = csv.field_size_limit(CSV_FIELD_LIMIT)
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            present = reader.fieldnames or []
            if not any(name.strip() for name in present):  # no header: "no column 'text'; columns present: []"
                what = ("is empty (0 bytes)" if path.stat().st_size == 0
                        else "has no header row (its first line is blank)")
                raise ValueError(f"{path} {what}: a CSV file starts with a header row naming its columns ({header}), "
                                 "then one row per sample")
            for column in columns:
                if column not in present:
                    raise ValueError(f"{path}: no column {column!r}; columns present: {present}")
            rows = []
            for row in reader:
                values = [row[c] for c in columns]
                if any(v is None for v in values):
                    missing = next(c for c, v in zip(columns, values) if v is None)
                    raise ValueError(f"{path}: line {reader.line_num} has no {missing!r} field (fewer fields than "
                                     "the header: a missing comma or quote?)")
                rows.append((reader.line_num, values))
    finally:
        csv.field_size_limit(before)
    if not rows:
        raise ValueError(f"{path} has a header row but no data rows: add one row per sample below it ({header})")
    return rows
