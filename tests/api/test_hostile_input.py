"""Hostile requests a submitter may send: each gets a clear 4xx naming what is wrong,
and leaves the store as it was; an accepted one comes back unchanged after a restart."""

from __future__ import annotations

from typing import Any

import pytest

from mlwe.api.auth import Role
from mlwe.store import db
from tests.api.conftest import Api

JSON = {"Content-Type": "application/json"}
YAML = {"Content-Type": "application/yaml"}

#: name -> (body, content type, the field the 422 must name)
BAD_BODIES: dict[str, tuple[bytes, dict[str, str], str]] = {
    "json Infinity deadline": (b'{"name": "a", "deadline": Infinity}', JSON, "Infinity"),
    "json NaN priority": (b'{"name": "a", "min_progress": NaN}', JSON, "NaN"),
    "json 1e400 duration": (b'{"name": "a", "estimated_duration": 1e400}', JSON,
                            "estimated_duration"),
    "json 5000-digit integer": (b'{"name": "a", "priority": ' + b"9" * 5000 + b"}", JSON,
                                "too many digits"),
    "json 400-digit quantity": (b'{"name": "a", "resources": {"memory": "' + b"9" * 400
                                + b'Gi"}}', JSON, "resources.memory"),
    "json huge min_runtime": (b'{"name": "a", "min_runtime": 1e300}', JSON, "min_runtime"),
    "yaml .inf deadline": (b"name: a\ndeadline: .inf\n", YAML, "not a finite number"),
    "yaml 5000-digit integer": (b"name: a\nreplicas: " + b"9" * 5000 + b"\n", YAML,
                                "too many digits"),
    "yaml duplicate key": (b"name: a\nreplicas: 1\nreplicas: 2\n", YAML, "duplicate key"),
    "id with a trailing newline": (b'{"id": "abc\\n", "name": "a"}', JSON, "id"),
    "token-shaped id": (b'{"id": "ghp_' + b"A1b2C3d4E5" * 4 + b'", "name": "a"}', JSON,
                        "credential"),
    "secret glued to a label": (b'{"name": "a", "labels": {"k": "keyAKIAIOSFODNN7EXAMPLE"}}',
                                JSON, "labels.k"),
    "credential in env": (b'{"name": "a", "env": {"DB_PASSWORD": "hunter2"}}', JSON,
                          "env DB_PASSWORD"),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_a_hostile_body_is_a_clear_422_and_stores_nothing(api: Api, case: str) -> None:
    body, headers, field = BAD_BODIES[case]
    before = api.engine.repo.count_workloads()
    r = api.client.post("/api/v1/workloads", content=body,
                        headers={**api.h(Role.SUBMITTER), **headers})
    assert r.status_code == 422, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    assert field in r.text, r.text
    assert api.engine.repo.count_workloads() == before
    assert api.client.get("/readyz").status_code == 200  # nothing wedged


def test_a_hostile_queue_quota_is_refused(api: Api) -> None:
    for quota in ({"gpu": "1e400"}, {"memory": 10**30}, {"cpu": "9" * 400}):
        r = api.client.put("/api/v1/queues/q1", json={"name": "q1", "nominal": quota},
                           headers=api.h(Role.ADMIN))
        assert r.status_code == 422, (quota, r.status_code, r.text)


def test_a_hostile_correlation_id_is_refused(api: Api) -> None:
    for cid in ("has space", "ghp_" + "A1b2C3d4E5" * 4, "-leading"):
        r = api.client.post("/api/v1/workloads", json={"name": "a"},
                            headers={**api.h(Role.SUBMITTER), "X-Correlation-ID": cid})
        assert r.status_code == 422, (cid, r.status_code, r.text)
    assert api.engine.repo.count_workloads() == 0


def _submit(api: Api, body: dict[str, Any], key: str) -> Any:
    return api.client.post("/api/v1/workloads", json=body,
                           headers={**api.h(Role.SUBMITTER), "Idempotency-Key": key})


def test_a_retry_with_the_same_idempotency_key_returns_the_first_answer(api: Api) -> None:
    first = _submit(api, {"name": "no-id"}, "retry-1")
    assert first.status_code == 201
    again = _submit(api, {"name": "no-id"}, "retry-1")
    assert again.status_code == 201 and again.json() == first.json()
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert api.engine.repo.count_workloads() == 1  # no duplicate of the id-less spec
    other = _submit(api, {"name": "something else"}, "retry-1")
    assert other.status_code == 422 and "Idempotency-Key" in other.text
    assert _submit(api, {"name": "no-id"}, "retry-2").status_code == 201  # a new key: new work
    assert api.engine.repo.count_workloads() == 2


def test_a_503_means_nothing_was_stored(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = api.engine
    real = eng.writer.flush

    def down(*a: Any, **k: Any) -> int:
        raise db.StoreUnavailable("database unavailable after 5 attempts: connection refused")

    monkeypatch.setattr(eng.writer, "flush", down)
    r = _submit(api, {"name": "during-outage"}, "outage-1")
    assert r.status_code == 503 and "nothing was stored" in r.json()["detail"]
    with eng.lock:
        assert not any(w.spec.name == "during-outage" for w in eng.cp.workloads.values())
    monkeypatch.setattr(eng.writer, "flush", real)
    r = _submit(api, {"name": "during-outage"}, "outage-1")  # the client's retry
    assert r.status_code == 201
    with eng.lock:
        assert sum(w.spec.name == "during-outage" for w in eng.cp.workloads.values()) == 1


def test_inadmissible_is_said_apart_from_waiting(api: Api) -> None:
    h = api.h(Role.SUBMITTER)
    never = {"id": "never", "name": "never", "resources": {"gpu": 64, "cpu": 1}}
    r = api.client.post("/api/v1/workloads", json=never, headers=h)
    assert r.status_code == 422 and "inadmissible" in r.text
    # admissible when it came; then its queue's quota is lowered below it: inadmissible
    q = {"name": "team", "nominal": {"gpu": 8}}
    assert api.client.put("/api/v1/queues/team", json=q, headers=api.h(Role.ADMIN)).status_code == 200
    api.engine.stop()  # keep it queued: no scheduling cycle runs
    big = {"id": "big", "name": "big", "queue": "team", "resources": {"gpu": 1, "cpu": 1}}
    assert api.client.post("/api/v1/workloads", json=big, headers=h).status_code == 201
    q = {"name": "team", "nominal": {"gpu": 0}}
    assert api.client.put("/api/v1/queues/team", json=q, headers=api.h(Role.ADMIN)).status_code == 200
    detail = api.client.get("/api/v1/workloads/big", headers=h).json()
    assert detail["condition"] == "inadmissible" and detail["inadmissible_reasons"]
    why = api.client.get("/api/v1/workloads/big/explain", headers=h).json()
    assert why["condition"] == "inadmissible" and "inadmissible" in why["summary"]
    q = {"name": "team", "nominal": {"gpu": 8}}
    assert api.client.put("/api/v1/queues/team", json=q, headers=api.h(Role.ADMIN)).status_code == 200
    listed = api.client.get("/api/v1/workloads", headers=h).json()["items"]
    assert [w["condition"] for w in listed if w["id"] == "big"] == ["waiting"]
