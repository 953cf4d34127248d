"""Which class of work each GPU kernel is, from its name family and the op that launched it.

The patterns are data, kept here in one place as HolisticTraceAnalysis keeps its kernel
categories (hta/configs): a new library's kernel family is one line below. Sources for the name
families: NCCL (ncclKernel_* / ncclDevKernel_*), cuBLAS/cuBLASLt (ampere_/sm80_/sm90_xmma,
nvjet_*, cublasLt::*), CUTLASS (cutlass::Kernel<cutlass_80_tensorop_...>), cuDNN (cudnn::,
implicit_gemm convolutions, fmha), FlashAttention (flash_fwd_/flash_bwd_), PyTorch's own kernels
(at::native::vectorized_elementwise_kernel, reduce_kernel, multi_tensor_apply_kernel, ...),
Apex/Megatron fused kernels, DeepEP (deep_ep::), as seen in the reference traces
(tests/data/reference/kineto) and in the kernel tables of those libraries.

Two levels:
- ``kernel_class`` (KERNEL_CLASSES): the fine class one kernel is (softmax, reduce, copy and
  memset kept apart, as HTA does);
- ``op_class`` (the OpTable's and profiles' class): the cost-model class it is charged to
  (KERNEL_TO_OP_CLASS: softmax and reduce are memory-bound elementwise work, copies and memsets
  are memcpy).
"""

from __future__ import annotations

import re

KERNEL_CLASSES = (
    "gemm", "attention", "norm", "softmax", "elementwise", "reduce", "optimizer",
    "copy", "memset", "communication", "embedding", "other",
)

# kernel class -> the OpTable / profile op class its time and work are charged to.
KERNEL_TO_OP_CLASS = {
    "gemm": "gemm",
    "attention": "attention",
    "norm": "norm",
    "softmax": "elementwise",
    "elementwise": "elementwise",
    "reduce": "elementwise",
    "optimizer": "optimizer",
    "copy": "memcpy",
    "memset": "memcpy",
    "communication": "communication",
    "embedding": "other",
    "other": "other",
}

# Kernel name families that establish the class on their own, whatever launched them (checked in
# this order; the first match wins). Communication first: NCCL names contain "Sum"/"Reduce".
DEFINITIVE_KERNEL_PATTERNS: tuple[tuple[str, re.Pattern], ...] = (
    ("communication", re.compile(
        r"^(?:void\s+)?(?:nccl|rccl|hccl|gloo)|ncclKernel|ncclDevKernel|deep_ep::|deepep|nvshmem|"
        r"cross_device_reduce|all_?reduce_kernel|allgather_kernel|multimem", re.I)),
    ("attention", re.compile(
        r"flash_fwd|flash_bwd|flash::|flashattn|fmha|_attn_fwd|_attn_bwd|attention_kernel|"
        r"cudnn_?mha|cudnn_generated_fort_native_sdpa|sdpa|mha_fwd|mha_bwd|efficient_attention|"
        r"fused_attention|xformers|paged_attention|flashinfer", re.I)),
    # "(?<!fb)gemm": fbgemm's embedding/permute kernels are not matrix multiplies.
    ("gemm", re.compile(
        r"(?<![a-z])cutlass(?!_cudnn_train::reduction)|cublas(?!Lt::splitKreduce)|(?<!fb)(?<!fbgemm_gpu::)gemm|"
        r"^(?:void\s+)?(?:ampere|volta|turing|hopper|sm\d+)_[a-z0-9_]*(?:gemm|sgemm|hgemm|xmma|s1688|h1688|s16816|h16816|dgrad|wgrad|fprop)|"
        r"xmma|nvjet|implicit_?gemm|scudnn|cudnn_infer_ampere|s1688|h1688|s16816|h16816|tensorop_[a-z0-9]*(?:fprop|dgrad|wgrad)|"
        r"matmul_kernel|_scaled_mm|gemv", re.I)),
)

# Name families for kernels whose launching op did not say (no op, or an op of class other).
KERNEL_NAME_PATTERNS: tuple[tuple[str, re.Pattern], ...] = (
    ("optimizer", re.compile(r"multi_tensor_apply|AdamFunctor|adam|lamb|sgd_kernel|FusedSgd|adagrad|LAMBStage|l2norm_kernel", re.I)),
    ("norm", re.compile(
        r"layer_?norm|rms_?norm|batch_?norm|group_?norm|bn_fw|bn_bw|GammaBeta|RowwiseMoments|"
        r"ComputeInternalGradients|ComputeGradientFusedParams|cuComputeGradInput|cuApplyLayerNorm|cuApplyRMSNorm|"
        r"cuComputePartGradGammaBeta|cuComputeGradGammaBeta|welford", re.I)),
    ("softmax", re.compile(r"softmax|scaled_masked_softmax|scaled_upper_triang_masked_softmax|log_softmax", re.I)),
    ("embedding", re.compile(r"embedding|split_embedding|bounds_check_indices|EmbeddingBag|indexSelectLargeIndex|permute_2D|bucketize_sparse", re.I)),
    ("reduce", re.compile(r"reduce_kernel|ReduceOp|reduce_1Block|splitKreduce|reduction|cub::Device(?:Reduce|Segmented)|"
                          r"cub::DeviceScan|DeviceRadixSort|norm_kernel|cumsum|argmax|topk", re.I)),
    ("copy", re.compile(r"direct_copy_kernel|copy_kernel|CatArrayBatchedCopy|nchwToNhwc|nhwcToNchw|transpose|"
                        r"permute|contiguous|memcpy|index_put|gather|scatter", re.I)),
    ("memset", re.compile(r"FillFunctor|fill_kernel|zero_kernel|memset", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|triton|gelu|silu|swiglu|relu|dropout|"
                               r"bias|activation|Functor|_kernel_cuda|fused_|where|clamp|cast", re.I)),
)

# Launching CPU op -> kernel class (matched on the full op name; first match wins). These decide
# a kernel whose own name is not definitive: a vectorized_elementwise_kernel under
# aten::native_layer_norm is norm work. Optimizer context (inside Optimizer.step) wins over all
# but the definitive names.
OP_NAME_PATTERNS: tuple[tuple[str, re.Pattern], ...] = (
    ("optimizer", re.compile(r"^Optimizer\.step|^Optimizer\.zero_grad|^aten::_fused_(adam|adamw|sgd|adagrad)|^aten::_foreach_|"
                             r"FusedAdam|fused_adam|multi_tensor|^apex", re.I)),
    ("attention", re.compile(r"scaled_dot_product|flash_attention|flash_attn|efficient_attention|cudnn_attention|fmha|"
                             r"multi_head_attention|FlashAttn|_flash_attention|sdpa", re.I)),
    ("gemm", re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|addbmm|einsum|_grouped_mm|mv|dot|addmv|"
                        r"convolution|_convolution|cudnn_convolution|convolution_backward|conv\dd|cudnn_convolution_transpose)$")),
    ("norm", re.compile(r"^aten::(native_)?(layer_norm|rms_norm|group_norm|batch_norm|_fused_rms_norm|_batch_norm_impl_index|"
                        r"cudnn_batch_norm|native_batch_norm|native_group_norm)(_backward)?$|norm_backward$|"
                        r"^fb::rms_norm|FusedLayerNorm|FusedRMSNorm|LayerNorm|RMSNorm", re.I)),
    ("softmax", re.compile(r"^aten::(_?softmax|_?log_softmax|_softmax_backward_data|_log_softmax_backward_data)$|"
                           r"ScaledMaskedSoftmax|ScaledUpperTriangMaskedSoftmax|FusedScaleMaskSoftmax")),
    ("embedding", re.compile(r"^aten::embedding\w*|^aten::_embedding_bag\w*|^fbgemm::|split_embedding|SplitLookupFunction|"
                             r"^fb::lengths_range", re.I)),
    ("reduce", re.compile(r"^aten::(sum|mean|norm|linalg_vector_norm|max|min|amax|amin|argmax|argmin|cumsum|prod|var|std|"
                          r"var_mean|std_mean|nll_loss\w*|cross_entropy_loss|topk|sort|any|all|_local_scalar_dense)$")),
    ("memset", re.compile(r"^aten::(fill_|zero_|zeros|zeros_like|ones|ones_like|full|full_like|new_zeros|new_full)$")),
    # (views -- view, reshape, expand, slice, t, permute -- move no data and launch no kernel: not here)
    ("copy", re.compile(r"^aten::(copy_|_to_copy|to|clone|contiguous|cat|stack|index_select|index|index_put_|_index_put_impl_|"
                        r"gather|scatter|scatter_add_|narrow_copy|split_with_sizes_copy|repeat)$")),
    ("elementwise", re.compile(r"^aten::(add|sub|mul|div|gelu|silu|relu|sigmoid|tanh|exp|log|log2|pow|sqrt|rsqrt|neg|abs|clamp|"
                               r"clamp_min|clamp_max|where|masked_fill|erf|cos|sin|lerp|addcmul|addcdiv|maximum|minimum|"
                               r"threshold|gelu_backward|silu_backward|threshold_backward|sigmoid_backward|tanh_backward|"
                               r"dropout|native_dropout|native_dropout_backward|bernoulli|rand\w*|reciprocal|sign|"
                               r"nan_to_num|bitwise_\w+|eq|ne|lt|le|gt|ge|logical_\w+|floor|ceil|round|trunc|"
                               r"hardtanh|leaky_relu|elu|softplus|mish|hardswish|hardsigmoid|glu|square|exp2|expm1)_?$")),
)

# CPU-only traces (gloo captures): the op class (profile classes) of an outermost CPU op, which
# is itself the measured row. Coarser than OP_NAME_PATTERNS on purpose: factories and views stay
# "other" there, since on a CPU they are allocation and bookkeeping rather than memory traffic.
CPU_TRACE_OP_PATTERNS: tuple[tuple[str, re.Pattern], ...] = (
    ("optimizer", re.compile(r"^Optimizer\.step|^aten::_fused_(adam|sgd)|^aten::_foreach_|adam", re.I)),
    ("attention", re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|_flash_attention|fmha|multi_head_attention", re.I)),
    ("gemm", re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|addbmm|einsum|_grouped_mm|mv|dot|addmv|convolution|_convolution|cudnn_convolution|conv\dd)$")),
    ("norm", re.compile(r"^aten::(native_)?(layer_norm|rms_norm|group_norm|batch_norm|_fused_rms_norm|_batch_norm_impl_index|cudnn_batch_norm)(_backward)?$|norm_backward$|^fb::rms_norm")),
    ("elementwise", re.compile(r"^aten::(add|sub|mul|div|gelu|silu|relu|sigmoid|tanh|exp|log|pow|sqrt|rsqrt|neg|abs|clamp|where|copy|fill|zero|softmax|_softmax|log_softmax|_log_softmax|dropout|native_dropout|masked_fill|erf|cos|sin|lerp|addcmul|addcdiv|maximum|minimum|threshold|mean|sum|gelu_backward|silu_backward|threshold_backward|_softmax_backward_data|_log_softmax_backward_data|sigmoid_backward|tanh_backward|cross_entropy_loss|nll_loss\w*|to|_to_copy|clone|contiguous|cat|stack|index_select|embedding\w*)_?$")),
)


# The Kineto category of a GPU event that is not a kernel decides its class.
GPU_CATEGORY_CLASS = {"gpu_memcpy": "copy", "Memcpy": "copy", "gpu_memset": "memset", "Memset": "memset"}


def definitive_kernel_class(name: str) -> str | None:
    """The class a kernel name establishes whatever launched it (communication, attention, gemm)."""
    for cls, rx in DEFINITIVE_KERNEL_PATTERNS:
        if rx.search(name):
            return cls
    return None


def kernel_name_class(name: str) -> str | None:
    """The class a kernel name suggests when its launching op does not say; None if neither."""
    c = definitive_kernel_class(name)
    if c is not None:
        return c
    for cls, rx in KERNEL_NAME_PATTERNS:
        if rx.search(name):
            return cls
    return None


def op_name_class(name: str | None) -> str | None:
    """The kernel class a launching CPU op establishes, or None when its name does not say."""
    if not name:
        return None
    for cls, rx in OP_NAME_PATTERNS:
        if rx.search(name):
            return cls
    return None


def classify_kernel(kernel_name: str, op_name: str | None = None, in_optimizer: bool = False,
                    gpu_category: str = "kernel", context_class: str | None = None) -> str:
    """The kernel class of one GPU event.

    Precedence: memcpy/memset events by their category; definitive kernel names (communication,
    attention, gemm); optimizer context; the launching op's class; the class of an enclosing
    op (``context_class``, e.g. a norm module around an unnamed kernel); the kernel name family;
    other.
    """
    cat = GPU_CATEGORY_CLASS.get(gpu_category)
    if cat is not None:
        return cat
    d = definitive_kernel_class(kernel_name)
    if d is not None:
        return d
    if in_optimizer:
        return "optimizer"
    c = op_name_class(op_name)
    if c is not None:
        # Library ops like aten::cudnn_convolution also launch layout transposes and reductions;
        # a kernel that names itself a copy or a reduction is that, not gemm work.
        if c == "gemm":
            k = kernel_name_class(kernel_name)
            return k if k in ("copy", "reduce", "memset") else "gemm"
        return c
    if context_class is not None:
        return context_class
    return kernel_name_class(kernel_name) or "other"
