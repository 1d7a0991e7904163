"""The pipeline runner: steps as workloads through the control plane, followed to the end.

The first half runs on the simulated backend with a manual clock (the DAG
logic and the control plane's verdicts, deterministically); the second half
runs steps as real processes on local workload daemons, with real files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mlwe.core.lifecycle import State
from mlwe.core.spec import WorkloadSpec
from mlwe.pipelines.runner import PipelineEvent, PipelineRunner, stream_listener
from mlwe.pipelines.spec import Pipeline, PipelineError
from mlwe.runtime.engine import Engine
from mlwe.sim.live import LiveSimBackend
from mlwe.store.pipelines import PipelineStore
from tests.pipelines.conftest import SimRig


def w_state(engine: Engine, wid: str) -> State | None:
    with engine.lock:
        w = engine.cp.workloads.get(wid)
        return None if w is None else w.state


# ====================================================================== sim
def test_steps_start_only_after_their_dependencies_succeed(sim: SimRig) -> None:
    p = Pipeline("dag", defaults={"estimated_duration": "10s", "resources": {"cpu": "1"}})
    a = p.step("a", ["prog"], outputs={"o": "a.out"})
    p.step("b", ["prog", "${inputs.x}"], inputs={"x": a.output("o")})
    p.step("c", ["prog"], depends_on=["a"])
    p.step("d", ["prog"], depends_on=["b", "c"])
    events: list[PipelineEvent] = []
    sim.runner.listeners.append(events.append)
    sim.runner.listeners.append(stream_listener(sim.engine.streams.publish, sim.runner))
    sub = sim.engine.streams.subscribe(["state"])
    run = sim.runner.start(p.build())
    e = sim.engine
    assert w_state(e, f"{run.id}.a") is not None
    assert [w_state(e, f"{run.id}.{s}") for s in "bcd"] == [None, None, None]
    sim.until(lambda: sim.runner.status(run.id) == "succeeded")
    streamed = [ev.data for ev in sub.drain()[0] if ev.data.get("type") == "pipeline"]
    assert [d["kind"] for d in streamed] == [ev.kind for ev in events]  # on the dashboard too
    order = [ev.step for ev in events if ev.kind == "step.succeeded"]
    assert order[0] == "a" and order[-1] == "d" and set(order[1:3]) == {"b", "c"}
    submitted = {ev.step: ev.time for ev in events if ev.kind == "step.submitted"}
    finished = {ev.step: ev.time for ev in events if ev.kind == "step.succeeded"}
    for step, deps in {"b": "a", "c": "a", "d": "bc"}.items():
        assert all(submitted[step] >= finished[d] for d in deps), (step, submitted, finished)
    # the store has the run and every step, each with its workload
    stored = PipelineStore(e.repo).run(run.id)
    assert stored is not None and stored.status == "succeeded"
    assert {s.step: (s.status, s.workload_id) for s in stored.steps} == {
        s: ("succeeded", f"{run.id}.{s}") for s in "abcd"
    }
    assert stored.artifacts == {"a.o": str(sim.runner.data_dir / "runs" / run.id / "a.out")}


def test_a_pipeline_step_is_scheduled_like_any_workload_and_preempts(sim: SimRig) -> None:
    e = sim.engine
    low = WorkloadSpec(id="batch-low", name="low", priority=10, estimated_duration=3600,
                       resources={"gpu": 1, "cpu": "2", "memory": "4Gi"})
    assert e.submit([low], actor="test").accepted
    sim.run_for(3)
    assert w_state(e, "batch-low") is State.RUNNING
    p = Pipeline("urgent-ft")
    p.step("finetune", ["ft"], workload={
        "priority": "urgent", "estimated_duration": "20s",
        "resources": {"gpu": 1, "cpu": "2", "memory": "4Gi"},
    })
    run = sim.runner.start(p.build())
    sim.until(lambda: w_state(e, f"{run.id}.finetune") is State.RUNNING)
    assert w_state(e, "batch-low") in (State.PREEMPTED, State.ADMITTED, State.STARTING)
    with e.lock:
        assert e.cp.workloads["batch-low"].preempted_by == f"{run.id}.finetune"
    sim.until(lambda: sim.runner.status(run.id) == "succeeded")


def test_quota_holds_a_step_back_until_room_is_made(sim: SimRig) -> None:
    # queue "small" holds one cpu: two one-cpu steps side by side, the second waits for
    # the first's quota (a step larger than the queue could ever hold is refused at once)
    p = Pipeline("quota", defaults={"queue": "small", "estimated_duration": "100s"})
    p.step("first", ["x"], workload={"resources": {"cpu": "1"}})
    p.step("second", ["x"], workload={"resources": {"cpu": "1"}})
    waits: list[str] = []
    sim.runner.listeners.append(
        lambda ev: waits.append(ev.data["reason"]) if ev.kind == "step.waiting" else None)
    run = sim.runner.start(p.build())
    sim.run_for(20)
    assert len(waits) == 1 and "quota" in waits[0]  # told once, in the scheduler's words
    rec = sim.runner.run(run.id)
    assert rec.status == "running"
    assert sorted(s.status for s in rec.steps) == ["running", "submitted"]
    with sim.engine.lock:
        waiting = [w for w in sim.engine.cp.workloads.values() if w.state is State.PENDING]
        assert len(waiting) == 1 and "quota" in waiting[0].pending_reason
    sim.until(lambda: sim.runner.status(run.id) == "succeeded")  # room was made


def test_refused_runs_store_and_submit_nothing(sim: SimRig, tmp_path: Path) -> None:
    p = Pipeline("bad-queue")
    p.step("a", ["x"], workload={"queue": "nope"})
    with pytest.raises(PipelineError, match=r"step 'a': queue 'nope' does not exist \(queues: default, small\)"):
        sim.runner.start(p.build())
    p2 = Pipeline("needs-input")
    p2.step("a", ["x", "${inputs.raw}"], inputs={"raw": "raw/data.csv"})
    with pytest.raises(PipelineError, match=r"step 'a': input 'raw': .*raw/data.csv does not exist"):
        sim.runner.start(p2.build())
    with pytest.raises(PipelineError, match="unknown parameter 'lr'"):
        sim.runner.start(p2.build(), {"lr": 1})
    assert PipelineStore(sim.engine.repo).runs() == []
    assert sim.engine.cp.workloads == {}
    ok = Pipeline("fine")
    ok.step("a", ["x"])
    first = sim.runner.start(ok.build(), run_id="fine-x")
    with pytest.raises(PipelineError, match="run id 'fine-x' is already taken"):
        sim.runner.start(ok.build(), run_id="fine-x")
    assert first.id == "fine-x"


def test_agent_runs_and_scaling_are_audited_proposals(sim: SimRig) -> None:
    e = sim.engine
    p = Pipeline("svc")
    p.step("serve", ["server", "--replica", "${replica}"], kind="service", replicas=2,
           workload={"resources": {"cpu": "500m"}, "estimated_duration": "10h"})
    run = sim.runner.start(p.build(), actor="supervisor:test", rationale="demand rose")
    sim.until(lambda: sim.runner.status(run.id) == "serving")
    assert sim.runner.live_replicas(run.id, "serve") == [f"{run.id}.serve.0", f"{run.id}.serve.1"]
    with e.lock:  # each replica got its own rendered command
        assert e.cp.workloads[f"{run.id}.serve.1"].spec.command == ("server", "--replica", "1")
    up = sim.runner.scale_service(run.id, "serve", 4, actor="supervisor:test",
                                  rationale="p95 over target")
    assert up.accepted and up.created == (f"{run.id}.serve.2", f"{run.id}.serve.3")
    down = sim.runner.scale_service(run.id, "serve", 1, actor="supervisor:test",
                                    rationale="load fell")
    assert down.accepted and sim.runner.replica_target(run.id, "serve") == 1
    sim.run_for(10)
    assert len(sim.runner.live_replicas(run.id, "serve")) == 1
    sim.run_for(1)
    proposals = [a.data() for a in e.audit.show(kind="proposal", limit=None)]
    whys = [pr["rationale"] for pr in proposals]
    assert "demand rose; start 2 replica(s) of service serve of svc-1" in whys
    assert "p95 over target" in whys and "load fell" in whys
    assert all(pr["accepted"] for pr in proposals)
    cancels = [a for pr in proposals for a in pr["actions"] if a["action"] == "Cancel"]
    assert len(cancels) == 3
    with pytest.raises(PipelineError, match=r"replicas must be within 0\.\.256"):
        sim.runner.scale_service(run.id, "serve", -1, actor="x", rationale="x")
    sim.runner.stop(run.id)
    sim.run_for(10)
    assert sim.runner.status(run.id) == "succeeded"
    assert sim.runner.run(run.id).steps[0].status == "stopped"


# ==================================================================== local
PY = sys.executable


def write_prog(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(body)
    return str(path)


def test_real_steps_pass_files_and_metrics(local: tuple[Engine, PipelineRunner],
                                           tmp_path: Path) -> None:
    engine, runner = local
    produce = write_prog(tmp_path, "produce", (
        "import json, sys\n"
        "open(sys.argv[1], 'w').write('x' * int(sys.argv[2]))\n"
        "json.dump({'bytes': int(sys.argv[2])}, open(sys.argv[3], 'w'))\n"
    ))
    consume = write_prog(tmp_path, "consume", (
        "import json, sys\n"
        "n = len(open(sys.argv[1]).read())\n"
        "open(sys.argv[2], 'w').write(str(n * 2))\n"
        "json.dump({'doubled': n * 2, 'note': 'ok'}, open(sys.argv[3], 'w'))\n"
    ))
    p = Pipeline("files", params={"n": 21}, defaults={"resources": {"cpu": "250m", "memory": "64Mi"}})
    a = p.step("produce", [PY, produce, "${outputs.data}", "${params.n}", "${metrics}"],
               outputs={"data": "data/raw.txt"})
    p.step("consume", [PY, consume, "${inputs.raw}", "${outputs.result}", "${metrics}"],
           inputs={"raw": a.output("data")}, outputs={"result": "result.txt"})
    run = runner.start(p.build())
    rec = runner.wait(run.id, timeout_s=60)
    assert rec.status == "succeeded", rec.to_dict()
    result = Path(rec.artifacts["consume.result"])
    assert result.read_text() == "42"
    assert rec.metrics == {"produce.bytes": 21, "consume.doubled": 42, "consume.note": "ok"}
    stored = PipelineStore(engine.repo).run(run.id)
    assert stored is not None and stored.metrics == rec.metrics and stored.status == "succeeded"


def test_a_failing_step_is_retried_by_the_control_plane(
    local: tuple[Engine, PipelineRunner], tmp_path: Path
) -> None:
    engine, runner = local
    flaky = write_prog(tmp_path, "flaky", (
        "import os, sys\n"
        "marker = sys.argv[1] + '.tried'\n"
        "if not os.path.exists(marker):\n"
        "    open(marker, 'w').close(); sys.exit(3)\n"
        "open(sys.argv[1], 'w').write('done')\n"
    ))
    p = Pipeline("flaky", defaults={"resources": {"cpu": "250m", "memory": "64Mi"}})
    p.step("try", [PY, flaky, "${outputs.out}"], outputs={"out": "out.txt"}, retries=2)
    run = runner.start(p.build())
    rec = runner.wait(run.id, timeout_s=60)
    assert rec.status == "succeeded" and rec.steps[0].attempts == 2
    with engine.lock:
        w = engine.cp.workloads[f"{run.id}.try"]
        assert [t.target.value for t in w.history].count("failed") == 1
        assert w.failures == 1


FAILURES = [
    ("exits non-zero, no retries", "import sys; sys.exit(4)",
     "failed 1 time(s) (retries: 0); last: exit 4 (error)"),
    ("exits 0 without its output", "pass",
     "exited 0 but did not write its declared output(s): out"),
]


@pytest.mark.parametrize(("case", "body", "error"), FAILURES, ids=[f[0] for f in FAILURES])
def test_a_failed_step_fails_the_run_and_skips_its_dependents(
    local: tuple[Engine, PipelineRunner], tmp_path: Path, case: str, body: str, error: str
) -> None:
    _, runner = local
    prog = write_prog(tmp_path, "bad", body + "\n")
    p = Pipeline("fails", defaults={"resources": {"cpu": "250m", "memory": "64Mi"}})
    bad = p.step("bad", [PY, prog, "${outputs.out}"], outputs={"out": "out.txt"})
    p.step("after", [PY, "-c", "pass", "${inputs.x}"], inputs={"x": bad.output("out")})
    run = runner.start(p.build())
    rec = runner.wait(run.id, timeout_s=60)
    steps = {s.step: s for s in rec.steps}
    assert rec.status == "failed"
    assert steps["bad"].status == "failed" and error in (steps["bad"].error or "")
    assert steps["after"].status == "skipped" and steps["after"].workload_id is None


def test_status_events_reach_listeners_in_order(local: tuple[Engine, PipelineRunner]) -> None:
    _, runner = local
    events: list[str] = []
    runner.listeners.append(lambda ev: events.append(f"{ev.kind}:{ev.step or ''}"))
    p = Pipeline("one", defaults={"resources": {"cpu": "250m", "memory": "64Mi"}})
    p.step("only", [PY, "-c", "import json,sys; json.dump({'v': 1}, open(sys.argv[1], 'w'))",
                    "${metrics}"])
    run = runner.start(p.build())
    runner.wait(run.id, timeout_s=60)
    assert events[0] == "run.started:" and events[-1] == "run.succeeded:"
    assert events.index("step.submitted:only") < events.index("step.succeeded:only")
    metrics = json.loads((runner.data_dir / "runs" / run.id / "steps" / "only" / "metrics.json")
                         .read_text())
    assert metrics == {"v": 1}


def test_a_new_runner_resumes_unfinished_runs_from_the_store(sim: SimRig) -> None:
    p = Pipeline("long", defaults={"estimated_duration": "10s"})
    p.step("a", ["a"])
    p.step("b", ["b"], depends_on=["a"])
    p.step("svc", ["s", "${replica}"], kind="service", replicas=2, depends_on=["b"],
           workload={"estimated_duration": "10h"})
    run = sim.runner.start(p.build(), actor="supervisor:x", rationale="nightly")
    sim.until(lambda: sim.runner.run(run.id).steps[0].status == "succeeded")
    # whatever drove the run goes away; a new runner on the same engine and store takes over
    fresh = PipelineRunner(sim.engine, sim.runner.data_dir, verify_outputs=False)
    sim.runner = fresh
    assert fresh.resume() == [run.id]
    assert fresh.resume() == []  # already followed
    sim.until(lambda: fresh.status(run.id) == "serving")
    rec = fresh.run(run.id)
    assert [s.status for s in rec.steps] == ["succeeded", "succeeded", "serving"]
    assert rec.actor == "supervisor:x" and rec.rationale == "nightly"
    assert fresh.scale_service(run.id, "svc", 3, actor="x", rationale="more").created == (
        f"{run.id}.svc.2",)  # replica numbering continues
    proposals = [a.data()["rationale"] for a in sim.engine.audit.show(kind="proposal", limit=None)]
    # the service (after b, which ran after the takeover) was submitted by the resumed runner
    assert "nightly; start 2 replica(s) of service svc of long-1" in proposals


def test_a_service_converges_to_its_target_through_retries_and_stops_for_good(
    sim: SimRig,
) -> None:
    e = sim.engine
    p = Pipeline("conv")
    p.step("svc", ["s"], kind="service", replicas=3,
           workload={"resources": {"cpu": "500m"}, "estimated_duration": "10h"})
    run = sim.runner.start(p.build())
    sim.until(lambda: sim.runner.status(run.id) == "serving")
    with e.lock:
        nodes = {a.node for w in sim.runner.live_replicas(run.id, "svc")
                 for a in e.cp.workloads[w].placement}
    backend = e.backend
    assert isinstance(backend, LiveSimBackend)
    for n in nodes:  # every replica's node fails: they wait for their retry, uncancellable
        backend.fail_node(n, down_for=30.0)
    sim.run_for(0.1, step=0.1)
    with e.lock:
        states = {e.cp.workloads[w].state for w in sim.runner.live_replicas(run.id, "svc")}
    assert states == {State.FAILED}
    down = sim.runner.scale_service(run.id, "svc", 1, actor="t", rationale="less")
    assert down.accepted  # recorded; nothing could be cancelled yet
    sim.until(lambda: len(sim.runner.live_replicas(run.id, "svc")) == 1, limit_s=120)
    sim.run_for(5)
    assert len(sim.runner.live_replicas(run.id, "svc")) == 1
    converged = [a.data() for a in e.audit.show(kind="proposal", limit=None)
                 if a.actor == f"pipeline:{run.id}"]
    assert converged and all(pr["accepted"] for pr in converged)
    assert "to its target of 1 replica(s)" in converged[0]["rationale"]

    for n in nodes | {"gpu-0", "cpu-0"}:
        backend.fail_node(n, down_for=5.0)
    sim.run_for(0.1, step=0.1)
    sim.runner.stop(run.id)  # its replica waits for a retry: it must not come back later
    sim.run_for(60)
    assert sim.runner.live_replicas(run.id, "svc") == []
    assert sim.runner.status(run.id) == "succeeded"


def test_a_stopped_run_cancels_a_step_that_was_waiting_for_its_retry(sim: SimRig) -> None:
    e = sim.engine
    p = Pipeline("stopme", defaults={"estimated_duration": "1h"})
    p.step("long", ["x"])
    p.step("after", ["y"], depends_on=["long"])
    run = sim.runner.start(p.build())
    sim.until(lambda: sim.runner.run(run.id).steps[0].status == "running")
    with e.lock:
        node = e.cp.workloads[f"{run.id}.long"].placement[0].node
    backend = e.backend
    assert isinstance(backend, LiveSimBackend)
    backend.fail_node(node, down_for=5.0)
    sim.run_for(0.1, step=0.1)
    assert w_state(e, f"{run.id}.long") is State.FAILED  # waits for its retry
    sim.runner.stop(run.id, reason="not needed")
    sim.run_for(60)
    assert w_state(e, f"{run.id}.long") is State.CANCELLED
    rec = sim.runner.run(run.id)
    assert rec.status == "cancelled"
    assert [s.status for s in rec.steps] == ["cancelled", "cancelled"]
