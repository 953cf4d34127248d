"""Fitting the few per-system constants of NCCL's cost model (simulator.network.nccl) to
nccl-tests logs.

One fit per system (topology + GPU): every log of that system at once, whatever its rank count,
so the constants are the system's, not a size's or a log's. Fitted (``NcclCalibration``):

- latency_scale: factor on NCCL's base and per-hop latency tables;
- net_latency_us: the network latency per network hop that NCCL takes from its net plugin
  (``latencyInter``, 0 for InfiniBand): fitted only when a log crosses nodes;
- intra_bw_scale: achieved / NCCL's NVLink bandwidth (at most 1);
- inter_bw_scale: achieved / NCCL's NIC bandwidth, bounded by the NIC line rate over what NCCL
  counts (NCCL uses ladder speeds below the line rate): fitted only when a log crosses nodes;
- launch_us: host launch cost per GPU one thread drives: nccl-tests run with ``-g G`` (one
  process driving G GPUs, read from the log's header) pays G launches per iteration;
- copy_GBps, copy_latency_us: only with a 1-rank log (a device-to-device copy: rate at most half
  the HBM bandwidth, and its start-up);
- intra_ll_bw_scale: LL's factor inside one node when the system also has multi-node logs;
- cta_bound_intra (structure, always on in a fit): inside one node a collective gets the
  bandwidth of only the CTAs NCCL's channel rule (§3.7) launches;
- channel_us: a cost per channel (CTA) a collective launches, which NCCL's tuner does not have:
  on one A100 node (Azure 2, 4, 8 GPUs) the time steps by 1.3-1.8 µs each time NCCL's own
  channel rule (§3.7) adds a channel at constant bytes per channel, and the LL128 "latency" is
  55-60 µs at 2, 4 and 8 GPUs alike (24 channels) where NCCL's grows with the rank count.

- ll_bw_scale, ll128_bw_scale: achieved / NCCL's LL and LL128 bandwidth factors (at most 1);
- ll128_latency_scale, simple_latency_scale: the LL128 and Simple latencies relative to LL's (the
  Simple pipeline fill, which NCCL's own 2.18 comment folds into the Tree/Simple latency, is an
  explicit term of the model now: ``simulator.network.nccl.pipeline_fill_us``, no constant);
- intra_latency_scale: latency_scale for collectives inside one node (fitted only with such logs);
- net_step_us (multi-node logs): a cost per network step a channel runs beyond its first loop,
  with the steps of NCCL's own chunking (``simulator.network.nccl.chunking``, calcCollChunking,
  NCCL-MODEL.md §4.4); runtime_chunking (structure, always on in a fit): Tree/LL128 across nodes
  takes its size dependence from that chunk count instead of the tuner's treeCorrectionFactor;
- inter_simple_latency_scale (multi-node and single-node logs together): the Ring/Simple latency
  scale across nodes apart from inside one node (NCCL's Simple ring latency across nodes charges
  netOverhead x 3 per NVLink step, §3.3, which one node does not), no lower than Ring/LL's
  latency on the same ring (``ring_simple_floor``).

The objective is the relative time error at every size, weighted by the tolerance the issue
asks for (10 % from 64 KiB, 25 % below), as |log-ratio / tolerance|^3 (leaning towards the worst
sizes, which the targets are about) under a soft-L1 loss so one noisy row does not drag the
system's constants; each log weighs the same whatever its number of rows.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simulator.errors import UserError
from simulator.profile import NcclCalibration
from simulator.network.nccl import NcclModel, NcclSystem, NcclTuning

_NGPUS = re.compile(r"nGpus\s+(\d+)")
_SMALL_BYTES = 64 << 10
# At most this many read+write passes over the buffer can be exposed: a Simple ring step reads its
# input and the received chunk and writes the result (about 3 passes of traffic per byte moved).
MAX_MEM_PASSES = 3.0
# Protocol bandwidth factors hopped to either end from the best point (fit_system)
HOPS = (("ll_bw_scale", 0.15), ("ll_bw_scale", 1.0), ("ll128_bw_scale", 0.15), ("ll128_bw_scale", 1.0))


@dataclass
class NcclLog:
    """The rows of one nccl-tests run: what the fit and the error table need."""

    name: str
    op: str
    n_ranks: int
    n_nodes: int
    gpus_per_thread: int
    size_bytes: np.ndarray
    time_us: np.ndarray  # out-of-place column (median of the rows of a size)


def read_log(path: str | Path, gpus_per_node: int, collective: str | None = None) -> NcclLog:
    """One nccl-tests log; ``collective`` names what a log that does not say measured (--collective)."""
    from simulator.trace.nccl_tests import import_nccl_tests

    path = Path(path)
    res = import_nccl_tests(path, collective=collective)
    t = res.table
    t = t[t["time_us"] > 0]
    n = int(res.nranks or t["nranks"].dropna().max())
    if n <= 1:
        # One rank: out-of-place is a device-to-device copy; in-place does nothing (0.47 µs on
        # the Azure 1-GPU log: no kernel at all), so only the out-of-place column measures a copy.
        t = t[~t["in_place"]]
    nodes = len(res.hosts) if res.hosts else max(1, math.ceil(n / gpus_per_node))
    text = path.read_text(errors="replace")
    m = _NGPUS.search(text)
    gpt = int(m.group(1)) if m else 1
    # With 2+ ranks both columns run the same collective (same algorithm, same bytes on the
    # wire; FORMATS.md §5): two measurements of one time. Interference on a shared host or
    # fabric only ever adds time, so the smaller of the two is the better estimate (p5 64 KiB:
    # 135.1 µs out-of-place, 103.8 µs in-place, between 89.8 at 32 KiB and 96.6 at 128 KiB;
    # Azure 32 GPUs 2 KiB: 146.7 vs 54.4 µs).
    g = t.groupby(["size_bytes", "in_place"])["time_us"].median().unstack().min(axis=1).sort_index()
    op = str(t["collective"].iloc[0]) if len(t) else "all_reduce"
    return NcclLog(path.name, op, n, nodes, gpt, g.index.to_numpy(float), g.to_numpy(float))


def predict_us(model: NcclModel, log: NcclLog) -> np.ndarray:
    ppn = max(1, math.ceil(log.n_ranks / log.n_nodes))
    return np.array([model.choose(log.op, float(s), log.n_ranks, log.n_nodes, ppn, log.gpus_per_thread).time_us
                     for s in log.size_bytes])


def errors(model: NcclModel, log: NcclLog) -> np.ndarray:
    """Signed relative time error (predicted - measured) / measured at every size."""
    return predict_us(model, log) / log.time_us - 1.0


def _tolerance(sizes: np.ndarray) -> np.ndarray:
    return np.where(sizes >= _SMALL_BYTES, 0.10, 0.25)


def physical_bounds(system: NcclSystem) -> tuple[float, float]:
    """Upper bounds of the bandwidth scales from the hardware: NCCL counts NVLink at its per-link
    constant (A100: 20 of 25 GB/s per link, NCCL-MODEL.md §1.8), so NVLink can deliver at most
    25/20 of it; NCCL's graph runs a NIC at the highest ladder speed not above its line rate
    (12 of 12.5 GB/s for 100 Gb/s), so a NIC delivers at most line / ladder of it."""
    from simulator.network.nccl import NVLINK_PER_LINK_GBPS, NVLINK_SPEC_PER_LINK_GBPS, graphs

    intra = NVLINK_SPEC_PER_LINK_GBPS[system.gen] / NVLINK_PER_LINK_GBPS[system.gen]
    g = graphs(system, 2, system.gpus_per_node)["ring"]
    per_nic = min(system.nic_GBps, system.pcie_GBps)
    inter = max(1.0, per_nic * system.nics_per_node / max(g.n_ch * g.bw_inter, 1e-9))
    return float(intra), float(inter)


def ring_simple_floor(system: NcclSystem, shapes: list[tuple[int, int]]) -> float:
    """The lowest Simple latency scale across nodes at which Ring/Simple starts no sooner than
    Ring/LL on the same ring: Simple waits on a fenced counter per step where LL polls a flag in
    the data (NCCL-MODEL.md §2.1), so its latency is no lower. From NCCL's own tables (§3.3, the
    ×1.4 plateau of §3.4 included), the largest ratio over the (ranks, nodes) shapes given."""
    from simulator.network.nccl import algo_time_us, graphs, tune

    floor = 0.0
    for n, nodes in shapes:
        if nodes < 2:
            continue
        ppn = max(1, math.ceil(n / nodes))
        table = tune(system, "all_reduce", n, nodes, ppn, NcclTuning())
        if ("ring", "LL") not in table or ("ring", "Simple") not in table:
            continue
        rt = graphs(system, nodes, ppn)["ring"].runtime_ch
        big = float(1 << 30)
        ll = algo_time_us(system, "all_reduce", big, n, nodes, "ring", "LL", *table[("ring", "LL")], rt)[1]
        simple = algo_time_us(system, "all_reduce", big, n, nodes, "ring", "Simple", *table[("ring", "Simple")], rt)[1]
        floor = max(floor, ll / simple)
    return floor


# A constant the logs measure moves the fit's cost by more than this when scaled by
# PRODUCT_STEP; a pair whose product-preserving move stays within PRODUCT_FLAT of the cost is fixed
# only as a product.
PRODUCT_STEP = 0.1
PRODUCT_FLAT = 1e-3
PRODUCT_SEEN = 1e-2
# Scaled Jacobian columns this close (relative) make a pair a candidate for the cost test.
PRODUCT_CANDIDATE = 0.2


def product_only_pairs(resid, x, names: list[str], lo: list[float], hi: list[float],
                       jac: np.ndarray) -> list[tuple[str, str]]:
    """Pairs of fitted constants the logs fix only as a product: scaling one up by PRODUCT_STEP and
    the other down by as much leaves the cost (sum of squared residuals) within PRODUCT_FLAT of
    itself, while scaling either alone moves it by more than PRODUCT_SEEN. The p5 log's large
    messages cross its nodes on LL128, so it measures inter_bw_scale x ll128_bw_scale and the fit
    lands anywhere along that product (which point follows the host's floating-point rounding).

    ``jac`` (the fit's Jacobian at x) picks the candidates first: a product-preserving move
    changes the residuals by about step x (column i x x_i - column j x x_j), so only pairs whose
    scaled columns nearly coincide are tried on the cost itself (a fit of six logs has ~130 pairs)."""
    x = np.asarray(x, float)
    base = float(np.sum(resid(x) ** 2))
    cols = np.asarray(jac, float) * x
    norm = np.linalg.norm(cols, axis=0)
    candidates = {(i, j) for i in range(len(x)) for j in range(i + 1, len(x))
                  if norm[i] > 0 and norm[j] > 0
                  and np.linalg.norm(cols[:, i] - cols[:, j]) <= PRODUCT_CANDIDATE * max(norm[i], norm[j])}

    def cost(scale: dict[int, float]) -> float | None:
        y = x.copy()
        for i, f in scale.items():
            y[i] *= f
            if not lo[i] <= y[i] <= hi[i]:
                return None
        return float(np.sum(resid(y) ** 2))

    def moves(scale_sets) -> list[float]:
        return [abs(c - base) for c in (cost(sc) for sc in scale_sets) if c is not None]

    up, down = 1 + PRODUCT_STEP, 1 / (1 + PRODUCT_STEP)
    involved = sorted({i for pair in candidates for i in pair})
    seen = {i for i in involved if x[i] > 0 and any(m > PRODUCT_SEEN * base for m in moves([{i: up}, {i: down}]))}
    pairs = []
    for i, j in sorted(candidates):
        if i in seen and j in seen:
            flat = moves([{i: up, j: down}, {i: down, j: up}])
            if flat and min(flat) <= PRODUCT_FLAT * base:
                pairs.append((names[i], names[j]))
    return pairs


def fit_system(system: NcclSystem, logs: list[NcclLog], hbm_GBps: float | None = None,
               system_name: str = "", note=None, n_random_starts: int = 4) -> NcclCalibration:
    """The system's constants from all its logs (see the module docstring)."""
    from scipy.optimize import least_squares

    # One canonical order: the optimiser's path (and so which local minimum it ends in) must not
    # depend on the order the caller lists the logs in.
    logs = sorted(logs, key=lambda l: (l.n_ranks, l.n_nodes, l.name))
    multi = any(l.n_nodes > 1 for l in logs)
    single_rank = [l for l in logs if l.n_ranks <= 1]
    intra_hi, inter_hi = physical_bounds(system)
    # Physics bounds. Latencies: LL and LL128 at least NCCL's own (its tuner is optimistic,
    # NCCL-MODEL.md §8.4), so the regime scales and the LL128 scale are >= 1; Simple may go
    # below (0.2) because its pipeline fill, which NCCL's Simple latency folds in (2.18 comment,
    # §1.6), is an explicit term here. Bandwidth scales <= 1 of NCCL's protocol factors.
    # channel_us: 0-10 µs per channel (a sanity cap, not a physical limit: one channel's
    # set-up is a few µs of host or device work at most).
    names = ["ll_bw_scale", "ll128_bw_scale", "ll128_latency_scale", "simple_latency_scale", "channel_us"]
    lo = [0.05, 0.05, 1.0, 0.2, 0.0]
    hi = [1.0, 1.0, 5.0, 5.0, 10.0]
    x0 = [0.8, 0.8, 1.2, 1.0, 1.0]
    for key, seen in (("latency_scale", multi), ("intra_latency_scale", any(l.n_nodes == 1 and l.n_ranks > 1 for l in logs))):
        if seen:  # a latency scale only where a log runs collectives of that kind
            names.append(key)
            lo.append(1.0)
            hi.append(5.0)
            x0.append(1.0)
    if any(l.gpus_per_thread > 1 or l.n_ranks <= 1 for l in logs):
        # The host launch cost shows only where launches bound a run: one thread driving several
        # GPUs, or a 1-rank copy; elsewhere NCCL's latency hides it and it is not fitted.
        names.append("launch_us")
        lo.append(0.0)
        hi.append(20.0)
        x0.append(1.0)
    if any(l.n_nodes == 1 and l.n_ranks > 1 for l in logs) or system.nvls:
        # NVLink bandwidth is seen only by single-node logs (and by NVLS inside a node); otherwise
        # it stays NCCL's own.
        if multi and any(l.n_nodes == 1 and l.n_ranks > 1 for l in logs):
            # LL inside one node (SMs on NVLink) apart from LL across nodes (through the proxy
            # and the NIC), only where logs of both kinds are fitted together
            names.append("intra_ll_bw_scale")
            lo.append(0.05)
            hi.append(1.0)
            x0.append(0.8)
        names.append("intra_bw_scale")
        lo.append(0.2)
        hi.append(intra_hi)
        x0.append(0.8)
    if multi:
        names += ["net_latency_us", "inter_bw_scale"]
        lo += [0.0, 0.2]
        hi += [200.0, inter_hi]
        x0 += [5.0, 0.9]
        # A cost per network step beyond a channel's first loop (NCCL's proxy runs the steps of
        # calcCollChunking one after another, §4.4): 0-10 µs, a sanity cap like channel_us (a
        # step is a few µs of proxy work and NIC handshake at most).
        names.append("net_step_us")
        lo.append(0.0)
        hi.append(10.0)
        x0.append(1.0)
        if any(l.n_nodes == 1 and l.n_ranks > 1 for l in logs):
            # Ring/Simple's latency across nodes apart from inside one node: NCCL's ring formula
            # charges every NVLink step max(hwLat, netOverhead x 3) across nodes (6 µs on AMD
            # hosts, §3.3) and none inside one; one scale for both left Azure 32 GPUs at 256 MiB
            # on Ring/LL128 (+13 %) where the run is at Simple's rate. Lower bound: no sooner
            # than Ring/LL on the same ring (ring_simple_floor).
            names.append("inter_simple_latency_scale")
            lo.append(max(0.2, ring_simple_floor(system, [(l.n_ranks, l.n_nodes) for l in logs])))
            hi.append(5.0)
            x0.append(1.0)
    if hbm_GBps:
        # The exposed memory pass, as the fraction of one read + write of the buffer at the HBM
        # rate that the transfers do not hide: 0 (none, NCCL's model) to 3 passes.
        names.append("mem_passes")
        lo.append(0.0)
        hi.append(MAX_MEM_PASSES)
        x0.append(0.5)
    if single_rank:
        cap = (hbm_GBps / 2.0) if hbm_GBps else 5000.0  # a copy reads and writes every byte
        names += ["copy_GBps", "copy_latency_us"]
        lo += [1.0, 0.0]
        hi += [cap, 20.0]
        x0 += [min(cap * 0.8, 500.0), 2.0]

    def tuning(x) -> NcclTuning:
        kw = dict(zip(names, (float(v) for v in x)))
        kw["cta_bound_intra"] = True  # structure, not fitted: see NcclTuning.cta_bound_intra
        kw["runtime_chunking"] = True  # structure, not fitted: see NcclTuning.runtime_chunking
        passes = kw.pop("mem_passes", 0.0)
        if passes >= 0.01 and hbm_GBps:  # below 1 % of a pass: none (NCCL's model)
            kw["mem_GBps"] = hbm_GBps / (2.0 * passes)
        return NcclTuning(**kw)

    def resid(x) -> np.ndarray:
        m = NcclModel(system, tuning(x))
        out = []
        for l in logs:
            r = np.log(predict_us(m, l) / l.time_us) / _tolerance(l.size_bytes)
            r = r * np.sqrt(np.abs(r))  # |r|^3 in the sum: leans towards the worst sizes (the targets are per size)
            out.append(r / math.sqrt(len(l.size_bytes)))
        return np.concatenate(out)

    best = None
    starts = [x0]
    # a second start from NCCL's own constants: the fit must not depend on the first guess
    starts.append([1.0 if n.endswith("scale") else v for n, v in zip(names, x0)])
    # and without the per-channel cost (NCCL's own structure)
    starts.append([0.0 if n == "channel_us" else v for n, v in zip(names, x0)])
    # and a few spread over the box (fixed seed: the fit is reproducible). The algorithm and
    # protocol switch with the constants, so the objective has steps and several local minima:
    # every start runs a short descent, the best one is then refined.
    rng = np.random.default_rng(0)
    lo_a, hi_a = np.asarray(lo, float), np.asarray(hi, float)
    for _ in range(n_random_starts):
        starts.append(list(lo_a + (hi_a - lo_a) * rng.uniform(0.1, 0.6, size=len(lo))))
    short = []
    for s in starts:
        s = np.clip(s, lo_a + 1e-9, hi_a - 1e-9)
        short.append(least_squares(resid, s, bounds=(lo, hi), loss="soft_l1", f_scale=1.0, diff_step=1e-3, max_nfev=30))
    best = min(short, key=lambda r: r.cost)
    best = least_squares(resid, np.clip(best.x, lo_a + 1e-9, hi_a - 1e-9), bounds=(lo, hi), loss="soft_l1",
                         f_scale=1.0, diff_step=1e-3, max_nfev=300)
    # Where one protocol hands over to the next is a step of the objective that a descent does not
    # cross: from the best point, each protocol's bandwidth factor is set to either end (a small
    # fraction of NCCL's factor, NCCL's own) and the point refined again, kept if better (Azure:
    # LL at 0.09-0.13 of NCCL's factor, cost 0.28, against 0.63 with NCCL's own, every other
    # constant alike; p4de: LL128 at NCCL's own against 0.82). Likewise Ring/Simple's latency
    # across nodes at its lower bound: where Ring/Simple takes over from Ring/LL128 across nodes
    # (Azure fitted without its 16-GPU log: 0.27 against 4.9, the held-out log 24.8 % below 64 KiB
    # against 33 %).
    hops = list(HOPS)
    if "inter_simple_latency_scale" in names:
        hops.append(("inter_simple_latency_scale", lo[names.index("inter_simple_latency_scale")] + 0.01))
    for name, value in hops:
        if name not in names or abs(best.x[names.index(name)] - value) < 0.1:
            continue
        hop = np.array([value if n == name else v for n, v in zip(names, best.x)])
        r = least_squares(resid, np.clip(hop, lo_a + 1e-9, hi_a - 1e-9), bounds=(lo, hi), loss="soft_l1",
                          f_scale=1.0, diff_step=1e-3, max_nfev=300)
        if r.cost < best.cost:
            best = r
    tn = tuning(best.x)
    products = product_only_pairs(resid, best.x, names, lo, hi, jac=best.jac)
    if products:
        line = f"NCCL fit for {system_name or 'this system'}: " + "; ".join(
            f"these logs fix {a} x {b} = {getattr(tn, a) * getattr(tn, b):.3g}, not each (the split between them is "
            f"the fit's)" for a, b in products)
        note(line) if note is not None else warnings.warn(line, stacklevel=2)
    tol = [1e-6 * max(1.0, abs(b)) for b in hi]
    at_lo = [n for n, v, a, t in zip(names, best.x, lo, tol) if v - a <= t]
    at_hi = [n for n, v, b, t in zip(names, best.x, hi, tol) if b - v <= t]
    if at_lo or at_hi:
        # At the lower bound: NCCL's own value for the latency scales (the logs would take less,
        # physics does not allow it), not measured by these logs for the bandwidth factors (LL128
        # at 5 % of NCCL's: the runs effectively never used it); at the upper: held at its
        # physical limit, the logs want more.
        parts = ([f"{', '.join(at_lo)} at the lower bound (NCCL's own latency, or not seen in these logs)"] if at_lo else []) + \
                ([f"{', '.join(at_hi)} held at the physical limit"] if at_hi else [])
        line = f"NCCL fit for {system_name or 'this system'}: " + "; ".join(parts)
        # calibrate prints low-confidence facts as readable lines; library callers get a warning
        note(line) if note is not None else warnings.warn(line, stacklevel=2)
    model = NcclModel(system, tn)
    worst = {l.name: float(np.max(np.abs(errors(model, l)))) for l in logs}
    return NcclCalibration(latency_scale=tn.latency_scale, intra_latency_scale=tn.intra_latency_scale,
                           ll128_latency_scale=tn.ll128_latency_scale, simple_latency_scale=tn.simple_latency_scale,
                           net_latency_us=tn.net_latency_us,
                           intra_bw_scale=tn.intra_bw_scale, inter_bw_scale=tn.inter_bw_scale,
                           launch_us=tn.launch_us, copy_GBps=tn.copy_GBps, ll_bw_scale=tn.ll_bw_scale,
                           ll128_bw_scale=tn.ll128_bw_scale, channel_us=tn.channel_us, copy_latency_us=tn.copy_latency_us,
                           mem_GBps=tn.mem_GBps, intra_ll_bw_scale=tn.intra_ll_bw_scale, cta_bound_intra=tn.cta_bound_intra,
                           net_step_us=tn.net_step_us, inter_simple_latency_scale=tn.inter_simple_latency_scale,
                           runtime_chunking=tn.runtime_chunking,
                           channel_us_max_channels=fitted_max_channels(model, logs),
                           system=system_name, fit_error=worst, product_only=[list(p) for p in products])


def fitted_max_channels(model: "NcclModel", logs: list[NcclLog]) -> int:
    """The most channels a collective of ``logs`` launched: the fitted model's choice (NCCL's
    channel rule, §3.7) at every logged size, i.e. what channel_us was measured over."""
    most = 1
    for l in logs:
        if l.n_ranks > 1:
            for size in l.size_bytes:
                most = max(most, int(model.choose(l.op, float(size), l.n_ranks, l.n_nodes).channels))
    return most


def physics_checks(system: NcclSystem, cal: NcclCalibration, hbm_GBps: float | None = None,
                   shapes: list[tuple[int, int]] | None = None) -> list[tuple[str, str, bool]]:
    """Each fitted constant against what the hardware allows: (constant, the check in words, holds).
    shapes: the (ranks, nodes) of the fitted logs, for the Ring/Simple latency floor (default: 2
    full nodes)."""
    intra_hi, inter_hi = physical_bounds(system)
    nvl_GBps = system.nvl_GBps * cal.intra_bw_scale
    out = [
        ("intra_bw_scale", f"{cal.intra_bw_scale:.3f} x NCCL's {system.nvl_GBps:.0f} GB/s = {nvl_GBps:.0f} GB/s "
         f"<= NVLink spec {system.nvl_GBps * intra_hi:.0f} GB/s per direction", cal.intra_bw_scale <= intra_hi + 1e-9),
        ("inter_bw_scale", f"{cal.inter_bw_scale:.3f} <= NIC line rate / NCCL's ladder speed {inter_hi:.3f}",
         cal.inter_bw_scale <= inter_hi + 1e-9),
        ("latency scales", f"across nodes {cal.latency_scale:.2f}, inside one {cal.intra_latency_scale:.2f}, "
         f"LL128 x{cal.ll128_latency_scale:.2f} >= 1 (no faster than NCCL's own LL/LL128 latency tables)",
         min(cal.latency_scale, cal.intra_latency_scale) >= 1 - 1e-9 and cal.ll128_latency_scale >= 1 - 1e-9),
        ("protocol bw", f"LL x{cal.ll_bw_scale:.2f}, LL128 x{cal.ll128_bw_scale:.2f} <= 1 of NCCL's protocol factors",
         cal.ll_bw_scale <= 1 + 1e-9 and cal.ll128_bw_scale <= 1 + 1e-9),
        ("channel_us", f"{cal.channel_us:.2f} µs per channel launched, 0..10", 0 <= cal.channel_us <= 10 + 1e-9),
        ("net_step_us", f"{cal.net_step_us:.2f} µs per network step beyond a channel's first loop, 0..10",
         0 <= cal.net_step_us <= 10 + 1e-9),
    ]
    if cal.inter_simple_latency_scale is not None:
        floor = max(0.2, ring_simple_floor(system, shapes or [(2 * system.gpus_per_node, 2)]))
        out.append(("inter_simple_latency_scale", f"Ring/Simple latency across nodes x{cal.inter_simple_latency_scale:.3f} of "
                    f"NCCL's (inside one node x{cal.simple_latency_scale:.2f}) >= {floor:.3f}, where it would start "
                    "sooner than Ring/LL on the same ring", cal.inter_simple_latency_scale >= floor - 1e-6))
    if hbm_GBps:
        if cal.mem_GBps:
            passes = hbm_GBps / 2 / cal.mem_GBps
            out.append(("mem_GBps", f"{cal.mem_GBps:.0f} GB/s = {passes:.2f} exposed read+write passes of the buffer at HBM "
                        f"{hbm_GBps:.0f} GB/s, 0..{MAX_MEM_PASSES:g} (a ring step reads and writes each byte a few times)",
                        0 <= passes <= MAX_MEM_PASSES + 1e-6))
        if cal.copy_GBps:
            out.append(("copy_GBps", f"{cal.copy_GBps:.0f} GB/s <= HBM / 2 = {hbm_GBps / 2:.0f} (a copy reads and writes)",
                        cal.copy_GBps <= hbm_GBps / 2 + 1e-6))
    return out


def error_table(model: NcclModel, logs: list[NcclLog]) -> list[dict]:
    """Per log: worst |error| at >= 64 KiB and below, and the sizes that miss 10 % / 25 %."""
    rows = []
    for l in logs:
        e = errors(model, l)
        big = l.size_bytes >= _SMALL_BYTES
        miss = [(int(s), float(x)) for s, x, tol in zip(l.size_bytes, e, _tolerance(l.size_bytes)) if abs(x) > tol]
        rows.append({
            "log": l.name, "ranks": l.n_ranks, "nodes": l.n_nodes,
            "worst_ge_64KiB": float(np.max(np.abs(e[big]))) if big.any() else None,
            "worst_lt_64KiB": float(np.max(np.abs(e[~big]))) if (~big).any() else None,
            "misses": miss,
        })
    return rows


# Two logs of one collective and group shape that differ by more than this at the same sizes are
# not one system (run-to-run spread of nccl-tests is a few percent): one fit over both sits between.
LOG_DISAGREEMENT = 1.25


def _refuse_repeated_logs(logs: list[NcclLog]) -> None:
    """Two logs with the same measurements (a copy re-spaced or re-columned, which the CLI's
    byte check cannot see) would weight the fit twice towards one run: one line, which ones."""
    seen: dict[tuple, str] = {}
    for log in logs:
        key = (log.op, log.n_ranks, log.n_nodes, log.size_bytes.tobytes(), np.round(log.time_us, 3).tobytes())
        if key in seen:
            raise UserError(f"nccl-tests logs {seen[key]} and {log.name} hold the same measurements (every size and "
                            f"time): pass each run once (a copy counts its samples twice)")
        seen[key] = log.name


def disagreeing_logs(logs: list[NcclLog]) -> list[str]:
    """One line per pair of logs of the same collective and shape (ranks, nodes) whose times at
    their common sizes from 1 MiB are more than LOG_DISAGREEMENT apart (median ratio)."""
    out = []
    for i, a in enumerate(logs):
        for b in logs[i + 1:]:
            if (a.op, a.n_ranks, a.n_nodes) != (b.op, b.n_ranks, b.n_nodes):
                continue
            common, ia, ib = np.intersect1d(a.size_bytes, b.size_bytes, return_indices=True)
            big = common >= (1 << 20)
            if big.sum() < 2:
                continue
            r = float(np.median(b.time_us[ib][big] / a.time_us[ia][big]))
            if max(r, 1 / r) > LOG_DISAGREEMENT:
                out.append(f"{a.name} and {b.name} time {a.op} on {a.n_ranks} GPUs ({a.n_nodes} node(s)) {max(r, 1 / r):.2f}x "
                           f"apart at the same sizes: not one system's runs; one fit over both sits between them "
                           f"(calibrate each on its own, or keep the one that matches your system)")
    return out


def calibrate_nccl(paths: list[Path], topology, device: str, hbm_GBps: float | None, note=None,
                   collective: str | None = None):
    """(NcclCalibration, provenance items) from the nccl-tests logs of one system, or (None, [])
    when the device is not a GPU NCCL's model describes."""
    from simulator.profile import ProvenanceItem

    system = NcclSystem.from_specs(topology.node, device)
    if system is None or not paths:
        return None, []
    logs = [read_log(p, topology.node.gpus_per_node, collective) for p in paths]
    _refuse_repeated_logs(logs)
    for line in disagreeing_logs(logs):
        note(line) if note is not None else warnings.warn(line, stacklevel=2)
    cal = fit_system(system, logs, hbm_GBps, topology.name, note=note)
    names = ", ".join(l.name for l in logs)
    src = f"fitted by simulator.calibrate.nccl_fit on {names} through topology {topology.name!r} (NCCL 2.28 tuner model)"
    items = [ProvenanceItem(field=f"comm.nccl.{k}", value=float(v), source=src)
             for k, v in cal.model_dump(exclude={"system", "fit_error", "product_only"}).items() if v is not None]
    worst = "; ".join(f"{k}: {v:.1%}" for k, v in cal.fit_error.items())
    items.append(ProvenanceItem(field="comm.nccl.fit_error", value=worst, source="worst |relative time error| per log"))
    if cal.product_only:
        items.append(ProvenanceItem(field="comm.nccl.product_only", value="; ".join(" x ".join(p) for p in cal.product_only),
                                    source="pairs these logs fix only as a product (nccl_fit.product_only_pairs): the "
                                           "split between the two is the fit's"))
    return cal, items
