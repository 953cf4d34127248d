"""Load what a PATH holds -- a trace bundle, one Kineto file, or a folder of per-rank Kineto files
from one job -- into one OpTable."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from simulator.errors import UserError
from simulator.trace.bundle import MANIFEST_NAME, Manifest, load_manifest
from simulator.trace.kineto import KinetoTrace, TraceImportWarning, import_kineto
from simulator.trace.optable import concat_optables

_TRACE_SUFFIXES = (".json", ".json.gz")
_BUNDLE_TRACE_RE = re.compile(r"^rank(\d+)\.trace\.json(\.gz)?$")
_RANK_IN_NAME_RE = re.compile(r"rank[-_]?(\d+)", re.I)


@dataclass
class TraceSet:
    ops: pd.DataFrame                  # OpTable of every rank; start_us from the job's first event
    ranks: list[int]
    devices: list[str]                 # device name of each rank, in the order of ranks
    files: list[Path]
    world_size: int | None = None
    backend: str | None = None
    manifest: Manifest | None = None
    traces: list[KinetoTrace] = field(default_factory=list)   # per file (their ops are not re-based)
    warnings: list[str] = field(default_factory=list)

    @property
    def span_us(self) -> float:
        if self.ops.empty:
            return 0.0
        return float((self.ops["start_us"] + self.ops["dur_us"]).max() - self.ops["start_us"].min())


def is_trace_file(p: Path) -> bool:
    return p.is_file() and p.name.endswith(_TRACE_SUFFIXES)


def load_trace(path: str | Path) -> TraceSet:
    """Import a bundle dir, one Kineto file, or a folder of per-rank Kineto files."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{str(path)!r} does not exist: give a trace bundle, a Kineto trace file or a folder of them")
    manifest = None
    if path.is_dir():
        entries = sorted(p for p in path.iterdir() if p.is_file())
        if (path / MANIFEST_NAME).exists() or any(_BUNDLE_TRACE_RE.match(p.name) for p in entries):
            manifest = load_manifest(path)  # raises on a missing manifest or a newer schema
            files = [path / f for f in manifest.trace_files]
            missing = [str(f.name) for f in files if not f.exists()]
            if missing:
                raise UserError(f"bundle {str(path)!r} lists trace files that are not there: {', '.join(missing)}: re-capture the bundle")
            if not files:
                raise UserError(f"bundle {str(path)!r} lists no trace_files in its manifest: re-capture the bundle")
        else:
            files = [p for p in entries if p.name.endswith(_TRACE_SUFFIXES)]
            if not files:
                raise UserError(f"{str(path)!r} holds no .json or .json.gz trace files and no {MANIFEST_NAME}")
    else:
        files = [path]

    traces: list[KinetoTrace] = []
    for i, f in enumerate(files):
        rank = None
        if manifest is not None:
            m = _BUNDLE_TRACE_RE.match(f.name)
            rank = int(m.group(1)) if m else i
        with warnings.catch_warnings():
            # The set collects warnings once, below; per-file copies would repeat them.
            warnings.simplefilter("ignore")
            tr = import_kineto(f, rank=rank)
        if tr.rank is None:
            m = _RANK_IN_NAME_RE.search(f.name)
            tr.rank = int(m.group(1)) if m else (i if len(files) > 1 else 0)
            tr.ops["rank"] = tr.rank
        traces.append(tr)
    seen: dict[int, Path] = {}
    for tr in traces:
        if tr.rank in seen:
            raise UserError(
                f"{str(tr.path)!r} and {str(seen[tr.rank])!r} both hold rank {tr.rank}: "
                "a folder must hold one trace per rank of one job"
            )
        seen[tr.rank] = tr.path
    traces.sort(key=lambda t: t.rank)

    ops = concat_optables([t.ops for t in traces])
    if len(ops):
        origin = int(ops["start_abs_ns"].min())
        ops["start_us"] = (ops["start_abs_ns"] - origin) / 1000.0
        ops = ops.sort_values(["start_abs_ns", "rank", "stream"], kind="stable").reset_index(drop=True)
    warn = [w for t in traces for w in t.warnings]
    for w in warn:
        warnings.warn(w, TraceImportWarning, stacklevel=2)
    worlds = {t.world_size for t in traces if t.world_size}
    backends = {t.backend for t in traces if t.backend}
    devices = [", ".join(t.devices) if t.devices else "unknown" for t in traces]
    if manifest is not None and manifest.devices and all(d == "cpu" for d in devices):
        devices = [manifest.devices[t.rank] if t.rank < len(manifest.devices) else devices[k] for k, t in enumerate(traces)]
    return TraceSet(
        ops=ops,
        ranks=[t.rank for t in traces],
        devices=devices,
        files=[t.path for t in traces],
        world_size=(manifest.world_size if manifest else (max(worlds) if worlds else None)),
        backend=(manifest.backend if manifest else (backends.pop() if len(backends) == 1 else None)),
        manifest=manifest,
        traces=traces,
        warnings=warn,
    )
