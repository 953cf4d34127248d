"""Kineto (torch.profiler) Chrome-trace importer -> OpTable.

GPU traces give one row per kernel / memcpy / memset, each linked to the CPU op that launched
it in both ways Kineto has used (FORMATS.md §2.2):
  new: kernel 'External id' == the launching cpu_op's 'External id';
  old: kernel 'correlation' -> cuda_runtime launch -> innermost cpu_op enclosing the launch on
       the launching thread.
CPU-only traces (gloo) give one row per outermost aten op / optimizer step on each thread and
one per collective span (gloo:* / nccl:* record_function spans, else c10d::* ops). A span's
collective kind and sizes come from the c10d op that issued it; a DTensor op's FLOPs/bytes from
the op that ran on the local shard beneath it.

The file is streamed (jsonstream) and kept as compact arrays, never as a list of event dicts.
"""

from __future__ import annotations

import math
import re
import warnings
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from simulator.errors import UserError
from simulator.gcpause import cyclic_gc_paused
from simulator.trace import kernel_classes as KC
from simulator.trace import kineto_fields as K
from simulator.trace.jsonstream import stream_trace
from simulator.trace.optable import make_optable


class TraceImportWarning(UserWarning):
    """Something in a trace was skipped or could not be interpreted; the message says what."""


@dataclass
class KinetoTrace:
    path: Path
    ops: pd.DataFrame
    rank: int | None
    world_size: int | None
    backend: str | None
    devices: list[str]                 # name of each device this rank's rows ran on
    device_properties: list[dict]
    distributed_info: dict
    n_events: int
    origin_ns: int                     # start_abs_ns of the earliest event in the file
    warnings: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)


_CLASS_CODES = {c: i for i, c in enumerate(K.OP_CLASSES)}
_OTHER = _CLASS_CODES["other"]
_COMM = _CLASS_CODES["communication"]
_OPT = _CLASS_CODES["optimizer"]
_GPU_CAT_KERNEL, _GPU_CAT_MEMCPY, _GPU_CAT_MEMSET = 0, 1, 2
_GPU_CAT_NAMES = ("kernel", "gpu_memcpy", "gpu_memset")
_KIND_CPU_OP, _KIND_ANNOTATION = 0, 1
_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")


# ---------------------------------------------------------------------------------------------
# per-op FLOPs and bytes from Input Dims / Input type
# ---------------------------------------------------------------------------------------------


# Kineto's ts is microseconds, relative to baseTimeNanoseconds or since the epoch (~1.7e15 in 2024);
# no profiled op lasts a day. Values outside these are corrupt and skipped, and counted.
_MAX_TS_US = 1e17
_MAX_DUR_US = 86_400e6


def _span(event: dict) -> tuple[float, float]:
    """(ts, dur) in µs, or ValueError for a negative, non-finite or absurd one."""
    ts = float(event["ts"])
    dur = float(event.get("dur", 0.0))
    if not (math.isfinite(ts) and math.isfinite(dur)) or abs(ts) > _MAX_TS_US or not 0.0 <= dur <= _MAX_DUR_US:
        raise ValueError("bad span")
    return ts, dur


def _int64_or(value, default: int) -> int:
    """An id that fits an int64 column, or ``default`` (NaN, inf, text, 2**64 in a corrupt trace)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    if isinstance(value, float) and not math.isfinite(value):
        return default
    value = int(value)
    return value if -2**63 <= value < 2**63 else default


def _args_of(event: dict) -> dict:
    """An event's ``args``; anything but a mapping (a hand-edited or corrupt trace) counts as none."""
    args = event.get("args")
    return args if isinstance(args, dict) else {}

def _prod(dims) -> int:
    p = 1
    for d in dims:
        p *= int(d)
    return p


def _is_shape(x) -> bool:
    return isinstance(x, list) and all(isinstance(d, int) for d in x)


def _numel_nested(x) -> int:
    """Elements in one Input Dims entry: a shape, or a TensorList's list of shapes."""
    if _is_shape(x):
        return _prod(x) if x else 0
    if isinstance(x, list):
        return sum(_numel_nested(y) for y in x)
    return 0


def _input_types(args: dict) -> list:
    """An op's recorded input types; [] where the record holds something else (a corrupt trace)."""
    types = args.get(K.ARG_INPUT_TYPE)
    return types if isinstance(types, list) else []


def _first_dtype(types) -> str | None:
    for t in types or ():
        dt = K.canonical_dtype(t) if isinstance(t, str) else None
        if dt is not None:
            return dt
    return None


def _matmul_flops(a: list[int], b: list[int]) -> tuple[int, int, int, int] | None:
    """(batch, m, k, n) of torch.matmul(a, b) with broadcasting, or None."""
    if not a or not b:
        return None
    a2 = [1] + a if len(a) == 1 else a
    b2 = b + [1] if len(b) == 1 else b
    m, k = a2[-2], a2[-1]
    k2, n = b2[-2], b2[-1]
    if k != k2:
        return None
    ba, bb = a2[:-2], b2[:-2]
    width = max(len(ba), len(bb))
    ba = [1] * (width - len(ba)) + ba
    bb = [1] * (width - len(bb)) + bb
    batch = _prod(max(x, y) for x, y in zip(ba, bb))
    return batch, m, k, n


def _tensor_args(dims: list, types: list) -> list[tuple[int, int]] | None:
    """(elements, bytes per element) of each tensor argument; 0 bytes where the dtype is unknown.

    Kineto writes one Input Dims / Input type entry per argument: a dtype name for a tensor (its
    dims [] for a 0-d tensor), 'Scalar' / '' / 'ScalarList' for non-tensors, 'TensorList' with a
    list of shapes (or [] when the list's shapes were not recorded) for tensor lists."""
    out = []
    for k, d in enumerate(dims):
        t = types[k] if k < len(types) else None
        if t == "TensorList" or (isinstance(d, list) and d and isinstance(d[0], list)):
            subs = [sub for sub in d if _is_shape(sub)] if isinstance(d, list) else []
            if not subs:
                return None  # a tensor list whose shapes were not recorded: the op's bytes are unknown
            for sub in subs:
                out.append((_prod(sub) if sub else 1, 0))
            continue
        if not isinstance(t, str) or not _is_shape(d):
            continue
        dt = K.canonical_dtype(t)
        if dt is None:
            continue  # Scalar, '', ScalarList, Device, ...
        out.append((_prod(d) if d else 1, K.DTYPE_BYTES.get(dt, 0)))
    return out


# Ops that only write their first argument (nothing read); ops that read every input and write a
# result the size of one (reductions write far less and are counted as reads only).
_WRITE_ONLY_OPS = frozenset({"fill_", "zero_", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
                             "new_zeros", "new_full", "normal_", "uniform_",
                             "bernoulli_", "random_"})
_READ_ONLY_OPS = frozenset({"sum", "mean", "norm", "linalg_vector_norm", "max", "min", "amax", "amin", "argmax",
                            "argmin", "prod", "var", "std", "var_mean", "std_mean", "any", "all",
                            "_local_scalar_dense", "item", "equal"})
# Tensor inputs of common elementwise ops; a further trailing tensor the size of the output is the
# out= argument of the op's .out overload (Kineto records it as an input): written, not read.
_UNARY_OPS = frozenset({"exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "neg", "sigmoid", "tanh", "relu", "gelu",
                        "silu", "sqrt", "rsqrt", "abs", "cos", "sin", "erf", "reciprocal", "sign", "floor", "ceil", "round",
                        "trunc", "square", "nan_to_num", "hardtanh", "leaky_relu", "elu", "softplus", "mish", "hardswish",
                        "hardsigmoid", "clamp", "clamp_min", "clamp_max", "_softmax", "softmax", "_log_softmax",
                        "log_softmax", "bitwise_not", "logical_not", "dropout", "native_dropout", "_to_copy", "to",
                        "clone", "contiguous"})
_BINARY_OPS = frozenset({"add", "sub", "mul", "div", "pow", "maximum", "minimum", "masked_fill", "threshold_backward",
                         "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward", "eq", "ne", "lt", "le",
                         "gt", "ge", "logical_and", "logical_or", "bitwise_and", "bitwise_or", "atan2", "fmod",
                         "remainder", "_softmax_backward_data", "_log_softmax_backward_data", "native_dropout_backward",
                         "rsub", "xlogy"})
_TERNARY_OPS = frozenset({"where", "lerp", "addcmul", "addcdiv"})
# Gathers read only the rows their indices pick, which shapes do not tell. nll_loss is one: its
# forward reads the one logit each target picks and its backward writes only those (the zero fill
# of the gradient is its own fill_ op); torch's nll_loss_forward_reduce_cuda_kernel_2d on an H200
# took 24 us over [16384, 128256] fp32 logits, 8.4 GB that counting the whole input would have
# had it read at 350 TB/s (device check, docs/design-notes.md, Round 28).
_GATHER_OPS = frozenset({"nll_loss", "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward",
                         "nll_loss2d_backward", "nll_loss_nd", "index_select", "index", "gather", "take", "embedding", "embedding_backward",
                         "embedding_dense_backward", "_embedding_bag", "_embedding_bag_backward", "embedding_bag",
                         "index_put_", "_index_put_impl_", "index_put", "scatter", "scatter_", "scatter_add",
                         "scatter_add_", "scatter_reduce", "index_add_", "index_copy_", "masked_select",
                         "masked_scatter_", "nonzero"})
# Fused optimizers update params, exp_avg, exp_avg_sq (lists 0, 2, 3) and read the grads (list 1).
_FUSED_ADAM_OPS = frozenset({"_fused_adam_", "_fused_adamw_", "_fused_adam", "_fused_adamw"})


def _rw_bytes(short: str, dims: list, types: list, fallback_itemsize: int) -> float:
    """Bytes an op really reads and writes: its tensor inputs once, plus its output once.

    An in-place op (name ending in '_') writes over its first argument; an out-of-place op writes
    a new tensor the size of its largest input (broadcasting) in its first input's dtype; fill_
    and the factories only write; reductions are counted as the reads they are dominated by."""
    if short in _GATHER_OPS or short.startswith(("embedding", "_embedding")):
        return math.nan
    tens = _tensor_args(dims, types)
    if not tens:  # None (unknown) or no tensors
        return math.nan
    sized = [(n, b or fallback_itemsize) for n, b in tens]
    if any(b == 0 for _, b in sized):
        return math.nan
    base = short.rstrip("_")
    arity = 1 if base in _UNARY_OPS else 2 if base in _BINARY_OPS else 3 if base in _TERNARY_OPS else None
    if arity is not None and len(sized) > arity and not short.endswith("_"):
        out_n, out_b = sized[-1]
        if out_n >= max(n for n, _ in sized[:arity]):
            # .out overload: inputs read once, the out tensor written once
            return float(sum(n * b for n, b in sized[:arity]) + out_n * out_b)
    if short in _FUSED_ADAM_OPS and isinstance(dims, list) and len(dims) >= 4:
        lists = [[_prod(x) if x else 1 for x in d if _is_shape(x)] if isinstance(d, list) else [] for d in dims[:4]]
        if all(lists[:4]):
            isz = fallback_itemsize or 4
            read = sum(sum(lst) for lst in lists[:4])
            written = sum(lists[0]) + sum(lists[2]) + sum(lists[3])
            return float(isz * (read + written))
    first_n, first_b = sized[0]
    if short in _WRITE_ONLY_OPS:
        return float(first_n * first_b)
    read = sum(n * b for n, b in sized)
    if short in _READ_ONLY_OPS:
        return float(read)
    if short.endswith("_") and not short.endswith("__"):
        if short.startswith("_foreach_"):
            # in place on the first list: its tensors are written back
            lst = dims[0] if isinstance(dims, list) and dims and isinstance(dims[0], list) else []
            n0 = sum(_prod(x) if x else 1 for x in lst if _is_shape(x))
            return float(read + n0 * first_b) if n0 else float(read + first_n * first_b)
        if short == "copy_" and len(sized) >= 2:
            # copy_(dst, src): src read, dst written (in its own dtype)
            return float(sized[1][0] * sized[1][1] + first_n * first_b)
        return float(read + first_n * first_b)
    out_n = max(n for n, _ in sized)
    return float(read + out_n * first_b)


def op_flops_bytes(name: str, cls: str, args: dict) -> tuple[float, float, str | None]:
    """(FLOPs, bytes read+written, dtype) of one CPU op from its recorded shapes; NaN if unknown.

    Bytes are what the op reads and writes, each tensor once (see _rw_bytes); ``cls`` is the
    kernel class of the op (simulator.trace.kernel_classes)."""
    dims = args.get(K.ARG_INPUT_DIMS)
    types = _input_types(args)
    dtype = _first_dtype(types)
    itemsize = K.DTYPE_BYTES.get(dtype or "", 0)
    flops = math.nan
    nbytes = math.nan
    if not isinstance(dims, list):
        f = args.get(K.ARG_FLOPS)
        return (float(f) if isinstance(f, (int, float)) else math.nan), nbytes, dtype
    short = name.split("::", 1)[-1]
    shapes = [d if _is_shape(d) else None for d in dims]
    try:
        if cls == "gemm":
            mkn = None
            if short in ("mm", "bmm", "matmul", "_scaled_mm") and len(shapes) >= 2 and shapes[0] and shapes[1]:
                mkn = _matmul_flops(shapes[0], shapes[1])
            elif short in ("addmm", "baddbmm") and len(shapes) >= 3 and shapes[1] and shapes[2]:
                mkn = _matmul_flops(shapes[1], shapes[2])
            elif short == "linear" and len(shapes) >= 2 and shapes[0] and shapes[1] and len(shapes[1]) == 2:
                x, w = shapes[0], shapes[1]
                if x[-1] == w[1]:
                    mkn = (1, _prod(x[:-1]), w[1], w[0])
            if mkn is not None:
                batch, m, k, n = mkn
                flops = 2.0 * batch * m * k * n
                if itemsize:
                    # A and B read, C written (a bias, when there is one, is read once more)
                    bias = _prod(shapes[0]) if short in ("addmm",) and shapes[0] else 0
                    nbytes = float(itemsize * (batch * (m * k + k * n + m * n) + bias))
        elif cls == "attention":
            # Forward inputs are (q, k, v, ...); backward ops put grad_out first.
            bwd = short.endswith("backward")
            qkv = shapes[1:4] if bwd else shapes[0:3]
            if len(qkv) == 3 and all(s and len(s) == 4 for s in qkv):
                q, k, v = qkv
                b, h, sq, d = q
                sk, dv = k[2], v[3]
                fwd = 2.0 * b * h * sq * sk * (d + dv)
                flops = 2.0 * fwd if bwd else fwd
                if itemsize:
                    o = b * h * sq * dv
                    # forward: q, k, v read, o written; backward: dO, q, k, v, o read, dq, dk, dv written
                    nbytes = float(itemsize * ((_prod(q) + _prod(k) + _prod(v)) * (2 if bwd else 1) + o * (2 if bwd else 1)))
        elif cls not in ("communication", "other", "embedding"):
            nbytes = _rw_bytes(short, dims, types, itemsize)
    except (TypeError, ValueError, IndexError):
        pass
    f = args.get(K.ARG_FLOPS)
    if isinstance(f, (int, float)) and f > 0 and math.isnan(flops):
        flops = float(f)
    return flops, nbytes, dtype


# ---------------------------------------------------------------------------------------------
# streaming collector
# ---------------------------------------------------------------------------------------------

class _Collector:
    """Keeps what the OpTable needs from each event in typed arrays (8 bytes a field)."""

    def __init__(self) -> None:
        self.name_codes: dict[str, int] = {}
        self.names: list[str] = []
        self.thread_codes: dict[tuple, int] = {}
        self.threads: list[tuple] = []
        # per name code, decided once
        self.name_cls: list[int] = []
        self.name_kcls: list[str | None] = []   # kernel class a CPU op of this name establishes
        self.name_flags: list[int] = []
        # GPU activity
        self.g_cat = array("b")
        self.g_name = array("l")
        self.g_dev = array("l")
        self.g_stream = array("q")
        self.g_ts = array("d")
        self.g_dur = array("d")
        self.g_ext = array("q")
        self.g_corr = array("q")
        self.g_coll_args: dict[int, dict] = {}
        self.g_grid: dict[int, int] = {}  # row -> CTAs launched (kernels whose args carry a grid)
        # launches (cuda_runtime / cuda_driver)
        self.r_corr = array("q")
        self.r_thread = array("l")
        self.r_ts = array("d")
        # host ops: cpu_op and user_annotation
        self.h_kind = array("b")
        self.h_name = array("l")
        self.h_thread = array("l")
        self.h_ts = array("d")
        self.h_dur = array("d")
        self.h_ext = array("q")
        self.h_flops = array("d")
        self.h_bytes = array("d")
        self.h_dtype = array("l")
        self.h_sig = array("l")          # op signature code: name + shapes + types (name alone without shapes)
        self.h_shapes = array("b")       # 1 when the op recorded Input Dims
        self.sig_codes: dict[str, int] = {}
        self.sig_names: list[str] = []
        self.sig_work: dict[int, tuple] = {}
        self.h_coll_args: dict[int, dict] = {}
        self.dtype_codes: dict[str | None, int] = {None: -1}
        self.dtype_names: list[str] = []
        self.gpu_labels: dict[Any, str] = {}
        self.malformed = 0

    # flags per name
    F_COMM_SPAN = 1      # nccl:* / gloo:* record_function span
    F_C10D = 2
    F_RPC = 4
    F_STEP = 8
    F_WANT_SHAPES = 16

    def _name(self, name: str) -> int:
        code = self.name_codes.get(name)
        if code is None:
            code = len(self.names)
            self.name_codes[name] = code
            self.names.append(name)
            cls = K.classify_cpu_op(name)
            flags = 0
            if name.startswith(K.COMM_ANNOTATION_PREFIXES):
                flags |= self.F_COMM_SPAN
            elif name.startswith(K.C10D_PREFIX):
                flags |= self.F_C10D
            elif name == K.RECORD_PARAM_COMMS:
                flags |= self.F_RPC
            if name.startswith(K.PROFILER_STEP_PREFIX):
                flags |= self.F_STEP
            kcls = KC.op_name_class(name)
            if kcls is not None or cls in ("gemm", "attention", "norm", "elementwise", "optimizer"):
                flags |= self.F_WANT_SHAPES
            self.name_cls.append(_CLASS_CODES[cls])
            self.name_kcls.append(kcls or K.OP_CLASSES[_CLASS_CODES[cls]])
            self.name_flags.append(flags)
        return code

    def _thread(self, pid, tid) -> int:
        if type(pid) is int and type(tid) is int:
            # Fast path (every event has a thread): a key seen before was stored as these very
            # ints; an int beyond 64 bits was stored as text and misses here, as it must.
            code = self.thread_codes.get((pid, tid))
            if code is not None:
                return code
        # Ids become int64 columns: anything that is not a 64-bit integer is kept as text.
        pid, tid = (v if isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63 else str(v) for v in (pid, tid))
        key = (pid, tid)
        code = self.thread_codes.get(key)
        if code is None:
            code = len(self.threads)
            self.thread_codes[key] = code
            self.threads.append(key)
        return code

    def _dtype(self, dt: str | None) -> int:
        code = self.dtype_codes.get(dt)
        if code is None:
            code = len(self.dtype_names)
            self.dtype_codes[dt] = code
            self.dtype_names.append(dt)
        return code

    def on_event(self, e: dict) -> None:
        ph = e.get("ph")
        if ph != "X":
            if ph == "M" and e.get("name") == "process_labels":
                label = _args_of(e).get("labels")
                if isinstance(label, str):
                    self.gpu_labels[e.get("pid")] = label
            return
        cat = e.get("cat")
        try:
            if cat in K.CAT_CPU_OP or cat in K.CAT_USER_ANNOTATION:
                self._host(e, _KIND_CPU_OP if cat in K.CAT_CPU_OP else _KIND_ANNOTATION)
            elif cat in K.CAT_RUNTIME:
                args = _args_of(e)
                corr = args.get(K.ARG_CORRELATION)
                if corr is None:
                    return
                ts, _ = _span(e)
                corr = _int64_or(corr, -1)
                if corr < 0:
                    raise ValueError("unusable correlation id")  # counted as malformed, never linked
                thread = self._thread(e.get("pid"), e.get("tid"))
                self.r_corr.append(corr)
                self.r_thread.append(thread)
                self.r_ts.append(ts)
            elif cat in K.CAT_GPU:
                self._gpu(e, cat)
        except (KeyError, TypeError, ValueError, OverflowError):
            self.malformed += 1

    def _host(self, e: dict, kind: int) -> None:
        name = e.get("name")
        if not isinstance(name, str):
            raise TypeError
        ts, dur = _span(e)
        args = _args_of(e)
        # Everything that can fail is read before the first append: the columns stay aligned.
        ext = _int64_or(args.get(K.ARG_EXTERNAL_ID, -1), -1)
        thread = self._thread(e.get("pid"), e.get("tid"))
        code = self._name(name)
        i = len(self.h_ts)
        self.h_kind.append(kind)
        self.h_name.append(code)
        self.h_thread.append(thread)
        self.h_ts.append(ts)
        self.h_dur.append(dur)
        self.h_ext.append(ext)
        flags = self.name_flags[code]
        flops = nbytes = math.nan
        dt = None
        dims = args.get(K.ARG_INPUT_DIMS)
        if kind == _KIND_CPU_OP and dims is not None:
            sig = f"{name}|{dims}|{args.get(K.ARG_INPUT_TYPE)}"
            self.h_shapes.append(1)
        else:
            sig = name
            self.h_shapes.append(0)
        sc = self.sig_codes.get(sig)
        if sc is None:
            sc = self.sig_codes[sig] = len(self.sig_names)
            self.sig_names.append(sig)
        self.h_sig.append(sc)
        if flags & self.F_WANT_SHAPES:
            # ops repeat with the same shapes every layer and step: compute each signature once
            hit = self.sig_work.get(sc) if dims is not None else None
            if hit is None:
                hit = op_flops_bytes(name, self.name_kcls[code], args)
                if dims is not None and K.ARG_FLOPS not in args:
                    self.sig_work[sc] = hit
            flops, nbytes, dt = hit
        elif flags & (self.F_COMM_SPAN | self.F_C10D | self.F_RPC):
            # Collective ops are few; keep the args that carry their metadata.
            keep = {k: args[k] for k in _COLL_ARG_KEYS if k in args}
            if keep:
                self.h_coll_args[i] = keep
        self.h_flops.append(flops)
        self.h_bytes.append(nbytes)
        self.h_dtype.append(self._dtype(dt))

    def _gpu(self, e: dict, cat: str) -> None:
        name = e.get("name")
        if not isinstance(name, str):
            raise TypeError
        args = _args_of(e)
        ts, dur = _span(e)
        # Everything that can fail is read before the first append: the columns stay aligned.
        dev = _int64_or(args.get(K.ARG_DEVICE, e.get("pid")), -1)
        stream = _int64_or(args.get(K.ARG_STREAM, e.get("tid")), -1)
        ext = _int64_or(args.get(K.ARG_EXTERNAL_ID, -1), -1)
        corr = _int64_or(args.get(K.ARG_CORRELATION, -1), -1)
        i = len(self.g_ts)
        gcat = _GPU_CAT_KERNEL if cat in K.CAT_KERNEL else _GPU_CAT_MEMCPY if cat in K.CAT_MEMCPY else _GPU_CAT_MEMSET
        self.g_cat.append(gcat)
        self.g_name.append(self._name(name))
        self.g_dev.append(dev)
        self.g_stream.append(stream)
        self.g_ts.append(ts)
        self.g_dur.append(dur)
        self.g_ext.append(ext)
        self.g_corr.append(corr)
        if K.ARG_COLL_NAME in args:
            self.g_coll_args[i] = {k: args[k] for k in _COLL_ARG_KEYS if k in args}
        grid = args.get(K.ARG_GRID)
        if type(grid) is list and len(grid) == 3:
            x, y, z = grid
            if type(x) is int and type(y) is int and type(z) is int and x > 0 and y > 0 and z > 0:
                blocks = x * y * z
                if blocks < 2**31:
                    self.g_grid[i] = blocks


_COLL_ARG_KEYS = (
    K.ARG_COLL_NAME, K.ARG_COLL_DTYPE, K.ARG_IN_NELEMS, K.ARG_OUT_NELEMS, K.ARG_GROUP_SIZE,
    K.ARG_PG_NAME, K.ARG_PG_RANKS, K.ARG_SEQ, K.ARG_INPUT_DIMS, K.ARG_INPUT_TYPE, K.ARG_CONCRETE_INPUTS,
)


# ---------------------------------------------------------------------------------------------
# collective metadata
# ---------------------------------------------------------------------------------------------

@dataclass
class _Coll:
    collective: str | None = None
    dtype: str | None = None
    in_bytes: int | None = None
    out_bytes: int | None = None
    msg_bytes: int | None = None
    group_size: int | None = None
    group_ranks: str | None = None
    pg_name: str | None = None
    seq: int | None = None
    peer: int | None = None  # send/recv: the other side, as its index in the call's process group
    source: str | None = None
    raw_name: str | None = None


MAX_GROUP_RANKS = 1 << 24  # no job has more ranks in one process group; beyond it a group size is corrupt
# No GPU holds a tensor near a pebibyte (the largest HBM is a few hundred GB): a message size below 0
# or above this comes from corrupt Input Dims or nelems, and is taken as unknown.
MAX_MESSAGE_BYTES = 1 << 50


def _coll_from_args(args: dict, source: str) -> _Coll | None:
    """From record_param_comms args (or the copy Kineto puts on NCCL kernels)."""
    raw = args.get(K.ARG_COLL_NAME)
    if not isinstance(raw, str) or raw == K.COLL_NAME_WAIT:
        return None
    c = _Coll(collective=K.normalise_collective(raw), raw_name=raw, source=source)
    c.dtype = K.canonical_dtype(args.get(K.ARG_COLL_DTYPE)) if isinstance(args.get(K.ARG_COLL_DTYPE), str) else None
    size = K.DTYPE_BYTES.get(c.dtype or "")
    n_in, n_out = args.get(K.ARG_IN_NELEMS), args.get(K.ARG_OUT_NELEMS)
    if size and isinstance(n_in, int):
        c.in_bytes = n_in * size
    if size and isinstance(n_out, int):
        c.out_bytes = n_out * size
    if c.in_bytes is not None or c.out_bytes is not None:
        c.msg_bytes = max(b for b in (c.in_bytes, c.out_bytes) if b is not None)
    gs = args.get(K.ARG_GROUP_SIZE)
    c.group_size = int(gs) if isinstance(gs, int) and not isinstance(gs, bool) and gs > 0 else None
    ranks = args.get(K.ARG_PG_RANKS)
    c.group_ranks = ranks if isinstance(ranks, str) else (str(ranks) if isinstance(ranks, list) else None)
    pg = args.get(K.ARG_PG_NAME)
    c.pg_name = str(pg) if pg is not None else None
    seq = args.get(K.ARG_SEQ)
    c.seq = int(seq) if isinstance(seq, int) else None
    return c


def _coll_from_dims(name: str, args: dict, source: str, default_group: int | None, input_index: int | None,
                    dtype_hint: str | None = None) -> _Coll:
    """From a nccl:/gloo: span's (or c10d op's) Input Dims: the input tensors of the call.
    dtype_hint stands in where the types say only 'TensorList' (c10d ops taking tensor lists)."""
    c = _Coll(collective=K.normalise_collective(name), raw_name=name, source=source)
    dims = args.get(K.ARG_INPUT_DIMS)
    types = _input_types(args)
    if isinstance(dims, list) and dims:
        if input_index is not None and input_index < len(dims):
            numel = _numel_nested(dims[input_index])
            dt = K.canonical_dtype(types[input_index]) if input_index < len(types) and isinstance(types[input_index], str) else None
            c.dtype = dt or _first_dtype(types) or dtype_hint
        else:
            numel = sum(_numel_nested(d) for d in dims)
            c.dtype = _first_dtype(types) or dtype_hint
        size = K.DTYPE_BYTES.get(c.dtype or "")
        if size and numel:
            c.in_bytes = numel * size
    c.group_size = default_group
    c.peer = _peer_from_args(name, args)
    # The *_base_ c10d ops record both buffers, whose ratio is the group size.
    if name in _C10D_OUT_IN and isinstance(dims, list) and len(dims) >= 2:
        n_out, n_in = _numel_nested(dims[0]), _numel_nested(dims[1])
        if n_out and n_in:
            big, small = max(n_out, n_in), min(n_out, n_in)
            if big % small == 0:
                c.group_size = big // small
    if c.in_bytes is not None:
        if c.collective == "all_gather":
            if c.group_size:
                c.out_bytes = c.in_bytes * c.group_size
                c.msg_bytes = c.out_bytes
        else:
            c.msg_bytes = c.in_bytes
            if c.collective == "reduce_scatter" and c.group_size:
                c.out_bytes = c.in_bytes // c.group_size
            elif c.collective in ("all_reduce", "all_to_all", "broadcast"):
                c.out_bytes = c.in_bytes
    return c


# c10d point-to-point ops: (tensors, process_group, dstRank / srcRank, tag). The peer is the other
# side's rank within the call's process group (torch.distributed.send converts the global rank).
_C10D_PEER_INDEX = {"c10d::send": 2, "c10d::recv_": 2}


def _peer_from_args(name: str, args: dict) -> int | None:
    k = _C10D_PEER_INDEX.get(name)
    vals = args.get(K.ARG_CONCRETE_INPUTS)
    if k is None or not isinstance(vals, list) or k >= len(vals):
        return None
    try:
        v = int(str(vals[k]))
    except ValueError:
        return None  # not recorded ("" without record_shapes)
    return v if v >= 0 else None


# c10d ops take (output, input, ...) for these; the rest take the input tensor list first.
_C10D_INPUT_INDEX = {
    "c10d::_allgather_base_": 1, "c10d::_reduce_scatter_base_": 1, "c10d::alltoall_base_": 1,
    "c10d::allgather_": 1, "c10d::reduce_scatter_": 1, "c10d::alltoall_": 1,
    "c10d::allgather_into_tensor_coalesced_": 1, "c10d::reduce_scatter_tensor_coalesced_": 1,
}


_C10D_OUT_IN = ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_",
                "c10d::allgather_into_tensor_coalesced_", "c10d::reduce_scatter_tensor_coalesced_")


def _coll_from_kernel_name(name: str) -> _Coll | None:
    m = K.NCCL_KERNEL_RE.match(name)
    if not m:
        return None
    c = _Coll(collective=K.normalise_collective(m.group("coll")), raw_name=name, source="kernel_name")
    rest = m.group("rest") or ""
    # Only reducing kernels name the real dtype; the others say int8_t for "bytes".
    if c.collective in ("all_reduce", "reduce_scatter", "reduce"):
        for tok in reversed(rest.split("_")):
            dt = K.canonical_dtype(tok)
            if dt:
                c.dtype = dt
                break
    return c


def _merge(primary: _Coll | None, fallback: _Coll | None) -> _Coll | None:
    if primary is None:
        return fallback
    if fallback is None:
        return primary
    for f in ("collective", "dtype", "in_bytes", "out_bytes", "msg_bytes", "group_size", "group_ranks", "pg_name", "seq", "peer"):
        if getattr(primary, f) is None and getattr(fallback, f) is not None:
            setattr(primary, f, getattr(fallback, f))
    return primary


# ---------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------

# A CUDA stream runs its work in order: one kernel or copy starts after the previous one ends. The
# profiler's timestamps are microsecond-rounded (an overlap of 1 us is rounding), and a real trace
# has next to none beyond it (the HTA A100 rank trace: 1 of 7,741 pairs). Past this share the
# timings cannot be a GPU's (durations edited, clocks of two traces merged into one file).
MAX_STREAM_OVERLAP_SHARE = 0.05
STREAM_OVERLAP_TOLERANCE_US = 1.0


def _refuse_overlapping_streams(table, path: Path) -> None:
    """Refuse, in one line, a trace whose GPU work overlaps itself on one stream (a duration
    edited to 3x overlapped 7,208 of 7,741 pairs; its measured parts then summed to 130% of the
    step without a word)."""
    if table.empty or "dur_us" not in table:
        return
    # GPU work only: a CPU trace's ops (gloo collectives, host compute) sit on threads and nest.
    gpu = table["category"].isin(_GPU_CAT_NAMES) & (table["stream"] >= 0)
    t = table[gpu].sort_values(["device", "stream", "start_us"], kind="stable")
    if len(t) < 2:
        return
    same = (t["stream"].to_numpy()[1:] == t["stream"].to_numpy()[:-1]) & (t["device"].to_numpy()[1:] == t["device"].to_numpy()[:-1])
    start = t["start_us"].to_numpy()
    end = start + t["dur_us"].to_numpy()
    over = same & (start[1:] < end[:-1] - STREAM_OVERLAP_TOLERANCE_US)
    pairs, n_over = int(same.sum()), int(over.sum())
    if pairs >= 20 and n_over > MAX_STREAM_OVERLAP_SHARE * pairs:
        worst = int(np.argmax(np.where(over, end[:-1] - start[1:], -1.0)))
        stream = int(t["stream"].to_numpy()[worst + 1])
        raise UserError(f"{path.name}: {n_over:,} of {pairs:,} GPU ops start before the previous one on their stream ends "
                        f"(stream {stream}: by up to {end[worst] - start[worst + 1]:.0f} us), which a GPU cannot do: the "
                        "trace's durations or clocks are not a run's (edited, or two traces merged); re-export it")


def import_kineto(path: str | Path, rank: int | None = None) -> KinetoTrace:
    """Read one Kineto trace (.json or .json.gz). Raises UserError on input that is not one."""
    with cyclic_gc_paused():
        return _import_kineto(Path(path), rank)


def _import_kineto(path: Path, rank: int | None) -> KinetoTrace:
    col = _Collector()
    top, n_events = stream_trace(path, col.on_event)
    if K.TRACE_EVENTS not in top:
        keys = ", ".join(list(top)[:5]) or "none"
        raise UserError(f"{str(path)!r} has no traceEvents (top-level keys: {keys}): it is not a Kineto/Chrome trace")
    events = top.get(K.TRACE_EVENTS)
    if events is not None and not isinstance(events, list):
        raise UserError(f"{str(path)!r}: traceEvents is a {type(events).__name__}, not a list of events: it is not a "
                        "Kineto/Chrome trace")
    if n_events == 0:
        raise UserError(f"{str(path)!r} holds no trace events (traceEvents is empty or holds no event objects): "
                        "re-run the profiler over at least one step")
    warn: list[str] = []
    di = top.get(K.DISTRIBUTED_INFO) if isinstance(top.get(K.DISTRIBUTED_INFO), dict) else {}
    di_rank, di_world = di.get(K.DI_RANK), di.get(K.DI_WORLD_SIZE)
    for key, v, lo in ((K.DI_RANK, di_rank, 0), (K.DI_WORLD_SIZE, di_world, 1)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= MAX_GROUP_RANKS):
            raise UserError(f"{str(path)!r}: distributedInfo.{key} {v!r} is not a {'rank' if lo == 0 else 'world size'} "
                            f"(a whole number {lo}..{MAX_GROUP_RANKS:,}): fix the trace, or remove distributedInfo and "
                            "name the rank in the path (rank_<k>/)")
    if isinstance(di_rank, int) and isinstance(di_world, int) and di_rank >= di_world:
        raise UserError(f"{str(path)!r}: distributedInfo.{K.DI_RANK} {di_rank} is not below its {K.DI_WORLD_SIZE} {di_world}: "
                        "fix the trace")
    if rank is None and isinstance(di_rank, int):
        rank = di_rank
    world = di_world if isinstance(di_world, int) else None
    props = top.get(K.DEVICE_PROPERTIES) if isinstance(top.get(K.DEVICE_PROPERTIES), list) else []
    base_ns = top.get(K.BASE_TIME_NS)
    # A corrupt base (NaN, infinite, beyond 64 bits) would shift every timestamp: count it, use 0.
    if isinstance(base_ns, bool) or not isinstance(base_ns, (int, float)) or not math.isfinite(base_ns) \
            or not 0 <= base_ns < 2**63:
        if base_ns is not None:
            warn.append(f"{path.name}: baseTimeNanoseconds {base_ns!r} is not a usable time; timestamps taken as they are")
        base_ns = 0
    base_ns = int(base_ns)
    if col.malformed:
        noun = "event" if col.malformed == 1 else "events"
        warn.append(f"{path.name}: skipped {col.malformed} {noun} without a usable ts, dur or name (negative, non-finite or absurd)")
    default_group = _default_group_size(di)

    if len(col.g_ts):
        ops = _gpu_rows(col, default_group, warn, path)
    elif len(col.h_ts):
        ops = _cpu_rows(col, default_group, warn, path)
    else:
        other = top.get("otherData")
        if isinstance(other, dict) and other.get("generator") == "clustersim":
            raise UserError(f"{str(path)!r} is a timeline ClusterSim simulated (simulate --perfetto), not a profiler "
                            "trace: open it in ui.perfetto.dev; give trace, validate and calibrate a torch.profiler trace")
        if col.malformed:
            raise UserError(f"{str(path)!r} has {n_events} event{'s' if n_events != 1 else ''} but none usable: {col.malformed} were skipped for a ts, "
                            "dur or name that is negative, non-finite or absurd: the trace is corrupt, re-export it")
        raise UserError(
            f"{str(path)!r} has {n_events} event{'s' if n_events != 1 else ''} but no GPU kernels and no CPU ops: "
            "profile with activities=[CPU] (and CUDA) so that ops are recorded"
        )
    if not len(ops["ts"]):
        raise UserError(f"{str(path)!r} has no ops this importer understands: expected kernel or cpu_op events")

    # Unknown collectives keep their rows (class communication, collective 'other') and are named.
    unknown = ops.pop("_unknown_colls")
    corrupt = ops.pop("_corrupt_sizes", 0)
    if corrupt:
        warn.append(f"{path.name}: {corrupt} collective(s) record a message size below 0 or above 1 PiB (corrupt "
                    "Input Dims or nelems): their size is taken as unknown")
    if unknown:
        listed = ", ".join(f"{n!r} x{c}" for n, c in sorted(unknown.items()))
        warn.append(f"{path.name}: unknown collective names kept as collective 'other': {listed}")

    ts = np.asarray(ops.pop("ts"), dtype=np.float64)
    whole = np.floor(ts)
    abs_ns = whole.astype(np.int64) * 1000 + np.round((ts - whole) * 1000).astype(np.int64) + base_ns
    origin = int(abs_ns.min())
    n = len(ts)
    ops["start_abs_ns"] = abs_ns
    ops["start_us"] = (abs_ns - origin) / 1000.0
    ops["rank"] = np.full(n, -1 if rank is None else rank, dtype=np.int32)
    table = make_optable(ops, n)
    table = table.sort_values(["start_abs_ns", "stream"], kind="stable").reset_index(drop=True)

    _refuse_overlapping_streams(table, path)
    devices = _device_names(table, props, col.gpu_labels)
    for w in warn:
        warnings.warn(w, TraceImportWarning, stacklevel=2)
    meta = {k: v for k, v in top.items() if k not in (K.TRACE_EVENTS, K.DEVICE_PROPERTIES)}
    return KinetoTrace(
        path=path, ops=table, rank=rank, world_size=world,
        backend=di.get(K.DI_BACKEND) if isinstance(di.get(K.DI_BACKEND), str) else None,
        devices=devices, device_properties=props, distributed_info=di, n_events=n_events,
        origin_ns=origin, warnings=warn, metadata=meta,
    )


def _default_group_size(di: dict) -> int | None:
    """Group size to assume for a collective whose own record does not say: known only when every
    process group of the job has the same size."""
    pgs = di.get(K.DI_PG_CONFIG)
    if isinstance(pgs, list) and pgs:
        sizes = {p.get(K.PG_SIZE) for p in pgs if isinstance(p, dict)}
        if len(sizes) == 1:
            (s,) = sizes
            return s if isinstance(s, int) else None
    return None


def _device_names(table: pd.DataFrame, props: list, labels: dict) -> list[str]:
    devs = sorted(int(d) for d in table["device"].unique() if d >= 0)
    if not devs:
        return ["cpu"] if len(table) else []
    by_id = {p.get(K.DEV_ID): p.get(K.DEV_NAME) for p in props if isinstance(p, dict)}
    return [str(by_id.get(d) or f"GPU {d} (unnamed)") for d in devs]


def _np(a: array, dtype) -> np.ndarray:
    if not len(a):
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(a, dtype={"b": np.int8, "l": np.dtype(f"i{a.itemsize}"), "q": np.int64, "d": np.float64}[a.typecode]).astype(dtype, copy=False)


def _step_of(name: str) -> int:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else -1


def _enclosing(col: _Collector, q_thread: np.ndarray, q_ts: np.ndarray):
    """For each query (thread, ts): innermost enclosing cpu_op, comm span, collective op, and
    context class (optimizer wins; else the innermost classified op).

    Host ops are walked per thread in start order with a stack whose entries carry what their
    ancestors established, so a query costs O(1) after popping the entries that have ended.
    """
    nq = len(q_ts)
    out_op = np.full(nq, -1, dtype=np.int64)
    out_span = np.full(nq, -1, dtype=np.int64)
    out_coll = np.full(nq, -1, dtype=np.int64)
    out_cls = np.full(nq, _OTHER, dtype=np.int64)
    if not nq or not len(col.h_ts):
        return out_op, out_span, out_coll, out_cls
    h_ts, h_dur = _np(col.h_ts, np.float64), _np(col.h_dur, np.float64)
    h_thread, h_name, h_kind = _np(col.h_thread, np.int64), _np(col.h_name, np.int64), _np(col.h_kind, np.int64)
    name_cls = col.name_cls
    name_flags = col.name_flags
    coll_args = col.h_coll_args
    F_SPAN, F_C10D, F_RPC = col.F_COMM_SPAN, col.F_C10D, col.F_RPC
    # ops sorted by (thread, ts, -dur) so parents precede children
    h_order = np.lexsort((-h_dur, h_ts, h_thread))
    q_order = np.lexsort((q_ts, q_thread))
    h_end = h_ts + h_dur
    hb = np.searchsorted(h_thread[h_order], np.arange(len(col.threads) + 1))
    qb = np.searchsorted(q_thread[q_order], np.arange(len(col.threads) + 1))
    for t in range(len(col.threads)):
        qs = q_order[qb[t]:qb[t + 1]]
        if not len(qs):
            continue
        hs = h_order[hb[t]:hb[t + 1]].tolist()
        hts = h_ts[hs].tolist() if hs else []
        hend = h_end[hs].tolist() if hs else []
        root = (math.inf, -1, -1, -1, _OTHER, False)
        stack = [root]
        j = 0
        nh = len(hs)
        for qi, qt in zip(qs.tolist(), q_ts[qs].tolist()):
            while j < nh and hts[j] <= qt:
                i = hs[j]
                st = hts[j]
                while stack[-1][0] < st:
                    stack.pop()
                p = stack[-1]
                code = int(h_name[i])
                flags = name_flags[code]
                cls = name_cls[code]
                op = i if h_kind[i] == _KIND_CPU_OP and not flags & F_SPAN else p[1]
                span = i if flags & F_SPAN else p[2]
                coll = p[3]
                if flags & F_RPC:
                    a = coll_args.get(i)
                    if a and a.get(K.ARG_COLL_NAME) not in (None, K.COLL_NAME_WAIT):
                        coll = i
                elif flags & F_C10D and coll < 0:
                    coll = i
                ccls = cls if cls not in (_OTHER, _COMM) else p[4]
                opt = p[5] or cls == _OPT
                stack.append((hend[j], op, span, coll, ccls, opt))
                j += 1
            while stack[-1][0] < qt:
                stack.pop()
            top = stack[-1]
            out_op[qi], out_span[qi], out_coll[qi] = top[1], top[2], top[3]
            out_cls[qi] = _OPT if top[5] else top[4]
    return out_op, out_span, out_coll, out_cls


def _steps(col: _Collector, t: np.ndarray) -> np.ndarray:
    """ProfilerStep#N (on any thread) that contains each CPU time t; -1 outside every step."""
    step = np.full(len(t), -1, dtype=np.int32)
    if not len(col.h_ts) or not len(t):
        return step
    h_name = _np(col.h_name, np.int64)
    flags = np.asarray(col.name_flags, dtype=np.int64)[h_name]
    idx = np.flatnonzero((flags & col.F_STEP) != 0)
    if not len(idx):
        return step
    h_ts, h_dur = _np(col.h_ts, np.float64), _np(col.h_dur, np.float64)
    idx = idx[np.argsort(h_ts[idx], kind="stable")]
    s_start, s_end = h_ts[idx], h_ts[idx] + h_dur[idx]
    s_num = np.array([_step_of(col.names[h_name[i]]) for i in idx.tolist()], dtype=np.int32)
    pos = np.searchsorted(s_start, t, side="right") - 1
    ok = (pos >= 0) & (t <= s_end[np.maximum(pos, 0)])
    return np.where(ok, s_num[np.maximum(pos, 0)], -1).astype(np.int32)


def _gpu_rows(col: _Collector, default_group: int | None, warn: list[str], path: Path) -> dict:
    n = len(col.g_ts)
    g_cat = _np(col.g_cat, np.int64)
    g_name = _np(col.g_name, np.int64)
    g_ext = _np(col.g_ext, np.int64)
    g_corr = _np(col.g_corr, np.int64)
    g_ts = _np(col.g_ts, np.float64)

    # kernel -> launch (cuda_runtime with the same correlation id)
    r_corr = _np(col.r_corr, np.int64)
    launch_thread = np.full(n, -1, dtype=np.int64)
    launch_ts = np.full(n, np.nan)
    has_launch = np.zeros(n, dtype=bool)
    if len(r_corr):
        order = np.argsort(r_corr, kind="stable")
        sc = r_corr[order]
        pos = np.clip(np.searchsorted(sc, g_corr), 0, len(sc) - 1)
        has_launch = (sc[pos] == g_corr) & (g_corr >= 0)
        ridx = order[pos]
        launch_thread = np.where(has_launch, _np(col.r_thread, np.int64)[ridx], -1)
        launch_ts = np.where(has_launch, _np(col.r_ts, np.float64)[ridx], np.nan)
    q = np.flatnonzero(has_launch)
    e_op, e_span, e_coll, e_cls = _enclosing(col, launch_thread[q], launch_ts[q])
    op = np.full(n, -1, dtype=np.int64)
    span = np.full(n, -1, dtype=np.int64)
    collop = np.full(n, -1, dtype=np.int64)
    ctx_cls = np.full(n, _OTHER, dtype=np.int64)
    op[q], span[q], collop[q], ctx_cls[q] = e_op, e_span, e_coll, e_cls
    # A kernel belongs to the step its launch happened in (the GPU may run it later).
    step = _steps(col, np.where(has_launch, launch_ts, g_ts))

    # New-style link: kernel External id names the launching cpu_op (it differs from correlation).
    h_ext = _np(col.h_ext, np.int64)
    h_kind = _np(col.h_kind, np.int64)
    n_ext_linked = 0
    if len(h_ext):
        cpu_idx = np.flatnonzero((h_kind == _KIND_CPU_OP) & (h_ext >= 0))
        order = cpu_idx[np.argsort(h_ext[cpu_idx], kind="stable")]
        se = h_ext[order]
        if len(se):
            pos = np.clip(np.searchsorted(se, g_ext), 0, len(se) - 1)
            hit = (se[pos] == g_ext) & (g_ext >= 0) & (g_ext != g_corr)
            op = np.where(hit, order[pos], op)
            n_ext_linked = int(hit.sum())
    no_link = int((op < 0).sum())
    if no_link:
        warn.append(
            f"{path.name}: {no_link} of {n} GPU events have no launching CPU op in the trace "
            "(CUDA graphs, or launches outside the profiled window); classified by name only"
        )

    h_name = _np(col.h_name, np.int64)
    # Kernel class from the kernel's name family and its launching op (kernel_classes), decided
    # once per distinct (kernel name, op name, optimizer context, enclosing class, category).
    op_name_code = np.where(op >= 0, h_name[np.maximum(op, 0)], -1) if len(h_name) else np.full(n, -1, dtype=np.int64)
    in_opt = ctx_cls == _OPT
    kcls_codes = {c: i for i, c in enumerate(KC.KERNEL_CLASSES)}
    ctx_kcls = {_CLASS_CODES["attention"]: "attention", _CLASS_CODES["norm"]: "norm"}
    cache: dict[tuple, int] = {}
    kcls = np.empty(n, dtype=np.int64)
    for i, key in enumerate(zip(g_name.tolist(), op_name_code.tolist(), in_opt.tolist(), ctx_cls.tolist(), g_cat.tolist())):
        v = cache.get(key)
        if v is None:
            kn, on, opt, cx, gc = key
            onm = col.names[on] if on >= 0 else None
            # c10d / record_param_comms say nothing about a compute kernel's class
            if onm is not None and K.is_comm_op_name(onm):
                onm = None
            v = kcls_codes[KC.classify_kernel(col.names[kn], onm, bool(opt), _GPU_CAT_NAMES[gc], ctx_kcls.get(cx))]
            cache[key] = v
        kcls[i] = v
    kcls_names = list(KC.KERNEL_CLASSES)
    to_op = np.array([_CLASS_CODES[KC.KERNEL_TO_OP_CLASS[c]] for c in kcls_names], dtype=np.int64)
    cls = to_op[kcls]
    # Kernels that copy or fill are memory-bound SM work like elementwise kernels; only the DMA
    # engine's memcpy/memset events are charged to memcpy.
    cls = np.where(np.isin(kcls, [kcls_codes["copy"], kcls_codes["memset"]]), _CLASS_CODES["elementwise"], cls)
    cls = np.where(g_cat != _GPU_CAT_KERNEL, _CLASS_CODES["memcpy"], cls)

    # An op's FLOPs and bytes are counted once, spread over the kernels it launched in proportion
    # to their durations; only over its kernels of its own class where it has any (a convolution's
    # layout transposes do no multiply-adds).
    flops = np.full(n, np.nan)
    nbytes = np.full(n, np.nan)
    dtype_code = np.full(n, -1, dtype=np.int64)
    g_dur = _np(col.g_dur, np.float64)
    linked = np.flatnonzero(op >= 0)
    if len(linked):
        h_flops, h_bytes = _np(col.h_flops, np.float64), _np(col.h_bytes, np.float64)
        name_kcls = col.name_kcls
        own = np.array([_CLASS_CODES.get(KC.KERNEL_TO_OP_CLASS.get(name_kcls[h_name[o]] or "", "other"), _OTHER)
                        for o in op[linked].tolist()], dtype=np.int64)
        same = cls[linked] == own
        df = pd.DataFrame({"op": op[linked], "same": same, "dur": np.maximum(g_dur[linked], 0.0)})
        any_same = df.groupby("op")["same"].transform("any").to_numpy()
        take = np.where(any_same, same, True)
        w = np.where(take, df["dur"].to_numpy(), 0.0)
        n_take = pd.Series(take.astype(float)).groupby(df["op"].to_numpy()).transform("sum").to_numpy()
        tot = pd.Series(w).groupby(df["op"].to_numpy()).transform("sum").to_numpy()
        # zero-duration kernels: equal shares
        share = np.where(tot > 0, w / np.where(tot > 0, tot, 1.0), np.where(take, 1.0 / np.maximum(n_take, 1.0), 0.0))
        src = op[linked]
        flops[linked] = np.where(take, h_flops[src] * share, np.nan)
        nbytes[linked] = np.where(take, h_bytes[src] * share, np.nan)
        dtype_code[linked] = _np(col.h_dtype, np.int64)[src]
    h_sig, h_shapes = _np(col.h_sig, np.int64), _np(col.h_shapes, np.int64)
    # Signature of the launching op (its name, shapes and types), else the kernel's own name.
    sig = np.where(op >= 0, h_sig[np.maximum(op, 0)] if len(h_sig) else -1, -1)
    op_sig = [col.sig_names[c] if c >= 0 else col.names[k] for c, k in zip(sig.tolist(), g_name.tolist())]
    shapes_known = np.where(op >= 0, h_shapes[np.maximum(op, 0)] if len(h_shapes) else 0, 0).astype(bool)
    dtypes = [None if c < 0 else col.dtype_names[c] for c in dtype_code.tolist()]

    # collective metadata for communication kernels
    colls: dict[int, _Coll] = {}
    unknown: dict[str, int] = {}
    comm_rows = np.flatnonzero(cls == _COMM)
    for r in comm_rows.tolist():
        c = None
        a = col.g_coll_args.get(r)
        if a:
            c = _coll_from_args(a, "kernel_args")
        o = int(op[r])
        if o >= 0 and col.name_flags[h_name[o]] & col.F_RPC:
            c = _merge(c, _coll_from_args(col.h_coll_args.get(o, {}), "record_param_comms"))
        co = int(collop[r])
        if co >= 0 and col.name_flags[h_name[co]] & col.F_RPC:
            c = _merge(c, _coll_from_args(col.h_coll_args.get(co, {}), "record_param_comms"))
        s = int(span[r])
        if s >= 0:
            c = _merge(c, _coll_from_dims(col.names[h_name[s]], col.h_coll_args.get(s, {}), "annotation", default_group, None))
        if co >= 0 and col.name_flags[h_name[co]] & col.F_C10D:
            nm = col.names[h_name[co]]
            c = _merge(c, _coll_from_dims(nm, col.h_coll_args.get(co, {}), "c10d_op", default_group, _C10D_INPUT_INDEX.get(nm, 0)))
        c = _merge(c, _coll_from_kernel_name(col.names[g_name[r]]))
        if c is None:
            c = _Coll(raw_name=col.names[g_name[r]], source="kernel_name")
        if c.collective is None:
            unknown[c.raw_name] = unknown.get(c.raw_name, 0) + 1
            c.collective = "other"
        colls[r] = c
        if c.dtype and dtypes[r] is None:
            dtypes[r] = c.dtype
        elif c.dtype:
            dtypes[r] = c.dtype

    cpu_op_names = [None if o < 0 else col.names[h_name[o]] for o in op.tolist()]
    out = {
        "ts": g_ts,
        "device": _np(col.g_dev, np.int16),
        "stream": _np(col.g_stream, np.int64),
        "category": pd.Categorical.from_codes(g_cat, categories=list(_GPU_CAT_NAMES)),
        "name": pd.Categorical.from_codes(g_name, categories=col.names),
        "cpu_op": cpu_op_names,
        "op_class": pd.Categorical.from_codes(cls, categories=list(K.OP_CLASSES)),
        "kernel_class": pd.Categorical.from_codes(kcls, categories=kcls_names),
        "op_id": op,
        "op_sig": op_sig,
        "shapes_known": shapes_known,
        "dur_us": g_dur,
        "step": step.astype(np.int32),
        "flops": flops,
        "bytes": nbytes,
        "dtype": dtypes,
        "external_id": g_ext,
        "correlation": g_corr,
    }
    out.update(_coll_columns(colls, n, g_ts, out["stream"]))
    grid = [pd.NA] * n
    for r, b in col.g_grid.items():
        grid[r] = b
    out["grid_blocks"] = pd.array(grid, dtype="Int32")
    out["_unknown_colls"] = unknown
    return out


def _coll_columns(colls: dict[int, _Coll], n: int, ts: np.ndarray, stream: np.ndarray) -> dict:
    collective = [None] * n
    msg = [pd.NA] * n
    inb = [pd.NA] * n
    outb = [pd.NA] * n
    gsize = [pd.NA] * n
    granks = [None] * n
    pg = [None] * n
    seq = [pd.NA] * n
    peer = [pd.NA] * n
    src = [None] * n
    corrupt = 0

    def size_or_na(b):
        nonlocal corrupt
        if b is None:
            return pd.NA
        if not 0 <= b <= MAX_MESSAGE_BYTES:
            corrupt += 1
            return pd.NA
        return b

    for r, c in colls.items():
        collective[r] = c.collective
        bad_before = corrupt
        msg[r], inb[r], outb[r] = size_or_na(c.msg_bytes), size_or_na(c.in_bytes), size_or_na(c.out_bytes)
        if corrupt > bad_before:  # one collective: count it once, and know none of its sizes
            corrupt = bad_before + 1
            msg[r] = inb[r] = outb[r] = pd.NA
        # (a group beyond MAX_GROUP_RANKS is no real job's, whichever record gave it: unknown)
        gsize[r] = c.group_size if c.group_size is not None and 0 < c.group_size <= MAX_GROUP_RANKS else pd.NA
        granks[r] = c.group_ranks
        pg[r] = c.pg_name
        seq[r] = c.seq if c.seq is not None else pd.NA
        peer[r] = c.peer if c.peer is not None else pd.NA
        src[r] = c.source
    # Without a recorded Seq, number each stream's collectives in start order.
    missing = [r for r in colls if colls[r].seq is None]
    if missing:
        rows = np.array(missing, dtype=np.int64)
        rows = rows[np.lexsort((ts[rows], stream[rows]))]
        last, k = None, 0
        for r in rows.tolist():
            s = int(stream[r])
            k = k + 1 if s == last else 0
            last = s
            seq[r] = k
    return {
        "collective": collective, "msg_bytes": pd.array(msg, dtype="Int64"),
        "in_msg_bytes": pd.array(inb, dtype="Int64"), "out_msg_bytes": pd.array(outb, dtype="Int64"),
        "group_size": pd.array(gsize, dtype="Int32"), "group_ranks": granks, "pg_name": pg,
        "seq": pd.array(seq, dtype="Int64"), "coll_source": src, "peer": pd.array(peer, dtype="Int32"),
        "_corrupt_sizes": corrupt,
    }


def _parents(h_thread: np.ndarray, h_ts: np.ndarray, end: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Enclosing host event on the same thread (-1 at the top); order is (thread, ts, -dur)."""
    parent = np.full(len(h_ts), -1, dtype=np.int64)
    stack: list[int] = []
    last = None
    ends = end.tolist()
    for i, th, st in zip(order.tolist(), h_thread[order].tolist(), h_ts[order].tolist()):
        if th != last:
            stack = []
            last = th
        while stack and ends[stack[-1]] < st:
            stack.pop()
        if stack:
            parent[i] = stack[-1]
        stack.append(i)
    return parent


def _span_issuers(col: _Collector, span_idx: np.ndarray, c10d_idx: np.ndarray, parent: np.ndarray) -> dict[int, int]:
    """gloo:/nccl: span -> the c10d op that issued it.

    The span runs on the process group's worker thread and names what the backend ran, not
    what was asked for (gloo runs reduce_scatter_tensor as an all_reduce); the c10d op on the
    calling thread knows the real collective and both buffers. Neither side records a process
    group in CPU traces, so pairing is by order: each backend executes its queue in issue order,
    and the span's input must be the op's input. Each span takes the earliest still-unpaired op
    that started no later than it with a compatible kind and the same input element count, so an
    op that never got a span (cut off by the profiling window) can only be skipped over by ops
    with an identical signature, which carry the same metadata anyway.
    """
    h_ts, h_name = _np(col.h_ts, np.float64), _np(col.h_name, np.int64)
    h_end = h_ts + _np(col.h_dur, np.float64)
    flags = col.name_flags
    ops = []
    for i in c10d_idx.tolist():
        p = int(parent[i])
        # A gloo:send/recv span stays open on the calling thread until its work is waited on, so
        # the next c10d op (batch_isend_irecv's recv_ after its send) nests in it and, through
        # it, under the c10d op that issued it although that op had returned: only a c10d op
        # still running at this one's start issued it.
        while p >= 0 and not (flags[h_name[p]] & col.F_C10D and h_end[p] >= h_ts[i]):
            p = int(parent[p])
        if p >= 0:
            continue  # issued by an enclosing c10d op, which is the one that pairs
        nm = col.names[h_name[i]]
        kind = K.normalise_collective(nm)
        if kind in (None, "barrier"):
            continue
        dims = col.h_coll_args.get(i, {}).get(K.ARG_INPUT_DIMS)
        k = _C10D_INPUT_INDEX.get(nm, 0)
        numel = _numel_nested(dims[k]) if isinstance(dims, list) and k < len(dims) else 0
        ops.append((h_ts[i], i, kind, numel or None))
    ops.sort()
    spans = sorted((h_ts[i], i) for i in span_idx.tolist())
    pending: list[tuple] = []
    out: dict[int, int] = {}
    j = 0
    for t, s in spans:
        while j < len(ops) and ops[j][0] <= t:
            pending.append(ops[j])
            j += 1
        kind = K.normalise_collective(col.names[h_name[s]])
        if kind in (None, "barrier"):
            continue  # a barrier's c10d op adds only a dummy 1-element tensor
        dims = col.h_coll_args.get(s, {}).get(K.ARG_INPUT_DIMS)
        numel = (sum(_numel_nested(d) for d in dims) if isinstance(dims, list) else 0) or None
        for n, (_, i, okind, onumel) in enumerate(pending):
            if okind != kind and not (kind == "all_reduce" and okind == "reduce_scatter"):
                continue
            if numel is not None and onumel is not None and numel != onumel:
                continue
            out[s] = i
            del pending[n]
            break
    return out


# DTensor's __torch_dispatch__ shows up as this record_function between the op called on global
# shapes and the op that ran on the local shard.
_DTENSOR_DISPATCH = "PythonSubclass"


def _local_work(col: _Collector, rows: np.ndarray, cls: np.ndarray, parent: np.ndarray,
                flops: np.ndarray, nbytes: np.ndarray) -> int:
    """Replace, in place, the FLOPs/bytes of each row whose op dispatched through a tensor subclass
    with those of the ops that ran on local shards beneath it; returns how many rows changed.

    A DTensor op is recorded with the global shapes, so its own FLOPs overstate the work by the
    sharding degree. The shard's op is the direct child of the dispatch span that has no further
    dispatch below it; only ops of the row's class count (redistribution copies are not gemm work).
    """
    code = col.name_codes.get(_DTENSOR_DISPATCH)
    if code is None or not len(rows):
        return 0
    h_name = _np(col.h_name, np.int64)
    is_ps = h_name == code
    dispatches = np.zeros(len(h_name), dtype=bool)   # a dispatch span lies somewhere beneath
    for i in np.flatnonzero(is_ps).tolist():
        p = int(parent[i])
        while p >= 0 and not dispatches[p]:
            dispatches[p] = True
            p = int(parent[p])
    row_of = {int(r): k for k, r in enumerate(rows.tolist())}
    targets = {k for k, r in enumerate(rows.tolist()) if dispatches[r]}
    if not targets:
        return 0
    h_flops, h_bytes = _np(col.h_flops, np.float64), _np(col.h_bytes, np.float64)
    name_cls = np.asarray(col.name_cls, dtype=np.int64)
    acc: dict[int, list[float]] = {}
    for x in np.flatnonzero(~is_ps & ~dispatches).tolist():
        p = int(parent[x])
        if p < 0 or not is_ps[p]:
            continue
        a = p
        while a >= 0 and a not in row_of:
            a = int(parent[a])
        k = row_of.get(a, -1)
        if k not in targets or name_cls[h_name[x]] != cls[k]:
            continue
        v = acc.setdefault(k, [math.nan, math.nan])
        for j, val in ((0, h_flops[x]), (1, h_bytes[x])):
            if not math.isnan(val):
                v[j] = val if math.isnan(v[j]) else v[j] + val
    for k, (f, b) in acc.items():
        flops[k], nbytes[k] = f, b
    return len(acc)


def _cpu_rows(col: _Collector, default_group: int | None, warn: list[str], path: Path) -> dict:
    """CPU-only trace: the outermost aten op / optimizer step on each thread, and collective spans."""
    h_ts, h_dur = _np(col.h_ts, np.float64), _np(col.h_dur, np.float64)
    h_thread, h_name, h_kind = _np(col.h_thread, np.int64), _np(col.h_name, np.int64), _np(col.h_kind, np.int64)
    flags = np.asarray(col.name_flags, dtype=np.int64)[h_name]
    name_cls = np.asarray(col.name_cls, dtype=np.int64)
    cls = name_cls[h_name]
    is_span = (flags & col.F_COMM_SPAN) != 0
    is_c10d = (flags & col.F_C10D) != 0
    is_rpc = (flags & col.F_RPC) != 0
    rpc_coll = np.array(
        [bool(is_rpc[i]) and (col.h_coll_args.get(i, {}).get(K.ARG_COLL_NAME) not in (None, K.COLL_NAME_WAIT)) for i in range(len(h_ts))]
    ) if is_rpc.any() else np.zeros(len(h_ts), dtype=bool)
    # The span a process group opens around its work is the collective's real duration; the
    # c10d op on the calling thread only enqueues it. Fall back to c10d ops, then to rpc.
    if is_span.any():
        comm = is_span
        coll_source = "annotation"
    elif is_c10d.any():
        comm = is_c10d
        coll_source = "c10d_op"
    else:
        comm = rpc_coll
        coll_source = "record_param_comms"
    aten = np.array([col.names[c].startswith("aten::") for c in range(len(col.names))], dtype=bool)[h_name]
    compute = ~comm & ~is_c10d & ~is_rpc & ~is_span & (
        (aten & (h_kind == _KIND_CPU_OP)) | np.isin(cls, [_CLASS_CODES[c] for c in ("gemm", "attention", "norm", "optimizer", "elementwise")])
    )
    candidate = comm | compute
    blocker = candidate | is_c10d | is_rpc | is_span
    emit = np.zeros(len(h_ts), dtype=bool)
    order = np.lexsort((-h_dur, h_ts, h_thread))
    end = h_ts + h_dur
    last_thread = None
    stack: list[float] = []
    o_thread, o_ts, o_end = h_thread[order].tolist(), h_ts[order].tolist(), end[order].tolist()
    o_block, o_cand = blocker[order].tolist(), candidate[order].tolist()
    o_span = (comm & is_span)[order].tolist()
    for k, i in enumerate(order.tolist()):
        th = o_thread[k]
        if th != last_thread:
            stack = []
            last_thread = th
        st = o_ts[k]
        while stack and stack[-1] < st:
            stack.pop()
        if o_span[k]:
            # A collective span is the collective's own record even when it starts inside
            # the c10d op that issued it (gloo:send does), so it is never folded away.
            emit[i] = True
            continue
        if stack:
            continue  # inside an emitted op or a collective: counted there
        if o_block[k]:
            if o_cand[k]:
                emit[i] = True
            stack.append(o_end[k])
    rows = np.flatnonzero(emit)
    rows = rows[np.argsort(h_ts[rows], kind="stable")]
    n = len(rows)
    row_cls = cls[rows]
    row_comm = comm[rows]
    row_cls = np.where(row_comm, _COMM, row_cls)
    parent = _parents(h_thread, h_ts, end, order)
    row_flops = _np(col.h_flops, np.float64)[rows].copy()
    row_bytes = _np(col.h_bytes, np.float64)[rows].copy()
    _local_work(col, rows, np.where(row_comm, -1, row_cls), parent, row_flops, row_bytes)
    issuer = _span_issuers(col, np.flatnonzero(comm & is_span), np.flatnonzero(is_c10d), parent) \
        if coll_source == "annotation" and is_c10d.any() else {}

    step = _steps(col, h_ts[rows])

    colls: dict[int, _Coll] = {}
    unknown: dict[str, int] = {}
    dtypes = [None if c < 0 else col.dtype_names[c] for c in _np(col.h_dtype, np.int64)[rows].tolist()]
    for k, i in enumerate(rows.tolist()):
        if not comm[i]:
            continue
        nm = col.names[h_name[i]]
        a = col.h_coll_args.get(i, {})
        if is_rpc[i]:
            c = _coll_from_args(a, "record_param_comms")
        else:
            c = _coll_from_dims(nm, a, coll_source, default_group, _C10D_INPUT_INDEX.get(nm, 0) if is_c10d[i] else None)
            o = issuer.get(i)
            if o is not None:
                onm = col.names[h_name[o]]
                oc = _coll_from_dims(onm, col.h_coll_args.get(o, {}), "annotation+c10d_op", default_group,
                                     _C10D_INPUT_INDEX.get(onm, 0), dtype_hint=c.dtype)
                c = _merge(oc, c)
        if c is None:
            c = _Coll(raw_name=nm, source=coll_source)
        if c.collective is None:
            unknown[c.raw_name or nm] = unknown.get(c.raw_name or nm, 0) + 1
            c.collective = "other"
        colls[k] = c
        dtypes[k] = c.dtype or dtypes[k]
    stream = np.array([col.threads[t][1] if isinstance(col.threads[t][1], int) else -1 for t in h_thread[rows].tolist()], dtype=np.int64)
    ts = h_ts[rows]
    cat_names = ["cpu_op", "user_annotation"]
    out = {
        "ts": ts,
        "device": np.full(n, -1, dtype=np.int16),
        "stream": stream,
        "category": pd.Categorical.from_codes(h_kind[rows], categories=cat_names),
        "name": [col.names[c] for c in h_name[rows].tolist()],
        "cpu_op": [col.names[c] for c in h_name[rows].tolist()],
        "op_class": pd.Categorical.from_codes(row_cls, categories=list(K.OP_CLASSES)),
        "kernel_class": [("communication" if row_comm[k] else (col.name_kcls[c] if col.name_kcls[c] in KC.KERNEL_CLASSES else "other"))
                         for k, c in enumerate(h_name[rows].tolist())],
        "op_id": rows.astype(np.int64),
        "op_sig": [col.sig_names[c] for c in _np(col.h_sig, np.int64)[rows].tolist()],
        "shapes_known": _np(col.h_shapes, np.int64)[rows].astype(bool),
        "dur_us": h_dur[rows],
        "step": step,
        "flops": row_flops,
        "bytes": row_bytes,
        "dtype": dtypes,
        "external_id": _np(col.h_ext, np.int64)[rows],
        "correlation": np.full(n, -1, dtype=np.int64),
    }
    out.update(_coll_columns(colls, n, ts, stream))
    out["_unknown_colls"] = unknown
    return out
