"""Cluster topology descriptions (topologies/*.yaml), validated by pydantic.

The spine reads only the node description (GPUs per node, NVLink and NIC bandwidth and
latency); the flow-level fabric reads the whole graph.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from simulator.errors import UserError

TOPOLOGY_DIR = Path(__file__).resolve().parents[2] / "topologies"


class NodeSpec(BaseModel):
    """One server: GPUs on an NVLink/NVSwitch domain, NICs to the scale-out fabric."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field(description="Node model, e.g. dgx-h100, dgx-a100, p4de, cpu-host.")
    gpus_per_node: int = Field(ge=1, description="GPUs sharing one NVLink/NVSwitch domain.")
    nvlink_GBps: float = Field(gt=0, description="NVLink bandwidth per GPU, one direction, GB/s.")
    nvlink_latency_us: float = Field(ge=0, description="Per-hop latency inside the node, µs.")
    nics_per_node: int = Field(ge=1, description="Scale-out NICs per node.")
    nic_gbps: float = Field(gt=0, description="Bandwidth of one NIC, one direction, Gbit/s.")
    nic_latency_us: float = Field(ge=0, description="Per-hop latency across the fabric, µs.")

    @property
    def nic_GBps_per_gpu(self) -> float:
        """Scale-out bandwidth available to one GPU, GB/s (NICs shared evenly by the GPUs)."""
        return self.nic_gbps / 8.0 * self.nics_per_node / self.gpus_per_node


class TopologySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    node: NodeSpec
    # The scale-out fabric (fat-tree, rail-optimized, torus ...); its schema belongs to
    # simulator.topology and the flow-level fabric.
    fabric: dict[str, Any] = Field(default_factory=dict)


def available_topologies() -> list[str]:
    return sorted(p.stem for p in TOPOLOGY_DIR.glob("*.yaml"))


def load_topology(name_or_path: str | Path) -> TopologySpec:
    """A preset name in topologies/ or a path to a YAML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = TOPOLOGY_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            raise UserError(
                f"unknown topology {str(name_or_path)!r}: use one of "
                f"{', '.join(available_topologies())} or a path to a YAML file"
            )
    if not path.exists():
        raise UserError(f"topology file {str(path)!r} does not exist: check the path")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"topology file {str(path)!r} is not valid YAML: {_one_line(exc)}") from None
    try:
        return TopologySpec.model_validate(data)
    except ValidationError as exc:
        raise UserError(f"topology file {str(path)!r}: {first_validation_error(exc)}") from None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def first_validation_error(exc: ValidationError) -> str:
    """One line from a pydantic error: where, what, and (for unknown keys) how to fix it."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown key {loc!r}: remove it or check its spelling"
    if err["type"] == "missing":
        return f"missing key {loc!r}: add it"
    return f"{loc}: {err['msg']} (got {err.get('input')!r})"
