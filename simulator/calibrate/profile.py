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

import json
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from simulator.errors import UserError

PROFILE_SCHEMA_VERSION = 1
CALIBRATION_DIR = Path(__file__).resolve().parents[2] / "calibration"
OP_CLASSES = ("gemm", "attention", "elementwise", "norm", "optimizer", "other")

_STRICT = ConfigDict(extra="forbid")


class OpClassModel(BaseModel):
    model_config = _STRICT

    peak_efficiency: float = Field(gt=0, le=1, description="Fraction of peak FLOP/s that large ops of this class reach.")
    half_efficiency_flops: float = Field(ge=0, description="FLOPs at which an op reaches half of peak_efficiency.")
    bandwidth_efficiency: float = Field(gt=0, le=1, description="Fraction of HBM bandwidth memory-bound ops reach.")
    overhead_us: float = Field(0.0, ge=0, description="Fixed cost per kernel (launch, tail), µs.")
    # A fitted lookup (from calibration): achieved TFLOP/s at given FLOPs, log-space interpolated.
    table_flops: list[float] | None = Field(None, description="FLOPs of the measured points, ascending.")
    table_tflops: list[float] | None = Field(None, description="Achieved TFLOP/s at table_flops.")
    fit_error: float | None = Field(None, description="Median |relative error| on held-out captured ops.")
    fit_range_flops: tuple[float, float] | None = Field(None, description="FLOPs range the fit saw.")


class ComputeModel(BaseModel):
    model_config = _STRICT

    peak_tflops: float = Field(gt=0, description="Peak dense TFLOP/s in the compute dtype (BF16 tensor cores).")
    hbm_GBps: float = Field(gt=0, description="Peak HBM bandwidth, GB/s.")
    classes: dict[str, OpClassModel]
    # Compute kernels slow down while communication kernels share the SMs and HBM.
    overlap_slowdown: float = Field(1.0, ge=1.0, description="Factor on compute time while communication overlaps it.")


class CommModel(BaseModel):
    model_config = _STRICT

    nvlink_efficiency: float = Field(gt=0, le=1, description="Achieved bus bandwidth / NVLink bandwidth, large messages.")
    nic_efficiency: float = Field(gt=0, le=1, description="Achieved bus bandwidth / NIC bandwidth, large messages.")
    intra_node_latency_us: float = Field(ge=0, description="Latency per algorithm step inside a node, µs.")
    inter_node_latency_us: float = Field(ge=0, description="Latency per algorithm step across nodes, µs.")
    launch_overhead_us: float = Field(0.0, ge=0, description="Fixed cost per collective call, µs.")


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
            if model.table_flops and model.table_tflops:
                achieved = 1e12 * np.exp(np.interp(np.log(np.maximum(f, 1.0)), np.log(model.table_flops), np.log(model.table_tflops)))
            else:
                achieved = peak * model.peak_efficiency * f / (f + model.half_efficiency_flops + 1e-30)
            t_flops = np.where(f > 0, f / np.maximum(achieved, 1.0), 0.0)
            t_bytes = bytes_[sel] / (hbm * model.bandwidth_efficiency)
            out[sel] = np.maximum(t_flops, t_bytes) + model.overhead_us * 1e-6 * (f + bytes_[sel] > 0)
        return out


def available_profiles() -> list[str]:
    return sorted(p.stem for p in CALIBRATION_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A profile name in calibration/ or a path to a profile JSON."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = CALIBRATION_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise UserError(
                f"unknown GPU profile {str(name_or_path)!r}: use one of {', '.join(available_profiles())} or a path to a profile JSON"
            )
    if not path.exists():
        raise UserError(f"GPU profile file {str(path)!r} does not exist: check the path")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"GPU profile {str(path)!r} is not valid JSON ({exc.msg} at line {exc.lineno}): fix or re-calibrate it") from None
    if isinstance(data, dict) and isinstance(data.get("schema_version"), int) and data["schema_version"] > PROFILE_SCHEMA_VERSION:
        raise UserError(f"GPU profile {str(path)!r} has schema_version {data['schema_version']}: upgrade clustersim")
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise UserError(f"GPU profile {str(path)!r}: {loc}: {err['msg']}") from None
