"""Durable pipeline runs, their steps, and the model registry (tables of schema 0002).

``pipeline_runs`` holds one row per run (spec, parameters, metrics,
artifacts, status); ``pipeline_steps`` one row per step of a run (workload
ids, attempts, metrics, outputs, error); ``models`` one row per registered
model version with its stage. JSON columns are sanitised (credentials never
stored) and written canonically, as everywhere in the store.

Model stages: ``candidate`` (registered, not serving), ``production`` (the
one version served; at most one per model), ``retired`` (was production,
replaced by a promotion), ``rolled-back`` (was production, removed by a
rollback), ``rejected`` (a promotion was refused for it). The production
version is also written to ``<data_dir>/models/<name>/production.json``
(atomically) so that serving processes, which do not open the database,
follow promotions and rollbacks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, func, select, update

from mlwe.store import schema as S
from mlwe.store.repository import Repository
from mlwe.store.rows import canonical_json, upsert
from mlwe.store.sanitize import sanitize


class RegistryError(ValueError):
    """A registry operation that cannot be done (unknown model or version, wrong stage)."""


def _json(value: Any) -> str:
    return canonical_json(sanitize(value))


def _load(text: str | None, default: Any) -> Any:
    return json.loads(text) if text else default


@dataclass
class StepRecord:
    run_id: str
    step: str
    status: str
    kind: str = "batch"
    workload_id: str | None = None
    workloads: list[str] = field(default_factory=list)
    attempts: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    started: float | None = None
    finished: float | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "kind": self.kind,
            "status": self.status,
            "workload_id": self.workload_id,
            "workloads": list(self.workloads),
            "attempts": self.attempts,
            "metrics": dict(self.metrics),
            "outputs": dict(self.outputs),
            "started": self.started,
            "finished": self.finished,
            "error": self.error,
        }


@dataclass
class RunRecord:
    id: str
    pipeline: str
    status: str
    spec: dict[str, Any]
    params: dict[str, Any]
    created: float
    updated: float
    correlation_id: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    actor: str = "user"
    rationale: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "pipeline": self.pipeline,
            "status": self.status,
            "actor": self.actor,
            "rationale": self.rationale,
            "correlation_id": self.correlation_id,
            "params": dict(self.params),
            "metrics": dict(self.metrics),
            "artifacts": dict(self.artifacts),
            "created": self.created,
            "updated": self.updated,
            "steps": [s.to_dict() for s in self.steps],
        }


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: int
    stage: str
    path: str
    metrics: dict[str, Any]
    created: float
    run_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "stage": self.stage,
            "path": self.path,
            "metrics": dict(self.metrics),
            "created": self.created,
            "run_id": self.run_id,
        }


STAGES = ("candidate", "production", "retired", "rolled-back", "rejected")


class PipelineStore:
    """Reads and writes ``pipeline_runs`` and ``pipeline_steps``."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo

    # ------------------------------------------------------------------ writes
    def save_run(self, run: RunRecord, steps: list[StepRecord] | None = None) -> None:
        """Write the run (and ``steps``) in one transaction; idempotent."""
        row = {
            "id": run.id,
            "pipeline": run.pipeline,
            "status": run.status,
            "correlation_id": run.correlation_id,
            "spec": _json(run.spec),
            "params": _json(run.params),
            "metrics": _json(run.metrics),
            "artifacts": _json(run.artifacts),
            "created": run.created,
            "updated": run.updated,
            "actor": run.actor,
            "rationale": run.rationale,
        }

        def go(c: Connection) -> None:
            upsert(c, S.pipeline_runs, ["id"], [row])
            for st in steps or ():
                upsert(c, S.pipeline_steps, ["run_id", "step"], [self._step_row(st)])

        self.repo.write(go)

    @staticmethod
    def _step_row(st: StepRecord) -> dict[str, Any]:
        return {
            "run_id": st.run_id,
            "step": st.step,
            "workload_id": st.workload_id,
            "status": st.status,
            "attempts": st.attempts,
            "metrics": _json(st.metrics),
            "outputs": _json(st.outputs),
            "started": st.started,
            "finished": st.finished,
            "kind": st.kind,
            "workloads": _json(st.workloads),
            "error": st.error,
        }

    # ------------------------------------------------------------------- reads
    def next_number(self, pipeline: str) -> int:
        t = S.pipeline_runs
        q = select(func.count()).select_from(t).where(t.c.pipeline == pipeline)
        with self.repo.engine.connect() as c:
            return int(c.execute(q).scalar() or 0) + 1

    def exists(self, run_id: str) -> bool:
        t = S.pipeline_runs
        with self.repo.engine.connect() as c:
            return c.execute(select(t.c.id).where(t.c.id == run_id)).first() is not None

    def runs(
        self, pipeline: str | None = None, *, limit: int = 50, statuses: tuple[str, ...] = ()
    ) -> list[RunRecord]:
        """The latest runs, newest first (without their steps)."""
        t = S.pipeline_runs
        q = select(t).order_by(t.c.created.desc(), t.c.id.desc()).limit(limit)
        if pipeline is not None:
            q = q.where(t.c.pipeline == pipeline)
        if statuses:
            q = q.where(t.c.status.in_(statuses))
        with self.repo.engine.connect() as c:
            rows = c.execute(q).mappings().all()
        return [self._run(r) for r in rows]

    def run(self, run_id: str) -> RunRecord | None:
        t, st = S.pipeline_runs, S.pipeline_steps
        with self.repo.engine.connect() as c:
            row = c.execute(select(t).where(t.c.id == run_id)).mappings().first()
            if row is None:
                return None
            srows = c.execute(
                select(st).where(st.c.run_id == run_id).order_by(st.c.started, st.c.step)
            ).mappings().all()
        run = self._run(row)
        order = {name: i for i, name in enumerate(s.get("name") for s in run.spec.get("steps", []))}
        steps = [self._step(r) for r in srows]
        run.steps = sorted(steps, key=lambda s: order.get(s.step, len(order)))
        return run

    @staticmethod
    def _run(r: Any) -> RunRecord:
        return RunRecord(
            id=r["id"],
            pipeline=r["pipeline"],
            status=r["status"],
            spec=_load(r["spec"], {}),
            params=_load(r["params"], {}),
            created=r["created"],
            updated=r["updated"],
            correlation_id=r["correlation_id"],
            metrics=_load(r["metrics"], {}),
            artifacts=_load(r["artifacts"], {}),
            actor=r["actor"],
            rationale=r["rationale"],
        )

    @staticmethod
    def _step(r: Any) -> StepRecord:
        return StepRecord(
            run_id=r["run_id"],
            step=r["step"],
            status=r["status"],
            kind=r["kind"],
            workload_id=r["workload_id"],
            workloads=_load(r["workloads"], []),
            attempts=r["attempts"],
            metrics=_load(r["metrics"], {}),
            outputs=_load(r["outputs"], {}),
            started=r["started"],
            finished=r["finished"],
            error=r["error"],
        )


class ModelRegistry:
    """Model versions and their stages in the ``models`` table (see the module docstring)."""

    def __init__(self, repo: Repository, data_dir: str | Path) -> None:
        self.repo = repo
        self.data_dir = Path(data_dir)

    # ------------------------------------------------------------------- reads
    def versions(self, name: str | None = None) -> list[ModelVersion]:
        t = S.models
        q = select(t).order_by(t.c.name, t.c.version)
        if name is not None:
            q = q.where(t.c.name == name)
        with self.repo.engine.connect() as c:
            return [self._mv(r) for r in c.execute(q).mappings().all()]

    def get(self, name: str, version: int) -> ModelVersion:
        t = S.models
        with self.repo.engine.connect() as c:
            r = c.execute(
                select(t).where(t.c.name == name, t.c.version == version)
            ).mappings().first()
        if r is None:
            known = [v.version for v in self.versions(name)]
            raise RegistryError(
                f"model {name!r} has no version {version}"
                + (f" (versions: {', '.join(map(str, known))})" if known else " (no versions)")
            )
        return self._mv(r)

    def production(self, name: str) -> ModelVersion | None:
        prod = [v for v in self.versions(name) if v.stage == "production"]
        return prod[-1] if prod else None

    def pointer_path(self, name: str) -> Path:
        return self.data_dir / "models" / name / "production.json"

    @staticmethod
    def _mv(r: Any) -> ModelVersion:
        return ModelVersion(
            name=r["name"],
            version=r["version"],
            stage=r["stage"],
            path=r["path"],
            metrics=_load(r["metrics"], {}),
            created=r["created"],
            run_id=r["run_id"],
        )

    # ------------------------------------------------------------------ writes
    def register(
        self,
        name: str,
        path: str | Path,
        *,
        metrics: dict[str, Any] | None = None,
        run_id: str | None = None,
        time: float,
    ) -> ModelVersion:
        """A new candidate version (the next number) for ``path``, which must exist."""
        if not Path(path).exists():
            raise RegistryError(f"model {name!r}: artifact {path} does not exist")
        t = S.models
        out: list[ModelVersion] = []

        def go(c: Connection) -> None:
            out.clear()
            n = c.execute(select(func.max(t.c.version)).where(t.c.name == name)).scalar()
            version = int(n or 0) + 1
            row = {
                "name": name,
                "version": version,
                "stage": "candidate",
                "run_id": run_id,
                "path": str(path),
                "metrics": _json(metrics or {}),
                "created": time,
            }
            c.execute(t.insert(), row)
            out.append(self._mv({**row, "metrics": row["metrics"]}))

        self.repo.write(go)
        return out[0]

    def _set_stages(self, name: str, changes: dict[int, str]) -> None:
        t = S.models

        def go(c: Connection) -> None:
            for version, stage in changes.items():
                c.execute(
                    update(t).where(t.c.name == name, t.c.version == version).values(stage=stage)
                )

        self.repo.write(go)

    def promote(self, name: str, version: int) -> ModelVersion | None:
        """Make ``version`` production; the previous production is retired (returned)."""
        mv = self.get(name, version)
        if mv.stage == "production":
            raise RegistryError(f"model {name!r} version {version} is already production")
        prev = self.production(name)
        changes = {version: "production"}
        if prev is not None:
            changes[prev.version] = "retired"
        self._set_stages(name, changes)
        self._write_pointer(self.get(name, version))
        return prev

    def rollback(self, name: str) -> tuple[ModelVersion, ModelVersion]:
        """Put back the most recently retired version; returns (removed, restored)."""
        prod = self.production(name)
        if prod is None:
            raise RegistryError(f"model {name!r} has no production version to roll back")
        retired = [v for v in self.versions(name) if v.stage == "retired"]
        if not retired:
            raise RegistryError(
                f"model {name!r}: no earlier production version to roll back to"
                f" (version {prod.version} is the only one that served)"
            )
        back = retired[-1]
        self._set_stages(name, {prod.version: "rolled-back", back.version: "production"})
        restored = self.get(name, back.version)
        self._write_pointer(restored)
        return prod, restored

    def reject(self, name: str, version: int) -> None:
        mv = self.get(name, version)
        if mv.stage != "candidate":
            raise RegistryError(f"model {name!r} version {version} is {mv.stage}, not a candidate")
        self._set_stages(name, {version: "rejected"})

    def _write_pointer(self, mv: ModelVersion) -> None:
        p = self.pointer_path(mv.name)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(mv.to_dict(), sort_keys=True), encoding="utf-8")
        os.replace(tmp, p)  # readers see the old pointer or the new one, never half of one
