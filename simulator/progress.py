"""Progress on stderr for commands that take more than a second.

Shown only when stderr is a terminal (a rich spinner with the current phase and the elapsed
time, removed when the command ends); silent when stderr is a pipe or a file, and under
``--json``. Nothing here touches stdout: results stay machine-readable.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator


def progress_wanted(as_json: bool = False) -> bool:
    """Progress goes to a terminal only, and never with --json."""
    return not as_json and sys.stderr.isatty()


class _StopOnStdout:
    """sys.stdout stand-in that ends the spinner before the first result line, so results never
    interleave with the spinner's redraws."""

    def __init__(self, real: Any, stop: Callable[[], None]):
        self._real, self._stop = real, stop

    def write(self, text: str) -> int:
        self._stop()
        return self._real.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextmanager
def progress(label: str, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """A spinner on stderr showing ``label`` and the elapsed time; yields ``update(text)`` to
    name the current phase. Lines the command prints to stderr meanwhile appear above it; the
    spinner ends at the first line written to stdout or when the block exits."""
    if not (enabled and sys.stderr.isatty()):
        yield lambda text: None
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    bar = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
        console=Console(stderr=True), transient=True, redirect_stdout=False, redirect_stderr=True,
    )
    task = bar.add_task(label, total=None)
    state = {"running": True}

    def stop() -> None:
        if state["running"]:
            state["running"] = False
            bar.stop()

    real_stdout = sys.stdout
    bar.start()
    sys.stdout = _StopOnStdout(real_stdout, stop)
    try:
        yield lambda text: bar.update(task, description=f"{label}: {text}") if state["running"] else None
    finally:
        sys.stdout = real_stdout
        stop()


def with_progress(label: str, fn: Callable[..., Any], when: Callable[[dict], bool] | None = None) -> Callable[..., Any]:
    """Wrap a typer command so that it shows a spinner while it runs (see ``progress``); a
    command's ``as_json`` keyword, when true, keeps it silent, and so does ``when(kwargs)``
    returning false. The signature is kept, so typer builds the same options."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        enabled = not kwargs.get("as_json", False) and (when is None or when(kwargs))
        with progress(label, enabled=enabled):
            return fn(*args, **kwargs)

    return run
