"""Validation against published runs: simulate each row of a published table as its source
describes the run, and compare. Nothing here is tuned to a table.

``megatron-2021``: Narayanan et al. SC'21 Table 1 (validation/megatron-2021-table1.csv). Every
row is described as the paper describes its runs: GPT models (GELU MLP of 4h, learned
positions, vocabulary 51,200, sequence 2048), fp16 mixed precision, full activation
recomputation, the (interleaved) pipeline schedule with the scatter/gather optimisation, tensor
parallelism without sequence parallelism (it came in 2022), attention without FlashAttention
(2022), data-parallel gradients all-reduced after the backward pass (the 2021 code did not
overlap them), the tied word-embedding gradient all-reduced between the first and last stage,
gradients clipped by their global norm, each microbatch's loss averaged over dp (the 2021
``pretrain_gpt.py`` loss_func), on the A100 profile and a Selene-like DGX A100 fat-tree.

``torchtitan-2024``: torchtitan's published H100, H200 and A100 throughput
(validation/torchtitan-2024-h100.csv, tokens/s per GPU). Rows whose source leaves out what
the time depends on (sequence length, pipeline microbatches, TP degree, recompute policy we
cannot express) are simulated with torchtitan's defaults, shown, and left out of the
stated-setup MAPE with the reason.

``vtrain-single-node``: 1,440 Megatron-DeepSpeed layouts on one 8-GPU A100 node
(validation/vtrain-single-node-a100.csv): full recomputation, 1F1B, gradients all-reduced after
the backward without buckets, classic attention, no sequence parallelism. On one node the
flow-level fabric and the alpha-beta network give the same times (every collective is on the
NVSwitch; checked in tests/test_published.py), so these rows use alpha-beta, and each unique
layout is simulated once.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from simulator.data import data_dir
from simulator.errors import UserError
from simulator.scenario import build_scenario
from simulator.simulate import simulate

VALIDATION_DIR = data_dir("validation")
PUBLISHED = {
    "megatron-2021": "megatron-2021-table1.csv",
    "torchtitan-2024": "torchtitan-2024-h100.csv",
    "vtrain-single-node": "vtrain-single-node-a100.csv",
}


@dataclass
class PublishedRow:
    label: str
    gpus: int
    published_step_time_s: float
    predicted_step_time_s: float
    published_tflops_per_gpu: float | None = None
    predicted_tflops_per_gpu: float | None = None  # Megatron: eq. 3 FLOPs / predicted step / GPUs
    stated: bool = True  # the source states every setting the time depends on
    reason: str = ""  # why not stated (shown; the row is left out of the stated-setup figures)
    note: str = ""  # how the row was simulated where it departs from the source's hardware/software
    features: tuple[str, ...] = ()  # what the run used (torchtitan: fsdp-only, tp, cp, pp, float8, compile, ac-...)
    # Peak memory per GPU where the source publishes it (torchtitan: the maximum over GPUs of what
    # its memory monitor logged), and the memory model's peak for the same run.
    published_memory_gib: float | None = None
    predicted_memory_gib: float | None = None

    @property
    def error(self) -> float:
        return (self.predicted_step_time_s - self.published_step_time_s) / self.published_step_time_s

    @property
    def memory_error(self) -> float:
        if self.published_memory_gib is None or self.predicted_memory_gib is None:
            return math.nan
        return (self.predicted_memory_gib - self.published_memory_gib) / self.published_memory_gib


def _mape_and_signed(errors: list[float]) -> tuple[float, float]:
    """(mean |error|, mean error) of relative errors; NaN where there are none."""
    if not errors:
        return math.nan, math.nan
    return sum(abs(e) for e in errors) / len(errors), sum(errors) / len(errors)


@dataclass
class PublishedValidation:
    name: str
    rows: list[PublishedRow]
    notes: list[str] = field(default_factory=list)

    @property
    def stated_rows(self) -> list[PublishedRow]:
        return [r for r in self.rows if r.stated]

    @property
    def mape(self) -> float:
        """Mean |error| over the rows whose setup the source states."""
        return _mape_and_signed([r.error for r in self.stated_rows])[0]

    @property
    def mean_signed_error(self) -> float:
        return _mape_and_signed([r.error for r in self.stated_rows])[1]

    def feature_groups(self) -> dict[str, dict[str, float]]:
        """Per feature (a row may count in several): rows, stated rows, and MAPE / mean signed
        error over all rows and over the stated ones (NaN where none)."""
        out: dict[str, dict[str, float]] = {}
        feats = sorted({f for r in self.rows for f in r.features})
        for f in feats:
            rows = [r for r in self.rows if f in r.features and not math.isnan(r.error)]
            st = [r for r in rows if r.stated]
            m_all, s_all = _mape_and_signed([r.error for r in rows])
            m_st, s_st = _mape_and_signed([r.error for r in st])
            out[f] = {"rows": len(rows), "stated_rows": len(st), "mape_all": m_all, "mean_signed_all": s_all,
                      "mape_stated": m_st, "mean_signed_stated": s_st}
        return out

    @property
    def memory_rows(self) -> list[PublishedRow]:
        """Rows with a published and a predicted peak memory (every such row: memory does not
        depend on the unstated settings the step-time figures leave out, e.g. the fabric)."""
        return [r for r in self.rows if not math.isnan(r.memory_error)]

    @property
    def memory_mape(self) -> float:
        return _mape_and_signed([r.memory_error for r in self.memory_rows])[0]

    @property
    def memory_mean_signed_error(self) -> float:
        return _mape_and_signed([r.memory_error for r in self.memory_rows])[1]

    @property
    def mape_all(self) -> float:
        errs = [abs(r.error) for r in self.rows if not math.isnan(r.error)]
        return sum(errs) / len(errs) if errs else math.nan

    def to_json(self) -> dict:
        def num(x):
            return None if x is None or (isinstance(x, float) and math.isnan(x)) else x

        return {
            "published": self.name,
            "mape": num(self.mape),
            "mean_signed_error": num(self.mean_signed_error),
            "stated_rows": len(self.stated_rows),
            "mape_all_rows": num(self.mape_all),
            "memory_rows": len(self.memory_rows),
            "memory_mape": num(self.memory_mape),
            "memory_mean_signed_error": num(self.memory_mean_signed_error),
            "notes": self.notes,
            "rows": [dict(label=r.label, gpus=r.gpus, published_step_time_s=r.published_step_time_s,
                          predicted_step_time_s=num(r.predicted_step_time_s), step_time_error=num(r.error),
                          published_tflops_per_gpu=r.published_tflops_per_gpu,
                          predicted_tflops_per_gpu=r.predicted_tflops_per_gpu, stated=r.stated, reason=r.reason,
                          note=r.note, features=list(r.features), published_memory_gib=r.published_memory_gib,
                          predicted_memory_gib=r.predicted_memory_gib, memory_error=num(r.memory_error))
                     for r in self.rows],
            "feature_groups": {f: {k: num(x) for k, x in st.items()} for f, st in self.feature_groups().items()},
        }


def group_errors(v: PublishedValidation, key: str) -> dict[int, tuple[int, float, float]]:
    """Stated rows grouped by a layout number in their label (``tp``, ``pp``, ``dp``, ``mb``, ``h``,
    ``L``, ``gb``; ``B`` for Megatron's model size): value -> (rows, mean signed error, MAPE).
    A pattern here (say, errors that grow with pp) points at a cause; a flat one at none."""
    pattern = re.compile(rf"(?:^|\s){re.escape(key)}(\d+)(?:\s|$)" if key != "B" else r"^([\d.]+)B\s")
    groups: dict = {}
    for r in v.stated_rows:
        m = pattern.search(r.label)
        if m is None or math.isnan(r.error):
            continue
        groups.setdefault(float(m.group(1)) if key == "B" else int(m.group(1)), []).append(r.error)
    return {k: (len(e), sum(e) / len(e), sum(map(abs, e)) / len(e)) for k, e in sorted(groups.items())}


def group_errors_by_pair(v: PublishedValidation, key_a: str, key_b: str) -> dict[tuple, tuple[int, float, float]]:
    """Stated rows grouped by two layout numbers at once (say ``tp`` and ``mb``): (a, b) -> (rows,
    mean signed error, MAPE). A trend over one key can be two opposite ones over the other (vTrain:
    the microbatch trend runs the other way at tp 4 than at tp 2); the pair separates them."""
    pa, pb = (re.compile(rf"(?:^|\s){re.escape(k)}(\d+)(?:\s|$)") for k in (key_a, key_b))
    groups: dict = {}
    for r in v.stated_rows:
        ma, mb = pa.search(r.label), pb.search(r.label)
        if ma is None or mb is None or math.isnan(r.error):
            continue
        groups.setdefault((int(ma.group(1)), int(mb.group(1))), []).append(r.error)
    return {k: (len(e), sum(e) / len(e), sum(map(abs, e)) / len(e)) for k, e in sorted(groups.items())}


# --------------------------------------------------------------------------- Megatron SC'21

def megatron_2021_scenario(row: dict[str, str]) -> dict:
    h = int(row["hidden_size"])
    vpp = int(row["vpp"])
    return {
        "name": f"gpt-{row['params_billion']}b",
        "model": {
            "name": f"gpt-{row['params_billion']}b", "num_layers": int(row["num_layers"]), "hidden_size": h,
            "ffn_hidden_size": 4 * h, "num_attention_heads": int(row["num_attention_heads"]), "vocab_size": 51200,
            "mlp": "gelu", "tied_embeddings": True, "learned_position_embeddings": True, "max_position_embeddings": 2048,
        },
        "parallelism": {
            "tp": int(row["tp"]), "pp": int(row["pp"]), "vpp": vpp, "dp": int(row["dp"]), "zero": 0,
            "sequence_parallel": False, "pp_scatter_gather": True, "overlap_grad_reduce": False,
            # p2p_communication._communicate: batch_isend_irecv, wait, torch.cuda.synchronize
            "pp_exchange": "blocking",
            # Megatron-LM 2021: loss_func averages each microbatch's loss over dp; clip-grad 1.0.
            "loss_all_reduce_per_microbatch": True, "grad_clip": True,
            # Megatron-LM 2021 had no gradient-accumulation fusion (2022): its DDP hook adds
            # every microbatch's gradient into main_grad (param.main_grad.add_(param.grad.data)).
            "grad_accumulation_fusion": False,
        },
        "batch": {"micro_batch_size": int(row["micro_batch_size"]), "global_batch_size": int(row["global_batch_size"]),
                  "seq_length": 2048},
        "recompute": "full",
        "framework": "megatron-2021",
        "schedule": "interleaved-1f1b" if vpp > 1 else "1f1b",
        "dtype": "fp16",
        "flash_attention": False,
        "cluster": {"gpus": int(row["gpus"]), "gpu": "a100-sxm-80gb", "topology": "dgx-a100-fattree"},
    }


def _megatron_rows(table: list[dict[str, str]], run) -> list[PublishedRow]:
    rows = []
    for row in table:
        label = f"{row['params_billion']}B tp{row['tp']} pp{row['pp']} dp{row['dp']}"
        rep = run(label, megatron_2021_scenario(row))
        flops = float(row["flops_per_step_eq3"])
        rows.append(PublishedRow(
            label=label, gpus=int(row["gpus"]),
            published_step_time_s=float(row["step_time_s"]), predicted_step_time_s=rep.step_time_s,
            published_tflops_per_gpu=float(row["published_tflops_per_gpu"]),
            predicted_tflops_per_gpu=flops / rep.step_time_s / int(row["gpus"]) / 1e12,
        ))
    return rows


# --------------------------------------------------------------------------- torchtitan

# Llama 2 (Touvron et al. 2023, released config.json): torchtitan's Llama 2 configs.
LLAMA2 = {
    "Llama 2 13B": dict(name="llama2-13b", num_layers=40, hidden_size=5120, ffn_hidden_size=13824,
                        num_attention_heads=40, vocab_size=32000, mlp="swiglu"),
    "Llama 2 70B": dict(name="llama2-70b", num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                        num_attention_heads=64, num_kv_heads=8, vocab_size=32000, mlp="swiglu"),
}
LLAMA3 = {"8B": "llama3-8b", "70B": "llama3-70b", "405B": "llama3-405b"}
# torchtitan's Llama 3 training configs of the time (train_configs/llama3_*.toml): seq_len 8192.
TORCHTITAN_DEFAULT_SEQ = 8192


def _int(cell: str, default: int | None = None) -> int | None:
    cell = (cell or "").strip()
    return int(cell) if cell.isdigit() else default


def torchtitan_scenario(row: dict[str, str]) -> tuple[dict, list[str], list[str]]:
    """(scenario dict, reasons the setup is not fully stated, notes on how it is simulated)."""
    missing: list[str] = []
    notes: list[str] = []
    model_name = row["model"]
    if model_name in LLAMA2:
        model: dict | str = dict(LLAMA2[model_name])
    else:
        model = LLAMA3[model_name.split()[-1]]
    gpus = int(row["num_gpus"])
    tp = _int(row["tp"])
    dp = _int(row["dp"], 1)
    if tp is None:
        tp = gpus // dp
        missing.append(f"TP degree not stated ({gpus}/{dp} = {tp} implied)")
    pp = _int(row["pp"], 1)
    cp = _int(row["cp"], 1)
    seq = _int(row["seq_length"])
    if seq is None:
        seq = TORCHTITAN_DEFAULT_SEQ
        missing.append(f"sequence length not stated (torchtitan default {seq} used)")
    local = _int(row["local_batch_size"], 1)
    rec = row["recompute"]
    if rec.startswith("full"):
        recompute = "full"
    elif rec.startswith("none"):
        recompute = "none"
    elif "granularity not stated" in rec:
        recompute = "selective-op"  # torchtitan's default selective_ac_option at the time: op
        missing.append("activation-checkpointing granularity not stated (per-op SAC, torchtitan's default, used)")
    elif "layer" in rec:
        recompute = "selective-layer"
    else:
        recompute = "selective-op"
    prec = row["precision"]
    fp8 = prec.startswith("fp8")
    fp8_cfg = {}
    if fp8:
        recipe = "rowwise" if "rowwise" in prec else "tensorwise"  # torchao default: tensorwise
        fp8_cfg = {"recipe": recipe, "param_all_gather": "enable_fsdp_float8_all_gather" in row["notes"]}
    sched = row["schedule"].strip()
    if pp > 1:
        missing.append("pipeline microbatch count / virtual stages not stated")
    # The global batch may be left out: torchtitan of 2024 had no gradient accumulation, so every
    # rank runs local_batch_size sequences a step whatever the global figure.
    if gpus > 8 and "Gb/s" not in row["notes"]:
        # More than one 8-GPU node: FSDP (and PP/TP) traffic crosses a fabric the source does not
        # describe (validation/README.md names only the GPU; only the Trainy rows give 400 Gb/s).
        missing.append(f"inter-node fabric not stated ({gpus} GPUs = {gpus // 8} nodes)")
    compile_cell = row["torch_compile"].strip()
    if not compile_cell:
        # Table 1 of the same source shows compile alone worth 14-16% of throughput.
        missing.append("torch.compile not stated")
    gpu_cell = row["gpu"]
    if gpu_cell.startswith("H200"):
        gpu, topo = "h200-sxm-141gb", "dgx-h200"
        notes.append("H200 on DGX H200 fat-tree (400 Gb/s per GPU stated)")
    elif gpu_cell.startswith("A100"):
        gpu, topo = "a100-sxm-80gb", "dgx-a100-fattree"
        notes.append("A100 80GB on the DGX A100 fat-tree (8 x 200 Gb/s HDR per node; assumed)")
    else:
        # Meta's H100 variant (96 GB HBM2e at 2.4 TB/s: torchao's roofline table; the profile
        # cites it). Its 500 W limit is not modelled as a lower clock: no source gives one, and
        # torchao measured large GEMMs on it at 0.78 of peak, as on SXM parts.
        gpu, topo = "h100-hbm2e-96gb", "dgx-h100-fattree"
        notes.append("H100 96GB HBM2e (Meta's variant, 2.4 TB/s) on the DGX H100 fat-tree; its 500 W limit not modelled")
    if compile_cell != "yes":
        notes.append("eager kernels (torchtitan default compile off where not stated): RMSNorm, SwiGLU, RoPE unfused")
    async_tp = row["async_tp"].strip() == "yes"
    if async_tp:
        notes.append("async TP: micro-pipelined all-gather/reduce-scatter GEMMs (torch symmetric memory)")
    if cp > 1:
        notes.append("CP: K/V all-gathered (torchtitan's default rotate method)")
    model_ranks = tp * pp * cp
    dp = gpus // model_ranks
    sc = {
        "name": row["table"],
        "model": model,
        "parallelism": {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "zero": 3, "sequence_parallel": tp > 1,
                        "async_tp": async_tp and tp > 1, "cp_attention": "allgather", "overlap_grad_reduce": True,
                        # torchtitan keeps FSDP units gathered from forward to backward under PP (no
                        # all-gather per microbatch): distributed/fsdp.py (0.3.0) policy "default" =
                        # not pp_enabled.
                        "fsdp_reshard_after_forward": pp == 1},
        # FSDP: every DP rank takes local_batch sequences; a pipeline splits them into as many
        # microbatches as it has stages (set below), torchtitan's default of the time.
        "batch": {"micro_batch_size": local, "global_batch_size": local * dp, "seq_length": seq},
        "recompute": recompute,
        "schedule": "interleaved-1f1b" if "Interleaved" in sched else "1f1b",
        "dtype": "fp8" if fp8 else "bf16",
        "flash_attention": True,
        # torchtitan calls F.scaled_dot_product_attention; on H100/H200 its flash backend is
        # FlashAttention-2. Read from torchtitan 0.1.0 (PyPI, mid-2025, the era of the async-TP
        # and Trainy rows): models/attention.py puts FLASH_ATTENTION first and cuDNN first only
        # on B200. The Dec 2024 runs: PyTorch's context-parallel attention handles the flash and
        # efficient SDPA ops (torch 2.6.0 distributed/tensor/experimental/_attention.py); flash is
        # first in SDPA's default order (torch 2.13; 2.6's is C++, not read) and takes torchtitan's
        # bf16 head-dim-128 causal call (docs/design-notes.md);
        # the Dec 2024 non-CP rows took the torch nightly's default order, not checked here
        # (those rows are not stated anyway). On A100 the profile's attention figures are FA2's.
        "attention_kernel": "fa2",
        # torchtitan's RoPE, repeat_kv and FSDP2 copy-out kernels; eager RMSNorm / SwiGLU / RoPE
        # without compile (torchtitan 0.1.0 config_manager.py Training.compile: bool = False).
        "framework": "torchtitan",
        "torch_compile": compile_cell == "yes",
        # The 2024 runs left the loss eager (train.py of that time: "compiling loss function
        # causes CUDA errors, turning off for now"); torchtitan 0.1.0 (2025) compiles it with the
        # model (components/loss.py build_cross_entropy_loss), as the 2025 rows ran.
        "compile_loss": compile_cell == "yes" and "2025" in row["source_file"],
        # The torch each source ran, for what eager mode fuses (RMSNorm from 2.9): Aug 2024's
        # docs/performance.md a 2.5 nightly, Dec 2024's benchmark torch 1963fc8 (a 2.6 nightly),
        # the June 2025 files 2.8 (the Trainy rows name 2.8.0a0+5228986c39).
        "torch_version": "2.8" if "2025" in row["source_file"] else "2.6" if "202412" in row["source_file"] else "2.5",
        "cluster": {"gpus": gpus, "gpu": gpu, "topology": topo},
    }
    if fp8_cfg:
        sc["fp8"] = fp8_cfg
    if pp > 1 and "Interleaved" in sched:
        sc["parallelism"]["vpp"] = 2
    if pp > 1:
        # torchtitan of Dec 2024 (build_pipeline_schedule): n_microbatches =
        # experimental.pipeline_parallel_microbatches, "the number of pipeline stages, if
        # unspecified" (pp x stages per rank); the source states none. Was one sequence a
        # microbatch (32 of them for the 405B 1F1B row: bubble 7/39 where the default's is 7/15).
        stages = pp * sc["parallelism"].get("vpp", 1)
        sc["batch"]["micro_batch_size"] = max(1, local // stages) if local % stages == 0 else 1
    return sc, missing, notes


def torchtitan_features(row: dict[str, str], sc: dict) -> tuple[str, ...]:
    """What a torchtitan row used, for errors grouped by feature."""
    p = sc["parallelism"]
    f = []
    if p["tp"] == 1 and p["pp"] == 1 and p["cp"] == 1:
        f.append("fsdp-only")
    f += [name for name, on in (("tp", p["tp"] > 1), ("async-tp", row["async_tp"].strip() == "yes"), ("pp", p["pp"] > 1),
                                ("cp", p["cp"] > 1), ("float8", sc["dtype"] == "fp8"),
                                ("compile", row["torch_compile"].strip() == "yes")) if on]
    f.append(f"ac-{sc['recompute']}")
    f.append("a100" if sc["cluster"]["gpu"].startswith("a100") else "h200" if sc["cluster"]["gpu"].startswith("h200")
             else "h100")
    return tuple(f)


def _torchtitan_rows(table: list[dict[str, str]], run, stated_only: bool = False) -> list[PublishedRow]:
    rows = []
    for row in table:
        sc, missing, notes = torchtitan_scenario(row)
        gpus = int(row["num_gpus"])
        label = f"{row['model']}: {row['table']}"
        tps = float(row["measured_value"])
        tokens_per_gpu = sc["batch"]["global_batch_size"] * sc["batch"]["seq_length"] / gpus
        feats = torchtitan_features(row, sc)
        if stated_only and missing:
            continue
        try:
            rep = run(label, sc)
            predicted = rep.step_time_s
        except UserError as exc:
            rows.append(PublishedRow(label, gpus, tokens_per_gpu / tps, math.nan, stated=False,
                                     reason=f"not simulable: {exc}", note="; ".join(notes), features=feats))
            continue
        mem_cell = row.get("peak_memory_gib", "").strip()
        rows.append(PublishedRow(
            label=label, gpus=gpus, published_step_time_s=tokens_per_gpu / tps, predicted_step_time_s=predicted,
            stated=not missing, reason="; ".join(missing), note="; ".join(notes), features=feats,
            published_memory_gib=float(mem_cell) if mem_cell else None, predicted_memory_gib=rep.peak_memory_gib,
        ))
    return rows


# --------------------------------------------------------------------------- vTrain

# Megatron-DeepSpeed pads the GPT-2 BPE vocabulary (50,257) to a multiple of 128 x tp
# (--make-vocab-size-divisible-by 128).
GPT2_VOCAB = 50257


def vtrain_scenario(row: dict[str, str]) -> dict:
    h = int(row["hidden size"])
    tp, pp, dp = int(row["tensor parallelism"]), int(row["pipeline parallelism"]), int(row["data parallelism"])
    seq = int(row["sequence length"])
    multiple = 128 * tp
    vocab = -(-GPT2_VOCAB // multiple) * multiple
    return {
        "name": "vtrain",
        "model": {"name": f"gpt-h{h}-l{row['# layers']}", "num_layers": int(row["# layers"]), "hidden_size": h,
                  "ffn_hidden_size": 4 * h, "num_attention_heads": int(row["attention heads"]), "vocab_size": vocab,
                  "mlp": "gelu", "tied_embeddings": True, "learned_position_embeddings": True,
                  "max_position_embeddings": seq},
        "parallelism": {"tp": tp, "pp": pp, "dp": dp, "zero": 0, "sequence_parallel": False,
                        "overlap_grad_reduce": False, "loss_all_reduce_per_microbatch": True, "grad_clip": True,
                        # DeepSpeed's engine (ZeRO 0) accumulates fp16 gradients in .grad through
                        # autograd's AccumulateGrad: one add per parameter per microbatch.
                        "grad_accumulation_fusion": False},
        "batch": {"micro_batch_size": int(row["micro batch"]), "global_batch_size": int(row["global batch"]),
                  "seq_length": seq},
        "recompute": "full", "schedule": "1f1b", "dtype": "fp16", "flash_attention": False,
        "framework": "megatron-deepspeed",
        # One node: the alpha-beta network gives the flow fabric's times (all on NVSwitch).
        "network": "alpha-beta",
        "cluster": {"gpus": int(row["# GPUs"]), "gpu": "a100-sxm-80gb", "topology": "dgx-a100-fattree"},
    }


def _vtrain_rows(table: list[dict[str, str]], run) -> list[PublishedRow]:
    rows = []
    for row in table:
        label = (f"h{row['hidden size']} L{row['# layers']} tp{row['tensor parallelism']} dp{row['data parallelism']} "
                 f"pp{row['pipeline parallelism']} mb{row['micro batch']} gb{row['global batch']}")
        rep = run(label, vtrain_scenario(row))
        # The error by regime and layout: where the modelled step waits on kernel launches for
        # HOST_BOUND_SHARE of it or more, the run is host-bound (simulator.report.analysis).
        host = rep.step_breakdown_s.get("host_launch", 0.0) / rep.step_time_s if rep.step_time_s > 0 else 0.0
        feats = ("host-bound" if host >= HOST_BOUND_SHARE else "device-bound", f"tp{row['tensor parallelism']}",
                 f"pp{row['pipeline parallelism']}", f"mb{row['micro batch']}")
        rows.append(PublishedRow(label, int(row["# GPUs"]), float(row["iteration time (ms)"]) / 1e3, rep.step_time_s,
                                 features=feats))
    return rows


# A step whose modelled device waits on kernel launches for this share of it counts as host-bound.
HOST_BOUND_SHARE = 0.25


# --------------------------------------------------------------------------- driver

SET_NOTES = {
    "megatron-2021": ["A100 80GB, Selene-like DGX A100 fat-tree; every setting from the paper and run_table_1.sh"],
    "torchtitan-2024": ["error = predicted / published step time - 1, with published step time = tokens per GPU per "
                        "step / published tokens/s per GPU",
                        # torchtitan 0.3.0 (PyPI), torchtitan/components/metrics.py: the log line prints
                        # device_mem_stats.max_reserved_gib, torch.cuda.memory_stats()["reserved_bytes.all.peak"].
                        "published memory is torchtitan's logged max_reserved (the caching allocator's segments, cached "
                        "free blocks included); predicted memory is the peak of live bytes plus a 1 GiB runtime reserve, "
                        "so it reads low by the allocator's fragmentation"],
    "vtrain-single-node": ["precision not stated (fp16 assumed; A100 FP16 and BF16 peaks are equal)",
                           "vocabulary not stated (GPT-2 BPE padded to 128 x tp assumed)",
                           "alpha-beta network: equal to the flow fabric on one NVSwitch node",
                           "rows are composed, not each timed: exactly linear in layers and microbatches within a "
                           "layout group, 24 layer times under the rows at micro batch 1-4 "
                           "(simulator.calibrate.composition; the bench prints the terms)"],
}


def published_set_name(name: str) -> str:
    """The set's name for NAME, which may also be its shipped file's stem (megatron-2021-table1)."""
    if name in PUBLISHED:
        return name
    for key, file in PUBLISHED.items():
        if name == Path(file).stem:
            return key
    raise UserError(f"unknown published set {name!r}: use one of {', '.join(PUBLISHED)}")


def read_table(name: str) -> list[dict[str, str]]:
    if name not in PUBLISHED:
        raise UserError(f"unknown published set {name!r}: use one of {', '.join(PUBLISHED)}")
    path = VALIDATION_DIR / PUBLISHED[name]
    # vTrain's CSV is copied byte for byte: a UTF-8 BOM and CRLF line ends.
    with path.open(encoding="utf-8-sig", newline="") as f:
        return list(csv.DictReader(f))


def simulate_row(data: dict, fast_forward: bool = True):
    """One row's scenario as ``validate --published`` simulates it (bench/bench_published_rows.py
    times this): the steady-state fast path (exact to float rounding where it verifies, else the
    plain run), for the report's figures only: no critical path and no rows for the replayed
    periods, neither of which validation reports (on the 1T row the walk took 0.5 s and the rows
    ~1.3 s of 5 s)."""
    return simulate(build_scenario(data), fast_forward=fast_forward, with_critical_path=False, rows=False)


def validate_published(name: str, progress: Callable[[str], None] | None = None,
                       limit: int | None = None, stated_only: bool = False) -> PublishedValidation:
    """Simulate every row (each unique scenario once); ``progress`` hears about each simulation.
    ``limit``: only the first rows (tests). ``stated_only`` (torchtitan-2024): simulate only the
    rows whose setup the source states (the stated-setup figures are the same)."""
    table = read_table(name)
    if limit is not None:
        table = table[:limit]
    cache: dict[str, object] = {}
    n = len(table)

    def run(label: str, data: dict):
        # Rows that differ only in what is not modelled (async TP, torch.compile) share a run.
        key = json.dumps({k: v for k, v in data.items() if k != "name"}, sort_keys=True)
        rep = cache.get(key)
        if rep is None:
            if progress is not None:
                progress(f"[{len(cache) + 1}/{n}] {label}")
            rep = cache[key] = simulate_row(data).report
        return rep

    builder = {"megatron-2021": _megatron_rows, "torchtitan-2024": _torchtitan_rows, "vtrain-single-node": _vtrain_rows}[name]
    rows = builder(table, run, stated_only=True) if stated_only and name == "torchtitan-2024" else builder(table, run)
    return PublishedValidation(name, rows, list(SET_NOTES[name]))


def print_published(v: PublishedValidation, max_rows: int | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=200)
    t = Table(title=f"{v.name}: predicted vs published step time (stated-setup MAPE {v.mape:.1%}, "
                    f"mean signed error {v.mean_signed_error:+.1%}, {len(v.stated_rows)}/{len(v.rows)} rows)")
    cols = ["run", "GPUs", "published s", "predicted s", "error"]
    tflops = any(r.published_tflops_per_gpu is not None for r in v.rows)
    if tflops:
        cols += ["published TFLOP/s per GPU", "predicted TFLOP/s per GPU"]
    memory = bool(v.memory_rows)
    if memory:
        cols += ["published GiB", "predicted GiB", "memory error"]
    setup = any(not r.stated or r.note for r in v.rows)
    if setup:
        cols += ["setup"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("run", "setup") else "right", overflow="fold")
    shown = v.rows if max_rows is None else v.rows[:max_rows]
    for r in shown:
        cells = [r.label + ("" if r.stated else " *"), str(r.gpus), f"{r.published_step_time_s:.3f}",
                 f"{r.predicted_step_time_s:.3f}", f"{r.error:+.1%}"]
        if tflops:
            cells += [f"{r.published_tflops_per_gpu:.0f}", f"{r.predicted_tflops_per_gpu:.0f}"]
        if memory:
            m_ok = not math.isnan(r.memory_error)
            cells += [f"{r.published_memory_gib:.1f}" if r.published_memory_gib is not None else "-",
                      f"{r.predicted_memory_gib:.1f}" if m_ok else "-", f"{r.memory_error:+.1%}" if m_ok else "-"]
        if setup:
            cells.append(("not stated: " + r.reason if not r.stated else "") + (("; " if not r.stated else "") + r.note if r.note else ""))
        t.add_row(*cells)
    con.print(t)
    if max_rows is not None and len(v.rows) > max_rows:
        con.print(f"({len(v.rows) - max_rows} more rows: --rows 0 prints them all, --json lists them all)")
    if any(not r.stated for r in v.rows):
        con.print("* setup not fully stated by the source: shown, left out of the stated-setup MAPE and mean error")
    groups = v.feature_groups()
    if groups:
        g = Table(title=f"{v.name}: error by feature (a row counts under each feature it used)")
        for col in ("feature", "rows", "MAPE", "mean signed", "stated rows", "stated MAPE", "stated mean signed"):
            g.add_column(col, justify="left" if col == "feature" else "right")

        def pct(x: float) -> str:
            return "-" if math.isnan(x) else f"{x:+.1%}"

        for f, st in groups.items():
            g.add_row(f, str(st["rows"]), pct(st["mape_all"]).lstrip("+"), pct(st["mean_signed_all"]),
                      str(st["stated_rows"]), pct(st["mape_stated"]).lstrip("+"), pct(st["mean_signed_stated"]))
        con.print(g)
    for note in v.notes:
        con.print(f"note: {note}")
    con.print(f"{v.name}: MAPE {v.mape:.1%}, mean signed error {v.mean_signed_error:+.1%} over {len(v.stated_rows)} stated rows "
              f"(all {len(v.rows)} rows: MAPE {v.mape_all:.1%})")
    if memory:
        con.print(f"{v.name}: peak memory MAPE {v.memory_mape:.1%}, mean signed error {v.memory_mean_signed_error:+.1%} "
                  f"over the {len(v.memory_rows)} rows that publish it (predicted: the memory model's peak per GPU)")
