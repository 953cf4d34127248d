"""torch's AdamW on one GPU, multi-tensor (foreach, torch's default) against fused, for bf16 and
fp32 parameters: the HBM bytes each really moves per parameter, from its time and the copy
ceiling measured alongside. Run by the device check; prints one line per case and writes
``optimizer.csv`` to the folder given."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

from rows_csv import write_rows_csv  # beside this script (python3 bench/device/optimizer_h200.py)

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
NUMEL = 1 << 28  # 268M parameters in 8 tensors: every state tensor far beyond the 60 MB L2
TENSORS = 8


def timed_s(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1) * 1e-3)
    return statistics.median(out)


rows = []
x = torch.empty(1 << 30, device="cuda", dtype=torch.uint8)
y = torch.empty_like(x)
copy_GBps = 2 * x.numel() / timed_s(lambda: y.copy_(x)) / 1e9
del x, y
rows.append({"case": "copy_1GiB", "GBps": round(copy_GBps, 1)})
print(rows[-1], flush=True)
for dtype in (torch.bfloat16, torch.float32):
    for impl in ("foreach", "fused"):
        params = [torch.nn.Parameter(torch.randn(NUMEL // TENSORS, device="cuda", dtype=dtype)) for _ in range(TENSORS)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=impl == "foreach", fused=impl == "fused")
        t = timed_s(opt.step)
        es = params[0].element_size()
        rows.append({"case": f"adamw_{impl}_{str(dtype).split('.')[-1]}", "numel": NUMEL, "time_us": round(t * 1e6, 1),
                     "bytes_per_param_at_copy_rate": round(t * copy_GBps * 1e9 / NUMEL, 2),
                     "element_bytes": es})
        print(rows[-1], flush=True)
        del params, opt
        torch.cuda.empty_cache()
write_rows_csv(rows, OUT / "optimizer.csv")
