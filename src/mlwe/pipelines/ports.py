"""The pipelines' port to an engine: what they need of one, as a structural type.

The runner, the supervisors and the loop drive any object with these members;
:class:`mlwe.runtime.engine.Engine` is the one the project has (a test double
or a remote engine would do as well). In the layering (DESIGN "Layers", the
import contract in ``pyproject.toml``) pipelines sit above the runtime, so they
may import it; their library code names this port instead, so that what they
rely on is written down in one place and checked by mypy, and only the
composition code (the CLI bodies and the case studies, which build an engine)
imports the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from mlwe.core.actions import Action
from mlwe.core.controlplane import ApplyResult, ControlPlane
from mlwe.core.spec import WorkloadSpec
from mlwe.store.repository import Repository


class AuditWriter(Protocol):
    def note_audit(
        self,
        kind: str,
        actor: str,
        payload: dict[str, Any],
        *,
        workload: str | None = None,
        correlation_id: str | None = None,
    ) -> None: ...


class EngineLike(AuditWriter, Protocol):  # note_audit: an audit note, as a request
    @property
    def cp(self) -> ControlPlane: ...

    @property
    def lock(self) -> AbstractContextManager[Any]: ...

    @property
    def repo(self) -> Repository: ...

    @property
    def writer(self) -> AuditWriter: ...

    def now(self) -> float: ...

    def wake(self) -> None: ...

    def tick(self) -> Any: ...

    def submit(
        self,
        specs: Sequence[WorkloadSpec],
        *,
        actor: str = ...,
        correlation_id: str | None = None,
    ) -> ApplyResult: ...

    def propose(
        self,
        actions: Sequence[Action],
        *,
        actor: str,
        expected_version: int | None = None,
        correlation_id: str | None = None,
        rationale: str | None = None,
    ) -> ApplyResult: ...

    def cancel(
        self, workload_id: str, *, actor: str = ..., correlation_id: str | None = None
    ) -> ApplyResult: ...

    def record_reasoning(
        self, record: dict[str, Any], *, correlation_id: str | None = None, actor: str = ...
    ) -> None: ...
