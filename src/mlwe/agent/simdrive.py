"""Drive a control plane, a reconciler and a simulated backend on a kernel.

The same loop the trace replay runs (one reconcile step per distinct event
time, commands back to the backend, retries woken on time), packaged so the
what-if engine and the scenario evaluations share it. ``on_quiet`` hooks run
after the engine's step at each time (the agent's tick, in evaluations).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlwe.core.actions import Released
from mlwe.core.reconcile import Reconciler
from mlwe.sim.backend import SimBackend
from mlwe.sim.kernel import Kernel


def release_with_checkpoint(backend: SimBackend, arg: tuple[str, int]) -> bool:
    """A graceful stop of a workload that checkpoints: it saves its state on the
    signal (within the grace period), so no work is lost. Returns False when the
    workload does not checkpoint (the simulator's default then applies: work
    since the last periodic checkpoint is lost)."""
    run = backend._current(*arg)
    if run is None or not run.spec.checkpoint_interval:
        return False
    now = backend.kernel.clock.t
    total = backend.durations[run.workload]
    done = min(total, run.base_work + max(0.0, now - run.t_start - run.overhead))
    run.finished = True
    backend.saved[run.workload] = done
    est = run.spec.estimated_duration
    frac = min(1.0, done / est) if est else None
    backend._emit(Released(run.workload, run.attempt, checkpointed_progress=frac))
    return True


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
