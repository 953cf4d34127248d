"""Running a sweep: prune and estimate every point, then simulate the best on a process pool or
a Dask cluster, storing each result as it arrives.

Pass 1 (driver process, no event loop): every point of the space is built as a Scenario;
points that fail the scenario's own checks, the schedule's constraints, the GPU-count or the
memory constraints are pruned with their reason counted; the rest are estimated
(``estimate.Estimator``) and ranked by the objective.

Pass 2: the top-k candidates (all with ``exhaustive``) not already in the store are cut into
coarse tasks (a batch of scenarios each) and simulated by workers; results stream back as
tasks finish and the driver appends each to the store at once. Workers return plain dicts and
never write the store, so a killed worker can only lose its unfinished batch, which a re-run
(or Dask's own retry) redoes; ``INSERT OR IGNORE`` by hash keeps re-runs from duplicating.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sqlite3
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from simulator.errors import UserError
from simulator.gcpause import cyclic_gc_paused
from simulator.scenario import Scenario, build_scenario
from simulator.sweep.estimate import Estimate, Estimator, rank_agreement
from simulator.sweep.space import SHORT, SweepSpec, expand
from simulator.sweep.store import RESULTS_VERSION  # noqa: F401 -- its home was here
from simulator.sweep.store import (CLAIM_HEARTBEAT_S, CLAIM_POLL_S, REUSE_BASIS, ResultKey, ResultKeyer, ResultStore,
                                   changed_inputs)
from simulator.version import package_version
_FIX_VERBS = {"choose", "use", "set", "add", "change", "remove", "raise", "leave", "put", "adjust", "check", "omit",
              "fix", "give", "pass", "shrink", "lower", "increase", "reduce", "quote", "write"}


# ---------------------------------------------------------------------------------------------
# Points
# ---------------------------------------------------------------------------------------------

def scenario_hash(sc: Scenario | dict[str, Any], mode: str) -> str:
    """The store's key of one scenario: the scenario (name left out) and the contents of the files it
    names (see ``simulator.sweep.store.ResultKeyer``; a sweep keeps one keyer so files are read once)."""
    d = sc.model_dump(mode="json") if isinstance(sc, Scenario) else json.loads(json.dumps(sc))
    return ResultKeyer(mode).key(_absolute_paths(d)).hash


def _drop_fix(message: str) -> str:
    """A UserError message without its fix (the trailing ": use ..." / "; set ..." parts)."""
    parts = message.split(": ")
    while len(parts) > 1 and parts[-1].split(" ", 1)[0].lower().strip("(") in _FIX_VERBS:
        parts.pop()
    parts = ": ".join(parts).split("; ")
    while len(parts) > 1 and parts[-1].split(" ", 1)[0].lower() in _FIX_VERBS:
        parts.pop()
    msg = "; ".join(parts)
    return msg if len(msg) <= 120 else msg[:117] + "..."


def prune_reason(message: str) -> str:
    """A UserError message as a countable reason: numbers masked, the fix dropped."""
    # Numbers that are values ("tp=16", "of 8 GPUs") are masked; names like 1f1b are kept.
    return _drop_fix(re.sub(r"(?<![A-Za-z0-9_.])\d+(\.\d+)?(e[+-]?\d+)?(?![A-Za-z0-9_])", "N", message))


def prune_example(message: str) -> str:
    """The same message with its numbers, the fix dropped: what a reason's group is shown as (its
    masked form reads "tp=N does not divide num_attention_heads=N")."""
    return _drop_fix(message)


def pruned_summary(ev: "Evaluation", groups: int | None = None) -> list[tuple[str, int]]:
    """(an example of the reason, points) per prune reason, most points first."""
    return [(ev.pruned_examples.get(r, r), n) for r, n in ev.pruned.most_common(groups)]


def _absolute_paths(d: dict[str, Any]) -> dict[str, Any]:
    """Paths in a scenario made absolute, so remote workers and later runs read the same files."""
    if not isinstance(d, dict):
        return d  # the scenario's own validation names what is wrong
    cl = d.get("cluster", {})
    for holder, key in ((cl, "gpu"), (cl, "topology"), (d, "schedule_file")):
        v = holder.get(key) if isinstance(holder, dict) else None
        if not isinstance(v, str) or "\0" in v or not ("/" in v or v.endswith((".json", ".yaml", ".yml", ".csv"))):
            continue
        try:
            if Path(v).exists():
                holder[key] = str(Path(v).resolve())
        except (OSError, ValueError):
            pass  # a name too long or otherwise unusable: the scenario's loader says so
    return d


@dataclass
class Candidate:
    hash: str
    point: dict[str, Any]  # short axis name -> value
    scenario: dict[str, Any]  # the full scenario (json-able)
    estimate: Estimate
    score: float  # objective of the estimate
    key: ResultKey | None = None  # how the store knows this point (hash == key.hash)


@dataclass
class Evaluation:
    total: int
    candidates: list[Candidate]  # feasible points, best estimate first
    pruned: Counter
    estimate_s: float
    stats: dict[str, int] = field(default_factory=dict)
    # One real message per prune reason (the reason's numbers are masked to group the points).
    pruned_examples: dict[str, str] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.total / self.estimate_s if self.estimate_s > 0 else float("inf")


def evaluate_space(
    spec: SweepSpec,
    estimator: Estimator | None = None,
    progress: Callable[[int], None] | None = None,
) -> Evaluation:
    """Pass 1: prune every point (reasons counted) and estimate the rest, best first."""
    est = estimator or Estimator()
    pruned: Counter = Counter()
    examples: dict[str, str] = {}

    def prune(exc: UserError) -> None:
        reason = prune_reason(str(exc))
        pruned[reason] += 1
        examples.setdefault(reason, prune_example(str(exc)))

    cands: list[Candidate] = []
    seen: set[str] = set()
    c = spec.constraints
    t0 = time.perf_counter()
    total = 0
    keyer = ResultKeyer(spec.mode)
    base = _absolute_paths(json.loads(json.dumps(spec.base)))
    # The estimate's caches (reference programs, replays) grow into a large heap of live objects
    # the cyclic collector re-scans for nothing (simulator.gcpause). Measured on the 30,240-point
    # 405B slice: cold 149 -> 130 s, peak RSS 1,210 MiB either way.
    with cyclic_gc_paused():
        for point in expand(spec):
            total += 1
            if progress is not None and total % 256 == 0:
                progress(256)
            try:
                sc = build_scenario(base, point)
            except UserError as exc:
                prune(exc)
                continue
            gpus = sc.cluster.gpus
            if c.max_gpus is not None and gpus > c.max_gpus:
                pruned[f"gpus above max_gpus={c.max_gpus}"] += 1
                continue
            if c.min_gpus is not None and gpus < c.min_gpus:
                pruned[f"gpus below min_gpus={c.min_gpus}"] += 1
                continue
            if sc.schedule in ("zbv", "dualpipev") and sc.parallelism.vpp == 2 and not sc.schedule_file:
                pruned[f"duplicate: {sc.schedule} always holds 2 chunks per rank (vpp=N is vpp=N)".replace("N", "2", 1).replace("N", "1")] += 1
                continue
            d = _absolute_paths(sc.model_dump(mode="json"))
            key = keyer.key(d)
            h = key.hash
            if h in seen:
                pruned["duplicate of an earlier point"] += 1
                continue
            seen.add(h)
            try:
                e = est.estimate(sc)
            except UserError as exc:
                prune(exc)
                continue
            if not e.fits_in_memory:
                pruned["does not fit in memory"] += 1
                continue
            if c.memory_headroom > 0 and e.peak_memory_gib > e.memory_capacity_gib * (1 - c.memory_headroom):
                pruned[f"memory headroom below {c.memory_headroom:g}"] += 1
                continue
            d["name"] = f"{spec.name}-{h[:10]}"
            short = {SHORT.get(k, k): v for k, v in point.items()}
            cands.append(Candidate(h, short, d, e, getattr(e, spec.objective), key))
    if progress is not None:
        progress(total % 256)
    cands.sort(key=lambda x: (-x.score if spec.maximize else x.score, x.hash))
    return Evaluation(total, cands, pruned, time.perf_counter() - t0, dict(est.stats), examples)


# ---------------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------------

def run_batch(items: list[tuple[str, dict[str, Any], dict[str, Any], str]]) -> list[dict[str, Any]]:
    """Simulate a batch of (hash, point, scenario dict, mode); runs on a worker.

    Bad input (a UserError, e.g. a stalled schedule) is a result worth storing; any other
    exception is a bug, returned as status 'crash' so it is reported and not stored.
    """
    from simulator.simulate import simulate

    out = []
    for h, point, scen, mode in items:
        t0 = time.perf_counter()
        rec: dict[str, Any] = {"hash": h, "point": point, "scenario": scen}
        try:
            res = simulate(build_scenario(scen), mode=mode)
            rec.update(status="ok", report=res.report.model_dump(mode="json"))
        except UserError as exc:
            rec.update(status="error", error=str(exc))
        except Exception as exc:  # noqa: BLE001 -- reported to the driver, never stored
            rec.update(status="crash", error=f"{type(exc).__name__}: {exc}")
        rec["wall_s"] = time.perf_counter() - t0
        out.append(rec)
    return out


def _worker_init() -> None:
    """Runs first in every local pool worker: the driver alone decides when the workers stop.

    Ctrl-C reaches the whole process group; a worker that took it as KeyboardInterrupt would report
    it as the task's exception and go on with the next batch, so it ignores SIGINT and the driver
    kills it. If the driver dies, even by SIGKILL, the kernel kills the worker (Linux
    PR_SET_PDEATHSIG): no worker outlives its sweep.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1  # linux/prctl.h
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the driver died before prctl took effect
            os._exit(1)
    except (OSError, AttributeError):
        pass  # not Linux: workers still end when they next read the closed task queue


class LocalExecutor:
    """A process pool on this machine (all cores by default)."""

    def __init__(self, workers: int | None = None):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        self.workers = workers or os.cpu_count() or 1
        # fork, before the driver starts any thread (the progress bar's): a worker then starts in
        # milliseconds with the simulator already imported, and inherits no held lock. (spawn and
        # forkserver would re-run a caller's unguarded __main__.)
        import simulator.simulate  # noqa: F401 -- imported once, inherited by every worker

        ctx = mp.get_context("fork")
        self.pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx, initializer=_worker_init)
        self.futures: list = []
        # Start every worker now (fork launches them all on the first submit).
        try:
            for f in [self.pool.submit(os.getpid) for _ in range(self.workers)]:
                f.result()
        except BaseException:
            self.close(abort=True)
            raise

    def worker_pids(self) -> list[int]:
        return list(getattr(self.pool, "_processes", None) or {})

    def submit(self, fn, batch):
        fut = self.pool.submit(fn, batch)
        self.futures.append(fut)
        return fut

    def wait(self, futures: list, timeout_s: float) -> set:
        """The futures that finished within ``timeout_s`` (maybe none)."""
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures

        return set(wait_futures(futures, timeout=timeout_s, return_when=FIRST_COMPLETED).done)

    @staticmethod
    def result(fut) -> Any:
        from concurrent.futures.process import BrokenProcessPool

        try:
            return fut.result()
        except BrokenProcessPool:
            raise UserError(
                "a worker process died (killed or out of memory): results that finished are stored; rerun the same command to resume"
            ) from None

    def run(self, fn, batches: list) -> Iterator[Any]:
        from concurrent.futures import as_completed

        futs = [self.submit(fn, b) for b in batches]
        for fut in as_completed(futs):
            yield self.result(fut)

    def close(self, abort: bool = False) -> None:
        """Stop the pool. ``abort`` (Ctrl-C, SIGTERM, an error): kill the workers now, mid-batch; what
        finished is stored already and the rest is redone by a re-run."""
        procs = dict(getattr(self.pool, "_processes", None) or {})
        for f in self.futures:
            f.cancel()
        if abort:
            for proc in procs.values():
                try:
                    proc.kill()
                except (OSError, AttributeError, ValueError):
                    pass
        self.pool.shutdown(wait=not abort, cancel_futures=True)
        deadline = time.monotonic() + 5.0
        for proc in procs.values():  # reap them: no zombie and no worker left behind
            try:
                proc.join(max(0.0, deadline - time.monotonic()))
            except (OSError, AssertionError, ValueError):
                pass


class DaskExecutor:
    """An existing Dask distributed cluster (``tcp://host:8786``), or a given Client."""

    def __init__(self, scheduler: Any):
        try:
            from distributed import Client
        except ImportError:
            raise UserError("--executor dask needs dask.distributed: pip install 'clustersim[sweep]'") from None
        if isinstance(scheduler, str) or scheduler is None:
            if not scheduler:
                raise UserError("--executor dask needs --scheduler tcp://HOST:8786 (the address of a running dask scheduler)")
            try:
                self.client = Client(scheduler, timeout="20s")
            except OSError as exc:
                raise UserError(f"cannot reach dask scheduler {scheduler!r} ({exc}): start one or fix --scheduler") from None
            except (ValueError, TypeError) as exc:  # dask's parse of the address ("missing port number")
                raise UserError(f"--scheduler {scheduler!r} is not a dask address ({exc}): give tcp://HOST:PORT, "
                                "e.g. tcp://10.0.0.5:8786") from None
            self._own = True
        else:
            self.client = scheduler
            self._own = False
        self.workers = max(1, sum(self.client.nthreads().values()))
        self.futures: list = []

    def submit(self, fn, batch):
        # pure=False: equal batches are still distinct tasks; retries cover a lost worker.
        fut = self.client.submit(fn, batch, pure=False, retries=2)
        self.futures.append(fut)
        return fut

    def wait(self, futures: list, timeout_s: float) -> set:
        deadline = time.monotonic() + timeout_s
        while True:
            done = {f for f in futures if f.done()}
            if done or time.monotonic() >= deadline:
                return done
            time.sleep(min(0.05, timeout_s))

    @staticmethod
    def result(fut) -> Any:
        return fut.result()

    def run(self, fn, batches: list) -> Iterator[Any]:
        from distributed import as_completed

        futs = [self.submit(fn, b) for b in batches]
        for fut in as_completed(futs):
            yield fut.result()

    def close(self, abort: bool = False) -> None:
        if self.futures:
            self.client.cancel([f for f in self.futures if not f.done()])
        if self._own:
            self.client.close()


def make_executor(kind: str, workers: int | None = None, scheduler: Any = None):
    if kind == "local":
        return LocalExecutor(workers)
    if kind == "dask":
        return DaskExecutor(scheduler)
    raise UserError(f"--executor {kind!r} is unknown: use local or dask")


def make_batches(items: list, workers: int, batch_size: int | None = None) -> list[list]:
    """Coarse tasks: a few per worker, so a slow batch does not leave the others idle."""
    if not items:
        return []
    size = batch_size or max(1, min(32, math.ceil(len(items) / (workers * 4))))
    return [items[i:i + size] for i in range(0, len(items), size)]


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------

class _NoBar:
    def add_task(self, *a: Any, **k: Any) -> int:
        return 0

    def advance(self, *a: Any, **k: Any) -> None:
        pass

    def update(self, *a: Any, **k: Any) -> None:
        pass


@contextmanager
def progress_bar(enabled: bool = True):
    """A rich progress bar with ETA on stderr (stdout stays for results)."""
    if not enabled:
        yield _NoBar()
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    with Progress(TextColumn("{task.description:<11}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("eta"), TimeRemainingColumn(), console=Console(stderr=True), transient=False) as bar:
        yield bar


@dataclass
class SweepOutcome:
    spec: SweepSpec
    evaluation: Evaluation
    simulated: list[dict[str, Any]]  # candidates simulated (now or before): estimate + report
    errors: list[dict[str, Any]]
    agreement: dict[str, Any]
    newly_simulated: int
    reused: int
    simulate_s: float
    store_path: str | None
    crashes: list[dict[str, Any]] = field(default_factory=list)
    # How many chosen points came from the store, on what basis, and why the others' stored rows (if
    # any) were not used: {"reused", "of", "basis", "clustersim", "stale_points", "stale_reasons"}.
    reuse: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> dict[str, Any] | None:
        return self.simulated[0] if self.simulated else None

    def to_json(self, top: int | None = None) -> dict[str, Any]:
        ev = self.evaluation
        rows = self.simulated[: top or self.spec.top_k]
        return {
            "name": self.spec.name,
            "objective": self.spec.objective,
            "maximize": self.spec.maximize,
            "points": ev.total,
            "pruned": dict(ev.pruned.most_common()),
            "pruned_examples": {r: ev.pruned_examples.get(r, r) for r, _ in ev.pruned.most_common()},
            "pruned_total": sum(ev.pruned.values()),
            "estimated": len(ev.candidates),
            "estimate_s": ev.estimate_s,
            "estimate_per_s": ev.rate,
            "simulated": len(self.simulated),
            "newly_simulated": self.newly_simulated,
            "reused_from_store": self.reused,
            "reuse": self.reuse,
            "simulate_s": self.simulate_s,
            "simulation_errors": len(self.errors),
            "crashes": len(self.crashes),
            "agreement": self.agreement,
            "store": self.store_path,
            "top": [
                {"rank": i + 1, "hash": r["hash"], "point": r["point"], "estimate": r["estimate"],
                 "report": {k: r["report"].get(k) for k in _SUMMARY}}
                for i, r in enumerate(rows)
            ],
        }


_SUMMARY = ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "mfu", "bubble_fraction",
            "exposed_comm_s", "peak_memory_gib", "fits_in_memory", "gpus", "num_microbatches", "sim_wall_s")


def run_sweep(
    spec: SweepSpec,
    *,
    store: str | Path | None,
    executor: str | Any = "local",
    workers: int | None = None,
    scheduler: Any = None,
    exhaustive: bool = False,
    top_k: int | None = None,
    estimate_only: bool = False,
    batch_size: int | None = None,
    show_progress: bool = True,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    evaluation: Evaluation | None = None,
) -> SweepOutcome:
    """Both passes; returns the simulated candidates best first (by the simulation).

    ``evaluation``: the first pass of this spec, if already done (``evaluate_space``).
    """
    k = top_k or spec.top_k
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size {batch_size} must be at least 1 (scenarios per task)")
    own = isinstance(executor, str) and not estimate_only
    ex = None
    db = None
    results: dict[str, dict[str, Any]] = {}
    crashes: list[dict[str, Any]] = []
    reused = new = from_others = 0
    reuse: dict[str, Any] = {}
    chosen: list[Candidate] = []
    t_sim = time.perf_counter()
    aborted = True
    restore_sigterm = _sigterm_as_interrupt()
    try:
        # The pool forks before the progress bar starts its thread.
        ex = make_executor(executor, workers, scheduler) if own else executor
        # The store is opened (and a bad --store refused) before any work is done.
        store_was_there = store is not None and Path(store).exists()
        db = ResultStore(store) if store is not None else None
        with progress_bar(show_progress) as bar:
            task = bar.add_task("estimating", total=spec.size)
            ev = evaluation or evaluate_space(spec, progress=lambda n: bar.advance(task, n))
            bar.update(task, completed=spec.size)
            if not ev.candidates:
                # Exit 0 with an empty table read as success; nothing was estimated or simulated.
                shown = "; ".join(f"{r} ({n:,} {'point' if n == 1 else 'points'})" for r, n in pruned_summary(ev, 3))
                more = f"; {len(ev.pruned) - 3} more reasons" if len(ev.pruned) > 3 else ""
                if db is not None and not store_was_there:
                    # bad input writes nothing: the store this run created, empty, goes again
                    db.close()
                    db = None
                    for suffix in ("", "-journal", "-wal", "-shm"):
                        Path(str(store) + suffix).unlink(missing_ok=True)
                raise UserError(f"nothing to simulate: every point was pruned ({shown}{more}): change the axes or constraints")
            chosen = [] if estimate_only else (ev.candidates if exhaustive else ev.candidates[:k])
            t_sim = time.perf_counter()
            if db is not None:
                prior = db.get([c.hash for c in chosen])
                results.update(prior)
                reused = len(prior)
            todo = [c for c in chosen if c.hash not in results]
            todo_by_hash = {c.hash: c for c in todo}
            if db is not None:
                reuse = reuse_summary(db, chosen, todo, reused)
            stask = bar.add_task("simulating", total=len(todo))

            def stored_by_others(hashes: list[str]) -> None:
                nonlocal from_others
                if db is None:
                    return
                for h, rec in db.get(hashes).items():
                    if h not in results:
                        results[h] = rec
                        from_others += 1
                        finished.add(h)
                        bar.advance(stask, 1)
                        if on_result is not None:
                            on_result({"hash": h, **rec})

            # Pass 2, shared with any other sweep on the same store: claim a batch at a time (a few
            # per worker in flight), simulate it, store each row (which drops its claim); points a
            # live sweep holds are waited for and read from the store; a dead sweep's are taken over.
            size = batch_size or max(1, min(32, math.ceil(len(todo) / (ex.workers * 4)))) if todo else 1
            in_flight: dict[Any, list[str]] = {}
            finished: set[str] = set()  # stored (by us or another sweep), or crashed here
            mine: set[str] = set()  # claimed by this sweep and not finished
            order = [c.hash for c in todo]
            last_beat = time.monotonic()
            while True:
                left = [h for h in order if h not in finished and h not in mine]
                while left and len(in_flight) < 2 * ex.workers:
                    if db is None:
                        claimed, stored = left[:size], set()
                    else:
                        claimed, stored = db.claim(left, size)
                        if stored:
                            stored_by_others(sorted(stored))
                    if not claimed:
                        break
                    mine.update(claimed)
                    items = [(h, todo_by_hash[h].point, todo_by_hash[h].scenario, spec.mode) for h in claimed]
                    in_flight[ex.submit(run_batch, items)] = claimed
                    left = [h for h in left if h not in mine and h not in finished]
                if not in_flight:
                    if not left:
                        break
                    time.sleep(CLAIM_POLL_S)  # another live sweep holds the rest: read its rows as they land
                    stored_by_others(left)
                    if db is not None and time.monotonic() - last_beat > CLAIM_HEARTBEAT_S:
                        db.heartbeat()
                        last_beat = time.monotonic()
                    continue
                for fut in ex.wait(list(in_flight), CLAIM_POLL_S):
                    batch = in_flight.pop(fut)
                    for rec in ex.result(fut):
                        if rec["status"] == "crash":
                            crashes.append(rec)
                        else:
                            if db is not None:
                                key = todo_by_hash[rec["hash"]].key
                                if key is not None:
                                    rec = {**rec, "scenario_key": key.scenario_key, "inputs": key.inputs}
                                db.add(rec)
                            results[rec["hash"]] = rec
                            new += 1
                            if on_result is not None:
                                on_result(rec)
                        finished.add(rec["hash"])
                        bar.advance(stask, 1)
                    mine.difference_update(batch)
                    if db is not None:
                        db.release(batch)  # a crashed point's claim too: another sweep may try it
                if db is not None and time.monotonic() - last_beat > CLAIM_HEARTBEAT_S:
                    db.heartbeat()
                    last_beat = time.monotonic()
                    stored_by_others([h for h in left if h not in mine])
        aborted = False
    except sqlite3.Error as exc:
        raise UserError(f"results store {str(store)!r} failed during the sweep ({exc}): results that finished are stored; "
                        "check the disk and rerun the same command to resume") from None
    finally:
        restore_sigterm()
        if own and ex is not None:
            ex.close(abort=aborted)  # Ctrl-C, SIGTERM or an error: the workers are killed at once
        elif aborted and ex is not None and hasattr(ex, "futures"):
            for f in ex.futures:
                f.cancel()
        if db is not None:
            try:
                db.release()  # points this sweep did not finish: free for any other sweep at once
            except sqlite3.Error:
                pass  # dead claims are taken over anyway
            db.close()
    sim_s = time.perf_counter() - t_sim
    reused += from_others
    if reuse and from_others:
        reuse["reused"] = reused
        reuse["from_concurrent_sweeps"] = from_others  # simulated meanwhile by another sweep on this store

    by_hash = {c.hash: c for c in chosen}
    simulated, errors = [], []
    for h, rec in results.items():
        c = by_hash[h]
        row = {"hash": h, "point": c.point, "scenario": c.scenario, "estimate": c.estimate.to_dict(),
               "estimate_score": c.score}
        if rec.get("status") == "ok" and rec.get("report"):
            row["report"] = rec["report"]
            row["score"] = rec["report"][spec.objective]
            simulated.append(row)
        else:
            row["error"] = rec.get("error")
            errors.append(row)
    simulated.sort(key=lambda r: (-r["score"] if spec.maximize else r["score"], r["hash"]))
    agreement = rank_agreement([r["estimate_score"] for r in simulated], [r["score"] for r in simulated], spec.maximize)
    if simulated and ev.candidates:
        # The estimate's best of the whole space, and whether the simulation confirms it.
        agreement["estimate_best_hash"] = ev.candidates[0].hash
        agreement["simulation_best_hash"] = simulated[0]["hash"]
    return SweepOutcome(spec, ev, simulated, errors, agreement, new, reused, sim_s,
                        str(store) if store is not None else None, crashes, reuse)


def _sigterm_as_interrupt() -> Callable[[], None]:
    """While a sweep runs, SIGTERM (kill, a job scheduler) stops it like Ctrl-C: workers killed, claims
    dropped, the store closed. Returns the function that restores the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, previous)


def reuse_summary(db: ResultStore, chosen: list[Candidate], todo: list[Candidate], reused: int) -> dict[str, Any]:
    """How many points the store answered, on what basis, and why stored rows of the others did not count."""
    keyed = [c.key for c in todo if c.key is not None]
    stale = db.stale(keyed)
    reasons: Counter = Counter()
    for k in keyed:
        why: set[str] = set()
        for old in stale.get(k.scenario_key, []):
            why.update(changed_inputs(old, k.inputs))
        for w in why:
            reasons[w] += 1
    version = package_version()
    return {"reused": reused, "of": len(chosen), "basis": f"{REUSE_BASIS}, clustersim {version}", "clustersim": version,
            "stale_points": sum(1 for k in keyed if k.scenario_key in stale), "stale_reasons": dict(reasons.most_common())}


def reuse_line(reuse: dict[str, Any]) -> str:
    """One line for the terminal: '12 of 40 points reused from the store (same ..., clustersim 0.1.0)'."""
    if not reuse or not reuse["of"]:
        return ""  # nothing was to be simulated (--estimate-only)
    line = f"{reuse['reused']:,} of {reuse['of']:,} points reused from the store ({reuse['basis']})"
    if reuse.get("from_concurrent_sweeps"):
        line += f", {reuse['from_concurrent_sweeps']:,} of them simulated meanwhile by another sweep on the same store"
    if reuse.get("stale_points"):
        why = "; ".join(f"{r} changed for {n:,}" for r, n in reuse["stale_reasons"].items())
        line += f"; {reuse['stale_points']:,} simulated again because their stored rows came from other inputs ({why})"
    return line
