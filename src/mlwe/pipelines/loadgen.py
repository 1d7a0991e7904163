"""A seeded synthetic request load, and a client-side router over a service's replicas.

:class:`LoadProfile` is a request rate that rises and falls (base -> peak ->
base, piecewise linear) and its arrival times: a Poisson process of that rate,
drawn by thinning from a seeded generator, so the same seed gives the same
requests at the same offsets.

:class:`LoadGenerator` sends them (open loop: an arrival does not wait for
earlier answers) from a pool of client threads with keep-alive connections
(latency counts from the arrival, so waiting for a free client counts too), through a
:class:`Router` that picks the replica with the fewest requests in flight.
A replica that refuses a connection or breaks one is set aside for a moment
and the request is retried on another: when a node dies, traffic goes to the
replicas that remain. Every request's latency (end to end, retries included)
and outcome is recorded.
"""

from __future__ import annotations

import http.client
import json
import math
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    import numpy as np
except ImportError as exc:  # the core install has no NumPy: name the extra that brings it
    from mlwe.core.extras import missing_extra

    raise missing_extra("pipelines", exc) from exc


@dataclass(frozen=True)
class LoadProfile:
    duration_s: float = 40.0
    base_rps: float = 15.0
    peak_rps: float = 150.0
    rise: tuple[float, float] = (0.1, 0.35)  # fractions of the duration: ramp up
    fall: tuple[float, float] = (0.65, 0.9)  # ramp down
    seed: int = 0

    def rate(self, t: float) -> float:
        d = self.duration_s
        a, b = self.rise[0] * d, self.rise[1] * d
        c, e = self.fall[0] * d, self.fall[1] * d
        if t < a or t >= e:
            return self.base_rps
        if t < b:
            return self.base_rps + (self.peak_rps - self.base_rps) * (t - a) / (b - a)
        if t < c:
            return self.peak_rps
        return self.peak_rps - (self.peak_rps - self.base_rps) * (t - c) / (e - c)

    def arrivals(self) -> list[float]:
        """Offsets (seconds from the start) of every request."""
        rng = np.random.default_rng(self.seed)
        top = max(self.base_rps, self.peak_rps)
        t, out = 0.0, list[float]()
        while True:
            t += float(rng.exponential(1.0 / top))
            if t >= self.duration_s:
                return out
            if rng.random() * top <= self.rate(t):
                out.append(t)


@dataclass
class RequestRecord:
    sent: float  # offset from the start of the load
    latency_ms: float
    ok: bool
    replica: str | None
    retries: int
    service_ms: float | None = None
    error: str | None = None


@dataclass
class Router:
    """Least-requests-in-flight over the live replicas; broken ones set aside briefly."""

    set_aside_s: float = 1.0
    _urls: tuple[str, ...] = ()
    inflight: dict[str, int] = field(default_factory=dict)
    _bad_until: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set_endpoints(self, urls: Sequence[str]) -> None:
        with self._lock:
            self._urls = tuple(urls)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self._urls

    def pick(self, avoid: set[str]) -> str | None:
        now = time.monotonic()
        with self._lock:
            ok = [u for u in self._urls if u not in avoid and self._bad_until.get(u, 0) <= now]
            if not ok:
                ok = [u for u in self._urls if u not in avoid]
            if not ok:
                return None
            return min(ok, key=lambda u: self.inflight.get(u, 0))

    def acquire(self, url: str) -> None:
        with self._lock:
            self.inflight[url] = self.inflight.get(url, 0) + 1

    def release(self, url: str) -> None:
        with self._lock:
            self.inflight[url] = self.inflight.get(url, 1) - 1

    def broken(self, url: str) -> None:
        with self._lock:
            self._bad_until[url] = time.monotonic() + self.set_aside_s


class LoadGenerator:
    """Sends a profile's requests through a router (see the module docstring)."""

    def __init__(
        self,
        profile: LoadProfile,
        router: Router,
        payloads: Sequence[list[float]],
        *,
        timeout_s: float = 5.0,
        max_retries: int = 3,
        wait_for_replica_s: float = 2.0,
        workers: int = 48,
    ) -> None:
        self.workers = workers
        self.profile = profile
        self.router = router
        self.payloads = list(payloads)
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.wait_for_replica_s = wait_for_replica_s
        self.records: list[RequestRecord] = []
        self.sent: list[float] = []  # offsets of the requests sent so far (arrival rate)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.t0: float | None = None
        self.done = threading.Event()

    # ---------------------------------------------------------------- running
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mlwe-loadgen", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def elapsed(self) -> float:
        return 0.0 if self.t0 is None else time.monotonic() - self.t0

    def _run(self) -> None:
        try:
            self._main()
        finally:
            self.done.set()

    def _main(self) -> None:
        arrivals = self.profile.arrivals()
        work: queue.Queue[tuple[float, list[float]] | None] = queue.Queue()
        workers = [
            threading.Thread(target=self._worker, args=(work,), daemon=True)
            for _ in range(self.workers)
        ]
        for w in workers:
            w.start()
        self.t0 = time.monotonic()
        for i, at in enumerate(arrivals):
            delay = self.t0 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self.sent.append(at)
            work.put((at, self.payloads[i % len(self.payloads)]))
        for _ in workers:
            work.put(None)
        for w in workers:
            w.join()

    def _worker(self, work: queue.Queue[tuple[float, list[float]] | None]) -> None:
        conns: dict[str, http.client.HTTPConnection] = {}
        while True:
            item = work.get()
            if item is None:
                break
            at, payload = item
            self._one(conns, at, json.dumps({"pixels": payload}).encode())
        for c in conns.values():
            c.close()

    def _post(
        self, conns: dict[str, http.client.HTTPConnection], url: str, body: bytes
    ) -> tuple[int, str | None]:
        c = conns.get(url)
        if c is None:
            host, _, port = url.removeprefix("http://").partition(":")
            c = http.client.HTTPConnection(host, int(port), timeout=self.timeout_s)
            conns[url] = c
        try:
            c.request("POST", "/predict", body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            r.read()
        except BaseException:
            c.close()
            conns.pop(url, None)
            raise
        return r.status, r.getheader("X-Service-Ms")

    def _one(self, conns: dict[str, http.client.HTTPConnection], at: float, body: bytes) -> None:
        assert self.t0 is not None
        start = self.t0 + at  # latency counts from the arrival, queueing in the client included
        tried: set[str] = set()
        retries = 0
        last_error = "no replica available"
        while True:
            url = self.router.pick(tried)
            if url is None:
                if time.monotonic() - start > self.wait_for_replica_s:
                    break
                time.sleep(0.02)
                tried.clear()
                continue
            self.router.acquire(url)
            try:
                status, svc = self._post(conns, url, body)
            except (OSError, http.client.HTTPException) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                self.router.broken(url)
                tried.add(url)
                retries += 1
                if retries > self.max_retries:
                    break
                continue
            finally:
                self.router.release(url)
            if status == 200:
                self._record(RequestRecord(
                    at, (time.monotonic() - start) * 1000, True, url, retries,
                    float(svc) if svc else None,
                ))
                return
            last_error = f"HTTP {status}"
            tried.add(url)
            retries += 1
            if retries > self.max_retries:
                break
        self._record(RequestRecord(
            at, (time.monotonic() - start) * 1000, False, None, retries, None, last_error
        ))

    def _record(self, rec: RequestRecord) -> None:
        with self._lock:
            self.records.append(rec)

    # ---------------------------------------------------------------- reading
    def snapshot(self) -> list[RequestRecord]:
        with self._lock:
            return list(self.records)

    def window(self, seconds: float) -> dict[str, Any]:
        """Figures over the requests sent in the last ``seconds`` (the scaler's sensor)."""
        now = self.elapsed()
        recs = [r for r in self.snapshot() if r.sent >= now - seconds]
        arrived = sum(1 for t in self.sent[-10_000:] if t >= now - seconds)
        lat = [r.latency_ms for r in recs if r.ok]
        svc = [r.service_ms for r in recs if r.service_ms is not None]
        return {
            "requests": len(recs),
            "rate_rps": arrived / seconds if seconds > 0 else 0.0,
            "errors": sum(1 for r in recs if not r.ok),
            "p95_ms": percentile(lat, 95),
            "p50_ms": percentile(lat, 50),
            "service_ms": sum(svc) / len(svc) if svc else None,
        }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), None for no values."""
    if not values:
        return None
    v = float(np.percentile(np.asarray(values, dtype=np.float64), q))
    return v if math.isfinite(v) else None
