"""Data shipped inside the package: GPU profiles, topologies and published validation tables.

Found through importlib.resources so a regular (non-editable) install works from any folder.
A user's own file is always named by path and overrides nothing here.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def data_dir(kind: str) -> Path:
    """The packaged folder for ``kind`` (profiles, topologies, validation).

    The package is installed as files (setuptools' default, not a zip), so the Traversable is a real path.
    """
    return Path(str(files("simulator") / "data" / kind))
