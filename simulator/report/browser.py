"""Open a dashboard in headless Chromium: the DOM after scripts ran, console errors, a screenshot.

Used by the browser tests and to make the README screenshots. It drives the ``chromium`` command
line (Debian's package) rather than a browser-automation library, so nothing is downloaded.
Virtual time (``--virtual-time-budget``) lets Plotly finish drawing before the DOM is dumped or
the picture is taken, without sleeping in real time.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-default-apps", "--hide-scrollbars", "--mute-audio",
]
# Chromium logs console messages as: [pid:tid:date:INFO:CONSOLE(12)] "message", source: url (12)
CONSOLE_RE = re.compile(r':CONSOLE(?::\d+|\(\d+\))\] "(.*)", source: (.*)$')


def find_chromium() -> str | None:
    env = os.environ.get("CLUSTERSIM_CHROMIUM")
    if env:
        return env if shutil.which(env) or Path(env).exists() else None
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageResult:
    dom: str
    console: list[str] = field(default_factory=list)  # every console message the page produced
    stderr: str = ""

    @property
    def js_errors(self) -> list[str]:
        """Uncaught exceptions and console.error output, and errors recorded by the page's hook."""
        errs = [m for m in self.console if m.startswith("Uncaught") or "Error" in m]
        html_tag = re.search(r"<html[^>]*>", self.dom)
        m = re.search(r'data-js-error-last="([^"]*)"', html_tag.group(0) if html_tag else "")
        if m:
            errs.append(f"page error hook: {m.group(1)}")
        return errs


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, errors="replace")


def open_page(html_path: Path | str, budget_ms: int = 8000, window: tuple[int, int] = (1400, 1000),
              timeout_s: float = 90.0, screenshot_to: Path | str | None = None) -> PageResult:
    """Load ``html_path``, let it run for ``budget_ms`` of virtual time, return the DOM and console
    (and save a PNG of the first ``window`` pixels to ``screenshot_to`` from the same load)."""
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("chromium not found (apt-get install chromium)")
    url = Path(html_path).resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="clustersim-chromium-") as profile:
        proc = _run([exe, *FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
                     f"--window-size={window[0]},{window[1]}", f"--virtual-time-budget={budget_ms}", "--dump-dom",
                     *([f"--screenshot={Path(screenshot_to).resolve()}"] if screenshot_to else []), url],
                    timeout_s)
    console = []
    for line in proc.stderr.splitlines():
        m = CONSOLE_RE.search(line)
        if m:
            console.append(m.group(1))
    return PageResult(proc.stdout, console, proc.stderr)


def screenshot(html_path: Path | str, png_path: Path | str, window: tuple[int, int] = (1400, 1000),
               budget_ms: int = 8000, timeout_s: float = 90.0, hide: tuple[str, ...] = ()) -> Path:
    """Save a PNG of the page's first ``window`` pixels, with the elements of ids ``hide`` removed
    from the layout (how one section is brought to the top: headless Chromium does not reliably
    honour a #fragment once Plotly has changed the page height)."""
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("chromium not found (apt-get install chromium)")
    png = Path(png_path).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    src = Path(html_path).resolve()
    with tempfile.TemporaryDirectory(prefix="clustersim-chromium-") as profile:
        if hide:
            css = ",".join(f"#{h}" for h in hide) + "{display:none !important}"
            copy = Path(profile) / "page.html"
            copy.write_text(src.read_text().replace("</head>", f"<style>{css}</style></head>", 1))
            src = copy
        proc = _run([exe, *FLAGS, f"--user-data-dir={profile}/p", f"--window-size={window[0]},{window[1]}",
                     f"--virtual-time-budget={budget_ms}", f"--screenshot={png}", src.as_uri()], timeout_s)
    if not png.exists() or png.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr[-500:]}")
    return png
