"""Sweeps: space files, pruning, the estimate against the simulation, the local pool against a
real Dask LocalCluster, kill-and-resume, the CLI's JSON and dashboard."""

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

from simulator.errors import UserError
from simulator.scenario import build_scenario
from simulator.simulate import simulate
from simulator.sweep.estimate import Estimator, kendall_tau_b, rank_agreement, spearman
from simulator.sweep.runner import evaluate_space, run_sweep
from simulator.sweep.space import expand, load_space, make_spec
from simulator.sweep.store import ResultStore

DATA = Path(__file__).parent / "data" / "sweep"
TINY = DATA / "tiny.yaml"
# Fields of a report that must not depend on where or when it was simulated.
STABLE = ("step_time_s", "tokens_per_s", "mfu", "bubble_fraction", "exposed_comm_s", "peak_memory_gib", "events")


def _stable(rows: list[dict]) -> dict[str, tuple]:
    return {r["hash"]: tuple(json.dumps(r["report"][k], sort_keys=True) for k in STABLE) for r in rows}


def _store_rows(path: Path) -> list[tuple]:
    db = sqlite3.connect(str(path))
    try:
        return list(db.execute("SELECT hash, status, report_json FROM results ORDER BY hash"))
    finally:
        db.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny space simulated in full on the local process pool."""
    store = tmp_path_factory.mktemp("ref") / "ref.sqlite"
    out = run_sweep(load_space(TINY), store=store, executor="local", workers=2, exhaustive=True, show_progress=False)
    return out, store


# ------------------------------------------------------------------------------ space files

BAD_SPACES = [
    ("space: {tp: [1, 2]}\nfoo: 1\n", r"unknown key 'foo'"),
    ("space: {tensor: [1, 2]}\n", r"unknown axis 'tensor'"),
    ("space: {tp: []}\n", r"axis 'tp' has no values"),
    ("space: {tp: [2, 2]}\n", r"axis 'tp' repeats a value"),
    ("space: {tp: [{a: 1}]}\n", r"must be a number, string or boolean"),
    ("space: {tp: [1]}\nobjective: speed\n", r"objective 'speed' is unknown"),
    ("space: {tp: [1]}\nconstraints: {memory_headroom: 1.5}\n", r"memory_headroom=1.5 must be a fraction"),
    ("space: {tp: [1]}\nconstraints: {max_memory: 3}\n", r"unknown constraint 'max_memory'"),
    ("space: {tp: [1]}\ntop_k: 0\n", r"top_k=0 must be a positive integer"),
    ("space: {tp: [1]}\nmode: fast\n", r"mode='fast' must be reduced or full"),
    ("tp: [1, 2]\n", r"unknown key 'tp'"),
    ("name: x\n", r"no 'space' section"),
    ("space: {tp: [1, 2]\n", r"is not valid YAML"),
    ("- tp\n- pp\n", r"must hold a mapping"),
    ("base: nowhere.yaml\nspace: {tp: [1]}\n", r"nowhere.yaml' does not exist"),
    ("base: a.yaml\nscenario: {}\nspace: {tp: [1]}\n", r"either 'base'.*or 'scenario'"),
    ("space: {tp: [1], parallelism.tp: [2]}\n", r"axis 'parallelism.tp' is given twice"),
    # a typo on a named axis is refused, not pruned (it would silently drop those points)
    ("space: {schedule: [1f1b, 1fb1]}\n", r"axis 'schedule' value '1fb1' is unknown: use one of gpipe, 1f1b"),
    ("space: {recompute: [none, partial]}\n", r"axis 'recompute' value 'partial' is unknown"),
    ("space: {network: [flw]}\n", r"axis 'network' value 'flw' is unknown: use one of flow, alpha-beta"),
    ("space: {gpu: [h100-sxm-80gb, h1000]}\n", r"axis 'gpu' value 'h1000': unknown GPU profile"),
    ("space: {topology: [nowhere-fabric]}\n", r"axis 'topology' value 'nowhere-fabric'"),
]


@pytest.mark.parametrize("text,match", BAD_SPACES, ids=[m for _, m in BAD_SPACES])
def test_bad_space_file_is_one_line_user_error(tmp_path, text, match):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=match) as info:
        load_space(path)
    assert "\n" not in str(info.value)


def test_missing_space_file(tmp_path):
    with pytest.raises(UserError, match=r"does not exist: check the path"):
        load_space(tmp_path / "none.yaml")


def test_space_file_expands_axes_in_order():
    spec = load_space(TINY)
    assert spec.size == 2 * 2 * 2 * 2 * 2
    assert list(spec.axes)[:2] == ["parallelism.tp", "parallelism.pp"]
    assert spec.base["network"] == "alpha-beta"


def test_tp_overlap_axes_reach_their_fields_and_the_estimate_ranks_them():
    from simulator.scenario import default_scenario_dict

    spec = make_spec(default_scenario_dict(), {"tp": [8], "async_tp": [False, True], "tp_comm_overlap": [False, True]},
                     name="overlap")
    assert set(spec.axes) == {"parallelism.tp", "parallelism.async_tp", "parallelism.tp_comm_overlap"}
    est = Estimator()
    points = {(p["parallelism.async_tp"], p["parallelism.tp_comm_overlap"]): p for p in expand(spec)}
    with pytest.raises(UserError, match="set one of them false"):  # the runner prunes it
        build_scenario(spec.base, points[(True, True)])
    step = {k: est.estimate(build_scenario(spec.base, points[k])).step_time_s for k in [(False, False), (True, False), (False, True)]}
    assert step[(True, False)] < step[(False, False)] and step[(False, True)] < step[(False, False)]



def test_the_param_gather_axis_reaches_its_field_and_the_estimate_follows_the_simulation():
    # A plain 1F1B pipeline with ZeRO-1: megatron-core's bucketed gathers serialize along the fill,
    # gathered after the step every stage gathers at once (docs/design-notes.md, round 26).
    base = {"name": "z1", "model": "llama3-70b", "parallelism": {"tp": 8, "pp": 8, "cp": 4, "zero": 1},
            "batch": {"micro_batch_size": 1, "global_batch_size": 64, "seq_length": 8192},
            "cluster": {"gpus": 1024, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}, "network": "alpha-beta"}
    spec = make_spec(base, {"overlap_param_gather": [True, False]}, name="gather")
    assert set(spec.axes) == {"parallelism.overlap_param_gather"}
    est = Estimator()
    for point in expand(spec):
        sc = build_scenario(spec.base, point)
        assert sc.overlap_param_gather is point["parallelism.overlap_param_gather"]
        sim = simulate(sc, with_critical_path=False).report.step_time_s
        assert est.estimate(sc).step_time_s == pytest.approx(sim, rel=0.01)


# ------------------------------------------------------------------------------ pruning

def test_pruning_reasons_are_counted():
    base = load_space(TINY).base
    spec = make_spec(base, {"tp": [2, 3], "pp": [1, 2], "zero": [0, 1], "schedule": ["1f1b", "interleaved-1f1b"],
                            "gpus": [64, 128]},
                     constraints={"memory_headroom": 0.5, "max_gpus": 64})
    ev = evaluate_space(spec)
    pr = ev.pruned
    assert ev.total == 32
    assert pr["tp=N does not divide num_attention_heads=N"] == 16  # every tp=3 point
    # interleaved-1f1b with pp=1 is refused by the scenario itself (Megatron-LM needs pp >= 2 for it)
    assert pr["schedule 'interleaved-1f1b' needs pp >= N (model chunks are interleaved over pipeline ranks), but pp=N"] == 4
    assert pr["gpus above max_gpus=64"] == 6  # the other tp=2 points at 128 GPUs
    assert pr["schedule 'interleaved-1f1b': vpp=N must be at least N (model chunks per rank)"] == 2  # pp=2, vpp=1
    # Each reason is shown by one real message, not its masked form.
    assert ev.pruned_examples["tp=N does not divide num_attention_heads=N"] == "tp=3 does not divide num_attention_heads=32"
    assert pr["memory headroom below 0.5"] == 1  # tp=2, pp=1, zero=0: 4B parameters x 18 bytes
    assert len(ev.candidates) == 3
    assert sum(pr.values()) + len(ev.candidates) == ev.total
    # Nothing pruned would have fitted, nothing kept breaks the headroom.
    for c in ev.candidates:
        assert c.estimate.peak_memory_gib <= 0.5 * c.estimate.memory_capacity_gib


def test_points_that_do_not_fit_are_pruned_before_simulation():
    base = load_space(TINY).base
    base = {**base, "batch": {"micro_batch_size": 1, "global_batch_size": 64, "seq_length": 8192}}
    spec = make_spec(base, {"tp": [1], "pp": [1, 8], "zero": [0]})
    ev = evaluate_space(spec)
    assert ev.pruned["does not fit in memory"] == 1  # 8B with DDP and no pipeline: > 80 GB
    assert [c.point["pp"] for c in ev.candidates] == [8]


# ------------------------------------------------------------------------------ the estimate

@pytest.mark.parametrize("layout", [
    {"tp": 2, "pp": 4, "zero": 1, "schedule": "1f1b"},
    {"tp": 1, "pp": 4, "vpp": 2, "zero": 0, "schedule": "interleaved-1f1b"},
    {"tp": 2, "pp": 2, "zero": 1, "schedule": "zbv"},
])
def test_estimate_memory_is_the_simulations_and_time_is_close(layout):
    sched = layout.pop("schedule")
    base = load_space(TINY).base
    sc = build_scenario({**base, "schedule": sched, "parallelism": layout})
    e = Estimator().estimate(sc)
    rep = simulate(sc).report
    assert e.peak_memory_gib == pytest.approx(rep.peak_memory_gib, rel=1e-9)
    assert e.fits_in_memory == rep.fits_in_memory
    assert e.step_time_s == pytest.approx(rep.step_time_s, rel=0.15)


def test_rank_statistics():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert kendall_tau_b([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    a = rank_agreement([3.0, 2.0, 1.0], [30.0, 10.0, 20.0], maximize=True)
    assert a["top1_agree"] and a["n"] == 3


def test_estimate_ranks_the_tiny_space_like_the_simulation(reference):
    out, _ = reference
    a = out.agreement
    assert a["n"] == len(out.evaluation.candidates) == len(out.simulated)
    assert a["spearman"] > 0.9 and a["kendall"] > 0.75


# ------------------------------------------------------------------------------ executors and store

def test_dask_local_cluster_gives_the_local_pools_results(reference, tmp_path):
    distributed = pytest.importorskip("distributed")
    ref, _ = reference
    from simulator.sweep.runner import DaskExecutor

    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  silence_logs=40) as cluster, distributed.Client(cluster) as client:
        out = run_sweep(load_space(TINY), store=tmp_path / "dask.sqlite", executor=DaskExecutor(client),
                        exhaustive=True, show_progress=False)
    assert out.newly_simulated == len(ref.simulated) > 20
    assert _stable(out.simulated) == _stable(ref.simulated)
    assert [r["hash"] for r in out.simulated] == [r["hash"] for r in ref.simulated]
    assert len(_store_rows(tmp_path / "dask.sqlite")) == len(ref.simulated)


def test_rerun_skips_what_the_store_holds(reference, tmp_path):
    ref, store = reference
    copy = tmp_path / "copy.sqlite"
    src = sqlite3.connect(str(store))
    dst = sqlite3.connect(str(copy))
    src.backup(dst)
    src.close(), dst.close()
    out = run_sweep(load_space(TINY), store=copy, executor="local", workers=1, exhaustive=True, show_progress=False)
    assert out.newly_simulated == 0 and out.reused == len(ref.simulated)
    assert _stable(out.simulated) == _stable(ref.simulated)


def test_kill_then_resume_loses_and_duplicates_nothing(reference, tmp_path):
    ref, ref_store = reference
    store = tmp_path / "killed.sqlite"
    cmd = [sys.executable, "-c", "from simulator.sweep.cli import sweep_app; sweep_app()", str(TINY), "--exhaustive",
           "--workers", "1", "--batch-size", "1", "--store", str(store), "--no-dashboard", "--no-progress", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        n = 0
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            if store.exists():
                try:
                    n = ResultStore(store).count()
                except sqlite3.Error:
                    continue
                if n >= 4:
                    break
        assert proc.poll() is None, f"the sweep ended before it could be killed: {proc.stderr.read().decode()[-500:]}"
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its pool worker, mid-sweep
    finally:
        proc.wait(timeout=30)
        proc.stderr.close()
    stored_at_kill = len(_store_rows(store))
    assert 4 <= stored_at_kill < len(ref.simulated)

    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-1000:]
    summary = json.loads(res.stdout)
    assert summary["reused_from_store"] >= stored_at_kill
    assert summary["reused_from_store"] + summary["newly_simulated"] == len(ref.simulated)

    rows = _store_rows(store)
    assert len(rows) == len({h for h, _, _ in rows}) == len(ref.simulated)
    ref_rows = {h: json.loads(r) for h, _, r in _store_rows(ref_store)}
    for h, status, rj in rows:
        rep = json.loads(rj)
        assert status == "ok"
        assert {k: rep[k] for k in STABLE} == {k: ref_rows[h][k] for k in STABLE}


# ------------------------------------------------------------------------------ CLI

def test_cli_json_table_and_escaped_dashboard(tmp_path, reference):
    from typer.testing import CliRunner

    from simulator.sweep.cli import sweep_app

    _, ref_store = reference
    store = tmp_path / "s.sqlite"
    src, dst = sqlite3.connect(str(ref_store)), sqlite3.connect(str(store))
    src.backup(dst)
    src.close(), dst.close()
    dash = tmp_path / "d" / "sweep.html"
    # A hostile mesh order (a free-form axis, checked per point) reaches the prune reasons; the
    # dashboard must show it inert. (Unknown names on named axes are refused up front instead.)
    space = tmp_path / "hostile.yaml"
    space.write_text(TINY.read_text().replace(
        "space:\n", 'space:\n  mesh_order: [tp-cp-ep-dp-pp, "<img src=x onerror=alert(1)>"]\n'))
    args = [str(space), "--schedule", "1f1b", "--top-k", "3", "--store", str(store),
            "--dashboard", str(dash), "--cdn", "--no-progress"]
    res = CliRunner().invoke(sweep_app, args + ["--json"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert obj["simulated"] == 3 and obj["newly_simulated"] == 0
    assert obj["store"] == str(store)
    assert len(obj["top"]) == 3 and obj["top"][0]["rank"] == 1
    assert any("<img src=x" in r for r in obj["pruned"])
    assert obj["agreement"]["n"] == 3
    html_text = dash.read_text()
    assert "<img src=x" not in html_text and "&lt;img src=x" in html_text
    best = dash.with_name("sweep-best.html")
    assert best.exists() and 'href="sweep-best.html"' in html_text
    assert "Pareto front" in html_text

    res = CliRunner().invoke(sweep_app, args + ["--no-dashboard"])
    assert res.exit_code == 0, res.output
    assert "top 3 by simulated tokens_per_s" in res.stdout and "pruned before simulation" in res.stdout
    # the store a re-run reuses is named (it is written whether or not --store was given)
    assert f"results store: {store} " in res.stdout


def test_cli_flags_alone_and_bad_flags():
    from typer.testing import CliRunner

    from simulator.sweep.cli import sweep_app

    res = CliRunner().invoke(sweep_app, ["--tp", "2,x"])
    assert isinstance(res.exception, UserError) and "--tp value 'x' is not an integer" in str(res.exception)
    res = CliRunner().invoke(sweep_app, ["--model", "llama3-8b"])
    assert isinstance(res.exception, UserError) and "nothing to sweep" in str(res.exception)
    res = CliRunner().invoke(sweep_app, [str(TINY), "--executor", "dask"])
    assert isinstance(res.exception, UserError) and "--scheduler" in str(res.exception)
    res = CliRunner().invoke(sweep_app, [str(TINY), "--workers", "100000"])
    assert isinstance(res.exception, UserError) and "--workers 100,000 is more than" in str(res.exception)
    res = CliRunner().invoke(sweep_app, [str(TINY), "--scheduler", "tcp://h:8786"])
    assert isinstance(res.exception, UserError) and "used only with --executor dask" in str(res.exception)
    try:
        import distributed  # noqa: F401
    except ImportError:
        return
    res = CliRunner().invoke(sweep_app, [str(TINY), "--executor", "dask", "--scheduler", "notanaddress", "--no-dashboard"])
    assert isinstance(res.exception, UserError) and "is not a dask address" in str(res.exception)
