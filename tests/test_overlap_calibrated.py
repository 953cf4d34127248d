"""Contention calibrated from traces (issue 15 item 2, issue 14): compute kernels under NCCL kernels
against the same signature alone, per class, on the shipped HTA Kineto traces and on a built
trace whose answer is known; a confident GEMM figure scales the engine's SM-share slowdown."""

from __future__ import annotations

import gzip
import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from simulator.calibrate.overlap import MIN_KERNEL_US, measure_overlap, overlap_lines
from simulator.contention import COLLECTIVE_CTAS, compute_slowdown, measured_excess_scale, scaled_slowdown
from simulator.engine.core import Engine
from simulator.network.alpha_beta import TierNetwork
from simulator.profile import OverlapFit, load_profile
from simulator.topology import load_topology
from simulator.trace.kineto import import_kineto
from simulator.trace.optable import make_optable

KINETO = Path(__file__).resolve().parent / "data" / "reference" / "kineto"


def _ops(name: str) -> pd.DataFrame:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return import_kineto(KINETO / name).ops


def test_kernel_grid_is_imported_as_the_raw_trace_has_it():
    """grid_blocks: the CTAs each kernel launched, straight from args.grid (NCCL: one per channel)."""
    name = "hta_a100_rank0of16.json.gz"
    raw = json.loads(gzip.open(KINETO / name).read())
    want = sorted(int(np.prod(e["args"]["grid"])) for e in raw["traceEvents"]
                  if e.get("cat") == "kernel" and e.get("name", "").startswith("ncclKernel"))
    ops = _ops(name)
    nccl = ops[ops["name"].astype(str).str.startswith("ncclKernel")]
    got = sorted(int(x) for x in nccl["grid_blocks"])
    assert got == want and set(got) == {2, 3, 16, 24}
    n_kernels = sum(1 for e in raw["traceEvents"] if e.get("cat") == "kernel" and "grid" in e.get("args", {}))
    assert int(ops.loc[ops["category"] == "kernel", "grid_blocks"].notna().sum()) == n_kernels


def test_shipped_traces_measure_little_and_say_so():
    """The HTA traces. A100 rank 0 of 16 (shapes recorded): every compute kernel that an NCCL
    kernel covers is short or smaller than the GPU (elementwise, 3-26 µs): nothing to compare.
    Rank 0 of 2 records no shapes: no like-for-like signature. The sampled pair of a 128-rank
    job: GEMMs that fill 108 SMs run x0.987 under 16-CTA NCCL kernels (3 signatures, 10 launches),
    where the SM-share model says x1.174: reported, too few to use."""
    assert measure_overlap([_ops("hta_a100_rank0of16.json.gz")], 108) == {}
    assert measure_overlap([_ops("hta_nccl_data_a100_rank0of2.json.gz")], 108) == {}
    fits = measure_overlap([_ops(f"hta_sampled_rank{r}of128.json.gz") for r in (0, 1)], 108)
    g = fits["gemm"]
    assert (g.signatures, g.overlapped_kernels, g.nccl_ctas) == (3, 10, 16.0)
    assert g.slowdown == pytest.approx(0.987, abs=5e-4)
    assert g.sm_share_slowdown == pytest.approx(108 / 92)
    assert not any(f.confident for f in fits.values())
    lines = overlap_lines(fits)
    assert any("low confidence" in ln and "x0.987" in ln for ln in lines) and all("\n" not in ln for ln in lines)
    assert measured_excess_scale(fits, 108) == 1.0  # nothing confident: the SM-share model as it is


def _built_trace(slow: float, n_sig: int = 3, n_each: int = 8, gemm_grid: int | None = None) -> pd.DataFrame:
    """One rank: GEMMs of n_sig shapes, each n_each times alone and n_each times under a 24-CTA
    NCCL kernel on another stream that runs ``slow`` times longer; plus short kernels (< 10 µs)
    that must not count."""
    rows = []
    t = 0.0
    for s in range(n_sig):
        base = 100.0 + 50 * s
        for i in range(n_each):
            rows.append(dict(name="sm80_xmma_gemm", op_sig=f"aten::mm|[[{s}]]|['float']", op_class="gemm", stream=7,
                             start_us=t, dur_us=base, grid=gemm_grid))
            t += base + 10
            rows.append(dict(name="ncclKernel_AllReduce", op_sig="nccl:all_reduce", op_class="communication",
                             stream=20, start_us=t - 1, dur_us=base * slow + 2, grid=24))
            rows.append(dict(name="sm80_xmma_gemm", op_sig=f"aten::mm|[[{s}]]|['float']", op_class="gemm", stream=7,
                             start_us=t, dur_us=base * slow, grid=gemm_grid))
            t += base * slow + 10
            rows.append(dict(name="elementwise_kernel", op_sig="aten::add|[[1]]|['float']", op_class="elementwise",
                             stream=7, start_us=t, dur_us=3.0, grid=None))
            t += 13
    d = pd.DataFrame(rows)
    n = len(d)
    cols = {"rank": np.zeros(n, np.int32), "device": np.zeros(n, np.int16), "stream": d["stream"].to_numpy(),
            "category": ["kernel"] * n, "name": d["name"].tolist(), "op_class": d["op_class"].tolist(),
            "op_sig": d["op_sig"].tolist(), "shapes_known": d["op_class"].ne("communication").to_numpy(),
            "start_us": d["start_us"].to_numpy(), "dur_us": d["dur_us"].to_numpy(),
            "start_abs_ns": (d["start_us"].to_numpy() * 1000).astype(np.int64),
            "grid_blocks": pd.array([g if g else pd.NA for g in d["grid"]], dtype="Int32")}
    return make_optable(cols, n)


def test_built_trace_gives_its_slowdown_and_scales_the_model():
    fits = measure_overlap([_built_trace(1.15)], 108)
    assert set(fits) == {"gemm"}  # the 3 µs elementwise kernels are under the timer's resolution
    g = fits["gemm"]
    assert g.slowdown == pytest.approx(1.15) and g.signatures == 3 and g.overlapped_kernels == 24 and g.confident
    assert g.nccl_ctas == 24 and g.sm_share_slowdown == pytest.approx(108 / 84)
    scale = measured_excess_scale(fits, 108)
    assert scale == pytest.approx(0.15 / (108 / 84 - 1))
    # The engine's factor for the trace's own CTAs is then the measured one.
    assert scaled_slowdown(compute_slowdown(108, COLLECTIVE_CTAS), scale) == pytest.approx(1.15)
    # Overlapped kernels measured faster than alone are no speed-up: no contention, never below 1.
    assert measured_excess_scale(measure_overlap([_built_trace(0.9)], 108), 108) == 0.0
    # Too few signatures: reported, not used.
    few = measure_overlap([_built_trace(1.15, n_sig=2)], 108)
    assert not few["gemm"].confident and measured_excess_scale(few, 108) == 1.0
    assert MIN_KERNEL_US == 10.0
    # GEMMs that fill the GPU count; ones with fewer CTAs than SMs run beside NCCL on free SMs.
    assert measure_overlap([_built_trace(1.15, gemm_grid=216)], 108)["gemm"].confident
    assert measure_overlap([_built_trace(1.15, gemm_grid=64)], 108) == {}


def test_engine_uses_the_calibrated_scale():
    """The engine's overlapped segment: the SM-share slowdown with its excess scaled; scale 1 is
    the model unchanged, scale 0 no contention."""
    from tests.test_contention import _program

    prof = load_profile("h100-sxm-80gb")
    net = TierNetwork(load_topology("dgx-h100-fattree").node, prof.comm)
    durs, comm_s = {}, {}
    for scale in (1.0, 0.5, 0.0):
        tl = Engine(_program(True), net, sm_count=132, contention_scale=scale).run()
        ev = tl.events
        b = ev[(ev.stream == "compute") & (ev.name == "b")].iloc[0]
        comm = ev[ev.stream == "tp"].iloc[0]
        durs[scale] = b.end_s - b.start_s
        comm_s[scale] = comm.end_s - comm.start_s
    model = 132 / (132 - COLLECTIVE_CTAS)
    # b is slowed by the scaled factor only while the all-reduce holds its SMs (it ends first):
    # c seconds of wall clock do c/f of b's work, the rest runs at full speed.
    for scale, f in ((1.0, model), (0.5, 1 + 0.5 * (model - 1))):
        c = comm_s[scale]
        assert c / f < 5e-3
        assert durs[scale] == pytest.approx(c + (5e-3 - c / f), rel=1e-9)
    assert durs[0.0] == pytest.approx(5e-3, rel=1e-9)
    assert durs[1.0] > durs[0.5] > durs[0.0]


def test_profile_field_round_trips():
    f = OverlapFit(slowdown=1.1, signatures=3, overlapped_kernels=30, ratio_min=1.0, ratio_max=1.2, nccl_ctas=24,
                   sm_count=108, sm_share_slowdown=108 / 84, confident=True)
    prof = load_profile("a100-sxm-80gb")
    p2 = prof.model_copy(update={"compute": prof.compute.model_copy(update={"overlap_fits": {"gemm": f}})})
    back = type(prof).model_validate_json(p2.model_dump_json())
    assert back.compute.overlap_fits["gemm"] == f


def test_calibrate_reports_the_measurement(tmp_path):
    """`calibrate` on the sampled pair: the figure lands in the profile with its counts, and one
    readable note says it is reported, not used."""
    import shutil

    from simulator.calibrate.fit import calibrate
    from simulator.calibrate.physics import Notes

    for r in (0, 1):
        d = tmp_path / f"rank_{r}"
        d.mkdir()
        shutil.copy(KINETO / f"hta_sampled_rank{r}of128.json.gz", d / "trace.json.gz")
    notes = Notes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = calibrate([tmp_path], "sampled", base="a100-sxm-80gb", notes=notes)
    g = prof.compute.overlap_fits["gemm"]
    assert (g.signatures, g.overlapped_kernels, g.sm_count, g.confident) == (3, 10, 108, False)
    assert any(ln.startswith("overlap: gemm kernels under NCCL kernels run x0.987") for ln in notes.lines)
    assert any(i.field == "compute.overlap_fits.gemm" for i in prof.provenance.items)
