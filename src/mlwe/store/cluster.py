"""The cluster's nodes and queues (tables ``nodes`` and ``queues``).

A node row holds its spec (JSON), its current status and its position (nodes
are read back in the order they were added); a queue row its spec. Writes are
upserts by name, so a retried transaction stores nothing twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, func, select, update

from mlwe.core.catalog import GpuCatalog
from mlwe.core.spec import NodeSpec, NodeStatus, QueueSpec
from mlwe.store import schema as S
from mlwe.store.db import Transactions
from mlwe.store.rows import CorruptRecord, Encoder, StoreError, upsert

__all__ = ["Cluster"]


class Cluster:
    """Tables ``nodes`` and ``queues`` (``context``: how stored specs are validated)."""

    def __init__(self, tx: Transactions, encode: Encoder, context: dict[str, Any]) -> None:
        self.tx = tx
        self.encode = encode
        self.ctx = context

    def _node_row(self, spec: NodeSpec, status: NodeStatus | str, position: int) -> dict[str, Any]:
        return {
            "name": spec.name,
            "spec": self.encode(spec.model_dump(mode="json")),
            "status": NodeStatus(status).value,
            "position": position,
        }

    def save_cluster(
        self,
        nodes: Sequence[NodeSpec],
        queues: Sequence[QueueSpec],
        *,
        conn: Connection | None = None,
    ) -> None:
        """Store the cluster's nodes (in this order) and queues, replacing same-named ones."""

        def go(c: Connection) -> None:
            upsert(
                c, S.nodes, ["name"], [self._node_row(n, n.status, i) for i, n in enumerate(nodes)]
            )
            upsert(c, S.queues, ["name"], [self._queue_row(q) for q in queues])

        self.tx.write(go, conn)

    def upsert_node(
        self,
        spec: NodeSpec,
        status: NodeStatus | str | None = None,
        *,
        position: int | None = None,
        conn: Connection | None = None,
    ) -> None:
        """Store one node; a new node goes after the others unless ``position`` is given."""

        def go(c: Connection) -> None:
            pos = position
            if pos is None:
                pos = c.execute(
                    select(S.nodes.c.position).where(S.nodes.c.name == spec.name)
                ).scalar()
            if pos is None:
                top = c.execute(select(func.max(S.nodes.c.position))).scalar()
                pos = 0 if top is None else int(top) + 1
            upsert(c, S.nodes, ["name"], [self._node_row(spec, status or spec.status, pos)])

        self.tx.write(go, conn)

    def set_node_status(
        self, name: str, status: NodeStatus | str, *, conn: Connection | None = None
    ) -> None:
        def go(c: Connection) -> None:
            res = c.execute(
                update(S.nodes)
                .where(S.nodes.c.name == name)
                .values(status=NodeStatus(status).value)
            )
            if res.rowcount == 0:
                raise StoreError(f"cannot set the status of node {name!r}: it is not stored")

        self.tx.write(go, conn)

    def _queue_row(self, spec: QueueSpec) -> dict[str, Any]:
        return {"name": spec.name, "spec": self.encode(spec.model_dump(mode="json"))}

    def put_queue(self, spec: QueueSpec, *, conn: Connection | None = None) -> None:
        self.tx.write(lambda c: upsert(c, S.queues, ["name"], [self._queue_row(spec)]), conn)

    def load_nodes(
        self,
        catalog: GpuCatalog | None = None,
        corrupt: list[tuple[CorruptRecord, dict[str, Any]]] | None = None,
    ) -> list[tuple[NodeSpec, NodeStatus]]:
        """Stored nodes in the order they were added, each with its current status
        (``corrupt``: unreadable ones are left out and noted there, as in
        :meth:`mlwe.store.state.Workloads.load_workloads`)."""
        ctx = self.ctx if catalog is None else {"catalog": catalog}
        rows: Any = self.tx.read(
            lambda c: c.execute(
                select(S.nodes.c.name, S.nodes.c.spec, S.nodes.c.status).order_by(
                    S.nodes.c.position, S.nodes.c.name
                )
            ).all()
        )
        out = []
        for name, text, status in rows:
            try:
                try:
                    spec = NodeSpec.model_validate_json(text, context=ctx)
                except ValueError as exc:
                    raise CorruptRecord("node", name, "spec", str(exc)) from exc
                try:
                    st = NodeStatus(status)
                except ValueError as exc:
                    raise CorruptRecord(
                        "node", name, "status", f"unknown status {status!r}"
                    ) from exc
            except CorruptRecord as exc:
                if corrupt is None:
                    raise
                corrupt.append((exc, {"row": {"name": name, "spec": text, "status": status}}))
                continue
            out.append((spec, st))
        return out

    def load_queues(
        self,
        catalog: GpuCatalog | None = None,
        corrupt: list[tuple[CorruptRecord, dict[str, Any]]] | None = None,
    ) -> list[QueueSpec]:
        ctx = self.ctx if catalog is None else {"catalog": catalog}
        rows: Any = self.tx.read(
            lambda c: c.execute(
                select(S.queues.c.name, S.queues.c.spec).order_by(S.queues.c.name)
            ).all()
        )
        out = []
        for name, text in rows:
            try:
                out.append(QueueSpec.model_validate_json(text, context=ctx))
            except ValueError as exc:
                if corrupt is None:
                    raise CorruptRecord("queue", name, "spec", str(exc)) from exc
                corrupt.append((CorruptRecord("queue", name, "spec", str(exc)),
                                {"row": {"name": name, "spec": text}}))
        return out
