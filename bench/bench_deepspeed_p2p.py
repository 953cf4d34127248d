"""How much DeepSpeed's pipeline exchange costs over the engine's eager sends, on vTrain's
single-node Megatron-DeepSpeed rows with a pipeline (a side replay, not the engine).

DeepSpeed's TrainSchedule (deepspeed/runtime/pipe/schedule.py, 0.9.x) defers each send to the
next step's exchange: a forward step runs SendGrad(previous buffer) then RecvActivation(current),
a backward step RecvGrad(current) then SendActivation(previous); p2p.send/recv are blocking
dist.send/dist.recv (torch >= 1.8; dist.broadcast on 2-rank groups before). So a forward's output
leaves only at the rank's next exchange, after it has met the peer's matching receive. This is
the blocking replay of bench_megatron2021_p2p with one action between exchanges.

    python bench/bench_deepspeed_p2p.py [STRIDE]     (every STRIDE-th row with pp > 1; default 48)
"""

from __future__ import annotations

import sys

from bench_megatron2021_p2p import replay

from simulator.calibrate.published import read_table, vtrain_scenario
from simulator.profile import load_profile
from simulator.scenario import build_scenario
from simulator.simulate import resolve_schedule
from simulator.workload.program import build_program

# NVLink point-to-point on one DGX A100 node: ~230 GB/s (profile comm.nvlink_efficiency source).
NVLINK_GBps = 230.0


def main(stride: int) -> None:
    rows = [r for r in read_table("vtrain-single-node") if int(r["pipeline parallelism"]) > 1][::stride]
    deltas = []
    for row in rows:
        sc = build_scenario(vtrain_scenario(row))
        sched = resolve_schedule(sc)
        prog = build_program(sc, load_profile(sc.cluster.gpu), sched)
        dur = {key: seg.total_compute_s for key, seg in prog.segments.items()}
        c = prog.pp_bytes / (NVLINK_GBps * 1e9)
        eager, block = replay(sched, dur, c, False), replay(sched, dur, c, True)
        deltas.append(block / eager - 1)
        print(f"h{row['hidden size']} L{row['# layers']} tp{row['tensor parallelism']} pp{row['pipeline parallelism']} "
              f"mb{row['micro batch']} nmb{sc.num_microbatches}: eager {eager * 1e3:.1f} ms, "
              f"deferred blocking exchange {block * 1e3:.1f} ms ({deltas[-1]:+.1%})")
    print(f"{len(deltas)} rows: mean {sum(deltas) / len(deltas):+.2%}, max {max(deltas):+.2%}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 48)
