"""The Python client library: typed answers that match the server's models, one error
hierarchy, wait(), a stream that reconnects across a server restart, and the async twin."""

from __future__ import annotations

import asyncio
import threading
import time
import typing
from pathlib import Path

import pytest
import uvicorn

from mlwe.api import models
from mlwe.api.auth import Role
from mlwe.client import (
    MODELS,
    AsyncClient,
    Client,
    ClientError,
    Conflict,
    Forbidden,
    InvalidRequest,
    NotFound,
    ServerUnreachable,
    WaitTimeout,
)
from tests.api.conftest import Api, Live, free_port, make_api, wait_for


@pytest.mark.parametrize("server_name", sorted(MODELS))
def test_typed_answers_have_the_fields_of_the_servers_models(server_name: str) -> None:
    server = getattr(models, server_name)
    client = MODELS[server_name]
    assert set(typing.get_type_hints(client)) == set(server.model_fields), server_name


def test_a_down_server_is_a_client_error() -> None:
    with Client(f"http://127.0.0.1:{free_port()}", "x", timeout=5) as c, pytest.raises(ServerUnreachable) as err:
        c.workloads()
    assert isinstance(err.value, ClientError) and err.value.status == 0
    assert "cannot reach the server" in str(err.value)


def test_each_status_has_its_error_and_wait_returns_at_a_state(live: Live) -> None:
    with Client(live.url, live.api.tokens[Role.SUBMITTER]) as c:
        with pytest.raises(InvalidRequest) as bad:
            c.submit({"name": "bad", "replicas": -1})
        assert bad.value.errors[0]["path"] == "replicas"
        with pytest.raises(NotFound):
            c.workload("nope")
        with pytest.raises(Forbidden):
            c.node_action("a100-0", "cordon")
        created = c.submit({"id": "c-w", "name": "c-w", "resources": {"cpu": 1}, "estimated_duration": 3600})
        w = c.wait(created["created"][0], {"running"}, timeout=30, poll=0.05)
        assert w["state"] == "running" and w["nodes"]
        with pytest.raises(WaitTimeout) as late:
            c.wait("c-w", {"succeeded"}, timeout=0.3, poll=0.05)
        assert late.value.last is not None and late.value.last["state"] == "running"
        c.cancel("c-w")
        with pytest.raises(Conflict):
            c.cancel("c-w")
        page = c.workload_page(limit=1)
        assert page["total"] == 1 and page["next_offset"] is None and page["now"] > 0


def test_iter_workloads_pages_through_everything(live: Live) -> None:
    with Client(live.url, live.api.tokens[Role.SUBMITTER]) as c:
        c.submit([{"id": f"p{i}", "name": f"p{i}", "resources": {"cpu": 1}} for i in range(7)])
        assert c.workload_page(limit=3)["next_offset"] == 3
        assert sorted(w["id"] for w in c.iter_workloads(page_size=3)) == [f"p{i}" for i in range(7)]


def _serve(api: Api, port: int) -> tuple[uvicorn.Server, threading.Thread]:
    server = uvicorn.Server(uvicorn.Config(api.svc.app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=1))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    assert wait_for(lambda: server.started, timeout=20)
    return server, t


def test_the_stream_reconnects_across_a_server_restart_and_misses_nothing(tmp_path: Path) -> None:
    api = make_api(tmp_path)
    port = free_port()
    hub = api.engine.streams
    server, thread = _serve(api, port)
    got: list[int] = []
    notices: list[str] = []
    try:
        with Client(f"http://127.0.0.1:{port}", api.tokens[Role.VIEWER]) as c:
            it = c.stream(["reasoning"], last_event_id=hub.last_id, notices=True, max_retries=20)
            base = hub.subscribers
            threading.Thread(
                target=lambda: wait_for(lambda: hub.subscribers > base) and hub.publish("reasoning", {"n": 0}),
                daemon=True,
            ).start()
            for ev in it:
                if ev.id is not None:
                    got.append(ev.payload["n"])
                    break
            # the server goes away; an event is published while the client is not connected
            server.should_exit = True
            thread.join(timeout=15)
            hub.publish("reasoning", {"n": 1})
            server, thread = _serve(api, port)
            hub.publish("reasoning", {"n": 2})
            for ev in it:
                if ev.id is None:
                    notices.append(ev.topic)
                    continue
                got.append(ev.payload["n"])
                if len(got) == 3:
                    break
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        api.svc.close()
    assert got == [0, 1, 2]  # resumed after the last event seen: the one missed was replayed
    assert "reconnecting" in notices


def test_the_async_client_submits_waits_and_streams(live: Live) -> None:
    hub = live.api.engine.streams

    async def run() -> tuple[str, int]:
        async with AsyncClient(live.url, live.api.tokens[Role.SUBMITTER]) as c:
            await c.submit({"id": "a-w", "name": "a-w", "resources": {"cpu": 1}, "estimated_duration": 3600})
            w = await c.wait("a-w", {"running"}, timeout=30, poll=0.05)
            start = hub.last_id
            t0 = time.monotonic()

            async def publish() -> None:
                while hub.subscribers == 0 and time.monotonic() - t0 < 10:
                    await asyncio.sleep(0.02)
                hub.publish("reasoning", {"n": 7})

            task = asyncio.create_task(publish())
            async for ev in c.stream(["reasoning"], last_event_id=start):
                await task
                return w["state"], int(ev.payload["n"])
        raise AssertionError("the stream ended")

    assert asyncio.run(run()) == ("running", 7)
