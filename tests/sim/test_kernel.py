"""The discrete-event kernel: ordering, determinism, hooks."""

from __future__ import annotations

import math
from typing import Any

import pytest

from mlwe.sim.kernel import Kernel, bench_kernel


def test_events_run_in_time_then_priority_then_sequence_order() -> None:
    k = Kernel()
    seen: list[str] = []
    k.at(5.0, seen.append, "t5-p0-first")
    k.at(1.0, seen.append, "t1")
    k.at(5.0, seen.append, "t5-p-1", priority=-1)
    k.at(5.0, seen.append, "t5-p0-second")
    k.at(3.0, seen.append, "t3")
    k.run()
    assert seen == ["t1", "t3", "t5-p-1", "t5-p0-first", "t5-p0-second"]
    assert k.clock.now() == 5.0
    assert k.events == 5


def test_on_quiet_runs_once_per_distinct_time_after_all_its_events() -> None:
    k = Kernel()
    log: list[tuple[str, float]] = []
    for t in (1.0, 1.0, 2.0):
        k.at(t, lambda a: log.append(("event", a)), t)
    k.run(on_quiet=lambda t: log.append(("quiet", t)))
    assert log == [("event", 1.0), ("event", 1.0), ("quiet", 1.0), ("event", 2.0), ("quiet", 2.0)]


def test_events_scheduled_at_the_current_time_by_the_hook_run_before_time_moves() -> None:
    k = Kernel()
    log: list[str] = []
    once = [True]

    def quiet(t: float) -> None:
        log.append(f"quiet@{t}")
        if once[0]:
            once[0] = False
            k.at(t, log.append, "same-time follow-up")

    k.at(1.0, log.append, "first")
    k.at(2.0, log.append, "later")
    k.run(on_quiet=quiet)
    assert log == ["first", "quiet@1.0", "same-time follow-up", "quiet@1.0", "later", "quiet@2.0"]


def test_run_until_stops_and_leaves_later_events() -> None:
    k = Kernel()
    seen: list[int] = []
    for t in range(10):
        k.at(float(t), seen.append, t)
    k.run(until=4.5)
    assert seen == [0, 1, 2, 3, 4]
    assert k.clock.now() == 4.5
    assert k.peek() == 5.0
    k.run()
    assert seen == list(range(10))


def test_scheduling_in_the_past_is_refused() -> None:
    k = Kernel()
    k.at(10.0, lambda _: None)
    k.run()
    with pytest.raises(ValueError, match="past"):
        k.at(9.0, lambda _: None)


def test_same_inputs_same_order_every_run() -> None:
    def run() -> list[Any]:
        k = Kernel()
        out: list[Any] = []
        for i in range(200):
            k.at(float(i % 7), out.append, i, priority=i % 3)
        k.run()
        return out

    assert run() == run()


def test_bench_kernel_reports_figures() -> None:
    r = bench_kernel(20_000)
    assert r["events"] == 20_000
    assert r["events_per_s"] > 0 and r["chain_events_per_s"] > 0
    assert math.isfinite(r["wall_s"])


def test_step_runs_one_distinct_time_then_the_hook() -> None:
    k = Kernel()
    log: list[Any] = []
    for t in (1.0, 1.0, 2.0):
        k.at(t, log.append, t)
    assert k.step(on_quiet=lambda t: log.append(("quiet", t))) == 2
    assert log == [1.0, 1.0, ("quiet", 1.0)]
    assert k.clock.now() == 1.0 and k.events == 2
    assert k.step() == 1 and k.clock.now() == 2.0 and k.events == 3
    assert k.step() == 0 and k.clock.now() == 2.0


def test_paced_run_gives_the_same_order_and_clock_as_an_unpaced_one() -> None:
    def world(pace: float | None) -> tuple[list[Any], float, int]:
        k = Kernel()
        log: list[Any] = []
        for t in (0.0, 0.01, 0.01, 0.02):
            k.at(t, log.append, t)
        k.run(until=0.05, on_quiet=lambda t: log.append(("quiet", t)), pace=pace)
        return log, k.clock.now(), k.events

    assert world(1.0) == world(None)
