"""What a GPU can do, and whether a fitted number respects it.

- identify_gpu: the shipped spec profile of the GPU a trace ran on, from its deviceProperties
  (name, totalGlobalMem, numSms). Matching is data-driven over the profiles in
  simulator/data/profiles (their ``device`` names), so a new profile JSON is all a new GPU needs.
- check_compute / check_comm: a fitted rate above the device's peak FLOP/s, HBM or link
  bandwidth, or a negative time, is refused (UserError: one line naming the number and the ops it
  came from). Such a number is never physics: it is a counting error upstream (bytes counted
  twice, waiting counted as transfer, groups merged).
- Low-confidence fits are not errors: they come back as readable lines (``Notes``), which the
  CLI prints one per line.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from simulator.profile import Profile, available_profiles, load_profile
from simulator.errors import UserError

GIB = float(1 << 30)
# Fitted rates may exceed the spec peak by this much before they are refused: clocks above base
# (boost), and timing granularity of µs-rounded kernel durations on the smallest bins.
PEAK_TOLERANCE = 1.05
# Fewer ops than this behind a class fit is reported as low confidence.
FEW_SAMPLES = 10

# L2 cache per GPU model: a memory-bound op whose data fits in L2 may run above HBM bandwidth
# (its inputs were just written by the kernel before), so the HBM check starts above this size.
# Sources: NVIDIA A100 whitepaper (40 MB L2), H100 whitepaper (50 MB), V100 whitepaper (6 MB).
L2_BYTES = {"a100": 40 << 20, "a800": 40 << 20, "h100": 50 << 20, "h800": 50 << 20, "h200": 50 << 20, "v100": 6 << 20}


def l2_bytes(device: str) -> float:
    """L2 capacity of the named GPU; 0 (check every size) when the model is not listed."""
    model, _ = _model_and_form(device)
    return float(L2_BYTES.get(model or "", 0))


_MODEL_RE = re.compile(r"\b(gb\d{3}|[abhv]\d{3}|l40s?|l4|mi\d{3}x?)\b")
_FORMS = {"sxm": "sxm", "sxm2": "sxm", "sxm4": "sxm", "sxm5": "sxm", "hgx": "sxm", "pg509": "sxm",
          "pcie": "pcie", "nvl": "nvl"}


@dataclass
class Notes:
    """Readable lines about the calibration: low-confidence fits, substitutions, mismatches."""

    lines: list[str] = field(default_factory=list)

    def add(self, line: str) -> None:
        if line not in self.lines:
            self.lines.append(line)


def _tokens(name: str) -> list[str]:
    return re.sub(r"[^a-z0-9]+", " ", name.lower()).split()


def _model_and_form(name: str) -> tuple[str | None, str | None]:
    toks = _tokens(name)
    model = next((t for t in toks if _MODEL_RE.fullmatch(t)), None)
    form = next((_FORMS[t] for t in toks if t in _FORMS), None)
    return model, form


def gpu_model(name: str) -> str | None:
    """The GPU model a device name names ("a100", "h100", ...; None if none): variants of one
    part (SXM / PCIe, memory sizes) share it."""
    return _model_and_form(name)[0]


@dataclass
class GpuMatch:
    profile: Profile
    memory_gib: float | None
    sm_count: int | None
    note: str | None = None


def identify_gpu(name: str, total_mem_bytes: int | None = None, num_sms: int | None = None) -> GpuMatch:
    """The spec profile of the GPU named ``name`` (as deviceProperties / the driver write it).

    The model (A100, H800, V100, ...) must match a shipped profile's; among those, the form
    factor (SXM / PCIe; unnamed counts as SXM) and then the memory closest to totalGlobalMem.
    Raises UserError for a GPU no shipped profile describes."""
    model, form = _model_and_form(name)
    if isinstance(total_mem_bytes, bool) or not isinstance(total_mem_bytes, (int, float)) \
            or not math.isfinite(total_mem_bytes) or total_mem_bytes <= 0:
        total_mem_bytes = None  # (a corrupt deviceProperties entry: the name decides)
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms <= 0:
        num_sms = None
    mem_gib = total_mem_bytes / GIB if total_mem_bytes else None
    if model is None:
        raise UserError(
            f"unknown GPU {name!r}: no GPU model in its name; pass --base PROFILE "
            f"(one of {', '.join(p for p in available_profiles() if not p.startswith('cpu'))} or a profile JSON)")
    cands = []
    for pname in available_profiles():
        p = load_profile(pname)
        pm, pf = _model_and_form(p.device)
        if pm != model or p.provenance.method != "spec":
            continue  # (a system's calibration of the same part, h100-sxm-80gb-p5-efa, is chosen by name)
        pf = pf or "sxm"
        if (form or "sxm") != pf:
            continue
        cands.append(p)
    if not cands:
        raise UserError(
            f"unknown GPU {name!r}: no shipped profile for a {model.upper()}{' ' + form.upper() if form else ''}; "
            f"pass --base PROFILE (a profile JSON with its spec numbers, see simulator/data/profiles)")
    named = re.search(r"(\d+)\s*gb\b", name.lower())
    target = mem_gib if mem_gib is not None else (float(named.group(1)) if named else None)
    exact = [p for p in cands if p.device == name]
    if target is not None:
        # the memory the trace reports decides; a profile of the very driver name wins a tie
        best = min(cands, key=lambda p: (abs(p.hbm_gib - target), p.device != name))
    elif exact:
        # "NVIDIA H100" alone is Meta's 96 GB HBM2e variant as torch names it (the 80 GB SXM
        # part reports "NVIDIA H100 80GB HBM3"): the profile that carries the name
        best = exact[0]
    else:
        best = max(cands, key=lambda p: p.hbm_gib)
    note = None
    if num_sms and best.compute.sm_count and num_sms != best.compute.sm_count:
        # A MIG slice or a cut-down part: compute peaks scale with the SMs it has.
        scale = num_sms / best.compute.sm_count
        upd = {"peak_tflops": best.compute.peak_tflops * scale, "sm_count": num_sms}
        if best.compute.peak_tflops_fp8:
            upd["peak_tflops_fp8"] = best.compute.peak_tflops_fp8 * scale
        best = best.model_copy(update={"compute": best.compute.model_copy(update=upd)})
        note = (f"{name}: the trace's GPU has {num_sms} SMs, profile {best.name!r} {int(num_sms / scale)}: "
                f"a MIG slice or a cut-down part; peak FLOP/s scaled by {scale:.3f}")
    return GpuMatch(best, mem_gib, num_sms, note)


# ---------------------------------------------------------------------------------------------
# physics checks
# ---------------------------------------------------------------------------------------------

def _ops_of(samples: pd.DataFrame, limit: int = 3) -> str:
    if samples is None or samples.empty or "op" not in samples:
        return "ops of unknown name"
    vc = samples["op"].astype(str).value_counts()
    parts = [f"{n} x{c}" for n, c in vc.head(limit).items()]
    return ", ".join(parts) + (f" and {len(vc) - limit} more" if len(vc) > limit else "")


def check_compute(cls: str, fit, samples: pd.DataFrame, peak_tflops: float, hbm_GBps: float, device: str) -> None:
    """Refuse a class fit whose rate at any size is above the device's peak or HBM bandwidth,
    or whose overhead is negative. ``fit`` is a compute_fit.ClassFit; samples its ops (op_class,
    flops, bytes, time_us, op)."""
    from simulator.calibrate.compute_fit import _bin_ids

    if fit.overhead_us < 0:
        raise UserError(f"fitted {cls} overhead {fit.overhead_us:.3g} us is negative (from {_ops_of(samples)}): "
                        "the op timings are inconsistent; check the trace")
    if fit.basis == "flops":
        rate = fit.rates * 1e6 / 1e12
        limit, unit, what = peak_tflops, "TFLOP/s", "peak"
    else:
        rate = fit.rates * 1e6 / 1e9
        limit, unit, what = hbm_GBps, "GB/s", "HBM bandwidth"
    over = rate > limit * PEAK_TOLERANCE
    if fit.basis == "bytes":
        over &= fit.sizes > l2_bytes(device)
    bad = np.flatnonzero(over)
    if not len(bad):
        return
    # the worst size; among rates equal up to rounding the smallest size, so the line does not
    # depend on the last bit of a fit that is flat across sizes
    k = int(bad[rate[bad] >= rate[bad].max() * (1 - 1e-9)][0])
    size = fit.sizes[k]
    col = "flops" if fit.basis == "flops" else "bytes"
    sub = samples
    if samples is not None and col in samples:
        s = samples[col].to_numpy(float)
        ok = np.isfinite(s) & (s > 0)
        b = np.full(len(s), -10**9, dtype=np.int64)
        b[ok] = _bin_ids(s[ok])
        sub = samples[b == _bin_ids(np.array([size]))[0]]
    raise UserError(
        f"fitted {cls} rate {rate[k]:.4g} {unit} at {size:.3g} {col} is above the {device}'s {what} "
        f"{limit:.4g} {unit}: refused; it came from {_ops_of(sub)} (their {col} are over-counted or their "
        "times cut short; check the trace or pass --base for another GPU)")


def check_collective(fit, link_GBps: float, tier: str, topo_name: str, notes: Notes) -> None:
    """Refuse a negative latency; a bus bandwidth above the link is a topology mismatch for
    inter-node fits (the topology is a guess) and an error inside a node (NVLink is the GPU's)."""
    from simulator.calibrate.comm_fit import large_message_busbw

    if fit.alpha_us < 0:
        raise UserError(f"fitted {fit.collective} x{fit.group_size} latency {fit.alpha_us:.3g} us is negative: refused")
    if tier != "intra":
        # Across nodes most of a hierarchical collective's traffic stays on NVLink, so bus
        # bandwidth above one GPU's NIC share is no violation; derive_link_model's efficiency
        # through the topology says whether the log and the topology agree.
        return
    bw = max(large_message_busbw(fit), max(fit.table_busbw_GBps) if fit.table_busbw_GBps else 0.0)
    if bw > link_GBps * PEAK_TOLERANCE:
        raise UserError(
            f"fitted {fit.collective} x{fit.group_size} (intra-node) bus bandwidth {bw:.4g} GB/s is above the "
            f"{link_GBps:.4g} GB/s NVLink per GPU of topology {topo_name!r}: refused; it came from {fit.source or 'the inputs'} "
            "(waiting or merged groups counted as transfer, or pass --topology with the real NVLink)")
