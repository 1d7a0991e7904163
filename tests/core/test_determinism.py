"""Determinism: the same inputs give the same decisions, byte for byte, whatever the
process's string-hash seed; and a dry run (planning without applying) changes nothing."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from mlwe.core import (
    Cancel,
    ControlPlane,
    Exited,
    NodePool,
    NodeStatus,
    Preempt,
    Progress,
    Released,
    Retry,
    Scheduler,
    SetNodeStatus,
    Started,
    Workload,
)
from tests.core.builders import (
    A100,
    T4,
    cluster,
    gpu_node,
    job,
    ok,
    queue,
    run_to_running,
    running_on,
    submit,
)

ROOT = Path(__file__).resolve().parents[2]


def state_digest(cp: ControlPlane) -> str:
    """A digest of everything the control plane holds, indexes included."""
    cap = cp.capacity
    nodes = cap.node_names()
    state = (
        cp.version,
        [
            (wid, [(f.name, getattr(w, f.name)) for f in dataclasses.fields(Workload)])
            for wid, w in cp.workloads.items()
        ],
        [(n, cap.free(n), cap.free_devices(n), cap.status(n)) for n in nodes],
        # the search indexes a policy walks (private, but part of the state a dry run must keep)
        list(cap._key.items()),
        [(k, list(b)) for k, b in cap._buckets.items()],
        [(k, list(b)) for k, b in cap._partial.items()],
        [(name, list(q.usage), q.spec) for name, q in cp.queues.items()],
        list(cp.queued),
        [(n, list(ids)) for n, ids in cp.on_node.items()],
        [d.to_json() for d in cp.decisions],
        sorted(cp.counters.items()),
    )
    return hashlib.sha256(repr(state).encode()).hexdigest()


def scenario() -> str:
    """A scripted day: submissions, cycles, facts, a preemption, a failure and retry.

    Returns the decision log (one canonical JSON line per record) and a final state digest.
    """
    cp, clock = cluster(
        NodePool(prefix="a100", count=2, gpu_model=A100, gpus=8, cpu=64, memory="512Gi"),
        NodePool(prefix="t4", count=2, gpu_model=T4, gpus=4, cpu=32, memory="128Gi"),
        NodePool(prefix="cpu", count=2, cpu=96, memory="1Ti"),
        queues=(queue("vision", cohort="research", gpu=8), queue("nlp", cohort="research", gpu=8)),
    )
    s = Scheduler()
    batch = dict(priority="batch", estimated_duration="4h", checkpoint_interval="30m")
    submit(
        cp,
        *(job(f"emb-{i}", gpu=4, models=[A100], queue="nlp", **batch) for i in range(3)),
        job("etl-zeta", cpu=32, memory="256Gi", priority="low", estimated_duration="2h"),
        job("etl-alpha", cpu=32, memory="256Gi", priority="low"),
        job("frac-a", gpu=0.5, models=[T4], cpu=2, memory="8Gi", estimated_duration="1h"),
        job("frac-b", gpu=0.25, models=[T4], cpu=2, memory="8Gi", estimated_duration="1h"),
        job("train", gpu=4, models=[A100], replicas=2, queue="vision", estimated_duration="6h",
            deadline_in="12h"),
    )
    ok(s.run_cycle(cp, cause_id="cycle-1"))
    admitted = [w.id for w in cp.workloads.values() if w.state == "admitted"]
    run_to_running(cp, admitted)

    clock.advance(1800)
    ok(cp.apply([Progress("emb-0", 1, 0.2, checkpointed=True)], event_id="tel-1"))
    ok(cp.apply([Progress("emb-0", 1, 0.2, checkpointed=True)], event_id="tel-1"))  # redelivered
    ok(cp.apply([Exited("frac-b", 1, 0)], cause_id="backend"))
    ok(cp.apply([Exited("etl-alpha", 1, 1, "oom")], cause_id="backend"))
    ok(cp.apply([Retry("etl-alpha")]))
    cp.apply([Preempt("etl-zeta", "etl-alpha")])  # rejected: equal priority (audited)
    ok(cp.apply([Started("frac-b", 0)]))  # stale: ignored

    clock.advance(2400)
    submit(
        cp,
        job("ft", gpu=8, models=[A100], priority="urgent", kind="fine-tune",
            estimated_duration="2h", deadline_in="3h"),
    )
    ft = cp.get("ft")
    verdict = s.admission(cp, ft)
    ok(s.run_cycle(cp, cause_id="cycle-2"))
    victims = [w.id for w in cp.workloads.values() if w.state == "preempting"]
    assert victims, "the scenario must exercise a preemption"

    clock.advance(30)
    for v in victims:
        ok(cp.apply([Released(v, cp.get(v).attempt, 0.2)], cause_id="backend"))
    ok(s.run_cycle(cp, cause_id="cycle-3"))
    run_to_running(cp, [w.id for w in cp.workloads.values() if w.state == "admitted"])

    clock.advance(600)
    ok(cp.apply([SetNodeStatus("t4-1", NodeStatus.CORDONED, "maintenance")]))
    ok(cp.apply([Cancel("frac-a")]))
    ok(cp.apply([Released("frac-a", 1)]))
    ok(s.run_cycle(cp, cause_id="cycle-4"))
    assert cp.validate_state() == []

    lines = [d.to_json() for d in cp.decisions]
    lines.append(f"admission {verdict.status.value} {verdict.reason}")
    lines.append(f"state {state_digest(cp)}")
    return "\n".join(lines) + "\n"


def test_same_script_twice_gives_byte_identical_decisions() -> None:
    first, second = scenario(), scenario()
    assert first == second
    kinds = {line.split('"kind":"')[1].split('"')[0] for line in first.splitlines()[:-2]}
    assert {"place", "preempt", "reject", "unschedulable"} <= kinds  # the script is not trivial


def _scenario_in_subprocess(hash_seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
    code = (
        "import sys; from tests.core.test_determinism import scenario;"
        " sys.stdout.write(scenario())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_string_hash_seed_does_not_change_decisions() -> None:
    here = scenario()
    assert _scenario_in_subprocess("1") == here
    assert _scenario_in_subprocess("4242") == here


# ------------------------------------------------------------------ dry run
def _busy_cluster() -> tuple[ControlPlane, Scheduler]:
    cp, clock = cluster(gpu_node("a100-0"), gpu_node("a100-1"), gpu_node("t4-0", T4, 4))
    running_on(cp, job("emb", gpu=8, models=[A100], priority="batch"), "a100-0")
    running_on(cp, job("r1", gpu=4, models=[A100], estimated_duration="1h"), "a100-1")
    clock.advance(900)
    submit(
        cp,
        job("ft", gpu=8, models=[A100], priority="urgent", estimated_duration="2h",
            deadline_in="3h"),
        job("head", gpu=8, models=[A100], priority="batch", estimated_duration="1h"),
        job("small", gpu=0.5, models=[T4], cpu=2, memory="8Gi", estimated_duration="10m",
            priority="low"),
    )
    return cp, Scheduler()


def test_dry_run_leaves_the_state_untouched() -> None:
    cp, s = _busy_cluster()
    before = state_digest(cp)

    plan = s.plan(cp)
    verdict = s.admission(cp, cp.get("ft"))

    # the plan did real what-if work: a placement, a preemption and a backfill reservation
    assert [a.kind for a in plan.actions] == ["preempt", "place"]
    assert plan.reservation is not None and plan.reservation.workload == "head"
    assert verdict.status == "feasible"
    assert state_digest(cp) == before
    assert cp.validate_state() == []

    # and the digest does see a change when the plan is applied
    ok(cp.apply(plan.actions, plan.version, decisions=plan.decisions))
    assert state_digest(cp) != before


def test_planning_twice_gives_the_same_plan() -> None:
    cp, s = _busy_cluster()
    first, second = s.plan(cp), s.plan(cp)  # the first plan is a dry run for the second
    assert first.actions == second.actions
    assert [d.to_json() for d in first.decisions] == [d.to_json() for d in second.decisions]
    assert first.pending == second.pending
