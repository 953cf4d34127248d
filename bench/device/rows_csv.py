"""One CSV from rows of differing keys (the union of keys, in first-seen order): the device
scripts' tables, whose sections record different columns."""

from __future__ import annotations

import csv
from pathlib import Path


def write_rows_csv(rows: list[dict], path: Path) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
