"""Settings a run would not read: a user who sets ``parallelism.fsdp_prefetch`` on a ZeRO-1
layout, or ``fp8.recipe`` with dtype bf16, sees the same prediction and no word about why. Each
rule here names a field and the layouts in which the model does not read it, with the reason.

The rules are claims about the model, so tests/test_inert_settings.py checks each one: on a
layout the rule covers, the run with the field changed predicts the same step time and memory.
They are deliberately narrow (a field that is read in part, such as an HSDP layout's gathers,
has no rule): a note that says "no effect" where there is one would mislead more than silence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from simulator.scenario import Scenario


@dataclass(frozen=True)
class InertRule:
    path: str  # dotted, as --set takes it
    why_inert: Callable[[Scenario], str | None]  # the reason where the field is not read, else None


def _zero3(sc: Scenario) -> str | None:
    z = sc.parallelism.zero
    return None if z >= 3 else f"it applies to ZeRO-3 (FSDP) parameter gathers and this layout is ZeRO-{z}"


def _torchtitan(what: str) -> Callable[[Scenario], str | None]:
    def why(sc: Scenario) -> str | None:
        if sc.framework != "torchtitan":
            return f"{what} is read under framework torchtitan only and this run's framework is {sc.framework}"
        return None
    return why


def _first(*checks: Callable[[Scenario], str | None]) -> Callable[[Scenario], str | None]:
    def why(sc: Scenario) -> str | None:
        for check in checks:
            reason = check(sc)
            if reason:
                return reason
        return None
    return why


def _degree(dim: str, meaning: str) -> Callable[[Scenario], str | None]:
    def why(sc: Scenario) -> str | None:
        if getattr(sc.parallelism, dim) == 1:
            return f"it applies to {meaning} and this layout has {dim}=1"
        return None
    return why


def _one_pipeline_position(sc: Scenario) -> str | None:
    p = sc.parallelism
    if p.pp == 1:
        return "it applies to pipeline parallelism and this layout has pp=1"
    return None


def _zero12(sc: Scenario) -> str | None:
    z = sc.parallelism.zero
    if z in (1, 2):
        return None
    return (f"it applies to the distributed optimizer's parameter all-gather (ZeRO-1/2) and this layout is ZeRO-{z}"
            + (" (FSDP gathers by unit: fsdp_prefetch)" if z >= 3 else ""))


def _nothing_to_reduce(sc: Scenario) -> str | None:
    if sc.dp * sc.parallelism.cp == 1:
        return "no rank shares this rank's parameters (dp=1, cp=1), so there are no gradients to reduce"
    return None


def _fsdp2_has_no_buckets(sc: Scenario) -> str | None:
    from simulator.workload.plan import hsdp_shard_of

    p = sc.parallelism
    shard = hsdp_shard_of(p.zero, p.fsdp_shard_size, sc.dp, cp=p.cp) or sc.dp * p.cp
    if sc.framework == "torchtitan" and p.zero >= 3 and shard > 1:
        # (memory charges Megatron's and DeepSpeed's bucket buffers at every other ZeRO stage)
        return "torch FSDP2 (framework torchtitan, ZeRO-3) has no gradient buckets: it reduce-scatters each unit whole"
    return None


def _fsdp_one_communicator_applies(sc: Scenario) -> str | None:
    from simulator.workload.plan import hsdp_shard_of

    p = sc.parallelism
    if hsdp_shard_of(p.zero, p.fsdp_shard_size, sc.dp, cp=p.cp) is not None:
        return ("under HSDP the gathers already run on a communicator of their own (the reduce-scatters chain to "
                "the replicate group's all-reduce)")
    return None


def _dense_model(sc: Scenario) -> str | None:
    if not sc.model.is_moe:
        return f"model {sc.model.name!r} is dense (num_experts 0): moe settings apply to mixture-of-experts models"
    return None


def _not_precision_aware(sc: Scenario) -> str | None:
    if not sc.optimizer.precision_aware:
        return "it applies to the precision-aware optimizer (optimizer.precision_aware) and this run's is not"
    if sc.dtype not in ("bf16", "fp8"):
        return f"the master weights are kept as remainders of bf16 parameters and this run's are {sc.dtype}"
    return None


def _never_read_by_megatron_core(sc: Scenario) -> str | None:
    return ("megatron-core 0.16.1 reads it only in its config check: the optimizer reads the gradient buffer, whose "
            "dtype parallelism.grad_reduce_in_fp32 sets")


def _experts_whole(sc: Scenario) -> str | None:
    if not sc.model.is_moe:
        return f"it splits the experts of a mixture-of-experts model and model {sc.model.name!r} is dense"
    return None


def _uniform_routing(sc: Scenario) -> str | None:
    if sc.moe.routing == "uniform":
        return "moe.routing is uniform; the skew's exponent and seed shape skewed routing only"
    return None


def _not_fp8(sc: Scenario) -> str | None:
    if sc.dtype != "fp8":
        return f"dtype is {sc.dtype}; fp8 settings apply with dtype fp8 (--dtype fp8)"
    return None


def _fp8_gather_needs_zero3(sc: Scenario) -> str | None:
    if sc.parallelism.zero < 3:
        return (f"the model applies it to ZeRO-3 (FSDP) parameter gathers and this layout is ZeRO-{sc.parallelism.zero} "
                "(Megatron's --fp8-param-gather under the distributed optimizer is not modelled)")
    return None


def _no_flash(sc: Scenario) -> str | None:
    if not sc.flash_attention:
        return "it chooses the fused attention kernel and flash_attention is false"
    return None


def _not_hf_eager(sc: Scenario) -> str | None:
    if sc.implementation != "hf-eager":
        return f"it shapes implementation hf-eager's layers and this run's implementation is {sc.implementation}"
    return None


def _no_learned_positions(sc: Scenario) -> str | None:
    if sc.implementation != "hf-eager" and not sc.model.learned_position_embeddings:
        return "it sizes the learned position table and model.learned_position_embeddings is false"
    return None


def _sequence_parallel_sends_shards(sc: Scenario) -> str | None:
    p = sc.parallelism
    if p.tp > 1 and p.sequence_parallel:
        return "with sequence parallelism each TP rank already sends its 1/tp shard"
    return None


def _compiled(sc: Scenario) -> str | None:
    if sc.torch_compile:
        return "it decides which eager kernels torch fuses and this run is compiled (torch_compile), which fuses them"
    return None


def _torchtitan_flash_cp(sc: Scenario) -> str | None:
    if not sc.flash_attention:
        return "it balances torch's context-parallel SDPA, which runs with flash_attention only"
    return None


RULES: tuple[InertRule, ...] = (
    InertRule("parallelism.fsdp_prefetch", _zero3),
    InertRule("parallelism.fsdp_reshard_after_forward", _zero3),
    InertRule("parallelism.fsdp_separate_reduce_scatter_group",
              _first(_torchtitan("torch FSDP2's reduce-scatter communicator"), _zero3, _fsdp_one_communicator_applies)),
    InertRule("parallelism.cp_attention", _degree("cp", "context parallelism")),
    InertRule("parallelism.cp_load_balance",
              _first(_degree("cp", "context parallelism"), _torchtitan("torch's context-parallel load balancing"),
                     _torchtitan_flash_cp)),
    InertRule("parallelism.sequence_parallel", _degree("tp", "tensor parallelism")),
    InertRule("parallelism.async_tp", _degree("tp", "tensor parallelism")),
    InertRule("parallelism.tp_comm_overlap", _degree("tp", "tensor parallelism")),
    InertRule("parallelism.pp_scatter_gather",
              _first(_one_pipeline_position, _degree("tp", "tensor parallelism"), _sequence_parallel_sends_shards)),
    InertRule("parallelism.pp_exchange", _one_pipeline_position),
    InertRule("parallelism.grad_bucket_params", _fsdp2_has_no_buckets),
    InertRule("parallelism.overlap_grad_reduce", _nothing_to_reduce),
    InertRule("parallelism.overlap_param_gather", _first(_zero12, _nothing_to_reduce)),
    InertRule("parallelism.loss_all_reduce_per_microbatch", _nothing_to_reduce),
    InertRule("parallelism.etp", _experts_whole),
    InertRule("optimizer.store_param_remainders", _not_precision_aware),
    InertRule("optimizer.main_grads_dtype", _never_read_by_megatron_core),
    InertRule("optimizer.implementation", _torchtitan("optimizer.implementation (torch's fused or foreach AdamW)")),
    InertRule("moe.routing", _dense_model),
    InertRule("moe.skew", _first(_dense_model, _uniform_routing)),
    InertRule("moe.seed", _first(_dense_model, _uniform_routing)),
    InertRule("moe.capacity_factor", _dense_model),
    InertRule("moe.overlap_dispatch", _dense_model),
    InertRule("fp8.recipe", _not_fp8),
    InertRule("fp8.attention", _not_fp8),
    InertRule("fp8.param_all_gather", _first(_not_fp8, _fp8_gather_needs_zero3)),
    InertRule("torch_compile", _torchtitan("torch_compile")),
    InertRule("compile_loss", _torchtitan("compile_loss")),
    InertRule("training_dtype", _torchtitan("training_dtype (torchtitan's training.dtype)")),
    InertRule("torch_version", _first(_torchtitan("torch_version"), _compiled)),
    InertRule("attention_kernel", _no_flash),
    InertRule("model.hf_model_type", _not_hf_eager),
    InertRule("model.attention_dropout", _not_hf_eager),
    InertRule("model.max_position_embeddings", _no_learned_positions),
)
RULE_PATHS = frozenset(r.path for r in RULES)


def given_paths(data: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None) -> list[str]:
    """The rule paths a user wrote: in the scenario file's mapping (a section given as a preset
    name, such as ``model: llama3-8b``, writes none of its fields) or as a command-line override
    with a value."""
    paths = [k for k, v in (overrides or {}).items() if v is not None and k in RULE_PATHS]
    for path in sorted(RULE_PATHS - set(paths)):
        node: Any = data
        for part in path.split("."):
            node = node.get(part, _MISSING) if isinstance(node, Mapping) else _MISSING
        if node is not _MISSING:
            paths.append(path)
    return paths


_MISSING = object()


def inert_settings(sc: Scenario, paths: Iterable[str]) -> list[str]:
    """One line for each of ``paths`` this scenario does not read: the field, its value, why."""
    rules = {r.path: r for r in RULES}
    lines = []
    for path in paths:
        rule = rules.get(path)
        reason = rule.why_inert(sc) if rule else None
        if reason:
            value: Any = sc
            for part in path.split("."):
                value = getattr(value, part)
            shown = str(value).lower() if isinstance(value, bool) else value
            lines.append(f"{path}={shown} has no effect on this run: {reason}")
    return lines
