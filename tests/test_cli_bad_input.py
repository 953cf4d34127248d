"""Bad input found by a CLI fuzzing pass (fuzz9): each case ends with one ``error:`` line, exit 2,
no traceback and no file written. CLI cases run `python -m simulator.cli` in a subprocess from a
temporary folder, so the exit status, stderr and the files left behind are those of `clustersim`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from cli_helpers import REPO, TINY_SCENARIO as TINY, assert_one_line_error, clustersim

DATA = REPO / "tests" / "data"


@pytest.fixture
def tiny(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


@pytest.mark.parametrize("flags", [["--fail-node", "-1"], ["--fail-node", "0", "--fail-node", "-3"]])
def test_negative_failed_node_is_refused(tmp_path, tiny, flags):
    # Was exit 0 with "failed node(s) -1" and a goodput for a node that does not exist.
    p = clustersim(["simulate", tiny, "--no-dashboard", "--report", tmp_path / "r.json", *flags], tmp_path)
    assert_one_line_error(p, r"perturbations\.failures\.nodes\.\d: got -\d: write a number at least 0$")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["tiny.yaml"]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("flag", ["--report", "--perfetto", "--dashboard"])
def test_simulate_output_over_the_scenario_is_refused(tmp_path, tiny, flag):
    # Was exit 0, the scenario YAML replaced by the report / trace / dashboard.
    before = _files(tmp_path)
    no_dash = [] if flag == "--dashboard" else ["--no-dashboard"]  # (the two together are refused as such)
    p = clustersim(["simulate", tiny.name, *no_dash, flag, f"./{tiny.name}"], tmp_path)
    assert_one_line_error(p, rf"^error: {flag} 'tiny\.yaml' would overwrite the scenario file this command reads: "
                             r"choose another path$")
    assert _files(tmp_path) == before


def test_simulate_output_over_a_file_the_scenario_names_is_refused(tmp_path, tiny):
    # The schedule CSV is named in the scenario, relative to it; the link reaches it under another name.
    (tmp_path / "s.csv").write_bytes((DATA / "schedules" / "custom_interleaved_2ranks.csv").read_bytes())
    data = yaml.safe_load(tiny.read_text())
    data["schedule_file"] = "s.csv"
    tiny.write_text(yaml.safe_dump(data))
    (tmp_path / "link.csv").symlink_to("s.csv")
    before = _files(tmp_path)
    p = clustersim(["simulate", tiny, "--no-dashboard", "--report", "link.csv"], tmp_path)
    assert_one_line_error(p, r"--report 'link\.csv' would overwrite the schedule file this command reads")
    assert _files(tmp_path) == before


def test_simulate_two_outputs_on_one_path_are_refused(tmp_path, tiny):
    # Was exit 0 with the Perfetto trace silently replaced by the report.
    p = clustersim(["simulate", tiny, "--no-dashboard", "--perfetto", "out.json", "--report", "./out.json"], tmp_path)
    assert_one_line_error(p, r"^error: --perfetto and --report both name 'out\.json': give each its own path$")
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("args, pattern", [
    (["w.yaml", "-o", "w.yaml"], r"--output 'w\.yaml' would overwrite the file A this command reads"),
    (["tiny.yaml", "w.yaml", "-o", "w.yaml"], r"--output 'w\.yaml' would overwrite the file B this command reads"),
    (["tiny.yaml", "w.yaml", "-o", "tiny.yaml/x.html"], r"goes through 'tiny\.yaml', which is a file, not a folder"),
])
def test_compare_output_checked_before_simulating(tmp_path, tiny, args, pattern):
    # Was exit 0 with A or B replaced by the dashboard; a bad --output was found only after simulating.
    (tmp_path / "w.yaml").write_bytes((DATA / "scenarios" / "whatif-small.yaml").read_bytes())
    before = _files(tmp_path)
    p = clustersim(["compare", *args], tmp_path)
    assert_one_line_error(p, pattern)
    assert _files(tmp_path) == before


@pytest.mark.parametrize("flags, pattern", [
    (["--dashboard", "space.yaml"], r"--dashboard 'space\.yaml' would overwrite the space file this command reads"),
    (["--store", "space.yaml", "--no-dashboard"], r"--store 'space\.yaml' would overwrite the space file"),
    (["--store", "d.html", "--dashboard", "d.html"], r"--store and --dashboard both name 'd\.html'"),
    (["--store", "d-best.html", "--dashboard", "d.html"], r"--store and the best point's dashboard both name 'd-best\.html'"),
])
def test_sweep_outputs_checked_against_inputs_and_each_other(tmp_path, flags, pattern):
    # Was exit 0 with the space file (or the results store) replaced by a dashboard.
    (tmp_path / "space.yaml").write_bytes((DATA / "sweep" / "tiny.yaml").read_bytes())
    before = _files(tmp_path)
    p = clustersim(["sweep", "space.yaml", "--estimate-only", "--no-progress", *flags], tmp_path)
    assert_one_line_error(p, pattern)
    assert _files(tmp_path) == before


@pytest.mark.parametrize("source, out, pattern", [
    ("bundle", "bundle/manifest.json", r"--out 'bundle/manifest\.json' would overwrite a file of the trace input 'bundle'"),
    ("k.json", "k.json", r"--out 'k\.json' would overwrite the trace input this command reads"),
])
def test_calibrate_force_never_replaces_an_input(tmp_path, source, out, pattern):
    # Was exit 0 with --force: the bundle's manifest (or the Kineto trace) replaced by the profile.
    import shutil

    shutil.copytree(REPO / "traces" / "cpu-gloo-train-dp2-tp2", tmp_path / "bundle")
    (tmp_path / "k.json").write_bytes((DATA / "trace" / "empty.json").read_bytes())
    before = _files(tmp_path)
    p = clustersim(["calibrate", source, "--out", out, "--force"], tmp_path)
    assert_one_line_error(p, pattern)
    assert _files(tmp_path) == before


@pytest.mark.parametrize("item, field, shown", [
    ("parallelism.tp=true", "parallelism.tp", "true"), ("model.num_layers=yes", "model.num_layers", "true"),
    ("parallelism.dp=off", "parallelism.dp", "false"), ("perturbations.failures.nodes=[true]", "perturbations.failures.nodes.0", "true"),
])
def test_a_boolean_is_not_a_count(tmp_path, tiny, item, field, shown):
    # Was exit 0: pydantic read true as 1, so tp: true simulated tp=1 (num_layers: yes, one layer) without a word.
    p = clustersim(["simulate", tiny, "--no-dashboard", "--report", tmp_path / "r.json", "--set", item], tmp_path)
    assert_one_line_error(p, rf"^error: scenario: {re.escape(field)}: got the boolean {shown} \(YAML reads yes/no/on/off "
                             r"as booleans\): write a whole number$")
    assert not (tmp_path / "r.json").exists()


def test_a_boolean_count_in_the_scenario_file_is_refused(tmp_path):
    from simulator.errors import UserError
    from simulator.scenario import build_scenario

    data = yaml.safe_load(yaml.safe_dump(TINY))
    data["cluster"]["gpus"] = True
    with pytest.raises(UserError, match=r"^scenario: cluster\.gpus: got the boolean true .*: write a whole number$"):
        build_scenario(data)
    data["cluster"]["gpus"] = 8
    assert build_scenario(data).cluster.gpus == 8


@pytest.mark.parametrize("args, ran", [
    (["all_reduce", "-g", "16", "--algorithm", "torus"], "ring"),  # a fat-tree is no torus
    (["all_gather", "-g", "16", "--algorithm", "tree"], "ring"),
    (["alltoall", "-g", "16", "--algorithm", "ring"], "pairwise"),
])
def test_collective_forced_algorithm_that_does_not_apply_is_refused(tmp_path, args, ran):
    # Was exit 0 with a table of another algorithm than the one forced.
    p = clustersim(["collective", *args, "-b", "1K", "-e", "4K"], tmp_path)
    algorithm = args[-1]
    assert_one_line_error(p, rf"^error: --algorithm {algorithm} does not apply to \w+ on {args[2]} GPUs of dgx-h100-fattree "
                             rf"\(it would run {ran}\): choose {ran}, or omit --algorithm$")


def test_collective_forced_algorithm_that_applies_runs(tmp_path):
    import json

    p = clustersim(["collective", "all_reduce", "-g", "16", "-b", "1K", "-e", "4K", "--algorithm", "tree", "--json"], tmp_path)
    assert p.returncode == 0, p.stderr
    # (NCCL's pick restricted to tree, as NCCL_ALGO=Tree: its protocol rides along)
    assert {r["algorithm"].split("/")[0] for r in json.loads(p.stdout)["rows"]} == {"tree"}
    # One node: NCCL runs its tree as a chain inside the node (the flow model had refused it).
    p = clustersim(["collective", "all_reduce", "-g", "8", "-b", "1K", "-e", "4K", "--algorithm", "tree", "--json"], tmp_path)
    assert p.returncode == 0 and {r["algorithm"].split("/")[0] for r in json.loads(p.stdout)["rows"]} == {"tree"}


@pytest.mark.parametrize("command", [["trace", "info", "bundle"], ["calibrate", "bundle", "--out", "p.json"]])
def test_unknown_collective_is_said_even_when_no_log_needs_it(tmp_path, command):
    # Was exit 0 (trace info) or a calibration run: --collective was only read for an unlabelled nccl-tests log.
    import shutil

    shutil.copytree(REPO / "traces" / "cpu-gloo-train-dp2-tp2", tmp_path / "bundle")
    p = clustersim([*command, "--collective", "allredcue"], tmp_path)
    assert_one_line_error(p, r"^error: unknown collective 'allredcue': use all_reduce, all_gather, ")
    assert not (tmp_path / "p.json").exists()


def test_validate_names_a_missing_bundle_before_asking_for_a_profile(tmp_path):
    # Was "validate 'nope' needs --profile": adding one only then said the path does not exist.
    p = clustersim(["validate", "nope"], tmp_path)
    assert_one_line_error(p, r"^error: bundle 'nope' does not exist: give a trace bundle folder written by 'clustersim capture'$")


@pytest.mark.parametrize("flags, pattern", [
    (["--max-gpus", "-1"], r"^error: --max-gpus -1 must be at least 1: it prunes points by their GPU count$"),
    (["--min-gpus", "0"], r"^error: --min-gpus 0 must be at least 1"),
    (["--min-gpus", "100", "--max-gpus", "10"], r"^error: min_gpus=100 is above max_gpus=10: every point would be pruned"),
])
def test_sweep_gpu_bounds_from_flags_are_checked_like_the_space_file(tmp_path, flags, pattern):
    # Was exit 0 with every point pruned ("gpus above max_gpus=-1"); the space file's constraints were already checked.
    (tmp_path / "space.yaml").write_bytes((DATA / "sweep" / "tiny.yaml").read_bytes())
    p = clustersim(["sweep", "space.yaml", "--estimate-only", "--no-progress", "--no-dashboard", *flags], tmp_path)
    assert_one_line_error(p, pattern)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["space.yaml"]


def test_a_profile_or_topology_path_of_the_wrong_kind_is_named_as_such(tmp_path, tiny):
    """A file or folder given where a profile JSON / topology YAML is expected is said to be one
    (it was reported as an unknown shipped name)."""
    (tmp_path / "fabric").mkdir()
    p = clustersim(["simulate", tiny, "--gpu", tiny, "--no-dashboard"], tmp_path)
    assert_one_line_error(p, r"GPU profile '.*tiny.yaml' is a file but not a profile JSON \(\.json\)")
    p = clustersim(["simulate", tiny, "--topology", "fabric", "--no-dashboard"], tmp_path)
    assert_one_line_error(p, r"topology 'fabric' is a folder, not a topology YAML")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["fabric", "tiny.yaml"]


def test_compare_output_never_replaces_a_file_a_scenario_names(tmp_path, tiny):
    """`compare -o` over the topology file that B's scenario reads: refused before simulating
    (it was checked against A and B themselves only)."""
    topo = REPO / "simulator" / "data" / "topologies" / "dgx-h100-fattree.yaml"
    (tmp_path / "topo.yaml").write_bytes(topo.read_bytes())
    b = {**TINY, "name": "b", "cluster": {**TINY["cluster"], "topology": "topo.yaml"}}
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(b))
    before = _files(tmp_path)
    p = clustersim(["compare", tiny, "b.yaml", "-o", "topo.yaml"], tmp_path)
    assert_one_line_error(p, r"--output 'topo\.yaml' would overwrite the topology file of B this command reads")
    assert _files(tmp_path) == before


def test_dashboard_path_naming_a_folder_or_a_foreign_file_is_refused(tmp_path, tiny):
    # Were exit 0: 'newdir/' (not there yet) became a 2 MB HTML *file* named newdir, and an
    # existing notes.txt was replaced by the dashboard without a word.
    (tmp_path / "notes.txt").write_text("keep me\n")
    before = _files(tmp_path)
    p = clustersim(["simulate", tiny, "--dashboard", "newdir/"], tmp_path)
    assert_one_line_error(p, r"--dashboard path 'newdir/' names a folder: name a file inside it, e\.g\. 'newdir/out\.html'")
    p = clustersim(["simulate", tiny, "--dashboard", "notes.txt"], tmp_path)
    assert_one_line_error(p, r"--dashboard path 'notes\.txt' is an existing file that is not \.html or \.htm")
    assert _files(tmp_path) == before
    # an earlier dashboard is replaced, as a re-run expects
    (tmp_path / "d.html").write_text("<html>old</html>")
    p = clustersim(["simulate", tiny, "--dashboard", "d.html", "--findings-budget-s", "0"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "d.html").read_text().startswith("<!DOCTYPE html>") or "plotly" in (tmp_path / "d.html").read_text()


def test_setting_class_curves_a_kernel_profile_ignores_is_refused(tmp_path, tiny):
    # Was exit 0: the README's --set ...classes.gemm.peak_efficiency=0.3 printed the override in the
    # header and simulated the default step (shipped profiles time kernels by shape).
    p = clustersim(["simulate", tiny, "--no-dashboard", "--report", tmp_path / "r.json",
                    "--set", "cluster.gpu.compute.classes.gemm.peak_efficiency=0.3"], tmp_path)
    assert_one_line_error(p, r"^error: --set cluster\.gpu\.compute\.classes\.gemm\.peak_efficiency: profile "
                             r"'h100-sxm-80gb' times kernels by shape \(compute\.kernels\) and does not read its class "
                             r"curves: set cluster\.gpu\.compute\.kernels\.gemm_efficiency\.bf16 instead$")
    assert not (tmp_path / "r.json").exists()
    # the key it names does change the step
    base = clustersim(["simulate", tiny, "--no-dashboard", "--json", "--findings-budget-s", "0"], tmp_path)
    slow = clustersim(["simulate", tiny, "--no-dashboard", "--json", "--findings-budget-s", "0",
                       "--set", "cluster.gpu.compute.kernels.gemm_efficiency.bf16=0.3"], tmp_path)
    import json
    assert json.loads(slow.stdout)["step_time_s"] > 1.1 * json.loads(base.stdout)["step_time_s"]


def test_capture_without_torch_says_how_to_install_it(tmp_path):
    # Was a 40-line traceback ending in ModuleNotFoundError when torch (the [capture] extra) was missing.
    import os
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; sys.argv = ['clustersim'] + sys.argv[1:]; "
            "from simulator.cli import main; main()")
    p = subprocess.run([sys.executable, "-c", code, "capture", "train", "--out", "traces/mine", "--nproc", "4",
                        "--tp", "2", "--pp", "2", "--schedule", "1f1b"], cwd=tmp_path, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert_one_line_error(p, r'^error: capture runs real PyTorch, which is not installed here: '
                             r'pip install -e "\.\[capture\]" \(or pip install torch\)$')
    assert not (tmp_path / "traces").exists()


@pytest.mark.parametrize("flags, pattern", [
    (["--no-dashboard", "--dashboard", "x.html"], r"^error: --dashboard x\.html and --no-dashboard ask for opposite things: give one$"),
    (["--mode", "full", "--steady-fast-path"], r"^error: --steady-fast-path replays reduced mode's steady period, not "
                                               r"--mode full: drop one of them$"),
])
def test_flags_that_cancel_each_other_are_refused(tmp_path, tiny, flags, pattern):
    # Were exit 0: no x.html written; fast_forward null without a word.
    p = clustersim(["simulate", tiny, *flags], tmp_path)
    assert_one_line_error(p, pattern)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["tiny.yaml"]


def test_warnings_are_one_line_each_once(tmp_path):
    """A profile fitted on small CPU ops extrapolates to a real model's: each class's warning is
    one line, printed once (Python's default echoed the source line, once per re-simulation)."""
    p = clustersim(["simulate", REPO / "tests" / "data" / "scenarios" / "small-llama.yaml", "--json", "--gpu",
                    "cpu-gloo-host", "--network", "alpha-beta", "--findings-budget-s", "3"], tmp_path)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.strip().splitlines()
    warned = [l for l in lines if l.startswith("warning: profile 'cpu-gloo-host'")]
    assert warned and len(warned) == len(set(warned))
    assert all(l.startswith("warning: ") for l in lines), lines
    assert "Warning:" not in p.stderr and "out[" not in p.stderr


# --- A file of the wrong kind, or given twice (round 19: left alone by round 18's fuzz pass) ---

PROFILES = REPO / "simulator" / "data" / "profiles"
TOPOLOGIES = REPO / "simulator" / "data" / "topologies"
NDV4_LOG = DATA / "reference" / "nccl-tests" / "azure-ndv4-a100-40gb-16gpu_all_reduce_perf.txt"


def _report(tmp_path: Path, tiny: Path) -> Path:
    out = tmp_path / "rep.json"
    p = clustersim(["simulate", tiny, "--no-dashboard", "--report", out], tmp_path)
    assert p.returncode == 0, p.stderr
    return out


def test_a_report_given_as_a_profile_is_named_as_a_report(tmp_path, tiny):
    # Was "unknown key 'step_time_s': remove it or check its spelling", as if one key were wrong.
    report = _report(tmp_path, tiny)
    before = _files(tmp_path)
    p = clustersim(["calibrate", NDV4_LOG, "--out", "p.json", "--base", report.name], tmp_path)
    assert_one_line_error(p, r"^error: GPU profile 'rep\.json' is a simulate report \(clustersim simulate "
                             r"--report/--json\), not a GPU profile \(clustersim calibrate --out\): give a profile JSON")
    assert _files(tmp_path) == before


@pytest.mark.parametrize("args, pattern", [
    (["simulate", "--topology", PROFILES / "h100-sxm-80gb.json"],
     r"topology file '.*h100-sxm-80gb\.json' is a GPU profile .*, not a topology: give a topology YAML"),
    (["simulate", TOPOLOGIES / "p5-efa.yaml"],
     r"scenario file '.*p5-efa\.yaml' is a topology, not a scenario: give a scenario YAML"),
    (["compare", PROFILES / "h100-sxm-80gb.json"],
     r"A = '.*h100-sxm-80gb\.json' is a GPU profile .*, not a simulate report .*: write one with --report"),
])
def test_a_file_of_another_kind_is_named_by_its_kind(tmp_path, args, pattern):
    p = clustersim([*args, "--no-dashboard"] if args[0] == "simulate" else args, tmp_path)
    assert_one_line_error(p, pattern)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text, holds", [("- a\n- b\n", "holds a list, not a mapping of fields"), ("", "is empty")])
def test_a_topology_that_is_not_a_mapping_is_one_line(tmp_path, text, holds):
    # A list was pydantic's "Input should be a valid dictionary or instance of TopologySpec".
    (tmp_path / "topo.yaml").write_text(text)
    p = clustersim(["simulate", "--topology", "topo.yaml", "--no-dashboard"], tmp_path)
    assert_one_line_error(p, rf"^error: topology file 'topo\.yaml' {holds}: give a topology YAML \(node:, fabric:\)")


@pytest.mark.parametrize("second", ["same", "copy", "inside", "gzipped", "respaced"])
def test_calibrate_refuses_an_input_given_twice(tmp_path, second):
    # Was a fit over the log's rows twice, weighted towards them, without a word.
    (tmp_path / "logs").mkdir()
    log = tmp_path / "logs" / "a.txt"
    log.write_bytes(NDV4_LOG.read_bytes())
    if second == "same":
        inputs, pattern = ["logs/a.txt", "logs/../logs/a.txt"], r"input 'logs/\.\./logs/a\.txt' is given twice \(also as 'logs/a\.txt'\)"
    elif second == "copy":
        (tmp_path / "b.txt").write_bytes(NDV4_LOG.read_bytes())
        inputs, pattern = ["logs/a.txt", "b.txt"], r"input 'b\.txt' holds the same content as 'logs/a\.txt'"
    elif second == "respaced":
        # the same rows with other spacing: no byte check sees it, the parsed measurements do
        (tmp_path / "b_all_reduce_perf.txt").write_text(
            "\n".join("  ".join(line.split()) for line in NDV4_LOG.read_text().splitlines()) + "\n")
        inputs = ["logs/a.txt", "b_all_reduce_perf.txt", "--collective", "all_reduce",
                  "--base", "a100-sxm-40gb", "--topology", "azure-ndv4"]
        pattern = r"nccl-tests logs a\.txt and b_all_reduce_perf\.txt hold the same measurements"
    elif second == "gzipped":
        import gzip

        (tmp_path / "b.txt.gz").write_bytes(gzip.compress(NDV4_LOG.read_bytes()))
        inputs, pattern = ["logs/a.txt", "b.txt.gz"], r"input 'b\.txt\.gz' holds the same content as 'logs/a\.txt'"
    else:
        inputs, pattern = ["logs", "logs/a.txt"], r"input 'logs/a\.txt' is inside the folder 'logs', also given"
    before = _files(tmp_path)
    p = clustersim(["calibrate", *inputs, "--out", "p.json"], tmp_path)
    assert_one_line_error(p, pattern)
    assert _files(tmp_path) == before


@pytest.mark.parametrize("args, flag, example", [
    (["simulate", "tiny.yaml", "--no-dashboard", "--report", "out/"], "--report", "out/out.json"),
    (["simulate", "tiny.yaml", "--no-dashboard", "--perfetto", "out/"], "--perfetto", "out/out.json"),
    (["compare", "tiny.yaml", "tiny.yaml", "-o", "out/"], "--output", "out/out.html"),
    (["sweep", DATA / "sweep" / "tiny.yaml", "--store", "out/"], "--store", "out/out.sqlite"),
])
def test_an_output_path_ending_in_a_slash_names_a_folder(tmp_path, tiny, args, flag, example):
    # Were exit 0 with a *file* named out (typer's Path drops the slash before we see it).
    before = _files(tmp_path)
    p = clustersim(args, tmp_path)
    assert_one_line_error(p, rf"^error: {flag} path 'out/' names a folder: name a file inside it, e\.g\. '{example}'$")
    assert _files(tmp_path) == before


@pytest.mark.parametrize("flags,match", [
    (["--nic-gbps", "-1"], r"--nic-gbps -1: give a positive number$"),
    (["--nvlink-GBps", "0"], r"--nvlink-GBps 0: give a positive number$"),
    (["--leaf-oversubscription", "0.5"], r"--leaf-oversubscription 0.5: give at least 1 \(1 = non-blocking\)$"),
    (["--slow-gpu", "3=0"], r"--slow-gpu 3=0: got 0\.0: write a number at least 0\.01$"),
    (["--slow-link", "uplink:0=0"], r"--slow-link uplink:0=0: got 0\.0: write a number at least 0\.01$"),
])
def test_bad_flag_values_are_named_as_typed(tmp_path, tiny, flags, match):
    # Were named by the field they set: "scenario: cluster.topology: node.nic_gbps: Input should
    # be greater than 0", "what-if flags: perturbations.gpus.0.speed: ...".
    p = clustersim(["simulate", tiny, "--no-dashboard", *flags], tmp_path)
    assert_one_line_error(p, match)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["tiny.yaml"]


def test_a_report_named_as_yaml_is_refused_before_simulating(tmp_path, tiny):
    # Was written (JSON under a .yaml name), then `compare r.yaml ...` read it as a scenario and
    # said it was a report, not a scenario.
    before = _files(tmp_path)
    p = clustersim(["simulate", tiny, "--no-dashboard", "--report", "r.yaml"], tmp_path)
    assert_one_line_error(p, r"^error: --report 'r\.yaml' writes a JSON report: name it \.json \(or \.json\.gz\), e\.g\. r\.json$")
    assert _files(tmp_path) == before


@pytest.mark.parametrize("args,pattern", [
    (["simulate", "{sweep}", "--no-dashboard"], r"is a sweep space file \(clustersim sweep\), not a scenario"),
    (["sweep", "{scenario}", "--no-dashboard"], r"is a scenario, not a sweep space file: give a space file"),
    (["validate", "{scenario}"], r"is YAML \(a scenario\?\), not a measurement"),
    (["trace", "info", "{scenario}"], r"is YAML \(a scenario\?\), not a trace"),
    (["simulate", "--slow-gpu", "515:0.8", "--no-dashboard"], r"--slow-gpu '515:0\.8' is not RANK=SPEED"),
])
def test_a_file_of_another_kind_is_named_as_such(tmp_path, args, pattern):
    # Were "unknown key 'scenario'", "unknown key 'parallelism'", "needs --profile" and "is not a
    # JSON object or array (starts with 'n')"; --slow-gpu's form is RANK=SPEED in its help.
    files = {"sweep": str(DATA / "sweep" / "small.yaml"), "scenario": str(DATA / "scenarios" / "small-llama.yaml")}
    p = clustersim([a.format(**files) for a in args], tmp_path)
    assert_one_line_error(p, pattern)
