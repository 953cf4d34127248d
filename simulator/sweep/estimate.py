"""The closed-form pass: a step-time and memory estimate per scenario, with no event loop.

Durations come from the same workload model and profile the simulation uses: a Program is
built (``build_program``) and its segments are summed. Building a Program for every point of a
100,000-point space would dominate the search, so the estimator builds one *reference*
Program per layer configuration (model, tp, cp, ep, micro-batch, sequence, recompute, zero,
GPU profile...) with one pipeline position per layer, and composes any pipeline split of the
same configuration from those per-layer costs. Points that differ only in pp, vpp, schedule,
global batch or GPU count share one reference Program.

Step time of a point:

    all-gather of the first stage's parameters (ZeRO >= 1; nothing hides it at step start)
  + pipeline makespan: a unit-cost replay of the schedule (cached per schedule and cost ratio)
    with mean per-stage costs, plus the load imbalance of the heaviest rank
    (per-stage costs include the blocking tp / cp / ep collectives, priced by the network's
    ``collective_time_s``)
  + pipeline p2p on the fill/drain critical path: 2 x (cross-rank stage boundaries) x send time
  + exposed DP gradient reduction: what the last backward of each stage cannot hide
  + the optimizer step

Memory is ``memory_report`` of the same layout, so pruning by memory agrees with the simulation.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from simulator.calibrate.profile import Profile, load_profile
from simulator.errors import UserError
from simulator.network.alpha_beta import TierNetwork
from simulator.network.base import CollectiveRequest
from simulator.scenario import Scenario, spec_key
from simulator.schedules import build_schedule, replay_unit_costs
from simulator.schedules.base import PipelineSchedule
from simulator.topology import load_topology
from simulator.topology.placement import Mesh
from simulator.workload.memory import memory_report
from simulator.workload.program import ADAM_BYTES_PER_PARAM, Program, build_program, split_layers

KINDS = ("F", "B", "I", "W")
# Cost ratios are quantised so that one replay serves many points (error well under 1%).
RATIO_STEP = 0.1


@dataclass
class Estimate:
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    peak_memory_gib: float
    memory_capacity_gib: float
    fits_in_memory: bool
    gpus: int
    num_microbatches: int
    pipeline_s: float
    exposed_comm_s: dict[str, float]
    optimizer_s: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class _Table:
    """Costs per reference position (one layer each on the fast path)."""

    comp: dict[str, np.ndarray]  # kind -> compute seconds per position
    counts: dict[str, np.ndarray]  # kind -> (positions, comm types) collective counts
    comm_types: list[tuple[str, str, float]]  # (dim, op, size_bytes)
    grad_bytes: np.ndarray  # dense gradient bytes per position (from its weight-grad pass)
    expert_grad_bytes: np.ndarray  # expert gradient bytes per position (reduced over edp)
    params: np.ndarray  # parameters per position on one rank
    model_flops_unit: float  # model FLOPs of one microbatch on one data-parallel replica
    program: Program
    per_layer: bool  # True: one position per layer (compose any split); False: the point's own


def _layer_key(sc: Scenario) -> str:
    """Everything that shapes a layer's ops; pipeline, batch count and cluster size are left out."""
    d = sc.model_dump(mode="json")
    d.pop("name", None)
    par = d["parallelism"]
    # ZeRO changes no segment (its collectives live on the engine's dp stream): one reference
    # Program serves every stage; the estimate adds the ZeRO-3 gathers itself.
    for k in ("pp", "vpp", "dp", "zero", "pp_layer_split", "mesh_order", "overlap_grad_reduce", "grad_bucket_params"):
        par.pop(k, None)
    d["batch"].pop("global_batch_size", None)
    for k in ("schedule", "schedule_file", "network"):
        d.pop(k, None)
    d["cluster"] = {"gpu": d["cluster"]["gpu"]}
    # Tied embeddings share the head's matrix only without a pipeline.
    d["_pp1"] = sc.parallelism.pp == 1
    return json.dumps(d, sort_keys=True)


class Estimator:
    """Estimates points; caches profiles, topologies, schedules, reference Programs and replays.

    One Estimator per process: its caches assume the files it loaded do not change.
    """

    def __init__(self) -> None:
        self._profiles: dict[str, Profile] = {}
        self._nets: dict[tuple[str, str], tuple[TierNetwork, int]] = {}
        self._scheds: dict[tuple, PipelineSchedule | UserError] = {}
        self._sched_info: dict[tuple, tuple[np.ndarray, int]] = {}
        self._tables: dict[str, _Table] = {}
        self._replays: dict[tuple, tuple[float, float]] = {}
        self._splits: dict[tuple, np.ndarray] = {}
        self._costs: dict[tuple, tuple[dict[str, np.ndarray], np.ndarray]] = {}
        self._coll: dict[tuple, float] = {}
        self._groups: dict[tuple, np.ndarray] = {}
        self._memory: dict[tuple, Any] = {}
        self.stats = {"reference_programs": 0, "schedules": 0, "replays": 0, "slow_path": 0}

    # ------------------------------------------------------------------ cached loads

    def profile(self, name: str | Profile) -> Profile:
        if isinstance(name, Profile):  # an inline profile (a what-if on a shipped one)
            return name
        p = self._profiles.get(name)
        if p is None:
            p = self._profiles[name] = load_profile(name)
        return p

    def network(self, sc: Scenario) -> tuple[TierNetwork, int]:
        key = (spec_key(sc.cluster.topology), spec_key(sc.cluster.gpu))
        hit = self._nets.get(key)
        if hit is None:
            topo = load_topology(sc.cluster.topology)
            hit = self._nets[key] = (TierNetwork.from_profile(topo.node, self.profile(sc.cluster.gpu)), topo.node.gpus_per_node)
        return hit

    def schedule(self, name: str, pp: int, nmb: int, vpp: int) -> PipelineSchedule:
        key = (name, pp, nmb, vpp)
        s = self._scheds.get(key)
        if s is None:
            try:
                # Named generators are validated by their own tests and by every simulation;
                # validating each here would cost more than the estimate itself.
                s = build_schedule(name, pp, nmb, vpp)
            except UserError as exc:
                s = exc
            self._scheds[key] = s
            self.stats["schedules"] += 1
        if isinstance(s, UserError):
            raise s
        return s

    def _schedule_info(self, key: tuple, sched: PipelineSchedule) -> tuple[np.ndarray, int, list[tuple[int, ...]]]:
        """(actions per rank x position x kind, cross-rank boundaries along a chain, stages per rank)."""
        hit = self._sched_info.get(key)
        if hit is None:
            P = sched.num_positions
            counts = np.zeros((sched.num_ranks, P, len(KINDS)))
            pos_of = sched.stage_position
            for r, ops in enumerate(sched.actions):
                for a in ops:
                    for leaf in (a.sub if a.kind == "FB" and a.sub is not None else (a,)):
                        counts[r, pos_of[leaf.stage], KINDS.index(leaf.kind)] += 1
            chain = sched.chains[0]
            hops = sum(sched.stage_rank[a] != sched.stage_rank[b] for a, b in zip(chain, chain[1:]))
            stages = [sched.stages_of_rank(r) for r in range(sched.num_ranks)]
            hit = self._sched_info[key] = (counts, int(hops), stages)
        return hit

    def _replay(self, key: tuple, sched: PipelineSchedule, rb: float, rw: float) -> float:
        """Makespan of the schedule with F=1, B=rb, W=rw, in units of F."""
        qb = max(RATIO_STEP, round(rb / RATIO_STEP) * RATIO_STEP)
        qw = min(qb, round(rw / RATIO_STEP) * RATIO_STEP)
        rkey = (key, qb, qw)
        hit = self._replays.get(rkey)
        if hit is None:
            rep = replay_unit_costs(sched, 1.0, qb, qw)
            hit = self._replays[rkey] = (rep.makespan, float(np.mean(rep.busy)))
            self.stats["replays"] += 1
        return hit[0] * (1 + rb) / (1 + qb) if qb > 0 else hit[0]

    # ------------------------------------------------------------------ reference programs

    def _table(self, sc: Scenario) -> _Table:
        if sc.parallelism.account_for_embedding_in_pipeline_split or sc.parallelism.account_for_loss_in_pipeline_split:
            # The per-layer reference program ties the embedding and head to the first and last
            # layer; a split that gives them positions of their own takes the exact path.
            return self._exact_table(sc)
        key = _layer_key(sc)
        tab = self._tables.get(key)
        if tab is not None:
            return tab
        prof = self.profile(sc.cluster.gpu)
        L = sc.model.num_layers
        try:
            ref_sc = sc.model_copy(update={"parallelism": sc.parallelism.model_copy(update={"pp_layer_split": None})})
            prog = build_program(ref_sc, prof, build_schedule("1f1b", L, 1))
            if prog.schedule.num_positions != L or len(prog.stage_params) != L:
                raise ValueError("reference program does not have one position per layer")
            per_layer = True
        except Exception:
            # If the workload ever refuses a pipeline of one layer per stage, fall back to the
            # point's own Program (exact, slower); keyed by the whole scenario then.
            return self._exact_table(sc)
        tab = self._tables[key] = self._make_table(prog, sc, per_layer)
        self.stats["reference_programs"] += 1
        return tab

    def _exact_table(self, sc: Scenario) -> _Table:
        key = "exact:" + sc.model_dump_json()
        tab = self._tables.get(key)
        if tab is None:
            sched = self.schedule(sc.schedule, sc.parallelism.pp, sc.num_microbatches, sc.parallelism.vpp)
            prog = build_program(sc, self.profile(sc.cluster.gpu), sched)
            tab = self._tables[key] = self._make_table(prog, sc, False)
            self.stats["slow_path"] += 1
        return tab

    @staticmethod
    def _make_table(prog: Program, sc: Scenario, per_layer: bool) -> _Table:
        P = len(prog.position_layers)
        types: dict[tuple[str, str, float], int] = {}
        comp: dict[str, np.ndarray] = {}
        rows: dict[str, list[dict[int, int]]] = {}
        grad = np.zeros(P)
        egrad = np.zeros(P)
        for k in KINDS:
            comp[k] = np.zeros(P)
            rows[k] = []
            for pos in range(P):
                seg = prog.segments[(pos, k)]
                comp[k][pos] = float(np.sum(seg.compute_s))
                cnt: dict[int, int] = {}
                for c in seg.comm:
                    if c is None:
                        continue
                    t = types.setdefault((c.dim, c.op, float(c.size_bytes)), len(types))
                    cnt[t] = cnt.get(t, 0) + 1
                rows[k].append(cnt)
                if k == "W":
                    grad[pos] = float(np.sum(seg.grad_bytes))
                    eg = getattr(seg, "expert_grad_bytes", None)
                    egrad[pos] = float(np.sum(eg)) if eg is not None else 0.0
        counts = {}
        for k in KINDS:
            m = np.zeros((P, max(1, len(types))))
            for pos, cnt in enumerate(rows[k]):
                for t, n in cnt.items():
                    m[pos, t] = n
            counts[k] = m
        unit = prog.model_flops_per_step / max(1, sc.num_microbatches * sc.dp)
        return _Table(comp, counts, list(types), grad, egrad, np.asarray(prog.stage_params, dtype=float), unit, prog, per_layer)

    # ------------------------------------------------------------------ network

    def _group(self, mesh: Mesh, dim: str) -> np.ndarray:
        key = (mesh.tp, mesh.cp, mesh.ep, mesh.dp, mesh.pp, mesh.order, dim)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = mesh.groups(dim)[:1].copy()
        return g

    def _coll_time(self, net: TierNetwork, netkey: tuple, mesh: Mesh, dim: str, op: str, size: float) -> float:
        key = (netkey, mesh.tp, mesh.cp, mesh.ep, mesh.dp, mesh.pp, mesh.order, dim, op, size)
        t = self._coll.get(key)
        if t is None:
            if dim == "pp":
                g = self._group(mesh, "pp")[:, :2] if mesh.pp > 1 else np.zeros((1, 1), dtype=np.int64)
            else:
                g = self._group(mesh, dim)
            t = self._coll[key] = float(net.collective_time_s(CollectiveRequest(op, dim, g, size)))
        return t

    # ------------------------------------------------------------------ the estimate

    def estimate(self, sc: Scenario) -> Estimate:
        p = sc.parallelism
        prof = self.profile(sc.cluster.gpu)
        net, _ = self.network(sc)
        netkey = (spec_key(sc.cluster.topology), spec_key(sc.cluster.gpu))
        nmb = sc.num_microbatches
        dp = sc.dp
        if sc.schedule_file:
            from simulator.simulate import resolve_schedule

            sched = resolve_schedule(sc)
            skey: tuple = ("file", sc.schedule_file, p.pp, nmb)
        else:
            sched = self.schedule(sc.schedule, p.pp, nmb, p.vpp)
            skey = (sc.schedule, p.pp, nmb, p.vpp)
        P = sched.num_positions
        if P > sc.model.num_layers + int(p.account_for_embedding_in_pipeline_split) + int(p.account_for_loss_in_pipeline_split):
            # Scenario.check only sees pp*vpp; V-shaped schedules hold 2 stages per rank.
            raise UserError(
                f"schedule {sched.name!r} splits the model into {P} positions but num_layers={sc.model.num_layers}: "
                "lower pp or pick another schedule"
            )
        tab = self._table(sc)
        mesh = Mesh(tp=p.tp, cp=p.cp, ep=p.ep, dp=dp, pp=p.pp, order=p.mesh_order)

        # Per-position costs: compute plus blocking collectives (by dimension for the report).
        fsdp = p.zero >= 3 and dp > 1
        ckey = (id(tab), netkey, p.tp, p.cp, p.ep, dp, p.pp, p.mesh_order, fsdp)
        hit = self._costs.get(ckey)
        if hit is None:
            ct = np.array([self._coll_time(net, netkey, mesh, d, op, s) for d, op, s in tab.comm_types] or [0.0])
            layer_cost = {k: tab.comp[k] + tab.counts[k] @ ct for k in KINDS}
            if fsdp and tab.per_layer:
                # ZeRO-3: each layer's parameters are all-gathered before its forward (and again
                # before its backward when resharded), prefetched behind the previous layer's
                # compute; what that compute cannot hide extends the action.
                units = tab.program.unit_params or {}
                n = len(tab.params)
                upar = np.array([units.get(i, 0.0) for i in range(n)], dtype=float)
                upar[0] += units.get(-1, 0.0)
                upar[-1] += units.get(n, 0.0)
                ag = np.array([self._coll_time(net, netkey, mesh, "dp", "all_gather", float(x * sc.dtype_bytes))
                               if x > 0 else 0.0 for x in upar])
                kinds = ("F", "B", "I") if p.fsdp_reshard_after_forward else ("F",)
                for k in kinds:
                    layer_cost[k] = layer_cost[k] + np.maximum(0.0, ag - layer_cost[k])
            dims = sorted({d for d, _, _ in tab.comm_types})
            by_dim = {}
            for d in dims:
                mask = np.array([t[0] == d for t in tab.comm_types], dtype=float)
                by_dim[d] = np.stack([tab.counts[k] @ (ct * mask) for k in KINDS], axis=1)  # layers x kinds
            hit = self._costs[ckey] = (layer_cost, by_dim)
        layer_cost, by_dim = hit
        if tab.per_layer:
            L = len(tab.params)
            split_key = (L, P, tuple(p.pp_layer_split) if p.pp_layer_split else None,
                         p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split)
            counts_ = self._splits.get(split_key)
            if counts_ is None:
                layers = split_layers(L, P, p.pp_layer_split, p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split)
                counts_ = self._splits[split_key] = np.array([len(ls) for ls in layers])
            pos_cost = {k: _segment_sum(layer_cost[k], counts_) for k in KINDS}
            pos_dim = {d: _segment_sum(v, counts_) for d, v in by_dim.items()}
            pos_grad = _segment_sum(tab.grad_bytes, counts_)
            pos_egrad = _segment_sum(tab.expert_grad_bytes, counts_)
            pos_params = _segment_sum(tab.params, counts_)
        else:
            pos_cost, pos_dim = layer_cost, by_dim
            pos_grad, pos_egrad, pos_params = tab.grad_bytes, tab.expert_grad_bytes, tab.params

        # Pipeline: unit-cost replay with the mean stage, plus the heaviest rank's excess load.
        counts, hops, rank_stages = self._schedule_info(skey, sched)
        cost_mat = np.stack([pos_cost[k] for k in KINDS], axis=1)  # positions x kinds
        busy = np.einsum("rpk,pk->r", counts, cost_mat)
        f = float(pos_cost["F"].mean())
        b = float(pos_cost["B"].mean())
        w = float(pos_cost["W"].mean())
        if f > 0:
            makespan = f * self._replay(skey, sched, b / f, w / f)
        else:
            makespan = float(busy.max())
        pipeline = makespan + float(busy.max() - busy.mean())

        exposed = dict.fromkeys(("tp", "cp", "ep", "pp", "dp"), 0.0)
        # Blocking collectives of the busiest rank are exposed by construction.
        rmax = int(np.argmax(busy))
        for d, m in pos_dim.items():
            exposed[d] = exposed.get(d, 0.0) + float((counts[rmax] * m).sum())

        # Pipeline p2p on the fill / drain path.
        if p.pp > 1 and hops:
            sp = p.sequence_parallel and p.tp > 1
            pp_bytes = sc.batch.micro_batch_size * (sc.batch.seq_length // p.cp) * sc.model.hidden_size * sc.dtype_bytes
            pp_bytes /= p.tp if sp else 1
            exposed["pp"] += 2 * hops * self._coll_time(net, netkey, mesh, "pp", "send_recv", pp_bytes)

        # Data parallel: parameter all-gather before the first forward, gradient tail at the end.
        start_s = end_dp = 0.0
        opt_params = 0.0
        stage_pos = sched.stage_position
        param_bytes = sc.dtype_bytes
        if dp > 1:
            if p.zero >= 1:
                start_s = self._coll_time(net, netkey, mesh, "dp", "all_gather", float(pos_params[0] * param_bytes))
            grad_op = "all_reduce" if p.zero == 0 else "reduce_scatter"
            bucket = p.grad_bucket_params * 4.0
            edp = dp // p.ep
            for r, stages in enumerate(rank_stages):
                tg = last = 0.0
                window = 0.0
                for st in stages:
                    pos = stage_pos[st]
                    for dim, gb in (("dp", float(pos_grad[pos])), ("edp", float(pos_egrad[pos]) if edp > 1 else 0.0)):
                        full = int(gb // bucket)
                        rem = gb - full * bucket
                        if full:
                            last = self._coll_time(net, netkey, mesh, dim, grad_op, bucket)
                            tg += full * last
                        if rem > 0:
                            last = self._coll_time(net, netkey, mesh, dim, grad_op, rem)
                            tg += last
                    window += float(pos_cost["W" if counts[r, pos, 3] else "B"][pos])
                tail = max(last, tg - window) if p.overlap_grad_reduce else tg
                end_dp = max(end_dp, tail)
        for stages in rank_stages:
            opt_params = max(opt_params, float(sum(pos_params[stage_pos[st]] for st in stages)))
        exposed["dp"] = start_s + end_dp
        shard = dp if p.zero >= 1 else 1
        opt_s = float(prof.compute_time_s(np.array(["optimizer"]), np.array([0.0]),
                                          np.array([opt_params / shard * ADAM_BYTES_PER_PARAM]))[0])

        step = start_s + pipeline + exposed["pp"] + end_dp + opt_s
        gpus = sc.cluster.gpus
        tokens = sc.batch.global_batch_size * sc.batch.seq_length
        flops = tab.model_flops_unit * nmb * dp
        tps = tokens / step
        mfu = flops / (step * gpus * prof.compute.peak_tflops * 1e12)

        # Memory: the simulation's own model, on this layout (shared by points that differ only
        # in what memory does not see: topology, network, GPU count at equal dp...).
        mkey = (id(tab), skey, dp, p.zero, p.grad_bucket_params, p.pp_layer_split and tuple(p.pp_layer_split))
        mem = self._memory.get(mkey)
        if mem is None:
            if tab.per_layer:
                layers = split_layers(len(tab.params), P, p.pp_layer_split, p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split)
                view = dataclasses.replace(
                    tab.program, scenario=sc, mesh=mesh, schedule=sched, position_layers=layers,
                    stage_params=[float(x) for x in pos_params], zero=p.zero, overlap_grad_reduce=p.overlap_grad_reduce,
                    grad_bucket_bytes=p.grad_bucket_params * 4.0, param_bytes=param_bytes,
                )
            else:
                view = tab.program
            mem = self._memory[mkey] = memory_report(sc, view, prof.hbm_gib, prof.usable_memory_fraction)
        return Estimate(
            step_time_s=step, tokens_per_s=tps, tokens_per_s_per_gpu=tps / gpus, mfu=mfu,
            peak_memory_gib=mem.peak_gib, memory_capacity_gib=mem.capacity_gib, fits_in_memory=mem.fits,
            gpus=gpus, num_microbatches=nmb, pipeline_s=pipeline, exposed_comm_s=exposed, optimizer_s=opt_s,
        )


# ---------------------------------------------------------------------------------------------
# Rank agreement between the estimate and the simulation
# ---------------------------------------------------------------------------------------------

def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share their mean rank), 0-based."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    ranks = np.empty(len(x))
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 2:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    sa, sb = ra.std(), rb.std()
    if sa == 0 or sb == 0:
        return float("nan")
    return float(((ra - ra.mean()) * (rb - rb.mean())).mean() / (sa * sb))


def kendall_tau_b(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, float), np.asarray(b, float)
    n = len(a)
    if n < 2:
        return float("nan")
    conc = disc = ties_a = ties_b = 0
    # Row blocks keep the pairwise matrices small for a few thousand points.
    for i0 in range(0, n, 512):
        da = np.sign(a[i0:i0 + 512, None] - a[None, :])
        db = np.sign(b[i0:i0 + 512, None] - b[None, :])
        iu = np.arange(i0, min(n, i0 + 512))[:, None] < np.arange(n)[None, :]
        prod = (da * db)[iu]
        conc += int((prod > 0).sum())
        disc += int((prod < 0).sum())
        ties_a += int(((da == 0) & (db != 0))[iu].sum())
        ties_b += int(((db == 0) & (da != 0))[iu].sum())
    denom = math.sqrt((conc + disc + ties_a) * (conc + disc + ties_b))
    return float((conc - disc) / denom) if denom else float("nan")


def rank_agreement(estimated: list[float], simulated: list[float], maximize: bool) -> dict[str, Any]:
    """How well the estimate orders the simulated points: Spearman, Kendall tau-b, top-1."""
    e, s = np.asarray(estimated, float), np.asarray(simulated, float)
    out: dict[str, Any] = {"n": int(len(e)), "spearman": spearman(e, s), "kendall": kendall_tau_b(e, s)}
    if len(e):
        pick = np.argmax if maximize else np.argmin
        out["top1_agree"] = bool(pick(e) == pick(s) or s[pick(e)] == s[pick(s)])
        best = s[pick(s)]
        out["estimate_top1_sim_regret"] = float(abs(best - s[pick(e)]) / abs(best)) if best else 0.0
        out["median_abs_rel_error"] = float(np.median(np.abs(e - s) / np.abs(s))) if np.all(s != 0) else float("nan")
    return out


def _segment_sum(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sums of consecutive runs of ``counts`` rows (a run may be empty: a pipeline position that
    holds only the embedding or the LM head)."""
    v = np.asarray(values, dtype=float)
    cs = np.concatenate([np.zeros((1,) + v.shape[1:]), np.cumsum(v, axis=0)])
    ends = np.cumsum(counts)
    return cs[ends] - cs[ends - counts]
