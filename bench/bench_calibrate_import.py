"""Import + calibrate of an 8-rank set of ~1.3 MB gz Kineto traces: wall time and peak RSS.

The set is the real HTA A100 trace (tests/data/reference/kineto/hta_a100_rank0of16.json.gz,
7,747 GPU events, 25k CPU ops) copied into rank_0/ .. rank_7/ with distributedInfo.rank
rewritten, as torch.profiler's tensorboard_trace_handler lays out a job. Targets (issue 14):
<= 20 s and <= 1 GB peak RSS.

    python bench/bench_calibrate_import.py [--ranks 8] [--keep DIR]

The measurement runs in a fresh child process so its peak RSS is the import + calibrate alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "tests" / "data" / "reference" / "kineto" / "hta_a100_rank0of16.json.gz"

_CHILD = r"""
import json, resource, sys, time, warnings
from pathlib import Path
warnings.simplefilter("ignore")
from simulator.calibrate.fit import calibrate
from simulator.calibrate.physics import Notes
from simulator.trace.loader import load_trace
folder = Path(sys.argv[1])
notes = Notes()
t0, c0 = time.perf_counter(), time.process_time()
prof = calibrate([folder], "bench", notes=notes)       # import included: what `clustersim calibrate DIR` does
t1, c1 = time.perf_counter(), time.process_time()
rss_cal = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
kids = resource.getrusage(resource.RUSAGE_CHILDREN)   # import workers (one rank file each)
kid_cpu, kid_rss = kids.ru_utime + kids.ru_stime, kids.ru_maxrss / 1024
ts = load_trace(folder)                                  # the import alone, for the split
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({
    "ranks": len(ts.ranks), "ops": int(len(ts.ops)),
    "total_wall_s": t1 - t0, "total_cpu_s": c1 - c0 + kid_cpu, "peak_rss_MiB": rss_cal, "worker_rss_MiB": kid_rss,
    "import_wall_s": t2 - t1,
    "collective_fits": len(prof.comm.collectives), "notes": len(notes.lines),
}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--keep", type=Path, default=None, help="Build the set here and keep it.")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.make_rank_set import make_rank_set

    with tempfile.TemporaryDirectory() as tmp:
        out = a.keep or Path(tmp) / "profile"
        files = make_rank_set(SRC, out, a.ranks, "rank_{k}")
        sizes = [f.stat().st_size for f in files]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        r = subprocess.run([sys.executable, "-c", _CHILD, str(out)], capture_output=True, text=True, env=env, check=False)
        if r.returncode != 0:
            sys.exit(f"benchmark child failed:\n{r.stderr}")
        res = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"trace set: {res['ranks']} ranks x {sum(sizes) / len(sizes) / 1e6:.2f} MB gz ({res['ops']} OpTable rows)")
    want = os.environ.get("CLUSTERSIM_IMPORT_WORKERS", "")
    workers = int(want) if want.isdigit() else min(res["ranks"], os.cpu_count() or 1, 8)
    bound = res["peak_rss_MiB"] + (workers * res["worker_rss_MiB"] if workers > 1 else 0)
    print(f"import + calibrate (clustersim calibrate DIR): {res['total_wall_s']:6.2f} s wall  {res['total_cpu_s']:6.2f} s CPU "
          f"(all processes)   (target <= 20 s)")
    print(f"peak RSS: main {res['peak_rss_MiB']:.0f} MiB, largest import worker {res['worker_rss_MiB']:.0f} MiB, "
          f"{workers} worker(s): at most {bound:.0f} MiB together (target <= 1024 MiB)")
    print(f"  import alone (load_trace, second run):       {res['import_wall_s']:6.2f} s wall")
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (wall time is CPU time / available cores)")

if __name__ == "__main__":
    main()
