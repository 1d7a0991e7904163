"""The event tables: ``processed_events`` (the idempotency claim) and ``dead_letters``.

One claim and one dead-letter writer for every caller: the bus's idempotent consumer,
the engine's ingress (``Engine.ingest``) and the workflows that give up.

- :class:`EventClaim` records an event id as processed inside the caller's
  transaction and says whether it was new. A duplicate never aborts the
  transaction (``ON CONFLICT DO NOTHING ... RETURNING`` where the dialect has it,
  a savepoint elsewhere), so the caller simply skips its effect.
- :func:`put_dead_letter` writes a dead letter by event id: a second one for the
  same id (an event dead-lettered again after a replay) replaces the first and is
  not replayed yet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, Insert, Row, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError

from mlwe.store.schema import dead_letters, processed_events

__all__ = [
    "DeadLetterRow",
    "EventClaim",
    "dead_letter_row",
    "dead_letter_rows",
    "is_processed",
    "mark_replayed",
    "put_dead_letter",
]


class EventClaim:
    """``claim(conn, event_id, at)``: record ``event_id`` as processed in ``conn``'s
    transaction; True when it is new (do the effect), False when it already was."""

    def __init__(self, engine: Engine) -> None:
        dialect = engine.dialect
        self.returning = bool(dialect.insert_returning) and dialect.name in ("sqlite", "postgresql")
        if self.returning:
            upsert = sqlite.insert if dialect.name == "sqlite" else postgresql.insert
            # RETURNING, not rowcount: psycopg reports -1 for an INSERT ... ON CONFLICT
            self.stmt: Insert = (
                upsert(processed_events)
                .on_conflict_do_nothing(index_elements=["event_id"])
                .returning(processed_events.c.event_id)
            )
        else:
            self.stmt = insert(processed_events)

    def __call__(self, conn: Connection, event_id: str, at: float) -> bool:
        row = {"event_id": event_id, "processed_at": at}
        if self.returning:
            return conn.execute(self.stmt, row).first() is not None
        try:
            with conn.begin_nested():  # a duplicate rolls back to here, not the whole transaction
                conn.execute(self.stmt, row)
        except IntegrityError:
            return False
        return True


def is_processed(conn: Connection, event_id: str) -> bool:
    got = conn.execute(
        select(processed_events.c.event_id).where(processed_events.c.event_id == event_id)
    ).first()
    return got is not None


@dataclass(frozen=True, slots=True)
class DeadLetterRow:
    event_id: str
    time: float
    subject: str
    #: the whole envelope as JSON, so a replay keeps its id, correlation id and timestamp
    payload: str
    error: str
    attempts: int


def put_dead_letter(conn: Connection, rec: DeadLetterRow) -> None:
    """Write (or replace) the dead letter of ``rec.event_id``; it is not replayed yet."""
    values: Mapping[str, Any] = {
        "time": rec.time,
        "subject": rec.subject,
        "payload": rec.payload,
        "error": rec.error,
        "attempts": rec.attempts,
        "replayed": False,
    }
    t = dead_letters
    # select-then-write is portable; a concurrent writer of the same id makes this raise
    # IntegrityError, and the caller's transaction is retried whole
    if conn.execute(select(t.c.event_id).where(t.c.event_id == rec.event_id)).first() is None:
        conn.execute(insert(t).values(event_id=rec.event_id, **values))
    else:
        conn.execute(update(t).where(t.c.event_id == rec.event_id).values(**values))


def dead_letter_rows(conn: Connection, *, include_replayed: bool = True) -> Sequence[Row[Any]]:
    """Every dead letter, oldest first, each with ``processed``: its event was applied since."""
    t, pe = dead_letters, processed_events
    stmt = (
        select(t, pe.c.event_id.is_not(None).label("processed"))
        .select_from(t.outerjoin(pe, pe.c.event_id == t.c.event_id))
        .order_by(t.c.time, t.c.event_id)
    )
    if not include_replayed:
        stmt = stmt.where(t.c.replayed.is_(False))
    return conn.execute(stmt).all()


def dead_letter_row(conn: Connection, event_id: str) -> Row[Any] | None:
    return conn.execute(select(dead_letters).where(dead_letters.c.event_id == event_id)).first()


def mark_replayed(conn: Connection, event_id: str) -> None:
    conn.execute(
        update(dead_letters).where(dead_letters.c.event_id == event_id).values(replayed=True)
    )
