"""Predicted vs published step time on every development set: Megatron-LM SC'21 Table 1,
torchtitan's published H100/H200/A100 throughput, vTrain's 1,440 single-node A100 layouts.
Per-row tables, stated-setup MAPE and mean signed error (what `clustersim validate --published
NAME` prints, set by set).

    python bench/bench_validate_published.py [NAME ...]

After each table, the errors grouped by layout (pp, tp, microbatch size, model size): a
systematic error shows up as a trend over one of them. For vTrain, the rows read as the
composition they are (simulator.calibrate.composition): the published and predicted terms per
layer and microbatch, per microbatch, per step, and the set's MAPE were each term right.
"""

import sys
import time

from simulator.calibrate.composition import TERMS, fit_terms, layer_times, mape_with_published_terms
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


def print_vtrain_terms(v) -> None:
    """vTrain's rows as composed terms: which cost a miss is in."""
    fits = fit_terms(v)
    for label, sel in (("dp = 1", [f for f in fits if f.dp == 1]), ("dp > 1", [f for f in fits if f.dp > 1])):
        print(f"  composition, {label}: {len(sel)} groups, published rows linear in (microbatches x layers, "
              f"microbatches, layers, 1) to a relative residual of {max(f.published_residual for f in sel):.1e}")
    print("  one layer, one microbatch (forward, recomputation, backward), ms: published (spread over its "
          "pp/dp groups) / predicted / error")
    cells = layer_times(fits)
    for (tp, mb, h), (pub, pred) in sorted(cells.items()):
        p, q = sum(pub) / len(pub), sum(pred) / len(pred)
        spread = (max(pub) - min(pub)) / p
        print(f"    tp{tp} mb{mb} h{h:<5d} {p * 1e3:6.2f} (spread {spread:.0e}, {len(pub)} groups)  {q * 1e3:6.2f}  {q / p - 1:+6.1%}")
    # The same per-layer cell at a larger hidden size does 4x the GEMM work with the same kernels:
    # a smaller published time there is the measurement's scatter, not a cost to model.
    for (tp, mb, h), (pub, _) in sorted(cells.items()):
        big = cells.get((tp, mb, 2 * h))
        if big and sum(big[0]) / len(big[0]) < sum(pub) / len(pub):
            print(f"    scatter: tp{tp} mb{mb} h{2 * h} published below h{h} "
                  f"({sum(big[0]) / len(big[0]) * 1e3:.2f} < {sum(pub) / len(pub) * 1e3:.2f} ms)")
    print("  per microbatch outside the layers at pp >= 2 (the bottleneck stage's extra), ms: published / predicted")
    per_mb: dict = {}
    for f in fits:
        if f.pp >= 2 and f.full_rank:
            per_mb.setdefault((f.tp, f.micro_batch, f.hidden), []).append((f.published_s[1], f.predicted_s[1]))
    for (tp, mb, h), pairs in sorted(per_mb.items()):
        p, q = (sum(x[i] for x in pairs) / len(pairs) for i in (0, 1))
        print(f"    tp{tp} mb{mb} h{h:<5d} {p * 1e3:6.2f}  {q * 1e3:6.2f}  {q / p - 1:+6.1%}")
    print("  MAPE / mean signed were these terms the published ones (in a group of one microbatch count, micro "
          "batch 8, a term moves with the one the group cannot tell it from):")
    for terms in ((), (0,), (1,), (2, 3), (0, 1), (0, 1, 2, 3)):
        mape, signed = mape_with_published_terms(v, fits, terms)
        names = ", ".join(TERMS[i] for i in terms) or "none (as predicted)"
        print(f"    {names:75s} {mape:5.1%} / {signed:+5.1%}")


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
        if name == "vtrain-single-node":
            print_vtrain_terms(v)
        summary.append((name, v, dt))
    print()
    for name, v, dt in summary:
        ok = v.mape <= TARGET_MAPE[name] and abs(v.mean_signed_error) <= 0.03
        print(f"{name:20s} MAPE {v.mape:6.1%} (target <= {TARGET_MAPE[name]:.0%})  mean signed {v.mean_signed_error:+6.1%} "
              f"(target |.| <= 3%)  {len(v.stated_rows)}/{len(v.rows)} stated rows  {'met' if ok else 'MISSED'}  "
              f"[{dt:.0f} s]")
