"""A discrete-event kernel: a heap ordered by (time, priority, sequence).

Same inputs, same order, every run: ties in time break by priority, then by
the order events were scheduled. The clock is the kernel's own; nothing here
reads the wall clock except :func:`run_paced`, the optional pacing for live demos.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from typing import Any

_push = heapq.heappush


class SimClock:
    __slots__ = ("t",)

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t


class Kernel:
    """Runs callbacks in (time, priority, sequence) order.

    ``on_quiet(t)`` is called whenever every event at time ``t`` has run (it
    may schedule more at ``t``, which then run before time moves on): the
    replay uses it to run one scheduling cycle per distinct event time.
    """

    __slots__ = ("_heap", "_seq", "clock", "events")

    def __init__(self, start: float = 0.0) -> None:
        self._heap: list[tuple[float, int, int, Callable[[Any], None], Any]] = []
        self._seq = itertools.count(1)
        self.clock = SimClock(start)
        self.events = 0

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None, priority: int = 0) -> None:
        if t < self.clock.t:
            raise ValueError(f"cannot schedule in the past: {t} < {self.clock.t}")
        _push(self._heap, (t, priority, next(self._seq), fn, arg))

    def after(self, delay: float, fn: Callable[[Any], None], arg: Any = None, priority: int = 0) -> None:
        self.at(self.clock.t + delay, fn, arg, priority)

    def peek(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def __len__(self) -> int:
        return len(self._heap)

    def step(self, on_quiet: Callable[[float], None] | None = None) -> int:
        """Run every event at the earliest pending time ``t`` (the clock moves there),
        then ``on_quiet(t)``; returns how many events ran (0: nothing was pending)."""
        n = self._step(on_quiet)
        self.events += n
        return n

    def _step(self, on_quiet: Callable[[float], None] | None) -> int:
        heap = self._heap
        if not heap:
            return 0
        pop = heapq.heappop
        t = heap[0][0]
        self.clock.t = t
        n = 0
        while heap and heap[0][0] == t:
            _, _, _, fn, arg = pop(heap)
            fn(arg)
            n += 1
        if on_quiet is not None:
            on_quiet(t)
        return n

    def run(
        self,
        until: float = math.inf,
        on_quiet: Callable[[float], None] | None = None,
        pace: float | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """Run events up to ``until``. ``pace``: simulated seconds per wall second
        (see :func:`run_paced`)."""
        if pace:
            run_paced(self, pace, until, on_quiet, stop)
            return
        heap = self._heap
        clock = self.clock
        if on_quiet is None and stop is None:
            pop = heapq.heappop
            n = 0
            while heap:  # the fast path: no per-time hook
                item = pop(heap)
                if item[0] > until:
                    heapq.heappush(heap, item)
                    break
                clock.t = item[0]
                item[3](item[4])
                n += 1
            if until != math.inf and clock.t < until:
                clock.t = until
            self.events += n
            return
        step = self._step
        n = 0
        while heap and heap[0][0] <= until:
            n += step(on_quiet)
            if stop is not None and stop():
                break
        self._end_run(until, n, stop)

    def _end_run(self, until: float, n: int, stop: Callable[[], bool] | None) -> None:
        if until != math.inf and self.clock.t < until and not (stop is not None and stop()):
            self.clock.t = until
        self.events += n


def run_paced(
    kernel: Kernel,
    pace: float,
    until: float = math.inf,
    on_quiet: Callable[[float], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> None:
    """:meth:`Kernel.run` held to the wall clock, ``pace`` simulated seconds per wall
    second (live demos): the same steps, each one waiting until the wall clock has
    caught up with its time (the way SimPy's ``RealtimeEnvironment`` wraps its core)."""
    wall0 = time.monotonic()
    sim0 = kernel.clock.t
    n = 0
    while len(kernel) and kernel.peek() <= until:
        lag = (kernel.peek() - sim0) / pace - (time.monotonic() - wall0)
        if lag > 0:
            time.sleep(min(lag, 1.0))
            continue
        n += kernel._step(on_quiet)
        if stop is not None and stop():
            break
    kernel._end_run(until, n, stop)


def bench_kernel(n: int = 1_000_000, seed: int = 0) -> dict[str, float]:
    """Kernel speed on a null model (handlers do nothing): ``mlwe bench kernel``.

    ``events_per_s``: n events at seeded random times are scheduled and then
    run; the time counts both. ``chain_events_per_s``: 1,000 chains where each
    event schedules the next (a heap that never empties).
    """
    import random

    rng = random.Random(seed)
    times = [rng.random() * 1e6 for _ in range(n)]

    def noop(_: Any) -> None:
        return None

    k = Kernel()
    at = k.at
    t0 = time.perf_counter()
    for t in times:
        at(t, noop)
    k.run()
    wall = time.perf_counter() - t0

    k2 = Kernel()
    left = [n]
    at2 = k2.at
    clock = k2.clock

    def tick(_: Any) -> None:
        left[0] -= 1
        if left[0] > 0:
            at2(clock.t + 1.0, tick)

    for i in range(1000):
        k2.at(i / 1000, tick)
    t1 = time.perf_counter()
    k2.run()
    wall2 = time.perf_counter() - t1
    return {
        "events": k.events,
        "wall_s": round(wall, 3),
        "events_per_s": round(k.events / wall),
        "chain_events_per_s": round(k2.events / wall2),
    }
