"""The tamper-evident audit log: an append-only hash chain in the ``audit`` table.

Every decision, agent proposal, operator action and configuration change is
one record. Each record carries the hash of the one before it, so editing,
deleting, inserting or reordering rows breaks the chain, and ``verify`` names
the first record where it breaks.

Canonical hash encoding (version ``mlwe-audit-v1``)::

    hash = sha256(utf8(json.dumps(
        ["mlwe-audit-v1", seq, repr(time), kind, actor, workload, correlation_id,
         payload, prev_hash],
        ensure_ascii=False, separators=(",", ":"),
    ))).hexdigest()

where ``seq`` is the integer sequence number (1, 2, ...), ``repr(time)`` the
shortest round-trip text of the float time (so the stored double gives back
exactly the hashed text), ``workload`` and ``correlation_id`` are strings or
JSON ``null``, ``payload`` is the stored canonical JSON text itself (as a JSON
string), and ``prev_hash`` the previous record's hex hash, or 64 zeros for
record 1. A JSON array is unambiguous (no field can run into the next), and
the version tag lets a later encoding coexist.

Payloads are sanitised (``store.sanitize``) and then serialised canonically:
``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False)``;
values JSON cannot hold are first turned into text with ``str`` so that the
sanitizer sees them too. Identifiers (actor, workload, correlation id) go
through the same sanitizer.

Concurrency: ``seq`` is the table's primary key, so two writers can never both
write record N; the loser of a race gets an integrity error, re-reads the head
and retries (within a savepoint when it writes in the caller's transaction on
a database with real savepoints; SQLite rolls back just the failed statement).
Appends in their own transaction also take a process-local lock (shared by
every ``AuditLog`` on the same database URL) so threads of one process do not
race at all. Appends inside a caller's connection skip that lock: they may
wait on the database for another open transaction, and holding a Python lock
meanwhile could deadlock.

Limits of a plain hash chain, by design: whoever can write the table can
append a well-formed record at the end, and can remove records from the end
without a trace. Record the head (``head()``) somewhere else and pass it to
``verify(anchor=...)`` to detect truncation. A record rewritten *with* a
recomputed hash is reported at the next record, whose ``prev_hash`` no longer
matches.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time as _time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, func, insert, select
from sqlalchemy.exc import IntegrityError, OperationalError

from mlwe.core.decisions import DecisionRecord
from mlwe.store.sanitize import sanitize, sanitize_text
from mlwe.store.schema import audit

__all__ = [
    "GENESIS_HASH",
    "HASH_VERSION",
    "AuditConflict",
    "AuditEntry",
    "AuditLog",
    "VerifyResult",
    "canonical_json",
    "entry_hash",
]

#: ``prev_hash`` of the first record.
GENESIS_HASH = "0" * 64
#: First element of the hashed array; names the encoding.
HASH_VERSION = "mlwe-audit-v1"

# Column widths of the ``audit`` table; checked here so SQLite and PostgreSQL agree.
_MAX_KIND = 32
_MAX_ACTOR = 128
_MAX_WORKLOAD = 128
_MAX_CORRELATION = 256


#: ``json.dumps(..., ensure_ascii=False, separators=(",", ":"))``, built once.
_HASH_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


class AuditConflict(RuntimeError):
    """An append kept losing the race for the next sequence number."""


class _SeqTaken(Exception):
    """The INSERT of record ``seq`` failed on a constraint (usually: another writer won)."""

    def __init__(self, seq: int, cause: IntegrityError) -> None:
        super().__init__(seq)
        self.seq = seq
        self.cause = cause


def canonical_json(payload: Any) -> str:
    """The canonical JSON text of ``payload`` (sorted keys, no spaces, UTF-8 kept)."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def entry_hash(
    seq: int,
    time: float,
    kind: str,
    actor: str,
    workload: str | None,
    correlation_id: str | None,
    payload: str,
    prev_hash: str,
) -> str:
    """The record hash in the canonical encoding described in the module doc."""
    encoded = _HASH_ENCODER.encode(
        [
            HASH_VERSION,
            int(seq),
            repr(float(time)),
            kind,
            actor,
            workload,
            correlation_id,
            payload,
            prev_hash,
        ]
    ).encode("utf-8")
    return hashlib.sha256(encoded).hexdigest()


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One stored record."""

    seq: int
    time: float
    kind: str  # decision, proposal, operator, config, ...
    actor: str
    workload: str | None
    correlation_id: str | None
    payload: str  # canonical JSON text, sanitised
    prev_hash: str
    hash: str

    def data(self) -> dict[str, Any]:
        """The payload as a dict."""
        loaded: dict[str, Any] = json.loads(self.payload)
        return loaded

    def expected_hash(self) -> str:
        return entry_hash(
            self.seq,
            self.time,
            self.kind,
            self.actor,
            self.workload,
            self.correlation_id,
            self.payload,
            self.prev_hash,
        )

    def line(self) -> str:
        """One human-readable line (``mlwe audit show``)."""
        data = self.data()
        why = data.get("reasons")
        detail = "; ".join(str(r) for r in why) if isinstance(why, list) else self.payload
        where = f" {self.workload}" if self.workload else ""
        corr = f" [{self.correlation_id}]" if self.correlation_id else ""
        return f"#{self.seq} t={self.time:.3f} {self.kind} by {self.actor}{where}{corr}: {detail}"


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """What ``AuditLog.verify`` found."""

    ok: bool
    checked: int  # records that verified, in order, before any problem
    first_bad_seq: int | None = None
    reason: str = ""
    head_seq: int = 0  # last good record (0: none)
    head_hash: str = GENESIS_HASH


_COLUMNS = (
    audit.c.seq,
    audit.c.time,
    audit.c.kind,
    audit.c.actor,
    audit.c.workload,
    audit.c.correlation_id,
    audit.c.payload,
    audit.c.prev_hash,
    audit.c.hash,
)

_locks_guard = threading.Lock()
_locks: dict[str, threading.Lock] = {}


def _lock_for(engine: Engine) -> threading.Lock:
    key = engine.url.render_as_string(hide_password=False)
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def _jsonable(payload: Mapping[str, Any]) -> dict[str, Any]:
    """A plain JSON structure: non-JSON values become text (and so get sanitised)."""
    plain: dict[str, Any] = json.loads(json.dumps(dict(payload), default=str))
    return plain


def _check_text(name: str, value: str | None, limit: int, *, required: bool) -> None:
    if value is None:
        if required:
            raise ValueError(f"audit {name} is required")
        return
    if not isinstance(value, str) or (required and not value):
        raise ValueError(f"audit {name} must be a non-empty string, got {value!r}")
    if len(value) > limit:
        raise ValueError(f"audit {name} is {len(value)} characters, the limit is {limit}")


def _is_lock_error(exc: OperationalError) -> bool:
    text = str(exc.orig).lower()
    return "locked" in text or "busy" in text


# Built once: constructing statements costs more than running them here.
_HEAD = select(audit.c.seq, audit.c.hash).order_by(audit.c.seq.desc()).limit(1)
_INSERT = insert(audit)


def _row(entry: AuditEntry) -> dict[str, Any]:
    return {
        "seq": entry.seq,
        "time": entry.time,
        "kind": entry.kind,
        "actor": entry.actor,
        "workload": entry.workload,
        "correlation_id": entry.correlation_id,
        "payload": entry.payload,
        "prev_hash": entry.prev_hash,
        "hash": entry.hash,
    }


class AuditLog:
    """The append-only, hash-chained audit log over one database."""

    def __init__(
        self,
        engine: Engine,
        *,
        clock: Callable[[], float] = _time.time,
        batch_size: int = 10_000,
        max_attempts: int = 100,
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._batch_size = batch_size
        self._max_attempts = max_attempts
        self._lock = _lock_for(engine)
        # SQLite (pysqlite) savepoints do not nest reliably; a failed INSERT there
        # rolls back only itself, which is all the retry needs.
        self._use_savepoint = engine.dialect.name != "sqlite"

    @property
    def engine(self) -> Engine:
        return self._engine

    # --- writing -------------------------------------------------------------------

    def append(
        self,
        kind: str,
        actor: str,
        payload: Mapping[str, Any],
        workload: str | None = None,
        correlation_id: str | None = None,
        time: float | None = None,
        conn: Connection | None = None,
    ) -> AuditEntry:
        """Append one record; with ``conn``, inside the caller's transaction.

        The payload is sanitised before anything is written. Returns the stored
        record.
        """
        build = self._prepare(kind, actor, payload, workload, correlation_id, time)
        if conn is not None:
            return self._append_in(conn, build)
        return self._append_own(build)

    def extend(self, records: Sequence[Mapping[str, Any]], conn: Connection) -> list[AuditEntry]:
        """Append several records inside the caller's transaction, in order.

        Each record is a mapping of :meth:`append`'s keyword arguments. The head
        is read once and the rows go in one statement (what a group commit
        writes); if another writer took a sequence number meanwhile, the records
        are appended one by one instead, with :meth:`append`'s retries.
        """
        builds = [self._prepare(**r) for r in records]
        if len(builds) <= 1:
            return [self._append_in(conn, b) for b in builds]
        savepoint = conn.begin_nested() if self._use_savepoint else None
        seq, prev_hash = self._head(conn)
        entries: list[AuditEntry] = []
        for build in builds:
            entry = build(seq + 1, prev_hash)
            entries.append(entry)
            seq, prev_hash = entry.seq, entry.hash
        try:
            conn.execute(_INSERT, [_row(e) for e in entries])
        except IntegrityError:
            if savepoint is not None:
                savepoint.rollback()
            # a lost race: another writer holds the first number (then none of these rows
            # went in: the first one failed); else a real integrity error, which the
            # caller's transaction rolls back
            taken = conn.execute(
                select(audit.c.hash).where(audit.c.seq == entries[0].seq)
            ).scalar()
            if taken is None or taken == entries[0].hash:
                raise
            return [self._append_in(conn, b) for b in builds]
        if savepoint is not None:
            savepoint.commit()
        return entries

    def _prepare(
        self,
        kind: str,
        actor: str,
        payload: Mapping[str, Any],
        workload: str | None = None,
        correlation_id: str | None = None,
        time: float | None = None,
    ) -> Callable[[int, str], AuditEntry]:
        """Check and sanitise one record; returns how to build it at a given place."""
        if not isinstance(payload, Mapping):
            raise TypeError(f"audit payload must be a mapping, got {type(payload).__name__}")
        actor = sanitize_text(actor) if isinstance(actor, str) else actor
        workload = sanitize_text(workload) if isinstance(workload, str) else workload
        if isinstance(correlation_id, str):
            correlation_id = sanitize_text(correlation_id)
        _check_text("kind", kind, _MAX_KIND, required=True)
        _check_text("actor", actor, _MAX_ACTOR, required=True)
        _check_text("workload", workload, _MAX_WORKLOAD, required=False)
        _check_text("correlation_id", correlation_id, _MAX_CORRELATION, required=False)
        when = float(self._clock() if time is None else time)
        if not math.isfinite(when):
            raise ValueError(f"audit time must be finite, got {when!r}")
        body = canonical_json(sanitize(_jsonable(payload)))

        def build(seq: int, prev_hash: str) -> AuditEntry:
            return AuditEntry(
                seq=seq,
                time=when,
                kind=kind,
                actor=actor,
                workload=workload,
                correlation_id=correlation_id,
                payload=body,
                prev_hash=prev_hash,
                hash=entry_hash(seq, when, kind, actor, workload, correlation_id, body, prev_hash),
            )

        return build

    def append_decision(
        self, record: DecisionRecord, conn: Connection | None = None, time: float | None = None
    ) -> AuditEntry:
        """Record a scheduling decision: kind ``decision``, actor = the policy.

        ``time`` is when it was recorded (the log's clock by default); the
        decision's own engine time is in the payload.
        """
        return self.append(
            "decision",
            record.policy,
            record.to_dict(),
            workload=record.workload,
            correlation_id=record.cause_id,
            time=time,
            conn=conn,
        )

    def _append_own(self, build: Callable[[int, str], AuditEntry]) -> AuditEntry:
        delay = 0.001
        for _ in range(self._max_attempts):
            try:
                with self._lock, self._engine.begin() as conn:
                    return self._insert_next(conn, build)
            except _SeqTaken as taken:
                if self.head()[0] < taken.seq:
                    raise taken.cause from None  # not a lost race: a real integrity error
            except OperationalError as exc:
                if not _is_lock_error(exc):
                    raise
            _time.sleep(delay)
            delay = min(delay * 2, 0.1)
        raise AuditConflict(f"no free audit sequence number after {self._max_attempts} attempts")

    def _append_in(self, conn: Connection, build: Callable[[int, str], AuditEntry]) -> AuditEntry:
        for _ in range(self._max_attempts):
            savepoint = conn.begin_nested() if self._use_savepoint else None
            try:
                entry = self._insert_next(conn, build)
            except _SeqTaken as taken:
                if savepoint is not None:
                    savepoint.rollback()
                # In a REPEATABLE READ / SERIALIZABLE transaction the head never moves:
                # give the error back so the caller retries its whole transaction.
                if self._head(conn)[0] < taken.seq:
                    raise taken.cause from None
                continue
            if savepoint is not None:
                savepoint.commit()
            return entry
        raise AuditConflict(f"no free audit sequence number after {self._max_attempts} attempts")

    def _insert_next(self, conn: Connection, build: Callable[[int, str], AuditEntry]) -> AuditEntry:
        seq, prev_hash = self._head(conn)
        entry = build(seq + 1, prev_hash)
        try:
            conn.execute(_INSERT, _row(entry))
        except IntegrityError as exc:
            raise _SeqTaken(entry.seq, exc) from exc
        return entry

    # --- reading -------------------------------------------------------------------

    @staticmethod
    def _head(conn: Connection) -> tuple[int, str]:
        row = conn.execute(_HEAD).first()
        if row is None:
            return 0, GENESIS_HASH
        return int(row[0]), str(row[1])

    def head(self, conn: Connection | None = None) -> tuple[int, str]:
        """``(seq, hash)`` of the last record, ``(0, GENESIS_HASH)`` when empty.

        Keep it outside the database to detect truncation later
        (``verify(anchor=...)``).
        """
        if conn is not None:
            return self._head(conn)
        with self._engine.connect() as own:
            return self._head(own)

    def count(self) -> int:
        with self._engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(audit)).scalar_one())

    def entries(self, after_seq: int = 0) -> Iterator[AuditEntry]:
        """Every record with ``seq > after_seq`` in order, read in batches."""
        with self._engine.connect() as conn:
            last = after_seq
            while True:
                rows: Sequence[Any] = conn.execute(
                    select(*_COLUMNS)
                    .where(audit.c.seq > last)
                    .order_by(audit.c.seq)
                    .limit(self._batch_size)
                ).all()
                if not rows:
                    return
                for row in rows:
                    yield AuditEntry(*row)
                last = int(rows[-1][0])

    def show(
        self,
        workload: str | None = None,
        correlation_id: str | None = None,
        kind: str | None = None,
        limit: int | None = 100,
    ) -> list[AuditEntry]:
        """The latest ``limit`` records matching every filter given, oldest first."""
        query = select(*_COLUMNS)
        if workload is not None:
            query = query.where(audit.c.workload == workload)
        if correlation_id is not None:
            query = query.where(audit.c.correlation_id == correlation_id)
        if kind is not None:
            query = query.where(audit.c.kind == kind)
        query = query.order_by(audit.c.seq.desc())
        if limit is not None:
            query = query.limit(limit)
        with self._engine.connect() as conn:
            rows: Sequence[Any] = conn.execute(query).all()
        return [AuditEntry(*row) for row in reversed(rows)]

    # --- verifying -----------------------------------------------------------------

    def verify(self, anchor: tuple[int, str] | None = None) -> VerifyResult:
        """Walk the chain in order and report the first record that does not fit.

        Reads in batches of ``batch_size`` (memory stays flat however long the
        chain). With ``anchor=(seq, hash)`` (an earlier ``head()`` kept
        elsewhere) it also checks that record ``seq`` still exists with that
        hash, which catches removal of records from the end.
        """
        expected = 1
        prev_hash = GENESIS_HASH
        sha256 = hashlib.sha256
        dumps = _HASH_ENCODER.encode  # the encoding of entry_hash, inlined for speed

        def bad(seq: int, reason: str) -> VerifyResult:
            return VerifyResult(False, expected - 1, seq, reason, expected - 1, prev_hash)

        with self._engine.connect() as conn:
            last = 0
            while True:
                rows: Sequence[Any] = conn.execute(
                    select(*_COLUMNS)
                    .where(audit.c.seq > last)
                    .order_by(audit.c.seq)
                    .limit(self._batch_size)
                ).all()
                if not rows:
                    break
                for seq, when, kind, actor, workload, corr, payload, prev, stored in rows:
                    if seq != expected:
                        return bad(
                            expected,
                            f"record {expected} is missing: the chain goes from record "
                            f"{expected - 1} to record {seq}",
                        )
                    if prev != prev_hash:
                        return bad(
                            seq,
                            f"record {seq} does not link to record {seq - 1}: its prev_hash "
                            f"is not the hash of record {seq - 1} (a record was inserted, "
                            f"replaced, moved or rewritten)",
                        )
                    encoded = dumps(
                        [
                            HASH_VERSION,
                            seq,
                            repr(float(when)),
                            kind,
                            actor,
                            workload,
                            corr,
                            payload,
                            prev,
                        ]
                    ).encode("utf-8")
                    if sha256(encoded).hexdigest() != stored:
                        return bad(
                            seq,
                            f"record {seq} was edited: its fields do not match its hash",
                        )
                    if anchor is not None and seq == anchor[0] and stored != anchor[1]:
                        return bad(seq, f"record {seq} does not match the anchor hash")
                    prev_hash = stored
                    expected += 1
                last = int(rows[-1][0])
        if anchor is not None and anchor[0] >= expected:
            return bad(
                expected,
                f"the chain ends at record {expected - 1} but the anchor names record "
                f"{anchor[0]}: records {expected}..{anchor[0]} were removed",
            )
        return VerifyResult(True, expected - 1, None, "", expected - 1, prev_hash)
