"""``mlwe bench core`` on a small cluster: what it measures is really measured.

Timings are not checked (they belong to the benchmark, not to tests); what is
checked is that each figure comes from samples of the scenario it names, on a
control plane whose invariants hold at the end.
"""

from __future__ import annotations

import random

from mlwe.core import ManualClock, build_control_plane
from mlwe.core.scheduler import default_scheduler
from mlwe.sim import bench
from mlwe.sim.bench import bench_core


def test_bench_core_times_preemptions_and_the_cycle_after_them() -> None:
    # more running work than the cluster holds: every GPU node is busy, so each
    # urgent whole-node job must preempt, and the bench stops at the number asked
    r = bench_core(nodes=40, pending=60, running=1000, preemptions=6, latency_samples=10)
    assert r["invariants_ok"] is True
    assert r["running"] > 0 and r["placed"] > 0
    assert r["placements_per_s"] > 0
    # each preempting cycle timed, and the one after it
    assert r["preemption_samples"] == 6
    assert 0 < r["preemption_p50_ms"] <= r["preemption_p99_ms"]
    assert 0 < r["after_preemption_p50_ms"] <= r["after_preemption_p99_ms"]
    # the scenario stays fixed: every victim released (as a backend does after the
    # grace period), including those the requeued victims' gain searches chose
    assert r["releasing_end"] == 0
    assert r["running_end"] > 0


def test_bench_core_leaves_no_victim_holding_its_node() -> None:
    # many small equals: the victims back in the queue preempt equals for gain in
    # the cycle after, and those victims must release too
    r = bench_core(nodes=60, pending=0, running=2000, preemptions=40, latency_samples=20)
    assert r["preemption_samples"] == 40
    assert r["releasing_end"] == 0
    assert r["invariants_ok"] is True


def test_bench_core_without_running_work_reports_no_preemption() -> None:
    r = bench_core(nodes=20, pending=20, running=0, preemptions=5, latency_samples=5)
    assert r["invariants_ok"] is True
    assert r["preemption_samples"] == 0
    assert r["preemption_p99_ms"] is None and r["after_preemption_p99_ms"] is None


def test_placement_samples_see_the_same_backlog() -> None:
    # each sample is withdrawn or finished, and the backlog stays queued for the next
    rng = random.Random(0)
    clock = ManualClock(0.0)
    cp = build_control_plane(bench.synthetic_cluster(40, 8, 0), clock)
    sched = default_scheduler()
    bench._fill_running(cp, sched, rng, clock, 200)
    bench._throughput(cp, sched, rng, 300)
    backlog = set(cp.queued)
    assert backlog
    bench._placement_latency(cp, sched, rng, 30)
    assert set(cp.queued) == backlog
