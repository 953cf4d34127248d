"""Plain-text lines of a report's what-if section (CLI summary, bench output)."""

from __future__ import annotations


def whatif_lines(w: dict) -> list[str]:
    out = ["what-if: " + "; ".join(w.get("perturbations", []))]
    clean, step = w["clean_step_time_s"], w["step_time_s"]
    out.append(f"  step time {step:.4f} s vs clean {clean:.4f} s: {w['delta_s']:+.4f} s ({w['delta_fraction']:+.2%})"
               + (f", {w['simulated_ranks']} simulated ranks" if "simulated_ranks" in w else ""))
    deltas = {d: v for d, v in w.get("exposed_comm_delta_s", {}).items() if abs(v) > 1e-9}
    if deltas:
        out.append("  exposed comm change: " + ", ".join(f"{d} {v:+.4f} s" for d, v in deltas.items()))
    chain = w.get("wait_chain") or []
    if chain:
        out.append("  who waits on whom, beyond the clean step (from the perturbed ranks outward):")
        for h in chain[:8]:
            out.append(f"    {'  ' * (h['depth'] - 1)}rank {h['rank']} (x{h['ranks']}) waited {h['wait_s']:.4f} s on rank "
                       f"{h['waited_on']} in {h['dim']}")
    dist = w.get("distribution")
    if dist:
        out.append(f"  step time over {dist['seeds']} seeds: P50 {dist['p50_s']:.4f} s, P90 {dist['p90_s']:.4f} s, "
                   f"P99 {dist['p99_s']:.4f} s (mean {dist['mean_s']:.4f} s)")
        n = int(dist["seeds"])
        if n < 100:
            # A percentile needs draws beyond it: with n seeds, P(1 - 1/n) is the largest one.
            which = "P90 and P99 are" if n < 10 else "P99 is"
            out.append(f"  ({which} interpolated between {n} draws, not measured: --seeds 100 or more for a P99)")
    f = w.get("failures")
    if f:
        out.append(f"  failures ({f['policy']}, MTBF {f['mtbf_per_gpu_h']:,.0f} h/GPU): {f['failures_per_day']:.2f}/day, "
                   f"goodput {f['goodput']:.1%}, {f['lost_to_failures']:.1%} lost to failures and restarts, "
                   f"{f['lost_to_checkpoints']:.1%} to checkpoints")
        out.append(f"  one failure costs {f['cost_per_failure_s']:.0f} s = {f['cost_per_failure_gpu_h']:,.0f} GPU-h "
                   f"= {f['cost_per_failure_steps']:,.0f} steps"
                   + (f"; failed node(s) {f['failed_nodes']}: {f['cost_of_failed_nodes_gpu_h']:,.0f} GPU-h" if f['failed_nodes'] else ""))
    return out
