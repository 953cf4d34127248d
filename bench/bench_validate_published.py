"""Predicted vs published step time on the Megatron-LM SC'21 Table 1 development set (MAPE).

    python bench/bench_validate_published.py      (same as `clustersim validate --published megatron-2021`)
"""

import time

from simulator.calibrate.published import print_published, validate_published

if __name__ == "__main__":
    t0 = time.perf_counter()
    v = validate_published("megatron-2021")
    print_published(v)
    print(f"MAPE {v.mape:.1%} over {len(v.rows)} rows (target <= 15%); simulated in {time.perf_counter() - t0:.1f} s")
