"""The GPU kernels a framework op launches, forward and backward, from its type and shapes.

One description serves both sides of a comparison: an imported per-operator table (its rows
become kernels to fit and check the kernel model on) and the workload (HF eager layers are
built from the same op types, so prediction and measurement name the same kernels).

A kernel is either a GEMM (``kind="gemm"``: batch, M, N, K; timed by the shape-aware GEMM
model) or memory-bound (``kind="mem"``: bytes moved; timed by bytes at achievable HBM
bandwidth). Every kernel also pays the per-kernel launch floor.

Backward kernels follow PyTorch's autograd formulas (tools/autograd/derivatives.yaml):
  addmm / linear: dgrad = G @ W^T (M x K, inner N), wgrad = X^T @ G (K x N, inner M), bias = sum(G)
  matmul / bmm of two activations: dA = G @ B^T, dB = A^T @ G
  add / sub of same-shape tensors: the gradient passes through (no kernel)
  mul / div by a scalar: one kernel (read G, write dX); tanh, relu, gelu, threshold: one kernel
  reading G and the saved output/input; mul of two tensors: one kernel per input;
  pow(x, c): pow, scale and multiply (three kernels); where / masked_fill: one select kernel;
  dropout: one masked scale (G, the 1-byte mask); softmax: one kernel (G and the saved output);
  layer_norm: input-grad kernel and weight/bias-grad reduction (two kernels);
  embedding: zero the table gradient, then index-add G into it (sort + scatter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

KernelKind = Literal["gemm", "mem", "flash"]


@dataclass(frozen=True)
class Kernel:
    kind: KernelKind
    op_class: str
    bytes: float = 0.0
    flops: float = 0.0
    batch: int = 1
    m: int = 0
    n: int = 0
    k: int = 0
    param_numel: float = 0.0  # parameters whose gradient this kernel produces (weight-grad kernels)
    # Fused attention (kind "flash"): batch = sequences x heads, m = query rows, n = keys, k = head dim.
    causal: bool = False
    backward: bool = False
    # Memory-bound kernels that stream slower than a pointwise pass over the same bytes, measured
    # apart (NeuSight, HF GPT-2 Large/GPT-3 XL, H100 and A100 alike: softmax backward at 0.72-0.77x
    # and dropout backward at 0.48x the rate of the class's forward kernels): their efficiency is
    # looked up as "class:variant" in KernelModel.mem_efficiency, else the class's.
    variant: str = ""


def numel(shape) -> int:
    return int(math.prod(shape)) if shape else 1


def gemm_kernel(op_class: str, batch: int, m: int, n: int, k: int, dt: int, a_batched: bool = True,
                b_batched: bool = True, param_numel: float = 0.0) -> Kernel:
    """C[batch, m, n] = A[batch?, m, k] @ B[batch?, k, n] in dtype of dt bytes."""
    a = (batch if a_batched else 1) * m * k
    b = (batch if b_batched else 1) * k * n
    c = batch * m * n
    return Kernel("gemm", op_class, bytes=float((a + b + c) * dt), flops=2.0 * batch * m * n * k, batch=batch, m=m, n=n, k=k,
                  param_numel=param_numel)


def flash_kernel(batch_heads: int, s_q: int, s_k: int, head_dim: int, causal: bool, flops: float, bytes_: float) -> Kernel:
    return Kernel("flash", "attention", bytes=float(bytes_), flops=float(flops), batch=batch_heads, m=s_q, n=s_k, k=head_dim,
                  causal=causal)


# Adam through multi_tensor_apply (apex / torch._foreach fused Adam): one launch covers at most
# 36 tensors (depth 4: param, grad, exp_avg, exp_avg_sq) and 320 blocks x 65,536 elements
# (apex csrc/multi_tensor_apply.cuh: depth_to_max_tensors[3] = 36, depth_to_max_blocks = 320,
# chunk_size 65536 in apex.optimizers.FusedAdam).
ADAM_MAX_TENSORS_PER_LAUNCH = 36
ADAM_MAX_ELEMENTS_PER_LAUNCH = 320 * 65536


def adam_launches(params: float, tensors: int) -> int:
    """Launches of one multi-tensor Adam step over ``params`` in ``tensors`` tensors (0: none)."""
    if params <= 0:
        return 0
    return max(math.ceil(tensors / ADAM_MAX_TENSORS_PER_LAUNCH), math.ceil(params / ADAM_MAX_ELEMENTS_PER_LAUNCH), 1)


def adam_kernel(params: float, tensors: int, bytes_per_param: float) -> Kernel:
    """One of the ``adam_launches`` equal launches: its share of params x bytes_per_param (master,
    grad, two moments read; written back)."""
    n = max(1, adam_launches(params, tensors))
    return mem_kernel("optimizer", params * bytes_per_param / n, 10.0 * params / n)


def adam_kernels(params: float, tensors: int, bytes_per_param: float) -> list[Kernel]:
    """The launches of one multi-tensor Adam step over ``params`` in ``tensors`` tensors."""
    return [adam_kernel(params, tensors, bytes_per_param)] * adam_launches(params, tensors)


# A memory-bound kernel is timed by its bytes alone; the FLOP counts given to them below (5 a norm
# element forward, 8 backward, 10 an Adam parameter...) are nominal, no source, and only reported.
def mem_kernel(op_class: str, bytes_: float, flops: float = 0.0, param_numel: float = 0.0, variant: str = "") -> Kernel:
    return Kernel("mem", op_class, bytes=float(bytes_), flops=float(flops), param_numel=param_numel, variant=variant)


# Ops that launch no kernel: views, shape queries, Python scalars.
VIEW_OPS = frozenset({
    "placeholder", "get_attr", "output", "size", "getitem", "getattr", "view", "reshape", "permute", "transpose",
    "split", "unsqueeze", "squeeze", "expand", "finfo", "dim", "flatten", "unflatten", "chunk", "t", "type_as_view",
    "iinfo", "device", "_assert", "eq_scalar",
})
GEMM_OPS = frozenset({"addmm", "mm", "matmul", "bmm", "baddbmm", "linear", "Linear", "Conv1D"})
NORM_OPS = frozenset({"LayerNorm", "layer_norm", "RMSNorm", "LlamaRMSNorm", "group_norm", "GroupNorm"})
EMBED_OPS = frozenset({"Embedding", "embedding"})
LOSS_OPS = frozenset({"cross_entropy", "CrossEntropyLoss", "nll_loss", "NLLLoss", "mse_loss", "MSELoss"})
SOFTMAX_OPS = frozenset({"softmax", "Softmax", "log_softmax"})
DROPOUT_OPS = frozenset({"dropout", "Dropout"})
# Ops whose result takes no gradient (index and mask construction).
NO_GRAD_OPS = frozenset({"arange", "full", "ones", "zeros", "tensor", "lt", "gt", "le", "ge", "eq", "ne", "cumsum", "long",
                         "bool", "int", "masked_fill_", "fill_", "zero_", "ones_like", "zeros_like", "full_like"})


def op_kernels(op_type: str, op_class: str, in_shapes: list, out_shape, dt: int, *, training: bool = True,
               has_bias: bool = True, table_rows: int = 0, scalar_args: int = 0) -> tuple[list[Kernel], list[Kernel]]:
    """(forward kernels, backward kernels) of one framework op.

    ``in_shapes``: shapes of the tensor inputs as recorded (a [1] entry may be a Python scalar);
    ``table_rows``: rows of an embedding table the lookup reads (its gradient is that big).
    """
    out = numel(out_shape)
    tensors = [s for s in in_shapes if numel(s) > 1 or out <= 1]
    if op_type in VIEW_OPS or op_class == "host":
        return [], []
    if op_type in GEMM_OPS:
        return _gemm_op_kernels(op_type, op_class, in_shapes, out_shape, dt, has_bias)
    if op_type in NORM_OPS:
        h = out_shape[-1] if out_shape else 1
        fw = [mem_kernel(op_class, 2 * out * dt, 5.0 * out)]
        bw = [mem_kernel(op_class, 3 * out * dt, 8.0 * out),
              mem_kernel(op_class, 2 * out * dt, 2.0 * out, param_numel=2 * h)]
        return fw, bw
    if op_type in EMBED_OPS:
        h = out_shape[-1] if out_shape else 1
        idx = numel(in_shapes[0]) if in_shapes else out // max(h, 1)
        rows = table_rows or (in_shapes[1][0] if len(in_shapes) > 1 and len(in_shapes[1]) == 2 else idx)
        fw = [mem_kernel(op_class, 2 * out * dt + idx * 8)]
        # Zero the table's gradient, then index-add the output gradient into it: the add reads G
        # and the indices and writes only the rows looked up (at most idx of them), not the table
        # (embedding_dense_backward_cuda sorts the indices and sums each row's gradients).
        touched = min(rows, idx) * h * dt
        bw = [mem_kernel(op_class, rows * h * dt), mem_kernel(op_class, out * dt + idx * 8 + touched,
                                                                param_numel=rows * h)]
        return fw, bw
    if op_type in SOFTMAX_OPS:
        return [mem_kernel(op_class, 2 * out * dt, 5.0 * out)], [mem_kernel(op_class, 3 * out * dt, 3.0 * out, variant="softmax_bw")]
    if op_type in LOSS_OPS:
        n = numel(in_shapes[0]) if in_shapes else out
        # Log-softmax and NLL forward; their backward (softmax minus one-hot) in one pass each.
        return ([mem_kernel(op_class, 2 * n * 4, 5.0 * n), mem_kernel(op_class, n * 4)],
                [mem_kernel(op_class, 3 * n * 4, 3.0 * n)])
    if op_type in DROPOUT_OPS:
        if not training:
            return [], []
        # Bernoulli mask (1 byte) and scaled output; backward: G x mask x scale.
        return ([mem_kernel(op_class, out * (2 * dt + 1), 2.0 * out)],
                [mem_kernel(op_class, out * (2 * dt + 1), 2.0 * out, variant="dropout_bw")])
    # Elementwise and everything else: read the tensor inputs, write the output.
    read = sum(numel(s) for s in tensors)
    fw = [mem_kernel(op_class, (read + out) * dt, float(out))]
    if op_type in NO_GRAD_OPS or op_type in ("contiguous", "clone", "to", "type", "float", "half"):
        # A copy's backward passes the gradient through; index/mask construction takes none.
        return fw, []
    if op_type in ("add", "sub", "iadd", "neg"):
        # The gradient passes through; a broadcast operand's sum is folded into its producer's
        # backward (NeuSight measures ~0 for both: wte + wpe, scores + mask).
        return fw, []
    if op_type in ("mul", "truediv", "div") and len(tensors) >= 2:
        return fw, [mem_kernel(op_class, 3 * out * dt, float(out)) for _ in tensors]
    if op_type in ("mul", "truediv", "div"):
        return fw, [mem_kernel(op_class, 2 * out * dt, float(out))]
    if op_type == "pow":
        return fw, [mem_kernel(op_class, 2 * out * dt, float(out)), mem_kernel(op_class, 2 * out * dt, float(out)),
                    mem_kernel(op_class, 3 * out * dt, float(out))]
    if op_type in ("where", "masked_fill", "clamp"):
        # One select: read G (and the 1-byte mask), write dX.
        return fw, [mem_kernel(op_class, 2 * out * dt + out, float(out))]
    if op_type in ("max", "min", "maximum", "minimum"):
        # Elementwise max/min of two tensors (PyTorch derivatives.yaml, max.other / maximum):
        #   self: at::where(self == other, grad / 2, grad).masked_fill_(self < other, 0)
        # and the same with > for other. Per input that takes a gradient, five kernels: eq (x in,
        # 1-byte mask out), grad / 2, where (mask and two operands in, dX out), lt (x in, mask
        # out), masked_fill_ in place (mask in, dX read and written): 9 x dt + 4 bytes an element.
        # Only full-size inputs take one: a recorded [1] operand is a constant such as OPT's
        # torch.tensor(finfo.min) clamp (NeuSight OPT-1.3B, 32x2048x2048 fp32: measured 3,506 us
        # on A100 PCIe and 1,956 us on H100, i.e. 0.79 and 0.82 of HBM bandwidth over these
        # 40 B/element; the former 2 x 12 B/element gave 0.48 and 0.49). A broadcast input's
        # gradient is then summed to its shape (one more pass over the full size).
        bw = []
        for s in tensors:
            bw += [mem_kernel(op_class, out * (dt + 1), float(out)), mem_kernel(op_class, 2 * out * dt, float(out)),
                   mem_kernel(op_class, out * (3 * dt + 1), float(out)), mem_kernel(op_class, out * (dt + 1), float(out)),
                   mem_kernel(op_class, out * (2 * dt + 1), float(out))]
            if numel(s) < out:
                bw.append(mem_kernel(op_class, (out + numel(s)) * dt, float(out)))
        return fw, bw
    # Unary activations and anything else with a gradient: G and the saved tensor in, dX out.
    return fw, [mem_kernel(op_class, 3 * out * dt, 4.0 * out)]


def _gemm_op_kernels(op_type, op_class, in_shapes, out_shape, dt, has_bias):
    shapes = [list(s) for s in in_shapes]
    if op_type in ("addmm", "baddbmm"):
        shapes = shapes[1:]  # the bias (or the added batch) comes first
        has_bias = True
    if op_type in ("Linear", "Conv1D", "linear") and len(shapes) == 1:
        # A module call records only its input; the weight is [K, N] with N the output's width.
        x = shapes[0]
        shapes = [x, [x[-1], out_shape[-1]]]
    a, b = shapes[0], shapes[1]
    weight = len(b) == 2 and op_type not in ("bmm", "matmul") or op_type in ("Linear", "Conv1D", "linear", "addmm", "mm")
    if weight:
        M = numel(a[:-1])
        K, N = a[-1], b[-1]
        fw = [gemm_kernel(op_class, 1, M, N, K, dt, b_batched=False)]
        bw = [gemm_kernel(op_class, 1, M, K, N, dt, b_batched=False),
              gemm_kernel(op_class, 1, K, N, M, dt, param_numel=K * N + (N if has_bias else 0))]
        if has_bias:
            bw.append(mem_kernel(op_class, (M * N + N) * dt, float(M * N)))
        return fw, bw
    # Two activations: batched matmul; batch dims broadcast.
    B = max(numel(a[:-2]), numel(b[:-2]))
    M, K, N = a[-2], a[-1], b[-1]
    fw = [gemm_kernel(op_class, B, M, N, K, dt)]
    bw = [gemm_kernel(op_class, B, M, K, N, dt), gemm_kernel(op_class, B, K, N, M, dt)]
    return fw, bw
