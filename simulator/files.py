"""Writing files the user asked for: whole or not at all, never over a device or folder, and with
the path checked before the work (bottom layer: every CLI may use it)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
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


# What an existing file must look like for an output to replace it: a dashboard replaces an earlier
# dashboard, not a notes.txt or a scenario.yaml that happens to sit at the path given.
HTML_SUFFIXES = (".html", ".htm")
# The file an output flag writes, for the example in "names a folder: name a file inside it, e.g. ...".
_EXAMPLE_SUFFIX = {"--report": ".json", "--perfetto": ".json", "--out": ".json", "--store": ".sqlite"}


def check_outputs(outputs: dict[str, Path | str | None], inputs: Iterable[tuple[str, Path | str | None]] = (),
                  replaces_only: dict[str, tuple[str, ...]] | None = None) -> None:
    """Refuse, before any work is done, outputs that would lose a file: each is checked by
    ``check_output_path``; two outputs may not name the same file (the second would replace the
    first), and none may replace a file the command reads: an input file itself (also through a
    link), or a file inside an input folder (a trace bundle). ``outputs`` maps the flag to its path;
    ``inputs`` holds (what the input is called, e.g. "scenario file", its path); None is skipped.
    A path given as text that ends in a separator names a folder (``Path`` would drop the
    slash and write a file of the folder's name). ``replaces_only`` maps a flag to the suffixes
    an existing file at its path must have to be replaced (``HTML_SUFFIXES`` for dashboards)."""
    seen: dict[str, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        if isinstance(path, str) and path.endswith(("/", os.sep)):
            suffix = _EXAMPLE_SUFFIX.get(flag) or (replaces_only or {}).get(flag, ("",))[0]
            raise UserError(f"{flag} path {path!r} names a folder: name a file inside it, e.g. {path + 'out' + suffix!r}")
        path = Path(path)
        check_output_path(path, flag)
        key = os.path.realpath(path)
        if key in seen:
            raise UserError(f"{seen[key]} and {flag} both name {str(path)!r}: give each its own path")
        seen[key] = flag
        if not os.path.isfile(path):
            continue  # nothing there yet: no input can be lost
        for what, source in inputs:
            if source is None or str(source) == "" or not _replaces(Path(path), Path(source)):
                continue
            which = f"the {what}" if os.path.isfile(source) else f"a file of the {what} {str(source)!r}"
            raise UserError(f"{flag} {str(path)!r} would overwrite {which} this command reads: choose another path")
        # (after the inputs: "would overwrite the scenario file" says more than the suffix)
        suffixes = (replaces_only or {}).get(flag)
        if suffixes and Path(path).suffix.lower() not in suffixes:
            raise UserError(f"{flag} path {str(path)!r} is an existing file that is not {' or '.join(suffixes)}: "
                            f"writing would replace it; name a new file or a {suffixes[0]} file")


def _replaces(out: Path, source: Path) -> bool:
    """Would writing ``out`` (an existing file) replace ``source`` or a file inside it (a folder)?"""
    try:
        if os.path.isdir(source):
            return Path(os.path.realpath(out)).is_relative_to(os.path.realpath(source))
        return os.path.isfile(source) and os.path.samefile(out, source)
    except (OSError, ValueError):
        return False


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder, then rename: never a half-written file,
    and never a device or folder replaced by a file (``check_output_path``). A path ending in
    .gz is written gzip-compressed (as its name says)."""
    check_output_path(path, "output")
    # The folders this write creates: removed again if it fails, so a failed command leaves nothing.
    created = []
    folder = Path(path).parent
    while not folder.exists() and folder != folder.parent:
        created.append(folder)
        folder = folder.parent
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        if Path(path).suffix.lower() == ".gz":
            import gzip

            with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", filename="", mtime=0) as f:
                f.write(text.encode())
        else:
            with os.fdopen(fd, "w") as f:
                f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a dashboard is meant to be shared
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        for d in created:  # (innermost first; a folder something else wrote into stays)
            try:
                d.rmdir()
            except OSError:
                break
        if isinstance(exc, OSError):
            # Disk full, quota, file too large, I/O error, permission: the user's to fix, one line.
            reason = exc.strerror or type(exc).__name__
            raise UserError(f"could not write {str(path)!r}: {reason}: free space there or give another path; "
                            "nothing was written") from None
        raise

