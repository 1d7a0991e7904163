"""Tenancy: ownership by subject (never by token name), per-token admission policy
(queues, highest priority, protected), and correlation ids scoped per subject."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any

import pytest

from mlwe.api.auth import Principal, Role, TokenPolicy, policy_denials
from mlwe.api.models import TokenCreateIn
from mlwe.core.spec import DEFAULT_PRIORITY_CLASSES, WorkloadSpec
from tests.api.conftest import Api


def _h(token: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", **extra}


def _job(wid: str, **kw: Any) -> dict[str, Any]:
    return {"id": wid, "name": wid, "resources": {"cpu": 1}, "estimated_duration": "1h", **kw}


# ========================================================= ownership by subject
@dataclass(frozen=True)
class OwnerCase:
    name: str
    second: str  # how the second token comes to be: "same-name" | "reissued" | "other-name"
    revoke_first: bool


OWNER_CASES = [
    OwnerCase("a second token with the same name", "same-name", revoke_first=False),
    OwnerCase("a token re-issued under a revoked name", "same-name", revoke_first=True),
    OwnerCase("a token with another name", "other-name", revoke_first=False),
]


@pytest.mark.parametrize("case", OWNER_CASES, ids=lambda c: c.name)
def test_only_the_submitting_subject_may_cancel(api: Api, case: OwnerCase) -> None:
    store = api.svc.tokens
    first, first_info = store.create("alice", Role.SUBMITTER)
    r = api.client.post("/api/v1/workloads", json=_job("alices-job"), headers=_h(first))
    assert r.status_code == 201, r.text
    if case.revoke_first:
        store.revoke(first_info.id)
    second, second_info = store.create("alice" if case.second == "same-name" else "bob", Role.SUBMITTER)
    assert second_info.id != first_info.id
    w = api.client.get("/api/v1/workloads/alices-job", headers=_h(second)).json()
    assert w["owner"] == "alice" and w["owner_subject"] == first_info.id
    r = api.client.post("/api/v1/workloads/alices-job/cancel", headers=_h(second))
    assert r.status_code == 403, r.text
    assert first_info.id in r.json()["detail"]
    assert api.engine.cp.workloads["alices-job"].state.value not in ("cancelled", "stopping")
    if not case.revoke_first:  # the holder itself still may
        r = api.client.post("/api/v1/workloads/alices-job/cancel", headers=_h(first))
        assert r.status_code == 200, r.text


def test_a_workload_owned_by_name_only_is_for_operators(api: Api) -> None:
    # stored before subjects existed: only the name label; no token may claim it by name
    spec = WorkloadSpec.model_validate(_job("legacy", labels={"mlwe.io/owner": "alice"}))
    assert api.engine.submit([spec], actor="test").accepted
    alice, _ = api.svc.tokens.create("alice", Role.SUBMITTER)
    r = api.client.post("/api/v1/workloads/legacy/cancel", headers=_h(alice))
    assert r.status_code == 403 and "before tokens had subjects" in r.json()["detail"]
    r = api.client.post("/api/v1/workloads/legacy/cancel", headers=api.h(Role.OPERATOR))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("label", ["mlwe.io/owner", "mlwe.io/owner-subject", "mlwe.io/anything"])
def test_owner_labels_cannot_be_forged(api: Api, label: str) -> None:
    r = api.client.post("/api/v1/workloads", json=_job("forged", labels={label: "x"}), headers=api.h(Role.SUBMITTER))
    assert r.status_code == 422
    assert r.json()["errors"] == [
        {"path": f"[0].labels.{label}", "message": "labels under 'mlwe.io/' are set by the engine"}
    ]


def test_list_filters_by_owner_name_or_subject(api: Api) -> None:
    t1, i1 = api.svc.tokens.create("carol", Role.SUBMITTER)
    t2, i2 = api.svc.tokens.create("carol", Role.SUBMITTER)
    assert api.client.post("/api/v1/workloads", json=_job("c1"), headers=_h(t1)).status_code == 201
    assert api.client.post("/api/v1/workloads", json=_job("c2"), headers=_h(t2)).status_code == 201
    def ids(owner: str) -> list[str]:
        r = api.client.get("/api/v1/workloads", params={"owner": owner}, headers=api.h(Role.VIEWER))
        return sorted(w["id"] for w in r.json()["items"])
    assert ids("carol") == ["c1", "c2"]
    assert ids(i1.id) == ["c1"] and ids(i2.id) == ["c2"]


# ================================================================ token policy
@dataclass(frozen=True)
class PolicyCase:
    name: str
    policy: dict[str, Any]
    specs: list[dict[str, Any]]
    denied: list[tuple[str, str]] = field(default_factory=list)  # (path, words in the message)


POLICY_CASES = [
    PolicyCase("no policy allows anything", {}, [_job("p", queue="default", priority="critical", protected=True)]),
    PolicyCase("an allowed queue", {"queues": ["default"]}, [_job("p")]),
    PolicyCase("a queue not allowed", {"queues": ["team-a"]}, [_job("p")],
               [("[0].queue", "may not submit to queue 'default'; allowed: team-a")]),
    PolicyCase("priority at the limit", {"max_priority": "high"}, [_job("p", priority="high")]),
    PolicyCase("an integer priority under a class limit", {"max_priority": "high"}, [_job("p", priority=99)]),
    PolicyCase("a class above the limit", {"max_priority": "high"}, [_job("p", priority="urgent")],
               [("[0].priority", "priority 500 (urgent) is above token 't'")]),
    PolicyCase("an integer above an integer limit", {"max_priority": 70}, [_job("p", priority=71)],
               [("[0].priority", "highest allowed priority 70")]),
    PolicyCase("protected not allowed", {"allow_protected": False}, [_job("p", protected=True)],
               [("[0].protected", "may not submit protected workloads")]),
    PolicyCase("unprotected is fine without the right", {"allow_protected": False}, [_job("p")]),
    PolicyCase(
        "every problem of every workload is named",
        {"queues": ["default"], "max_priority": "normal", "allow_protected": False},
        [_job("ok"), _job("bad", queue="other", priority="high", protected=True)],
        [("[1].queue", "queue 'other'"), ("[1].priority", "100 (high)"), ("[1].protected", "protected")],
    ),
]


@pytest.mark.parametrize("case", POLICY_CASES, ids=lambda c: c.name)
def test_policy_denials_table(case: PolicyCase) -> None:
    policy = TokenPolicy.build(**case.policy)
    specs = [WorkloadSpec.model_validate(s) for s in case.specs]
    got = policy_denials(Principal("t0t0t0t0t0t0", "t", Role.SUBMITTER, policy), specs)
    assert [p for p, _ in got] == [p for p, _ in case.denied]
    for (_, msg), (_, words) in zip(got, case.denied, strict=True):
        assert words in msg, (msg, words)


@pytest.mark.parametrize("case", POLICY_CASES, ids=lambda c: c.name)
def test_policy_is_enforced_at_submission_over_http(api: Api, case: PolicyCase) -> None:
    body = {"name": "t", "role": "submitter", **case.policy}
    r = api.client.post("/api/v1/tokens", json=body, headers=api.h(Role.ADMIN))
    assert r.status_code == 201, r.text
    assert r.json()["policy"]["allow_protected"] == case.policy.get("allow_protected", True)
    token = r.json()["token"]
    before = api.engine.repo.count_workloads()
    r = api.client.post("/api/v1/workloads", json=case.specs, headers=_h(token))
    if not case.denied:
        assert r.status_code == 201, r.text
        return
    assert r.status_code == 403, r.text
    assert "not allowed to submit" in r.json()["detail"] and "nothing was stored" in r.json()["detail"]
    assert [e["path"] for e in r.json()["errors"]] == [p for p, _ in case.denied]
    assert api.engine.repo.count_workloads() == before


@pytest.mark.parametrize(
    ("policy", "path", "words"),
    [
        ({"queues": []}, "body.queues", "at least 1 item"),
        ({"queues": ["bad queue"]}, "body.queues", "should match pattern"),
        ({"max_priority": "sky-high"}, "body.max_priority", "priority class (best-effort, low, batch"),
        ({"max_priority": 2_000_000}, "body.max_priority", "1000000"),
        ({"max_priority": -1}, "body.max_priority", "0"),
        ({"max_priority": True}, "body.max_priority", "not a boolean"),
        ({"max_priority": "70"}, "body.max_priority", "got '70'"),
        ({"allow_protected": "perhaps"}, "body.allow_protected", "boolean"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_field(api: Api, policy: dict[str, Any], path: str, words: str) -> None:
    r = api.client.post("/api/v1/tokens", json={"name": "t", "role": "viewer", **policy}, headers=api.h(Role.ADMIN))
    assert r.status_code == 422, r.text
    errs = r.json()["errors"]
    assert any(e["path"].startswith(path) and words in e["message"] for e in errs), errs


def test_the_policy_survives_the_store_and_shows_in_whoami_and_the_listing(api: Api) -> None:
    body = {"name": "pol", "role": "submitter", "queues": ["b", "a"], "max_priority": "high", "allow_protected": False}
    created = api.client.post("/api/v1/tokens", json=body, headers=api.h(Role.ADMIN)).json()
    want = {"queues": ["a", "b"], "max_priority": 100, "max_priority_class": "100 (high)", "allow_protected": False}
    assert created["policy"] == want
    api.svc.tokens._cache.clear()  # read it back from the database, not the cache
    me = api.client.get("/api/v1/whoami", headers=_h(created["token"])).json()
    assert me["policy"] == want and me["subject"] == created["id"]
    listed = {t["id"]: t for t in api.client.get("/api/v1/tokens", headers=api.h(Role.ADMIN)).json()["items"]}
    assert listed[created["id"]]["policy"] == want


def test_the_schema_lists_the_priority_classes() -> None:
    hint = typing.get_type_hints(TokenCreateIn, include_extras=True)["max_priority"]
    literals = [a for a in typing.get_args(hint) if typing.get_origin(a) is typing.Literal]
    assert list(typing.get_args(literals[0])) == list(DEFAULT_PRIORITY_CLASSES)


# ============================================================ correlation ids
def test_a_correlation_id_is_filed_under_the_callers_subject(api: Api) -> None:
    t1, i1 = api.svc.tokens.create("dave", Role.SUBMITTER)
    t2, i2 = api.svc.tokens.create("erin", Role.SUBMITTER)
    r1 = api.client.post("/api/v1/workloads", json=_job("d1"), headers=_h(t1, **{"X-Correlation-ID": "release-7"}))
    r2 = api.client.post("/api/v1/workloads", json=_job("e1"), headers=_h(t2, **{"X-Correlation-ID": "release-7"}))
    assert r1.json()["correlation_id"] == f"{i1.id}.release-7"
    assert r2.json()["correlation_id"] == f"{i2.id}.release-7"
    # erin cannot file under dave's scoped id either: hers gets her own prefix
    r3 = api.client.post("/api/v1/workloads", json=_job("e2"),
                         headers=_h(t2, **{"X-Correlation-ID": f"{i1.id}.release-7"}))
    assert r3.json()["correlation_id"] == f"{i2.id}.{i1.id}.release-7"
    audit = api.client.get("/api/v1/audit", params={"correlation_id": f"{i1.id}.release-7"},
                           headers=api.h(Role.VIEWER)).json()["items"]
    assert {a["workload"] for a in audit if a["kind"] == "request"} <= {"d1", None}
    assert all(a["actor"] == f"api:dave#{i1.id}" for a in audit if a["kind"] == "request")


@pytest.mark.parametrize(
    "value",
    ["has space", "-leading-dash", "semi;colon", "x" * 116, "trailing\t", "a/b", "per%cent"],
)
def test_a_correlation_id_outside_the_id_rule_is_refused_naming_the_header(api: Api, value: str) -> None:
    before = api.engine.repo.count_workloads()
    r = api.client.post("/api/v1/workloads", json=_job("c"),
                        headers={**api.h(Role.SUBMITTER), "X-Correlation-ID": value})
    assert r.status_code == 422, r.text
    assert any("x-correlation-id" in e["path"].lower() for e in r.json()["errors"]), r.json()
    assert api.engine.repo.count_workloads() == before


def test_a_correlation_id_at_the_limit_is_accepted(api: Api) -> None:
    r = api.client.post("/api/v1/workloads", json=_job("c"), headers={**api.h(Role.SUBMITTER), "X-Correlation-ID": "x" * 115})
    assert r.status_code == 201, r.text


# ======================================================================= CLI
def test_cli_token_create_takes_the_policy(tmp_path: Any) -> None:
    import json

    from typer.testing import CliRunner

    from mlwe.cli import app
    from mlwe.store.db import database_url, make_engine, migrate

    migrate(make_engine(database_url(tmp_path)))
    runner = CliRunner()
    r = runner.invoke(app, ["token", "create", "--role", "submitter", "--name", "team-a-ci", "--queue", "team-a",
                            "--queue", "shared", "--max-priority", "high", "--no-protected", "--data-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "queues shared,team-a; priority up to 100 (high); protected no" in r.output
    r = runner.invoke(app, ["token", "list", "--json", "--data-dir", str(tmp_path)])
    (tok,) = json.loads(r.output)
    assert tok["subject"] == tok["id"] and tok["policy"] == {
        "queues": ["shared", "team-a"], "max_priority": 100, "max_priority_class": "100 (high)",
        "allow_protected": False,
    }
    r = runner.invoke(app, ["token", "create", "--role", "viewer", "--max-priority", "sky", "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "unknown priority class 'sky'" in r.output
