"""Names that torch.profiler (Kineto) writes into Chrome-trace JSON, kept in one place.

HolisticTraceAnalysis keeps these in hta/configs; we do the same so that a Kineto rename is a
one-line change here. Sources: pytorch/kineto libkineto/src/output_json.cpp and
pytorch/pytorch torch/csrc/profiler/util.h (see ../shared/reference/FORMATS.md §2).
"""

from __future__ import annotations

import re

# --- top-level keys -------------------------------------------------------------------------
TRACE_EVENTS = "traceEvents"
SCHEMA_VERSION = "schemaVersion"
DEVICE_PROPERTIES = "deviceProperties"
DISTRIBUTED_INFO = "distributedInfo"
BASE_TIME_NS = "baseTimeNanoseconds"
DISPLAY_TIME_UNIT = "displayTimeUnit"
# Keys of one distributedInfo / pg_config entry.
DI_BACKEND = "backend"
DI_RANK = "rank"
DI_WORLD_SIZE = "world_size"
DI_PG_CONFIG = "pg_config"
DI_NCCL_VERSION = "nccl_version"
PG_NAME = "pg_name"
PG_DESC = "pg_desc"
PG_SIZE = "pg_size"
PG_RANKS = "ranks"
# Keys of a deviceProperties entry.
DEV_ID = "id"
DEV_NAME = "name"

# --- event keys -------------------------------------------------------------------------------
PH = "ph"
CAT = "cat"
NAME = "name"
PID = "pid"
TID = "tid"
TS = "ts"
DUR = "dur"
ARGS = "args"
PH_COMPLETE = "X"
PH_METADATA = "M"

# --- categories -------------------------------------------------------------------------------
# The capitalised names are the very old Kineto spellings (HTA's trace_file_list test file).
CAT_KERNEL = frozenset({"kernel", "Kernel"})
CAT_MEMCPY = frozenset({"gpu_memcpy", "Memcpy"})
CAT_MEMSET = frozenset({"gpu_memset", "Memset"})
CAT_GPU = CAT_KERNEL | CAT_MEMCPY | CAT_MEMSET
CAT_RUNTIME = frozenset({"cuda_runtime", "Runtime", "cuda_driver"})
CAT_CPU_OP = frozenset({"cpu_op", "Operator"})
CAT_USER_ANNOTATION = frozenset({"user_annotation"})
CAT_GPU_USER_ANNOTATION = frozenset({"gpu_user_annotation"})

# --- args -------------------------------------------------------------------------------------
ARG_EXTERNAL_ID = "External id"
ARG_CORRELATION = "correlation"
ARG_STREAM = "stream"
ARG_DEVICE = "device"
# Kernel launch grid [x, y, z] (Kineto CUPTI kernel args): an NCCL kernel launches one CTA per channel.
ARG_GRID = "grid"
ARG_INPUT_DIMS = "Input Dims"
ARG_INPUT_TYPE = "Input type"
# Scalar arguments of an op as strings ("" for tensors and objects), with record_shapes.
ARG_CONCRETE_INPUTS = "Concrete Inputs"
ARG_FLOPS = "flops"
ARG_SEQUENCE_NUMBER = "Sequence number"
ARG_RECORD_FUNCTION_ID = "Record function id"

# Collective args: on record_param_comms, and copied by Kineto onto NCCL kernels.
ARG_COLL_NAME = "Collective name"
ARG_COLL_DTYPE = "dtype"
ARG_IN_NELEMS = "In msg nelems"
ARG_OUT_NELEMS = "Out msg nelems"
ARG_IN_SPLIT = "In split size"
ARG_OUT_SPLIT = "Out split size"
ARG_GROUP_SIZE = "Group size"
ARG_PG_NAME = "Process Group Name"
ARG_PG_DESC = "Process Group Description"
ARG_PG_RANKS = "Process Group Ranks"
ARG_GLOBAL_RANK_START = "Global rank start"
ARG_GLOBAL_RANK_STRIDE = "Global rank stride"
ARG_SEQ = "Seq"

# --- op names ---------------------------------------------------------------------------------
RECORD_PARAM_COMMS = "record_param_comms"
PROFILER_STEP_PREFIX = "ProfilerStep#"
# record_param_comms "wait" marks work.wait(), not a collective.
COLL_NAME_WAIT = "wait"
# Prefixes of the record_function spans the process groups open around each collective.
COMM_ANNOTATION_PREFIXES = ("nccl:", "gloo:", "ucc:", "mpi:")
C10D_PREFIX = "c10d::"
# HTA (hta/common/types.py) and Chakra: which kernels are communication.
COMM_KERNEL_RE = re.compile(r"(^nccl)|(^hip)|(^hccl)|(ncclKernel)|(ncclDevKernel)|(^gloo)")
NCCL_KERNEL_RE = re.compile(r"^(?:void\s+)?nccl(?:Dev)?Kernel_(?P<coll>[A-Za-z]+)(?:_(?P<rest>[A-Za-z0-9_]+))?")

# --- dtypes -----------------------------------------------------------------------------------
# Canonical dtype -> bytes per element.
DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint32": 4, "uint64": 8,
    "bool": 1, "complex64": 8, "complex128": 16,
}
# Spellings of dtypes in "Input type" (c10 type names), record_param_comms "dtype"
# (ScalarType names), NCCL kernel names and nccl-tests' "type" column.
DTYPE_ALIASES = {
    "float": "float32", "c10::float": "float32", "float32": "float32", "f32": "float32", "Float": "float32",
    "double": "float64", "Double": "float64", "float64": "float64", "f64": "float64",
    "c10::Half": "float16", "Half": "float16", "half": "float16", "f16": "float16", "float16": "float16",
    "c10::BFloat16": "bfloat16", "BFloat16": "bfloat16", "bf16": "bfloat16", "bfloat16": "bfloat16",
    "c10::Float8_e4m3fn": "float8_e4m3fn", "Float8_e4m3fn": "float8_e4m3fn", "f8e4m3": "float8_e4m3fn",
    "c10::Float8_e5m2": "float8_e5m2", "Float8_e5m2": "float8_e5m2", "f8e5m2": "float8_e5m2",
    "c10::Float8_e4m3fnuz": "float8_e4m3fnuz", "c10::Float8_e5m2fnuz": "float8_e5m2fnuz",
    "long int": "int64", "long": "int64", "Long": "int64", "int64": "int64", "int64_t": "int64", "i64": "int64",
    "int": "int32", "Int": "int32", "int32": "int32", "int32_t": "int32", "i32": "int32",
    "short int": "int16", "short": "int16", "Short": "int16", "int16": "int16",
    "signed char": "int8", "char": "int8", "Char": "int8", "int8": "int8", "int8_t": "int8", "i8": "int8",
    "unsigned char": "uint8", "Byte": "uint8", "uint8": "uint8", "uint8_t": "uint8", "u8": "uint8",
    "unsigned int": "uint32", "uint32_t": "uint32", "u32": "uint32", "uint32": "uint32",
    "unsigned long": "uint64", "uint64_t": "uint64", "u64": "uint64", "uint64": "uint64",
    "bool": "bool", "Bool": "bool",
    "c10::complex<float>": "complex64", "ComplexFloat": "complex64",
    "c10::complex<double>": "complex128", "ComplexDouble": "complex128",
}


def canonical_dtype(name: str | None) -> str | None:
    if not name:
        return None
    return DTYPE_ALIASES.get(name) or DTYPE_ALIASES.get(name.strip())


# --- collectives ------------------------------------------------------------------------------
COLLECTIVES = (
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce",
    "send", "recv", "send_recv", "barrier", "gather", "scatter", "coalesced",
)
# Keys are names lower-cased with '_' removed and the variant suffixes stripped (see
# normalise_collective); this covers c10d ops, nccl:/gloo: spans, record_param_comms names
# and NCCL kernel names.
_COLLECTIVE_KEYS = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "alltoallv": "all_to_all",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "send": "send",
    "recv": "recv",
    "recvanysource": "recv",
    "sendrecv": "send_recv",
    "barrier": "barrier",
    "monitoredbarrier": "barrier",
    "gather": "gather",
    "scatter": "scatter",
    "coalesced": "coalesced",
}
_COLLECTIVE_SUFFIXES = ("coalesced", "intotensor", "tensor", "single", "base", "perf")


def normalise_collective(name: str) -> str | None:
    """Normalised collective name, or None when the name is not a known collective."""
    key = name
    for prefix in (C10D_PREFIX, *COMM_ANNOTATION_PREFIXES):
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    key = key.lower().replace("_", "")
    if key in _COLLECTIVE_KEYS:
        return _COLLECTIVE_KEYS[key]
    stripped = True
    while stripped:
        stripped = False
        for suffix in _COLLECTIVE_SUFFIXES:
            if key.endswith(suffix) and len(key) > len(suffix):
                key = key[: -len(suffix)]
                stripped = True
    return _COLLECTIVE_KEYS.get(key)


# --- op classes -------------------------------------------------------------------------------
OP_CLASSES = ("gemm", "attention", "elementwise", "norm", "optimizer", "communication", "memcpy", "other")

# The name patterns that classify kernels and CPU ops live in simulator/trace/kernel_classes.py.


def classify_cpu_op(name: str) -> str:
    """The op class (OP_CLASSES) of a CPU op by its name (kernel_classes.CPU_TRACE_OP_PATTERNS)."""
    from simulator.trace import kernel_classes as KC

    for cls, rx in KC.CPU_TRACE_OP_PATTERNS:
        if rx.search(name):
            return cls
    if is_comm_op_name(name):
        return "communication"
    return "other"


def classify_kernel_name(name: str) -> str | None:
    """The op class a kernel name alone establishes, or None when only its launching op can tell."""
    from simulator.trace import kernel_classes as KC

    k = KC.kernel_name_class(name)
    return None if k is None else KC.KERNEL_TO_OP_CLASS[k]


def is_comm_op_name(name: str) -> bool:
    return name.startswith(C10D_PREFIX) or name.startswith(COMM_ANNOTATION_PREFIXES) or name == RECORD_PARAM_COMMS
