"""Sweeps under stress (issue 16): a killed sweep leaves no worker and no debris, two sweeps on one store
share the work, and a bad store or space is one line with exit status 2."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from simulator.errors import UserError
from simulator.sweep.space import MAX_SPACE_POINTS, load_space, make_spec
from simulator.sweep.store import CLAIM_STALE_S, ResultStore

from test_fuzz import run_cli  # the fuzz suite's in-process runner: exit status and stderr as main() ends a run

DATA = Path(__file__).parent / "data" / "sweep"
TINY = DATA / "tiny.yaml"
SMALL = DATA / "small.yaml"
REPO = Path(__file__).parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _children(pid: int) -> set[int]:
    """Live direct children of ``pid`` (from /proc: no psutil needed)."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _rows(store: Path) -> list[tuple]:
    db = sqlite3.connect(str(store))
    try:
        return list(db.execute("SELECT hash, status, report_json, point_json, scenario_json FROM results"))
    finally:
        db.close()


def _claims(store: Path) -> list[tuple]:
    db = sqlite3.connect(str(store))
    try:
        return list(db.execute("SELECT hash, owner, pid FROM claims"))
    finally:
        db.close()


def _sweep_cmd(space: Path, store: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "simulator.cli", "sweep", str(space), "--exhaustive", "--store", str(store),
            "--no-dashboard", "--no-progress", "--json", *extra]


# ------------------------------------------------------------------------------ 1. killing a sweep

@pytest.mark.parametrize("how", ["sigint-group", "sigterm", "sigkill-driver"])
def test_killed_sweep_leaves_no_worker_and_only_complete_rows(tmp_path, how):
    store = tmp_path / "store.sqlite"
    # A terminal's Ctrl-C meets a sweep whose SIGINT is at its default. A test run started in the
    # background by a non-interactive shell (`.ci/run &`) has SIGINT ignored (POSIX: asynchronous
    # commands without job control), every child inherits that, and the sweep then rightly ignores
    # the signal and runs to its end: start it with SIGINT at its default, as a terminal would.
    proc = subprocess.Popen(_sweep_cmd(SMALL, store, "--workers", "2", "--batch-size", "1"), cwd=tmp_path,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            workers |= _children(proc.pid)
            if store.exists() and len(workers) >= 2:
                try:
                    if _rows(store):
                        break
                except sqlite3.Error:
                    pass
            time.sleep(0.05)
        assert proc.poll() is None, f"the sweep ended before it could be killed: {proc.stderr.read().decode()[-500:]}"
        workers |= _children(proc.pid)
        assert len(workers) >= 2, workers
        t_kill = time.monotonic()
        if how == "sigint-group":
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches the driver and its workers
        elif how == "sigterm":
            os.kill(proc.pid, signal.SIGTERM)  # kill PID, a job scheduler: the driver alone
        else:
            os.kill(proc.pid, signal.SIGKILL)  # the driver dies at once; the kernel must end its workers
        _, err = proc.communicate(timeout=30)
        err = err.decode()
        gone_by = time.monotonic() + 5
        while time.monotonic() < gone_by and any(_alive(p) for p in workers):
            time.sleep(0.05)
        alive = [p for p in workers if _alive(p)]
        assert not alive, f"workers {alive} still running {time.monotonic() - t_kill:.1f} s after {how}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for p in workers:
            if _alive(p):
                os.kill(p, signal.SIGKILL)

    if how != "sigkill-driver":
        assert proc.returncode == 130, (proc.returncode, err[-500:])
        assert "Traceback" not in err, err[-1000:]
    rows = _rows(store)
    for h, status, report_json, point_json, scenario_json in rows:  # only complete rows
        assert status in ("ok", "error")
        assert status == "error" or json.loads(report_json)["step_time_s"] > 0
        json.loads(point_json), json.loads(scenario_json)
    if how == "sigkill-driver":
        # The dead sweep's claims stay behind but are taken over at once: a re-run finishes the space.
        res = subprocess.run(_sweep_cmd(SMALL, store, "--workers", "2"), cwd=tmp_path, env=_env(),
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-1000:]
        out = json.loads(res.stdout)
        assert out["reused_from_store"] >= len(rows) and out["reused_from_store"] + out["newly_simulated"] == out["simulated"]
    else:
        # A stopped sweep drops its claims, closes the store (SQLite folds its WAL back) and writes nothing else.
        assert _claims(store) == []
        assert sorted(p.name for p in tmp_path.iterdir()) == ["store.sqlite"]


# ------------------------------------------------------------------------------ 2. sweeps sharing a store

COUNTING_DRIVER = """
import os, sys
import simulator.sweep.runner as runner
original = runner.run_batch
def run_batch(items):
    with open(os.environ["SIM_COUNT_FILE"], "a") as f:  # O_APPEND: one whole line per simulated point
        for h, *_ in items:
            f.write(f"{os.getppid()} {h}\\n")
            f.flush()
    return original(items)
run_batch.__module__, run_batch.__qualname__ = "simulator.sweep.runner", "run_batch"  # pickled by name
runner.run_batch = run_batch
sys.argv = ["clustersim", *sys.argv[1:]]
from simulator.cli import main
main()
"""


def test_two_sweeps_on_one_store_simulate_each_point_once(tmp_path):
    store = tmp_path / "shared.sqlite"
    count = tmp_path / "simulated.txt"
    env = {**_env(), "SIM_COUNT_FILE": str(count)}
    args = ["sweep", str(TINY), "--exhaustive", "--store", str(store), "--no-dashboard", "--no-progress", "--json",
            "--workers", "1", "--batch-size", "1"]
    procs = [subprocess.Popen([sys.executable, "-c", COUNTING_DRIVER, *args], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-1000:]
        outs.append(json.loads(out))
    simulated = [line.split() for line in count.read_text().splitlines()]
    hashes = [h for _, h in simulated]
    n = outs[0]["simulated"]
    assert n >= 8  # the tiny space's feasible points
    # Each point simulated once in total, and the store holds one row per point.
    assert len(hashes) == len(set(hashes)) == n, f"{len(hashes)} simulations for {n} points"
    assert len(_rows(store)) == n
    # Both print the full result: every point, the same ranking.
    for out in outs:
        assert out["simulated"] == n and out["simulation_errors"] == 0 and out["crashes"] == 0
        assert out["newly_simulated"] + out["reused_from_store"] == n
    assert sum(out["newly_simulated"] for out in outs) == n
    assert [r["hash"] for r in outs[0]["top"]] == [r["hash"] for r in outs[1]["top"]]
    assert _claims(store) == []


def _fake_claim(store: Path, h: str, owner: str, pid: int, heartbeat: float) -> None:
    import socket

    db = sqlite3.connect(str(store))
    db.execute("INSERT OR REPLACE INTO claims VALUES (?,?,?,?,?)", [h, owner, socket.gethostname(), pid, heartbeat])
    db.commit()
    db.close()


def test_claims_of_dead_or_stale_sweeps_are_taken_over(tmp_path):
    store_path = tmp_path / "s.sqlite"
    store = ResultStore(store_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now = time.time()
    _fake_claim(store_path, "dead", "h:dead", dead.pid, now)
    _fake_claim(store_path, "stale", "h:stale", os.getppid(), now - CLAIM_STALE_S - 1)
    _fake_claim(store_path, "live", "h:live", os.getppid(), now)
    claimed, stored = store.claim(["live", "dead", "stale", "free"], limit=10)
    assert claimed == ["dead", "stale", "free"] and stored == set()
    assert store.held_elsewhere(["live", "dead", "stale", "free"]) == {"live"}
    # A second sweep (another owner in the same process) gets none of them, then all once released.
    other = ResultStore(store_path)
    assert other.claim(["dead", "stale", "free"], limit=10) == ([], set())
    store.release()
    assert other.claim(["dead", "stale", "free"], limit=2)[0] == ["dead", "stale"]
    store.close(), other.close()


def _two_point_spec():
    # llama3-8b on 32 H100, two layouts: each simulates in well under a second.
    base = {"model": "llama3-8b", "batch": {"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 1024},
            "network": "alpha-beta", "cluster": {"gpus": 32, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}
    return make_spec(base, {"tp": [2, 4], "pp": [2]}, name="wait", top_k=10)


FINISH_LATER = """
import sqlite3, sys, time
src, dst, h, delay = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
time.sleep(delay)  # "simulating": this process owns the claim meanwhile
db = sqlite3.connect(dst, timeout=30)
db.execute("ATTACH DATABASE ? AS src", [src])
db.execute("INSERT INTO results SELECT * FROM src.results WHERE hash=?", [h])
db.execute("DELETE FROM claims WHERE hash=?", [h])
db.commit()
"""


@pytest.mark.parametrize("owner", ["live", "dead"])
def test_a_point_held_by_a_live_sweep_is_waited_for_and_read(tmp_path, owner):
    from simulator.sweep.runner import run_sweep

    ref_path = tmp_path / "ref.sqlite"
    ref = run_sweep(_two_point_spec(), store=ref_path, executor="local", workers=1, exhaustive=True, show_progress=False)
    assert len(ref.simulated) == 2
    held = ref.simulated[0]["hash"]
    store = tmp_path / "shared.sqlite"
    src = sqlite3.connect(str(ref_path))
    dst = sqlite3.connect(str(store))
    src.backup(dst)
    src.close()
    dst.execute("DELETE FROM results WHERE hash=?", [held])
    dst.commit()
    dst.close()
    delay_s = 2.0
    other = subprocess.Popen([sys.executable, "-c", FINISH_LATER, str(ref_path), str(store), held,
                              str(delay_s if owner == "live" else 0)])
    if owner == "dead":
        other.wait()  # it stored nothing: make it a sweep that died mid-point
        db = sqlite3.connect(str(store))
        db.execute("DELETE FROM results WHERE hash=?", [held])
        db.commit()
        db.close()
    _fake_claim(store, held, f"elsewhere:{other.pid}", other.pid, time.time())
    t0 = time.monotonic()
    try:
        out = run_sweep(_two_point_spec(), store=store, executor="local", workers=1, exhaustive=True, show_progress=False)
    finally:
        other.wait(timeout=60)
    assert len(out.simulated) == 2 and out.errors == []
    if owner == "live":
        # Not simulated here: waited for (about delay_s) and read from the store.
        assert out.newly_simulated == 0 and out.reused == 2 and out.reuse["from_concurrent_sweeps"] == 1
        assert time.monotonic() - t0 >= delay_s * 0.9
    else:
        assert out.newly_simulated == 1 and out.reused == 1  # the dead sweep's claim taken over at once
    steps = {r["hash"]: r["report"]["step_time_s"] for r in out.simulated}
    assert steps == {r["hash"]: r["report"]["step_time_s"] for r in ref.simulated}
    assert _claims(store) == []


# ------------------------------------------------------------------------------ 3. bad stores and spaces

def _bad_store(tmp_path: Path, kind: str) -> Path:
    if kind == "folder":
        path = tmp_path / "dir.sqlite"
        path.mkdir()
    elif kind == "not-sqlite":
        path = tmp_path / "text.sqlite"
        path.write_text("these are my notes, not a database\n" * 50)
    elif kind == "schema-abc":
        path = tmp_path / "abc.sqlite"
        ResultStore(path).close()
        db = sqlite3.connect(str(path))
        db.execute("UPDATE meta SET value='abc' WHERE key='schema_version'")
        db.commit()
        db.close()
    elif kind == "schema-2":
        path = tmp_path / "two.sqlite"
        ResultStore(path).close()
        db = sqlite3.connect(str(path))
        db.execute("UPDATE meta SET value='2' WHERE key='schema_version'")
        db.commit()
        db.close()
    elif kind == "parent-is-file":
        (tmp_path / "afile").write_text("keep")
        path = tmp_path / "afile" / "s.sqlite"
    elif kind == "device":
        path = Path("/dev/null")
    else:
        raise ValueError(kind)
    return path


@pytest.mark.parametrize("kind, match", [
    ("folder", "is a folder"), ("not-sqlite", "is not a ClusterSim SQLite store"), ("schema-abc", "schema version 'abc'"),
    ("schema-2", "schema version '2', expected 1"), ("parent-is-file", "which is a file, not a folder"),
    ("device", "not a regular file"),
])
def test_bad_store_is_one_line_before_any_work(tmp_path, monkeypatch, kind, match):
    monkeypatch.chdir(tmp_path)
    path = _bad_store(tmp_path, kind)
    before = path.read_bytes() if path.is_file() else None
    t0 = time.perf_counter()
    code, err = run_cli(["sweep", str(TINY), "--store", str(path), "--no-dashboard", "--no-progress", "--workers", "1"])
    assert code == 2 and match in err and "--store" in err, err
    assert len(err.strip().splitlines()) == 1
    assert time.perf_counter() - t0 < 20
    if before is not None:
        assert path.read_bytes() == before  # refused, not "repaired"
    assert (tmp_path / "afile").read_text() == "keep" if kind == "parent-is-file" else True


def test_read_only_store_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "ro.sqlite"
    ResultStore(path).close()
    path.chmod(0o444)
    if os.geteuid() == 0:
        # root writes read-only files anyway: pretend, as an unprivileged user sees it.
        import simulator.sweep.store as store_module

        real = store_module._writable
        monkeypatch.setattr(store_module, "_writable", lambda p: False if Path(p) == path else real(p))
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(["sweep", str(TINY), "--store", str(path), "--no-dashboard", "--no-progress", "--workers", "1"])
    assert code == 2 and "is read-only" in err, err


def test_space_size_is_bounded_with_the_limit_named(tmp_path):
    space = tmp_path / "huge.yaml"
    space.write_text(yaml.safe_dump({"space": {"tp": list(range(1, 3001)), "pp": list(range(1, 3001)),
                                               "micro_batch_size": [1, 2]}}))
    t0 = time.perf_counter()
    with pytest.raises(UserError, match=r"18,000,000 points .*at most 10,000,000 points"):
        load_space(space)
    assert time.perf_counter() - t0 < 10
    assert MAX_SPACE_POINTS == 10_000_000
    # Just at the limit is a valid space (only counted, never expanded here).
    spec = make_spec({}, {"tp": list(range(1, 5001)), "pp": list(range(1, 2001))})
    assert spec.size == MAX_SPACE_POINTS
    code, err = run_cli(["sweep", "--tp", ",".join(map(str, range(1, 4001))), "--pp", ",".join(map(str, range(1, 4001)))])
    assert code == 2 and "at most 10,000,000 points" in err, err


@pytest.mark.parametrize("extra, match", [
    ({"objective": ["tokens_per_s"]}, "objective"), ({"objective": {"a": 1}}, "objective"), ({"objective": 3}, "objective"),
    ({"constraints": ["max_gpus"]}, "constraints must be a mapping"), ({"constraints": "max_gpus: 8"}, "constraints must be"),
    ({"constraints": {"max_gpus": "8"}}, "max_gpus='8'"), ({"constraints": {"max_gpus": True}}, "max_gpus=True"),
    ({"constraints": {"memory_headroom": float("nan")}}, "non-finite number (nan)"),
    ({"constraints": {"memory_headroom": True}}, "memory_headroom=True"),
    ({"constraints": {"memory_headroom": [0.1]}}, "memory_headroom=[0.1]"),
    ({"top_k": "5"}, "top_k='5'"), ({"top_k": 2.5}, "top_k=2.5"), ({"mode": ["full"]}, "mode=['full']"),
    ({"name": ["a", "b"]}, "name ['a', 'b']"),
])
def test_space_fields_of_the_wrong_type_are_one_line(tmp_path, monkeypatch, extra, match):
    monkeypatch.chdir(tmp_path)
    space = tmp_path / "s.yaml"
    space.write_text(yaml.safe_dump({"space": {"tp": [1, 2]}, **extra}))
    code, err = run_cli(["sweep", str(space), "--no-dashboard", "--no-progress", "--estimate-only"])
    assert code == 2 and match in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag, value", [("--batch-size", "0"), ("--batch-size", "-3"), ("--workers", "0")])
def test_task_sizes_are_checked(tmp_path, monkeypatch, flag, value):
    # --batch-size -3 used to claim nothing and wait forever for points nobody simulated.
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(["sweep", str(TINY), "--no-dashboard", "--no-progress", flag, value])
    assert code == 2 and f"{flag} {value} must be at least 1" in err, err
