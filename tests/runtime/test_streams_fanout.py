"""Stream fan-out runs off the publisher's thread (the engine publishes under its lock)."""

from __future__ import annotations

import asyncio
import threading

from mlwe.runtime.streams import StreamHub


def test_publish_does_not_wait_for_a_reader() -> None:
    hub = StreamHub(fanout_interval_s=0.0)
    sub = hub.subscribe(["state"])
    with sub._cond:  # a reader busy with its buffer: the old hub blocked the publisher here
        done = threading.Event()

        def publish() -> None:
            for i in range(100):
                hub.publish("state", {"i": i})
            done.set()

        t = threading.Thread(target=publish, daemon=True)
        t.start()
        assert done.wait(timeout=30), "publish waited for a reader's lock"
    events, dropped = sub.drain()
    assert [e.data["i"] for e in events] == list(range(100)) and dropped == 0


def test_a_synchronous_drain_sees_everything_published_before_it() -> None:
    hub = StreamHub(fanout_interval_s=3600.0)  # the dispatcher would wait an hour between batches
    sub = hub.subscribe()
    hub.publish("state", {"n": 1})  # the first goes out at once
    hub.publish("audit", {"n": 2})
    hub.publish("telemetry", {"n": 3})
    events, _ = sub.drain()
    assert [e.data["n"] for e in events] == [1, 2, 3]


def test_a_resumed_reader_gets_each_event_once_in_order() -> None:
    hub = StreamHub(fanout_interval_s=0.0)
    first = hub.subscribe()
    for i in range(10):
        hub.publish("state", {"i": i})
    seen, _ = first.drain()
    resumed = hub.subscribe(last_event_id=seen[4].id)  # replayed from the ring: 5..9
    for i in range(10, 15):
        hub.publish("state", {"i": i})
    got, _ = resumed.drain()
    assert [e.data["i"] for e in got] == list(range(5, 15))


def test_many_async_readers_on_one_loop_are_woken_per_batch() -> None:
    hub = StreamHub(fanout_interval_s=0.0)

    async def main() -> list[list[int]]:
        subs = [hub.subscribe(["telemetry"]) for _ in range(50)]

        async def read(s):  # type: ignore[no-untyped-def]
            got: list[int] = []
            while len(got) < 20:
                evs, _ = await s.wait(30)
                got += [e.data["i"] for e in evs]
            return got

        tasks = [asyncio.create_task(read(s)) for s in subs]
        await asyncio.sleep(0)
        threading.Thread(target=lambda: [hub.publish("telemetry", {"i": i}) for i in range(20)]).start()
        return list(await asyncio.gather(*tasks))

    for got in asyncio.run(main()):
        assert got == list(range(20))
