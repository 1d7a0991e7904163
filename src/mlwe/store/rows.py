"""What every table module of the repository shares: the errors, canonical JSON, the
sanitizer default, and the dialect's insert-or-ignore and upsert.

JSON documents are stored as canonical text (sorted keys, no spaces), after the
credential sanitizer (``mlwe.store.sanitize.sanitize``) has run on them: a table
module is given the repository's :data:`Encoder` and writes every document through it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.dialects import postgresql, sqlite

__all__ = [
    "CHUNK",
    "CorruptRecord",
    "Encoder",
    "Sanitizer",
    "StoreError",
    "canonical_json",
    "clip",
    "default_sanitizer",
    "identity",
    "insert",
    "insert_ignore",
    "upsert",
]

Sanitizer = Callable[[Any], Any]
#: A JSON value to its stored text (sanitised, canonical).
Encoder = Callable[[Any], str]

#: Rows per statement when a list of ids goes into an ``IN (...)``.
CHUNK = 500


class StoreError(RuntimeError):
    """A store operation failed for a reason other than the database being unreachable."""


class CorruptRecord(StoreError):
    """A stored row cannot be turned back into the record it stands for."""

    def __init__(self, table: str, key: object, column: str, problem: str) -> None:
        self.table = table
        self.key = key
        self.column = column
        super().__init__(f"{table} {key!r}: column {column}: {_one_line(problem)}")


def _one_line(text: str) -> str:
    """A (pydantic) error message on one line, without its documentation links."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return "; ".join(ln for ln in lines if not ln.startswith("For further information"))


def canonical_json(value: Any) -> str:
    """The one text form of a JSON value: sorted keys, no spaces (stable across runs)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def identity(value: Any) -> Any:
    return value


def default_sanitizer() -> tuple[Sanitizer, bool]:
    """``mlwe.store.sanitize.sanitize`` when it is installed; else identity (and False)."""
    try:
        from mlwe.store.sanitize import sanitize
    except ModuleNotFoundError as exc:  # only a missing module, never a broken one
        if exc.name != "mlwe.store.sanitize":
            raise
        return identity, False
    return sanitize, True


def clip(value: str | None, n: int) -> str | None:
    return value if value is None or len(value) <= n else value[:n]


def insert(conn: Connection, table: Any) -> postgresql.Insert | sqlite.Insert:
    """An INSERT of ``conn``'s dialect (which has ``ON CONFLICT``)."""
    if conn.dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def insert_ignore(conn: Connection, table: Any, keys: list[str], rows: list[Any]) -> None:
    """Insert ``rows``; one whose ``keys`` are already stored is left as it is."""
    if rows:
        conn.execute(insert(conn, table).on_conflict_do_nothing(index_elements=keys), rows)


def upsert(conn: Connection, table: Any, keys: list[str], rows: list[dict[str, Any]]) -> None:
    """Insert ``rows``, replacing the other columns of one whose ``keys`` are stored."""
    if not rows:
        return
    ins = insert(conn, table)
    cols = [c for c in rows[0] if c not in keys]
    stmt = ins.on_conflict_do_update(
        index_elements=keys, set_={c: ins.excluded[c] for c in cols}
    )
    conn.execute(stmt, rows)
