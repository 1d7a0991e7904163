"""Whatever the engine accepts survives store -> restart -> recover unchanged, and a
record it cannot read back never stops it from starting (it is quarantined).

The property is checked on SQLite and on the real PostgreSQL, with hypothesis
generating specs full of what breaks naive stores: token-shaped ids and names,
unicode, control characters, maximum lengths, extreme numbers. A spec is
either refused at the edge or stored exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from sqlalchemy import Engine as SqlEngine
from sqlalchemy import text
from typer.testing import CliRunner

from mlwe.core.clock import ManualClock
from mlwe.core.cluster import build_control_plane
from mlwe.core.spec import WorkloadSpec
from mlwe.runtime import Engine, LiveSimBackend
from mlwe.store import db
from mlwe.store.recovery import recover
from mlwe.store.repository import Repository
from tests.runtime.test_engine import cluster, job

TOKENS = [
    "ghp_" + "A1b2C3d4E5" * 4,
    "AKIAIOSFODNN7EXAMPLE",
    "sk-proj-" + "Ab1Cd2Ef3Gh4Ij5Kl6Mn7Op8",
    "xoxb-123456789012-abcdefABCDEF",
    "hf_" + "aB3" * 12,
    "glpat-" + "x1Y2z3" * 4,
]
ID = st.one_of(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", fullmatch=True),
    st.sampled_from(TOKENS),
    st.text(max_size=140),
)
TEXT = st.one_of(
    st.text(min_size=1, max_size=200),
    st.sampled_from(TOKENS).map(lambda t: f"job {t}"),
    st.just("x" * 200),
    st.sampled_from(["é🚀名", "DB_PASSWORD=hunter2", "a\u0000b", "line\nbreak", "—"]),
)
NUMBER = st.one_of(
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["1e400", "9" * 50, "16Gi", "1h30m", "500m", "0.5"]),
)
SPEC = st.fixed_dictionaries(
    {"id": ID, "name": TEXT},
    optional={
        "queue": ID,
        "priority": st.one_of(st.integers(0, 1_000_000), NUMBER),
        "replicas": st.integers(1, 3),
        "resources": st.fixed_dictionaries({}, optional={"cpu": NUMBER, "memory": NUMBER}),
        "estimated_duration": NUMBER,
        "deadline_in": NUMBER,
        "min_runtime": NUMBER,
        "labels": st.dictionaries(ID, TEXT, max_size=3),
        "command": st.lists(TEXT, max_size=3).map(tuple),
        "env": st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,10}", fullmatch=True), TEXT,
                               max_size=2),
    },
)


ACCEPTED: list[int] = []  # how many specs each example stored (the property is not vacuous)


def _engine_on(sql: SqlEngine) -> Engine:
    db.migrate(sql)
    clock = ManualClock(1000.0)
    repo = Repository(sql, health=db.Health())
    return Engine(build_control_plane(cluster(), clock), LiveSimBackend(clock), repo,
                  clock=clock, synced=False)


def _check_roundtrip(sql: SqlEngine, docs: list[dict[str, Any]]) -> None:
    eng = _engine_on(sql)
    accepted: dict[str, dict[str, Any]] = {}
    for doc in docs:
        try:
            spec = WorkloadSpec.model_validate(doc)
        except (ValidationError, ValueError):
            continue  # refused at the edge, as an HTTP client would be (422)
        result = eng.submit([spec], actor="prop")
        if result.accepted:
            [wid] = result.created
            accepted[wid] = spec.model_dump(mode="json")
    eng.close()
    ACCEPTED.append(len(accepted))
    again = recover(Repository(sql, health=db.Health()), ManualClock(2000.0), quarantined=[])
    got = {wid: again.workloads[wid].spec.model_dump(mode="json") for wid in accepted}
    assert got == accepted
    for spec in got.values():  # and nothing non-finite was stored
        assert all(not isinstance(v, float) or math.isfinite(v) for v in spec.values())


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(docs=st.lists(SPEC, min_size=1, max_size=6))
def test_what_is_accepted_comes_back_unchanged(backend: str, docs: list[dict[str, Any]],
                                               tmp_path_factory: pytest.TempPathFactory,
                                               request: pytest.FixtureRequest) -> None:
    if backend == "sqlite":
        sql = db.make_engine(f"sqlite:///{tmp_path_factory.mktemp('rt') / 'mlwe.db'}")
        try:
            _check_roundtrip(sql, docs)
        finally:
            sql.dispose()
    else:
        make = request.getfixturevalue("pg_schema")
        _check_roundtrip(make(), docs)


def test_the_property_stored_something() -> None:
    assert sum(ACCEPTED) > 0, "no generated spec was ever accepted: the round trip tested nothing"


def test_token_shaped_identity_fields_are_refused_not_altered(tmp_path: Path) -> None:
    eng = Engine.open(cluster(), data_dir=tmp_path)
    for t in TOKENS:
        for field in ("id", "name", "queue"):
            doc = {"id": "w-ok", "name": "ok", field: t}
            r = eng.submit([WorkloadSpec.model_validate(doc)])
            assert not r.accepted and "credential" in " ".join(r.reasons()), (field, t)
    long_name = "x" * 180 + " " + TOKENS[0][:19]  # redaction would have made it longer
    assert eng.submit([job("long").model_copy(update={"name": long_name})]).accepted
    eng.close()
    again = Engine.open(cluster(), data_dir=tmp_path)  # starts, and the name is intact
    assert again.cp.workloads["long"].spec.name == long_name and not again.quarantined
    again.close()


def test_an_unreadable_record_is_quarantined_and_the_rest_comes_back(tmp_path: Path) -> None:
    eng = Engine.open(cluster(), data_dir=tmp_path)
    assert eng.submit([job("good"), job("bad"), job("also-good", gpu=0)]).accepted
    eng.close()
    sql = db.make_engine(db.database_url(tmp_path))
    with sql.begin() as c:  # what an older version (or a damaged disk) may leave behind
        c.execute(text("UPDATE workloads SET spec = :s WHERE id = 'bad'"),
                  {"s": json.dumps({"name": "bad", "resources": {"gpu": "1e400"}})})
        c.execute(text("INSERT INTO queues (name, spec) VALUES ('q-broken', '{not json')"))
    sql.dispose()
    again = Engine.open(cluster(), data_dir=tmp_path)
    assert set(again.cp.workloads) == {"good", "also-good"}
    assert sorted((q.table, q.key) for q in again.quarantined) == [
        ("queue", "q-broken"), ("workload", "bad")]
    assert again.health()["quarantined"] and "bad" in " ".join(again.health()["quarantined"])
    audit = [e.data() for e in again.audit.show(kind="config", limit=None)]
    assert any(d.get("event") == "quarantine" for d in audit)
    assert again.submit([job("after")]).accepted
    again.close()
    third = Engine.open(cluster(), data_dir=tmp_path)  # quarantined once, not again
    assert not third.quarantined and "after" in third.cp.workloads
    third.close()

    from mlwe.cli import app

    runner = CliRunner()
    listed = runner.invoke(app, ["quarantine", "list", "--json", "--data-dir", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.output)
    assert sorted(r["key"] for r in rows) == ["bad", "q-broken"]
    bad = next(r["id"] for r in rows if r["key"] == "bad")
    shown = runner.invoke(app, ["quarantine", "show", str(bad), "--data-dir", str(tmp_path)])
    assert shown.exit_code == 0 and "1e400" in shown.output
    dropped = runner.invoke(app, ["quarantine", "drop", str(bad), "--data-dir", str(tmp_path)])
    assert dropped.exit_code == 0, dropped.output
    listed = runner.invoke(app, ["quarantine", "list", "--json", "--data-dir", str(tmp_path)])
    assert [r["key"] for r in json.loads(listed.output)] == ["q-broken"]
