"""File names made from scenario names: safe slugs that stay inside the output folder.

A scenario name is free text (``--set name=...``); used raw as a file name, ``../../x`` or ``/abs``
would write outside ``dashboards/`` and create folders on the way. ``slug`` keeps letters, digits,
dot, dash and underscore, turns every other run into one dash, and never yields a name that starts
with a dot (no ``..``, no hidden files) or is empty.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

MAX_STEM = 80


def slug(name: str, max_len: int = MAX_STEM) -> str:
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", str(name)).strip("-.")
    text = re.sub(r"\.{2,}", ".", text)
    if len(text) > max_len:
        # keep names distinct when they only differ past the cut
        digest = hashlib.sha1(str(name).encode()).hexdigest()[:8]
        text = text[: max_len - 9].rstrip("-.") + "-" + digest
    return text or "scenario"


def output_path(folder: Path | str, name: str, suffix: str = ".html", prefix: str = "") -> Path:
    """``folder / (prefix + slug(name) + suffix)``, checked to lie inside ``folder``."""
    folder = Path(folder)
    path = folder / f"{prefix}{slug(name)}{suffix}"
    if path.resolve().parent != folder.resolve():
        raise ValueError(f"{path} escapes {folder}")  # unreachable with slug(); kept as a guard
    return path
