"""The four live streams (telemetry, state, reasoning, audit), fanned out to many readers.

The engine publishes from its own thread; readers (SSE clients of the API, the
CLI's ``watch``, tests) each hold a :class:`Subscription` with a BOUNDED buffer.
Publishing never waits for a reader: when a reader's buffer is full its oldest
event is dropped and counted, and the reader is told how many it missed (it
can resume from the hub's replay ring with the last id it saw). Event ids are
one increasing sequence across topics, so ``Last-Event-ID`` resumes exactly.

Everything published goes through the credential sanitizer first: streams are
shown to people.
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

    def _offer(self, ev: StreamEvent) -> None:
        with self._cond:
            if len(self._buf) >= self.maxsize:
                self._buf.popleft()
                self.dropped += 1
                self.dropped_total += 1
            self._buf.append(ev)
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed: the reader is gone
                loop.call_soon_threadsafe(event.set)

    def drain(self, limit: int | None = None) -> tuple[list[StreamEvent], int]:
        """The buffered events (oldest first) and how many were dropped before them."""
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
        with self._cond:
            if not self._buf and not self.closed:
                self._cond.wait(timeout)
        return self.drain()

    async def wait(self, timeout: float | None = None) -> tuple[list[StreamEvent], int]:
        """The async ``get``: waits on the caller's event loop, never blocks it."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._cond:
            if self._buf or self.closed:
                return self.drain()
            self._waiters.append((loop, event))
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            with self._cond:
                self._waiters.remove((loop, event))
        return self.drain()

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


class StreamHub:
    """Publish/subscribe over the four topics, with a replay ring for resumption."""

    def __init__(
        self,
        *,
        ring_size: int = 20_000,
        default_buffer: int = 1_000,
        clock: Callable[[], float] = time.time,
        sanitizer: Callable[[Any], Any] = sanitize,
    ) -> None:
        self._ids = itertools.count(1)
        self._ring: deque[StreamEvent] = deque(maxlen=ring_size)
        self._subs: list[Subscription] = []
        self._lock = threading.Lock()
        self.default_buffer = default_buffer
        self._clock = clock
        self._sanitize = sanitizer
        self.published = 0

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
            subs = [s for s in self._subs if topic in s.topics]
            self.published += 1
        for s in subs:
            s._offer(ev)
        return ev

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
