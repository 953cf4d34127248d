"""The SimPy model: rank streams, collectives as rendezvous, the network behind an interface.

One long-lived process per (rank, stream) walks its work (DESIGN rule 3):
  compute      the schedule's actions, segment by segment; blocks on tp / cp / ep collectives
  tp, cp, ep   blocking collectives the compute stream hands over
  pp-send-f    activations to the next stage; pp-send-b: gradients to the previous stage
  dp           gradient buckets (all-reduce or reduce-scatter) and ZeRO parameter all-gathers

A collective is a rendezvous: it starts when every *simulated* member of its group has issued
it, and its duration comes from the network. In reduced mode one representative per pipeline
rank is simulated (tp, cp, dp peers run the same program on the same hardware); the request
still names every replica group, so the network sees all the traffic. In full mode every rank is
simulated and every group rendezvous for real.

Point-to-point transfers are eager: the receiver's buffer is always posted, so a transfer starts
as soon as its sender's stream is free. Only true dependency cycles can then stall the loop, and
a stall is reported (which ranks wait on what), never returned as a result.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pandas as pd
import simpy

from simulator.errors import SimulationStalled
from simulator.network.base import CollectiveRequest, Network, bus_factor
from simulator.schedules.base import Action, required_inputs
from simulator.workload.ops import Comm
from simulator.workload.program import Program

Mode = Literal["reduced", "full"]
DIMS = ("tp", "cp", "ep", "pp", "dp")
# Sub-groups report under their parallel dimension.
BASE_DIM = {"tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp", "dp": "dp", "edp": "dp", "dp_shard": "dp", "dp_rep": "dp"}
TIMELINE_COLUMNS = ["rank", "stream", "kind", "name", "start_s", "end_s", "microbatch", "stage", "layer", "bytes"]
# One row per interval the compute stream waited: the cause (a dimension of DIMS, or "bubble" for
# waiting on another stage's compute), since when the awaited work was on the wire ("issued_s",
# NaN while it was not yet), the rank that produces it ("src_rank") and what it was.
WAIT_COLUMNS = ["rank", "start_s", "end_s", "cause", "issued_s", "src_rank", "what"]


@dataclass
class Timeline:
    """What happened: one row per compute segment or communication on a (rank, stream)."""

    events: pd.DataFrame
    step_time_s: float
    ranks: list[int]  # simulated ranks
    pp_rank_of: dict[int, int]
    busy_compute_s: dict[int, float]
    exposed_s: dict[int, dict[str, float]]  # rank -> dim -> seconds the compute stream waited
    comm_bytes: dict[int, dict[str, float]]  # rank -> dim -> bytes the rank put on the wire (bus convention)
    sim_wall_s: float
    num_events: int
    mode: str
    network_report: list[dict] = field(default_factory=list)
    waits: pd.DataFrame | None = None  # WAIT_COLUMNS; None from an engine that does not record them
    end_time_s: dict[int, float] = field(default_factory=dict)  # rank -> when its compute stream finished
    optimizer_s: float = 0.0  # the optimizer step at the end of every rank's compute stream


class _Rendezvous:
    """Collects the simulated members of a group; the last arrival starts the collective."""

    __slots__ = ("needed", "arrived", "done")

    def __init__(self, needed: int, done: simpy.Event):
        self.needed = needed
        self.arrived = 0
        self.done = done


class Engine:
    def __init__(self, program: Program, network: Network, mode: Mode = "reduced"):
        self.prog = program
        self.net = network
        self.mode = mode
        self.mesh = program.mesh
        self.sched = program.schedule
        coords = self.mesh.coords  # rank -> (pp, dp, cp, tp, ep)
        if mode == "reduced":
            self.ranks = [self.mesh.rank(pp=i) for i in range(self.mesh.pp)]
        elif mode == "full":
            self.ranks = list(range(self.mesh.world_size))
        else:
            raise ValueError(f"mode must be 'reduced' or 'full', got {mode!r}")
        self.simulated = np.zeros(self.mesh.world_size, dtype=bool)
        self.simulated[self.ranks] = True
        self.coords = coords
        self._group_index: dict[str, np.ndarray] = {}
        self._groups: dict[str, np.ndarray] = {}
        all_groups = {dim: self.mesh.groups(dim) for dim in ("tp", "cp", "ep", "dp", "edp", "pp")}
        shard = program.fsdp_shard_size or self.mesh.dp
        dp_groups = all_groups["dp"]
        # HSDP: shard inside consecutive blocks of the DP group, replicate across blocks.
        all_groups["dp_shard"] = dp_groups.reshape(-1, shard)
        all_groups["dp_rep"] = dp_groups.reshape(len(dp_groups), -1, shard).transpose(0, 2, 1).reshape(-1, self.mesh.dp // shard)
        for dim, groups in all_groups.items():
            idx = np.empty(self.mesh.world_size, dtype=np.int64)
            for gi, g in enumerate(groups):
                idx[g] = gi
            self._groups[dim] = groups
            self._group_index[dim] = idx
        self._request_cache: dict[tuple, CollectiveRequest] = {}

    # ------------------------------------------------------------------ helpers

    def _request(self, dim: str, op: str, size_bytes: float, rank: int) -> tuple[CollectiveRequest, tuple]:
        """The request a rank's group issues, and the rendezvous key prefix of that group."""
        gi = int(self._group_index[dim][rank])
        if op == "ring_step":
            return self._ring_step_request(dim, size_bytes, rank, gi), (dim, gi)
        if self.mode == "reduced":
            # Every replica group with the same pipeline rank issues this collective together.
            pp = int(self.coords[rank, 0])
            ckey = (dim, op, size_bytes, pp)
            req = self._request_cache.get(ckey)
            if req is None:
                groups = self._groups[dim]
                sel = self.coords[groups[:, 0], 0] == pp
                req = CollectiveRequest(op, dim, groups[sel], size_bytes)
                self._request_cache[ckey] = req
        else:
            ckey = (dim, op, size_bytes, gi)
            req = self._request_cache.get(ckey)
            if req is None:
                req = CollectiveRequest(op, dim, self._groups[dim][gi : gi + 1], size_bytes)
                self._request_cache[ckey] = req
        return req, (dim, gi)

    def _ring_step_request(self, dim: str, size_bytes: float, rank: int, gi: int) -> CollectiveRequest:
        """One step of a ring exchange: every member sends a block to the next one, at once."""
        pp = int(self.coords[rank, 0])
        key = ("ring_step", dim, size_bytes, pp if self.mode == "reduced" else gi)
        req = self._request_cache.get(key)
        if req is None:
            groups = self._groups[dim]
            if self.mode == "reduced":
                groups = groups[self.coords[groups[:, 0], 0] == pp]
            else:
                groups = groups[gi : gi + 1]
            pairs = np.stack([groups, np.roll(groups, -1, axis=1)], axis=-1).reshape(-1, 2)
            req = CollectiveRequest("send_recv", dim, pairs, size_bytes)
            self._request_cache[key] = req
        return req

    def _p2p_request(self, src: int, dst: int, size_bytes: float) -> CollectiveRequest:
        key = ("pp", src, dst, size_bytes)
        req = self._request_cache.get(key)
        if req is None:
            if self.mode == "reduced":
                # All replicas send together: same (dp, cp, tp) offsets, the two pipeline ranks.
                g = self._groups["pp"]
                ps, pd_ = int(self.coords[src, 0]), int(self.coords[dst, 0])
                pairs = np.stack([g[:, ps], g[:, pd_]], axis=1)
            else:
                pairs = np.array([[src, dst]])
            req = CollectiveRequest("send_recv", "pp", pairs, size_bytes)
            self._request_cache[key] = req
        return req

    def _peer(self, rank: int, pp_rank: int) -> int:
        _, dp, cp, tp, _ = self.coords[rank]
        if self.mode == "reduced":
            return self.mesh.rank(pp=pp_rank)
        return self.mesh.rank(pp=pp_rank, dp=int(dp), cp=int(cp), tp=int(tp))

    # ------------------------------------------------------------------ run

    def run(self) -> Timeline:
        t_wall = time.perf_counter()
        env = simpy.Environment()
        self.env = env
        self.rows: list[tuple] = []
        self.n_events = 0
        self.rdv: dict[tuple, _Rendezvous] = {}
        self._needed: dict[tuple, int] = {}
        self.outstanding: dict[tuple[int, str], int] = defaultdict(int)
        self.seq: dict[tuple, int] = defaultdict(int)
        self.events: dict[tuple, simpy.Event] = {}
        self.transfer_start: dict[tuple, float] = {}
        self.busy = {r: 0.0 for r in self.ranks}
        self.exposed = {r: dict.fromkeys(DIMS, 0.0) for r in self.ranks}
        self.comm_bytes = {r: dict.fromkeys(DIMS, 0.0) for r in self.ranks}
        self.waiting_on: dict[int, str] = {}
        self.finished: set[int] = set()
        self.end_time: dict[int, float] = {}
        self.wait_rows: list[tuple] = []

        self.stores: dict[tuple[int, str], simpy.Store] = {}
        for r in self.ranks:
            for stream in ("tp", "cp", "ep", "pp-send-f", "pp-send-b", "dp", "dp-ag"):
                st = simpy.Store(env)
                self.stores[(r, stream)] = st
                if stream in ("tp", "cp", "ep"):
                    env.process(self._collective_stream(r, stream, st))
                elif stream in ("dp", "dp-ag"):
                    env.process(self._dp_stream(r, stream, st))
                else:
                    env.process(self._send_stream(r, stream, st))
            env.process(self._compute_stream(r))
        env.run()
        if len(self.finished) < len(self.ranks):
            stuck = [r for r in self.ranks if r not in self.finished]
            detail = "; ".join(f"rank {r} (pp {int(self.coords[r, 0])}) waits on {self.waiting_on.get(r, '?')}" for r in stuck[:6])
            more = f" and {len(stuck) - 6} more" if len(stuck) > 6 else ""
            raise SimulationStalled(
                f"simulation stalled at t={env.now:.6f}s: {detail}{more}: the schedule has a dependency cycle; fix the schedule"
            )
        step = max(self.end_time.values())
        events = pd.DataFrame.from_records(self.rows, columns=TIMELINE_COLUMNS)
        report = []
        if hasattr(self.net, "link_report"):
            report = self.net.link_report(duration_s=step)  # type: ignore[attr-defined]
        return Timeline(
            events=events, step_time_s=step, ranks=list(self.ranks),
            pp_rank_of={r: int(self.coords[r, 0]) for r in self.ranks},
            busy_compute_s=self.busy, exposed_s=self.exposed, comm_bytes=self.comm_bytes,
            sim_wall_s=time.perf_counter() - t_wall, num_events=self.n_events, mode=self.mode,
            network_report=report,
            waits=pd.DataFrame.from_records(self.wait_rows, columns=WAIT_COLUMNS),
            end_time_s=dict(self.end_time), optimizer_s=float(self.prog.optimizer_s),
        )

    # ------------------------------------------------------------------ streams

    def _event(self, key: tuple) -> simpy.Event:
        ev = self.events.get(key)
        if ev is None:
            ev = self.env.event()
            self.events[key] = ev
        return ev

    def _collective(self, rank: int, dim: str, op: str, size_bytes: float):
        """Rendezvous with the group's simulated members, then run the collective."""
        req, gkey = self._request(dim, op, size_bytes, rank)
        wire = size_bytes if op == "ring_step" else bus_factor(op, self._groups[dim].shape[1]) * size_bytes
        self.comm_bytes[rank][BASE_DIM[dim]] += wire
        sk = (rank, dim)
        seq = self.seq[sk]
        self.seq[sk] = seq + 1
        key = (gkey, seq)
        rv = self.rdv.get(key)
        if rv is None:
            needed = self._needed.get(gkey)
            if needed is None:
                needed = int(self.simulated[self._groups[dim][gkey[1]]].sum())
                self._needed[gkey] = needed
            rv = _Rendezvous(needed, self.env.event())
            self.rdv[key] = rv
        rv.arrived += 1
        if rv.arrived == rv.needed:
            del self.rdv[key]
            start = self.env.now
            net_ev = self.net.start(self.env, req)
            net_ev.callbacks.append(lambda _e, done=rv.done, s=start: done.succeed(s))
        return rv.done

    def _collective_stream(self, rank: int, stream: str, store: simpy.Store):
        env = self.env
        while True:
            comm, done, meta = yield store.get()
            t0 = env.now
            ev = self._collective(rank, comm.dim, comm.op, comm.size_bytes)
            yield ev
            self.n_events += 2
            mb, stage, layer, name = meta
            self.rows.append((rank, stream, comm.dim, f"{comm.op} {name}", t0, env.now, mb, stage, layer, comm.size_bytes))
            self.outstanding[(rank, stream)] -= 1
            done.succeed()

    def _send_stream(self, rank: int, stream: str, store: simpy.Store):
        env = self.env
        while True:
            dst, key, mb, stage, kind = yield store.get()
            t0 = env.now
            self.transfer_start[(dst, key)] = t0
            req = self._p2p_request(rank, dst, self.prog.pp_bytes)
            self.comm_bytes[rank]["pp"] += self.prog.pp_bytes
            yield self.net.start(env, req)
            self.n_events += 2
            if self.prog.pp_gather_bytes > 0:
                # Megatron's scatter/gather: the slices arrive, then an all-gather over NVLink.
                gather, _ = self._request("tp", "all_gather", self.prog.pp_gather_bytes, dst)
                yield self.net.start(env, gather)
                self.n_events += 1
            name = f"send {kind} mb{mb}"
            self.rows.append((rank, stream, "pp", name, t0, env.now, mb, stage, -1, self.prog.pp_bytes))
            self.rows.append((dst, "pp-recv-f" if stream == "pp-send-f" else "pp-recv-b", "pp",
                              f"recv {kind} mb{mb}", t0, env.now, mb, stage, -1, self.prog.pp_bytes))
            self._event((dst, key)).succeed()

    def _dp_stream(self, rank: int, stream: str, store: simpy.Store):
        env = self.env
        while True:
            steps, done, label = yield store.get()
            t0 = env.now
            # A request may chain collectives (HSDP: reduce-scatter in the shard group, then
            # all-reduce of the shard across replicas).
            for dim, op, size_bytes in steps:
                yield self._collective(rank, dim, op, size_bytes)
                self.n_events += 2
            self.rows.append((rank, stream, "dp", f"{steps[0][1]} {label}", t0, env.now, -1, -1, -1, steps[0][2]))
            if done is not None:
                done.succeed()

    def _compute_stream(self, rank: int):
        env = self.env
        prog, sched = self.prog, self.sched
        pp_rank = int(self.coords[rank, 0])
        actions = sched.actions[pp_rank]
        stores = self.stores
        exposed = self.exposed[rank]
        wait_rows = self.wait_rows

        def waited(t0: float, cause: str, issued: float = float("nan"), src: int = -1):
            if env.now > t0:
                wait_rows.append((rank, t0, env.now, cause, issued, src, self.waiting_on.get(rank, "")))

        # Which action is the last backward (B or W) of each stage: gradient buckets fill there.
        last_grad_action: dict[int, int] = {}
        for idx, a in enumerate(actions):
            for sub in (a.sub if a.kind == "FB" else (a,)):
                if sub.kind in ("B", "W"):
                    last_grad_action[sub.stage] = idx
        zb = any(a.kind == "W" for a in actions)
        use_dp = self.mesh.dp > 1
        zero3 = prog.zero >= 3
        hsdp = zero3 and prog.fsdp_shard_size is not None and prog.fsdp_shard_size < self.mesh.dp
        use_edp = self.mesh.edp > 1
        pending_dp: list[simpy.Event] = []
        bucket = [0.0, 0.0]  # dense, expert gradient bytes waiting to be reduced

        def grad_steps(size: float, expert: bool) -> list[tuple[str, str, float]]:
            if expert:
                return [("edp", "all_reduce" if prog.zero == 0 else "reduce_scatter", size)]
            if prog.zero == 0:
                return [("dp", "all_reduce", size)]
            if hsdp:
                shard = prog.fsdp_shard_size
                return [("dp_shard", "reduce_scatter", size), ("dp_rep", "all_reduce", size / shard)]
            return [("dp", "reduce_scatter", size)]

        def flush(label: str):
            for i, expert, on in ((0, False, use_dp), (1, True, use_edp)):
                if bucket[i] > 0 and on:
                    ev = env.event()
                    pending_dp.append(ev)
                    stores[(rank, "dp")].put((grad_steps(bucket[i], expert), ev, label))
                bucket[i] = 0.0

        # ZeRO-1/2: the updated parameters are all-gathered; Megatron overlaps that with the
        # next step's forward, so a stage's first forward waits for its own gather.
        param_ready: dict[int, simpy.Event] = {}
        if 1 <= prog.zero <= 2 and use_dp:
            for st in sched.stages_of_rank(pp_rank):
                ev = env.event()
                param_ready[st] = ev
                pos = sched.stage_position[st]
                expert = prog.stage_expert_params[pos] if prog.stage_expert_params else 0.0
                # Dense parameters are sharded over dp, expert parameters over edp.
                steps = [("dp", "all_gather", (prog.stage_params[pos] - expert) * prog.param_bytes)]
                if expert > 0 and use_edp:
                    steps.append(("edp", "all_gather", expert * prog.param_bytes))
                stores[(rank, "dp-ag")].put((steps, ev, f"params stage {st}"))

        # ZeRO-3 / FSDP: every unit (layer) is all-gathered before it runs, forward and (when
        # resharded after forward) backward, `fsdp_prefetch` units ahead on its own stream.
        gathers: list[tuple[int, int, float]] = []  # (action index, layer, bytes) in execution order
        ag_dim = "dp_shard" if hsdp else "dp"
        if zero3 and use_dp:
            gathered: set[tuple[int, int]] = set()
            for idx, a in enumerate(actions):
                for sub in (a.sub if a.kind == "FB" else (a,)):
                    if sub.kind == "W" or (sub.kind != "F" and not prog.fsdp_reshard_after_forward):
                        continue
                    seg = prog.segments[(sched.stage_position[sub.stage], sub.kind)]
                    for L in dict.fromkeys(int(x) for x in seg.layer):
                        if prog.fsdp_reshard_after_forward or (sub.stage, L) not in gathered:
                            gathered.add((sub.stage, L))
                            gathers.append((idx, L, prog.unit_params.get(L, 0.0) * prog.param_bytes))
        gather_events: list[simpy.Event] = [env.event() for _ in gathers]
        next_gather = [0, 0]  # [next to wait for, next to issue]

        def issue_gathers(upto: int):
            while next_gather[1] < min(upto, len(gathers)):
                i = next_gather[1]
                _, L, nbytes = gathers[i]
                stores[(rank, "dp-ag")].put(([(ag_dim, "all_gather", nbytes)], gather_events[i], f"params layer {L}"))
                next_gather[1] += 1

        issue_gathers(1 + prog.fsdp_prefetch)

        def wait_gather(idx: int, layer: int):
            i = next_gather[0]
            if i >= len(gathers) or gathers[i][0] != idx or gathers[i][1] != layer:
                return
            next_gather[0] += 1
            issue_gathers(i + 1 + prog.fsdp_prefetch)
            ev = gather_events[i]
            if not ev.triggered:
                t0 = env.now
                self.waiting_on[rank] = f"dp all_gather of layer {layer} parameters"
                yield ev
                exposed["dp"] += env.now - t0
                waited(t0, "dp")

        def wait_pending(pending: list):
            for dim, done, *issued in pending:
                if not done.triggered:
                    t0 = env.now
                    self.waiting_on[rank] = f"overlapped {dim} communication"
                    yield done
                    exposed[BASE_DIM[dim]] += env.now - t0
                    waited(t0, BASE_DIM[dim], *issued)
            pending.clear()

        def run_segments(a: Action, idx: int, grads_here: bool, blocking: bool):
            pos = sched.stage_position[a.stage]
            seg = prog.segments[(pos, a.kind)]
            pending: list = []  # overlapped collectives in flight
            deferred: list = []  # collectives of an overlapped F&B pair, waited for at its end
            layer = None
            expert_grads = seg.expert_grad_bytes
            for j in range(len(seg.compute_s)):
                if gathers and int(seg.layer[j]) != layer:
                    layer = int(seg.layer[j])
                    yield from wait_gather(idx, layer)
                c = seg.compute_s[j]
                if c > 0:
                    t0 = env.now
                    yield env.timeout(c)
                    self.n_events += 1
                    self.busy[rank] += c
                    self.rows.append((rank, "compute", a.kind, seg.label[j], t0, env.now, a.microbatch, a.stage,
                                      int(seg.layer[j]), 0.0))
                if grads_here and prog.overlap_grad_reduce:
                    bucket[0] += seg.grad_bytes[j]
                    if expert_grads is not None:
                        bucket[1] += expert_grads[j]
                    # FSDP reduces per unit; DDP/ZeRO-1/2 per bucket.
                    unit_done = zero3 and (j + 1 == len(seg.compute_s) or int(seg.layer[j + 1]) != int(seg.layer[j]))
                    if bucket[0] + bucket[1] >= prog.grad_bucket_bytes or (unit_done and bucket[0] + bucket[1] > 0):
                        flush(f"grads stage {a.stage}")
                comm: Comm | None = seg.comm[j]
                if comm is not None:
                    yield from wait_pending(pending)
                    sk = (rank, comm.dim)
                    if blocking and not comm.overlap and not self.outstanding[sk]:
                        # The stream is idle and compute blocks on it anyway: run the collective
                        # in place (same timing, a third of the events of a hand-over).
                        t0 = env.now
                        self.waiting_on[rank] = f"{comm.dim} {comm.op} in {a}"
                        yield self._collective(rank, comm.dim, comm.op, comm.size_bytes)
                        self.n_events += 2
                        self.rows.append((rank, comm.dim, comm.dim, f"{comm.op} {seg.label[j]}", t0, env.now, a.microbatch,
                                          a.stage, int(seg.layer[j]), comm.size_bytes))
                        exposed[comm.dim] += env.now - t0
                        waited(t0, BASE_DIM[comm.dim], t0)
                        continue
                    done = env.event()
                    self.outstanding[sk] += 1
                    stores[sk].put((comm, done, (a.microbatch, a.stage, int(seg.layer[j]), seg.label[j])))
                    if not blocking:
                        deferred.append((comm.dim, done, env.now))
                    elif comm.overlap:
                        pending.append((comm.dim, done, env.now))
                    else:
                        t0 = env.now
                        self.waiting_on[rank] = f"{comm.dim} {comm.op} in {a}"
                        yield done
                        exposed[comm.dim] += env.now - t0
                        waited(t0, BASE_DIM[comm.dim], t0)
            yield from wait_pending(pending)
            # Overlapped F&B: what the pair's compute could not hide is exposed at its end.
            yield from wait_pending(deferred)

        def wait_inputs(a: Action):
            for (st, kind, mb) in required_inputs(sched, a):
                src_pp = sched.stage_rank[st]
                if src_pp == pp_rank:
                    ev = self._event((rank, (st, kind, mb)))
                    if not ev.triggered:
                        t0 = env.now
                        self.waiting_on[rank] = f"{st}{kind}{mb} (same rank) before {a}"
                        yield ev
                        waited(t0, "bubble", src=rank)
                    continue
                key = (st, kind, mb)
                ev = self._event((rank, key))
                if ev.triggered:
                    continue
                t0 = env.now
                self.waiting_on[rank] = f"{'activation' if kind == 'F' else 'gradient'} of {st}{kind}{mb} from pp rank {src_pp} before {a}"
                yield ev
                self.n_events += 1
                # Waiting while the transfer was in flight is exposed pp communication; waiting
                # for the producer to finish computing is pipeline bubble.
                ts = self.transfer_start.get((rank, key), env.now)
                exposed["pp"] += env.now - max(t0, ts)
                src = self._peer(rank, src_pp)
                if ts > t0:
                    wait_rows.append((rank, t0, min(ts, env.now), "bubble", float("nan"), src, self.waiting_on[rank]))
                now = env.now
                if now > max(t0, ts):
                    wait_rows.append((rank, max(t0, ts), now, "pp", ts, src, self.waiting_on[rank]))

        def complete(a: Action):
            kinds = []
            if a.kind == "F":
                kinds.append("F")
            elif a.kind in ("B", "I"):
                kinds.append("BI")
            for kind in kinds:
                key = (a.stage, kind, a.microbatch)
                self._event((rank, key)).succeed()
                consumer = sched.stage_next[a.stage] if kind == "F" else sched.stage_prev[a.stage]
                if consumer >= 0:
                    dst_pp = sched.stage_rank[consumer]
                    if dst_pp != pp_rank:
                        dst = self._peer(rank, dst_pp)
                        stream = "pp-send-f" if kind == "F" else "pp-send-b"
                        stores[(rank, stream)].put((dst, key, a.microbatch, a.stage, kind))

        for idx, a in enumerate(actions):
            subs = a.sub if a.kind == "FB" else (a,)
            for sub in subs:
                yield from wait_inputs(sub)
                if sub.kind == "F" and sub.stage in param_ready and not param_ready[sub.stage].triggered:
                    t0 = env.now
                    self.waiting_on[rank] = f"dp all_gather of stage {sub.stage} parameters"
                    yield param_ready[sub.stage]
                    exposed["dp"] += env.now - t0
                    waited(t0, "dp", 0.0)
            for sub in subs:
                g = last_grad_action.get(sub.stage) == idx and sub.kind in (("W",) if zb else ("B", "W"))
                yield from run_segments(sub, idx, g, blocking=a.kind != "FB")
                complete(sub)
                if g and prog.overlap_grad_reduce:
                    flush(f"grads stage {sub.stage}")

        # Gradient reduction not overlapped with backward: all buckets after the last backward.
        if not prog.overlap_grad_reduce:
            for st in sched.stages_of_rank(pp_rank):
                w = prog.segments[(sched.stage_position[st], "W")]
                dense = float(w.grad_bytes.sum())
                expert = float(w.expert_grad_bytes.sum()) if w.expert_grad_bytes is not None else 0.0
                n_buckets = max(1, int(np.ceil((dense + expert) / prog.grad_bucket_bytes)))
                for _ in range(n_buckets):
                    bucket[0], bucket[1] = dense / n_buckets, expert / n_buckets
                    flush(f"grads stage {st}")
        for ev in pending_dp:
            if not ev.triggered:
                t0 = env.now
                self.waiting_on[rank] = "dp gradient reduction"
                yield ev
                exposed["dp"] += env.now - t0
                waited(t0, "dp")
        # Optimizer step on this rank's (ZeRO-sharded) parameters.
        if prog.optimizer_s > 0:
            t0 = env.now
            yield env.timeout(prog.optimizer_s)
            self.busy[rank] += prog.optimizer_s
            self.rows.append((rank, "compute", "opt", "optimizer step", t0, env.now, -1, -1, -1, 0.0))
        self.finished.add(rank)
        self.end_time[rank] = env.now
        self.waiting_on.pop(rank, None)
