"""What-if runs: the perturbed step against the clean one, who waits on whom, the step-time
distribution over seeds, and the goodput of a run with failures.

Both steps are simulated (clean: the scenario without ``perturbations``). The perturbed step
runs in *split* mode (``simulator.whatif.split``) unless full mode is asked for: one simulated
rank per class of ranks that behave alike, so one slow GPU among 16,384 costs a few dozen
simulated ranks.

Jitter (seeded): each compute segment of a rank is multiplied by a draw of mean 1 and the given
CV. A class stands for k ranks of one TP x CP group (jitter keys classes by TP x CP group): the
group's next collective waits for the slowest member, so the representative takes the maximum of
k draws per segment (exact when every segment ends in a group collective, as Megatron layers with
TP do; otherwise an upper bound per segment). Collective noise only slows: a draw m > 1 delays
the collective's end by (m - 1) x its isolated time, since nothing makes a collective beat its
bandwidth bound. Each seed's draws come from numpy generators keyed by (seed, rank), and SimPy
orders events deterministically, so a seed gives the same step to the byte.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from simulator.engine.core import Engine, Timeline
from simulator.errors import UserError
from simulator.vocabulary import GROUP_DIMS, CollectiveOp, Dim
from simulator.whatif.goodput import FailurePolicy, goodput
from simulator.whatif.links import link_factors
from simulator.whatif.perturbations import Jitter, Perturbations
from simulator.whatif.split import Classes, SplitEngine, group_index, refine_classes, stage_groups
from simulator.workload.plan import Compute, Plan

# Lower clip of a normal multiplier: a kernel never takes (near) zero time.
NORMAL_FLOOR = 0.05


def multiplier_draws(rng: np.random.Generator, dist: str, cv: float, shape) -> np.ndarray:
    """Multipliers of mean 1 and coefficient of variation cv."""
    if dist == "lognormal":
        sigma2 = math.log1p(cv * cv)
        return rng.lognormal(mean=-sigma2 / 2.0, sigma=math.sqrt(sigma2), size=shape)
    return np.maximum(NORMAL_FLOOR, 1.0 + cv * rng.standard_normal(size=shape))


def gpus_per_node_of(topo) -> int:
    return int(topo.node.gpus_per_node)


def rank_speeds(pert: Perturbations, world: int, gpus_per_node: int) -> np.ndarray:
    """Compute speed factor of every rank (rank = GPU id under the default placement)."""
    speed = np.ones(world)
    n_nodes = -(-world // gpus_per_node)
    if pert.gpu_draw is not None:
        d = pert.gpu_draw
        raw = multiplier_draws(np.random.default_rng([d.seed, 0x5EED]), d.distribution, d.cv, world)
        # Round to quantile levels so equal-speed GPUs stay in one class.
        edges = np.quantile(raw, np.linspace(0, 1, d.levels + 1))
        bins = np.clip(np.searchsorted(edges, raw, side="right") - 1, 0, d.levels - 1)
        means = np.array([raw[bins == b].mean() if (bins == b).any() else 1.0 for b in range(d.levels)])
        speed = means[bins]
    for g in pert.gpus:
        if g.rank is not None:
            if g.rank >= world:
                raise UserError(f"perturbations.gpus: rank {g.rank} is outside the job's {world} GPUs: use 0..{world - 1}")
            speed[g.rank] = g.speed
        else:
            if g.node >= n_nodes:
                raise UserError(f"perturbations.gpus: node {g.node} is outside the job's {n_nodes} node{'s' if n_nodes != 1 else ''}: use 0..{n_nodes - 1}")
            speed[g.node * gpus_per_node:(g.node + 1) * gpus_per_node] = g.speed
    return speed


def degraded_group_tags(net, plan: Plan, degraded: np.ndarray) -> list[np.ndarray]:
    """Per group dimension, per rank: does the rank's group send a flow over a degraded link."""
    from simulator.network.collectives import candidates

    world = plan.mesh.world_size
    graph = net.graph
    out = []
    for d in GROUP_DIMS:
        g = plan.groups[d]
        tag = np.zeros(world, dtype=bool)
        if g.shape[1] > 1:
            gi = group_index(g, world)
            hit = np.zeros(len(g), dtype=bool)
            if d == Dim.PP:
                src, dst = g[:, :-1].ravel(), g[:, 1:].ravel()
                phases = [(np.concatenate([src, dst]), np.concatenate([dst, src]), None, None)]
            else:
                ops = [CollectiveOp.ALL_TO_ALL] if d == Dim.EP else [CollectiveOp.ALL_REDUCE, CollectiveOp.ALL_GATHER]
                phases = []
                for op in ops:
                    for p in candidates(graph, op, g, None):
                        phases += [(ph.src, ph.dst, ph.src_nic, ph.dst_nic) for ph in p.phases]
            for src, dst, sn, dn in phases:
                routes = graph.route(src, dst, sn, dn)
                bad_flow = np.zeros(routes.n_flows, dtype=bool)
                bad_flow[routes.flow[degraded[routes.link]]] = True
                hit[gi[src[bad_flow]]] = True
            tag = hit[gi]
        out.append(tag)
    return out


@dataclass
class PerturbedRun:
    timeline: Timeline
    classes: Classes | None
    wait_log: list
    speeds: np.ndarray
    straggler_ranks: np.ndarray  # ranks a perturbation lands on


class WhatIfRunner:
    """Builds the perturbed fabric and classes once; runs a step per seed."""

    def __init__(self, sc, prog, plan: Plan, make_net, topo, mode: str, sm_count: int | None = None):
        self.sc, self.prog, self.plan, self.mode = sc, prog, plan, mode
        self.sm_count = sm_count  # contention, as in the clean run (simulator.contention)
        pert: Perturbations = sc.perturbations
        self.pert = pert
        world = plan.mesh.world_size
        gpn = gpus_per_node_of(topo)
        self.speeds = rank_speeds(pert, world, gpn)
        self.net = make_net()
        degraded = np.zeros(0, dtype=bool)
        if pert.links:
            if not hasattr(self.net, "capacity_Bps"):
                raise UserError("perturbations.links needs the flow network: set network: flow (or drop --slow-link)")
            f = link_factors(self.net.graph, [(l.name, l.bandwidth) for l in pert.links])
            self.net.capacity_Bps = self.net.capacity_Bps * f
            degraded = f != 1.0
        stragglers = self.speeds != 1.0
        keys = [plan.mesh.coords[:, 0], np.unique(self.speeds, return_inverse=True)[1].reshape(-1)]
        if degraded.any():
            tags = degraded_group_tags(self.net, plan, degraded)
            keys += [t.astype(np.int64) for t in tags]
            for t in tags:
                stragglers |= t
        jit = pert.jitter
        if jit is not None and jit.granularity == "group":
            # TP x CP groups: one per (pp, dp) position.
            keys.append(plan.mesh.coords[:, 1])
        self.straggler_ranks = np.nonzero(stragglers)[0]
        if mode != "full":
            self.classes = Classes.of(refine_classes(plan, keys))
        elif jit is not None and jit.target in ("collective", "both"):
            # Full mode with collective noise: every rank its own class (the same rendezvous as
            # full mode), through the engine that draws collective noise.
            self.classes = Classes.of(np.arange(world, dtype=np.int64))
        else:
            self.classes = None  # the reference engine, every rank simulated
        self.n_compute = [sum(1 for i in rp.instrs if type(i) is Compute) for rp in plan.ranks]

    def _k_of(self, rep: int) -> int:
        """Members of the rep's class inside its TP x CP group (they synchronise every layer)."""
        if self.classes is None:
            return 1
        c = self.plan.mesh.coords
        lab = self.classes.labels
        same = (c[:, 0] == c[rep, 0]) & (c[:, 1] == c[rep, 1]) & (lab == lab[rep])
        return int(same.sum())

    def run(self, seed: int | None, record_waits: bool = True) -> PerturbedRun:
        jit: Jitter | None = self.pert.jitter
        if self.classes is None:
            eng = Engine(self.prog, self.net, mode="full", plan=self.plan, sm_count=self.sm_count)
        else:
            cj = None
            if jit is not None and jit.target in ("collective", "both") and seed is not None:
                rng_c = np.random.default_rng([seed, 0xC011])
                cj = lambda n: float(multiplier_draws(rng_c, jit.distribution, jit.cv, n).max())  # noqa: E731
            eng = SplitEngine(self.prog, self.net, self.plan, self.classes, collective_jitter=cj, sm_count=self.sm_count)
        kernel_jitter = jit is not None and jit.target in ("kernel", "both") and seed is not None
        for r in eng.ranks:
            n = self.n_compute[int(eng._pp_of[r])]
            f = np.full(n, 1.0 / self.speeds[r])
            if kernel_jitter:
                k = self._k_of(r)
                draws = multiplier_draws(np.random.default_rng([seed, r]), jit.distribution, jit.cv, (n, k))
                f = f * draws.max(axis=1)
            if kernel_jitter or self.speeds[r] != 1.0:
                eng.compute_factor[r] = f
        eng.wait_log = [] if record_waits else None
        tl = eng.run()
        return PerturbedRun(tl, self.classes, eng.wait_log or [], self.speeds, self.straggler_ranks)


# ----------------------------------------------------------------------------- answers

def wait_chain(run: PerturbedRun, limit: int = 12, clean_log: list | None = None, pp_of=None,
               clean_by_pp: bool = True) -> list[dict]:
    """Who waits on whom, from the ranks a perturbation lands on outward (breadth first).

    Each hop: a (representative) rank, how many ranks it stands for, the rank it waited on, the
    group dimension of the wait, and the seconds each of those ranks waited in the step *more
    than in the clean step* (``clean_log``: the clean run's waits; pipeline receipts wait in a
    clean step too, group rendezvous do not since identical ranks arrive together)."""
    edges: dict[tuple[int, int, str], float] = defaultdict(float)
    for waiter, on, dim, s in run.wait_log:
        if waiter != on:
            edges[(waiter, on, str(dim))] += s
    if clean_log:
        base: dict[tuple, float] = defaultdict(float)
        key = (lambda r: int(pp_of[r])) if clean_by_pp else (lambda r: int(r))
        for waiter, on, dim, s in clean_log:
            base[(key(waiter), key(on), str(dim))] += s
        edges = defaultdict(float, {(w, on, d): s - base.get((key(w), key(on), d), 0.0) for (w, on, d), s in edges.items()})
    sizes = {}
    if run.classes is not None:
        sizes = {int(r): int(run.classes.sizes[run.classes.labels[r]]) for r in run.classes.reps}
    simulated = {k[0] for k in edges} | {k[1] for k in edges}
    frontier = {int(r) for r in run.straggler_ranks if int(r) in simulated}
    if not frontier and run.classes is not None:
        frontier = {int(run.classes.reps[run.classes.labels[r]]) for r in run.straggler_ranks}
    seen = set(frontier)
    out = []
    depth = 1
    while frontier and depth <= 8:
        hops = [(w, on, d, s) for (w, on, d), s in edges.items() if on in frontier and w not in seen and s > 0]
        # keep the largest wait per waiter
        best: dict[int, tuple] = {}
        for h in hops:
            if h[0] not in best or h[3] > best[h[0]][3]:
                best[h[0]] = h
        for w, on, d, s in sorted(best.values(), key=lambda h: -h[3]):
            out.append({"depth": depth, "rank": w, "ranks": sizes.get(w, 1), "waited_on": on, "dim": d,
                        "wait_s": s})
        seen |= set(best)
        frontier = set(best)
        depth += 1
    out.sort(key=lambda h: (h["depth"], -h["wait_s"]))
    return out[:limit]


def distribution(step_times_s: list[float], first_seed: int) -> dict:
    a = np.asarray(step_times_s, dtype=np.float64)
    return {
        "seeds": int(a.size), "first_seed": int(first_seed),
        "p50_s": float(np.percentile(a, 50)), "p90_s": float(np.percentile(a, 90)),
        "p99_s": float(np.percentile(a, 99)), "mean_s": float(a.mean()), "min_s": float(a.min()),
        "max_s": float(a.max()), "step_times_s": [float(x) for x in a],
    }


def failure_answer(pert: Perturbations, gpus: int, gpus_per_node: int, step_time_s: float) -> dict | None:
    fl = pert.failures
    if fl is None:
        return None
    n_nodes = -(-gpus // gpus_per_node)
    for n in fl.nodes:
        if n >= n_nodes:
            raise UserError(f"perturbations.failures.nodes: node {n} is outside the job's {n_nodes} node{'s' if n_nodes != 1 else ''}: use 0..{n_nodes - 1}")
    restart = fl.restart_cost_s if fl.policy == "restart" else fl.spare_swap_s
    g = goodput(gpus, FailurePolicy(fl.mtbf_per_gpu_h, fl.checkpoint_interval_s, fl.checkpoint_cost_s, restart))
    per_failure_gpu_h = g.cost_per_failure_s * gpus / 3600.0
    return {
        "policy": fl.policy, "mtbf_per_gpu_h": fl.mtbf_per_gpu_h, "checkpoint_interval_s": fl.checkpoint_interval_s,
        "checkpoint_cost_s": fl.checkpoint_cost_s, "restart_cost_s": restart,
        "goodput": g.goodput, "lost_to_failures": g.lost_to_failures, "lost_to_checkpoints": g.lost_to_checkpoints,
        "failures_per_day": g.failures_per_day, "job_mtbf_h": g.job_mtbf_s / 3600.0,
        "cost_per_failure_s": g.cost_per_failure_s, "cost_per_failure_gpu_h": per_failure_gpu_h,
        "cost_per_failure_steps": g.cost_per_failure_s / step_time_s if step_time_s > 0 else 0.0,
        "failed_nodes": list(fl.nodes), "cost_of_failed_nodes_gpu_h": per_failure_gpu_h * len(fl.nodes),
        "optimal_checkpoint_interval_s": g.optimal_checkpoint_interval_s,
        "steps_per_checkpoint": fl.checkpoint_interval_s / step_time_s if step_time_s > 0 else 0.0,
    }


def describe(pert: Perturbations) -> list[str]:
    out = [f"GPU {'rank ' + str(g.rank) if g.rank is not None else 'node ' + str(g.node)} at {g.speed:g}x speed" for g in pert.gpus]
    if pert.gpu_draw is not None:
        d = pert.gpu_draw
        out.append(f"GPU speeds drawn {d.distribution} CV {d.cv:g} (seed {d.seed}, {d.levels} levels)")
    out += [f"link {l.name} at {l.bandwidth:g}x bandwidth" for l in pert.links]
    if pert.failures is not None and pert.failures.nodes:
        out.append(f"failed node(s) {', '.join(map(str, pert.failures.nodes))} ({pert.failures.policy})")
    if pert.jitter is not None:
        j = pert.jitter
        out.append(f"jitter {j.distribution} CV {j.cv:g} on {j.target}, {j.seeds} seed(s) from {j.seed}")
    return out


def _simulate_clean(sc, mode: str, progress):
    """``simulate.simulate`` of the clean scenario, also keeping the engine's wait log."""
    from simulator.simulate import simulate_step

    log: list = []
    return simulate_step(sc, mode, progress, what="clean", wait_log=log), log


def validate_perturbations(sc) -> None:
    """Ranks, nodes and link names exist in this job and topology (UserError naming them)."""
    from simulator.topology import load_topology
    from simulator.topology.graph import build_graph

    pert: Perturbations = sc.perturbations
    topo = load_topology(sc.cluster.topology)
    gpn = gpus_per_node_of(topo)
    rank_speeds(pert, sc.cluster.gpus, gpn)
    failure_answer(pert, sc.cluster.gpus, gpn, 1.0)
    if pert.links:
        if sc.network != "flow":
            raise UserError("perturbations.links needs the flow network: set network: flow (or drop --slow-link)")
        link_factors(build_graph(topo, sc.cluster.gpus), [(l.name, l.bandwidth) for l in pert.links])


# Set in a forked worker process only (seed_step_times): the runner it inherited from its parent.
_WORKER_RUNNER: "WhatIfRunner | None" = None


def _init_worker(runner: "WhatIfRunner") -> None:
    global _WORKER_RUNNER
    _WORKER_RUNNER = runner


def _worker_step(seed: int) -> float:
    return _WORKER_RUNNER.run(seed, record_waits=False).timeline.step_time_s


def seed_step_times(runner: "WhatIfRunner", seeds: list[int], workers: int = 1,
                    progress: Callable[[str], None] | None = None, done_before: int = 0,
                    total: int | None = None) -> list[float]:
    """Step time per seed, in seed order. Seeds are independent and each is deterministic, so
    forked workers (Linux) give the very same numbers as one process. ``progress`` hears
    "seed k of N" as each finishes (``done_before`` already done, of ``total``)."""
    import multiprocessing as mp

    total = total if total is not None else done_before + len(seeds)

    def tick(k: int) -> None:
        if progress is not None:
            progress(f"what-if: seed {done_before + k} of {total} simulated")

    out: list[float] = []
    if workers <= 1 or len(seeds) < 2 or "fork" not in mp.get_all_start_methods():
        for s in seeds:
            out.append(runner.run(s, record_waits=False).timeline.step_time_s)
            tick(len(out))
        return out
    with mp.get_context("fork").Pool(min(workers, len(seeds)), initializer=_init_worker, initargs=(runner,)) as pool:
        for t in pool.imap(_worker_step, seeds, chunksize=1):  # in seed order, as they finish
            out.append(t)
            tick(len(out))
    return out


class LongRunWarning(UserWarning):
    """A what-if distribution that will take minutes: said once, after its first seed."""


def _warn_if_long(first_s: float, n_seeds: int, jit, dp: int) -> None:
    """After the first seed, the time the rest will take when it is over a minute (a run off a
    terminal shows no progress), with the cheaper granularity where it applies."""
    rest_s = first_s * (n_seeds - 1)
    if rest_s < 60:
        return
    import warnings

    cheaper = (f"; --jitter-granularity stage draws per pipeline rank, about {dp}x cheaper"
               if jit is not None and jit.granularity == "group" and dp > 1 else "")
    warnings.warn(f"what-if: the first seed took {first_s:.0f} s, so the other {n_seeds - 1} take about "
                  f"{rest_s / 60:.0f} min{cheaper}; fewer --seeds shorten it", LongRunWarning, stacklevel=2)


def simulate_whatif(sc, mode: str = "reduced", progress=None, workers: int = 1):
    """Simulate the clean step and the perturbed one; the result is the perturbed step with a
    ``whatif`` section in its report."""
    from simulator.report.metrics import build_report
    from simulator.simulate import SimulationResult, make_network
    from simulator.workload.memory import memory_report

    pert: Perturbations = sc.perturbations
    if mode == "every-rank":
        mode = "full"  # what-if full mode already runs one process per rank (its reference)
    validate_perturbations(sc)  # before any simulation: bad input costs nothing
    clean_sc = sc.model_copy(update={"perturbations": None})
    clean, clean_log = _simulate_clean(clean_sc, mode, progress)
    profile, topo, prog, plan = clean.profile, clean.topology, clean.program, clean.plan
    gpn = gpus_per_node_of(topo)
    perturbed_tl = clean.timeline
    answer: dict = {
        "perturbations": describe(pert), "clean_step_time_s": clean.timeline.step_time_s,
        "clean_exposed_comm_s": dict(clean.report.exposed_comm_s), "mode": mode,
    }
    if pert.changes_step:
        runner = WhatIfRunner(sc, prog, plan, lambda: make_network(sc, topo, profile), topo, mode,
                              sm_count=profile.compute.sm_count)
        jit = pert.jitter
        seeds = [jit.seed + i for i in range(jit.seeds)] if jit is not None else [None]
        if progress is not None:
            n_sim = len(runner.classes.reps) if runner.classes is not None else plan.mesh.world_size
            progress(f"what-if: {'; '.join(describe(pert))}: {n_sim} simulated ranks "
                     f"({'split' if runner.classes is not None else 'full'} mode), {len(seeds)} step(s)")
        t_first = time.perf_counter()
        first = runner.run(seeds[0], record_waits=True)
        _warn_if_long(time.perf_counter() - t_first, len(seeds), jit, sc.dp)
        times = [first.timeline.step_time_s] + seed_step_times(runner, seeds[1:], workers, progress, 1, len(seeds))
        perturbed_tl = first.timeline
        answer["simulated_ranks"] = len(first.timeline.ranks)
        answer["wait_chain"] = wait_chain(first, clean_log=clean_log, pp_of=plan.mesh.coords[:, 0],
                                          clean_by_pp=mode != "full")
        answer["straggler_ranks"] = [int(r) for r in first.straggler_ranks[:32]]
        answer["straggler_rank_count"] = int(first.straggler_ranks.size)
        if jit is not None:
            answer["distribution"] = distribution(times, jit.seed)
    mem = memory_report(sc, prog, profile.hbm_gib, profile.usable_memory_fraction)
    weights = stages = None
    if pert.changes_step:
        rep_of = np.arange(plan.mesh.world_size)
        if runner.classes is not None:
            cl = runner.classes
            weights = {int(r): int(cl.sizes[cl.labels[r]]) for r in cl.reps}
            rep_of = cl.reps[cl.labels]
        stages = stage_groups(plan.mesh, rep_of, perturbed_tl.ranks)
    report = build_report(sc.name, prog, perturbed_tl, mem, profile.compute.peak_tflops, sc.cluster.gpus,
                          rank_weight=weights, stages=stages)
    answer["step_time_s"] = perturbed_tl.step_time_s
    answer["delta_s"] = perturbed_tl.step_time_s - clean.timeline.step_time_s
    answer["delta_fraction"] = answer["delta_s"] / clean.timeline.step_time_s
    answer["exposed_comm_delta_s"] = {d: report.exposed_comm_s.get(d, 0.0) - v for d, v in clean.report.exposed_comm_s.items()}
    answer["failures"] = failure_answer(pert, sc.cluster.gpus, gpn, perturbed_tl.step_time_s)
    report.whatif = answer
    return SimulationResult(sc, profile, topo, prog, perturbed_tl, mem, report, plan, clean=clean)
