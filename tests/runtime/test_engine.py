"""The runtime engine: durable acknowledgement, the loop over a backend, restart
reconciliation (adopt / requeue vanished / stop orphans), audit of operator
actions and proposals, and correlation ids from request to stream."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mlwe.core.actions import Place, SetNodeStatus, Submit
from mlwe.core.backend import RunningAttempt
from mlwe.core.clock import ManualClock
from mlwe.core.lifecycle import State
from mlwe.core.spec import ClusterSpec, NodeSpec, NodeStatus, WorkloadSpec
from mlwe.runtime import Engine, LiveSimBackend, WallClock
from mlwe.store.audit import AuditLog
from mlwe.store.recovery import recover
from mlwe.store.repository import Repository


def cluster() -> ClusterSpec:
    return ClusterSpec(
        nodes=(
            NodeSpec(name="g1", gpu_model="A100-80GB", gpus=2, cpu=16, memory="64Gi"),
            NodeSpec(name="c1", cpu=8, memory="32Gi"),
        )
    )


def job(wid: str, gpu: int = 1, secs: float = 60.0, **kw) -> WorkloadSpec:
    res = {"gpu": gpu, "cpu": 1, "memory": "1Gi"} if gpu else {"cpu": 1, "memory": "1Gi"}
    return WorkloadSpec(id=wid, name=wid, resources=res, estimated_duration=secs, **kw)


def open_engine(tmp_path: Path, clock=None, backend=None) -> Engine:
    clock = clock or WallClock(speed=50.0)
    return Engine.open(cluster(), backend or LiveSimBackend(clock), data_dir=tmp_path, clock=clock)


def test_a_submission_is_durable_when_submit_returns(tmp_path: Path) -> None:
    eng = open_engine(tmp_path)
    result = eng.submit([job("a"), job("b")], actor="alice", correlation_id="req-1")
    assert result.accepted and result.created == ("a", "b")
    # a second reader of the same database sees both, before any tick ran
    other = Repository.open(data_dir=tmp_path)
    cp = recover(other, ManualClock(eng.now()))
    assert set(cp.workloads) == {"a", "b"}
    assert cp.workloads["a"].history[0].cause_id == "req-1"
    other.close()
    entries = AuditLog(eng.repo.engine).show(correlation_id="req-1")
    assert [(e.kind, e.actor) for e in entries] == [("request", "alice")]
    eng.close()


def test_a_rejected_submission_stores_nothing(tmp_path: Path) -> None:
    eng = open_engine(tmp_path)
    assert eng.submit([job("a")]).accepted
    version = eng.cp.version
    bad = eng.submit([job("b"), job("a")])  # "a" exists: the whole batch is refused
    assert not bad.accepted and any("a" in r for r in bad.reasons())
    assert eng.cp.version == version and "b" not in eng.cp.workloads
    assert eng.repo.count_workloads() == 1
    eng.close()


def test_workloads_run_to_completion_and_the_story_is_searchable(tmp_path: Path) -> None:
    eng = open_engine(tmp_path)
    sub = eng.streams.subscribe(buffer=10_000)
    eng.submit([job("a", secs=20)], correlation_id="story-1")
    assert eng.run_until(lambda e: e.cp.workloads["a"].state is State.SUCCEEDED, 20)
    evs, dropped = sub.drain()
    assert dropped == 0
    story = [e for e in evs if e.correlation_id == "story-1"]
    topics = {e.topic for e in story}
    assert {"state", "audit"} <= topics
    states = [e.data["to"] for e in story if e.data.get("type") == "transition"]
    assert states == ["pending", "admitted", "starting", "running", "succeeded"]
    commands = [e.data for e in story if e.data.get("type") == "command"]
    assert commands and commands[0]["command"] == "start"  # the backend command carries it too
    # the audit chain holds the request and the placement decision under the same id
    kinds = {e.kind for e in AuditLog(eng.repo.engine).show(correlation_id="story-1")}
    assert {"request", "decision"} <= kinds
    assert eng.audit.verify().ok
    assert eng.cp.validate_state() == []
    eng.close()


def test_preemption_places_the_urgent_job_after_the_release(tmp_path: Path) -> None:
    eng = open_engine(tmp_path)
    eng.submit([job("low1", secs=3600), job("low2", secs=3600)])
    assert eng.run_until(
        lambda e: all(e.cp.workloads[w].state is State.RUNNING for w in ("low1", "low2")), 20
    )
    eng.submit([job("urgent", secs=30, priority="urgent")])
    assert eng.run_until(lambda e: e.cp.workloads["urgent"].state is State.RUNNING, 20)
    victims = [w for w in ("low1", "low2") if e_state(eng, w) is not State.RUNNING]
    assert len(victims) == 1  # minimal: one GPU was needed
    hist = [tr.target for tr in eng.cp.workloads[victims[0]].history]
    assert State.PREEMPTING in hist and State.PREEMPTED in hist
    assert eng.cp.validate_state() == []
    eng.close()


def e_state(eng: Engine, wid: str) -> State:
    return eng.cp.workloads[wid].state


def test_operator_actions_and_proposals_are_audited(tmp_path: Path) -> None:
    eng = open_engine(tmp_path)
    eng.submit([job("a", secs=3600)])
    assert eng.run_until(lambda e: e_state(e, "a") is State.RUNNING, 20)
    assert eng.set_node_status("c1", NodeStatus.CORDONED, "maintenance", actor="ops").accepted
    bad = eng.propose(
        [Place("a", ())], actor="agent:rules", expected_version=eng.cp.version,
        correlation_id="prop-1", rationale="hallucinated",
    )
    assert not bad.accepted
    stale = eng.propose(
        [SetNodeStatus("c1", NodeStatus.READY, "x")], actor="agent:rules", expected_version=0,
    )
    assert not stale.accepted and any("version" in r for r in stale.reasons())
    assert eng.cancel("a", actor="bob").accepted
    entries = list(eng.audit.entries())
    kinds = [(e.kind, e.actor) for e in entries]
    assert ("operator", "ops") in kinds and ("operator", "bob") in kinds
    props = [e for e in entries if e.kind == "proposal"]
    assert len(props) == 2 and all(not e.data()["accepted"] for e in props)
    assert all(e.data()["reasons"] for e in props)  # each rejection says why
    assert [e.kind for e in eng.audit.show(correlation_id="prop-1")] == ["proposal"]
    assert eng.audit.verify().ok
    eng.close()


def test_restart_adopts_what_still_runs(tmp_path: Path) -> None:
    clock = WallClock(speed=50.0)
    backend = LiveSimBackend(clock)
    eng = open_engine(tmp_path, clock, backend)
    eng.submit([job("a", secs=3600), job("b", gpu=0, secs=3600)])
    assert eng.run_until(lambda e: all(e_state(e, w) is State.RUNNING for w in "ab"), 20)
    eng.close()  # the backend keeps running (like a daemon outliving the engine)
    eng2 = open_engine(tmp_path, clock, backend)
    assert sorted(eng2.last_restart.adopted) == ["a", "b"]
    assert eng2.last_restart.vanished == [] and eng2.last_restart.orphans == []
    assert e_state(eng2, "a") is State.RUNNING and eng2.cp.validate_state() == []
    eng2.close()


class _ForeignBackend(LiveSimBackend):
    """A live sim that also reports an attempt the engine never started (an orphan)."""

    def __init__(self, clock) -> None:
        super().__init__(clock)
        self.sent = []

    def inventory(self) -> list[RunningAttempt]:
        return [*super().inventory(), RunningAttempt("ghost", 3, ("g1",))]

    def send(self, commands) -> None:
        self.sent.extend(commands)
        super().send(commands)


def test_restart_requeues_vanished_work_and_stops_orphans(tmp_path: Path) -> None:
    clock = WallClock(speed=50.0)
    eng = open_engine(tmp_path, clock)
    eng.submit([job("a", secs=60)])
    assert eng.run_until(lambda e: e_state(e, "a") is State.RUNNING, 20)
    eng.close()
    fresh = _ForeignBackend(clock)  # the machine rebooted: nothing of ours runs there
    eng2 = open_engine(tmp_path, clock, fresh)
    assert eng2.last_restart.vanished == ["a"]
    assert eng2.last_restart.orphans == ["ghost#3"]
    # the vanished workload is requeued (not its fault) and finishes; the orphan is stopped
    assert eng2.run_until(lambda e: e_state(e, "a") is State.SUCCEEDED, 30)
    w = eng2.cp.workloads["a"]
    assert w.failures == 0 and w.attempt == 2
    stops = [c for c in fresh.sent if c.kind == "stop" and c.workload == "ghost"]
    assert stops and stops[0].reason == "orphan" and stops[0].grace_s == 0
    assert eng2.audit.verify().ok and eng2.cp.validate_state() == []
    eng2.close()


def test_an_old_schema_is_refused_with_the_command_to_run(tmp_path: Path) -> None:
    from mlwe.store import db

    engine = db.make_engine(db.database_url(tmp_path))
    db.migrate(engine, "0001")
    engine.dispose()
    with pytest.raises(db.SchemaError, match="mlwe db upgrade"):
        open_engine(tmp_path)


def test_streams_resume_and_slow_readers_do_not_block(tmp_path: Path) -> None:
    eng = open_engine(tmp_path)
    slow = eng.streams.subscribe(["state"], buffer=3)
    eng.submit([job(f"j{i}", gpu=0, secs=5) for i in range(10)])
    eng.tick()
    evs, dropped = slow.drain()
    assert len(evs) == 3 and dropped > 0  # the engine went on; the reader is told
    last = evs[0].id
    resumed = eng.streams.subscribe(["state"], last_event_id=last)
    more, _ = resumed.drain()
    assert more and more[0].id > last and all(e.topic == "state" for e in more)
    eng.close()


CHILD = textwrap.dedent(
    """
    import sys
    from mlwe.core.spec import ClusterSpec, NodeSpec, WorkloadSpec
    from mlwe.runtime import Engine, LiveSimBackend, WallClock

    clock = WallClock()
    eng = Engine.open(
        ClusterSpec(nodes=(NodeSpec(name="c1", cpu=4, memory="8Gi"),)),
        LiveSimBackend(clock), data_dir=sys.argv[1], clock=clock,
    )
    for b in range(100):
        specs = [
            WorkloadSpec(id=f"j{b}-{k}", name="burst", resources={"cpu": 1, "memory": "1Gi"},
                         estimated_duration=3600)
            for k in range(10)
        ]
        assert eng.submit(specs, correlation_id=f"req-{b}").accepted
        eng.tick()
        print(" ".join(s.id for s in specs), flush=True)  # acknowledged only now
    """
)


def test_sigkill_of_an_engine_process_mid_burst_loses_nothing_acknowledged(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    acked: list[str] = []
    assert proc.stdout is not None
    while len(acked) < 300:
        line = proc.stdout.readline()
        assert line, f"the engine process ended early (exit {proc.wait()})"
        acked += line.split()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    eng = open_engine(tmp_path)
    assert set(acked) <= set(eng.cp.workloads)
    assert len(eng.cp.workloads) < 1000  # it really died mid-burst
    assert eng.cp.validate_state() == []  # nothing allocated twice
    assert eng.audit.verify().ok
    # each acknowledged submission exists once, with one submission record in its history
    for wid in acked:
        hist = eng.repo.history(wid)
        assert sum(1 for tr in hist if tr.source is None) == 1
    eng.close()


def test_submit_through_the_control_plane_only(tmp_path: Path) -> None:
    eng = open_engine(tmp_path)
    # the engine's submit is Submit actions through apply: the same check as any proposal
    r = eng.propose([Submit(job("p"))], actor="agent:rules")
    assert r.accepted and "p" in eng.cp.workloads
    eng.close()


def test_maintenance_stores_downsamples_and_snapshots(tmp_path: Path) -> None:
    from mlwe.runtime import EngineConfig

    clock = WallClock(speed=50.0)
    eng = Engine.open(
        cluster(), LiveSimBackend(clock), data_dir=tmp_path, clock=clock,
        config=EngineConfig(telemetry_store_every_s=1.0, telemetry_downsample_after_s=0.0,
                            telemetry_downsample_to_s=10),
    )
    eng.submit([job("a", secs=600)])
    assert eng.run_until(lambda e: e_state(e, "a") is State.RUNNING, 20)
    for _ in range(20):
        eng.tick()
        import time as _t

        _t.sleep(0.02)
    eng.telemetry.store()
    raw = eng.repo.telemetry(workload="a")
    assert len(raw) >= 3, "the simulated backend's telemetry was stored"
    _t.sleep(0.5)  # 25 engine seconds: every stored sample is now in a closed 10 s bucket
    eng.maintenance()
    after = eng.repo.telemetry(workload="a")
    assert 0 < len(after) < len(raw) and all(s.resolution_s == 10 for s in after)
    snap = eng.repo.latest_snapshot()
    assert snap is not None and json.loads(snap.state)["workloads"]["running"] == 1
    eng.close()


def test_credentials_in_a_spec_are_refused_not_silently_redacted(tmp_path: Path) -> None:
    eng = open_engine(tmp_path)
    leaky = job("leaky").model_copy(
        update={"env": {"HF_TOKEN": "hf_" + "a" * 34, "EPOCHS": "3"},
                "command": ("python", "train.py", "--api-key=sk-" + "x" * 40)}
    )
    r = eng.submit([leaky, job("fine")])
    assert not r.accepted
    text = " ".join(r.reasons())
    assert "command[2] and env HF_TOKEN look like a credential" in text
    assert "EPOCHS" not in text and "hf_" not in text  # the error does not echo the secret
    assert "fine" not in eng.cp.workloads and eng.repo.count_workloads() == 0
    ok = job("ok").model_copy(update={"env": {"EPOCHS": "3"}})
    assert eng.submit([ok]).accepted
    eng.close()


def test_a_burst_of_submissions_shares_scheduling_cycles(tmp_path: Path) -> None:
    """Submissions ask for a tick "soon": a burst costs a few cycles over the queue, not
    one each, and every workload is still placed promptly."""
    import time

    from mlwe.runtime.engine import EngineConfig

    clock = WallClock(speed=1.0)
    eng = Engine.open(cluster(), LiveSimBackend(clock), data_dir=tmp_path, clock=clock,
                      config=EngineConfig(admit_batch_s=1.0))
    eng.start(period_s=30.0)  # only wakes make it tick
    try:
        time.sleep(0.3)
        before = eng.ticks
        for i in range(20):  # 20 CPUs' worth: all fit
            assert eng.submit([job(f"j{i}", gpu=0, secs=600)]).accepted
            time.sleep(0.02)  # a tick per wake would run one cycle each
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(
            w.state is State.PENDING for w in eng.cp.workloads.values()
        ):
            time.sleep(0.05)
        assert all(w.state is not State.PENDING for w in eng.cp.workloads.values())
        assert eng.ticks - before <= 5
    finally:
        eng.close()


def test_a_wake_now_cuts_a_submission_window_short(tmp_path: Path) -> None:
    import time

    from mlwe.runtime.engine import EngineConfig

    clock = WallClock(speed=1.0)
    eng = Engine.open(cluster(), LiveSimBackend(clock), data_dir=tmp_path, clock=clock,
                      config=EngineConfig(admit_batch_s=60.0))
    eng.start(period_s=60.0)
    try:
        time.sleep(0.3)
        before = eng.ticks
        assert eng.submit([job("a", gpu=0)]).accepted  # acknowledged without a tick
        time.sleep(0.5)
        assert eng.ticks == before  # the window is still gathering submissions
        eng.wake()  # e.g. a backend event: at once
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and eng.cp.workloads["a"].state is State.PENDING:
            time.sleep(0.02)
        assert eng.cp.workloads["a"].state is not State.PENDING
    finally:
        eng.close()


def test_mlwes_policy_learns_from_the_stores_history_across_restarts(tmp_path: Path) -> None:
    from mlwe.core.scheduler import default_scheduler

    def open_learning(clock: WallClock) -> Engine:
        return Engine.open(cluster(), LiveSimBackend(clock), data_dir=tmp_path, clock=clock,
                           scheduler=default_scheduler())

    clock = WallClock(speed=600.0)
    eng = open_learning(clock)
    eng.submit([job(f"t{i}", secs=60) for i in range(3)])
    assert eng.run_until(lambda e: all(e_state(e, f"t{i}") is State.SUCCEEDED for i in range(3)), 30)
    est = eng.scheduler.estimator
    assert est is not None and est.learned == 3
    eng.close()
    eng2 = open_learning(clock)
    est2 = eng2.scheduler.estimator
    assert est2 is not None and est2 is not est
    eng2.scheduler.plan(eng2.cp)  # attaches: seeded from the recovered completed workloads
    assert est2.learned == 3
    w = eng2.cp.workloads["t0"]
    got = est2.estimate(w)
    assert got is not None and got.source == "user-calibrated" and got.samples == 3
    eng2.close()
