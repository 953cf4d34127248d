"""The event core the engine runs on: SimPy's semantics, without SimPy's per-event objects where
nothing needs them.

SimPy (the reference, and what the networks are written against) processes one heap entry
``(time, priority, id, event)`` at a time and runs the event's callbacks; a process is a
generator resumed by a callback on the event it yielded. This core keeps exactly that order —
entries of one instant in the order they were scheduled (SimPy's id order), URGENT before
NORMAL, callbacks run in the order they were added — so a simulation gives the same results,
value for value, on either core (``tests/test_event_core.py`` runs scenarios on both and
compares every row).

What is cheaper here, measured on the full-mode engine (docs/design-notes.md, "Event core"):
- A process may yield a plain number: a delay. The heap entry then holds the process itself,
  resumed directly when it is popped, with no Timeout object, no callback list and no bound
  method call in between. (SimPy: a Timeout whose only callback is the process's resume; its
  id is taken at the same point, so the order is the same.)
- Events carry ``__slots__``; ``now`` is a plain attribute, not a property; the loop is one
  function, not a ``step()`` call per event.
- The queue is a list per instant and a heap of the distinct instants (``Environment``), not one
  heap of every entry: a symmetric run wakes many ranks at one instant.
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
        self.env._push(self.env.now, self)
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
        env._push(env.now + delay, self)


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


class Interruptible:
    """A delay another process may cut short, in the order SimPy's ``yield env.timeout(d) | change``
    gives, with fewer objects (no change Event, Timeout or AnyOf with its callback lists).

    The waiter yields ``wake``. The end of the delay is this object's own entry (where the
    Timeout's was); ``interrupt()`` schedules a poke now (where ``change.succeed()`` scheduled
    the change event). Whichever fires first triggers ``wake`` (where the AnyOf was scheduled),
    and the waiter resumes when ``wake`` is processed, as it did on the AnyOf. ``finished`` says
    whether the delay's end had been processed by then (``finish in fired``)."""

    __slots__ = ("callbacks", "_ok", "wake", "finished")

    def __init__(self, env: "Environment", delay: float):
        self.callbacks = [_interruptible_end]
        self._ok = True
        self.wake = Event(env)
        self.finished = False
        env._push(env.now + delay, self)

    def interrupt(self) -> None:
        env = self.wake.env
        env._push(env.now, _Poke(self))


def _interruptible_end(item: Interruptible) -> None:
    item.finished = True
    wake = item.wake
    if wake._value is PENDING:
        wake.succeed()


class _Poke:
    """The entry of an ``Interruptible.interrupt()``."""

    __slots__ = ("callbacks", "_ok", "target")

    def __init__(self, target: Interruptible):
        self.callbacks = [_poke]
        self._ok = True
        self.target = target


def _poke(item: _Poke) -> None:
    wake = item.target.wake
    if wake._value is PENDING:
        wake.succeed()


class At(float):
    """What a process yields to wake at this absolute time (>= now): ``now + (t - now)`` can
    land an ulp off ``t``, and a rank that ran ahead on its own clock must meet the loop at the
    clock its rows were written with (``Engine.run_ahead``)."""

    __slots__ = ()


def simpy_wake_at(env, t: float):
    """SimPy's counterpart of yielding ``At(t)``: an event processed at ``t`` exactly, in the
    order an entry scheduled now at ``t`` would take. (SimPy only schedules by delay; its queue
    entry ``(time, priority, id, event)`` is written here as ``Environment.schedule`` writes it.)"""
    import simpy

    ev = simpy.Event(env)
    ev._ok = True
    ev._value = None
    heappush(env._queue, (t, NORMAL, next(env._eid), ev))
    return ev


class Process:
    """A generator resumed with the value of what it yielded: an event (when processed), a
    delay in seconds (when it has passed), or ``At(t)`` (at ``t``)."""

    __slots__ = ("env", "_send", "_resume")

    def __init__(self, env: "Environment", generator):
        self.env = env
        self._send = generator.send
        self._resume = self._on_event
        # SimPy's Initialize event: the process starts at this instant, before NORMAL events.
        env.schedule(self, URGENT)

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
                env._push(env.now + got, self)
                return
            if got.__class__ is At:
                env._push(float(got), self)
                return
            try:
                cbs = got.callbacks
            except AttributeError:  # a delay of another numeric type (numpy, int)
                env._push(env.now + float(got), self)
                return
            if cbs is not None:
                cbs.append(self._resume)
                return
            value = got._value  # already processed: go on at once, as SimPy does


class Environment:
    """The loop: take the earliest entry; a process entry resumes its process, an event entry
    runs its callbacks.

    SimPy's heap key is (time, priority, id), ids growing with each entry. Here NORMAL entries
    are kept per instant, in a list in the order they were scheduled (which is id order), with a
    heap of the distinct instants: many ranks meet at the same instant in a symmetric run, so the
    heap holds a fraction of the entries and an entry at an instant already pending is one list
    append. URGENT entries (a process's start) go to a small heap of their own and come before
    the NORMAL entries of their instant. The order is SimPy's exactly."""

    __slots__ = ("now", "_times", "_at", "_urgent", "_eid")

    def __init__(self):
        self.now = 0.0
        self._times: list[float] = []  # heap of the instants that have NORMAL entries
        self._at: dict[float, list] = {}  # instant -> its NORMAL entries, in scheduling order
        self._urgent: list = []  # heap of (time, id, entry)
        self._eid = count()

    def _push(self, t: float, item) -> None:
        """A NORMAL entry at ``t``."""
        at = self._at.get(t)
        if at is None:
            self._at[t] = [item]
            heappush(self._times, t)
        else:
            at.append(item)

    def event(self) -> Event:
        return Event(self)

    def timeout(self, delay: float, value=None) -> Timeout:
        return Timeout(self, delay, value)

    def process(self, generator) -> Process:
        return Process(self, generator)

    def schedule(self, event, priority: int = NORMAL, delay: float = 0.0) -> None:
        """SimPy's hook: SimPy events created on this environment schedule themselves here."""
        if priority == NORMAL:
            self._push(self.now + delay, event)
        else:
            heappush(self._urgent, (self.now + delay, next(self._eid), event))

    def _fire(self, item) -> None:
        """Process one entry: resume its process, or run its callbacks. (Spelled out inline in
        ``run`` it measured no faster: bench_event_core, same load.)"""
        if item.__class__ is Process:
            item._step(None)
            return
        callbacks = item.callbacks
        item.callbacks = None
        for cb in callbacks:
            cb(item)
        if not item._ok:  # pragma: no cover - nothing in the engine fails an event
            raise item._value

    def run(self) -> None:
        times, at, urgent = self._times, self._at, self._urgent
        fire = self._fire
        while True:
            if urgent and (not times or urgent[0][0] <= times[0]):
                t, _, item = heappop(urgent)
                self.now = t
                fire(item)
                continue
            if not times:
                return
            t = times[0]
            entries = at[t]
            self.now = t
            i = 0
            # Entries scheduled at t while its entries run join the end of the same list.
            while i < len(entries):
                i += 1
                fire(entries[i - 1])
                while urgent and urgent[0][0] <= t:  # an URGENT entry at t comes first
                    fire(heappop(urgent)[2])
            del at[t]
            heappop(times)
