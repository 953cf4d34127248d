"""nccl-tests stdout importer -> the collective table (FORMATS.md §5).

The same table is what the capture harness's `collectives` sweep writes as collectives.parquet,
so COLLECTIVE_TABLE_COLUMNS and busbw_factor are the shared definition of both.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from simulator.errors import UserError
from simulator.trace.kineto_fields import canonical_dtype, normalise_collective

# One row per (collective, size, in_place). size_bytes follows nccl-tests: max(send, recv) bytes
# of one rank's call; time_us is the per-iteration time; algbw = size / time; busbw = algbw x
# busbw_factor(collective, nranks).
COLLECTIVE_TABLE_COLUMNS: dict[str, str] = {
    "collective": "string",
    "size_bytes": "int64",
    "count": "int64",
    "dtype": "string",
    "redop": "string",
    "in_place": "bool",
    "time_us": "float64",
    "algbw_GBps": "float64",
    "busbw_GBps": "float64",
    "nranks": "Int64",
}


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor (src/*.cu *GetBw, doc/PERFORMANCE.md) for n ranks."""
    coll = normalise_collective(collective) or collective
    if n < 1:
        raise UserError(f"nranks {n} must be >= 1")
    if coll == "all_reduce":
        return 2.0 * (n - 1) / n
    if coll in ("reduce_scatter", "all_gather", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    if coll in ("broadcast", "reduce", "send", "recv", "send_recv", "hypercube"):
        return 1.0
    raise UserError(f"no bus-bandwidth factor for collective {collective!r}: use one of all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, reduce, send_recv, gather, scatter")


@dataclass
class NcclTestsResult:
    table: pd.DataFrame
    nranks: int | None
    devices: list[str] = field(default_factory=list)   # GPU name of each rank, by rank
    hosts: list[str] = field(default_factory=list)     # distinct hosts in rank order
    version: str | None = None
    avg_busbw_GBps: float | None = None                # the log's own figure; a mean, not a peak
    warnings: list[str] = field(default_factory=list)


_PREFIX = re.compile(r"^\s*(?:(\d+):\s?|\[\d+,(\d+)\]<std(?:out|err)>:\s?)")
# A launcher line (mpirun -np P / srun -n P / --ntasks P ... *_perf ... -g G) and an explicit
# "nranks N" say the world size outright.
_NP = re.compile(r"(?:^|\s)(?:-np|-n|--np|--ntasks|--nproc_per_node)[\s=]+(\d+)")
_G = re.compile(r"_perf\S*\s.*?(?:^|\s)-g[\s=]*(\d+)")
_NRANKS = re.compile(r"\bnranks[\s=:]+(\d+)", re.I)
_THREADS = re.compile(r"#\s*nThread\s+(\d+)\s+nGpus\s+(\d+)")
_START = re.compile(r"#\s*Collective test starting:\s*(\S+)")
_VERSION = re.compile(r"#\s*nccl-tests version (\S+)")
_RANK = re.compile(r"#\s+Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+\s+\[[^\]]*\]\s+(.*?)\s*$")
_AVG = re.compile(r"#\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+)")
_PROG = re.compile(r"(all_reduce|all_gather|reduce_scatter|alltoall|sendrecv|broadcast|reduce|gather|scatter|hypercube)_perf")
_TABLE_HEADER = re.compile(r"#\s*size\s+count\s+type\b.*\balgbw\s+busbw\b")
_NUM = re.compile(r"^[0-9.]+(?:[eE][+-]?\d+)?$")

# Programs whose name is not a collective name.
_PROG_COLLECTIVE = {"alltoall": "all_to_all", "sendrecv": "send_recv", "hypercube": "hypercube"}


def _prog_collective(prog: str) -> str | None:
    base = prog.removesuffix("_perf").removesuffix("_mpi")
    return _PROG_COLLECTIVE.get(base.replace("_", "")) or normalise_collective(base)


def check_collective_name(collective: str | None) -> str | None:
    """The collective a --collective flag names (nccl-tests' names work too), or one UserError line;
    None stays None. CLIs call it up front, so a typo is said even when no log needs it."""
    if collective is None:
        return None
    coll = _prog_collective(collective)
    if coll is None:
        raise UserError(f"unknown collective {collective!r}: use all_reduce, all_gather, reduce_scatter, alltoall, broadcast, reduce, sendrecv, gather, scatter or hypercube")
    return coll


NCCL_TESTS_SUFFIXES = (".txt", ".log", ".out")


def looks_like_nccl_tests(path: Path) -> bool:
    """A text log whose first 64 KiB carry nccl-tests' header (nThread / nGpus, or its table's
    column line: size count type ... algbw busbw): what a folder's other files are not."""
    if path.suffix not in NCCL_TESTS_SUFFIXES:
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(65536).decode("utf-8", "replace")
    except OSError:
        return False
    return bool(_THREADS.search(head) or _TABLE_HEADER.search(head))


def import_nccl_tests(path: str | Path, collective: str | None = None, nranks: int | None = None) -> NcclTestsResult:
    """Parse an nccl-tests log. The collective comes from the log's 'Collective test starting'
    line, else from a *_perf file name, else from the argument."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{str(path)!r} does not exist: give an nccl-tests output file")
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UserError(f"{str(path)!r} cannot be read ({exc.strerror})") from None
    coll = check_collective_name(collective)
    if coll is None:
        m = _PROG.search(path.name)
        coll = _prog_collective(m.group(0)) if m else None
    result = NcclTestsResult(table=pd.DataFrame(), nranks=nranks)
    rows: list[dict] = []
    rank_lines: dict[int, tuple[str, str]] = {}
    has_root: bool | None = None
    bad_rows = 0
    first_bad = ""
    procs_seen: set[int] = set()
    per_proc = None
    launched: int | None = None
    said: int | None = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        pm = _PREFIX.match(raw)
        if pm:
            procs_seen.add(int(pm.group(1) or pm.group(2)))
        line = _PREFIX.sub("", raw, count=1).rstrip()
        if not line.strip():
            continue
        if "_perf" in line and (mg := _G.search(line)):
            mp = _NP.search(line)
            launched = int(mg.group(1)) * (int(mp.group(1)) if mp else 1)
        if m := _NRANKS.search(line):
            said = int(m.group(1))
        if line.lstrip().startswith("#"):
            if m := _THREADS.search(line):
                per_proc = int(m.group(1)) * int(m.group(2))
            if m := _START.search(line):
                coll = _prog_collective(m.group(1)) or coll
            elif m := _VERSION.search(line):
                result.version = m.group(1)
            elif m := _RANK.search(line):
                rank_lines[int(m.group(1))] = (m.group(2), m.group(3))
            elif m := _AVG.search(line):
                result.avg_busbw_GBps = float(m.group(1))
            elif re.search(r"\bsize\b.*\bcount\b.*\btype\b", line):
                has_root = re.search(r"\broot\b", line) is not None
            continue
        tok = line.split()
        if not tok or not tok[0].isdigit():
            continue
        parsed = _parse_row(tok, has_root)
        if parsed is None:
            bad_rows += 1
            first_bad = first_bad or f"line {lineno}: {_row_problem(tok)}"
            continue
        size, count, dtype, redop, halves = parsed
        why = _implausible(size, halves)
        if why:
            # A row of the right shape with numbers no run measures (a corrupt or edited log).
            bad_rows += 1
            first_bad = first_bad or f"line {lineno}: {why}"
            continue
        for in_place, (time_us, algbw, busbw) in zip((False, True), halves):
            rows.append({
                "collective": coll, "size_bytes": size, "count": count, "dtype": dtype, "redop": redop,
                "in_place": in_place, "time_us": time_us, "algbw_GBps": algbw, "busbw_GBps": busbw,
            })
    if not rows:
        if first_bad:
            raise UserError(f"{str(path)!r} has no usable nccl-tests result rows ({first_bad}): fix or re-run the log")
        raise UserError(f"{str(path)!r} has no nccl-tests result rows: expected lines 'size count type redop [root] time algbw busbw ...'")
    if bad_rows:
        result.warnings.append(f"{path.name}: skipped {bad_rows} lines that look like rows but do not parse"
                               + (f" ({first_bad})" if first_bad else ""))
    if coll is None:
        raise UserError(f"{str(path)!r}: the log does not say which collective it measured: pass --collective NAME (e.g. all_reduce)")
    if rank_lines:
        result.devices = [rank_lines[r][1] for r in sorted(rank_lines)]
        hosts: list[str] = []
        for r in sorted(rank_lines):
            if rank_lines[r][0] not in hosts:
                hosts.append(rank_lines[r][0])
        result.hosts = hosts
    df = pd.DataFrame(rows)
    _check_algbw(df, path.name, result.warnings)
    if result.nranks is None:
        result.nranks = _world_size(df, coll, rank_lines, per_proc, procs_seen, path.name, result.warnings,
                                    said if said is not None else launched)
    df["nranks"] = result.nranks if result.nranks is not None else pd.NA
    result.table = df.astype(COLLECTIVE_TABLE_COLUMNS)[list(COLLECTIVE_TABLE_COLUMNS)]
    return result


def _check_algbw(df: pd.DataFrame, name: str, warned: list[str]) -> None:
    """nccl-tests prints algbw = size / time (GB/s, two decimals). A log whose algbw column
    disagrees with its own sizes and times on most rows was edited on one side (times x2 with the
    bandwidths kept was fitted without a word); the times are what the fit uses, say so."""
    sized = df[df["algbw_GBps"] >= 1.0]  # (below 1 GB/s the two decimals are too coarse to compare)
    if len(sized) < 4:
        return
    implied = sized["size_bytes"] / (sized["time_us"] * 1e3)
    ratio = sized["algbw_GBps"] / implied
    off = (ratio - 1.0).abs() > 0.05
    if off.sum() > len(sized) / 2:
        warned.append(f"{name}: its algbw column is {float(ratio[off].median()):.2f}x size / time on {int(off.sum())} of "
                      f"{len(sized)} rows, where nccl-tests prints them equal: the times or the bandwidths were edited; "
                      "the times are used")


MAX_ROW_BYTES = 1 << 50  # 1 PiB: beyond any message a collective test times
MAX_ROW_TIME_US = 1e12  # ~11.6 days for one call


def _implausible(size: int, halves) -> str:
    """Why a parsed row's numbers are no measurement ('' when they are)."""
    if not 0 <= size <= MAX_ROW_BYTES:
        return f"size {size} is outside 0..{MAX_ROW_BYTES}"
    for time_us, _algbw, _busbw in halves:
        if not (math.isfinite(time_us) and 0 < time_us <= MAX_ROW_TIME_US):
            return f"time {time_us!r} us is not a positive time a call takes"
    return ""


def _row_problem(tok: list[str]) -> str:
    """Why a line that starts like a result row is not one (``_parse_row`` returned None)."""
    n = len(tok)
    if n not in (11, 12, 13):
        return (f"{n} fields where a result row has 11 to 13: size count type redop [root], then time algbw busbw "
                "#wrong out-of-place and again in-place; a log without the in-place columns is not read")
    start = {13: 5, 12: 4, 11: 3}[n]
    for t in [tok[1], *tok[start:start + 3], *tok[start + 4:start + 7]]:
        if _num(t) is None and not t.isdigit():
            return f"{t!r} is not a non-negative number"
    return "a field is not a number"


def _num(s: str) -> float | None:
    return float(s) if _NUM.match(s) else None


def _parse_row(tok: list[str], has_root: bool | None):
    """(size, count, dtype, redop, [(time, algbw, busbw) out-of-place, in-place]) or None.

    New layout: size count type redop root | time algbw busbw #wrong | x2 (13 tokens).
    Old layout: size count type redop | time algbw busbw error | x2 (12), redop empty for
    alltoall (11).
    """
    n = len(tok)
    if n == 13 or (has_root and n == 13):
        head, rest = tok[:5], tok[5:]
    elif n == 12:
        head, rest = tok[:4], tok[4:]
    elif n == 11:
        head, rest = tok[:3] + ["none"], tok[3:]
    else:
        return None
    try:
        size, count = int(head[0]), int(head[1])
    except ValueError:
        return None
    halves = []
    for k in (0, 4):
        vals = [_num(x) for x in rest[k:k + 3]]
        if any(v is None for v in vals):
            return None
        halves.append(tuple(vals))
    dtype = canonical_dtype(head[2]) or head[2]
    return size, count, dtype, head[3], halves


def _world_size(df: pd.DataFrame, coll: str, rank_lines: dict, per_proc: int | None, procs_seen: set[int],
                name: str, warn: list[str], stated: int | None = None) -> int | None:
    """The number of ranks that ran the test.

    busbw/algbw = factor(n) is exact where the figures have enough digits, and wins. Otherwise the
    largest of: the '# Rank' lines (their highest index + 1: a log may list only some ranks),
    nThread x nGpus per process x the processes whose launcher prefix ([1,K]<stdout>, K:) shows.
    """
    from_ratio = _infer_nranks(df, coll)
    if stated:
        # "nranks N" or the launcher's -np P x -g G
        if from_ratio is not None and from_ratio != stated:
            warn.append(f"{name}: the log states {stated} ranks but busbw/algbw says {from_ratio}: using {from_ratio}")
            return from_ratio
        return stated
    lower = 0
    if rank_lines:
        lower = max(len(rank_lines), max(rank_lines) + 1)
    if per_proc:
        lower = max(lower, per_proc * max(1, len(procs_seen)))
    if from_ratio is not None:
        if lower and from_ratio != lower:
            warn.append(f"{name}: the header suggests {lower} ranks ('# Rank' lines, nThread x nGpus, launcher prefixes) but "
                        f"busbw/algbw says {from_ratio}: using {from_ratio}")
        return from_ratio
    if lower and (rank_lines or procs_seen):
        if not rank_lines and len(procs_seen) <= 1:
            warn.append(f"{name}: only nThread x nGpus = {per_proc} per process is known and busbw/algbw cannot tell the "
                        "process count: assuming one process")
        return lower
    if lower:
        return lower
    warn.append(f"{name}: cannot tell how many ranks ran it: no '# Rank' lines, no nThread/nGpus header, and busbw/algbw "
                "does not fix it; give the whole log")
    return None


def _infer_nranks(df: pd.DataFrame, coll: str) -> int | None:
    """Solve busbw/algbw = factor(n) for n on rows large enough for 2-decimal figures to be exact."""
    big = df[df["algbw_GBps"] >= 10]
    if big.empty:
        return None
    ratio = float((big["busbw_GBps"] / big["algbw_GBps"]).median())
    if coll == "all_reduce":
        n = 2.0 / (2.0 - ratio) if ratio < 2 else None
    elif coll in ("reduce_scatter", "all_gather", "all_to_all", "gather", "scatter"):
        n = 1.0 / (1.0 - ratio) if ratio < 1 else None
    else:
        return None
    if n is None or n < 1:
        return None
    k = round(n)
    return k if abs(busbw_factor(coll, k) - ratio) < 0.01 else None
