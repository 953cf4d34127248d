"""Simulated vs real bus bandwidth: 16-GPU all-reduce on two p4de.24xlarge (EFA).

Real: reference/nccl-tests/p4de-2nodes-16gpu_all_reduce_perf.txt (out-of-place column), read
with simulator.trace's nccl-tests importer. Simulated: the `clustersim collective` sweep on
simulator/data/topologies/p4de-efa.yaml, (a) with link efficiency 1.0 and the topology's own latencies and
(b) with the shipped A100 profile: NCCL's cost model with NCCL's own constants. Nothing here is
fitted to this log (bench/bench_nccl.py shows the model calibrated per system on every log).
Run: python bench/compare_p4de.py [path-to-log]
"""

from __future__ import annotations

import sys
from pathlib import Path

from simulator.network.cli import simulate_sweep
from simulator.trace.nccl_tests import import_nccl_tests

LOG = Path(__file__).resolve().parents[1].parent / "shared/reference/nccl-tests/p4de-2nodes-16gpu_all_reduce_perf.txt"


def main() -> None:
    log = Path(sys.argv[1]) if len(sys.argv) > 1 else LOG
    if not log.exists():
        log = Path("/work/shared/reference/nccl-tests/p4de-2nodes-16gpu_all_reduce_perf.txt")
    real = import_nccl_tests(log, nranks=16).table
    real = real[~real["in_place"]].set_index("size_bytes")
    lo, hi = int(real.index.min()), int(real.index.max())
    raw, _, _ = simulate_sweep("all_reduce", 16, "p4de-efa", None, lo, hi, 2.0)
    prof, _, note = simulate_sweep("all_reduce", 16, "p4de-efa", "a100-sxm-80gb", lo, hi, 2.0)
    print("16 x A100 (2 x p4de.24xlarge, 4 x 100 Gb/s EFA each), all_reduce, out-of-place")
    print("sim-topo: efficiency 1.0, topology latencies (EFA 15 us);  sim-prof: " + note)
    print(f"{'size (B)':>12} {'real us':>9} {'real busbw':>10} | {'topo us':>9} {'busbw':>7} {'algo':>5} | {'prof us':>9} {'busbw':>7} | {'prof/real':>9}")
    for a, b in zip(raw, prof):
        s = a["size_bytes"]
        if s not in real.index:
            continue
        r = real.loc[s]
        ratio = b["busbw_GBps"] / r["busbw_GBps"] if r["busbw_GBps"] > 0 else float("nan")
        print(f"{s:12d} {r['time_us']:9.1f} {r['busbw_GBps']:10.2f} | {a['time_us']:9.1f} {a['busbw_GBps']:7.2f} {a['algorithm']:>5} | "
              f"{b['time_us']:9.1f} {b['busbw_GBps']:7.2f} | {ratio:9.2f}")


if __name__ == "__main__":
    main()
