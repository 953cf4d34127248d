"""How much Megatron-LM 2021's blocking pipeline exchange costs over the engine's eager sends,
on the SC'21 Table 1 rows with a pipeline (a side replay, not the engine).

Megatron-LM 2021 (schedules.py, p2p_communication._communicate) exchanges activations and
gradients with torch.distributed.batch_isend_irecv, waits for every request and calls
torch.cuda.synchronize(): a rank leaves the exchange only when its sends have met the peers'
receives. In the interleaved schedule's steady state one exchange follows each forward+backward
pair, so a forward's output leaves only after the backward that follows it. The engine models
that exchange (parallelism.pp_exchange: blocking, which the SC'21 rows set; docs/design-notes.md);
this side replay, independent of it, is the check its figures were compared with.

This replays each row's schedule twice with the program's per-action compute times (no TP
collectives, the same for both): eager sends, and Megatron's blocking grouped exchange, where a
transfer ends at max(send posted, receive posted) + c and a rank resumes when all its transfers
of the exchange end. c: the scatter/gather message over one HDR NIC plus the NVLink all-gather.

    python bench/bench_megatron2021_p2p.py [ROW ...]     (rows 4..9 by default; 9 takes minutes)
"""

from __future__ import annotations

import sys

from simulator.calibrate.published import megatron_2021_scenario, read_table
from simulator.profile import load_profile
from simulator.scenario import build_scenario
from simulator.schedules.base import required_inputs
from simulator.simulate import resolve_schedule
from simulator.workload.program import build_program

# One 200 Gb/s HDR NIC per GPU at the NCCL-tests bus bandwidth of ~22 GB/s, NVLink all-gather
# at ~230 GB/s bus bandwidth (profile comm.nic_efficiency, comm.nvlink_efficiency sources).
NIC_GBps, NVLINK_GBps = 22.0, 230.0


def _groups(sched, r: int) -> list[list]:
    """Compute between two exchanges: an interleaved steady-state F+B pair, else one action."""
    acts, out, i = sched.actions[r], [], 0
    interleaved = sched.num_stages > sched.num_ranks
    while i < len(acts):
        if interleaved and i + 1 < len(acts) and acts[i].kind == "F" and acts[i + 1].kind == "B":
            out.append([acts[i], acts[i + 1]])
            i += 2
        else:
            out.append([acts[i]])
            i += 1
    return out


def replay(sched, dur: dict, c: float, blocking: bool) -> float:
    p = sched.num_ranks

    def out_key(a):
        peer = sched.stage_next[a.stage] if a.kind == "F" else sched.stage_prev[a.stage]
        if peer < 0 or sched.stage_rank[peer] == sched.stage_rank[a.stage]:
            return None
        return ("F" if a.kind == "F" else "BI", a.stage, a.microbatch)

    def in_keys(a, r):
        return [(k, st, mb) for st, k, mb in required_inputs(sched, a) if sched.stage_rank[st] != r]

    groups = [_groups(sched, r) for r in range(p)]
    t, gi = [0.0] * p, [0] * p
    arrive: dict = {}
    posted_send: dict = {}
    posted_recv: dict = {}
    pending: list = [None] * p
    exchanged = [False] * p
    flushed = [False] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while True:
                if pending[r] is not None:
                    sends, recvs, t0 = pending[r]
                    ends = [t0]
                    if not all(k in posted_recv for k in sends) or not all(k in posted_send for k in recvs):
                        break
                    ends += [max(t0, posted_recv[k]) + c for k in sends] + [max(t0, posted_send[k]) + c for k in recvs]
                    t[r], pending[r] = max(ends), None
                    progress = True
                    continue
                if gi[r] >= len(groups[r]):
                    if blocking and not flushed[r]:
                        flushed[r] = True
                        sends = [k for k in (out_key(a) for a in groups[r][-1]) if k]
                        if sends:
                            for k in sends:
                                posted_send[k] = t[r]
                            pending[r] = (sends, [], t[r])
                            progress = True
                            continue
                    break
                g = groups[r][gi[r]]
                if not blocking:
                    if not all(k in arrive for a in g for k in in_keys(a, r)):
                        break
                    for a in g:
                        t[r] = max([t[r]] + [arrive[k] for k in in_keys(a, r)]) + dur[(sched.stage_position[a.stage], a.kind)]
                        k = out_key(a)
                        if k:
                            arrive[k] = t[r] + c
                else:
                    if not exchanged[r]:
                        # The exchange before this group: the last group's outputs, this group's inputs.
                        prev = groups[r][gi[r] - 1] if gi[r] else []
                        sends = [k for k in (out_key(a) for a in prev) if k]
                        recvs = [k for a in g for k in in_keys(a, r)]
                        for k in sends:
                            posted_send[k] = t[r]
                        for k in recvs:
                            posted_recv[k] = t[r]
                        pending[r], exchanged[r] = (sends, recvs, t[r]), True
                        progress = True
                        continue
                    for a in g:
                        t[r] += dur[(sched.stage_position[a.stage], a.kind)]
                    exchanged[r] = False
                gi[r] += 1
                progress = True
    if any(gi[r] < len(groups[r]) or pending[r] is not None for r in range(p)):
        raise RuntimeError("replay stalled")
    return max(t)


def main(rows: list[int]) -> None:
    table = read_table("megatron-2021")
    for i in rows:
        sc = build_scenario(megatron_2021_scenario(table[i]))
        sched = resolve_schedule(sc)
        prog = build_program(sc, load_profile(sc.cluster.gpu), sched)
        dur = {key: seg.total_compute_s for key, seg in prog.segments.items()}
        c = prog.pp_bytes / (NIC_GBps * 1e9) + prog.pp_gather_bytes * 7 / 8 / (NVLINK_GBps * 1e9)
        eager, block = replay(sched, dur, c, False), replay(sched, dur, c, True)
        print(f"{table[i]['params_billion']:>7s}B pp{sc.parallelism.pp:<3d} vpp{sc.parallelism.vpp}: transfer {c * 1e3:.2f} ms, "
              f"eager {eager:.3f} s, blocking exchange {block:.3f} s ({block / eager - 1:+.1%})")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [4, 5, 6, 7, 8, 9])
