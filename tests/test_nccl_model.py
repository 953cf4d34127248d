"""NCCL's cost model (simulator.network.nccl): the choices NCCL's tuner documents, the one model
behind every network, and the per-system calibration on the development nccl-tests logs."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest
import simpy
from typer.testing import CliRunner

from simulator.calibrate.fit import calibrate
from simulator.calibrate.nccl_fit import error_table, errors, fit_system, physical_bounds, physics_checks, read_log, ring_simple_floor
from simulator.profile import load_profile
from simulator.network.alpha_beta import TierNetwork
from simulator.network.base import CollectiveRequest
from simulator.network.cli import collective_app, simulate_sweep
from simulator.network.fabric import FlowNetwork
from simulator.network.nccl import NcclModel, NcclSystem, NcclTuning, collective_time_s, graphs, tune
from simulator.topology.spec import load_topology

LOGS = Path(__file__).resolve().parent / "data" / "reference" / "nccl-tests"

# NCCL-MODEL.md §8.1: 2 nodes x 8 A100, 4 x 100 Gb/s NICs per node, Intel hosts.
P4D = NS(gpus_per_node=8, nvlink_GBps=300, nics_per_node=4, nic_gbps=100, cpu_vendor="intel")
H100 = NS(gpus_per_node=8, nvlink_GBps=450, nics_per_node=8, nic_gbps=400, cpu_vendor="intel", nvls=True)
NDV4 = NS(gpus_per_node=8, nvlink_GBps=300, nics_per_node=8, nic_gbps=200, cpu_vendor="intel")


def _model(node, device):
    return NcclModel(NcclSystem.from_specs(node, device))


def test_graphs_match_the_documented_search_results():
    a = NcclSystem.from_specs(P4D, "A100-SXM4-80GB")
    g = graphs(a, 2, 8)
    assert (g["ring"].n_ch, g["ring"].bw_inter, g["ring"].runtime_ch) == (4, 12.0, 8)  # §8.1
    assert (g["tree"].n_ch, g["tree"].bw_intra, g["tree"].bw_inter) == (4, 24.0, 12.0)
    g1 = graphs(a, 1, 8)["ring"]
    assert (g1.n_ch, g1.bw_intra, g1.runtime_ch) == (12, 20.0, 24)  # §4.2: one A100 node
    n = graphs(NcclSystem.from_specs(NDV4, "A100"), 2, 8)
    assert (n["ring"].n_ch, n["ring"].bw_inter) == (8, 24.0) and n["tree"].bw_intra == 30.0  # §4.2 NDv4-like
    h = graphs(NcclSystem.from_specs(H100, "H100"), 1, 8)
    assert (h["ring"].n_ch, h["ring"].bw_intra) == (12, 30.0)  # §4.2: 6 x 60 duplicated
    assert (h["nvls"].n_ch, h["nvls"].bw_intra, h["nvls"].bw_inter, h["nvls"].runtime_ch) == (8, 40.0, 60.0, 16)


def test_worked_example_picks_and_times():
    """NCCL-MODEL.md §8.2-8.3: the tuner's table and its picks for 16 ranks on 2 p4d-like nodes."""
    m = _model(P4D, "A100-SXM4-80GB")
    tab = tune(m.system, "all_reduce", 16, 2, 8, m.tuning)
    assert tab[("ring", "LL")] == pytest.approx((12.8, 40.0), rel=1e-3)
    assert tab[("ring", "LL128")] == pytest.approx((23.55, 75.2), rel=1e-3)
    assert tab[("tree", "LL128")] == pytest.approx((40.0, 48.5), rel=1e-3)
    assert tab[("tree", "Simple")] == pytest.approx((44.16, 92.4), rel=1e-3)
    for size, algo, proto, t_us in ((1 << 20, "tree", "LL128", 92.2), (16 << 20, "tree", "LL128", 514.5),
                                    (1 << 30, "tree", "Simple", 24407.0)):
        c = m.choose("all_reduce", size, 16, 2)
        assert (c.algorithm, c.protocol) == (algo, proto)
        # NCCL's tuner time is the model's time less the Simple pipeline fill NCCL leaves out.
        assert c.time_us - c.pipeline_us == pytest.approx(t_us, rel=2e-3)
        assert (c.pipeline_us > 0) == (proto == "Simple")
    # The ring/Simple plateau factor (x1.4) of §3.4 at 1 MiB: 131.6 x 1.4 + the size term.
    # A ring has no pipeline fill (lockstep; a network crossing hides behind the chunk's 2nd slice).
    assert m.choose("all_reduce", 1 << 20, 16, 2).table[("ring", "Simple")] == pytest.approx(225.2, rel=2e-3)


def test_pipeline_fill_follows_nccl_chunking():
    """The Simple store-and-forward fill (pipeline_fill_us) from NCCL's chunk sizes and the graph's
    per-channel rates, by hand: p4de tree graph 4 ch x 24 GB/s intra, 12 GB/s inter, 8 CTAs."""
    m = _model(P4D, "A100-SXM4-80GB")
    c = m.choose("all_reduce", 1 << 30, 16, 2)
    assert (c.algorithm, c.protocol, c.channels, c.pipeline_unit_bytes) == ("tree", "Simple", 8, 512 << 10)
    # up and down: 7 NVLink hops at 12 GB/s and 1 network hop at 6 GB/s per CTA, less the slowest stage
    step_nvl, step_net = (512 << 10) / 12000, (512 << 10) / 6000
    assert c.pipeline_us == pytest.approx(2 * (7 * step_nvl + step_net) - step_net, rel=1e-9)
    # LL and LL128 forward line by line: no fill; a ring runs in lockstep: no fill, in one node or
    # across nodes (NCCL_ALGO=RING on the p4de graph at 1 GiB: ring/Simple).
    assert m.choose("all_reduce", 1 << 20, 16, 2).pipeline_us == 0.0  # tree/LL128
    one = m.choose("all_reduce", 1 << 30, 8, 1)
    assert (one.algorithm, one.protocol, one.pipeline_us) == ("ring", "Simple", 0.0)
    ring = NcclModel(m.system, m.tuning)
    assert ring.choose("all_reduce", 1 << 30, 16, 2).table[("ring", "Simple")] == pytest.approx(42127.0, rel=2e-3)  # §8.3
    # A broadcast is a chain: n - 1 stages of a 512 KiB step (shrunk to spread the remainder).
    b = m.choose("broadcast", 1 << 30, 8, 1)
    assert b.pipeline_stages == 6 and b.pipeline_unit_bytes == pytest.approx((1 << 30) / 24 / 86)
    assert b.pipeline_us == pytest.approx(6 * b.pipeline_unit_bytes / 10000, rel=1e-9)
    # The unit shrinks with the message: below one chunk per channel the fill scales with the size.
    small, big = m.choose("broadcast", 1 << 20, 8, 1), m.choose("broadcast", 4 << 20, 8, 1)
    if (small.protocol, big.protocol) == ("Simple", "Simple"):
        assert big.pipeline_us == pytest.approx(4 * small.pipeline_us, rel=0.3)


def test_single_node_h100_ring_ll_then_nvls():
    """§5.1: on 8 x H100 Ring/LL (15 µs, 80.6 GB/s) wins small sizes, NVLS (25 µs, 272 GB/s) from
    about 1.2 MiB; without NVLS the large sizes go to Ring/Simple at 360 GB/s busbw."""
    m = _model(H100, "H100")
    tab = tune(m.system, "all_reduce", 8, 1, 8, m.tuning)
    assert tab[("ring", "LL")] == pytest.approx((80.57, 15.0), rel=1e-3)
    assert tab[("nvls", "Simple")] == pytest.approx((272.0, 25.0), rel=1e-3)
    assert m.choose("all_reduce", 1 << 20, 8, 1).algorithm == "ring"
    assert m.choose("all_reduce", 2 << 20, 8, 1).algorithm == "nvls"
    plain = _model(NS(**{**vars(H100), "nvls": False}), "H100")
    big = plain.choose("all_reduce", 1 << 30, 8, 1)
    assert (big.algorithm, big.protocol) == ("ring", "Simple")
    assert (1 << 30) / big.time_us / 1e3 * 2 * 7 / 8 == pytest.approx(360, rel=0.02)


def test_which_algorithms_are_enabled():
    m = _model(H100, "H100")
    # NVLS Tree only across nodes; PAT only for all_gather/reduce_scatter with one rank per node.
    assert not any(a == "nvls_tree" for a, _ in tune(m.system, "all_reduce", 8, 1, 8, m.tuning))
    assert any(a == "nvls_tree" for a, _ in tune(m.system, "all_reduce", 16, 2, 8, m.tuning))
    assert any(a == "pat" for a, _ in tune(m.system, "all_gather", 64, 64, 1, m.tuning))
    assert not any(a == "pat" for a, _ in tune(m.system, "all_gather", 64, 8, 8, m.tuning))
    assert not any(a == "tree" for a, _ in tune(m.system, "all_gather", 16, 2, 8, m.tuning))
    # CollNet only where the fabric has SHARP.
    assert not any(a.startswith("collnet") for a, _ in tune(m.system, "all_reduce", 16, 2, 8, m.tuning))
    sharp = _model(NS(**{**vars(H100), "sharp": True}), "H100")
    assert any(a.startswith("collnet") for a, _ in tune(sharp.system, "all_reduce", 16, 2, 8, sharp.tuning))
    # PAT's logarithmic latency beats the ring's linear one for small all-gathers at 1 GPU per node.
    c = m.choose("all_gather", 64 << 10, 128, 128, 1)
    assert c.algorithm == "pat"
    assert m.choose("all_gather", 16 << 30, 128, 128, 1).algorithm == "ring"  # PAT pays its 0.75 factor
    # CPU profiles have no NCCL model.
    assert NcclSystem.from_specs(H100, "CPU (x86_64)") is None


def test_crossovers_follow_the_documented_table():
    """NCCL-MODEL.md §6.5 (NCCL's own constants, AllReduce, 8 A100 per node, Intel hosts): the pick
    by size for 2, 4 and 8 nodes, with 8 x 200 Gb/s and with 4 x 100 Gb/s NICs per node."""
    doc = {
        ("ndv4", 2): [("tree", "LL", 8), ("ring", "LL", 256 << 10), ("tree", "LL128", 512 << 10),
                    ("ring", "LL128", 16 << 20), ("ring", "Simple", 64 << 20)],
        ("ndv4", 4): [("tree", "LL", 8), ("tree", "LL128", 256 << 10), ("ring", "LL128", 32 << 20), ("ring", "Simple", 128 << 20)],
        ("ndv4", 8): [("tree", "LL", 8), ("tree", "LL128", 256 << 10), ("ring", "LL128", 64 << 20), ("ring", "Simple", 256 << 20)],
        ("p4d", 2): [("tree", "LL", 8), ("tree", "LL128", 256 << 10), ("tree", "Simple", 512 << 20)],
        ("p4d", 4): [("tree", "LL", 8), ("tree", "LL128", 128 << 10), ("ring", "LL128", 8 << 20), ("ring", "Simple", 128 << 20)],
        ("p4d", 8): [("tree", "LL", 8), ("tree", "LL128", 256 << 10), ("ring", "LL128", 32 << 20), ("ring", "Simple", 256 << 20)],
    }
    for (name, nodes), steps in doc.items():
        node = NDV4 if name == "ndv4" else P4D
        m = _model(node, "A100")
        got, prev = [], None
        for k in range(3, 34):
            c = m.choose("all_reduce", 1 << k, 8 * nodes, nodes)
            if (c.algorithm, c.protocol) != prev:
                prev = (c.algorithm, c.protocol)
                got.append((*prev, 1 << k))
        assert got == steps, (name, nodes, got)
    # 32 nodes, 512 MiB: §6.5 has Tree/Simple, a near tie; NCCL ranks on its tuner time, without
    # the Simple pipeline fill the model adds (rank_on_tuner_time reproduces NCCL's rule).
    m = _model(NDV4, "A100")
    assert m.choose("all_reduce", 512 << 20, 256, 32).algorithm == "ring"
    nccl_rule = NcclModel(m.system, NcclTuning(rank_on_tuner_time=True)).choose("all_reduce", 512 << 20, 256, 32)
    assert (nccl_rule.algorithm, nccl_rule.protocol) == ("tree", "Simple")
    # pick_on_own_table: whatever the calibration, the pair is the one NCCL's own table picks.
    own = NcclModel(m.system, NcclTuning(rank_on_tuner_time=True))
    cal = NcclModel(m.system, NcclTuning(latency_scale=3.0, ll128_bw_scale=0.2, pick_on_own_table=True))
    moved = 0
    for k in range(3, 34, 2):
        a, b = own.choose("all_reduce", 1 << k, 16, 2), cal.choose("all_reduce", 1 << k, 16, 2)
        assert (a.algorithm, a.protocol) == (b.algorithm, b.protocol)
        free = NcclModel(m.system, NcclTuning(latency_scale=3.0, ll128_bw_scale=0.2)).choose("all_reduce", 1 << k, 16, 2)
        moved += (free.algorithm, free.protocol) != (a.algorithm, a.protocol)
    assert moved > 0  # the calibrated ranking does move the picks, so the check above has teeth


def test_channels_shrink_for_small_messages():
    m = _model(H100, "H100")
    small, big = m.choose("all_reduce", 4096, 8, 1), m.choose("all_reduce", 1 << 20, 8, 1)
    assert small.channels < big.channels == 24


SYSTEMS = {
    "p4de-efa": ("A100-SXM4-80GB", "p4de-*", 2039.0),
    "p5-efa": ("NVIDIA H100 80GB HBM3", "p5-*", 3350.0),
    "azure-ndv4": ("A100-SXM4-40GB", "azure-ndv4-*", 1555.0),
}
# Worst |relative error| reached per log (>= 64 KiB, < 64 KiB), with about 1.5 points of slack
# over what the fit reaches (bench/bench_nccl.py prints the figures). The targets are 10 % / 25 %;
# every log but Azure 8 GPUs meets them (asserted at the target below); Azure 8 GPUs misses
# (10.5 % from 64 KiB, at 64 MiB), with the cause in docs/design-notes.md. These bounds guard
# against regressions.
BOUNDS = {
    "p4de-2nodes-16gpu_all_reduce_perf.txt": (0.09, 0.13),
    "p5-2nodes-16gpu_all_reduce_perf.txt": (0.09, 0.09),
    "azure-ndv4-a100-40gb-1gpu_all_reduce_perf.txt": (0.075, 0.09),
    "azure-ndv4-a100-40gb-2gpu_all_reduce_perf.txt": (0.085, 0.15),
    "azure-ndv4-a100-40gb-4gpu_all_reduce_perf.txt": (0.10, 0.18),
    "azure-ndv4-a100-40gb-8gpu_all_reduce_perf.txt": (0.12, 0.13),
    "azure-ndv4-a100-40gb-16gpu_all_reduce_perf.txt": (0.10, 0.18),
    "azure-ndv4-a100-40gb-32gpu_all_reduce_perf.txt": (0.10, 0.12),
}
MEETS_TARGET = ("p4de-", "p5-", "azure-ndv4-a100-40gb-1gpu", "azure-ndv4-a100-40gb-2gpu", "azure-ndv4-a100-40gb-4gpu",
                "azure-ndv4-a100-40gb-16gpu", "azure-ndv4-a100-40gb-32gpu")


@pytest.fixture(scope="module")
def fitted():
    warnings.simplefilter("ignore")  # constants at their bounds warn; the bounds are checked below
    out = {}
    for topo, (device, pat, hbm) in SYSTEMS.items():
        spec = load_topology(topo)
        system = NcclSystem.from_specs(spec.node, device)
        logs = [read_log(p, 8) for p in sorted(LOGS.glob(pat))]
        cal = fit_system(system, logs, hbm, topo)
        out[topo] = (spec, system, logs, cal)
    return out


def test_one_fit_per_system_reproduces_its_logs(fitted):
    for topo, (spec, system, logs, cal) in fitted.items():
        model = NcclModel(system, NcclTuning.from_comm(NS(nccl=cal)))
        for row in error_table(model, logs):
            hi, lo = BOUNDS[row["log"]]
            assert row["worst_ge_64KiB"] <= hi, (topo, row)
            if row["worst_lt_64KiB"] is not None:
                assert row["worst_lt_64KiB"] <= lo, (topo, row)
        # Physics: the fitted bandwidth scales stay within what the links carry.
        intra_hi, inter_hi = physical_bounds(system)
        assert cal.intra_bw_scale <= intra_hi + 1e-9 and cal.inter_bw_scale <= inter_hi + 1e-9 and inter_hi <= 1.12
        assert cal.copy_GBps is None or cal.copy_GBps <= SYSTEMS[topo][2] / 2


def test_logs_that_meet_the_targets(fitted):
    """p4de, p5 (EFA, one process per GPU), Azure 1 GPU (a copy), Azure 2 and 4 GPUs (one host
    thread) and Azure 16 and 32 GPUs (2 and 4 nodes) meet the issue's targets: 10 % from 64 KiB,
    25 % below."""
    seen = 0
    for topo, (spec, system, logs, cal) in fitted.items():
        model = NcclModel(system, NcclTuning.from_comm(NS(nccl=cal)))
        for row in error_table(model, logs):
            if row["log"].startswith(MEETS_TARGET):
                seen += 1
                assert row["worst_ge_64KiB"] <= 0.10, row
                assert row["worst_lt_64KiB"] is None or row["worst_lt_64KiB"] <= 0.25, row
    assert seen == 7


def test_fitted_constants_within_physics(fitted):
    for topo, (spec, system, logs, cal) in fitted.items():
        checks = physics_checks(system, cal, SYSTEMS[topo][2], [(l.n_ranks, l.n_nodes) for l in logs])
        assert all(ok for _, _, ok in checks), (topo, checks)
    # The Azure fit: NVLink at most its 300 GB/s spec, the NICs below their 200 Gb/s line rate
    # (128 GB/s busbw at 16 GPUs), a cost per channel of about 1.2 µs (the single-node steps of
    # 1.3-1.8 µs per added channel), about one exposed read+write pass at HBM rate.
    cal = fitted["azure-ndv4"][3]
    assert 0.6 < cal.inter_bw_scale < 0.8 and 0.9 < cal.intra_bw_scale <= 1.25 + 1e-9
    assert 0.8 < cal.channel_us < 1.6
    assert 1555.0 / 2 / 2 < cal.mem_GBps < 1555.0 / 2 * 1.6
    assert 3.8 < cal.launch_us < 4.6  # the 8-GPU floor: 31 µs = 8 launches
    # A network step beyond a channel's first loop costs a couple of µs (Azure 32 GPUs: the Tree/
    # LL128 chunk time at 18,000 B is ~4.4 µs where 2.3 µs moves the bytes); Simple's latency
    # across nodes well under NCCL's AMD-host ring formula (netOverhead x 3 per NVLink step).
    assert 1.0 < cal.net_step_us < 4.0 and cal.runtime_chunking
    assert ring_simple_floor(fitted["azure-ndv4"][1], [(16, 2), (32, 4)]) - 1e-6 <= cal.inter_simple_latency_scale < 0.5 < cal.simple_latency_scale


def test_held_out_log_predicted_from_the_others(fitted):
    """Overfitting guard: Azure fitted without its 32-GPU log predicts that log within 15.1 % from
    64 KiB and 16.4 % below (fitted on it: 9.9 % / 10.7 %): the constants carry over from 16 to 32
    GPUs, less well at small sizes (the 4-node tree's latency is only seen at 2 nodes)."""
    spec, system, logs, _ = fitted["azure-ndv4"]
    name = "azure-ndv4-a100-40gb-32gpu_all_reduce_perf.txt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cal = fit_system(system, [l for l in logs if l.name != name], SYSTEMS["azure-ndv4"][2], "azure-ndv4")
    (row,) = error_table(NcclModel(system, NcclTuning.from_comm(NS(nccl=cal))), [l for l in logs if l.name == name])
    assert row["worst_ge_64KiB"] <= 0.165 and row["worst_lt_64KiB"] <= 0.18, row


def test_measured_time_is_the_better_column():
    """Both columns of a 2+ rank log time the same collective; noise only adds, so the smaller is
    kept (p5 64 KiB: 135.1 out-of-place, 103.8 in-place). One rank: in-place does nothing (0.47
    µs), so the out-of-place copy is kept."""
    p5 = read_log(LOGS / "p5-2nodes-16gpu_all_reduce_perf.txt", 8)
    assert p5.time_us[p5.size_bytes == 64 << 10][0] == pytest.approx(103.8)
    assert p5.time_us[p5.size_bytes == 8][0] == pytest.approx(69.12)  # out-of-place is the smaller there
    one = read_log(LOGS / "azure-ndv4-a100-40gb-1gpu_all_reduce_perf.txt", 8)
    assert one.time_us[one.size_bytes == 64 << 10][0] == pytest.approx(4.51)
    assert (one.n_ranks, one.gpus_per_thread) == (1, 1)
    eight = read_log(LOGS / "azure-ndv4-a100-40gb-8gpu_all_reduce_perf.txt", 8)
    assert (eight.n_ranks, eight.n_nodes, eight.gpus_per_thread) == (8, 1, 8)


def test_measured_terms_add_to_the_time_as_documented():
    """The three measured terms NCCL's tuner lacks: a cost per channel launched, an exposed
    memory pass per byte, and a 1-rank copy's own start-up overlapped with the launch."""
    sys_ = NcclSystem.from_specs(NDV4, "A100")
    base = NcclModel(sys_)
    for size in (256 << 10, 64 << 20):
        c0 = base.choose("all_reduce", size, 8, 1)
        c1 = NcclModel(sys_, NcclTuning(channel_us=1.5)).choose("all_reduce", size, 8, 1)
        if (c1.algorithm, c1.protocol) == (c0.algorithm, c0.protocol):
            assert c1.time_us - c0.time_us == pytest.approx(1.5 * c0.channels)
            assert c1.channel_cost_us == pytest.approx(1.5 * c0.channels)
        c2 = NcclModel(sys_, NcclTuning(mem_GBps=700.0)).choose("all_reduce", size, 8, 1)
        if (c2.algorithm, c2.protocol) == (c0.algorithm, c0.protocol):
            assert c2.time_us - c0.time_us == pytest.approx(size / 700e3)
    cp = NcclModel(sys_, NcclTuning(launch_us=4.0, copy_GBps=650.0, copy_latency_us=3.8))
    assert cp.choose("all_reduce", 64 << 10, 1, 1).time_us == pytest.approx(4.0)  # launch-bound
    assert cp.choose("all_reduce", 1 << 30, 1, 1).time_us == pytest.approx(3.8 + (1 << 30) / 650e3)


def _profile_with(cal, base: str):
    p = load_profile(base)
    return p.model_copy(update={"comm": p.comm.model_copy(update={"nccl": cal})})


def test_collective_simulate_and_validate_use_one_curve(fitted):
    """Calibrated on the p4de log: `collective`, both of simulate's networks, the sweep's
    function and validate's FittedNetwork give the same time for an uncontended collective."""
    from simulator.calibrate.network import FittedNetwork

    spec, system, logs, cal = fitted["p4de-efa"]
    prof = _profile_with(cal, "a100-sxm-80gb")
    flow = FlowNetwork.from_profile(spec, 16, prof)
    tier = TierNetwork.from_profile(spec.node, prof)
    fitted_net = FittedNetwork(flow, prof.comm, 8)
    (log,) = logs
    g = np.arange(16)[None, :]
    model = NcclModel(system, NcclTuning.from_comm(prof.comm))
    for s in (8, 64 << 10, 1 << 20, 16 << 20, 1 << 30):
        req = CollectiveRequest("all_reduce", "dp", g, float(s))
        t = model.choose("all_reduce", s, 16, 2).time_us * 1e-6
        assert flow.collective_time_s(req) == pytest.approx(t, rel=1e-9)
        assert tier.collective_time_s(req) == pytest.approx(t, rel=1e-9)
        assert fitted_net.collective_time_s(req) == pytest.approx(t, rel=1e-9)
        assert collective_time_s("all_reduce", s, g[0], spec, prof) == pytest.approx(t, rel=1e-9)
        env = simpy.Environment()
        ev = flow.start(env, req)
        env.run(ev)
        assert env.now == pytest.approx(t, rel=1e-9)
    # The flow-level run (fast path off: real flows under max-min) ends at the same time.
    slow = FlowNetwork.from_profile(spec, 16, prof, fast_path=False)
    env = simpy.Environment()
    req = CollectiveRequest("all_reduce", "dp", g, float(64 << 20))
    ev = slow.start(env, req)
    env.run(ev)
    assert env.now == pytest.approx(flow.collective_time_s(req), rel=1e-6)


def test_contention_still_shares_links(fitted):
    spec, system, logs, cal = fitted["p4de-efa"]
    prof = _profile_with(cal, "a100-sxm-80gb")
    net = FlowNetwork.from_profile(spec, 16, prof)
    req = CollectiveRequest("all_reduce", "dp", np.arange(16)[None, :], float(256 << 20))
    alone = net.collective_time_s(req)
    env = simpy.Environment()
    a, b = net.start(env, req), net.start(env, req)
    env.run(env.all_of([a, b]))
    lat = net.nccl_choice(req).latency_us * 1e-6
    assert env.now == pytest.approx(lat + 2 * (alone - lat), rel=0.02)


def test_collective_cli_reproduces_each_log_with_its_calibration(fitted, tmp_path):
    for topo, (spec, system, logs, cal) in fitted.items():
        base = "h100-sxm-80gb" if topo == "p5-efa" else "a100-sxm-80gb"
        path = tmp_path / f"{topo}.json"
        path.write_text(_profile_with(cal, base).model_dump_json())
        model = NcclModel(system, NcclTuning.from_comm(NS(nccl=cal)))
        for log in logs:
            if log.n_ranks < 2:
                continue
            rows, _, note = simulate_sweep("all_reduce", log.n_ranks, topo, str(path), int(log.size_bytes[0]),
                                           int(log.size_bytes[-1]), 2.0, gpus_per_thread=log.gpus_per_thread)
            assert "calibrated" in note
            pred = {r["size_bytes"]: r["time_us"] for r in rows}
            e = errors(model, log)
            for s, err, meas in zip(log.size_bytes, e, log.time_us):
                if int(s) in pred:
                    assert pred[int(s)] / meas - 1 == pytest.approx(err, abs=1e-9)


def test_explain_prints_choice_per_size(tmp_path):
    # NCCL's own constants (the shipped A100 profile carries the Azure NDv4 calibration).
    raw = tmp_path / "a100-nccl-own.json"
    raw.write_text(_profile_with(None, "a100-sxm-80gb").model_dump_json())
    res = CliRunner().invoke(collective_app, ["all_reduce", "--gpus", "16", "--topology", "p4de-efa", "--gpu", str(raw),
                                              "-b", "1M", "-e", "1G", "-f", "1024", "--explain"])
    assert res.exit_code == 0, res.output
    rows = [l.split() for l in res.stdout.splitlines() if l and not l.startswith("#")]
    assert [r[:3] for r in rows] == [["1048576", "tree", "LL128"], ["1073741824", "tree", "Simple"]]
    assert float(rows[0][11]) == pytest.approx(92.2, rel=0.01)
    # the pipeline fill is printed: none for LL128, the tree's 15 stages of 512 KiB for Simple at 1 GiB
    assert float(rows[0][6]) == 0.0 and float(rows[1][6]) > 0 and rows[1][7:9] == ["15", "524288"]
    assert float(rows[0][13]) == 0.0  # NCCL's own model has no cost per channel
    # The shipped A100 profile (the Azure fit): the measured cost per channel is printed as its own
    # term, channels x channel_us, and the terms add up to the time.
    shipped = load_profile("a100-sxm-80gb").comm.nccl
    res = CliRunner().invoke(collective_app, ["all_reduce", "--gpus", "8", "--topology", "azure-ndv4", "--gpu", "a100-sxm-80gb",
                                              "-b", "1M", "-e", "1M", "--explain"])
    assert res.exit_code == 0, res.output
    (row,) = [l.split() for l in res.stdout.splitlines() if l and not l.startswith("#")]
    assert float(row[13]) == pytest.approx(int(row[3]) * shipped.channel_us, abs=0.06)
    assert float(row[5]) + float(row[6]) + float(row[9]) + float(row[13]) + float(row[15]) == pytest.approx(float(row[11]), abs=0.2)


def test_calibrate_writes_nccl_constants_with_provenance():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = calibrate([LOGS / "p4de-2nodes-16gpu_all_reduce_perf.txt"], "p4de", base="a100-sxm-80gb", topology="p4de-efa")
    assert p.comm.nccl is not None and p.comm.nccl.system == "p4de-efa"
    assert p.comm.nccl.net_latency_us > 5.0  # EFA's latency is far above InfiniBand's 0
    fields = {i.field for i in p.provenance.items}
    assert {"comm.nccl.latency_scale", "comm.nccl.net_latency_us", "comm.nccl.inter_bw_scale"} <= fields


def test_new_topologies_load_with_sourced_facts():
    p5, nd = load_topology("p5-efa"), load_topology("azure-ndv4")
    assert (p5.node.nics_per_node, p5.node.nic_gbps, p5.node.nvls, p5.node.cpu_vendor) == (32, 100, True, "amd")
    assert (nd.node.nics_per_node, nd.node.nic_gbps, nd.node.nvls) == (8, 200, False)
    assert load_topology("dgx-a100-fattree").node.cpu_vendor == "intel"  # the default keeps old files valid


@pytest.mark.parametrize("profile,system", [("a100-sxm-80gb", "azure-ndv4"), ("a100-sxm-40gb", "azure-ndv4"),
                                            ("h100-sxm-80gb-p5-efa", "p5-efa")])
def test_shipped_calibrations_are_the_fits(fitted, profile, system):
    """A shipped profile's comm.nccl is what the fit gives on its system's logs (not edited by hand):
    the A100 profiles carry the Azure NDv4 fit, the p5 profile the p5 log's.

    Where the logs fix only a product of two constants the fit may land anywhere along it: the p5
    log's large messages cross the nodes on LL128, so it measures inter_bw_scale x ll128_bw_scale
    and not each (0.667 x 0.820 and 0.781 x 0.700, the same errors to 1e-5; which one a fit finds
    follows the BLAS's rounding: an Intel and an AMD host here). The fit names such pairs
    (product_only) and they are compared as products; every log's worst error must be the fit's
    either way."""
    shipped = load_profile(profile).comm.nccl
    spec, nccl_system, logs, cal = fitted[system]
    assert shipped.system == system
    fit = cal.model_dump(exclude={"system", "fit_error", "product_only"}, exclude_none=True)
    assert shipped.product_only == cal.product_only
    product_only = [tuple(p) for p in cal.product_only]
    for a, b in product_only:
        assert shipped_product(shipped, a, b) == pytest.approx(fit[a] * fit[b], rel=2e-2), (a, b)
    paired = {k for pair in product_only for k in pair}
    for k, v in fit.items():
        if k not in paired:
            assert getattr(shipped, k) == pytest.approx(v, rel=2e-2, abs=1e-3), k
    for mine, theirs in zip(error_table(NcclModel(nccl_system, NcclTuning.from_comm(NS(nccl=shipped))), logs),
                            error_table(NcclModel(nccl_system, NcclTuning.from_comm(NS(nccl=cal))), logs)):
        assert mine["worst_ge_64KiB"] == pytest.approx(theirs["worst_ge_64KiB"], abs=5e-3), mine["log"]


def shipped_product(shipped, a: str, b: str) -> float:
    return getattr(shipped, a) * getattr(shipped, b)


def test_the_fit_names_a_pair_its_logs_fix_only_as_a_product(fitted):
    """p5: inter-node bandwidth and LL128's bandwidth factor multiply on the sizes the log times
    across its two nodes, so only their product is measured: the fit says so (and its calibrate
    note). The p4de and Azure logs measure each of their constants."""
    assert fitted["p5-efa"][3].product_only == [["ll128_bw_scale", "inter_bw_scale"]]
    assert fitted["p4de-efa"][3].product_only == [] and fitted["azure-ndv4"][3].product_only == []


@pytest.mark.parametrize("profile", ["a100-sxm-80gb", "h100-sxm-80gb-p5-efa"])
def test_faster_nvlink_never_slows_a_calibrated_collective(profile):
    """The fitted per-channel cost is charged up to the channels its logs ran. Charged for every
    channel, the Azure fit (1.41 µs a channel) made a 4-GPU 16 MiB all_gather 129.6 µs at 300 GB/s
    NVLink and 153.4 µs at 1,200 (24 -> 64 channels), a faster fabric running slower. Asserted where
    bandwidth matters (16 MiB up). Below a few MiB a node whose graph has more channels launches
    more of them, each at the measured cost (A100, 4-GPU 1 MiB all_gather: 37.7 µs at 150 GB/s,
    53.1 at 300): the model's own law inside the fitted range, left as found (design notes)."""
    prof = load_profile(profile)
    spec = load_topology("dgx-a100-fattree" if profile.startswith("a100") else "dgx-h100-fattree")
    tn = NcclTuning.from_comm(prof.comm)
    assert tn.channel_us > 0 and tn.channel_us_max_channels is not None
    for op, n in (("all_gather", 4), ("all_reduce", 8), ("reduce_scatter", 8)):
        for size in (1 << 24, 1 << 26, 1 << 28):
            times = []
            # (not 1,800 on these Hopper/Ampere ladders: search.cc's channel duplication halves
            # bwIntra even where MAX_SEARCH_CHANNELS caps the doubling, 30 -> 32 channels at half
            # the rate: NCCL's own artifact, kept by the faithful graph model)
            for nvl in (150.0, 300.0, 450.0, 600.0, 900.0, 1200.0):
                node = spec.node.model_copy(update={"nvlink_GBps": nvl})
                times.append(NcclModel(NcclSystem.from_specs(node, prof.device), tn).choose(op, float(size), n, 1).time_us)
            assert all(b <= a * (1 + 1e-9) for a, b in zip(times, times[1:])), (op, n, size, times)


@pytest.mark.parametrize("topology,gpu", [("dgx-b200", "b200"), ("dgx-h100-nvls", "h100-sxm-80gb"),
                                          ("dgx-h100-fattree", "h100-sxm-80gb"), ("dgx-a100-fattree", "a100-sxm-80gb")])
@pytest.mark.parametrize("nodes", [2, 4, 8])
def test_a_multi_node_all_reduce_never_beats_the_nics(topology, gpu, nodes):
    """Each node's reduced buffer leaves through its NICs, 2(m-1)/m of it over m nodes: algbw <=
    egress x m / (2(m-1)). NCCL's tuner doubles nvls_tree's inter-node bandwidth at <= 2 nodes
    (§5.1), which put B200 on 2 nodes at 408 GB/s of algbw over 8 x 50 GB/s of NICs."""
    node = load_topology(topology).node
    m = NcclModel.from_specs(node, load_profile(gpu))
    egress = node.nics_per_node * min(node.nic_GBps, m.system.pcie_GBps)
    for size in (1 << 26, 1 << 30, 1 << 33):
        c = m.choose("all_reduce", float(size), nodes * node.gpus_per_node, nodes)
        algbw = size / (c.time_us * 1e-6) / 1e9
        assert algbw <= egress * nodes / (2 * (nodes - 1)) * (1 + 1e-9), (c.algorithm, c.protocol, algbw)


def test_logs_of_one_shape_far_apart_are_said_to_be_two_systems(tmp_path):
    # Two logs of the same collective and group shape, times 2x apart, were fitted as one system
    # without a word (the held-out error, on medians, read 1.7%).
    from simulator.calibrate.nccl_fit import disagreeing_logs

    src = LOGS / "p4de-2nodes-16gpu_all_reduce_perf.txt"
    slow = tmp_path / "slow_all_reduce_perf.txt"
    lines = []
    for line in src.read_text().splitlines():
        tok = line.split()
        o = 1 if tok and tok[0].endswith(":") else 0
        if len(tok) >= 13 + o and tok[o].isdigit():
            for j in (5 + o, 9 + o):
                tok[j] = f"{float(tok[j]) * 2:.1f}"
            for j in (6 + o, 7 + o, 10 + o, 11 + o):
                tok[j] = f"{float(tok[j]) / 2:.2f}"
            line = "  ".join(tok)
        lines.append(line)
    slow.write_text("\n".join(lines) + "\n")
    a, b = read_log(src, 8), read_log(slow, 8)
    (line,) = disagreeing_logs([a, b])
    assert "time all_reduce on 16 GPUs (2 node(s)) 2.00x apart" in line
    assert disagreeing_logs([a]) == [] and disagreeing_logs([read_log(p, 8) for p in sorted(LOGS.glob("azure-ndv4-*"))]) == []
