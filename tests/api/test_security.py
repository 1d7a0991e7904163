"""Security at the edge: body size limits, the submit rate limit, strict CORS, security
headers, hostile bodies (YAML aliases, deep nesting, wrong types), and no secrets in
responses, audit records or streams."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlwe.api.auth import Role
from mlwe.api.context import ApiSettings
from mlwe.api.security import CONTENT_SECURITY_POLICY, RateLimiter
from tests.api.conftest import Api, make_api

S, V = Role.SUBMITTER, Role.VIEWER


@pytest.fixture
def strict(tmp_path: Path) -> Iterator[Api]:
    a = make_api(
        tmp_path,
        ApiSettings(max_body_bytes=2000, submit_rate_per_s=0.01, submit_burst=3,
                    cors_origins=("https://ops.example.com",)),
    )
    try:
        yield a
    finally:
        a.svc.close()


def _job(wid: str) -> dict[str, object]:
    return {"id": wid, "name": wid, "resources": {"cpu": 1}}


def test_bodies_over_the_limit_are_refused_declared_or_streamed(strict: Api) -> None:
    big = json.dumps([_job(f"w{i}") for i in range(100)]).encode()
    assert len(big) > 2000
    r = strict.client.post("/api/v1/workloads", content=big,
                           headers={**strict.h(S), "Content-Type": "application/json"})
    assert r.status_code == 413 and "limit is 2000" in r.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer
        for i in range(0, len(big), 500):
            yield big[i : i + 500]

    r = strict.client.post("/api/v1/workloads", content=chunks(),
                           headers={**strict.h(S), "Content-Type": "application/json"})
    assert r.status_code == 413
    assert not strict.engine.cp.workloads  # nothing got in
    small = json.dumps(_job("fits")).encode()

    def small_chunks() -> Iterator[bytes]:
        yield small[:10]
        yield small[10:]

    r = strict.client.post("/api/v1/workloads", content=small_chunks(),
                           headers={**strict.h(S), "Content-Type": "application/json"})
    assert r.status_code == 201, r.text


def test_submissions_are_rate_limited_per_token_and_refused_ones_store_nothing(strict: Api) -> None:
    c = strict.client
    assert c.post("/api/v1/workloads", json=[_job("r1"), _job("r2")], headers=strict.h(S)).status_code == 201
    assert c.post("/api/v1/workloads", json=_job("r3"), headers=strict.h(S)).status_code == 201
    r = c.post("/api/v1/workloads", json=_job("r4"), headers=strict.h(S))
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert "r4" not in strict.engine.cp.workloads
    # another token has its own bucket
    assert c.post("/api/v1/workloads", json=_job("r5"), headers=strict.h(Role.OPERATOR)).status_code == 201
    # a batch bigger than a burst can never pass, and says so
    r = c.post("/api/v1/workloads", json=[_job(f"b{i}") for i in range(4)], headers=strict.h(Role.ADMIN))
    assert r.status_code == 429 and "bursts of 3" in r.json()["detail"]


def test_rate_limiter_refills_at_its_rate() -> None:
    now = [0.0]
    lim = RateLimiter(rate=2.0, burst=2, clock=lambda: now[0])
    assert lim.take("k") == 0.0 and lim.take("k") == 0.0
    assert lim.take("k") == pytest.approx(0.5)
    now[0] += 0.5
    assert lim.take("k") == 0.0
    assert lim.take("other") == 0.0


def test_cors_allows_only_the_configured_origin(strict: Api, api: Api) -> None:
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    r = strict.client.options("/api/v1/workloads", headers={"Origin": "https://ops.example.com", **pre})
    assert r.headers.get("access-control-allow-origin") == "https://ops.example.com"
    r = strict.client.options("/api/v1/workloads", headers={"Origin": "https://evil.example", **pre})
    assert "access-control-allow-origin" not in r.headers
    r = strict.client.get("/api/v1/whoami", headers={"Origin": "https://evil.example", **strict.h(V)})
    assert "access-control-allow-origin" not in r.headers
    # by default no cross-origin reader at all
    r = api.client.get("/api/v1/whoami", headers={"Origin": "https://ops.example.com", **api.h(V)})
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("path", ["/", "/static/app.js", "/api/v1/whoami", "/api/v1/nodes", "/healthz"])
def test_security_headers_everywhere(api: Api, path: str) -> None:
    for headers in ({}, api.h(V)):  # on refusals too
        r = api.client.get(path, headers=headers)
        assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["referrer-policy"] == "no-referrer"
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe-inline" not in CONTENT_SECURITY_POLICY


def test_the_dashboard_loads_nothing_from_elsewhere(api: Api) -> None:
    html = api.client.get("/").text
    for asset in ("static/app.js", "static/style.css"):
        assert asset in html and api.client.get("/" + asset).status_code == 200
    assert "http://" not in html and "https://" not in html
    js = api.client.get("/static/app.js").text
    assert "innerHTML" not in js and "eval(" not in js and "https://" not in js


def test_hostile_bodies_get_clear_errors(api: Api) -> None:
    h = {**api.h(S)}
    bomb = "a: &a [x, x]\nb: &b [*a, *a]\nname: *b\n"
    r = api.client.post("/api/v1/workloads", content=bomb, headers={**h, "Content-Type": "application/yaml"})
    assert r.status_code == 422 and "aliases" in r.json()["errors"][0]["message"]
    r = api.client.post("/api/v1/workloads", content="[" * 5000 + "]" * 5000,
                        headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 422
    r = api.client.post("/api/v1/workloads", content="{not json", headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 422 and "invalid JSON" in r.json()["errors"][0]["message"]
    r = api.client.post("/api/v1/workloads", content=b"<xml/>", headers={**h, "Content-Type": "application/xml"})
    assert r.status_code == 415
    r = api.client.post("/api/v1/workloads", content=b"\xff\xfe", headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 422 and "UTF-8" in r.json()["errors"][0]["message"]
    r = api.client.post("/api/v1/workloads", json=[1, "two"], headers=h)
    assert r.status_code == 422 and r.json()["errors"][0]["path"] == "[0]"
    assert not api.engine.cp.workloads


def test_no_secrets_in_responses_audit_or_streams(api: Api) -> None:
    secret = "s3cr3t-Value-0123456789abcdef"
    spec = {"id": "leaky", "name": "leaky", "resources": {"cpu": 1},
            "env": {"AWS_SECRET_ACCESS_KEY": secret, "HF_TOKEN": secret},
            "command": ["train", f"--password={secret}"], "labels": {"api_key": secret}}
    # refused over HTTP as through every other door (it could not be stored as sent, so it
    # could not resume as sent): the answer names each field, never the value
    r = api.client.post("/api/v1/workloads", json=spec, headers=api.h(S))
    assert r.status_code == 422, r.text
    assert secret not in r.text
    for field in ("labels.api_key", "command[1]", "env AWS_SECRET_ACCESS_KEY", "env HF_TOKEN"):
        assert field in r.text, field
    # a name glued to a secret, a secret in a correlation id: refused too, nothing echoed
    glued = {"id": "glued", "name": "keyAKIAIOSFODNN7EXAMPLE", "resources": {"cpu": 1}}
    r = api.client.post("/api/v1/workloads", json=glued, headers=api.h(S))
    assert r.status_code == 422 and "AKIAIOSFODNN7EXAMPLE" not in r.text
    assert api.client.post("/api/v1/workloads", json={"name": "a"}, headers={
        **api.h(S), "X-Correlation-ID": "ghp_" + "A1b2C3d4E5" * 4}).status_code == 422
    for path in ("/api/v1/workloads/leaky", "/api/v1/workloads", "/api/v1/cluster", "/api/v1/audit",
                 "/api/v1/streams/recent", "/api/v1/decisions?workload=leaky"):
        body = api.client.get(path, headers=api.h(Role.ADMIN)).text
        assert secret not in body and "AKIAIOSFODNN7EXAMPLE" not in body, path
    assert api.engine.repo.count_workloads() == 0


def test_a_script_name_is_data_not_markup(api: Api) -> None:
    name = "<script>alert('x')</script>"
    r = api.client.post("/api/v1/workloads", json={"id": "xss", "name": name, "resources": {"cpu": 1}},
                        headers=api.h(S))
    assert r.status_code == 201
    r = api.client.get("/api/v1/workloads/xss", headers=api.h(V))
    assert r.headers["content-type"].startswith("application/json") and r.json()["name"] == name
