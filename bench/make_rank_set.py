"""Build an N-rank Kineto trace set from one real trace, for import/calibrate benchmarks and tests:
rank_k/<host>_<pid>.<ts>.pt.trace.json.gz with distributedInfo.rank = k (the layout torch.profiler's
tensorboard_trace_handler writes per rank). Kernel times are kept, so the ranks' collectives align."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def make_rank_set(src: Path, out: Path, world: int, layout: str = "rank_{k}") -> list[Path]:
    with gzip.open(src, "rt") if src.name.endswith(".gz") else open(src) as f:
        data = json.load(f)
    files = []
    for k in range(world):
        d = dict(data)
        di = dict(d.get("distributedInfo") or {})
        di.update({"rank": k, "world_size": world})
        d["distributedInfo"] = di
        folder = out / layout.format(k=k)
        folder.mkdir(parents=True, exist_ok=True)
        p = folder / f"host{k // 8}_{1000 + k}.1700000000000.pt.trace.json.gz"
        with gzip.open(p, "wt", compresslevel=6) as f:
            json.dump(d, f, separators=(",", ":"))
        files.append(p)
    return files
