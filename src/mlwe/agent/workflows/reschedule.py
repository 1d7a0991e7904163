"""The ``reschedule`` workflow: checkpoint the victims, confirm their release, place
and start the preemptor, confirm it runs; its compensation resumes the victims.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
from mlwe.core.actions import Place, Preempt, PreemptReason
from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import HOLDING, QUEUED, TERMINAL, State
from mlwe.core.model import Workload
from mlwe.store.repository import (
    placement_from_json,
    placement_to_json,
)


class RescheduleParams(BaseModel):
    """One preemptor and the victim(s) whose resources it takes.

    ``victim`` names one victim; ``victims`` several (an agent's preemption plan
    often needs more than one to free a node); give exactly one of the two."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    victim: Id | None = None
    victims: tuple[Id, ...] = Field(default=(), max_length=64)
    preemptor: Id
    reason: PreemptReason = PreemptReason.PRIORITY
    #: the victims' checkpoint and release (grace period and the backend's confirmation)
    checkpoint_timeout_s: Seconds = 600.0
    place_timeout_s: Seconds = 300.0
    start_timeout_s: Seconds = 300.0
    running_timeout_s: Seconds = 600.0
    compensation_timeout_s: Seconds = 900.0

    @model_validator(mode="after")
    def _one_victim_list(self) -> RescheduleParams:
        if (self.victim is None) == (not self.victims):
            raise ValueError("give exactly one of victim or victims")
        if len(set(self.victims)) != len(self.victims):
            raise ValueError("victims: a workload is named twice")
        return self

    @property
    def all_victims(self) -> tuple[str, ...]:
        return self.victims or ((self.victim,) if self.victim is not None else ())


def _preempted_for(v: Workload, preemptor: str) -> bool:
    return v.state in (State.PREEMPTING, State.PREEMPTED) and v.preempted_by == preemptor


def _check_reschedule(cp: ControlPlane, p: RescheduleParams) -> list[str]:
    out = []
    for role, wid in (*(("victim", v) for v in p.all_victims), ("preemptor", p.preemptor)):
        if wid not in cp.workloads:
            out.append(f"{role}: unknown workload {wid!r}")
    if out:
        return out
    if p.preemptor in p.all_victims:
        return ["a workload cannot preempt itself"]
    w = cp.workloads[p.preemptor]
    for vid in p.all_victims:
        v = cp.workloads[vid]
        # a preemption already under way for this preemptor (the agent's committed plan)
        # is adopted: the workflow carries out the rest
        if v.state not in (State.ADMITTED, State.STARTING, State.RUNNING) and not _preempted_for(
            v, w.id
        ):
            out.append(
                f"victim {v.id} is {v.state.value}; only admitted or running work is preempted"
            )
    if w.state not in QUEUED:
        out.append(f"preemptor {w.id} is {w.state.value}; it must be waiting for placement")
    return out


def _victim_record(v: Workload) -> dict[str, Any]:
    """What compensation needs to know of a victim, taken before it releases."""
    return {
        "attempt": v.attempt,
        "nodes": _nodes(v),
        "placement": placement_to_json(v.placement),
        "progress_before": round(v.progress, 6),
    }


def _victims(ctx: StepContext) -> tuple[list[Workload], str | None]:
    p: RescheduleParams = ctx.params
    out = []
    for vid in p.all_victims:
        v = ctx.workload(vid)
        if v is None:
            return [], f"unknown workload {vid!r}"
        out.append(v)
    return out, None


def _r_checkpoint(ctx: StepContext) -> Outcome:
    p: RescheduleParams = ctx.params
    st = ctx.state
    vs, err = _victims(ctx)
    w = ctx.workload(p.preemptor)
    if err is not None or w is None:
        return Fail(err or f"unknown workload {p.preemptor!r}")
    st.setdefault("preemptor_attempt", w.attempt)
    info: dict[str, Any] = st.setdefault("victims", {})
    if st.get("preempted"):
        return Next("the victims were asked already")
    adopted, to_ask = [], []
    for v in vs:
        rec = info.get(v.id)
        if _preempted_for(v, w.id) and (rec is None or v.attempt == rec["attempt"]):
            # asked already: by the plan that started this workflow, before a restart
            # (the record had not said so yet), or by the scheduler
            if rec is None:
                info[v.id] = _victim_record(v)
            adopted.append(v.id)
        else:
            to_ask.append(v)
    if not to_ask:
        st["preempted"] = True
        return Next(f"{', '.join(adopted)} already preempted for {w.id}")
    if w.state in HOLDING or w.state is State.SUCCEEDED:
        return Finish(True, f"{w.id} is {w.state.value} already; no preemption needed")
    if w.state not in QUEUED:
        return Fail(f"preemptor {w.id} is {w.state.value}, not waiting for placement")
    for v in to_ask:
        if v.state not in (State.ADMITTED, State.STARTING, State.RUNNING):
            if adopted:
                ctx.had_effect()  # the adopted victims are resumed by the compensation
            return Fail(f"victim {v.id} is {v.state.value}; there is nothing to preempt")
    for v in to_ask:
        info[v.id] = _victim_record(v)
    names = ", ".join(v.id for v in to_ask)
    res = ctx.propose(
        [Preempt(v.id, w.id, p.reason) for v in to_ask],
        f"reschedule: {names} checkpoint{'s' if len(to_ask) == 1 else ''} and yield"
        f" {'its' if len(to_ask) == 1 else 'their'} resources to {w.id}",
    )
    if not res.accepted:
        for v in to_ask:
            info.pop(v.id, None)
        if adopted:
            ctx.had_effect()
        return Fail("the control plane refused the preemption: " + "; ".join(res.reasons()))
    st["preempted"] = True
    where = sorted({n for v in to_ask for n in info[v.id]["nodes"]})
    return Next(f"asked {names} to checkpoint and stop (on {', '.join(where)})")


def _r_wait_checkpoint(ctx: StepContext) -> Outcome:
    p: RescheduleParams = ctx.params
    st = ctx.state
    vs, err = _victims(ctx)
    if err is not None:
        return Fail(err)
    info: dict[str, Any] = st.get("victims", {})
    lost = [
        v.id
        for v in vs
        if v.holding
        and v.state is not State.PREEMPTING
        and v.id in info
        and v.attempt == info[v.id]["attempt"]
        and v.preempted_by != p.preemptor
    ]
    if lost:
        # the preemption is not in the state (it was not durable when the engine stopped)
        st.pop("preempted", None)
        for vid in lost:
            info.pop(vid, None)
        return Goto("checkpoint", f"{', '.join(lost)}: the preemption was lost; asking again")
    waiting = [v.id for v in vs if v.state is State.PREEMPTING]
    if waiting:
        return Wait(f"{', '.join(waiting)} checkpointing within the grace period")
    return Next("; ".join(f"{v.id} is {v.state.value}" for v in vs))


_RELEASED_HOW = {
    State.PREEMPTED: "the backend confirmed the release",
    State.SUCCEEDED: "it finished within its grace period",
    State.FAILED: "it failed within its grace period",
    State.CANCELLED: "it was cancelled",
}


def _r_confirm_release(ctx: StepContext) -> Outcome:
    st = ctx.state
    vs, err = _victims(ctx)
    if err is not None:
        return Fail(err)
    info: dict[str, Any] = st.get("victims", {})
    listed = []
    for v in vs:
        rec = info.get(v.id, {})
        same = v.attempt == rec.get("attempt")
        if v.state is State.PREEMPTING:
            return Goto("wait_checkpoint", f"{v.id} is still releasing")
        if v.holding and same:
            return Goto("wait_checkpoint", f"{v.id} still holds its resources")
        listed += [
            f"{v.id} on {n}"
            for n in rec.get("nodes", [])
            if same and v.id in ctx.cp.on_node.get(n, {})
        ]
    if listed:
        return Wait(f"still listed: {', '.join(listed)}")
    st["released"] = True
    notes = []
    for v in vs:
        info.setdefault(v.id, {})["saved_progress"] = round(v.progress, 6)
        how = _RELEASED_HOW.get(v.state, f"it is {v.state.value}")
        notes.append(f"{v.id}: {how}; it saved {v.progress:.0%} of its work")
    return Next("; ".join(notes))


def _r_place(ctx: StepContext) -> Outcome:
    p: RescheduleParams = ctx.params
    st = ctx.state
    w = ctx.workload(p.preemptor)
    if w is None:
        return Fail(f"unknown workload {p.preemptor!r}")
    before = int(st.get("preemptor_attempt", 0))
    if w.attempt > before and (w.holding or w.state is State.SUCCEEDED):
        st["preemptor_nodes"] = _nodes(w)
        by = "the workflow" if st.get("placed_by_workflow") else "the scheduler"
        return Next(f"{w.id} placed by {by} on {', '.join(_nodes(w)) or 'its nodes'}")
    if w.state not in QUEUED:
        return Fail(f"preemptor {w.id} is {w.state.value}; it cannot be placed")
    allocs = ctx.placement_for(w)
    if allocs is None:
        return Wait(f"{w.id} does not fit yet")
    res = ctx.propose([Place(w.id, allocs)], f"reschedule: place {w.id} on the freed resources")
    if not res.accepted:
        return Wait("placement refused: " + "; ".join(res.reasons()))
    st["placed_by_workflow"] = True
    st["preemptor_nodes"] = _nodes(w)
    return Next(f"placed {w.id} on {', '.join(_nodes(w))}")


def _r_start(ctx: StepContext) -> Outcome:
    # The start edge belongs to the runtime: it pairs the ``Start`` with the backend's
    # start command (applying Start here would leave a workload no backend was asked to run).
    p: RescheduleParams = ctx.params
    w = ctx.workload(p.preemptor)
    if w is None:
        return Fail(f"unknown workload {p.preemptor!r}")
    if w.state in (State.STARTING, State.RUNNING, State.SUCCEEDED):
        return Next(f"{w.id} is {w.state.value}")
    if w.state is State.ADMITTED:
        return Wait(f"{w.id} is admitted; the runtime sends its start command")
    return Fail(f"{w.id} could not start: {_describe_end(w)}")


def _r_confirm_running(ctx: StepContext) -> Outcome:
    p: RescheduleParams = ctx.params
    st = ctx.state
    w = ctx.workload(p.preemptor)
    if w is None:
        return Fail(f"unknown workload {p.preemptor!r}")
    if w.state in (State.RUNNING, State.SUCCEEDED):
        info: dict[str, Any] = st.get("victims", {})
        saved = [
            f"{vid} saved {float(r['saved_progress']):.0%}"
            for vid, r in info.items()
            if r.get("saved_progress")
        ]
        tail = (
            f"; {', '.join(saved)} and wait{'s' if len(saved) == 1 else ''} in the queue"
            if saved
            else ""
        )
        return Finish(True, f"{w.id} is {w.state.value}{tail}")
    if w.state is State.STARTING:
        return Wait(f"{w.id} is starting")
    return Fail(f"{w.id} did not come up: {_describe_end(w)}")


def _r_resume_victims(ctx: StepContext) -> Outcome:
    st = ctx.state
    vs, err = _victims(ctx)
    if err is not None:
        return Fail(err)
    info: dict[str, Any] = st.get("victims", {})
    notes: list[str] = []
    waiting: list[str] = []
    for v in vs:
        rec = info.get(v.id)
        if rec is None or rec.get("resumed"):
            continue  # never asked to stop (or resumed on an earlier tick)
        note = _resume_one(ctx, v, rec)
        if note is None:
            waiting.append(rec.pop("waiting", f"{v.id} is not resumed yet"))
        else:
            rec["resumed"] = True
            notes.append(note)
    if waiting:
        return Wait("; ".join(waiting))
    return Next("; ".join(notes) or "nothing to resume")


def _resume_one(ctx: StepContext, v: Workload, rec: dict[str, Any]) -> str | None:
    """Resume one victim; returns what was done, or None (with ``rec['waiting']``) to wait."""
    if v.state in TERMINAL or v.state is State.FAILED:
        return f"nothing to resume: {v.id} is {v.state.value}"
    if v.state is State.PREEMPTING:
        rec["waiting"] = f"{v.id} is still releasing; it is resumed once released"
        return None
    if v.holding:
        again = v.attempt > int(rec.get("attempt", v.attempt))
        return f"{v.id} is {v.state.value}" + (" again" if again else " (it was never stopped)")
    if v.state is not State.PREEMPTED:
        return f"{v.id} is {v.state.value}; the scheduler places it"
    tried: list[str] = []
    old = placement_from_json(rec["placement"]) if rec.get("placement") else ()
    for label, allocs in (("its old nodes", old), ("the best fit", None)):
        if allocs is None:
            allocs = ctx.placement_for(v)
        if not allocs:
            continue
        res = ctx.propose(
            [Place(v.id, tuple(allocs))],
            f"compensation: resume {v.id} from its checkpoint ({ctx.wf.data.get('error')})",
        )
        if res.accepted:
            return f"resumed {v.id} on {label} ({', '.join(_nodes(v))})"
        tried.append("; ".join(res.reasons()))
    rec["waiting"] = f"no room to resume {v.id} yet" + (f" ({tried[-1]})" if tried else "")
    return None


RESCHEDULE = WorkflowDefinition(
    kind="reschedule",
    doc="Move resources from running victims to a waiting, more urgent workload, gracefully.",
    params=RescheduleParams,
    steps=(
        Step(
            "checkpoint",
            _r_checkpoint,
            "ask the victims to checkpoint and stop (Preempt)",
            compensate=_r_resume_victims,
            compensate_doc="resume the victims from their checkpoints (their old nodes first)",
        ),
        Step(
            "wait_checkpoint",
            _r_wait_checkpoint,
            "wait while the victims checkpoint",
            timeout="checkpoint_timeout_s",
        ),
        Step(
            "confirm_release",
            _r_confirm_release,
            "confirm the backend released the victims' resources",
            timeout="checkpoint_timeout_s",
        ),
        Step(
            "place",
            _r_place,
            "place the preemptor on the freed resources",
            timeout="place_timeout_s",
        ),
        Step("start", _r_start, "see the runtime start the preemptor", timeout="start_timeout_s"),
        Step(
            "confirm_running",
            _r_confirm_running,
            "confirm the preemptor runs",
            timeout="running_timeout_s",
        ),
    ),
    subjects=lambda p: (p.preemptor, *p.all_victims),
    check=_check_reschedule,
    compensation_timeout="compensation_timeout_s",
)
