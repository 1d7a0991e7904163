"""Persisting a control plane as it runs, and rebuilding it from the store.

A small cluster goes through submissions, placements, starts, progress, a
preemption, a failure and retry, a cancellation, a priority change, a node
status change and a new queue; everything is flushed through the store
writer; a new control plane recovered from the store must then be the same,
field for field, and pass the full invariant sweep.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, update

from mlwe.core import (
    Action,
    Cancel,
    ControlPlane,
    DecisionRecord,
    Exited,
    ManualClock,
    NodeStatus,
    Progress,
    QueueSpec,
    Released,
    Retry,
    Scheduler,
    SetNodeStatus,
    SetPriority,
    SetQueue,
    Start,
    Started,
    State,
    Submit,
)
from mlwe.core.reconcile import Reconciler
from mlwe.store import schema as S
from mlwe.store.bench import bulk_load, synthetic_workloads
from mlwe.store.recovery import RecoveryError, StoreWriter, attach, recover
from mlwe.store.repository import Repository
from tests.core.builders import A100, cluster, cpu_node, gpu_node, job, queue


# ==================================================================== helpers
class Driver:
    """Applies batches, flushing after each one (acknowledged = flushed)."""

    def __init__(self, cp: ControlPlane, writer: StoreWriter, clock: ManualClock) -> None:
        self.cp, self.writer, self.clock = cp, writer, clock
        self.scheduler = Scheduler()

    def apply(self, *actions: Action, cause: str | None = None) -> None:
        result = self.cp.apply(list(actions), cause_id=cause)
        assert result.accepted, result.reasons()
        self.writer.flush()

    def cycle(self, cause: str) -> None:
        self.scheduler.run_cycle(self.cp, cause_id=cause)
        self.writer.flush()

    def start(self, *ids: str) -> None:
        for wid in ids:
            self.apply(Start(wid, self.cp.get(wid).attempt), cause=f"start-{wid}")
            self.clock.advance(1)
            self.apply(Started(wid, self.cp.get(wid).attempt), cause=f"ev-started-{wid}")


def state_of(cp: ControlPlane) -> dict[str, Any]:
    """Everything recovery must reproduce."""
    cap = cp.capacity
    return {
        "version": cp.version,
        "workloads": dict(cp.workloads),
        "queued": set(cp.queued),
        "nodes": [
            (info, cap.status(info.name), cap.free(info.name), cap.free_devices(info.name))
            for info in cap.nodes()
        ],
        "queues": {n: (q.spec, list(q.usage)) for n, q in cp.queues.items()},
        "on_node": {n: set(ids) for n, ids in cp.on_node.items()},
        "holding": {p: k for p, k in cp.holding_by_priority.items() if k},
    }


def assert_same(a: ControlPlane, b: ControlPlane) -> None:
    sa, sb = state_of(a), state_of(b)
    for wid in sa["workloads"].keys() | sb["workloads"].keys():
        wa, wb = sa["workloads"].get(wid), sb["workloads"].get(wid)
        if wa != wb:
            fields = [
                f
                for f in wa.__slots__  # type: ignore[union-attr]
                if getattr(wa, f, None) != getattr(wb, f, None)
            ] if wa is not None and wb is not None else ["missing"]  # fmt: skip
            pytest.fail(f"workload {wid} differs after recovery in {fields}")
    for key in sa:
        assert sa[key] == sb[key], key
    assert b.validate_state() == []


def scenario(repo: Repository) -> tuple[ControlPlane, ManualClock, Driver]:
    cp, clock = cluster(
        gpu_node("g1", A100),
        gpu_node("g2", A100),
        cpu_node("c1", cpu=32, memory="256Gi"),
        queues=[queue("team-a", gpu=16), queue("team-b", gpu=16)],
    )
    writer = attach(repo, cp, sync=True)
    d = Driver(cp, writer, clock)
    est = {"estimated_duration": "2h", "checkpoint_interval": "10m"}
    d.apply(
        Submit(job("big-a", gpu=8, models=[A100], priority="low", queue="team-a", **est)),
        Submit(job("big-b", gpu=8, models=[A100], priority="low", queue="team-b", **est)),
        Submit(job("etl", cpu=8, memory="32Gi")),
        Submit(job("flaky", cpu=4, memory="8Gi", max_retries=2)),
        Submit(job("later", gpu=1, models=[A100], priority="best-effort", queue="team-a")),
        cause="req-1",
    )
    clock.advance(5)
    d.cycle("cycle-1")
    assert {w.id for w in cp.workloads.values() if w.state is State.ADMITTED} == {
        "big-a", "big-b", "etl", "flaky",
    }  # fmt: skip
    d.start("big-a", "big-b", "etl", "flaky")
    clock.advance(600)
    d.apply(Progress("big-a", 1, 0.1, checkpointed=True), cause="ev-progress")
    d.apply(Progress("big-b", 1, 0.05), cause="ev-progress-b")

    # an urgent job preempts one of the low-priority ones; it waits for the release
    d.apply(
        Submit(job("urgent", gpu=8, models=[A100], priority="urgent", queue="team-b")),
        cause="req-2",
    )
    d.cycle("cycle-2")
    victim = next(w for w in cp.workloads.values() if w.state is State.PREEMPTING)
    assert cp.get("urgent").victims == (victim.id,)
    clock.advance(30)
    d.apply(Released(victim.id, victim.attempt, 0.1), cause="ev-released")
    d.cycle("cycle-3")
    assert cp.get("urgent").state is State.ADMITTED
    d.start("urgent")

    clock.advance(100)
    d.apply(Exited("etl", 1, 0), cause="ev-exit-etl")
    d.apply(Exited("flaky", 1, 3, "error"), cause="ev-exit-flaky")
    d.apply(Retry("flaky"), cause="op-retry")
    d.apply(Cancel("later", "no longer needed"), cause="op-cancel")
    d.apply(SetPriority("big-b" if victim.id == "big-a" else "big-a", 30, "agent"), cause="agent-1")
    d.apply(SetNodeStatus("c1", NodeStatus.CORDONED, "maintenance"), cause="op-cordon")
    d.apply(SetQueue(QueueSpec(name="team-c", cohort="org")), cause="op-queue")
    d.cycle("cycle-4")
    return cp, clock, d


# ==================================================================== tests
def test_recovered_control_plane_is_identical(repo: Repository) -> None:
    cp, clock, _ = scenario(repo)
    states = {w.id: w.state for w in cp.workloads.values()}
    assert states["etl"] is State.SUCCEEDED and states["later"] is State.CANCELLED
    flaky = cp.get("flaky")  # failed, retried, placed again
    assert flaky.failures == 1 and flaky.attempt == 2 and states["flaky"] is State.ADMITTED
    assert [t.target for t in flaky.history].count(State.FAILED) == 1
    assert State.PREEMPTED in states.values()
    assert cp.validate_state() == []

    cp2 = recover(repo, ManualClock(clock.now()))
    assert_same(cp, cp2)
    # decisions are stored, and the sequence continues where it stopped
    assert repo.decisions_for() == cp.decisions
    probe = DecisionRecord(kind="note", workload="x", policy="test", chosen="-", reasons=())
    assert cp2.record(probe).seq == cp.record(probe).seq == len(cp.decisions)

    # the recovered plane keeps running and stays durable
    w2 = attach(repo, cp2)
    d2 = Driver(cp2, w2, ManualClock(clock.now()))
    cp2.clock = d2.clock
    d2.clock.advance(50)
    d2.apply(Exited("urgent", cp2.get("urgent").attempt, 0), cause="ev-exit-urgent")
    d2.apply(Submit(job("after", cpu=2, memory="4Gi")), cause="req-3")
    d2.cycle("cycle-5")
    assert cp2.get("urgent").state is State.SUCCEEDED
    cp3 = recover(repo, ManualClock(d2.clock.now()))
    assert_same(cp2, cp3)
    assert cp3.get("after").seq > cp3.get("urgent").seq


def test_only_flushed_changes_are_durable(repo: Repository) -> None:
    cp, clock = cluster(cpu_node("c1"))
    writer = attach(repo, cp, sync=True)
    assert cp.apply([Submit(job("acked", cpu=1, memory="1Gi"))]).accepted
    writer.flush()
    flushed = state_of(cp)
    assert cp.apply([Submit(job("not-acked", cpu=1, memory="1Gi"))]).accepted
    assert writer.pending()
    cp2 = recover(repo, ManualClock(clock.now()))  # as if the process died here
    assert set(cp2.workloads) == {"acked"}
    assert state_of(cp2)["version"] == flushed["version"]
    writer.flush()
    assert not writer.pending()
    assert set(recover(repo, ManualClock(clock.now())).workloads) == {"acked", "not-acked"}


def test_a_flush_that_fails_is_written_by_the_next_one(repo: Repository, monkeypatch) -> None:
    cp, clock = cluster(cpu_node("c1"))
    writer = attach(repo, cp, sync=True)
    assert cp.apply([Submit(job("a", cpu=1, memory="1Gi"))], cause_id="r1").accepted
    real_write = repo.write

    def broken(fn):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(repo, "write", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        writer.flush()
    monkeypatch.setattr(repo, "write", real_write)
    assert cp.apply([Submit(job("b", cpu=1, memory="1Gi"))], cause_id="r2").accepted
    writer.flush()
    assert_same(cp, recover(repo, ManualClock(clock.now())))


def stored_rows(repo: Repository) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The stored transitions (workload, step, target) and decisions (seq, kind, workload)."""
    with repo.transaction() as c:
        t = S.transitions.c
        trs = c.execute(select(t.workload_id, t.step, t.target).order_by(t.id)).all()
        d = S.decisions.c
        decs = c.execute(select(d.seq, d.kind, d.workload).order_by(d.seq)).all()
    return [tuple(r) for r in trs], [tuple(r) for r in decs]


def test_a_flush_after_a_rolled_back_batch_writes_nothing_of_it(repo: Repository) -> None:
    cp, clock = cluster(cpu_node("c1"))
    writer = attach(repo, cp, sync=True)
    before = stored_rows(repo)
    assert cp.apply([Submit(job("kept", cpu=1, memory="1Gi"))], cause_id="r1").accepted
    priority = cp.get("kept").priority
    sp = cp.savepoint()
    assert cp.apply([Submit(job("undone", cpu=1, memory="1Gi"))], cause_id="r2").accepted
    assert cp.apply([SetPriority("kept", priority + 20)], cause_id="r3").accepted
    assert not cp.apply([Cancel("nobody")], cause_id="r4").accepted  # a rejection record
    cp.rollback_to(sp)
    writer.flush()
    assert stored_rows(repo) == (before[0] + [("kept", 0, "pending")], before[1])
    stored = recover(repo, ManualClock(clock.now()))
    assert set(stored.workloads) == {"kept"} and stored.get("kept").priority == priority
    assert_same(cp, stored)


def test_the_writer_stores_a_batch_applied_with_no_listener_registered(
    repo: Repository,
) -> None:
    cp, clock = cluster(cpu_node("c1"))
    writer = attach(repo, cp, sync=True)
    assert cp.listeners == [] and cp.decision_listeners == []  # it reads the effects
    assert cp.apply([Submit(job("a", cpu=1, memory="1Gi"))]).accepted
    writer.flush()
    # no lifecycle transition, no decision: only the effects record says "a" changed
    assert cp.apply([SetPriority("a", 90)]).accepted
    assert writer.pending()
    writer.flush()
    assert not writer.pending()
    assert recover(repo, ManualClock(clock.now())).get("a").priority == 90


def test_the_reconciler_reading_the_effects_takes_nothing_from_the_writer(
    repo: Repository,
) -> None:
    cp, clock = cluster(cpu_node("c1"))
    writer = attach(repo, cp, sync=True)
    before = stored_rows(repo)
    rec = Reconciler(cp, Scheduler())
    assert cp.apply([Submit(job("a", cpu=1, memory="1Gi"))], cause_id="r1").accepted
    assert not cp.apply([Cancel("nobody")], cause_id="r2").accepted
    cmds = rec.step()  # takes the submission's effects, places and starts "a"
    assert [c.workload for c in cmds] == ["a"] and cp.take_effects() == ()
    writer.flush()
    seq = before[1][-1][0] if before[1] else 0
    assert stored_rows(repo) == (
        before[0] + [("a", 0, "pending"), ("a", 1, "admitted"), ("a", 2, "starting")],
        before[1] + [(seq + 1, "reject", "nobody"), (seq + 2, "place", "a")],
    )
    assert_same(cp, recover(repo, ManualClock(clock.now())))


def test_an_over_capacity_placement_is_refused_and_nothing_is_loaded(repo: Repository) -> None:
    cp, clock, _ = scenario(repo)
    running = next(
        w for w in cp.workloads.values() if w.state is State.RUNNING and w.spec.resources.gpu
    )
    node = running.placement[0].node
    # claim a second workload holds the same eight GPUs of the same node
    other = next(
        w.id
        for w in cp.workloads.values()
        if w.state is State.PENDING or w.state is State.PREEMPTED
    )
    with repo.transaction() as c:
        placement = c.execute(
            select(S.workloads.c.placement).where(S.workloads.c.id == running.id)
        ).scalar_one()
        c.execute(
            update(S.workloads)
            .where(S.workloads.c.id == other)
            .values(state="running", placement=placement)
        )
    # whichever of the two loads second is the one that does not fit
    pattern = (
        rf"nothing was loaded.*({other}|{running.id}): node {node}: gpu 8000 requested, 0 free"
    )
    with pytest.raises(RecoveryError, match=pattern) as err:
        recover(repo, ManualClock(clock.now()))
    assert "restored state is invalid" in str(err.value)


def test_an_unreadable_record_is_named(repo: Repository) -> None:
    _, clock, _ = scenario(repo)
    with repo.transaction() as c:
        c.execute(update(S.workloads).where(S.workloads.c.id == "etl").values(spec="{not json"))
    with pytest.raises(RecoveryError, match=r"unreadable: workload 'etl': column spec"):
        recover(repo, ManualClock(clock.now()))


def test_a_stored_node_the_catalog_no_longer_knows_is_refused(repo: Repository) -> None:
    scenario(repo)
    with repo.transaction() as c:
        text = c.execute(select(S.nodes.c.spec).where(S.nodes.c.name == "g1")).scalar_one()
        c.execute(
            update(S.nodes).where(S.nodes.c.name == "g1").values(spec=text.replace(A100, "Z9000"))
        )
    with pytest.raises(RecoveryError, match=r"node 'g1': column spec.*unknown GPU model 'Z9000'"):
        recover(repo, ManualClock(0))


def test_writer_attaches_once(repo: Repository) -> None:
    cp, _ = cluster(cpu_node("c1"))
    attach(repo, cp, sync=True)
    with pytest.raises(RuntimeError, match="already has a store writer"):
        attach(repo, cp)


def test_bulk_load_writes_what_the_repository_writes(
    repo: Repository, sqlite_repo: Repository
) -> None:
    """The benchmark's fast loader produces the same records as ``insert_workloads``."""
    workloads = synthetic_workloads(60, 1)
    bulk_load(repo, workloads)
    sqlite_repo.insert_workloads(workloads, version=1)
    assert repo.load_workloads() == sqlite_repo.load_workloads() == workloads


CHILD = textwrap.dedent(
    """
    import sys
    from mlwe.core import ClusterSpec, ManualClock, NodeSpec, Submit, WorkloadSpec
    from mlwe.core import build_control_plane
    from mlwe.store.db import make_engine
    from mlwe.store.recovery import attach
    from mlwe.store.repository import Repository

    url, schema = sys.argv[1], sys.argv[2] or None
    repo = Repository(make_engine(url, schema_name=schema))
    clock = ManualClock(0)
    cp = build_control_plane(ClusterSpec(nodes=(NodeSpec(name="c1", cpu=4),)), clock)
    writer = attach(repo, cp, sync=True)
    for b in range(100):
        specs = [
            WorkloadSpec(id=f"j{b}-{k}", name="burst", resources={"cpu": 1, "memory": "1Gi"})
            for k in range(10)
        ]
        assert cp.apply([Submit(s) for s in specs], cause_id=f"req-{b}").accepted
        clock.advance(1)
        writer.flush()
        print(" ".join(s.id for s in specs), flush=True)  # acknowledged only now
    """
)


def test_sigkill_mid_burst_loses_no_acknowledged_submission(engine: Engine) -> None:
    """A separate process submits 1,000 workloads in batches and is SIGKILLed mid-burst:
    every acknowledged submission comes back exactly once, and the state is valid."""
    schema = ""
    if engine.dialect.name == "postgresql":
        with engine.connect() as c:
            schema = c.exec_driver_sql("SELECT current_schema()").scalar() or ""
    url = engine.url.render_as_string(hide_password=False)
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, url, schema], stdout=subprocess.PIPE, text=True
    )
    acked: list[str] = []
    assert proc.stdout is not None
    while len(acked) < 300:
        line = proc.stdout.readline()
        assert line, f"the submitting process ended early (exit {proc.wait()})"
        acked += line.split()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    repo = Repository(engine)
    cp = recover(repo, ManualClock(0))
    assert set(acked) <= set(cp.workloads)
    assert len(cp.workloads) < 1000  # it really died mid-burst
    assert cp.validate_state() == []
    with engine.connect() as c:
        per_workload = c.execute(
            select(S.transitions.c.workload_id, func.count()).group_by(S.transitions.c.workload_id)
        ).all()
    assert len(per_workload) == len(cp.workloads)
    assert {n for _, n in per_workload} == {1}  # each submission stored exactly once
