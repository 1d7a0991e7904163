"""The idempotent consumer: exactly-once effects over an at-least-once bus.

For each delivered envelope, one database transaction inserts the event id
into ``processed_events`` and runs the handler's effect on the *same*
connection; both commit or neither does. A copy whose id is already there is
a duplicate: acknowledged, no effect. A failing handler rolls back (no
processed row), and the copy is retried with exponential backoff and jitter;
after ``max_attempts`` it becomes a ``dead_letters`` row (error text,
attempts) and is acknowledged. An operator lists dead letters and replays
one: the original envelope, same id, so a later success is still
exactly-once.

Delivery is acknowledged only after the commit: a crash in between means a
redelivery, which the processed row turns into a duplicate.

The database work is synchronous SQLAlchemy run in a worker thread, one
batch of deliveries per hop, each delivery its own transaction.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine

from mlwe.bus.base import (
    DEFAULT_DURABLE,
    Backoff,
    Bus,
    BusClosed,
    Delivery,
    Envelope,
    EnvelopeError,
    validate_filter,
)
from mlwe.store.events import (
    DeadLetterRow,
    EventClaim,
    dead_letter_row,
    dead_letter_rows,
    mark_replayed,
    put_dead_letter,
)

log = logging.getLogger(__name__)

#: The effect of one event, written with the consumer's connection (same transaction).
Handler = Callable[[Envelope, Connection], None]

_ERROR_MAX = 4000


class Outcome(enum.Enum):
    PROCESSED = "processed"  # effect committed
    DUPLICATE = "duplicate"  # already processed: acknowledged, no effect
    RETRY = "retry"  # handler failed, will be delivered again
    DEAD_LETTERED = "dead_lettered"  # failed max_attempts times: recorded, acknowledged


@dataclass
class ConsumerMetrics:
    """Counters of what the consumer did, one increment per delivered copy."""

    processed: int = 0
    duplicates: int = 0
    retries: int = 0
    dead_lettered: int = 0
    transport_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "processed": self.processed,
            "duplicates": self.duplicates,
            "retries": self.retries,
            "dead_lettered": self.dead_lettered,
            "transport_errors": self.transport_errors,
        }


@dataclass(frozen=True)
class DeadLetter:
    """A recorded dead letter, as an operator sees it."""

    event_id: str
    time: float
    subject: str
    error: str
    attempts: int
    replayed: bool
    processed: bool  # a later copy or a replay has since been processed
    envelope: Envelope

    @property
    def payload(self) -> dict[str, Any]:
        return self.envelope.payload

    @property
    def correlation_id(self) -> str:
        return self.envelope.correlation_id


@dataclass(frozen=True)
class _Result:
    outcome: Outcome
    error: str | None = None


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _ERROR_MAX else text[: _ERROR_MAX - 3] + "..."


class IdempotentConsumer:
    """Apply each event's effect exactly once (see the module docstring).

    ``handler(envelope, connection)`` writes the effect with ``connection``;
    it must not commit, and should raise to signal failure. ``seed`` seeds
    the backoff jitter. ``concurrency`` splits each fetched batch over that
    many worker threads, each with its own connection: worth it on
    PostgreSQL, where concurrent commits share one flush to disk; keep 1 on
    SQLite, which has one writer at a time. The bus never promised order, so
    handlers must not depend on it either way.
    """

    def __init__(
        self,
        engine: Engine,
        handler: Handler,
        *,
        max_attempts: int = 5,
        backoff: Backoff | None = None,
        seed: int | None = None,
        clock: Callable[[], float] = time.time,
        concurrency: int = 1,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.concurrency = concurrency
        self.engine = engine
        self.handler = handler
        self.max_attempts = max_attempts
        self.backoff = backoff or Backoff()
        self.metrics = ConsumerMetrics()
        self._rng = random.Random(seed)
        self._clock = clock
        self._claim = EventClaim(engine)

    # -- the transaction ----------------------------------------------------

    def apply(self, envelope: Envelope) -> bool:
        """One transaction: claim the id, run the effect. False if already processed.

        The handler's exception propagates after the rollback. Synchronous:
        call it from a worker thread in async code. Does not touch metrics.
        """
        with self.engine.connect() as conn:
            return self._apply_on(conn, envelope)

    def _apply_on(self, conn: Connection, envelope: Envelope) -> bool:
        # One transaction per envelope, on a connection reused across a batch
        # (checking one out of the pool per message costs more than the insert).
        trans = conn.begin()
        try:
            if not self._claim(conn, envelope.id, self._clock()):
                trans.rollback()
                return False
            self.handler(envelope, conn)
            trans.commit()
            return True
        finally:
            if trans.is_active:
                trans.rollback()

    def _record_dead_letter(self, envelope: Envelope, error: str) -> None:
        # the whole envelope, so a replay keeps the correlation id and timestamp
        rec = DeadLetterRow(envelope.id, self._clock(), envelope.subject,
                            envelope.to_bytes().decode("utf-8"), error, envelope.attempt)
        with self.engine.begin() as conn:
            put_dead_letter(conn, rec)

    def _handle_batch(self, envelopes: Sequence[Envelope]) -> list[_Result]:
        try:
            conn = self.engine.connect()
        except Exception as exc:  # database unreachable: nothing applied, all retried
            log.warning("cannot reach the database: %s", _error_text(exc))
            return [_Result(Outcome.RETRY, _error_text(exc)) for _ in envelopes]
        with conn:
            return [self._handle_one(conn, envelope) for envelope in envelopes]

    def _handle_one(self, conn: Connection, envelope: Envelope) -> _Result:
        try:
            done = self._apply_on(conn, envelope)
        except Exception as exc:
            error = _error_text(exc)
            if envelope.attempt < self.max_attempts:
                log.info("event %s (attempt %d/%d) failed, will retry: %s",
                         envelope.id, envelope.attempt, self.max_attempts, error)
                return _Result(Outcome.RETRY, error)
            log.warning("event %s failed %d times, dead-lettering",
                        envelope.id, envelope.attempt, exc_info=exc)
            try:
                self._record_dead_letter(envelope, error)
            except Exception:
                # Could not record it (database down?): keep it on the bus instead,
                # so nothing is lost; the next attempt may well succeed.
                log.exception("event %s: cannot record the dead letter; will retry",
                              envelope.id)
                return _Result(Outcome.RETRY, error)
            return _Result(Outcome.DEAD_LETTERED, error)
        return _Result(Outcome.PROCESSED if done else Outcome.DUPLICATE)

    # -- the async side -----------------------------------------------------

    async def process(self, deliveries: Sequence[Delivery]) -> list[Outcome]:
        """Handle and settle a batch; returns each delivery's outcome.

        A settle that fails (bus connection lost) is logged, not raised: that
        copy stays unacknowledged and is delivered again later, where the
        processed row makes it a duplicate.
        """
        envelopes = [d.envelope for d in deliveries]
        workers = min(self.concurrency, len(envelopes))
        if workers <= 1:
            results = await asyncio.to_thread(self._handle_batch, envelopes)
        else:
            parts = await asyncio.gather(
                *(asyncio.to_thread(self._handle_batch, envelopes[i::workers])
                  for i in range(workers))
            )
            results = [_Result(Outcome.RETRY)] * len(envelopes)
            for i, part in enumerate(parts):
                results[i::workers] = part
        for delivery, result in zip(deliveries, results, strict=True):
            try:
                await self._settle(delivery, result)
            except BusClosed:
                raise
            except Exception:
                self.metrics.transport_errors += 1
                log.exception("event %s: settling (%s) failed; the bus will redeliver it",
                              delivery.envelope.id, result.outcome.value)
        return [r.outcome for r in results]

    async def _settle(self, delivery: Delivery, result: _Result) -> None:
        outcome = result.outcome
        if outcome is Outcome.PROCESSED:
            self.metrics.processed += 1
            await delivery.ack()
        elif outcome is Outcome.DUPLICATE:
            self.metrics.duplicates += 1
            await delivery.ack()
        elif outcome is Outcome.RETRY:
            self.metrics.retries += 1
            await delivery.retry(self.backoff.delay(delivery.envelope.attempt, self._rng))
        else:
            self.metrics.dead_lettered += 1
            await delivery.dead_letter(result.error or "error")

    async def run(
        self,
        bus: Bus,
        subject_filter: str,
        *,
        durable: str = DEFAULT_DURABLE,
        batch: int = 256,
        fetch_timeout: float = 0.5,
        stop: asyncio.Event | None = None,
        until_idle: bool = False,
    ) -> None:
        """Consume until ``stop`` is set, the bus closes, or (``until_idle``) nothing is left.

        "Nothing left" means no copy queued, in flight or awaiting a retry.
        Transport errors are logged and retried with backoff; bad arguments
        raise at once.
        """
        validate_filter(subject_filter)
        failures = 0
        while stop is None or not stop.is_set():
            try:
                deliveries = await bus.fetch(
                    subject_filter, durable=durable, batch=batch, timeout=fetch_timeout
                )
                if deliveries:
                    await self.process(deliveries)
                elif until_idle and await bus.pending(subject_filter, durable=durable) == 0:
                    return
                failures = 0
            except BusClosed:
                return
            except (EnvelopeError, ValueError, TypeError):
                raise
            except Exception:
                failures += 1
                self.metrics.transport_errors += 1
                log.warning("consuming %r failed (%d in a row); retrying", subject_filter,
                            failures, exc_info=True)
                await asyncio.sleep(self.backoff.delay(failures, self._rng))

    async def run_until_idle(
        self, bus: Bus, subject_filter: str, *, durable: str = DEFAULT_DURABLE, batch: int = 256
    ) -> None:
        """Consume everything there is, retries included, then return."""
        await self.run(bus, subject_filter, durable=durable, batch=batch, until_idle=True)


# -- operator actions ---------------------------------------------------------


def _envelope_of(row: Any) -> Envelope:
    try:
        return Envelope.from_bytes(row.payload)
    except EnvelopeError:
        # A row written by something else: the column holds just the payload.
        payload = json.loads(row.payload)
        return Envelope(
            id=row.event_id,
            subject=row.subject,
            payload=payload if isinstance(payload, dict) else {"value": payload},
            correlation_id=row.event_id,
            published_at=row.time,
        )


def dead_letters(engine: Engine, *, include_replayed: bool = True) -> list[DeadLetter]:
    """The recorded dead letters, oldest first."""
    with engine.connect() as conn:
        rows = dead_letter_rows(conn, include_replayed=include_replayed)
    return [
        DeadLetter(
            event_id=row.event_id,
            time=row.time,
            subject=row.subject,
            error=row.error,
            attempts=row.attempts,
            replayed=bool(row.replayed),
            processed=bool(row.processed),
            envelope=_envelope_of(row),
        )
        for row in rows
    ]


async def replay_dead_letter(engine: Engine, bus: Bus, event_id: str) -> Envelope:
    """Publish a dead letter's original envelope again (same id) and mark it replayed.

    Raises ``KeyError`` for an unknown id. Replaying an event that has since
    been processed is harmless: the consumer sees a duplicate.
    """
    def load() -> Any:
        with engine.connect() as conn:
            return dead_letter_row(conn, event_id)

    row = await asyncio.to_thread(load)
    if row is None:
        raise KeyError(f"no dead letter with event id {event_id!r}")
    envelope = _envelope_of(row)
    await bus.publish(envelope)

    def mark() -> None:
        with engine.begin() as conn:
            mark_replayed(conn, event_id)

    await asyncio.to_thread(mark)
    return envelope
