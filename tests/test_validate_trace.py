"""validate TRACE --scenario on NeuSight's real measurements (HF GPT-2 Large, GPT-3 XL, OPT-1.3B
training in fp32 eager PyTorch on one H100 SXM / A100 80GB PCIe, and 4-GPU DP/TP/PP steps)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from simulator.workload.kernel_model import calibrate_from_tables
from simulator.calibrate.validate import validate_trace
from simulator.errors import UserError
from simulator.trace.optable_csv import load_op_table

ROOT = Path(__file__).resolve().parent.parent
NEU = ROOT / "tests" / "data" / "reference" / "neusight"
SCN = ROOT / "tests" / "data" / "scenarios" / "neusight"
GPUS = {"h100": "NVIDIA_H100_80GB_HBM3", "a100": "NVIDIA_A100_80GB_PCIe"}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """Profiles calibrated on GPT-2 Large (batch 4) of each GPU, written as a user would."""
    out = {}
    for gpu, folder in GPUS.items():
        path = tmp_path_factory.mktemp("prof") / f"{gpu}.json"
        prof = calibrate_from_tables([load_op_table(NEU / folder / "gpt2_large-train-1024-4.csv")])
        path.write_text(prof.model_dump_json(indent=2, exclude_none=True))
        out[gpu] = str(path)
    return out


@pytest.mark.parametrize("gpu", list(GPUS))
def test_self_consistency_on_gpt2_large(gpu):
    """Calibrated on the run itself: the step within 10%, every op class's total within 15%."""
    r = validate_trace(NEU / GPUS[gpu] / "gpt2_large-train-1024-4.csv", SCN / f"gpt2_large-{gpu}-1024-4.yaml")
    assert r["mode"] == "self-consistency"
    assert abs(r["step_time_error"]) <= 0.10, r["step_time_error"]
    classes = r["op_classes"]
    assert {"gemm", "attention", "elementwise", "norm", "embedding"} <= set(classes)
    for name, row in classes.items():
        assert row["measured_time_s"] > 0 and abs(row["error"]) <= 0.15, (name, row)
    # One GPU: nothing to communicate on either side, and the same names on both.
    assert all(row["measured_time_s"] == 0.0 and row["predicted_time_s"] == 0.0 for row in r["exposed_comm"].values())
    assert set(r["exposed_comm"]) == {"tp", "cp", "ep", "pp", "dp"}


# A100 OPT-1.3B batch 2: NeuSight's measured forward (1,335 ms) is 1.48x the sum of its own
# forward op measurements (904 ms) and 2.95x batch 1's forward (452 ms), while its backward
# (1,854 ms) is 1.035x its ops and 2.02x batch 1's; every other run's forward is 0.74-1.02x its
# ops except four other A100 runs (GPT-2 Large b1 1.37x, GPT-3 2.7B 1.61x, BERT-Large b2 1.39x and
# b8 1.49x). An op-level model predicts -17.5%; against the per-op-consistent step
# (904 + 1,854 = 2,758 ms) it is -4.6%.
_MISSES = {("a100", "opt_13-train-2048-2"): "measured forward 1.48x the sum of the table's own forward ops (backward "
                                            "1.035x): predicted -17.5%, -4.6% against forward ops + measured backward"}


@pytest.mark.parametrize("gpu", list(GPUS))
@pytest.mark.parametrize("stem", ["gpt3_xl-train-2048-1", "opt_13-train-2048-1", "opt_13-train-2048-2"])
def test_predicts_other_models_from_gpt2_large(fitted, gpu, stem, request):
    if (gpu, stem) in _MISSES:
        request.node.add_marker(pytest.mark.xfail(reason=_MISSES[(gpu, stem)], strict=True))
    scn = stem.replace("-train", f"-{gpu}")
    r = validate_trace(NEU / GPUS[gpu] / f"{stem}.csv", SCN / f"{scn}.yaml", fitted[gpu])
    assert r["mode"] == "predict"
    assert abs(r["step_time_error"]) <= 0.15, r["step_time_error"]


# Rows of distributed.csv: (gpu, step file stem, measured ms, NeuSight's |error|). The A100 rows
# have no JSON of their own; their measured step is the table's.
DIST = [
    ("a100", "gpt2_large-train-1024-4-dp4", 452.3, 0.129), ("a100", "gpt2_large-train-1024-4-tp4", 484.9, 0.084),
    ("a100", "gpt2_large-train-1024-4-pp4_1", 1597.6, 0.103),
    ("h100", "gpt2_large-train-1024-4-dp4", 194.9, 0.099), ("h100", "gpt2_large-train-1024-4-tp4", 211.1, 0.080),
    ("h100", "gpt2_large-train-1024-4-pp4_1", 637.5, 0.020), ("h100", "gpt2_large-train-1024-16-dp4", 642.1, 0.012),
    ("h100", "gpt2_large-train-1024-16-tp4", 729.7, 0.131), ("h100", "gpt2_large-train-1024-16-pp4_1", 2384.0, 0.107),
    ("h100", "gpt3_xl-train-2048-4-tp4", 1010.5, 0.037), ("h100", "gpt3_xl-train-2048-4-pp4_1", 3554.4, 0.046),
]
# The shipped sources name NeuSight's A100s PCIe parts (the single-GPU labels) and say nothing of
# the 4-GPU A100 box (its step files are not in the A100 label folder); simulated over PCIe Gen4
# as they say (NCCL on PCI paths: 24 GB/s graph, no LL128), the TP row cannot fit: 144 fp32
# all-reduces of 21 MB put 4.56 GB out of each rank, 144.8 ms at PCIe's 31.5 GB/s peak, beside
# >= 408.9 ms of compute (a quarter of the measured single-GPU batch-4 step): 553.7 ms > 484.9
# measured (bench/neusight_validate.py prints this floor). With 300 GB/s NVLink links
# (dgx-a100-fattree) the A100 rows come out TP -3.8%, DP -4.5%, PP -1.9%.
_DIST_MISSES = {
    ("a100", "gpt2_large-train-1024-4-tp4"): "+31.8% over PCIe Gen4, as the sources describe the A100s: the TP "
                                             "all-reduces alone need 144.8 ms at PCIe's peak, compute >= 408.9 ms, "
                                             "553.7 ms > 484.9 ms measured (with NVLink: -3.8%)",
}


@pytest.mark.parametrize("gpu,stem,measured_ms,neusight_err", DIST)
def test_distributed_rows_no_worse_than_neusight(fitted, tmp_path, gpu, stem, measured_ms, neusight_err, request):
    if (gpu, stem) in _DIST_MISSES:
        request.node.add_marker(pytest.mark.xfail(reason=_DIST_MISSES[(gpu, stem)], strict=True))
    step = NEU / GPUS[gpu] / f"{stem}.json"
    if not step.exists():
        step = tmp_path / f"{stem}.json"
        step.write_text(json.dumps({"e2e_latency": measured_ms}))
    assert json.loads(step.read_text())["e2e_latency"] == pytest.approx(measured_ms, abs=0.06)
    model, _, seq, batch, par = stem.split("-")
    r = validate_trace(step, SCN / f"{model}-{gpu}-{seq}-{batch}-{par.split('_')[0]}.yaml", fitted[gpu])
    assert abs(r["step_time_error"]) <= neusight_err, r["step_time_error"]


def test_distributed_breakdown_names(fitted):
    r = validate_trace(NEU / GPUS["h100"] / "gpt2_large-train-1024-4-tp4.json", SCN / "gpt2_large-h100-1024-4-tp4.yaml",
                       fitted["h100"])
    assert r["exposed_comm"]["tp"]["predicted_time_s"] > 0 and r["exposed_comm"]["dp"]["predicted_time_s"] == 0
    assert r["exposed_comm"]["tp"]["measured_time_s"] is None  # a step JSON measures the step only
    r = validate_trace(NEU / GPUS["h100"] / "gpt2_large-train-1024-4-pp4_1.json", SCN / "gpt2_large-h100-1024-4-pp4.yaml",
                       fitted["h100"])
    assert r["bubble"]["predicted_time_s"] > 0.5 * r["predicted_step_time_s"]  # one microbatch through 4 stages
    assert len(r["per_rank"]) == 4


@pytest.mark.parametrize("change,what", [
    ({"cluster.gpus": 4, "batch.micro_batch_size": 1}, "runs on 4 GPUs but"),
    ({"batch.seq_length": 2048}, "seq_length=2048"),
    ({"batch.global_batch_size": 2, "batch.micro_batch_size": 2}, "global_batch_size=2"),
    ({"dtype": "bf16"}, "dtype bf16"),
    ({"model": str(ROOT / "tests" / "data" / "hf" / "neusight" / "gpt3-xl.json")}, "24 layers"),
])
def test_scenario_that_disagrees_is_one_line(tmp_path, change, what):
    import yaml

    from simulator.scenario import set_dotted

    data = yaml.safe_load((SCN / "gpt2_large-h100-1024-4.yaml").read_text())
    data["model"] = str((SCN / data["model"]).resolve())
    for k, v in change.items():
        set_dotted(data, k, v)
    sc = tmp_path / "s.yaml"
    sc.write_text(yaml.safe_dump(data))
    with pytest.raises(UserError, match=what) as exc:
        validate_trace(NEU / GPUS["h100"] / "gpt2_large-train-1024-4.csv", sc)
    assert "\n" not in str(exc.value)


def test_cli_json_and_exit_2(tmp_path):
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "simulator.cli", "validate", str(NEU / GPUS["h100"] / "gpt2_large-train-1024-4.csv"),
           "--scenario", str(SCN / "gpt2_large-h100-1024-4.yaml"), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["measured_step_time_s"] == pytest.approx(0.6388, rel=1e-3)
    bad = cmd[:5] + ["--scenario", str(SCN / "gpt3_xl-h100-2048-1.yaml")]
    p = subprocess.run(bad, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    step_only = cmd[:4] + [str(NEU / GPUS["h100"] / "gpt2_large-train-1024-4-dp4.json"), "--scenario",
                           str(SCN / "gpt2_large-h100-1024-4-dp4.yaml")]
    p = subprocess.run(step_only, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert p.returncode == 2 and "give --profile" in p.stderr


KINETO = ROOT / "tests" / "data" / "reference" / "kineto" / "hta_a100_rank0of16.json.gz"


def test_kineto_trace_set_measured_side():
    """A real 16-rank A100 trace (rank 0): the step from ProfilerStep boundaries on the GPU
    timeline, compute per class, exposed communication per dimension; same names as predicted."""
    r = validate_trace(KINETO, ROOT / "tests" / "data" / "scenarios" / "hta16-a100.yaml", "a100-sxm-80gb")
    assert r["mode"] == "predict"
    assert 0.20 < r["measured_step_time_s"] < 0.23  # ~216 ms between ProfilerStep starts
    assert r["op_classes"]["gemm"]["measured_time_s"] > 0
    assert set(r["exposed_comm"]) == {"tp", "cp", "ep", "pp", "dp"}
    assert r["exposed_comm"]["dp"]["measured_time_s"] > 0
    meas = r["measured_per_rank"][0]
    assert meas["compute_s"] + sum(meas["exposed_comm_s"].values()) + meas["bubble_s"] == pytest.approx(meas["step_s"])


def test_kineto_trace_layout_disagreement(tmp_path):
    import yaml

    data = yaml.safe_load((ROOT / "tests" / "data" / "scenarios" / "hta16-a100.yaml").read_text())
    data["parallelism"]["tp"] = 1
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(UserError, match="groups of 8 ranks"):
        validate_trace(KINETO, tmp_path / "s.yaml", "a100-sxm-80gb")
    data["cluster"]["gpus"] = 8
    data["parallelism"]["tp"] = 8
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(UserError, match="job of 16"):
        validate_trace(KINETO, tmp_path / "s.yaml", "a100-sxm-80gb")


def test_calibrate_cli_on_op_table(tmp_path):
    from simulator.profile import load_profile

    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = tmp_path / "h100-neusight.json"
    cmd = [sys.executable, "-m", "simulator.cli", "calibrate", str(NEU / GPUS["h100"] / "gpt2_large-train-1024-4.csv"),
           "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    prof = load_profile(out)
    km = prof.compute.kernels
    assert prof.device == "NVIDIA H100 80GB HBM3" and prof.provenance.method == "mixed"
    # Physics: fp32 GEMMs below the FP32 peak, HBM below the datasheet.
    assert 0.5 < km.gemm_efficiency["fp32"] <= 1.0 and all(v <= 0.92 for v in km.mem_efficiency.values())
    assert "gpt2_large-train-1024-4.csv" in km.fit_source
    # One provenance item per number, the fitted one replacing the base's (fp32 only: the table's
    # dtype), and the summary names only what was fitted.
    items = {i.field: i for i in prof.provenance.items}
    assert len([i for i in prof.provenance.items if i.field == "compute.kernels.gemm_efficiency.fp32"]) == 1
    assert items["compute.kernels.gemm_efficiency.fp32"].value == pytest.approx(km.gemm_efficiency["fp32"], abs=1e-4)
    assert "fitted on" in items["compute.kernels.gemm_efficiency.fp32"].source
    assert "fitted on" not in items["compute.kernels.gemm_efficiency.bf16"].source
    assert "GEMM efficiency fp32 " in p.stderr and "bf16" not in p.stderr.split("GEMM efficiency")[1].split(",")[0]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert p.returncode == 2 and "already exists" in p.stderr


def test_new_user_bad_inputs_one_line_exit_2(tmp_path):
    """As a user types them: a table measured on another GPU than the scenario's, an unknown GPU
    name (in the scenario, or as the table's folder), a table cut short, and a Kineto file without
    --scenario: one line each, exit 2, no traceback, nothing written."""
    import shutil

    import yaml

    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    table = NEU / GPUS["h100"] / "gpt2_large-train-1024-4.csv"
    data = yaml.safe_load((SCN / "gpt2_large-h100-1024-4.yaml").read_text())
    data["model"] = str((SCN / data["model"]).resolve())
    unknown = tmp_path / "unknown-gpu.yaml"
    unknown.write_text(yaml.safe_dump({**data, "cluster": {**data["cluster"], "gpu": "h100-foo"}}))
    foo = tmp_path / "NVIDIA_Foo_X9000"
    foo.mkdir()
    shutil.copy(table, foo)
    shutil.copy(table.with_suffix(".json"), foo)
    cut = tmp_path / "NVIDIA_H100_80GB_HBM3"
    cut.mkdir()
    text = table.read_text()
    (cut / table.name).write_text(text[: len(text) // 2])
    shutil.copy(table.with_suffix(".json"), cut)
    cases = [
        ([str(table), "--scenario", str(SCN / "gpt2_large-a100-1024-4.yaml")],
         "measured on NVIDIA H100 80GB HBM3: set cluster.gpu: h100-sxm-80gb"),
        ([str(table), "--scenario", str(unknown)], "unknown GPU profile 'h100-foo'"),
        ([str(foo / table.name), "--scenario", str(SCN / "gpt2_large-h100-1024-4.yaml")], "measured on NVIDIA Foo X9000"),
        ([str(cut / table.name), "--scenario", str(SCN / "gpt2_large-h100-1024-4.yaml")], "ends in the middle of row"),
        ([str(KINETO), "--profile", "a100-sxm-80gb"], "needs --scenario S.yaml"),
    ]
    for args, what in cases:
        p = subprocess.run([sys.executable, "-m", "simulator.cli", "validate", *args], capture_output=True, text=True,
                           env=env, cwd=tmp_path)
        lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
        assert p.returncode == 2 and len(lines) == 1 and what in lines[0] and "Traceback" not in p.stderr, (args, p.stderr)
    p = subprocess.run([sys.executable, "-m", "simulator.cli", "calibrate", str(cut / table.name), "--out",
                        str(tmp_path / "p.json")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert p.returncode == 2 and "ends in the middle of row" in p.stderr and not (tmp_path / "p.json").exists()
    p = subprocess.run([sys.executable, "-m", "simulator.cli", "trace", "info", str(table)], capture_output=True, text=True,
                       env=env, cwd=tmp_path)
    assert p.returncode == 2 and "per-operator latency table" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    # A folder named anything else is no GPU name: the scenario's GPU holds.
    plain = tmp_path / "mine"
    plain.mkdir()
    shutil.copy(table, plain)
    shutil.copy(table.with_suffix(".json"), plain)
    r = validate_trace(plain / table.name, SCN / "gpt2_large-h100-1024-4.yaml")
    assert r["mode"] == "self-consistency"


@pytest.mark.parametrize("value,what", [(-5, "e2e_latency -5 is not a positive"), (0, "e2e_latency 0 is not a positive"),
                                        ("fast", "e2e_latency 'fast' is not a positive")])
def test_step_json_with_a_bad_latency_is_one_line(tmp_path, value, what):
    step = tmp_path / "gpt2_large-train-1024-4-tp4.json"
    step.write_text(json.dumps({"e2e_latency": value}))
    with pytest.raises(UserError, match=what):
        validate_trace(step, SCN / "gpt2_large-h100-1024-4-tp4.yaml")


def test_a_trace_with_no_world_size_is_not_called_a_job_of_one(tmp_path):
    # Was "come from a job of 1: set cluster.gpus: 1" for a rank-0 trace of a 16-GPU job whose
    # distributedInfo was stripped and whose name carries no rank<k>of<N>.
    import gzip

    with gzip.open(KINETO, "rt") as f:
        d = json.load(f)
    d.pop("distributedInfo", None)
    bare = tmp_path / "trace.json.gz"
    with gzip.open(bare, "wt") as f:
        json.dump(d, f)
    with pytest.raises(UserError, match=r"record no world size .* which of the scenario's 16 GPUs they are is unknown: "
                                        r"name each file rank<k>of16\.json\(\.gz\)"):
        validate_trace(bare, ROOT / "tests" / "data" / "scenarios" / "hta16-a100.yaml", "a100-sxm-80gb")
    # Named as the error says, it validates as the original does.
    named = tmp_path / "rank0of16.json.gz"
    bare.rename(named)
    assert validate_trace(named, ROOT / "tests" / "data" / "scenarios" / "hta16-a100.yaml", "a100-sxm-80gb")["mode"] == "predict"
