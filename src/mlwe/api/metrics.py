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
from dataclasses import dataclass
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


@dataclass
class _Figures:
    """What the collector reads from the control plane, under the engine lock, at one scrape."""

    depth: dict[str, int]  # queue -> workloads waiting for placement
    states: dict[str, int]  # lifecycle state -> workloads
    nodes: dict[str, int]  # node status -> nodes
    gpus: int  # milli-GPUs in the cluster
    used: int  # milli-GPUs held
    counters: dict[str, int]
    version: int
    #: (node, model, status, gpu cap, gpu used, cpu cap, cpu used, ram cap, ram used)
    per_node: list[tuple[str, str, str, int, int, int, int, int, int]]
    running: dict[str, int]  # queue -> workloads holding resources
    queue_gpu: dict[str, int]  # queue -> milli-GPUs held


class _EngineCollector(Collector):
    def __init__(self, engine: Engine, streams: StreamStats) -> None:
        self.engine = engine
        self.streams = streams

    def collect(self) -> Iterator[Any]:
        f = self._read()
        yield from self._cluster_families(f)
        yield from self._node_families(f)
        yield from self._queue_families(f)
        yield from self._stream_families()

    def _read(self) -> _Figures:
        eng = self.engine
        cp = eng.reads
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
            per_node = []  # (node, model, status, gpu cap, gpu used, cpu cap, cpu used, ram cap, ram used)
            for name in cp.capacity.node_names():
                info = cp.capacity.info(name)
                cap, free = info.capacity, cp.capacity.free(name)
                per_node.append((name, info.gpu_model or "none", cp.capacity.status(name).value,
                                 cap.gpu, cap.gpu - free.gpu, cap.cpu, cap.cpu - free.cpu,
                                 cap.ram, cap.ram - free.ram))
            running: dict[str, int] = dict.fromkeys(cp.queues, 0)
            queue_gpu: dict[str, int] = dict.fromkeys(cp.queues, 0)
            for w in cp.workloads.values():
                if w.placement:
                    running[w.queue] = running.get(w.queue, 0) + 1
                    queue_gpu[w.queue] = queue_gpu.get(w.queue, 0) + sum(a.res.gpu for a in w.placement)
        return _Figures(depth, states, nodes, gpus, used, counters, version, per_node, running,
                        queue_gpu)

    def _cluster_families(self, f: _Figures) -> Iterator[Any]:
        g = GaugeMetricFamily("mlwe_queue_depth", "workloads waiting for placement", labels=["queue"])
        for q, n in sorted(f.depth.items()):
            g.add_metric([q], n)
        yield g
        g = GaugeMetricFamily("mlwe_workloads", "workloads by lifecycle state", labels=["state"])
        for s, n in f.states.items():
            g.add_metric([s], n)
        yield g
        g = GaugeMetricFamily("mlwe_nodes", "nodes by status", labels=["status"])
        for s, n in f.nodes.items():
            g.add_metric([s], n)
        yield g
        yield GaugeMetricFamily("mlwe_gpus", "GPUs in the cluster", value=f.gpus / 1000)
        yield GaugeMetricFamily("mlwe_gpus_allocated", "GPUs held by workloads", value=f.used / 1000)
        yield GaugeMetricFamily("mlwe_state_version", "control-plane state version", value=f.version)
        yield CounterMetricFamily(
            "mlwe_admissions", "placements applied (admissions)", value=f.counters.get("place", 0)
        )
        yield CounterMetricFamily(
            "mlwe_preemptions", "preemptions applied", value=f.counters.get("preempt", 0)
        )
        c = CounterMetricFamily("mlwe_actions", "actions applied by kind", labels=["kind"])
        for k, n in sorted(f.counters.items()):
            c.add_metric([k], n)
        yield c

    def _node_families(self, f: _Figures) -> Iterator[Any]:
        # per node, per GPU model, per queue (Prometheus conventions: base units, _total counters)
        labels = ["node", "gpu_model", "status"]
        fams = {
            "gpus": GaugeMetricFamily("mlwe_node_gpus", "GPUs of a node", labels=labels),
            "gpus_used": GaugeMetricFamily("mlwe_node_gpus_allocated", "GPUs of a node held by workloads",
                                           labels=labels),
            "cpu": GaugeMetricFamily("mlwe_node_cpu_cores", "CPU cores of a node", labels=labels),
            "cpu_used": GaugeMetricFamily("mlwe_node_cpu_cores_allocated", "CPU cores of a node held",
                                          labels=labels),
            "ram": GaugeMetricFamily("mlwe_node_memory_bytes", "RAM of a node", labels=labels),
            "ram_used": GaugeMetricFamily("mlwe_node_memory_allocated_bytes", "RAM of a node held",
                                          labels=labels),
        }
        by_model: dict[str, list[int]] = {}
        for name, model, status, gcap, gused, ccap, cused, rcap, rused in f.per_node:
            lv = [name, model, status]
            fams["gpus"].add_metric(lv, gcap / 1000)
            fams["gpus_used"].add_metric(lv, gused / 1000)
            fams["cpu"].add_metric(lv, ccap / 1000)
            fams["cpu_used"].add_metric(lv, cused / 1000)
            fams["ram"].add_metric(lv, rcap * 1024 * 1024)
            fams["ram_used"].add_metric(lv, rused * 1024 * 1024)
            if gcap:
                m = by_model.setdefault(model, [0, 0])
                m[0] += gcap
                m[1] += gused
        yield from fams.values()
        g = GaugeMetricFamily("mlwe_gpu_model_gpus", "GPUs of one model", labels=["gpu_model"])
        ga = GaugeMetricFamily("mlwe_gpu_model_gpus_allocated", "GPUs of one model held", labels=["gpu_model"])
        for model, (cap_g, used_g) in sorted(by_model.items()):
            g.add_metric([model], cap_g / 1000)
            ga.add_metric([model], used_g / 1000)
        yield g
        yield ga

    def _queue_families(self, f: _Figures) -> Iterator[Any]:
        g = GaugeMetricFamily("mlwe_queue_pending_workloads", "workloads waiting, per queue", labels=["queue"])
        for q, n in sorted(f.depth.items()):
            g.add_metric([q], n)
        yield g
        g = GaugeMetricFamily("mlwe_queue_running_workloads", "workloads holding resources, per queue",
                              labels=["queue"])
        for q, n in sorted(f.running.items()):
            g.add_metric([q], n)
        yield g
        g = GaugeMetricFamily("mlwe_queue_gpus_allocated", "GPUs held by a queue's workloads", labels=["queue"])
        for q, n in sorted(f.queue_gpu.items()):
            g.add_metric([q], n / 1000)
        yield g

    def _stream_families(self) -> Iterator[Any]:
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
        self.preempted = Counter(
            "mlwe_preempted_workloads",
            "workloads sent to preemption, by the victim's queue",
            ["queue"],
            registry=self.registry,
        )
        self.lost_gpu_seconds = Counter(
            "mlwe_preemption_lost_gpu_seconds",
            "GPU-seconds of work since the last checkpoint when a workload was preempted"
            " (an upper bound: the grace period may save some), by the victim's queue",
            ["queue"],
            registry=self.registry,
        )
        for q in engine.reads.queues:
            self.preempted.labels(q)
            self.lost_gpu_seconds.labels(q)
        for outcome in ("met", "missed"):  # exported at 0 from the start, so rate() has a series
            self.deadlines.labels(outcome)
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
        elif tr.target is State.PREEMPTING:
            self.preempted.labels(w.queue).inc()
            self.lost_gpu_seconds.labels(w.queue).inc(w.work_at_risk(tr.time) * w.gpus())
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


class AccessLog:
    """ASGI middleware: the request's correlation id (``X-Correlation-ID``, else a new one) in
    :data:`mlwe.runtime.logs.correlation_id` and on the response, and one ``mlwe.access`` line
    per request (method, route, status, milliseconds to the first byte)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        import logging
        import secrets

        from mlwe.runtime.logs import correlation_id

        cid = None
        for k, v in scope.get("headers", ()):
            if k == b"x-correlation-id":
                cid = v.decode("latin-1")[:128]
        cid = cid or secrets.token_hex(8)
        token = correlation_id.set(cid)
        t0 = time.perf_counter()
        logged = [False]

        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start" and not logged[0]:
                logged[0] = True
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-correlation-id" for k, _ in headers):
                    headers.append((b"x-correlation-id", cid.encode("latin-1", "replace")))
                message = {**message, "headers": headers}
                route = getattr(scope.get("route"), "path", None) or scope.get("path", "")
                status = int(message["status"])
                logging.getLogger("mlwe.access").log(
                    logging.WARNING if status >= 500 else logging.INFO,
                    "%s %s %d", scope.get("method", ""), scope.get("path", ""), status,
                    extra={"method": scope.get("method", ""), "route": route, "status": status,
                           "duration_ms": round((time.perf_counter() - t0) * 1000, 2),
                           "client": (scope.get("client") or ("", 0))[0]},
                )
            await send(message)

        try:
            await self.app(scope, receive, wrapped)
        finally:
            correlation_id.reset(token)
