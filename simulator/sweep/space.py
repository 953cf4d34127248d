"""A sweep's search space: a base scenario, lists of values per axis, an objective and constraints.

A space file (YAML)::

    name: llama3-8b-64                 # names the store and the dashboards
    base: ../scenarios/small.yaml      # a scenario file (relative to this file), or
    scenario: {model: llama3-8b, ...}  # an inline scenario dict; default: the built-in default
    model: llama3-8b                   # shortcuts for the common fixed fields
    gpus: 64
    space:                             # axis -> list of values (a scalar means one value)
      tp: [1, 2, 4, 8]
      pp: [1, 2, 4]
      schedule: [1f1b, interleaved-1f1b]
      parallelism.sequence_parallel: [true, false]   # any dotted scenario field
    objective: tokens_per_s            # tokens_per_s | tokens_per_s_per_gpu | mfu | step_time_s
    constraints: {memory_headroom: 0.1, max_gpus: 1024, min_gpus: 8}
    top_k: 20
    mode: reduced

Every point is the base scenario with one value per axis; ``expand`` yields them in a fixed
order (the product of the axes in the order written), so a sweep is deterministic.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator


from simulator.errors import UserError, read_yaml
from simulator.scenario import default_scenario_dict, load_scenario_dict, set_dotted

# Short axis names -> dotted scenario fields.
AXES: dict[str, str] = {
    "tp": "parallelism.tp",
    "pp": "parallelism.pp",
    "vpp": "parallelism.vpp",
    "cp": "parallelism.cp",
    "ep": "parallelism.ep",
    "etp": "parallelism.etp",
    "dp": "parallelism.dp",
    "zero": "parallelism.zero",
    "sequence_parallel": "parallelism.sequence_parallel",
    "async_tp": "parallelism.async_tp",
    "tp_comm_overlap": "parallelism.tp_comm_overlap",
    "overlap_param_gather": "parallelism.overlap_param_gather",
    "grad_reduce_in_fp32": "parallelism.grad_reduce_in_fp32",
    "mesh_order": "parallelism.mesh_order",
    "micro_batch_size": "batch.micro_batch_size",
    "mbs": "batch.micro_batch_size",
    "global_batch_size": "batch.global_batch_size",
    "gbs": "batch.global_batch_size",
    "seq_length": "batch.seq_length",
    "schedule": "schedule",
    "recompute": "recompute",
    "gpus": "cluster.gpus",
    "gpu": "cluster.gpu",
    "topology": "cluster.topology",
    "model": "model",
    "dtype": "dtype",
    "flash_attention": "flash_attention",
    "network": "network",
}
# Short names used in tables and the dashboard, by dotted field.
SHORT = {v: k for k, v in reversed(list(AXES.items()))}
# Top-level keys of a space file that fix one field for every point.
FIXED_SHORTCUTS = ("model", "gpus", "gpu", "topology", "seq_length", "global_batch_size", "micro_batch_size", "network")

OBJECTIVES: dict[str, bool] = {  # name -> larger is better
    "tokens_per_s": True,
    "tokens_per_s_per_gpu": True,
    "mfu": True,
    "step_time_s": False,
}
# At most this many points per sweep (the product of the axes' lengths): every point is built and
# estimated in the driver (~1,000-10,000 points/s), so 10 million is hours of estimating; real
# layout searches are thousands. A typo (an axis of 10,000 values twice) is refused before any work.
MAX_SPACE_POINTS = 10_000_000
SPACE_KEYS = ("name", "base", "scenario", "space", "objective", "constraints", "top_k", "mode") + FIXED_SHORTCUTS
CONSTRAINT_KEYS = ("memory_headroom", "max_gpus", "min_gpus")


@dataclass
class Constraints:
    memory_headroom: float = 0.0  # fraction of usable memory that must stay free
    max_gpus: int | None = None
    min_gpus: int | None = None


@dataclass
class SweepSpec:
    name: str
    base: dict[str, Any]
    axes: dict[str, list[Any]]  # dotted field -> values, in the order written
    objective: str = "tokens_per_s"
    constraints: Constraints = field(default_factory=Constraints)
    top_k: int = 20
    mode: str = "reduced"

    @property
    def size(self) -> int:
        return math.prod(len(v) for v in self.axes.values()) if self.axes else 1

    @property
    def maximize(self) -> bool:
        return OBJECTIVES[self.objective]

    def axis_names(self) -> list[str]:
        return [SHORT.get(k, k) for k in self.axes]


def expand(spec: SweepSpec) -> Iterator[dict[str, Any]]:
    """Each point as {dotted field: value}, in a fixed order."""
    keys = list(spec.axes)
    for values in itertools.product(*(spec.axes[k] for k in keys)):
        yield dict(zip(keys, values))


def _field(name: str, where: str) -> str:
    if name in AXES:
        return AXES[name]
    if "." in name:
        return name
    raise UserError(f"{where}: unknown axis {name!r}: use one of {', '.join(AXES)} or a dotted field like parallelism.zero")


def _values(name: str, raw: Any, where: str) -> list[Any]:
    vals = raw if isinstance(raw, list) else [raw]
    if not vals:
        raise UserError(f"{where}: axis {name!r} has no values: give at least one")
    for v in vals:
        if isinstance(v, (dict, list)):
            raise UserError(f"{where}: axis {name!r} value {v!r} must be a number, string or boolean: flatten it")
    if len(set(map(repr, vals))) != len(vals):
        raise UserError(f"{where}: axis {name!r} repeats a value in {vals!r}: list each value once")
    return vals


def _check_names(name: str, dotted: str, vals: list[Any], where: str) -> None:
    """Axes whose values are names (schedule, recompute, network, dtype, GPU profile, topology):
    an unknown one is a typo, refused here rather than pruned as a layout (every point with it
    would be, silently thinning the sweep)."""
    from typing import get_args

    from simulator.scenario import Scenario

    if dotted == "schedule":
        from simulator.schedules.registry import SCHEDULES

        choices = tuple(SCHEDULES)
    elif dotted in ("recompute", "network", "dtype"):
        choices = get_args(Scenario.model_fields[dotted].annotation)
    elif dotted in ("cluster.gpu", "cluster.topology"):
        from simulator.profile import load_profile
        from simulator.topology.spec import load_topology

        load = load_profile if dotted == "cluster.gpu" else load_topology
        for v in vals:
            try:
                load(str(v))
            except UserError as e:
                raise UserError(f"{where}: axis {name!r} value {v!r}: {e}") from None
        return
    else:
        return
    for v in vals:
        if v not in choices:
            raise UserError(f"{where}: axis {name!r} value {v!r} is unknown: use one of {', '.join(map(str, choices))}")


def _check_constraints(raw: Any, where: str) -> Constraints:
    if raw is None:
        return Constraints()
    if not isinstance(raw, dict):
        raise UserError(f"{where}: constraints must be a mapping like {{memory_headroom: 0.1, max_gpus: 1024}}")
    for k in raw:
        if k not in CONSTRAINT_KEYS:
            raise UserError(f"{where}: unknown constraint {k!r}: use {', '.join(CONSTRAINT_KEYS)}")
    c = Constraints(**{str(k): v for k, v in raw.items()})
    if isinstance(c.memory_headroom, bool) or not isinstance(c.memory_headroom, (int, float)) or not 0 <= c.memory_headroom < 1:
        raise UserError(f"{where}: memory_headroom={c.memory_headroom!r} must be a fraction in [0, 1), e.g. 0.1")
    for k in ("max_gpus", "min_gpus"):
        v = getattr(c, k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise UserError(f"{where}: {k}={v!r} must be a positive integer")
    return c


def make_spec(
    base: dict[str, Any],
    axes: dict[str, Any],
    *,
    name: str = "sweep",
    objective: str = "tokens_per_s",
    constraints: Constraints | dict | None = None,
    top_k: int = 20,
    mode: str = "reduced",
    where: str = "sweep",
) -> SweepSpec:
    """Validate the pieces of a sweep (from a file or from flags)."""
    if not isinstance(objective, str) or objective not in OBJECTIVES:
        raise UserError(f"{where}: objective {objective!r} is unknown: use one of {', '.join(OBJECTIVES)}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise UserError(f"{where}: top_k={top_k!r} must be a positive integer")
    if not isinstance(mode, str) or mode not in ("reduced", "full"):
        raise UserError(f"{where}: mode={mode!r} must be reduced or full")
    if isinstance(name, (dict, list, tuple, set)) or name is None:
        raise UserError(f"{where}: name {name!r} must be a string like llama3-8b-64")
    if not isinstance(axes, dict):
        raise UserError(f"{where}: space must be a mapping of axis -> list of values, e.g. {{tp: [2, 4, 8]}}")
    out: dict[str, list[Any]] = {}
    for k, v in axes.items():
        dotted = _field(str(k), where)
        if dotted in out:
            raise UserError(f"{where}: axis {k!r} is given twice (as {SHORT.get(dotted, dotted)!r}): keep one")
        out[dotted] = _values(str(k), v, where)
        _check_names(str(k), dotted, out[dotted], where)
    points = math.prod(len(v) for v in out.values()) if out else 1
    if points > MAX_SPACE_POINTS:
        sizes = " x ".join(f"{SHORT.get(k, k)} {len(v):,}" for k, v in out.items())
        raise UserError(f"{where}: the space has {points:,} points ({sizes}), at most {MAX_SPACE_POINTS:,} points: "
                        "remove values or axes, or split it into several sweeps")
    if isinstance(constraints, Constraints):
        cons = constraints
    else:
        cons = _check_constraints(constraints, where)
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in str(name)) or "sweep"
    return SweepSpec(safe, base, out, objective, cons, top_k, mode)


def load_space(path: str | Path) -> SweepSpec:
    """Read a space file; every problem is a one-line UserError naming the key and the fix."""
    path = Path(path)
    where = f"space file {str(path)!r}"
    data = read_yaml(path, "space file")
    if not isinstance(data, dict):
        raise UserError(f"{where} must hold a mapping with a 'space' section (axis -> list of values)")
    from simulator.errors import document_kind

    kind = document_kind(data)
    if kind is not None and "space" not in data:
        # (a scenario given to sweep was "unknown key 'parallelism'")
        raise UserError(f"{where} is {kind}, not a sweep space file: give a space file (a 'space' section of axes, "
                        "as tests/data/sweep/small.yaml), or put this scenario under its 'base'")
    for k in data:
        if k not in SPACE_KEYS:
            raise UserError(f"{where}: unknown key {k!r}: use {', '.join(SPACE_KEYS)}")
    if "base" in data and "scenario" in data:
        raise UserError(f"{where}: give either 'base' (a scenario file) or 'scenario' (inline), not both")
    if "base" in data:
        if not isinstance(data["base"], str):
            raise UserError(f"{where}: base must be a path to a scenario YAML")
        bpath = Path(data["base"])
        if not bpath.is_absolute():
            bpath = path.parent / bpath
        base = load_scenario_dict(bpath)
    elif "scenario" in data:
        if not isinstance(data["scenario"], dict):
            raise UserError(f"{where}: scenario must be a mapping (model, parallelism, batch, cluster)")
        base = data["scenario"]
    else:
        base = default_scenario_dict()
    base = apply_fixed(base, {k: data[k] for k in FIXED_SHORTCUTS if k in data})
    if "space" not in data:
        raise UserError(f"{where}: no 'space' section: add e.g. space: {{tp: [2, 4, 8], pp: [1, 2, 4]}}")
    return make_spec(
        base, data["space"] or {}, name=data.get("name") or path.stem, objective=data.get("objective", "tokens_per_s"),
        constraints=data.get("constraints"), top_k=data.get("top_k", 20), mode=data.get("mode", "reduced"), where=where,
    )


def apply_fixed(base: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    """The base scenario with shortcut fields (model, gpus, ...) set."""
    import copy

    base = copy.deepcopy(base)
    for k, v in fixed.items():
        if v is not None:
            set_dotted(base, AXES[k], v)
    return base


def parse_list(option: str, raw: str | None, kind: type = int) -> list[Any] | None:
    """A comma-separated flag value (``--tp 4,8``) as a list."""
    if raw is None:
        return None
    items = [x.strip() for x in str(raw).split(",") if x.strip()]
    if not items:
        raise UserError(f"--{option} {raw!r} lists no values: write e.g. --{option} 2,4,8")
    out = []
    for x in items:
        if kind is int:
            try:
                out.append(int(x))
            except ValueError:
                raise UserError(f"--{option} value {x!r} is not an integer: write e.g. --{option} 2,4,8") from None
        elif kind is bool:
            low = x.lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise UserError(f"--{option} value {x!r} is not a boolean: use true or false")
            out.append(low in ("true", "1", "yes"))
        else:
            out.append(x)
    return out
