"""Property-based fuzzing of every input a user hands the CLI (issue 16).

Each case runs the real command in-process and must end the way ``simulator.cli.main`` ends a run:
exit 0, or exit 2 with one line on stderr; never a traceback, never a hang. Hypothesis draws the
cases deterministically (``derandomize``) so CI sees the same inputs every run, and the example
counts keep the whole file within about a minute on two cores.
"""

from __future__ import annotations

import copy
import os
from collections import Counter
import gzip
import json
import math
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from simulator.cli import app
from simulator.errors import UserError

from cli_helpers import TINY_SCENARIO

DATA = Path(__file__).parent / "data"
REF = DATA / "reference"

# A scenario that simulates in well under a second (its own copy: cases mutate theirs).
TINY = copy.deepcopy({**TINY_SCENARIO, "name": "fuzz"})

CASE_LIMIT_S = 60
# CI runs a bounded number of cases per target; CLUSTERSIM_FUZZ_EXAMPLES raises it for a longer hunt,
# and then the outcome counts per command are printed at the end (pytest -s).
EXAMPLES = int(os.environ.get("CLUSTERSIM_FUZZ_EXAMPLES", "25"))
OUTCOMES: Counter = Counter()
# No shrinking: a failure prints its (unshrunk) example at once instead of searching for minutes.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@contextmanager
def time_limit(seconds: int):
    def expire(signum, frame):
        raise TimeoutError(f"case ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_cli(args: list[str]) -> tuple[int, str]:
    """The command's exit status and stderr, as ``simulator.cli.main`` would end it."""
    runner = CliRunner()
    with time_limit(CASE_LIMIT_S):
        result = runner.invoke(app, [str(a) for a in args], catch_exceptions=True)
    exc = result.exception
    command = " ".join(str(a) for a in args[:2] if not str(a).startswith("/"))
    if isinstance(exc, UserError):
        OUTCOMES[(command, "exit 2")] += 1
        return 2, f"error: {exc}"
    if exc is not None and not isinstance(exc, SystemExit):
        OUTCOMES[(command, "traceback")] += 1
        raise AssertionError(f"clustersim {' '.join(map(str, args))} raised {type(exc).__name__}: {exc}") from exc
    OUTCOMES[(command, f"exit {result.exit_code}")] += 1
    return result.exit_code, result.stderr if hasattr(result, "stderr") else ""


@pytest.fixture(scope="module", autouse=True)
def _print_outcomes():
    yield
    if "CLUSTERSIM_FUZZ_EXAMPLES" in os.environ:
        for (command, outcome), n in sorted(OUTCOMES.items()):
            print(f"fuzz outcome: {command:24s} {outcome:10s} {n}")


def assert_clean_exit(args: list[str]) -> None:
    code, err = run_cli(args)
    assert code in (0, 2), f"clustersim {' '.join(map(str, args))} exited {code}: {err[-500:]}"
    if code == 2:
        lines = [line for line in err.strip().splitlines() if line.strip()]
        assert "Traceback" not in err, err


# Values no field should crash on: wrong types, huge, negative, non-finite, empty.
odd_values = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 2**31, 2**63, 10**9]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["", "768", "true", "false", "null", "[/bold]x", "\x1b]0;x\x07", "../../x", "a" * 300]),
    st.none(),
    st.booleans(),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=2),
)


def dotted_paths(node, prefix=""):
    for key, value in node.items():
        path = f"{prefix}{key}"
        yield path
        if isinstance(value, dict):
            yield from dotted_paths(value, path + ".")


TINY_PATHS = sorted(dotted_paths(TINY))


def set_path(data, dotted, value):
    node = data
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict):  # an earlier mutation may have replaced a section by a value
        node[leaf] = value


def to_yaml(data) -> str:
    # Non-finite floats and odd strings pass through YAML as a user could write them.
    return yaml.safe_dump(data, allow_unicode=True)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_fuzz_base_scenario_runs(workdir):
    """The unmutated scenario must simulate, or every mutation would fail for the same dull reason."""
    path = workdir / "s.yaml"
    path.write_text(to_yaml(TINY))
    code, err = run_cli(["simulate", path, "--json", "--no-dashboard"])
    assert code == 0, err


@FUZZ
@given(mutations=st.lists(st.tuples(st.sampled_from(TINY_PATHS), odd_values), min_size=1, max_size=3))
def test_fuzz_scenario_files(workdir, mutations):
    data = copy.deepcopy(TINY)
    for dotted, value in mutations:
        set_path(data, dotted, value)
    path = workdir / "s.yaml"
    path.write_text(to_yaml(data))
    assert_clean_exit(["simulate", path, "--json", "--no-dashboard"])


set_keys = st.one_of(st.sampled_from(TINY_PATHS), st.text(min_size=0, max_size=20),
                     st.sampled_from(["model.num_layers.x", "cluster.topology.node.nic_gbps", ".", "a..b", "name."]))
set_values = st.one_of(st.text(max_size=12), st.sampled_from(["", "nan", "inf", "-1", "1e30", "[1, 2", "{a: 1}", "null"]))


@FUZZ
@given(pairs=st.lists(st.tuples(set_keys, set_values), min_size=1, max_size=3))
def test_fuzz_set_overrides(workdir, pairs):
    path = workdir / "s.yaml"
    path.write_text(to_yaml(TINY))
    args = ["simulate", path, "--json", "--no-dashboard"]
    for key, value in pairs:
        args += ["--set", f"{key}={value}"]
    assert_clean_exit(args)


TOPOLOGY = yaml.safe_load((Path(__file__).parents[1] / "simulator" / "data" / "topologies" / "dgx-h100-fattree.yaml").read_text())
TOPOLOGY_PATHS = sorted(dotted_paths(TOPOLOGY))


@FUZZ
@given(mutations=st.lists(st.tuples(st.sampled_from(TOPOLOGY_PATHS), odd_values), min_size=1, max_size=2))
def test_fuzz_topology_files(workdir, mutations):
    data = copy.deepcopy(TOPOLOGY)
    for dotted, value in mutations:
        set_path(data, dotted, value)
    path = workdir / "t.yaml"
    path.write_text(to_yaml(data))
    assert_clean_exit(["collective", "all_reduce", "--gpus", "16", "--topology", path, "-b", "1024", "-e", "1048576"])


PROFILE = json.loads((Path(__file__).parents[1] / "simulator" / "data" / "profiles" / "h100-sxm-80gb.json").read_text())
PROFILE_PATHS = sorted(p for p in dotted_paths(PROFILE) if not p.startswith("provenance.items"))


@FUZZ
@given(mutations=st.lists(st.tuples(st.sampled_from(PROFILE_PATHS), odd_values), min_size=1, max_size=2))
def test_fuzz_profile_files(workdir, mutations):
    data = copy.deepcopy(PROFILE)
    for dotted, value in mutations:
        set_path(data, dotted, value)
    path = workdir / "p.json"
    # json.dumps writes NaN/Infinity tokens for non-finite floats, as a careless tool would.
    path.write_text(json.dumps(data))
    scenario = workdir / "s.yaml"
    scenario.write_text(to_yaml(TINY))
    assert_clean_exit(["simulate", scenario, "--gpu", path, "--json", "--no-dashboard"])


action = st.builds(lambda s, k, m: f"{s}{k}{m}", st.integers(-1, 3), st.sampled_from(["F", "B", "W", "I", "X", ""]),
                   st.one_of(st.integers(-1, 9), st.just(999_999_999)))
csv_text = st.lists(st.lists(st.one_of(action, st.text(max_size=6)), min_size=0, max_size=10), min_size=0, max_size=3)


@FUZZ
@given(rows=csv_text)
def test_fuzz_schedule_csv(workdir, rows):
    path = workdir / "sched.csv"
    path.write_text("\n".join(",".join(r) for r in rows) + "\n")
    scenario = workdir / "s.yaml"
    scenario.write_text(to_yaml(TINY))
    assert_clean_exit(["simulate", scenario, "--schedule-file", path, "--json", "--no-dashboard"])


NCCL_LOG_LINES = (REF / "nccl-tests" / "p4de-2nodes-16gpu_all_reduce_perf.txt").read_text().splitlines()
line_edit = st.tuples(
    st.integers(0, len(NCCL_LOG_LINES) - 1),
    st.sampled_from(["drop", "nan", "inf", "neg", "huge", "garble", "dup"]),
)


def edit_line(line: str, how: str) -> list[str]:
    words = line.split()
    if how == "drop":
        return []
    if how == "dup":
        return [line, line]
    if how == "garble":
        return [line[: len(line) // 2]]
    repl = {"nan": "nan", "inf": "inf", "neg": "-5", "huge": "1" + "0" * 30}[how]
    if len(words) > 2:
        words[len(words) // 2] = repl
    return [" ".join(words)]


@FUZZ
@given(edits=st.lists(line_edit, min_size=1, max_size=6))
def test_fuzz_nccl_tests_logs(workdir, edits):
    lines = list(NCCL_LOG_LINES)
    for index, how in sorted(edits, reverse=True):
        if index < len(lines):
            lines[index:index + 1] = edit_line(lines[index], how)
    path = workdir / "log.txt"
    path.write_text("\n".join(lines) + "\n")
    assert_clean_exit(["trace", "info", path, "--json"])


def small_kineto_events() -> dict:
    with gzip.open(REF / "kineto" / "hta_sampled_rank0of128.json.gz", "rt") as f:
        trace = json.load(f)
    trace["traceEvents"] = trace["traceEvents"][:400]
    return trace


KINETO = small_kineto_events()
event_edit = st.tuples(
    st.integers(0, len(KINETO["traceEvents"]) - 1),
    st.sampled_from(["ts", "dur", "args", "name", "ph", "cat", "pid", "tid"]),
    st.one_of(odd_values, st.just(float("nan")), st.just(float("inf")), st.just(-1e30), st.just(2**64)),
)


@settings(FUZZ, max_examples=max(80, EXAMPLES))
@given(edits=st.lists(event_edit, min_size=1, max_size=8), drop_base=st.booleans())
def test_fuzz_kineto_traces(workdir, edits, drop_base):
    trace = copy.deepcopy(KINETO)
    for index, key, value in edits:
        event = trace["traceEvents"][index]
        if isinstance(event, dict):
            event[key] = value
    if drop_base:
        trace.pop("baseTimeNanoseconds", None)
    path = workdir / "t.json"
    path.write_text(json.dumps(trace))
    assert_clean_exit(["trace", "info", path, "--json"])


def test_fuzz_harness_catches_a_traceback(monkeypatch):
    """The harness itself must fail on a crash, or the properties above prove nothing."""
    import simulator.cli as cli

    @cli.app.command("crash-for-test")
    def crash() -> None:
        raise ZeroDivisionError("boom")

    try:
        with pytest.raises(AssertionError, match="ZeroDivisionError"):
            assert_clean_exit(["crash-for-test"])
    finally:
        cli.app.registered_commands = [c for c in cli.app.registered_commands if c.name != "crash-for-test"]


@pytest.mark.parametrize(
    "target, match",
    [
        ("/dev/full", "not a regular file"),
        ("{tmp}", "is a folder"),
        ("{tmp}/afile/report.json", "which is a file, not a folder"),
        ("{tmp}/" + "x" * 300 + ".json", "longer than 255 bytes"),
    ],
)
def test_output_paths_checked_before_simulating(workdir, target, match):
    (workdir / "afile").write_text("keep me")
    path = workdir / "s.yaml"
    path.write_text(to_yaml(TINY))
    code, err = run_cli(["simulate", path, "--no-dashboard", "--report", target.format(tmp=workdir)])
    assert code == 2 and match in err and "--report" in err, err
    assert (workdir / "afile").read_text() == "keep me"
    import os
    import stat

    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)  # the device node was not replaced by a file


def test_read_only_output_folder(workdir):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    ro = workdir / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    path = workdir / "s.yaml"
    path.write_text(to_yaml(TINY))
    code, err = run_cli(["simulate", path, "--no-dashboard", "--report", ro / "r.json"])
    assert code == 2 and "not writable" in err, err


@pytest.mark.parametrize("name", ["[/bold]x", "[red]hi", "a]b[c"])
def test_markup_in_names_is_printed_literally(workdir, name):
    data = copy.deepcopy(TINY)
    data["name"] = name
    path = workdir / "s.yaml"
    path.write_text(to_yaml(data))
    runner = CliRunner()
    result = runner.invoke(app, ["simulate", str(path), "--no-dashboard"], catch_exceptions=False)
    assert result.exit_code == 0
    assert name in result.stdout


@pytest.mark.parametrize("name, match", [("\x1b]0;owned\x07", "control characters"), ("n" * 300, "at most 200"), (" ", "empty")])
def test_hostile_names_refused(workdir, name, match):
    data = copy.deepcopy(TINY)
    data["name"] = name
    path = workdir / "s.yaml"
    path.write_text(to_yaml(data))
    code, err = run_cli(["simulate", path, "--no-dashboard"])
    assert code == 2 and match in err, err


def test_control_sequences_in_trace_names_are_escaped(workdir):
    trace = copy.deepcopy(KINETO)
    for event in trace["traceEvents"]:
        if isinstance(event, dict) and event.get("ph") == "X":
            event["name"] = "\x1b]0;owned\x07[/bold]" + str(event.get("name"))
    path = workdir / "t.json"
    path.write_text(json.dumps(trace))
    result = CliRunner().invoke(app, ["trace", "info", str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    assert "\x1b]" not in result.stdout


@pytest.mark.parametrize("item, match", [("name=", "gives no value"), ("name=null", "gives no value"),
                                         ("=3", "names no field"), ("a..b=1", "names no field")])
def test_set_without_value_or_field_is_refused(workdir, item, match):
    path = workdir / "s.yaml"
    path.write_text(to_yaml(TINY))
    code, err = run_cli(["simulate", path, "--no-dashboard", "--set", item])
    assert code == 2 and match in err, err


def test_gradient_bucket_larger_than_the_model_costs_no_more_than_the_model(workdir):
    path = workdir / "s.yaml"
    path.write_text(to_yaml(TINY))
    reports = []
    for bucket in ("40000000", "1000000000000000"):
        result = CliRunner().invoke(app, ["simulate", str(path), "--json", "--no-dashboard",
                                          "--set", f"parallelism.grad_bucket_params={bucket}"], catch_exceptions=False)
        assert result.exit_code == 0, result.stdout
        reports.append(json.loads(result.stdout.strip().splitlines()[-1]))
    assert reports[1]["peak_memory_gib"] < 80
    assert reports[1]["peak_memory_gib"] == pytest.approx(reports[0]["peak_memory_gib"], rel=0.05)


def test_profile_without_fallback_class_is_one_line(workdir):
    data = copy.deepcopy(PROFILE)
    data["compute"]["classes"] = {}
    path = workdir / "p.json"
    path.write_text(json.dumps(data))
    scenario = workdir / "s.yaml"
    scenario.write_text(to_yaml(TINY))
    code, err = run_cli(["simulate", scenario, "--gpu", path, "--no-dashboard"])
    assert code == 2 and "no 'other'" in err, err


@pytest.mark.parametrize("flags, match", [
    (["--nproc", "0"], "--nproc 0"), (["--threads-per-rank", "0"], "--threads-per-rank 0"),
    (["--factor", "nan"], "--factor nan"), (["--timeout-s", "-1"], "--timeout-s -1"), (["--max-repeats", "0"], "--max-repeats 0"),
])
def test_capture_numbers_checked_before_any_rank_starts(workdir, flags, match):
    code, err = run_cli(["capture", "collectives", "--out", workdir / "b", *flags])
    assert code == 2 and match in err, err
    assert not (workdir / "b").exists()


@pytest.mark.parametrize("field, value", [("dur", -5000.0), ("dur", float("nan")), ("dur", 1e30), ("ts", float("inf"))])
def test_corrupt_kernel_times_are_skipped_and_counted_not_summed(workdir, field, value):
    with gzip.open(REF / "kineto" / "hta_sampled_rank0of128.json.gz", "rt") as f:
        full = json.load(f)
    clean = workdir / "clean.json"
    clean.write_text(json.dumps(full))
    trace = copy.deepcopy(full)
    kernels = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") == "kernel"]
    kernels[3][field] = value
    bad = workdir / "bad.json"
    bad.write_text(json.dumps(trace))
    infos = []
    for path in (clean, bad):
        result = CliRunner().invoke(app, ["trace", "info", str(path), "--json"], catch_exceptions=False)
        assert result.exit_code == 0
        infos.append(json.loads(result.stdout))
    removed = kernels[3]["dur"] if field == "ts" else full["traceEvents"][trace["traceEvents"].index(kernels[3])]["dur"]
    assert sum(infos[1]["op_classes"].values()) == pytest.approx(sum(infos[0]["op_classes"].values()) - removed)
    assert infos[1]["span_us"] <= infos[0]["span_us"]
    assert any("skipped 1 event" in w for w in infos[1]["warnings"]), infos[1]["warnings"]


# Sweep space files: the space's axes, objective, constraints and the other top-level keys mutated.
# Estimate-only keeps each case to the driver (no pool); a space that passes is still estimated fully.
SPACE = {
    "name": "fuzz",
    "scenario": {k: v for k, v in TINY.items() if k != "name"},
    "space": {"tp": [1, 2], "pp": [1, 2]},
    "objective": "tokens_per_s",
    "constraints": {"memory_headroom": 0.1, "max_gpus": 64},
    "top_k": 5,
    "mode": "reduced",
}
SPACE_PATHS = sorted(dotted_paths(SPACE))
space_keys = st.one_of(st.sampled_from(SPACE_PATHS), st.sampled_from([
    "space.zero", "space.schedule", "space.micro_batch_size", "space.parallelism.vpp", "space.bogus", "space.gpus",
    "gpus", "model", "base", "constraints.min_gpus", "extra",
]))
axis_values = st.one_of(
    odd_values,
    st.lists(st.one_of(st.integers(-2, 16), st.sampled_from(["1f1b", "zbv", "full", "none", ""]), st.booleans(),
                       st.floats(allow_nan=True, allow_infinity=True)), max_size=5),
    st.just(list(range(1, 5001))),  # with a second long axis: over the 10,000,000-point limit
)
SPACE_CASES: dict[str, int] = {}


@FUZZ
@given(mutations=st.lists(st.tuples(space_keys, axis_values), min_size=1, max_size=3))
def test_fuzz_sweep_space_files(workdir, mutations):
    data = copy.deepcopy(SPACE)
    for dotted, value in mutations:
        set_path(data, dotted, value)
    path = workdir / "space.yaml"
    path.write_text(to_yaml(data))
    code, err = run_cli(["sweep", path, "--estimate-only", "--json", "--no-dashboard", "--no-progress",
                         "--store", workdir / "store.sqlite"])
    assert code in (0, 2), f"sweep exited {code}: {err[-500:]}"
    assert "Traceback" not in err, err
    outcome = "exit 0" if code == 0 else "exit 2"
    SPACE_CASES[outcome] = SPACE_CASES.get(outcome, 0) + 1


def test_fuzz_sweep_space_base_runs(workdir):
    """The unmutated space must pass, or every mutation would fail for the same dull reason."""
    path = workdir / "space.yaml"
    path.write_text(to_yaml(SPACE))
    code, err = run_cli(["sweep", path, "--estimate-only", "--json", "--no-dashboard", "--no-progress",
                         "--store", workdir / "store.sqlite"])
    assert code == 0, err


# `collective` flags: sizes, factors and rank counts as a user could type them (bounded runs only).
size_text = st.one_of(st.sampled_from(["8", "1K", "1M", "8G", "1T", "2T", "0", "-1", "nan", "inf", "1e9", "1.5M", "", "9" * 30]),
                      st.text(max_size=6))
factor_text = st.one_of(st.sampled_from(["2", "1", "1.0000001", "1.001", "nan", "inf", "-2", "0", "1e308", "x"]),
                        st.floats(allow_nan=True, allow_infinity=True).map(repr))
gpus_text = st.sampled_from(["0", "1", "2", "16", "-4", "1000000", str(2**63), "x", "131073"])


@FUZZ
@given(b=size_text, e=size_text, f=factor_text, g=gpus_text)
def test_fuzz_collective_flags(workdir, b, e, f, g):
    assert_clean_exit(["collective", "all_reduce", "--gpus", g, "-b", b, "-e", e, "-f", f, "--json"])


@pytest.mark.parametrize("entry", ["/etc/passwd", "../rank0.trace.json.gz", "sub/rank0.trace.json.gz", ".."])
def test_bundle_manifest_cannot_point_outside_the_bundle(workdir, entry):
    import shutil

    bundle = workdir / "b"
    shutil.copytree(Path(__file__).parents[1] / "traces" / "cpu-gloo-train-tp2-pp2", bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["trace_files"][0] = entry
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    code, err = run_cli(["trace", "info", bundle, "--json"])
    assert code == 2 and "not a file name inside the bundle" in err, err


@pytest.mark.parametrize("wall_s", [-1.0, 0.0])
def test_bundle_step_times_must_be_positive(workdir, wall_s):
    import shutil

    bundle = workdir / "b"
    shutil.copytree(Path(__file__).parents[1] / "traces" / "cpu-gloo-train-tp2-pp2", bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["step_times"][0]["wall_s"] = wall_s
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    code, err = run_cli(["calibrate", bundle, "--out", workdir / "p.json"])
    assert code == 2 and "wall_s" in err, err
    assert not (workdir / "p.json").exists()


@pytest.mark.parametrize("base", [float("nan"), 2**70, -5])
def test_corrupt_base_time_is_said_not_a_traceback(workdir, base):
    trace = copy.deepcopy(KINETO)
    trace["baseTimeNanoseconds"] = base
    path = workdir / "t.json"
    path.write_text(json.dumps(trace))
    result = CliRunner().invoke(app, ["trace", "info", str(path), "--json"], catch_exceptions=False)
    assert result.exit_code == 0
    assert any("baseTimeNanoseconds" in w for w in json.loads(result.stdout)["warnings"])


def test_corrupt_parquet_table_is_one_line(workdir):
    import shutil

    bundle = workdir / "b"
    shutil.copytree(Path(__file__).parents[1] / "traces" / "cpu-gloo-collectives", bundle)
    (bundle / "collectives.parquet").write_bytes(b"not parquet" * 8)
    code, err = run_cli(["calibrate", bundle, "--out", workdir / "p.json"])
    assert code == 2 and "not a readable parquet table" in err, err
    assert not (workdir / "p.json").exists()


def test_schedule_csv_with_a_huge_microbatch_is_refused_at_once(workdir):
    import time

    path = workdir / "s.csv"
    path.write_text("0F999999999,0B999999999\n1F999999999,1B999999999\n")
    scenario = workdir / "s.yaml"
    scenario.write_text(to_yaml(TINY))
    t0 = time.perf_counter()
    code, err = run_cli(["simulate", scenario, "--schedule-file", path, "--no-dashboard"])
    assert code == 2 and "beyond the 100,000 microbatches" in err, err
    assert time.perf_counter() - t0 < 20  # refused before anything is sized by it (was 70 s)


@pytest.mark.parametrize("flag", ["--topology", "--gpu", "--model"])
def test_names_longer_than_the_os_allows_are_unknown_names(workdir, flag):
    code, err = run_cli(["simulate", flag, "a" * 300, "--no-dashboard"])
    assert code == 2 and "unknown" in err, err
