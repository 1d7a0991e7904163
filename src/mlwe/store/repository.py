"""The repository: every read and write of durable state, over one SQLAlchemy engine.

All writes run in transactions. A method that writes takes an optional
``conn``: given one (from :meth:`Repository.transaction`), it writes inside
that transaction, so another module can store its own rows (a processed event
id, an audit record) atomically with the effect; without one, it opens its
own transaction and retries it on transient errors (``db.Transactions``, the one
transaction helper, over ``db.with_retry``).

Writes of state are idempotent, so a transaction retried after a commit whose
outcome was unknown stores nothing twice: workloads are keyed by id,
transitions by (workload, step), decisions by sequence number, nodes, queues,
snapshots and meta by their keys. Telemetry and reasoning rows have no natural
key; a retry may duplicate one, never lose one.

JSON documents are stored as canonical text (sorted keys, no spaces), after
the credential sanitizer (``mlwe.store.sanitize.sanitize``) has run on them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, bindparam, delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import Insert

from mlwe.core.capacity import ReplicaAlloc
from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.decisions import DecisionRecord
from mlwe.core.lifecycle import State, Transition
from mlwe.core.model import Workload
from mlwe.core.resources import Resources
from mlwe.core.spec import NodeSpec, NodeStatus, QueueSpec, WorkloadSpec
from mlwe.store import db, events
from mlwe.store import schema as S

T = TypeVar("T")
Sanitizer = Callable[[Any], Any]

#: Rows per statement when a list of ids goes into an ``IN (...)``.
_CHUNK = 500


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


def _identity(value: Any) -> Any:
    return value


def default_sanitizer() -> tuple[Sanitizer, bool]:
    """``mlwe.store.sanitize.sanitize`` when it is installed; else identity (and False)."""
    try:
        from mlwe.store.sanitize import sanitize
    except ModuleNotFoundError as exc:  # only a missing module, never a broken one
        if exc.name != "mlwe.store.sanitize":
            raise
        return _identity, False
    return sanitize, True


# ====================================================================== records
@dataclass(frozen=True, slots=True)
class TelemetrySample:
    time: float
    node: str
    metrics: Mapping[str, Any]
    workload: str | None = None
    resolution_s: int = 0  # filled in when read back


@dataclass(frozen=True, slots=True)
class ReasoningEntry:
    id: int
    time: float
    correlation_id: str | None
    record: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: int
    time: float
    state: str  # JSON text


# ================================================================ conversions
def placement_to_json(placement: Sequence[ReplicaAlloc]) -> str:
    if not placement:
        return "[]"
    return canonical_json(
        [
            {
                "node": a.node,
                "devices": list(a.devices),
                "gpu_per_device": a.gpu_per_device,
                "res": {"gpu": a.res.gpu, "vram": a.res.vram, "cpu": a.res.cpu, "ram": a.res.ram},
            }
            for a in placement
        ]
    )


def _int(v: object, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{what} is {v!r}, not an integer")
    return v


def placement_from_json(text: str) -> tuple[ReplicaAlloc, ...]:
    if text == "[]":
        return ()
    items = json.loads(text)
    if not isinstance(items, list):
        raise ValueError("placement is not a JSON list")
    out = []
    for k, it in enumerate(items):
        if not isinstance(it, dict) or not isinstance(it.get("node"), str):
            raise ValueError(f"replica {k}: not an allocation object with a node")
        res = it.get("res")
        if not isinstance(res, dict):
            raise ValueError(f"replica {k}: no resource vector")
        devices = it.get("devices")
        if not isinstance(devices, list):
            raise ValueError(f"replica {k}: devices is not a list")
        out.append(
            ReplicaAlloc(
                node=it["node"],
                devices=tuple(_int(d, f"replica {k} device") for d in devices),
                gpu_per_device=_int(it.get("gpu_per_device"), f"replica {k} gpu_per_device"),
                res=Resources(
                    *(_int(res.get(n), f"replica {k} {n}") for n in ("gpu", "vram", "cpu", "ram"))
                ),
            )
        )
    return tuple(out)


def _victims_to_json(victims: Sequence[str]) -> str:
    return canonical_json(list(victims)) if victims else "[]"


def _victims_from_json(text: str) -> tuple[str, ...]:
    if text == "[]":
        return ()
    v = json.loads(text)
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("victims is not a JSON list of workload ids")
    return tuple(v)


def decision_from_row(seq: int, time: float, text: str) -> DecisionRecord:
    d = json.loads(text)
    return DecisionRecord(
        kind=d["kind"],
        workload=d["workload"],
        policy=d["policy"],
        chosen=d["chosen"],
        reasons=tuple(d.get("reasons", ())),
        candidates=tuple(d.get("candidates", ())),
        inputs_digest=d.get("inputs_digest", ""),
        cause_id=d.get("cause_id"),
        time=time,
        version=d.get("version", 0),
        seq=seq,
        extra=d.get("extra", {}),
    )


def _clip(value: str | None, n: int) -> str | None:
    return value if value is None or len(value) <= n else value[:n]


# Mutable columns of a workload row (everything but the identity and the spec).
_MUTABLE = (
    "state",
    "attempt",
    "failures",
    "work_done",
    "progress",
    "priority_override",
    "placement",
    "started_at",
    "failure_cause",
    "updated_version",
    "run_base_work",
    "last_checkpoint_at",
    "preempted_by",
    "victims",
    "preemptions",
    "borrowing",
    "pending_reason",
    "exit_code",
)


def mutable_values(w: Workload, version: int) -> dict[str, Any]:
    """The columns of a workload row that change as it goes through its lifecycle."""
    return {
        "state": w.state.value,
        "attempt": w.attempt,
        "failures": w.failures,
        "work_done": w.work_done,
        "progress": w.progress,
        "priority_override": w.priority_override,
        "placement": placement_to_json(w.placement),
        "started_at": w.started_at,
        "failure_cause": _clip(w.failure_cause, 64),
        "updated_version": version,
        "run_base_work": w.run_base_work,
        "last_checkpoint_at": w.last_checkpoint_at,
        "preempted_by": w.preempted_by,
        "victims": _victims_to_json(w.victims),
        "preemptions": w.preemptions,
        "borrowing": w.borrowing,
        "pending_reason": w.pending_reason,
        "exit_code": w.exit_code,
    }


def transition_row(workload_id: str, step: int, tr: Transition) -> dict[str, Any]:
    """A transitions row: the ``step``-th transition of the workload's history."""
    return {
        "workload_id": workload_id,
        "step": step,
        "time": tr.time,
        "source": tr.source.value if tr.source is not None else None,
        "target": tr.target.value,
        "reason": tr.reason,
        # ids come from outside (event ids); an overlong one must not make the write fail
        "cause_id": _clip(tr.cause_id, 256),
    }


def _json_string(token: str) -> Any:
    """A JSON string (or null) token's value; without escapes it is just the inside."""
    if token == "null":
        return None
    return token[1:-1] if "\\" not in token else json.loads(token)


class SpecReader:
    """Reads stored WorkloadSpec JSON, validating every spec.

    Specs that differ only in ``id`` and ``name`` (jobs submitted from one
    template) are validated once: later ones are copies of the validated one
    with their own id and name, which get the same checks as in
    ``WorkloadSpec`` (an id of letters, digits, ``._-``; a name of 1-200
    printable characters; anything else goes through full validation, which
    reports it). Validation is most of the cost of recovery, so this matters
    at 100,000 workloads. The id and name are found by their neighbours in the
    canonical (sorted-key) text; if the spec's fields ever change so that the
    pattern does not match, every spec is simply validated in full.
    """

    _ID = re.compile(r'"id":(null|"(?:[^"\\]|\\.)*"),"kind":')
    _NAME = re.compile(r'"min_vram_per_gpu":\d+,"name":("(?:[^"\\]|\\.)*"),"node_selector":')
    _ID_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
    _CONTROL = re.compile(r"[\x00-\x1f\x7f]")

    def __init__(self, context: dict[str, Any], max_templates: int = 200_000) -> None:
        self._ctx = context
        self._templates: dict[str, WorkloadSpec] = {}
        self._max = max_templates
        self.validated = 0

    def _full(self, text: str) -> WorkloadSpec:
        self.validated += 1
        return WorkloadSpec.model_validate_json(text, context=self._ctx)

    def read(self, text: str) -> WorkloadSpec:
        mi = self._ID.search(text)
        mn = self._NAME.search(text) if mi is not None else None
        if mi is None or mn is None or mi.end(1) > mn.start(1):
            return self._full(text)
        key = text[: mi.start(1)] + text[mi.end(1) : mn.start(1)] + text[mn.end(1) :]
        tpl = self._templates.get(key)
        if tpl is None:
            spec = self._full(text)
            if len(self._templates) < self._max:
                self._templates[key] = spec
            return spec
        ident = _json_string(mi.group(1))
        name = _json_string(mn.group(1))
        if (
            (ident is not None and not (isinstance(ident, str) and self._ID_OK.fullmatch(ident)))
            or not isinstance(name, str)
            or not 0 < len(name) <= 200
            or self._CONTROL.search(name)
        ):
            return self._full(text)  # raises, naming the field
        return tpl.model_copy(update={"id": ident, "name": name})


# ================================================================== repository
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
            self.sanitizing = sanitize is not _identity
        self._sanitize = sanitize
        self.tx = db.Transactions(
            engine, health=health, attempts=retry_attempts, base_delay=retry_base_delay
        )
        self.dialect = engine.dialect.name
        if self.dialect not in ("sqlite", "postgresql"):
            raise StoreError(f"unsupported database dialect {self.dialect!r}")
        self._claim = events.EventClaim(engine)
        self._ctx = {"catalog": catalog}

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

    # ------------------------------------------------------------ transactions
    def transaction(self) -> AbstractContextManager[Connection]:
        """A write transaction (``BEGIN IMMEDIATE`` on SQLite), committed when the block ends.

        Pass the connection to the repository's write methods (``conn=``) to
        make them part of it. Not retried: the caller owns the whole unit.
        """
        return self.tx.transaction()

    def _write(self, fn: Callable[[Connection], T], conn: Connection | None) -> T:
        return self.tx.write(fn, conn)

    def write(self, fn: Callable[[Connection], T]) -> T:
        """``fn(conn)`` in one write transaction, re-run whole on transient errors.

        ``fn`` must be safe to run again from the start (the repository's own
        writes are: they are idempotent).
        """
        return self.tx.write(fn)

    def read(self, fn: Callable[[Connection], T]) -> T:
        """``fn(conn)`` on a connection of its own, re-run on transient errors."""
        return self.tx.read(fn)

    def _read(self, fn: Callable[[Connection], T]) -> T:
        return self.tx.read(fn)

    def _insert(self, table: Any) -> Insert:
        if self.dialect == "postgresql":
            return postgresql.insert(table)
        return sqlite.insert(table)

    def _insert_ignore(
        self, conn: Connection, table: Any, keys: list[str], rows: list[Any]
    ) -> None:
        if rows:
            stmt = self._insert(table).on_conflict_do_nothing(index_elements=keys)  # type: ignore[attr-defined]
            conn.execute(stmt, rows)

    def _upsert(
        self, conn: Connection, table: Any, keys: list[str], rows: list[dict[str, Any]]
    ) -> None:
        if not rows:
            return
        ins = self._insert(table)
        cols = [c for c in rows[0] if c not in keys]
        stmt = ins.on_conflict_do_update(  # type: ignore[attr-defined]
            index_elements=keys,
            set_={c: ins.excluded[c] for c in cols},  # type: ignore[attr-defined]
        )
        conn.execute(stmt, rows)

    def _json(self, value: Any) -> str:
        return canonical_json(self._sanitize(value))

    # ================================================================ cluster
    def _node_row(self, spec: NodeSpec, status: NodeStatus | str, position: int) -> dict[str, Any]:
        return {
            "name": spec.name,
            "spec": self._json(spec.model_dump(mode="json")),
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
            self._upsert(
                c, S.nodes, ["name"], [self._node_row(n, n.status, i) for i, n in enumerate(nodes)]
            )
            self._upsert(c, S.queues, ["name"], [self._queue_row(q) for q in queues])

        self._write(go, conn)

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
            self._upsert(c, S.nodes, ["name"], [self._node_row(spec, status or spec.status, pos)])

        self._write(go, conn)

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

        self._write(go, conn)

    def _queue_row(self, spec: QueueSpec) -> dict[str, Any]:
        return {"name": spec.name, "spec": self._json(spec.model_dump(mode="json"))}

    def put_queue(self, spec: QueueSpec, *, conn: Connection | None = None) -> None:
        self._write(lambda c: self._upsert(c, S.queues, ["name"], [self._queue_row(spec)]), conn)

    def load_nodes(
        self,
        catalog: GpuCatalog | None = None,
        corrupt: list[tuple[CorruptRecord, dict[str, Any]]] | None = None,
    ) -> list[tuple[NodeSpec, NodeStatus]]:
        """Stored nodes in the order they were added, each with its current status
        (``corrupt``: unreadable ones are left out and noted there, as in
        :meth:`load_workloads`)."""
        ctx = self._ctx if catalog is None else {"catalog": catalog}
        rows: Any = self._read(
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
        ctx = self._ctx if catalog is None else {"catalog": catalog}
        rows: Any = self._read(
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

    # ============================================================= quarantine
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

        self._write(go, conn)
        return list(ids)

    def quarantined(self) -> list[dict[str, Any]]:
        """Every quarantined record, oldest first."""
        q = S.quarantine
        rows = self._read(lambda c: c.execute(select(
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

        return self._write(go, conn)

    # ============================================================ idempotency
    def idempotent_answer(self, key: str) -> tuple[str, int, str] | None:
        """The first answer ``(request hash, status, response JSON)`` given to ``key``."""
        k = S.idempotency_keys
        row = self._read(lambda c: c.execute(
            select(k.c.request_hash, k.c.status, k.c.response).where(k.c.key == key)
        ).first())
        return None if row is None else (row[0], int(row[1]), row[2])

    def remember_answer(
        self, conn: Connection, key: str, request_hash: str, status: int, response: str,
        time: float,
    ) -> None:
        """Keep the answer to ``key`` (in the transaction that makes its effect durable)."""
        self._insert_ignore(conn, S.idempotency_keys, ["key"], [{
            "key": key, "request_hash": request_hash, "status": status, "response": response,
            "created": time,
        }])

    def prune_idempotency(self, older_than: float) -> int:
        k = S.idempotency_keys

        def go(c: Connection) -> int:
            return int(c.execute(delete(k).where(k.c.created < older_than)).rowcount or 0)

        return self._write(go, None)

    # ============================================================== workloads
    def _full_row(self, w: Workload, version: int, correlation_id: str | None) -> dict[str, Any]:
        row = {
            "id": w.id,
            "seq": w.seq,
            "spec": self._json(w.spec.model_dump(mode="json")),
            "submit_time": w.submit_time,
            "deadline": w.deadline,
            "correlation_id": _clip(correlation_id, 256),
        }
        row.update(mutable_values(w, version))
        return row

    def insert_workloads(
        self,
        workloads: Sequence[Workload],
        correlation_id: str | None = None,
        *,
        version: int = 0,
        with_history: bool = True,
        conn: Connection | None = None,
    ) -> None:
        """Store new workloads with their history, in one transaction.

        This is the durable half of a submission: acknowledge only after it
        returns. A workload already stored (same id) is left as it is, so a
        batch retried after an uncertain commit is harmless.
        ``correlation_id`` defaults to the cause of each workload's first transition.
        """
        rows = []
        trs: list[dict[str, Any]] = []
        for w in workloads:
            cid = correlation_id
            if cid is None and w.history:
                cid = w.history[0].cause_id
            rows.append(self._full_row(w, version, cid))
            if with_history:
                trs.extend(transition_row(w.id, i, tr) for i, tr in enumerate(w.history))

        def go(c: Connection) -> None:
            self._insert_ignore(c, S.workloads, ["id"], rows)
            self._insert_ignore(c, S.transitions, ["workload_id", "step"], trs)

        self._write(go, conn)

    def update_specs(
        self, workloads: Sequence[Workload], *, conn: Connection | None = None
    ) -> None:
        """Rewrite the stored spec of workloads whose request changed (``SetResources``)."""
        if not workloads:
            return
        rows = [
            {"b_id": w.id, "b_spec": self._json(w.spec.model_dump(mode="json"))} for w in workloads
        ]
        stmt = (
            update(S.workloads)
            .where(S.workloads.c.id == bindparam("b_id"))
            .values(spec=bindparam("b_spec"))
        )
        self._write(lambda c: c.execute(stmt, rows), conn)

    def save_workload_states(
        self, workloads: Sequence[Workload], version: int, *, conn: Connection | None = None
    ) -> None:
        """Update the mutable columns (state, placement, counters...) of stored workloads.

        A workload that is not stored yet is inserted whole (without history:
        transitions are written by :meth:`append_transitions`).
        """
        if not workloads:
            return
        # bind names must differ from column names in an UPDATE ... SET
        rows = []
        for w in workloads:
            r = {f"b_{k}": v for k, v in mutable_values(w, version).items()}
            r["b_id"] = w.id
            rows.append(r)
        stmt = (
            update(S.workloads)
            .where(S.workloads.c.id == bindparam("b_id"))
            .values({c: bindparam(f"b_{c}") for c in _MUTABLE})
        )
        by_id = {w.id: w for w in workloads}

        def go(c: Connection) -> None:
            res = c.execute(stmt, rows)
            if res.rowcount != len(rows) or not self.engine.dialect.supports_sane_multi_rowcount:
                stored: set[str] = set()
                ids = list(by_id)
                for i in range(0, len(ids), _CHUNK):
                    stored.update(
                        c.execute(
                            select(S.workloads.c.id).where(
                                S.workloads.c.id.in_(ids[i : i + _CHUNK])
                            )
                        ).scalars()
                    )
                missing = [by_id[i] for i in ids if i not in stored]
                self._insert_ignore(
                    c,
                    S.workloads,
                    ["id"],
                    [
                        self._full_row(w, version, w.history[0].cause_id if w.history else None)
                        for w in missing
                    ],
                )

        self._write(go, conn)

    def append_transitions(
        self,
        rows: Iterable[tuple[str, Transition] | tuple[str, int, Transition]],
        *,
        conn: Connection | None = None,
    ) -> None:
        """Append lifecycle transitions, each ``(workload_id, step, transition)``.

        ``step`` is the transition's position in the workload's history (0 for
        its submission); a row already stored at that step is left as it is.

        Rows may also be given as ``(workload_id, transition)``: they go after
        the workload's last stored step, in order, except that a leading run
        equal to the end of the stored history is recognised as already stored
        (so writing a new workload with its history through
        :meth:`insert_workloads` and then appending the same transitions in
        the same transaction stores them once). No legal history repeats a
        transition immediately, so this never drops a real one.
        """
        explicit: list[dict[str, Any]] = []
        implicit: dict[str, list[Transition]] = {}
        for r in rows:
            if len(r) == 3:
                explicit.append(transition_row(r[0], r[1], r[2]))
            else:
                implicit.setdefault(r[0], []).append(r[1])

        def go(c: Connection) -> None:
            out = list(explicit)
            if implicit:
                out += self._place_implicit(c, implicit, explicit)
            self._insert_ignore(c, S.transitions, ["workload_id", "step"], out)

        self._write(go, conn)

    def _place_implicit(
        self, c: Connection, implicit: dict[str, list[Transition]], explicit: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        t = S.transitions
        ids = sorted(implicit)
        stored: dict[str, dict[int, tuple[Any, ...]]] = {}
        for i in range(0, len(ids), _CHUNK):
            q = select(
                t.c.workload_id,
                t.c.step,
                t.c.time,
                t.c.source,
                t.c.target,
                t.c.reason,
                t.c.cause_id,
            ).where(t.c.workload_id.in_(ids[i : i + _CHUNK]))
            found: Any = c.execute(q)
            for wid, step, *rest in found:
                stored.setdefault(wid, {})[step] = tuple(rest)
        for row in explicit:
            if row["workload_id"] in implicit:
                stored.setdefault(row["workload_id"], {}).setdefault(
                    row["step"],
                    (row["time"], row["source"], row["target"], row["reason"], row["cause_id"]),
                )
        out = []
        for wid in ids:
            trs = implicit[wid]
            have = stored.get(wid, {})
            hist = [have[k] for k in sorted(have)]
            nxt = max(have) + 1 if have else 0
            keys = [
                (
                    tr.time,
                    tr.source.value if tr.source is not None else None,
                    tr.target.value,
                    tr.reason,
                    _clip(tr.cause_id, 256),
                )
                for tr in trs
            ]
            overlap = 0
            for k in range(min(len(keys), len(hist)), 0, -1):
                if keys[:k] == hist[len(hist) - k :]:
                    overlap = k
                    break
            for j, tr in enumerate(trs[overlap:]):
                out.append(transition_row(wid, nxt + j, tr))
        return out

    def load_workloads(
        self,
        *,
        states: Iterable[State] | None = None,
        catalog: GpuCatalog | None = None,
        corrupt: list[tuple[CorruptRecord, dict[str, Any]]] | None = None,
    ) -> list[Workload]:
        """Every stored workload (or those in ``states``), complete: spec, history, placement.

        In arrival order (``seq``). Raises :class:`CorruptRecord` naming the
        workload and column of the first row that cannot be read back, unless
        ``corrupt`` is given: then such rows are left out and each is appended
        to it with its raw record (the row and its transitions), for quarantine.
        """
        w = S.workloads
        cols = [
            w.c.id, w.c.seq, w.c.spec, w.c.submit_time, w.c.deadline, w.c.state, w.c.attempt,
            w.c.failures, w.c.work_done, w.c.progress, w.c.priority_override, w.c.placement,
            w.c.started_at, w.c.failure_cause, w.c.run_base_work, w.c.last_checkpoint_at,
            w.c.preempted_by, w.c.victims, w.c.preemptions, w.c.borrowing, w.c.pending_reason,
            w.c.exit_code,
        ]  # fmt: skip
        t = S.transitions
        wanted = None if states is None else sorted(State(s).value for s in states)

        def fetch(c: Connection) -> tuple[Any, Any]:
            q = select(*cols).order_by(w.c.seq)
            tq = select(t.c.workload_id, t.c.step, t.c.time, t.c.source, t.c.target, t.c.reason,
                        t.c.cause_id).order_by(t.c.id)  # fmt: skip
            if wanted is not None:
                q = q.where(w.c.state.in_(wanted))
                tq = tq.where(t.c.workload_id.in_(select(w.c.id).where(w.c.state.in_(wanted))))
            return c.execute(q).all(), c.execute(tq).all()

        rows, trows = self._read(fetch)
        reader = SpecReader(self._ctx if catalog is None else {"catalog": catalog})
        if corrupt is None:
            histories = self._histories(trows)
            return [self._workload_from_row(r, histories.get(r[0], []), reader) for r in rows]
        bad: dict[str, CorruptRecord] = {}
        histories = self._histories(trows, bad)
        out: list[Workload] = []
        for r in rows:
            problem = bad.get(r[0])
            if problem is None:
                try:
                    out.append(self._workload_from_row(r, histories.get(r[0], []), reader))
                    continue
                except CorruptRecord as exc:
                    problem = exc
            corrupt.append((problem, self._raw_record(r, cols, trows)))
        return out

    @staticmethod
    def _raw_record(r: Any, cols: Sequence[Any], trows: Sequence[Any]) -> dict[str, Any]:
        """A stored row as plain JSON values, with its transitions (for quarantine)."""
        wid = r[0]
        return {
            "row": {c.name: v for c, v in zip(cols, r)},
            "transitions": [
                {"step": t[1], "time": t[2], "source": t[3], "target": t[4], "reason": t[5],
                 "cause_id": t[6]}
                for t in trows if t[0] == wid
            ],
        }

    def _histories(
        self, trows: Iterable[Any], bad: dict[str, CorruptRecord] | None = None
    ) -> dict[str, list[Transition]]:
        """Transitions grouped by workload, in step order; a gap in the steps is corruption
        (raised, or with ``bad`` given, noted there by workload)."""
        if bad is not None:
            try:
                return self._histories(trows)
            except CorruptRecord:
                pass
            by: dict[str, list[Any]] = {}
            for t in trows:
                by.setdefault(t[0], []).append(t)
            good: dict[str, list[Transition]] = {}
            for wid, ts in by.items():
                try:
                    good.update(self._histories(ts))
                except CorruptRecord as exc:
                    bad[wid] = exc
            return good
        states = {s.value: s for s in State}
        out: dict[str, list[Transition]] = {}
        # workloads whose rows did not arrive as steps 0, 1, 2, ...: (step, transition) pairs
        unordered: dict[str, list[tuple[int, Transition]]] = {}
        for wid, step, time, source, target, reason, cause in trows:
            try:
                tr = Transition(
                    time, None if source is None else states[source], states[target], reason, cause
                )
            except KeyError as exc:
                raise CorruptRecord(
                    "workload", wid, "transitions", f"unknown state {exc.args[0]!r} at step {step}"
                ) from None
            lst = out.get(wid)
            if lst is None:
                lst = out[wid] = []
            pairs = unordered.get(wid)
            if pairs is not None:
                pairs.append((step, tr))
            elif step != len(lst):
                unordered[wid] = [*enumerate(lst), (step, tr)]
            else:
                lst.append(tr)
        for wid, pairs in unordered.items():
            pairs.sort(key=lambda p: p[0])
            for i, (s, _) in enumerate(pairs):
                if s != i:
                    raise CorruptRecord(
                        "workload", wid, "transitions", f"history has no step {i} (found {s})"
                    )
            out[wid] = [tr for _, tr in pairs]
        return out

    def _workload_from_row(
        self, r: Any, history: list[Transition], reader: SpecReader | None = None
    ) -> Workload:
        (wid, seq, spec_text, submit_time, deadline, state, attempt, failures, work_done, progress,
         prio, placement, started_at, failure_cause, run_base_work, last_ckpt, preempted_by,
         victims, preemptions, borrowing, pending_reason, exit_code) = r  # fmt: skip
        try:
            spec = (reader or SpecReader(self._ctx)).read(spec_text)
        except ValueError as exc:
            raise CorruptRecord("workload", wid, "spec", str(exc)) from exc
        try:
            st = State(state)
        except ValueError:
            raise CorruptRecord("workload", wid, "state", f"unknown state {state!r}") from None
        try:
            alloc = placement_from_json(placement)
        except ValueError as exc:
            raise CorruptRecord("workload", wid, "placement", str(exc)) from exc
        try:
            vic = _victims_from_json(victims)
        except ValueError as exc:
            raise CorruptRecord("workload", wid, "victims", str(exc)) from exc
        return Workload(
            id=wid,
            spec=spec,
            seq=seq,
            submit_time=submit_time,
            deadline=deadline,
            state=st,
            history=history,
            placement=alloc,
            attempt=attempt,
            failures=failures,
            started_at=started_at,
            work_done=work_done,
            run_base_work=run_base_work,
            progress=progress,
            last_checkpoint_at=last_ckpt,
            preempted_by=preempted_by,
            victims=vic,
            preemptions=preemptions,
            borrowing=bool(borrowing),
            pending_reason=pending_reason,
            exit_code=exit_code,
            failure_cause=failure_cause,
            priority_override=prio,
        )

    def workload(self, workload_id: str) -> Workload | None:
        """One stored workload with its history, or None."""
        w = S.workloads
        t = S.transitions

        def fetch(c: Connection) -> tuple[Any, Any]:
            row = c.execute(
                select(
                    w.c.id, w.c.seq, w.c.spec, w.c.submit_time, w.c.deadline, w.c.state,
                    w.c.attempt, w.c.failures, w.c.work_done, w.c.progress, w.c.priority_override,
                    w.c.placement, w.c.started_at, w.c.failure_cause, w.c.run_base_work,
                    w.c.last_checkpoint_at, w.c.preempted_by, w.c.victims, w.c.preemptions,
                    w.c.borrowing, w.c.pending_reason, w.c.exit_code,
                ).where(w.c.id == workload_id)
            ).first()  # fmt: skip
            trs = c.execute(
                select(t.c.workload_id, t.c.step, t.c.time, t.c.source, t.c.target, t.c.reason,
                       t.c.cause_id).where(t.c.workload_id == workload_id).order_by(t.c.step)
            ).all()  # fmt: skip
            return row, trs

        row, trs = self._read(fetch)
        if row is None:
            return None
        return self._workload_from_row(row, self._histories(trs).get(workload_id, []))

    def history(self, workload_id: str) -> list[Transition]:
        t = S.transitions
        trs = self._read(
            lambda c: c.execute(
                select(t.c.workload_id, t.c.step, t.c.time, t.c.source, t.c.target, t.c.reason,
                       t.c.cause_id).where(t.c.workload_id == workload_id).order_by(t.c.step)
            ).all()
        )  # fmt: skip
        return self._histories(trs).get(workload_id, [])

    def workload_correlation(self, workload_id: str) -> str | None:
        return self._read(
            lambda c: c.execute(
                select(S.workloads.c.correlation_id).where(S.workloads.c.id == workload_id)
            ).scalar()
        )

    def count_workloads(self) -> int:
        return int(
            self._read(lambda c: c.execute(select(func.count()).select_from(S.workloads)).scalar())
            or 0
        )

    def max_version(self) -> int:
        """The newest control-plane version stored (meta, workload rows or snapshots)."""

        def go(c: Connection) -> int:
            meta = c.execute(select(S.meta_kv.c.value).where(S.meta_kv.c.key == "version")).scalar()
            wv = c.execute(select(func.max(S.workloads.c.updated_version))).scalar()
            sv = c.execute(select(func.max(S.snapshots.c.version))).scalar()
            return max(int(meta or 0), int(wv or 0), int(sv or 0))

        return self._read(go)

    # ============================================================== decisions
    def append_decisions(
        self, records: Iterable[DecisionRecord], *, conn: Connection | None = None
    ) -> None:
        """Store decision records (keyed by their sequence number; a repeat is ignored)."""
        rows = [
            {
                "seq": r.seq,
                "time": r.time,
                "kind": _clip(r.kind, 32),
                "workload": _clip(r.workload, 128),
                "cause_id": _clip(r.cause_id, 256),
                "record": self._json(r.to_dict()),
            }
            for r in records
        ]
        self._write(lambda c: self._insert_ignore(c, S.decisions, ["seq"], rows), conn)

    def decisions_for(
        self, workload: str | None = None, cause_id: str | None = None, *, limit: int | None = None
    ) -> list[DecisionRecord]:
        """Decision records about ``workload`` and/or caused by ``cause_id``, oldest first."""
        d = S.decisions
        q = select(d.c.seq, d.c.time, d.c.record).order_by(d.c.seq)
        if workload is not None:
            q = q.where(d.c.workload == workload)
        if cause_id is not None:
            q = q.where(d.c.cause_id == cause_id)
        if limit is not None:
            q = q.limit(limit)
        rows: Any = self._read(lambda c: c.execute(q).all())
        out = []
        for seq, time, text in rows:
            try:
                out.append(decision_from_row(seq, time, text))
            except (ValueError, KeyError, TypeError) as exc:
                raise CorruptRecord("decision", seq, "record", str(exc)) from exc
        return out

    def max_decision_seq(self) -> int:
        return int(
            self._read(lambda c: c.execute(select(func.max(S.decisions.c.seq))).scalar()) or 0
        )

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
        row = {
            "time": time,
            "correlation_id": _clip(correlation_id, 256),
            "record": self._json(dict(record)),
        }

        def go(c: Connection) -> int:
            res = c.execute(self._insert(S.reasoning).returning(S.reasoning.c.id), row)
            return int(res.scalar_one())

        return self._write(go, conn)

    def reasoning(
        self, correlation_id: str | None = None, *, after_id: int = 0, limit: int = 1000
    ) -> list[ReasoningEntry]:
        r = S.reasoning
        q = select(r.c.id, r.c.time, r.c.correlation_id, r.c.record).where(r.c.id > after_id)
        if correlation_id is not None:
            q = q.where(r.c.correlation_id == correlation_id)
        rows: Any = self._read(lambda c: c.execute(q.order_by(r.c.id).limit(limit)).all())
        return [ReasoningEntry(i, t, cid, json.loads(rec)) for i, t, cid, rec in rows]

    def latest_reasoning(
        self, correlation_id: str | None = None, *, limit: int = 200
    ) -> list[ReasoningEntry]:
        """The last ``limit`` reasoning traces (of one correlation id if given), oldest first."""
        r = S.reasoning
        q = select(r.c.id, r.c.time, r.c.correlation_id, r.c.record)
        if correlation_id is not None:
            q = q.where(r.c.correlation_id == correlation_id)
        rows: Any = self._read(lambda c: c.execute(q.order_by(r.c.id.desc()).limit(limit)).all())
        return [ReasoningEntry(i, t, cid, json.loads(rec)) for i, t, cid, rec in reversed(rows)]

    # ============================================================== telemetry
    def append_telemetry(
        self,
        samples: Iterable[TelemetrySample],
        resolution_s: int = 1,
        *,
        conn: Connection | None = None,
    ) -> int:
        """Store raw telemetry samples at ``resolution_s``; returns how many."""
        rows = [
            {
                "time": s.time,
                "node": s.node,
                "workload": s.workload,
                "resolution_s": resolution_s,
                "metrics": self._json(dict(s.metrics)),
            }
            for s in samples
        ]
        if rows:
            self._write(lambda c: c.execute(S.telemetry.insert(), rows), conn)
        return len(rows)

    def telemetry(
        self,
        *,
        node: str | None = None,
        workload: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = None,
    ) -> list[TelemetrySample]:
        t = S.telemetry
        q = select(t.c.time, t.c.node, t.c.workload, t.c.resolution_s, t.c.metrics).order_by(
            t.c.time, t.c.id
        )
        if node is not None:
            q = q.where(t.c.node == node)
        if workload is not None:
            q = q.where(t.c.workload == workload)
        if since is not None:
            q = q.where(t.c.time >= since)
        if until is not None:
            q = q.where(t.c.time < until)
        if limit is not None:
            q = q.limit(limit)
        rows: Any = self._read(lambda c: c.execute(q).all())
        return [
            TelemetrySample(time=tm, node=n, workload=wl, metrics=json.loads(m), resolution_s=res)
            for tm, n, wl, res, m in rows
        ]

    def downsample_telemetry(
        self, older_than: float, to_resolution_s: int, *, conn: Connection | None = None
    ) -> tuple[int, int]:
        """Replace samples older than ``older_than`` (and finer than ``to_resolution_s``) by
        one sample per node, workload and ``to_resolution_s`` bucket.

        Numeric metrics are averaged; others keep their latest value. The cut-off
        is rounded down to a bucket boundary, so no bucket is split. Returns
        (samples removed, samples written).
        """
        if to_resolution_s <= 0:
            raise ValueError("to_resolution_s must be positive")
        cutoff = math.floor(older_than / to_resolution_s) * to_resolution_s
        t = S.telemetry

        def go(c: Connection) -> tuple[int, int]:
            rows: Any = c.execute(
                select(t.c.id, t.c.time, t.c.node, t.c.workload, t.c.metrics)
                .where(t.c.time < cutoff, t.c.resolution_s < to_resolution_s)
                .order_by(t.c.time, t.c.id)
            ).all()
            if not rows:
                return 0, 0
            groups: dict[tuple[str, str | None, float], list[dict[str, Any]]] = {}
            for _id, tm, node, wl, m in rows:
                bucket = math.floor(tm / to_resolution_s) * to_resolution_s
                groups.setdefault((node, wl, float(bucket)), []).append(json.loads(m))
            out = []
            for (node, wl, start), ms in groups.items():
                agg: dict[str, Any] = {}
                sums: dict[str, list[float]] = {}
                for m in ms:
                    for k, v in m.items():
                        if isinstance(v, int | float) and not isinstance(v, bool):
                            sums.setdefault(k, []).append(float(v))
                        else:
                            agg[k] = v
                for k, vs in sums.items():
                    agg[k] = sum(vs) / len(vs)
                out.append(
                    {
                        "time": start,
                        "node": node,
                        "workload": wl,
                        "resolution_s": to_resolution_s,
                        "metrics": canonical_json(agg),
                    }
                )
            ids = [r[0] for r in rows]
            for i in range(0, len(ids), _CHUNK):
                c.execute(delete(t).where(t.c.id.in_(ids[i : i + _CHUNK])))
            c.execute(t.insert(), out)
            return len(ids), len(out)

        return self._write(go, conn)

    def prune_telemetry(
        self, retention_s: float, now: float, *, conn: Connection | None = None
    ) -> int:
        """Delete samples older than ``now - retention_s``; returns how many."""
        t = S.telemetry
        return self._write(
            lambda c: int(c.execute(delete(t).where(t.c.time < now - retention_s)).rowcount), conn
        )

    # ============================================================== snapshots
    def save_snapshot(
        self,
        version: int,
        time: float,
        state_json: str | Mapping[str, Any],
        *,
        conn: Connection | None = None,
    ) -> None:
        text = state_json if isinstance(state_json, str) else self._json(dict(state_json))
        row = {"version": version, "time": time, "state": text}
        self._write(lambda c: self._upsert(c, S.snapshots, ["version"], [row]), conn)

    def latest_snapshot(self) -> Snapshot | None:
        s = S.snapshots
        row = self._read(
            lambda c: c.execute(
                select(s.c.version, s.c.time, s.c.state).order_by(s.c.version.desc()).limit(1)
            ).first()
        )
        return None if row is None else Snapshot(int(row[0]), float(row[1]), row[2])

    # =================================================================== meta
    def meta_get(self, key: str, default: str | None = None) -> str | None:
        v = self._read(
            lambda c: c.execute(select(S.meta_kv.c.value).where(S.meta_kv.c.key == key)).scalar()
        )
        return default if v is None else str(v)

    def meta_set(self, key: str, value: str, *, conn: Connection | None = None) -> None:
        row = {"key": key, "value": value}
        self._write(lambda c: self._upsert(c, S.meta_kv, ["key"], [row]), conn)

    # ======================================================= processed events
    def mark_processed(self, conn: Connection, event_id: str, at: float) -> bool:
        """Record ``event_id`` as processed inside ``conn``'s transaction
        (:class:`mlwe.store.events.EventClaim`).

        False when it already was: the caller then skips the effect (and the
        transaction writes nothing new).
        """
        return self._claim(conn, event_id, at)

    def is_processed(self, event_id: str) -> bool:
        return self._read(lambda c: events.is_processed(c, event_id))
