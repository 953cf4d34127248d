"""`clustersim`: capture, calibrate, simulate, validate, trace, collective.

Only this module writes files. Bad input prints one line (``error: ...``) and exits with 2.
Results go to stdout (a rich summary, or exactly one JSON object with --json); progress and
logs go to stderr.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import warnings
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from simulator.errors import RunFailed, UserError
from simulator.progress import progress, progress_wanted, with_progress
from simulator.words import plural
from simulator.files import HTML_SUFFIXES, check_outputs, write_atomic
from simulator.schedules.registry import schedule_names

# (from the registry: a new schedule shows in --help without a second list to keep)
_SCHEDULE_CHOICES = ", ".join(f"{n} (default)" if n == "1f1b" else n for n in schedule_names())


def _fold_long_option_names() -> None:
    """--help wraps an option's names instead of cutting them (--tp,--tensor-model… at 80
    columns): typer renders them in a table column with rich's default overflow, ellipsis."""
    import typer.rich_utils as rich_utils

    for attr in ("highlighter", "negative_highlighter"):
        base = getattr(rich_utils, attr, None)
        if base is None or getattr(base, "_folds", False):
            continue

        class Folding(type(base)):  # type: ignore[misc]
            _folds = True

            def __call__(self, text):
                # a space after each comma lets the names wrap between aliases
                out = super().__call__(text.replace(",", ", ") if isinstance(text, str) else text)
                out.overflow = "fold"
                return out

        setattr(rich_utils, attr, Folding())


def _fold_when_help_is_drawn() -> None:
    # typer imports its rich help renderer (rich_utils: markdown, pygments; ~0.15 s) only to draw
    # help or an error; folding at import made every run pay for it. Fold just before help is drawn.
    import typer.core

    for cls in (typer.core.TyperCommand, typer.core.TyperGroup):
        if getattr(cls.format_help, "_folds", False):
            continue
        draw = cls.format_help

        def format_help(self, ctx, formatter, _draw=draw):
            _fold_long_option_names()
            return _draw(self, ctx, formatter)

        format_help._folds = True
        cls.format_help = format_help


_fold_when_help_is_drawn()

app = typer.Typer(
    name="clustersim",
    help="Trace-driven simulator of GPU clusters for LLM training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from simulator.version import package_version

        print(f"clustersim {package_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", "-V", help="Print the version and exit.", is_eager=True,
                                 callback=_print_version),
) -> None:
    """Capture traces, calibrate profiles, simulate training steps at scale, validate predictions."""


def _register_subcommands() -> None:
    # Each command module imports its heavy dependencies (torch for capture) inside the command.
    from simulator.calibrate.cli import calibrate_command
    from simulator.calibrate.validate import validate_command
    from simulator.capture.cli import capture_command
    from simulator.network.cli import collective_command
    from simulator.report.compare import compare_command
    from simulator.sweep.cli import sweep_command
    from simulator.trace.cli import trace_app

    # Long-running commands show a spinner on a terminal (simulator.progress); simulate, compare
    # and sweep show their own phases. Under torchrun every rank runs capture: none shows one.
    app.command("capture", help="Capture a trace bundle from a real torch run (gloo on CPU, NCCL on GPUs).")(
        with_progress("capture: running the ranks", capture_command, when=lambda kw: "RANK" not in os.environ)
    )
    app.command("calibrate", help="Fit a GPU profile (compute and communication cost models) from traces.")(
        with_progress("calibrate", calibrate_command)
    )
    app.command("validate", help="Compare the simulator with a captured bundle, or with a published table (--published).")(
        with_progress("validate", validate_command)
    )
    app.command("sweep", help="Search parallel layouts: estimate the whole space, simulate the best, Pareto dashboard.")(sweep_command)
    app.command("compare", help="Two scenarios or reports side by side: the what-if dashboard.")(compare_command)

    app.command("collective", help="Simulated nccl-tests: time, algbw and busbw of one collective over message sizes.")(
        collective_command
    )
    for info in trace_app.registered_commands:  # a large Kineto trace takes seconds to read
        info.callback = with_progress(f"trace {info.name or info.callback.__name__}", info.callback)
    app.add_typer(trace_app, name="trace", help="Inspect traces: a bundle, a Kineto file, a folder of them, or an nccl-tests log.")


_register_subcommands()


class SimMode(str, Enum):
    reduced = "reduced"
    full = "full"
    every_rank = "every-rank"


class Recompute(str, Enum):
    # every value Scenario.recompute takes (the YAML's selective-op / selective-layer were refused here)
    none = "none"
    selective = "selective"
    full = "full"
    selective_op = "selective-op"
    selective_layer = "selective-layer"


class Framework(str, Enum):
    # every value Scenario.framework takes
    generic = "generic"
    megatron_2021 = "megatron-2021"
    megatron_deepspeed = "megatron-deepspeed"
    torchtitan = "torchtitan"


class Dtype(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"
    fp8 = "fp8"
    # torch's names (collective -d takes nccl-tests' bfloat16 / float16 / float32): the same precisions
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


# torch's dtype names -> the scenario's
_DTYPE_OF = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def _text_field(key: str) -> bool:
    """A scenario field only text fills (name, schedule, torch_version): its --set value stays as
    written, where YAML would read 2.10 as the number 2.1 or 2024 as an int."""
    from simulator.scenario import Scenario

    field = Scenario.model_fields.get(key)
    return field is not None and field.annotation in (str, str | None)


def _parse_set(values: list[str]) -> dict:
    """--set section.key=value, value parsed as YAML (numbers, booleans, lists)."""
    import yaml

    out = {}
    for item in values:
        if "=" not in item:
            raise UserError(f"--set {item!r} is not KEY=VALUE: write e.g. --set parallelism.zero=3")
        key, raw = item.split("=", 1)
        if not key.strip() or any(not part for part in key.strip().split(".")):
            raise UserError(f"--set {item!r} names no field: write e.g. --set parallelism.zero=3")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise UserError(f"--set {item!r}: the value is not valid YAML: quote it") from None
        if value is None:
            # Dropping it silently would simulate something the user did not ask for.
            raise UserError(f"--set {item!r} gives no value: write --set {key.strip()}=VALUE")
        if _text_field(key.strip()) and not isinstance(value, str):
            out[key.strip()] = raw.strip()  # 2.10 as written, not the number YAML reads
            continue
        if isinstance(value, str) and re.fullmatch(r"[+-]?\d+(\.\d*)?[eE][+-]?\d+", value.strip()):
            # YAML 1.1 reads 1e8 as a string; a user means the number (a whole one stays an int).
            number = float(value)
            value = int(number) if number.is_integer() and abs(number) < 2**63 else number
        out[key.strip()] = value
    return out


# ---------------------------------------------------------------------------------------------
# simulate
# ---------------------------------------------------------------------------------------------


def _note_uneven_layer_split(sc) -> None:
    """Say so when the layers do not split evenly over the pipeline positions (pp x vpp) and no
    split was given: the first and last positions get fewer (split_layers), which Megatron's
    --num-layers-per-virtual-pipeline-stage would refuse and which shows up as stage imbalance."""
    p = sc.parallelism
    positions = p.pp * p.vpp
    if positions <= 1 or p.pp_layer_split is not None or p.account_for_embedding_in_pipeline_split \
            or p.account_for_loss_in_pipeline_split or sc.schedule_file:
        return
    layers = sc.model.num_layers
    if layers % positions == 0:
        return
    from simulator.workload.program import split_layers

    counts = [len(x) for x in split_layers(layers, positions)]
    shown = str(counts) if positions <= 32 else f"{min(counts)} to {max(counts)} each"
    even = [str(v) for v in range(2, layers // p.pp + 1) if layers % (p.pp * v) == 0][:4]
    other = f"vpp {' or '.join(filter(None, [', '.join(even[:-1]), even[-1]]))} splits evenly, or " if even else ""
    _stderr(f"note: {layers} layers do not split evenly over pp x vpp = {positions} pipeline positions: {shown} "
            f"layers, the ends short; {other}--set parallelism.pp_layer_split=[...] chooses the split")

def _note_sliding_window(sc) -> None:
    """Say so when the model's config asks for sliding-window attention over fewer tokens than a
    sequence: attention is simulated full-causal (its time and model FLOPs over-counted there)."""
    w = sc.model.sliding_window
    if w is not None and sc.batch.seq_length > w:
        _stderr(f"note: sliding_window={w} in the model config is not modelled: attention is simulated full-causal over "
                f"seq_length={sc.batch.seq_length} tokens, so its time and FLOPs are over-counted (seq_length ≤ {w} "
                "is unaffected)")


# First-class what-if flags -> the topology / profile field they override (the same path works
# with --set; a named topology or profile becomes a mapping before the change).
WHAT_IF_FIELDS = {
    "nic_gbps": "cluster.topology.node.nic_gbps",
    "nvlink_GBps": "cluster.topology.node.nvlink_GBps",
    "leaf_oversubscription": "cluster.topology.fabric.leaf_oversubscription",
    "spine_oversubscription": "cluster.topology.fabric.spine_oversubscription",
    "peak_tflops": "cluster.gpu.compute.peak_tflops",
    "hbm_GBps": "cluster.gpu.compute.hbm_GBps",
    "hbm_gib": "cluster.gpu.hbm_gib",
}

DEFAULT_ZERO_HELP = "default 1: optimizer state sharded over dp, as Megatron's distributed optimizer; `capture` uses the same default"
_DASHBOARD_DEFAULT = "\0default"  # --dashboard given without a path


class _OptionalValueCommand(typer.core.TyperCommand):
    """Lets ``--dashboard`` stand alone (default path) or take a path: click options cannot have an
    optional value, so a bare ``--dashboard`` gets a sentinel before parsing."""

    optional_value_flags = ("--dashboard",)

    def parse_args(self, ctx, args):
        out = []
        for i, a in enumerate(args):
            out.append(a)
            nxt = args[i + 1] if i + 1 < len(args) else None
            if a in self.optional_value_flags and (nxt is None or nxt.startswith("-")):
                out.append(_DASHBOARD_DEFAULT)
        return super().parse_args(ctx, out)


def _megatron_vpp(sc, layers_per_chunk: int) -> int:
    """Megatron's --num-layers-per-virtual-pipeline-stage: vpp = num_layers / (pp x that)."""
    pp, layers = sc.parallelism.pp, sc.model.num_layers
    if layers_per_chunk < 1:
        raise UserError(f"--num-layers-per-virtual-pipeline-stage {layers_per_chunk} must be at least 1 (layers per "
                        "model chunk)")
    if layers % (pp * layers_per_chunk):
        raise UserError(
            f"--num-layers-per-virtual-pipeline-stage {layers_per_chunk}: num_layers={layers} is not divisible by "
            f"pp*{layers_per_chunk}={pp * layers_per_chunk}: choose a divisor of {layers // pp if layers % pp == 0 else layers}"
        )
    return layers // (pp * layers_per_chunk)


@app.command(cls=_OptionalValueCommand)
def simulate(
    scenario: Optional[Path] = typer.Argument(None, help="Scenario YAML; the built-in Llama-3-70B / 1,024 H100 default when omitted."),
    # --- what runs where
    model: Optional[str] = typer.Option(None, "--model", help="Model preset (llama3-8b, llama3-70b, llama3-405b, gpt3-175b, mixtral-8x7b, deepseek-v3, ...) or a HuggingFace config.json. Default: the scenario's; built-in llama3-70b.", rich_help_panel="Model and cluster"),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU profile: a shipped name (h100-sxm-80gb, h200-sxm-141gb, b200, gb200, a100-sxm-80gb, ...) or a path to a profile JSON. Default: the scenario's; built-in h100-sxm-80gb.", rich_help_panel="Model and cluster"),
    topology: Optional[str] = typer.Option(None, "--topology", help="Topology: a shipped name (dgx-h100-fattree, dgx-h100-rail, gb200-nvl72, ...) or a path to a topology YAML. Default: the scenario's; built-in dgx-h100-fattree.", rich_help_panel="Model and cluster"),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs in the job (= tp x cp x pp x dp). Default: the scenario's; built-in 1024.", rich_help_panel="Model and cluster"),
    # --- parallel layout (Megatron-LM's long names work too)
    tp: Optional[int] = typer.Option(None, "--tp", "--tensor-model-parallel-size", help="Tensor-parallel size: GPUs that split each layer's matrices. Default: the scenario's; built-in 8.", rich_help_panel="Parallelism"),
    pp: Optional[int] = typer.Option(None, "--pp", "--pipeline-model-parallel-size", help="Pipeline-parallel size: stages the layers are split into. Default: the scenario's; built-in 8.", rich_help_panel="Parallelism"),
    vpp: Optional[int] = typer.Option(None, "--vpp", "--virtual-pipeline-model-parallel-size", help="Virtual pipeline stages (model chunks) per pipeline rank; > 1 selects interleaved-1f1b unless --schedule is given.", rich_help_panel="Parallelism"),
    layers_per_virtual_stage: Optional[int] = typer.Option(None, "--num-layers-per-virtual-pipeline-stage", help="Megatron's way to give vpp: layers per model chunk; vpp = num_layers / (pp x this).", rich_help_panel="Parallelism"),
    cp: Optional[int] = typer.Option(None, "--cp", "--context-parallel-size", help="Context-parallel size: GPUs that split each sequence (default 1).", rich_help_panel="Parallelism"),
    ep: Optional[int] = typer.Option(None, "--ep", "--expert-model-parallel-size", help="Expert-parallel size (MoE), folded over dp x cp, and tp under sequence parallelism with etp 1 (default 1).", rich_help_panel="Parallelism"),
    etp: Optional[int] = typer.Option(None, "--etp", "--expert-tensor-parallel-size", help="Expert tensor parallelism (MoE): 1 keeps experts whole, tp splits each over the tp group (default 1; megatron-core's own default is tp).", rich_help_panel="Parallelism"),
    dp: Optional[int] = typer.Option(None, "--dp", "--data-parallel-size", help="Data-parallel size; derived as gpus / (tp x cp x pp) when omitted.", rich_help_panel="Parallelism"),
    zero: Optional[int] = typer.Option(None, "--zero", help=f"ZeRO stage: 0 replicated (DDP), 1 + optimizer sharded, 2 + gradients, 3 + parameters (FSDP); {DEFAULT_ZERO_HELP}.", rich_help_panel="Parallelism"),
    sequence_parallel: Optional[bool] = typer.Option(None, "--sequence-parallel/--no-sequence-parallel", help="Megatron sequence parallelism with tp > 1 (default on).", rich_help_panel="Parallelism"),
    async_tp: Optional[bool] = typer.Option(None, "--async-tp/--no-async-tp", help="Async (micro-pipelined) TP, torchtitan's enable_async_tensor_parallel: sequence-parallel gathers and reduce-scatters overlap chunks of their GEMMs (default off).", rich_help_panel="Parallelism"),
    tp_comm_overlap: Optional[bool] = typer.Option(None, "--tp-comm-overlap/--no-tp-comm-overlap", help="Megatron's TP communication overlap (Transformer Engine userbuffers): sequence-parallel gathers and reduce-scatters overlap the TP GEMMs (default off).", rich_help_panel="Parallelism"),
    # --- batch
    micro_batch_size: Optional[int] = typer.Option(None, "--micro-batch-size", help="Sequences per microbatch per data-parallel rank (default 1).", rich_help_panel="Batch"),
    global_batch_size: Optional[int] = typer.Option(None, "--global-batch-size", help="Sequences per optimizer step, all data-parallel ranks together (tokens = this x seq-length). Default: the scenario's; built-in 2048.", rich_help_panel="Batch"),
    seq_length: Optional[int] = typer.Option(None, "--seq-length", help="Tokens per sequence. Default: the scenario's; built-in 8192.", rich_help_panel="Batch"),
    recompute: Optional[Recompute] = typer.Option(None, "--recompute", "--recompute-granularity", help="Activation recomputation: none (default), selective (Megatron: attention core), full (whole layers), selective-op (torchtitan per-op SAC) or selective-layer (torchtitan: every second block each pipeline rank holds).", rich_help_panel="Batch"),
    dtype: Optional[Dtype] = typer.Option(None, "--dtype", help="Compute precision: bf16 (default), fp16, fp32 or fp8 (recipe: --set fp8.recipe=...).", rich_help_panel="Batch"),
    framework: Optional[Framework] = typer.Option(None, "--framework", help="Training framework whose defaults and refusals apply: generic (megatron-core, default), megatron-2021, megatron-deepspeed or torchtitan.", rich_help_panel="Batch"),
    schedule: Optional[str] = typer.Option(None, "--schedule", help=f"Pipeline schedule: {_SCHEDULE_CHOICES}.", rich_help_panel="Batch"),
    schedule_file: Optional[Path] = typer.Option(None, "--schedule-file", help="A torchtitan-style schedule CSV (overrides --schedule).", rich_help_panel="Batch"),
    # --- what-ifs on the hardware
    nic_gbps: Optional[float] = typer.Option(None, "--nic-gbps", help="Bandwidth of each scale-out NIC, Gbit/s, one direction (DGX H100: 400).", rich_help_panel="Hardware what-ifs"),
    nvlink_GBps: Optional[float] = typer.Option(None, "--nvlink-GBps", help="NVLink bandwidth per GPU, GByte/s, one direction (H100 SXM: 450).", rich_help_panel="Hardware what-ifs"),
    leaf_oversubscription: Optional[float] = typer.Option(None, "--leaf-oversubscription", help="Leaf switch down:up bandwidth ratio (1 = full bisection, 2 = 2:1).", rich_help_panel="Hardware what-ifs"),
    spine_oversubscription: Optional[float] = typer.Option(None, "--spine-oversubscription", help="Spine layer down:up bandwidth ratio towards the core (1 = full bisection).", rich_help_panel="Hardware what-ifs"),
    peak_tflops: Optional[float] = typer.Option(None, "--peak-tflops", help="GPU peak dense BF16 TFLOP/s, MFU's denominator (H100 SXM: 989); FP8 GEMMs run at the profile's FP8 peak.", rich_help_panel="Hardware what-ifs"),
    hbm_GBps: Optional[float] = typer.Option(None, "--hbm-GBps", help="GPU memory (HBM) bandwidth, GByte/s (H100 SXM: 3350).", rich_help_panel="Hardware what-ifs"),
    hbm_gib: Optional[float] = typer.Option(None, "--hbm-gib", help="GPU memory capacity, GiB (H100 SXM 80 GB: 79.6, what the driver reports).", rich_help_panel="Hardware what-ifs"),
    set_: list[str] = typer.Option([], "--set", help="Override any field, dotted: --set parallelism.grad_bucket_params=1e8, --set model.num_layers=4, --set cluster.topology.node.nic_gbps=200, --set cluster.gpu.compute.peak_tflops=500. Applied after the flags.", rich_help_panel="Hardware what-ifs"),
    # --- how and what to write
    network: Optional[str] = typer.Option(None, "--network", help="flow (default: flows sharing links max-min fairly) or alpha-beta (per-tier formulas, faster)."),
    mode: SimMode = typer.Option(SimMode.reduced, "--mode", help="reduced: one rank per pipeline rank, report only; full: every rank's timeline (ranks the network "
                                "treats alike are simulated once); every-rank: one process per rank, the reference (slow at scale)."),
    steady_fast_path: bool = typer.Option(False, "--steady-fast-path", help="Reduced mode, a named schedule: simulate a shorter pipeline and replay its verified steady period in closed form (the same step to ~1e-12; many microbatches run several times faster; no busiest-link table). Falls back to the plain run where the period does not verify."),
    as_json: bool = typer.Option(False, "--json", help="Print exactly one JSON object with the report; writes no dashboard unless --dashboard is given."),
    dashboard: Optional[str] = typer.Option(None, "--dashboard", metavar="[PATH]", help="Write the HTML dashboard (to PATH, or dashboards/<name>.html). Written by default without --json."),
    no_dashboard: bool = typer.Option(False, "--no-dashboard", help="Write no dashboard."),
    cdn: bool = typer.Option(False, "--cdn", help="Load plotly.js from its CDN (small HTML)."),
    perfetto: Optional[str] = typer.Option(None, "--perfetto", metavar="PATH", help="Write a Perfetto / Chrome trace JSON to this path (open in ui.perfetto.dev)."),
    report_json: Optional[str] = typer.Option(None, "--report", metavar="PATH", help="Also write the full report JSON to this path (input to clustersim compare)."),
    findings_budget_s: float = typer.Option(20.0, "--findings-budget-s", min=0.0, help="Seconds the findings may spend re-simulating their suggestions (0: none, findings from the model alone)."),
    # --- what-if (simulator.whatif; the scenario's perturbations: section) ---
    slow_gpu: list[str] = typer.Option([], "--slow-gpu", help="What-if: RANK=SPEED or node:N=SPEED (repeatable), SPEED relative to nominal compute speed (0.8: 20% slower; above 1: faster), e.g. 3=0.8."),
    slow_link: list[str] = typer.Option([], "--slow-link", help="What-if: LINK=BANDWIDTH (repeatable), BANDWIDTH relative to nominal (0.5: half; above 1: more); LINK a link name, uplink:LEAF, nic:N (NICs numbered across nodes; on one-NIC-per-GPU nodes, GPU N's), node:N, rail:R or tier:NAME, e.g. nic:3=0.5."),
    fail_node: list[int] = typer.Option([], "--fail-node", help="What-if: a node that fails (repeatable); goodput from --mtbf-hours etc."),
    failure_policy: Optional[str] = typer.Option(None, "--failure-policy", help="What-if: restart (from the last checkpoint; default) or spares (a hot spare node takes over)."),
    mtbf_hours: Optional[float] = typer.Option(None, "--mtbf-hours", help="What-if: MTBF of one GPU, hours (default 50,000, Llama 3)."),
    checkpoint_interval_s: Optional[float] = typer.Option(None, "--checkpoint-interval-s", help="What-if: work between checkpoints, s (default 1800)."),
    checkpoint_cost_s: Optional[float] = typer.Option(None, "--checkpoint-cost-s", help="What-if: blocking time to write a checkpoint, s (default 60)."),
    restart_cost_s: Optional[float] = typer.Option(None, "--restart-cost-s", help="What-if: time to restart after a failure, s (default 600)."),
    jitter: Optional[float] = typer.Option(None, "--jitter", help="What-if: coefficient of variation of seeded lognormal noise on each duration, e.g. 0.05 (5%)."),
    jitter_target: Optional[str] = typer.Option(None, "--jitter-target", help="What-if: what --jitter applies to: kernel (default), collective or both."),
    seeds: Optional[int] = typer.Option(None, "--seeds", help="What-if: steps (one per seed) for the P50/P90/P99 step time (default 1)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="What-if: first jitter seed (default 0)."),
    jitter_granularity: Optional[str] = typer.Option(None, "--jitter-granularity", help="What-if: jitter drawn per group (every TP x CP group; default) or per stage (about dp times cheaper)."),
) -> None:
    """Simulate one training step and print the prediction.

    Batch sizes count sequences (tokens per step = global batch size x sequence length).
    """
    from simulator.scenario import load_scenario
    from simulator.simulate import simulate as run_simulation

    overrides = {
        "model": model, "cluster.gpu": gpu, "cluster.topology": topology, "cluster.gpus": gpus,
        "parallelism.tp": tp, "parallelism.pp": pp, "parallelism.vpp": vpp, "parallelism.cp": cp,
        "parallelism.ep": ep, "parallelism.etp": etp, "parallelism.dp": dp, "parallelism.zero": zero,
        "parallelism.sequence_parallel": sequence_parallel, "parallelism.async_tp": async_tp,
        "parallelism.tp_comm_overlap": tp_comm_overlap,
        "batch.micro_batch_size": micro_batch_size,
        "batch.global_batch_size": global_batch_size, "batch.seq_length": seq_length,
        "recompute": recompute.value if recompute else None, "dtype": _DTYPE_OF.get(dtype.value, dtype.value) if dtype else None, "schedule": schedule,
        "framework": framework.value if framework else None,
        "schedule_file": str(schedule_file) if schedule_file else None, "network": network,
    }
    what_ifs = dict(nic_gbps=nic_gbps, nvlink_GBps=nvlink_GBps, leaf_oversubscription=leaf_oversubscription,
                    spine_oversubscription=spine_oversubscription, peak_tflops=peak_tflops, hbm_GBps=hbm_GBps,
                    hbm_gib=hbm_gib)
    for k, v in what_ifs.items():
        # Checked here so the error names the flag, not the topology/profile field it sets.
        ratio = k.endswith("oversubscription")
        if v is not None and not (math.isfinite(v) and (v >= 1 if ratio else v > 0)):
            raise UserError(f"--{k.replace('_', '-')} {v:g}: give "
                            + ("at least 1 (1 = non-blocking)" if ratio else "a positive number"))
    overrides.update({WHAT_IF_FIELDS[k]: v for k, v in what_ifs.items()})
    overrides.update(_parse_set(set_))
    if scenario is not None and not scenario.exists():
        raise UserError(f"scenario file {str(scenario)!r} does not exist: check the path, or omit it to run the default")
    if vpp is not None and layers_per_virtual_stage is not None:
        raise UserError("give --vpp or --num-layers-per-virtual-pipeline-stage, not both")
    # Flags that cancel each other are refused, not ignored: the run would not do what one asked.
    if no_dashboard and dashboard not in (None, _DASHBOARD_DEFAULT):
        raise UserError(f"--dashboard {dashboard} and --no-dashboard ask for opposite things: give one")
    if steady_fast_path and mode.value != "reduced":
        raise UserError(f"--steady-fast-path replays reduced mode's steady period, not --mode {mode.value}: "
                        "drop one of them")

    with progress("simulate", enabled=progress_wanted(as_json)) as phase:
        phase("loading the scenario")
        sc = load_scenario(scenario, overrides)
        if layers_per_virtual_stage is not None:
            overrides["parallelism.vpp"] = _megatron_vpp(sc, layers_per_virtual_stage)
            sc = load_scenario(scenario, overrides)
        if sc.parallelism.vpp > 1 and sc.schedule == "1f1b" and not sc.schedule_file and overrides.get("schedule") is None:
            # Megatron interleaves whenever vpp > 1; plain 1F1B has one chunk per rank.
            sc = load_scenario(scenario, dict(overrides, schedule="interleaved-1f1b"))
            _stderr(f"note: vpp={sc.parallelism.vpp}: using schedule interleaved-1f1b, as Megatron does; --schedule chooses another")
        _note_uneven_layer_split(sc)
        _note_sliding_window(sc)
        _note_unused_comm_inputs(sc, overrides)
        _note_inert_settings(sc, scenario, overrides)
        # Checked before simulating, so a bad output path never costs the result.
        explicit_dashboard = None if dashboard in (None, _DASHBOARD_DEFAULT) else Path(dashboard)
        from simulator.scenario import scenario_input_files

        write_dash = not no_dashboard and (dashboard is not None or not as_json)
        # The scenario name is free text: a safe slug, inside dashboards/. A run changed by flags
        # gets its own file (every what-if of one scenario wrote the same one, the last winning).
        flags = [f"slow-gpu-{x}" for x in slow_gpu] + [f"slow-link-{x}" for x in slow_link] + \
            [f"fail-node-{x}" for x in fail_node] + ([f"jitter{jitter}"] if jitter is not None else []) + \
            ([f"seeds{seeds}"] if seeds is not None else []) + \
            ([] if mode == SimMode.reduced else [f"{mode.value}"])  # (full and every-rank wrote over the reduced run's file)
        from simulator.report.files import output_path

        default_dash = output_path(Path("dashboards"), _variant_name(sc.name, overrides, scenario is not None, flags), ".html")
        default_key = "the dashboard (--dashboard PATH chooses another, --no-dashboard writes none)"
        check_outputs({"--perfetto": perfetto, "--report": report_json,
                       # as typed: a trailing slash names a folder (Path() would drop it)
                       "--dashboard": None if explicit_dashboard is None else dashboard,
                       default_key: default_dash if write_dash and explicit_dashboard is None else None},
                      scenario_input_files(scenario, overrides).items(),
                      replaces_only={"--dashboard": HTML_SUFFIXES, default_key: HTML_SUFFIXES})
        if report_json is not None and not str(report_json).lower().endswith((".json", ".json.gz")):
            # (compare tells a report from a scenario by its name: a report named r.yaml read as a scenario)
            raise UserError(f"--report {report_json!r} writes a JSON report: name it .json (or .json.gz), e.g. "
                            f"{Path(str(report_json)).stem or 'report'}.json")
        # (str until checked: a trailing slash names a folder, and Path() would drop it)
        perfetto = None if perfetto is None else Path(perfetto)
        report_json = None if report_json is None else Path(report_json)
        from simulator.whatif.cli_flags import merge_perturbations, perturbations_from_flags

        sc = merge_perturbations(sc, perturbations_from_flags(
            slow_gpu, slow_link, fail_node, failure_policy, mtbf_hours, checkpoint_interval_s, checkpoint_cost_s,
            restart_cost_s, jitter, jitter_target, seeds, seed, jitter_granularity))
        result = run_simulation(sc, mode=mode.value, progress=phase, fast_forward=steady_fast_path)
        report = result.report
        mismatch = _gpu_topology_mismatch(sc)  # after the run: a note never precedes an error line
        if mismatch:
            report.notes.append(mismatch)

        from simulator.report.findings import attach as attach_findings

        phase("checking findings")
        t_findings = time.perf_counter()
        report = attach_findings(result, budget_s=findings_budget_s).report  # re-simulates cheap suggestions, time-boxed
        findings_s = time.perf_counter() - t_findings
        if write_dash:
            from simulator.report.dashboard import build_dashboard_html

            phase("writing the dashboard")
            path = default_dash if explicit_dashboard is None else explicit_dashboard
            write_atomic(path, build_dashboard_html(result, cdn=cdn))
        if perfetto is not None:
            from simulator.report.perfetto import perfetto_trace

            phase("writing the Perfetto trace")
            write_atomic(perfetto, json.dumps(perfetto_trace(result.timeline, result=result)))
        if report_json is not None:
            write_atomic(report_json, report.model_dump_json(indent=2))
    if write_dash:
        _stderr(f"dashboard: {path}")
    elif cdn:
        _stderr("note: --cdn changes only the dashboard, and none was written"
                + (" (--no-dashboard)" if no_dashboard else " (--json writes one only with --dashboard PATH)"))
    if perfetto is not None:
        _stderr(f"perfetto trace: {perfetto}")
    if as_json:
        print(json.dumps(report.model_dump(mode="json")))
    else:
        print_summary(report, sc, findings_s=findings_s)


# Short names of the flags a dashboard's file name records.
_VARIANT_SHORT = {"batch.micro_batch_size": "mbs", "batch.global_batch_size": "gbs",
                  "batch.seq_length": "seq", "parallelism.sequence_parallel": "sp", "parallelism.async_tp": "async-tp",
                  "parallelism.tp_comm_overlap": "tp-overlap", "dtype": "", "schedule": "", "network": "",
                  "recompute": "recompute-", "cluster.gpus": "gpus", "cluster.gpu": "", "cluster.topology": "", "model": ""}


def _note_unused_comm_inputs(sc, overrides: dict) -> None:
    """A communication override the active collective model does not read gets one note, not silence."""
    from simulator.network.nccl import NCCL_UNUSED_KEYS, unused_comm_note

    keys = [k for k in overrides if k in NCCL_UNUSED_KEYS]
    if keys:
        from simulator.profile import load_profile
        from simulator.topology.spec import load_topology

        topo = load_topology(sc.cluster.topology)
        if getattr(topo.fabric, "kind", "") == "torus":
            return  # (no NCCL model on a torus: the links' latencies and efficiencies time it)
        note = unused_comm_note(keys, topo.node, load_profile(sc.cluster.gpu))
        if note:
            _stderr(f"note: {note}")


def _note_inert_settings(sc, scenario: Path | None, overrides: dict) -> None:
    """A setting this run does not read (fsdp_prefetch on a ZeRO-1 layout, fp8.recipe with bf16)
    gets one note naming it and why, where it would otherwise change nothing without a word."""
    from simulator.inert_settings import given_paths, inert_settings
    from simulator.scenario import load_scenario_dict

    data = None if scenario is None else load_scenario_dict(scenario)
    for line in inert_settings(sc, given_paths(data, overrides)):
        _stderr(f"note: {line}")


def _variant_name(base: str, overrides: dict, scenario_given: bool, flags: list[str]) -> str:
    """The dashboard's name: the scenario's, plus what the command line changed (--tp 4, --set,
    what-if flags), so variants of one scenario do not overwrite each other's dashboard. The
    default scenario's name already says its model, GPU count and GPU."""
    parts = []
    for key, value in overrides.items():
        if value is None or (not scenario_given and key in ("model", "cluster.gpus", "cluster.gpu")):
            continue
        if key == "schedule_file":
            value = Path(str(value)).stem
        short = _VARIANT_SHORT.get(key, key.rsplit(".", 1)[-1].replace("_", "-"))
        if isinstance(value, bool):
            parts.append(short if value else f"no-{short}")
        else:
            text = Path(str(value)).stem if key in ("model", "cluster.gpu", "cluster.topology") else str(value)
            parts.append(f"{short}{text}")
    parts += flags
    return "-".join([base, *parts])


def _gpu_topology_mismatch(sc) -> str:
    """A note where the scenario's GPU is not the one the topology's nodes hold (--topology
    gb200-nvl72 kept the default h100-sxm-80gb compute, said only in the header); "" if it is."""
    from simulator.network.cli import NODE_KIND_PROFILES
    from simulator.topology import load_topology

    gpu = sc.cluster.gpu
    if not isinstance(gpu, str) or not isinstance(sc.cluster.topology, str) or "/" in gpu or gpu.endswith(".json"):
        return ""  # an inline, edited or calibrated profile / topology: the user chose it
    try:
        native = NODE_KIND_PROFILES.get(load_topology(sc.cluster.topology).node.kind)
    except UserError:
        return ""
    if native and native != Path(gpu).stem and "cpu" not in native:
        from simulator.calibrate.physics import gpu_model
        from simulator.profile import load_profile

        try:
            same_part = gpu_model(load_profile(native).device) == gpu_model(load_profile(gpu).device)
        except UserError:
            same_part = False
        if same_part:
            if load_profile(native).provenance.method != "spec":
                # the same part, with NCCL constants fitted on that very system's nccl-tests log
                return (f"topology {sc.cluster.topology_name} has a profile calibrated on its own nccl-tests log: "
                        f"--gpu {native} simulates its collectives with those constants")
            return ""  # a variant of the node's GPU (H100 96GB HBM2e in an H100 node): a deliberate choice
        return (f"topology {sc.cluster.topology_name}'s nodes hold {native} GPUs but the GPU simulated is "
                f"{sc.cluster.gpu_name}: --gpu {native} simulates that system")
    return ""


def layout_line(sc) -> str:
    """What was simulated, in one line: layout, batch, schedule (a schedule file by its file name)."""
    p = sc.parallelism
    dims = [f"TP{p.tp}", f"PP{p.pp}"] + ([f"VPP{p.vpp}"] if p.vpp > 1 else []) + [f"DP{sc.dp}"]
    dims += ([f"CP{p.cp}"] if p.cp > 1 else []) + ([f"EP{p.ep}"] if p.ep > 1 else [])
    dims += [f"ETP{p.expert_tp}"] if sc.model.is_moe and p.expert_tp > 1 and p.tp > 1 else []
    dims += [f"ZeRO-{p.zero}"]
    from simulator.textsafe import plain

    # (the model's name and the schedule file's come from the user's files: no control characters)
    sched = f"schedule file {plain(Path(sc.schedule_file).name)}" if sc.schedule_file else f"schedule {sc.schedule}"
    # precision and recompute change the step as much as the layout: a fp8 run must not read as bf16
    prec = f"{sc.dtype} ({sc.fp8.recipe})" if sc.dtype == "fp8" else sc.dtype
    extras = ([sc.framework] if sc.framework != "generic" else []) \
        + ([f"recompute {sc.recompute}"] if sc.recompute != "none" else []) + (["async TP"] if p.async_tp else []) \
        + (["TP comm overlap"] if p.tp_comm_overlap else []) \
        + (["parameter all-gather after the step"] if p.zero in (1, 2) and not sc.overlap_param_gather else [])
    from simulator.workload.ops import active_parameters, model_size_text, total_parameters

    size = model_size_text(total_parameters(sc), active_parameters(sc))
    return (f"{plain(sc.model.name)} ({size}) · {' '.join(dims)} · {sched} · global batch {plural(sc.batch.global_batch_size, 'sequence')} "
            f"of {sc.batch.seq_length:,} tokens · {' · '.join([prec, *extras])} · {sc.cluster.gpu_name} on {sc.cluster.topology_name}")


def group_links(links: list[dict], tolerance: float = 0.01) -> list[tuple[dict, int]]:
    """Busiest links with near-identical ones folded together: (first link, how many), for links
    of one kind whose utilizations lie within ``tolerance`` of the group's first (a symmetric
    collective loads every leaf uplink alike; ten rows of the same 97% say nothing)."""
    groups: list[tuple[dict, int]] = []
    for link in links:
        u = link.get("utilization", 0.0)
        for i, (first, n) in enumerate(groups):
            if first.get("kind") == link.get("kind") and abs(first.get("utilization", 0.0) - u) <= tolerance:
                groups[i] = (first, n + 1)
                break
        else:
            groups.append((link, 1))
    return groups


def print_summary(report, scenario=None, findings_s: float | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from simulator.textsafe import for_rich

    con = Console()
    t = Table(title=f"{for_rich(report.name)}: {plural(report.gpus, 'GPU')}, {plural(report.num_microbatches, 'microbatch')}",
              show_header=False)
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    t.add_row("step time", f"{report.step_time_s:.3f} s")
    t.add_row("throughput", f"{report.tokens_per_s:,.0f} tokens/s ({report.tokens_per_s_per_gpu:,.0f} per GPU)")
    t.add_row("model TFLOP/s per GPU", f"{report.model_tflops_per_gpu:.1f}")
    peak = report.model_tflops_per_gpu / report.mfu if report.mfu > 0 else 0.0
    # Against the dense BF16 peak whatever the dtype, as torchtitan and Megatron report FP8 runs.
    mfu = f"{report.mfu:.1%} of {peak:,.0f} TFLOP/s (peak_tflops: dense BF16)" if peak else f"{report.mfu:.1%}"
    fp8_peak = (report.setup or {}).get("fp8_peak_tflops")
    if fp8_peak:  # (an FP8 run can pass 100% of the BF16 peak: say how close it runs to its own)
        mfu += f"; {report.model_tflops_per_gpu / fp8_peak:.1%} of the FP8 peak {fp8_peak:,.0f}"
    t.add_row("MFU", mfu)
    # The idle share holds bubble and stage imbalance together; the breakdown below splits them.
    t.add_row("pipeline idle", f"{report.bubble_fraction:.1%} of the step (worst stage {report.bubble_fraction_worst:.1%})")
    from simulator.report.analysis import breakdown_lines, memory_parts_line

    breakdown = breakdown_lines(report)
    for label, value in breakdown:
        t.add_row(label, value)
    if not breakdown:
        # The breakdown's "+ exposed <dim>" rows already say this; a report without one still does.
        for dim, v in report.exposed_comm_s.items():
            if v > 0:
                t.add_row(f"exposed {dim} comm", f"{v:.3f} s ({v / report.step_time_s:.1%})")
    fit = "fits" if report.fits_in_memory else "[red]DOES NOT FIT[/red]"
    t.add_row("peak memory", f"{report.peak_memory_gib:.1f} GiB of {report.memory_capacity_gib:.1f} ({fit})")
    parts = memory_parts_line(report)
    if parts:
        t.add_row("  largest parts", parts)
    for link, n in group_links(report.busiest_links)[:3]:
        name, util = for_rich(link.get("name", link.get("link"))), link.get("utilization", 0)
        t.add_row("busy link", f"{name}: {util:.0%}" if n == 1 else f"{n} links like {name} at {util:.0%}")
    ff = report.fast_forward
    ls = getattr(report, "lockstep", None)
    how = report.mode if not ff else (f"{report.mode}; {ff['microbatches_simulated']:,} of {report.num_microbatches:,} "
                                      f"microbatches simulated, the steady period replayed {ff['periods_skipped']:,}x")
    if ls:
        how += f"; {ls['simulated_ranks']:,} simulated ranks stand for all {ls['ranks']:,}, which move in lockstep"
    took = report.wall_s if report.wall_s is not None else report.sim_wall_s
    t.add_row("simulated in", f"{took:.2f} s, {report.events:,} events ({how})")
    if report.wall_s is not None:
        t.add_row("of which event loop", f"{report.sim_wall_s:.2f} s")
    if findings_s is not None and findings_s >= 0.5:
        # the suggestions below were re-simulated after the step: time the user waited as well
        t.add_row("then findings", f"{findings_s:.2f} s (re-simulating suggestions, --findings-budget-s)")
    if scenario is not None:
        con.print(layout_line(scenario), highlight=False, markup=False, soft_wrap=True)
    con.print(t)
    for note in report.notes:
        con.print(f"note: {for_rich(note)}")
    if getattr(report, "whatif", None):
        from simulator.whatif.summary import whatif_lines

        for line in whatif_lines(report.whatif):
            con.print(for_rich(line))


def main() -> None:
    """Console entry point: one-line errors with exit status 2, never a traceback for bad input.

    Typer's standalone mode handles usage errors itself (exit 2); our UserError comes out of
    the command and is printed here as one line.
    """
    seen: set[str] = set()

    def one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
        # A warning is one line for the user, once per message: Python's default echoes the
        # source line that raised it (and a findings pass may raise the same one dozens of times).
        text = " ".join(str(message).split())
        if text not in seen:
            seen.add(text)
            _stderr(f"warning: {text}")

    warnings.showwarning = one_line_warning
    try:
        # Not standalone: click's usage errors (a bad flag, a value of the wrong type) come here, to be
        # printed as one line like every other bad input instead of a multi-line panel.
        rv = app(standalone_mode=False)
    except UserError as exc:
        _stderr(f"error: {exc}")
        sys.exit(2)
    except KeyboardInterrupt:
        _stderr("interrupted")
        sys.exit(130)
    except RunFailed as exc:
        _stderr(f"error: {exc}")
        sys.exit(1)
    except Exception as exc:
        if type(exc).__name__ == "Abort":  # click's Ctrl-C / EOF at a prompt
            _stderr("interrupted")
            sys.exit(130)
        if not _is_click_error(exc):
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":
            sys.exit(exc.exit_code)  # the help was printed when it was raised
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        msg = " ".join(exc.format_message().split()).removeprefix("Value error, ").rstrip(".")
        _stderr(f"error: {msg.replace(': Value error, ', ': ')}{hint}")
        sys.exit(exc.exit_code)
    if rv == 130:
        # typer turns Ctrl-C into Exit(130), which a non-standalone app returns as a value: say it
        _stderr("interrupted")
    sys.exit(rv if isinstance(rv, int) else 0)


def _is_click_error(exc: Exception) -> bool:
    """A click (or typer's vendored click) ClickException: a usage error with a message and an exit code."""
    return any(c.__name__ == "ClickException" for c in type(exc).__mro__) and hasattr(exc, "format_message")


if __name__ == "__main__":
    main()
