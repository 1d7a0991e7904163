"""The Backend protocol: what the engine asks of whatever runs workloads.

One narrow protocol for the simulator, the local daemon and Ray (DESIGN
convention 8). Commands are idempotent by ``request_id``: sending the same
command twice has the effect of sending it once. Results come back as
:class:`Event` values whose ``fact`` is a core action about one attempt
(``Started``, ``Progress``, ``Released``, ``Exited``) or a node fact; each has
an ``event_id`` so duplicates are acknowledged and ignored by the control
plane. Telemetry is observation, not state: it never changes the control plane.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mlwe.core.actions import Exited, Progress, Released, Started
from mlwe.core.capacity import ReplicaAlloc
from mlwe.core.spec import WorkloadSpec


@dataclass(frozen=True, slots=True)
class StartCommand:
    request_id: str
    workload: str
    attempt: int
    placement: tuple[ReplicaAlloc, ...]
    spec: WorkloadSpec
    resume_work_s: float = 0.0  # seconds of work already saved in checkpoints
    correlation_id: str | None = None  # the story this start belongs to (the submission's)
    kind = "start"


@dataclass(frozen=True, slots=True)
class StopCommand:
    """Ask a workload to checkpoint and stop within ``grace_s``, then force it.

    ``grace_s == 0`` is a force-stop: no checkpoint is waited for. ``reason`` is
    "preempt", "cancel", or "orphan" (running on the backend but unknown to the
    engine, found when reconciling after a restart)."""

    request_id: str
    workload: str
    attempt: int
    grace_s: float
    reason: str
    correlation_id: str | None = None
    kind = "stop"


Command = StartCommand | StopCommand


def dispatch(
    commands: Sequence[Command],
    seen: set[str],
    start: Callable[[StartCommand], None],
    stop: Callable[[StopCommand], None],
) -> None:
    """Carry out each command once: a request id already in ``seen`` is skipped (the
    idempotence every backend owes), a new one is recorded, then started or stopped."""
    for c in commands:
        if c.request_id in seen:
            continue
        seen.add(c.request_id)
        if isinstance(c, StartCommand):
            start(c)
        else:
            stop(c)


@dataclass(frozen=True, slots=True)
class NodeDown:
    node: str
    reason: str = "heartbeat lost"


@dataclass(frozen=True, slots=True)
class NodeUp:
    node: str


Fact = Started | Progress | Released | Exited | NodeDown | NodeUp


@dataclass(frozen=True, slots=True)
class Event:
    event_id: str
    time: float
    fact: Fact
    correlation_id: str | None = None


@dataclass(frozen=True, slots=True)
class Telemetry:
    """A sample of what something uses; ``declared`` marks figures that are the
    allocation, not a measurement (e.g. GPU numbers where no GPU exists)."""

    time: float
    node: str
    workload: str | None
    metrics: Mapping[str, float] = field(default_factory=dict)
    declared: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RunningAttempt:
    """What a backend says it is running now (asked once after an engine restart)."""

    workload: str
    attempt: int
    nodes: tuple[str, ...]


class Backend(Protocol):
    name: str

    def send(self, commands: Sequence[Command]) -> None:
        """Queue commands for execution (idempotent by request id)."""
        ...

    def poll(self) -> list[Event]:
        """Events that happened since the last poll, in order."""
        ...

    def drain_telemetry(self) -> list[Telemetry]:
        """Telemetry samples taken since the last call, oldest first."""
        ...

    def inventory(self) -> list[RunningAttempt]:
        """Every attempt the backend holds resources for right now.

        The engine calls it after a restart to reconcile the stored state with
        reality: adopt what runs, stop orphans, requeue what vanished."""
        ...

    def close(self) -> None:
        """Stop everything the backend started for this engine and free it."""
        ...
