"""Rank launcher, profiler wrapper and atomic bundle writer for ``clustersim capture``.

Ranks come from one of two places: ``launch`` spawns N local processes itself (MASTER_ADDR
127.0.0.1 and a free port), or, when RANK / WORLD_SIZE / LOCAL_RANK are set, this process is one
rank started by torchrun (so multi-node works the same way).

Every rank runs the workload under torch.profiler and writes its Kineto trace; rank 0 gathers
the traces of ranks on other hosts, writes the tables and, last, the manifest into a temporary
sibling of --out, then renames that folder into place. A failed or interrupted capture removes
the temporary folder, so no half bundle is ever visible under --out.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import json
import os
import platform
import shutil
import signal
import sys
import socket
import tempfile
import time
import traceback
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import simulator
from simulator.errors import RunFailed, UserError
from simulator.trace.bundle import MANIFEST_NAME, Manifest, StepTiming

_ERROR_PREFIX = ".error-rank"
# A spawned rank's stderr (torch's profiler prints USDT probe lines and warnings straight to
# fd 2) goes to this log inside the bundle, not to the user's terminal.
STDERR_LOG = "rank{rank}.stderr.log"


@dataclass
class CaptureConfig:
    workload: str
    out_dir: str
    backend: str
    steps: int
    warmup_steps: int
    args: dict[str, Any]
    force: bool = False
    timeout_s: float = 600.0
    threads_per_rank: int = 1
    # Chosen by the launcher (spawn) or by rank 0 (torchrun); holds the bundle until the rename.
    tmp_dir: str | None = None
    # The process that spawned the ranks (None under torchrun). A rank whose launcher is gone must
    # not rename a bundle into place: the user saw the command die.
    launcher_pid: int | None = None


@dataclass
class RankContext:
    cfg: CaptureConfig
    rank: int
    world_size: int
    local_rank: int
    device: "torch.device"
    trace_path: Path  # where this rank's uncompressed Kineto JSON goes

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def profiler(self, schedule: Any = None) -> "torch.profiler.profile":
        """torch.profiler with record_shapes; the Kineto trace goes to trace_path when ready."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.is_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        kwargs: dict[str, Any] = {
            "activities": activities,
            "record_shapes": True,
            # called when the profiler stops (or when a schedule's active steps end)
            "on_trace_ready": lambda prof: prof.export_chrome_trace(str(self.trace_path)),
        }
        if schedule is not None:
            kwargs["schedule"] = schedule
        return torch.profiler.profile(**kwargs)


@dataclass
class WorkloadResult:
    """What a workload hands back; only rank 0's tables and step times are written."""

    tables: dict[str, Any] = field(default_factory=dict)  # name -> pandas.DataFrame
    step_times_s: list[float] = field(default_factory=list)
    scenario: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def _workload(name: str) -> Callable[[RankContext], WorkloadResult]:
    # Only the chosen workload is imported: DTensor and pipelining add seconds to every rank's start.
    import importlib

    return importlib.import_module(f"simulator.capture.{name}").run


def in_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def check_out_dir(out_dir: str | Path, force: bool) -> None:
    """Refuse an --out the capture must not write or replace, before any rank starts: --force
    replaces only a bundle an earlier capture wrote (or an empty folder), never another folder,
    the working folder or one holding it."""
    if not str(out_dir).strip():
        raise UserError("--out is empty: give the folder to write the trace bundle to, e.g. traces/mine")
    out = Path(out_dir)
    parent = out.resolve().parent
    for up in (parent, *parent.parents):
        if up.exists() and not up.is_dir():
            raise UserError(f"--out {str(out)!r}: {str(up)!r} is a file, not a folder: choose another path")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} is a file, not a folder: choose another path")
    if out.exists() and not force:
        what = "a trace bundle" if (out / MANIFEST_NAME).exists() else "a folder"
        raise UserError(f"--out {str(out)!r} already exists ({what}): choose another folder"
                        + (" or pass --force to replace it" if what == "a trace bundle" else ""))
    if out.exists():
        cwd = Path.cwd().resolve()
        if out.resolve() == cwd or out.resolve() in cwd.parents:
            raise UserError(f"--out {str(out)!r} is the working folder or holds it: --force will not replace it; "
                            "choose a new folder, e.g. traces/mine")
        if not (out / MANIFEST_NAME).exists() and any(out.iterdir()):
            raise UserError(f"--out {str(out)!r} is not a trace bundle (no {MANIFEST_NAME}) and not empty: --force "
                            "replaces only a bundle 'clustersim capture' wrote; choose another folder")


def _tmp_sibling(out_dir: str | Path) -> str:
    out = Path(out_dir).resolve()
    return str(out.parent / f".{out.name}.capture-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_captures(out_dir: str | Path) -> list[Path]:
    """Remove temporary bundle folders of captures whose launcher no longer runs (killed with
    SIGKILL, or the machine went down), so no hidden debris outlives them. Returns what was removed."""
    out = Path(out_dir).resolve()
    removed = []
    for tmp in out.parent.glob(f".{out.name}.capture-*"):
        pid_text = tmp.name.rsplit(".capture-", 1)[1].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)) and tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def _die_with_parent() -> None:
    """Linux: have the kernel send SIGTERM to this rank when its launcher dies, even by SIGKILL,
    so no rank outlives the command (prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1  # linux/prctl.h
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(cfg: CaptureConfig, nproc: int) -> Path:
    """Run the capture on nproc local ranks (or as one torchrun rank) and return the bundle path."""
    check_out_dir(cfg.out_dir, cfg.force)
    try:
        Path(cfg.out_dir).resolve().parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {str(cfg.out_dir)!r}: cannot create its folder ({exc.strerror}): choose a writable path") from None
    if in_torchrun():
        run_rank(cfg, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
        return Path(cfg.out_dir)

    import torch.multiprocessing as mp

    remove_stale_captures(cfg.out_dir)
    cfg.tmp_dir = _tmp_sibling(cfg.out_dir)
    cfg.launcher_pid = os.getpid()
    try:
        Path(cfg.tmp_dir).mkdir(parents=True)
    except OSError as exc:
        raise UserError(f"--out {str(cfg.out_dir)!r}: cannot write in {str(Path(cfg.tmp_dir).parent)!r} "
                        f"({exc.strerror}): choose a writable folder") from None
    # SIGTERM (kill, a job scheduler) ends the launcher like Ctrl-C: the ranks stop and the
    # temporary folder is removed below.
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    port = _free_port()
    # Children read these when they import torch, before run_rank could set them.
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    for k in saved:
        os.environ[k] = str(cfg.threads_per_rank)
    try:
        mp.spawn(_spawned_rank, args=(cfg, nproc, port), nprocs=nproc, join=True)
    except BaseException as exc:
        err = _first_rank_error(cfg.tmp_dir)
        log_tail = _log_tail(Path(cfg.tmp_dir) / STDERR_LOG.format(rank=err["rank"] if err else 0))
        shutil.rmtree(cfg.tmp_dir, ignore_errors=True)
        if err is not None and err.get("user_error"):
            raise UserError(err["message"]) from None
        if err is not None and not isinstance(exc, KeyboardInterrupt):
            raise RunFailed(f"capture failed on rank {err['rank']}: {_last_line(err['traceback'])}\n"
                            f"{err['traceback']}{log_tail}") from None
        if log_tail and not isinstance(exc, KeyboardInterrupt):
            raise RunFailed(f"capture failed ({type(exc).__name__}: {exc}){log_tail}") from None
        raise
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if cfg.tmp_dir and Path(cfg.tmp_dir).exists() and Path(cfg.out_dir).exists():
            # Success renames tmp_dir away; anything left is debris of a failure.
            shutil.rmtree(cfg.tmp_dir, ignore_errors=True)
    return Path(cfg.out_dir)


def _last_line(text: str) -> str:
    """The exception line of a traceback (its last non-empty line)."""
    lines = [l for l in str(text).splitlines() if l.strip()]
    return lines[-1].strip() if lines else "see below"


def _first_rank_error(tmp_dir: str) -> dict[str, Any] | None:
    errors = []
    for p in sorted(Path(tmp_dir).glob(f"{_ERROR_PREFIX}*.json")):
        try:
            errors.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    if not errors:
        return None
    # The first failure is the cause; the other ranks typically die of the broken connection after it.
    errors.sort(key=lambda e: (not e.get("user_error"), e.get("time", 0.0), e.get("rank", 0)))
    return errors[0]


def _log_tail(path: Path, lines: int = 30) -> str:
    """The end of a rank's stderr log, for the message of a failed capture."""
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return ""
    return f"\nlast lines of rank stderr ({path.name}):\n" + "\n".join(text.splitlines()[-lines:]) if text else ""


def _redirect_stderr(path: Path) -> None:
    """Send this process's fd 2 (Python and C++ alike) to ``path``."""
    import sys

    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def _spawned_rank(local_rank: int, cfg: CaptureConfig, world_size: int, port: int) -> None:
    _die_with_parent()
    if cfg.launcher_pid is not None and os.getppid() != cfg.launcher_pid:
        return  # the launcher died before this rank started
    if cfg.tmp_dir is not None:
        _redirect_stderr(Path(cfg.tmp_dir) / STDERR_LOG.format(rank=local_rank))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(local_rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(local_rank)
    run_rank(cfg, local_rank, world_size, local_rank)


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    # torchrun stops the surviving ranks with SIGTERM; turning it into SystemExit lets the
    # finally blocks remove the temporary bundle folder.
    raise SystemExit(128 + signum)


def run_rank(cfg: CaptureConfig, rank: int, world_size: int, local_rank: int) -> None:
    torch.set_num_threads(max(1, cfg.threads_per_rank))
    if cfg.backend == "nccl":
        if not torch.cuda.is_available():
            raise UserError("--backend nccl needs CUDA GPUs, and none is visible: use --backend gloo on CPU")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    owns_tmp = cfg.tmp_dir is None  # torchrun: rank 0 creates and cleans the temporary folder
    try:
        signal.signal(signal.SIGTERM, _raise_on_sigterm)
    except ValueError:  # not the main thread
        pass
    dist.init_process_group(
        cfg.backend,
        rank=rank,
        world_size=world_size,
        timeout=_dt.timedelta(seconds=cfg.timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    local_trace = Path(tempfile.mkdtemp(prefix=f"clustersim-rank{rank}-")) / "trace.json"
    try:
        if owns_tmp:
            box = [_tmp_sibling(cfg.out_dir) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            cfg.tmp_dir = box[0]
            if rank == 0:
                Path(cfg.tmp_dir).mkdir(parents=True)
        ctx = RankContext(cfg, rank, world_size, local_rank, device, local_trace)
        fn = _workload(cfg.workload)
        result = fn(ctx)
        if os.environ.get("CLUSTERSIM_CAPTURE_FAIL_RANK") == str(rank):
            # Fault injection for tests: a rank dying after its work must still leave no bundle.
            raise RuntimeError(f"injected failure on rank {rank} (CLUSTERSIM_CAPTURE_FAIL_RANK)")
        _finish_bundle(ctx, result)
    except BaseException as exc:
        if cfg.tmp_dir is not None and Path(cfg.tmp_dir).exists():
            _write_error(cfg.tmp_dir, rank, exc)
            if owns_tmp and rank == 0:
                shutil.rmtree(cfg.tmp_dir, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(local_trace.parent, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


def _write_error(tmp_dir: str, rank: int, exc: BaseException) -> None:
    info = {
        "rank": rank,
        "user_error": isinstance(exc, UserError),
        "time": time.time(),
        "message": str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        "traceback": "".join(traceback.format_exception(exc)),
    }
    try:
        (Path(tmp_dir) / f"{_ERROR_PREFIX}{rank}.json").write_text(json.dumps(info))
    except OSError:
        pass


def _device_name(device: "torch.device") -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU " + (platform.processor() or platform.machine())


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:
        return None
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def _finish_bundle(ctx: RankContext, result: WorkloadResult) -> None:
    cfg = ctx.cfg
    if not ctx.trace_path.exists() or ctx.trace_path.stat().st_size == 0:
        raise RuntimeError(f"rank {ctx.rank}: the profiler wrote no trace to {ctx.trace_path}")
    host = socket.gethostname()
    info = {"rank": ctx.rank, "host": host, "device": _device_name(ctx.device)}
    infos: list[dict[str, Any]] = [None] * ctx.world_size  # type: ignore[list-item]
    dist.all_gather_object(infos, info)
    name = f"rank{ctx.rank}.trace.json.gz"
    same_fs = host == infos[0]["host"]
    payload = None
    if same_fs:
        _gzip_file(ctx.trace_path, Path(cfg.tmp_dir) / name)
    else:
        # Ranks on other hosts may not share the filesystem: ship the compressed trace to rank 0.
        payload = gzip.compress(ctx.trace_path.read_bytes(), compresslevel=6)
    shipped = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object((name, payload), shipped, dst=0)
    dist.barrier()
    if ctx.rank != 0:
        return

    tmp = Path(cfg.tmp_dir)
    for item in shipped or []:
        if item is not None and item[1] is not None:
            (tmp / item[0]).write_bytes(item[1])
    tables = []
    for tname, df in sorted(result.tables.items()):
        fname = f"{tname}.parquet"
        df.to_parquet(tmp / fname, index=False)
        tables.append(fname)
    devices = [i["device"] for i in infos]
    hosts = list(dict.fromkeys(i["host"] for i in infos))
    manifest = Manifest(
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        tool_version=simulator.__version__,
        torch_version=torch.__version__,
        backend=cfg.backend,
        nccl_version=_nccl_version() if cfg.backend == "nccl" else None,
        devices=devices,
        device_counts=dict(Counter(devices)),
        world_size=ctx.world_size,
        hosts=hosts,
        workload=cfg.workload,
        workload_args={
            **cfg.args,
            "steps": cfg.steps,
            "warmup_steps": cfg.warmup_steps,
            "threads_per_rank": cfg.threads_per_rank,
        },
        scenario=result.scenario,
        step_times=[StepTiming(step=i, wall_s=t) for i, t in enumerate(result.step_times_s)],
        trace_files=[f"rank{r}.trace.json.gz" for r in range(ctx.world_size)],
        tables=tables,
        notes=result.notes,
    )
    missing = [f for f in manifest.trace_files if not (tmp / f).exists()]
    if missing:
        raise RuntimeError(f"traces missing from the bundle: {missing}")
    for p in tmp.glob(f"{_ERROR_PREFIX}*.json"):
        p.unlink()
    # The manifest is written last: a folder without one is never a bundle.
    (tmp / MANIFEST_NAME).write_text(manifest.model_dump_json(indent=2) + "\n")
    if cfg.launcher_pid is not None and os.getppid() != cfg.launcher_pid:
        # The command was killed while the ranks finished: it failed as far as the user knows,
        # so no bundle may appear afterwards.
        shutil.rmtree(tmp, ignore_errors=True)
        return
    _rename_into_place(tmp, Path(cfg.out_dir), cfg.force)


def _gzip_file(src: Path, dst: Path) -> None:
    with open(src, "rb") as fi, gzip.open(dst, "wb", compresslevel=6) as fo:
        shutil.copyfileobj(fi, fo, length=1 << 20)


def _rename_into_place(tmp: Path, out: Path, force: bool) -> None:
    out = out.resolve()
    if out.exists():
        if not force:
            raise UserError(f"--out {str(out)!r} appeared during the capture: choose another folder or pass --force")
        trash = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, trash)
        os.replace(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, out)


def timed_steps(ctx: RankContext, n: int, step_fn: Callable[[int], None], prof: Any = None) -> list[float]:
    """Run step_fn n times, each between barriers; return the wall time of each step in seconds."""
    times = []
    for i in range(n):
        ctx.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        step_fn(i)
        ctx.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        if prof is not None:
            prof.step()
    return times
