"""The results store: one SQLite row per simulated scenario, keyed by the scenario's hash.

Rows are written by the sweep's driver process only (workers return results; they never
touch the file), one transaction per result, as soon as the result arrives. WAL mode keeps
readers (a dashboard, a second terminal) from blocking the writer, and a crash or Ctrl-C
loses at most the result being written. ``INSERT OR IGNORE`` on the hash makes a re-run, or
a task that Dask re-ran after a worker died, add nothing twice.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterable

from simulator.errors import UserError

SCHEMA_VERSION = 1
# The key fields kept as columns (the rest lives in report_json).
KEY_FIELDS = ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "peak_memory_gib", "fits_in_memory", "gpus")

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    hash TEXT PRIMARY KEY,
    status TEXT NOT NULL,            -- ok | error
    point_json TEXT NOT NULL,        -- the swept fields of this point
    scenario_json TEXT NOT NULL,     -- the whole scenario simulated
    step_time_s REAL, tokens_per_s REAL, tokens_per_s_per_gpu REAL, mfu REAL,
    peak_memory_gib REAL, fits_in_memory INTEGER, gpus INTEGER,
    report_json TEXT,                -- Report.model_dump(mode="json")
    error TEXT,
    wall_s REAL,
    finished_at REAL NOT NULL
);
INSERT OR IGNORE INTO meta VALUES ('schema_version', '{SCHEMA_VERSION}');
"""


class ResultStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(str(self.path), timeout=30.0)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(_SCHEMA)
            row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise UserError(f"results store {str(self.path)!r} is not a ClusterSim SQLite store ({exc}): pass another --store path") from None
        if row is None or int(row[0]) != SCHEMA_VERSION:
            raise UserError(
                f"results store {str(self.path)!r} has schema version {row[0] if row else None}, expected {SCHEMA_VERSION}: use a new --store path"
            )

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def done(self, hashes: Iterable[str] | None = None) -> set[str]:
        """Hashes already stored (of ``hashes``, or all)."""
        if hashes is None:
            return {r[0] for r in self.db.execute("SELECT hash FROM results")}
        out: set[str] = set()
        hs = list(hashes)
        for i in range(0, len(hs), 500):
            chunk = hs[i:i + 500]
            q = f"SELECT hash FROM results WHERE hash IN ({','.join('?' * len(chunk))})"
            out.update(r[0] for r in self.db.execute(q, chunk))
        return out

    def add(self, record: dict[str, Any]) -> bool:
        """Store one finished scenario and commit; False if its hash was already there."""
        rep = record.get("report") or {}
        vals = [rep.get(k) for k in KEY_FIELDS]
        if vals[5] is not None:
            vals[5] = int(bool(vals[5]))
        cur = self.db.execute(
            "INSERT OR IGNORE INTO results (hash, status, point_json, scenario_json, step_time_s, tokens_per_s, "
            "tokens_per_s_per_gpu, mfu, peak_memory_gib, fits_in_memory, gpus, report_json, error, wall_s, finished_at) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            [record["hash"], record["status"], json.dumps(record.get("point", {}), sort_keys=True),
             json.dumps(record["scenario"], sort_keys=True), *vals,
             json.dumps(rep) if rep else None, record.get("error"), record.get("wall_s"), time.time()],
        )
        self.db.commit()
        return cur.rowcount == 1

    def get(self, hashes: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Stored records by hash: status, report (dict) or error."""
        out: dict[str, dict[str, Any]] = {}
        hs = list(hashes)
        for i in range(0, len(hs), 500):
            chunk = hs[i:i + 500]
            q = f"SELECT hash, status, report_json, error, wall_s FROM results WHERE hash IN ({','.join('?' * len(chunk))})"
            for h, status, rj, err, wall in self.db.execute(q, chunk):
                out[h] = {"status": status, "report": json.loads(rj) if rj else None, "error": err, "wall_s": wall}
        return out

    def count(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM results").fetchone()[0])
