"""The lifecycle table, walked edge by edge through the real control plane.

Every edge of ``TRANSITIONS`` has a row below naming the action that causes
it. Each row reaches its source state with real actions, applies the cause
and checks the workload lands on the target with the edge in its history.
A state missing from the table, an edge without a row, a row for an edge the
table lacks, or a state no recipe reaches fails the suite.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mlwe.core import (
    TRANSITIONS,
    Action,
    Cancel,
    ControlPlane,
    Exited,
    IllegalTransition,
    Preempt,
    Released,
    Retry,
    Start,
    Started,
    State,
    Transition,
)
from mlwe.core.lifecycle import check_transition
from tests.core.builders import cluster, gpu_node, job, ok, place_on, submit

S = State
Step = Callable[[ControlPlane], list[Action]]


def _attempt(cp: ControlPlane) -> int:
    return cp.get("w").attempt


def place(cp: ControlPlane) -> list[Action]:
    return [place_on(cp, "w", "a100-0")]


def start(cp: ControlPlane) -> list[Action]:
    return [Start("w", _attempt(cp))]


def started(cp: ControlPlane) -> list[Action]:
    return [Started("w", _attempt(cp))]


def preempt(cp: ControlPlane) -> list[Action]:
    return [Preempt("w", "p")]  # p: urgent, waiting for the GPUs w holds


def released(cp: ControlPlane) -> list[Action]:
    return [Released("w", _attempt(cp))]


def exit_0(cp: ControlPlane) -> list[Action]:
    return [Exited("w", _attempt(cp), 0)]


def exit_1(cp: ControlPlane) -> list[Action]:
    return [Exited("w", _attempt(cp), 1, "error")]


def start_failed(cp: ControlPlane) -> list[Action]:
    return [Exited("w", _attempt(cp), 127, "start-failed")]


def node_lost(cp: ControlPlane) -> list[Action]:
    return [Exited("w", _attempt(cp), 137, "node-lost")]


def cancel(cp: ControlPlane) -> list[Action]:
    return [Cancel("w")]


def retry(cp: ControlPlane) -> list[Action]:
    return [Retry("w")]


#: How a fresh workload "w" reaches each state, by real actions only.
REACH: dict[State, tuple[Step, ...]] = {
    S.PENDING: (),
    S.ADMITTED: (place,),
    S.STARTING: (place, start),
    S.RUNNING: (place, start, started),
    S.PREEMPTING: (place, start, started, preempt),
    S.PREEMPTED: (place, start, started, preempt, released),
    S.STOPPING: (place, start, started, cancel),
    S.SUCCEEDED: (place, start, started, exit_0),
    S.FAILED: (place, start, started, exit_1),
    S.CANCELLED: (cancel,),
}

#: One row per (edge, cause). Every edge of TRANSITIONS has at least one row.
EDGES: list[tuple[State, State, Step]] = [
    (S.PENDING, S.ADMITTED, place),
    (S.PENDING, S.CANCELLED, cancel),
    (S.ADMITTED, S.STARTING, start),
    (S.ADMITTED, S.PREEMPTING, preempt),
    (S.ADMITTED, S.STOPPING, cancel),
    (S.ADMITTED, S.FAILED, start_failed),
    (S.STARTING, S.RUNNING, started),
    (S.STARTING, S.PREEMPTING, preempt),
    (S.STARTING, S.STOPPING, cancel),
    (S.STARTING, S.FAILED, exit_1),
    (S.STARTING, S.SUCCEEDED, exit_0),
    (S.RUNNING, S.SUCCEEDED, exit_0),
    (S.RUNNING, S.FAILED, exit_1),
    (S.RUNNING, S.FAILED, node_lost),
    (S.RUNNING, S.PREEMPTING, preempt),
    (S.RUNNING, S.STOPPING, cancel),
    (S.PREEMPTING, S.PREEMPTED, released),
    (S.PREEMPTING, S.SUCCEEDED, exit_0),
    (S.PREEMPTING, S.FAILED, exit_1),
    (S.PREEMPTING, S.STOPPING, cancel),
    (S.PREEMPTED, S.ADMITTED, place),
    (S.PREEMPTED, S.CANCELLED, cancel),
    (S.STOPPING, S.CANCELLED, released),
    (S.STOPPING, S.CANCELLED, exit_1),
    (S.FAILED, S.PENDING, retry),
]


def fresh() -> ControlPlane:
    cp, _ = cluster(gpu_node("a100-0"))
    submit(
        cp,
        job("w", gpu=4, priority="batch", estimated_duration="1h"),
        job("p", gpu=8, priority="urgent"),  # a preemptor, only ever used by `preempt`
    )
    return cp


def reach(state: State) -> ControlPlane:
    cp = fresh()
    for step in REACH[state]:
        ok(cp.apply(step(cp)))
    assert cp.get("w").state is state
    return cp


# -------------------------------------------------------------- the table
def test_every_state_is_in_the_table() -> None:
    assert set(TRANSITIONS) == set(State)
    for targets in TRANSITIONS.values():
        assert targets <= set(State)


def test_every_table_edge_has_a_row_and_every_row_is_a_table_edge() -> None:
    table = {(s, t) for s, targets in TRANSITIONS.items() for t in targets}
    rows = {(s, t) for s, t, _ in EDGES}
    assert rows == table


def test_every_state_is_reachable_from_pending_in_the_table() -> None:
    seen, frontier = {S.PENDING}, [S.PENDING]
    while frontier:
        for t in TRANSITIONS[frontier.pop()]:
            if t not in seen:
                seen.add(t)
                frontier.append(t)
    assert seen == set(State)


def test_terminal_states_have_no_way_out() -> None:
    assert {s for s, targets in TRANSITIONS.items() if not targets} == {S.SUCCEEDED, S.CANCELLED}


@pytest.mark.parametrize("state", list(State), ids=[s.value for s in State])
def test_every_state_is_reached_by_real_actions(state: State) -> None:
    cp = reach(state)
    w = cp.get("w")
    # the history is a walk through the table, from submission to here
    assert w.history[0].source is None and w.history[0].target is S.PENDING
    for prev, nxt in zip(w.history, w.history[1:], strict=False):
        assert nxt.source is prev.target
        assert nxt.target in TRANSITIONS[prev.target]
    assert cp.validate_state() == []


# ------------------------------------------------------------------ edges
@pytest.mark.parametrize(
    ("source", "target", "cause"),
    EDGES,
    ids=[f"{s.value}->{t.value}-by-{c.__name__}" for s, t, c in EDGES],
)
def test_edge(source: State, target: State, cause: Step) -> None:
    cp = reach(source)
    version = cp.version
    ok(cp.apply(cause(cp)))
    w = cp.get("w")
    assert w.state is target
    last = w.history[-1]
    assert (last.source, last.target) == (source, target)
    assert cp.version == version + 1
    assert cp.validate_state() == []


def test_resources_follow_the_holding_states() -> None:
    """Held from placement until the backend confirms release, never after."""
    cp = reach(S.PREEMPTING)
    assert cp.capacity.whole_free_gpus("a100-0") == 4  # still held while checkpointing
    ok(cp.apply(released(cp)))
    assert cp.capacity.whole_free_gpus("a100-0") == 8
    assert cp.get("w").placement == ()


# ---------------------------------------------------------- illegal edges
ILLEGAL: list[tuple[State, str, Step, str]] = [
    # (state w is in, what is tried, the action, fragment of the reason)
    (S.SUCCEEDED, "place", place, "succeeded, only pending or preempted workloads are placed"),
    (S.SUCCEEDED, "start", start, "succeeded; only admitted workloads are started"),
    (S.SUCCEEDED, "cancel", cancel, "succeeded; it cannot be cancelled"),
    (S.CANCELLED, "place", place, "cancelled, only pending or preempted workloads are placed"),
    (S.CANCELLED, "retry", retry, "cancelled; only failed workloads are retried"),
    (S.RUNNING, "place", place, "running, only pending or preempted workloads are placed"),
    (S.RUNNING, "retry", retry, "running; only failed workloads are retried"),
    (S.RUNNING, "release-without-stop", released, "release is only confirmed after a stop"),
    (S.PENDING, "started-before-start", started, "'started' is only expected while starting"),
    (S.PENDING, "exit-without-process", exit_1, "it has no process to exit"),
    (S.PREEMPTED, "preempt-again", preempt, "victim w is preempted, not running"),
    (S.FAILED, "start", start, "failed; only admitted workloads are started"),
]

HISTORY = {
    S.SUCCEEDED: "history: pending -> admitted -> starting -> running -> succeeded",
    S.CANCELLED: "history: pending -> cancelled",
    S.RUNNING: "history: pending -> admitted -> starting -> running",
    S.PENDING: "history: pending",
    S.PREEMPTED: "history: pending -> admitted -> starting -> running -> preempting -> preempted",
    S.FAILED: "history: pending -> admitted -> starting -> running -> failed",
}


@pytest.mark.parametrize(
    ("state", "cause", "fragment"),
    [(s, c, f) for s, _, c, f in ILLEGAL],
    ids=[f"{s.value}-{name}" for s, name, _, _ in ILLEGAL],
)
def test_illegal_transition_is_rejected_with_history(
    state: State, cause: Step, fragment: str
) -> None:
    cp = reach(state)
    before = (cp.version, list(cp.get("w").history))
    result = cp.apply(cause(cp))
    assert not result.accepted
    (reason,) = [r for rej in result.rejections for r in rej.reasons if fragment in r]
    assert HISTORY[state] in reason
    assert (cp.version, cp.get("w").history) == before
    assert cp.get("w").state is state
    assert cp.validate_state() == []


ILLEGAL_PAIRS = [(s, t) for s in State for t in State if t not in TRANSITIONS[s]]


@pytest.mark.parametrize(
    ("source", "target"), ILLEGAL_PAIRS, ids=[f"{s.value}->{t.value}" for s, t in ILLEGAL_PAIRS]
)
def test_check_transition_rejects_every_edge_outside_the_table(
    source: State, target: State
) -> None:
    history = [
        Transition(0.0, None, S.PENDING, "submitted"),
        Transition(5.0, S.PENDING, source, "test") if source is not S.PENDING else None,
    ]
    trail = [t for t in history if t is not None]
    with pytest.raises(IllegalTransition) as exc:
        check_transition("w", source, target, trail)
    err = exc.value
    assert (err.workload_id, err.source, err.target) == ("w", source, target)
    assert err.history == tuple(trail)
    text = str(err)
    assert f"illegal transition {source.value} -> {target.value} for workload w" in text
    assert "history: " + " -> ".join(t.target.value for t in trail) in text
    allowed = ", ".join(sorted(TRANSITIONS[source])) or "none (terminal)"
    assert f"allowed from {source.value}: {allowed}" in text


@pytest.mark.parametrize(
    ("source", "target"),
    [(s, t) for s, ts in TRANSITIONS.items() for t in ts],
    ids=[f"{s.value}->{t.value}" for s, ts in TRANSITIONS.items() for t in ts],
)
def test_check_transition_accepts_every_table_edge(source: State, target: State) -> None:
    check_transition("w", source, target, [])  # does not raise

