"""What the server enforces, the schema declares (and the edges schemathesis found)."""

from __future__ import annotations

import pytest

from mlwe.api.auth import Role
from tests.api.conftest import Api


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("OPTIONS", "/api/v1/workloads", "GET, POST"),
        ("DELETE", "/api/v1/workloads", "GET, POST"),
        ("OPTIONS", "/api/v1/tokens", "GET, POST"),
        ("PUT", "/api/v1/workloads/validate", "POST"),  # the concrete path, not /workloads/{id}
        ("DELETE", "/api/v1/workloads/w1", "GET"),
        ("GET", "/api/v1/tokens/abc", "DELETE"),
    ],
)
def test_a_405_lists_every_method_of_the_path(api: Api, method: str, path: str, allow: str) -> None:
    r = api.client.request(method, path, headers=api.h(Role.ADMIN))
    assert r.status_code == 405
    assert r.headers["allow"] == allow
    assert r.json()["detail"] == f"method {method} not allowed here; allowed: {allow}"


@pytest.mark.parametrize("content_type", ["application/json", "application/yaml", None])
def test_validate_without_a_body_is_a_422(api: Api, content_type: str | None) -> None:
    headers = {**api.h(Role.SUBMITTER), **({"Content-Type": content_type} if content_type else {})}
    r = api.client.post("/api/v1/workloads/validate", content=b"  \n", headers=headers)
    assert r.status_code == 422
    assert r.json()["errors"][0]["path"] == "body" and "empty body" in r.json()["errors"][0]["message"]


@pytest.mark.parametrize(
    ("path", "param", "value", "ok"),
    [
        ("/api/v1/workloads", "state", "running, pending", True),
        ("/api/v1/workloads", "state", ",,", True),
        ("/api/v1/workloads", "state", "running,sleeping", False),
        ("/api/v1/streams/recent", "topics", " state , audit", True),
        ("/api/v1/streams/recent", "topics", ",", True),  # nothing named: every topic
        ("/api/v1/streams/recent", "topics", "state,gossip", False),
    ],
)
def test_list_parameters_follow_their_declared_pattern(
    api: Api, path: str, param: str, value: str, ok: bool
) -> None:
    r = api.client.get(path, params={param: value}, headers=api.h(Role.VIEWER))
    if ok:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 422
    (err,) = r.json()["errors"]
    assert err["path"] == f"query.{param}"
    assert ("'sleeping'" if param == "state" else "'gossip'") in err["message"]
    schema = api.client.get("/openapi.json").json()
    (p,) = [q for q in schema["paths"][path]["get"]["parameters"] if q["name"] == param]
    pattern = p["schema"].get("pattern") or next(a["pattern"] for a in p["schema"]["anyOf"] if "pattern" in a)
    assert "running" in pattern or "telemetry" in pattern


def test_the_agent_mode_and_token_role_are_enums_in_the_schema(api: Api) -> None:
    comps = api.client.get("/openapi.json").json()["components"]["schemas"]
    assert comps["AgentModeIn"]["properties"]["mode"]["enum"] == ["autonomous", "approve", "observe"]
    assert comps["TokenCreateIn"]["properties"]["role"]["enum"] == ["viewer", "submitter", "operator", "admin"]
    assert "QueueSpecBody" in comps and "name" not in comps["QueueSpecBody"].get("required", [])
