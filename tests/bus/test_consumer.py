"""The idempotent consumer over the in-process bus and a real SQLite file database."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Column, Engine, MetaData, String, Table, insert, select

from mlwe.bus import (
    Backoff,
    Envelope,
    IdempotentConsumer,
    InProcessBus,
    Outcome,
    dead_letters,
    new_envelope,
    replay_dead_letter,
)
from mlwe.store import schema
from mlwe.store.events import EventClaim, is_processed
from tests.bus import (
    effect_counts,
    effects,
    postgres_engine,
    processed_count,
    record_effect,
    sqlite_engine,
)

FAST = Backoff(base=0.001, cap=0.01)


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """SQLite (a WAL file in tmp_path) and the real PostgreSQL (a fresh schema)."""
    if request.param == "sqlite":
        eng = sqlite_engine(tmp_path / "bus.db")
        yield eng
        eng.dispose()
    else:
        with postgres_engine() as eng:
            yield eng


@pytest.mark.parametrize("concurrency", [1, 4])
def test_duplicates_and_reordering_have_no_second_effect(engine: Engine, concurrency: int) -> None:
    async def main() -> None:
        bus = InProcessBus(duplicate_rate=1.0, max_copies=3, reorder=True, seed=11)
        # With 4 workers, copies of one event in one batch race on separate connections.
        consumer = IdempotentConsumer(engine, record_effect, seed=1, concurrency=concurrency)
        sent = [new_envelope("ev.tick", {"n": i}) for i in range(300)]
        await bus.publish_many(sent)
        await bus.publish(sent[0])  # and a publisher that retried one outright
        await consumer.run_until_idle(bus, "ev.>", batch=64)
        assert effect_counts(engine) == (300, 300)
        assert processed_count(engine) == 300
        m = consumer.metrics
        assert (m.processed, m.retries, m.dead_lettered) == (300, 0, 0)
        assert m.duplicates == bus.stats.delivered - 300 >= 301  # every copy beyond the first
        with engine.connect() as conn:
            ns = sorted(r.n for r in conn.execute(select(effects.c.n)))
        assert ns == list(range(300))

    asyncio.run(main())


def test_apply_reports_processed_then_duplicate(engine: Engine) -> None:
    consumer = IdempotentConsumer(engine, record_effect)
    env = new_envelope("ev.x", {"n": 1})
    assert consumer.apply(env) is True
    assert consumer.apply(env) is False
    assert consumer.apply(env.with_attempt(2)) is False
    assert effect_counts(engine) == (1, 1)


class Flaky:
    """Fails the first ``failures`` calls per event, then records the effect."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: dict[str, list[int]] = {}

    def __call__(self, env: Envelope, conn: Any) -> None:
        seen = self.calls.setdefault(env.id, [])
        seen.append(env.attempt)
        record_effect(env, conn)  # written, then rolled back when we raise
        if len(seen) <= self.failures:
            raise RuntimeError(f"transient failure {len(seen)}")


def test_handler_failing_twice_is_retried_and_applied_once(engine: Engine) -> None:
    async def main() -> None:
        bus = InProcessBus()
        handler = Flaky(failures=2)
        consumer = IdempotentConsumer(engine, handler, max_attempts=5, backoff=FAST, seed=2)
        env = new_envelope("ev.x", {"n": 7})
        await bus.publish(env)
        await consumer.run_until_idle(bus, "ev.>")
        assert handler.calls[env.id] == [1, 2, 3]  # attempts as the bus counted them
        assert effect_counts(engine) == (1, 1)
        assert processed_count(engine) == 1
        m = consumer.metrics
        assert (m.processed, m.duplicates, m.retries, m.dead_lettered) == (1, 0, 2, 0)
        assert dead_letters(engine) == []

    asyncio.run(main())


def test_always_failing_handler_dead_letters_then_replay_applies_once(engine: Engine) -> None:
    async def main() -> None:
        bus = InProcessBus()
        good = new_envelope("ev.ok", {"n": 1})
        bad = new_envelope("ev.bad", {"n": 2}, correlation_id="req-42")

        def handler(env: Envelope, conn: Any) -> None:  # only the "bad" event fails
            (_boom if env.id == bad.id else record_effect)(env, conn)

        consumer = IdempotentConsumer(engine, handler, max_attempts=3, backoff=FAST, seed=3)
        await bus.publish_many([good, bad])
        await consumer.run_until_idle(bus, "ev.>")

        assert effect_counts(engine) == (1, 1)
        assert processed_count(engine) == 1
        (dead,) = dead_letters(engine)
        assert dead.event_id == bad.id and dead.subject == "ev.bad"
        assert dead.error == "ValueError: poison payload 2"
        assert dead.attempts == 3
        assert (dead.replayed, dead.processed) == (False, False)
        assert dead.envelope == bad and dead.correlation_id == "req-42"
        assert bus.recent_dead_letters[-1] == (bad, "ValueError: poison payload 2")
        m = consumer.metrics
        assert (m.processed, m.retries, m.dead_lettered) == (1, 2, 1)

        # The operator fixes the handler and replays: applied exactly once.
        consumer.handler = record_effect
        replayed = await replay_dead_letter(engine, bus, bad.id)
        assert replayed == bad  # same id, same correlation id
        await consumer.run_until_idle(bus, "ev.>")
        assert effect_counts(engine) == (2, 2)
        (dead,) = dead_letters(engine)
        assert (dead.replayed, dead.processed) == (True, True)
        assert dead_letters(engine, include_replayed=False) == []

        # Replaying again is harmless: a duplicate, no second effect.
        await replay_dead_letter(engine, bus, bad.id)
        await consumer.run_until_idle(bus, "ev.>")
        assert effect_counts(engine) == (2, 2)
        assert consumer.metrics.duplicates == 1

        with pytest.raises(KeyError, match="no dead letter"):
            await replay_dead_letter(engine, bus, "nope")

    asyncio.run(main())


def _boom(env: Envelope, conn: Any) -> None:
    record_effect(env, conn)
    raise ValueError(f"poison payload {env.payload['n']}")


def test_a_dead_letter_that_fails_again_after_replay_is_updated(engine: Engine) -> None:
    async def main() -> None:
        bus = InProcessBus()
        consumer = IdempotentConsumer(engine, _boom, max_attempts=2, backoff=FAST)
        env = new_envelope("ev.bad", {"n": 5})
        await bus.publish(env)
        await consumer.run_until_idle(bus, "ev.>")
        await replay_dead_letter(engine, bus, env.id)
        assert dead_letters(engine)[0].replayed is True
        await consumer.run_until_idle(bus, "ev.>")
        (dead,) = dead_letters(engine)
        assert (dead.replayed, dead.attempts, dead.processed) == (False, 2, False)
        assert consumer.metrics.dead_lettered == 2
        assert effect_counts(engine) == (0, 0)

    asyncio.run(main())


def test_effect_and_processed_row_roll_back_together(engine: Engine) -> None:
    # The handler's effect statement succeeds, then the handler fails:
    # neither the effect nor the processed row may survive.
    consumer = IdempotentConsumer(engine, _boom)
    env = new_envelope("ev.x", {"n": 3})
    with pytest.raises(ValueError, match="poison"):
        consumer.apply(env)
    assert effect_counts(engine) == (0, 0)
    assert processed_count(engine) == 0
    # ... and they commit together: a good handler leaves both.
    consumer.handler = record_effect
    assert consumer.apply(env) is True
    assert effect_counts(engine) == (1, 1)
    with engine.connect() as conn:
        row = conn.execute(select(schema.processed_events)).one()
    assert row.event_id == env.id


def test_handlers_own_integrity_error_is_a_failure_not_a_duplicate(engine: Engine) -> None:
    unique = Table("bus_test_unique", MetaData(), Column("k", String(8), primary_key=True))
    unique.create(engine)

    def insert_same_key(env: Envelope, conn: Any) -> None:
        conn.execute(unique.insert(), {"k": "same"})

    async def main() -> None:
        bus = InProcessBus()
        consumer = IdempotentConsumer(engine, insert_same_key, max_attempts=2, backoff=FAST)
        first, second = new_envelope("ev.a", {}), new_envelope("ev.b", {})
        await bus.publish_many([first, second])
        await consumer.run_until_idle(bus, "ev.>")
        m = consumer.metrics
        assert (m.processed, m.duplicates, m.dead_lettered) == (1, 0, 1)
        (dead,) = dead_letters(engine)
        assert dead.event_id == second.id and dead.error.startswith("IntegrityError")

    asyncio.run(main())


def test_crash_between_commit_and_ack_is_a_duplicate_on_redelivery(engine: Engine) -> None:
    async def main() -> None:
        bus = InProcessBus(ack_wait=0.05)
        consumer = IdempotentConsumer(engine, record_effect)
        env = new_envelope("ev.x", {"n": 1})
        await bus.publish(env)
        (delivery,) = await bus.fetch("ev.>", timeout=0)
        assert consumer.apply(delivery.envelope) is True  # committed ... then "crashed"
        await consumer.run_until_idle(bus, "ev.>")  # the bus redelivers after ack_wait
        assert consumer.metrics.duplicates == 1 and consumer.metrics.processed == 0
        assert effect_counts(engine) == (1, 1)

    asyncio.run(main())


def test_cannot_record_the_dead_letter_keeps_it_on_the_bus(engine: Engine) -> None:
    async def main() -> None:
        bus = InProcessBus()
        consumer = IdempotentConsumer(engine, _boom, max_attempts=1, backoff=FAST)
        schema.dead_letters.drop(engine)  # the database refuses the dead-letter row
        await bus.publish(new_envelope("ev.x", {"n": 1}))
        (delivery,) = await bus.fetch("ev.>", timeout=0)
        assert await consumer.process([delivery]) == [Outcome.RETRY]
        assert await bus.pending("ev.>") == 1  # not acknowledged, not lost
        schema.dead_letters.create(engine)
        await consumer.run_until_idle(bus, "ev.>")
        assert [d.attempts for d in dead_letters(engine)] == [2]

    asyncio.run(main())


def test_consumer_stops_on_event_and_on_close(engine: Engine) -> None:
    async def main() -> None:
        bus = InProcessBus()
        consumer = IdempotentConsumer(engine, record_effect)
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(bus, "ev.>", stop=stop, fetch_timeout=0.02))
        await bus.publish(new_envelope("ev.x", {"n": 1}))
        for _ in range(100):
            if consumer.metrics.processed:
                break
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, 1)
        task = asyncio.create_task(consumer.run(bus, "ev.>", fetch_timeout=5))
        await asyncio.sleep(0.01)
        await bus.close()
        await asyncio.wait_for(task, 1)
        assert consumer.metrics.as_dict() == {
            "processed": 1, "duplicates": 0, "retries": 0, "dead_lettered": 0,
            "transport_errors": 0,
        }

    asyncio.run(main())


def test_non_upsert_dialect_path_detects_duplicates_by_integrity_error(engine: Engine) -> None:
    consumer = IdempotentConsumer(engine, record_effect)
    # Force the portable path (plain INSERT in a savepoint; the primary key violation says
    # "duplicate" and rolls back only to the savepoint)
    consumer._claim.returning = False
    consumer._claim.stmt = insert(schema.processed_events)
    env = new_envelope("ev.x", {"n": 1})
    assert consumer.apply(env) is True
    assert consumer.apply(env) is False
    assert effect_counts(engine) == (1, 1)
    claim = EventClaim(engine)
    claim.returning, claim.stmt = False, insert(schema.processed_events)
    with engine.begin() as conn:  # a duplicate leaves the caller's transaction usable
        assert claim(conn, "ev.y", 1.0) is True
        assert claim(conn, "ev.y", 2.0) is False
        assert claim(conn, "ev.z", 3.0) is True
    with engine.connect() as conn:
        assert is_processed(conn, "ev.y") and is_processed(conn, "ev.z")
