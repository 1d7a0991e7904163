"""Bus ingress into the engine: duplicated, reordered request events have one effect each;
malformed and refused requests are dead-lettered with the reason; correlation ids follow."""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path

import pytest

from mlwe.bus.base import Backoff, new_envelope
from mlwe.bus.consumer import dead_letters
from mlwe.bus.inprocess import InProcessBus
from mlwe.bus.nats import NatsBus
from mlwe.core.lifecycle import State
from mlwe.runtime.ingress import SUBJECT_FILTER, EngineIngress, decode_request
from tests.runtime.test_engine import cluster, open_engine

FAST = Backoff(base=0.001, cap=0.005)


def spec(wid: str) -> dict:
    return {"id": wid, "name": wid, "resources": {"cpu": 1, "memory": "1Gi"},
            "estimated_duration": 3600}


def submit_env(i: int, cid: str | None = None):
    return new_envelope(
        "mlwe.requests.submit",
        {"type": "submit", "workloads": [spec(f"w{i}")], "actor": "ci-bot"},
        cid,
    )


def test_duplicated_and_reordered_requests_have_one_effect_each(tmp_path: Path) -> None:
    eng = open_engine(tmp_path)
    rng = random.Random(7)
    sent = [submit_env(i) for i in range(300)]
    copies = [e for e in sent for _ in range(rng.choice((2, 3)))]
    rng.shuffle(copies)
    bus = InProcessBus(seed=1)
    ingress = EngineIngress(eng, backoff=FAST, seed=1)

    async def main() -> None:
        await bus.publish_many(copies)
        await ingress.run_until_idle(bus, SUBJECT_FILTER)

    asyncio.run(main())
    assert ingress.metrics.processed == 300
    assert ingress.metrics.duplicates == len(copies) - 300
    assert ingress.metrics.dead_lettered == 0
    assert eng.repo.count_workloads() == 300
    assert sorted(eng.cp.workloads) == sorted(f"w{i}" for i in range(300))
    with eng.repo.engine.connect() as c:
        n = c.exec_driver_sql("SELECT count(*) FROM processed_events").scalar()
    assert n == 300
    # the correlation id of each event is the workload's story id
    w = eng.cp.workloads["w5"]
    assert w.history[0].cause_id == sent[5].correlation_id
    assert [e.kind for e in eng.audit.show(correlation_id=sent[5].correlation_id)] == ["request"]
    eng.close()


def test_bad_and_refused_requests_are_dead_lettered_with_the_reason(tmp_path: Path) -> None:
    eng = open_engine(tmp_path)
    good = submit_env(1)
    again = new_envelope(  # a new event for an id that exists: refused by the control plane
        "mlwe.requests.submit", {"type": "submit", "workloads": [spec("w1")]}
    )
    malformed = new_envelope(
        "mlwe.requests.submit",
        {"type": "submit", "workloads": [{"id": "x", "resources": {"gpu": -1}}]},
    )
    unknown = new_envelope("mlwe.requests.reboot", {"type": "reboot"})
    bus = InProcessBus(seed=2)
    ingress = EngineIngress(eng, backoff=FAST, max_attempts=2, seed=2)

    async def main() -> None:
        await bus.publish(good)
        await ingress.run_until_idle(bus, SUBJECT_FILTER)
        await bus.publish_many([again, malformed, unknown])
        await ingress.run_until_idle(bus, SUBJECT_FILTER)

    asyncio.run(main())
    letters = {d.event_id: d.error for d in dead_letters(eng.repo.engine)}
    assert set(letters) == {again.id, malformed.id, unknown.id}
    assert "exists" in letters[again.id] or "w1" in letters[again.id]
    assert "workloads[0]" in letters[malformed.id]
    assert "type" in letters[unknown.id]
    assert eng.repo.count_workloads() == 1  # nothing of the bad ones was stored
    eng.close()


def test_decode_request_names_the_field() -> None:
    from mlwe.bus.base import EnvelopeError

    with pytest.raises(EnvelopeError, match="node"):
        decode_request({"type": "node-status", "status": "cordoned"})
    with pytest.raises(EnvelopeError, match="status"):
        decode_request({"type": "node-status", "node": "g1", "status": "melted"})
    actions, actor = decode_request({"type": "cancel", "workload": "a", "actor": "ops"})
    assert actor == "ops" and type(actions[0]).__name__ == "Cancel"


def test_requests_over_nats_jetstream_reach_the_engine(tmp_path: Path) -> None:
    from mlwe.bus.base import BusConnectionError
    from tests.bus.test_nats import NATS_URL, service_missing

    eng = open_engine(tmp_path)
    prefix = f"mlweing{uuid.uuid4().hex[:10]}"
    sent = [submit_env(i) for i in range(50)]

    async def main() -> EngineIngress:
        try:
            bus = await NatsBus.connect(NATS_URL, prefix=prefix, storage="memory", connect_timeout=3)
        except BusConnectionError as exc:
            service_missing(f"NATS JetStream at {NATS_URL}", str(exc))
        ingress = EngineIngress(eng, backoff=FAST, seed=3)
        try:
            await bus.publish_many([*sent, *sent[:10]])  # ten published twice
            await ingress.run_until_idle(bus, SUBJECT_FILTER)
        finally:
            await bus.delete_stream()
            await bus.close()
        return ingress

    ingress = asyncio.run(main())
    assert ingress.metrics.processed == 50 and ingress.metrics.duplicates == 10
    assert eng.repo.count_workloads() == 50
    eng.tick()
    assert all(w.state in (State.PENDING, State.ADMITTED, State.STARTING, State.RUNNING)
               for w in eng.cp.workloads.values())
    assert cluster() is not None
    eng.close()


def test_the_ingress_runner_consumes_nats_in_the_background(tmp_path: Path) -> None:
    from mlwe.bus.base import BusConnectionError
    from mlwe.runtime.ingress import nats_ingress
    from tests.bus.test_nats import NATS_URL, service_missing

    eng = open_engine(tmp_path)
    prefix = f"mlwerun{uuid.uuid4().hex[:10]}"
    try:
        runner = nats_ingress(eng, NATS_URL, prefix=prefix)
    except BusConnectionError as exc:
        service_missing(f"NATS JetStream at {NATS_URL}", str(exc))
    sent = [submit_env(i, cid=f"bus-{i}") for i in range(20)]

    async def publish() -> None:
        bus = await NatsBus.connect(NATS_URL, prefix=prefix)
        try:
            await bus.publish_many([*sent, *sent[:5]])
        finally:
            await bus.close()

    try:
        asyncio.run(publish())
        assert eng.run_until(lambda e: e.repo.count_workloads() == 20, 30)
        assert eng.run_until(lambda e: runner.ingress.metrics.duplicates == 5, 30)
    finally:
        runner.stop()

        async def drop() -> None:
            bus = await NatsBus.connect(NATS_URL, prefix=prefix)
            await bus.delete_stream()
            await bus.close()

        asyncio.run(drop())
    assert eng.cp.workloads["w3"].history[0].cause_id == "bus-3"
    eng.close()
