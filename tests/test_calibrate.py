"""Calibration: fits recover known parameters, hold-out errors are stored, extrapolation warns,
the nccl-tests reference log is reproduced, bad inputs give one-line errors."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from simulator.calibrate.cli import calibrate_app
from simulator.calibrate.comm_fit import collectives_from_ops, fit_collectives
from simulator.calibrate.compute_fit import fit_class
from simulator.calibrate.fit import calibrate, fit_overlap
from simulator.profile import ExtrapolationWarning, Profile, load_profile
from simulator.errors import UserError
from simulator.trace.bundle import Manifest, StepTiming
from simulator.trace.nccl_tests import import_nccl_tests
from simulator.trace.optable import make_optable

ROOT = Path(__file__).resolve().parents[1]
NCCL_LOG = ROOT / "tests" / "data" / "reference" / "nccl-tests" / "p4de-2nodes-16gpu_all_reduce_perf.txt"

# Synthetic truth: 5 µs per kernel; GEMM rate rising from 2 to 20 TFLOP/s (log-linear in FLOPs)
# between 1e6 and 1e10 FLOPs and flat outside; memory-bound ops at 400 GB/s with 3 µs overhead.
GEMM_OVH_US, GEMM_NODES, GEMM_TFLOPS = 5.0, np.array([1e6, 1e10]), np.array([2.0, 20.0])
BW_OVH_US, BW_GBPS = 3.0, 400.0


def gemm_time_us(flops: np.ndarray) -> np.ndarray:
    rate = np.exp(np.interp(np.log(flops), np.log(GEMM_NODES), np.log(GEMM_TFLOPS)))
    return GEMM_OVH_US + flops / (rate * 1e12) * 1e6


def bytes_time_us(nbytes: np.ndarray) -> np.ndarray:
    return BW_OVH_US + nbytes / (BW_GBPS * 1e9) * 1e6


def synthetic_compute(rng: np.random.Generator) -> pd.DataFrame:
    f = np.repeat(np.geomspace(1e5, 1e11, 25), 3)
    b = np.repeat(np.geomspace(1e3, 1e9, 25), 3)
    noise = lambda n: rng.normal(1.0, 0.01, n)  # noqa: E731
    rows = [pd.DataFrame({"op": "gemm", "flops": f, "bytes": f / 100, "time_us": gemm_time_us(f) * noise(f.size)})]
    for op in ("gelu", "layernorm", "adamw"):
        rows.append(pd.DataFrame({"op": op, "flops": b, "bytes": b, "time_us": bytes_time_us(b) * noise(b.size)}))
    return pd.concat(rows, ignore_index=True)


def sweep_busbw_GBps(s: np.ndarray) -> np.ndarray:
    """1 GB/s at 1 KiB rising log-linearly to 10 GB/s at 1 MiB, flat above."""
    return np.exp(np.interp(np.log(s), np.log([1024.0, 1 << 20]), np.log([1.0, 10.0])))


def sweep_time_us(s: np.ndarray) -> np.ndarray:
    return 20.0 + 1.5 * s / (sweep_busbw_GBps(s) * 1e3)


def synthetic_sweep() -> pd.DataFrame:
    """all_reduce over 4 ranks: alpha 20 µs, busbw rising to 10 GB/s."""
    s = np.array([2.0 ** k for k in range(10, 27)])
    t = sweep_time_us(s)
    return pd.DataFrame({"collective": "all_reduce", "size_bytes": s.astype(int), "count": (s // 4).astype(int),
                         "dtype": "float", "redop": "sum", "in_place": True, "time_us": t, "algbw_GBps": s / t / 1e3,
                         "busbw_GBps": 1.5 * s / t / 1e3, "nranks": 4, "group_size": 4})


def write_bundle(path: Path, compute: pd.DataFrame | None = None, collectives: pd.DataFrame | None = None) -> Path:
    path.mkdir(parents=True)
    tables = []
    if compute is not None:
        compute.to_parquet(path / "compute.parquet")
        tables.append("compute.parquet")
    if collectives is not None:
        collectives.to_parquet(path / "collectives.parquet")
        tables.append("collectives.parquet")
    m = Manifest(created="2026-01-01T00:00:00+00:00", tool_version="test", torch_version="2.x", backend="gloo",
                 devices=["CPU Test"] * 4, device_counts={"CPU Test": 4}, world_size=4, hosts=["h"],
                 workload="compute", tables=tables, step_times=[StepTiming(step=0, wall_s=1.0)])
    (path / "manifest.json").write_text(m.model_dump_json())
    return path


@pytest.fixture(scope="module")
def synthetic_profile(tmp_path_factory) -> Profile:
    d = tmp_path_factory.mktemp("syn")
    b = write_bundle(d / "b", synthetic_compute(np.random.default_rng(0)), synthetic_sweep())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return calibrate([b], "syn")


def test_compute_fit_recovers_known_curve(synthetic_profile: Profile) -> None:
    p = synthetic_profile
    gemm = p.compute.classes["gemm"]
    assert gemm.basis == "flops"
    assert gemm.overhead_us == pytest.approx(GEMM_OVH_US, rel=0.15)
    f = np.geomspace(2e5, 5e10, 40)  # between the fitted points, inside the range
    pred = p.compute_time_s(np.array(["gemm"] * f.size), f, f / 100) * 1e6
    assert np.max(np.abs(pred / gemm_time_us(f) - 1)) < 0.04
    # Memory-bound classes follow bytes: 400 GB/s and 3 µs recovered.
    for cls in ("elementwise", "norm", "optimizer"):
        m = p.compute.classes[cls]
        assert m.basis == "bytes"
        assert max(m.table_GBps) == pytest.approx(BW_GBPS, rel=0.03)
        assert m.overhead_us == pytest.approx(BW_OVH_US, rel=0.15)
    assert p.compute.peak_tflops == pytest.approx(20.0, rel=0.03)


def test_holdout_error_is_computed_and_stored(synthetic_profile: Profile, tmp_path: Path) -> None:
    for cls in ("gemm", "elementwise", "norm", "optimizer"):
        err = synthetic_profile.compute.classes[cls].fit_error
        assert err is not None and 0 < err < 0.03  # 1% noise, smooth curve
    # Noise that no curve explains shows up in the held-out error.
    rng = np.random.default_rng(1)
    f = np.repeat(np.geomspace(1e6, 1e10, 12), 4)
    t = gemm_time_us(f) * rng.lognormal(0, 0.3, f.size)
    assert fit_class("gemm", f, f / 100, t).fit_error > 0.1
    # ... and it survives the round trip through the JSON file.
    path = tmp_path / "p.json"
    path.write_text(synthetic_profile.model_dump_json(exclude_none=True))
    assert load_profile(path).compute.classes["gemm"].fit_error == synthetic_profile.compute.classes["gemm"].fit_error


def test_extrapolation_warns_once_per_class(synthetic_profile: Profile) -> None:
    p = synthetic_profile.model_copy(deep=True)
    with pytest.warns(ExtrapolationWarning, match="op class 'gemm'.*outside the fitted range"):
        t_big = p.compute_time_s(np.array(["gemm"]), np.array([1e13]), np.array([1e11]))
    # Beyond the range the end rate is kept: 20 TFLOP/s.
    assert t_big[0] == pytest.approx(1e13 / 20e12, rel=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p.compute_time_s(np.array(["gemm"]), np.array([1e14]), np.array([1e12]))  # no second warning
        p.compute_time_s(np.array(["gemm"]), np.array([1e8]), np.array([1e6]))  # inside: none
    with pytest.warns(ExtrapolationWarning, match="op class 'norm'"):
        p.compute_time_s(np.array(["norm"]), np.array([0.0]), np.array([1e12]))


def test_comm_fit_recovers_sweep(synthetic_profile: Profile) -> None:
    (fit,) = synthetic_profile.comm.collectives
    assert (fit.collective, fit.group_size, fit.tier) == ("all_reduce", 4, "intra")
    assert fit.alpha_us == pytest.approx(20.0, rel=0.1)
    s = np.geomspace(3000, 5e7, 30)
    assert np.max(np.abs(fit.time_us(s) / sweep_time_us(s) - 1)) < 0.05
    assert fit.fit_error is not None and fit.fit_error < 0.05
    # 10 GB/s of busbw over the cpu-loopback topology's 2 GB/s placeholder: capped efficiency.
    assert synthetic_profile.comm.nvlink_efficiency == 1.0
    assert synthetic_profile.provenance.bundles[0]["files"]["compute.parquet"]


def test_nccl_tests_busbw_within_5_percent_above_1mib() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = calibrate([NCCL_LOG], "p4de", base="a100-sxm-80gb", topology="p4de-efa")
    (fit,) = p.comm.collectives
    assert (fit.collective, fit.group_size, fit.tier) == ("all_reduce", 16, "inter")
    t = import_nccl_tests(NCCL_LOG).table
    big = t[t["size_bytes"] >= 1 << 20]
    s = big["size_bytes"].to_numpy(float)
    busbw = 2 * 15 / 16 * s / (fit.time_us(s) * 1e3)
    err = np.abs(busbw / big["busbw_GBps"].to_numpy() - 1)
    assert err.max() < 0.05, err
    # Sizes left out of the fit are predicted from their neighbours.
    assert fit.fit_error < 0.05
    # The fabric's NIC efficiency reproduces the large-message end through p4de's 4 x 100 Gb/s.
    assert 0.7 < p.comm.nic_efficiency < 0.95
    assert p.provenance.bundles[0]["kind"] == "nccl-tests"
    assert p.provenance.method == "mixed"


def test_collectives_in_traces_use_latest_starting_rank() -> None:
    # Rank 0 calls 300 µs early and waits; rank 1 arrives late: the transfer took 100 µs.
    n = 4
    ops = make_optable({
        "rank": np.array([0, 1, 0, 1], dtype=np.int32), "op_class": pd.Categorical(["communication"] * n),
        "collective": pd.Categorical(["all_reduce"] * n), "msg_bytes": pd.array([4096, 4096, 8192, 8192], dtype="Int64"),
        "group_size": pd.array([2] * n, dtype="Int32"),
        "start_us": np.array([0.0, 300.0, 1000.0, 1010.0]), "dur_us": np.array([400.0, 100.0, 150.0, 140.0]),
    }, n)
    got = collectives_from_ops(ops)
    assert got["time_us"].tolist() == [100.0, 140.0]
    assert got["group_size"].tolist() == [2, 2]


def test_overlap_slowdown_from_traces() -> None:
    # The same op: 100 µs alone, 130 µs while a collective runs on another thread.
    starts = np.arange(10) * 1000.0
    dur = np.array([100.0] * 5 + [130.0] * 5)
    n = 11
    ops = make_optable({
        "rank": np.zeros(n, dtype=np.int32), "stream": np.array([1] * 10 + [2]),
        "op_class": pd.Categorical(["gemm"] * 10 + ["communication"]), "name": pd.Categorical(["aten::mm"] * 10 + ["gloo:all_reduce"]),
        "flops": np.array([1e6] * 10 + [np.nan]), "bytes": np.array([1e4] * 10 + [np.nan]),
        "start_us": np.append(starts, 4900.0), "dur_us": np.append(dur, 6000.0),
    }, n)
    slow, shapes = fit_overlap([ops])
    assert shapes == 1 and slow == pytest.approx(1.3)
    assert fit_overlap([]) == (1.0, 0)


def test_calibrate_cli_writes_profile(tmp_path: Path) -> None:
    b = write_bundle(tmp_path / "b", synthetic_compute(np.random.default_rng(2)), synthetic_sweep())
    out = tmp_path / "cal" / "host.json"
    r = CliRunner().invoke(calibrate_app, [str(b), "--out", str(out)])
    assert r.exit_code == 0, r.output
    prof = load_profile(out)
    assert prof.name == "host" and prof.device == "CPU Test" and prof.provenance.method == "fitted"
    assert not list(out.parent.glob(".*tmp"))
    r = CliRunner().invoke(calibrate_app, [str(b), "--out", str(out)])
    assert isinstance(r.exception, UserError) and "already exists" in str(r.exception)


def test_a_ring_sendrecv_of_four_ranks_fits_the_link_model(tmp_path: Path) -> None:
    # The capture's (and nccl-tests') sendrecv of n ranks sends to the next rank and receives from
    # the previous at once. Calibrating the repository's own collectives bundle said "cannot map
    # send_recv x 4 ... give [src, dst] pairs", which no user could act on.
    from simulator.calibrate.fit import _group

    fit = load_profile(calibrate_bundle_profile(tmp_path)).comm.collectives
    four = next(f for f in fit if f.collective == "send_recv" and f.group_size == 4)
    pairs, gpus = _group(four, gpn=8)
    assert pairs.tolist() == [[0, 1], [1, 2], [2, 3], [3, 0]] and gpus == 4


def calibrate_bundle_profile(tmp_path: Path) -> Path:
    out = tmp_path / "host.json"
    traces = Path(__file__).parents[1] / "traces"
    r = CliRunner().invoke(calibrate_app, [str(traces / "cpu-gloo-train-tp2-pp2"), str(traces / "cpu-gloo-collectives"),
                                           "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "cannot map" not in r.output, r.output
    # cpu-loopback's bandwidths are placeholders: a low fitted efficiency is the host's rate, not
    # a sign of "another fabric" to fix with --topology (there is no other CPU topology)
    assert "pass --topology matching it" not in r.output and "placeholder 2 GB/s a rank" in r.output, r.output
    return out


def test_bad_inputs_give_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist: give trace bundles"):
        calibrate([tmp_path / "missing"], "x")
    (tmp_path / "notabundle").mkdir()
    (tmp_path / "notabundle" / "readme.md").write_text("hi")
    with pytest.raises(UserError, match="no .json or .json.gz trace files and no manifest.json"):
        calibrate([tmp_path / "notabundle"], "x")
    empty = write_bundle(tmp_path / "empty", compute=synthetic_compute(np.random.default_rng(0)).iloc[:0])
    with pytest.raises(UserError, match="op table is empty"):
        calibrate([empty], "x")
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(UserError, match="holds no trace events"):
        calibrate([trace], "x")
    odd = tmp_path / "x.csv"
    odd.write_text("a,b\n")
    with pytest.raises(UserError, match="neither a bundle folder"):
        calibrate([odd], "x")
    with pytest.raises(UserError, match="and no --base profile"):
        calibrate([NCCL_LOG], "x")
    with pytest.raises(UserError, match="at least one input"):
        calibrate([], "x")
