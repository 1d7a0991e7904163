"""Auth: every route declares a role, and every route refuses a missing, malformed,
revoked or under-privileged token; tokens are stored only as hashes."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Annotated

import pytest
from fastapi import FastAPI
from sqlalchemy import select

from mlwe.api import PUBLIC_PATHS, route_roles
from mlwe.api.app import _check_roles
from mlwe.api.auth import Principal, Role, TokenStore, requires
from mlwe.store.schema import api_tokens
from tests.api.conftest import Api

# path parameters for calling each route; ids that do not exist are fine: auth comes first
PARAMS = {
    "workload_id": "no-such-workload",
    "node": "a100-0",
    "queue": "default",
    "approval_id": "no-such-plan",
    "event_id": "no-such-event",
    "name": "urgent-fine-tune",
    "token_id": "nosuchtoken0",
    "run_id": "no-such-run",
}


def _fill(path: str) -> str:
    return re.sub(r"{(\w+)}", lambda m: PARAMS[m.group(1)], path)


def _call(api: Api, method: str, path: str, headers: dict[str, str]) -> int:
    kw: dict[str, object] = {"headers": headers}
    if method in ("POST", "PUT"):
        kw["json"] = {}
    # (a granted stream never ends: the matrix only calls /streams where it must be refused;
    # granted streams are exercised in test_sse)
    return api.client.request(method, _fill(path), **kw).status_code  # type: ignore[arg-type]


def test_every_route_declares_a_role_or_is_public(api: Api) -> None:
    roles = route_roles(api.svc.app)
    assert len(roles) >= 35
    public = sorted(p for _, p, r in roles if r is None)
    assert set(public) <= PUBLIC_PATHS, public
    assert set(public) == {"/", "/healthz", "/readyz"}


def test_the_matrix_covers_every_route_in_the_openapi_schema(api: Api) -> None:
    schema = api.client.get("/openapi.json").json()
    documented = {(m.upper(), p) for p, ops in schema["paths"].items() for m in ops}
    enumerated = {(m, p) for m, p, _ in route_roles(api.svc.app)}
    assert documented <= enumerated, documented - enumerated
    # and every documented route says which role it needs (401/403 documented)
    for p, ops in schema["paths"].items():
        for m, op in ops.items():
            if p not in PUBLIC_PATHS:
                assert {"401", "403"} <= set(op["responses"]), (m, p)


def test_every_route_refuses_a_missing_or_underprivileged_token(api: Api) -> None:
    checked = 0
    for method, path, role in route_roles(api.svc.app):
        if role is None:
            assert _call(api, method, path, {}) == 200, (method, path)
            continue
        # no token at all
        assert _call(api, method, path, {}) == 401, (method, path, "no token")
        # a malformed header, a token that was never issued, the wrong scheme
        for headers in (
            {"Authorization": "Bearer"},
            {"Authorization": "Bearer mlwe_aaaaaaaaaaaa_" + "x" * 43},
            {"Authorization": f"Basic {api.tokens[Role.ADMIN]}"},
        ):
            assert _call(api, method, path, headers) == 401, (method, path, headers)
        # every role below the one declared
        for lower in Role:
            if lower < role:
                assert _call(api, method, path, api.h(lower)) == 403, (method, path, lower)
        # the declared role itself gets past auth (whatever the route then answers)
        if not path.endswith("/streams"):
            assert _call(api, method, path, api.h(role)) not in (401, 403), (method, path, role)
        checked += 1
    assert checked >= 32


def test_the_stream_route_refuses_missing_and_bad_tokens(api: Api) -> None:
    r = api.client.get("/api/v1/streams")
    assert r.status_code == 401
    r = api.client.get("/api/v1/streams", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401


def test_an_app_with_an_unguarded_route_is_refused() -> None:
    app = FastAPI()

    @app.get("/api/v1/guarded")
    def guarded(principal: Annotated[Principal, requires(Role.VIEWER)]) -> int:
        return 1

    _check_roles(app)  # fine so far

    @app.get("/api/v1/forgotten")
    def forgotten() -> int:
        return 2

    with pytest.raises(RuntimeError, match="/api/v1/forgotten"):
        _check_roles(app)


def test_tokens_are_stored_only_as_hashes(api: Api, tmp_path: Path) -> None:
    token = api.tokens[Role.OPERATOR]
    store = api.svc.tokens
    with store.engine.connect() as c:
        rows = c.execute(select(api_tokens.c.token_hash, api_tokens.c.role)).all()
    assert (hashlib.sha256(token.encode()).hexdigest(), "operator") in rows
    # the secret appears nowhere in the database files
    secret = token.split("_", 2)[2].encode()  # the secret may itself contain "_"
    assert len(secret) >= 32
    for f in tmp_path.rglob("mlwe.db*"):
        assert secret not in f.read_bytes(), f


def test_revoked_tokens_stop_working(api: Api) -> None:
    headers = api.h(Role.VIEWER)
    assert api.client.get("/api/v1/whoami", headers=headers).json()["role"] == "viewer"
    tid = api.client.get("/api/v1/whoami", headers=headers).json()["token_id"]
    r = api.client.delete(f"/api/v1/tokens/{tid}", headers=api.h(Role.ADMIN))
    assert r.status_code == 200
    assert api.client.get("/api/v1/whoami", headers=headers).status_code == 401


def test_admin_creates_tokens_over_the_api_and_they_carry_their_role(api: Api) -> None:
    r = api.client.post("/api/v1/tokens", json={"name": "ci-bot", "role": "submitter"}, headers=api.h(Role.ADMIN))
    assert r.status_code == 201, r.text
    body = r.json()
    me = api.client.get("/api/v1/whoami", headers={"Authorization": f"Bearer {body['token']}"}).json()
    assert me == {
        "token_id": body["id"], "name": "ci-bot", "role": "submitter", "subject": body["id"],
        "policy": {"queues": None, "max_priority": None, "max_priority_class": None, "allow_protected": True},
    }
    listed = api.client.get("/api/v1/tokens", headers=api.h(Role.ADMIN)).json()["items"]
    assert all("token" not in t for t in listed)  # never the secret again
    r = api.client.post("/api/v1/tokens", json={"name": "x", "role": "root"}, headers=api.h(Role.ADMIN))
    assert r.status_code == 422 and r.json()["errors"][0]["path"] == "body.role"
    assert "'viewer', 'submitter', 'operator' or 'admin'" in r.json()["errors"][0]["message"]


def test_a_submitter_cancels_only_its_own_workloads(api: Api) -> None:
    c = api.client
    other = api.svc.tokens.create("someone-else", Role.SUBMITTER)[0]
    r = c.post("/api/v1/workloads", json={"id": "mine", "name": "mine", "resources": {"cpu": 1}}, headers=api.h(Role.SUBMITTER))
    assert r.status_code == 201, r.text
    r = c.post("/api/v1/workloads/mine/cancel", headers={"Authorization": f"Bearer {other}"})
    assert r.status_code == 403 and "submitter-user" in r.json()["detail"]
    assert api.engine.cp.workloads["mine"].state.value != "cancelled"
    r = c.post("/api/v1/workloads/mine/cancel", headers=api.h(Role.SUBMITTER))
    assert r.status_code == 200, r.text


def test_operators_may_cancel_any_workload(api: Api) -> None:
    c = api.client
    c.post("/api/v1/workloads", json={"id": "theirs", "name": "t", "resources": {"cpu": 1}}, headers=api.h(Role.SUBMITTER))
    r = c.post("/api/v1/workloads/theirs/cancel", headers=api.h(Role.OPERATOR))
    assert r.status_code == 200, r.text


def test_token_names_and_roles_are_validated(api: Api) -> None:
    store: TokenStore = api.svc.tokens
    with pytest.raises(ValueError, match="token name"):
        store.create("<script>", Role.VIEWER)
    with pytest.raises(ValueError, match="unknown role"):
        Role.parse("superuser")
    assert store.verify("not-a-token") is None
