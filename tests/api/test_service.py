"""The service around the API: `mlwe serve` end to end, first-start admin token, the
workload generator, fault injection, the scheduler-reasoning relay, and the engine's
group commit called under its own lock (no deadlock)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from mlwe.api.auth import Role
from mlwe.api.generator import WorkloadGenerator
from mlwe.api.relay import trace_of
from mlwe.api.serve import DEFAULT_CLUSTER, build_service
from mlwe.backends.faults import FaultInjector
from mlwe.core.actions import Exited, Released, Started
from mlwe.core.backend import StartCommand
from mlwe.core.clock import ManualClock
from mlwe.core.spec import WorkloadSpec
from mlwe.runtime.streams import StreamEvent
from mlwe.sim.live import LiveSimBackend
from tests.api.conftest import free_port, make_api, wait_for


def test_mlwe_serve_prints_the_dashboard_url_and_an_admin_token_once(tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "mlwe.cli", "serve", "--port", str(port), "--data-dir", str(tmp_path),
           "--speed", "10", "--no-agent"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("dashboard:"):
                break
        text = "".join(lines)
        m = re.search(rf"dashboard: http://localhost:{port}/#token=(mlwe_\S+)", text)
        assert m, text
        token = m.group(1)
        url = f"http://127.0.0.1:{port}"
        assert wait_for(lambda: _ok(f"{url}/readyz"), timeout=30)
        me = httpx.get(f"{url}/api/v1/whoami", headers={"Authorization": f"Bearer {token}"}).json()
        assert me["role"] == "admin"
        # the generator keeps the dashboard alive
        assert wait_for(lambda: httpx.get(f"{url}/api/v1/workloads", headers={
            "Authorization": f"Bearer {token}"}).json()["total"] > 0, timeout=30)
        # a dashboard still watching the stream does not keep the server from stopping
        streaming = threading.Event()

        def watch() -> None:
            try:
                with httpx.stream("GET", f"{url}/api/v1/streams", headers={"Authorization": f"Bearer {token}"},
                                  timeout=httpx.Timeout(5, read=60)) as r:
                    for _ in r.iter_lines():
                        streaming.set()
            except httpx.HTTPError:
                pass

        threading.Thread(target=watch, daemon=True).start()
        assert streaming.wait(10)
        proc.terminate()
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    # a second start finds the admin token and does not print a new one
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        again = []
        for line in proc.stdout:
            again.append(line)
            if line.startswith("dashboard:"):
                break
        assert "token" not in "".join(again).split("dashboard:")[0].lower()
        assert "mlwe token create" in "".join(again)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_generator_submits_a_valid_mix_and_keeps_the_queue_short(tmp_path: Path) -> None:
    svc = build_service(data_dir=tmp_path, generator=False, agent=False, create_admin=False, start_loop=False)
    try:
        gen = WorkloadGenerator(svc.engine, seed=7, max_pending=5)
        made = [gen.step() for _ in range(40)]
        ids = [m for m in made if m]
        assert len(ids) >= 5 and len(set(ids)) == len(ids)
        kinds = {svc.engine.cp.workloads[i].spec.kind.value for i in ids}
        assert len(kinds) >= 2
        queued = sum(1 for _ in svc.engine.cp.queued)
        assert queued <= 5  # nothing is scheduled here (no loop), so it stopped at the cap
        assert {n.name for n in DEFAULT_CLUSTER.all_nodes()} >= {"h100-0", "a100-0", "t4-0", "himem-0"}
    finally:
        svc.close()


def _spec(memory: str) -> WorkloadSpec:
    return WorkloadSpec.model_validate({"id": "w", "name": "w", "resources": {"gpu": 1, "memory": memory},
                                        "estimated_duration": "1h"})


def test_the_oom_fault_kills_each_attempt_until_it_asks_for_more_memory() -> None:
    clock = ManualClock(1000.0)
    inj = FaultInjector(LiveSimBackend(clock), clock, oom_after_s=3.0)
    inj.oom("w")
    inj.send([StartCommand("s1", "w", 1, (), _spec("8Gi"))])
    clock.advance(1.0)
    assert [type(e.fact) for e in inj.poll()] == [Started]
    clock.advance(5.0)
    facts = [e.fact for e in inj.poll()]
    assert facts == [Exited("w", 1, 137, "oom")]
    clock.advance(30.0)
    assert not [e for e in inj.poll() if isinstance(e.fact, Released | Exited)]  # the kill is final
    assert inj.inventory() == []
    # the fix: more memory; this attempt runs
    inj.send([StartCommand("s2", "w", 2, (), _spec("16Gi"))])
    clock.advance(10.0)
    facts = [e.fact for e in inj.poll()]
    assert facts and all(not isinstance(f, Exited) for f in facts)


def test_the_relay_turns_a_stored_preempt_decision_into_a_trace() -> None:
    payload = {"kind": "preempt", "workload": "urgent", "chosen": "evict a, b", "reasons": ["r1"],
               "candidates": ["alt"], "policy": "p", "version": 9, "seq": 3}
    ev = StreamEvent(1, "audit", 1.0, {"kind": "decision", "seq": 4, "payload": payload})
    t = trace_of(ev)
    assert t is not None and t["victims"] == ["a", "b"] and t["workload"] == "urgent"
    assert t["verdict"] == "applied by the control plane at version 9"
    place = StreamEvent(2, "audit", 1.0, {"kind": "decision", "payload": {**payload, "kind": "place"}})
    assert trace_of(place) is None
    assert trace_of(StreamEvent(3, "audit", 1.0, {"kind": "request", "payload": {}})) is None


def test_a_commit_under_the_engine_lock_does_not_deadlock_with_a_request_commit(tmp_path: Path) -> None:
    """A tick hook (agent, workflow) commits while holding the engine lock; a request
    thread meanwhile holds the flush mutex and waits for the lock. Both must finish."""
    api = make_api(tmp_path)
    eng = api.engine
    try:
        eng.stop()
        holding = threading.Event()
        request_has_mutex = threading.Event()
        finished: list[str] = []

        def hook_thread() -> None:
            with eng.lock:
                holding.set()
                request_has_mutex.wait(5)
                eng._commit()  # as Engine.propose / record_reasoning do inside a tick hook
            finished.append("hook")

        def request_thread() -> None:
            holding.wait(5)
            with eng._flush_mutex:
                request_has_mutex.set()
                with eng.lock:
                    pass
            finished.append("request")

        threads = [threading.Thread(target=hook_thread, daemon=True),
                   threading.Thread(target=request_thread, daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(finished) == ["hook", "request"]
    finally:
        api.svc.close()


def test_concurrent_submissions_are_each_durable_and_audited_on_their_own(tmp_path: Path) -> None:
    api = make_api(tmp_path)
    try:
        queue = api.svc.app.state.ctx.submitter
        errors: list[int] = []

        def client(k: int) -> None:
            for i in range(10):
                r = api.client.post("/api/v1/workloads", headers=api.h(Role.SUBMITTER),
                                    json={"id": f"c{k}-{i}", "name": "x", "resources": {"cpu": "100m"}})
                if r.status_code != 201:
                    errors.append(r.status_code)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        assert queue.requests == 80  # all went through the group-commit queue
        # every one is durable and audited under its own request
        assert api.engine.repo.count_workloads() == 80
        audit = api.client.get("/api/v1/audit", params={"kind": "request", "limit": 200},
                               headers=api.h(Role.VIEWER)).json()["items"]
        assert len(audit) == 80 and len({a["correlation_id"] for a in audit}) == 80
    finally:
        api.svc.close()


def test_serve_with_a_bus_takes_requests_from_it(tmp_path: Path) -> None:
    """``--bus nats://...``: a request published on mlwe.requests.* reaches the engine once."""
    import asyncio

    from mlwe.bus.base import new_envelope
    from mlwe.bus.nats import NatsBus
    from tests.bus.test_nats import NATS_URL

    svc = build_service(data_dir=tmp_path, generator=False, agent=False, create_admin=False,
                        bus_url=NATS_URL)
    env = new_envelope("mlwe.requests.submit", {"type": "submit", "workloads": [
        {"id": "from-bus", "name": "from-bus", "resources": {"cpu": 1, "memory": "1Gi"}}]},
        "bus-req-1")

    async def publish() -> None:
        bus = await NatsBus.connect(NATS_URL)
        try:
            await bus.publish_many([env, env])
        finally:
            await bus.close()

    try:
        asyncio.run(publish())
        deadline = time.monotonic() + 30
        while "from-bus" not in svc.engine.cp.workloads and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "from-bus" in svc.engine.cp.workloads
        assert svc.engine.cp.workloads["from-bus"].history[0].cause_id == "bus-req-1"
    finally:
        svc.close()
