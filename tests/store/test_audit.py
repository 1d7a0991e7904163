"""The audit hash chain on real databases: SQLite (a file) and PostgreSQL.

PostgreSQL runs at 127.0.0.1:5432 (database ``test``); each test gets a fresh
schema that it drops afterwards. Without a server the PostgreSQL cases skip,
except under ``CI=true`` where they fail.

Tampering is done the way an intruder would: raw SQL against the table. Each
case names the record ``verify`` must report first.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, insert, select, text
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from mlwe.core.decisions import DecisionRecord
from mlwe.store import schema
from mlwe.store.audit import (
    GENESIS_HASH,
    AuditLog,
    VerifyResult,
    canonical_json,
    entry_hash,
)
from mlwe.store.sanitize import REDACTED

PG_URL = os.environ.get("MLWE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REPO = Path(__file__).resolve().parents[2]


# --- databases -----------------------------------------------------------------------


def _sqlite_engine(path: Path) -> Engine:
    engine = create_engine(f"sqlite:///{path}")

    @event.listens_for(engine, "connect")
    def _wal(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=10000")
        cur.close()

    return engine


def _pg_admin_or_skip() -> Engine:
    try:
        admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except (SQLAlchemyError, ImportError) as exc:
        message = f"PostgreSQL not reachable at {PG_URL}: {exc}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return admin


def _pg_engine(schema_name: str) -> Engine:
    return create_engine(PG_URL, connect_args={"options": f"-csearch_path={schema_name}"})


@pytest.fixture(scope="module")
def pg() -> Iterator[tuple[Engine, str, str]]:
    """A fresh schema for this module's run, dropped at the end."""
    admin = _pg_admin_or_skip()
    name = f"audit_test_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{name}"'))
    engine = _pg_engine(name)
    try:
        schema.metadata.create_all(engine)
        yield engine, PG_URL, name
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{name}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Engine, str, str]]:
    """(engine, url, schema) with every table created and empty; schema is "" on SQLite."""
    if request.param == "sqlite":
        path = tmp_path / "audit.db"
        engine = _sqlite_engine(path)
        schema.metadata.create_all(engine)
        yield engine, f"sqlite:///{path}", ""
        engine.dispose()
        return
    engine, url, name = request.getfixturevalue("pg")
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE audit, meta"))
    yield engine, url, name


@pytest.fixture
def engine(db: tuple[Engine, str, str]) -> Engine:
    return db[0]


class Clock:
    """Deterministic, non-round times (so repr(time) is exercised)."""

    def __init__(self) -> None:
        self.t = 1_700_000_000.123456

    def __call__(self) -> float:
        self.t += 0.731
        return self.t


def make_log(engine: Engine, **kw: Any) -> AuditLog:
    return AuditLog(engine, clock=Clock(), **kw)


def fill(log: AuditLog, n: int = 10) -> None:
    kinds = ["decision", "proposal", "operator", "config"]
    for i in range(1, n + 1):
        log.append(
            kinds[i % 4],
            f"actor-{i % 3}",
            {"i": i, "reasons": [f"reason {i}"], "nested": {"ü": "ñ", "n": i * 1.5}},
            workload=f"w{i % 4}" if i % 5 else None,
            correlation_id=f"req-{i % 2}",
        )


def exec_sql(engine: Engine, *statements: str, **params: Any) -> None:
    with engine.begin() as conn:
        for sql in statements:
            conn.execute(text(sql), params)


def raw_rows(engine: Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(text("SELECT * FROM audit ORDER BY seq"))]


# --- a clean chain -------------------------------------------------------------------


def test_clean_chain_verifies(engine: Engine) -> None:
    log = make_log(engine)
    assert log.verify() == VerifyResult(True, 0)
    fill(log, 25)
    result = log.verify()
    assert result.ok and result.checked == 25 and result.first_bad_seq is None
    assert (result.head_seq, result.head_hash) == log.head()
    rows = raw_rows(engine)
    assert [r["seq"] for r in rows] == list(range(1, 26))
    assert rows[0]["prev_hash"] == GENESIS_HASH
    for before, after in itertools.pairwise(rows):
        assert after["prev_hash"] == before["hash"]


def test_small_batches_stream_the_same_chain(engine: Engine) -> None:
    fill(make_log(engine), 23)
    log = AuditLog(engine, batch_size=4)
    assert log.verify().checked == 23
    assert [e.seq for e in log.entries()] == list(range(1, 24))
    assert [e.seq for e in log.entries(after_seq=20)] == [21, 22, 23]


def test_hash_encoding_is_the_documented_one(engine: Engine) -> None:
    log = AuditLog(engine)
    entry = log.append(
        "decision", "fifo", {"b": 2, "a": "é"}, workload="w1", correlation_id=None, time=1.25
    )
    assert entry.payload == '{"a":"é","b":2}'
    expected_bytes = (
        '["mlwe-audit-v1",1,"1.25","decision","fifo","w1",null,'
        '"{\\"a\\":\\"é\\",\\"b\\":2}",'
        f'"{"0" * 64}"]'
    ).encode()
    assert entry.hash == hashlib.sha256(expected_bytes).hexdigest()
    assert entry.hash == entry.expected_hash()
    assert raw_rows(engine)[0]["hash"] == entry.hash
    assert canonical_json({"z": [1, 2.5, None], "a": True}) == '{"a":true,"z":[1,2.5,null]}'


def test_payload_is_sanitised_and_canonical(engine: Engine) -> None:
    log = make_log(engine)
    secrets = {
        "aws": "AKIAZ7QX4MLWE3EXAMP1",
        "gh": "ghp_16C7e42F292c6912E7710c838347Ae178B4a",
        "pw": "Tr0ub4dor&3horse",
        "url": "Pg-Pr0d-Passw0rd",
        "openai": "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAB7cDE0fGH3iJK6lMN9oPQ2rST5u",
    }
    entry = log.append(
        "config",
        "operator:alice",
        {
            "env": {"DB_PASSWORD": secrets["pw"], "AWS_ACCESS_KEY_ID": secrets["aws"]},
            "note": f"rotated {secrets['gh']}",
            "dsn": f"postgresql://mlwe:{secrets['url']}@db/mlwe",
            "args": ["--api-key", secrets["openai"]],
            "when": datetime(2024, 5, 1, tzinfo=UTC),  # not JSON: stored as text
            "token_count": 7,
        },
        workload="ft-1",
        correlation_id=f"req-{secrets['gh']}",
    )
    stored = json.dumps(raw_rows(engine))
    assert [name for name, value in secrets.items() if value in stored] == []
    data = entry.data()
    assert data["env"] == {"DB_PASSWORD": REDACTED, "AWS_ACCESS_KEY_ID": REDACTED}
    assert data["dsn"] == f"postgresql://mlwe:{REDACTED}@db/mlwe"
    assert data["when"] == "2024-05-01 00:00:00+00:00"
    assert data["token_count"] == 7
    assert entry.correlation_id == f"req-{REDACTED}"
    assert entry.payload == canonical_json(data)
    assert log.verify().ok


def test_append_decision(engine: Engine) -> None:
    log = make_log(engine)
    record = DecisionRecord(
        kind="preempt",
        workload="ft-9",
        policy="cost-aware-preemption",
        chosen="evict ft-7",
        reasons=("ft-9 (priority 100) outranks ft-7 (priority 50)", "frees 8 GPUs on node-3"),
        candidates=("ft-7", "ft-8"),
        inputs_digest="9fceb02d0ae598e9",
        cause_id="evt-42",
        time=3600.5,
        version=17,
        seq=4,
    )
    entry = log.append_decision(record)
    assert (entry.kind, entry.actor, entry.workload, entry.correlation_id) == (
        "decision",
        "cost-aware-preemption",
        "ft-9",
        "evt-42",
    )
    assert entry.data() == record.to_dict()
    assert "outranks" in entry.line()
    assert log.show(workload="ft-9") == [entry]


def test_show_answers_why(engine: Engine) -> None:
    log = make_log(engine)
    fill(log, 20)
    by_workload = log.show(workload="w1")
    assert [e.seq for e in by_workload] == [1, 9, 13, 17]  # i % 4 == 1 and i % 5 != 0
    assert all(e.workload == "w1" for e in by_workload)
    assert [e.seq for e in log.show(correlation_id="req-0")] == list(range(2, 21, 2))
    assert [e.seq for e in log.show(correlation_id="req-0", limit=3)] == [16, 18, 20]
    assert [e.seq for e in log.show(workload="w2", correlation_id="req-0")] == [2, 6, 14, 18]
    assert [e.seq for e in log.show(kind="config", limit=None)] == [3, 7, 11, 15, 19]
    assert log.show(workload="nope") == []
    assert log.count() == 20


def test_bad_input_is_refused(engine: Engine) -> None:
    log = make_log(engine)
    with pytest.raises(ValueError, match="kind"):
        log.append("k" * 33, "a", {})
    with pytest.raises(ValueError, match="actor"):
        log.append("decision", "", {})
    with pytest.raises(ValueError, match="time"):
        log.append("decision", "a", {}, time=float("nan"))
    with pytest.raises(TypeError, match="mapping"):
        log.append("decision", "a", [1, 2])  # type: ignore[arg-type]
    assert log.count() == 0


# --- tampering -----------------------------------------------------------------------


def _swap_payloads(engine: Engine) -> None:
    rows = {r["seq"]: r for r in raw_rows(engine)}
    exec_sql(engine, "UPDATE audit SET payload = :p WHERE seq = 3", p=rows[6]["payload"])
    exec_sql(engine, "UPDATE audit SET payload = :p WHERE seq = 6", p=rows[3]["payload"])


def _swap_rows(engine: Engine) -> None:
    exec_sql(
        engine,
        "UPDATE audit SET seq = 1000 WHERE seq = 4",
        "UPDATE audit SET seq = 4 WHERE seq = 5",
        "UPDATE audit SET seq = 5 WHERE seq = 1000",
    )


def _forge_tail(engine: Engine, *, link: bool, rehash: bool) -> None:
    rows = raw_rows(engine)
    prev = rows[-1]["hash"] if link else "f" * 64
    when, payload = 1_800_000_000.5, '{"forged":true}'
    good = entry_hash(11, when, "operator", "mallory", None, None, payload, prev)
    with engine.begin() as conn:
        conn.execute(
            insert(schema.audit).values(
                seq=11,
                time=when,
                kind="operator",
                actor="mallory",
                workload=None,
                correlation_id=None,
                payload=payload,
                prev_hash=prev,
                hash=good if rehash else "0" * 64,
            )
        )


def _replace_row_with_recomputed_hash(engine: Engine) -> None:
    """Rewrite record 5 *and* its hash: record 5 looks whole, 6 no longer links."""
    row = raw_rows(engine)[4]
    payload = '{"i":5,"rewritten":true}'
    new = entry_hash(
        5,
        row["time"],
        row["kind"],
        row["actor"],
        row["workload"],
        row["correlation_id"],
        payload,
        row["prev_hash"],
    )
    exec_sql(engine, "UPDATE audit SET payload = :p, hash = :h WHERE seq = 5", p=payload, h=new)


TAMPERING: list[tuple[str, Callable[[Engine], None], int, str]] = [
    (
        "edit payload",
        lambda e: exec_sql(e, "UPDATE audit SET payload = :p WHERE seq = 5", p='{"i":5}'),
        5,
        "edited",
    ),
    (
        "edit payload of the first record",
        lambda e: exec_sql(e, "UPDATE audit SET payload = '{}' WHERE seq = 1"),
        1,
        "edited",
    ),
    (
        "edit payload of the last record",
        lambda e: exec_sql(e, "UPDATE audit SET payload = '{}' WHERE seq = 10"),
        10,
        "edited",
    ),
    (
        "edit kind",
        lambda e: exec_sql(e, "UPDATE audit SET kind = 'operator' WHERE seq = 3"),
        3,
        "edited",
    ),
    (
        "edit time by a microsecond",
        lambda e: exec_sql(e, "UPDATE audit SET time = time + 0.000001 WHERE seq = 7"),
        7,
        "edited",
    ),
    (
        "edit actor",
        lambda e: exec_sql(e, "UPDATE audit SET actor = 'root' WHERE seq = 2"),
        2,
        "edited",
    ),
    (
        "edit workload",
        lambda e: exec_sql(e, "UPDATE audit SET workload = 'other' WHERE seq = 9"),
        9,
        "edited",
    ),
    (
        "null a workload",
        lambda e: exec_sql(e, "UPDATE audit SET workload = NULL WHERE seq = 4"),
        4,
        "edited",
    ),
    (
        "edit correlation id",
        lambda e: exec_sql(e, "UPDATE audit SET correlation_id = 'x' WHERE seq = 6"),
        6,
        "edited",
    ),
    (
        "edit stored hash",
        lambda e: exec_sql(e, "UPDATE audit SET hash = :h WHERE seq = 8", h="a" * 64),
        8,
        "edited",
    ),
    (
        "edit prev_hash",
        lambda e: exec_sql(e, "UPDATE audit SET prev_hash = :h WHERE seq = 8", h="a" * 64),
        8,
        "does not link",
    ),
    ("delete a row", lambda e: exec_sql(e, "DELETE FROM audit WHERE seq = 4"), 4, "missing"),
    (
        "delete the first row",
        lambda e: exec_sql(e, "DELETE FROM audit WHERE seq = 1"),
        1,
        "missing",
    ),
    (
        "delete a range",
        lambda e: exec_sql(e, "DELETE FROM audit WHERE seq BETWEEN 6 AND 8"),
        6,
        "missing",
    ),
    ("swap two rows' payloads", _swap_payloads, 3, "edited"),
    ("swap two rows' positions", _swap_rows, 4, "does not link"),
    (
        "renumber a row into a gap",
        lambda e: exec_sql(e, "UPDATE audit SET seq = 12 WHERE seq = 10"),
        10,
        "missing",
    ),
    (
        "forged row with a wrong prev_hash",
        lambda e: _forge_tail(e, link=False, rehash=True),
        11,
        "does not link",
    ),
    (
        "forged row with a made-up hash",
        lambda e: _forge_tail(e, link=True, rehash=False),
        11,
        "edited",
    ),
    # A rewrite that recomputes the record's own hash is seen at the next record.
    ("rewrite a row and its hash", _replace_row_with_recomputed_hash, 6, "does not link"),
]


@pytest.mark.parametrize(
    ("tamper", "first_bad", "reason"),
    [pytest.param(fn, bad, why, id=name) for name, fn, bad, why in TAMPERING],
)
def test_tampering_is_detected_at_the_first_bad_record(
    engine: Engine, tamper: Callable[[Engine], None], first_bad: int, reason: str
) -> None:
    log = make_log(engine)
    fill(log, 10)
    assert log.verify().ok
    tamper(engine)
    result = log.verify()
    assert not result.ok
    assert result.first_bad_seq == first_bad, result.reason
    assert reason in result.reason
    assert result.checked == first_bad - 1  # everything before it verified


def test_truncating_the_tail_needs_an_anchor(engine: Engine) -> None:
    log = make_log(engine)
    fill(log, 10)
    anchor = log.head()
    assert anchor[0] == 10 and log.verify(anchor=anchor).ok
    exec_sql(engine, "DELETE FROM audit WHERE seq >= 9")
    assert log.verify().ok  # a bare hash chain cannot see a cut end ...
    result = log.verify(anchor=anchor)  # ... a head kept elsewhere can
    assert (result.ok, result.first_bad_seq) == (False, 9)
    assert "removed" in result.reason
    # an anchor naming a record whose hash changed
    fill(log, 2)
    result = log.verify(anchor=anchor)
    assert (result.ok, result.first_bad_seq) == (False, 10)
    assert "anchor" in result.reason


# --- transactions and concurrency ---------------------------------------------------------


def test_append_in_the_callers_transaction(engine: Engine) -> None:
    log = make_log(engine)
    fill(log, 2)
    with pytest.raises(RuntimeError), engine.begin() as conn:
        log.append("decision", "p", {"n": 1}, conn=conn)
        log.append("decision", "p", {"n": 2}, conn=conn)
        raise RuntimeError("the caller's work failed")
    assert log.count() == 2  # rolled back with the caller
    with engine.begin() as conn:
        conn.execute(insert(schema.meta_kv).values(key="k", value="v"))
        entry = log.append("operator", "bob", {"n": 3}, workload="w", conn=conn)
    assert entry.seq == 3
    log.append("config", "carol", {"n": 4})
    assert log.verify().checked == 4
    with engine.connect() as conn:
        assert conn.execute(select(schema.meta_kv.c.value)).scalar_one() == "v"


@pytest.mark.parametrize("in_callers_transaction", [False, True])
def test_lost_race_retries_on_the_new_head(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, in_callers_transaction: bool
) -> None:
    """A writer that read a stale head hits the primary key and retries, keeping the
    caller's other work in the same transaction."""
    log = make_log(engine)
    fill(log, 3)
    real_head = AuditLog._head
    stale = iter([(2, raw_rows(engine)[1]["hash"])])

    def head(conn: Any) -> tuple[int, str]:
        return next(stale, None) or real_head(conn)

    monkeypatch.setattr(AuditLog, "_head", staticmethod(head))
    if in_callers_transaction:
        with engine.begin() as conn:
            conn.execute(insert(schema.meta_kv).values(key="before", value="kept"))
            entry = log.append("decision", "p", {"n": 4}, conn=conn)
    else:
        entry = log.append("decision", "p", {"n": 4})
    assert entry.seq == 4
    assert entry.prev_hash == raw_rows(engine)[2]["hash"]
    assert log.verify().checked == 4
    if in_callers_transaction:
        with engine.connect() as conn:
            assert conn.execute(select(schema.meta_kv.c.value)).scalar_one() == "kept"


def _no_mallory(engine: Engine) -> tuple[str, str]:
    """SQL that makes any record by 'mallory' a (non-sequence) integrity error, and its undo."""
    if engine.dialect.name == "sqlite":
        return ("CREATE TRIGGER no_mallory BEFORE INSERT ON audit WHEN NEW.actor = 'mallory' "
                "BEGIN SELECT RAISE(ABORT, 'mallory may not write'); END",
                "DROP TRIGGER no_mallory")
    return ("ALTER TABLE audit ADD CONSTRAINT no_mallory CHECK (actor <> 'mallory')",
            "ALTER TABLE audit DROP CONSTRAINT no_mallory")


def test_a_real_integrity_error_is_not_retried(engine: Engine) -> None:
    """Only a taken seq is retried; any other constraint failure surfaces at once."""
    add, drop = _no_mallory(engine)
    log = make_log(engine)
    fill(log, 2)
    exec_sql(engine, add)
    try:
        start = time.perf_counter()
        with pytest.raises(IntegrityError):
            log.append("operator", "mallory", {})
        with pytest.raises(IntegrityError), engine.begin() as conn:
            log.append("operator", "mallory", {}, conn=conn)
        # a retry loop on a non-seq integrity error would spin until the timeout
        assert time.perf_counter() - start < 15.0
    finally:
        exec_sql(engine, drop)
    assert log.append("operator", "alice", {}).seq == 3
    assert log.verify().ok


def test_threads_append_without_forking_the_chain(engine: Engine) -> None:
    log = AuditLog(engine)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(25):
                log.append("decision", f"thread-{t}", {"t": t, "i": i})
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert log.verify() == VerifyResult(True, 200, head_seq=200, head_hash=log.head()[1])


WRITER = textwrap.dedent(
    """
    import sys
    from sqlalchemy import create_engine, event
    from mlwe.store.audit import AuditLog

    url, schema_name, proc, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if schema_name:
        engine = create_engine(url, connect_args={"options": f"-csearch_path={schema_name}"})
    else:
        engine = create_engine(url)

        @event.listens_for(engine, "connect")
        def _busy(dbapi_conn, _record):
            dbapi_conn.execute("PRAGMA busy_timeout=10000")

    log = AuditLog(engine)
    log.count()  # connected
    print("ready", flush=True)
    sys.stdin.readline()  # start together
    for i in range(n):
        log.append("decision", f"proc-{proc}", {"proc": proc, "i": i})
    """
)


def test_processes_append_without_forking_the_chain(db: tuple[Engine, str, str]) -> None:
    """Separate processes share no lock: only the primary key on seq keeps one chain."""
    engine, url, schema_name = db
    procs, n = 3, 25
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, url, schema_name, str(p), str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for p in range(procs)
    ]
    for w in writers:  # wait until every writer has imported and connected
        assert w.stdout is not None
        assert w.stdout.readline() == "ready\n", w.stderr.read() if w.stderr else ""
    for w in writers:
        assert w.stdin is not None
        w.stdin.write("go\n")
        w.stdin.flush()
    for w in writers:
        _, err = w.communicate(timeout=60)
        assert w.returncode == 0, err
    log = AuditLog(engine)
    result = log.verify()
    assert result.ok and result.checked == procs * n, result
    seen = sorted((e.data()["proc"], e.data()["i"]) for e in log.entries())
    assert seen == [(p, i) for p in range(procs) for i in range(n)]


# --- speed ---------------------------------------------------------------------------


@functools.cache
def chain_rows(n: int) -> tuple[dict[str, Any], ...]:
    """A valid chain of ``n`` records, built once for both databases."""
    prev, rows = GENESIS_HASH, []
    for seq in range(1, n + 1):
        when = 1_700_000_000.0 + seq * 0.013
        workload, corr = f"w{seq % 977}", f"c{seq}"
        payload = canonical_json({"workload": workload, "reasons": ["fits"], "n": seq})
        h = entry_hash(seq, when, "decision", "fifo", workload, corr, payload, prev)
        rows.append(
            {
                "seq": seq,
                "time": when,
                "kind": "decision",
                "actor": "fifo",
                "workload": workload,
                "correlation_id": corr,
                "payload": payload,
                "prev_hash": prev,
                "hash": h,
            }
        )
        prev = h
    return tuple(rows)


def test_verify_100k_records_streams_in_seconds(engine: Engine) -> None:
    """100k records on SQLite; 20k on PostgreSQL (the same streaming code, less setup)."""
    n = 100_000 if engine.dialect.name == "sqlite" else 20_000
    rows = chain_rows(100_000)[:n]
    with engine.begin() as conn:
        for first in range(0, n, 20_000):
            conn.execute(insert(schema.audit), list(rows[first : first + 20_000]))
    log = AuditLog(engine)
    start = time.perf_counter()
    result = log.verify()
    elapsed = time.perf_counter() - start
    assert result.ok and result.checked == n
    print(f"\nverify {n} records on {engine.dialect.name}: {elapsed:.2f} s")
    # the speed is a figure (printed above), not a test; the chain must verify

    exec_sql(engine, "UPDATE audit SET payload = '{}' WHERE seq = :s", s=12_345)
    assert log.verify().first_bad_seq == 12_345  # in the second batch


def _records(n: int, actor: str = "p") -> list[dict[str, Any]]:
    return [{"kind": "decision", "actor": actor, "payload": {"n": i, "token": "sk-" + "a" * 40},
             "workload": f"w{i}", "correlation_id": f"c{i}"} for i in range(n)]


def test_extend_appends_a_batch_in_the_callers_transaction(engine: Engine) -> None:
    """What a group commit writes: one head read, one statement, the same chain."""
    log = make_log(engine)
    fill(log, 2)
    with pytest.raises(RuntimeError), engine.begin() as conn:
        log.extend(_records(5), conn=conn)
        raise RuntimeError("the caller's work failed")
    assert log.count() == 2
    with engine.begin() as conn:
        conn.execute(insert(schema.meta_kv).values(key="k", value="v"))
        entries = log.extend(_records(5), conn=conn)
    assert [e.seq for e in entries] == [3, 4, 5, 6, 7]
    assert [e.workload for e in entries] == [f"w{i}" for i in range(5)]
    assert all("sk-" not in e.payload for e in entries)  # sanitised like append
    rows = raw_rows(engine)
    assert [r["hash"] for r in rows[2:]] == [e.hash for e in entries]
    assert entries[0].prev_hash == rows[1]["hash"]
    assert log.verify().checked == 7
    with engine.begin() as conn:
        assert log.extend([], conn=conn) == []
        (one,) = log.extend(_records(1), conn=conn)
    assert one.seq == 8 and log.verify().ok


def test_extend_after_a_lost_race_appends_one_by_one(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = make_log(engine)
    fill(log, 3)
    real_head = AuditLog._head
    stale = iter([(2, raw_rows(engine)[1]["hash"])])  # as if seq 3 came from another writer

    def head(conn: Any) -> tuple[int, str]:
        return next(stale, None) or real_head(conn)

    monkeypatch.setattr(AuditLog, "_head", staticmethod(head))
    with engine.begin() as conn:
        conn.execute(insert(schema.meta_kv).values(key="before", value="kept"))
        entries = log.extend(_records(4), conn=conn)
    assert [e.seq for e in entries] == [4, 5, 6, 7]
    assert entries[0].prev_hash == raw_rows(engine)[2]["hash"]
    assert log.verify().checked == 7
    with engine.connect() as conn:
        assert conn.execute(select(schema.meta_kv.c.value)).scalar_one() == "kept"


def test_extend_does_not_retry_a_real_integrity_error(engine: Engine) -> None:
    add, drop = _no_mallory(engine)
    log = make_log(engine)
    fill(log, 2)
    exec_sql(engine, add)
    try:
        batch = [*_records(2), *_records(1, actor="mallory"), *_records(2)]
        with pytest.raises(IntegrityError), engine.begin() as conn:
            log.extend(batch, conn=conn)
        with pytest.raises(IntegrityError), engine.begin() as conn:
            log.extend(_records(1, actor="mallory") + _records(2), conn=conn)
    finally:
        exec_sql(engine, drop)
    assert log.count() == 2 and log.verify().ok
    with engine.begin() as conn:
        assert [e.seq for e in log.extend(_records(2), conn=conn)] == [3, 4]
