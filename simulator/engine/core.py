"""The SimPy model: a generic replay of each rank's plan, collectives as rendezvous, the network
behind an interface. It runs on the lean event core (``simulator.engine.events``: SimPy's event
order without SimPy's per-event objects), or on SimPy itself (``core="simpy"``, the reference).

The engine holds no parallelism policy. The workload's plan (``simulator.workload.plan``) lists,
per pipeline rank, compute segments, blocking and asynchronous collectives on named streams,
waits, input receipts and completions; the engine replays it (DESIGN rules 2 and 3). One
long-lived process per (rank, stream):
  compute      walks the rank's plan
  tp, cp, ep, dp, dp-ag ...   collectives the compute stream hands over, in order
  pp-send-f/b  activations to the next stage, gradients to the previous one

A collective is a rendezvous: it starts when every *simulated* member of its group has issued
it, and its duration comes from the network. In reduced mode one representative per pipeline
rank is simulated (tp, cp, dp peers run the same plan on the same hardware); the request still
names every replica group, so the network sees all the traffic. In full mode every rank is
simulated and every group rendezvous for real.

Point-to-point transfers are eager: the receiver's buffer is always posted, so a transfer starts
as soon as its sender's stream is free. Only true dependency cycles can then stall the loop, and
a stall is reported (which ranks wait on what), never returned as a result.
"""

from __future__ import annotations

import time
from array import array
from collections import defaultdict, deque
from functools import partial
from operator import itemgetter
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pandas as pd
import simpy

from simulator.contention import P2P_CTAS, collective_ctas, compute_slowdown, scaled_slowdown
from simulator.engine import events as lean_events
from simulator.errors import SimulationStalled
from simulator.gcpause import cyclic_gc_paused
from simulator.network.base import CollectiveRequest, Network
from simulator.vocabulary import GROUP_DIMS, REPORT_DIMS, RECV_STREAM_OF, CollectiveOp, Dim, Stream, bus_factor
from simulator.workload.plan import Collective, Complete, Compute, Plan, Post, Recv, SendDone, Wait, build_plan
from simulator.workload.program import Program

Mode = Literal["reduced", "full", "every-rank"]  # every-rank: full mode without the lockstep shortcut (simulator.engine.lockstep)
# The event core: "lean" (simulator.engine.events, SimPy's order without its per-event objects)
# or "simpy" (the reference it is checked against, value for value).
Core = Literal["lean", "simpy"]
DIMS: tuple[str, ...] = tuple(d.value for d in REPORT_DIMS)
# Sub-groups report under their parallel dimension.
BASE_DIM = {d.value: d.base.value for d in Dim}
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
    # rank -> seconds compute took longer because communication kernels held SMs (contention)
    contention_s: dict[int, float] = field(default_factory=dict)
    waits: pd.DataFrame | None = None  # WAIT_COLUMNS; None from an engine that does not record them
    end_time_s: dict[int, float] = field(default_factory=dict)  # rank -> when its compute stream finished
    # Set when the steady-state fast path (simulator.engine.steady) produced this timeline: how
    # many schedule periods were replayed in closed form, the period, and the microbatches simulated.
    fast_forward: dict | None = None
    # Set when full mode simulated one rank per pipeline rank and gave its rows to every rank of
    # it (simulator.engine.lockstep): {"simulated_ranks": n, "ranks": world}.
    lockstep: dict | None = None
    # Seconds of sim_wall_s in the event loop itself: without the set-up before it (the plans'
    # requests analysed and routed once, O(world) for world-sized groups) and the frames after.
    loop_wall_s: float | None = None
    # False where the steady-state fast path was asked for the figures only (simulate(rows=False)):
    # the replayed periods' rows were not made, events and waits are empty, and row_totals holds
    # what the report reads from the rows (simulator.engine.steady.row_totals), summed without them.
    rows: bool = True
    row_totals: dict | None = None


def _describe(w: object) -> str:
    """What a compute stream waits on, in words: a plan instruction, a note, or unknown."""
    return "?" if w is None else w if isinstance(w, str) else w.describe()  # type: ignore[attr-defined]


# The cause a Wait's exposed time is reported under (its dimension's base), as text.
_WAIT_CAUSE = {d.value: str(d.base) for d in Dim} | {d: str(d.base) for d in Dim}
# A stream's name (an enum's .value goes through a descriptor: once per plan instruction adds up).
_STREAM_NAME = {s: s.value for s in Stream}


class _Queue:
    """A stream's work queue: what ``simpy.Store`` did here, without its put and get events.

    The consumer's wake-up is scheduled at the same point of the event order as the Store's
    get event was (on put when the stream waits, on get when work is queued), so the
    simulation's order, and every result, is unchanged; the put event, which nothing
    waited on, is gone."""

    __slots__ = ("items", "waiter")

    def __init__(self):
        self.items: deque = deque()
        self.waiter: simpy.Event | None = None

    def put(self, item: tuple) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            w.succeed(item)
        else:
            self.items.append(item)

    def get(self, env: simpy.Environment) -> simpy.Event:
        ev = env.event()
        if self.items:
            ev.succeed(self.items.popleft())
        else:
            self.waiter = ev
        return ev


class _Rendezvous:
    """Collects the simulated members of a group; the last arrival starts the collective.
    Shared by Engine and SplitEngine (simulator.whatif.split)."""

    __slots__ = ("needed", "arrived", "done", "arrivals")

    def __init__(self, needed: int, done: simpy.Event):
        self.needed = needed
        self.arrived = 0
        self.done = done
        self.arrivals: list[tuple[int, float]] | None = None  # (rank, time), only for a wait log

    def arrive(self, rank: int, now: float, log: list | None) -> bool:
        """Count an arrival (kept with its time where waits are logged); True for the last."""
        self.arrived += 1
        if log is not None:
            if self.arrivals is None:
                self.arrivals = []
            self.arrivals.append((rank, now))
        return self.arrived == self.needed

    def log_waits(self, log: list | None, start: float, last: int, dim: str) -> None:
        """Each earlier member waited on the last one from its arrival to ``start`` (what-if's
        "who waits on whom", in the clean run and the perturbed one alike)."""
        if log is None or not self.arrivals:
            return
        base = BASE_DIM[dim]
        for r, t in self.arrivals[:-1]:
            if start > t:
                log.append((r, last, base, start - t))


class _Rows:
    """Rows kept as columns while the loop runs: a code per row for what every rank of a pipeline
    rank shares (the plan instruction's stream, kind, name, microbatch, stage, layer, bytes),
    the rank and the two times in typed arrays. A row costs 32 bytes instead of a 10-tuple and
    its floats (~180 bytes), and the frame is built with numpy takes instead of from millions
    of tuples (docs/design-notes.md, "Event core")."""

    __slots__ = ("code", "rank", "t0", "t1", "shared", "index")

    def __init__(self):
        self.code, self.rank, self.t0, self.t1 = array("q"), array("q"), array("d"), array("d")
        self.shared: list[tuple] = []  # code -> the columns every row with that code has
        self.index: dict = {}  # key -> code

    def code_of(self, key, shared: tuple) -> int:
        """The code of ``key`` (a new one holding ``shared`` the first time)."""
        c = self.index.get(key)
        if c is None:
            c = self.index[key] = len(self.shared)
            self.shared.append(shared)
        return c

    def columns(self, names: list[str], dtypes: dict, shared: list[tuple] | None = None,
                order: np.ndarray | None = None) -> dict:
        """name -> column; the shared columns taken by code (``dtypes``: a column's dtype where
        it is not inferred from its values; ``shared``: the shared tuples to use, by code, in
        place of the recorded ones; ``order``: the rows in this order, else as written)."""
        shared = self.shared if shared is None else shared
        # np.array on an array buffer copies it with its type ('q' int64, 'd' float64), empty included.
        codes = np.array(self.code)
        out = {"rank": np.array(self.rank), "t0": np.array(self.t0), "t1": np.array(self.t1)}
        if order is not None:
            codes = codes[order]
            out = {k: v[order] for k, v in out.items()}
        for i, name in enumerate(names):
            # One column of the shared tuples (itemgetter: zip(*shared) over ~10^6 tuples
            # measured 4-5x slower), then taken by code.
            values = list(map(itemgetter(i), shared))
            dt = dtypes.get(name)
            if isinstance(dt, np.dtype):
                out[name] = np.array(values, dtype=dt)[codes]
            elif dt == "category":
                # a code per row into the distinct values (a few hundred): 1-2 bytes a row
                # instead of an Arrow string's offset and characters (~10-26 bytes). Categories
                # in string order, so sorting and grouping by the column order rows as before.
                # (factorized as Python objects, then only the distinct values made strings:
                # half the time of converting every value first; the same codes and order)
                value_codes, uniques = pd.factorize(np.array(values, dtype=object), sort=True)
                out[name] = pd.Categorical.from_codes(value_codes[codes], categories=pd.array(uniques, dtype=_STR))
            elif dt is not None:
                out[name] = pd.array(values, dtype=dt).take(codes)
            else:
                out[name] = np.asarray(values)[codes]
        return out


# pandas' string dtype (the categories of the timeline's string columns).
_STR = pd.Series(["x"]).dtype

# A pipeline event triggered before anybody asked for it (Engine._trigger): only its
# ``triggered`` is ever read.
_TRIGGERED = lean_events.Event(None)
_TRIGGERED._ok, _TRIGGERED._value, _TRIGGERED.callbacks = True, None, None


class Engine:
    # Closed-form stretches (``_replay``): a rank whose streams are idle runs its compute segments
    # and its closed-form collectives (``_closed_form_requests``) ahead of the event loop, on its
    # own clock, and meets the loop again at its next interaction (a receipt, a send, an
    # asynchronous collective, a wait, a shared collective). Nothing outside the rank can change
    # those durations (no SMs taken, no link shared), so the times are the ones the loop would
    # give, addition for addition; the events saved are the loop's, not the timeline's rows.
    run_ahead = True
    # False: the waits' "what" column is left empty ("") instead of describing each awaited
    # instruction in words. For a run whose rows nobody reads (the fast path's short run when
    # only the report's figures are wanted: simulate(..., rows=False)); describing them and
    # factorizing ~10^5 distinct texts was 0.15 s of Megatron 529.6B's 5.5 s.
    describe_waits = True

    def __init__(self, program: Program, network: Network, mode: Mode = "reduced", plan: Plan | None = None,
                 sm_count: int | None = None, contention_scale: float = 1.0, core: Core = "lean"):
        """``core``: the event loop (``Core``); both give the same timeline.
        ``sm_count``: the GPU's SMs; given, compute that overlaps in-flight communication
        kernels slows down by the SMs they hold (``simulator.contention``); None: no contention.
        ``contention_scale``: scale on that slowdown's excess measured from traces
        (``simulator.contention.measured_excess_scale``); 1.0: the SM-share model as it is."""
        if core not in ("lean", "simpy"):
            raise ValueError(f"core must be 'lean' or 'simpy', got {core!r}")
        self.core = core
        self.sm_count = sm_count
        self.contention_scale = contention_scale
        self.prog = program
        self.plan = plan if plan is not None else build_plan(program)
        self.net = network
        self.mode = mode
        self.mesh = program.mesh
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
        self._pp_of = coords[:, 0].astype(np.int64)
        self._group_index: dict[str, np.ndarray] = {}
        self._groups: dict[str, np.ndarray] = {}
        for dim in GROUP_DIMS:
            groups = self.plan.groups[dim]
            idx = np.empty(self.mesh.world_size, dtype=np.int64)
            idx[groups.ravel()] = np.repeat(np.arange(len(groups)), groups.shape[1])
            self._groups[dim] = groups
            self._group_index[dim] = idx
        self._request_cache: dict[tuple, CollectiveRequest] = {}
        self._peers: dict[tuple[int, int], int] = {}  # (rank, pipeline rank) -> its peer there
        self._wire_factor: dict[tuple, float] = {}
        # What-if hooks (simulator.whatif), empty in a nominal run: per simulated rank, a factor
        # per Compute instruction of its plan (1/speed x jitter); and, when a list, every wait
        # of a compute stream on a pipeline receipt as (waiter, sender, dim, seconds).
        self.compute_factor: dict[int, np.ndarray] = {}
        self.wait_log: list[tuple[int, int, str, float]] | None = None
        # Steady-state fast path (simulator.engine.steady): when a dict, each simulated rank's
        # accumulators as its first compute segment of every action starts, keyed by
        # (stage, kind, microbatch): (time, busy, exposed per dim, bytes per dim, contention).
        self.action_marks: dict[int, dict[tuple, tuple]] | None = None

    # ------------------------------------------------------------------ helpers

    def _request(self, dim: str, op: str, size_bytes: float, rank: int) -> tuple[CollectiveRequest, tuple]:
        """The request a rank's group issues, and the rendezvous key prefix of that group."""
        gi = int(self._group_index[dim][rank])
        if op == CollectiveOp.RING_STEP:
            return self._ring_step_request(dim, size_bytes, rank, gi), (dim, gi)
        if self.mode == "reduced":
            # Every replica group with the same pipeline rank issues this collective together.
            pp = int(self._pp_of[rank])
            ckey = (dim, op, size_bytes, pp)
            req = self._request_cache.get(ckey)
            if req is None:
                groups = self._groups[dim]
                # Groups across pipeline ranks (pp, emb) are issued by every pipeline rank's representative.
                sel = self._pp_of[groups[:, 0]] == pp if dim not in (Dim.PP, Dim.EMB) else np.ones(len(groups), bool)
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
        pp = int(self._pp_of[rank])
        key = ("ring_step", dim, size_bytes, pp if self.mode == "reduced" else gi)
        req = self._request_cache.get(key)
        if req is None:
            groups = self._groups[dim]
            if self.mode == "reduced":
                groups = groups[self._pp_of[groups[:, 0]] == pp]
            else:
                groups = groups[gi : gi + 1]
            pairs = np.stack([groups, np.roll(groups, -1, axis=1)], axis=-1).reshape(-1, 2)
            req = CollectiveRequest(CollectiveOp.SEND_RECV, dim, pairs, size_bytes)
            self._request_cache[key] = req
        return req

    def _p2p_request(self, src: int, dst: int, size_bytes: float) -> CollectiveRequest:
        key = ("pp", src, dst, size_bytes)
        req = self._request_cache.get(key)
        if req is None:
            if self.mode == "reduced":
                # All replicas send together: same (dp, cp, tp) offsets, the two pipeline ranks.
                g = self._groups[Dim.PP]
                ps, pd_ = int(self._pp_of[src]), int(self._pp_of[dst])
                pairs = np.stack([g[:, ps], g[:, pd_]], axis=1)
            else:
                pairs = np.array([[src, dst]])
            req = CollectiveRequest(CollectiveOp.SEND_RECV, Dim.PP, pairs, size_bytes)
            self._request_cache[key] = req
        return req

    def _peer(self, rank: int, pp_rank: int) -> int:
        key = (rank, pp_rank)
        peer = self._peers.get(key)
        if peer is None:
            _, dp, cp, tp, _ = self.coords[rank]
            if self.mode == "reduced":
                peer = self.mesh.rank(pp=pp_rank)
            else:
                peer = self.mesh.rank(pp=pp_rank, dp=int(dp), cp=int(cp), tp=int(tp))
            self._peers[key] = peer
        return peer

    # ------------------------------------------------------------------ run

    def run(self) -> Timeline:
        t_wall = time.perf_counter()
        env = lean_events.Environment() if self.core == "lean" else simpy.Environment()
        self.env = env
        # What a process yields to wait ``x`` seconds: the number itself on the lean core (no
        # Timeout object), a Timeout on SimPy's. Same heap entry, same order.
        self._delay = float if self.core == "lean" else env.timeout
        self.rows = _Rows()
        self.n_events = 0
        self.rdv: dict[tuple, _Rendezvous] = {}
        self._needed: dict[tuple, int] = {}
        # Per simulated rank (a list indexed by rank: no hashing of a rank key per issue, and a
        # small dict per rank instead of one world-sized one): (dim, op, bytes) -> what an issue
        # needs (_collective).
        self._collectives_of_rank: list[dict | None] = [None] * self.mesh.world_size
        for r in self.ranks:
            self._collectives_of_rank[r] = {}
        self._seq_box: dict[tuple, list[int]] = {}  # (rank, dim) -> [next rendezvous number]
        # rank -> stream -> work handed to the stream and not finished (list indexed by rank)
        self.outstanding: list[defaultdict | None] = [None] * self.mesh.world_size
        for r in self.ranks:
            self.outstanding[r] = defaultdict(int)
        self.seq: dict[tuple, int] = defaultdict(int)  # (rank, dim) -> next rendezvous number (SplitEngine)
        self.events: dict[tuple, simpy.Event] = {}
        self.transfer_start: dict[tuple, float] = {}
        self.busy = {r: 0.0 for r in self.ranks}
        self.exposed = {r: dict.fromkeys(DIMS, 0.0) for r in self.ranks}
        self.comm_bytes = {r: dict.fromkeys(DIMS, 0.0) for r in self.ranks}
        # rank -> SMs held by its running NCCL kernels (lists indexed by rank: read per segment)
        self.sms_taken = [0] * self.mesh.world_size
        self.contention = dict.fromkeys(self.ranks, 0.0)
        self._sm_change: list = [None] * self.mesh.world_size  # rank -> wakes its contended compute segment
        self.waiting_on: list = [None] * self.mesh.world_size  # rank -> the instruction it waits on
        self.finished: set[int] = set()
        self.end_time: dict[int, float] = {}
        self.wait_rows = _Rows()
        self._w_issued, self._w_src = array("d"), array("q")
        self._codes_of_plan: dict[int, list[int]] = {}

        # id(request) -> request, for the blocking collectives that may run in closed form
        self._plan_uses_of: dict[int, tuple] = {}
        self._closed: dict[int, CollectiveRequest] = self._closed_form_requests() if self.run_ahead else {}
        self._joins_next_of: dict = {}
        self._stretches = 0  # closed-form stretches run (their rows were written ahead of the loop)
        streams_of = [rp.streams for rp in self.plan.ranks]
        self.stores: dict[tuple[int, str], _Queue] = {}
        self._in_place: dict[tuple[int, Stream], simpy.Event] = {}  # last transfer started in place (_start_copy)
        stream_loops = []  # (they wait for work forever: closed once the loop is done)
        for r in self.ranks:
            used = streams_of[int(self._pp_of[r])]
            for stream in Stream:
                if stream not in used:
                    continue
                st = _Queue()
                self.stores[(r, stream)] = st
                if stream in (Stream.PP_SEND_F, Stream.PP_SEND_B):
                    loop = self._send_stream(r, stream, st)
                else:
                    loop = self._collective_stream(r, stream, st)
                stream_loops.append(loop)
                env.process(loop)
            env.process(self._replay(r))
        # The cyclic collector's passes over millions of live rows cost ~20% of the loop's CPU
        # and find next to nothing (cyclic_gc_paused).
        try:
            with cyclic_gc_paused():
                t_loop = time.perf_counter()
                env.run()
                loop_wall_s = time.perf_counter() - t_loop
        finally:
            # A stream loop left waiting on its queue holds the engine (its frame's ``self``) from
            # an event the engine holds: a reference cycle over every plan instruction and event
            # of the run (2.2 M objects on Megatron 529.6B) that only the cyclic collector could
            # free, and whose first pass after the run (cyclic_gc_paused) took 0.4 s. Closed (also
            # when a run is stopped early), they are freed by reference counting with the engine.
            for loop in stream_loops:
                loop.close()
        if len(self.finished) < len(self.ranks):
            stuck = [r for r in self.ranks if r not in self.finished]
            detail = "; ".join(f"rank {r} (pp {int(self.coords[r, 0])}) waits on {self._waiting(r)}" for r in stuck[:6])
            more = f" and {len(stuck) - 6} more" if len(stuck) > 6 else ""
            raise SimulationStalled(
                f"simulation stalled at t={env.now:.6f}s: {detail}{more}: the schedule has a dependency cycle; "
                f"with a schedule_file, fix its order; with a shipped schedule this is a ClusterSim bug: report it "
                f"with the scenario"
            )
        step = max(self.end_time.values())
        events = self._event_frame()
        waits = self._wait_frame()
        # The frames hold the rows now; the row buffers (32 B a row, millions in full mode) would
        # otherwise stay alive beside them through the report, as long as the engine does.
        self.rows = self.wait_rows = None
        self._w_issued = self._w_src = None
        report = []
        if hasattr(self.net, "link_report"):
            report = self.net.link_report(duration_s=step)  # type: ignore[attr-defined]
        return Timeline(
            events=events, step_time_s=step, ranks=list(self.ranks),
            pp_rank_of={r: int(self.coords[r, 0]) for r in self.ranks},
            busy_compute_s=self.busy, exposed_s=self.exposed, comm_bytes=self.comm_bytes,
            sim_wall_s=time.perf_counter() - t_wall, num_events=self.n_events, mode=self.mode,
            network_report=report, contention_s=self.contention,
            waits=waits,
            end_time_s=dict(self.end_time), loop_wall_s=loop_wall_s,
        )

    def _closed_form_requests(self) -> dict[int, CollectiveRequest]:
        """The blocking collectives whose time nothing else can change while their rank's streams
        are idle, by request id: issued by one simulated rank alone (no rendezvous) from its
        compute stream, on links no other simulated rank ever puts bytes on. (The rank's own
        other streams may use them: ``_replay`` runs such a collective in closed form only while
        those are idle, and they stay idle until the rank issues work.) Found from every request
        the plans will issue, before the loop: which links whose requests touch, no policy."""
        net = self.net
        if not (hasattr(type(net), "links_of") and hasattr(type(net), "run_closed_form")):
            return {}
        uses: dict[tuple[int, int], CollectiveRequest] = {}  # (issuing rank, id(req)) -> req
        blocking: dict[int, CollectiveRequest] = {}
        for r in self.ranks:
            colls, sends = self._plan_uses(self.plan.ranks[int(self._pp_of[r])])
            for alone, steps in colls:
                for dim, op, size_bytes in steps:
                    req, gkey = self._request(dim, op, size_bytes, r)
                    uses[(r, id(req))] = req
                    if alone and int(self.simulated[self._groups[dim][gkey[1]]].sum()) == 1:
                        blocking[id(req)] = req
            for dst_pp, size_bytes in sends:
                req = self._p2p_request(r, self._peer(r, dst_pp), size_bytes)
                uses[(r, id(req))] = req
        if not blocking:
            return {}
        try:
            links = {rid: net.links_of(req) for (_, rid), req in uses.items()}
        except AttributeError:  # a wrapped network without them
            return {}
        n_links = 1 + max((int(ids.max()) for ids in links.values() if ids is not None and ids.size), default=-1)
        first = np.full(n_links, -1, dtype=np.int64)  # link -> the first rank seen using it
        shared = np.zeros(n_links, dtype=bool)  # link -> used by two ranks or more
        for r, rid in uses:
            ids = links[rid]
            if ids is None or not ids.size:
                continue
            owner = first[ids]
            shared[ids[(owner >= 0) & (owner != r)]] = True
            first[ids[owner < 0]] = r
        return {rid: req for rid, req in blocking.items()
                if links[rid] is None or not shared[links[rid]].any()}

    def _plan_uses(self, rp) -> tuple[list[tuple[bool, tuple]], list[tuple]]:
        """A pipeline rank's plan as the network sees it, once per plan: its distinct collectives
        as (blocking with one step, steps), and its distinct sends as (destination pipeline rank,
        bytes)."""
        hit = self._plan_uses_of.get(id(rp))
        if hit is None:
            colls: dict[tuple, None] = {}
            sends: dict[tuple, None] = {}
            for ins in rp.instrs:
                t = type(ins)
                if t is Collective:
                    colls[(ins.handle < 0 and len(ins.steps) == 1, tuple(ins.steps))] = None
                elif t is Complete:
                    for send in ins.sends:
                        sends[(send.dst_pp, send.size_bytes)] = None
            hit = self._plan_uses_of[id(rp)] = (list(colls), list(sends))
        return hit

    def _take_sms(self, rank: int, ctas: int) -> None:
        """NCCL kernels of ``rank`` take (ctas > 0) or release SMs; a compute segment running
        contended re-times itself at the new share."""
        if not ctas:
            return  # copy-engine transfers hold no SMs: nothing to re-time
        self.sms_taken[rank] += ctas
        ev = self._sm_change[rank]
        if ev is not None:
            self._sm_change[rank] = None
            if ev.__class__ is lean_events.Interruptible:
                ev.interrupt()
            elif not ev.triggered:
                ev.succeed()

    def _slowdown(self, rank: int, sm_share: float = 1.0) -> float:
        """Factor on compute time at the SMs ``rank``'s communication kernels hold now, for
        compute whose ``sm_share`` of time is in SM-bound kernels (the rest keeps its speed)."""
        return scaled_slowdown(compute_slowdown(self.sm_count, self.sms_taken[rank]), self.contention_scale * sm_share)

    def _contended_compute(self, rank: int, work_s: float, sm_share: float = 1.0):
        """Run ``work_s`` seconds of (uncontended) compute while NCCL kernels hold SMs: at
        1/slowdown of full speed while they do, at full speed once they are done; the SM-share
        law slows the segment's SM-bound share (GEMMs, attention), not its memory-bound kernels.
        Returns the wall time it took; the difference is counted as contention."""
        env = self.env
        t_start = env.now
        left = work_s
        outstanding = self.outstanding[rank]
        while left > 0.0:
            f = self._slowdown(rank, sm_share)
            if f == 1.0 and not any(outstanding.values()):
                # Nothing of this rank's can take SMs before it issues more work.
                yield self._delay(left)
                break
            t0 = env.now
            if self.core == "lean":
                # the same entries, in the same order, as the timeout | change below
                seg = self._sm_change[rank] = lean_events.Interruptible(env, left * f)
                yield seg.wake
                finished = seg.finished
            else:
                change = self._sm_change[rank] = env.event()
                finish = env.timeout(left * f)
                fired = yield finish | change
                finished = finish in fired
            self.n_events += 1
            # The segment ends when its work is done (a change at that very instant included);
            # deciding by the timeout, not by elapsed time, survives clocks too coarse to advance.
            left = 0.0 if finished else left - (env.now - t0) / f
            if left <= 1e-12 * work_s:
                # An SM change at the very instant the work ends leaves a rounding sliver
                # (left x f / f): the work is done, not re-timed for a sliver.
                left = 0.0
        self._sm_change[rank] = None
        wall = env.now - t_start
        self.contention[rank] += wall - work_s
        return wall

    def _waiting(self, rank: int) -> str:
        return _describe(self.waiting_on[rank])

    def _event_frame(self) -> pd.DataFrame:
        """TIMELINE_COLUMNS from the rows' columns."""
        shared = ["stream", "kind", "name", "microbatch", "stage", "layer", "bytes"]
        i64, f64 = np.dtype(np.int64), np.dtype(np.float64)
        c = self.rows.columns(shared, {"stream": "category", "kind": "category", "name": "category", "microbatch": i64, "stage": i64,
                                       "layer": i64, "bytes": f64}, order=self._written_order(self.rows))
        c["start_s"], c["end_s"] = c.pop("t0"), c.pop("t1")
        # copy=False: the columns are this frame's own (made just above); a copy into consolidated
        # blocks held the rows twice while it ran (+0.1 GiB at 1,024 GPUs full mode).
        return pd.DataFrame({k: c[k] for k in TIMELINE_COLUMNS}, copy=False)

    def _wait_frame(self) -> pd.DataFrame:
        """WAIT_COLUMNS from the recorded waits; each awaited instruction is described once
        (plan instructions are shared by every rank of a pipeline rank)."""
        w = self.wait_rows
        # A wait's code names its (cause, awaited instruction); when it was issued and by which
        # rank vary per wait and have their own arrays (_w_issued, _w_src).
        # Described once per awaited instruction, and only where a wait was recorded (codes are
        # made up front for every blocking collective, most of whose waits are empty).
        used = np.zeros(len(w.shared), dtype=bool)
        used[np.array(w.code)] = True
        if self.describe_waits:
            described = [(cause, _describe(what) if u else "") for (cause, what), u in zip(w.shared, used.tolist())]
        else:
            described = [(cause, "") for cause, _ in w.shared]
        order = self._written_order(w)
        c = w.columns(["cause", "what"], {"cause": "category", "what": "category"}, described, order=order)
        issued, src = np.array(self._w_issued), np.array(self._w_src)
        if order is not None:
            issued, src = issued[order], src[order]
        return pd.DataFrame({"rank": c["rank"], "start_s": c["t0"], "end_s": c["t1"], "cause": c["cause"],
                             "issued_s": issued, "src_rank": src,
                             "what": c["what"]}, columns=WAIT_COLUMNS, copy=False)

    def _written_order(self, rows: "_Rows") -> np.ndarray | None:
        """The order that puts rows by end time, as the loop writes them (each when it ends),
        where closed-form stretches wrote some ahead (ties keep the order written); None where
        none did."""
        if not self._stretches:
            return None
        return np.argsort(np.array(rows.t1), kind="stable")

    def _wait(self, rank: int, t0: float, t1: float, cause: str, issued: float, src: int, what: object) -> None:
        """Record one wait of ``rank``'s compute stream (WAIT_COLUMNS)."""
        w = self.wait_rows
        w.code.append(w.code_of((cause, id(what)), (cause, what)))
        w.rank.append(rank)
        w.t0.append(t0)
        w.t1.append(t1)
        self._w_issued.append(issued)
        self._w_src.append(src)

    def _row(self, rank: int, key, shared: tuple, t0: float, t1: float) -> None:
        """Record one timeline row; ``key`` names its shared columns (``_Rows.code_of``)."""
        r = self.rows
        r.code.append(r.code_of(key, shared))
        r.rank.append(rank)
        r.t0.append(t0)
        r.t1.append(t1)

    # ------------------------------------------------------------------ streams

    def _event(self, key: tuple) -> simpy.Event:
        ev = self.events.get(key)
        if ev is None:
            ev = self.env.event()
            self.events[key] = ev
        return ev

    def _trigger(self, key: tuple) -> None:
        """Trigger a pipeline event (a receipt, a posted receive, a finished send). Every
        waiter on these tests ``triggered`` before it waits, so one that nobody waits on yet can
        never be waited on: it is marked triggered and processed without a loop entry (an entry
        with no callbacks does nothing, and the other entries keep their order). A third of
        Megatron 529.6B's loop entries were these."""
        ev = self.events.get(key)
        if ev is None:
            self.events[key] = _TRIGGERED
        elif ev.triggered:  # (as succeed() refuses it: a plan that delivers one input twice)
            raise RuntimeError(f"pipeline event {key} triggered twice")
        elif ev.callbacks:
            ev.succeed()
        else:
            ev._ok, ev._value, ev.callbacks = True, None, None

    def _request_counted(self, rank: int, dim: str, op: str, size_bytes: float) -> tuple[CollectiveRequest, tuple]:
        """The request (``_request``), with the bytes this rank puts on the wire counted."""
        req, gkey = self._request(dim, op, size_bytes, rank)
        fkey = (dim, op)
        f = self._wire_factor.get(fkey)
        if f is None:
            f = self._wire_factor[fkey] = bus_factor(op, self._groups[dim].shape[1])
        self.comm_bytes[rank][BASE_DIM[dim]] += f * size_bytes
        return req, gkey

    def _joins_next(self, rp, rank: int) -> list[bool]:
        """Per plan instruction: may the next one run in the same closed-form stretch (a compute
        segment, or a blocking collective in ``self._closed``)? A stretch that cannot outlast
        its first segment would save no event, so ``_replay`` starts one only where this holds."""
        closed = self._closed
        key = id(rp) if not closed else (id(rp), rank)  # (requests are per rank only where some are closed)
        hit = self._joins_next_of.get(key)
        if hit is None:
            closed_step: dict[tuple, bool] = {}
            for alone, steps in self._plan_uses(rp)[0]:
                if alone and closed:
                    req, _ = self._request(*steps[0], rank)
                    closed_step[steps[0]] = closed.get(id(req)) is req
            j = [t is Compute or (t is Collective and ins.handle < 0 and len(ins.steps) == 1
                                  and closed_step.get(ins.steps[0], False))
                 for ins in rp.instrs for t in (type(ins),)]
            hit = self._joins_next_of[key] = j[1:] + [False]
        return hit

    def _closed_request(self, rank: int, step: tuple, closed: dict) -> tuple | None:
        """(request, base dim, bytes on the wire) of a blocking collective that may run in closed
        form (``closed``: ``_closed_form_requests``), else None. The bytes are counted as
        ``_collective`` counts them."""
        dim, op, size_bytes = step
        req, _ = self._request(dim, op, size_bytes, rank)
        if closed.get(id(req)) is not req:
            return None
        f = self._wire_factor.get((dim, op))
        if f is None:
            f = self._wire_factor[(dim, op)] = bus_factor(op, self._groups[dim].shape[1])
        return req, BASE_DIM[dim], f * size_bytes

    def _collective(self, rank: int, dim: str, op: str, size_bytes: float):
        """Rendezvous with the group's simulated members, then run the collective."""
        # One look-up per issue: a rank issues the same few collectives (per layer, per
        # microbatch) many times; their request, group, wire bytes, simulated members, the
        # rank's byte counters and rendezvous counter are fixed.
        cache = self._collectives_of_rank[rank]
        ck = (dim, op, size_bytes)
        c = cache.get(ck)
        if c is None:
            req, gkey = self._request(dim, op, size_bytes, rank)
            fkey = (dim, op)
            f = self._wire_factor.get(fkey)
            if f is None:
                f = self._wire_factor[fkey] = bus_factor(op, self._groups[dim].shape[1])
            needed = self._needed.get(gkey)
            if needed is None:
                needed = int(self.simulated[self._groups[dim][gkey[1]]].sum())
                self._needed[gkey] = needed
            box = self._seq_box.get((rank, dim))
            if box is None:
                box = self._seq_box[(rank, dim)] = [0]
            c = cache[ck] = (req, gkey, BASE_DIM[dim], f * size_bytes, needed, self.comm_bytes[rank], box)
        req, gkey, base_dim, wire_bytes, needed, comm_bytes, box = c
        comm_bytes[base_dim] += wire_bytes
        if needed == 1:
            # The only simulated member (reduced mode): no rendezvous, the network's event is it.
            return self.net.start(self.env, req)
        seq = box[0]
        box[0] = seq + 1
        key = (gkey, seq)
        rv = self.rdv.get(key)
        if rv is None:
            rv = _Rendezvous(needed, self.env.event())
            self.rdv[key] = rv
        if rv.arrive(rank, self.env.now, self.wait_log):
            del self.rdv[key]
            start = self.env.now
            # (what-if subtracts the clean run's waits from the perturbed run's)
            rv.log_waits(self.wait_log, start, rank, dim)
            net_ev = self.net.start(self.env, req)
            # (when the transfer started, and who arrived last: a member's wait before it is
            # waiting on that peer's compute, not communication)
            net_ev.callbacks.append(lambda _e, done=rv.done, s=(start, rank): done.succeed(s))
        return rv.done

    def _start_copy(self, rank: int, ins: Collective, code: int) -> simpy.Event:
        """An asynchronous copy-engine transfer (no SMs) on an idle stream, started in place: the
        same timing as handing it to the stream's process, two events fewer. Its event is the
        handle's; the stream's process waits for it before starting anything queued behind it."""
        env = self.env
        stream = ins.stream
        outstanding = self.outstanding[rank]
        outstanding[stream] += 1
        dim, op, size_bytes = ins.steps[0]
        t0 = env.now
        done = env.event()
        rows = self.rows

        def finished(_ev) -> None:
            self.n_events += 2
            rows.code.append(code); rows.rank.append(rank); rows.t0.append(t0); rows.t1.append(env.now)
            outstanding[stream] -= 1
            done.succeed()

        self._collective(rank, dim, op, size_bytes).callbacks.append(finished)
        self._in_place[(rank, stream)] = done
        return done

    def _collective_stream(self, rank: int, stream: Stream, store: "_Queue"):
        env = self.env
        outstanding = self.outstanding[rank]
        in_place = self._in_place
        while True:
            ins, done, code, counted = yield store.get(env)
            before = in_place.get((rank, stream))
            if before is not None and not before.triggered:
                yield before  # a transfer started in place still runs: the stream is FIFO
            t0 = env.now
            met = None
            # An instruction may chain collectives; they run back to back on this stream. Its
            # NCCL kernel holds SMs from launch (waiting for peers included) to completion.
            for i, (dim, op, size_bytes) in enumerate(ins.steps):
                ctas = ins.sms if i == 0 else collective_ctas(op)
                if not (counted and i == 0):
                    self._take_sms(rank, ctas)
                v = yield self._collective(rank, dim, op, size_bytes)
                if i == 0 and type(v) is tuple:  # (a network's own event may carry a value of its own)
                    met = (t0,) + v  # (arrived, transfer start, last member) of the first step
                self._take_sms(rank, -ctas)
                self.n_events += 2
            rows = self.rows
            rows.code.append(code); rows.rank.append(rank); rows.t0.append(t0); rows.t1.append(env.now)
            outstanding[stream] -= 1
            done.succeed(met)

    def _send_stream(self, rank: int, stream: Stream, store: "_Queue"):
        env = self.env
        sname, rname = stream.value, RECV_STREAM_OF[stream].value
        while True:
            send, dst, key, mb, stage, kind, counted = yield store.get(env)
            if send.rendezvous:
                # Megatron-LM 2021's exchange: the transfer starts once the receiver has posted
                # its receive (its NCCL kernel, launched with the sender's, waits for the peer).
                posted = self._event(("posted", dst, key))
                if not posted.triggered:
                    yield posted
            t0 = env.now
            self.transfer_start[(dst, key)] = t0
            req = self._p2p_request(rank, dst, send.size_bytes)
            self.comm_bytes[rank]["pp"] += send.size_bytes
            if not counted:
                self._take_sms(rank, P2P_CTAS)
            yield self.net.start(env, req)
            self._take_sms(rank, -P2P_CTAS)
            self.n_events += 2
            size = send.size_bytes
            self._row(rank, (sname, kind, mb, stage, size), (sname, "pp", f"send {kind} mb{mb}", mb, stage, -1, size),
                      t0, env.now)
            self._row(dst, (rname, kind, mb, stage, size), (rname, "pp", f"recv {kind} mb{mb}", mb, stage, -1, size),
                      t0, env.now)
            self.outstanding[rank][stream] -= 1
            self._trigger((dst, key))
            if send.rendezvous:
                self._trigger(("sent", rank, key))

    def _issue(self, rank: int, stream: Stream, item: tuple, ctas: int) -> None:
        """Hand work to a stream. On an idle stream the kernel launches now: its SMs are taken
        before the compute stream's next segment starts (the stream process runs later in the
        same instant)."""
        outstanding = self.outstanding[rank]
        idle = not outstanding[stream]
        if idle:
            self._take_sms(rank, ctas)
        outstanding[stream] += 1
        self.stores[(rank, stream)].put(item + (idle,))

    def _row_codes(self, rp) -> tuple[list[int], list[int]]:
        """Each plan instruction's row code (compute segments and collectives; -1 for the rest)
        and, for a blocking collective, the code of the compute stream's wait on it (-1 for the
        rest), once per pipeline rank's plan."""
        cache = self._codes_of_plan
        hit = cache.get(id(rp))
        if hit is None:
            waits = self.wait_rows
            shared = self.rows.shared  # (codes handed out inline: one per instruction, in order)
            share, n = shared.append, len(shared)
            codes, wait_codes = [], []
            code, wcode = codes.append, wait_codes.append
            for ins in rp.instrs:
                t = type(ins)
                if t is Compute:
                    share(("compute", ins.kind, ins.label, ins.microbatch, ins.stage, ins.layer, 0.0))
                    code(n)
                    n += 1
                    wcode(-1)
                elif t is Collective:
                    share((_STREAM_NAME[ins.stream], ins.row_kind, ins.name, ins.microbatch, ins.stage, ins.layer,
                           ins.row_bytes))
                    code(n)
                    n += 1
                    if ins.handle < 0:
                        cause = ins.exposed_dim or BASE_DIM[ins.steps[0][0]]
                        wcode(waits.code_of((cause, id(ins)), (cause, ins)))
                    else:
                        wcode(-1)
                else:
                    code(-1)
                    wcode(-1)
            hit = cache[id(rp)] = (codes, wait_codes)
        return hit

    def _replay(self, rank: int):
        """Walk the rank's plan: no decisions here beyond 'is the stream idle' and 'has it arrived'."""
        env = self.env
        rp = self.plan.ranks[int(self._pp_of[rank])]
        handles: list[simpy.Event | None] = [None] * rp.num_handles
        exposed = self.exposed[rank]
        outstanding = self.outstanding[rank]
        record_wait = self._wait
        wrows = self.wait_rows
        w_code, w_rank, w_t0, w_t1 = wrows.code.append, wrows.rank.append, wrows.t0.append, wrows.t1.append
        w_issued, w_src, w_code_of = self._w_issued.append, self._w_src.append, wrows.code_of
        waiting_on = self.waiting_on
        codes, wait_codes = self._row_codes(rp)
        rows = self.rows
        row_code, row_rank, row_t0, row_t1 = rows.code.append, rows.rank.append, rows.t0.append, rows.t1.append

        def waited(t0: float, cause: str, issued: float = float("nan"), src: int = -1) -> None:
            # Every wait of the compute stream with its cause (the dashboard's colours, the step
            # breakdown). What it waited on is kept as the plan instruction and described once
            # per instruction when the table is built (_wait_frame), not once per wait.
            now = env.now
            if now > t0:
                what = waiting_on[rank]
                w_code(w_code_of((cause, id(what)), (cause, what))); w_rank(rank); w_t0(t0); w_t1(now)
                w_issued(issued); w_src(src)

        def transfer_waited(t0: float, ts: float, peer: int, what: object) -> None:
            # A wait on a pipeline transfer (a receipt, or a blocking exchange's send) that
            # started at ts: waiting before it started is pipeline bubble (the peer computing, or
            # not yet posted), while it was in flight exposed pp communication.
            now = env.now
            exposed["pp"] += now - max(t0, ts)
            if ts > t0:
                record_wait(rank, t0, min(ts, now), "bubble", float("nan"), peer, what)
            if now > max(t0, ts):
                record_wait(rank, max(t0, ts), now, "pp", ts, peer, what)
            if self.wait_log is not None:
                self.wait_log.append((rank, peer, "pp", now - t0))

        wait_cause = _WAIT_CAUSE
        factor = self.compute_factor.get(rank)
        marks = None if self.action_marks is None else self.action_marks.setdefault(rank, {})
        comm_bytes = self.comm_bytes[rank]
        sms_taken, sm_count, timeout = self.sms_taken, self.sm_count, self._delay
        wake_at = lean_events.At if self.core == "lean" else partial(lean_events.simpy_wake_at, env)
        busy_s = 0.0  # this rank's compute seconds so far (kept local: added per segment; stored at the end)
        ci = 0
        base_dim_of = BASE_DIM
        # Closed-form stretch (Engine.run_ahead): while ``ahead``, this rank's clock is ``lt``
        # (>= env.now), its streams are idle and it holds no SMs; it syncs (one delay) before
        # anything that meets the rest of the simulation.
        run_ahead = self.run_ahead
        closed = self._closed
        closed_of: dict[tuple, tuple | None] = {}  # (dim, op, bytes) -> (request, base dim, wire bytes), or None
        net = self.net
        ahead = False
        lt = 0.0
        joins_next = self._joins_next(rp, rank) if run_ahead else None
        for ii, (ins, code, wcode) in enumerate(zip(rp.instrs, codes, wait_codes)):
            t = type(ins)
            if t is Compute:
                if marks is not None:
                    mk = (ins.stage, ins.kind, ins.microbatch)
                    if mk not in marks:
                        if ahead:  # (the steady-state check reads marks against the loop's clock)
                            yield wake_at(lt)
                            ahead = False
                        marks[mk] = (env.now, busy_s, tuple(exposed.values()), tuple(comm_bytes.values()),
                                     self.contention[rank])
                seconds = ins.seconds
                if factor is not None:
                    seconds *= float(factor[ci])
                    ci += 1
                if ahead or (run_ahead and joins_next[ii] and not sms_taken[rank] and not any(outstanding.values())):
                    # No SMs taken and none can be before this rank issues work: the segment's
                    # time is its own, run on the rank's clock.
                    if not ahead:
                        self._stretches += 1
                    t0 = lt if ahead else env.now
                    lt = t0 + seconds
                    ahead = True
                    if ins.counted:
                        self.n_events += 1
                    busy_s += seconds
                    row_code(code); row_rank(rank); row_t0(t0); row_t1(lt)
                    continue
                t0 = env.now
                if sm_count and ins.sm_share > 0.0 and (sms_taken[rank] or any(outstanding.values())):
                    # Overlapped with communication kernels: fewer SMs while they hold theirs,
                    # and only then (_contended_compute). Work on another stream that holds no
                    # SMs yet (queued behind a collective, or a send waiting for its receiver)
                    # may take them while this segment runs: it is re-timed then.
                    seconds = yield from self._contended_compute(rank, seconds, ins.sm_share)
                else:
                    yield timeout(seconds)
                if ins.counted:
                    self.n_events += 1
                busy_s += seconds
                row_code(code); row_rank(rank); row_t0(t0); row_t1(env.now)
                continue
            if t is Collective and ins.handle < 0 and closed and len(ins.steps) == 1 and (ahead or not sms_taken[rank]):
                step = ins.steps[0]
                hit = closed_of.get(step, False)
                if hit is False:
                    hit = closed_of[step] = self._closed_request(rank, step, closed)
                if hit is not None and (ahead or not any(outstanding.values())):
                    req, base_dim, wire_bytes = hit
                    t0 = lt if ahead else env.now
                    dur = net.run_closed_form(env, req, t0)
                    if dur is not None:
                        if not ahead:
                            self._stretches += 1
                        comm_bytes[base_dim] += wire_bytes
                        lt = t0 + dur
                        ahead = True
                        self.n_events += 2
                        row_code(code); row_rank(rank); row_t0(t0); row_t1(lt)
                        exposed[ins.exposed_dim or base_dim] += lt - t0
                        if lt > t0:
                            w_code(wcode); w_rank(rank); w_t0(t0); w_t1(lt); w_issued(t0); w_src(-1)
                        continue
            if ahead:
                yield wake_at(lt)
                ahead = False
            if t is Collective:
                if ins.handle >= 0:
                    if ins.ctas == 0 and not outstanding[ins.stream] and len(ins.steps) == 1:
                        handles[ins.handle] = self._start_copy(rank, ins, code)
                        continue
                    ev = handles[ins.handle] = env.event()
                    self._issue(rank, ins.stream, (ins, ev, code), ins.sms)
                    continue
                dim, op, size_bytes = ins.steps[0]
                t0 = env.now
                waiting_on[rank] = ins
                if not outstanding[ins.stream] and len(ins.steps) == 1:
                    # The stream is idle and compute blocks on it anyway: run the collective in
                    # place (same timing, a third of the events of a hand-over).
                    met = yield self._collective(rank, dim, op, size_bytes)
                    met = (t0,) + met if type(met) is tuple else None
                    self.n_events += 2
                    row_code(code); row_rank(rank); row_t0(t0); row_t1(env.now)
                else:
                    ev = env.event()
                    self._issue(rank, ins.stream, (ins, ev, code), ins.sms)
                    met = yield ev
                now = env.now
                cause_dim = ins.exposed_dim or base_dim_of[dim]
                if met is not None and met[1] > met[0] and met[2] != rank:
                    # Arrived at met[0], the last member (met[2]) at met[1]: that stretch is
                    # waiting on another rank's compute (a pipeline's drain before the step's pp
                    # all-reduces, a straggler), bubble as a pp receipt's wait before its
                    # transfer is; the rest (a queue on the stream, the transfer) is exposed.
                    arrived, start, last = met
                    exposed[cause_dim] += (arrived - t0) + (now - start)
                    if arrived > t0:
                        w_code(wcode); w_rank(rank); w_t0(t0); w_t1(arrived); w_issued(t0); w_src(-1)
                    record_wait(rank, arrived, start, "bubble", float("nan"), last, ins)
                    if now > start:
                        w_code(wcode); w_rank(rank); w_t0(start); w_t1(now); w_issued(start); w_src(-1)
                else:
                    exposed[cause_dim] += now - t0
                    if now > t0:  # the wait, as waited() records it (its code was made with the plan's)
                        w_code(wcode); w_rank(rank); w_t0(t0); w_t1(now); w_issued(t0); w_src(-1)
            elif t is Wait:
                ev = handles[ins.handle]
                if not ev.triggered:
                    t0 = env.now
                    self.waiting_on[rank] = ins
                    yield ev
                    exposed[ins.dim] += env.now - t0
                    waited(t0, wait_cause[ins.dim])
            elif t is Recv:
                key = (ins.stage, ins.kind, ins.microbatch)
                ev = self._event((rank, key))
                if ev.triggered:
                    continue
                t0 = env.now
                self.waiting_on[rank] = ins
                yield ev
                if ins.local:
                    waited(t0, "bubble", src=rank)
                    continue
                if env.now > t0:
                    # A wake that waited: one met at the very instant of its arrival is no event
                    # (whether it found the receipt already in depends only on the order of
                    # same-instant events, which a rank running ahead in closed form changes).
                    self.n_events += 1
                transfer_waited(t0, self.transfer_start.get((rank, key), env.now), self._peer(rank, ins.src_pp), ins)
            elif t is Complete:
                key = (ins.stage, ins.kind, ins.microbatch)
                if ins.wake:
                    self._trigger((rank, key))
                for send in ins.sends:
                    dst = self._peer(rank, send.dst_pp)
                    self._issue(rank, send.stream, (send, dst, key, ins.microbatch, ins.stage, ins.kind), P2P_CTAS)
            elif t is Post:
                for key in ins.keys:
                    self._trigger(("posted", rank, key))
            elif t is SendDone:
                key = (ins.stage, ins.kind, ins.microbatch)
                ev = self._event(("sent", rank, key))
                if ev.triggered:
                    continue
                t0 = env.now
                self.waiting_on[rank] = ins
                yield ev
                if env.now > t0:  # as a receipt's
                    self.n_events += 1
                # As a receipt: waiting for the peer to post its receive is pipeline bubble.
                dst = self._peer(rank, ins.dst_pp)
                transfer_waited(t0, self.transfer_start.get((dst, key), env.now), dst, ins)
            else:  # pragma: no cover - a plan only holds the instruction types above
                raise TypeError(f"unknown plan instruction {ins!r}")
        if ahead:
            yield wake_at(lt)
        self.busy[rank] = busy_s
        self.finished.add(rank)
        self.end_time[rank] = env.now
        self.waiting_on[rank] = None
