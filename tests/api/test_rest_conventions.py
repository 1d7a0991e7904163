"""One REST convention (issue 16): unknown query parameters are a 400 naming them, every
list has a cursor, times come as RFC 3339 next to engine seconds, and node resources
also come as quantities written as in specs."""

from __future__ import annotations

import re

import pytest

from mlwe.api.auth import Role
from tests.api.conftest import Api, wait_for

V = Role.VIEWER


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        ("/api/v1/workloads?stat=running", "stat"),
        ("/api/v1/audit?limit=5&workld=x", "workld"),
        ("/api/v1/nodes?x=1", "x"),
        ("/api/v1/streams/recent?topic=state", "topic"),
    ],
)
def test_an_unknown_query_parameter_is_a_400_naming_it(api: Api, path: str, bad: str) -> None:
    r = api.client.get(path, headers=api.h(V))
    assert r.status_code == 400, r.text
    body = r.json()
    assert bad in body["detail"] and body["errors"][0]["path"] == f"query.{bad}"
    if bad == "stat":
        assert "did you mean 'state'?" in body["errors"][0]["message"]


def test_the_dashboard_page_takes_any_query(api: Api) -> None:
    assert api.client.get("/?filter=x").status_code == 200


def test_lists_have_cursors_and_times_come_as_rfc3339(api: Api) -> None:
    for i in range(3):
        r = api.client.post("/api/v1/workloads", json={"id": f"r{i}", "name": f"r{i}", "resources": {"cpu": 1}},
                            headers=api.h(Role.SUBMITTER))
        assert r.status_code == 201
    page = api.client.get("/api/v1/workloads?limit=2", headers=api.h(V)).json()
    assert page["next_offset"] == 2 and len(page["items"]) == 2
    last = api.client.get("/api/v1/workloads?limit=2&offset=2", headers=api.h(V)).json()
    assert last["next_offset"] is None and [w["id"] for w in last["items"]] == ["r0"]
    w = page["items"][0]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", w["submitted_at"])

    assert wait_for(lambda: len(api.client.get("/api/v1/decisions?kind=place", headers=api.h(V)).json()["items"]) == 3)
    first = api.client.get("/api/v1/decisions?kind=place&after_seq=0&limit=2", headers=api.h(V)).json()
    assert len(first["items"]) == 2 and first["items"][0]["at"].endswith("Z")
    rest = api.client.get(f"/api/v1/decisions?kind=place&after_seq={first['next_after_seq']}",
                          headers=api.h(V)).json()
    assert [d["workload"] for d in first["items"] + rest["items"]] == ["r0", "r1", "r2"]

    audit = api.client.get("/api/v1/audit?limit=3", headers=api.h(V)).json()
    assert audit["next_after_seq"] == audit["items"][-1]["seq"] and audit["items"][-1]["at"].endswith("Z")
    newer = api.client.get(f"/api/v1/audit?after_seq={audit['next_after_seq']}", headers=api.h(V)).json()
    assert all(e["seq"] > audit["next_after_seq"] for e in newer["items"])
    detail = api.client.get("/api/v1/workloads/r0", headers=api.h(V)).json()
    assert detail["history"][0]["at"].endswith("Z")


def test_nodes_give_their_resources_as_in_specs(api: Api) -> None:
    n = api.client.get("/api/v1/nodes/a100-0", headers=api.h(V)).json()
    assert n["quantities"]["capacity"] == {"gpu": "4", "cpu": "32", "memory": "256Gi", "vram": "320Gi"}
    assert n["capacity"]["gpu"] == 4000  # the integer units stay, for existing clients
