"""The workload lifecycle, as data.

``TRANSITIONS`` is the whole state machine: every allowed edge, with the
reason it exists. The control plane consults it for every state change and
rejects anything else with the workload's history attached, so a bug
elsewhere shows up as a clear rejection, not as silently corrupt state.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final


class State(enum.StrEnum):
    PENDING = "pending"
    ADMITTED = "admitted"  # placed: resources reserved on nodes
    STARTING = "starting"
    RUNNING = "running"
    PREEMPTING = "preempting"  # asked to checkpoint and stop; still holds resources
    PREEMPTED = "preempted"  # released; back in the queue, resumes from its checkpoint
    STOPPING = "stopping"  # cancelled while holding resources; waiting for release
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


S = State

TRANSITIONS: Final[Mapping[State, frozenset[State]]] = MappingProxyType(
    {
        S.PENDING: frozenset(
            {
                S.ADMITTED,  # scheduler placed every replica (gang all-or-nothing)
                S.CANCELLED,  # user cancelled before placement
            }
        ),
        S.ADMITTED: frozenset(
            {
                S.STARTING,  # runtime sent the start command to the backend
                S.PREEMPTING,  # evicted before it started; backend confirms nothing runs
                S.STOPPING,  # user cancelled after placement
                S.FAILED,  # backend refused the start (bad command, node lost)
            }
        ),
        S.STARTING: frozenset(
            {
                S.RUNNING,  # backend reports the process is up
                S.PREEMPTING,  # evicted while starting
                S.STOPPING,  # user cancelled while starting
                S.FAILED,  # start failed or node lost
                S.SUCCEEDED,  # finished before the started event arrived (fast job)
            }
        ),
        S.RUNNING: frozenset(
            {
                S.SUCCEEDED,  # exited with code 0
                S.FAILED,  # exited non-zero, OOM-killed, or its node was lost
                S.PREEMPTING,  # a strictly higher priority (or quota reclaim) needs its resources
                S.STOPPING,  # user or agent cancelled it
            }
        ),
        S.PREEMPTING: frozenset(
            {
                S.PREEMPTED,  # backend confirmed release after the checkpoint (or force-stop)
                S.SUCCEEDED,  # it finished inside the grace period
                S.FAILED,  # it crashed inside the grace period, or its node was lost
                S.STOPPING,  # user cancelled it while it was being preempted
            }
        ),
        S.PREEMPTED: frozenset(
            {
                S.ADMITTED,  # placed again; resumes from its last checkpoint
                S.CANCELLED,  # user cancelled it while it waited
            }
        ),
        S.STOPPING: frozenset(
            {
                S.CANCELLED,  # backend confirmed release
            }
        ),
        S.FAILED: frozenset(
            {
                S.PENDING,  # retried: retries remain, or the failure was the node's
            }
        ),
        S.SUCCEEDED: frozenset(),  # terminal
        S.CANCELLED: frozenset(),  # terminal
    }
)

#: States in which a workload holds resources on nodes.
HOLDING: Final = frozenset({S.ADMITTED, S.STARTING, S.RUNNING, S.PREEMPTING, S.STOPPING})
#: States in which a workload waits in the queue for placement.
QUEUED: Final = frozenset({S.PENDING, S.PREEMPTED})
#: States that never change again (FAILED may still be retried).
TERMINAL: Final = frozenset({S.SUCCEEDED, S.CANCELLED})


@dataclass(frozen=True, slots=True)
class Transition:
    time: float
    source: State | None
    target: State
    reason: str
    cause_id: str | None = None


class IllegalTransition(ValueError):
    """An edge not in ``TRANSITIONS``; carries the workload's history."""

    def __init__(
        self, workload_id: str, source: State, target: State, history: Sequence[Transition]
    ):
        self.workload_id = workload_id
        self.source = source
        self.target = target
        self.history = tuple(history)
        allowed = ", ".join(sorted(TRANSITIONS[source])) or "none (terminal)"
        trail = " -> ".join(t.target.value for t in history[-8:])
        super().__init__(
            f"illegal transition {source.value} -> {target.value} for workload {workload_id}"
            f" (allowed from {source.value}: {allowed}; history: {trail})"
        )


def check_transition(
    workload_id: str, source: State, target: State, history: Sequence[Transition]
) -> None:
    if target not in TRANSITIONS[source]:
        raise IllegalTransition(workload_id, source, target, history)
