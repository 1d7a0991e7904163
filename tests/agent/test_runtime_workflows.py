"""Workflows in the runtime engine: loaded from its store, ticked by its loop, and
resumed after the engine stops mid-workflow and ``Engine.open`` starts it again on the
same SQLite data directory.

The backend object outlives the engine in these tests, as a real cluster outlives the
engine process: the simulated cluster keeps running while the engine restarts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from mlwe.agent.workflows import WorkflowRunner, WorkflowStatus
from mlwe.core.backend import Command, StartCommand
from mlwe.core.clock import ManualClock
from mlwe.core.lifecycle import State
from mlwe.core.scheduler import Scheduler, SchedulerConfig
from mlwe.core.spec import ClusterSpec, NodeSpec
from mlwe.runtime import Engine, EngineConfig, LiveSimBackend
from mlwe.runtime.streams import StreamHub
from mlwe.runtime.wiring import attach_workflows, detach_workflows
from tests.core.builders import A100, gpu_job, tick_until


class CrashingSim(LiveSimBackend):
    """The live simulated backend, plus crashes of chosen attempts (a TEST DOUBLE for a
    job that dies: the simulator's own crash event, ``crash_after_s`` after the start)."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.crash: dict[str, set[int]] = {}  # workload -> attempts that crash
        self.crash_after_s = 20.0

    def send(self, commands: Sequence[Command]) -> None:
        super().send(commands)
        for c in commands:
            if isinstance(c, StartCommand) and c.attempt in self.crash.get(c.workload, set()):
                self.kernel.at(self.kernel.clock.t + self.crash_after_s, self.sim._crash,
                               (c.workload, c.attempt, 1))


class Rig:
    """An engine on a data directory, a backend that survives it, and a clock."""

    def __init__(self, tmp: Path, *, retry_base_s: float = 5.0) -> None:
        self.tmp = tmp
        self.clock = ManualClock(0.0)
        self.backend = CrashingSim(self.clock)
        self.cluster = ClusterSpec(nodes=(
            NodeSpec(name="g1", gpu_model=A100, gpus=2, cpu=64, memory="512Gi"),
        ))
        self.config = EngineConfig(retry_base_s=retry_base_s)
        self.eng = self.open()

    def open(self) -> Engine:
        # the scheduler does not preempt by itself here: the workflow does
        return Engine.open(self.cluster, self.backend, data_dir=self.tmp, clock=self.clock,
                           config=self.config,
                           scheduler=Scheduler(config=SchedulerConfig(preemption=False)))

    def restart(self) -> WorkflowRunner:
        """The engine stops (no goodbye to the workflows) and starts again on the same data."""
        self.eng.close()
        self.eng = self.open()
        return attach_workflows(self.eng)

    def run(self, pred: Callable[[], bool], limit: int = 3000) -> None:
        tick_until(self.eng, self.clock, pred, limit)

    def state(self, wid: str) -> State:
        return self.eng.cp.workloads[wid].state

    def stored_step(self, wid: str) -> str | None:
        got = WorkflowRunner(self.eng.cp, repo=self.eng.repo)._stored(wid)
        return got.step_name if got is not None else None


def test_a_reschedule_in_flight_resumes_after_a_restart(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    wfe = attach_workflows(rig.eng)
    assert attach_workflows(rig.eng) is wfe and rig.eng.workflows is wfe  # one per engine
    rig.eng.submit([gpu_job("victim", gpu=2, priority=10, checkpoint_interval=30,
                            estimated_duration=3000)], actor="alice")
    rig.run(lambda: rig.state("victim") is State.RUNNING)
    rig.clock.advance(100)
    rig.eng.submit([gpu_job("urgent", gpu=2, priority=900, estimated_duration=600)], actor="bob")
    rig.eng.tick()
    with rig.eng.lock:
        wf = wfe.start("reschedule", {"victim": "victim", "preemptor": "urgent"},
                       correlation_id="ops-1", workflow_id="wf-r")
    # stop while the victim checkpoints: the stored row says so
    rig.run(lambda: rig.stored_step("wf-r") == "wait_checkpoint")
    assert wf.active and rig.state("victim") in (State.PREEMPTING, State.PREEMPTED)
    wfe2 = rig.restart()
    resumed = wfe2.active["wf-r"]
    assert resumed is not wf and resumed.log[-1]["event"] == "resumed"
    assert resumed.log[-1]["at"] == "wait_checkpoint"
    rig.run(lambda: not resumed.active)
    assert resumed.status == WorkflowStatus.DONE, resumed.log
    assert rig.state("urgent") is State.RUNNING
    assert rig.eng.cp.workloads["victim"].preemptions == 1  # asked once, across the restart
    rig.eng.tick()  # the hook stores the last step
    assert rig.stored_step("wf-r") == "confirm_running"
    assert WorkflowRunner(rig.eng.cp, repo=rig.eng.repo)._stored("wf-r").status == "done"  # type: ignore[union-attr]
    entries = rig.eng.audit.show(correlation_id="ops-1")
    assert {"proposal", "workflow"} <= {e.kind for e in entries}
    assert rig.eng.audit.verify().ok
    rig.eng.close()


def failing_job(rig: Rig) -> WorkflowRunner:
    rig.backend.crash["job"] = {1}  # the first attempt dies 20 s in; the next one is fine
    wfe = attach_workflows(rig.eng)
    rig.eng.submit([gpu_job("job", gpu=1, priority=50, estimated_duration=3000, max_retries=5)],
                   actor="alice")
    rig.run(lambda: rig.state("job") is State.FAILED)
    return wfe


def test_a_recovery_in_flight_resumes_after_a_restart(tmp_path: Path) -> None:
    rig = Rig(tmp_path, retry_base_s=1e6)  # the runtime leaves retries to the workflow
    wfe = failing_job(rig)
    failed_at = rig.clock.now()
    with rig.eng.lock:
        wf = wfe.start("recover", {"workload": "job", "backoff_base_s": 100,
                                   "healthy_after_s": 60}, correlation_id="ops-2",
                       workflow_id="wf-v")
    rig.run(lambda: rig.stored_step("wf-v") == "retry")
    assert wf.data.get("waiting", "").startswith("backoff: retry 1/3")
    # the workflow retries after its backoff; the engine stops while it watches attempt 2
    rig.run(lambda: rig.stored_step("wf-v") == "watch")
    assert rig.state("job") in (State.ADMITTED, State.STARTING, State.RUNNING)
    wfe2 = rig.restart()
    assert "job" in rig.eng.last_restart.adopted  # type: ignore[union-attr]
    resumed = wfe2.active["wf-v"]
    assert resumed.log[-1]["at"] == "watch"
    rig.run(lambda: not resumed.active)
    assert resumed.status == WorkflowStatus.DONE, resumed.log
    assert resumed.data["summary"].startswith("recovered: job runs on g1 (1 retry")
    job = rig.eng.cp.workloads["job"]
    assert job.state is State.RUNNING and job.attempt == 2
    retried = [e for e in resumed.log if e["event"] == "proposed"]
    assert [e["actions"][0]["kind"] for e in retried] == ["retry"]  # once, after the backoff
    assert retried[0]["t"] >= failed_at + 100
    assert [t.cause_id for t in job.history if t.target is State.PENDING][-1] == "ops-2"
    rig.eng.close()


def test_a_restart_during_the_backoff_counts_the_runtimes_retry(tmp_path: Path) -> None:
    """After a restart the runtime retries a failed workload at once (the reconciler does
    not know what backoff was waited); the workflow takes that as its retry, not twice."""
    rig = Rig(tmp_path, retry_base_s=1e6)
    wfe = failing_job(rig)
    with rig.eng.lock:
        wfe.start("recover", {"workload": "job", "backoff_base_s": 100, "healthy_after_s": 60},
                  workflow_id="wf-b")
    rig.run(lambda: rig.stored_step("wf-b") == "retry")
    wfe2 = rig.restart()
    resumed = wfe2.active["wf-b"]
    rig.run(lambda: not resumed.active)
    assert resumed.status == WorkflowStatus.DONE, resumed.log
    assert any("already retried by the runtime" in e.get("note", "") for e in resumed.log)
    assert not [e for e in resumed.log if e["event"] == "proposed"]
    assert rig.eng.cp.workloads["job"].attempt == 2
    rig.eng.close()


def test_workflow_steps_are_streamed_and_detach_stores_them(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    hub: StreamHub = rig.eng.streams
    sub = hub.subscribe(["state"], buffer=10_000)
    wfe = attach_workflows(rig.eng)
    rig.eng.submit([gpu_job("victim", gpu=2, priority=10, estimated_duration=3000)], actor="a")
    rig.run(lambda: rig.state("victim") is State.RUNNING)
    rig.eng.submit([gpu_job("urgent", gpu=2, priority=900, estimated_duration=600)], actor="b")
    with rig.eng.lock:
        wf = wfe.start("reschedule", {"victim": "victim", "preemptor": "urgent"},
                       workflow_id="wf-s")
    rig.run(lambda: not wf.active)
    rig.eng.tick()
    got, dropped = sub.drain()
    assert dropped == 0
    events = [dict(e.data) for e in got]
    steps = [e for e in events if e.get("type") == "workflow" and e["workflow"] == "wf-s"]
    assert [e["event"] for e in steps][:3] == ["started", "proposed", "step-done"]
    assert steps[1]["actions"][0]["kind"] == "preempt" and steps[1]["status"] == "running"
    assert steps[-1]["event"] == "done"
    before = len(rig.eng.tick_hooks)
    detach_workflows(rig.eng)
    assert len(rig.eng.tick_hooks) == before - 1 and rig.eng.workflows is None
    rig.eng.close()
