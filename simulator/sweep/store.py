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
import os
import socket
import sqlite3
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from simulator.data import data_dir
from simulator.errors import UserError
from simulator.version import package_version

SCHEMA_VERSION = 1
# Bump when the simulator's results for the same inputs change meaning within one version (keys rows).
# 2: round 21 (gradient buckets by framework, Megatron's cross-entropy bytes, classic attention's
# layout copies): a stored step for the same scenario is no longer today's.
# 3: round 22 (the embedding's dense backward and main_grad add, FP8 + SP re-gathers and TE's FP8
# gathers, the tied-embedding all-reduce's ranks under V schedules).
# 4: round 23 (expert groups with tp, HSDP and ZeRO-3; MLA's latents and tensor-parallel shared
# experts; TE FP8 casts on the shard; a tied head once under V schedules; torchtitan's layer AC per
# rank; contention from collectives that start during a segment; context parallelism as torch's
# and Transformer Engine's sources run it; torchtitan's FSDP2 as torch 2.13 runs it).
# 5: round 24 (cp_attention unset follows the framework: TE's p2p ring outside torchtitan; TE's
# per-tensor FP8 on compute capability 10.x without transposes).
# 6: round 25 (FSDP2's gathers and reduce-scatters queue on one communicator).
RESULTS_VERSION = "6"
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
-- Points a running sweep is simulating now (added beside schema 1): concurrent sweeps on one store
-- share the work. A claim is dropped when its row is written or its sweep ends; one whose owner
-- process is gone (same host) or whose heartbeat is older than CLAIM_STALE_S is taken over.
CREATE TABLE IF NOT EXISTS claims (
    hash TEXT PRIMARY KEY,
    owner TEXT NOT NULL,             -- host:pid:token of the sweep
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    heartbeat REAL NOT NULL          -- time.time() of the owner's last sign of life
);
INSERT OR IGNORE INTO meta VALUES ('schema_version', '{SCHEMA_VERSION}');
"""

# Input files a scenario names: (holder section, field, what the summary calls it). The resolution of
# a name mirrors simulator.profile.load_profile and simulator.topology.spec.load_topology
# (a test holds them together).
INPUT_FILES = (("cluster", "gpu", "profile"), ("cluster", "topology", "topology"), (None, "schedule_file", "schedule"))
# What the summary says reused rows had in common with this run.
REUSE_BASIS = "same scenario, profile, topology and schedule content"
# A running sweep's driver renews its claims at least this often (it wakes every CLAIM_POLL_S).
CLAIM_HEARTBEAT_S = 2.0
CLAIM_POLL_S = 0.25
# A claim not renewed for this long belongs to a sweep that is hung, suspended or dead on another host:
# another sweep takes it over. Far above the heartbeat so a loaded machine never loses a live claim.
CLAIM_STALE_S = 60.0


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
        shown = str(self.path)
        _check_store_path(self.path)
        try:
            self.db = sqlite3.connect(str(self.path), timeout=30.0)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(_SCHEMA)
            row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.OperationalError as exc:
            if "readonly" in str(exc) or "read-only" in str(exc):
                raise UserError(f"results store {shown!r} is read-only: make it writable or pass another --store path") from None
            raise UserError(f"results store {shown!r} cannot be opened ({exc}): pass another --store path") from None
        except sqlite3.DatabaseError as exc:
            raise UserError(f"results store {shown!r} is not a ClusterSim SQLite store ({exc}): pass another --store path") from None
        version = row[0] if row else None
        if str(version).strip() != str(SCHEMA_VERSION):  # also a value that is no integer ('abc')
            self.db.close()
            raise UserError(
                f"results store {shown!r} has schema version {str(version)[:40]!r}, expected {SCHEMA_VERSION}: use a new --store path"
            )
        self.owner = Owner.mine()

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
        self.db.execute("DELETE FROM claims WHERE hash=?", [record["hash"]])  # stored: nobody need simulate it
        self.db.commit()  # the row, what it was made from and the dropped claim, in one transaction
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

    # --- claims: concurrent sweeps on one store simulate each point once --------------------------

    def claim(self, hashes: list[str], limit: int) -> tuple[list[str], set[str]]:
        """Claim up to ``limit`` of ``hashes`` (in order) for this sweep, in one ``BEGIN IMMEDIATE``
        transaction. Returns (claimed, already stored): points another live sweep holds are in neither.
        A claim whose owner is dead or stale is taken over."""
        me = self.owner
        now = time.time()
        claimed: list[str] = []
        stored: set[str] = set()
        self.db.execute("BEGIN IMMEDIATE")  # one claimer at a time: no point is claimed twice
        try:
            for h in hashes:
                if len(claimed) >= limit:
                    break
                if self.db.execute("SELECT 1 FROM results WHERE hash=?", [h]).fetchone():
                    stored.add(h)
                    continue
                row = self.db.execute("SELECT owner, host, pid, heartbeat FROM claims WHERE hash=?", [h]).fetchone()
                if row is not None and row[0] != me.id and _alive(row[1], row[2], row[3], now):
                    continue
                self.db.execute("INSERT OR REPLACE INTO claims (hash, owner, host, pid, heartbeat) VALUES (?,?,?,?,?)",
                                [h, me.id, me.host, me.pid, now])
                claimed.append(h)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return claimed, stored

    def held_elsewhere(self, hashes: Iterable[str]) -> set[str]:
        """Of ``hashes``, those another live sweep has claimed (and not yet stored)."""
        now = time.time()
        out: set[str] = set()
        hs = list(hashes)
        for i in range(0, len(hs), 500):
            chunk = hs[i:i + 500]
            q = f"SELECT hash, owner, host, pid, heartbeat FROM claims WHERE hash IN ({','.join('?' * len(chunk))})"
            for h, owner, host, pid, beat in self.db.execute(q, chunk):
                if owner != self.owner.id and _alive(host, pid, beat, now):
                    out.add(h)
        return out

    def heartbeat(self) -> None:
        self.db.execute("UPDATE claims SET heartbeat=? WHERE owner=?", [time.time(), self.owner.id])
        self.db.commit()

    def release(self, hashes: Iterable[str] | None = None) -> None:
        """Drop this sweep's claims (of ``hashes``, or all)."""
        if hashes is None:
            self.db.execute("DELETE FROM claims WHERE owner=?", [self.owner.id])
        else:
            self.db.executemany("DELETE FROM claims WHERE hash=? AND owner=?", [(h, self.owner.id) for h in hashes])
        self.db.commit()


@dataclass(frozen=True)
class Owner:
    """Who holds a claim: this host and process, and a token per store opened (two sweeps in one
    process are two owners)."""

    id: str
    host: str
    pid: int

    @staticmethod
    def mine() -> "Owner":
        host = socket.gethostname()
        pid = os.getpid()
        return Owner(f"{host}:{pid}:{uuid.uuid4().hex[:12]}", host, pid)


def _alive(host: str, pid: int, heartbeat: float, now: float) -> bool:
    """Is a claim's owner still simulating? Stale heartbeats never are; on this host the process must exist."""
    if now - heartbeat > CLAIM_STALE_S:
        return False
    if host == socket.gethostname():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, OverflowError, ValueError):
            pass  # another user's live process (or a pid we cannot check): trust the heartbeat
    return True


def _writable(path: Path) -> bool:
    return os.access(path, os.R_OK | os.W_OK)


def _check_store_path(path: Path) -> None:
    """A store path that cannot hold a SQLite file is one line, before any work is done."""
    shown = str(path)
    if "\0" in shown:
        raise UserError(f"results store path {shown!r} holds a NUL character: choose another --store path")
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        st = None  # a parent that is a file is named below
    except OSError as exc:
        raise UserError(f"results store path {shown!r} cannot be used ({exc.strerror}): choose another --store path") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise UserError(f"results store path {shown!r} is a folder: name a file inside it with --store, e.g. {str(path / 'results.sqlite')!r}")
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"results store path {shown!r} is not a regular file (a device, pipe or socket): name a file with --store")
        if not _writable(path):
            raise UserError(f"results store {shown!r} is read-only: make it writable or pass another --store path")
        return
    parent = path.parent
    for p in (parent, *parent.parents):
        if p.exists():
            if not p.is_dir():
                raise UserError(f"results store path {shown!r} goes through {str(p)!r}, which is a file, not a folder: "
                                "choose another --store path")
            if not os.access(p, os.W_OK | os.X_OK):
                raise UserError(f"results store folder {str(p)!r} is not writable: choose another --store path")
            break
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"results store folder {str(parent)!r} cannot be made ({exc.strerror}): choose another --store path") from None
