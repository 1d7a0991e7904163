"""Idempotency keys of API requests (table ``idempotency_keys``).

The first answer given to a key (request hash, status, response JSON) is kept in
the transaction that makes the request's effect durable; a repeat of the key is
answered from it. The API owns what a key means; this module owns its rows.
"""

from __future__ import annotations

from sqlalchemy import Connection, delete, select

from mlwe.store import schema as S
from mlwe.store.db import Transactions
from mlwe.store.rows import insert_ignore

__all__ = ["IdempotencyKeys"]


class IdempotencyKeys:
    """Table ``idempotency_keys``."""

    def __init__(self, tx: Transactions) -> None:
        self.tx = tx

    def idempotent_answer(self, key: str) -> tuple[str, int, str] | None:
        """The first answer ``(request hash, status, response JSON)`` given to ``key``."""
        k = S.idempotency_keys
        row = self.tx.read(lambda c: c.execute(
            select(k.c.request_hash, k.c.status, k.c.response).where(k.c.key == key)
        ).first())
        return None if row is None else (row[0], int(row[1]), row[2])

    def remember_answer(
        self, conn: Connection, key: str, request_hash: str, status: int, response: str,
        time: float,
    ) -> None:
        """Keep the answer to ``key`` (in the transaction that makes its effect durable)."""
        insert_ignore(conn, S.idempotency_keys, ["key"], [{
            "key": key, "request_hash": request_hash, "status": status, "response": response,
            "created": time,
        }])

    def prune_idempotency(self, older_than: float) -> int:
        k = S.idempotency_keys

        def go(c: Connection) -> int:
            return int(c.execute(delete(k).where(k.c.created < older_than)).rowcount or 0)

        return self.tx.write(go, None)
