"""Envelopes, subjects, backoff, and the in-process bus's delivery contract."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from mlwe.bus import (
    Backoff,
    BusClosed,
    BusError,
    Envelope,
    EnvelopeError,
    InProcessBus,
    new_envelope,
    subject_matches,
)
from mlwe.bus.base import validate_filter

# -- envelopes ----------------------------------------------------------------


def test_envelope_round_trips_through_canonical_json() -> None:
    env = Envelope("e1", "workload.started", {"b": 2, "a": [1, "x"]}, "c1", 12.5, attempt=3)
    data = env.to_bytes()
    assert data == (
        b'{"correlation_id":"c1","id":"e1","payload":{"a":[1,"x"],"b":2},'
        b'"published_at":12.5,"subject":"workload.started"}'
    )
    # attempt is delivery metadata, not part of the event: every copy has the same bytes
    assert Envelope.from_bytes(data) == Envelope("e1", "workload.started", env.payload, "c1", 12.5)
    assert Envelope.from_bytes(data, attempt=3) == env
    assert len({env, Envelope.from_bytes(data, attempt=3)}) == 1  # hashable despite the dict


def test_new_envelope_ids() -> None:
    first = new_envelope("a.b", {"x": 1}, clock=lambda: 7.0)
    second = new_envelope("a.b", {"x": 1}, correlation_id="req-9")
    assert len(first.id) == 32 and first.id != second.id
    assert first.correlation_id == first.id  # defaults to the event's own id
    assert second.correlation_id == "req-9"
    assert first.published_at == 7.0 and first.attempt == 1


BAD_ENVELOPES = {
    "not json": (b"{nope", "not JSON"),
    "not an object": (b"[1]", "not a JSON object"),
    "missing id": (b'{"subject":"a","payload":{},"correlation_id":"c","published_at":1}', "'id'"),
    "empty subject": (
        b'{"id":"i","subject":"","payload":{},"correlation_id":"c","published_at":1}',
        "'subject'",
    ),
    "payload not object": (
        b'{"id":"i","subject":"a","payload":[],"correlation_id":"c","published_at":1}',
        "'payload'",
    ),
    "time not number": (
        b'{"id":"i","subject":"a","payload":{},"correlation_id":"c","published_at":"x"}',
        "'published_at'",
    ),
    "bad subject token": (
        b'{"id":"i","subject":"a..b","payload":{},"correlation_id":"c","published_at":1}',
        "subject",
    ),
}


@pytest.mark.parametrize("data,names", BAD_ENVELOPES.values(), ids=BAD_ENVELOPES.keys())
def test_malformed_envelope_names_the_problem(data: bytes, names: str) -> None:
    with pytest.raises(EnvelopeError, match=names):
        Envelope.from_bytes(data)


@pytest.mark.parametrize(
    "subject,payload",
    [("a b", {}), ("a.*", {}), ("dlq.x", {}), ("a", {"x": object()}), ("a", {"x": float("nan")})],
    ids=["space", "wildcard", "reserved dlq", "not json", "nan"],
)
def test_new_envelope_rejects_bad_input(subject: str, payload: dict[str, object]) -> None:
    with pytest.raises(EnvelopeError):
        new_envelope(subject, payload)


SUBJECT_MATCHES = {
    "exact": ("a.b", "a.b", True),
    "exact mismatch": ("a.b", "a.c", False),
    "star one token": ("a.*", "a.b", True),
    "star not two": ("a.*", "a.b.c", False),
    "gt one": ("a.>", "a.b", True),
    "gt many": ("a.>", "a.b.c", True),
    "gt needs one": ("a.>", "a", False),
    "middle star": ("a.*.c", "a.b.c", True),
    "longer subject": ("a.b", "a.b.c", False),
    "dlq": ("dlq.>", "dlq.a.b", True),
}


@pytest.mark.parametrize("flt,subject,expected", SUBJECT_MATCHES.values(), ids=SUBJECT_MATCHES.keys())
def test_subject_matches(flt: str, subject: str, expected: bool) -> None:
    assert subject_matches(flt, subject) is expected


@pytest.mark.parametrize("flt", [">", "*.x", "a.>.b", "", "a..b"])
def test_filters_that_would_swallow_dead_letters_or_are_malformed(flt: str) -> None:
    with pytest.raises(EnvelopeError):
        validate_filter(flt)


# -- backoff ------------------------------------------------------------------


def test_backoff_doubles_from_base_and_caps_without_jitter() -> None:
    backoff = Backoff(base=0.05, factor=2, cap=0.3, jitter=0.0)
    rng = random.Random(1)
    assert [backoff.delay(a, rng) for a in range(1, 7)] == [0.05, 0.1, 0.2, 0.3, 0.3, 0.3]
    assert backoff.delay(10_000, rng) == 0.3  # no overflow


def test_backoff_jitter_stays_in_band_and_is_seeded() -> None:
    backoff = Backoff(base=0.05, cap=10.0, jitter=0.5)
    delays = [backoff.delay(3, random.Random(s)) for s in range(200)]
    assert all(0.1 <= d <= 0.2 for d in delays)
    assert len(set(delays)) > 100  # spread out, not one value
    assert backoff.delay(3, random.Random(9)) == backoff.delay(3, random.Random(9))


@pytest.mark.parametrize(
    "kwargs", [{"base": 0}, {"factor": 0.5}, {"base": 1, "cap": 0.5}, {"jitter": 1.5}]
)
def test_backoff_rejects_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)


# -- the in-process bus ----------------------------------------------------------


def envs(n: int, subject: str = "ev.tick") -> list[Envelope]:
    return [new_envelope(subject, {"n": i}) for i in range(n)]


def test_publish_fetch_ack_in_order() -> None:
    async def main() -> None:
        bus = InProcessBus()
        sent = envs(5)
        await bus.publish_many(sent)
        got = await bus.fetch("ev.>", batch=3, timeout=0)
        assert [d.envelope for d in got] == sent[:3]
        assert await bus.pending("ev.>") == 5  # 3 in flight, 2 queued
        for d in got:
            await d.ack()
        rest = await bus.fetch("ev.>", batch=10, timeout=0)
        assert [d.envelope for d in rest] == sent[3:]
        for d in rest:
            await d.ack()
        assert await bus.pending("ev.>") == 0
        assert await bus.fetch("ev.>", timeout=0) == []
        with pytest.raises(BusError, match="already settled"):
            await rest[0].ack()
        await bus.close()

    asyncio.run(main())


def test_fetch_waits_for_a_publish_and_times_out_when_idle() -> None:
    async def main() -> None:
        bus = InProcessBus()
        start = time.monotonic()
        assert await bus.fetch("ev.>", timeout=0.05) == []
        assert time.monotonic() - start >= 0.04
        env = new_envelope("ev.x", {})
        waiter = asyncio.create_task(bus.fetch("ev.>", timeout=5))
        await asyncio.sleep(0.01)
        await bus.publish(env)
        got = await asyncio.wait_for(waiter, 1)
        assert [d.envelope for d in got] == [env]

    asyncio.run(main())


def test_unsettled_delivery_is_redelivered_after_ack_wait() -> None:
    async def main() -> None:
        bus = InProcessBus(ack_wait=0.05)
        env = new_envelope("ev.x", {})
        await bus.publish(env)
        first = await bus.fetch("ev.>", timeout=0)
        assert first[0].envelope.attempt == 1
        # the consumer "crashed": never settles the first delivery
        again = await bus.fetch("ev.>", timeout=1)
        assert again[0].envelope == env.with_attempt(2)
        assert bus.stats.redelivered == 1
        await first[0].ack()  # late ack of a copy already redelivered: harmless
        await again[0].ack()
        assert await bus.pending("ev.>") == 0

    asyncio.run(main())


def test_retry_redelivers_after_the_delay_with_the_next_attempt() -> None:
    async def main() -> None:
        bus = InProcessBus()
        await bus.publish(new_envelope("ev.x", {}))
        (d,) = await bus.fetch("ev.>", timeout=0)
        start = time.monotonic()
        await d.retry(0.1)
        assert await bus.fetch("ev.>", timeout=0) == []  # not before the delay
        (again,) = await bus.fetch("ev.>", timeout=2)
        assert time.monotonic() - start >= 0.09
        assert again.envelope.attempt == 2
        await again.ack()

    asyncio.run(main())


def test_dead_letter_goes_to_the_dlq_subject() -> None:
    async def main() -> None:
        bus = InProcessBus()
        await bus.pending("dlq.>", durable="ops")  # an operator's group, declared first
        env = new_envelope("ev.x", {"k": 1})
        await bus.publish(env)
        (d,) = await bus.fetch("ev.>", timeout=0)
        await d.dead_letter("ValueError: nope")
        (dead,) = await bus.fetch("dlq.>", durable="ops", timeout=0)
        assert dead.envelope == env
        assert bus.recent_dead_letters[-1] == (env, "ValueError: nope")
        assert await bus.pending("ev.>") == 0

    asyncio.run(main())


def test_injected_duplicates_and_reordering_are_seeded() -> None:
    async def deliveries(seed: int) -> list[tuple[int, int]]:
        bus = InProcessBus(duplicate_rate=1.0, max_copies=3, reorder=True, seed=seed)
        sent = envs(50)
        await bus.publish_many(sent)
        got = await bus.fetch("ev.>", batch=1000, timeout=0)
        counts = {e.id: sum(d.envelope.id == e.id for d in got) for e in sent}
        assert set(counts.values()) <= {2, 3} and len(set(counts.values())) == 2
        order = [int(d.envelope.payload["n"]) for d in got]
        assert order != sorted(order)
        return [(int(d.envelope.payload["n"]), d.envelope.attempt) for d in got]

    assert asyncio.run(deliveries(3)) == asyncio.run(deliveries(3))


def test_events_published_before_any_consumer_wait_in_the_backlog() -> None:
    async def main() -> None:
        bus = InProcessBus(max_backlog=3)
        sent = envs(3)
        await bus.publish_many(sent)
        with pytest.raises(BusError, match="backlog is full"):
            await bus.publish(new_envelope("ev.x", {}))
        got = await bus.fetch("ev.>", timeout=0)
        assert [d.envelope for d in got] == sent

    asyncio.run(main())


def test_groups_each_get_a_copy_and_keep_their_filter() -> None:
    async def main() -> None:
        bus = InProcessBus()
        await bus.pending("ev.>", durable="a")
        await bus.pending("ev.x", durable="b")
        await bus.publish(new_envelope("ev.x", {}))
        await bus.publish(new_envelope("ev.y", {}))
        assert len(await bus.fetch("ev.>", durable="a", timeout=0)) == 2
        assert len(await bus.fetch("ev.x", durable="b", timeout=0)) == 1
        with pytest.raises(EnvelopeError, match=r"consumes 'ev\.>'"):
            await bus.fetch("ev.y", durable="a", timeout=0)
        with pytest.raises(EnvelopeError, match="durable consumer name"):
            await bus.fetch("ev.y", durable="bad.name", timeout=0)

    asyncio.run(main())


def test_close_wakes_fetchers_and_refuses_more_work() -> None:
    async def main() -> None:
        bus = InProcessBus()
        waiter = asyncio.create_task(bus.fetch("ev.>", timeout=10))
        await asyncio.sleep(0.01)
        await bus.close()
        with pytest.raises(BusClosed):
            await asyncio.wait_for(waiter, 1)
        with pytest.raises(BusClosed):
            await bus.publish(new_envelope("ev.x", {}))

    asyncio.run(main())


def test_publish_rejects_reserved_and_non_json() -> None:
    async def main() -> None:
        bus = InProcessBus()
        with pytest.raises(EnvelopeError, match="reserved"):
            await bus.publish(Envelope("i", "dlq.x", {}, "c", 1.0))
        with pytest.raises(EnvelopeError, match="canonical JSON"):
            await bus.publish(Envelope("i", "ev.x", {"t": {1, 2}}, "c", 1.0))
        assert json.loads(Envelope("i", "ev.x", {}, "c", 1.0).to_bytes())["id"] == "i"

    asyncio.run(main())
