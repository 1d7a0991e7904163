"""The agent's reasoning traces (table ``reasoning``), in the order they were stored.

A trace is one JSON document with its time and correlation id; its id (assigned
by the database) is the order readers page by. A trace has no natural key: a
write retried after an uncertain commit may store one twice, never lose one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select

from mlwe.store import schema as S
from mlwe.store.db import Transactions
from mlwe.store.rows import Encoder, clip, insert

__all__ = ["Reasoning", "ReasoningEntry"]


@dataclass(frozen=True, slots=True)
class ReasoningEntry:
    id: int
    time: float
    correlation_id: str | None
    record: dict[str, Any]


class Reasoning:
    """Table ``reasoning``."""

    def __init__(self, tx: Transactions, encode: Encoder) -> None:
        self.tx = tx
        self.encode = encode

    def append_reasoning(
        self,
        record: Mapping[str, Any],
        *,
        time: float,
        correlation_id: str | None = None,
        conn: Connection | None = None,
    ) -> int:
        """Store one agent reasoning trace; returns its id."""
        row = {
            "time": time,
            "correlation_id": clip(correlation_id, 256),
            "record": self.encode(dict(record)),
        }

        def go(c: Connection) -> int:
            res = c.execute(insert(c, S.reasoning).returning(S.reasoning.c.id), row)
            return int(res.scalar_one())

        return self.tx.write(go, conn)

    def reasoning(
        self, correlation_id: str | None = None, *, after_id: int = 0, limit: int = 1000
    ) -> list[ReasoningEntry]:
        r = S.reasoning
        q = select(r.c.id, r.c.time, r.c.correlation_id, r.c.record).where(r.c.id > after_id)
        if correlation_id is not None:
            q = q.where(r.c.correlation_id == correlation_id)
        rows: Any = self.tx.read(lambda c: c.execute(q.order_by(r.c.id).limit(limit)).all())
        return [ReasoningEntry(i, t, cid, json.loads(rec)) for i, t, cid, rec in rows]

    def latest_reasoning(
        self, correlation_id: str | None = None, *, limit: int = 200
    ) -> list[ReasoningEntry]:
        """The last ``limit`` reasoning traces (of one correlation id if given), oldest first."""
        r = S.reasoning
        q = select(r.c.id, r.c.time, r.c.correlation_id, r.c.record)
        if correlation_id is not None:
            q = q.where(r.c.correlation_id == correlation_id)
        rows: Any = self.tx.read(lambda c: c.execute(q.order_by(r.c.id.desc()).limit(limit)).all())
        return [ReasoningEntry(i, t, cid, json.loads(rec)) for i, t, cid, rec in reversed(rows)]
