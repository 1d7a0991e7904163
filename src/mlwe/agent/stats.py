"""Where the agent's time goes (:class:`AgentStats`: lock holds by phase, deliberations),
and the telemetry window read under the lock for the reasoner's tools."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from mlwe.agent.telemetry import TelemetryWindow
from mlwe.core.backend import Telemetry


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3) if s else 0.0


class AgentStats:
    """Where the agent's time goes: under the lock (analysis, snapshot, execution)
    and outside it (reasoning and forecasts on a snapshot)."""

    def __init__(self) -> None:
        self.rounds = 0
        self.lock_ms: deque[float] = deque(maxlen=10_000)  # each locked phase
        self.lock_max_ms: dict[str, float] = {}  # the longest hold, per phase
        self.think_ms: deque[float] = deque(maxlen=10_000)  # each deliberation (no lock)
        self.stale = 0  # proposals rejected as decided on an older state
        self.workflows = 0  # workflows started for committed plans

    def held(self, phase: str, ms: float) -> None:
        self.lock_ms.append(ms)
        if ms > self.lock_max_ms.get(phase, 0.0):
            self.lock_max_ms[phase] = round(ms, 3)

    def summary(self) -> dict[str, Any]:
        lock, think = list(self.lock_ms), list(self.think_ms)
        return {
            "agent_rounds": self.rounds,
            "agent_lock_ms_p50": _pct(lock, 0.5),
            "agent_lock_ms_p99": _pct(lock, 0.99),
            "agent_lock_ms_max": round(max(lock), 3) if lock else 0.0,
            "agent_think_ms_p50": _pct(think, 0.5),
            "agent_think_ms_max": round(max(think), 3) if think else 0.0,
            "agent_stale": self.stale,
            "agent_workflows": self.workflows,
            "agent_lock_max_ms_by_phase": dict(sorted(self.lock_max_ms.items())),
        }


class _LockedTelemetry:
    """The monitor's telemetry window, read under the lock (the engine adds samples)."""

    def __init__(self, window: TelemetryWindow, lock: Any) -> None:
        self.window = window
        self.lock = lock

    def samples(
        self,
        *,
        workload: str | None = None,
        node: str | None = None,
        metric: str | None = None,
        last: int | None = None,
    ) -> list[Telemetry]:
        with self.lock:
            return self.window.samples(workload=workload, node=node, metric=metric, last=last)
