"""What the pipeline runner keeps and reports about a run: step and run statuses, the
:class:`PipelineEvent` s it announces, a service's :class:`Endpoint` s, the run it follows in
memory, and which workload states count as gone (see :mod:`mlwe.pipelines.runner`)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlwe.core.controlplane import NOT_ITS_FAULT
from mlwe.core.lifecycle import State
from mlwe.core.model import Workload
from mlwe.pipelines.spec import (
    PipelineSpec,
)
from mlwe.store.pipelines import RunRecord, StepRecord


class StepStatus(enum.StrEnum):
    WAITING = "waiting"  # dependencies or inputs not there yet
    SUBMITTED = "submitted"  # its workload is queued or starting
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"  # a dependency failed
    CANCELLED = "cancelled"
    SERVING = "serving"  # service: every replica up
    STOPPED = "stopped"  # service: stopped with its run


class RunStatus(enum.StrEnum):
    RUNNING = "running"
    SERVING = "serving"  # batch steps done, services up
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINISHED_STEPS = frozenset(
    {StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.SKIPPED, StepStatus.CANCELLED,
     StepStatus.STOPPED}
)
FINISHED_RUNS = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})


@dataclass(frozen=True)
class PipelineEvent:
    """Something that happened to a run: ``run.started``, ``step.waiting`` (with the
    scheduler's reason), ``step.running``,
    ``step.succeeded``, ``step.failed``, ``step.serving``, ``model.registered``,
    ``service.scaled``, ``run.succeeded``, ``run.failed``, ``run.serving``, ..."""

    kind: str
    run_id: str
    pipeline: str
    time: float
    step: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "run_id": self.run_id,
            "pipeline": self.pipeline,
            "time": self.time,
            "step": self.step,
            "data": dict(self.data),
        }


@dataclass(frozen=True)
class Endpoint:
    workload: str
    url: str
    nodes: tuple[str, ...]


@dataclass
class _Run:
    spec: PipelineSpec
    record: RunRecord
    steps: dict[str, StepRecord]
    values: dict[str, str]
    run_dir: Path
    actor: str
    rationale: str | None
    next_replica: dict[str, int] = field(default_factory=dict)
    targets: dict[str, int] = field(default_factory=dict)  # service -> replicas wanted
    settled: bool = False  # finished, and no replica of its services can come back
    stopping: str | None = None  # why it was stopped: its batch steps are cancelled as they can
    waiting: dict[str, str] = field(default_factory=dict)  # step -> why its workload waits

    @property
    def id(self) -> str:
        return self.record.id


def _terminally_failed(w: Workload) -> bool:
    return (
        w.state is State.FAILED
        and w.failures > w.spec.max_retries
        and w.failure_cause not in NOT_ITS_FAULT
    )


def _gone(w: Workload) -> bool:
    return w.state in (State.CANCELLED, State.SUCCEEDED) or _terminally_failed(w)


def _counts(w: Workload) -> bool:
    """Whether a replica counts toward its service's replicas: not gone, not being cancelled."""
    return not _gone(w) and w.state is not State.STOPPING
