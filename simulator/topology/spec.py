"""Cluster topology descriptions (topologies/*.yaml), validated by pydantic.

A topology is a node description (GPUs on an NVLink/NVSwitch domain, NICs) and a scale-out
fabric, a discriminated union by ``kind``. Every kind is parametric in the number of GPUs: the
graph (simulator.topology.graph.build_graph) is built for the GPU count a scenario asks for.

The spine reads only the node description (GPUs per node, NVLink and NIC bandwidth and
latency); the flow-level fabric reads the whole graph.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from simulator.data import data_dir
from simulator.errors import UserError, check_document_kind, did_you_mean_name, path_exists, read_yaml, validation_error_line

TOPOLOGY_DIR = data_dir("topologies")

# Bounds: real nodes hold 1-72 GPUs (GB200 NVL72 is one NVLink domain of 72) and up to 16 NICs; real
# switches 32-512 ports; real links carry below 10 TB/s. The limits sit far above and stop a typo from
# building a graph of billions of vertices.
_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class NodeSpec(BaseModel):
    """One server: GPUs on an NVLink/NVSwitch domain, NICs to the scale-out fabric."""

    model_config = _STRICT

    kind: str = Field(description="Node model, e.g. dgx-h100, dgx-a100, p4de, cpu-host.")
    gpus_per_node: int = Field(ge=1, le=1024, description="GPUs sharing one NVLink/NVSwitch domain.")
    nvlink_GBps: float = Field(gt=0, le=1e6, description="NVLink bandwidth per GPU, one direction, GB/s.")
    nvlink_latency_us: float = Field(ge=0, description="GPU-to-GPU latency through the NVSwitch, µs. Not read on a GPU NCCL's cost model describes (it takes NCCL's latencies: comm.nccl).")
    nics_per_node: int = Field(ge=1, le=1024, description="Scale-out NICs per node.")
    nic_gbps: float = Field(gt=0, le=1e6, description="Bandwidth of one NIC, one direction, Gbit/s.")
    nic_latency_us: float = Field(
        ge=0, description="NIC-to-NIC latency through one (leaf) switch, µs; each higher switch hop adds fabric.switch_latency_us. Not read on a GPU NCCL's cost model describes (it takes NCCL's latencies: comm.nccl)."
    )
    # Facts NCCL's tuning model reads (simulator.network.nccl); defaults keep older files valid.
    cpu_vendor: Literal["intel", "amd", "arm"] = Field(
        "intel", description="Host CPU vendor: NCCL picks its LL bandwidth cap and network overhead by it."
    )
    nvls: bool = Field(False, description="NVSwitch with NVLink SHARP (in-switch reduction; NVSwitch gen3+, H100 and newer).")
    sharp: bool = Field(False, description="Scale-out fabric with in-network reduction (InfiniBand SHARP, NCCL CollNet) enabled.")
    nvlink_links: int | None = Field(None, ge=1, description="NVLink links per GPU (default: nvlink_GBps / the generation's per-link rate).")
    pcie_GBps: float | None = Field(None, gt=0, description="GPU-NIC PCIe bandwidth as NCCL counts it (default: x16 of the GPU's PCIe generation).")
    ll128: bool = Field(True, description="NCCL may use its LL128 protocol (False: NCCL_PROTO without it); NCCL's own rule then needs NVLink inside and gpu_nic_path.")
    gpu_nic_path: Literal["PIX", "PXB", "P2C", "PXN", "PHB", "SYS"] = Field(
        "PXB", description="NCCL's path type from a GPU to its NIC (PIX/PXB: under PCIe switches; PXN: through another GPU; "
                           "PHB/SYS: through the CPU). Above PXB (PXN on Hopper+) NCCL turns LL128 off across nodes.")
    nvlink: bool = Field(True, description=(
        "GPUs inside the node reach each other over NVLink; false: over PCIe (nvlink_GBps is then the PCIe link), "
        "so NCCL's path type is PCI: PCIe graph bandwidth, PCI hop latencies, no LL128 (NCCL-MODEL.md §1.8, §3.6)."))
    nccl_protocols: list[Literal["LL", "LL128", "Simple"]] | None = Field(
        None, description="Protocols NCCL may use (NCCL_PROTO as the system sets it); default all.")

    @property
    def nvlink_domain_gpus(self) -> int:
        """GPUs that reach each other over NVLink: the node as this spec describes it (8 in a
        DGX, 72 in a GB200 NVL72 rack, whose "node" is the whole NVLink domain)."""
        return self.gpus_per_node

    @property
    def nic_GBps_per_gpu(self) -> float:
        """Scale-out bandwidth available to one GPU, GB/s (NICs shared evenly by the GPUs)."""
        return self.nic_gbps / 8.0 * self.nics_per_node / self.gpus_per_node

    @property
    def nic_GBps(self) -> float:
        return self.nic_gbps / 8.0


class SingleNodeFabric(BaseModel):
    """One host and nothing else: every GPU (or CPU rank) hangs off one switch (NVSwitch or
    loopback). A GPU count above gpus_per_node is an error."""

    model_config = _STRICT
    kind: Literal["single-node"]


class _ClosBase(BaseModel):
    model_config = _STRICT

    radix: int = Field(64, ge=2, le=65_536, description="Ports per switch.")
    leaf_oversubscription: float = Field(
        1.0, ge=1.0, description="Leaf downlink : uplink bandwidth (1 = full bisection, 7 = 1:7)."
    )
    spine_oversubscription: float = Field(
        1.0, ge=1.0, description="Pod (spine layer) down : up bandwidth towards the core."
    )
    pod_gpus: int | None = Field(
        None,
        ge=1,
        description="GPUs under one spine layer (a pod). Default: as many leaves as one spine's "
        "radix reaches (a two-level leaf-spine); more GPUs add a core level between pods.",
    )
    switch_latency_us: float = Field(0.3, ge=0, description="Latency added by each switch-to-switch hop, µs. Not read on a GPU NCCL's cost model describes (it takes NCCL's latencies: comm.nccl).")


class FatTreeFabric(_ClosBase):
    """Leaf-spine(-core) Clos: every NIC of a node on the same leaf switch (top of rack)."""

    kind: Literal["fat-tree", "leaf-spine"]


class RailOptimizedFabric(_ClosBase):
    """NIC i of every node of a rail group on rail (leaf) switch i; rails meet at the spines."""

    kind: Literal["rail-optimized"]


class TorusFabric(BaseModel):
    """2D/3D torus of GPUs (TPU-like): each GPU routes, links to its neighbours in every
    dimension, wrap-around links closing each ring. Routing is dimension-ordered."""

    model_config = _STRICT

    kind: Literal["torus"]
    ndim: Literal[2, 3] = Field(3, description="Used when dims is not given: factor the GPU count into ndim sides.")
    dims: list[int] | None = Field(None, description="Sides of the torus; their product must equal the GPU count.")
    link_GBps: float | list[float] = Field(
        description="Bandwidth of one link, one direction, GB/s; one value or one per dimension."
    )
    hop_latency_us: float = Field(1.0, ge=0, description="Latency per link hop, µs.")
    wraparound: bool = Field(True, description="Wrap-around links (torus); false gives a mesh.")

    @model_validator(mode="after")
    def _check(self) -> "TorusFabric":
        if self.dims is not None and not (2 <= len(self.dims) <= 3 and all(d >= 1 for d in self.dims)):
            raise ValueError(f"dims {self.dims} must list 2 or 3 positive sides")
        n = len(self.dims) if self.dims is not None else self.ndim
        if isinstance(self.link_GBps, list) and len(self.link_GBps) != n:
            raise ValueError(f"link_GBps has {len(self.link_GBps)} values for {n} dimensions: give one or {n}")
        values = self.link_GBps if isinstance(self.link_GBps, list) else [self.link_GBps]
        if min(values) <= 0:
            raise ValueError(f"link_GBps {self.link_GBps} must be positive")
        return self


Fabric = Annotated[
    Union[SingleNodeFabric, FatTreeFabric, RailOptimizedFabric, TorusFabric],
    Field(discriminator="kind"),
]
FABRIC_KINDS = ("single-node", "fat-tree", "leaf-spine", "rail-optimized", "torus")


class TopologySpec(BaseModel):
    model_config = _STRICT

    name: str
    description: str = ""
    node: NodeSpec
    # A spec written without a fabric (the spine's tests) gets a non-blocking fat-tree.
    fabric: Fabric = Field(default_factory=lambda: FatTreeFabric(kind="fat-tree"))


def available_topologies() -> list[str]:
    return sorted(p.stem for p in TOPOLOGY_DIR.glob("*.yaml"))


def load_topology(name_or_path: "str | Path | TopologySpec") -> TopologySpec:
    """A preset name in topologies/ or a path to a YAML file (a TopologySpec passes through:
    a scenario may hold its topology inline)."""
    if isinstance(name_or_path, TopologySpec):
        return name_or_path
    path = Path(name_or_path)
    if not path.suffix:
        given = path
        path = TOPOLOGY_DIR / f"{name_or_path}.yaml"
        if not path_exists(path) and path_exists(given):
            raise UserError(f"topology {str(given)!r} is a {'folder' if given.is_dir() else 'file without an extension'}, "
                            f"not a topology YAML: give the path of a .yaml file, or a shipped name "
                            f"({', '.join(available_topologies())})")
        if not path_exists(path):
            raise UserError(
                f"unknown topology {str(name_or_path)!r}{did_you_mean_name(str(name_or_path), available_topologies())}: use one of "
                f"{', '.join(available_topologies())} or a path to a YAML file"
            )
    data = read_yaml(path, "topology file")
    check_document_kind(data, "topology file", str(path), "a topology",
                        fix=f"give a topology YAML (node:, fabric:) or a shipped name ({', '.join(available_topologies())})")
    try:
        return TopologySpec.model_validate(data)
    except ValidationError as exc:
        raise UserError(f"topology file {str(path)!r}: {first_validation_error(exc)}") from None


def first_validation_error(exc: ValidationError) -> str:
    """One line from a pydantic error: where, what, and (for unknown keys) how to fix it."""
    err = exc.errors()[0]
    # The discriminated union puts the tag into the location (fabric.fat-tree.radix); a user
    # wrote fabric.radix.
    loc = ".".join(str(p) for p in err["loc"] if str(p) not in FABRIC_KINDS)
    if err["type"] == "missing" or any(e["type"] == "extra_forbidden" for e in exc.errors()):
        return validation_error_line(exc, hide_loc=FABRIC_KINDS, model=TopologySpec)
    if err["type"] == "union_tag_invalid":
        tag = (err.get("ctx") or {}).get("tag")
        return f"unknown {loc}.kind {tag!r}: use one of {', '.join(FABRIC_KINDS)}"
    if err["type"] == "union_tag_not_found":
        return f"missing key '{loc}.kind': add one of {', '.join(FABRIC_KINDS)}"
    msg = " ".join(str(err["msg"]).split())
    return f"{loc}: {msg} (got {_short(err.get('input'))})"


def _short(value: Any) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."
