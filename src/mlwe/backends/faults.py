"""Fault injection for demos and scenario triggers, as a Backend wrapper.

``FaultInjector`` wraps any backend and passes everything through, except the
faults an operator asked for (through the scenario routes):

- ``diverge(workload)``: from now on that workload's reported loss grows
  instead of falling (a training run whose loss diverges);
- ``oom(workload)``: every attempt of that workload is killed for running out
  of memory a few seconds after it starts (an OOM crash loop): the wrapper
  force-stops the attempt on the real backend and reports ``Exited(137, "oom")``
  instead of its release. The process "needs" more memory than it asked for:
  an attempt that asks for more than the first one did (the fix an operator
  or the agent would apply) runs normally.

These are injected faults, labelled as such in the scenario results; the
engine, the agent and the dashboard react to them exactly as they would to
the real thing, because they only ever see the Backend protocol.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mlwe.core.actions import Exited, Released
from mlwe.core.backend import (
    Backend,
    Command,
    Event,
    RunningAttempt,
    StartCommand,
    StopCommand,
    Telemetry,
)
from mlwe.core.clock import Clock


class FaultInjector:
    """A Backend that forwards to ``inner`` and adds the faults asked for."""

    def __init__(self, inner: Backend, clock: Clock, *, oom_after_s: float = 3.0) -> None:
        self.inner = inner
        self.clock = clock
        self.name = getattr(inner, "name", type(inner).__name__)
        self.oom_after_s = oom_after_s
        self._lock = threading.Lock()
        self._diverging: dict[str, tuple[float, float]] = {}  # workload -> (since, base loss)
        self._oom: dict[str, int | None] = {}  # workload -> memory (MiB) that is too little
        self._oom_due: dict[tuple[str, int], tuple[float, str | None]] = {}
        self._swallow: set[tuple[str, int]] = set()  # releases of attempts we killed
        self._n = 0

    # ------------------------------------------------------------ faults asked
    def diverge(self, workload: str) -> None:
        with self._lock:
            self._diverging.setdefault(workload, (self.clock.now(), math.nan))

    def oom(self, workload: str, too_little_mib: int | None = None) -> None:
        """OOM-kill attempts of ``workload`` that ask for at most ``too_little_mib`` of memory
        (default: what its first attempt after this call asks for)."""
        with self._lock:
            self._oom[workload] = too_little_mib

    def clear(self, workload: str) -> None:
        with self._lock:
            self._diverging.pop(workload, None)
            self._oom.pop(workload, None)

    def active(self) -> dict[str, list[str]]:
        with self._lock:
            return {"diverging": sorted(self._diverging), "oom": sorted(self._oom)}

    # ---------------------------------------------------------------- protocol
    def send(self, commands: Sequence[Command]) -> None:
        now = self.clock.now()
        with self._lock:
            for c in commands:
                if isinstance(c, StartCommand) and c.workload in self._oom:
                    memory = c.spec.resources.memory
                    limit = self._oom[c.workload]
                    if limit is None:
                        limit = self._oom[c.workload] = memory
                    if memory <= limit:
                        self._oom_due[(c.workload, c.attempt)] = (
                            now + self.oom_after_s,
                            c.correlation_id,
                        )
        self.inner.send(commands)

    def poll(self) -> list[Event]:
        now = self.clock.now()
        stops: list[Command] = []
        injected: list[Event] = []
        with self._lock:
            for key, (due, cid) in list(self._oom_due.items()):
                if due <= now:
                    del self._oom_due[key]
                    wid, attempt = key
                    self._swallow.add(key)
                    self._n += 1
                    stops.append(
                        StopCommand(
                            request_id=f"fault-oom:{wid}:{attempt}",
                            workload=wid,
                            attempt=attempt,
                            grace_s=0.0,
                            reason="oom",
                            correlation_id=cid,
                        )
                    )
                    injected.append(
                        Event(
                            f"fault-{self._n}-oom-{wid}-{attempt}",
                            now,
                            Exited(wid, attempt, 137, "oom"),
                            cid,
                        )
                    )
        if stops:
            self.inner.send(stops)
        out: list[Event] = []
        for ev in self.inner.poll():
            f = ev.fact
            key = (getattr(f, "workload", ""), getattr(f, "attempt", -1))
            with self._lock:
                killed = key in self._swallow
            if killed and isinstance(f, Released | Exited):
                continue  # the attempt already ended with the injected OOM
            if killed and type(f).__name__ in ("Started", "Progress"):
                continue
            out.append(ev)
        return [*out, *injected]

    def drain_telemetry(self) -> list[Telemetry]:
        samples = self.inner.drain_telemetry()
        with self._lock:
            if not self._diverging:
                return samples
            div = dict(self._diverging)
        out = []
        for s in samples:
            st = div.get(s.workload or "")
            if st is not None and "loss" in s.metrics:
                since, base = st
                if math.isnan(base):
                    base = float(s.metrics["loss"])
                    with self._lock:
                        self._diverging[s.workload or ""] = (since, base)
                grown = base * math.exp(max(0.0, s.time - since) / 20.0)
                metrics = dict(s.metrics)
                metrics["loss"] = min(grown, 1e6)  # finite: JSON and the store refuse inf
                s = replace(s, metrics=metrics)
            out.append(s)
        return out

    def inventory(self) -> list[RunningAttempt]:
        with self._lock:
            killed = set(self._swallow)
        return [r for r in self.inner.inventory() if (r.workload, r.attempt) not in killed]

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # backend-specific extras (e.g. LiveSimBackend.fail_node) stay reachable
        return getattr(self.inner, name)
