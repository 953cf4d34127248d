"""The event core the engine runs on: SimPy's semantics, without SimPy's per-event objects where
nothing needs them.

SimPy (the reference, and what the networks are written against) processes one heap entry
``(time, priority, id, event)`` at a time and runs the event's callbacks; a process is a
generator resumed by a callback on the event it yielded. This core keeps exactly that order —
the same heap key, ids handed out at the same points, callbacks run in the order they were
added — so a simulation gives the same results, value for value, on either core
(``tests/test_event_core.py`` runs scenarios on both and compares every row).

What is cheaper here, measured on the full-mode engine (docs/design-notes.md, "Event core"):
- A process may yield a plain number: a delay. The heap entry then holds the process itself,
  resumed directly when it is popped, with no Timeout object, no callback list and no bound
  method call in between. (SimPy: a Timeout whose only callback is the process's resume; its
  id is taken at the same point, so the order is the same.)
- Events carry ``__slots__``; ``now`` is a plain attribute, not a property; the loop is one
  function, not a ``step()`` call per event.
- A process that ends schedules nothing (SimPy schedules the Process event itself; nothing in
  the engine waits on a process, and an entry no one waits on changes no other entry's order).
- An exception in a process propagates out of ``run()`` as itself (SimPy re-raises a copy
  from its step): the engine's callers catch it by type either way.

SimPy events (``simpy.Event(env)``, ``simpy.Timeout``) also run here: they schedule through
``env.schedule`` and carry the same ``callbacks`` / ``_value`` / ``_ok`` fields.
"""

from __future__ import annotations

from heapq import heappop, heappush
from itertools import count

# simpy.events.PENDING: a value no event can have, so "triggered" is "value is not PENDING"; the
# same sentinel, so SimPy events mix in.
from simpy.events import PENDING

# SimPy's priorities (simpy.events.URGENT / NORMAL): process start before anything else at
# the same instant, everything else in the order it was scheduled.
URGENT = 0
NORMAL = 1


class Event:
    """An event: triggered once (``succeed``), processed when the loop pops it, then its
    callbacks run in the order they were added."""

    __slots__ = ("env", "callbacks", "_value", "_ok")

    def __init__(self, env: "Environment"):
        self.env = env
        self.callbacks: list | None = []
        self._value = PENDING

    @property
    def triggered(self) -> bool:
        return self._value is not PENDING

    @property
    def processed(self) -> bool:
        return self.callbacks is None

    @property
    def value(self):
        if self._value is PENDING:
            raise AttributeError(f"value of {self!r} is not yet available")
        return self._value

    @property
    def ok(self) -> bool:
        return self._ok

    def succeed(self, value=None) -> "Event":
        if self._value is not PENDING:
            raise RuntimeError(f"{self!r} has already been triggered")
        self._ok = True
        self._value = value
        env = self.env
        heappush(env._queue, (env.now, NORMAL, next(env._eid), self))
        return self

    def __or__(self, other: "Event") -> "AnyOf":
        return AnyOf(self.env, (self, other))


class Timeout(Event):
    """An event processed ``delay`` seconds from now (for callbacks; a process that only waits
    yields the delay itself)."""

    __slots__ = ()

    def __init__(self, env: "Environment", delay: float, value=None):
        if delay < 0:
            raise ValueError(f"negative delay {delay}")
        self.env = env
        self.callbacks = []
        self._value = value
        self._ok = True
        heappush(env._queue, (env.now + delay, NORMAL, next(env._eid), self))


class AnyOf(Event):
    """Triggered when the first of its events is processed (SimPy's ``a | b``); its value is the
    list of its events processed by the time it is (``x in value`` asks whether x fired)."""

    __slots__ = ("_events", "_chk")

    def __init__(self, env: "Environment", events: tuple):
        self.env = env
        self.callbacks = []
        self._value = PENDING
        self._events = events
        self._chk = check = self._check  # one bound method: added to the events, removed from them
        for ev in events:
            if ev.callbacks is None:
                check(ev)
            else:
                ev.callbacks.append(check)
        self.callbacks.append(self._build_value)

    def _check(self, event) -> None:
        if self._value is PENDING:
            self.succeed()

    def _build_value(self, _event) -> None:
        check = self._chk
        # The bound method refers to self: drop it, or every condition would stay alive in a
        # reference cycle until the cyclic collector (paused while a simulation runs) ran.
        self._chk = None
        for ev in self._events:
            cbs = ev.callbacks
            if cbs and check in cbs:
                cbs.remove(check)
        self._value = [ev for ev in self._events if ev.callbacks is None]


class Process:
    """A generator resumed with the value of what it yielded: an event (when processed) or a
    delay in seconds (when it has passed)."""

    __slots__ = ("env", "_send", "_resume")

    def __init__(self, env: "Environment", generator):
        self.env = env
        self._send = generator.send
        self._resume = self._on_event
        # SimPy's Initialize event: the process starts at this instant, before NORMAL events.
        heappush(env._queue, (env.now, URGENT, next(env._eid), self))

    def _on_event(self, event) -> None:
        self._step(event._value)

    def _step(self, value) -> None:
        send = self._send
        env = self.env
        while True:
            try:
                got = send(value)
            except StopIteration:
                return
            if got.__class__ is float:
                heappush(env._queue, (env.now + got, NORMAL, next(env._eid), self))
                return
            try:
                cbs = got.callbacks
            except AttributeError:  # a delay of another numeric type (numpy, int)
                heappush(env._queue, (env.now + float(got), NORMAL, next(env._eid), self))
                return
            if cbs is not None:
                cbs.append(self._resume)
                return
            value = got._value  # already processed: go on at once, as SimPy does


class Environment:
    """The loop: pop the earliest entry; a process entry resumes its process, an event entry
    runs its callbacks."""

    __slots__ = ("now", "_queue", "_eid")

    def __init__(self):
        self.now = 0.0
        self._queue: list = []
        self._eid = count()

    def event(self) -> Event:
        return Event(self)

    def timeout(self, delay: float, value=None) -> Timeout:
        return Timeout(self, delay, value)

    def process(self, generator) -> Process:
        return Process(self, generator)

    def schedule(self, event, priority: int = NORMAL, delay: float = 0.0) -> None:
        """SimPy's hook: SimPy events created on this environment schedule themselves here."""
        heappush(self._queue, (self.now + delay, priority, next(self._eid), event))

    def run(self) -> None:
        queue = self._queue
        pop = heappop
        process = Process
        while queue:
            now, _, _, item = pop(queue)
            self.now = now
            if item.__class__ is process:
                item._step(None)
                continue
            callbacks = item.callbacks
            item.callbacks = None
            for cb in callbacks:
                cb(item)
            if not item._ok:  # pragma: no cover - nothing in the engine fails an event
                raise item._value
