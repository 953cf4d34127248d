"""Writing files the user asked for: whole or not at all, never over a device or folder, and with
the path checked before the work (bottom layer: every CLI may use it)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from simulator.errors import UserError


def check_output_path(path: Path, what: str) -> Path:
    """Refuse, before any work is done, an output path that cannot be written as a regular file.

    Checked up front so that a long simulation is never lost to a bad --report or --perfetto path:
    a folder or device as target, a file where a folder should be, a read-only folder, a name too
    long or holding NUL. Returns the path.
    """
    import stat

    shown = str(path)
    if "\x00" in shown:
        raise UserError(f"{what} path {shown!r} holds a NUL character: choose another name")
    if any(len(part.encode()) > 255 for part in path.parts):
        raise UserError(f"{what} path {shown[:60]!r}... has a name longer than 255 bytes: choose a shorter name")
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        st = None  # NotADirectoryError: a parent is a file; said below
    except OSError as exc:
        raise UserError(f"{what} path {shown!r} cannot be used ({exc.strerror}): choose another path") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise UserError(f"{what} path {shown!r} is a folder: name a file inside it")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UserError(f"{what} path {shown!r} is not a regular file (a device, pipe or socket): name a file")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{what} path {shown!r} goes through {str(parent)!r}, which is a file, not a folder: choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{what} folder {str(parent)!r} is not writable: choose another path")
    return path


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder, then rename: never a half-written file,
    and never a device or folder replaced by a file (``check_output_path``)."""
    check_output_path(path, "output")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a dashboard is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
