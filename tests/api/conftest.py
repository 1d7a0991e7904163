"""Fixtures for the API: a real engine (SQLite store, simulated cluster behind the fault
injector, engine loop running on a sped-up wall clock), its app, a token per role, an
in-process client, and a real uvicorn server on a free port for streaming tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from fastapi.testclient import TestClient

from mlwe.api.auth import Role
from mlwe.api.context import ApiSettings
from mlwe.api.serve import Service, build_service
from mlwe.core.spec import ClusterSpec, NodeSpec

SMALL_CLUSTER = ClusterSpec(
    nodes=(
        NodeSpec(name="a100-0", gpu_model="A100-80GB", gpus=4, cpu=32, memory="256Gi"),
        NodeSpec(name="a100-1", gpu_model="A100-80GB", gpus=4, cpu=32, memory="256Gi"),
        NodeSpec(name="t4-0", gpu_model="T4", gpus=2, cpu=16, memory="64Gi"),
        NodeSpec(name="cpu-0", cpu=32, memory="128Gi"),
    )
)


@dataclass
class Api:
    svc: Service
    client: TestClient
    tokens: dict[Role, str]

    def h(self, role: Role | None) -> dict[str, str]:
        return {} if role is None else {"Authorization": f"Bearer {self.tokens[role]}"}

    @property
    def engine(self):  # type: ignore[no-untyped-def]
        return self.svc.engine


def make_api(tmp_path: Path, settings: ApiSettings | None = None, speed: float = 20.0) -> Api:
    svc = build_service(
        data_dir=tmp_path,
        cluster=SMALL_CLUSTER,
        speed=speed,
        generator=False,
        agent=False,
        create_admin=False,
        settings=settings,
    )
    tokens = {r: svc.tokens.create(f"{r.label}-user", r)[0] for r in Role}
    return Api(svc, TestClient(svc.app), tokens)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    a = make_api(tmp_path)
    try:
        yield a
    finally:
        a.svc.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Live:
    api: Api
    url: str
    server: uvicorn.Server


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    """A real HTTP server (uvicorn on a free port) in front of a real engine."""
    a = make_api(tmp_path)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(a.svc.app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield Live(a, f"http://127.0.0.1:{port}", server)
    finally:
        server.should_exit = True
        t.join(timeout=10)
        a.svc.close()


def wait_for(predicate, timeout: float = 20.0, period: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period)
    return predicate()
