"""The version of the running clustersim.

One source: ``simulator.__version__`` (pyproject.toml reads it, ``[tool.setuptools.dynamic]``).
The installed distribution's metadata is preferred when it describes the code that is running
(a regular install); a source tree on PYTHONPATH or an editable install reports ``__version__``,
so another clustersim installed beside it cannot lend its version.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import simulator

DIST_NAME = "clustersim"


def package_version() -> str:
    try:
        dist = metadata.distribution(DIST_NAME)
    except metadata.PackageNotFoundError:
        return simulator.__version__
    installed = Path(str(dist.locate_file("simulator/__init__.py")))
    if installed.exists() and installed.resolve() == Path(simulator.__file__).resolve():
        return dist.version
    return simulator.__version__
