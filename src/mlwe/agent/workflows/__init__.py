"""Multi-step workflows: declarative, persisted, resumable step sequences.

The original system ran its multi-step operations as Cloud Workflows; here a
:class:`WorkflowDefinition` is the same idea as data: an ordered list of named
:class:`Step` values, each with an optional timeout and an optional
compensation (saga style), and a pydantic model for its parameters. Two
definitions ship:

``reschedule``
    ask the victim to checkpoint (``Preempt``) -> wait for the grace period
    -> confirm the backend released it -> place the preemptor -> see it start
    -> confirm it runs. If a later step fails (the preemptor cannot be placed
    or cannot start, or it is cancelled), the compensation of the first step
    resumes the victim: it is placed again, on its old nodes when they are
    free, and continues from its checkpoint.
``recover``
    failure recovery: retry with exponential backoff -> watch the new attempt
    -> move the workload off the nodes it failed on -> give up: a dead letter
    (the bus's ``dead_letters`` table, as a replayable envelope) and an alert.

Modules: ``model`` (outcomes, steps, definitions, the persisted workflow, what a
step sees), ``runner`` (the :class:`WorkflowRunner`), one per definition
(``reschedule``, ``recover``).

A :class:`WorkflowRunner` runs them. It has no thread of its own: the runtime
(or a test driving a bare control plane, simulated backend and reconciler)
calls :meth:`WorkflowRunner.tick` once per loop, and each running workflow
advances as far as it can without waiting. Steps act only through proposals
(the control plane verifies them; a rejection is a value the step reacts to)
and observe the state the backend's events produced. Every proposal carries
the workflow's correlation id as its cause, so decisions and transitions name
the workflow that caused them.

Persistence (table ``workflows``): the status, the current step and a JSON
document (parameters, step state, a bounded log) are written after each tick
(:meth:`WorkflowRunner.flush`), after the control plane's own changes are
durable (pass ``writer=`` or call ``flush`` after the store flush), so a stored
workflow is never ahead of the cluster state. Steps are written as "ensure"
operations (look first, act only if the effect is missing, go back a step if
an earlier effect was lost), so a crash anywhere resumes at the right step:
:meth:`WorkflowRunner.load` rebuilds the runner from the store.

Wiring into the runtime (``mlwe.runtime.Engine``) is
:func:`mlwe.runtime.wiring.attach_workflows` (``attach_agent``, which ``mlwe serve``
uses, calls it): it loads the
workflows from the engine's store, so one in flight when the engine stopped
resumes, and ticks them in the engine's tick hooks (call ``start``/``cancel``
under ``engine.lock``; the hook already runs under it). By hand it amounts to::

    workflows = WorkflowRunner.load(
        engine.cp, engine.repo, scheduler=engine.scheduler, audit=engine.audit,
        proposer=EngineProposer(engine), autoflush=False)  # mlwe.runtime.wiring
    engine.tick_hooks.append(workflows.tick_hook())  # stores the last tick, then ticks

The agent starts ``reschedule`` for its preemption plans and ``recover`` for
repeated failures, after committing the plan's first actions itself (the
first step then finds the preemption under way and adopts it).

In the runtime the scheduling cycle runs before the hooks, so the scheduler
may place a released preemptor or a retried workload before a step does;
the steps take that as done. The reconciler also retries failed workloads by
itself (and at once after a restart); the recovery workflow counts such a
retry as its own and adds what the runtime does not: moving off the failing
nodes, and giving up with a dead letter and an alert.
"""

from __future__ import annotations

from mlwe.agent.workflows.model import (
    Alert,
    AuditingProposer,
    ControlPlaneProposer,
    DeadLetterRecord,
    Fail,
    Finish,
    Goto,
    Next,
    Outcome,
    Proposer,
    Step,
    StepContext,
    Wait,
    Workflow,
    WorkflowDefinition,
    WorkflowError,
    WorkflowStatus,
)
from mlwe.agent.workflows.recover import RECOVER, RecoverParams
from mlwe.agent.workflows.reschedule import RESCHEDULE, RescheduleParams
from mlwe.agent.workflows.runner import DEFINITIONS, WorkflowRunner

__all__ = [
    "DEFINITIONS",
    "RECOVER",
    "RESCHEDULE",
    "Alert",
    "AuditingProposer",
    "ControlPlaneProposer",
    "DeadLetterRecord",
    "Fail",
    "Finish",
    "Goto",
    "Next",
    "Outcome",
    "Proposer",
    "RecoverParams",
    "RescheduleParams",
    "Step",
    "StepContext",
    "Wait",
    "Workflow",
    "WorkflowDefinition",
    "WorkflowError",
    "WorkflowRunner",
    "WorkflowStatus",
]
