"""Every registered policy replays real Philly jobs with invariants on.

Two runs per policy: the first 2,000 jobs on Philly's own cluster (552
machines, 3,205 GPUs: no job waits), and the first 300 jobs on 8 nodes
of 8 GPUs (64 GPUs, several times overloaded: queues, backfill and, for the
preemptive baselines, many preemptions). Both must finish every job with the
control plane's full invariant sweep clean at the end.
"""

from __future__ import annotations

import pytest

from mlwe.core.lifecycle import State
from mlwe.sim.baselines import POLICIES
from mlwe.sim.replay import ReplayConfig, ReplayResult, replay
from mlwe.sim.traces import Trace, load_trace

PREEMPTIVE = {"mlwe", "mlwe-drain", "mlwe-rewait", "srtf", "srtf-free", "tiresias", "tiresias-free"}  # may preempt
METRIC_KEYS = {
    "trace", "policy", "policy_semantics", "jobs", "completed", "unfinished",
    "avg_jct_s", "median_jct_s", "p99_jct_s", "avg_queue_delay_s", "makespan_s",
    "gpu_util", "preemptions", "gpu_hours_lost_to_preemption", "invariant_checks",
    "invariants", "cycles", "events", "rejected_batches",
}


@pytest.fixture(scope="module")
def philly_2000() -> Trace:
    return load_trace("philly", limit=2000)


@pytest.fixture(scope="module")
def philly_300_small() -> Trace:
    return load_trace("philly", limit=300, cluster="nodes:8x8")


def check(result: ReplayResult, trace: Trace, policy: str) -> None:
    m = result.metrics
    assert not METRIC_KEYS - set(m), sorted(METRIC_KEYS - set(m))
    assert m["policy"] == policy
    assert m["policy_semantics"]
    assert m["jobs"] == m["completed"] == len(trace.jobs)
    assert m["unfinished"] == 0
    assert m["invariants"] == "on"
    assert m["invariant_checks"] > 0
    assert m["rejected_batches"] == 0
    assert len(result.jcts) == len(trace.jobs)
    assert all(w.state is State.SUCCEEDED for w in result.cp.workloads.values())
    assert result.cp.validate_state() == []
    if policy not in PREEMPTIVE:
        assert m["preemptions"] == 0


@pytest.mark.parametrize("policy", list(POLICIES))
def test_first_2000_philly_jobs(policy: str, philly_2000: Trace) -> None:
    result = replay(philly_2000, ReplayConfig(policy=policy, full_check_every=500))
    check(result, philly_2000, policy)
    # Philly's own cluster is big enough for these jobs: every JCT is the run time
    durations = sorted(j.duration for j in philly_2000.jobs)
    assert sorted(result.jcts) == pytest.approx(durations)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_first_300_philly_jobs_on_64_gpus(policy: str, philly_300_small: Trace) -> None:
    result = replay(philly_300_small, ReplayConfig(policy=policy, full_check_every=200))
    check(result, philly_300_small, policy)
    m = result.metrics
    # the small cluster really is contended: jobs wait (under free instant
    # preemption an arrival may always start at once, by evicting lower levels)
    if policy == "tiresias-free":
        assert m["avg_jct_s"] > sum(j.duration for j in philly_300_small.jobs) / 300
    else:
        assert m["avg_queue_delay_s"] > 0
    if policy in PREEMPTIVE - {"mlwe", "mlwe-drain", "mlwe-rewait"}:
        assert m["preemptions"] > 0
