"""The cluster over time, stored: what the dashboard's plots draw, surviving a reload.

A daemon thread samples the control plane every ``every_s`` seconds (under the
engine lock, a few microseconds) and stores the sample as telemetry of the
pseudo-node :data:`NODE` (so it is downsampled and pruned with the rest):
GPUs allocated and total, waiting and running workloads (in all and per
queue), and what happened since the previous sample: preemptions, GPU-hours
of work lost to them (an upper bound: work since the last checkpoint), and
deadlines met and missed. Counts per interval, not running totals, so an
engine restart leaves no cliff in the plots.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from mlwe.core.lifecycle import HOLDING, QUEUED, State, Transition
from mlwe.core.model import Workload
from mlwe.runtime.engine import Engine
from mlwe.store.repository import TelemetrySample

log = logging.getLogger("mlwe.api.history")

#: the pseudo-node the samples are stored under (no real node name starts with "_")
NODE = "_cluster"


class ClusterHistory:
    def __init__(self, engine: Engine, every_s: float = 10.0) -> None:
        self.engine = engine
        self.every_s = every_s
        self._lock = threading.Lock()
        self._events = {"preemptions": 0.0, "lost_gpu_h": 0.0, "deadlines_met": 0.0, "deadlines_missed": 0.0}
        self._stop = threading.Event()
        self.samples = 0
        engine.cp.listeners.append(self._on_transition)
        self._thread = threading.Thread(target=self._run, name="mlwe-cluster-history", daemon=True)
        self._thread.start()

    def _on_transition(self, w: Workload, tr: Transition) -> None:  # under the engine lock
        with self._lock:
            if tr.target is State.PREEMPTING:
                self._events["preemptions"] += 1
                self._events["lost_gpu_h"] += w.work_at_risk(tr.time) * w.gpus() / 3600
            elif tr.target is State.SUCCEEDED and w.deadline is not None:
                self._events["deadlines_met" if tr.time <= w.deadline else "deadlines_missed"] += 1

    def sample(self) -> dict[str, float]:
        eng = self.engine
        cp = eng.reads
        with eng.lock:
            now = cp.now()
            gpus = used = 0
            for name in cp.capacity.node_names():
                cap = cp.capacity.info(name).capacity.gpu
                gpus += cap
                used += cap - cp.capacity.free(name).gpu
            m: dict[str, float] = {"gpus": gpus / 1000, "gpus_used": used / 1000,
                                   "gpu_util": used / gpus if gpus else 0.0, "pending": 0.0, "running": 0.0}
            for q in cp.queues:
                m[f"pending:{q}"] = 0.0
            for w in cp.workloads.values():
                if w.state in QUEUED:
                    m["pending"] += 1
                    m[f"pending:{w.queue}"] = m.get(f"pending:{w.queue}", 0.0) + 1
                elif w.state in HOLDING:
                    m["running"] += 1
        with self._lock:
            m.update(self._events)
            for k in self._events:
                self._events[k] = 0.0
        m["time"] = now
        return m

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                m = self.sample()
                t = m.pop("time")
                self.engine.repo.append_telemetry(
                    [TelemetrySample(time=t, node=NODE, workload=None, metrics=m)],
                    resolution_s=max(1, int(self.every_s)),
                )
                self.samples += 1
            except Exception:  # observations, not state: a missed sample is a gap in a plot
                log.warning("cluster history sample not stored", exc_info=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(ValueError):
            self.engine.cp.listeners.remove(self._on_transition)


def series(engine: Engine, since: float | None, limit: int) -> list[dict[str, Any]]:
    """The stored samples, oldest first (the latest ``limit``)."""
    samples = engine.repo.telemetry(node=NODE, since=since)[-limit:]
    return [{"time": s.time, "metrics": dict(s.metrics), "resolution_s": s.resolution_s} for s in samples]
