"""Workflow rows (table ``workflows``): one row per workflow, its document as JSON.

The workflow runner (:mod:`mlwe.agent.workflows`) owns what a workflow is and how
it advances; this module owns how its rows are written (an upsert by id, inside the
caller's transaction, so a workflow is stored with the audit records of its tick)
and read back (oldest first; by status or by id).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Row, insert, select, update

from mlwe.store.schema import workflows

__all__ = ["save_workflows", "workflow_rows"]


def save_workflows(conn: Connection, rows: Iterable[Mapping[str, Any]]) -> None:
    """Write each row (``id``, ``kind``, ``correlation_id``, ``status``, ``step``,
    ``data`` as JSON text, ``created``, ``updated``): updated if its id exists, else inserted."""
    t = workflows
    for row in rows:
        if conn.execute(update(t).where(t.c.id == row["id"]).values(**row)).rowcount == 0:
            conn.execute(insert(t).values(**row))


def workflow_rows(
    conn: Connection, statuses: Sequence[str] | None = None, workflow_id: str | None = None
) -> Sequence[Row[Any]]:
    """The stored workflows (all, or those in ``statuses``, or the one ``workflow_id``),
    in creation order."""
    t = workflows
    q = select(t)
    if statuses is not None:
        q = q.where(t.c.status.in_(list(statuses)))
    if workflow_id is not None:
        q = q.where(t.c.id == workflow_id)
    return conn.execute(q.order_by(t.c.created, t.c.id)).all()
