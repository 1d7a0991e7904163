"""A database outage: every route answers JSON (a 503 naming the store when it needs the
database), never a plain-text 500.

The store is PostgreSQL behind a TCP proxy that the test cuts: open connections
are reset and new ones refused, as when the database host goes away.
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
import threading
import uuid
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, make_url, text
from sqlalchemy import exc as sa_exc

from mlwe.api.app import route_roles
from mlwe.api.auth import Role
from mlwe.api.serve import build_service
from mlwe.store.db import StoreUnavailable
from tests.api.conftest import SMALL_CLUSTER
from tests.store.conftest import PG_URL, require_postgres


class CuttableProxy:
    """Forwards 127.0.0.1:<port> to PostgreSQL until :meth:`cut`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.up = threading.Event()
        self.up.set()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up.is_set():
                client.close()  # the database is "down": refuse
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                ready, _, _ = select.select([a, b], [], [], 1.0)
                if not self.up.is_set():
                    break
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    (b if s is a else a).sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()

    def cut(self) -> None:
        self.up.clear()
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for a, b in pairs:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def restore(self) -> None:
        self.up.set()

    def close(self) -> None:
        self._stop = True
        self.cut()
        self.listener.close()


@pytest.fixture
def proxied_pg() -> Iterator[tuple[str, CuttableProxy]]:
    require_postgres()
    admin = create_engine(PG_URL)
    schema = f"mlweout_{uuid.uuid4().hex[:10]}"
    with admin.begin() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    u = make_url(PG_URL)
    proxy = CuttableProxy((u.host or "127.0.0.1", u.port or 5432))
    url = u.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    sep = "&" if "?" in url else "?"
    try:
        yield f"{url}{sep}options=-csearch_path%3D{schema}", proxy
    finally:
        proxy.close()
        with admin.begin() as c:
            c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def test_every_route_answers_json_during_a_database_outage(proxied_pg: tuple[str, CuttableProxy]) -> None:
    url, proxy = proxied_pg
    svc = build_service(database_url=url, cluster=SMALL_CLUSTER, speed=20, generator=False,
                        agent=False, create_admin=False)
    try:
        c = TestClient(svc.app, raise_server_exceptions=False)
        admin, _ = svc.tokens.create("admin", Role.ADMIN)
        fresh, _ = svc.tokens.create("fresh", Role.ADMIN)  # never used: not in the token cache
        assert c.get("/api/v1/whoami", headers={"Authorization": f"Bearer {admin}"}).status_code == 200
        svc.tokens.cache_ttl_s = 3600.0  # the admin token stays cached for the whole test
        c.get("/api/v1/whoami", headers={"Authorization": f"Bearer {admin}"})
        svc.tokens._cache.clear()
        assert c.get("/api/v1/whoami", headers={"Authorization": f"Bearer {admin}"}).status_code == 200

        proxy.cut()
        routes = [(m, p) for m, p, role in route_roles(svc.app) if role is not None and m != "HEAD"]
        assert len(routes) > 20
        for method, path in routes:
            # a token the server must look up: the lookup needs the database -> 503, JSON
            r = c.request(method, _concrete(path), headers={"Authorization": f"Bearer {fresh}"}, json={})
            assert r.status_code == 503, (method, path, r.status_code, r.text)
            assert r.headers["content-type"].startswith("application/json"), (method, path)
            assert "store (database) is unavailable" in r.json()["detail"], (method, path, r.text)
            assert r.headers["retry-after"] == "5"
            if path.endswith("/streams"):
                continue  # with a valid token the stream would stay open
            # a cached token: what the route can answer from memory it answers; what needs
            # the database is a JSON 503; nothing is a 500 or plain text
            r = c.request(method, _concrete(path), headers={"Authorization": f"Bearer {admin}"}, json={})
            assert r.status_code < 500 or r.status_code == 503, (method, path, r.status_code, r.text)
            assert r.headers["content-type"].startswith(("application/json", "text/plain; version=0.0.4")), (
                method, path, r.headers["content-type"])
        # a submission during the outage is a 503 (the route says nothing was acknowledged)
        r = c.post("/api/v1/workloads", json={"id": "o1", "name": "o1", "resources": {"cpu": 1}},
                   headers={"Authorization": f"Bearer {admin}"})
        assert r.status_code == 503 and r.headers["content-type"].startswith("application/json"), r.text
        r = c.get("/api/v1/audit", headers={"Authorization": f"Bearer {admin}"})
        assert r.status_code == 503 and "store (database) is unavailable" in r.json()["detail"], r.text
        assert c.get("/readyz").status_code == 503

        proxy.restore()
        r = c.get("/api/v1/whoami", headers={"Authorization": f"Bearer {fresh}"})
        assert r.status_code == 200, r.text
    finally:
        proxy.restore()
        svc.close()


@pytest.mark.parametrize(
    ("exc", "outage"),
    [
        (sa_exc.OperationalError("SELECT", {}, Exception("connection refused")), True),
        (sa_exc.InterfaceError("SELECT", {}, Exception("connection closed")), True),
        (StoreUnavailable("after 5 attempts"), True),
        (sa_exc.IntegrityError("INSERT", {}, Exception("duplicate key")), False),
        (ValueError("a bug"), False),
    ],
    ids=["operational", "interface", "store-unavailable", "integrity-is-not-an-outage", "a-bug"],
)
def test_what_counts_as_an_outage(exc: Exception, outage: bool) -> None:
    from mlwe.api.errors import store_outage

    assert store_outage(exc) is outage
