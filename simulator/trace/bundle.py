"""TraceBundle: traces/<name>/manifest.json + rank<k>.trace.json.gz + derived tables.

The manifest model lives here so that the capture harness (which writes bundles) and the
importers, calibration and validation (which read them) agree on one versioned format.
This module never imports torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from simulator.errors import UserError, check_document_kind, read_json, validation_error_line

BUNDLE_SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
_BARE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}")


class StepTiming(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    step: int
    # A measured step takes time: zero, negative or non-finite would silently zero the fitted host overhead.
    wall_s: float = Field(gt=0, description="Wall time of the step, measured between barriers, seconds.")


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    schema_version: int = BUNDLE_SCHEMA_VERSION
    created: str = Field(description="ISO-8601 UTC time the capture finished.")
    tool_version: str
    torch_version: str | None = None
    backend: str = Field(description="gloo or nccl (or 'imported' for foreign traces).")
    nccl_version: str | None = None
    devices: list[str] = Field(default_factory=list, description="Device name of each rank.")
    device_counts: dict[str, int] = Field(default_factory=dict)
    world_size: int = Field(ge=1, description="Ranks that ran the capture.")
    hosts: list[str] = Field(default_factory=list)
    workload: str = Field(description="collectives | compute | train | imported")
    workload_args: dict[str, Any] = Field(default_factory=dict)
    # The scenario the train workload ran, as a dict in simulator.scenario.Scenario's schema.
    scenario: dict[str, Any] | None = None
    step_times: list[StepTiming] = Field(default_factory=list)
    trace_files: list[str] = Field(default_factory=list, description="rank<k>.trace.json.gz, by rank.")
    tables: list[str] = Field(default_factory=list, description="Derived parquet tables.")

    @field_validator("trace_files", "tables")
    @classmethod
    def _inside_the_bundle(cls, names: list[str]) -> list[str]:
        # A manifest names files of its own folder: never a path that leads out of it (/etc/passwd, ../x).
        for name in names:
            if not isinstance(name, str) or not _BARE_NAME.fullmatch(name) or name in (".", ".."):
                raise ValueError(f"{name!r} is not a file name inside the bundle: list bare names such as rank0.trace.json.gz")
        return names

    @field_validator("scenario", mode="before")
    @classmethod
    def _scenario_mapping(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise ValueError("scenario must be a mapping of the scenario's sections, or absent")
        return value

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
    check_document_kind(data, "bundle manifest", str(path), "a trace bundle manifest", fix="re-capture the bundle")
    version = data.get("schema_version") if isinstance(data, dict) else None
    if isinstance(version, int) and version > BUNDLE_SCHEMA_VERSION:
        raise UserError(
            f"{str(path)!r} has schema_version {version}, newer than this ClusterSim reads "
            f"({BUNDLE_SCHEMA_VERSION}): upgrade clustersim"
        )
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise UserError(f"{str(path)!r}: {validation_error_line(exc, model=Manifest)}: re-capture the bundle") from None
