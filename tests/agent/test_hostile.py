"""A hostile proposer: >= 100,000 proposals, none invalid accepted, invariants hold.

Proposals come the two ways an agent (rules or LLM) can send them: as JSON
descriptions through the agent's codec (what an LLM's ``propose`` tool gets),
and as typed actions straight to ``ControlPlane.apply`` (what a buggy
strategy could build). They are hand-written hallucinations (resume a
finished workload, more VRAM or memory than any node has, preempt a higher
priority, a GPU job on a CPU node, unknown ids, negative sizes, stale
versions, replayed proposals) and random fuzz. Every hand-written one must be
rejected with a reason and leave the state digest unchanged; a random one
that is accepted is checked against the rules by an independent judge
written here; the full invariant sweep runs every 2,000 proposals and at
the end. A fresh cluster is built every 10,000 proposals so that accepted
random actions do not drain the interesting states.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from mlwe.agent.codec import ActionError, action_from_dict
from mlwe.agent.whatif import state_digest
from mlwe.core import (
    Action,
    Cancel,
    ControlPlane,
    DecisionRecord,
    Evict,
    Exited,
    NodeStatus,
    Place,
    Preempt,
    Progress,
    ReplicaAlloc,
    ReplicaResources,
    Resources,
    Retry,
    SetNodeStatus,
    SetPriority,
    SetResources,
    State,
    Submit,
    WorkloadSpec,
)
from mlwe.core.controlplane import ApplyResult
from mlwe.core.lifecycle import QUEUED
from tests.core.builders import (
    A100,
    T4,
    cpu_node,
    gpu_node,
    job,
    ok,
    place_on,
    run_to_running,
    submit,
)

N_PROPOSALS = 100_000
WORLD_EVERY = 10_000
SWEEP_EVERY = 2_000


def build_world() -> ControlPlane:
    from mlwe.core import ClusterSpec, ManualClock, build_control_plane

    counted: list[int] = [0]

    def sink(_: DecisionRecord) -> None:  # count, do not keep 100k records
        counted[0] += 1

    clock = ManualClock(1000.0)
    spec = ClusterSpec(nodes=(gpu_node("a0"), gpu_node("a1"), gpu_node("t0", T4, 4),
                              cpu_node("c0")))
    cp = build_control_plane(spec, clock, decision_sink=sink)
    submit(cp,
           job("run-low", gpu=4, models=[A100], priority="low"),
           job("run-high", gpu=4, models=[A100], priority="high"),
           job("run-prot", gpu=2, models=[T4], priority="low", protected=True),
           job("run-cpu", cpu=16, memory="64Gi", priority="batch"),
           job("done", gpu=1, models=[A100]),
           job("gone", gpu=1, models=[A100]),
           job("broke", gpu=1, models=[A100], max_retries=0),
           job("wait-gpu", gpu=8, models=[A100], priority="batch"),
           job("wait-cpu", cpu=8, memory="16Gi", priority="batch"),
           job("wait-top", gpu=4, models=[A100], priority="urgent"))
    for wid, node in [("run-low", "a0"), ("run-high", "a1"), ("run-prot", "t0"),
                      ("run-cpu", "c0"), ("done", "a0"), ("broke", "a0")]:
        ok(cp.apply([place_on(cp, wid, node)]))
    run_to_running(cp, ["run-low", "run-high", "run-prot", "run-cpu", "done", "broke"])
    ok(cp.apply([Exited("done", cp.get("done").attempt, 0)]))
    ok(cp.apply([Exited("broke", cp.get("broke").attempt, 1, "error")]))
    ok(cp.apply([Cancel("gone")]))
    clock.advance(600)
    assert cp.validate_state() == []
    return cp


# ============================================================ hand-written
def _ids(cp: ControlPlane, pred: Callable[[Any], bool]) -> list[str]:
    return [w.id for w in cp.workloads.values() if pred(w)]


def hallucinations(cp: ControlPlane, rng: random.Random) -> list[tuple[str, Any]]:
    """(label, proposal) pairs that are invalid whatever the state is now.

    A proposal is a list of typed actions, or a list of dicts (through the codec).
    """
    finished = _ids(cp, lambda w: w.state in (State.SUCCEEDED, State.CANCELLED))
    holding = _ids(cp, lambda w: w.state in (State.ADMITTED, State.STARTING, State.RUNNING))
    queued_gpu = _ids(cp, lambda w: w.state in QUEUED and w.spec.resources.gpu and not w.victims)
    out: list[tuple[str, Any]] = []
    for wid in finished:
        out += [
            ("resume a finished workload", [Retry(wid)]),
            ("evict a finished workload", [Evict(wid, "x")]),
            ("reprioritise a finished workload", [SetPriority(wid, 60)]),
            ("resize a finished workload", [SetResources(wid, ReplicaResources(cpu=1000, memory=1024))]),
            ("resume a finished workload (json)", [{"kind": "retry", "workload": wid}]),
        ]
    for wid in queued_gpu:
        w = cp.get(wid)
        out += [
            ("more VRAM than any GPU has",
             [SetResources(wid, ReplicaResources.model_validate(
                 {"gpu": f"{w.spec.resources.gpu}m", "vram": "4000Gi", "memory": "8Gi"}))]),
            ("more memory than any node has",
             [{"kind": "set-resources", "workload": wid,
               "resources": {"gpu": w.spec.resources.gpu // 1000, "memory": "64Ti"}}]),
            ("more GPUs per replica than any node has",
             [{"kind": "set-resources", "workload": wid, "resources": {"gpu": 16}}]),
            ("place a GPU job on a CPU node",
             [Place(wid, tuple(ReplicaAlloc("c0", (), 0, Resources(w.spec.resources.gpu, 0,
                                                                   w.spec.resources.cpu,
                                                                   w.spec.resources.memory))
                               for _ in range(w.spec.replicas)))]),
            ("place with more VRAM than the node has",
             [Place(wid, (ReplicaAlloc("a0", tuple(range(8)), 1000,
                                       Resources(8000, 10**7, 8000, 65536)),))]),
            ("negative sizes in a placement",
             [Place(wid, (ReplicaAlloc("a1", (0,), 1000, Resources(1000, -5, -8000, 1024)),))]),
            ("place on an unknown node",
             [Place(wid, (ReplicaAlloc(f"ghost-{rng.randrange(99)}", (0,), 1000,
                                       Resources(1000, 81920, 8000, 65536)),))]),
        ]
    # preempt a workload of higher or equal priority
    for v in holding:
        for p in _ids(cp, lambda w: w.state in QUEUED):
            if cp.get(p).priority <= cp.get(v).priority:
                out.append(("preempt a higher (or equal) priority", [Preempt(v, p)]))
                out.append(("preempt a higher priority (json)",
                            [{"kind": "preempt", "victim": v, "preemptor": p}]))
    # protected victims are never preempted, whatever the priority
    if "run-prot" in holding:
        out.append(("preempt a protected workload", [Preempt("run-prot", "wait-top")]))
        if all(cp.capacity.status(a.node) is NodeStatus.READY for a in cp.get("run-prot").placement):
            out.append(("evict a protected workload on a ready node", [Evict("run-prot", "x")]))
    ghost = f"ghost-{rng.randrange(10**6)}"
    out += [
        ("unknown workload", [Cancel(ghost)]),
        ("unknown workload (evict)", [Evict(ghost)]),
        ("unknown preemptor", [Preempt(holding[0] if holding else ghost, ghost)]),
        ("unknown node", [SetNodeStatus(ghost, NodeStatus.CORDONED)]),
        ("unknown workload (json)", [{"kind": "set-priority", "workload": ghost, "priority": 5}]),
        ("negative priority", [SetPriority(holding[0] if holding else ghost, -5)]),
        ("priority not an integer (json)",
         [{"kind": "set-priority", "workload": holding[0] if holding else ghost, "priority": 1.5}]),
        ("priority is a bool (json)",
         [{"kind": "set-priority", "workload": ghost, "priority": True}]),
        ("negative progress", [Progress(holding[0] if holding else ghost, 1, -0.5)]),
        ("NaN progress", [Progress(holding[0] if holding else ghost, 1, math.nan)]),
        ("negative memory (json)",
         [{"kind": "set-resources", "workload": ghost, "resources": {"memory": "-1Gi"}}]),
        ("a fact is not an agent's to report (json)",
         [{"kind": "exited", "workload": ghost, "attempt": 1, "exit_code": 0}]),
        ("a placement is not an agent's to make (json)", [{"kind": "place", "workload": ghost}]),
        ("unknown field (json)", [{"kind": "cancel", "workload": ghost, "force": True}]),
        ("not an object (json)", ["cancel everything"]),
        ("missing field (json)", [{"kind": "evict"}]),
        ("not an action at all", [None]),
        ("a dict sent as a typed action", [{"kind": "cancel"}]),
        ("duplicate workload id", [Submit(job("run-low", gpu=1))]),
        ("unvalidated spec", [Submit(WorkloadSpec.model_construct(name="x", queue="nope"))]),
        ("unvalidated resources",
         [SetResources(ghost, ReplicaResources.model_construct(gpu=-1000, cpu=-1, memory=-1))]),
        ("a valid action next to an invalid one is not half-applied",
         [SetPriority("wait-cpu", 33), Cancel(ghost)]),
    ]
    return out


# ================================================================== fuzz
_KINDS = ["preempt", "evict", "cancel", "retry", "set-priority", "set-resources",
          "set-node-status", "place", "exited", "submit", "set-queue", "bogus"]


def _value(rng: random.Random, ids: list[str]) -> Any:
    r = rng.random()
    if r < 0.5:
        return rng.choice(ids)
    return rng.choice([None, -1, 0, 10**12, 1.5, math.nan, True, "", "x" * 2000, [], {}, "ghost"])


def fuzz(cp: ControlPlane, rng: random.Random) -> list[Any]:
    ids = list(cp.workloads) + cp.capacity.node_names()
    out: list[Any] = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(_KINDS)
        d: dict[str, Any] = {"kind": kind}
        for field in ("workload", "victim", "preemptor", "node", "priority", "status",
                      "resources", "reason", "spec"):
            if rng.random() < 0.5:
                d[field] = _value(rng, ids)
        if kind == "set-priority" and rng.random() < 0.5:
            d = {"kind": kind, "workload": rng.choice(ids), "priority": rng.randrange(-10, 2000)}
        if kind == "set-resources" and rng.random() < 0.5:
            d = {"kind": kind, "workload": rng.choice(ids),
                 "resources": {"gpu": rng.choice([0, 1, 2, 4, 8, 16, 0.5]),
                               "memory": rng.choice(["1Gi", "64Gi", "900Gi", "2Ti"])}}
        if kind in ("preempt", "evict", "cancel", "retry") and rng.random() < 0.5:
            d = {"kind": kind, "workload": rng.choice(ids), "victim": rng.choice(ids),
                 "preemptor": rng.choice(ids)}
            d = {k: v for k, v in d.items()
                 if k == "kind" or (k == "workload") != (kind == "preempt")}
        if kind == "set-node-status" and rng.random() < 0.5:
            d = {"kind": kind, "node": rng.choice(cp.capacity.node_names()),
                 "status": rng.choice(["ready", "cordoned", "down", "melted"])}
        out.append(d)
    return out


# ================================================================== judge
def judge(before: dict[str, tuple[State, int, bool]], cp: ControlPlane, a: Action) -> str | None:
    """Why an ACCEPTED action should not have been (None: it was valid), from the state
    before the batch (state, priority, protected per workload) and the rules."""
    def st(wid: str) -> State | None:
        return before[wid][0] if wid in before else None

    if isinstance(a, Preempt):
        if st(a.victim) not in (State.ADMITTED, State.STARTING, State.RUNNING):
            return "victim was not running"
        if st(a.preemptor) not in QUEUED:
            return "preemptor was not waiting"
        if before[a.victim][2]:
            return "victim was protected"
        if before[a.preemptor][1] <= before[a.victim][1]:
            return "preemptor's priority was not strictly higher"
    elif isinstance(a, Evict):
        if st(a.workload) not in (State.ADMITTED, State.STARTING, State.RUNNING):
            return "evicted a workload that held nothing"
    elif isinstance(a, Retry):
        if st(a.workload) is not State.FAILED:
            return "retried a workload that had not failed"
    elif isinstance(a, Cancel):
        if st(a.workload) in (None, State.SUCCEEDED, State.CANCELLED, State.FAILED, State.STOPPING):
            return "cancelled a workload that cannot be cancelled"
    elif isinstance(a, SetPriority):
        if st(a.workload) in (None, State.SUCCEEDED, State.CANCELLED):
            return "reprioritised a finished or unknown workload"
        if isinstance(a.priority, bool) or not isinstance(a.priority, int) or not 0 <= a.priority <= 10**6:
            return "priority out of range"
    elif isinstance(a, SetResources):
        if st(a.workload) not in (State.PENDING, State.PREEMPTED, State.FAILED):
            return "resized a workload that was not waiting or failed"
        r = cp.get(a.workload).spec.resources
        fits = any(
            i.capacity.cpu >= r.cpu and i.capacity.ram >= r.memory
            and (not r.gpu or (i.gpu_model is not None and i.gpu_count * 1000 >= r.gpu))
            for i in cp.capacity.nodes()
        )
        if not fits:
            return "resized beyond every node"
    elif isinstance(a, Place):
        return "an agent proposal placed a workload"
    elif isinstance(a, Exited):
        return "an agent proposal reported a backend fact"
    return None


def _assert_reasons(result: ApplyResult, label: str) -> None:
    assert result.rejections, f"{label}: rejected without rejections"
    for r in result.rejections:
        assert r.reasons and all(isinstance(x, str) and x.strip() for x in r.reasons), (label, r)


def test_hostile_proposer_gets_nothing_invalid_through() -> None:
    rng = random.Random(20240611)
    stats: dict[str, int] = {"proposals": 0, "rejected": 0, "accepted": 0, "replayed": 0,
                             "codec_rejected": 0, "stale": 0}
    by_label: dict[str, int] = {}
    cp = build_world()
    hand, hand_version = hallucinations(cp, rng), cp.version
    accepted_ids: list[tuple[str, list[Action]]] = []
    while stats["proposals"] < N_PROPOSALS:
        n = stats["proposals"]
        if n and n % WORLD_EVERY == 0:
            assert cp.validate_state() == []
            cp = build_world()
            accepted_ids.clear()
        if n % 50 == 0 or hand_version != cp.version:
            # hand-written ones are invalid for the state they were written against
            hand, hand_version = hallucinations(cp, rng), cp.version
        if n and n % SWEEP_EVERY == 0:
            assert cp.validate_state() == []
        stats["proposals"] += 1
        roll = rng.random()
        event_id: str | None = None
        expected: int | None = cp.version
        must_reject = True
        if roll < 0.45:
            label, proposal = rng.choice(hand)
        elif roll < 0.55:
            label = "stale version"
            proposal = [SetPriority("wait-cpu", rng.randrange(1, 100))]
            expected = cp.version - rng.randint(1, 5) if cp.version > 5 else cp.version + 3
            stats["stale"] += 1
        elif roll < 0.60 and accepted_ids:
            label = "replayed proposal"
            event_id, proposal = rng.choice(accepted_ids)
            expected = None
        else:
            label, proposal, must_reject = "random", fuzz(cp, rng), False
        by_label[label] = by_label.get(label, 0) + 1
        digest = state_digest(cp) if must_reject and rng.random() < 0.02 else None
        # through the codec when described as JSON (what an LLM tool call carries)
        actions: list[Any] = []
        codec_error = None
        for p in proposal:
            if (isinstance(p, dict) and label != "a dict sent as a typed action") or isinstance(p, str):
                try:
                    actions.append(action_from_dict(p))
                except ActionError as exc:
                    codec_error = str(exc)
                    break
            else:
                actions.append(p)
        if codec_error is not None:
            assert codec_error.strip()
            stats["codec_rejected"] += 1
            continue
        before = {w.id: (w.state, w.priority, w.spec.protected) for w in cp.workloads.values()}
        if label == "replayed proposal":
            d0 = state_digest(cp)
            result = cp.apply(actions, expected, cause_id="hostile", event_id=event_id)
            assert result.duplicate and state_digest(cp) == d0, "a replay had an effect"
            stats["replayed"] += 1
            continue
        if not actions:
            continue
        eid = f"hostile-{n}"
        result = cp.apply(actions, expected, cause_id="hostile", event_id=eid)
        if must_reject:
            assert not result.accepted, f"{label} was accepted: {proposal}"
            _assert_reasons(result, label)
            if digest is not None:
                assert state_digest(cp) == digest, f"{label} changed state though rejected"
            stats["rejected"] += 1
        elif result.accepted:
            stats["accepted"] += 1
            for a in actions:
                problem = judge(before, cp, a)
                assert problem is None, f"accepted an invalid action {a}: {problem}"
            accepted_ids.append((eid, actions))
            del accepted_ids[:-100]
        else:
            _assert_reasons(result, label)
            stats["rejected"] += 1
    assert cp.validate_state() == []
    assert stats["proposals"] >= N_PROPOSALS
    assert stats["replayed"] > 1000 and stats["stale"] > 5000 and stats["codec_rejected"] > 5000
    # every hand-written kind of hallucination was tried many times
    for label in ("resume a finished workload", "more VRAM than any GPU has",
                  "preempt a higher (or equal) priority", "place a GPU job on a CPU node",
                  "unknown workload", "negative sizes in a placement", "stale version",
                  "replayed proposal"):
        assert by_label.get(label, 0) > 100, (label, by_label.get(label))
    print("hostile proposer:", stats)
