"""The `perturbations:` section of a scenario: what differs from the ideal, identical cluster.

Every factor is a multiplier on the nominal figure of the GPU profile or topology (1.0 = nominal,
0.8 = 80 % of nominal). Compute factors scale a GPU's speed, so its kernels take 1/factor as
long; link factors scale a link's capacity. Jitter is seeded, so a seed reproduces a step to
the byte. Failures feed the goodput model (``simulator.whatif.goodput``, Daly 2006).

Sources of the defaults:
- MTBF per GPU 50,000 h: Llama 3 (Dubey et al. 2024, §3.3.4) reports 419 unexpected interruptions
  in 54 days on 16,384 H100 -> 16,384 x 54 x 24 / 419 = 50,677 GPU-hours between failures.
- Checkpoint interval 30 min, checkpoint cost 60 s, restart 10 min: orders of magnitude reported
  for large jobs (MegaScale, Jiang et al. NSDI 2024, §4: minutes to detect and restart; Llama 3
  checkpoints every few tens of minutes). They are inputs, not fits: set them to your job's.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from simulator.errors import Whole

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)

# Bounds: a factor of 0.01 (a GPU at 1 % of its speed) is already a dead part; above 10x nominal
# is a typo, not a what-if.
MIN_FACTOR = 0.01
MAX_FACTOR = 10.0
MAX_SEEDS = 100_000
# A CV above 2 means most kernels take a few times their mean: no real GPU jitters like that.
MAX_CV = 2.0


class GpuSpeed(BaseModel):
    """One GPU (by rank) or every GPU of one node runs at a fraction of its nominal speed."""

    model_config = _STRICT

    rank: Whole | None = Field(None, ge=0, description="Global rank (= GPU id under the default placement) of the GPU; unitless index.")
    node: Whole | None = Field(None, ge=0, description="Node index: every GPU of that node gets the factor; unitless index.")
    speed: float = Field(ge=MIN_FACTOR, le=MAX_FACTOR, description="Compute speed relative to nominal (kernels take 1/speed as long; above 1 is faster); unitless ratio.")

    @model_validator(mode="after")
    def _one_target(self) -> "GpuSpeed":
        if (self.rank is None) == (self.node is None):
            raise ValueError("a gpus entry names exactly one of rank or node")
        return self


class GpuSpeedDraw(BaseModel):
    """Speeds of all GPUs drawn from a seeded distribution (fleet variability, e.g. PRISM's ~9 %)."""

    model_config = _STRICT

    distribution: Literal["lognormal", "normal"] = Field("lognormal", description="Distribution of the per-GPU speed factor (mean 1).")
    cv: float = Field(gt=0, le=MAX_CV, description="Coefficient of variation of the speed factor; unitless ratio (0.03 = 3 %).")
    seed: Whole = Field(0, ge=0, le=2**32 - 1, description="Seed of the draw; unitless.")
    levels: Whole = Field(
        8, ge=1, le=1024,
        description="Speeds are rounded to this many quantile levels so GPUs of equal speed stay grouped (fewer simulated ranks); count.",
    )


class LinkFactor(BaseModel):
    """One link, or a set of links, carries a fraction of its nominal bandwidth."""

    model_config = _STRICT

    name: str = Field(
        min_length=1, max_length=200,
        description=("Link selector: a link name as the topology names it ('leaf0->spine0'; 'A<->B' for both directions), "
                     "a glob ('nic*->leaf*'), 'nic:N' (both directions of NIC N's cable), 'node:N' (every NIC cable of node N), "
                     "'uplink:LEAF' (both directions between leaf LEAF and its spine), 'tier:nic|leaf-spine|spine-core|nvlink', "
                     "or 'rail:R' (the NIC cables of local NIC index R on every node)."),
    )
    bandwidth: float = Field(ge=MIN_FACTOR, le=MAX_FACTOR, description="Capacity relative to nominal (above 1 is more); unitless ratio.")


class Failures(BaseModel):
    """Failed nodes and the job's policy; the step itself is simulated without them."""

    model_config = _STRICT

    nodes: list[Annotated[Whole, Field(ge=0)]] = Field(default_factory=list, max_length=100_000, description="Nodes that fail during the run (one failure each); node indices.")
    policy: Literal["restart", "spares"] = Field(
        "restart",
        description="restart: the job stops, waits restart_cost_s and resumes from the last checkpoint; "
                    "spares: a hot spare node replaces it, costing spare_swap_s instead of restart_cost_s (work since the checkpoint is still redone).",
    )
    mtbf_per_gpu_h: float = Field(50_000.0, gt=0, le=1e9, description="Mean time between failures of one GPU with its share of host and network, hours (Llama 3: ~50,677).")
    checkpoint_interval_s: float = Field(1800.0, gt=0, le=1e7, description="Work between two checkpoints, seconds.")
    checkpoint_cost_s: float = Field(60.0, ge=0, le=1e6, description="Blocking time to write one checkpoint, seconds.")
    restart_cost_s: float = Field(600.0, ge=0, le=1e7, description="Detect, reschedule, reload and warm up after a failure, seconds.")
    spare_swap_s: float = Field(120.0, ge=0, le=1e7, description="Swap in a hot spare and reload, seconds (policy spares).")


class Jitter(BaseModel):
    """Seeded run-to-run noise on kernels and/or collectives."""

    model_config = _STRICT

    cv: float = Field(gt=0, le=MAX_CV, description="Coefficient of variation of each duration's multiplier; unitless ratio (0.05 = 5 %).")
    distribution: Literal["lognormal", "normal"] = Field("lognormal", description="Distribution of the multiplier (mean 1; normal is truncated at 0.05).")
    target: Literal["kernel", "collective", "both"] = Field("kernel", description="What the noise applies to: compute segments, collectives, or both.")
    seed: Whole = Field(0, ge=0, le=2**32 - 1, description="First seed; seed i of a distribution is seed + i; unitless.")
    seeds: Whole = Field(1, ge=1, le=MAX_SEEDS, description="Steps simulated, one per seed, for the step-time distribution; count.")
    granularity: Literal["group", "stage"] = Field(
        "group",
        description="group: one simulated rank per TP x CP group, every data-parallel replica with its own noise; "
                    "stage: one per pipeline rank (replicas share draws: about dp times cheaper, misses the slowest "
                    "replica's accumulated noise, of order cv / sqrt(segments per step)).",
    )


class Perturbations(BaseModel):
    """What is not nominal in this run."""

    model_config = _STRICT

    gpus: list[GpuSpeed] = Field(default_factory=list, max_length=1_048_576, description="GPUs (by rank or node) slower or faster than nominal.")
    gpu_draw: GpuSpeedDraw | None = Field(None, description="Per-GPU speeds drawn from a seeded distribution (applied before `gpus`).")
    links: list[LinkFactor] = Field(default_factory=list, max_length=100_000, description="Links with less (or more) bandwidth than nominal.")
    failures: Failures | None = Field(None, description="Failed nodes and the restart policy: feeds the goodput model.")
    jitter: Jitter | None = Field(None, description="Seeded noise per kernel or per collective, and the number of seeds.")

    @model_validator(mode="after")
    def _each_target_once(self) -> "Perturbations":
        # Two entries for one GPU or link would both apply, one on top of the other: not what
        # either says (the --slow-gpu / --slow-link flags refuse it the same way).
        seen: set[tuple[str, int]] = set()
        for g in self.gpus:
            key = ("rank", g.rank) if g.rank is not None else ("node", g.node)
            if key in seen:
                raise ValueError(f"gpus names {key[0]} {key[1]} twice: give one speed for it")
            seen.add(key)
        names = [link.name for link in self.links]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"links names {twice[0]!r} twice: give one bandwidth for it")
        return self

    @property
    def changes_step(self) -> bool:
        """Does anything here change the simulated step (failures alone do not)."""
        return bool(self.gpus or self.gpu_draw or self.links or self.jitter)

    @property
    def empty(self) -> bool:
        return not (self.changes_step or self.failures)
