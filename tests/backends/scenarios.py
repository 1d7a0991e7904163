"""The conformance scenarios: the same control plane, the same assertions, any backend.

Each scenario takes a :class:`~tests.backends.harness.Harness`, builds its
cluster, submits jobs, drives the loop and asserts exact outcomes from the
control plane's records (states, attempts, failures, history order) plus the
backend's evidence (resume points, replicas that ran). Durations are short
so the real backends finish in seconds; the invariants are checked after
every loop iteration by the harness.
"""

from __future__ import annotations

from collections.abc import Callable

from mlwe.core import NodeSpec, NodeStatus, State
from tests.backends.harness import RETRY_BASE_S, RETRY_FACTOR, Harness


def _nodes(n: int, cpu: str = "1") -> list[NodeSpec]:
    return [NodeSpec(name=f"n{i}", cpu=cpu, memory="1Gi") for i in range(n)]


def _time_of(h: Harness, wid: str, target: State, nth: int = 0) -> float:
    times = [t.time for t in h.cp.get(wid).history if t.target is target]
    assert len(times) > nth, f"{wid} never reached {target.value} (#{nth})"
    return times[nth]


def submit_and_complete(h: Harness) -> None:
    h.start(_nodes(1))
    h.submit(h.job("one", work_s=0.5))
    h.run_until(lambda: h.state("one") is State.SUCCEEDED, timeout=30, what="one to succeed")
    w = h.cp.get("one")
    assert w.exit_code == 0
    assert w.attempt == 1
    assert w.progress == 1.0
    assert [t.target for t in w.history] == [
        State.PENDING, State.ADMITTED, State.STARTING, State.RUNNING, State.SUCCEEDED,
    ]
    assert h.replicas_seen("one") == {0}
    assert h.rejected() == []


def urgent_preempts_and_victim_resumes(h: Harness) -> None:
    h.start(_nodes(1))
    # a real program waits at half its work until released: on a loaded machine what the
    # control plane sees lags, and the victim must not finish before its preemption lands
    h.submit(h.job("low", work_s=3.0, priority="low", cpu="1", checkpoint_every=0.5,
                   hold_at=0.5))
    # a third of its work done: two periodic checkpoints (at 0.5 s and 1 s of work) behind it
    h.run_until(lambda: h.state("low") is State.RUNNING and h.progress("low") >= 0.34,
                timeout=30, what="low to do a third of its work")
    h.submit(h.job("urgent", work_s=0.5, priority="urgent", cpu="1"))
    h.run_until(lambda: h.cp.get("low").preemptions == 1, timeout=60, what="low to be preempted")
    h.release("low")
    h.run_until(
        lambda: h.state("urgent") is State.SUCCEEDED and h.state("low") is State.SUCCEEDED,
        timeout=60, what="both to finish",
    )
    low, urgent = h.cp.get("low"), h.cp.get("urgent")
    assert low.preemptions == 1
    assert urgent.preemptions == 0
    assert low.attempt == 2 and urgent.attempt == 1
    trail = [t.target for t in low.history]
    assert trail[: trail.index(State.PREEMPTED) + 1][-2:] == [State.PREEMPTING, State.PREEMPTED]
    # the preemptor was placed only after the backend confirmed the victim's release
    assert _time_of(h, "urgent", State.ADMITTED) >= _time_of(h, "low", State.PREEMPTED)
    # and the victim came back after the preemptor finished, from its checkpoint
    assert _time_of(h, "low", State.ADMITTED, 1) >= _time_of(h, "urgent", State.SUCCEEDED)
    assert h.resumed_from("low", 1) == 0.0
    resumed = h.resumed_from("low", 2)
    assert resumed is not None and resumed >= 0.33, resumed
    assert h.rejected() == []


def gang_is_placed_whole(h: Harness) -> None:
    h.start(_nodes(2))
    h.submit(h.job("gang", work_s=0.6, replicas=2, cpu="1"),
             h.job("too-big", work_s=0.5, replicas=3, cpu="1"))
    h.run_until(lambda: h.state("gang") is State.SUCCEEDED, timeout=30, what="gang to succeed")
    (start,) = h.starts("gang")
    assert sorted(a.node for a in start.placement) == ["n0", "n1"]
    assert h.replicas_seen("gang") == {0, 1}
    # a gang that cannot fit whole gets nothing: no partial placement, no process
    big = h.cp.get("too-big")
    assert big.state is State.PENDING
    assert big.placement == ()
    assert h.starts("too-big") == []
    assert h.rejected() == []


def shaped_gang_keeps_its_shape(h: Harness) -> None:
    """MPI-style gangs: two replicas on each of two nodes, then one per node (spread)."""
    from mlwe.core.spec import GangShape

    h.start(_nodes(2, cpu="2"))
    mpi = h.job("mpi", work_s=0.6, replicas=4, cpu="1").model_copy(
        update={"gang": GangShape(tasks_per_node=2)})
    h.submit(mpi)
    h.run_until(lambda: h.state("mpi") is State.SUCCEEDED, timeout=60, what="mpi to succeed")
    (start,) = h.starts("mpi")
    assert sorted(a.node for a in start.placement) == ["n0", "n0", "n1", "n1"]
    assert h.replicas_seen("mpi") == {0, 1, 2, 3}
    wide = h.job("wide", work_s=0.5, replicas=2, cpu="1").model_copy(
        update={"gang": GangShape(placement="spread", max_replicas_per_node=1)})
    h.submit(wide)
    h.run_until(lambda: h.state("wide") is State.SUCCEEDED, timeout=60, what="wide to succeed")
    (start,) = h.starts("wide")
    assert sorted(a.node for a in start.placement) == ["n0", "n1"]
    assert h.replicas_seen("wide") == {0, 1}
    assert h.rejected() == []


def crash_is_retried_with_backoff_until_the_limit(h: Harness) -> None:
    h.start(_nodes(1))
    h.submit(h.job("crashy", work_s=0.6, crash=(0.3, 3), max_retries=2))
    h.run_until(
        lambda: h.state("crashy") is State.FAILED and h.cp.get("crashy").failures == 3,
        timeout=60, what="crashy to fail for good",
    )
    h.run_for(2.0)  # no further retry comes
    w = h.cp.get("crashy")
    assert w.state is State.FAILED
    assert w.attempt == 3  # the first run and two retries
    assert w.failures == 3
    assert w.exit_code == 3
    assert w.failure_cause == "error"
    fails = [t.time for t in w.history if t.target is State.FAILED]
    retries = [t.time for t in w.history if t.target is State.PENDING][1:]
    assert len(fails) == 3 and len(retries) == 2
    for k, (failed, retried) in enumerate(zip(fails, retries, strict=False)):
        # backoff base * factor^k, with jitter in [0.5x, 1.5x): never sooner than half
        assert retried - failed >= 0.5 * RETRY_BASE_S * RETRY_FACTOR**k, (k, retried - failed)
    assert h.rejected() == []


def lost_node_work_is_requeued_and_finishes_elsewhere(h: Harness) -> None:
    h.start(_nodes(2))
    # a real program waits at half its work until released: on a loaded machine what the
    # control plane sees lags, and the program must neither finish before its node is lost
    # nor, on its second run, before its own telemetry told where it resumed from
    h.submit(h.job("a", work_s=2.0, cpu="1", checkpoint_every=0.3, hold_at=0.5))
    # 40 % done: at least two periodic checkpoints (every 0.3 s of its 2 s) behind it
    h.run_until(lambda: h.state("a") is State.RUNNING and h.progress("a") >= 0.4,
                timeout=30, what="a to do 40% of its work")
    (first,) = h.starts("a")
    lost = first.placement[0].node
    h.lose_node(lost)
    h.run_until(lambda: h.resumed_from("a", 2) is not None, timeout=60,
                what="a to resume elsewhere")
    h.release("a")
    h.run_until(lambda: h.state("a") is State.SUCCEEDED, timeout=60, what="a to finish elsewhere")
    w = h.cp.get("a")
    assert w.failures == 0  # a lost node is not the workload's fault
    assert w.failure_cause == "node-lost", [(t.target.value, t.reason) for t in w.history]
    assert w.attempt == 2
    assert h.cp.node_status(lost) is NodeStatus.DOWN
    (_, second) = h.starts("a")
    assert {a.node for a in second.placement} == {"n0", "n1"} - {lost}
    resumed = h.resumed_from("a", 2)
    assert resumed is not None and resumed >= 0.29, resumed  # from its periodic checkpoints
    assert h.rejected() == []


SCENARIOS: list[Callable[[Harness], None]] = [
    submit_and_complete,
    urgent_preempts_and_victim_resumes,
    gang_is_placed_whole,
    shaped_gang_keeps_its_shape,
    crash_is_retried_with_backoff_until_the_limit,
    lost_node_work_is_requeued_and_finishes_elsewhere,
]
