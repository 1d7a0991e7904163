"""The API on PostgreSQL (``mlwe serve --database-url postgresql://...``): tokens, durable
submissions, the audit chain and the reasoning history, in a fresh schema per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from mlwe.api.auth import Role
from mlwe.api.serve import build_service
from tests.api.conftest import SMALL_CLUSTER
from tests.store.conftest import PG_URL, require_postgres


@pytest.fixture
def pg_url() -> Iterator[str]:
    require_postgres()
    admin = create_engine(PG_URL)
    schema = f"mlweapi_{uuid.uuid4().hex[:10]}"
    with admin.begin() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in PG_URL else "?"
    try:
        yield f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as c:
            c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def test_the_api_on_postgresql(pg_url: str) -> None:
    svc = build_service(database_url=pg_url, cluster=SMALL_CLUSTER, speed=20, generator=False,
                        agent=False, create_admin=True)
    try:
        assert svc.admin_token is not None
        c = TestClient(svc.app)
        h = {"Authorization": f"Bearer {svc.admin_token}"}
        r = c.post("/api/v1/workloads", json={"id": "p1", "name": "p1", "resources": {"cpu": 1}}, headers=h)
        assert r.status_code == 201, r.text
        assert svc.engine.repo.count_workloads() == 1
        assert c.get("/api/v1/workloads/p1", headers=h).json()["owner"] == "admin"
        made = c.post("/api/v1/tokens", json={"name": "ro", "role": "viewer"}, headers=h).json()
        viewer = {"Authorization": f"Bearer {made['token']}"}
        assert c.get("/api/v1/whoami", headers=viewer).json()["role"] == "viewer"
        assert c.post("/api/v1/workloads/p1/cancel", headers=viewer).status_code == 403
        v = c.get("/api/v1/audit/verify", headers=viewer).json()
        assert v["ok"] and v["checked"] >= 3
        svc.engine.record_reasoning({"type": "agent-decision", "workload": "p1"}, correlation_id="c1")
        items = c.get("/api/v1/reasoning", headers=viewer).json()["items"]
        assert [i["workload"] for i in items] == ["p1"]
    finally:
        svc.close()
    # a second start on the same database finds the admin token and the workload
    svc = build_service(database_url=pg_url, cluster=SMALL_CLUSTER, generator=False, agent=False,
                        start_loop=False)
    try:
        assert svc.admin_token is None and "p1" in svc.engine.cp.workloads
        assert any(t.role is Role.ADMIN for t in svc.tokens.list())
    finally:
        svc.close()
