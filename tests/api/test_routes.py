"""The REST routes against a real engine: submit (JSON, YAML, lists), validate, list,
describe, explain a preemption and a wait, cancel, nodes, queues, decisions, audit,
events, scenarios, agent, metrics, health. Bad input gets a clear error and changes nothing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mlwe.api.auth import Role
from mlwe.core.lifecycle import State
from tests.api.conftest import Api, make_api, wait_for

V, S, OP, A = Role.VIEWER, Role.SUBMITTER, Role.OPERATOR, Role.ADMIN


def job(wid: str, gpu: int = 0, **kw: object) -> dict[str, object]:
    res: dict[str, object] = {"cpu": 1, "memory": "1Gi"}
    if gpu:
        res["gpu"] = gpu
    return {"id": wid, "name": wid, "resources": res, "estimated_duration": "30m", **kw}


def submit(api: Api, body: object, role: Role = S, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return api.client.post("/api/v1/workloads", json=body, headers={**api.h(role), **(headers or {})})


def state_of(api: Api, wid: str) -> str:
    return str(api.client.get(f"/api/v1/workloads/{wid}", headers=api.h(V)).json()["state"])


def fill_a100s(api: Api) -> None:
    """Take every A100 with one long job (what never fits is refused at submission now,
    so a workload that waits must wait for capacity)."""
    r = submit(api, job("filler", gpu=4, gpu_models=["A100-80GB"], replicas=2,
                        estimated_duration="1d"))
    assert r.status_code == 201, r.text
    assert wait_for(lambda: state_of(api, "filler") == "running", timeout=30)


# ================================================================== submit
def test_submit_json_one_list_and_mapping_and_yaml_documents(api: Api) -> None:
    r = submit(api, job("one"), headers={**api.h(S), "X-Correlation-ID": "story-42"})
    assert r.status_code == 201, r.text
    subject = api.svc.tokens.verify(api.tokens[S]).subject  # type: ignore[union-attr]
    cid = f"{subject}.story-42"  # a client's id is filed under its token's subject
    assert r.json()["created"] == ["one"] and r.json()["correlation_id"] == cid
    assert submit(api, [job("two"), job("three")]).json()["created"] == ["two", "three"]
    assert submit(api, {"workloads": [job("four")]}).json()["created"] == ["four"]
    yaml_text = "id: five\nname: five\nresources: {cpu: 1}\n---\nid: six\nname: six\n"
    r = api.client.post("/api/v1/workloads", content=yaml_text,
                        headers={**api.h(S), "Content-Type": "application/yaml"})
    assert r.status_code == 201, r.text
    assert r.json()["created"] == ["five", "six"]
    w = api.client.get("/api/v1/workloads/one", headers=api.h(V)).json()
    assert w["owner"] == "submitter-user" and w["owner_subject"] == subject and w["correlation_id"] == cid
    assert w["history"][0]["target"] == "pending" and w["history"][0]["cause_id"] == cid


def test_invalid_specs_name_every_field_and_store_nothing(api: Api) -> None:
    before = api.engine.repo.count_workloads()
    r = submit(api, [job("ok"), {"name": "", "resources": {"gpu": "-1"}, "colour": "red"}])
    assert r.status_code == 422
    paths = {e["path"] for e in r.json()["errors"]}
    assert {"[1].name", "[1].resources.gpu", "[1].colour"} <= paths, paths
    assert api.engine.repo.count_workloads() == before and "ok" not in api.engine.cp.workloads


def test_a_submission_the_control_plane_refuses_is_a_409_with_its_reason(api: Api) -> None:
    assert submit(api, job("dup")).status_code == 201
    before = api.engine.repo.count_workloads()
    r = submit(api, [job("fresh"), job("dup")])
    assert r.status_code == 409
    assert any("dup" in e["message"] for e in r.json()["errors"])
    # nothing of the batch applied nor stored (the engine's loop may meanwhile start "dup")
    assert "fresh" not in api.engine.cp.workloads
    assert api.engine.repo.count_workloads() == before and api.engine.repo.history("fresh") == []


def test_the_owner_label_is_the_engines_to_set(api: Api) -> None:
    r = submit(api, job("spoof", labels={"mlwe.io/owner": "admin"}))
    assert r.status_code == 422 and "set by the engine" in r.json()["errors"][0]["message"]


def test_validate_checks_without_submitting(api: Api) -> None:
    r = api.client.post("/api/v1/workloads/validate", json=[job("v1"), job("v2")], headers=api.h(S))
    assert r.json() == {"valid": True, "workloads": 2, "errors": []}
    r = api.client.post("/api/v1/workloads/validate", json={"name": "x", "replicas": 0}, headers=api.h(S))
    body = r.json()
    assert r.status_code == 200 and not body["valid"] and body["errors"][0]["path"] == "replicas"
    assert "v1" not in api.engine.cp.workloads


# ============================================================ list, describe
def test_list_filters_and_pages(api: Api) -> None:
    submit(api, [job(f"l{i}") for i in range(5)])
    submit(api, job("other-queue-job"))
    r = api.client.get("/api/v1/workloads", params={"limit": 2, "offset": 1}, headers=api.h(V)).json()
    assert r["total"] == 6 and [w["id"] for w in r["items"]] == ["l4", "l3"]  # newest first
    api.client.post("/api/v1/workloads/l0/cancel", headers=api.h(S))
    r = api.client.get("/api/v1/workloads", params={"state": "cancelled,stopping"}, headers=api.h(V)).json()
    assert [w["id"] for w in r["items"]] == ["l0"]
    r = api.client.get("/api/v1/workloads", params={"owner": "nobody"}, headers=api.h(V)).json()
    assert r["total"] == 0
    r = api.client.get("/api/v1/workloads", params={"state": "sleeping"}, headers=api.h(V))
    assert r.status_code == 422 and "unknown state" in r.json()["errors"][0]["message"]


def test_describe_shows_the_state_history_as_it_happens(api: Api) -> None:
    submit(api, job("h1", estimated_duration="20s"))
    assert wait_for(lambda: state_of(api, "h1") == "succeeded", timeout=30)
    w = api.client.get("/api/v1/workloads/h1", headers=api.h(V)).json()
    assert [t["target"] for t in w["history"]] == ["pending", "admitted", "starting", "running", "succeeded"]
    assert w["spec"]["name"] == "h1" and w["placement"] == []
    r = api.client.get("/api/v1/workloads/nope", headers=api.h(V))
    assert r.status_code == 404 and "nope" in r.json()["detail"]


# ===================================================== explain, preemption
def _fill_a100(api: Api) -> list[str]:
    ids = ["low-a", "low-b"]
    for wid in ids:
        assert submit(api, job(wid, gpu=4, priority="batch", gpu_models=["A100-80GB"],
                               checkpoint_interval="1m")).status_code == 201
    assert wait_for(lambda: all(state_of(api, w) == "running" for w in ids))
    return ids


def test_an_urgent_fine_tune_preempts_and_explain_says_why(api: Api) -> None:
    victims = _fill_a100(api)
    r = api.client.post("/api/v1/scenarios/urgent-fine-tune", json={"target": "A100-80GB"}, headers=api.h(OP))
    assert r.status_code == 200, r.text
    urgent = r.json()["workloads"][0]
    assert wait_for(lambda: state_of(api, urgent) == "running", timeout=30)
    preempted = [v for v in victims if api.engine.cp.workloads[v].preemptions]
    assert len(preempted) == 1  # minimal: one 4-GPU node frees what it needs
    victim = preempted[0]
    e = api.client.get(f"/api/v1/workloads/{victim}/explain", headers=api.h(V)).json()
    assert f"preempted by {urgent}" in e["summary"]
    pre = [d for d in e["decisions"] if d["kind"] == "preempt"]
    assert pre and victim in pre[0]["chosen"] and pre[0]["workload"] == urgent and pre[0]["reasons"]
    d = api.client.get("/api/v1/decisions", params={"kind": "preempt"}, headers=api.h(V)).json()["items"]
    assert [x["workload"] for x in d] == [urgent]
    # the scheduler's reasoning is on the reasoning stream, about both workloads
    recent = api.client.get("/api/v1/streams/recent", params={"topics": "reasoning"}, headers=api.h(V)).json()
    traces = [ev["data"] for ev in recent["items"] if ev["data"].get("source") == "scheduler"]
    assert traces and traces[0]["victims"] == [victim] and traces[0]["workload"] == urgent
    # ... and in the reasoning history, next to the agent's stored traces
    api.engine.record_reasoning({"type": "agent-decision", "workload": victim, "outcome": "nothing"},
                                correlation_id="agent-x")
    hist = api.client.get("/api/v1/reasoning", headers=api.h(V)).json()["items"]
    kinds = [(h["data"].get("source") or h["data"].get("type"), h["workload"]) for h in hist]
    assert ("scheduler", urgent) in kinds and ("agent-decision", victim) in kinds
    assert [h["time"] for h in hist] == sorted(h["time"] for h in hist)
    w = api.client.get("/api/v1/workloads", params={"state": "preempted,preempting,pending"}, headers=api.h(V)).json()
    mine = next(x for x in w["items"] if x["id"] == victim)
    assert mine["preempted_by"] == urgent and "preempting" in mine["lifecycle"]


def test_explain_says_why_a_workload_waits(api: Api) -> None:
    r = submit(api, job("never", gpu=8, gpu_models=["A100-80GB"]))  # no node has 8 A100s
    assert r.status_code == 422 and "inadmissible" in r.text
    fill_a100s(api)
    submit(api, job("too-big", gpu=4, gpu_models=["A100-80GB"]))  # waits for capacity
    assert wait_for(lambda: api.engine.cp.workloads["too-big"].pending_reason != "")
    e = api.client.get("/api/v1/workloads/too-big/explain", headers=api.h(V)).json()
    assert e["state"] == "pending" and "waiting:" in e["summary"] and e["pending_reason"]
    assert any(d["kind"] == "unschedulable" for d in e["decisions"])


# ================================================================== cancel
def test_cancel_and_cancel_again(api: Api) -> None:
    fill_a100s(api)
    submit(api, job("c1", gpu=4, gpu_models=["A100-80GB"]))  # waits: cancelled from pending
    r = api.client.post("/api/v1/workloads/c1/cancel", headers=api.h(S))
    assert r.status_code == 200 and state_of(api, "c1") == "cancelled"
    r = api.client.post("/api/v1/workloads/c1/cancel", headers=api.h(S))
    assert r.status_code == 409 and "cancelled" in r.json()["errors"][0]["message"]
    assert api.client.post("/api/v1/workloads/ghost/cancel", headers=api.h(S)).status_code == 404


# =================================================================== nodes
def test_cordon_uncordon_and_drain(api: Api) -> None:
    c = api.client
    assert c.post("/api/v1/nodes/t4-0/cordon", json={"reason": "maintenance"}, headers=api.h(OP)).status_code == 200
    assert c.get("/api/v1/nodes/t4-0", headers=api.h(V)).json()["status"] == "cordoned"
    submit(api, job("t4job", gpu=1, gpu_models=["T4"]))
    time.sleep(1.0)
    assert state_of(api, "t4job") == "pending"  # the only T4 node takes nothing new
    assert c.post("/api/v1/nodes/t4-0/uncordon", headers=api.h(OP)).status_code == 200
    assert wait_for(lambda: state_of(api, "t4job") == "running")
    r = c.post("/api/v1/nodes/t4-0/drain", headers=api.h(OP))
    assert r.status_code == 200, r.text
    assert wait_for(lambda: api.engine.cp.workloads["t4job"].preemptions >= 1 or
                    state_of(api, "t4job") in ("preempting", "preempted"))
    assert c.get("/api/v1/nodes/t4-0", headers=api.h(V)).json()["status"] == "cordoned"
    version = api.engine.cp.version
    r = c.post("/api/v1/nodes/no-such-node/cordon", headers=api.h(OP))
    assert r.status_code == 404 and api.engine.cp.version == version
    audit = c.get("/api/v1/audit", params={"kind": "operator"}, headers=api.h(V)).json()["items"]
    assert any(a["payload"].get("action") == "node-status" and a["actor"].startswith("api:operator-user#") for a in audit)


# ================================================================== queues
def test_queues_and_quotas(api: Api) -> None:
    c = api.client
    qs = c.get("/api/v1/queues", headers=api.h(V)).json()["items"]
    assert [q["name"] for q in qs] == ["default"] and qs[0]["nominal"]["gpu"] is None
    r = c.put("/api/v1/queues/research", json={"nominal": {"gpu": 4}, "cohort": "lab"}, headers=api.h(A))
    assert r.status_code == 200, r.text
    assert r.json()["nominal"]["gpu"] == 4000 and r.json()["cohort"] == "lab"
    r = c.put("/api/v1/queues/research", json={"nominal": {"gpu": "lots"}}, headers=api.h(A))
    assert r.status_code == 422 and r.json()["errors"][0]["path"].startswith("nominal.gpu")
    r = c.put("/api/v1/queues/research", json={"name": "other"}, headers=api.h(A))
    assert r.status_code == 422 and "does not match" in r.json()["errors"][0]["message"]
    assert api.engine.cp.queues["research"].nominal.gpu == 4000  # the bad requests changed nothing


# =========================================================== audit, events
def test_audit_query_and_verify(api: Api) -> None:
    cid = submit(api, job("a1"), headers={**api.h(S), "X-Correlation-ID": "audit-story"}).json()["correlation_id"]
    items = api.client.get("/api/v1/audit", params={"correlation_id": cid}, headers=api.h(V)).json()["items"]
    assert items and items[0]["kind"] == "request" and items[0]["actor"].startswith("api:submitter-user#")
    v = api.client.get("/api/v1/audit/verify", headers=api.h(V)).json()
    assert v["ok"] and v["checked"] == v["head_seq"] >= 1
    # the engine keeps running (the scheduler records its decision about a1 whenever it
    # gets to it), so records after head_seq - 1 are head_seq and whatever came since,
    # in order, with no gap; limit=1 is exactly head_seq
    head = v["head_seq"]
    after = api.client.get("/api/v1/audit", params={"after_seq": head - 1}, headers=api.h(V)).json()
    seqs = [a["seq"] for a in after["items"]]
    assert seqs == list(range(head, head + len(seqs))) and seqs, seqs
    one = api.client.get("/api/v1/audit", params={"after_seq": head - 1, "limit": 1}, headers=api.h(V)).json()
    assert [a["seq"] for a in one["items"]] == [head]


def test_verify_names_the_first_tampered_record(api: Api) -> None:
    submit(api, [job("t1"), job("t2")])
    from sqlalchemy import update

    from mlwe.store.schema import audit

    with api.engine.repo.engine.begin() as conn:
        conn.execute(update(audit).where(audit.c.seq == 2).values(actor="mallory"))
    v = api.client.get("/api/v1/audit/verify", headers=api.h(V)).json()
    assert not v["ok"] and v["first_bad_seq"] == 2 and v["checked"] == 1


def test_dead_letters_and_replay_without_a_bus(api: Api) -> None:
    assert api.client.get("/api/v1/events/dead-letters", headers=api.h(V)).json() == {"items": []}
    r = api.client.post("/api/v1/events/dead-letters/e1/replay", headers=api.h(OP))
    assert r.status_code == 409 and "--bus" in r.json()["detail"]


# =============================================================== scenarios
def test_scenarios_are_listed_and_unknown_ones_refused(api: Api) -> None:
    names = [s["name"] for s in api.client.get("/api/v1/scenarios", headers=api.h(V)).json()["items"]]
    assert names == ["urgent-fine-tune", "node-fails", "loss-diverges", "oom-loop"]
    r = api.client.post("/api/v1/scenarios/meteor-strike", headers=api.h(OP))
    assert r.status_code == 404 and "urgent-fine-tune" in r.json()["detail"]


def test_node_fails_requeues_its_work(api: Api) -> None:
    submit(api, job("on-t4", gpu=1, gpu_models=["T4"]))
    assert wait_for(lambda: state_of(api, "on-t4") == "running")
    r = api.client.post("/api/v1/scenarios/node-fails", json={"target": "t4-0"}, headers=api.h(OP))
    assert r.status_code == 200 and r.json()["workloads"] == ["on-t4"]
    assert wait_for(lambda: api.engine.cp.node_status("t4-0").value == "down")
    w = api.engine.cp.workloads["on-t4"]
    assert any(t.target is State.FAILED and "node" in t.reason for t in w.history) or w.failure_cause == "node-lost"
    r = api.client.post("/api/v1/scenarios/node-fails", json={"target": "t4-0"}, headers=api.h(OP))
    assert r.status_code == 409 and "already down" in r.json()["detail"]


def test_loss_diverges_makes_the_reported_loss_grow(api: Api) -> None:
    submit(api, job("trainer", gpu=1, kind="training"))
    assert wait_for(lambda: state_of(api, "trainer") == "running")
    r = api.client.post("/api/v1/scenarios/loss-diverges", json={"target": "trainer"}, headers=api.h(OP))
    assert r.status_code == 200

    def losses() -> list[float]:
        evs = api.client.get("/api/v1/streams/recent", params={"topics": "telemetry", "workload": "trainer",
                                                               "limit": 5000}, headers=api.h(V)).json()["items"]
        return [ev["data"]["metrics"]["loss"] for ev in evs if "loss" in ev["data"]["metrics"]]

    base = len(losses())
    assert wait_for(lambda: len(losses()) >= base + 4, timeout=30)
    tail = losses()[base:]
    assert tail[-1] > tail[0]  # injected divergence: it grows


def test_oom_loop_kills_each_attempt_for_memory(api: Api) -> None:
    r = api.client.post("/api/v1/scenarios/oom-loop", headers=api.h(OP))
    assert r.status_code == 200
    wid = r.json()["workloads"][0]
    assert wait_for(lambda: api.engine.cp.workloads[wid].failures >= 2, timeout=40)
    w = api.client.get(f"/api/v1/workloads/{wid}", headers=api.h(V)).json()
    assert w["failure_cause"] == "oom" and w["exit_code"] == 137


# =================================================================== agent
def test_without_an_agent_the_routes_say_so(api: Api) -> None:
    assert api.client.get("/api/v1/agent", headers=api.h(V)).json()["present"] is False
    r = api.client.put("/api/v1/agent/mode", json={"mode": "observe"}, headers=api.h(OP))
    assert r.status_code == 409
    assert api.client.get("/api/v1/agent/approvals", headers=api.h(V)).json() == {"items": []}


def test_the_agent_mode_and_approvals(tmp_path: Path) -> None:
    from mlwe.api.serve import attach_agent

    api = make_api(tmp_path)
    try:
        agent = attach_agent(api.engine, "autonomous")
        api.svc.app.state.ctx.agent = agent
        s = api.client.get("/api/v1/agent", headers=api.h(V)).json()
        assert s["present"] and s["mode"] == "autonomous" and s["reasoner"] == "rules"
        r = api.client.put("/api/v1/agent/mode", json={"mode": "approve"}, headers=api.h(OP))
        assert r.status_code == 200 and r.json()["mode"] == "approve"
        r = api.client.put("/api/v1/agent/mode", json={"mode": "yolo"}, headers=api.h(OP))
        assert r.status_code == 422
        audit = api.client.get("/api/v1/audit", params={"kind": "config"}, headers=api.h(V)).json()["items"]
        assert any(a["payload"].get("action") == "agent-mode" and a["payload"]["to"] == "approve" for a in audit)
        # an OOM loop in approve mode: the agent's plan waits for an operator
        wid = api.client.post("/api/v1/scenarios/oom-loop", headers=api.h(OP)).json()["workloads"][0]
        assert wait_for(lambda: api.client.get("/api/v1/agent/approvals", headers=api.h(V)).json()["items"], timeout=60)
        plan = api.client.get("/api/v1/agent/approvals", headers=api.h(V)).json()["items"][0]
        assert wid in plan["summary"] or wid in str(plan["plan"])
        assert api.client.post("/api/v1/agent/approvals/nope/approve", headers=api.h(OP)).status_code == 404
        r = api.client.post(f"/api/v1/agent/approvals/{plan['id']}/approve", headers=api.h(OP))
        assert r.status_code == 200, r.text
        assert r.json()["message"].startswith(f"plan {plan['id']}:")
    finally:
        api.svc.close()


# ========================================================= metrics, health
def test_metrics_count_what_happens(api: Api) -> None:
    fill_a100s(api)
    submit(api, job("m1", estimated_duration="20s", deadline_in="1h"))
    submit(api, job("m2", gpu=4, gpu_models=["A100-80GB"]))  # waits behind the filler
    assert wait_for(lambda: state_of(api, "m1") == "succeeded", timeout=30)
    text = api.client.get("/metrics", headers=api.h(V)).text
    assert 'mlwe_queue_depth{queue="default"} 1.0' in text
    assert "mlwe_admissions_total 2.0" in text  # the filler and m1
    assert 'mlwe_deadline_outcomes_total{outcome="met"} 1.0' in text
    count = [ln for ln in text.splitlines() if ln.startswith("mlwe_decision_latency_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 1
    assert 'mlwe_http_requests_total{method="POST",route="/api/v1/workloads",status="201"} 3.0' in text
    assert api.client.get("/metrics").status_code == 401


def test_health_and_readiness(api: Api) -> None:
    assert api.client.get("/healthz").json()["status"] == "ok"
    r = api.client.get("/readyz")
    assert r.status_code == 200 and r.json()["checks"]["loop"] == "running"
    api.engine.stop()
    r = api.client.get("/readyz")
    assert r.status_code == 503 and r.json()["checks"]["loop"] == "stopped"


def test_the_cluster_snapshot_maps_gpus_to_workloads(api: Api) -> None:
    submit(api, job("g2", gpu=2, gpu_models=["A100-80GB"], priority="high"))
    assert wait_for(lambda: state_of(api, "g2") == "running")
    snap = api.client.get("/api/v1/cluster", headers=api.h(V)).json()
    holders = [(n["name"], d["index"], h["id"], h["priority"]) for n in snap["nodes"] for d in n["devices"]
               for h in d["holders"]]
    assert len(holders) == 2 and {h[2] for h in holders} == {"g2"} and holders[0][3] == 100
    assert snap["totals"]["gpus"] == 10 and snap["totals"]["running"] == 1


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_no_cdn_pages(api: Api, path: str) -> None:
    assert api.client.get(path).status_code == 404  # Swagger UI and ReDoc load scripts from a CDN


def test_a_dead_letter_is_replayed_on_the_real_bus(tmp_path: Path) -> None:
    import asyncio
    import uuid

    from sqlalchemy import insert, select

    from mlwe.api.context import ApiSettings
    from mlwe.bus.base import new_envelope
    from mlwe.bus.nats import NatsBus
    from mlwe.store.schema import dead_letters
    from tests.bus import service_missing

    url = "nats://127.0.0.1:4222"
    prefix = f"mlweapi{uuid.uuid4().hex[:10]}"

    async def probe() -> None:
        bus = await NatsBus.connect(url, prefix=prefix, connect_timeout=3)
        await bus.close()

    try:
        asyncio.run(probe())
    except Exception as exc:
        service_missing(f"NATS JetStream at {url}", str(exc))
    api = make_api(tmp_path, ApiSettings(bus_prefix=prefix))
    try:
        api.svc.app.state.ctx.bus = url
        env = new_envelope(f"{prefix}.workloads.submit", {"spec": {"name": "x"}}, "dl-story")
        with api.engine.repo.engine.begin() as conn:
            conn.execute(insert(dead_letters).values(
                event_id=env.id, time=1.0, subject=env.subject, payload=env.to_bytes().decode(),
                error="handler failed: boom", attempts=5, replayed=False))
        items = api.client.get("/api/v1/events/dead-letters", headers=api.h(V)).json()["items"]
        assert [(d["event_id"], d["attempts"], d["replayed"]) for d in items] == [(env.id, 5, False)]
        r = api.client.post(f"/api/v1/events/dead-letters/{env.id}/replay", headers=api.h(OP))
        assert r.status_code == 200, r.text
        with api.engine.repo.engine.connect() as conn:
            assert conn.execute(select(dead_letters.c.replayed)).scalar() is True

        async def stored() -> int:
            bus = await NatsBus.connect(url, prefix=prefix)
            try:
                info = await bus._js.stream_info(bus.stream)
                return int(info.state.messages)
            finally:
                await bus.delete_stream()
                await bus.close()

        r = api.client.post("/api/v1/events/dead-letters/nope/replay", headers=api.h(OP))
        assert r.status_code == 404
        assert asyncio.run(stored()) == 1  # (and the test's stream is deleted)
    finally:
        api.svc.close()
