"""The repository: every read and write of durable state, over one SQLAlchemy engine.

:class:`Repository` is the one interface the rest of mlwe uses; it delegates each
table's SQL to the module of its aggregate, all over one transaction helper
(:class:`mlwe.store.db.Transactions`):

- :mod:`mlwe.store.state`: workloads, their transitions, decisions
  (row forms in :mod:`mlwe.store.codec`);
- :mod:`mlwe.store.cluster`: nodes and queues;
- :mod:`mlwe.store.telemetry`: telemetry samples (append, query, downsample, prune);
- :mod:`mlwe.store.reasoning`: the agent's reasoning traces;
- :mod:`mlwe.store.snapshots`: snapshots and the meta table;
- :mod:`mlwe.store.quarantine`: records recovery could not read;
- :mod:`mlwe.store.idempotency`: API idempotency keys;
- :mod:`mlwe.store.events`: processed event ids (and dead letters).

All writes run in transactions. A method that writes takes an optional
``conn``: given one (from :meth:`Repository.transaction`), it writes inside
that transaction, so another module can store its own rows (a processed event
id, an audit record) atomically with the effect; without one, it opens its
own transaction and retries it on transient errors (see ``db.with_retry``).

Writes of state are idempotent, so a transaction retried after a commit whose
outcome was unknown stores nothing twice: workloads are keyed by id,
transitions by (workload, step), decisions by sequence number, nodes, queues,
snapshots and meta by their keys. Telemetry and reasoning rows have no natural
key; a retry may duplicate one, never lose one.

JSON documents are stored as canonical text (sorted keys, no spaces), after
the credential sanitizer (``mlwe.store.sanitize.sanitize``) has run on them.

The names other modules import from here (records, errors, row forms) live in
the aggregate modules and :mod:`mlwe.store.rows`; they are re-exported unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine

from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.decisions import DecisionRecord
from mlwe.core.lifecycle import State, Transition
from mlwe.core.model import Workload
from mlwe.core.spec import NodeSpec, NodeStatus, QueueSpec
from mlwe.store import db, events
from mlwe.store.cluster import Cluster
from mlwe.store.codec import (
    SpecReader,
    decision_from_row,
    mutable_values,
    placement_from_json,
    placement_to_json,
    transition_row,
)
from mlwe.store.idempotency import IdempotencyKeys
from mlwe.store.quarantine import Quarantine
from mlwe.store.reasoning import Reasoning, ReasoningEntry
from mlwe.store.rows import (
    CorruptRecord,
    Sanitizer,
    StoreError,
    canonical_json,
    default_sanitizer,
    identity,
)
from mlwe.store.snapshots import Snapshot, Snapshots
from mlwe.store.state import Decisions, Workloads
from mlwe.store.telemetry import Telemetry, TelemetrySample

__all__ = [
    "CorruptRecord",
    "ReasoningEntry",
    "Repository",
    "Sanitizer",
    "Snapshot",
    "SpecReader",
    "StoreError",
    "TelemetrySample",
    "canonical_json",
    "decision_from_row",
    "default_sanitizer",
    "mutable_values",
    "placement_from_json",
    "placement_to_json",
    "transition_row",
]

T = TypeVar("T")


class Repository:
    """Durable state over one engine (SQLite or PostgreSQL)."""

    def __init__(
        self,
        engine: Engine,
        *,
        catalog: GpuCatalog = DEFAULT_CATALOG,
        sanitize: Sanitizer | None = None,
        health: db.Health | None = None,
        retry_attempts: int = 5,
        retry_base_delay: float = 0.05,
    ) -> None:
        self.engine = engine
        self.catalog = catalog
        if sanitize is None:
            sanitize, self.sanitizing = default_sanitizer()
        else:
            self.sanitizing = sanitize is not identity
        self._sanitize = sanitize
        self.tx = db.Transactions(
            engine, health=health, attempts=retry_attempts, base_delay=retry_base_delay
        )
        self.dialect = engine.dialect.name
        if self.dialect not in ("sqlite", "postgresql"):
            raise StoreError(f"unsupported database dialect {self.dialect!r}")
        self._claim = events.EventClaim(engine)
        self._ctx = {"catalog": catalog}
        tx, encode = self.tx, self._json
        self._workloads = Workloads(tx, encode, self._ctx)
        self._decisions = Decisions(tx, encode)
        self._cluster = Cluster(tx, encode, self._ctx)
        self._quarantine = Quarantine(tx)
        self._idempotency = IdempotencyKeys(tx)
        self._reasoning = Reasoning(tx, encode)
        self._telemetry = Telemetry(tx, encode)
        self._snapshots = Snapshots(tx, encode)

    @classmethod
    def open(
        cls,
        url: str | None = None,
        data_dir: str | Path | None = None,
        *,
        upgrade: bool = False,
        **kwargs: Any,
    ) -> Repository:
        """Connect to the configured database; migrate it (``upgrade``) or check its schema."""
        engine = db.make_engine(db.database_url(data_dir, url))
        try:
            if upgrade:
                db.migrate(engine)
            db.check_schema(engine)
        except BaseException:
            engine.dispose()
            raise
        return cls(engine, **kwargs)

    def close(self) -> None:
        self.engine.dispose()

    def health(self) -> dict[str, Any]:
        return self.health_state.report().to_dict()

    # the retry settings live in the transaction helper; these read and set them there
    @property
    def health_state(self) -> db.Health:
        return self.tx.health

    @health_state.setter
    def health_state(self, value: db.Health) -> None:
        self.tx.health = value

    @property
    def retry_attempts(self) -> int:
        return self.tx.attempts

    @retry_attempts.setter
    def retry_attempts(self, value: int) -> None:
        self.tx.attempts = value

    @property
    def retry_base_delay(self) -> float:
        return self.tx.base_delay

    @retry_base_delay.setter
    def retry_base_delay(self, value: float) -> None:
        self.tx.base_delay = value

    def _json(self, value: Any) -> str:
        return canonical_json(self._sanitize(value))

    # ------------------------------------------------------------ transactions
    def transaction(self) -> AbstractContextManager[Connection]:
        """A write transaction (``BEGIN IMMEDIATE`` on SQLite), committed when the block ends.

        Pass the connection to the repository's write methods (``conn=``) to
        make them part of it. Not retried: the caller owns the whole unit.
        """
        return self.tx.transaction()

    def write(self, fn: Callable[[Connection], T]) -> T:
        """``fn(conn)`` in one write transaction, re-run whole on transient errors.

        ``fn`` must be safe to run again from the start (the repository's own
        writes are: they are idempotent).
        """
        return self.tx.write(fn)

    def read(self, fn: Callable[[Connection], T]) -> T:
        """``fn(conn)`` on a connection of its own, re-run on transient errors."""
        return self.tx.read(fn)

    # ================================================================ cluster
    def save_cluster(
        self,
        nodes: Sequence[NodeSpec],
        queues: Sequence[QueueSpec],
        *,
        conn: Connection | None = None,
    ) -> None:
        """Store the cluster's nodes (in this order) and queues, replacing same-named ones."""
        self._cluster.save_cluster(nodes, queues, conn=conn)

    def upsert_node(
        self,
        spec: NodeSpec,
        status: NodeStatus | str | None = None,
        *,
        position: int | None = None,
        conn: Connection | None = None,
    ) -> None:
        """Store one node; a new node goes after the others unless ``position`` is given."""
        self._cluster.upsert_node(spec, status, position=position, conn=conn)

    def set_node_status(
        self, name: str, status: NodeStatus | str, *, conn: Connection | None = None
    ) -> None:
        self._cluster.set_node_status(name, status, conn=conn)

    def put_queue(self, spec: QueueSpec, *, conn: Connection | None = None) -> None:
        self._cluster.put_queue(spec, conn=conn)

    def load_nodes(
        self,
        catalog: GpuCatalog | None = None,
        corrupt: list[tuple[CorruptRecord, dict[str, Any]]] | None = None,
    ) -> list[tuple[NodeSpec, NodeStatus]]:
        """Stored nodes in the order they were added, each with its current status
        (``corrupt``: unreadable ones are left out and noted there, as in
        :meth:`load_workloads`)."""
        return self._cluster.load_nodes(catalog, corrupt)

    def load_queues(
        self,
        catalog: GpuCatalog | None = None,
        corrupt: list[tuple[CorruptRecord, dict[str, Any]]] | None = None,
    ) -> list[QueueSpec]:
        return self._cluster.load_queues(catalog, corrupt)

    # ============================================================= quarantine
    def quarantine(
        self, records: Sequence[tuple[str, str, str, dict[str, Any]]], time: float,
        *, conn: Connection | None = None,
    ) -> list[int]:
        """Move unreadable records ``(table, key, problem, raw)`` out of the way, whole:
        into the quarantine table, out of the table recovery reads (one transaction)."""
        return self._quarantine.quarantine(records, time, conn=conn)

    def quarantined(self) -> list[dict[str, Any]]:
        """Every quarantined record, oldest first."""
        return self._quarantine.quarantined()

    def drop_quarantined(self, qid: int, *, conn: Connection | None = None) -> bool:
        """Forget a quarantined record for good; False if there is none with that id."""
        return self._quarantine.drop_quarantined(qid, conn=conn)

    # ============================================================ idempotency
    def idempotent_answer(self, key: str) -> tuple[str, int, str] | None:
        """The first answer ``(request hash, status, response JSON)`` given to ``key``."""
        return self._idempotency.idempotent_answer(key)

    def remember_answer(
        self, conn: Connection, key: str, request_hash: str, status: int, response: str,
        time: float,
    ) -> None:
        """Keep the answer to ``key`` (in the transaction that makes its effect durable)."""
        self._idempotency.remember_answer(conn, key, request_hash, status, response, time)

    def prune_idempotency(self, older_than: float) -> int:
        return self._idempotency.prune_idempotency(older_than)

    # ============================================================== workloads
    def insert_workloads(
        self,
        workloads: Sequence[Workload],
        correlation_id: str | None = None,
        *,
        version: int = 0,
        with_history: bool = True,
        conn: Connection | None = None,
    ) -> None:
        """Store new workloads with their history, in one transaction (the durable half
        of a submission: acknowledge only after it returns); a stored id is left as it is."""
        self._workloads.insert_workloads(
            workloads, correlation_id, version=version, with_history=with_history, conn=conn
        )

    def update_specs(
        self, workloads: Sequence[Workload], *, conn: Connection | None = None
    ) -> None:
        """Rewrite the stored spec of workloads whose request changed (``SetResources``)."""
        self._workloads.update_specs(workloads, conn=conn)

    def save_workload_states(
        self, workloads: Sequence[Workload], version: int, *, conn: Connection | None = None
    ) -> None:
        """Update the mutable columns (state, placement, counters...) of stored workloads;
        one not stored yet is inserted whole (without history)."""
        self._workloads.save_workload_states(workloads, version, conn=conn)

    def append_transitions(
        self,
        rows: Iterable[tuple[str, Transition] | tuple[str, int, Transition]],
        *,
        conn: Connection | None = None,
    ) -> None:
        """Append lifecycle transitions, each ``(workload_id, step, transition)`` or
        ``(workload_id, transition)``: see :meth:`.state.Workloads.append_transitions`."""
        self._workloads.append_transitions(rows, conn=conn)

    def load_workloads(
        self,
        *,
        states: Iterable[State] | None = None,
        catalog: GpuCatalog | None = None,
        corrupt: list[tuple[CorruptRecord, dict[str, Any]]] | None = None,
    ) -> list[Workload]:
        """Every stored workload (or those in ``states``), complete, in arrival order.

        Raises :class:`CorruptRecord` for the first row that cannot be read back,
        unless ``corrupt`` is given: then such rows are left out and noted there
        with their raw record, for quarantine.
        """
        return self._workloads.load_workloads(states=states, catalog=catalog, corrupt=corrupt)

    def workload(self, workload_id: str) -> Workload | None:
        """One stored workload with its history, or None."""
        return self._workloads.workload(workload_id)

    def history(self, workload_id: str) -> list[Transition]:
        return self._workloads.history(workload_id)

    def workload_correlation(self, workload_id: str) -> str | None:
        return self._workloads.workload_correlation(workload_id)

    def count_workloads(self) -> int:
        return self._workloads.count_workloads()

    def max_version(self) -> int:
        """The newest control-plane version stored (meta, workload rows or snapshots)."""
        return self._snapshots.max_version()

    # ============================================================== decisions
    def append_decisions(
        self, records: Iterable[DecisionRecord], *, conn: Connection | None = None
    ) -> None:
        """Store decision records (keyed by their sequence number; a repeat is ignored)."""
        self._decisions.append_decisions(records, conn=conn)

    def decisions_for(
        self, workload: str | None = None, cause_id: str | None = None, *, limit: int | None = None
    ) -> list[DecisionRecord]:
        """Decision records about ``workload`` and/or caused by ``cause_id``, oldest first."""
        return self._decisions.decisions_for(workload, cause_id, limit=limit)

    def max_decision_seq(self) -> int:
        return self._decisions.max_decision_seq()

    # ============================================================== reasoning
    def append_reasoning(
        self,
        record: Mapping[str, Any],
        *,
        time: float,
        correlation_id: str | None = None,
        conn: Connection | None = None,
    ) -> int:
        """Store one agent reasoning trace; returns its id."""
        return self._reasoning.append_reasoning(
            record, time=time, correlation_id=correlation_id, conn=conn
        )

    def reasoning(
        self, correlation_id: str | None = None, *, after_id: int = 0, limit: int = 1000
    ) -> list[ReasoningEntry]:
        return self._reasoning.reasoning(correlation_id, after_id=after_id, limit=limit)

    def latest_reasoning(
        self, correlation_id: str | None = None, *, limit: int = 200
    ) -> list[ReasoningEntry]:
        """The last ``limit`` reasoning traces (of one correlation id if given), oldest first."""
        return self._reasoning.latest_reasoning(correlation_id, limit=limit)

    # ============================================================== telemetry
    def append_telemetry(
        self,
        samples: Iterable[TelemetrySample],
        resolution_s: int = 1,
        *,
        conn: Connection | None = None,
    ) -> int:
        """Store raw telemetry samples at ``resolution_s``; returns how many."""
        return self._telemetry.append_telemetry(samples, resolution_s, conn=conn)

    def telemetry(
        self,
        *,
        node: str | None = None,
        workload: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = None,
    ) -> list[TelemetrySample]:
        return self._telemetry.telemetry(
            node=node, workload=workload, since=since, until=until, limit=limit
        )

    def downsample_telemetry(
        self, older_than: float, to_resolution_s: int, *, conn: Connection | None = None
    ) -> tuple[int, int]:
        """Replace samples older than ``older_than`` (and finer than ``to_resolution_s``) by
        one per node, workload and bucket; returns (samples removed, samples written)."""
        return self._telemetry.downsample_telemetry(older_than, to_resolution_s, conn=conn)

    def prune_telemetry(
        self, retention_s: float, now: float, *, conn: Connection | None = None
    ) -> int:
        """Delete samples older than ``now - retention_s``; returns how many."""
        return self._telemetry.prune_telemetry(retention_s, now, conn=conn)

    # ============================================================== snapshots
    def save_snapshot(
        self,
        version: int,
        time: float,
        state_json: str | Mapping[str, Any],
        *,
        conn: Connection | None = None,
    ) -> None:
        self._snapshots.save_snapshot(version, time, state_json, conn=conn)

    def latest_snapshot(self) -> Snapshot | None:
        return self._snapshots.latest_snapshot()

    # =================================================================== meta
    def meta_get(self, key: str, default: str | None = None) -> str | None:
        return self._snapshots.meta_get(key, default)

    def meta_set(self, key: str, value: str, *, conn: Connection | None = None) -> None:
        self._snapshots.meta_set(key, value, conn=conn)

    # ======================================================= processed events
    def mark_processed(self, conn: Connection, event_id: str, at: float) -> bool:
        """Record ``event_id`` as processed inside ``conn``'s transaction
        (:class:`mlwe.store.events.EventClaim`).

        False when it already was: the caller then skips the effect (and the
        transaction writes nothing new).
        """
        return self._claim(conn, event_id, at)

    def is_processed(self, event_id: str) -> bool:
        return self.tx.read(lambda c: events.is_processed(c, event_id))
