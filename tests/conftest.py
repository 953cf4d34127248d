"""Test-suite guard: a test that reads a file outside the repository fails.

The tests must pass in a clean clone with nothing beside it (no ``../shared``), so every file a test
reads has to live in the repository (``tests/data/``). A ``sys.addaudithook`` hook watches the
``open``, directory-listing, copy and subprocess events of the test process and fails the test that
caused one whose path is

- under the repository's parent folder but not inside the repository (a sibling such as ``../shared``
  or ``../other-checkout``), or
- under a folder named ``shared`` beside any ancestor of the repository (``/work/shared`` seen from a
  worktree in ``/work/wt/``).

Left alone: the interpreter and its site-packages, the temporary folder (``tmp_path``), and hidden
folders beside the repository (``~/.cache``, ``~/.config`` when the clone sits in a home folder),
which hold caches and settings, not test data. Child processes are checked by their arguments and
working folder (a path to ``../shared`` passed on a command line fails the test too).

The hook raises ``OutsideRepoRead`` (not an OSError, so ``except OSError`` fallbacks cannot hide it)
and also records the read, so a test that swallows the exception still fails at teardown.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]

# Audit events whose first argument is a path that is read (or listed, or copied from).
_PATH_EVENTS = frozenset({"open", "os.listdir", "os.scandir", "glob.glob", "glob.glob/2", "shutil.copyfile",
                          "shutil.copytree", "shutil.copymode", "shutil.copystat", "shutil.make_archive"})
_PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.exec", "os.system"})


class OutsideRepoRead(RuntimeError):
    """A test touched a file outside the repository."""


def _norm(p: str | os.PathLike) -> str:
    return os.path.normpath(os.path.abspath(os.fsdecode(p)))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class ReadGuard:
    """Which paths are outside the repository, and what tests touched there.

    One per test session: an audit hook cannot be removed, so the hook and its state live as long as
    the interpreter (the session).
    """

    def __init__(self, repo: Path):
        self.repo = _norm(repo)
        self.parent = _norm(repo.parent)
        # Every ancestor's ``shared`` folder (the project's development data sits in one).
        self.shared = [_norm(a / "shared") for a in repo.parents if _norm(a / "shared") != self.repo]
        temp = _norm(tempfile.gettempdir())
        allowed = {_norm(a) for a in (sys.prefix, sys.base_prefix, sys.exec_prefix, temp, *site.getsitepackages(),
                                      site.getusersitepackages(), *sysconfig.get_paths().values()) if a}
        # A folder holding the repository's parent (the clone sits in /tmp, or inside a venv folder)
        # would allow every sibling: left out.
        self.allowed = sorted(a for a in allowed if not _inside(self.parent, a))
        # A clone right in the temporary folder: its siblings include every temporary file and
        # pytest's tmp_path; those are known by their prefixes.
        self.temp_prefixes = (tempfile.gettempprefix(), "pytest-of-") if self.parent == temp else ()
        self.violations: list[str] = []  # not yet reported (a swallowed OutsideRepoRead included)
        self.expecting = 0  # > 0 inside expect(): record, do not raise (the guard's own self-test)

    def forbidden(self, path: str) -> bool:
        if _inside(path, self.repo):
            return False
        if any(_inside(path, s) for s in self.shared):
            return True
        if not _inside(path, self.parent) or path == self.parent:
            return False
        if any(_inside(path, a) for a in self.allowed):
            return False
        first = os.path.relpath(path, self.parent).split(os.sep, 1)[0]
        if first.startswith((".", *self.temp_prefixes)):
            return False
        if self.temp_prefixes:
            # A clone right in the temporary folder shares it with every library's scratch files
            # (dask-scratch-space, Chromium profiles, torch's rank folders): there only what a test
            # could lean on as data is flagged, a shared/ folder or another checkout.
            return first == "shared" or os.path.isdir(os.path.join(self.parent, first, ".git"))
        return True

    def _flag(self, event: str, path: str) -> None:
        msg = f"{event} {path!r}: tests must not read outside the repository {self.repo!r}; copy the data into tests/data/"
        self.violations.append(msg)
        if not self.expecting:
            raise OutsideRepoRead(msg)

    def hook(self, event: str, args: tuple) -> None:
        if event in _PATH_EVENTS:
            if not args or isinstance(args[0], int) or args[0] is None:
                return  # a file descriptor, or os.listdir() of the working folder
            try:
                path = _norm(args[0])
            except (TypeError, ValueError):
                return
            if self.forbidden(path):
                self._flag(event, path)
        elif event in _PROCESS_EVENTS:
            self._check_process(event, args)

    def _check_process(self, event: str, args: tuple) -> None:
        if event == "os.system":
            words = os.fsdecode(args[0]).split()
        else:
            argv = args[1] if len(args) > 1 else ()
            words = [argv] if isinstance(argv, (str, bytes, os.PathLike)) else list(argv or ())
        cwd = os.getcwd()
        if event == "subprocess.Popen" and len(args) > 2 and args[2] is not None:
            cwd = _norm(args[2])
            if self.forbidden(cwd):
                self._flag(f"{event} cwd", cwd)
        for w in words:
            try:
                text = os.fsdecode(w)
            except TypeError:
                continue
            # --flag=PATH as well as PATH; a relative path is the child's, from its working folder
            for part in {text, text.split("=", 1)[-1]}:
                if os.sep in part:
                    path = os.path.normpath(os.path.join(cwd, part))
                    if self.forbidden(path):
                        self._flag(f"{event} argument", path)

    @contextmanager
    def expect(self) -> Iterator[list[str]]:
        """Record reads outside the repository without raising; yields the list of what was caught."""
        start = len(self.violations)
        caught: list[str] = []
        self.expecting += 1
        try:
            yield caught
        finally:
            self.expecting -= 1
            caught.extend(self.violations[start:])
            del self.violations[start:]


GUARD = ReadGuard(REPO)
sys.addaudithook(GUARD.hook)


@pytest.fixture
def read_guard() -> ReadGuard:
    return GUARD


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.when == "call":
        item.stash[_CALL_FAILED] = rep.failed
    return rep


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def _one_browser_at_a_time(request) -> Iterator[None]:
    """Tests marked ``browser`` run Chromium. The suite runs in two worker processes (pytest-xdist,
    pyproject's addopts), and two headless Chromiums at once on a 2-core machine hung past the
    page's 90 s timeout; a lock file in the temporary folder runs them one at a time."""
    if request.node.get_closest_marker("browser") is None:
        yield
        return
    import fcntl

    with open(Path(tempfile.gettempdir()) / "clustersim-tests-browser.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _no_reads_outside_repository(request) -> Iterator[None]:
    # Reads before the test (a module fixture that swallowed the error) are reported with it too.
    yield
    if GUARD.violations:
        found = list(dict.fromkeys(GUARD.violations))
        GUARD.violations.clear()
        if request.node.stash.get(_CALL_FAILED, False):
            return  # the test already failed (with OutsideRepoRead, raised where it read)
        pytest.fail("read outside the repository:\n  " + "\n  ".join(found[:10]), pytrace=False)


def pytest_configure(config) -> None:
    """Compile the package's modules once, before the workers start.

    A few hundred tests run ``python -m simulator.cli`` (or torchrun) in a child process, as a user
    would. Where PYTHONDONTWRITEBYTECODE is set (this project's machines set it) and the checkout is
    fresh, no bytecode exists for the package, so every child compiled its ~70 modules again: about
    0.4 s of CPU a run (all 107 modules: 0.56 s), roughly a tenth of the suite. An installed package
    has its bytecode (pip compiles at install), so the children now run as a user's would. The
    bytecode goes where Python keeps it (``__pycache__``, ignored by git); with it or without it the
    children run the same code."""
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the controller compiled before starting it
    import compileall

    compileall.compile_dir(REPO / "simulator", quiet=2, workers=1)


def _files_with_browser_tests(rootpath: Path) -> set[str]:
    """The test files (as in node ids, relative to pytest's rootdir) that mark a test ``browser``."""
    return {p.relative_to(rootpath).as_posix() for p in sorted((REPO / "tests").glob("test_*.py"))
            if "mark.browser" in p.read_text()}


@pytest.hookimpl(optionalhook=True)  # (pytest-xdist's hook: with -p no:xdist it is not called)
def pytest_xdist_make_scheduler(config, log):
    """The files with Chromium tests go to one worker as one unit. The browser lock above runs those
    tests one at a time, so with the files on both workers one worker sat waiting on the other's
    browser (73 s of test_dashboard.py's 107 s in one run); together they run back to back while
    the other worker takes the rest. Other files are scheduled as --dist loadfile does."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    together = _files_with_browser_tests(Path(config.rootpath))

    class BrowserFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "browser tests" if path in together else path

    return BrowserFilesTogether(config, log)
