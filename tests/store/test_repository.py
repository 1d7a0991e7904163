"""Round trips of every record the repository stores, on SQLite and on PostgreSQL."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select, update

from mlwe.core import (
    DecisionRecord,
    NodeStatus,
    QueueSpec,
    ReplicaAlloc,
    Resources,
    State,
    Transition,
    Workload,
)
from mlwe.store import schema as S
from mlwe.store.repository import (
    CorruptRecord,
    Repository,
    StoreError,
    TelemetrySample,
    canonical_json,
    placement_from_json,
    placement_to_json,
)
from tests.core.builders import A100, T4, cpu_node, gpu_node, job

S_ = State


def rich_workload(wid: str = "ft-1", seq: int = 1) -> Workload:
    """A workload with every field set to something other than its default."""
    spec = job(
        wid,
        gpu=2,
        models=[A100],
        priority="high",
        replicas=2,
        estimated_duration="2h",
        checkpoint_interval="10m",
        deadline_in="6h",
        labels={"team": "nlp"},
        node_selector={"zone": "a"},
    )
    alloc = ReplicaAlloc("n1", (0, 1), 1000, Resources(2000, 163840, 8000, 65536))
    alloc2 = ReplicaAlloc("n2", (3, 4), 1000, Resources(2000, 163840, 8000, 65536))
    history = [
        Transition(10.0, None, S_.PENDING, "submitted", "req-1"),
        Transition(11.5, S_.PENDING, S_.ADMITTED, "placed", "cycle-1"),
        Transition(12.0, S_.ADMITTED, S_.STARTING, "start sent to backend", None),
        Transition(13.25, S_.STARTING, S_.RUNNING, "backend reports running", "ev-9"),
        Transition(99.0, S_.RUNNING, S_.PREEMPTING, "preempted by urgent (priority)", "cycle-7"),
    ]
    return Workload(
        id=wid,
        spec=spec,
        seq=seq,
        submit_time=10.0,
        deadline=21610.0,
        state=S_.PREEMPTING,
        history=history,
        placement=(alloc, alloc2),
        attempt=2,
        failures=1,
        started_at=13.25,
        work_done=600.0,
        run_base_work=300.0,
        progress=0.125,
        last_checkpoint_at=80.5,
        preempted_by="urgent",
        victims=("v1", "v2"),
        preemptions=3,
        borrowing=True,
        pending_reason="",
        exit_code=None,
        failure_cause="oom",
        priority_override=77,
    )


def pending_workload(wid: str, seq: int) -> Workload:
    spec = job(wid, cpu=2, memory="4Gi")
    return Workload(
        id=wid,
        spec=spec,
        seq=seq,
        submit_time=float(seq),
        deadline=None,
        history=[Transition(float(seq), None, S_.PENDING, "submitted", f"req-{seq}")],
        pending_reason="no node has 2 cpu free",
    )


# ===================================================================== cluster
def test_cluster_round_trip_keeps_order_and_status(repo: Repository) -> None:
    nodes = [
        gpu_node("zeta", A100, labels={"zone": "a"}),
        gpu_node("alpha", T4, gpus=4, status=NodeStatus.CORDONED),
        cpu_node("mid"),
    ]
    queues = [QueueSpec(name="team-b", cohort="c", nominal={"gpu": 8}), QueueSpec(name="team-a")]
    repo.save_cluster(nodes, queues)
    assert repo.load_nodes() == [(n, n.status) for n in nodes]  # added order, not name order
    assert repo.load_queues() == sorted(queues, key=lambda q: q.name)

    repo.upsert_node(gpu_node("late", T4, gpus=2))
    repo.set_node_status("zeta", NodeStatus.DOWN)
    loaded = repo.load_nodes()
    assert [n.name for n, _ in loaded] == ["zeta", "alpha", "mid", "late"]
    assert loaded[0][1] is NodeStatus.DOWN
    repo.upsert_node(gpu_node("alpha", T4, gpus=8))  # replaced in place, keeps its position
    assert [(n.name, n.gpus) for n, _ in repo.load_nodes()][1] == ("alpha", 8)

    repo.put_queue(QueueSpec(name="team-a", nominal={"gpu": 2}))
    assert {q.name: q for q in repo.load_queues()}["team-a"].nominal_vector().gpu == 2000


def test_status_of_an_unknown_node_is_refused(repo: Repository) -> None:
    with pytest.raises(StoreError, match=r"node 'ghost'.*not stored"):
        repo.set_node_status("ghost", NodeStatus.DOWN)


# =================================================================== workloads
def test_workload_round_trip_is_exact(repo: Repository) -> None:
    w = rich_workload()
    p = pending_workload("p-1", 2)
    repo.insert_workloads([w, p], version=5)
    assert repo.load_workloads() == [w, p]
    assert repo.workload("ft-1") == w
    assert repo.workload("missing") is None
    assert repo.history("ft-1") == w.history
    assert repo.workload_correlation("ft-1") == "req-1"  # the submission's cause by default
    assert repo.load_workloads(states=[State.PENDING]) == [p]
    assert repo.count_workloads() == 2
    assert repo.max_version() == 5


def test_insert_is_idempotent_and_takes_an_explicit_correlation_id(repo: Repository) -> None:
    w = pending_workload("p-1", 1)
    repo.insert_workloads([w], "corr-7")
    repo.insert_workloads([w], "corr-7")  # a batch retried after an uncertain commit
    assert repo.load_workloads() == [w]
    assert repo.workload_correlation("p-1") == "corr-7"


def test_state_updates_and_transitions(repo: Repository) -> None:
    w = pending_workload("p-1", 1)
    repo.insert_workloads([w])
    alloc = ReplicaAlloc("c1", (), 0, Resources(0, 0, 2000, 4096))
    placed = Transition(5.0, S_.PENDING, S_.ADMITTED, "placed", "cycle-2")
    w.history.append(placed)
    w.state, w.placement, w.attempt, w.pending_reason = S_.ADMITTED, (alloc,), 1, ""
    repo.save_workload_states([w], version=9)
    repo.append_transitions([("p-1", 1, placed)])
    repo.append_transitions([("p-1", 1, placed)])  # the same step again: stored once
    assert repo.workload("p-1") == w
    assert repo.max_version() == 9


def test_transitions_without_step_go_after_the_stored_ones_once(repo: Repository) -> None:
    w = pending_workload("p-1", 1)
    placed = Transition(5.0, S_.PENDING, S_.ADMITTED, "placed", "cycle-2")
    started = Transition(6.0, S_.ADMITTED, S_.STARTING, "start sent to backend")
    w.history += [placed, started]
    w.state = S_.STARTING
    with repo.transaction() as c:
        # how a caller that writes new workloads whole and then appends the batch's
        # transitions (without steps) uses it: the overlap is recognised
        repo.insert_workloads([w], conn=c)
        repo.append_transitions([("p-1", tr) for tr in w.history], conn=c)
    assert repo.history("p-1") == w.history
    running = Transition(7.0, S_.STARTING, S_.RUNNING, "backend reports running")
    repo.append_transitions([("p-1", running)])
    assert repo.history("p-1") == [*w.history, running]


def test_saving_the_state_of_an_unstored_workload_stores_it(repo: Repository) -> None:
    w = pending_workload("p-1", 1)
    repo.save_workload_states([w], version=3)
    got = repo.workload("p-1")
    assert got is not None and got.state is State.PENDING and got.history == []


def test_json_columns_are_canonical(repo: Repository) -> None:
    w = rich_workload()
    repo.insert_workloads([w])
    with repo.engine.connect() as c:
        spec, placement = c.execute(
            select(S.workloads.c.spec, S.workloads.c.placement).where(S.workloads.c.id == "ft-1")
        ).one()
    assert spec == canonical_json(json.loads(spec))
    assert placement == placement_to_json(w.placement)
    assert placement_from_json(placement) == w.placement


def test_a_spec_from_a_template_is_still_validated(repo: Repository) -> None:
    """Specs that differ only in id and name share one validation; a bad name is still caught."""
    a, b = pending_workload("p-1", 1), pending_workload("p-2", 2)
    repo.insert_workloads([a, b])
    assert repo.load_workloads() == [a, b]
    with repo.transaction() as c:
        text = c.execute(select(S.workloads.c.spec).where(S.workloads.c.id == "p-2")).scalar_one()
        bad = text.replace('"name":"p-2"', '"name":"bad\\u0007name"')
        assert bad != text
        c.execute(update(S.workloads).where(S.workloads.c.id == "p-2").values(spec=bad))
    with pytest.raises(CorruptRecord, match=r"workload 'p-2': column spec:.*control characters"):
        repo.load_workloads()


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("placement", '[{"node":"n1","devices":[0],"gpu_per_device":1000,"res":{"gpu":"x"}}]', "not an integer"),
        ("placement", "{oops", "column placement"),
        ("state", "exploded", "unknown state 'exploded'"),
        ("spec", '{"name": 5}', "column spec"),
        ("victims", "[1, 2]", "column victims"),
    ],
)  # fmt: skip
def test_corrupt_rows_name_the_workload_and_column(
    repo: Repository, column: str, value: str, message: str
) -> None:
    repo.insert_workloads([rich_workload()])
    with repo.transaction() as c:
        c.execute(update(S.workloads).where(S.workloads.c.id == "ft-1").values({column: value}))
    with pytest.raises(CorruptRecord, match=f"workload 'ft-1'.*{message}"):
        repo.load_workloads()


def test_a_gap_in_the_history_is_corruption(repo: Repository) -> None:
    w = rich_workload()
    repo.insert_workloads([w])
    with repo.transaction() as c:
        c.execute(
            S.transitions.delete().where(
                S.transitions.c.workload_id == "ft-1", S.transitions.c.step == 2
            )
        )
    with pytest.raises(CorruptRecord, match=r"workload 'ft-1'.*history has no step 2"):
        repo.load_workloads()


# =================================================================== decisions
def decision(seq: int, workload: str, cause: str | None, kind: str = "place") -> DecisionRecord:
    return DecisionRecord(
        kind=kind,
        workload=workload,
        policy="best-fit",
        chosen="n1",
        reasons=("fits", "least waste"),
        candidates=("n1", "n2"),
        inputs_digest="abc123",
        cause_id=cause,
        time=seq * 1.5,
        version=seq + 10,
        seq=seq,
        extra={"score": 0.5} if seq % 2 else {},
    )


def test_decisions_round_trip_and_query(repo: Repository) -> None:
    recs = [decision(1, "a", "c1"), decision(2, "b", "c1"), decision(3, "a", "c2", "preempt")]
    repo.append_decisions(recs)
    repo.append_decisions(recs[:1])  # a repeat is ignored
    assert repo.decisions_for() == recs
    assert repo.decisions_for(workload="a") == [recs[0], recs[2]]
    assert repo.decisions_for(cause_id="c1") == recs[:2]
    assert repo.decisions_for(workload="a", cause_id="c2") == [recs[2]]
    assert repo.max_decision_seq() == 3


def test_overlong_decision_subjects_are_clipped_in_the_index_not_the_record(
    repo: Repository,
) -> None:
    long = "x" * 200  # a rejected submission is named by its (up to 200 character) name
    rec = decision(1, long, "c" * 300, kind="reject")
    repo.append_decisions([rec])
    (got,) = repo.decisions_for()
    assert got.workload == long and got.cause_id == "c" * 300


# ================================================================== reasoning
def test_reasoning_round_trip(repo: Repository) -> None:
    a = repo.append_reasoning(
        {"trigger": "deadline-at-risk", "steps": [1, 2]}, time=3.0, correlation_id="c1"
    )
    b = repo.append_reasoning({"trigger": "stall"}, time=4.0)
    assert b > a
    got = repo.reasoning()
    assert [(e.id, e.time, e.correlation_id, e.record) for e in got] == [
        (a, 3.0, "c1", {"steps": [1, 2], "trigger": "deadline-at-risk"}),
        (b, 4.0, None, {"trigger": "stall"}),
    ]
    assert [e.id for e in repo.reasoning("c1")] == [a]
    assert [e.id for e in repo.reasoning(after_id=a)] == [b]


# ================================================================== telemetry
def test_telemetry_append_downsample_prune(repo: Repository) -> None:
    samples = [
        TelemetrySample(
            time=float(t), node="n1", workload="w1", metrics={"gpu_util": t, "phase": f"p{t}"}
        )
        for t in range(0, 120, 10)
    ] + [TelemetrySample(time=5.0, node="n2", metrics={"cpu": 1.0})]
    assert repo.append_telemetry(samples, resolution_s=10) == 13
    assert len(repo.telemetry(node="n1")) == 12

    removed, written = repo.downsample_telemetry(older_than=75.0, to_resolution_s=60)
    # cut-off rounds down to 60: n1's samples at 0..50 and n2's become one sample each
    assert (removed, written) == (7, 2)
    n1 = repo.telemetry(node="n1")
    assert [(s.time, s.resolution_s) for s in n1[:2]] == [(0.0, 60), (60.0, 10)]
    assert n1[0].metrics == {"gpu_util": 25.0, "phase": "p50"}  # mean, and the latest text
    assert repo.telemetry(node="n2")[0].metrics == {"cpu": 1.0}
    assert repo.downsample_telemetry(older_than=75.0, to_resolution_s=60) == (0, 0)

    # older than 150 - 50 = 100: the two 60 s samples at 0, and n1 at 60, 70, 80, 90
    assert repo.prune_telemetry(retention_s=50, now=150.0) == 6
    assert [s.time for s in repo.telemetry()] == [100.0, 110.0]


# ============================================================ snapshots, meta
def test_snapshots_and_meta(repo: Repository) -> None:
    assert repo.latest_snapshot() is None
    repo.save_snapshot(3, 10.0, {"b": 1, "a": [1, 2]})
    repo.save_snapshot(7, 20.0, '{"x":1}')
    snap = repo.latest_snapshot()
    assert snap is not None and (snap.version, snap.time, snap.state) == (7, 20.0, '{"x":1}')
    assert repo.max_version() == 7
    assert repo.meta_get("k") is None and repo.meta_get("k", "d") == "d"
    repo.meta_set("k", "v1")
    repo.meta_set("k", "v2")
    assert repo.meta_get("k") == "v2"


# =============================================================== transactions
def test_rows_written_in_one_transaction_commit_or_roll_back_together(repo: Repository) -> None:
    w = pending_workload("p-1", 1)
    with pytest.raises(RuntimeError, match="boom"), repo.transaction() as c:
        assert repo.mark_processed(c, "ev-1", 1.0)
        repo.insert_workloads([w], conn=c)
        raise RuntimeError("boom")
    assert repo.load_workloads() == [] and not repo.is_processed("ev-1")

    with repo.transaction() as c:
        assert repo.mark_processed(c, "ev-1", 1.0)
        repo.insert_workloads([w], conn=c)
    with repo.transaction() as c:
        assert not repo.mark_processed(c, "ev-1", 2.0)  # a redelivery: skip the effect
    assert repo.is_processed("ev-1") and repo.load_workloads() == [w]


def test_sanitizer_runs_before_storing(engine) -> None:
    pytest.importorskip("mlwe.store.sanitize")
    repo = Repository(engine)
    assert repo.sanitizing
    secret = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
    spec = job("s-1", labels={"api_key": "hunter2hunter2", "note": f"token {secret}"})
    w = Workload(id="s-1", spec=spec, seq=1, submit_time=0.0, deadline=None)
    repo.insert_workloads([w])
    repo.append_reasoning({"prompt": f"use {secret}", "password": "pw12345678"}, time=1.0)
    with engine.connect() as c:
        texts = [
            c.execute(select(S.workloads.c.spec)).scalar_one(),
            c.execute(select(S.reasoning.c.record)).scalar_one(),
        ]
    for text in texts:
        assert secret not in text and "hunter2" not in text and "pw12345678" not in text


def test_bulk_inserts_in_batches_store_every_workload(sqlite_repo: Repository) -> None:
    """Durable inserts in batches of 100 (their speed is a figure of `mlwe bench store-direct`)."""
    specs = [job(f"b{i}", cpu=1, memory="1Gi") for i in range(100)]
    n = 0
    for b in range(10):
        batch = [
            Workload(
                id=f"{s.id}-{b}",
                spec=s,
                seq=b * 100 + i,
                submit_time=0.0,
                deadline=None,
                history=[Transition(0.0, None, S_.PENDING, "submitted")],
            )
            for i, s in enumerate(specs)
        ]
        sqlite_repo.insert_workloads(batch)
        n += len(batch)
    assert n == 1000
    assert sqlite_repo.count_workloads() == 1000
