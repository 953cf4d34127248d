"""Bugs a new user met walking the README (second pass): each pinned at the CLI or library level.

CLI cases run `python -m simulator.cli` in a subprocess from a temporary folder, so the exit status,
stderr and the files left behind are those of `clustersim` itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from simulator.calibrate.published import PUBLISHED, published_set_name
from simulator.errors import UserError
from simulator.scenario import load_scenario, model_from_hf_config

from cli_helpers import REPO, TINY_SCENARIO as TINY, assert_one_line_error, clustersim

DATA = REPO / "tests" / "data"
NCCL_LOG = DATA / "reference" / "nccl-tests" / "p4de-2nodes-16gpu_all_reduce_perf.txt"


def test_trace_info_on_an_nccl_tests_log_prints_sizes_not_a_traceback(tmp_path):
    # Was KeyError 'total_us': the rich table expected a trace's collectives.
    p = clustersim(["trace", "info", NCCL_LOG], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert "busbw GB/s" in p.stdout and "all_reduce" in p.stdout
    # the largest size's best busbw, from the log (78.33 out-of-place, 78.33 in-place)
    assert "78.33" in p.stdout


def test_compare_whatif_names_the_missing_file_a(tmp_path):
    # Was "B = 'nope.yaml' does not exist" for the one file the user gave (A).
    p = clustersim(["compare", "nope.yaml"], tmp_path)
    assert_one_line_error(p, r"^error: A = 'nope\.yaml' does not exist")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flags, pattern", [
    (["--gpus", "-64"], r"--gpus value -64 must be at least 1"),
    (["--gpus", "64", "--tp", "0,2"], r"--tp value 0 must be at least 1"),
    (["--gpus", "64", "--zero", "-1"], r"--zero value -1 must be at least 0"),
    (["--gpus", "64", "--tp", "2,4", "--top-k", "0"], r"--top-k 0 must be at least 1"),
])
def test_sweep_sizes_below_one_are_errors(tmp_path, flags, pattern):
    # Were pruned as infeasible points (exit 0); --top-k 0 silently became 20.
    p = clustersim(["sweep", "--model", "llama3-8b", *flags, "--no-progress"], tmp_path)
    assert_one_line_error(p, pattern)
    assert list(tmp_path.iterdir()) == []  # no store, no dashboard


def test_hf_config_named_after_its_file(tmp_path):
    # Was "hf" (the folder) for tests/data/hf/mistral.json; a hub download <model>/config.json keeps the folder's name.
    assert model_from_hf_config(DATA / "hf" / "mistral.json").name == "mistral"
    folder = tmp_path / "Mistral-7B-v0.1"
    folder.mkdir()
    (folder / "config.json").write_text((DATA / "hf" / "mistral.json").read_text())
    assert model_from_hf_config(folder / "config.json").name == "Mistral-7B-v0.1"
    # --model FOLDER (a snapshot folder as huggingface-cli download leaves it): was "is a folder, not a file"
    from simulator.scenario import resolve_model

    assert resolve_model(str(folder)) == model_from_hf_config(folder / "config.json")
    with pytest.raises(UserError, match="is a folder, not a file"):
        resolve_model(str(tmp_path))  # a folder without a config.json still says what is wrong


def test_set_typo_suggests_the_field():
    with pytest.raises(UserError, match=r"unknown key 'parallelism\.zer' \(did you mean 'zero'\?\): valid keys"):
        load_scenario(None, {"parallelism.zer": 3})
    with pytest.raises(UserError, match=r"unknown key 'batch\.seq_len' \(did you mean 'seq_length'\?\)"):
        load_scenario(None, {"batch.seq_len": 4096})
    with pytest.raises(UserError) as exc:
        load_scenario(None, {"parallelism.foo": 1})
    assert "did you mean" not in str(exc.value)


def test_published_set_by_its_file_name():
    assert published_set_name("megatron-2021-table1") == "megatron-2021"
    assert all(published_set_name(Path(f).stem) == k for k, f in PUBLISHED.items())
    with pytest.raises(UserError, match=r"unknown published set 'megatron-2022': use one of megatron-2021"):
        published_set_name("megatron-2022")


def test_calibrate_op_table_summary_is_rounded(tmp_path):
    # Was a Python dict repr with 16 digits ({'fp32': 0.808242724076368}) and a unitless "k overhead".
    table = DATA / "reference" / "neusight" / "NVIDIA_H100_80GB_HBM3" / "gpt2_large-train-1024-4.csv"
    p = clustersim(["calibrate", table, "--out", "h100.json"], tmp_path)
    assert p.returncode == 0, p.stderr
    line = next(x for x in p.stderr.splitlines() if "GEMM efficiency" in x)
    assert "{" not in line and "K overhead" in line and "elements of K" in line
    assert (tmp_path / "h100.json").exists()


def test_imbalance_split_that_does_not_shorten_the_simulated_step_is_not_advised(monkeypatch):
    # The default scenario printed "Move layers ... step 18.282 s (-0.0%, simulated)" and on 128 GB200
    # "(+1.6%, simulated)": advice the simulation had just refuted.
    from types import SimpleNamespace

    from simulator.report import findings as F
    from simulator.scenario import build_scenario
    from simulator.simulate import simulate

    base = {"name": "t", "model": "llama3-8b", "parallelism": {"tp": 2, "pp": 4, "zero": 1, "pp_layer_split": [5, 9, 9, 9]},
            "batch": {"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 4096},
            "cluster": {"gpus": 64, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}
    res = simulate(build_scenario(base))
    step = res.report.step_time_s
    worse = SimpleNamespace(step_time_s=step * 1.01, tokens_per_s=res.report.tokens_per_s / 1.01,
                            peak_memory_gib=res.report.peak_memory_gib, fits_in_memory=True,
                            exposed_comm_s=res.report.exposed_comm_s)
    monkeypatch.setattr(F._Budget, "simulate", lambda self, overrides: worse)
    f = {x["kind"]: x for x in F.attach(res, budget_s=10).report.findings}["imbalance"]
    assert "but not the step" in f["message"] and "keep pp_layer_split [5, 9, 9, 9]" in f["message"]
    assert "Move layers" not in f["message"] and "(+1.0%, simulated)" in f["message"]


def test_summary_says_exposed_comm_once(tmp_path):
    # The table printed each dimension twice: "+ exposed tp" in the breakdown and "exposed tp comm" below it.
    scenario = DATA / "scenarios" / "small-llama.yaml"
    p = clustersim(["simulate", scenario, "--no-dashboard", "--findings-budget-s", "0"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "+ exposed tp" in p.stdout and "exposed tp comm" not in p.stdout
    assert list(tmp_path.iterdir()) == []


def test_explain_header_names_every_column(tmp_path):
    p = clustersim(["collective", "all_reduce", "-g", "16", "--topology", "p4de-efa", "--gpu", "a100-sxm-80gb",
                    "-b", "1M", "-e", "1M", "--explain"], tmp_path)
    assert p.returncode == 0, p.stderr
    header = "\n".join(l for l in p.stdout.splitlines() if l.startswith("#"))
    assert "time us = lat us + fill us + bw-term us + chan us" in header
    assert "thr: threads per channel" in header and "busbw GB/s" in header
    (row,) = [l.split() for l in p.stdout.splitlines() if l and not l.startswith("#")]
    assert float(row[5]) + float(row[6]) + float(row[9]) + float(row[13]) + float(row[15]) == pytest.approx(float(row[11]), abs=0.2)


@pytest.mark.parametrize("args, pattern", [
    (["simulate", "--gpus", "abc"], r"^error: Invalid value for '--gpus': .*integer \(see '.* simulate --help'\)$"),
    (["simulate", "--bogus"], r"^error: No such option: --bogus"),
    (["simulatee"], r"^error: No such command 'simulatee'\. Did you mean 'simulate'\?"),
    (["collective"], r"^error: Missing argument 'op' \(see"),
    (["simulate", "--mode", "half"], r"^error: Invalid value for '--mode': 'half' is not one of 'reduced', 'full', 'every-rank' \(see"),
    (["simulate", "--findings-budget-s", "-1"], r"^error: Invalid value for '--findings-budget-s'"),
])
def test_usage_errors_are_one_line(tmp_path, args, pattern):
    # Were click's multi-line usage panel (Usage:, Try ..., a boxed Error); README: every bad input is one line.
    assert_one_line_error(clustersim(args, tmp_path), pattern)


def test_help_version_and_no_arguments_keep_their_exit_status(tmp_path):
    assert clustersim(["simulate", "--help"], tmp_path).returncode == 0
    # at 80 columns the long Megatron names wrap instead of being cut (--tp,--tensor-model…)
    page = clustersim(["simulate", "--help"], tmp_path, columns=80).stdout
    assert "…" not in page and "--tensor-model-paral" in page and "--num-layers-per-vir" in page
    v = clustersim(["--version"], tmp_path)
    assert v.returncode == 0 and v.stdout.startswith("clustersim ")
    bare = clustersim([], tmp_path)
    assert bare.returncode == 2 and "simulate" in bare.stdout + bare.stderr  # the command list, as before
    # a command's own exit status (trace info ends with typer.Exit(2) on a bad path)
    missing = clustersim(["trace", "info", "nope.json"], tmp_path)
    assert_one_line_error(missing, r"^error: 'nope\.json' does not exist")


def test_a_simulate_run_loads_neither_scipy_nor_the_help_renderer(tmp_path):
    """Start-up is paid by every command. scipy.sparse (~0.3 s to import, with the numpy.f2py its
    array-API shim loads) serves only the flow model, typer's rich help renderer (~0.15 s) only
    help and errors: a reduced run on the alpha-beta network loads neither (the test above checks
    that help still folds long names)."""
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    p = clustersim(["simulate", "tiny.yaml", "--no-dashboard", "--report", "r.json"], tmp_path, python_flags=("-X", "importtime"))
    assert p.returncode == 0, p.stderr[-2000:]
    loaded = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert {"simulator.simulate", "simulator.network.fabric", "pandas"} <= loaded  # (what was imported is listed)
    assert not {"scipy.sparse", "typer.rich_utils", "torch"} & loaded


def test_validate_op_table_leaves_out_dimensions_with_no_time(tmp_path):
    # A one-GPU table printed six rows of "0.00 ms | 0.00 ms | -" (tp, cp, ep, pp, dp, bubble).
    n = DATA / "reference" / "neusight" / "NVIDIA_H100_80GB_HBM3"
    s = DATA / "scenarios" / "neusight"
    p = clustersim(["validate", n / "gpt2_large-train-1024-4.csv", "--scenario", s / "gpt2_large-h100-1024-4.yaml"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "exposed comm" not in p.stdout and "compute gemm" in p.stdout
    assert "nothing measured or predicted, not shown: tp, cp, ep, pp, dp, bubble" in " ".join(p.stdout.split())


def test_header_and_report_say_precision_recompute_and_compare_names_what_differs(tmp_path):
    # Were: a --dtype fp8 run printed bf16's header; --dtype did not exist on simulate; --recompute
    # refused selective-op; a report JSON held only the name, so compare a.json b.json could not
    # say what differed.
    import json

    import yaml

    from cli_helpers import TINY_SCENARIO

    (tmp_path / "t.yaml").write_text(yaml.safe_dump(TINY_SCENARIO))
    base = ["simulate", "t.yaml", "--no-dashboard", "--findings-budget-s", "0"]
    a = clustersim([*base, "--report", "a.json"], tmp_path)
    b = clustersim([*base, "--report", "b.json", "--dtype", "fp8", "--recompute", "selective-op"], tmp_path)
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    assert " · bf16 · " in a.stdout.splitlines()[0]
    assert " · fp8 (te-delayed) · recompute selective-op · " in b.stdout.splitlines()[0]
    setup = json.loads((tmp_path / "b.json").read_text())["setup"]
    assert (setup["dtype"], setup["recompute"], setup["tp"], setup["gpus"]) == ("fp8", "selective-op", 2, 8)
    c = clustersim(["compare", "a.json", "b.json", "-o", "c.html"], tmp_path)
    assert c.returncode == 0, c.stderr
    assert "B differs from A in: dtype bf16 -> fp8, fp8_recipe None -> te-delayed, recompute none -> selective-op" in c.stdout


def test_a_gpu_the_topology_does_not_hold_is_noted(tmp_path):
    # Was said only in the header: --topology gb200-nvl72 simulated h100-sxm-80gb compute. A report
    # note (after the run, so never before an error line).
    base = ["simulate", "--model", "llama3-8b", "--tp", "8", "--pp", "1", "--global-batch-size", "64",
            "--no-dashboard", "--findings-budget-s", "0"]
    p = clustersim([*base, "--gpus", "64", "--topology", "gb200-nvl72"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert ("note: topology gb200-nvl72's nodes hold gb200 GPUs but the GPU simulated is h100-sxm-80gb: "
            "--gpu gb200 simulates that system") in " ".join(p.stdout.split())
    p = clustersim([*base, "--gpus", "64", "--topology", "gb200-nvl72", "--gpu", "gb200"], tmp_path)
    assert p.returncode == 0 and "note: topology" not in p.stdout, p.stdout
    # a variant of the node's part (Meta's 96 GB HBM2e H100 in a DGX H100 node) is a choice, not a slip
    p = clustersim([*base, "--gpus", "64", "--gpu", "h100-hbm2e-96gb"], tmp_path)
    assert p.returncode == 0 and "note: topology" not in p.stdout, p.stdout
    p = clustersim([*base, "--gpus", "64", "--gpu", "a100-sxm-80gb"], tmp_path)
    assert "note: topology dgx-h100-fattree's nodes hold h100-sxm-80gb GPUs" in " ".join(p.stdout.split())
    # a system whose nccl-tests log calibrated a profile of its part: the note names that profile
    p = clustersim([*base, "--gpus", "16", "--topology", "p5-efa"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert ("note: topology p5-efa has a profile calibrated on its own nccl-tests log: --gpu h100-sxm-80gb-p5-efa "
            "simulates its collectives with those constants") in " ".join(p.stdout.split())


def test_uneven_layer_split_is_said(tmp_path):
    # 6 layers over pp 2 x vpp 2 = 4 positions: the ends get one. Was silent (Megatron's
    # --num-layers-per-virtual-pipeline-stage refuses such a split; it shows up as imbalance).
    sc = dict(TINY, model=dict(TINY["model"], num_layers=6), parallelism=dict(TINY["parallelism"], vpp=2),
              schedule="interleaved-1f1b", batch=dict(TINY["batch"], global_batch_size=16))
    path = tmp_path / "uneven.yaml"
    path.write_text(yaml.safe_dump(sc))
    p = clustersim(["simulate", path, "--no-dashboard"], tmp_path)
    assert p.returncode == 0, p.stderr
    note = [line for line in p.stderr.splitlines() if "do not split evenly" in line]
    assert note == ["note: 6 layers do not split evenly over pp x vpp = 4 pipeline positions: [1, 2, 2, 1] layers, "
                    "the ends short; vpp 3 splits evenly, or --set parallelism.pp_layer_split=[...] chooses the split"]
    even = dict(sc, parallelism=dict(sc["parallelism"], vpp=3))
    path.write_text(yaml.safe_dump(even))
    p = clustersim(["simulate", path, "--no-dashboard"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "do not split evenly" not in p.stderr


def test_readme_sample_of_the_default_run_is_current():
    """The README's table of `clustersim simulate` is what the default scenario gives today (it had
    drifted: exposed pp 0.368 s shown for 0.043 s after the pipeline drain became bubble)."""
    import re

    from simulator.simulate import simulate

    text = (REPO / "README.md").read_text()
    rows = dict(re.findall(r"│ (step time|pipeline idle|  \+ exposed tp|  \+ exposed pp|  \+ bubble|  \+ stage imbalance)"
                           r"\s+│\s+([^│]*?)\s*│", text))
    r = simulate(load_scenario(None, {}), with_critical_path=False).report
    b = r.step_breakdown_s
    share = lambda s: f"{s:.3f} s ({s / r.step_time_s:.1%})"  # noqa: E731
    assert rows == {
        "step time": f"{r.step_time_s:.3f} s",
        "pipeline idle": f"{r.bubble_fraction:.1%} of the step (worst stage {r.bubble_fraction_worst:.1%})",
        "  + exposed tp": share(b["exposed_tp"]), "  + exposed pp": share(b["exposed_pp"]),
        "  + bubble": share(b["bubble"]), "  + stage imbalance": share(b["imbalance"]),
    }
    from simulator.cli import layout_line

    assert f"\n{layout_line(load_scenario(None, {}))}\n" in text


def _simulate_tiny(tmp_path, *flags: str, dashboard: bool = False):
    """``clustersim simulate`` of the tiny scenario in tmp_path with ``flags``, no findings."""
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(TINY))
    quiet = ["--cdn"] if dashboard else ["--no-dashboard"]
    return clustersim(["simulate", "t.yaml", *quiet, "--findings-budget-s", "0", *flags], tmp_path)


def test_the_framework_is_a_flag_and_shows_on_the_layout_line(tmp_path):
    # `simulate --framework torchtitan` was "No such option: --framework (Possible options:
    # --network, --report)"; the summary's first line never named the framework.
    p = _simulate_tiny(tmp_path, "--framework", "torchtitan")
    assert p.returncode == 0, p.stderr
    assert " · torchtitan · " in p.stdout.splitlines()[0]
    assert " · generic · " not in _simulate_tiny(tmp_path).stdout.splitlines()[0]
    bad = _simulate_tiny(tmp_path, "--framework", "titan")
    assert bad.returncode == 2 and "'titan' is not one of" in bad.stderr


def test_a_full_mode_run_writes_its_own_dashboard(tmp_path):
    # --mode full and --mode every-rank wrote dashboards/<name>.html over the reduced run's.
    reduced = _simulate_tiny(tmp_path, dashboard=True)
    full = _simulate_tiny(tmp_path, "--mode", "full", dashboard=True)
    assert reduced.returncode == 0 and full.returncode == 0, (reduced.stderr, full.stderr)
    names = [next(line for line in (p.stdout + p.stderr).splitlines() if line.startswith("dashboard: "))
             for p in (reduced, full)]
    assert names[0] != names[1] and names[1].endswith("-full.html"), names


def test_torch_dtype_names_are_taken(tmp_path):
    # `--dtype bfloat16` was refused without a hint, while `collective -d` wants bfloat16.
    p = _simulate_tiny(tmp_path, "--dtype", "float16")
    assert p.returncode == 0, p.stderr
    assert " · fp16 · " in p.stdout.splitlines()[0]
