"""The default bus: in-memory asyncio queues in one process, no service.

Same contract as the NATS adapter: durable consumer groups, at-least-once
delivery (an unsettled copy is delivered again after ``ack_wait``; a retried
copy after its delay), dead letters on ``dlq.<subject>``. Nothing survives
the process: durability comes from the idempotent consumer's database, and
multi-process deployments use :class:`mlwe.bus.nats.NatsBus`.

For tests it can inject faults a real network produces: duplicate copies of
a published event (``duplicate_rate``) and out-of-order delivery
(``reorder``), both from a seeded random source.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mlwe.bus.base import (
    DEFAULT_DURABLE,
    DLQ_TOKEN,
    BusClosed,
    BusError,
    BusStats,
    Delivery,
    Envelope,
    EnvelopeError,
    dlq_subject,
    subject_matches,
    validate_durable,
    validate_filter,
    validate_subject,
)

log = logging.getLogger(__name__)


@dataclass
class _Copy:
    """One queued copy of an envelope, as one consumer group sees it."""

    subject: str  # the transport subject (``dlq.<subject>`` for a dead letter)
    envelope: Envelope
    deliveries: int = 0


@dataclass
class _Group:
    """A durable consumer group: its queue, its timers, its copies in flight."""

    name: str
    subject_filter: str
    ready: deque[_Copy] = field(default_factory=deque)
    delayed: list[tuple[float, int, _Copy]] = field(default_factory=list)  # heap
    inflight: dict[int, tuple[float, _Copy]] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def unsettled(self) -> int:
        return len(self.ready) + len(self.delayed) + len(self.inflight)


class InProcessDelivery:
    """A copy handed to a consumer; settling a copy that already timed out is a no-op."""

    __slots__ = ("_bus", "_envelope", "_group", "_settled", "_token")

    def __init__(self, bus: InProcessBus, group: _Group, token: int, envelope: Envelope) -> None:
        self._bus = bus
        self._group = group
        self._token = token
        self._envelope = envelope
        self._settled = False

    @property
    def envelope(self) -> Envelope:
        return self._envelope

    def _take(self) -> _Copy | None:
        if self._settled:
            raise BusError(f"delivery of {self._envelope.id} was already settled")
        self._settled = True
        entry = self._group.inflight.pop(self._token, None)
        return None if entry is None else entry[1]

    async def ack(self) -> None:
        self._take()

    async def retry(self, delay: float) -> None:
        copy = self._take()
        if copy is not None:
            self._bus._delay(self._group, copy, max(0.0, delay))

    async def dead_letter(self, error: str) -> None:
        copy = self._take()
        if copy is not None:
            self._bus._dead_letter(copy, error)


class InProcessBus:
    """At-least-once bus over in-memory queues (see the module docstring).

    Events published while no consumer group matches them wait in a backlog
    (bounded by ``max_backlog``: publishing into a full backlog raises rather
    than dropping) and go to the first group that matches them.
    """

    def __init__(
        self,
        *,
        ack_wait: float = 30.0,
        duplicate_rate: float = 0.0,
        max_copies: int = 3,
        reorder: bool = False,
        seed: int | None = None,
        max_backlog: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ack_wait <= 0:
            raise ValueError("ack_wait must be positive")
        if not 0.0 <= duplicate_rate <= 1.0:
            raise ValueError("duplicate_rate is a probability in [0, 1]")
        if max_copies < 2:
            raise ValueError("max_copies must be at least 2")
        self.ack_wait = ack_wait
        self.duplicate_rate = duplicate_rate
        self.max_copies = max_copies
        self.reorder = reorder
        self.max_backlog = max_backlog
        self.stats = BusStats()
        #: The most recent dead letters with their errors, for inspection.
        self.recent_dead_letters: deque[tuple[Envelope, str]] = deque(maxlen=1000)
        self._rng = random.Random(seed)
        self._clock = clock
        self._groups: dict[str, _Group] = {}
        self._backlog: deque[_Copy] = deque()
        self._tokens = itertools.count()
        self._closed = False

    # -- publishing ---------------------------------------------------------

    async def publish(self, envelope: Envelope) -> None:
        self._check_open()
        validate_subject(envelope.subject)
        if envelope.subject.split(".")[0] == DLQ_TOKEN:
            raise EnvelopeError(
                f"subject {envelope.subject!r}: '{DLQ_TOKEN}.' is reserved for dead letters"
            )
        envelope.to_bytes()  # the same validation the wire transport applies
        self.stats.published += 1
        copies = 1
        if self.duplicate_rate and self._rng.random() < self.duplicate_rate:
            copies = self._rng.randint(2, self.max_copies)
        for _ in range(copies):
            self._route(envelope.subject, envelope.with_attempt(1), backlog=True)

    async def publish_many(self, envelopes: Sequence[Envelope]) -> None:
        for envelope in envelopes:
            await self.publish(envelope)

    def _route(self, subject: str, envelope: Envelope, *, backlog: bool) -> None:
        matched = False
        for group in self._groups.values():
            if subject_matches(group.subject_filter, subject):
                matched = True
                group.ready.append(_Copy(subject, envelope))
                group.wake.set()
        if not matched and backlog:
            if len(self._backlog) >= self.max_backlog:
                raise BusError(
                    f"in-process backlog is full ({self.max_backlog} events and no consumer "
                    "group matches them); start a consumer or raise max_backlog"
                )
            self._backlog.append(_Copy(subject, envelope))

    # -- consuming ----------------------------------------------------------

    def _group(self, subject_filter: str, durable: str) -> _Group:
        validate_filter(subject_filter)
        validate_durable(durable)
        group = self._groups.get(durable)
        if group is None:
            group = _Group(durable, subject_filter)
            self._groups[durable] = group
            keep: deque[_Copy] = deque()
            for copy in self._backlog:
                (group.ready if subject_matches(subject_filter, copy.subject) else keep).append(
                    copy
                )
            self._backlog = keep
        elif group.subject_filter != subject_filter:
            raise EnvelopeError(
                f"durable consumer {durable!r} consumes {group.subject_filter!r}, "
                f"not {subject_filter!r}; use another durable name"
            )
        return group

    def _promote(self, group: _Group, now: float) -> None:
        """Move due retries and timed-out deliveries back to the ready queue."""
        while group.delayed and group.delayed[0][0] <= now:
            _, _, copy = heapq.heappop(group.delayed)
            group.ready.append(copy)
        expired = [t for t, (deadline, _) in group.inflight.items() if deadline <= now]
        for token in expired:
            _, copy = group.inflight.pop(token)
            self.stats.redelivered += 1
            group.ready.append(copy)

    def _next_timer(self, group: _Group, now: float) -> float:
        times = [d for d, _ in group.inflight.values()]
        if group.delayed:
            times.append(group.delayed[0][0])
        return max(0.0, min(times) - now) if times else float("inf")

    async def fetch(
        self,
        subject_filter: str,
        *,
        durable: str = DEFAULT_DURABLE,
        batch: int = 100,
        timeout: float = 1.0,
    ) -> list[Delivery]:
        if batch < 1:
            raise ValueError("batch must be at least 1")
        group = self._group(subject_filter, durable)
        deadline = self._clock() + max(0.0, timeout)
        while True:
            self._check_open()
            now = self._clock()
            self._promote(group, now)
            if group.ready:
                return self._hand_out(group, batch, now)
            remaining = deadline - now
            if remaining <= 0:
                return []
            group.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    group.wake.wait(), min(remaining, self._next_timer(group, now))
                )

    def _hand_out(self, group: _Group, batch: int, now: float) -> list[Delivery]:
        out: list[Delivery] = []
        while group.ready and len(out) < batch:
            if self.reorder and len(group.ready) > 1:
                index = self._rng.randrange(len(group.ready))
                copy = group.ready[index]
                del group.ready[index]
            else:
                copy = group.ready.popleft()
            copy.deliveries += 1
            self.stats.delivered += 1
            token = next(self._tokens)
            group.inflight[token] = (now + self.ack_wait, copy)
            out.append(
                InProcessDelivery(self, group, token, copy.envelope.with_attempt(copy.deliveries))
            )
        return out

    def _delay(self, group: _Group, copy: _Copy, delay: float) -> None:
        heapq.heappush(group.delayed, (self._clock() + delay, next(self._tokens), copy))
        group.wake.set()  # a waiting fetch recomputes its timer

    def _dead_letter(self, copy: _Copy, error: str) -> None:
        self.stats.dead_lettered += 1
        self.recent_dead_letters.append((copy.envelope, error))
        log.warning("dead letter %s on %s: %s", copy.envelope.id, copy.subject, error)
        if not self._closed:
            self._route(dlq_subject(copy.envelope.subject), copy.envelope.with_attempt(1),
                        backlog=False)

    async def pending(self, subject_filter: str, *, durable: str = DEFAULT_DURABLE) -> int:
        group = self._group(subject_filter, durable)
        self._promote(group, self._clock())
        return group.unsettled()

    # -- lifecycle ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BusClosed("the in-process bus is closed")

    async def close(self) -> None:
        self._closed = True
        for group in self._groups.values():
            group.wake.set()
