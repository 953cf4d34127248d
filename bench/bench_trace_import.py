"""Import speed and memory of the Kineto importer on a large synthetic trace.

    python bench/bench_trace_import.py [--mb 200] [--gz] [--keep PATH]

Writes a GPU trace shaped like a real one (cpu_op with shapes -> cuda_runtime launch -> kernel
with args, flow events, NCCL kernels with collective args, Kineto-style relative timestamps),
then imports it in a fresh child process and reports wall time and peak RSS as a ratio of the
(uncompressed) file size. The budget is ~3x file size.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HEAD = (
    '{\n  "schemaVersion": 1,\n  "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "numSms": 132}],\n'
    '  "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 8, "pg_count": 1, '
    '"pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", "pg_size": 8, "ranks": [0, 1, 2, 3, 4, 5, 6, 7]}]},\n'
    '  "displayTimeUnit": "ms",\n  "baseTimeNanoseconds": 1711964646000000000,\n  "traceEvents": [\n'
)


def _block(i: int, t: float) -> str:
    """One training-like unit: a matmul and an add on stream 7, every 16th block an all-reduce."""
    ext = 10 * i
    corr = 100000 + 10 * i
    ev = [
        f'{{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1234, "tid": 1234, "ts": {t:.3f}, "dur": 20.125, '
        f'"args": {{"External id": {ext}, "Record function id": {ext}, "Ev Idx": {ext}, "Input Dims": [[8192, 4096], [4096, 4096]], '
        f'"Input type": ["c10::BFloat16", "c10::BFloat16"], "Input Strides": [[4096, 1], [1, 4096]], "Concrete Inputs": ["", ""], '
        f'"Sequence number": {i}, "Fwd thread id": 0}}}}',
        f'{{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1234, "tid": 1234, "ts": {t + 5:.3f}, "dur": 6.5, '
        f'"args": {{"External id": {ext}, "cbid": 211, "correlation": {corr}}}}}',
        f'{{"ph": "s", "id": {corr}, "pid": 1234, "tid": 1234, "ts": {t + 5:.3f}, "cat": "ac2g", "name": "ac2g"}}',
        f'{{"ph": "X", "cat": "kernel", "name": "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "pid": 0, "tid": 7, "ts": {t + 30:.3f}, "dur": 310.5, '
        f'"args": {{"External id": {ext}, "queued": 0, "device": 0, "context": 1, "stream": 7, "correlation": {corr}, '
        f'"registers per thread": 168, "shared memory": 213248, "blocks per SM": 1, "warps per SM": 12, "grid": [132, 1, 1], '
        f'"block": [384, 1, 1], "est. achieved occupancy %": 19}}}}',
        f'{{"ph": "f", "id": {corr}, "pid": 0, "tid": 7, "ts": {t + 30:.3f}, "cat": "ac2g", "name": "ac2g", "bp": "e"}}',
        f'{{"ph": "X", "cat": "cpu_op", "name": "aten::add_", "pid": 1234, "tid": 1234, "ts": {t + 40:.3f}, "dur": 9.0, '
        f'"args": {{"External id": {ext + 1}, "Record function id": {ext + 1}, "Ev Idx": {ext + 1}, "Input Dims": [[8192, 4096], [8192, 4096], []], '
        f'"Input type": ["c10::BFloat16", "c10::BFloat16", "Scalar"], "Input Strides": [[4096, 1], [4096, 1], []], "Concrete Inputs": ["", "", "1"]}}}}',
        f'{{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1234, "tid": 1234, "ts": {t + 42:.3f}, "dur": 4.0, '
        f'"args": {{"External id": {ext + 1}, "cbid": 211, "correlation": {corr + 1}}}}}',
        f'{{"ph": "X", "cat": "kernel", "name": "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, '
        f'std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)", "pid": 0, "tid": 7, '
        f'"ts": {t + 341:.3f}, "dur": 48.25, "args": {{"External id": {ext + 1}, "queued": 0, "device": 0, "context": 1, "stream": 7, '
        f'"correlation": {corr + 1}, "registers per thread": 26, "shared memory": 0, "blocks per SM": 1985.9, "warps per SM": 7943.8, '
        f'"grid": [262144, 1, 1], "block": [128, 1, 1], "est. achieved occupancy %": 100}}}}',
    ]
    if i % 16 == 0:
        ev += [
            f'{{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1234, "tid": 1234, "ts": {t + 50:.3f}, "dur": 30.0, '
            f'"args": {{"External id": {ext + 2}, "Record function id": {ext + 2}, "Collective name": "allreduce", "dtype": "BFloat16", '
            f'"In msg nelems": 33554432, "Out msg nelems": 33554432, "Group size": 8, "Process Group Name": "0", '
            f'"Process Group Description": "default_pg", "Process Group Ranks": "[0, 1, 2, 3, 4, 5, 6, 7]", "Seq": {i // 16}}}}}',
            f'{{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernelExC", "pid": 1234, "tid": 1234, "ts": {t + 60:.3f}, "dur": 8.0, '
            f'"args": {{"External id": {ext + 2}, "cbid": 430, "correlation": {corr + 2}}}}}',
            f'{{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "pid": 0, '
            f'"tid": 40, "ts": {t + 400:.3f}, "dur": 1500.0, "args": {{"External id": {ext + 2}, "device": 0, "stream": 40, '
            f'"correlation": {corr + 2}, "Collective name": "allreduce", "In msg nelems": 33554432, "Out msg nelems": 33554432, '
            f'"Group size": 8, "dtype": "BFloat16", "Process Group Name": "0", "Process Group Ranks": "[0, 1, 2, 3, 4, 5, 6, 7]", "Seq": {i // 16}}}}}',
        ]
    return ",\n    ".join(ev)


def write_trace(path: Path, target_bytes: int, gz: bool) -> tuple[int, int]:
    opener = (lambda p: gzip.open(p, "wt", compresslevel=1)) if gz else (lambda p: open(p, "w"))
    raw = 0
    i = 0
    with opener(path) as f:
        f.write(_HEAD)
        raw += len(_HEAD)
        t = 4458676388068.751
        while raw < target_bytes:
            parts = []
            for _ in range(256):
                parts.append(_block(i, t))
                i += 1
                t += 500.0
            s = ("    " if raw == len(_HEAD) else ",\n    ") + ",\n    ".join(parts)
            f.write(s)
            raw += len(s)
        tail = '\n  ],\n  "traceName": "synthetic"\n}\n'
        f.write(tail)
        raw += len(tail)
    return raw, i


def _child(path: str) -> None:
    import warnings

    from simulator.trace.kineto import import_kineto

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = import_kineto(path)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"wall_s": wall, "base_rss_bytes": base, "peak_rss_bytes": peak, "rows": len(tr.ops),
                      "events": tr.n_events, "table_bytes": int(tr.ops.memory_usage(deep=True).sum())}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=200.0, help="uncompressed size of the synthetic trace, MB")
    ap.add_argument("--gz", action="store_true", help="write it gzipped (sizes still count uncompressed bytes)")
    ap.add_argument("--keep", type=Path, help="write the trace here and keep it")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child)
        return
    tmp = None
    path = args.keep
    if path is None:
        tmp = tempfile.TemporaryDirectory()
        path = Path(tmp.name) / ("big.json.gz" if args.gz else "big.json")
    t0 = time.perf_counter()
    raw, blocks = write_trace(path, int(args.mb * 1e6), args.gz)
    gen_s = time.perf_counter() - t0
    out = subprocess.run([sys.executable, __file__, "--child", str(path)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if out.returncode:
        sys.exit(out.stderr)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    mb = raw / 1e6
    print(f"trace: {mb:.1f} MB uncompressed{' (gzip ' + format(path.stat().st_size / 1e6, '.1f') + ' MB)' if args.gz else ''}, "
          f"{r['events']} events, {r['rows']} OpTable rows; written in {gen_s:.1f} s")
    print(f"import: {r['wall_s']:.1f} s ({mb / r['wall_s']:.1f} MB/s, {r['events'] / r['wall_s'] / 1e3:.0f} k events/s)")
    print(f"peak RSS: {r['peak_rss_bytes'] / 1e6:.0f} MB = {r['peak_rss_bytes'] / raw:.2f} x file size "
          f"(interpreter+imports before import: {r['base_rss_bytes'] / 1e6:.0f} MB; "
          f"growth {(r['peak_rss_bytes'] - r['base_rss_bytes']) / raw:.2f} x); OpTable {r['table_bytes'] / 1e6:.0f} MB")
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
