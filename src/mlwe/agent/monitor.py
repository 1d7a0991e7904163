"""Monitor: what the agent knows, read from any backend through the control plane.

The monitor owns the agent's memory of the recent past, built only from what
a real operator could see: telemetry samples (given by the runtime or drained
from a backend), and the control plane's lifecycle transitions (it listens on
``ControlPlane.listeners``; it never changes state). It remembers, per
workload, the nodes of its attempts, its failures with exit codes and causes,
and when its progress last moved; per node, status changes and failures seen
there. Triggers read this memory; nothing else writes it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from mlwe.agent.telemetry import TelemetryWindow
from mlwe.core.backend import Telemetry
from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import State, Transition
from mlwe.core.model import Workload
from mlwe.core.spec import NodeStatus

#: Telemetry metrics read as a workload's memory use, in MiB (simulator, local daemon).
MEMORY_METRICS = ("memory_used_mib", "rss_mib")


def memory_of(metrics: Mapping[str, float], declared: Iterable[str] = ()) -> float | None:
    skip = set(declared)
    for name in MEMORY_METRICS:
        if name in metrics and name not in skip:
            return float(metrics[name])
    return None


@dataclass(frozen=True, slots=True)
class FailureRecord:
    time: float
    attempt: int
    exit_code: int | None
    cause: str
    nodes: tuple[str, ...]
    runtime_s: float  # how long the attempt ran before it failed
    peak_memory_mib: float | None  # highest memory use seen in telemetry for that attempt


@dataclass(slots=True)
class WorkloadMemory:
    nodes: tuple[str, ...] = ()
    started_at: float | None = None
    failures: list[FailureRecord] = field(default_factory=list)
    progress: float = -1.0
    progress_since: float = 0.0
    peak_memory_mib: float | None = None  # this attempt
    attempt: int = 0


@dataclass(slots=True)
class NodeMemory:
    status: NodeStatus = NodeStatus.READY
    since: float = 0.0
    losses: list[float] = field(default_factory=list)
    failures: deque[tuple[float, str, str]] = field(default_factory=lambda: deque(maxlen=64))


class Monitor:
    """Telemetry window plus memory of transitions; attach with :meth:`attach`."""

    def __init__(self, cp: ControlPlane, telemetry: TelemetryWindow | None = None) -> None:
        self.cp = cp
        self.telemetry = telemetry or TelemetryWindow()
        self.workloads: dict[str, WorkloadMemory] = {}
        self.nodes: dict[str, NodeMemory] = {}
        self.new_events = 0  # transitions since the analyzer last looked
        self.new_samples = 0  # telemetry samples since the analyzer last looked
        self.event_kinds: set[str] = set()
        self._attached = False
        self.source: Callable[[], list[Telemetry]] | None = None

    def attach(self, source: Callable[[], list[Telemetry]] | None = None) -> Monitor:
        """Listen to the control plane's transitions; ``source``: drained each tick."""
        if not self._attached:
            self.cp.listeners.append(self._on_transition)
            self._attached = True
        self.source = source
        for name in self.cp.capacity.node_names():
            self.nodes.setdefault(name, NodeMemory(self.cp.capacity.status(name), self.cp.now()))
        return self

    def detach(self) -> None:
        if self._attached:
            self.cp.listeners.remove(self._on_transition)
            self._attached = False

    # ----------------------------------------------------------------- input
    def observe(self, samples: Iterable[Telemetry]) -> int:
        batch = list(samples)
        n = self.telemetry.add(batch)
        self.new_samples += n
        for s in batch:
            if s.workload is None:
                continue
            mem = memory_of(s.metrics, s.declared)
            if mem is not None:
                m = self.workloads.setdefault(s.workload, WorkloadMemory())
                m.peak_memory_mib = mem if m.peak_memory_mib is None else max(m.peak_memory_mib, mem)
            prog = s.metrics.get("progress")
            if prog is not None:
                self._progress(s.workload, float(prog), s.time)
        return n

    def poll(self) -> None:
        """Drain the telemetry source, if any (cheap: every tick)."""
        if self.source is not None:
            self.observe(self.source())

    def refresh(self) -> None:
        """Read node statuses and running workloads' progress (a scan: before an analysis)."""
        self.poll()
        now = self.cp.now()
        cap = self.cp.capacity
        for name in cap.node_names():
            st = cap.status(name)
            mem = self.nodes.get(name)
            if mem is None:
                mem = self.nodes[name] = NodeMemory(st, now)
            if st is not mem.status:
                if st is NodeStatus.DOWN:
                    mem.losses.append(now)
                mem.status, mem.since = st, now
                self.new_events += 1
                self.event_kinds.add("node-status")
        for w in self.cp.workloads.values():
            if w.state is State.RUNNING:
                self._progress(w.id, w.progress, now)

    def _progress(self, wid: str, value: float, t: float) -> None:
        # progress comes from the control plane (backend facts) and from telemetry;
        # either moving forward counts (a restart resets it on the RUNNING edge)
        m = self.workloads.setdefault(wid, WorkloadMemory())
        if value > m.progress:
            m.progress, m.progress_since = value, t

    def _on_transition(self, w: Workload, tr: Transition) -> None:
        self.new_events += 1
        self.event_kinds.add(tr.target.value)
        m = self.workloads.setdefault(w.id, WorkloadMemory())
        if tr.target is State.ADMITTED:
            m.nodes = tuple(dict.fromkeys(a.node for a in w.placement))
            m.attempt = w.attempt
            m.peak_memory_mib = None
        elif tr.target is State.RUNNING:
            m.started_at = tr.time
            m.progress, m.progress_since = w.progress, tr.time
        elif tr.target is State.FAILED:
            rec = FailureRecord(
                tr.time, w.attempt, w.exit_code, w.failure_cause or "error", m.nodes,
                0.0 if m.started_at is None else max(0.0, tr.time - m.started_at),
                m.peak_memory_mib,
            )
            m.failures.append(rec)
            del m.failures[:-16]
            for node in m.nodes:
                nm = self.nodes.setdefault(node, NodeMemory())
                nm.failures.append((tr.time, w.id, rec.cause))
        if tr.source is not None and tr.target not in (State.RUNNING, State.ADMITTED, State.STARTING):
            m.started_at = None if tr.target is not State.PREEMPTING else m.started_at

    def take_news(self) -> tuple[int, int, frozenset[str]]:
        """(new transitions, new samples, kinds of events) since the last call."""
        out = (self.new_events, self.new_samples, frozenset(self.event_kinds))
        self.new_events = self.new_samples = 0
        self.event_kinds = set()
        return out

    def forget_finished(self) -> None:
        """Drop memory of workloads that are done for good (bounded memory)."""
        wl = self.cp.workloads
        for wid in list(self.workloads):
            w = wl.get(wid)
            if w is None or w.state in (State.SUCCEEDED, State.CANCELLED):
                del self.workloads[wid]
                self.telemetry.forget(wid)
