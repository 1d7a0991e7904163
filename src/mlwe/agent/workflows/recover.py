"""The ``recover`` workflow: retry with backoff, watch the new attempt, move off the
failing nodes, give up with a dead letter and an alert.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from mlwe.agent.workflows.model import (
    Fail,
    Finish,
    Goto,
    Id,
    Next,
    Outcome,
    Seconds,
    Step,
    StepContext,
    Wait,
    WorkflowDefinition,
    _describe_end,
    _nodes,
)
from mlwe.core.actions import Action, Evict, Place, Retry
from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import QUEUED, TERMINAL, State
from mlwe.core.model import Workload
from mlwe.core.spec import NodeStatus


class RecoverParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    workload: Id
    #: retries in place (the scheduler chooses the nodes) before moving off the failing nodes
    max_retries: int = Field(default=3, ge=0, le=20)
    backoff_base_s: Seconds = 30.0
    backoff_factor: float = Field(default=2.0, ge=1.0, le=10.0, allow_inf_nan=False)
    backoff_max_s: Seconds = 1800.0
    #: a retried attempt that runs this long (or succeeds) counts as recovered
    healthy_after_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 60.0
    max_moves: int = Field(default=1, ge=0, le=10)
    #: how long a move may wait for room off the failing nodes before giving up
    place_timeout_s: Seconds = 600.0
    #: nodes known to be bad already (a node trigger's evidence)
    bad_nodes: tuple[Id, ...] = ()


# ================================================================= recover
_NODE_CAUSES = frozenset({"node-lost", "vanished"})


def _check_recover(cp: ControlPlane, p: RecoverParams) -> list[str]:
    w = cp.workloads.get(p.workload)
    if w is None:
        return [f"workload: unknown workload {p.workload!r}"]
    unknown = [n for n in p.bad_nodes if n not in cp.capacity]
    if unknown:
        return [f"bad_nodes: unknown node(s) {', '.join(unknown)}"]
    if w.state in TERMINAL:
        return [f"{w.id} is {w.state.value}; there is nothing to recover"]
    return []


def _failed_at(w: Workload) -> float:
    for tr in reversed(w.history):
        if tr.target is State.FAILED:
            return tr.time
    return w.history[-1].time if w.history else 0.0


def _record_failure(ctx: StepContext, w: Workload) -> list[str]:
    """Note the failure of ``w``'s current attempt; returns the nodes it ran on."""
    st = ctx.state
    nodes = list(ctx.engine.nodes_of_attempt(w, w.attempt))
    if not nodes and st.get("current_attempt") == w.attempt:
        nodes = list(st.get("current_nodes", []))
    failures: list[dict[str, Any]] = st.setdefault("failures", [])
    if not any(f["attempt"] == w.attempt for f in failures):
        failures.append(
            {
                "attempt": w.attempt,
                "cause": w.failure_cause,
                "exit_code": w.exit_code,
                "nodes": nodes,
                "time": _failed_at(w),
            }
        )
        del failures[:-50]
    bad: list[str] = st.setdefault("bad_nodes", [])
    for n in nodes:
        if n not in bad:
            bad.append(n)
    st["seen_attempt"] = w.attempt
    st["failed_at"] = _failed_at(w)
    return nodes


def _node_trouble(ctx: StepContext, w: Workload, nodes: Sequence[str]) -> bool:
    cap = ctx.cp.capacity
    return w.failure_cause in _NODE_CAUSES or any(
        n in cap and cap.status(n) is not NodeStatus.READY for n in nodes
    )


def _v_triage(ctx: StepContext) -> Outcome:
    p: RecoverParams = ctx.params
    st = ctx.state
    w = ctx.workload(p.workload)
    if w is None:
        return Fail(f"unknown workload {p.workload!r}")
    st.setdefault("tries", 0)
    st.setdefault("moves", 0)
    for n in p.bad_nodes:
        st.setdefault("bad_nodes", [])
        if n not in st["bad_nodes"]:
            st["bad_nodes"].append(n)
    if w.state is State.FAILED:
        nodes = _record_failure(ctx, w)
        if _node_trouble(ctx, w, nodes):
            return Goto("move", f"{w.id} failed with its node ({w.failure_cause}); moving it off")
        return Next(f"{w.id} failed ({_describe_end(w)}) on {', '.join(nodes) or 'unknown nodes'}")
    if w.state in TERMINAL:
        return Finish(True, f"{w.id} is {w.state.value}; nothing to recover")
    # not failed right now (the runtime retried it already, or it runs): watch what comes
    st["seen_attempt"] = w.attempt if w.state in QUEUED else w.attempt - 1
    return Goto("watch", f"{w.id} is {w.state.value}; watching its next attempt")


def _v_retry(ctx: StepContext) -> Outcome:
    p: RecoverParams = ctx.params
    st = ctx.state
    w = ctx.workload(p.workload)
    if w is None:
        return Fail(f"unknown workload {p.workload!r}")
    tries = int(st.get("tries", 0))
    if tries >= p.max_retries:
        return Goto("move", f"{tries} retr{'y' if tries == 1 else 'ies'} failed; moving it")
    if w.state is not State.FAILED or w.attempt != st.get("seen_attempt"):
        # someone (the runtime's own retry policy) re-queued it already: that is the retry
        st["tries"] = tries + 1
        return Next(f"{w.id} is {w.state.value}: already retried by the runtime")
    delay = min(p.backoff_max_s, p.backoff_base_s * p.backoff_factor**tries)
    due = float(st.get("failed_at", ctx.now())) + delay
    st["retry_due"] = due
    if ctx.now() < due:
        return Wait(
            f"backoff: retry {tries + 1}/{p.max_retries} at t={due:g} ({delay:g}s)", until=due
        )
    res = ctx.propose([Retry(w.id)], f"recover: retry {tries + 1}/{p.max_retries} after {delay:g}s")
    if not res.accepted:
        st["give_up_reason"] = "retry refused: " + "; ".join(res.reasons())
        return Goto("give_up", st["give_up_reason"])
    st["tries"] = tries + 1
    st["retried_attempt"] = w.attempt
    return Next(f"retry {tries + 1}/{p.max_retries} after {delay:g}s backoff")


def _v_watch(ctx: StepContext) -> Outcome:
    p: RecoverParams = ctx.params
    st = ctx.state
    w = ctx.workload(p.workload)
    if w is None:
        return Fail(f"unknown workload {p.workload!r}")
    seen = int(st.get("seen_attempt", 0))
    if w.holding:
        st["current_attempt"] = w.attempt
        st["current_nodes"] = _nodes(w)
    if w.state is State.SUCCEEDED:
        return Finish(True, f"recovered: {w.id} succeeded ({_story(st)})")
    if w.state is State.CANCELLED:
        return Finish(True, f"{w.id} was cancelled; nothing left to recover")
    if w.state is State.RUNNING and w.attempt > seen and w.started_at is not None:
        healthy_at = w.started_at + p.healthy_after_s
        if ctx.now() >= healthy_at:
            return Finish(True, f"recovered: {w.id} runs on {', '.join(_nodes(w))} ({_story(st)})")
        return Wait(f"{w.id} runs again; healthy after {p.healthy_after_s:g}s", until=healthy_at)
    if w.state is State.FAILED and w.attempt > seen:
        nodes = _record_failure(ctx, w)
        if _node_trouble(ctx, w, nodes):
            return Goto("move", f"attempt {w.attempt} lost its node; moving it off")
        if int(st.get("tries", 0)) < p.max_retries:
            return Goto("retry", f"attempt {w.attempt} failed on {', '.join(nodes) or '?'}")
        return Goto("move", f"attempt {w.attempt} failed on {', '.join(nodes) or '?'}")
    if w.state is State.FAILED and w.attempt == seen:
        if st.get("retried_attempt") == seen:
            # the retry was not durable when the engine stopped: it did not happen
            st["tries"] = max(0, int(st.get("tries", 0)) - 1)
            st.pop("retried_attempt", None)
        if st.get("moved_attempt") == seen:
            st["moves"] = max(0, int(st.get("moves", 0)) - 1)
            st.pop("moved_attempt", None)
        return Goto("retry", f"{w.id} is still failed at attempt {seen}")
    return Wait(f"watching {w.id}: {w.state.value} (attempt {w.attempt})")


def _v_move(ctx: StepContext) -> Outcome:
    p: RecoverParams = ctx.params
    st = ctx.state
    w = ctx.workload(p.workload)
    if w is None:
        return Fail(f"unknown workload {p.workload!r}")
    moves = int(st.get("moves", 0))
    bad = list(st.get("bad_nodes", []))
    if w.state is State.SUCCEEDED:
        return Finish(True, f"recovered: {w.id} succeeded ({_story(st)})")
    if w.state is State.CANCELLED:
        return Finish(True, f"{w.id} was cancelled; nothing left to recover")
    if moves >= p.max_moves:
        st["give_up_reason"] = (
            f"still failing after {st.get('tries', 0)} retries and {moves} move(s)"
        )
        return Goto("give_up", st["give_up_reason"])
    if w.holding:
        on_bad = [n for n in _nodes(w) if n in bad]
        if not on_bad:
            return Goto("watch", f"{w.id} already runs off the failing nodes")
        if w.state is State.PREEMPTING:
            return Wait(f"{w.id} is being stopped")
        evictions = int(st.get("evictions", 0))
        if evictions > p.max_moves:
            # placed back on a failing node each time (by the scheduler): stop chasing it
            st["give_up_reason"] = (
                f"placed back on {', '.join(on_bad)} after {evictions} eviction(s)"
            )
            return Goto("give_up", st["give_up_reason"])
        res = ctx.propose(
            [Evict(w.id, f"move off {', '.join(on_bad)}")],
            f"recover: move {w.id} off {', '.join(on_bad)}",
        )
        if not res.accepted:
            return Wait("eviction refused: " + "; ".join(res.reasons()))
        st["evictions"] = evictions + 1
        return Wait(f"{w.id} is being moved off {', '.join(on_bad)}")
    if w.state is State.PREEMPTING:
        return Wait(f"{w.id} is being stopped")
    allocs = ctx.placement_for(w, exclude=bad)
    if allocs is None:
        return Wait(f"no node other than {', '.join(bad) or 'none'} fits {w.id} now")
    actions: list[Action] = [Retry(w.id)] if w.state is State.FAILED else []
    actions.append(Place(w.id, allocs))
    was = w.attempt
    res = ctx.propose(actions, f"recover: move {w.id} off {', '.join(bad) or 'its nodes'}")
    if not res.accepted:
        reasons = "; ".join(res.reasons())
        if w.state is State.FAILED and "max_retries" in reasons:
            st["give_up_reason"] = "retry refused: " + reasons
            return Goto("give_up", st["give_up_reason"])
        return Wait("move refused: " + reasons)
    st["moves"] = moves + 1
    st["moved_attempt"] = was
    st["seen_attempt"] = was
    return Goto("watch", f"moved {w.id} to {', '.join(_nodes(w))}")


def _v_give_up(ctx: StepContext) -> Outcome:
    p: RecoverParams = ctx.params
    st = ctx.state
    reason = str(st.get("give_up_reason") or st.get("timeout_reason") or "recovery exhausted")
    failures = list(st.get("failures", []))
    ctx.dead_letter(
        "workflow.recover.gave_up",
        {
            "workload": p.workload,
            "reason": reason,
            "failures": failures,
            "tries": st.get("tries", 0),
            "moves": st.get("moves", 0),
            "bad_nodes": st.get("bad_nodes", []),
        },
        reason,
        attempts=len(failures),
    )
    ctx.alert("critical", p.workload, f"gave up recovering {p.workload}: {reason}")
    return Finish(False, f"gave up: {reason}")


def _story(st: Mapping[str, Any]) -> str:
    return (
        f"{st.get('tries', 0)} retr{'y' if st.get('tries', 0) == 1 else 'ies'}, "
        f"{st.get('moves', 0)} move(s)"
    )


RECOVER = WorkflowDefinition(
    kind="recover",
    doc="Failure recovery: retry with backoff, move off the failing nodes, give up with an alert.",
    params=RecoverParams,
    steps=(
        Step(
            "triage", _v_triage, "note the failure and its nodes; a lost node goes straight to move"
        ),
        Step("retry", _v_retry, "retry after an exponential backoff"),
        Step("watch", _v_watch, "watch the new attempt: healthy, succeeded, or failed again"),
        Step(
            "move",
            _v_move,
            "place it again off the nodes it failed on",
            timeout="place_timeout_s",
            on_timeout="give_up",
        ),
        Step("give_up", _v_give_up, "dead-letter the case and alert an operator"),
    ),
    subjects=lambda p: (p.workload,),
    check=_check_recover,
)
