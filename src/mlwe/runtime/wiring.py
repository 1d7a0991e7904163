"""Wiring the agent and the workflows into a runtime :class:`~mlwe.runtime.engine.Engine`.

The agent (:mod:`mlwe.agent`) and the workflow runner (:mod:`mlwe.agent.workflows`)
know nothing of the runtime, an outer layer: they take a control plane, a lock and
callables. This module is where they meet an :class:`Engine`, typed:

- :func:`attach_workflows` loads the engine's stored workflows (one in flight when
  the engine stopped resumes at its step) and ticks them in the engine's tick hooks;
  their steps propose through :class:`EngineProposer`, the engine's one request path.
- :func:`attach_agent` runs an :class:`~mlwe.agent.loop.Agent` on the engine:
  telemetry in, proposals through ``Engine.propose``, reasoning records through
  ``Engine.record_reasoning``, its other steps into the audit, its preemption and
  recovery plans carried through the engine's workflows.

Each has its undo (:func:`detach_workflows`, ``Agent.close``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from mlwe.agent.loop import Agent, AgentConfig
from mlwe.agent.model import Mode
from mlwe.agent.reasoners.base import Reasoner
from mlwe.agent.workflows import Alert, Workflow, WorkflowRunner
from mlwe.core.actions import Action
from mlwe.core.backend import Telemetry
from mlwe.core.controlplane import ApplyResult
from mlwe.runtime.engine import Engine

log = logging.getLogger("mlwe.workflows")

__all__ = ["EngineProposer", "attach_agent", "attach_workflows", "detach_workflows"]


class EngineProposer:
    """Workflow steps' proposals through the engine's one request path (``Engine.propose``):
    the same checks and the same audit record as the agent's and any other request's."""

    def __init__(self, engine: Engine, actor: str = "workflow") -> None:
        self.engine = engine
        self.actor = actor

    def __call__(
        self, actions: Sequence[Action], *, correlation_id: str, rationale: str
    ) -> ApplyResult:
        return self.engine.propose(
            list(actions), actor=self.actor, correlation_id=correlation_id, rationale=rationale
        )


def attach_workflows(engine: Engine, *, actor: str = "workflow") -> WorkflowRunner:
    """The workflow runner of an engine, loaded from its store and ticked by it.

    Loaded from the engine's store, so a workflow in flight when an engine stopped
    resumes at its step after ``Engine.open`` on the same data; ticked in
    ``engine.tick_hooks`` (under the engine lock, after the scheduling cycle). Steps
    propose through an :class:`EngineProposer` (verified by the control plane; the
    audit record is written by the engine's flush with the effect). Each tick the hook
    first stores the workflows' previous tick (the engine has flushed the state they
    observed by then, so a stored workflow is never ahead of the cluster state),
    publishes their step events and alerts on the engine's ``state`` stream (``type``
    "workflow" and "workflow-alert"), then advances them.

    The engine keeps it as ``engine.workflows``; a second call returns the same one.
    Call ``start``/``cancel`` under ``engine.lock``. :func:`detach_workflows` undoes it.
    """
    if engine.workflows is not None:
        return engine.workflows
    with engine.lock:
        wfe = WorkflowRunner.load(
            engine.cp,
            engine.repo,
            scheduler=engine.scheduler,
            audit=engine.audit,
            proposer=EngineProposer(engine, actor),
            actor=actor,
            autoflush=False,  # the hook stores each tick once the engine flushed its state
        )
        out: list[tuple[dict[str, Any], str, str | None, float]] = []

        def on_step(wf: Workflow, entry: dict[str, Any]) -> None:
            subjects = wf.data.get("subjects") or [None]
            out.append(({"type": "workflow", "workflow": wf.id, "kind": wf.kind,
                         "status": wf.status, **entry}, wf.correlation_id, subjects[0],
                        float(entry["t"])))

        def on_alert(a: Alert) -> None:
            out.append(({"type": "workflow-alert", **a.to_dict()}, a.correlation_id, None, a.time))

        def hook(_engine: Engine) -> None:
            wfe.flush()
            events = list(out)
            out.clear()
            for data, cid, workload, t in events:
                engine.streams.publish("state", data, correlation_id=cid, workload=workload, time=t)
            wfe.tick()

        wfe.listeners.append(on_step)
        wfe.alert_listeners.append(on_alert)
        for wf in wfe.active.values():  # "resumed" entries were logged before the listener
            if wf.log:
                on_step(wf, wf.log[-1])
        engine.tick_hooks.append(hook)
        engine.workflows = wfe
        wfe._detach = lambda: engine.tick_hooks.remove(hook)
    return wfe


def detach_workflows(engine: Engine) -> None:
    """Undo :func:`attach_workflows` (stores what the workflows did last first)."""
    wfe = engine.workflows
    if wfe is None:
        return
    with engine.lock:
        if wfe._detach is not None:
            wfe._detach()
            wfe._detach = None
        try:
            wfe.flush()
        except Exception:  # the store is down: the workflows resume from their last row
            log.warning("workflows not stored on detach", exc_info=True)
        engine.workflows = None


def attach_agent(
    engine: Engine,
    *,
    mode: Mode | str = Mode.AUTONOMOUS,
    reasoner: Reasoner | str | None = None,
    config: AgentConfig | None = None,
    name: str = "agent",
    background: bool = True,
    workflows: bool = True,
) -> Agent:
    """An agent driving a runtime engine.

    Proposals go through ``engine.propose`` (verified, applied or rejected, and
    audited by the engine), reasoning records through ``engine.record_reasoning``
    (stored, chained in the audit log, streamed on "reasoning"), the other steps into
    the engine's audit; the agent takes telemetry from ``engine.telemetry_listeners``.

    ``workflows``: the engine's workflows are loaded from its store and ticked
    (:func:`attach_workflows`: one in flight when the engine stopped resumes now), and
    the agent carries its preemption and failure-recovery plans through them.

    ``background`` (the default): each engine tick only takes in telemetry and, when
    an analysis is due, wakes the agent's own thread, which analyses, deliberates and
    forecasts holding the engine lock only for its short phases (see
    :mod:`mlwe.agent.loop`). ``background=False``: the whole round runs inside the
    tick hook under the engine lock (deterministic: tests and engines ticked by hand).

    ``agent.close()`` stops the thread and undoes all of it.
    """

    def propose(actions: Sequence[Action], version: int | None, cid: str, why: str) -> ApplyResult:
        return engine.propose(
            actions, actor=name, expected_version=version, correlation_id=cid, rationale=why
        )

    def reasoning(rec: dict[str, Any]) -> None:
        engine.record_reasoning(rec, correlation_id=rec.get("correlation_id"), actor=name)

    def audit(rec: dict[str, Any]) -> None:
        # model-written text: redacted at rest by the writer (the request path would
        # refuse the whole record rather than redact it)
        engine.writer.note_audit(
            "agent", name, rec, workload=None, correlation_id=rec.get("correlation_id")
        )

    wfe: WorkflowRunner | None = None
    own_workflows = False
    if workflows:
        own_workflows = engine.workflows is None
        wfe = attach_workflows(engine)
    agent = Agent(engine.cp, reasoner=reasoner, mode=mode, config=config, propose=propose,
                  reasoning_sink=reasoning, audit_sink=audit, lock=engine.lock, name=name,
                  workflows=wfe, run_id=uuid.uuid4().hex[:6])

    def on_sample(sample: Telemetry) -> None:
        agent.observe([sample])

    def on_tick(_engine: Engine) -> None:
        if background:
            agent.background_tick()
        else:
            agent.tick()

    with engine.lock:
        engine.telemetry_listeners.append(on_sample)
        engine.tick_hooks.append(on_tick)
    agent.on_close(lambda: engine.telemetry_listeners.remove(on_sample))
    agent.on_close(lambda: engine.tick_hooks.remove(on_tick))
    if own_workflows:
        agent.on_close(lambda: detach_workflows(engine))
    if background:
        agent.start_background()
    return agent
