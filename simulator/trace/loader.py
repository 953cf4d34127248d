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
from simulator.trace.collectives import annotate_transfers, pg_ranks_from_config
from simulator.trace.kineto import KinetoTrace, TraceImportWarning, import_kineto
from simulator.trace.optable import concat_optables

_TRACE_SUFFIXES = (".json", ".json.gz")
_BUNDLE_TRACE_RE = re.compile(r"^rank(\d+)\.trace\.json(\.gz)?$")


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


def layout_of_manifest(manifest: Manifest | None):
    """The parallel layout (placement.Mesh) of the scenario a bundle ran, or None.

    gloo records no process group per collective call, so a capture's groups come from the
    layout its manifest records (the capture checks torch's device mesh against this Mesh)."""
    from simulator.topology.placement import DEFAULT_ORDER, Mesh

    par = (manifest.scenario or {}).get("parallelism") if manifest is not None else None
    if not isinstance(par, dict):
        return None
    try:
        tp, cp, ep, pp = (int(par.get(d) or 1) for d in ("tp", "cp", "ep", "pp"))
        dp = par.get("dp")
        dp = int(dp) if dp else manifest.world_size // max(1, tp * cp * pp)
        mesh = Mesh(tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, order=str(par.get("mesh_order") or DEFAULT_ORDER))
    except (TypeError, ValueError, UserError):
        return None  # a layout that is not one: the groups stay unknown, and the note says so
    return mesh if mesh.world_size == manifest.world_size else None


def is_trace_file(p: Path) -> bool:
    return p.is_file() and p.name.endswith(_TRACE_SUFFIXES)


_WORKER_RE = re.compile(r"(?:^|[^a-z])(?:local_rank|rank|worker)[-_]?(\d+)", re.I)
_RANK_OF_RE = re.compile(r"rank[-_]?(\d+)[-_]?of[-_]?(\d+)", re.I)
_NUMBER_DIR_RE = re.compile(r"^(\d+)$")
_PEEK_CHARS = 1 << 16
# Keys a Kineto / Chrome trace has near its start (traceEvents may come after deviceProperties).
_TRACE_KEYS = ('"traceEvents"', '"schemaVersion"', '"deviceProperties"', '"distributedInfo"', '"displayTimeUnit"')


def _looks_like_trace(p: Path) -> bool:
    """A cheap look at the start of a .json(.gz) file: does it hold a Chrome/Kineto trace?"""
    from simulator.trace.jsonstream import open_text

    try:
        with open_text(p) as f:
            head = f.read(_PEEK_CHARS)
    except (OSError, EOFError, UnicodeDecodeError, ValueError):
        return True  # let the importer say what is wrong with it
    head = head.lstrip()
    if head.startswith("["):
        return '"ph"' in head or not head[1:].strip()
    return any(k in head for k in _TRACE_KEYS)


def rank_from_path(p: Path, root: Path) -> tuple[int | None, int | None]:
    """(rank, world size) a trace's path names: rank_3/, worker3, rank3of16, *rank*3..., or a
    folder named by a bare number under the root; (None, None) when it names none."""
    rel = p.relative_to(root) if p != root and root in p.parents else Path(p.name)
    parts = list(rel.parts)
    for part in reversed(parts):
        m = _RANK_OF_RE.search(part)
        if m:
            return int(m.group(1)), int(m.group(2))
    for part in reversed(parts):
        m = _WORKER_RE.search(part)
        if m:
            return int(m.group(1)), None
    for part in reversed(parts[:-1]):
        m = _NUMBER_DIR_RE.match(part)
        if m:
            return int(m.group(1)), None
    return None, None


def find_trace_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """Kineto traces anywhere under folder (per-rank subfolders at any depth), and the files
    skipped: .json files that are not traces. Hidden folders are not entered."""
    files, skipped = [], []
    for p in _visible_files(folder):
        if p.name.endswith(_TRACE_SUFFIXES):
            (files if _looks_like_trace(p) else skipped).append(p)
    return files, skipped


def _visible_files(folder: Path) -> list[Path]:
    """The files anywhere under folder, sorted; hidden folders (and files) are not entered."""
    return [p for p in sorted(folder.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)]


def nccl_tests_logs(folder: Path) -> list[Path]:
    """nccl-tests logs anywhere under folder (hidden folders are not entered)."""
    from simulator.trace.nccl_tests import looks_like_nccl_tests

    return [p for p in _visible_files(folder) if looks_like_nccl_tests(p)]


def _import_quiet(args: tuple[Path, int | None]) -> KinetoTrace:
    with warnings.catch_warnings():
        # The set collects warnings once; per-file copies would repeat them.
        warnings.simplefilter("ignore")
        return import_kineto(args[0], rank=args[1])


def _import_all(files: list[Path], ranks: list[int | None]) -> list[KinetoTrace]:
    """Import the files, in worker processes when there are several files and free cores
    (CLUSTERSIM_IMPORT_WORKERS=1 forces one process). Each rank is independent until the set is
    assembled, and a worker holds one file's events at a time."""
    import os

    want = os.environ.get("CLUSTERSIM_IMPORT_WORKERS")
    workers = int(want) if want and want.isdigit() else min(len(files), os.cpu_count() or 1, 8)
    if workers > 1 and len(files) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        try:
            ctx = mp.get_context("fork")
        except ValueError:
            ctx = None
        if ctx is not None:
            with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
                return list(ex.map(_import_quiet, zip(files, ranks)))
    return [_import_quiet(a) for a in zip(files, ranks)]


def load_trace(path: str | Path, mesh=None) -> TraceSet:
    """Import a bundle dir, one Kineto file, or a folder of per-rank Kineto files (at any depth:
    torch.profiler's tensorboard_trace_handler output, rank_k/ or worker_k/ subfolders, ...).

    mesh (simulator.topology.placement.Mesh): the job's parallel layout, which tells the groups
    of collectives whose records name none (see simulator.trace.collectives); a bundle's own
    scenario gives it when none is given."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{str(path)!r} does not exist: give a trace bundle, a Kineto trace file or a folder of them")
    manifest = None
    skipped: list[Path] = []
    logs: list[Path] = []
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
            files, skipped = find_trace_files(path)
            logs = nccl_tests_logs(path)
            if not files:
                extra = f" (skipped {len(skipped)} .json files that are not traces)" if skipped else ""
                if logs:
                    extra += (f"; its {len(logs)} nccl-tests log(s) are read one at a time here (trace info "
                              f"{str(logs[0])!r}), or all together by calibrate (calibrate {str(path)!r})")
                raise UserError(f"{str(path)!r} holds no .json or .json.gz trace files and no {MANIFEST_NAME}{extra}")
    else:
        files = [path]
    root = path if path.is_dir() else path.parent
    skip_line = None
    if skipped:
        names = ", ".join(str(p.relative_to(root)) for p in skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        skip_line = f"skipped {len(skipped)} file(s) that are not Kineto traces: {names}"
    if path.is_dir() and manifest is None and logs:
        names = ", ".join(str(p.relative_to(root)) for p in logs[:5]) + (f" and {len(logs) - 5} more" if len(logs) > 5 else "")
        skip_line = ((skip_line + "; ") if skip_line else "") + (
            f"not read with the traces: {len(logs)} nccl-tests log(s) ({names}); calibrate reads them with the traces "
            "when given this folder, trace info one log at a time")

    traces: list[KinetoTrace] = []
    ranks_given = []
    for i, f in enumerate(files):
        rank = None
        if manifest is not None:
            m = _BUNDLE_TRACE_RE.match(f.name)
            rank = int(m.group(1)) if m else i
        ranks_given.append(rank)
    for f, tr in zip(files, _import_all(files, ranks_given)):
        if tr.rank is None or tr.world_size is None:
            prank, pworld = rank_from_path(f, root)
            if tr.rank is None:
                if prank is None and len(files) > 1:
                    raise UserError(
                        f"cannot tell the rank of {str(f)!r}: it has no distributedInfo and its path names no rank "
                        "(put each rank's trace in rank_<k>/ or name it ..rank<k>..)")
                tr.rank = prank if prank is not None else 0
                tr.ops["rank"] = tr.rank
            if tr.world_size is None and pworld is not None:
                tr.world_size = pworld
        traces.append(tr)
    seen: dict[int, Path] = {}
    for tr in traces:
        if tr.rank in seen:
            raise UserError(
                f"{str(tr.path)!r} and {str(seen[tr.rank])!r} both hold rank {tr.rank}: "
                "a folder must hold one trace per rank of one job (several steps of a rank? keep one file per rank, or point at one step's folder)"
            )
        seen[tr.rank] = tr.path
    traces.sort(key=lambda t: t.rank)
    if len(traces) > 1:
        ranks = [t.rank for t in traces]
        gaps = sorted(set(range(ranks[0], ranks[-1] + 1)) - set(ranks))
        if gaps:
            shown = ", ".join(map(str, gaps[:8])) + (" ..." if len(gaps) > 8 else "")
            raise UserError(
                f"{str(path)!r} holds ranks {ranks[0]}..{ranks[-1]} but not rank(s) {shown}: "
                "copy every rank's trace of the step, or give the ranks you have as separate folders")
        worlds_seen = {t.world_size for t in traces if t.world_size}
        if len(worlds_seen) > 1:
            raise UserError(f"{str(path)!r} mixes traces of world sizes {sorted(worlds_seen)}: give the traces of one job")
        if worlds_seen and ranks[-1] >= max(worlds_seen):
            raise UserError(f"{str(path)!r} holds rank {ranks[-1]} but its traces say world size {max(worlds_seen)}: "
                            "give the traces of one job")

    ops = concat_optables([t.ops for t in traces])
    if len(ops):
        origin = int(ops["start_abs_ns"].min())
        ops["start_us"] = (ops["start_abs_ns"] - origin) / 1000.0
        ops = ops.sort_values(["start_abs_ns", "rank", "stream"], kind="stable").reset_index(drop=True)
        # Transfer vs waiting per collective call; groups from the calls' own process-group
        # records, each rank's distributedInfo.pg_config, else the layout (mesh) given.
        pg_by_rank = {t.rank: pg_ranks_from_config([t.distributed_info]) for t in traces}
        world = manifest.world_size if manifest else max((t.world_size for t in traces if t.world_size), default=None)
        if mesh is not None and world and mesh.world_size != world:
            raise UserError(f"the scenario's layout has {mesh.world_size} ranks but the traces in {str(path)!r} come from a "
                            f"job of {world}: give the --scenario that job ran")
        annotate_transfers(ops, pg_by_rank, mesh if mesh is not None else layout_of_manifest(manifest))
    warn = ([skip_line] if skip_line else []) + [w for t in traces for w in t.warnings]
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
