"""Prometheus metrics of one engine and its API (``GET /metrics``).

Gauges are read from the control plane at scrape time (under the engine
lock), so they are never stale and cost nothing between scrapes. Counters of
things that happen (admissions, preemptions, actions) come from the control
plane's own counters. Latencies are observed as they happen:

- ``mlwe_decision_latency_seconds``: one scheduling cycle (snapshot, plan,
  verification and apply), measured around the scheduler's ``run_cycle``;
- ``mlwe_admission_wait_seconds``: submission to first placement;
- ``mlwe_deadline_outcomes_total{outcome}``: workloads with a deadline that
  finished in time (``met``) or late (``missed``);
- HTTP request counts and latency per route template.

Each app has its own registry, so several apps (tests) never clash.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mlwe.api.security import ASGIApp, Message, Receive, Scope, Send
from mlwe.api.sse import StreamStats
from mlwe.core.lifecycle import QUEUED, State, Transition
from mlwe.core.model import Workload
from mlwe.runtime.engine import Engine

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_WAIT_BUCKETS = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)


class _EngineCollector(Collector):
    def __init__(self, engine: Engine, streams: StreamStats) -> None:
        self.engine = engine
        self.streams = streams

    def collect(self) -> Iterator[Any]:
        eng = self.engine
        cp = eng.cp
        with eng.lock:
            depth: dict[str, int] = dict.fromkeys(cp.queues, 0)
            for wid in cp.queued:
                w = cp.workloads[wid]
                depth[w.queue] = depth.get(w.queue, 0) + 1
            states: dict[str, int] = {s.value: 0 for s in State}
            for w in cp.workloads.values():
                states[w.state.value] += 1
            nodes: dict[str, int] = {"ready": 0, "cordoned": 0, "down": 0}
            gpus = used = 0
            for name in cp.capacity.node_names():
                nodes[cp.capacity.status(name).value] += 1
                info = cp.capacity.info(name)
                gpus += info.capacity.gpu
                used += info.capacity.gpu - cp.capacity.free(name).gpu
            counters = dict(cp.counters)
            version = cp.version
        g = GaugeMetricFamily("mlwe_queue_depth", "workloads waiting for placement", labels=["queue"])
        for q, n in sorted(depth.items()):
            g.add_metric([q], n)
        yield g
        g = GaugeMetricFamily("mlwe_workloads", "workloads by lifecycle state", labels=["state"])
        for s, n in states.items():
            g.add_metric([s], n)
        yield g
        g = GaugeMetricFamily("mlwe_nodes", "nodes by status", labels=["status"])
        for s, n in nodes.items():
            g.add_metric([s], n)
        yield g
        yield GaugeMetricFamily("mlwe_gpus", "GPUs in the cluster", value=gpus / 1000)
        yield GaugeMetricFamily("mlwe_gpus_allocated", "GPUs held by workloads", value=used / 1000)
        yield GaugeMetricFamily("mlwe_state_version", "control-plane state version", value=version)
        yield CounterMetricFamily(
            "mlwe_admissions", "placements applied (admissions)", value=counters.get("place", 0)
        )
        yield CounterMetricFamily(
            "mlwe_preemptions", "preemptions applied", value=counters.get("preempt", 0)
        )
        c = CounterMetricFamily("mlwe_actions", "actions applied by kind", labels=["kind"])
        for k, n in sorted(counters.items()):
            c.add_metric([k], n)
        yield c
        yield GaugeMetricFamily("mlwe_stream_clients", "connected stream clients", value=self.streams.clients)
        yield CounterMetricFamily("mlwe_stream_events_sent", "stream events sent", value=self.streams.sent)
        yield CounterMetricFamily(
            "mlwe_stream_events_dropped",
            "stream events dropped for slow clients",
            value=self.streams.dropped,
        )


class ApiMetrics:
    """The registry of one app, wired to its engine."""

    def __init__(self, engine: Engine, streams: StreamStats) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, streams))
        self.decision_latency = Histogram(
            "mlwe_decision_latency_seconds",
            "one scheduling cycle: snapshot, plan, verify, apply",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.admission_wait = Histogram(
            "mlwe_admission_wait_seconds",
            "engine seconds from submission to first placement",
            buckets=_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.deadlines = Counter(
            "mlwe_deadline_outcomes",
            "workloads with a deadline that finished, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.requests = Counter(
            "mlwe_http_requests", "HTTP requests", ["method", "route", "status"], registry=self.registry
        )
        self.request_latency = Histogram(
            "mlwe_http_request_seconds",
            "HTTP request latency (to the first response byte)",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._attach(engine)

    def _attach(self, engine: Engine) -> None:
        # time the scheduler's cycles: wrap the bound method of this engine's scheduler only
        sched = engine.scheduler
        inner: Callable[..., Any] = sched.run_cycle
        if not getattr(inner, "_mlwe_timed", False):
            hist = self.decision_latency

            def timed(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return inner(*args, **kwargs)
                finally:
                    hist.observe(time.perf_counter() - t0)

            timed._mlwe_timed = True  # type: ignore[attr-defined]
            sched.run_cycle = timed  # type: ignore[method-assign]
        engine.cp.listeners.append(self._on_transition)

    def _on_transition(self, w: Workload, tr: Transition) -> None:
        if tr.target is State.ADMITTED and tr.source in QUEUED and w.attempt <= 1:
            self.admission_wait.observe(max(0.0, tr.time - w.submit_time))
        elif tr.target is State.SUCCEEDED and w.deadline is not None:
            self.deadlines.labels("met" if tr.time <= w.deadline else "missed").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestMetrics:
    """ASGI middleware counting requests per route template (never per raw path)."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], ApiMetrics | None]) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]
        timed = [False]
        m = self.metrics()

        async def observe(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                route = scope.get("route")
                path = getattr(route, "path", "unmatched")
                if m is not None and not timed[0]:
                    timed[0] = True
                    m.request_latency.labels(path).observe(time.perf_counter() - t0)
                    m.requests.labels(scope.get("method", ""), path, str(status[0])).inc()
            await send(message)

        await self.app(scope, receive, observe)
