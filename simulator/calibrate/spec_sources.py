"""Measured sources for the shipped spec profiles' kernel constants: the figures behind the
"measured: ..." provenance items of simulator/data/profiles/*.json, computed from the reference
data the project ships, so every such number can be reproduced.

    python -m simulator.calibrate.spec_sources [--reference tests/data/reference]

- HBM efficiency per op class (``compute.kernels.mem_efficiency``): NeuSight per-operator
  latencies (HF models, fp32, eager PyTorch; H100 SXM and A100 80GB PCIe). Every op phase that
  launches exactly one memory-bound kernel moving >= 16 MiB (so the launch floor is < ~5% of it)
  gives bytes / (net time x datasheet HBM bandwidth); the class value is the aggregate
  sum(bytes) / sum(time) / HBM (what a step's class total follows), the median beside it.
  Net time = measured less the per-op timer's own floor (MeasuredOpTable.net_times_us).
- Optimizer-like streaming (``mem_efficiency.optimizer``): the same tables' gradient
  accumulation (AccumulateGrad, ``grad += new`` in fp32: 12 bytes a parameter), a pure
  read-modify-write stream as multi-tensor Adam is. The A100 profiles keep it; the Hopper ones
  (and Blackwell's, assumed as H100) take a real Adam step measured on an H200 instead (fused
  AdamW, 0.69: tests/data/reference/h200/optimizer.csv), which this stand-in put at 0.92.
- Launch floor (``compute.kernels.launch_floor_us``): the HTA Kineto trace of an A100-SXM4-80GB
  training step: device time of single-block kernels (the least work a kernel can do) plus the
  device-side gap before the next kernel on the same stream when that kernel was already queued
  (its launch call returned before the previous kernel ended, so the host was not the limit).

Physics checks: an efficiency above 1 (faster than the datasheet) means the op's byte count is
wrong, never that the GPU beat its HBM; such samples are dropped and counted, and every reported
value must lie in (0, 1].
"""

from __future__ import annotations

import argparse
import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simulator.errors import UserError

# Datasheet HBM bandwidth of the NeuSight GPUs (GB/s): H100 SXM5 80GB HBM3 3,350 (NVIDIA H100
# datasheet); A100 80GB PCIe HBM2e 1,935 (NVIDIA A100 datasheet).
NEUSIGHT_GPUS = {"NVIDIA_H100_80GB_HBM3": ("h100-sxm-80gb", 3350.0), "NVIDIA_A100_80GB_PCIe": ("a100-pcie-80gb", 1935.0)}
KINETO_A100 = "kineto/hta_a100_rank0of16.json.gz"
# Kernels moving at least this much exceed the L2 cache of both GPUs (40 MB A100, 50 MB H100:
# NVIDIA architecture whitepapers), so HBM, not L2, serves them even when the per-op timer reruns
# the op on the same tensors, and they run >= 20 us at full bandwidth, so a few-us launch floor
# is a small part of their time.
MIN_BYTES = 64 * 2**20
# Kernels this small do no measurable work: their time is the per-kernel floor alone.
TINY_BYTES = 256 * 2**10
FP32_BYTES = 4


@dataclass(frozen=True)
class Measured:
    value: float  # the figure a profile adopts: the median, robust to byte-count errors either way
    aggregate: float  # sum(bytes) / sum(time) / HBM, dominated by the largest kernels
    n: int
    dropped: int = 0  # samples that broke physics (efficiency > 1) and were left out

    def line(self, what: str) -> str:
        drop = f", {self.dropped} dropped as faster than the datasheet (byte count wrong)" if self.dropped else ""
        return f"{what}: {self.value:.3f} (median; aggregate {self.aggregate:.3f}; n={self.n}{drop})"


def _aggregate(bytes_: list[float], times_us: list[float], hbm_GBps: float, floor_us: float = 0.0) -> Measured:
    b = np.asarray(bytes_, dtype=float)
    t = (np.asarray(times_us, dtype=float) - floor_us) * 1e-6
    # A kernel of >= MIN_BYTES done within the floor, or faster than the datasheet, breaks physics:
    # its byte count is wrong (a broadcast operand, an op that skips work), so it is left out.
    eff = np.where(t > 0, b / np.maximum(t, 1e-12) / (hbm_GBps * 1e9), np.inf)
    ok = eff <= 1.0
    if not ok.any():
        raise UserError("no physically possible samples (every efficiency > 1): check the byte model")
    aggregate = float(b[ok].sum() / t[ok].sum() / (hbm_GBps * 1e9))
    return Measured(float(np.median(eff[ok])), aggregate, int(ok.sum()), int((~ok).sum()))


def neusight_tables(folder: Path) -> list:
    from simulator.trace.optable_csv import load_op_table

    paths = sorted(folder.glob("*-train-*.csv"))
    if not paths:
        raise UserError(f"no NeuSight training tables (*-train-*.csv) in {str(folder)!r}: give --reference the folder holding neusight/")
    return [load_op_table(p) for p in paths]


def _single_mem_kernels(tables: list):
    """(op class, bytes, net µs) of every op phase that launches exactly one memory-bound kernel."""
    for t in tables:
        fw, bw = t.net_times_us()
        per_phase: dict[tuple[int, str], list] = {}
        for row, phase, k in t.kernels:
            per_phase.setdefault((row, phase), []).append(k)
        for (row, phase), ks in per_phase.items():
            time_us = (fw if phase == "fw" else bw)[row]
            if len(ks) == 1 and ks[0].kind == "mem" and time_us > 0:
                yield ks[0].op_class, ks[0].bytes, float(time_us)


def neusight_kernel_floor(tables: list) -> Measured:
    """Net time of single memory-bound kernels moving <= TINY_BYTES: the per-kernel floor of the
    isolated per-op timing (launch, ramp, tail, the event pair's resolution)."""
    t = [us for _, b, us in _single_mem_kernels(tables) if b <= TINY_BYTES]
    if not t:
        raise UserError("no single kernels of <= 256 KiB in the NeuSight tables to measure a floor on")
    return Measured(float(np.median(t)), float(np.mean(t)), len(t))


def neusight_mem_efficiency(tables: list, hbm_GBps: float, floor_us: float = 0.0) -> dict[str, Measured]:
    """HBM efficiency per op class of single memory-bound kernels >= MIN_BYTES: bytes /
    ((net time - floor_us) x HBM), median over the kernels. The report keeps floor_us = 0: the
    isolated-op floor (neusight_kernel_floor) does not add to large kernels; subtracted, it
    puts about half the elementwise kernels above the datasheet bandwidth."""
    samples: dict[str, tuple[list[float], list[float]]] = {}
    for cls, nbytes, time_us in _single_mem_kernels(tables):
        if nbytes >= MIN_BYTES:
            b, s = samples.setdefault(cls, ([], []))
            b.append(nbytes)
            s.append(time_us)
    return {c: _aggregate(b, s, hbm_GBps, floor_us) for c, (b, s) in sorted(samples.items())}


def neusight_accumulate_efficiency(tables: list, hbm_GBps: float, floor_us: float = 0.0) -> Measured:
    """AccumulateGrad (grad += new, fp32): read both, write one, 12 bytes a parameter."""
    b, s = [], []
    for t in tables:
        d = t.ops
        params: dict[int, float] = {}
        for row, _, k in t.kernels:
            params[row] = params.get(row, 0.0) + k.param_numel
        for row, acc_us in zip(d["row"], d["acc_us"]):
            nbytes = 3 * FP32_BYTES * params.get(int(row), 0.0)
            if acc_us > 0 and nbytes >= MIN_BYTES:
                b.append(nbytes)
                s.append(float(acc_us) - t.timer_floor_us)  # net of the per-op timer, as net_times_us
    if not b:
        raise UserError("no gradient-accumulation timings of >= 16 MiB in the NeuSight tables")
    return _aggregate(b, s, hbm_GBps, floor_us)


@dataclass(frozen=True)
class LaunchFloor:
    floor_us: float  # median start-to-next-start of a single-block kernel whose successor was queued
    kernel_us: float  # median device time of a single-block kernel
    gap_us: float  # median device gap to an already queued next kernel of the stream
    n_floor: int
    n_kernels: int
    n_gaps: int


def kineto_launch_floor(path: Path) -> LaunchFloor:
    """Stream time of the smallest kernels in a step, from a Kineto trace: for a single-block
    kernel whose successor on the same stream was launched before it started (so the device,
    not the host, set the pace), the time from its start to the successor's start."""
    with gzip.open(path, "rt") if str(path).endswith(".gz") else open(path) as f:
        events = json.load(f)["traceEvents"]
    launch_end = {e["args"]["correlation"]: e["ts"] + e.get("dur", 0) for e in events
                  if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and "nccl" not in e.get("name", "").lower()),
                     key=lambda e: (e["args"]["stream"], e["ts"]))

    def single_block(e) -> bool:
        return list(e["args"].get("grid", [])) == [1, 1, 1]

    tiny = [e["dur"] for e in kernels if single_block(e)]
    gaps, floor = [], []
    for a, b in zip(kernels, kernels[1:]):
        if a["args"]["stream"] != b["args"]["stream"]:
            continue
        launched = launch_end.get(b["args"]["correlation"])
        if launched is None or launched >= a["ts"] or b["ts"] < a["ts"] + a["dur"]:
            continue  # the host, not the device, may have set this gap
        gaps.append(b["ts"] - a["ts"] - a["dur"])
        if single_block(a):
            floor.append(b["ts"] - a["ts"])
    if not floor:
        raise UserError(f"Kineto trace {str(path)!r} has no queued single-block kernels to measure a launch floor on")
    return LaunchFloor(float(np.median(floor)), float(np.median(tiny)), float(np.median(gaps)), len(floor), len(tiny), len(gaps))


def report(reference: Path) -> str:
    lines = []
    for folder, (profile, hbm) in NEUSIGHT_GPUS.items():
        tables = neusight_tables(reference / "neusight" / folder)
        floor = neusight_kernel_floor(tables)
        lines.append(f"{folder} (-> {profile}, HBM {hbm:g} GB/s), {len(tables)} NeuSight training tables:")
        lines.append(f"  isolated-op kernel floor: {floor.value:.1f} us (median net time of single kernels <= 256 KiB, n={floor.n})")
        for cls, m in neusight_mem_efficiency(tables, hbm).items():
            lines.append("  " + m.line(f"mem_efficiency.{cls}"))
        acc = neusight_accumulate_efficiency(tables, hbm)
        lines.append("  " + acc.line("gradient accumulation (optimizer-like stream)"))
    lf = kineto_launch_floor(reference / KINETO_A100)
    lines.append(f"{KINETO_A100} (A100-SXM4-80GB): launch floor {lf.floor_us:.1f} us (median start-to-next-start of a "
                 f"single-block kernel with its successor queued, n={lf.n_floor}); single-block kernel {lf.kernel_us:.1f} us "
                 f"(median, n={lf.n_kernels}), queued gap {lf.gap_us:.1f} us (median, n={lf.n_gaps})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", type=Path, default=Path(__file__).resolve().parents[2] / "tests" / "data" / "reference",
                    help="folder holding neusight/ and kineto/ (default: tests/data/reference)")
    print(report(ap.parse_args(argv).reference))


if __name__ == "__main__":
    main()
