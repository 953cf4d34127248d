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
from typing import Callable

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


def _run(args: Callable[[str], list[str]], timeout_s: float, attempts: int = 2) -> subprocess.CompletedProcess:
    """Run Chromium with ``args(profile_dir)``, each attempt in a fresh temporary profile. A run
    that hangs past ``timeout_s`` is killed and started once more: headless Chromium with
    --dump-dom and --screenshot together now and then never exits (seen once in about twenty
    suite runs on a loaded 2-core machine, killed after 90 s; the same page loads in seconds)."""
    for attempt in range(attempts):
        with tempfile.TemporaryDirectory(prefix="clustersim-chromium-") as profile:
            try:
                return subprocess.run(args(profile), capture_output=True, text=True, timeout=timeout_s, errors="replace")
            except subprocess.TimeoutExpired:
                if attempt + 1 == attempts:
                    raise
    raise AssertionError("unreachable")  # pragma: no cover


def open_page(html_path: Path | str, budget_ms: int = 8000, window: tuple[int, int] = (1400, 1000),
              timeout_s: float = 60.0, screenshot_to: Path | str | None = None) -> PageResult:
    """Load ``html_path``, let it run for ``budget_ms`` of virtual time, return the DOM and console
    (and save a PNG of the first ``window`` pixels to ``screenshot_to`` from the same load)."""
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("chromium not found (apt-get install chromium)")
    url = Path(html_path).resolve().as_uri()
    proc = _run(lambda profile: [exe, *FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
                                 f"--window-size={window[0]},{window[1]}", f"--virtual-time-budget={budget_ms}",
                                 "--dump-dom", *([f"--screenshot={Path(screenshot_to).resolve()}"] if screenshot_to else []),
                                 url],
                timeout_s)
    console = []
    for line in proc.stderr.splitlines():
        m = CONSOLE_RE.search(line)
        if m:
            console.append(m.group(1))
    return PageResult(proc.stdout, console, proc.stderr)


def screenshot(html_path: Path | str, png_path: Path | str, window: tuple[int, int] = (1400, 1000),
               budget_ms: int = 8000, timeout_s: float = 60.0, hide: tuple[str, ...] = ()) -> Path:
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
        page = src.as_uri()
        proc = _run(lambda data_dir: [exe, *FLAGS, f"--user-data-dir={data_dir}", f"--window-size={window[0]},{window[1]}",
                                      f"--virtual-time-budget={budget_ms}", f"--screenshot={png}", page], timeout_s)
    if not png.exists() or png.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr[-500:]}")
    return png


@dataclass
class PageTiming:
    tti_ms: float  # performance.now() when the first screen's figures were drawn (the page responds)
    ready_ms: float  # ... when every figure and the op-level view were drawn
    wall_ms: float  # from opening the tab to seeing it ready, measured here
    dom_nodes: int
    js_errors: list[str] = field(default_factory=list)
    marks: list = field(default_factory=list)  # (name, ms) of the page's performance marks


class _Pipe:
    """Chrome DevTools protocol over --remote-debugging-pipe: JSON messages ending in NUL, commands
    written to the browser's fd 3, replies read from its fd 4 (no websocket library needed)."""

    def __init__(self, exe: str, profile: str, window: tuple[int, int]):
        r_cmd, w_cmd = os.pipe()
        r_out, w_out = os.pipe()

        def child_fds():  # runs in the child: its fd 3 reads our commands, fd 4 writes its replies
            import fcntl

            a = fcntl.fcntl(r_cmd, fcntl.F_DUPFD, 10)  # out of the way first: r_cmd or w_out may be 3 or 4
            b = fcntl.fcntl(w_out, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe", f"--window-size={window[0]},{window[1]}",
             "about:blank"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=child_fds, pass_fds=(3, 4, r_cmd, w_out))
        os.close(r_cmd)
        os.close(w_out)
        self.w = os.fdopen(w_cmd, "wb", buffering=0)
        self.r = os.fdopen(r_out, "rb", buffering=0)
        self.buf = b""
        self.next_id = 0

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout_s: float = 60.0) -> dict:
        import json
        import select
        import time

        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.w.write(json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" in self.buf:
                raw, self.buf = self.buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self.next_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.r], [], [], left)[0]:
                raise TimeoutError(f"chromium did not answer {method} within {timeout_s} s")
            chunk = self.r.read(1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the debugging pipe")
            self.buf += chunk

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout_s=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def time_page(html_path: Path | str, timeout_s: float = 60.0, window: tuple[int, int] = (1400, 1000)) -> PageTiming:
    """Open the page in real (not virtual) time and measure when it is interactive: the page's
    runtime sets data-ready once plotly.js is loaded and every figure is drawn, and records
    performance.now() (ms since navigation started) in data-tti-ms."""
    import time

    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("chromium not found (apt-get install chromium)")
    url = Path(html_path).resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="clustersim-chromium-") as profile:
        pipe = _Pipe(exe, profile, window)
        try:
            t0 = time.perf_counter()
            target = pipe.call("Target.createTarget", {"url": url})["targetId"]
            session = pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            expr = ("(function(){var d=document.documentElement;return JSON.stringify({"
                    "tti:d.getAttribute('data-interactive-ms')||d.getAttribute('data-tti-ms'),ready:d.getAttribute('data-ready'),"
                    "all:d.getAttribute('data-tti-ms'),nodes:document.getElementsByTagName('*').length,"
                    "err:d.getAttribute('data-js-error-last'),marks:performance.getEntriesByType('mark').map(function(m){"
                    "return [m.name,Math.round(m.startTime)];})});})()")
            import json

            while True:
                res = pipe.call("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session=session)
                v = json.loads(res.get("result", {}).get("value") or "{}")
                if v.get("ready"):
                    wall = (time.perf_counter() - t0) * 1e3
                    return PageTiming(float(v["tti"]), float(v["all"]), wall, int(v["nodes"]), [v["err"]] if v.get("err") else [],
                                      v.get("marks", []))
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(f"{html_path} did not become ready within {timeout_s} s")
                time.sleep(0.05)
        finally:
            pipe.close()
