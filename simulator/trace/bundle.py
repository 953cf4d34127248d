"""TraceBundle: traces/<name>/manifest.json + rank<k>.trace.json.gz + derived tables.

The manifest model lives here so that the capture harness (which writes bundles) and the
importers, calibration and validation (which read them) agree on one versioned format.
This module never imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from simulator.errors import UserError, read_json, validation_error_line

BUNDLE_SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"


class StepTiming(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: int
    wall_s: float = Field(description="Wall time of the step, measured between barriers, seconds.")


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = BUNDLE_SCHEMA_VERSION
    created: str = Field(description="ISO-8601 UTC time the capture finished.")
    tool_version: str
    torch_version: str | None = None
    backend: str = Field(description="gloo or nccl (or 'imported' for foreign traces).")
    nccl_version: str | None = None
    devices: list[str] = Field(default_factory=list, description="Device name of each rank.")
    device_counts: dict[str, int] = Field(default_factory=dict)
    world_size: int
    hosts: list[str] = Field(default_factory=list)
    workload: str = Field(description="collectives | compute | train | imported")
    workload_args: dict[str, Any] = Field(default_factory=dict)
    # The scenario the train workload ran, as a dict in simulator.scenario.Scenario's schema.
    scenario: dict[str, Any] | None = None
    step_times: list[StepTiming] = Field(default_factory=list)
    trace_files: list[str] = Field(default_factory=list, description="rank<k>.trace.json.gz, by rank.")
    tables: list[str] = Field(default_factory=list, description="Derived parquet tables.")
    notes: list[str] = Field(
        default_factory=list,
        description="How the capture mapped the request onto torch (e.g. which FSDP2 mode stands for a ZeRO stage).",
    )


def load_manifest(bundle_dir: str | Path) -> Manifest:
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST_NAME
    if not path.exists():
        raise UserError(f"{str(bundle_dir)!r} has no {MANIFEST_NAME}: it is not a trace bundle (capture one with 'clustersim capture')")
    data = read_json(path, "bundle manifest", fix="re-capture the bundle")
    version = data.get("schema_version") if isinstance(data, dict) else None
    if isinstance(version, int) and version > BUNDLE_SCHEMA_VERSION:
        raise UserError(
            f"{str(path)!r} has schema_version {version}, newer than this ClusterSim reads "
            f"({BUNDLE_SCHEMA_VERSION}): upgrade clustersim"
        )
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise UserError(f"{str(path)!r}: {validation_error_line(exc)}: re-capture the bundle") from None
