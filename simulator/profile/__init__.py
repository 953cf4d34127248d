"""GPU profiles: the cost models the engine's durations come from (calibration/<name>.json).

A profile says how fast one device computes each op class and how well collectives use the
links, and where every number came from (provenance). Profiles are either written from public
specs and published microbenchmarks (the shipped A100 / H100 ones) or fitted from traces by
``clustersim calibrate``.

Compute model, per op class:
    time = max(flops / (peak * eff(flops)), bytes / (hbm * bandwidth_efficiency)) + overhead
    eff(flops) = peak_efficiency * flops / (flops + half_efficiency_flops)
A saturating efficiency curve: small kernels waste most of the machine, large GEMMs approach
``peak_efficiency``. A fitted profile may instead carry a measured table of achieved TFLOP/s
against FLOPs, interpolated in log space.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from simulator.data import data_dir
from simulator.errors import UserError, check_document_kind, did_you_mean_name, path_exists, read_json, validation_error_line

PROFILE_SCHEMA_VERSION = 1
CALIBRATION_DIR = data_dir("profiles")
OP_CLASSES = ("gemm", "attention", "elementwise", "norm", "optimizer", "other")

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class OpClassModel(BaseModel):
    model_config = _STRICT

    # Defaults: the datasheet peak with no size penalty, the physical bound. A memory-bound class
    # (basis "bytes") reads them only for an op that moves no bytes, so spec profiles leave them out.
    peak_efficiency: float = Field(1.0, gt=0, le=1, description="Fraction of peak FLOP/s that large ops of this class reach.")
    half_efficiency_flops: float = Field(0.0, ge=0, description="FLOPs at which an op reaches half of peak_efficiency.")
    bandwidth_efficiency: float = Field(gt=0, le=1, description="Fraction of HBM bandwidth memory-bound ops reach.")
    overhead_us: float = Field(0.0, ge=0, description="Fixed cost per kernel (launch, tail), µs.")
    # A fitted lookup (from calibration): achieved TFLOP/s at given FLOPs, log-space interpolated.
    table_flops: list[float] | None = Field(None, description="FLOPs of the measured points, ascending.")
    table_tflops: list[float] | None = Field(None, description="Achieved TFLOP/s at table_flops.")
    fit_error: float | None = Field(None, description="Median |relative error| on held-out captured ops.")
    fit_range_flops: tuple[float, float] | None = Field(None, description="FLOPs range the fit saw.")
    # Added by calibration (all optional; absent = the spec-based behaviour above).
    # A fitted lookup for memory-bound classes: achieved GB/s at given bytes, log-space interpolated;
    # used instead of hbm_GBps x bandwidth_efficiency.
    table_bytes: list[float] | None = Field(None, description="Bytes of the measured points, ascending.")
    table_GBps: list[float] | None = Field(None, description="Achieved GB/s at table_bytes.")
    fit_range_bytes: tuple[float, float] | None = Field(None, description="Bytes range the fit saw.")
    # Which cost the time follows: "max" of the FLOP and byte costs (spec profiles), or only one of
    # them when the fit measured only one (a byte-fitted class must not be bounded by a FLOP guess).
    basis: Literal["max", "flops", "bytes"] = Field("max", description="Which cost sets the time: max, flops or bytes.")
    fit_samples: int | None = Field(None, description="Captured ops the fit used.")


class KernelModel(BaseModel):
    """Kernels by shape (simulator.workload.kernel_model): GEMMs by M, N, K and dtype with tile and
    wave quantization on the SMs; memory-bound kernels by bytes at achievable HBM bandwidth;
    FlashAttention by sequence, head dim and mask; a launch floor per kernel. The few free
    constants are fitted by calibration from measured ops; spec profiles carry sourced defaults."""

    model_config = _STRICT

    gemm_efficiency: dict[str, float] = Field(
        description="dtype -> fraction of that dtype's peak a full wave of large (128x128) tiles reaches.")
    gemm_k_overhead: float = Field(32.0, ge=0, description="Per-tile prologue/epilogue cost, in units of K (the reduction depth).")
    gemm_tiles: list[tuple[int, int]] = Field(
        default_factory=lambda: [(128, 128), (128, 256), (256, 128), (128, 64), (64, 128), (64, 64)],
        description="Threadblock tiles (M x N) the GEMM library chooses among (the fastest is taken).")
    gemm_split_k: list[int] = Field(default_factory=lambda: [1, 2, 4], description="Split-K factors the library may use.")
    mem_efficiency: dict[str, float] = Field(
        description="op class -> fraction of HBM bandwidth its memory-bound kernels reach ('default' for the rest).")
    attention_efficiency: float = Field(0.5, gt=0, le=1, description="FlashAttention forward: fraction of peak FLOP/s on full tiles.")
    attention_bwd_efficiency: float = Field(0.4, gt=0, le=1, description="FlashAttention backward: fraction of peak FLOP/s.")
    # The fused-attention kernel a framework runs differs by device generation: on Hopper,
    # FlashAttention-2 (PyTorch SDPA's flash backend) uses none of TMA / wgmma and reaches far less
    # than FlashAttention-3 or cuDNN. None: the device's attention_* figures are FA2's already.
    fa2_attention_efficiency: float | None = Field(
        None, gt=0, le=1, description="FlashAttention-2 (PyTorch SDPA flash backend) forward on this device: fraction of peak FLOP/s (None: attention_efficiency).")
    fa2_attention_bwd_efficiency: float | None = Field(
        None, gt=0, le=1, description="FlashAttention-2 backward on this device: fraction of peak FLOP/s (None: attention_bwd_efficiency).")
    # A fused-attention tile does more than its matmuls: the softmax's exp, scaling and masking
    # run on every score (the SFUs' exp alone: 3.9 T/s on H100 SXM5 against 989 TFLOP/s of
    # matmul, Shah et al. 2024, FlashAttention-3, arXiv 2407.08608 Sec. 3.1), and each CTA pays a
    # prologue and epilogue (the backward's K/V load, dK/dV write-back and its dot(dO, O) and dQ
    # conversion passes). None / 0: not modelled; the efficiency then covers the whole tile.
    attention_score_Tps: float | None = Field(
        None, gt=0, description="Fused attention forward: scores a second (T/s, whole GPU) of the non-matmul tile work, added to the matmul time (None: in the efficiency).")
    attention_bwd_score_Tps: float | None = Field(
        None, gt=0, description="Fused attention backward: scores a second (T/s, whole GPU) of the non-matmul tile work (None: in the efficiency).")
    attention_cta_us: float = Field(0.0, ge=0, description="Fused attention forward: fixed cost of each CTA (a query block of one head), µs on its SM.")
    attention_bwd_cta_us: float = Field(0.0, ge=0, description="Fused attention backward: fixed cost of each CTA (a key block of one head), µs on its SM.")
    fa2_attention_score_Tps: float | None = Field(
        None, gt=0, description="FlashAttention-2 forward on this device: as attention_score_Tps (None: attention_score_Tps).")
    fa2_attention_bwd_score_Tps: float | None = Field(
        None, gt=0, description="FlashAttention-2 backward on this device: as attention_bwd_score_Tps (None: attention_bwd_score_Tps).")
    fa2_attention_cta_us: float | None = Field(
        None, ge=0, description="FlashAttention-2 forward on this device: as attention_cta_us (None: attention_cta_us).")
    fa2_attention_bwd_cta_us: float | None = Field(
        None, ge=0, description="FlashAttention-2 backward on this device: as attention_bwd_cta_us (None: attention_bwd_cta_us).")
    launch_floor_us: float = Field(3.0, ge=0, description="Time of an empty kernel: launch, ramp and tail, µs.")
    fit_error: dict[str, float] | None = Field(None, description="Median |relative error| per op class on the fitted ops.")
    fit_source: str | None = Field(None, description="What the constants were fitted on.")


class OverlapFit(BaseModel):
    """Measured from traces (simulator.calibrate.overlap): compute kernels of one class that NCCL
    kernels on another stream overlap, against the same kernel signature (name + input shapes) alone."""

    model_config = _STRICT

    slowdown: float = Field(gt=0, description="Median (weighted by overlapped launches) of the signatures' overlapped/alone time.")
    signatures: int = Field(ge=1, description="Kernel signatures seen both overlapped and alone.")
    overlapped_kernels: int = Field(ge=1, description="Overlapped launches behind the figure.")
    ratio_min: float = Field(gt=0, description="Smallest per-signature ratio.")
    ratio_max: float = Field(gt=0, description="Largest per-signature ratio.")
    nccl_ctas: float | None = Field(None, gt=0, description="Median CTAs (one SM each) of the overlapping NCCL kernels.")
    sm_count: int | None = Field(None, ge=1, description="SMs of the traced GPU.")
    sm_share_slowdown: float | None = Field(None, ge=1, description="What the SM-share model predicts: sm_count / (sm_count - nccl_ctas).")
    confident: bool = Field(description="Enough signatures and launches for the simulator to use it.")


class ComputeModel(BaseModel):
    model_config = _STRICT

    peak_tflops: float = Field(gt=0, description="Peak dense TFLOP/s in the compute dtype (BF16 tensor cores).")
    hbm_GBps: float = Field(gt=0, description="Peak HBM bandwidth, GB/s.")
    # Shape-aware kernel models (tile and wave quantization) need the SM count; None = unknown.
    sm_count: int | None = Field(None, ge=1, description="Streaming multiprocessors on the device (None: unknown).")
    # Volta (V100) tensor cores take FP16 only; BF16 arrived with Ampere (NVIDIA V100 and A100
    # architecture whitepapers). A profile without the key is a BF16 device.
    bf16: bool = Field(True, description="BF16 tensor cores (false: Volta and older, FP16 only).")
    # FP8 tensor-core peak (dense); None = the device has no FP8 tensor cores (A100, V100).
    peak_tflops_fp8: float | None = Field(None, gt=0, description="Peak dense FP8 TFLOP/s (None: no FP8 tensor cores).")
    # FP32 (non-tensor-core) peak: fp32 GEMMs without TF32 (PyTorch's default since 1.12) run here.
    peak_tflops_fp32: float | None = Field(None, gt=0, description="Peak FP32 TFLOP/s without tensor cores (None: unknown).")
    # Shape-aware kernel model; None: derived from the class curves (simulator.workload.kernel_model).
    kernels: KernelModel | None = Field(None, description="Kernels by shape: GEMM tiles and waves, HBM bytes, launch floor.")
    # Block-scaled MXFP8 (OCP microscaling) tensor-core peak; None = the device has none (Hopper and older).
    peak_tflops_mxfp8: float | None = Field(None, gt=0, description="Peak dense MXFP8 TFLOP/s (None: no MXFP8 tensor cores).")
    # Hopper's and Ada's FP8 GEMMs take only the TN layout, so per-tensor FP8 keeps a transposed
    # copy of each quantized tensor for the other GEMM; compute capability 10.x (B200, GB200) takes
    # any layout and one row-wise buffer serves both (Transformer Engine 2.20.2
    # utils.is_non_tn_fp8_gemm_supported: 10.0 <= cc < 12.0 or cc >= 13.0).
    fp8_non_tn_gemm: bool = Field(False, description="FP8 GEMMs take non-TN layouts (compute capability 10.x): per-tensor FP8 needs no transposed copies.")
    classes: dict[str, OpClassModel] = Field(description="Cost model per op class; must include 'other', the fallback.")
    # Compute kernels slow down while communication kernels share the SMs and HBM. Calibration
    # measures and carries it; no simulation path reads it yet, so spec profiles leave it out.
    overlap_slowdown: float = Field(1.0, ge=1.0, description="Factor on compute time while communication overlaps it.")
    # Added by calibration from traces where NCCL kernels overlap compute (simulator.calibrate.overlap);
    # a confident GEMM figure scales the SM-share contention model (simulator.contention.measured_excess_scale).
    overlap_fits: dict[str, OverlapFit] = Field(default_factory=dict, description="Measured overlap slowdown per compute class.")
    # Added by calibration: time per modelled kernel that the device's host spends outside the
    # measured ops (framework dispatch, Python, autograd and hook bookkeeping). On a GPU the host
    # runs ahead of the device and this stays 0; when the "device" is a CPU rank, that time is on
    # the critical path. Fitted from the step times of train bundles (simulator.calibrate.fit).
    host_overhead_us: float = Field(0.0, ge=0, description="Host time per modelled kernel outside measured ops, µs.")
    # Eager PyTorch issues every kernel from Python: the host spends this long per launch
    # (framework dispatch, autograd, the launch call), so a run of small kernels cannot finish
    # faster than the host can issue them, whatever the device time. Forward ops are issued by
    # the Python thread, backward ops by the autograd engine's thread (slower per launch: graph
    # bookkeeping, AccumulateGrad). 0: the host always runs ahead (no floor).
    host_launch_forward_us: float = Field(0.0, ge=0, description="Host time to issue one forward kernel (eager), µs.")
    host_launch_backward_us: float = Field(0.0, ge=0, description="Host time to issue one backward kernel (autograd thread), µs.")
    # A collective call costs the host more than a kernel launch (c10d work object, stream
    # events, NCCL enqueue). 0: charged as one kernel launch.
    host_collective_us: float = Field(0.0, ge=0, description="Host time of one c10d collective call (eager), µs.")
    # Added by calibration: when the "devices" are CPU ranks sharing one host's cores (a gloo
    # capture), a rank that idles lends its core to the others, so a step takes at least the
    # ranks' total compute divided by the cores. None: every rank has a device of its own.
    host_cores: int | None = Field(None, ge=1, description="Cores shared by the ranks of one host (CPU profiles), else None.")


    @model_validator(mode="after")
    def _has_fallback_class(self) -> "ComputeModel":
        if "other" not in self.classes:
            raise ValueError(f"classes has {sorted(self.classes) or 'no entries'} but no 'other': add an 'other' class, the fallback for unlisted ops")
        return self


class CommModel(BaseModel):
    model_config = _STRICT

    nvlink_efficiency: float = Field(gt=0, le=1, description="Achieved bus bandwidth / NVLink bandwidth, large messages. Not read on a GPU NCCL's cost model describes (it takes NCCL's bandwidths: comm.nccl).")
    nic_efficiency: float = Field(gt=0, le=1, description="Achieved bus bandwidth / NIC bandwidth, large messages. Not read on a GPU NCCL's cost model describes (it takes NCCL's bandwidths: comm.nccl).")
    intra_node_latency_us: float = Field(ge=0, description="Latency per algorithm step inside a node, µs. Not read on a GPU NCCL's cost model describes (it takes NCCL's latencies: comm.nccl).")
    inter_node_latency_us: float = Field(ge=0, description="Latency per algorithm step across nodes, µs. Not read on a GPU NCCL's cost model describes (it takes NCCL's latencies: comm.nccl).")
    launch_overhead_us: float = Field(0.0, ge=0, description="Fixed cost per collective call, µs. Not read on a GPU NCCL's cost model describes (it takes NCCL's latencies: comm.nccl).")
    # Added by calibration: measured curves per collective x group size x tier. A network may use
    # them directly (simulator.calibrate.network.FittedNetwork); the efficiencies above are what
    # the flow-level fabric derives its link capacities from.
    collectives: list["CollectiveFit"] = Field(default_factory=list, description="Fitted per-collective time curves.")
    # Added by calibration from nccl-tests logs (simulator.calibrate.nccl_fit): the constants of NCCL's
    # own cost model (simulator.network.nccl) for this system. None: NCCL's model as NCCL ships it.
    nccl: "NcclCalibration | None" = Field(None, description="Calibrated constants of the NCCL cost model (None: NCCL's own).")

    def collective_fit(self, op: str, group_size: int, tier: str) -> "CollectiveFit | None":
        """The fitted curve for (op, group size, tier); the nearest fitted group size of the same
        op and tier when that exact size was not measured (None when nothing fits)."""
        same = [c for c in self.collectives if c.collective == op and c.tier == tier]
        if not same:
            return None
        exact = [c for c in same if c.group_size == group_size]
        if exact:
            return exact[0]
        return min(same, key=lambda c: (abs(np.log(c.group_size / max(group_size, 1))), c.group_size))


class NcclCalibration(BaseModel):
    """A few per-system constants on top of NCCL's tuning model (simulator.network.nccl), fitted to
    nccl-tests logs. Every default leaves NCCL's model unchanged."""

    model_config = _STRICT

    latency_scale: float = Field(1.0, gt=0, description="Factor on NCCL's base and per-hop latencies, collectives across nodes.")
    intra_latency_scale: float = Field(1.0, gt=0, description="Factor on NCCL's base and per-hop latencies, collectives inside one node.")
    ll128_latency_scale: float = Field(1.0, gt=0, description="Further factor on the LL128 protocol's latencies (relative to LL).")
    simple_latency_scale: float = Field(1.0, gt=0, description="Further factor on the Simple protocol's latencies (relative to LL).")
    net_latency_us: float = Field(0.0, ge=0, description="Network latency per network hop the net plugin adds (NCCL latencyInter; 0 on InfiniBand), µs.")
    intra_bw_scale: float = Field(1.0, gt=0, description="Achieved / NCCL's NVLink bandwidth (graph bwIntra); capped by the NVLink spec rate.")
    inter_bw_scale: float = Field(1.0, gt=0, description="Achieved / NCCL's NIC bandwidth (graph bwInter); capped by the line rate.")
    launch_us: float = Field(0.0, ge=0, description="Host launch cost per GPU a thread drives, µs (nccl-tests -g G pays G of them).")
    copy_GBps: float | None = Field(None, gt=0, description="Rate of a 1-rank collective (a device copy), GB/s.")
    ll_bw_scale: float = Field(1.0, gt=0, le=1.0, description="Achieved / NCCL's LL protocol bandwidth.")
    ll128_bw_scale: float = Field(1.0, gt=0, le=1.0, description="Achieved / NCCL's LL128 protocol bandwidth.")
    channel_us: float = Field(0.0, ge=0, description="Cost per channel (CTA) a collective launches, µs; NCCL's tuner has none (measured: time steps of 1.3-1.8 µs per added channel on one A100 node).")
    channel_us_max_channels: int | None = Field(None, ge=1, description="The most channels a collective of the fitted logs ran (NCCL's runtime channels over their shapes): channel_us is measured up to it and held there beyond, since a faster fabric's extra channels were never timed (None: no cap).")
    copy_latency_us: float | None = Field(None, ge=0, description="Start-up of a 1-rank collective's device copy, µs (None: the copy follows the launch).")
    mem_GBps: float | None = Field(None, gt=0, description="Rate of a pass over the buffer that the transfers do not hide, GB/s (None: none).")
    intra_ll_bw_scale: float | None = Field(None, gt=0, le=1.0, description="Achieved / NCCL's LL bandwidth inside one node, where it differs from across nodes (None: ll_bw_scale).")
    cta_bound_intra: bool = Field(False, description="Inside one node a collective gets the bandwidth of only the CTAs it launches (NCCL's channel rule), not all channels'.")
    inter_simple_latency_scale: float | None = Field(None, gt=0, description="The Ring/Simple latency scale for collectives across nodes, where it differs from inside one node (None: simple_latency_scale).")
    runtime_chunking: bool = Field(False, description="Tree/LL128 across nodes takes its size dependence from NCCL's runtime chunk count (calcCollChunking) instead of the tuner's treeCorrectionFactor.")
    net_step_us: float = Field(0.0, ge=0, description="Cost per network (proxy) step a channel runs beyond its first loop, µs (NCCL's calcCollChunking step count, NCCL-MODEL.md §4.4); NCCL's tuner has none.")
    system: str = Field("", description="The system (topology) the constants were fitted on.")
    fit_error: dict[str, float] = Field(default_factory=dict, description="Worst |relative time error| per fitted log.")
    product_only: list[list[str]] = Field(
        default_factory=list, description="Pairs of constants the fitted logs fix only as a product: the split between "
        "the two is the fit's, not the logs' (simulator.calibrate.nccl_fit.product_only_pairs).")


class CollectiveFit(BaseModel):
    """time_us(S) = alpha_us + S x bus_factor(collective, n) / busbw(S); busbw log-interpolated
    over the measured sizes (constant beyond them). Sizes follow nccl-tests' ``size``."""

    model_config = _STRICT

    collective: str
    group_size: int = Field(ge=1)
    tier: Literal["intra", "inter"] = Field(description="intra: all ranks on one node; inter: across nodes.")
    alpha_us: float = Field(ge=0, description="Latency of the call: the time of a vanishing message, µs.")
    table_bytes: list[float] = Field(description="Message sizes (nccl-tests size), ascending.")
    table_busbw_GBps: list[float] = Field(description="Bus bandwidth of the size-dependent part at table_bytes, GB/s.")
    fit_error: float | None = Field(None, description="Median |relative time error| on held-out sizes.")
    fit_range_bytes: tuple[float, float] | None = None
    source: str = ""

    def time_us(self, size_bytes: np.ndarray | float) -> np.ndarray:
        s = np.asarray(size_bytes, dtype=float)
        n = self.group_size
        if self.collective == "all_reduce":
            factor = 2.0 * (n - 1) / n if n > 1 else 0.0
        elif self.collective in ("all_gather", "reduce_scatter", "all_to_all"):
            factor = (n - 1) / n if n > 1 else 0.0
        else:
            factor = 1.0
        bw = np.exp(np.interp(np.log(np.maximum(s, 1.0)), np.log(self.table_bytes), np.log(self.table_busbw_GBps)))
        return self.alpha_us + factor * s / (bw * 1e3)


class ProvenanceItem(BaseModel):
    model_config = _STRICT

    field: str = Field(description="Dotted path of the number in this profile.")
    value: float | str
    source: str = Field(description="Where it comes from: a datasheet, a paper, a benchmark, a fitted bundle.")


class Provenance(BaseModel):
    model_config = _STRICT

    method: Literal["spec", "fitted", "mixed"]
    created: str
    items: list[ProvenanceItem] = Field(default_factory=list)
    bundles: list[dict] = Field(default_factory=list, description="Source bundles: path, sha256, devices, versions.")
    notes: str = ""


class Profile(BaseModel):
    model_config = _STRICT

    schema_version: int = PROFILE_SCHEMA_VERSION
    name: str
    device: str = Field(description="Device name as the driver reports it.")
    hbm_gib: float = Field(gt=0, description="Device memory, GiB.")
    usable_memory_fraction: float = Field(0.95, gt=0, le=1, description="Share of HBM a training job can use.")
    compute: ComputeModel
    comm: CommModel
    provenance: Provenance
    _warned: set = PrivateAttr(default_factory=set)

    def _warn_outside(self, name: str, what: str, values: np.ndarray, lo_hi: tuple[float, float] | None) -> None:
        """Fitted profiles warn (once per class and quantity) when asked outside what they saw."""
        if lo_hi is None or (name, what) in self._warned:
            return
        v = values[values > 0]
        if v.size == 0:
            return
        lo, hi = lo_hi
        if v.min() < lo * 0.999 or v.max() > hi * 1.001:
            self._warned.add((name, what))
            warnings.warn(
                f"profile {self.name!r}, op class {name!r}: {what} {v.min():.3g}..{v.max():.3g} outside the fitted range "
                f"{lo:.3g}..{hi:.3g}; extrapolating (capture larger/smaller ops to cover it)",
                ExtrapolationWarning,
                stacklevel=3,
            )

    # --- vectorised cost functions (called before the event loop, never inside it) ---

    def compute_time_s(self, op_class: np.ndarray, flops: np.ndarray, bytes_: np.ndarray) -> np.ndarray:
        """Durations of many ops at once. op_class: array of class names."""
        flops = np.asarray(flops, dtype=float)
        bytes_ = np.asarray(bytes_, dtype=float)
        op_class = np.asarray(op_class)
        out = np.zeros(flops.shape, dtype=float)
        peak = self.compute.peak_tflops * 1e12
        hbm = self.compute.hbm_GBps * 1e9
        for name in np.unique(op_class):
            model = self.compute.classes.get(str(name)) or self.compute.classes["other"]
            sel = op_class == name
            f = flops[sel]
            b = bytes_[sel]
            if model.table_flops and model.table_tflops:
                achieved = 1e12 * np.exp(np.interp(np.log(np.maximum(f, 1.0)), np.log(model.table_flops), np.log(model.table_tflops)))
            else:
                achieved = peak * model.peak_efficiency * f / (f + model.half_efficiency_flops + 1e-30)
            t_flops = np.where(f > 0, f / np.maximum(achieved, 1.0), 0.0)
            if model.table_bytes and model.table_GBps:
                bw = 1e9 * np.exp(np.interp(np.log(np.maximum(b, 1.0)), np.log(model.table_bytes), np.log(model.table_GBps)))
                t_bytes = np.where(b > 0, b / bw, 0.0)
            else:
                t_bytes = b / (hbm * model.bandwidth_efficiency)
            if model.basis == "flops":
                # Ops without FLOPs (a byte-only op of a FLOP-fitted class) still cost their bytes.
                t = np.where(f > 0, t_flops, t_bytes)
                self._warn_outside(str(name), "FLOPs", f, model.fit_range_flops)
            elif model.basis == "bytes":
                t = np.where(b > 0, t_bytes, t_flops)
                self._warn_outside(str(name), "bytes", b, model.fit_range_bytes)
            else:
                t = np.maximum(t_flops, t_bytes)
                self._warn_outside(str(name), "FLOPs", f, model.fit_range_flops)
                self._warn_outside(str(name), "bytes", b, model.fit_range_bytes)
            out[sel] = t + (model.overhead_us + self.compute.host_overhead_us) * 1e-6 * (f + b > 0)
        return out


class ExtrapolationWarning(UserWarning):
    """A fitted cost model was asked about sizes outside the range it was fitted on."""


CommModel.model_rebuild()


def available_profiles() -> list[str]:
    return sorted(p.stem for p in CALIBRATION_DIR.glob("*.json"))


def load_profile(name_or_path: "str | Path | Profile") -> Profile:
    """A profile name in calibration/ or a path to a profile JSON (a Profile passes through:
    a scenario may hold its profile inline)."""
    if isinstance(name_or_path, Profile):
        return name_or_path
    path = Path(name_or_path)
    if path.suffix != ".json":
        given = path
        path = CALIBRATION_DIR / f"{name_or_path}.json"
        if not path_exists(path) and path_exists(given):
            raise UserError(f"GPU profile {str(given)!r} is a {'folder' if given.is_dir() else 'file'} but not a profile JSON "
                            f"(.json): give the path of a profile .json, or a shipped name ({', '.join(available_profiles())})")
        if not path_exists(path):
            raise UserError(
                f"unknown GPU profile {str(name_or_path)!r}{did_you_mean_name(str(name_or_path), available_profiles())}: "
                f"use one of {', '.join(available_profiles())} or a path to a profile JSON"
            )
    data = read_json(path, "GPU profile file", fix="fix or re-calibrate it")
    if isinstance(data, dict) and isinstance(data.get("schema_version"), int) and data["schema_version"] > PROFILE_SCHEMA_VERSION:
        raise UserError(f"GPU profile {str(path)!r} has schema_version {data['schema_version']}: upgrade clustersim")
    check_document_kind(data, "GPU profile", str(path), "a GPU profile (clustersim calibrate --out)",
                        fix=f"give a profile JSON or a shipped name ({', '.join(available_profiles())})")
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise UserError(f"GPU profile {str(path)!r}: {validation_error_line(exc, model=Profile)}") from None
