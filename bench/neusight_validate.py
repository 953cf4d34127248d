"""NeuSight (per-operator latencies measured on H100 SXM and A100 80GB PCIe, HF models in fp32
eager PyTorch): calibrate ClusterSim's kernel model on GPT-2 Large (batch 4) of each GPU, then

1. per op class: median |error| of single ops and the error of the class total, every model;
2. single-GPU training steps: measured e2e vs the simulated step;
3. 4-GPU DP/TP/PP rows of distributed.csv: ClusterSim's error beside NeuSight's own, rank 0's compute
   and exposed communication; for TP rows the least the step can take on the scenario's links
   (single-GPU step / tp + the all-reduce bytes each rank must send at the link's spec rate); and
   a what-if of the A100 rows on NVLink (not a scenario of record: see docs/design-notes.md,
   "NeuSight's A100 rows").

Run: PYTHONPATH=. python bench/neusight_validate.py   (reads tests/data only; ~1 min)
"""

from __future__ import annotations

import csv
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simulator.workload.kernel_model import calibrate_from_tables, class_errors, predict_table  # noqa: E402
from simulator.calibrate.validate import validate_trace  # noqa: E402
from simulator.trace.optable_csv import load_op_table  # noqa: E402

NEU = ROOT / "tests" / "data" / "reference" / "neusight"
SCN = ROOT / "tests" / "data" / "scenarios" / "neusight"
GPUS = {"h100": "NVIDIA_H100_80GB_HBM3", "a100": "NVIDIA_A100_80GB_PCIe"}
SINGLE = ["gpt2_large-train-1024-4", "gpt2_large-train-1024-1", "gpt3_xl-train-2048-1", "gpt3_27-train-2048-1",
          "opt_13-train-2048-1", "opt_13-train-2048-2"]


def scenario_for(stem: str, gpu: str, par: str | None = None) -> Path:
    m = re.match(r"(.+)-train-(\d+)-(\d+)", stem)
    return SCN / (f"{m[1]}-{gpu}-{m[2]}-{m[3]}" + (f"-{par}" if par else "") + ".yaml")


def distributed_rows() -> list[tuple[str, str, int, str, float, float]]:
    """(gpu, model, global batch, layout, measured ms, NeuSight's |error|) from distributed.csv."""
    rows = list(csv.reader(open(NEU / "distributed.csv")))
    cols = [("a100", "dp"), ("a100", "tp"), ("a100", "pp"), ("h100", "dp"), ("h100", "tp"), ("h100", "pp")]
    out, model, batch = [], None, None
    for i, r in enumerate(rows):
        if len(r) > 2 and r[2] == "Measured Latency (ms)":
            model = r[0] or model
            batch = int(r[1])
            pred = rows[i + 1]
            for j, (g, lay) in enumerate(cols):
                if r[3 + j].strip():
                    e = float(re.search(r"\(([\d.]+)%\)", pred[3 + j])[1]) / 100
                    out.append((g, model, batch, lay, float(r[3 + j]), e))
    return out


def tp_floor(gpu: str, stem: str, seq: int, batch: int, meas_ms: float, sc_path: Path, prof_path: Path) -> None:
    """The least a TP row can take on its scenario's links, whatever the collective library does:
    compute no shorter than the measured single-GPU step of the same batch over tp, and every rank
    sending 2(n-1)/n of each all-reduce out of its own link at the link's spec rate (the ring's
    bandwidth-optimal bound). A measured step below it cannot have run on those links."""
    from simulator.profile import load_profile
    from simulator.scenario import load_scenario
    from simulator.simulate import resolve_schedule
    from simulator.topology import load_topology
    from simulator.workload.plan import build_plan
    from simulator.workload.program import build_program

    single = NEU / GPUS[gpu] / f"{stem}-train-{seq}-{batch}.json"
    if not single.exists():
        return
    import json

    single_ms = json.loads(single.read_text())["e2e_latency"]
    sc = load_scenario(sc_path)
    node = load_topology(sc.cluster.topology).node
    tp = sc.parallelism.tp
    plan = build_plan(build_program(sc, load_profile(prof_path), resolve_schedule(sc)))
    sent = sum(2 * (tp - 1) / tp * size for c in plan.ranks[0].collectives() for dim, op, size in c.steps
               if str(dim) == "tp" and str(getattr(op, "value", op)) == "all_reduce")
    link = "NVLink" if node.nvlink else "PCIe"
    comm_ms = sent / (node.nvlink_GBps * 1e9) * 1e3
    floor = single_ms / tp + comm_ms
    print(f"  floor {gpu} {stem} b{batch} tp{tp}: compute >= {single_ms:.1f}/{tp} = {single_ms / tp:.1f} ms, tp all-reduces "
          f"{sent / 1e9:.2f} GB out of each rank at {link} {node.nvlink_GBps:g} GB/s >= {comm_ms:.1f} ms: "
          f"{floor:.1f} ms {'>' if floor > meas_ms else '<='} {meas_ms:.1f} measured")


def main() -> None:
    t0 = time.time()
    profiles = {}
    for gpu, folder in GPUS.items():
        prof = calibrate_from_tables([load_op_table(NEU / folder / "gpt2_large-train-1024-4.csv")])
        path = Path(f"/tmp/neusight-{gpu}-fitted.json")
        path.write_text(prof.model_dump_json(indent=2, exclude_none=True))
        profiles[gpu] = (prof, path)
        km = prof.compute.kernels
        print(f"\n{gpu}: fitted on GPT-2 Large b4: fp32 GEMM eff {km.gemm_efficiency['fp32']:.3f}, k overhead "
              f"{km.gemm_k_overhead:.1f}, launch floor {km.launch_floor_us:.1f} us, HBM eff "
              + ", ".join(f"{k} {v:.2f}" for k, v in km.mem_efficiency.items() if k in ("attention", "elementwise", "norm", "embedding")))
        print(f"  {'model':28s} " + " ".join(f"{c:>17s}" for c in ("gemm", "attention", "elementwise", "norm", "embedding")))
        for stem in SINGLE:
            e = class_errors(predict_table(prof, load_op_table(NEU / folder / f"{stem}.csv"), km))
            print(f"  {stem:28s} " + " ".join(
                f"{e[c]['error']:+6.1%} (op {e[c]['median_abs_op_error']:4.0%})" if c in e else f"{'-':>17s}"
                for c in ("gemm", "attention", "elementwise", "norm", "embedding")))
        print("  class cells: error of the class total per step (median |error| of single ops)")
    print("\nsingle-GPU training steps (calibrated on GPT-2 Large b4 of the same GPU)")
    for gpu, folder in GPUS.items():
        for stem in SINGLE:
            sc = scenario_for(stem, gpu)
            if not sc.exists():
                continue
            prof_arg = None if stem == "gpt2_large-train-1024-4" else str(profiles[gpu][1])
            r = validate_trace(NEU / folder / f"{stem}.csv", sc, prof_arg)
            cls = " ".join(f"{c} {v['error']:+.1%}" for c, v in r["op_classes"].items() if v["error"] is not None)
            print(f"  {gpu} {stem:26s} measured {r['measured_step_time_s'] * 1e3:8.1f} ms  predicted "
                  f"{r['predicted_step_time_s'] * 1e3:8.1f} ms  {r['step_time_error']:+6.1%}   [{r['mode']}; {cls}]")
    print("\n4-GPU rows of distributed.csv (calibrated on single-GPU GPT-2 Large b4 of the same GPU)")
    print(f"  {'gpu':4s} {'model':10s} {'batch':>5s} {'layout':6s} {'measured':>9s} {'ClusterSim':>10s} {'error':>7s} {'NeuSight':>8s}")
    worse = []
    for gpu, model, batch, lay, meas_ms, neu_err in distributed_rows():
        stem = {"GPT2-Large": "gpt2_large", "GPT3-XL": "gpt3_xl"}[model]
        seq = 1024 if stem == "gpt2_large" else 2048
        sc = scenario_for(f"{stem}-train-{seq}-{batch}", gpu, f"{lay}4")
        import json
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            name = f"{stem}-train-{seq}-{batch}-{lay}4" + ("_1" if lay == "pp" else "")
            step = Path(tmp) / f"{name}.json"
            step.write_text(json.dumps({"e2e_latency": meas_ms}))
            r = validate_trace(step, sc, str(profiles[gpu][1]))
        err = r["step_time_error"]
        flag = "ok" if abs(err) <= neu_err + 1e-9 else "WORSE"
        pr = r["per_rank"][0]
        comm_ms = sum(pr["exposed_comm_s"].values()) * 1e3
        print(f"  {gpu:4s} {model:10s} {batch:5d} {lay:6s} {meas_ms:9.1f} {r['predicted_step_time_s'] * 1e3:10.1f} "
              f"{err:+7.1%} {neu_err:8.1%}  {flag:5s} [rank 0: compute {pr['compute_s'] * 1e3:.1f} ms, exposed comm "
              f"{comm_ms:.1f} ms]")
        if lay == "tp":
            worse.append((gpu, stem, seq, batch, meas_ms, sc))
    for gpu, stem, seq, batch, meas_ms, sc in worse:
        tp_floor(gpu, stem, seq, batch, meas_ms, sc, profiles[gpu][1])
    print("  what-if, not a scenario of record: the A100 rows with the GPUs on 300 GB/s NVLink (dgx-a100-fattree)")
    for gpu, model, batch, lay, meas_ms, neu_err in distributed_rows():
        if gpu != "a100":
            continue
        stem = {"GPT2-Large": "gpt2_large", "GPT3-XL": "gpt3_xl"}[model]
        seq = 1024 if stem == "gpt2_large" else 2048
        import json
        import tempfile

        import yaml

        from simulator.scenario import load_scenario_dict

        with tempfile.TemporaryDirectory() as tmp:
            data = load_scenario_dict(scenario_for(f"{stem}-train-{seq}-{batch}", gpu, f"{lay}4"))
            data["model"] = str(Path(data["model"]).resolve())
            data["cluster"]["topology"] = "dgx-a100-fattree"
            sc = Path(tmp) / "nvlink.yaml"
            sc.write_text(yaml.safe_dump(data))
            name = f"{stem}-train-{seq}-{batch}-{lay}4" + ("_1" if lay == "pp" else "")
            step = Path(tmp) / f"{name}.json"
            step.write_text(json.dumps({"e2e_latency": meas_ms}))
            r = validate_trace(step, sc, str(profiles[gpu][1]))
        print(f"  {gpu:4s} {model:10s} {batch:5d} {lay:6s} {meas_ms:9.1f} {r['predicted_step_time_s'] * 1e3:10.1f} "
              f"{r['step_time_error']:+7.1%} {neu_err:8.1%}")
    print(f"\n(wall {time.time() - t0:.0f} s on a loaded 2-core machine)")


if __name__ == "__main__":
    main()
