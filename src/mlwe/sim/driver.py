"""One simulated world: a reconciler and a simulated backend driven on a kernel.

The loop every simulated run shares (the trace replay, the agent's what-if
forecasts and its scenario evaluations): whenever every event at a time ``t``
has run, the driver

1. calls ``before_step`` (a forecast on a background thread lets others run);
2. settles the reconciler: ``handle(backend.poll())``, ``step()``,
   ``backend.send(commands)``, again until a step has nothing to send; when a
   send put events at ``t`` itself, it returns at once (the kernel runs them
   and calls back at the same ``t``);
3. calls the ``after_step`` hooks with ``t`` (the agent's tick; the replay's
   invariant sweep and progress report); with ``restep_after_hooks``, it then
   handles, steps and sends once more, so what a hook proposed takes effect
   at ``t``;
4. wakes itself on time: at the reconciler's next retry and, with
   ``scheduler_wakeup``, at the moment a policy that acts by time alone names
   (the reconciler is marked dirty then).

The kernel then moves the clock to the next event (a wakeup is one). Nothing
here reads the wall clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from mlwe.core.reconcile import Reconciler
from mlwe.sim.backend import SimBackend
from mlwe.sim.kernel import Kernel


def _noop(_: Any) -> None:
    return None


class Driver:
    """Drives ``reconciler`` and ``backend`` on ``kernel``; see the module docstring.

    ``after_step``: hooks called once the reconciler has settled at each time
    (append more to :attr:`hooks` later). ``restep_after_hooks``: whether one
    more handle/step/send follows the hooks (when there are any): hooks that
    propose actions need it; observers do not. ``scheduler_wakeup``: the next
    moment the policy wants a cycle with no event (None: none).
    """

    def __init__(
        self,
        kernel: Kernel,
        reconciler: Reconciler,
        backend: SimBackend,
        *,
        before_step: Callable[[], None] | None = None,
        after_step: Sequence[Callable[[float], None]] = (),
        restep_after_hooks: bool = True,
        scheduler_wakeup: Callable[[], float | None] | None = None,
    ) -> None:
        self.kernel = kernel
        self.rec = reconciler
        self.backend = backend
        self.before_step = before_step
        self.hooks: list[Callable[[float], None]] = list(after_step)
        self.restep_after_hooks = restep_after_hooks
        self.scheduler_wakeup = scheduler_wakeup
        self._wakeups: set[float] = set()
        self._scheduler_wakeups: set[float] = set()

    def _wake(self, _: Any) -> None:
        self.rec.dirty = True

    def on_quiet(self, t: float) -> None:
        """One scheduling round at ``t`` (the kernel's ``on_quiet`` callback)."""
        if self.before_step is not None:
            self.before_step()
        rec, backend, kernel = self.rec, self.backend, self.kernel
        while True:
            rec.handle(backend.poll())
            commands = rec.step()
            if not commands:
                break
            backend.send(commands)
            if kernel.peek() <= t:
                return  # events at this same moment first; we come back after them
        hooks = self.hooks
        if hooks:
            for hook in hooks:
                hook(t)
            if self.restep_after_hooks:
                # a hook may have proposed actions (the agent): apply their consequences now
                rec.handle(backend.poll())
                commands = rec.step()
                if commands:
                    backend.send(commands)
        nxt = rec.next_wakeup()
        if nxt is not None and nxt > t and nxt not in self._wakeups:
            self._wakeups.add(nxt)
            kernel.at(nxt, _noop)
        if self.scheduler_wakeup is not None:
            due = self.scheduler_wakeup()
            if due is not None and due > t and due not in self._scheduler_wakeups:
                self._scheduler_wakeups.add(due)
                kernel.at(due, self._wake)

    def start(self) -> None:
        """Schedule a first step at the current time (work already waiting)."""
        self.rec.dirty = True
        self.kernel.at(self.kernel.clock.t, _noop)

    def run(self, until: float = math.inf) -> int:
        """Run the world up to ``until`` (default: until no event is left); returns
        the number of kernel events this call ran."""
        k = self.kernel
        before = k.events
        k.run(until=until, on_quiet=self.on_quiet)
        return k.events - before


__all__ = ["Driver"]
