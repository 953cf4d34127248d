"""Streaming reader for Chrome-trace JSON: the top-level object, with the traceEvents array
handed out one event at a time.

A Kineto trace is one JSON object whose traceEvents array holds almost all of its bytes;
json.load of a 1 GB file needs ~10x that in Python objects. Here only one chunk of text and
one event live at a time: json.JSONDecoder.raw_decode parses each element in C, and a parse
error at the end of the buffer just means "read more".
"""

from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simulator.errors import UserError

try:  # optional: parses a whole trace ~3x faster than json; the results are the same
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

CHUNK_CHARS = 1 << 20
# No single event or top-level value is this large; past it the file is corrupt.
MAX_VALUE_CHARS = 256 << 20
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
GZIP_MAGIC = b"\x1f\x8b"


def open_bytes(path: Path):
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == GZIP_MAGIC else open(path, "rb")


def open_text(path: Path) -> io.TextIOBase:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == GZIP_MAGIC:
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


class _Stream:
    def __init__(self, f: io.TextIOBase, path: Path):
        self.f = f
        self.path = path
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.offset = 0  # characters dropped from the front of buf

    def _read(self) -> str:
        try:
            return self.f.read(CHUNK_CHARS)
        except EOFError:
            raise UserError(f"{str(self.path)!r} is a truncated gzip file: re-copy or re-capture it") from None
        except (gzip.BadGzipFile, zlib.error, OSError) as exc:
            raise UserError(f"{str(self.path)!r} is not a readable gzip file ({exc}): re-copy or re-capture it") from None
        except UnicodeDecodeError:
            raise UserError(f"{str(self.path)!r} is not UTF-8 text: expected a Kineto JSON trace") from None

    def fill(self) -> bool:
        if self.eof:
            return False
        data = self._read()
        if not data:
            self.eof = True
            return False
        self.offset += self.pos
        self.buf = self.buf[self.pos:] + data
        self.pos = 0
        return True

    def skip_ws(self) -> None:
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self.fill():
                return

    def peek(self) -> str:
        self.skip_ws()
        return self.buf[self.pos] if self.pos < len(self.buf) else ""

    def expect(self, ch: str, what: str) -> None:
        got = self.peek()
        if got != ch:
            self.fail(f"expected {ch!r} {what}, found {got!r}" if got else f"file ends where {ch!r} {what} was expected")
        self.pos += 1

    def value(self) -> Any:
        self.skip_ws()
        while True:
            try:
                val, end = _DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                # Text cut at the end of the buffer fails at (or, inside a string or escape,
                # just before) its end; anything earlier is a real syntax error, and reading
                # on would only pull the rest of the file into memory.
                at_end = exc.pos >= len(self.buf) - 8 or "Unterminated" in exc.msg
                if at_end and len(self.buf) - self.pos < MAX_VALUE_CHARS and self.fill():
                    continue
                if at_end and self.eof:
                    self.fail("file ends in the middle of a value (truncated?)")
                self.fail(exc.msg, at=exc.pos)
            # A number that touches the end of the buffer may continue in the next chunk.
            if end == len(self.buf) and not self.eof and self.fill():
                continue
            self.pos = end
            return val

    def fail(self, msg: str, at: int | None = None) -> None:
        where = self.offset + (self.pos if at is None else at)
        raise UserError(f"{str(self.path)!r} is not valid JSON: {msg} at character {where}: re-export the trace")


def stream_trace(
    path: str | Path,
    on_event: Callable[[dict], None],
    events_key: str = "traceEvents",
) -> tuple[dict[str, Any], int]:
    """Parse a Chrome-trace file, calling on_event for each element of traceEvents.

    Returns (the top-level keys other than traceEvents, number of events). A top-level array
    (Chrome's "JSON Array Format") counts as the events themselves.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"{str(path)!r} does not exist: give a Kineto trace file, a folder of them or a trace bundle")
    whole = _parse_small(path, on_event, events_key)
    if whole is not None:
        return whole
    top: dict[str, Any] = {}
    n_events = 0
    f = open_text(path)
    try:
        s = _Stream(f, path)
        first = s.peek()
        if first == "":
            raise UserError(f"{str(path)!r} is empty: expected a Kineto JSON trace")
        if first == "[":
            n_events = _stream_array(s, on_event)
            top[events_key] = None
        elif first == "{":
            s.pos += 1
            if s.peek() == "}":
                s.pos += 1
            else:
                while True:
                    key = s.value()
                    if not isinstance(key, str):
                        s.fail("expected an object key")
                    s.expect(":", f"after key {key!r}")
                    if key == events_key and s.peek() == "[":
                        n_events = _stream_array(s, on_event)
                        top[events_key] = None
                    else:
                        top[key] = s.value()
                    sep = s.peek()
                    if sep == ",":
                        s.pos += 1
                        continue
                    if sep == "}":
                        s.pos += 1
                        break
                    s.fail("expected ',' or '}' in the top-level object" if sep else "file ends inside the top-level object (truncated?)")
        else:
            raise UserError(f"{str(path)!r} is not a JSON object or array (starts with {first!r}): expected a Kineto JSON trace")
        if s.peek() != "":
            s.fail("extra data after the top-level value")
    finally:
        f.close()
    return top, n_events


# Below this many characters a trace is parsed in one json.loads (C speed, ~10x its size in
# Python objects, freed at once); above it, streamed event by event.
WHOLE_PARSE_CHARS = 48 << 20


def _parse_small(path: Path, on_event: Callable[[dict], None], events_key: str) -> tuple[dict[str, Any], int] | None:
    """Parse a small, well-formed trace in one go; None to fall back to the streaming parser
    (a large file, or any defect, which the streaming parser then names precisely)."""
    try:
        with open_bytes(path) as f:
            raw = f.read(WHOLE_PARSE_CHARS + 1)
    except (EOFError, OSError, zlib.error):
        return None
    if len(raw) > WHOLE_PARSE_CHARS:
        return None
    data = None
    if _orjson is not None:
        try:
            data = _orjson.loads(raw)
        except (ValueError, RecursionError):
            data = None  # orjson is stricter (NaN, lone surrogates): json may still read it
    if data is None:
        try:
            data = json.loads(raw.decode("utf-8"))
        except (json.JSONDecodeError, RecursionError, UnicodeDecodeError):
            return None
    del raw
    if isinstance(data, list):
        events, top = data, {events_key: None}
    elif isinstance(data, dict) and isinstance(data.get(events_key), list):
        events = data.pop(events_key)
        top = {**data, events_key: None}
    else:
        return None
    n = 0
    for ev in events:
        if isinstance(ev, dict):
            on_event(ev)
            n += 1
    return top, n


def _stream_array(s: _Stream, on_event: Callable[[dict], None]) -> int:
    s.expect("[", "to open traceEvents")
    n = 0
    if s.peek() == "]":
        s.pos += 1
        return 0
    while True:
        ev = s.value()
        if isinstance(ev, dict):
            on_event(ev)
            n += 1
        sep = s.peek()
        if sep == ",":
            s.pos += 1
            # Some writers leave a trailing comma before the closing bracket.
            if s.peek() == "]":
                s.pos += 1
                return n
            continue
        if sep == "]":
            s.pos += 1
            return n
        s.fail(f"expected ',' or ']' after event {n}" if sep else f"file ends inside traceEvents after {n} events (truncated?)")
