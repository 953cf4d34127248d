"""The sweep store keys results by content: an edited topology, profile or schedule file, or another
clustersim version, can never return an old row; the summary says what was reused and why not."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import yaml

from simulator.calibrate.profile import Profile, available_profiles, load_profile
from simulator.data import data_dir
from simulator.scenario import build_scenario
from simulator.simulate import simulate
from simulator.sweep.runner import run_sweep
from simulator.sweep.space import make_spec
from simulator.sweep.store import REUSE_BASIS, ResultKeyer, changed_inputs, input_file
from simulator.topology.spec import TopologySpec, available_topologies, load_topology
from simulator.version import package_version

SHIPPED_TOPOLOGY = data_dir("topologies") / "dgx-h100-fattree.yaml"
SCHEDULES = Path(__file__).parent / "data" / "schedules"


def _spec(topology: str, name: str = "content"):
    # llama3-8b on 32 H100 (4 nodes): dp crosses nodes at every point, so the NIC bandwidth matters.
    base = {
        "model": "llama3-8b",
        "batch": {"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 1024},
        "network": "alpha-beta",
        "cluster": {"gpus": 32, "gpu": "h100-sxm-80gb", "topology": topology},
    }
    return make_spec(base, {"tp": [2, 4], "pp": [2]}, name=name, top_k=10)


def _sweep(topology: Path, store: Path):
    return run_sweep(_spec(str(topology)), store=store, executor="local", workers=1, exhaustive=True, show_progress=False)


def _steps(out) -> dict[str, float]:
    return {json.dumps(r["point"], sort_keys=True): r["report"]["step_time_s"] for r in out.simulated}


def test_edited_topology_gets_a_fresh_simulation(tmp_path):
    topo = tmp_path / "my-fabric.yaml"
    topo.write_bytes(SHIPPED_TOPOLOGY.read_bytes())
    store = tmp_path / "store.sqlite"

    first = _sweep(topo, store)
    n = len(first.simulated)
    assert n == 2 and first.newly_simulated == n and first.reused == 0

    # Unchanged inputs: every row comes from the store, with the same numbers.
    again = _sweep(topo, store)
    assert again.newly_simulated == 0 and again.reused == n
    assert _steps(again) == _steps(first)
    assert again.reuse["reused"] == n and again.reuse["of"] == n and again.reuse["stale_points"] == 0
    assert again.reuse["basis"] == f"{REUSE_BASIS}, clustersim {package_version()}"

    # The edit: NIC 400 -> 25 Gb/s in the same file, same path.
    data = yaml.safe_load(topo.read_text())
    assert data["node"]["nic_gbps"] == 400
    data["node"]["nic_gbps"] = 25
    topo.write_text(yaml.safe_dump(data))
    slow = _sweep(topo, store)
    assert slow.newly_simulated == n and slow.reused == 0
    assert slow.reuse["stale_points"] == n and slow.reuse["stale_reasons"] == {"topology content": n}
    before, after = _steps(first), _steps(slow)
    assert before.keys() == after.keys()
    # 16x less scale-out bandwidth: the cross-node dp gradient all-reduce slows every point.
    assert all(after[p] > before[p] * 1.05 for p in before), (before, after)
    # The sweep's row is what a direct simulation of the edited file gives.
    best = slow.simulated[0]
    direct = simulate(build_scenario(best["scenario"]), mode="reduced").report
    assert direct.step_time_s == pytest.approx(best["report"]["step_time_s"], rel=1e-12)

    # Both versions are kept; putting the old content back reuses the old rows (content, not mtime).
    with sqlite3.connect(str(store)) as db:
        assert db.execute("SELECT COUNT(*) FROM results").fetchone()[0] == 2 * n
    topo.write_bytes(SHIPPED_TOPOLOGY.read_bytes())
    back = _sweep(topo, store)
    assert back.newly_simulated == 0 and back.reused == n and _steps(back) == before


def test_summary_says_what_was_reused_and_why_not(tmp_path):
    from typer.testing import CliRunner

    from simulator.sweep.cli import sweep_app

    topo = tmp_path / "fabric.yaml"
    topo.write_bytes(SHIPPED_TOPOLOGY.read_bytes())
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({
        "name": "why",
        "scenario": {"model": "llama3-8b", "batch": {"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 1024},
                     "network": "alpha-beta", "cluster": {"gpus": 32, "gpu": "h100-sxm-80gb", "topology": str(topo)}},
        "space": {"tp": [2, 4], "pp": [2]},
    }))
    args = [str(space), "--exhaustive", "--workers", "1", "--store", str(tmp_path / "s.sqlite"), "--no-dashboard",
            "--no-progress"]
    r = CliRunner().invoke(sweep_app, args + ["--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["reuse"]["reused"] == 0

    r = CliRunner().invoke(sweep_app, args)
    assert r.exit_code == 0, r.output
    assert (f"2 of 2 points reused from the store (same scenario, profile, topology and schedule content, "
            f"clustersim {package_version()})") in r.stdout

    topo.write_text(topo.read_text().replace("nic_gbps: 400", "nic_gbps: 200"))
    r = CliRunner().invoke(sweep_app, args)
    assert r.exit_code == 0, r.output
    assert ("0 of 2 points reused from the store (same scenario, profile, topology and schedule content, clustersim "
            f"{package_version()}); 2 simulated again because their stored rows came from other inputs "
            "(topology content changed for 2)") in " ".join(r.stdout.split())

    topo.write_text(topo.read_text().replace("nic_gbps: 200", "nic_gbps: 100"))
    r = CliRunner().invoke(sweep_app, args + ["--json"])
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["newly_simulated"] == 2 and obj["reused_from_store"] == 0
    assert obj["reuse"] == {"reused": 0, "of": 2, "basis": f"{REUSE_BASIS}, clustersim {package_version()}",
                            "clustersim": package_version(), "stale_points": 2, "stale_reasons": {"topology content": 2}}
    r = CliRunner().invoke(sweep_app, args)
    assert r.exit_code == 0, r.output
    assert "2 of 2 points reused" in r.stdout


# ---------------------------------------------------------------------------------------------
# The key itself
# ---------------------------------------------------------------------------------------------

def _scenario(**cluster) -> dict:
    sc = build_scenario({"model": "llama3-8b", "batch": {"global_batch_size": 32, "seq_length": 1024},
                         "cluster": {"gpus": 32, **cluster}})
    return sc.model_dump(mode="json")


def test_key_follows_file_contents_and_version_not_names(tmp_path, monkeypatch):
    keyer = ResultKeyer("reduced")
    shipped = keyer.key(_scenario())
    # The name is a label; the mode is not.
    renamed = dict(_scenario(), name="other")
    assert ResultKeyer("reduced").key(renamed).hash == shipped.hash
    assert ResultKeyer("full").key(_scenario()).hash != shipped.hash

    # A copy of the shipped profile by path: same content digest; edited: another key, same scenario_key.
    prof = tmp_path / "h100.json"
    prof.write_bytes(input_file("profile", "h100-sxm-80gb").read_bytes())
    copy = ResultKeyer("reduced").key(_scenario(gpu=str(prof)))
    assert copy.inputs["profile"] == shipped.inputs["profile"]
    data = json.loads(prof.read_text())
    data["hbm_gib"] = 40.0
    prof.write_text(json.dumps(data))
    edited = ResultKeyer("reduced").key(_scenario(gpu=str(prof)))
    assert edited.hash != copy.hash and edited.scenario_key == copy.scenario_key
    assert edited.inputs["profile"] != copy.inputs["profile"]

    # A schedule file: its content keys the row.
    csv = tmp_path / "s.csv"
    csv.write_bytes((SCHEDULES / "custom_interleaved_2ranks.csv").read_bytes())
    sc = dict(_scenario(), schedule_file=str(csv))
    k1 = ResultKeyer("reduced").key(sc)
    csv.write_text(csv.read_text() + "\n")
    k2 = ResultKeyer("reduced").key(sc)
    assert k1.inputs["schedule"] and k1.hash != k2.hash and k1.scenario_key == k2.scenario_key

    # Another clustersim version.
    monkeypatch.setattr("simulator.sweep.store.package_version", lambda: "99.0")
    newer = ResultKeyer("reduced").key(_scenario())
    assert newer.hash != shipped.hash and newer.inputs["clustersim"] == "99.0"
    assert changed_inputs(shipped.inputs, newer.inputs) == [f"clustersim version (stored with {package_version()})"]
    assert changed_inputs(copy.inputs, edited.inputs) == ["profile content"]


def test_key_resolves_shipped_names_to_the_files_the_loaders_read():
    for name in available_profiles():
        path = input_file("profile", name)
        assert path.is_file()
        assert Profile.model_validate(json.loads(path.read_text())) == load_profile(name)
    for name in available_topologies():
        path = input_file("topology", name)
        assert path.is_file()
        assert TopologySpec.model_validate(yaml.safe_load(path.read_text())) == load_topology(name)
    # Paths are taken as paths.
    assert input_file("profile", "/x/y.json") == Path("/x/y.json")
    assert input_file("topology", "/x/y.yaml") == Path("/x/y.yaml")
