"""Server-Sent Events over a real HTTP server: order, resume with Last-Event-ID, the gap
notice, filters, and a slow client that never blocks the engine and is told what it missed."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx

from mlwe.api.auth import Role
from mlwe.client import StreamEvent, parse_sse
from mlwe.runtime.streams import StreamHub
from tests.api.conftest import Live, wait_for


def _events(live: Live, params: dict[str, str], headers: dict[str, str] | None = None) -> Iterator[StreamEvent]:
    h = {**live.api.h(Role.VIEWER), **(headers or {})}
    with httpx.Client(base_url=live.url, timeout=httpx.Timeout(10, read=10)) as c, c.stream(
        "GET", "/api/v1/streams", params=params, headers=h
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        yield from parse_sse(r.iter_lines())


def _take(it: Iterator[StreamEvent], n: int, topic: str = "reasoning") -> list[StreamEvent]:
    out = []
    for ev in it:
        if ev.topic == topic:
            out.append(ev)
            if len(out) == n:
                break
    return out


def _publish(hub: StreamHub, start: int, n: int, topic: str = "reasoning", **kw: object) -> list[int]:
    return [hub.publish(topic, {"n": i}, **kw).id for i in range(start, start + n)]  # type: ignore[arg-type]


def test_events_arrive_in_order_and_a_reconnect_resumes_exactly_after_last_event_id(live: Live) -> None:
    hub = live.api.engine.streams
    ids = _publish(hub, 0, 5)
    it = _events(live, {"topics": "reasoning", "after": str(ids[0] - 1)})
    first = _take(it, 5)
    it.close()
    assert [e.data["data"]["n"] for e in first] == [0, 1, 2, 3, 4]
    assert [e.id for e in first] == ids
    # the client saw up to the third event, then lost its connection; more happen meanwhile
    ids += _publish(hub, 5, 5)
    resumed = _take(_events(live, {"topics": "reasoning"}, {"Last-Event-ID": str(ids[2])}), 7)
    assert [e.data["data"]["n"] for e in resumed] == [3, 4, 5, 6, 7, 8, 9]  # nothing lost, nothing twice
    assert [e.id for e in resumed] == ids[3:]


def test_resuming_from_before_the_replay_ring_says_so(live: Live) -> None:
    small = StreamHub(ring_size=5)
    live.api.engine.streams = small  # the API reads the engine's hub for each new client
    _publish(small, 0, 20)
    it = _events(live, {"topics": "reasoning"}, {"Last-Event-ID": "1"})
    notices = []
    for ev in it:
        notices.append(ev.topic)
        if ev.topic == "reasoning":
            break
    it.close()
    assert "gap" in notices and notices.index("gap") < notices.index("reasoning")


def test_filters_by_topic_and_workload(live: Live) -> None:
    hub = live.api.engine.streams
    start = hub.last_id
    hub.publish("state", {"n": 1}, workload="other")
    hub.publish("telemetry", {"n": 2}, workload="mine")
    hub.publish("state", {"n": 3}, workload="mine")
    hub.publish("state", {"n": 4}, workload="mine")
    got = _take(_events(live, {"topics": "state", "workload": "mine", "after": str(start)}), 2, "state")
    assert [e.data["data"]["n"] for e in got] == [3, 4]


def test_bad_stream_requests_are_refused_with_the_reason(live: Live) -> None:
    h = live.api.h(Role.VIEWER)
    with httpx.Client(base_url=live.url, headers=h) as c:
        r = c.get("/api/v1/streams", params={"topics": "state,gossip"})
        assert r.status_code == 422 and "gossip" in r.json()["errors"][0]["message"]
        r = c.get("/api/v1/streams", headers={"Last-Event-ID": "yesterday"})
        assert r.status_code == 422 and "Last-Event-ID" in r.json()["errors"][0]["path"]


def _read_sse_from_socket(sock: socket.socket, until: int, timeout: float = 30.0) -> list[tuple[str, dict]]:
    """Raw SSE events (event name, JSON data) read until the reasoning event with n == until.

    The body is chunked; uvicorn sends each write as one chunk, and each write is whole
    SSE events, so the chunk-size lines fall between events and are skipped as noise."""
    sock.settimeout(timeout)
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += sock.recv(65536)
    head, rest = raw.split(b"\r\n\r\n", 1)
    assert b" 200 " in head.split(b"\r\n")[0], head
    text = rest.decode("utf-8", "replace")
    out: list[tuple[str, dict]] = []
    while True:
        *blocks, text = text.split("\n\n")
        for block in blocks:
            name, data = "message", None
            for line in block.splitlines():
                line = line.strip("\r")
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
            if data is None:
                continue
            out.append((name, data))
            if name == "reasoning" and data["data"].get("n") == until:
                return out
        chunk = sock.recv(65536)
        assert chunk, "the server closed the stream"
        text += chunk.decode("utf-8", "replace")


def test_a_slow_client_never_blocks_the_engine_and_hears_what_it_missed(live: Live) -> None:
    hub = live.api.engine.streams
    baseline = hub.subscribers
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    token = live.api.tokens[Role.VIEWER]
    sock.sendall(
        (f"GET /api/v1/streams?topics=reasoning&buffer=50 HTTP/1.1\r\nHost: x\r\n"
         f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n").encode()
    )
    assert wait_for(lambda: hub.subscribers == baseline + 1)
    # the client reads nothing while the engine publishes far more than its buffer holds
    n = 3000
    pad = "x" * 20_000  # 60 MB in all: far more than the socket buffers hold
    done = threading.Event()

    def publish() -> None:
        for i in range(n):
            hub.publish("reasoning", {"n": i, "pad": pad})
        done.set()

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    assert done.wait(60), "publishing blocked on a slow reader"
    events = _read_sse_from_socket(sock, until=n - 1)
    sock.close()
    names = [name for name, _ in events]
    dropped = [d for name, d in events if name == "dropped"]
    got = [d["data"]["n"] for name, d in events if name == "reasoning"]
    assert dropped and sum(d["dropped"] for d in dropped) > 0, names[:10]
    assert got[-1] == n - 1  # the newest events arrive
    assert len(got) < n  # ... and the oldest were dropped, not queued without bound
    assert got == sorted(got)
    assert sum(d["dropped"] for d in dropped) + len(got) <= n
    # the server lets go of the subscription once the client is gone
    assert wait_for(lambda: hub.subscribers == baseline, timeout=30)


def test_the_stream_carries_sanitised_data_only(live: Live) -> None:
    hub = live.api.engine.streams
    start = hub.last_id
    hub.publish("reasoning", {"n": 1, "env": {"API_KEY": "sk-live-abcdefghijklmnop1234"},
                              "note": "password=hunter2hunter2"})
    got = _take(_events(live, {"topics": "reasoning", "after": str(start)}), 1)
    text = json.dumps(got[0].data)
    assert "sk-live-abcdefghijklmnop1234" not in text and "hunter2hunter2" not in text


def test_the_real_engine_streams_state_audit_and_scheduler_reasoning(live: Live) -> None:
    start = live.api.engine.streams.last_id
    h = live.api.h(Role.SUBMITTER)
    with httpx.Client(base_url=live.url, headers=h) as c:
        r = c.post("/api/v1/workloads", json={"id": "s1", "name": "s1", "resources": {"cpu": 1},
                                              "estimated_duration": "1m"})
        assert r.status_code == 201
        cid = r.json()["correlation_id"]
    seen: set[str] = set()
    deadline = time.monotonic() + 20
    for ev in _events(live, {"topics": "state,audit", "after": str(start), "correlation_id": cid}):
        if ev.id is None:
            continue  # a notice (hello)
        seen.add(ev.topic)
        assert ev.data["correlation_id"] == cid
        if {"state", "audit"} <= seen or time.monotonic() > deadline:
            break
    assert {"state", "audit"} <= seen
