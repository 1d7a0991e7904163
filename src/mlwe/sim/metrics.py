"""Replay metrics, collected from the control plane's transition stream.

Everything here is measured from what happened (transitions and the
simulator's ground truth), never from what the policy believed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import HOLDING, State, Transition
from mlwe.core.model import Workload


@dataclass(slots=True)
class JobRecord:
    submit: float
    deadline: float | None
    priority: int
    queue: str
    gpus: float
    duration: float
    first_start: float | None = None
    finish: float | None = None
    state: str = "pending"
    preemptions: int = 0


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def jain(xs: list[float]) -> float | None:
    if not xs:
        return None
    sq = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * sq) if sq else 1.0


@dataclass
class Metrics:
    cp: ControlPlane
    durations: Mapping[str, float]
    total_gpus: float
    sample_every_s: float = 600.0
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    preemptions: int = 0
    #: (time, allocated GPUs, queued workloads) samples for plots
    series: list[tuple[float, float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._alloc = 0.0
        self._area = 0.0
        self._last = 0.0
        self._next_sample = 0.0
        self._first_submit: float | None = None
        self.cp.listeners.append(self._on)

    def _advance(self, t: float) -> None:
        self._area += self._alloc * (t - self._last)
        self._last = t
        while t >= self._next_sample:
            self.series.append((self._next_sample, self._alloc, len(self.cp.queued)))
            self._next_sample += self.sample_every_s

    def _on(self, w: Workload, tr: Transition) -> None:
        t = tr.time
        self._advance(t)
        src, dst = tr.source, tr.target
        if src is None:
            if self._first_submit is None:
                self._first_submit = t
                self._next_sample = t
            self.jobs[w.id] = JobRecord(
                submit=t, deadline=w.deadline, priority=w.priority, queue=w.queue,
                gpus=w.gpus(), duration=self.durations.get(w.id, 0.0),
            )
            return
        rec = self.jobs.get(w.id)
        if rec is None:
            return
        rec.state = dst.value
        entering = dst in HOLDING and src not in HOLDING
        leaving = src in HOLDING and dst not in HOLDING
        if entering:
            self._alloc += rec.gpus
        elif leaving:
            self._alloc -= rec.gpus
        if dst is State.RUNNING and rec.first_start is None:
            rec.first_start = t
        elif dst is State.PREEMPTING:
            rec.preemptions += 1
            self.preemptions += 1
        elif dst in (State.SUCCEEDED, State.CANCELLED) or (
            dst is State.FAILED and w.failures > w.spec.max_retries
        ):
            rec.finish = t

    def summary(self, end: float, lost_gpu_s: float) -> dict[str, Any]:
        self._advance(end)
        done = [r for r in self.jobs.values() if r.state == "succeeded" and r.finish is not None]
        jct = [r.finish - r.submit for r in done if r.finish is not None]
        wait = [r.first_start - r.submit for r in self.jobs.values() if r.first_start is not None]
        first = self._first_submit or 0.0
        last = max((r.finish for r in done if r.finish is not None), default=first)
        makespan = last - first
        with_dl = [r for r in self.jobs.values() if r.deadline is not None]
        met = [r for r in with_dl if r.finish is not None and r.state == "succeeded" and r.finish <= r.deadline]  # type: ignore[operator]
        by_prio: dict[int, list[bool]] = {}
        for r in with_dl:
            ok = r.finish is not None and r.state == "succeeded" and r.finish <= r.deadline  # type: ignore[operator]
            by_prio.setdefault(r.priority, []).append(ok)
        queues: dict[str, list[float]] = {}
        for r in done:
            if r.finish is not None and r.duration > 0:
                queues.setdefault(r.queue, []).append((r.finish - r.submit) / r.duration)
        slowdowns = [sum(v) / len(v) for v in queues.values()]
        span = max(1e-9, end - first)
        return {
            "jobs": len(self.jobs),
            "completed": len(done),
            "unfinished": len(self.jobs) - len(done),
            "avg_jct_s": round(sum(jct) / len(jct), 3) if jct else None,
            "median_jct_s": _r(percentile(jct, 0.5)),
            "p99_jct_s": _r(percentile(jct, 0.99)),
            "avg_queue_delay_s": round(sum(wait) / len(wait), 3) if wait else None,
            "p99_queue_delay_s": _r(percentile(wait, 0.99)),
            "makespan_s": round(makespan, 3),
            "gpu_util": round(self._area / (self.total_gpus * span), 6) if self.total_gpus else None,
            "deadline_jobs": len(with_dl),
            "deadline_met_ratio": round(len(met) / len(with_dl), 6) if with_dl else None,
            "deadline_met_by_priority": {
                str(p): round(sum(v) / len(v), 6) for p, v in sorted(by_prio.items())
            } or None,
            "preemptions": self.preemptions,
            "gpu_hours_lost_to_preemption": round(lost_gpu_s / 3600, 3),
            "queue_fairness_jain": _r(jain(slowdowns)),
        }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
