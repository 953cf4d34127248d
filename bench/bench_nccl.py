"""Per-log error table of NCCL's cost model calibrated per system on the nccl-tests logs.

For each system (p4de-efa, p5-efa, azure-ndv4) one set of constants is fitted on all of that
system's logs at once (simulator.calibrate.nccl_fit), then every log is predicted with it.
Printed per log: worst |time error| at sizes >= 64 KiB (target 10 %) and below (target 25 %),
the sizes that miss, and the fitted constants. Also the model with NCCL's own constants
(uncalibrated) for comparison. Reads ../shared/reference/nccl-tests (or the test copies).
Run: PYTHONPATH=. python bench/bench_nccl.py [--sizes]
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace as NS

from simulator.calibrate.nccl_fit import error_table, errors, fit_system, read_log
from simulator.network.nccl import NcclModel, NcclSystem, NcclTuning
from simulator.topology.spec import load_topology

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "reference" / "nccl-tests"
if not SHARED.exists():
    SHARED = Path("/work/shared/reference/nccl-tests")
if not SHARED.exists():
    SHARED = ROOT / "tests" / "data" / "reference" / "nccl-tests"

# system -> (device as the logs name it, log glob, HBM GB/s of that GPU (datasheets) for the copy bound)
SYSTEMS = {
    "p4de-efa": ("A100-SXM4-80GB", "p4de-*", 2039.0),
    "p5-efa": ("NVIDIA H100 80GB HBM3", "p5-*", 3350.0),
    "azure-ndv4": ("A100-SXM4-40GB", "azure-ndv4-*", 1555.0),
}


def _size(b: int) -> str:
    return f"{b >> 20}M" if b >= 1 << 20 else (f"{b >> 10}K" if b >= 1 << 10 else f"{b}B")


def _pct(x):
    return "   -  " if x is None else f"{x * 100:5.1f}%"


def main() -> None:
    show_sizes = "--sizes" in sys.argv
    print(f"nccl-tests logs from {SHARED}")
    print(f"{'log':48} {'ranks':>5} {'NCCL >=64K':>10} {'<64K':>7} | {'fit >=64K':>9} {'<64K':>7}  misses (size: error)")
    for topo, (device, pat, hbm) in SYSTEMS.items():
        spec = load_topology(topo)
        system = NcclSystem.from_specs(spec.node, device)
        logs = [read_log(p, spec.node.gpus_per_node) for p in sorted(SHARED.glob(pat), key=lambda p: (len(p.name), p.name))]
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cal = fit_system(system, logs, hbm, topo)
        fit_s = time.perf_counter() - t0
        raw = NcclModel(system, NcclTuning())
        fitted = NcclModel(system, NcclTuning.from_comm(NS(nccl=cal)))
        for r0, r in zip(error_table(raw, logs), error_table(fitted, logs)):
            miss = ", ".join(f"{_size(s)}:{e:+.0%}" for s, e in r["misses"]) or "none"
            print(f"{r['log']:48} {r['ranks']:5d} {_pct(r0['worst_ge_64KiB']):>10} {_pct(r0['worst_lt_64KiB']):>7} | "
                  f"{_pct(r['worst_ge_64KiB']):>9} {_pct(r['worst_lt_64KiB']):>7}  {miss}")
        consts = ", ".join(f"{k} {v:.3g}" for k, v in cal.model_dump(exclude={"system", "fit_error"}).items() if v is not None)
        print(f"  {topo}: {consts}  (fit {fit_s:.1f} s)")
        for w in caught:
            print(f"  note: {w.message}")
        if show_sizes:
            for l in logs:
                ppn = max(1, math.ceil(l.n_ranks / l.n_nodes))
                print(f"    {l.name}")
                for s, e in zip(l.size_bytes, errors(fitted, l)):
                    c = fitted.choose(l.op, float(s), l.n_ranks, l.n_nodes, ppn, l.gpus_per_thread)
                    print(f"      {int(s):>12d} {c.algorithm:>10}/{c.protocol:<6} {e:+6.1%}")


if __name__ == "__main__":
    main()
