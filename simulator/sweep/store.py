"""The results store: one SQLite row per simulated scenario, keyed by the scenario's hash.

Rows are written by the sweep's driver process only (workers return results; they never
touch the file), one transaction per result, as soon as the result arrives. WAL mode keeps
readers (a dashboard, a second terminal) from blocking the writer, and a crash or Ctrl-C
loses at most the result being written. ``INSERT OR IGNORE`` on the hash makes a re-run, or
a task that Dask re-ran after a worker died, add nothing twice.

A row's key is a hash of everything that determines its result (``ResultKeyer``): the scenario
(validated and normalised: defaults filled in, the model resolved to its numbers, paths absolute,
the name left out), the simulation mode, the *contents* of the GPU profile, topology and schedule
files the scenario names (a shipped name is resolved to the shipped file), the clustersim version
and ``RESULTS_VERSION``. An edited topology file therefore keys new rows; the old ones stay, are
never returned for it, and are counted as "stored from other inputs" (``stale``) so the summary can
say why they were not reused.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from simulator.data import data_dir
from simulator.errors import UserError
from simulator.version import package_version

SCHEMA_VERSION = 1
# Bump when the simulator's results for the same inputs change meaning within one version (keys rows).
RESULTS_VERSION = "1"
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
-- What each row was computed from (added beside schema 1; older rows have none and are simply
-- never matched): the scenario alone, and the digests of the input files and the version.
CREATE TABLE IF NOT EXISTS row_inputs (
    hash TEXT PRIMARY KEY,
    scenario_key TEXT NOT NULL,
    inputs_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS row_inputs_scenario ON row_inputs (scenario_key);
INSERT OR IGNORE INTO meta VALUES ('schema_version', '{SCHEMA_VERSION}');
"""

# Input files a scenario names: (holder section, field, what the summary calls it). The resolution of
# a name mirrors simulator.calibrate.profile.load_profile and simulator.topology.spec.load_topology
# (a test holds them together).
INPUT_FILES = (("cluster", "gpu", "profile"), ("cluster", "topology", "topology"), (None, "schedule_file", "schedule"))
# What the summary says reused rows had in common with this run.
REUSE_BASIS = "same scenario, profile, topology and schedule content"


def input_file(role: str, value: str) -> Path:
    """The file a scenario's ``gpu`` / ``topology`` / ``schedule_file`` value names."""
    path = Path(value)
    if role == "profile" and path.suffix != ".json":
        return data_dir("profiles") / f"{value}.json"
    if role == "topology" and not path.suffix:
        return data_dir("topologies") / f"{value}.yaml"
    return path


def _digest(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


@dataclass(frozen=True)
class ResultKey:
    hash: str  # keys the row: scenario, mode, input file contents, versions
    scenario_key: str  # the scenario and mode alone: finds rows of the same point made from other inputs
    inputs: dict[str, str | None]  # role -> content digest (None: not a file), clustersim, results


class ResultKeyer:
    """Keys for one sweep. Each file is read once (its digest cached): inputs are taken to stay put
    while a sweep runs, as the estimator's caches take them to."""

    def __init__(self, mode: str):
        self.mode = mode
        self.version = package_version()
        self._digests: dict[tuple[str, str], str] = {}

    def file_digest(self, role: str, value: Any) -> str | None:
        """sha256 of the file's bytes; None when the value is not a file reference (an inline mapping)."""
        if not isinstance(value, str):
            return None
        k = (role, value)
        if k not in self._digests:
            path = input_file(role, value)
            try:
                self._digests[k] = _digest(path.read_bytes())
            except OSError:
                # The simulation will fail on it (an error row); the file appearing later changes the key.
                self._digests[k] = f"unreadable:{path.resolve()}"
        return self._digests[k]

    def key(self, scenario: dict[str, Any]) -> ResultKey:
        d = {k: v for k, v in scenario.items() if k != "name"}  # what is simulated, not what it is called
        inputs: dict[str, str | None] = {}
        for section, field, role in INPUT_FILES:
            holder = d.get(section, {}) if section else d
            inputs[role] = self.file_digest(role, holder.get(field)) if isinstance(holder, dict) else None
        inputs["clustersim"] = self.version
        inputs["results"] = RESULTS_VERSION
        scenario_blob = {"mode": self.mode, "scenario": d}
        return ResultKey(
            hash=_hash({**scenario_blob, "inputs": inputs}),
            scenario_key=_hash(scenario_blob),
            inputs=inputs,
        )


def _hash(obj: Any) -> str:
    return _digest(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())[:24]


def changed_inputs(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two rows' inputs, as the summary words it."""
    out = []
    for _, _, role in INPUT_FILES:
        if old.get(role) != new.get(role):
            out.append(f"{role} content")
    if old.get("clustersim") != new.get("clustersim"):
        out.append(f"clustersim version (stored with {old.get('clustersim')})")
    if old.get("results") != new.get("results"):
        out.append("results version")
    return out


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
        if cur.rowcount == 1 and record.get("scenario_key") is not None:
            self.db.execute("INSERT OR REPLACE INTO row_inputs (hash, scenario_key, inputs_json) VALUES (?,?,?)",
                            [record["hash"], record["scenario_key"], json.dumps(record.get("inputs", {}), sort_keys=True)])
        self.db.commit()  # the row and what it was made from, in one transaction
        return cur.rowcount == 1

    def stale(self, keys: Iterable[ResultKey]) -> dict[str, list[dict[str, Any]]]:
        """Rows of the same scenarios made from other inputs: scenario_key -> their inputs (to say why
        they were not reused)."""
        ks = {k.scenario_key: k.hash for k in keys}
        out: dict[str, list[dict[str, Any]]] = {}
        sk = list(ks)
        for i in range(0, len(sk), 500):
            chunk = sk[i:i + 500]
            q = f"SELECT hash, scenario_key, inputs_json FROM row_inputs WHERE scenario_key IN ({','.join('?' * len(chunk))})"
            for h, s, ij in self.db.execute(q, chunk):
                if h != ks[s]:
                    out.setdefault(s, []).append(json.loads(ij))
        return out

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
