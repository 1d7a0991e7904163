"""Quarantined records (table ``quarantine``): stored rows recovery could not read.

:meth:`Quarantine.quarantine` moves each such record out of the way whole, in one
transaction: its raw form (JSON) into ``quarantine``, its rows out of the tables
recovery reads (a workload with its transitions, a node, a queue).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, delete, select

from mlwe.store import schema as S
from mlwe.store.db import Transactions

__all__ = ["Quarantine"]


class Quarantine:
    """Table ``quarantine``."""

    def __init__(self, tx: Transactions) -> None:
        self.tx = tx

    def quarantine(
        self, records: Sequence[tuple[str, str, str, dict[str, Any]]], time: float,
        *, conn: Connection | None = None,
    ) -> list[int]:
        """Move unreadable records ``(table, key, problem, raw)`` out of the way, whole:
        into the quarantine table, out of the table recovery reads (one transaction)."""
        if not records:
            return []
        ids: list[int] = []

        def go(c: Connection) -> None:
            ids.clear()
            for table, key, problem, raw in records:
                res = c.execute(S.quarantine.insert().values(
                    record_table=table, record_key=str(key)[:256], problem=problem[:4000],
                    record=json.dumps(raw, sort_keys=True, default=str), quarantined_at=time,
                ))
                ids.append(int(res.inserted_primary_key[0]))  # type: ignore[index]
                if table == "workload":
                    c.execute(delete(S.transitions).where(S.transitions.c.workload_id == key))
                    c.execute(delete(S.workloads).where(S.workloads.c.id == key))
                elif table == "node":
                    c.execute(delete(S.nodes).where(S.nodes.c.name == key))
                elif table == "queue":
                    c.execute(delete(S.queues).where(S.queues.c.name == key))

        self.tx.write(go, conn)
        return list(ids)

    def quarantined(self) -> list[dict[str, Any]]:
        """Every quarantined record, oldest first."""
        q = S.quarantine
        rows = self.tx.read(lambda c: c.execute(select(
            q.c.id, q.c.record_table, q.c.record_key, q.c.problem, q.c.record, q.c.quarantined_at
        ).order_by(q.c.id)).all())
        return [
            {"id": i, "table": t, "key": k, "problem": p, "record": json.loads(str(r)),
             "quarantined_at": at}
            for i, t, k, p, r, at in rows
        ]

    def drop_quarantined(self, qid: int, *, conn: Connection | None = None) -> bool:
        """Forget a quarantined record for good; False if there is none with that id."""
        def go(c: Connection) -> bool:
            return bool(c.execute(delete(S.quarantine).where(S.quarantine.c.id == qid)).rowcount)

        return self.tx.write(go, conn)
