"""Pipeline routes (read-only): runs with their steps, and the model registry.

Runs are started by ``mlwe pipeline run`` / the supervision agents, which
record them in the store; these routes let the dashboard and operators see
them (status, parameters, metrics, artifacts, each step's workloads) and which
model version serves in production.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query
from fastapi.concurrency import run_in_threadpool
from pydantic import Field

from mlwe.api.auth import Principal, Role, requires
from mlwe.api.context import API_PREFIX, ApiContext, get_ctx
from mlwe.api.errors import ApiError
from mlwe.api.models import ErrorBody, _Out
from mlwe.api.sse import finite
from mlwe.store.pipelines import PipelineStore
from mlwe.store.sanitize import sanitize

router = APIRouter(prefix=API_PREFIX)
Ctx = Annotated[ApiContext, Depends(get_ctx)]


class PipelineRunList(_Out):
    runs: list[dict[str, Any]] = Field(description="latest runs, newest first, without steps")


class PipelineRunDetail(_Out):
    run: dict[str, Any] = Field(description="the run with its steps, in the pipeline's order")


class ModelList(_Out):
    models: list[dict[str, Any]] = Field(description="model versions with stage and metrics")


def _clean(doc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = finite(sanitize(doc))
    return out


@router.get("/pipelines/runs", response_model=PipelineRunList, summary="List pipeline runs")
async def list_runs(
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.VIEWER)],
    pipeline: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> dict[str, Any]:
    store = PipelineStore(ctx.engine.repo)
    runs = await run_in_threadpool(store.runs, pipeline, limit=limit)
    return {"runs": [_clean({k: v for k, v in r.to_dict().items() if k != "steps"})
                     for r in runs]}


@router.get(
    "/pipelines/runs/{run_id}",
    response_model=PipelineRunDetail,
    summary="One pipeline run with its steps",
    responses={404: {"model": ErrorBody, "description": "no such run"}},
)
async def get_run(
    run_id: Annotated[str, Path(min_length=1, max_length=128)],
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.VIEWER)],
) -> dict[str, Any]:
    run = await run_in_threadpool(PipelineStore(ctx.engine.repo).run, run_id)
    if run is None:
        raise ApiError(404, f"unknown pipeline run {run_id!r}")
    return {"run": _clean(run.to_dict())}


@router.get("/pipelines/models", response_model=ModelList, summary="The model registry")
async def list_models(
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.VIEWER)],
    name: Annotated[str | None, Query(max_length=128)] = None,
) -> dict[str, Any]:
    from mlwe.store.pipelines import ModelRegistry

    reg = ModelRegistry(ctx.engine.repo, ".")
    versions = await run_in_threadpool(reg.versions, name)
    return {"models": [_clean(v.to_dict()) for v in versions]}
