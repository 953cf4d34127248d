"""`clustersim simulate` what-if flags -> the scenario's `perturbations:` section.

Flags add to what the scenario file already says (lists are appended, scalars override), with
the same names as the YAML fields: --slow-gpu RANK=SPEED (or node:N=SPEED) -> gpus,
--slow-link NAME=BANDWIDTH -> links, --fail-node N -> failures.nodes, --jitter CV -> jitter.cv.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError

from simulator.errors import UserError


def _pair(flag: str, item: str) -> tuple[str, float]:
    if "=" not in item:
        # (in the words of each flag's help: --slow-gpu RANK=SPEED, --slow-link LINK=BANDWIDTH)
        form = "RANK=SPEED (or node:N=SPEED)" if flag == "--slow-gpu" else "LINK=BANDWIDTH"
        raise UserError(f"{flag} {item!r} is not {form}: write e.g. {flag} {'3=0.8' if flag == '--slow-gpu' else 'uplink:0=0.5'}")
    name, raw = item.rsplit("=", 1)
    try:
        value = float(raw)
    except ValueError:
        raise UserError(f"{flag} {item!r}: {raw!r} is not a number; write a factor such as 0.8") from None
    if not math.isfinite(value):
        raise UserError(f"{flag} {item!r}: the factor must be a finite number such as 0.8")
    return name.strip(), value


def perturbations_from_flags(
    slow_gpu: list[str], slow_link: list[str], fail_node: list[int], failure_policy: str | None,
    mtbf_hours: float | None, checkpoint_interval_s: float | None, checkpoint_cost_s: float | None,
    restart_cost_s: float | None, jitter: float | None, jitter_target: str | None, seeds: int | None,
    seed: int | None, jitter_granularity: str | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gpus = []
    for item in slow_gpu:
        name, speed = _pair("--slow-gpu", item)
        if name.startswith("node:"):
            name = name[5:]
            key = "node"
        else:
            key = "rank"
        if not name.isdigit():
            raise UserError(f"--slow-gpu {item!r}: {name!r} is not a rank number; write RANK=SPEED or node:N=SPEED")
        if any(g.get(key) == int(name) for g in gpus):
            # Both would apply, one on top of the other: not what either flag says.
            raise UserError(f"--slow-gpu names {key} {name} twice: give one SPEED for it")
        gpus.append({key: int(name), "speed": speed})
    if gpus:
        out["gpus"] = gpus
    links = [dict(zip(("name", "bandwidth"), _pair("--slow-link", item))) for item in slow_link]
    seen = [l["name"] for l in links]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:
        raise UserError(f"--slow-link names {twice[0]} twice: give one BANDWIDTH for it")
    if links:
        out["links"] = links
    failures = {k: v for k, v in {
        "nodes": list(fail_node) or None, "policy": failure_policy, "mtbf_per_gpu_h": mtbf_hours,
        "checkpoint_interval_s": checkpoint_interval_s, "checkpoint_cost_s": checkpoint_cost_s,
        "restart_cost_s": restart_cost_s}.items() if v is not None}
    if failures:
        out["failures"] = failures
    jit = {k: v for k, v in {"cv": jitter, "target": jitter_target, "seeds": seeds, "seed": seed,
                             "granularity": jitter_granularity}.items() if v is not None}
    if jit:
        out["jitter"] = jit
    return out


def merge_perturbations(sc, flags: dict[str, Any]):
    """The scenario with the flags' perturbations added; one-line UserError when invalid."""
    if not flags:
        return sc
    from simulator.scenario import Scenario, validation_message

    data = sc.model_dump(mode="json")
    pert = data.get("perturbations") or {}
    for key in ("gpus", "links"):
        if key in flags:
            pert[key] = (pert.get(key) or []) + flags[key]
    for key in ("failures", "jitter"):
        if key in flags:
            sec = dict(pert.get(key) or {})
            add = dict(flags[key])
            if key == "failures" and "nodes" in add:
                add["nodes"] = list(sec.get("nodes") or []) + add["nodes"]
            sec.update(add)
            if key == "jitter" and "cv" not in sec:
                raise UserError("--seeds/--seed/--jitter-target need a jitter: add --jitter CV (e.g. --jitter 0.05)")
            pert[key] = sec
    data["perturbations"] = pert
    try:
        return Scenario.model_validate(data).check()
    except ValidationError as exc:
        msg = validation_message(exc, Scenario)
        loc = exc.errors()[0].get("loc", ()) if exc.errors() else ()
        # Name the flag the user typed (--slow-gpu 515=0), not the list entry it became
        # (perturbations.gpus.0.speed); entries the scenario file already had come first.
        if len(loc) >= 3 and loc[0] == "perturbations" and loc[1] in ("gpus", "links") and isinstance(loc[2], int):
            before = len((sc.model_dump(mode="json").get("perturbations") or {}).get(loc[1]) or [])
            i = loc[2] - before
            if 0 <= i < len(flags.get(loc[1], [])):
                entry = flags[loc[1]][i]
                typed = (f"--slow-gpu {'node:' if 'node' in entry else ''}{entry.get('node', entry.get('rank'))}={entry['speed']:g}"
                         if loc[1] == "gpus" else f"--slow-link {entry['name']}={entry['bandwidth']:g}")
                field = ".".join(str(x) for x in loc)
                raise UserError(f"{typed}: {msg.replace(field + ': ', '', 1)}") from None
        raise UserError(f"what-if flags: {msg}") from None
