"""Compute-communication contention: NCCL kernels take SMs from the compute they overlap.

An NCCL collective runs as one CTA (thread block) per channel, each resident on one SM for the
whole collective (NCCL ``enqueue.cc`` ``ncclLaunchKernel``: grid = channels of the plan; see
``../shared/reference/NCCL-MODEL.md`` "CTAs per collective": 24 typical on one 8-GPU A100/H100
node, 16 for NVLS on Hopper). Point-to-point transfers use ``NCCL_NCHANNELS_PER_NET_PEER``
channels (default 2, same table). While those SMs are taken, a compute-bound kernel that filled
the GPU runs on the remaining SMs, so its time grows by ``sm_count / (sm_count - taken)``:
24 of the H100's 132 SMs -> x1.22, of the A100's 108 -> x1.29. Overlap papers measure GEMM
slowdowns of this order under concurrent NCCL kernels (e.g. T3, Pati et al., ASPLOS 2024, whose
motivation is exactly this SM and memory-bandwidth interference); no constant here is fitted.

Measured on an H200 (round 28, ``bench/device/kernels_h200.py``, tests/data/reference/h200/
kernels.csv): with N of 132 SMs held by a resident kernel of NCCL's shape, GEMMs and
FlashAttention slow by the law within 15% up to N = 32 (median 5-6%), and memory-bound kernels not
at all (0.997-0.999 at N = 8..64: the remaining SMs still fill HBM).

Scope of the model (a first order, stated so it can be refined): the law slows a compute
segment's SM-bound share only (``Segments.sm_share``: its GEMM and attention time), not its
memory-bound kernels nor the optimizer step; HBM traffic of the collective itself is not charged
to them (measured: x1.07 for a 1 GiB scale while 24 SMs streamed 231 GB/s beside it); the
collective itself is not slowed (its CTAs are resident); the share of SMs is fixed while a
segment runs and re-timed when it changes. Without overlap nothing changes.
"""

from __future__ import annotations

from simulator.vocabulary import CollectiveOp

# CTAs (= SMs) one NCCL collective occupies: NCCL-MODEL.md, "CTAs per collective" (enqueue.cc,
# ncclLaunchKernel): 24 typical on one 8-GPU A100/H100 node.
COLLECTIVE_CTAS = 24
# Point-to-point: NCCL_NCHANNELS_PER_NET_PEER, default 2 (NCCL-MODEL.md, environment table).
P2P_CTAS = 2


# The point-to-point kinds, as plain strings: the engine asks for every collective it launches,
# and an enum member lookup per call (CollectiveOp.SEND_RECV) cost 3% of a 1,024-GPU full run.
_P2P_OPS = frozenset({CollectiveOp.SEND_RECV.value, CollectiveOp.RING_STEP.value})


def collective_ctas(op: str) -> int:
    """SMs an in-flight NCCL operation of this kind occupies."""
    return P2P_CTAS if op in _P2P_OPS else COLLECTIVE_CTAS


def compute_slowdown(sm_count: int | None, sms_taken: int) -> float:
    """Factor on a compute segment's time while ``sms_taken`` SMs run communication kernels."""
    if not sm_count or sms_taken <= 0:
        return 1.0
    # NCCL never gets every SM: keep at least one for compute (a bound, not a fitted number).
    return sm_count / max(1, sm_count - sms_taken)


# --- calibrated input (issue 15 item 2: "calibrate it where traces show overlap") -------------
# simulator.calibrate.overlap measures, per compute class, how much slower kernels run under NCCL
# kernels than the same signature alone (profile compute.overlap_fits). The SM-share model above
# stays the law; a confident GEMM measurement scales its excess: the measured excess over the
# excess the model predicts for the CTAs the trace's NCCL kernels launched.


def measured_excess_scale(overlap_fits, sm_count: int | None) -> float:
    """Scale on the SM-share model's excess (``compute_slowdown - 1``) from a confident measured
    GEMM figure (an object with ``slowdown``, ``nccl_ctas``, ``confident``); 1.0 without one.
    Compute-bound GEMMs are what the SM-share model describes, and they dominate overlapped time."""
    fit = (overlap_fits or {}).get("gemm")
    if fit is None or not fit.confident or not fit.nccl_ctas or not sm_count:
        return 1.0
    model_excess = compute_slowdown(sm_count, int(round(fit.nccl_ctas))) - 1.0
    if model_excess <= 0:
        return 1.0
    # No negative excess: overlapped kernels measured faster than alone are noise, not a speed-up.
    return max(0.0, fit.slowdown - 1.0) / model_excess


def scaled_slowdown(slowdown: float, excess_scale: float) -> float:
    """The SM-share factor with its excess scaled by a measured ``excess_scale``."""
    return 1.0 + excess_scale * (slowdown - 1.0)
