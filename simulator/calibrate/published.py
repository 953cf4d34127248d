"""Validation against published runs: simulate each row of a published table and compare.

``megatron-2021``: Narayanan et al. SC'21 Table 1 (validation/megatron-2021-table1.csv). Every
row is described as the paper describes its runs, with nothing tuned to the table: GPT models
(GELU MLP of 4h, learned positions, vocabulary 51,200, sequence 2048), fp16 mixed precision,
full activation recomputation, the (interleaved) pipeline schedule with the scatter/gather
optimisation, tensor parallelism without sequence parallelism (it came in 2022), attention
without FlashAttention (2022), data-parallel gradients all-reduced after the backward pass (the
2021 code did not overlap them), on the A100 profile and a Selene-like DGX A100 fat-tree.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from simulator.data import data_dir
from simulator.errors import UserError
from simulator.scenario import build_scenario
from simulator.simulate import simulate

VALIDATION_DIR = data_dir("validation")
PUBLISHED = {"megatron-2021": "megatron-2021-table1.csv"}


@dataclass
class PublishedRow:
    label: str
    gpus: int
    published_step_time_s: float
    predicted_step_time_s: float
    published_tflops_per_gpu: float
    predicted_tflops_per_gpu: float  # eq. 3 FLOPs (recomputation counted) / predicted step / GPUs

    @property
    def error(self) -> float:
        return (self.predicted_step_time_s - self.published_step_time_s) / self.published_step_time_s


@dataclass
class PublishedValidation:
    name: str
    rows: list[PublishedRow]

    @property
    def mape(self) -> float:
        return sum(abs(r.error) for r in self.rows) / len(self.rows)

    def to_json(self) -> dict:
        return {
            "published": self.name,
            "mape": self.mape,
            "rows": [dict(label=r.label, gpus=r.gpus, published_step_time_s=r.published_step_time_s,
                          predicted_step_time_s=r.predicted_step_time_s, step_time_error=r.error,
                          published_tflops_per_gpu=r.published_tflops_per_gpu,
                          predicted_tflops_per_gpu=r.predicted_tflops_per_gpu) for r in self.rows],
        }


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
        },
        "batch": {"micro_batch_size": int(row["micro_batch_size"]), "global_batch_size": int(row["global_batch_size"]),
                  "seq_length": 2048},
        "recompute": "full",
        "schedule": "interleaved-1f1b" if vpp > 1 else "1f1b",
        "dtype": "fp16",
        "flash_attention": False,
        "cluster": {"gpus": int(row["gpus"]), "gpu": "a100-sxm-80gb", "topology": "dgx-a100-fattree"},
    }


def validate_published(name: str, progress=None) -> PublishedValidation:
    """Simulate every row; ``progress`` (a callable taking one line) hears about each row."""
    if name not in PUBLISHED:
        raise UserError(f"unknown published set {name!r}: use one of {', '.join(PUBLISHED)}")
    path = VALIDATION_DIR / PUBLISHED[name]
    rows = []
    with path.open() as f:
        table = list(csv.DictReader(f))
        for i, row in enumerate(table, 1):
            sc = build_scenario(megatron_2021_scenario(row))
            if progress is not None:
                progress(f"[{i}/{len(table)}] {sc.name}: {row['gpus']} GPUs, tp{row['tp']} pp{row['pp']} dp{row['dp']}")
            rep = simulate(sc).report
            flops = float(row["flops_per_step_eq3"])
            rows.append(PublishedRow(
                label=f"{row['params_billion']}B tp{row['tp']} pp{row['pp']} dp{row['dp']}", gpus=int(row["gpus"]),
                published_step_time_s=float(row["step_time_s"]), predicted_step_time_s=rep.step_time_s,
                published_tflops_per_gpu=float(row["published_tflops_per_gpu"]),
                predicted_tflops_per_gpu=flops / rep.step_time_s / int(row["gpus"]) / 1e12,
            ))
    return PublishedValidation(name, rows)


def print_published(v: PublishedValidation) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{v.name}: predicted vs published step time (MAPE {v.mape:.1%})")
    for col in ("run", "GPUs", "published s", "predicted s", "error", "published TFLOP/s", "predicted TFLOP/s"):
        t.add_column(col, justify="right")
    for r in v.rows:
        t.add_row(r.label, str(r.gpus), f"{r.published_step_time_s:.2f}", f"{r.predicted_step_time_s:.2f}",
                  f"{r.error:+.1%}", f"{r.published_tflops_per_gpu:.0f}", f"{r.predicted_tflops_per_gpu:.0f}")
    Console().print(t)
