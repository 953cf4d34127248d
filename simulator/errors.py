"""The one exception type for bad user input.

Library code raises ``UserError`` with a single line that names the bad value and says how to
fix it; the CLI prints that line to stderr and exits with status 2, without a traceback.
Anything else that escapes is a bug in ClusterSim, and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: a one-line message naming the value and the fix."""

    def __init__(self, message: str):
        if "\n" in message:
            raise ValueError("UserError messages are one line")
        super().__init__(message)


class RunFailed(RuntimeError):
    """A real run the command started (a capture's torch ranks) failed: the first line says
    where, the rest is what the failing process printed. The CLI prints it and exits 1 without
    the launcher's own traceback (the failure is in the ranks, not in ClusterSim's call path)."""


class SimulationStalled(UserError):
    """The event loop ran out of events before every rank finished (a deadlocked schedule).

    The message lists which ranks wait on what; no partial result is returned.
    """


def did_you_mean(word: str, choices) -> str:
    """' (did you mean 'zero'?)' for a near miss among ``choices``, else ''."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def did_you_mean_name(word: str, names) -> str:
    """' (did you mean ...?)' for a name typed short or in another case: the shipped names it
    begins (h100 -> h100-hbm2e-96gb, h100-sxm-80gb, ...; H100 the same), else a near miss."""
    names = [str(n) for n in names]
    w = str(word).strip().lower()
    starts = [n for n in names if w and n.lower().startswith(w)] or [n for n in names if w and w in n.lower()]
    if 0 < len(starts) <= 4:
        return f" (did you mean {' or '.join(repr(n) for n in starts)}?)"
    return did_you_mean(w, names)


def _models_in(annotation) -> list:
    """Pydantic model classes an annotation allows (through Optional, unions, Annotated, lists)."""
    import types
    from typing import Annotated, Union, get_args, get_origin

    from pydantic import BaseModel

    origin = get_origin(annotation)
    if origin is Annotated:
        return _models_in(get_args(annotation)[0])
    if origin in (Union, types.UnionType, list, tuple, dict):
        return [m for a in get_args(annotation) for m in _models_in(a)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _keys_at(model, path: tuple) -> set[str]:
    """Field names and aliases of the section ``path`` leads to from ``model`` (empty if unknown)."""
    from typing import get_origin

    models = [model] if model is not None else []
    keyed = False  # the last part was a dict of models: this part is one of its keys
    for part in path:
        if isinstance(part, int) or keyed:
            keyed = False
            continue  # a list index or a dict key: the same models
        fields = {n: f for m in models for n, f in m.model_fields.items()}
        if str(part) not in fields:
            return set()
        ann = fields[str(part)].annotation
        keyed = get_origin(ann) is dict
        models = _models_in(ann)
    keys: set[str] = set()
    for m in models:
        for name, f in m.model_fields.items():
            keys.add(name)
            if isinstance(f.alias, str):
                keys.add(f.alias)
    return keys


def _shown(value) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


# pydantic error types whose message never says what the user wrote; the line adds it (err["input"]).
_WANTS_WHOLE = ("int_parsing", "int_type", "int_from_float", "int_parsing_size")
_WANTS_NUMBER = ("float_parsing", "float_type", "decimal_parsing", "decimal_type")
_WANTS_BOOL = ("bool_parsing", "bool_type")


def validation_error_line(exc, hide_loc: tuple[str, ...] = (), model=None) -> str:
    """One line from a pydantic ValidationError: where, what, and how to fix it.

    An unknown key comes first, whatever else is wrong: a misspelt key (seq_len) also leaves the
    key it meant (seq_length) missing, and only the unknown one says what to fix. ``model`` (the
    validated class) lets the line suggest the field a misspelt key meant. Missing keys are listed
    together; a bad value is shown with what was written. ``hide_loc`` drops location parts a user
    never wrote (a discriminated union's tag).
    """
    errors = exc.errors()

    def where(err) -> str:
        return ".".join(str(p) for p in err["loc"] if str(p) not in hide_loc)

    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        err = extra[0]
        parent, key = tuple(err["loc"][:-1]), err["loc"][-1]
        # The keys that section has: the model's fields, else the keys reported missing beside it.
        choices = _keys_at(model, tuple(p for p in parent if str(p) not in hide_loc)) or {
            str(e["loc"][-1]) for e in errors if e["type"] == "missing" and tuple(e["loc"][:-1]) == parent
        }
        return f"unknown key {where(err)!r}{did_you_mean(key, choices)}: remove it or check its spelling"
    err = errors[0]
    loc = where(err)
    if err["type"] == "missing":
        missing = list(dict.fromkeys(where(e) for e in errors if e["type"] == "missing"))
        if len(missing) == 1:
            return f"missing key {loc!r}: add it"
        return f"missing keys {', '.join(repr(m) for m in missing)}: add them"
    value = _shown(err.get("input"))
    if err["type"] in ("literal_error", "enum"):
        import re

        expected = str((err.get("ctx") or {}).get("expected", ""))
        hint = did_you_mean(err.get("input"), re.findall(r"'([^']*)'", expected)) if isinstance(err.get("input"), str) else ""
        line = f"{value} is not one of {expected}{hint}" if expected else " ".join(str(err["msg"]).split())
    elif err["type"] in _WANTS_WHOLE:
        line = f"got {value}: write a whole number"
    elif err["type"] in _WANTS_NUMBER:
        line = f"got {value}: write a number"
    elif err["type"] in _WANTS_BOOL:
        line = f"got {value}: write true or false"
    elif err["type"] == "finite_number":
        line = f"got {value}: write a finite number"
    elif err["type"] == "string_type":
        # (YAML reads `name: 12345` as a number and `schedule: [1f1b]` as a list)
        line = f"got {value}: write one piece of text (quote it if YAML would read it otherwise, e.g. \"12345\")"
    elif err["type"] in ("dict_type", "model_type", "model_attributes_type"):
        # (pydantic: "Input should be a valid dictionary or instance of BatchConfig")
        line = f"got {value}: write a section of keys, e.g. {loc.rsplit('.', 1)[-1] or 'it'}: {{key: value}}"
    elif err["type"] in _BOUNDS and err.get("ctx"):
        key, words = _BOUNDS[err["type"]]
        line = f"got {value}: write a number {words} {_shown((err.get('ctx') or {}).get(key))}"
    else:
        line = " ".join(str(err["msg"]).split()).removeprefix("Value error, ")
    return f"{loc}: {line}" if loc else line


# pydantic's range errors, said with the value written: "got -8: write a number at least 1".
_BOUNDS = {"greater_than_equal": ("ge", "at least"), "greater_than": ("gt", "above"),
           "less_than_equal": ("le", "at most"), "less_than": ("lt", "below")}


def _not_a_boolean(value):
    if isinstance(value, bool):
        raise ValueError(f"got the boolean {str(value).lower()} (YAML reads yes/no/on/off as booleans): write a whole number")
    return value


def _whole_type():
    from typing import Annotated

    from pydantic import BeforeValidator

    return Annotated[int, BeforeValidator(_not_a_boolean)]


# An int field that refuses YAML's true / false (and yes / no): pydantic would read them as 1 / 0,
# so `tp: true` simulated tp=1 and `num_layers: yes` one layer without a word.
Whole = _whole_type()


# A scenario, topology, profile, schedule or nccl-tests log is kilobytes; a HuggingFace config or a
# profile with fitted tables a few megabytes. 64 MiB is far above any real one and keeps a wrong path
# (a trace, /dev/zero, a disk image) from being read into memory.
MAX_TEXT_FILE_BYTES = 64 * 2**20
# Scenario-like documents are a few hundred values; 1,000,000 after alias expansion stops YAML
# "billion laughs" documents long before they exhaust memory.
MAX_DOCUMENT_VALUES = 1_000_000
# Real configs nest 3 to 6 levels; Python's own recursion limit is 1,000.
MAX_DOCUMENT_DEPTH = 100


def path_exists(path) -> bool:
    """Path.exists() that answers False, not OSError, for a name the OS refuses (too long, NUL)."""
    from pathlib import Path

    try:
        return Path(path).exists()
    except (OSError, ValueError):
        return False


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n:,} bytes"


def read_user_text(path, what: str, max_bytes: int = MAX_TEXT_FILE_BYTES) -> str:
    """The text of a file a user named, or one UserError line that says what is wrong with it.

    Handles what users really pass: a missing path, an empty path, a folder, a device or pipe, a file
    that is too large, binary data, UTF-8 with or without a BOM, and UTF-16/32 with a BOM (Windows
    editors write those). Anything else that is not UTF-8 is refused with the offset of the first bad byte.
    """
    import codecs
    import os
    import stat
    from pathlib import Path

    if str(path) == "":
        raise UserError(f"{what} path is empty: name a file")
    path = Path(path)
    shown = str(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"{what} {shown!r} does not exist: check the path") from None
    except PermissionError:
        raise UserError(f"{what} {shown!r} cannot be read (permission denied): check its permissions") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise UserError(f"{what} {shown!r} cannot be opened ({reason}): check the path") from None
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"{what} {shown!r} is a folder, not a file: name a file")
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{what} {shown!r} is not a regular file (a device, pipe or socket): name a file")
    if st.st_size > max_bytes:
        raise UserError(
            f"{what} {shown!r} is {_fmt_bytes(st.st_size)}, more than the {_fmt_bytes(max_bytes)} such a file can be: check the path"
        )
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise UserError(f"{what} {shown!r} cannot be read ({exc.strerror}): check the path") from None
    if raw[:2] == b"\x1f\x8b":  # gzip (a .json.gz report, say): its text, no more of it than a plain file
        import gzip
        import io
        import zlib

        try:
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as z:
                raw = z.read(max_bytes + 1)
        except (OSError, EOFError, zlib.error):
            raise UserError(f"{what} {shown!r} is a truncated or corrupt gzip file: re-write or re-copy it") from None
        if len(raw) > max_bytes:
            raise UserError(f"{what} {shown!r} holds more than the {_fmt_bytes(max_bytes)} such a file can be: check the path")
    for bom, encoding in (
        (codecs.BOM_UTF32_LE, "utf-32"),
        (codecs.BOM_UTF32_BE, "utf-32"),
        (codecs.BOM_UTF8, "utf-8-sig"),
        (codecs.BOM_UTF16_LE, "utf-16"),
        (codecs.BOM_UTF16_BE, "utf-16"),
    ):
        if raw.startswith(bom):
            try:
                return raw.decode(encoding)
            except UnicodeDecodeError:
                raise UserError(f"{what} {shown!r} starts with a {encoding} mark but is not {encoding} text: save it as UTF-8") from None
    if b"\x00" in raw:
        raise UserError(f"{what} {shown!r} is a binary file, not text: check the path")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{what} {shown!r} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}): save it as UTF-8"
        ) from None


def check_document(data, what: str, shown: str):
    """Refuse a parsed YAML/JSON document whose shape no real file has: cycles (self-referencing
    aliases), alias bombs, nesting deeper than MAX_DOCUMENT_DEPTH, and values that are not plain
    data (dates, binary, sets). Returns the data unchanged."""
    import datetime
    import math

    seen_values = 0
    stack = [(data, 0, ())]
    while stack:
        node, depth, ancestors = stack.pop()
        seen_values += 1
        if seen_values > MAX_DOCUMENT_VALUES:
            raise UserError(
                f"{what} {shown!r} expands to more than {MAX_DOCUMENT_VALUES:,} values (YAML aliases?): write it out plainly"
            )
        if depth > MAX_DOCUMENT_DEPTH:
            raise UserError(f"{what} {shown!r} nests deeper than {MAX_DOCUMENT_DEPTH} levels: flatten it")
        if isinstance(node, (dict, list)):
            if id(node) in ancestors:
                raise UserError(f"{what} {shown!r} refers to itself (a recursive YAML alias): remove the cycle")
            inner = ancestors + (id(node),)
            if isinstance(node, dict):
                for key, value in node.items():
                    if not isinstance(key, (str, int, float, bool)) and key is not None:
                        raise UserError(f"{what} {shown!r} has a key of type {type(key).__name__}: use plain text keys")
                    stack.append((value, depth + 1, inner))
            else:
                stack.extend((value, depth + 1, inner) for value in node)
        elif isinstance(node, float) and not math.isfinite(node):
            # YAML's .inf/.nan and JSON's Infinity/NaN: no size, bandwidth or count is infinite.
            raise UserError(f"{what} {shown!r} holds a non-finite number ({node}): write a finite value")
        elif isinstance(node, (datetime.date, datetime.datetime)):
            raise UserError(f"{what} {shown!r} holds a date ({node.isoformat()}): quote it if it is a name")
        elif not isinstance(node, (str, int, float, bool)) and node is not None:
            raise UserError(f"{what} {shown!r} holds a {type(node).__name__} value: only plain text, numbers, lists and mappings are read")
    return data


def _yaml_loader():
    """yaml's SafeLoader, refusing duplicate keys (silently last-wins otherwise)."""
    import yaml

    class StrictSafeLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader, node, deep=False):
        keys = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults`: SafeLoader merges it (keys written here override it)
            key = loader.construct_object(key_node, deep=deep)
            try:
                duplicate = key in keys
            except TypeError:
                raise yaml.constructor.ConstructorError(None, None, f"unhashable key {key!r}", key_node.start_mark) from None
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            keys.add(key)
        return loader.construct_mapping(node, deep=deep)

    StrictSafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return StrictSafeLoader


def parse_yaml_text(text: str, what: str, shown: str):
    """A YAML document from text, checked by ``check_document``; errors are one UserError line."""
    import yaml

    try:
        data = yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise UserError(f"{what} {shown!r} is not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise UserError(f"{what} {shown!r} nests deeper than {MAX_DOCUMENT_DEPTH} levels: flatten it") from None
    return check_document(data, what, shown)


def read_yaml(path, what: str):
    """Parse a YAML file a user named; a missing, unreadable or malformed file is a one-line UserError."""
    text = read_user_text(path, what)
    return parse_yaml_text(text, what, str(path))


def _refuse_constant(name: str):
    raise ValueError(f"non-finite number {name}")


# Top-level keys that tell what a user's JSON/YAML document is, for "this is X, not Y": a report
# passed as --profile said "unknown key 'step_time_s': remove it", as if one key were the problem.
# Each kind's keys are ones its writer always emits (report.metrics.Report, profile.Profile,
# topology.TopologySpec, scenario.Scenario, torch.profiler, trace.bundle.Manifest, HF config.json).
DOCUMENT_KINDS: tuple[tuple[str, frozenset[str]], ...] = (
    ("a simulate report (clustersim simulate --report/--json)", frozenset({"step_time_s", "tokens_per_s"})),
    ("a GPU profile (clustersim calibrate --out)", frozenset({"device", "compute", "comm"})),
    ("a topology", frozenset({"node", "fabric"})),
    ("a scenario", frozenset({"model", "parallelism"})),
    ("a Kineto trace (torch.profiler)", frozenset({"traceEvents"})),
    ("a trace bundle manifest", frozenset({"tool_version", "workload", "world_size"})),
    ("a HuggingFace model config", frozenset({"model_type", "hidden_size"})),
    ("a sweep space file (clustersim sweep)", frozenset({"space"})),
)


def document_kind(data) -> str | None:
    """What a parsed document is, by the keys its writer always emits; None if it is none of them."""
    if not isinstance(data, dict):
        return None
    for label, keys in DOCUMENT_KINDS:
        if keys <= data.keys():
            return label
    return None


def check_document_kind(data, what: str, shown: str, expected: str, fix: str) -> dict:
    """Refuse a document that is not a mapping, or is a different kind of file than ``expected``
    (a label in DOCUMENT_KINDS), in one line naming what it is and ``fix``. Returns the mapping."""
    if not isinstance(data, dict):
        holds = "is empty" if data is None else f"holds a {type(data).__name__}, not a mapping of fields"
        raise UserError(f"{what} {shown!r} {holds}: {fix}")
    kind = document_kind(data)
    if kind is not None and kind != expected:
        raise UserError(f"{what} {shown!r} is {kind}, not {expected}: {fix}")
    return data


def read_json(path, what: str, fix: str):
    """Parse a JSON file a user named; ``fix`` says what to do about a malformed one."""
    import json

    text = read_user_text(path, what)
    shown = str(path)
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise UserError(f"{what} {shown!r} is not valid JSON ({exc.msg} at line {exc.lineno}): {fix}") from None
    except ValueError as exc:
        raise UserError(f"{what} {shown!r} holds a {exc}: write a finite value") from None
    except RecursionError:
        raise UserError(f"{what} {shown!r} nests deeper than {MAX_DOCUMENT_DEPTH} levels: {fix}") from None
    return check_document(data, what, shown)
