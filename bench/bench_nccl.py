"""Per-log error table of NCCL's cost model calibrated per system on the nccl-tests logs.

For each system (p4de-efa, p5-efa, azure-ndv4) one set of constants is fitted on all of that
system's logs at once (simulator.calibrate.nccl_fit), then every log is predicted with it.
Printed per log: worst |time error| at sizes >= 64 KiB (target 10 %) and below (target 25 %),
with NCCL's own constants and with the fit, and the sizes that miss; per system the fitted
constants and their physics checks; and held-out lines: Azure fitted without one of its
multi-node logs, then predicting it. The measured time is the smaller of the out-of-place and
in-place columns for 2+ ranks (see read_log). Reads ../shared/reference/nccl-tests (or the test
copies). Run: PYTHONPATH=. python bench/bench_nccl.py [--sizes] [--no-holdout]
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace as NS

from simulator.calibrate.nccl_fit import error_table, errors, fit_system, physics_checks, read_log
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
TARGET_BIG, TARGET_SMALL = 0.10, 0.25
# Held-out checks: (system, the log left out of the fit and predicted)
HOLDOUT = (("azure-ndv4", "azure-ndv4-a100-40gb-32gpu_all_reduce_perf.txt"),
           ("azure-ndv4", "azure-ndv4-a100-40gb-16gpu_all_reduce_perf.txt"))


def _size(b: int) -> str:
    return f"{b >> 20}M" if b >= 1 << 20 else (f"{b >> 10}K" if b >= 1 << 10 else f"{b}B")


def _pct(x):
    return "   -  " if x is None else f"{x * 100:5.1f}%"


def _mark(r) -> str:
    ok = (r["worst_ge_64KiB"] is None or r["worst_ge_64KiB"] <= TARGET_BIG) and \
         (r["worst_lt_64KiB"] is None or r["worst_lt_64KiB"] <= TARGET_SMALL)
    return "ok  " if ok else "MISS"


def _load(topo: str):
    device, pat, hbm = SYSTEMS[topo]
    spec = load_topology(topo)
    system = NcclSystem.from_specs(spec.node, device)
    logs = [read_log(p, spec.node.gpus_per_node) for p in sorted(SHARED.glob(pat), key=lambda p: (len(p.name), p.name))]
    return system, logs, hbm


def _fit(system, logs, hbm, topo):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        cal = fit_system(system, logs, hbm, topo)
        return cal, time.perf_counter() - t0, [str(w.message) for w in caught]


def main() -> None:
    show_sizes = "--sizes" in sys.argv
    print(f"nccl-tests logs from {SHARED}; targets: {TARGET_BIG:.0%} from 64 KiB, {TARGET_SMALL:.0%} below")
    print(f"{'log':48} {'ranks':>5} {'NCCL >=64K':>10} {'<64K':>7} | {'fit >=64K':>9} {'<64K':>7}       misses (size: error)")
    for topo in SYSTEMS:
        system, logs, hbm = _load(topo)
        cal, fit_s, notes = _fit(system, logs, hbm, topo)
        raw = NcclModel(system, NcclTuning())
        fitted = NcclModel(system, NcclTuning.from_comm(NS(nccl=cal)))
        for r0, r in zip(error_table(raw, logs), error_table(fitted, logs)):
            miss = ", ".join(f"{_size(s)}:{e:+.0%}" for s, e in r["misses"]) or "none"
            print(f"{r['log']:48} {r['ranks']:5d} {_pct(r0['worst_ge_64KiB']):>10} {_pct(r0['worst_lt_64KiB']):>7} | "
                  f"{_pct(r['worst_ge_64KiB']):>9} {_pct(r['worst_lt_64KiB']):>7} {_mark(r)}  {miss}")
        consts = ", ".join(f"{k} {v:.3g}" for k, v in cal.model_dump(exclude={"system", "fit_error", "product_only"}).items() if v is not None)
        print(f"  {topo} fitted constants: {consts}  (fit {fit_s:.1f} s, loaded machine)")
        for name, words, ok in physics_checks(system, cal, hbm, [(l.n_ranks, l.n_nodes) for l in logs]):
            print(f"    physics {'ok ' if ok else 'BAD'} {name}: {words}")
        for n in notes:
            print(f"    note: {n}")
        if show_sizes:
            for l in logs:
                ppn = max(1, math.ceil(l.n_ranks / l.n_nodes))
                print(f"    {l.name}: size, NCCL's choice (calibrated), channels, measured us, predicted us, error")
                for s, e, m in zip(l.size_bytes, errors(fitted, l), l.time_us):
                    c = fitted.choose(l.op, float(s), l.n_ranks, l.n_nodes, ppn, l.gpus_per_thread)
                    print(f"      {int(s):>12d} {c.algorithm:>10}/{c.protocol:<6} {c.channels:3d} {m:10.1f} {c.time_us:10.1f} {e:+6.1%}")
    if "--no-holdout" in sys.argv:
        return
    print("held out: the system fitted without one log, then predicting it")
    for topo, name in HOLDOUT:
        system, logs, hbm = _load(topo)
        train = [l for l in logs if l.name != name]
        (test,) = [l for l in logs if l.name == name]
        cal, fit_s, _ = _fit(system, train, hbm, topo)
        (r,) = error_table(NcclModel(system, NcclTuning.from_comm(NS(nccl=cal))), [test])
        miss = ", ".join(f"{_size(s)}:{e:+.0%}" for s, e in r["misses"]) or "none"
        print(f"  {topo} without {name}: {_pct(r['worst_ge_64KiB'])} >=64K, {_pct(r['worst_lt_64KiB'])} <64K {_mark(r)}  {miss}  (fit {fit_s:.1f} s)")


if __name__ == "__main__":
    main()
