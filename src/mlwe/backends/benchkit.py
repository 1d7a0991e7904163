"""What the backend benchmarks share: the engine's loop over one backend, and the
evict-to-place trial (``mlwe bench backend --backend local|ray|slurm``).

:class:`BenchDriver` is the loop the runtime Engine runs (poll, reconcile,
schedule, send) without the store, reacting as soon as the backend has an
event when it can say so (``backend.wait``). It records when each attempt's
``Started`` arrived, which workloads reported from inside their program, and
when node telemetry samples came in.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlwe.core.actions import Cancel, Started, Submit
from mlwe.core.backend import Backend
from mlwe.core.cluster import build_control_plane
from mlwe.core.lifecycle import State, Transition
from mlwe.core.model import Workload
from mlwe.core.reconcile import Reconciler
from mlwe.core.scheduler import Scheduler
from mlwe.core.spec import ClusterSpec, WorkloadSpec


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class BenchDriver:
    """The engine's loop over one backend (see the module docstring)."""

    def __init__(
        self,
        cluster: ClusterSpec,
        backend: Backend,
        clock: MonotonicClock,
        grace_s: float,
        *,
        is_report: Callable[[Mapping[str, float]], bool],
        sample_node: str | None = None,
    ) -> None:
        self.cp = build_control_plane(cluster, clock, check_invariants=False)
        self.rec = Reconciler(self.cp, Scheduler(), grace_s=grace_s)
        self.backend = backend
        self.is_report = is_report  # which workload telemetry came from the program itself
        self.sample_node = sample_node  # whose node samples time the telemetry period
        self.started_at: dict[tuple[str, int], float] = {}
        self.reports: dict[str, int] = {}
        self.node_samples: list[float] = []
        wait = getattr(backend, "wait", None)
        self._wait: Callable[[float], Any] = wait if callable(wait) else time.sleep

    def step(self) -> None:
        events = self.backend.poll()
        now = time.monotonic()
        for ev in events:
            if isinstance(ev.fact, Started):
                self.started_at[(ev.fact.workload, ev.fact.attempt)] = now
        self.rec.handle(events)
        commands = self.rec.step()
        if commands:
            self.backend.send(commands)
        for t in self.backend.drain_telemetry():
            if t.workload is None:
                if self.sample_node is None or t.node == self.sample_node:
                    self.node_samples.append(time.monotonic())
            elif self.is_report(t.metrics):
                self.reports[t.workload] = self.reports.get(t.workload, 0) + 1

    def reported(self, wid: str) -> bool:
        return self.reports.get(wid, 0) > 0

    def until(self, pred: Callable[[], bool], timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > end:
                states = {w.id: w.state.value for w in list(self.cp.workloads.values())[:10]}
                errors = list(getattr(self.backend, "errors", []))[-3:]
                raise RuntimeError(
                    f"bench: timed out waiting for {what} ({states}; backend errors: {errors})"
                )
            self.step()
            self._wait(0.005)

    def pump(self, seconds: float, period_s: float = 0.05) -> None:
        """Keep the loop going for ``seconds`` (while something else is measured)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.step()
            self._wait(period_s)

    def state(self, wid: str) -> State:
        return self.cp.get(wid).state

    def submit(self, spec: WorkloadSpec) -> None:
        r = self.cp.apply([Submit(spec)], cause_id="bench")
        if not r.accepted:
            raise RuntimeError("; ".join(r.reasons()))

    def telemetry_period_s(self) -> float | None:
        s = self.node_samples
        gaps = [b - a for a, b in itertools.pairwise(s)]
        return round(statistics.median(gaps), 3) if gaps else None


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def ms(values: list[float], q: float) -> float:
    """The median (q = 0.5) or the q-quantile of ``values`` (seconds), in milliseconds."""
    return round(1000 * (statistics.median(values) if q == 0.5 else pct(values, q)), 1)


@dataclass
class EvictTrials:
    """Seconds per trial: decision -> preemptor started, and the victim's own stop time."""

    totals: list[float] = field(default_factory=list)
    stops: list[float] = field(default_factory=list)

    @property
    def net(self) -> list[float]:
        return [t - s for t, s in zip(self.totals, self.stops, strict=True)]

    def figures(self, grace_s: float) -> dict[str, Any]:
        return {
            "evict_to_place_p50_ms": ms(self.net, 0.5),
            "evict_to_place_p99_ms": ms(self.net, 0.99),
            "evict_to_place_total_p50_ms": ms(self.totals, 0.5),
            "evict_to_place_total_p99_ms": ms(self.totals, 0.99),
            "victim_sigterm_to_exit_p50_ms": ms(self.stops, 0.5),
            "evict_trials": len(self.totals),
            "grace_s": grace_s,
        }


def evict_to_place(
    d: BenchDriver,
    trials: int,
    *,
    victim: Callable[[str], WorkloadSpec],
    urgent: Callable[[str], WorkloadSpec],
    stop_wait_s: Callable[[str], float],
    timeout_s: float = 60.0,
    after_trial: Callable[[str, str], None] | None = None,
) -> EvictTrials:
    """Per trial: a low-priority victim holds the node, an urgent one arrives; time from
    the preemption decision (the victim's PREEMPTING) to the preemptor's ``Started``."""
    decided: dict[str, float] = {}

    def on_transition(w: Workload, tr: Transition) -> None:
        if tr.target is State.PREEMPTING:
            decided[w.preempted_by or ""] = time.monotonic()

    d.cp.listeners.append(on_transition)
    out = EvictTrials()
    for i in range(trials):
        v, u = f"victim-{i}", f"urgent-{i}"
        d.submit(victim(v))
        # its first report: the program is up and has its SIGTERM hook
        d.until(lambda: d.reported(v), timeout_s, f"{v} to report")  # noqa: B023 (run now)
        d.submit(urgent(u))
        d.until(lambda: (u, 1) in d.started_at, timeout_s, f"{u} to start")  # noqa: B023
        out.totals.append(d.started_at[(u, 1)] - decided[u])
        out.stops.append(stop_wait_s(v))
        if after_trial is not None:
            after_trial(v, u)
        d.until(lambda: d.state(u) is State.SUCCEEDED, timeout_s, f"{u} to finish")  # noqa: B023
        d.cp.apply([Cancel(v, "bench trial over")], cause_id="bench")
        d.until(lambda: d.state(v) is State.CANCELLED, timeout_s, f"{v} to stop")  # noqa: B023
    return out
