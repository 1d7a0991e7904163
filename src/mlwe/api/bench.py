"""``mlwe bench api``: the API's figures, measured over real HTTP on loopback.

The server runs in its own process (``python -m mlwe.api.bench --serve``): a
real engine (SQLite store with fsync, simulated cluster, engine loop running)
behind uvicorn, so the client's work does not share the server's interpreter.

- ``submit_per_s``: workloads submitted per second by ``concurrency`` HTTP
  clients, one workload per request, each answered only once durable. The
  submit rate limiter is set out of the way for this measurement (it is a
  per-token policy, not a capacity), and the bench says so.
- ``sse_p99_lag_ms``: ``sse_clients`` stream clients each follow the
  telemetry stream while the server publishes ``events_per_s`` events (each
  stamped with its publication time); lag is delivery time minus publication
  time, over every delivery to every client.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    vs = sorted(values)
    k = min(len(vs) - 1, max(0, round(q * (len(vs) - 1))))
    return vs[k]


# ================================================================ server side
def _serve(port: int, data_dir: str, token_file: str, clients: int, rate: float, seconds: float) -> None:
    import logging

    import uvicorn

    from mlwe.api.auth import Role
    from mlwe.api.context import ApiSettings
    from mlwe.api.serve import build_service

    logging.basicConfig(level=logging.WARNING)
    settings = ApiSettings(submit_rate_per_s=1e9, submit_burst=10**9, stream_buffer=5000)
    svc = build_service(
        data_dir=data_dir, generator=False, agent=False, settings=settings, create_admin=False
    )
    token, _ = svc.tokens.create("bench", Role.ADMIN)
    Path(token_file).write_text(token)
    hub = svc.engine.streams
    base = hub.subscribers  # the server's own readers (decision relay)

    def publisher() -> None:
        # wait for every SSE client, then publish at a steady rate
        while hub.subscribers < base + clients:
            time.sleep(0.05)
        n = int(rate * seconds)
        t0 = time.perf_counter()
        for i in range(n):
            due = t0 + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            hub.publish("telemetry", {"bench": i, "sent_at": time.time(), "node": "bench", "metrics": {}})
        hub.publish("telemetry", {"bench": -1, "sent_at": time.time(), "node": "bench", "metrics": {}})

    if rate > 0:
        threading.Thread(target=publisher, daemon=True).start()
    try:
        uvicorn.run(svc.app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                    timeout_graceful_shutdown=2)
    finally:
        svc.close()


# ================================================================ client side
class _Conn:
    """A minimal HTTP/1.1 keep-alive connection (the load generator must not be the
    bottleneck: httpx's async client costs more CPU per request than the server does)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> _Conn:
        r, w = await asyncio.open_connection(host, port)
        return cls(r, w)

    async def request(self, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, bytes]:
        head = [f"{method} {path} HTTP/1.1", "Host: bench"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        head.append(f"Content-Length: {len(body)}")
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await self.writer.drain()
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        data = await self.reader.readexactly(length) if length else b""
        return status, data

    def close(self) -> None:
        self.writer.close()


async def _submits(url: str, token: str, n: int, concurrency: int) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    latencies: list[float] = []
    errors: list[str] = []
    counter = iter(range(n))
    conns = [await _Conn.open(host, int(port)) for _ in range(concurrency)]

    async def worker(conn: _Conn) -> None:
        for i in counter:
            body = json.dumps(
                {
                    "id": f"bench-{i}",
                    "name": f"bench job {i}",
                    "kind": "batch-embedding",
                    "priority": "batch",
                    "resources": {"gpu": 1, "cpu": 1, "memory": "2Gi"},
                    "gpu_models": ["T4"],
                    "estimated_duration": "10m",
                }
            ).encode()
            t = time.perf_counter()
            status, data = await conn.request("POST", "/api/v1/workloads", headers, body)
            latencies.append(time.perf_counter() - t)
            if status != 201:
                errors.append(f"{status}: {data[:200]!r}")

    # warm up (not timed)
    for c in conns:
        await c.request("GET", "/healthz", {})
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    wall = time.perf_counter() - t0
    for c in conns:
        c.close()
    return {
        "submit_per_s": round(n / wall, 1),
        "submit_p50_ms": round(_pct(latencies, 0.5) * 1000, 2),
        "submit_p99_ms": round(_pct(latencies, 0.99) * 1000, 2),
        "submit_errors": len(errors),
        "submit_first_error": errors[0] if errors else None,
        "submits": n,
        "concurrency": concurrency,
    }


async def _sse(url: str, token: str, clients: int, expected: int, timeout_s: float) -> dict[str, Any]:
    import httpx

    lags: list[float] = []
    received = [0] * clients
    dropped = [0] * clients
    connected = 0
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}

    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=httpx.Timeout(30, read=None)) as c:
        async def reader(k: int) -> None:
            nonlocal connected
            async with c.stream("GET", "/api/v1/streams", params={"topics": "telemetry"}) as r:
                connected += 1
                event = ""
                async for line in r.aiter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: "):
                        now = time.time()
                        if event == "dropped":
                            dropped[k] += json.loads(line[6:])["dropped"]
                            continue
                        if event != "telemetry":
                            continue
                        d = json.loads(line[6:])["data"]
                        if "bench" not in d:
                            continue
                        if d["bench"] < 0:
                            return
                        lags.append(now - d["sent_at"])
                        received[k] += 1

        tasks = [asyncio.create_task(reader(k)) for k in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        failures = [t.exception() for t in done if t.exception() is not None]
    return {
        "sse_clients": clients,
        "sse_connected": connected,
        "sse_events_published": expected,
        "sse_deliveries": sum(received),
        "sse_deliveries_expected": expected * clients,
        "sse_dropped": sum(dropped),
        "sse_p50_lag_ms": round(_pct(lags, 0.5) * 1000, 1),
        "sse_p99_lag_ms": round(_pct(lags, 0.99) * 1000, 1),
        "sse_max_lag_ms": round(max(lags) * 1000, 1) if lags else None,
        "sse_client_errors": len(failures),
    }


def _spec(i: int, tag: str) -> dict[str, Any]:
    return {
        "id": f"{tag}-{i}", "name": f"{tag} job {i}", "kind": "batch-embedding", "priority": "batch",
        "resources": {"gpu": 1, "cpu": 1, "memory": "2Gi"}, "gpu_models": ["T4"],
        "estimated_duration": "10m",
    }


async def _preload(conn: _Conn, headers: dict[str, str], workloads: int) -> None:
    """Submit ``workloads`` specs, 100 a request: the list has something to show."""
    for start in range(0, workloads, 100):
        body = json.dumps([_spec(i, "pre") for i in range(start, min(workloads, start + 100))]).encode()
        status, data = await conn.request("POST", "/api/v1/workloads", headers, body)
        if status != 201:
            raise RuntimeError(f"preloading workloads failed: {status} {data[:200]!r}")


async def _poll_list(conn: _Conn, headers: dict[str, str], seconds: float, latencies: list[float],
                     errors: list[str]) -> None:
    """GET the workload list for ``seconds``, as a dashboard polls; each latency recorded."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t_get = time.perf_counter()
        status, data = await conn.request("GET", "/api/v1/workloads?limit=100", headers)
        latencies.append(time.perf_counter() - t_get)
        if status != 200:
            errors.append(f"list {status}: {data[:120]!r}")
        await asyncio.sleep(0.02)  # a dashboard polls; it does not hammer


async def _reads(
    url: str, token: str, *, sse_clients: int, workloads: int, seconds: float, submit_per_s: float,
) -> dict[str, Any]:
    """GET latency of the workload list while ``sse_clients`` follow every stream."""
    host, port = url.removeprefix("http://").split(":")
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    conn = await _Conn.open(host, int(port))
    await _preload(conn, headers, workloads)

    connected = 0
    events = [0]
    stop = asyncio.Event()
    latencies: list[float] = []
    errors: list[str] = []
    submitted = 0
    # raw sockets for the stream clients: 300 httpx streams cost the load generator more
    # CPU than the server spends sending to them (and this machine's cores are shared)
    sse_request = (
        f"GET /api/v1/streams HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {token}\r\n"
        "Accept: text/event-stream\r\n\r\n"
    ).encode()

    async def reader() -> None:
        nonlocal connected
        r, w = await asyncio.open_connection(host, int(port))
        try:
            w.write(sse_request)
            await w.drain()
            head = await r.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                errors.append(f"stream: {head[:80]!r}")
                return
            connected += 1
            while not stop.is_set():
                chunk = await r.read(1 << 16)
                if not chunk:
                    return
                events[0] += chunk.count(b"\ndata: ")
        finally:
            w.close()

    async def submitter(sub: _Conn) -> None:
        nonlocal submitted
        t0 = time.perf_counter()
        while not stop.is_set():
            body = json.dumps(_spec(submitted, "trickle")).encode()
            status, data = await sub.request("POST", "/api/v1/workloads", headers, body)
            if status != 201:
                errors.append(f"submit {status}: {data[:120]!r}")
            submitted += 1
            delay = t0 + submitted / submit_per_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)

    tasks = [asyncio.create_task(reader()) for _ in range(sse_clients)]
    deadline = time.monotonic() + 120
    while connected < sse_clients and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    sub = await _Conn.open(host, int(port))
    sub_task = asyncio.create_task(submitter(sub))
    await _poll_list(conn, headers, seconds, latencies, errors)
    stop.set()
    await sub_task
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    sub.close()
    conn.close()
    return {
        "reads": len(latencies),
        "read_p50_ms": round(_pct(latencies, 0.5) * 1000, 1),
        "read_p99_ms": round(_pct(latencies, 0.99) * 1000, 1),
        "read_max_ms": round(max(latencies) * 1000, 1) if latencies else None,
        "sse_connected": connected,
        "sse_events_received": events[0],
        "submitted_during": submitted,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def _wait_ready(url: str, proc: subprocess.Popen[bytes], token_file: Path, timeout_s: float = 60) -> str:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the bench server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200 and token_file.exists():
                return token_file.read_text().strip()
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the bench server did not become ready")


def bench_api(
    *,
    submits: int = 2000,
    concurrency: int = 32,
    sse_clients: int = 200,
    events_per_s: float = 20.0,
    sse_seconds: float = 10.0,
    read_sse_clients: int = 300,
    read_workloads: int = 500,
    read_seconds: float = 10.0,
    read_submit_per_s: float = 10.0,
    phases: tuple[str, ...] = ("submit", "sse", "read-no-sse", "read-sse"),
    verbose: bool = False,
) -> dict[str, Any]:
    result: dict[str, Any] = {"rate_limit": "submit rate limiter set out of the way for this measurement"}
    with tempfile.TemporaryDirectory(prefix="mlwe-bench-api-") as tmp:
        for phase in phases:
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            token_file = Path(tmp) / f"token-{phase}"
            clients = {"sse": sse_clients, "read-sse": read_sse_clients}.get(phase, 0)
            # the read phases publish telemetry for as long as they measure (and a margin)
            secs = sse_seconds if phase == "sse" else read_seconds + 60
            cmd = [
                sys.executable, "-m", "mlwe.api.bench", "--serve", str(port), str(Path(tmp) / phase),
                str(token_file), str(clients), str(0.0 if phase == "submit" else events_per_s), str(secs),
            ]
            proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            try:
                token = _wait_ready(url, proc, token_file)
                if phase == "submit":
                    if verbose:
                        print(f"submitting {submits} workloads with {concurrency} clients ...", file=sys.stderr)
                    result.update(asyncio.run(_submits(url, token, submits, concurrency)))
                elif phase.startswith("read"):
                    n = clients
                    if verbose:
                        print(f"GET /api/v1/workloads for {read_seconds:g}s with {n} SSE clients on every"
                              f" stream, {read_submit_per_s:g} submissions/s ...", file=sys.stderr)
                    r = asyncio.run(_reads(url, token, sse_clients=n, workloads=read_workloads,
                                           seconds=read_seconds, submit_per_s=read_submit_per_s))
                    if phase == "read-sse":
                        result[f"read_p99_ms_with_{n}_sse"] = r["read_p99_ms"]
                        result[f"read_p50_ms_with_{n}_sse"] = r["read_p50_ms"]
                        result["read_with_sse"] = r
                    else:
                        result["read_p99_ms_no_sse"] = r["read_p99_ms"]
                        result["read_p50_ms_no_sse"] = r["read_p50_ms"]
                        result["read_no_sse"] = r
                else:
                    if verbose:
                        print(f"{sse_clients} SSE clients, {events_per_s:g} events/s for {sse_seconds:g}s ...",
                              file=sys.stderr)
                    expected = int(events_per_s * sse_seconds)
                    result.update(asyncio.run(_sse(url, token, sse_clients, expected, sse_seconds + 60)))
                    result["sse_events_per_s"] = events_per_s
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    result["cpu_count"] = os.cpu_count()
    return result


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--serve":
        _serve(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6]), float(sys.argv[7]))
    else:
        print(json.dumps(bench_api(verbose=True), indent=2, sort_keys=True))
