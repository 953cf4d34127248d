"""Predicted vs published step time on every development set: Megatron-LM SC'21 Table 1,
torchtitan's published H100/H200/A100 throughput, vTrain's 1,440 single-node A100 layouts.
Per-row tables, stated-setup MAPE and mean signed error (what `clustersim validate --published
NAME` prints, set by set).

    python bench/bench_validate_published.py [NAME ...]

After each table, the errors grouped by layout (pp, tp, microbatch size, model size): a
systematic error shows up as a trend over one of them.
"""

import sys
import time

from simulator.calibrate.published import (PUBLISHED, group_errors, group_errors_by_pair, print_published,
                                          validate_published)

# Targets of issue 15 (|mean signed error| <= 3% on every set).
TARGET_MAPE = {"megatron-2021": 0.05, "torchtitan-2024": 0.10, "vtrain-single-node": 0.08}
# Layout numbers in each set's row labels worth grouping by.
GROUP_KEYS = {"megatron-2021": ["B", "tp", "pp"], "torchtitan-2024": [],
              "vtrain-single-node": ["tp", "pp", "dp", "mb", "h", "L", "gb"]}
# Pairs of them (the microbatch trend differs by tp and by pp on vTrain).
GROUP_PAIRS = {"megatron-2021": [], "torchtitan-2024": [],
               "vtrain-single-node": [("tp", "mb"), ("pp", "mb"), ("h", "mb"), ("tp", "h")]}

if __name__ == "__main__":
    names = sys.argv[1:] or list(PUBLISHED)
    unknown = [n for n in names if n not in PUBLISHED]
    if unknown:
        print(f"error: unknown published set {unknown[0]!r}: use one of {', '.join(PUBLISHED)}", file=sys.stderr)
        sys.exit(2)
    summary = []
    for name in names:
        t0 = time.perf_counter()
        v = validate_published(name)
        dt = time.perf_counter() - t0
        print_published(v, max_rows=60 if len(v.rows) > 100 else None)
        for key in GROUP_KEYS[name]:
            cells = [f"{k:g}: n={n} {mean:+.1%} (MAPE {mape:.1%})" for k, (n, mean, mape) in group_errors(v, key).items()]
            print(f"  by {key:3s} " + "  ".join(cells))
        for a, b in GROUP_PAIRS[name]:
            cells = [f"{ka:g},{kb:g}: n={n} {mean:+.1%}" for (ka, kb), (n, mean, _) in group_errors_by_pair(v, a, b).items()]
            print(f"  by {a},{b} " + "  ".join(cells))
        summary.append((name, v, dt))
    print()
    for name, v, dt in summary:
        ok = v.mape <= TARGET_MAPE[name] and abs(v.mean_signed_error) <= 0.03
        print(f"{name:20s} MAPE {v.mape:6.1%} (target <= {TARGET_MAPE[name]:.0%})  mean signed {v.mean_signed_error:+6.1%} "
              f"(target |.| <= 3%)  {len(v.stated_rows)}/{len(v.rows)} stated rows  {'met' if ok else 'MISSED'}  "
              f"[{dt:.0f} s]")
