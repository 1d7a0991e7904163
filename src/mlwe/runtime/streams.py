"""The four live streams (telemetry, state, reasoning, audit), fanned out to many readers.

The engine publishes from its own thread; readers (SSE clients of the API, the
CLI's ``watch``, tests) each hold a :class:`Subscription` with a BOUNDED buffer.
Publishing never waits for a reader: when a reader's buffer is full its oldest
event is dropped and counted, and the reader is told how many it missed (it
can resume from the hub's replay ring with the last id it saw). Event ids are
one increasing sequence across topics, so ``Last-Event-ID`` resumes exactly.

Everything published goes through the credential sanitizer first: streams are
shown to people.

Fan-out happens off the publisher's thread. The engine publishes while it holds
its lock, so ``publish`` only stamps the event, appends it to the ring and to a
pending list, and kicks the hub's dispatcher thread; the dispatcher hands each
batch of pending events to every reader (one buffer lock and at most one
event-loop wake-up per reader per batch, however many events). A reader that
drains synchronously first delivers what is pending itself, so whatever was
published before ``drain()`` is in what it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlwe.core.backend import Command, StartCommand, StopCommand
from mlwe.core.lifecycle import Transition
from mlwe.core.model import Workload
from mlwe.store.audit import AuditEntry
from mlwe.store.sanitize import sanitize

TOPICS = ("telemetry", "state", "reasoning", "audit")


class UnknownTopic(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class StreamEvent:
    id: int
    topic: str
    time: float
    data: Mapping[str, Any]
    correlation_id: str | None = None
    workload: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "topic": self.topic,
            "time": self.time,
            "correlation_id": self.correlation_id,
            "workload": self.workload,
            "data": dict(self.data),
        }


@dataclass(eq=False)
class Subscription:
    """One reader's bounded view of some topics."""

    hub: StreamHub
    topics: frozenset[str]
    maxsize: int
    _buf: deque[StreamEvent] = field(default_factory=deque)
    dropped: int = 0  # events dropped since the reader last drained
    dropped_total: int = 0
    gap: bool = False  # the resume point was older than the replay ring
    closed: bool = False
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=list)
    _after: int = 0  # the id of the last event handed to this reader (replayed or delivered)

    def _offer_many(
        self, events: list[StreamEvent]
    ) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]:
        """Buffer ``events`` (those of its topics, newer than what it has); the waiters to wake."""
        with self._cond:
            fresh = [e for e in events if e.id > self._after and e.topic in self.topics]
            if not fresh:
                return []
            self._after = fresh[-1].id
            for ev in fresh:
                if len(self._buf) >= self.maxsize:
                    self._buf.popleft()
                    self.dropped += 1
                    self.dropped_total += 1
                self._buf.append(ev)
            self._cond.notify_all()
            return list(self._waiters)

    def drain(self, limit: int | None = None) -> tuple[list[StreamEvent], int]:
        """The buffered events (oldest first) and how many were dropped before them.

        What was published before this call is included (pending events are
        delivered first, on this thread, if the dispatcher has not yet)."""
        self.hub.deliver()
        return self._take(limit)

    def _take(self, limit: int | None = None) -> tuple[list[StreamEvent], int]:
        with self._cond:
            if limit is None or limit >= len(self._buf):
                out = list(self._buf)
                self._buf.clear()
            else:
                out = [self._buf.popleft() for _ in range(limit)]
            dropped, self.dropped = self.dropped, 0
        return out, dropped

    def get(self, timeout: float | None = None) -> tuple[list[StreamEvent], int]:
        """Block (up to ``timeout``) until something is buffered, then drain."""
        self.hub.deliver()
        with self._cond:
            if not self._buf and not self.closed:
                self._cond.wait(timeout)
        return self._take()

    async def wait(self, timeout: float | None = None) -> tuple[list[StreamEvent], int]:
        """The async ``get``: waits on the caller's event loop, never blocks it."""
        # never delivers on the event loop's thread: the dispatcher does, and wakes it
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._cond:
            if self._buf or self.closed:
                return self._take()
            self._waiters.append((loop, event))
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            with self._cond:
                self._waiters.remove((loop, event))
        return self._take()

    def close(self) -> None:
        self.hub.unsubscribe(self)
        with self._cond:
            self.closed = True
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_monotonic = time.monotonic


def _set_all(events: list[asyncio.Event]) -> None:
    for e in events:
        e.set()


class StreamHub:
    """Publish/subscribe over the four topics, with a replay ring for resumption."""

    def __init__(
        self,
        *,
        ring_size: int = 20_000,
        default_buffer: int = 1_000,
        clock: Callable[[], float] = time.time,
        sanitizer: Callable[[Any], Any] = sanitize,
        fanout_interval_s: float = 0.05,
    ) -> None:
        self._ids = itertools.count(1)
        self._ring: deque[StreamEvent] = deque(maxlen=ring_size)
        self._subs: list[Subscription] = []
        self._lock = threading.Lock()
        self.default_buffer = default_buffer
        self._clock = clock
        self._sanitize = sanitizer
        self.published = 0
        self._pending: list[StreamEvent] = []  # published, not yet handed to the readers
        self._deliver_lock = threading.Lock()  # one delivery at a time: readers see id order
        self._kick = threading.Event()
        self._dispatcher: threading.Thread | None = None
        self.fanout_interval_s = fanout_interval_s  # the most often readers are handed a batch

    @property
    def last_id(self) -> int:
        with self._lock:
            return self._ring[-1].id if self._ring else 0

    def publish(
        self,
        topic: str,
        data: Mapping[str, Any],
        *,
        correlation_id: str | None = None,
        workload: str | None = None,
        time: float | None = None,
    ) -> StreamEvent:
        if topic not in TOPICS:
            raise UnknownTopic(f"unknown stream topic {topic!r}; topics: {', '.join(TOPICS)}")
        clean = self._sanitize(dict(data))
        with self._lock:
            ev = StreamEvent(
                next(self._ids),
                topic,
                self._clock() if time is None else time,
                clean,
                correlation_id,
                workload,
            )
            self._ring.append(ev)
            self.published += 1
            if self._subs:
                self._pending.append(ev)
                kick = True
            else:
                kick = False
        if kick:
            self._kick.set()  # the dispatcher fans it out, off this (the engine's) thread
        return ev

    def deliver(self) -> int:
        """Hand every pending event to the readers now; how many events were delivered.

        Run by the dispatcher thread, and by a reader that drains synchronously."""
        n = 0
        with self._deliver_lock:
            while True:
                with self._lock:
                    batch, self._pending = self._pending, []
                    subs = list(self._subs)
                if not batch:
                    return n
                n += len(batch)
                wake: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
                for sub in subs:
                    for loop, event in sub._offer_many(batch):
                        wake.setdefault(loop, []).append(event)
                for loop, events in wake.items():  # one wake-up per event loop, not per reader
                    with contextlib.suppress(RuntimeError):  # that loop is closed
                        loop.call_soon_threadsafe(_set_all, events)

    def _dispatch(self) -> None:
        last = 0.0
        while True:
            self._kick.wait()
            # the first event after a quiet spell goes out at once; under a steady flow,
            # one batch per interval: readers wake (and sockets are written) per batch,
            # not per event, which is what 300 dashboards cost the server
            pause = last + self.fanout_interval_s - _monotonic()
            if pause > 0:
                time.sleep(pause)
            self._kick.clear()
            last = _monotonic()
            try:
                self.deliver()
            except Exception:  # pragma: no cover - a reader's bug must not end the fan-out
                import logging

                logging.getLogger("mlwe.streams").exception("stream fan-out failed")

    def subscribe(
        self,
        topics: Iterable[str] = TOPICS,
        *,
        last_event_id: int | None = None,
        buffer: int | None = None,
    ) -> Subscription:
        """A new reader. With ``last_event_id``, first replays what came after it."""
        wanted = frozenset(topics)
        bad = sorted(wanted - set(TOPICS))
        if bad:
            raise UnknownTopic(f"unknown stream topic(s) {', '.join(bad)}; topics: {', '.join(TOPICS)}")
        size = buffer or self.default_buffer
        if size < 1:
            raise ValueError("a subscription buffer holds at least one event")
        sub = Subscription(self, wanted, size)
        with self._lock:
            if self._dispatcher is None:
                self._dispatcher = threading.Thread(target=self._dispatch, name="mlwe-stream-fanout", daemon=True)
                self._dispatcher.start()
            # what is in the ring (pending included) is this reader's past: replayed below
            # from last_event_id, never delivered again
            sub._after = self._ring[-1].id if self._ring else 0
            if last_event_id is not None:
                if self._ring and last_event_id < self._ring[0].id - 1:
                    sub.gap = True  # some events it missed are gone from the ring
                for ev in self._ring:
                    if ev.id > last_event_id and ev.topic in wanted:
                        sub._buf.append(ev)
                while len(sub._buf) > size:
                    sub._buf.popleft()
                    sub.dropped += 1
            self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    @property
    def subscribers(self) -> int:
        with self._lock:
            return len(self._subs)

    def recent(
        self,
        topics: Iterable[str] = TOPICS,
        *,
        after_id: int = 0,
        limit: int = 500,
        correlation_id: str | None = None,
        workload: str | None = None,
    ) -> list[StreamEvent]:
        """The latest events still in the ring (oldest first), optionally filtered."""
        wanted = frozenset(topics)
        with self._lock:
            evs = [e for e in self._ring if e.id > after_id and e.topic in wanted]
        if correlation_id is not None:
            evs = [e for e in evs if e.correlation_id == correlation_id]
        if workload is not None:
            evs = [e for e in evs if e.workload == workload]
        return evs[-limit:]


# ============================================================ what is streamed
# The engine's events, one shape each (the dashboard and `mlwe watch` read these).
def transition_event(w: Workload, tr: Transition) -> dict[str, Any]:
    """A workload's state transition, on the ``state`` topic; ``seq`` is its number
    among the workload's transitions (1 = the first), as ``transitions`` counts them
    in a workload's summary."""
    h = w.history
    seq = len(h)
    while seq > 0 and h[seq - 1] is not tr:  # later transitions of the same batch follow it
        seq -= 1
    return {
        "type": "transition",
        "workload": w.id,
        "seq": seq or None,
        "name": w.spec.name,
        "kind": w.spec.kind.value,
        "priority": w.priority,
        "queue": w.queue,
        "from": tr.source.value if tr.source is not None else None,
        "to": tr.target.value,
        "reason": tr.reason,
        "attempt": w.attempt,
        "nodes": sorted({a.node for a in w.placement}),
        "deadline": w.deadline,
    }


def command_event(c: Command) -> dict[str, Any]:
    """A command sent to the backend, on the ``state`` topic."""
    data: dict[str, Any] = {
        "type": "command",
        "command": c.kind,
        "request_id": c.request_id,
        "workload": c.workload,
        "attempt": c.attempt,
    }
    if isinstance(c, StartCommand):
        data["nodes"] = sorted({a.node for a in c.placement})
    elif isinstance(c, StopCommand):
        data["reason"] = c.reason
        data["grace_s"] = c.grace_s
    return data


def audit_event(entry: AuditEntry) -> dict[str, Any]:
    """An audit record once durable, on the ``audit`` topic."""
    return {
        "seq": entry.seq,
        "kind": entry.kind,
        "actor": entry.actor,
        "hash": entry.hash,
        "prev_hash": entry.prev_hash,
        "payload": entry.data(),
    }
