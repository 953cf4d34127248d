"""Per-operator latency tables (CSV): measured forward/backward time of every op of one training
step, with its input shapes and dtype. NeuSight's label CSVs (sitar-lab/NeuSight
``scripts/asplos/label/<GPU>/<model>-train-<seq>-<batch>.csv``) are one such; a plain CSV with
columns ``op, input_shapes, dtype, fw_ms, bw_ms`` (optional ``output_shape, count, module``) is
the other.

NeuSight records one transformer layer (``...h.0`` / ``...layers.0``) plus the embedding and the
head; its JSON beside the CSV (``<same name>.json``) gives ``num_layer`` and the measured step
(``e2e_latency = fw_latency + bwall_latency``, ms). Rows inside layer 0 count ``num_layer``
times. Each row gets a class (gemm, attention, norm, softmax, elementwise, embedding, loss,
other, or host for ops that launch no kernel), FLOPs and bytes from its shapes, and the kernels
it launches forward and backward (simulator.workload.kernels), which is what calibration fits.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from simulator.errors import UserError, read_json
from simulator.workload.kernels import (DROPOUT_OPS, EMBED_OPS, GEMM_OPS, LOSS_OPS, NORM_OPS, SOFTMAX_OPS, VIEW_OPS,
                                        Kernel, numel, op_kernels)

TABLE_CLASSES = ("gemm", "attention", "norm", "softmax", "elementwise", "embedding", "loss", "other")
DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
               "float64": 8, "int64": 8, "long": 8, "int32": 4, "bool": 1, "uint8": 1, "float8_e4m3fn": 1}
# NeuSight file names: <model>-<train|inf>-<seq>-<batch>.csv
_NEUSIGHT_NAME_RE = re.compile(r"^(?P<model>.+)-(?P<mode>train|inf)-(?P<seq>\d+)-(?P<batch>\d+)$")
_MODULE_RE = re.compile(r"\('([^']+)', <class '([^']+)'>\)")
_LAYER0_RE = re.compile(r"\.(h|layers|layer|blocks)\.0$")
_ATTN_RE = re.compile(r"(attn|attention|self_attn)$", re.I)


@dataclass
class MeasuredOpTable:
    """One step's measured ops. ``ops``: one row per recorded op; times in µs for one occurrence;
    ``count``: occurrences per step (layer rows x num_layers)."""

    path: Path
    ops: pd.DataFrame
    device: str
    model: str | None
    seq: int | None
    batch: int | None
    dtype: str
    num_layers: int | None
    step_ms: dict[str, float] = field(default_factory=dict)  # e2e, fw, bw as measured (ms)
    kernels: list[tuple[int, str, Kernel]] = field(default_factory=list)  # (row, "fw"|"bw", kernel)
    notes: list[str] = field(default_factory=list)

    @property
    def timer_floor_us(self) -> float:
        """What the per-op timer adds to every measured op: the median time it reports for ops
        that launch no kernel (views, shape arithmetic); 0 when the table has none."""
        d = self.ops
        host = d[(d["op_class"] == "host") & (d["fw_us"] > 0)]
        return float(np.median(host["fw_us"])) if len(host) >= 5 else 0.0

    @property
    def measured_step_s(self) -> float | None:
        return self.step_ms["e2e"] * 1e-3 if "e2e" in self.step_ms else None

    def net_times_us(self) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) µs per op without the per-op timer's floor (``timer_floor_us``): what
        the op's kernels take when they run back to back in a step. A phase that launches no
        kernel keeps nothing; one with kernels keeps at least a fifth of what was measured."""
        d = self.ops
        t0 = self.timer_floor_us
        out = []
        for col, nk in (("fw_us", "fw_kernels"), ("bw_us", "bw_kernels")):
            x = d[col].to_numpy(float)
            out.append(np.where(d[nk] > 0, np.maximum(x - t0, 0.2 * x), np.maximum(x - t0, 0.0)))
        return out[0], out[1]

    def class_times_s(self, net: bool = False) -> dict[str, float]:
        """Seconds per step of each class (forward + backward), host ops and gradient accumulation
        apart; ``net``: without the per-op timer's floor (net_times_us)."""
        d = self.ops
        if net:
            fw, bw = self.net_times_us()
            t = pd.Series((fw + bw) * d["count"].to_numpy() * 1e-6, index=d.index)
        else:
            t = (d["fw_us"] + d["bw_us"]) * d["count"] * 1e-6
        out = {str(k): float(v) for k, v in t.groupby(d["op_class"]).sum().items()}
        acc = float((d["acc_us"] * d["count"]).sum() * 1e-6)
        if acc > 0:
            out["grad_accumulate"] = acc
        return out


def is_op_table(path: Path) -> bool:
    return path.is_file() and path.suffix == ".csv"


def _number(value, column: str, path: Path, row: int) -> float:
    """A table cell as a float, or one line naming the cell (a non-numeric latency raised ValueError)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(f"op table {str(path)!r} row {row}: {column} {value!r} is not a number: fix the row") from None


def _literal(s, what: str, path: Path, row: int):
    if isinstance(s, float) and np.isnan(s):
        return []
    try:
        return ast.literal_eval(str(s))
    except (ValueError, SyntaxError):
        raise UserError(f"op table {str(path)!r} row {row}: {what} {str(s)[:60]!r} is not a list of shapes: fix the row") from None


def _op_type(op: str, target: str, module_cls: str | None) -> str:
    if op in ("placeholder", "get_attr", "output"):
        return op
    if op == "call_module":
        return (module_cls or target).rsplit(".", 1)[-1]
    t = str(target)
    m = re.match(r"<built-in (?:method|function) (\w+)", t) or re.match(r"<function (\w+)", t) or re.match(r"<class '([\w.]+)'>", t)
    if m:
        return m.group(1).rsplit(".", 1)[-1]
    return t.rsplit(".", 1)[-1]


def _modules(meta: str) -> list[tuple[str, str]]:
    return _MODULE_RE.findall(str(meta))


def classify(op_type: str, modules: list[tuple[str, str]], in_shapes: list, out_shape, batch: int | None,
             seq: int | None) -> str:
    """The class of one recorded op (see the module docstring)."""
    out = numel(out_shape) if out_shape else 0
    if op_type in VIEW_OPS:
        return "host"
    if out <= 1 and all(numel(s) <= 1 for s in in_shapes):
        return "host"  # Python scalars and shape arithmetic
    in_attn = any(_ATTN_RE.search(path) or "Attention" in cls for path, cls in modules)
    # Attention scores/probabilities: [..., s, s] with more leading rows than the batch (heads).
    scores = (out_shape is not None and len(out_shape) >= 3 and seq is not None and out_shape[-1] == out_shape[-2] == seq
              and numel(out_shape[:-2]) > (batch or 1))
    if op_type in ("matmul", "bmm", "baddbmm") and in_attn and len(in_shapes) >= 2 and all(len(s) >= 3 for s in in_shapes[-2:]):
        return "attention"
    if op_type in GEMM_OPS:
        return "gemm"
    if in_attn and scores:
        return "attention"
    if op_type in NORM_OPS:
        return "norm"
    if op_type in SOFTMAX_OPS:
        return "softmax"
    if op_type in EMBED_OPS:
        return "embedding"
    if op_type in LOSS_OPS:
        return "loss"
    if op_type in DROPOUT_OPS or op_type in _ELEMENTWISE:
        return "elementwise"
    return "other"


_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "truediv", "div", "pow", "tanh", "where", "relu", "gelu", "silu", "ReLU", "GELU", "SiLU",
    "NewGELUActivation", "GELUActivation", "masked_fill", "masked_fill_", "max", "min", "maximum", "minimum", "clamp",
    "contiguous", "clone", "to", "type", "float", "half", "long", "bool", "int", "lt", "gt", "le", "ge", "eq", "ne",
    "full", "ones", "zeros", "arange", "tensor", "cumsum", "neg", "exp", "sqrt", "rsqrt", "sigmoid", "type_as", "abs",
})


_CASTS = frozenset({"to", "type", "type_as", "float", "half", "bfloat16"})
_P_RE = re.compile(r"'p':\s*([0-9.eE+-]+)")


def _dropout_p(args, kwargs) -> float | None:
    m = _P_RE.search(str(kwargs)) or _P_RE.search(str(args))
    return float(m.group(1)) if m else None


def _dtype_bytes(s) -> int | None:
    if not isinstance(s, str) or not s:
        return None
    return DTYPE_BYTES.get(s.replace("torch.", ""))


def load_op_table(path: str | Path, num_layers: int | None = None) -> MeasuredOpTable:
    """Import one per-operator latency CSV (NeuSight's or the plain format)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"op table {str(path)!r} does not exist: give a per-operator latency CSV")
    try:
        raw = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise UserError(f"op table {str(path)!r} is not a readable CSV ({' '.join(str(exc).split())[:80]}): fix or re-export it") from None
    neusight_cols = ("op", "target", "input_shapes", "fw_latency", "bw_latency")
    neusight = set(neusight_cols) <= set(raw.columns)
    plain = {"op", "input_shapes", "fw_ms", "bw_ms"} <= set(raw.columns)
    if not (neusight or plain):
        missing = [c for c in neusight_cols if c not in raw.columns] if "fw_latency" in raw.columns else []
        raise UserError(f"op table {str(path)!r} lacks the columns of a latency table"
                        + (f" (NeuSight's {', '.join(missing)} missing)" if missing else "")
                        + ": give NeuSight's (op, target, input_shapes, fw_latency, bw_latency) or op, input_shapes, "
                        "dtype, fw_ms, bw_ms")
    if raw.empty:
        raise UserError(f"op table {str(path)!r} has no rows: re-export it")
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - 1))
        ends_in_newline = f.read(1) in (b"\n", b"\r")
    times = ["fw_latency", "bw_latency"] if neusight else ["fw_ms", "bw_ms"]
    if not ends_in_newline and raw.iloc[-1][times].isna().any():
        # A copy cut short ends inside its last row, which then lacks its later fields (the times).
        raise UserError(f"op table {str(path)!r} ends in the middle of row {len(raw) - 1} (truncated?): re-copy or re-export it")

    m = _NEUSIGHT_NAME_RE.match(path.stem)
    model, seq, batch = (m["model"], int(m["seq"]), int(m["batch"])) if m else (None, None, None)
    step_ms: dict[str, float] = {}
    side = path.with_suffix(".json")
    if side.exists():
        j = read_json(side, "op table step file", fix="fix it or remove it")
        if isinstance(j, dict):
            # A value that is there but unusable is an error, not a silent fall-back to the op sum.
            nl = j.get("num_layer")
            if nl is not None and (isinstance(nl, bool) or not isinstance(nl, int) or nl <= 0):
                raise UserError(f"op table step file {str(side)!r}: num_layer={nl!r} is not a positive whole number of "
                                "layers: fix it or remove the key")
            if num_layers is None and nl is not None:
                num_layers = nl
            for key, name in (("e2e_latency", "e2e"), ("fw_latency", "fw"), ("bwall_latency", "bw")):
                v = j.get(key)
                if v is None:
                    continue
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v <= 0:
                    raise UserError(f"op table step file {str(side)!r}: {key}={v!r} is not a positive time in ms: "
                                    "fix it or remove the key")
                step_ms[name] = float(v)
    # (resolved: a table given as a bare name from inside its folder has parent '.', named '')
    device = path.resolve().parent.name.replace("_", " ") if neusight else "unknown"

    rows = []
    if neusight:
        first = raw[raw["op"] == "placeholder"]
        if seq is None and not first.empty:
            shp = _literal(first.iloc[0]["output_shape"], "output_shape", path, 0)
            if isinstance(shp, tuple) and len(shp) == 2:
                batch, seq = shp
        for i, r in raw.iterrows():
            mods = _modules(r.get("meta", ""))
            in_shapes = _literal(r["input_shapes"], "input_shapes", path, i)
            out_shape = _literal(r.get("output_shape"), "output_shape", path, i) if isinstance(r.get("output_shape"), str) else None
            op_type = _op_type(str(r["op"]), str(r["target"]), mods[-1][1] if mods and r["op"] == "call_module" else None)
            in_layer0 = any(_LAYER0_RE.search(p) for p, _ in mods)
            rows.append(dict(row=i, name=str(r.get("Name", r["target"])), op_type=op_type, module=mods[-1][0] if mods else "",
                             modules=mods, in_shapes=in_shapes, out_shape=tuple(out_shape) if isinstance(out_shape, (tuple, list)) else None,
                             dtype=str(r.get("dtype", "")), fw_us=_number(r["fw_latency"], "fw_latency", path, i) * 1e3,
                             bw_us=_number(r["bw_latency"], "bw_latency", path, i) * 1e3,
                             acc_us=_number(r.get("acc_latency", 0.0) or 0.0, "acc_latency", path, i) * 1e3, in_layer0=in_layer0, count_given=None,
                             dropout_p=_dropout_p(r.get("_args", ""), r.get("_kwargs", ""))))
    else:
        for i, r in raw.iterrows():
            in_shapes = _literal(r["input_shapes"], "input_shapes", path, i)
            out_shape = _literal(r["output_shape"], "output_shape", path, i) if "output_shape" in raw.columns else None
            module = str(r["module"]) if "module" in raw.columns and isinstance(r["module"], str) else ""
            rows.append(dict(row=i, name=str(r["op"]), op_type=str(r["op"]), module=module,
                             modules=[(module, "Attention" if _ATTN_RE.search(module) else "")] if module else [],
                             in_shapes=in_shapes, out_shape=tuple(out_shape) if out_shape else (tuple(in_shapes[0]) if in_shapes else None),
                             dtype=str(r.get("dtype", "")), fw_us=_number(r["fw_ms"], "fw_ms", path, i) * 1e3,
                             bw_us=_number(r["bw_ms"], "bw_ms", path, i) * 1e3,
                             acc_us=0.0, in_layer0=False,
                             count_given=int(_number(r["count"], "count", path, i)) if "count" in raw.columns else 1,
                             dropout_p=None))

    for r in rows:
        for key, column in (("fw_us", times[0]), ("bw_us", times[1])):
            if not np.isfinite(r[key]) or r[key] < 0:
                # (the cell as written: the table's unit, ms)
                raise UserError(f"op table {str(path)!r} row {r['row']}: {column} {r[key] / 1e3:g} is not a latency: "
                                "write a non-negative number of ms (a row without one: remove it)")
    has_layer = any(r["in_layer0"] for r in rows)
    if has_layer and num_layers is None:
        raise UserError(f"op table {str(path)!r} records one layer but not how many the model has: "
                        f"put num_layer (the model's layer count) in {side.name}, the step file beside it, as NeuSight writes it")
    # The dtype of the step: the most common floating dtype of its ops.
    floats = [r["dtype"].replace("torch.", "") for r in rows if _dtype_bytes(r["dtype"]) and "float" in r["dtype"] or r["dtype"] in ("bf16", "fp16", "fp32")]
    dtype = max(set(floats), key=floats.count) if floats else "float32"
    dt = DTYPE_BYTES.get(dtype, 4)
    # Vocabulary rows of the token embedding: the LM head's output width (tied or not).
    vocab = next((r["out_shape"][-1] for r in rows if r["op_type"] in ("Linear",) and "lm_head" in r["module"] and r["out_shape"]), None)

    kernels: list[tuple[int, str, Kernel]] = []
    for j, r in enumerate(rows):
        r["count"] = r["count_given"] if r["count_given"] is not None else (num_layers if r["in_layer0"] else 1)
        cls = classify(r["op_type"], r["modules"], r["in_shapes"], r["out_shape"], batch, seq)
        if cls != "host" and not r["out_shape"] and r["op_type"] not in GEMM_OPS:
            cls = "host"
        r["op_class"] = cls
        table_rows = 0
        if r["op_type"] in EMBED_OPS and r["op_type"] == "Embedding":
            table_rows = vocab if vocab and re.search(r"(wte|embed_tokens|word)", r["module"]) else (seq or 0)
        has_bias = "lm_head" not in r["module"]
        if r["op_type"] in _CASTS and _dtype_bytes(r["dtype"]) == dt:
            cls = r["op_class"] = "host"  # a cast to the dtype the tensor has is a no-op
        if r["op_type"] in DROPOUT_OPS and r["dropout_p"] == 0.0:
            cls = r["op_class"] = "host"  # dropout with p = 0 (OPT's attention) launches nothing
        try:
            fw, bw = op_kernels(r["op_type"], cls, r["in_shapes"], r["out_shape"], dt, has_bias=has_bias, table_rows=table_rows)
        except (IndexError, TypeError, ValueError):
            # The op's recorded shapes do not have the operands it takes (a GEMM with one input).
            raise UserError(f"op table {str(path)!r} row {r['row']}: {r['op_type']} with input_shapes {r['in_shapes']!r} "
                            f"and output_shape {r['out_shape']!r} lacks the operands the op takes: fix the row's shapes "
                            "or re-export the table") from None
        r["flops"] = sum(k.flops for k in fw)
        r["bytes"] = sum(k.bytes for k in fw)
        r["bw_flops"] = sum(k.flops for k in bw)
        r["bw_bytes"] = sum(k.bytes for k in bw)
        r["fw_kernels"] = len(fw)
        r["bw_kernels"] = len(bw)
        kernels += [(j, "fw", k) for k in fw] + [(j, "bw", k) for k in bw]
    ops = pd.DataFrame(rows).drop(columns=["count_given", "modules", "dropout_p"])
    return MeasuredOpTable(path=path, ops=ops, device=device, model=model, seq=seq, batch=batch, dtype=dtype,
                           num_layers=num_layers, step_ms=step_ms, kernels=kernels)
