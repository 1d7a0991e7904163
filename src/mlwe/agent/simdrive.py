"""Drive a control plane, a reconciler and a simulated backend on a kernel.

The same loop the trace replay runs (one reconcile step per distinct event
time, commands back to the backend, retries woken on time), packaged so the
what-if engine and the scenario evaluations share it. ``on_quiet`` hooks run
after the engine's step at each time (the agent's tick, in evaluations).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlwe.core.reconcile import Reconciler
from mlwe.sim.backend import SimBackend
from mlwe.sim.kernel import Kernel


class SimDriver:
    def __init__(self, kernel: Kernel, reconciler: Reconciler, backend: SimBackend,
                 pause: Callable[[], None] | None = None) -> None:
        self.kernel = kernel
        self.rec = reconciler
        self.backend = backend
        self.hooks: list[Callable[[float], None]] = []
        #: called before each step (a forecast on a background thread lets others run)
        self.pause = pause
        self._wakeups: set[float] = set()

    def _noop(self, _: Any) -> None:
        return None

    def _on_quiet(self, t: float) -> None:
        if self.pause is not None:
            self.pause()
        rec, backend, kernel = self.rec, self.backend, self.kernel
        while True:
            rec.handle(backend.poll())
            commands = rec.step()
            if not commands:
                break
            backend.send(commands)
            if kernel.peek() <= t:
                return  # events at this same moment first; we come back after them
        for hook in self.hooks:
            hook(t)
        if self.hooks:
            # a hook may have proposed actions (the agent): apply their consequences now
            rec.handle(backend.poll())
            commands = rec.step()
            if commands:
                backend.send(commands)
        nxt = rec.next_wakeup()
        if nxt is not None and nxt > t and nxt not in self._wakeups:
            self._wakeups.add(nxt)
            kernel.at(nxt, self._noop)

    def start(self) -> None:
        """Schedule a first step at the current time (work already waiting)."""
        self.rec.dirty = True
        self.kernel.at(self.kernel.clock.t, self._noop)

    def run(self, until: float) -> None:
        self.kernel.run(until=until, on_quiet=self._on_quiet)
