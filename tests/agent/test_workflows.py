"""Multi-step workflows on a bare control plane + simulated backend + reconciler.

Each scenario runs the real loop (backend events -> reconciler -> workflow
tick -> scheduling cycle -> backend commands) on simulated time. The crash
tests stop the engine mid-workflow, rebuild the control plane and the
workflow runner from the store (SQLite), and check the workflow resumes at
the step it was at and ends as it would have without the crash.

The scheduler here runs with preemption off and the reconciler's own retries
pushed out of reach, so the workflows are the only ones preempting and
retrying (each test says when it lets the runtime compete).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from mlwe.agent.workflows import (
    DEFINITIONS,
    RECOVER,
    RESCHEDULE,
    AuditingProposer,
    Workflow,
    WorkflowError,
    WorkflowRunner,
    WorkflowStatus,
)
from mlwe.bus.consumer import dead_letters
from mlwe.core.actions import Exited, Submit
from mlwe.core.backend import Command, Event, StartCommand, StopCommand
from mlwe.core.cluster import build_control_plane
from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import State
from mlwe.core.reconcile import Reconciler
from mlwe.core.scheduler import Scheduler, SchedulerConfig
from mlwe.core.spec import ClusterSpec, NodeSpec, WorkloadSpec
from mlwe.sim.backend import SimBackend, SimBackendConfig
from mlwe.sim.kernel import Kernel
from mlwe.store import db
from mlwe.store import schema as S
from mlwe.store.audit import AuditLog
from mlwe.store.recovery import StoreWriter, attach, recover
from mlwe.store.repository import Repository
from tests.core.builders import gpu_job, gpu_node, tick_until
from tests.store.conftest import PG_URL, require_postgres


# ============================================================ test doubles
class StartRefusals:
    """A backend that cannot start some workloads: a TEST DOUBLE wrapping the simulator.

    Starts of the listed workloads come back as ``start-failed`` exits (what a
    real backend reports for a missing image or a bad command); everything
    else goes to the wrapped SimBackend. Crashes on named nodes are injected
    through the simulator's own crash event."""

    def __init__(self, sim: SimBackend, kernel: Kernel) -> None:
        self.sim = sim
        self.kernel = kernel
        self.name = "sim-with-faults"
        self.refuse: set[str] = set()
        self.deaf: set[str] = set()  # stop commands for these are lost: no release ever comes
        self.crash_on_nodes: set[str] = set()
        self.crash_after_s = 20.0
        self.crash_attempts: dict[str, set[int]] = {}  # workload -> attempts that crash
        self._out: list[Event] = []
        self._n = 0

    def send(self, commands: Sequence[Command]) -> None:
        passed = []
        for c in commands:
            if isinstance(c, StartCommand) and c.workload in self.refuse:
                self._n += 1
                self._out.append(Event(f"refuse-{self._n}", self.kernel.clock.t,
                                       Exited(c.workload, c.attempt, 127, "start-failed")))
                continue
            if isinstance(c, StopCommand) and c.workload in self.deaf:
                continue
            passed.append(c)
            if isinstance(c, StartCommand) and (
                {a.node for a in c.placement} & self.crash_on_nodes
                or c.attempt in self.crash_attempts.get(c.workload, set())
            ):
                self.kernel.at(self.kernel.clock.t + self.crash_after_s, self.sim._crash,
                               (c.workload, c.attempt, 1))
        self.sim.send(passed)

    def poll(self) -> list[Event]:
        out, self._out = self._out, []
        return out + self.sim.poll()

    def pending(self) -> bool:
        return bool(self._out)

    def drain_telemetry(self) -> list[Any]:
        return self.sim.drain_telemetry()

    def inventory(self) -> list[Any]:
        return self.sim.inventory()

    def close(self) -> None:
        self.sim.close()


class Env:
    """Control plane, reconciler, simulated backend and workflow runner, with a driver loop."""

    def __init__(
        self,
        nodes: Sequence[NodeSpec],
        durations: dict[str, float],
        *,
        tmp: Path | None = None,
        repo: Repository | None = None,
        retry_base_s: float = 1e7,
        eviction_delay_s: float = 5.0,
        preemption: bool = False,
    ) -> None:
        self.kernel = Kernel()
        self.cluster = ClusterSpec(nodes=tuple(nodes))
        self.durations = durations
        self.sim = SimBackend(self.kernel, durations,
                              SimBackendConfig(eviction_delay_s=eviction_delay_s))
        self.backend = StartRefusals(self.sim, self.kernel)
        self.repo: Repository | None = None
        self.writer: StoreWriter | None = None
        self.audit: AuditLog | None = None
        self.retry_base_s = retry_base_s
        self.preemption = preemption
        cp = build_control_plane(self.cluster, self.kernel.clock)
        if tmp is not None:
            repo = Repository.open(url=f"sqlite:///{tmp / 'mlwe.db'}", upgrade=True)
        if repo is not None:
            self.repo = repo
            self.audit = AuditLog(self.repo.engine, clock=self.kernel.clock.now)
            self.writer = attach(self.repo, cp, sync=True)
        self._wire(cp, WorkflowRunner(cp, scheduler=self.scheduler(), repo=self.repo,
                                      writer=self.writer, audit=self.audit))

    def scheduler(self) -> Scheduler:
        return Scheduler(config=SchedulerConfig(preemption=self.preemption))

    def _wire(self, cp: ControlPlane, wf: WorkflowRunner) -> None:
        self.cp = cp
        self.wf = wf
        self.rec = Reconciler(cp, wf.scheduler, grace_s=30.0, retry_base_s=self.retry_base_s)

    def submit(self, *specs: WorkloadSpec) -> None:
        res = self.cp.apply([Submit(s) for s in specs], cause_id="test")
        assert res.accepted, res.reasons()

    def restart(self, *, runtime_retries: bool = True) -> None:
        """The engine process dies and starts again: everything rebuilt from the store.

        The backend (the cluster) keeps running, as a real one would."""
        assert self.repo is not None
        self.cp.listeners.clear()
        cp = recover(self.repo, self.kernel.clock)
        self.writer = attach(self.repo, cp)
        wf = WorkflowRunner.load(cp, self.repo, scheduler=self.scheduler(), writer=self.writer,
                                 audit=self.audit)
        assert wf.load_errors == []
        self._wire(cp, wf)
        self.rec.resume()
        if not runtime_retries:
            # a runtime that leaves retries to the workflows: resume() re-arms the
            # reconciler's own retry of every failed workload; take those back out
            self.rec._retries.clear()

    runtime_order = False  # True: the scheduling cycle runs before the workflows (Engine.tick)

    def step(self) -> None:
        self.rec.handle(self.backend.poll())
        if self.runtime_order:
            cmds = self.rec.step()
            self.wf.tick()
            cmds += self.rec.step()
        else:
            self.wf.tick()
            cmds = self.rec.step()
        if self.writer is not None:
            self.writer.flush()  # durable before the backend acts, as the runtime does
        if cmds:
            self.backend.send(cmds)

    def drive(self, until: float, stop: Callable[[], bool] | None = None) -> None:
        k = self.kernel
        for _ in range(20_000):
            self.step()
            if stop is not None and stop():
                return
            now = k.clock.t
            if self.backend.pending() or k.peek() <= now:
                k.run(until=now)
                continue
            wake = self.wf.next_wakeup()
            if wake is not None and wake <= now:
                continue  # a workflow has more to do at this moment
            wakes = [t for t in (self.wf.next_wakeup(), self.rec.next_wakeup())
                     if t is not None and t > now]
            nxt = min([k.peek(), *wakes])
            if nxt > until or math.isinf(nxt):
                k.run(until=until)
                self.step()
                return
            k.run(until=nxt)
        raise AssertionError("the loop did not settle")

    def state(self, wid: str) -> State:
        return self.cp.workloads[wid].state

    def nodes(self, wid: str) -> list[str]:
        return sorted({a.node for a in self.cp.workloads[wid].placement})


def steps_run(wf: Workflow) -> list[str]:
    return [e["step"] for e in wf.log if e["event"] == "step-done"]


def caused_by(cp: ControlPlane, wid: str, target: State) -> list[str | None]:
    return [t.cause_id for t in cp.workloads[wid].history if t.target is target]


def reschedule_env(tmp: Path | None = None, **kw: Any) -> Env:
    """One 8-GPU node; a low-priority checkpointing fine-tune runs on it; an urgent one waits."""
    env = Env([gpu_node("n1")], {"victim": 3600.0, "urgent": 600.0}, tmp=tmp, **kw)
    env.submit(gpu_job("victim", priority=10, checkpoint_interval=60, estimated_duration=3600))
    env.drive(until=300)
    assert env.state("victim") is State.RUNNING
    env.submit(gpu_job("urgent", priority=900, estimated_duration=600))
    env.drive(until=310)
    assert env.state("urgent") is State.PENDING  # no scheduler preemption here
    return env


# ========================================================== reschedule
def test_reschedule_walks_every_step_and_names_its_cause() -> None:
    env = reschedule_env()
    wf = env.wf.start("reschedule", {"victim": "victim", "preemptor": "urgent"},
                      correlation_id="plan-42")
    env.drive(until=2000, stop=lambda: not wf.active)
    assert wf.status == WorkflowStatus.DONE, wf.log
    assert steps_run(wf) == ["checkpoint", "wait_checkpoint", "confirm_release", "place",
                             "start"]
    assert wf.log[-1]["event"] == "done"
    assert env.state("urgent") is State.RUNNING
    assert env.state("victim") is State.PREEMPTED
    # the victim checkpointed every 60 s of work: it keeps what it saved
    assert env.cp.workloads["victim"].progress == pytest.approx(300 / 3600)
    assert wf.state["victims"]["victim"]["saved_progress"] == round(300 / 3600, 6)
    # the preemption and the placement were the workflow's, under its correlation id
    assert caused_by(env.cp, "victim", State.PREEMPTING) == ["plan-42"]
    assert caused_by(env.cp, "urgent", State.ADMITTED) == ["plan-42"]
    assert wf.state["placed_by_workflow"] is True
    assert env.cp.validate_state() == []


def test_reschedule_accepts_the_scheduler_placing_the_preemptor_first() -> None:
    # in the runtime's order (scheduling cycle first, then the tick hooks) the cycle
    # after the release places the preemptor itself; the place step sees that and goes on
    env = reschedule_env()
    env.runtime_order = True
    wf = env.wf.start("reschedule", {"victim": "victim", "preemptor": "urgent"},
                      correlation_id="plan-9")
    env.drive(until=2000, stop=lambda: not wf.active)
    assert wf.status == WorkflowStatus.DONE, wf.log
    assert env.state("urgent") is State.RUNNING
    assert "placed_by_workflow" not in wf.state
    assert any("placed by the scheduler" in e.get("note", "") for e in wf.log)
    assert caused_by(env.cp, "urgent", State.ADMITTED) != ["plan-9"]
    assert caused_by(env.cp, "victim", State.PREEMPTING) == ["plan-9"]


def test_refused_preemption_fails_without_compensation() -> None:
    env = reschedule_env()
    # equal priority: the control plane's priority rule refuses the preemption
    env.submit(gpu_job("peer", priority=10))
    wf = env.wf.start("reschedule", {"victim": "victim", "preemptor": "peer"})
    env.drive(until=400, stop=lambda: not wf.active)
    assert wf.status == WorkflowStatus.FAILED
    assert "refused the preemption" in wf.data["error"]
    assert "priority rule" in wf.data["error"]
    assert env.state("victim") is State.RUNNING  # nothing happened to it
    assert [e["event"] for e in wf.log].count("compensated") == 0
    assert env.wf.alerts and env.wf.alerts[-1].severity == "critical"


def test_preemptor_that_cannot_start_resumes_the_victim() -> None:
    env = reschedule_env()
    env.backend.refuse.add("urgent")  # its image cannot be pulled, say
    before = env.cp.workloads["victim"].placement
    wf = env.wf.start("reschedule", {"victim": "victim", "preemptor": "urgent"})
    env.drive(until=2000, stop=lambda: not wf.active)
    assert wf.status == WorkflowStatus.COMPENSATED, wf.log
    assert "could not start" in wf.data["error"] and "start-failed" in wf.data["error"]
    events = [e["event"] for e in wf.log]
    assert events.index("step-failed") < events.index("compensating") < events.index("compensated")
    # the victim runs again, on its old devices, resumed from its checkpoint
    env.drive(until=2100)
    victim = env.cp.workloads["victim"]
    assert victim.state is State.RUNNING
    assert victim.placement == before and victim.attempt == 2
    assert victim.work_done > 0
    assert caused_by(env.cp, "victim", State.ADMITTED)[-1] == wf.correlation_id
    assert env.wf.alerts[-1].severity == "warning"
    assert env.cp.validate_state() == []


def test_preemptor_cancelled_while_the_victim_checkpoints_resumes_the_victim() -> None:
    env = reschedule_env()
    wf = env.wf.start("reschedule", {"victim": "victim", "preemptor": "urgent"})
    env.drive(until=320, stop=lambda: env.state("victim") is State.PREEMPTING)
    from mlwe.core.actions import Cancel

    assert env.cp.apply([Cancel("urgent")]).accepted
    env.drive(until=2000, stop=lambda: not wf.active)
    assert wf.status == WorkflowStatus.COMPENSATED
    assert "cancelled" in wf.data["error"]
    env.drive(until=2100)
    assert env.state("victim") is State.RUNNING


def test_victim_that_never_releases_times_out_and_the_compensation_says_so() -> None:
    env = reschedule_env()
    env.backend.deaf.add("victim")  # the stop is lost: the backend never confirms a release
    wf = env.wf.start("reschedule", {"victim": "victim", "preemptor": "urgent",
                                     "checkpoint_timeout_s": 120, "compensation_timeout_s": 60})
    env.drive(until=1000, stop=lambda: not wf.active)
    assert wf.status == WorkflowStatus.FAILED
    assert "wait_checkpoint timed out after 120s" in wf.data["error"]
    assert "compensation failed" in wf.data["error"]
    # timeouts are measured on the engine clock from when the step began
    failed = next(e for e in wf.log if e["event"] == "step-failed")
    began = next(e for e in wf.log if e["event"] == "step-done" and e["step"] == "checkpoint")
    assert 120 < failed["t"] - began["t"] <= 121


def two_victims_env(tmp: Path | None = None) -> Env:
    """One 8-GPU node shared by two 4-GPU checkpointing runs; an urgent 8-GPU job waits."""
    env = Env([gpu_node("n1")], {"v1": 3600.0, "v2": 3600.0, "urgent": 600.0}, tmp=tmp)
    env.submit(gpu_job("v1", gpu=4, priority=10, checkpoint_interval=60, estimated_duration=3600),
               gpu_job("v2", gpu=4, priority=20, checkpoint_interval=60, estimated_duration=3600))
    env.drive(until=300)
    assert env.state("v1") is env.state("v2") is State.RUNNING
    env.submit(gpu_job("urgent", priority=900, estimated_duration=600))
    env.drive(until=310)
    return env


def test_reschedule_with_several_victims() -> None:
    env = two_victims_env()
    wf = env.wf.start("reschedule", {"victims": ["v1", "v2"], "preemptor": "urgent"},
                      correlation_id="plan-2v")
    env.drive(until=2000, stop=lambda: not wf.active)
    assert wf.status == WorkflowStatus.DONE, wf.log
    assert env.state("urgent") is State.RUNNING
    assert {env.state("v1"), env.state("v2")} == {State.PREEMPTED}
    # one batch asked both; each kept what it had checkpointed
    asked = [e for e in wf.log if e["event"] == "proposed" and e["actions"][0]["kind"] == "preempt"]
    assert [[a["victim"] for a in e["actions"]] for e in asked] == [["v1", "v2"]]
    assert caused_by(env.cp, "v1", State.PREEMPTING) == caused_by(env.cp, "v2", State.PREEMPTING) == [
        "plan-2v"]
    assert set(wf.state["victims"]) == {"v1", "v2"}
    assert all(r["saved_progress"] > 0 for r in wf.state["victims"].values())
    assert "v1 saved" in wf.data["summary"] and "v2 saved" in wf.data["summary"]


def test_a_preemption_already_under_way_is_adopted() -> None:
    """The agent commits its plan's preemptions itself (verified, at its version), then
    starts the workflow: the first step finds them under way and asks nobody again."""
    from mlwe.core.actions import Preempt, SetPriority

    env = two_victims_env()
    placed = {v: env.cp.workloads[v].placement for v in ("v1", "v2")}
    res = env.cp.apply([SetPriority("urgent", 950, "agent"), Preempt("v1", "urgent"),
                        Preempt("v2", "urgent")], env.cp.version, cause_id="agent-7")
    assert res.accepted
    wf = env.wf.start("reschedule", {"victims": ["v1", "v2"], "preemptor": "urgent"},
                      correlation_id="agent-7")
    env.backend.refuse.add("urgent")  # and then the preemptor cannot start
    env.drive(until=2000, stop=lambda: not wf.active)
    assert not [e for e in wf.log if e["event"] == "proposed" and
                e["actions"][0]["kind"] == "preempt"]
    first = next(e for e in wf.log if e["event"] == "step-done")
    assert first["step"] == "checkpoint"
    assert first["note"] == "v1, v2 already preempted for urgent"
    # the compensation resumes BOTH adopted victims on their old devices
    assert wf.status == WorkflowStatus.COMPENSATED, wf.log
    env.drive(until=2100)
    for v in ("v1", "v2"):
        w = env.cp.workloads[v]
        assert w.state is State.RUNNING and w.placement == placed[v] and w.attempt == 2
        assert caused_by(env.cp, v, State.ADMITTED)[-1] == "agent-7"
    assert env.cp.validate_state() == []


# ============================================================ crash / resume
RESCHEDULE_STEPS = [s.name for s in RESCHEDULE.steps]


@pytest.mark.parametrize("crash_at", ["wait_checkpoint", "confirm_release", "place", "start",
                                      "confirm_running"])
def test_reschedule_resumes_at_the_right_step_after_a_crash(tmp_path: Path, crash_at: str) -> None:
    env = reschedule_env(tmp=tmp_path)
    wf = env.wf.start("reschedule", {"victim": "victim", "preemptor": "urgent"},
                      workflow_id="wf-1", correlation_id="plan-7")
    env.wf.max_moves_per_tick = 1  # one step per tick, so the crash can land between any two
    env.drive(until=2000, stop=lambda: wf.step_name == crash_at or not wf.active)
    assert wf.step_name == crash_at and wf.active
    env.wf.flush()
    env.restart()
    resumed = env.wf.active["wf-1"]
    assert resumed.log[-1]["event"] == "resumed" and resumed.log[-1]["at"] == crash_at
    env.drive(until=3000, stop=lambda: not resumed.active)
    assert resumed.status == WorkflowStatus.DONE, resumed.log
    # exactly one preemption was asked for, however many times the steps ran
    assert len([e for e in resumed.log if e["event"] == "proposed"
                and e["actions"][0]["kind"] == "preempt"]) == 1
    assert env.cp.workloads["victim"].preemptions == 1
    assert env.state("urgent") is State.RUNNING
    env.wf.flush()
    stored = env.wf._stored("wf-1")
    assert stored is not None and stored.status == WorkflowStatus.DONE
    assert stored.correlation_id == "plan-7"


def test_a_preemption_lost_in_a_crash_is_asked_again(tmp_path: Path) -> None:
    # the workflow record says "asked" but the state never became durable: the
    # next step sees the victim still running and goes back to ask again
    env = reschedule_env(tmp=tmp_path)
    wf = env.wf.start("reschedule", {"victim": "victim", "preemptor": "urgent"},
                      workflow_id="wf-2")
    env.wf.autoflush = False
    env.wf.writer = None
    env.wf.tick()  # asks the victim; the control plane is NOT flushed
    assert wf.step_name == "wait_checkpoint"
    env.wf.flush()  # but the workflow record is (the order the engine normally forbids)
    env.restart()
    assert env.state("victim") is State.RUNNING  # the preemption was lost
    env.drive(until=3000, stop=lambda: not env.wf.active.get("wf-2", wf).active)
    done = env.wf.get("wf-2")
    assert done is not None and done.status == WorkflowStatus.DONE
    assert any(e["event"] == "goto" and e["to"] == "checkpoint" for e in done.log)


# ============================================================ recovery
def recover_env(tmp: Path | None = None, repo: Repository | None = None, **kw: Any) -> Env:
    """n1 (8 GPUs) is the best fit for an 8-GPU job, n2 (16 GPUs) the fallback: the
    scheduler puts the job back on n1 every time; only a move takes it to n2."""
    env = Env([gpu_node("n1", gpus=8), gpu_node("n2", gpus=16)], {"job": 1000.0},
              tmp=tmp, repo=repo, **kw)
    env.backend.crash_after_s = 20.0
    return env


def start_failing(env: Env, **params: Any) -> Workflow:
    env.submit(gpu_job("job", estimated_duration=1000, max_retries=10))
    env.drive(until=200, stop=lambda: env.state("job") is State.FAILED)
    assert env.state("job") is State.FAILED
    return env.wf.start("recover", {"workload": "job", **params})


def test_recover_retries_after_backoff_and_finishes_when_healthy() -> None:
    env = recover_env()
    env.backend.crash_attempts["job"] = {1}  # only the first attempt crashes
    wf = start_failing(env, backoff_base_s=30, healthy_after_s=60)
    failed_at = wf.state.get("failed_at") or env.kernel.clock.t
    env.drive(until=5000, stop=lambda: not wf.active)
    assert wf.status == WorkflowStatus.DONE, wf.log
    assert wf.data["summary"].startswith("recovered:")
    retry = next(e for e in wf.log if e["event"] == "proposed")
    assert retry["actions"] == [{"kind": "retry", "workload": "job"}]
    assert retry["t"] == pytest.approx(failed_at + 30)
    assert wf.state["tries"] == 1 and wf.state["moves"] == 0


def test_recover_backoff_grows_exponentially() -> None:
    env = recover_env()
    env.backend.crash_attempts["job"] = {1, 2, 3}
    wf = start_failing(env, backoff_base_s=10, backoff_factor=3, max_retries=3, healthy_after_s=30)
    env.drive(until=5000, stop=lambda: not wf.active)
    assert wf.status == WorkflowStatus.DONE
    retries = [e["t"] for e in wf.log if e["event"] == "proposed"]
    fails = [f["time"] for f in wf.state["failures"]]
    assert len(retries) == 3 and len(fails) == 3
    assert [round(r - f, 6) for r, f in zip(retries, fails)] == [10, 30, 90]


def test_recover_moves_off_the_node_it_keeps_failing_on() -> None:
    env = recover_env()
    env.backend.crash_on_nodes.add("n1")  # n1 is sick: everything on it crashes
    wf = start_failing(env, backoff_base_s=5, max_retries=2, healthy_after_s=60)
    env.drive(until=5000, stop=lambda: not wf.active)
    assert wf.status == WorkflowStatus.DONE, wf.log
    assert env.nodes("job") == ["n2"]
    assert wf.state["bad_nodes"] == ["n1"]
    assert wf.state["tries"] == 2 and wf.state["moves"] == 1
    move = [e for e in wf.log if e["event"] == "proposed"][-1]
    assert [a["kind"] for a in move["actions"]] == ["retry", "place"]
    assert move["actions"][1]["nodes"] == ["n2"]


def test_recover_gives_up_to_a_dead_letter_and_an_alert(tmp_path: Path) -> None:
    env = recover_env(tmp=tmp_path)
    env.backend.crash_on_nodes.update({"n1", "n2"})  # nowhere is safe
    alerts: list[Any] = []
    env.wf.alert_listeners.append(alerts.append)
    wf = start_failing(env, backoff_base_s=5, max_retries=1, healthy_after_s=60)
    env.drive(until=5000, stop=lambda: not wf.active)
    assert wf.status == WorkflowStatus.FAILED
    assert wf.data["error"].startswith("gave up: still failing after 1 retries and 1 move(s)")
    assert [a.severity for a in alerts] == ["critical"]
    assert "gave up recovering job" in alerts[0].message
    assert env.repo is not None
    letters = dead_letters(env.repo.engine)
    assert [d.event_id for d in letters] == [f"workflow:{wf.id}:gave-up"]
    letter = letters[0]
    assert letter.subject == "workflow.recover.gave_up"
    assert letter.envelope.correlation_id == wf.correlation_id  # a replayable envelope
    assert letter.envelope.payload["workload"] == "job"
    assert [f["nodes"] for f in letter.envelope.payload["failures"]] == [["n1"], ["n1"], ["n2"]]
    # every step event is an audit record, and the chain verifies
    assert env.audit is not None
    kinds = [e.kind for e in env.audit.entries() if e.correlation_id == wf.correlation_id]
    assert kinds.count("alert") == 1 and kinds.count("workflow") >= 8
    assert env.audit.verify().ok


def test_recover_a_lost_node_goes_straight_to_move() -> None:
    env = recover_env()
    env.submit(gpu_job("job", estimated_duration=1000))
    env.drive(until=100)
    assert env.nodes("job") == ["n1"]
    env.sim.fail_node(env.kernel.clock.t + 1, "n1")
    env.drive(until=200, stop=lambda: env.state("job") is State.FAILED)
    wf = env.wf.start("recover", {"workload": "job"})
    env.drive(until=5000, stop=lambda: not wf.active)
    assert wf.status == WorkflowStatus.DONE
    assert any(e["event"] == "goto" and e["to"] == "move" for e in wf.log)
    assert env.nodes("job") == ["n2"] and wf.state["tries"] == 0


def test_recover_resumes_its_backoff_after_a_crash(tmp_path: Path) -> None:
    env = recover_env(tmp=tmp_path)
    env.backend.crash_attempts["job"] = {1}
    wf = start_failing(env, backoff_base_s=300, healthy_after_s=30)
    env.drive(until=env.kernel.clock.t + 100, stop=lambda: False)
    assert wf.step_name == "retry" and "backoff" in wf.data["waiting"]
    due = wf.state["retry_due"]
    env.wf.flush()
    env.restart(runtime_retries=False)
    again = env.wf.active[wf.id]
    assert again.step_name == "retry" and again.state["retry_due"] == due
    env.drive(until=5000, stop=lambda: not again.active)
    assert again.status == WorkflowStatus.DONE
    retry = next(e for e in again.log if e["event"] == "proposed")
    assert retry["t"] == pytest.approx(due)  # not restarted from zero by the crash


def test_after_a_restart_the_runtime_retry_counts_and_is_not_doubled(tmp_path: Path) -> None:
    # the reconciler re-arms its own retry of failed workloads when the engine
    # restarts (at once): the workflow takes that as its retry instead of adding one
    env = recover_env(tmp=tmp_path)
    env.backend.crash_attempts["job"] = {1}
    wf = start_failing(env, backoff_base_s=300, healthy_after_s=30)
    env.drive(until=env.kernel.clock.t + 100)
    env.restart(runtime_retries=True)
    again = env.wf.active[wf.id]
    env.drive(until=5000, stop=lambda: not again.active)
    assert again.status == WorkflowStatus.DONE
    assert not [e for e in again.log if e["event"] == "proposed"]
    assert again.state["tries"] == 1
    assert env.cp.workloads["job"].attempt == 2


def test_recover_lets_the_runtime_retry_count_as_a_retry() -> None:
    # the reconciler retries failed workloads by itself (here after ~1 s): the
    # workflow's retry step sees the workload already re-queued and does not retry twice
    env = recover_env(retry_base_s=1.0)
    env.backend.crash_attempts["job"] = {1}
    wf = start_failing(env, backoff_base_s=600, healthy_after_s=30)
    env.drive(until=5000, stop=lambda: not wf.active)
    assert wf.status == WorkflowStatus.DONE
    assert not [e for e in wf.log if e["event"] == "proposed"]
    assert any("already retried by the runtime" in e.get("note", "") for e in wf.log)


# ========================================================= engine rules
def test_bad_requests_are_refused_and_store_nothing(tmp_path: Path) -> None:
    env = reschedule_env(tmp=tmp_path)
    cases: list[tuple[str, Any, str]] = [
        ("migrate", {}, "unknown workflow kind 'migrate'; known: recover, reschedule"),
        ("reschedule", {"victim": "victim"}, "preemptor: Field required"),
        ("reschedule", {"victim": "victim", "preemptor": "nope"},
         "preemptor: unknown workload 'nope'"),
        ("reschedule", {"victim": "victim", "preemptor": "urgent", "place_timeout_s": -1},
         "place_timeout_s: Input should be greater than 0"),
        ("reschedule", {"victim": "urgent", "preemptor": "victim"}, "victim urgent is pending"),
        ("reschedule", {"victim": "victim", "preemptor": "victim"}, "cannot preempt itself"),
        ("reschedule", {"victim": "victim", "preemptor": "urgent", "colour": "red"},
         "colour: Extra inputs are not permitted"),
        ("reschedule", {"preemptor": "urgent"}, "give exactly one of victim or victims"),
        ("reschedule", {"victim": "victim", "victims": ["victim"], "preemptor": "urgent"},
         "give exactly one of victim or victims"),
        ("reschedule", {"victims": ["victim", "victim"], "preemptor": "urgent"},
         "a workload is named twice"),
        ("reschedule", {"victims": ["victim", "ghost"], "preemptor": "urgent"},
         "victim: unknown workload 'ghost'"),
        ("recover", {"workload": "victim", "backoff_factor": 0.5},
         "backoff_factor: Input should be greater than or equal to 1"),
        ("recover", {"workload": "victim", "bad_nodes": ["n9"]}, "unknown node(s) n9"),
        ("recover", ["victim"], "parameters must be a mapping"),
    ]
    for kind, params, message in cases:
        with pytest.raises(WorkflowError) as err:
            env.wf.start(kind, params)
        assert message in str(err.value), (kind, params, str(err.value))
    assert env.repo is not None
    with env.repo.engine.connect() as c:
        assert c.execute(select(func.count()).select_from(S.workflows)).scalar() == 0
    assert env.wf.active == {}


def test_starting_twice_is_idempotent_and_a_conflict_is_refused(tmp_path: Path) -> None:
    env = reschedule_env(tmp=tmp_path)
    env.submit(gpu_job("other", priority=800))
    first = env.wf.start("reschedule", {"victim": "victim", "preemptor": "urgent"})
    again = env.wf.start("reschedule", {"victim": "victim", "preemptor": "urgent"})
    assert again is first
    with pytest.raises(WorkflowError, match="already running for victim"):
        env.wf.start("reschedule", {"victim": "victim", "preemptor": "other"})
    with pytest.raises(WorkflowError, match="already exists"):
        env.wf.start("recover", {"workload": "urgent"}, workflow_id=first.id)
    assert [w.id for w in env.wf.workflows()] == [first.id]
    # what a caller about to act checks first (the agent, before it commits a plan)
    assert env.wf.conflicts("reschedule", {"victim": "victim", "preemptor": "urgent"}) == []
    assert env.wf.conflicts("reschedule", {"victim": "victim", "preemptor": "other"}) == [
        f"reschedule: workflow {first.id} is already running for victim"]
    assert env.wf.conflicts("recover", {"workload": "victim"}) == []  # another kind
    assert "give exactly one of victim or victims" in env.wf.conflicts(
        "reschedule", {"preemptor": "urgent"})[0]
    assert "unknown workflow kind" in env.wf.conflicts("migrate", {})[0]


def test_cancel_runs_the_compensations(tmp_path: Path) -> None:
    env = reschedule_env(tmp=tmp_path)
    wf = env.wf.start("reschedule", {"victim": "victim", "preemptor": "urgent"})
    env.drive(until=320, stop=lambda: env.state("victim") is State.PREEMPTING)
    env.wf.cancel(wf.id, "operator changed their mind")
    assert wf.status == WorkflowStatus.COMPENSATING
    env.drive(until=2000, stop=lambda: not wf.active)
    assert wf.status == WorkflowStatus.COMPENSATED
    assert wf.data["error"] == "cancelled: operator changed their mind"
    env.drive(until=2100)
    assert env.state("victim") is State.RUNNING
    with pytest.raises(WorkflowError, match="only running ones are cancelled"):
        env.wf.cancel(wf.id)
    with pytest.raises(WorkflowError, match="unknown workflow"):
        env.wf.cancel("nope")


def test_stored_document_is_json_and_sanitised(tmp_path: Path) -> None:
    env = reschedule_env(tmp=tmp_path)
    wf = env.wf.start("reschedule", {"victim": "victim", "preemptor": "urgent"},
                      correlation_id="plan-1")
    wf.state["note"] = "api_key=sk-abcdefghijklmnopqrstuvwxyz0123456789"
    env.wf._touch(wf)
    env.wf.flush()
    assert env.repo is not None
    with env.repo.engine.connect() as c:
        row = c.execute(select(S.workflows).where(S.workflows.c.id == wf.id)).one()
    assert row.kind == "reschedule" and row.status == "running" and row.step == 0
    assert row.correlation_id == "plan-1"
    doc = json.loads(row.data)
    assert doc["params"]["victim"] == "victim"
    assert "sk-abcdefghijklmnopqrstuvwxyz" not in row.data


def test_corrupt_rows_are_reported_and_the_rest_resume(tmp_path: Path) -> None:
    env = reschedule_env(tmp=tmp_path)
    env.wf.start("reschedule", {"victim": "victim", "preemptor": "urgent"}, workflow_id="good")
    assert env.repo is not None
    with env.repo.engine.begin() as c:
        for wid, kind, data in (("bad-json", "reschedule", "{nope"),
                                ("bad-kind", "teleport", json.dumps({"params": {}})),
                                ("bad-params", "recover", json.dumps({"params": {"x": 1}}))):
            c.execute(S.workflows.insert().values(id=wid, kind=kind, status="running", step=0,
                                                  data=data, created=0.0, updated=0.0))
    eng = WorkflowRunner.load(env.cp, env.repo)
    assert list(eng.active) == ["good"]
    assert len(eng.load_errors) == 3
    assert any("bad-json" in e and "unreadable" in e for e in eng.load_errors)
    assert any("unknown kind 'teleport'" in e for e in eng.load_errors)
    assert any("bad-params" in e for e in eng.load_errors)


def test_auditing_proposer_notes_each_proposal() -> None:
    env = reschedule_env()
    notes: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    env.wf.proposer = AuditingProposer(env.cp, lambda *a, **k: notes.append((a, k)))
    wf = env.wf.start("reschedule", {"victim": "victim", "preemptor": "urgent"})
    env.drive(until=2000, stop=lambda: not wf.active)
    assert wf.status == WorkflowStatus.DONE
    kinds = [a[2]["actions"][0]["kind"] for a, _ in notes]
    assert kinds == ["preempt", "place"]
    assert all(a[0] == "proposal" and a[2]["accepted"] for a, _ in notes)
    assert all(k["correlation_id"] == wf.correlation_id for _, k in notes)


def test_definitions_describe_themselves() -> None:
    assert [d.kind for d in DEFINITIONS] == ["reschedule", "recover"]
    desc = RESCHEDULE.describe()
    assert [s["name"] for s in desc["steps"]] == RESCHEDULE_STEPS
    assert desc["steps"][0]["compensation"].startswith("resume the victim")
    assert desc["required"] == ["preemptor"]  # and one of victim / victims
    assert {"victim", "victims"} <= set(desc["params"])
    assert [s["name"] for s in RECOVER.describe()["steps"]] == [
        "triage", "retry", "watch", "move", "give_up"]
    assert RECOVER.describe()["steps"][3]["on_timeout"] == "give_up"


@pytest.mark.parametrize("crash_at", ["retry", "watch", "move"])
def test_recover_resumes_at_the_right_step_after_a_crash(tmp_path: Path, crash_at: str) -> None:
    env = recover_env(tmp=tmp_path)
    env.backend.crash_on_nodes.add("n1")
    wf = start_failing(env, backoff_base_s=5, max_retries=2, healthy_after_s=60)
    env.wf.max_moves_per_tick = 1
    env.drive(until=5000, stop=lambda: wf.step_name == crash_at or not wf.active)
    assert wf.step_name == crash_at and wf.active
    env.wf.flush()
    env.restart(runtime_retries=False)
    again = env.wf.active[wf.id]
    assert again.log[-1] == {"t": env.kernel.clock.t, "step": crash_at, "event": "resumed",
                             "at": crash_at, "phase": "forward"}
    env.drive(until=5000, stop=lambda: not again.active)
    # the same end as without the crash: two retries on n1, then moved to n2
    assert again.status == WorkflowStatus.DONE, again.log
    assert env.nodes("job") == ["n2"]
    assert (again.state["tries"], again.state["moves"]) == (2, 1)
    assert [f["nodes"] for f in again.state["failures"]] == [["n1"], ["n1"], ["n1"]]


# ============================================================ the runtime
def test_workflows_in_the_runtime_engine_are_audited_and_durable(tmp_path: Path) -> None:
    """Wired into mlwe.runtime.Engine as its DESIGN says: a tick hook, proposals noted
    as audit records in the engine's own flush, workflow rows in the same database."""
    from mlwe.core.clock import ManualClock
    from mlwe.runtime import Engine, LiveSimBackend

    clock = ManualClock(0.0)
    cluster = ClusterSpec(nodes=(gpu_node("g1", gpus=2),))

    def open_engine() -> Engine:
        return Engine.open(cluster, LiveSimBackend(clock), data_dir=tmp_path, clock=clock,
                           scheduler=Scheduler(config=SchedulerConfig(preemption=False)))

    eng = open_engine()
    wfe = WorkflowRunner(eng.cp, proposer=AuditingProposer(eng.cp, eng.writer.note_audit),
                         scheduler=eng.scheduler, repo=eng.repo, audit=eng.audit)
    eng.tick_hooks.append(wfe.tick_hook())

    def run(pred: Callable[[], bool]) -> None:
        tick_until(eng, clock, pred, limit=2000)

    eng.submit([gpu_job("victim", gpu=2, priority=10, checkpoint_interval=30,
                        estimated_duration=3000)], actor="alice")
    run(lambda: eng.cp.workloads["victim"].state is State.RUNNING)
    clock.advance(100)
    eng.submit([gpu_job("urgent", gpu=2, priority=900, estimated_duration=600)], actor="bob")
    eng.tick()
    wf = wfe.start("reschedule", {"victim": "victim", "preemptor": "urgent"},
                   correlation_id="ops-1")
    run(lambda: not wf.active)
    assert wf.status == WorkflowStatus.DONE, wf.log
    eng.tick()  # the hook stores the last step of the workflow
    entries = eng.audit.show(correlation_id="ops-1")
    proposals = [e for e in entries if e.kind == "proposal"]
    # the engine's own cycle (before the hooks) placed the preemptor once released
    assert [json.loads(e.payload)["actions"][0]["kind"] for e in proposals] == ["preempt"]
    assert any("placed by the scheduler" in e.get("note", "") for e in wf.log)
    assert all(e.actor == "workflow" and json.loads(e.payload)["accepted"] for e in proposals)
    assert {e.kind for e in entries} >= {"proposal", "workflow"}
    assert eng.audit.verify().ok
    eng.close()
    # a new engine on the same database finds the finished workflow
    eng2 = open_engine()
    again = WorkflowRunner.load(eng2.cp, eng2.repo)
    assert again.active == {}
    stored = again.get(wf.id)
    assert stored is not None and stored.status == WorkflowStatus.DONE
    assert stored.correlation_id == "ops-1"
    eng2.close()


@pytest.fixture
def pg_engine() -> Any:
    """A fresh schema on this machine's PostgreSQL (skipped without one; under CI=true, failed)."""
    import uuid

    require_postgres()
    name = f"mlwe_wf_{uuid.uuid4().hex[:12]}"
    admin = db.make_engine(PG_URL)
    with admin.begin() as c:
        c.exec_driver_sql(f'CREATE SCHEMA "{name}"')
    engine = db.make_engine(PG_URL, schema_name=name)
    db.migrate(engine)
    yield engine
    engine.dispose()
    with admin.begin() as c:
        c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    admin.dispose()


def test_workflows_on_postgresql(pg_engine: Any) -> None:
    """The same store code on PostgreSQL: rows, dead letter and audit, then a restart."""
    engine = pg_engine
    env = recover_env(repo=Repository(engine))
    env.backend.crash_on_nodes.update({"n1", "n2"})
    wf = start_failing(env, backoff_base_s=5, max_retries=1, healthy_after_s=60)
    env.wf.max_moves_per_tick = 1
    env.drive(until=5000, stop=lambda: wf.step_name == "move")
    env.restart(runtime_retries=False)
    again = env.wf.active[wf.id]
    env.drive(until=5000, stop=lambda: not again.active)
    assert again.status == WorkflowStatus.FAILED
    assert [d.event_id for d in dead_letters(engine)] == [f"workflow:{wf.id}:gave-up"]
    assert env.audit is not None and env.audit.verify().ok
    stored = env.wf.get(wf.id)
    assert stored is not None and stored.status == WorkflowStatus.FAILED
