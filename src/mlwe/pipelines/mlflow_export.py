"""Export pipeline runs and their metrics to MLflow (optional: ``pip install 'mlwe[mlflow]'``).

For teams that already track experiments in MLflow: each pipeline run becomes
an MLflow run in the experiment named after the pipeline (parameters,
numeric metrics, status, times, and the artifact paths as tags), each step a
nested run with its own metrics, and the whole run record is logged as the
artifact ``mlwe_run.json``. Exporting is idempotent: a run already exported
(tag ``mlwe.run_id``) is skipped. Any tracking URI works; a plain directory
or ``file:`` URI is MLflow's local file store, which MLflow 3 keeps in
maintenance mode and allows only when ``MLFLOW_ALLOW_FILE_STORE`` is set: the
exporter sets it for such URIs.

The import of ``mlflow`` is guarded: without the extra, :func:`export_runs`
raises :class:`MlflowMissing` with the command to install it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlwe.store.pipelines import PipelineStore, RunRecord

_STATUS = {
    "succeeded": "FINISHED",
    "failed": "FAILED",
    "cancelled": "KILLED",
}


class MlflowMissing(RuntimeError):
    """MLflow is not installed."""


@dataclass(frozen=True)
class Exported:
    run_id: str
    mlflow_run_id: str
    experiment_id: str
    skipped: bool  # already exported before


def _client(tracking_uri: str) -> Any:
    try:
        from mlflow.tracking import MlflowClient  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise MlflowMissing(
            "MLflow export needs the mlflow client: pip install 'mlwe[mlflow]'"
            f" ({type(exc).__name__}: {exc})"
        ) from None
    uri = tracking_uri
    if "://" not in uri:  # a plain directory: MLflow's local file store
        uri = Path(uri).resolve().as_uri()
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=uri)


def _numbers(d: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in d.items():
        if isinstance(v, bool) or (isinstance(v, int | float) and math.isfinite(float(v))):
            out[k] = float(v)
    return out


def _ms(t: float | None) -> int | None:
    return None if t is None else int(t * 1000)


def export_runs(
    store: PipelineStore,
    tracking_uri: str,
    run_ids: list[str] | None = None,
    *,
    experiment: str | None = None,
    limit: int = 100,
) -> list[Exported]:
    """Export ``run_ids`` (default: the latest ``limit`` runs); see the module docstring."""
    client = _client(tracking_uri)
    if run_ids:
        runs = []
        for rid in run_ids:
            rec = store.run(rid)
            if rec is None:
                raise KeyError(f"no pipeline run {rid!r}")
            runs.append(rec)
    else:
        runs = [r for r in (store.run(x.id) for x in store.runs(limit=limit)) if r is not None]
    return [_export_one(client, rec, experiment or f"mlwe/{rec.pipeline}") for rec in runs]


def _experiment(client: Any, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    return str(exp.experiment_id) if exp is not None else str(client.create_experiment(name))


def _export_one(client: Any, rec: RunRecord, experiment: str) -> Exported:
    exp_id = _experiment(client, experiment)
    found = client.search_runs(
        [exp_id], filter_string=f"tags.`mlwe.run_id` = '{rec.id}'", max_results=1
    )
    if found:
        return Exported(rec.id, found[0].info.run_id, exp_id, True)
    tags = {
        "mlwe.run_id": rec.id,
        "mlwe.pipeline": rec.pipeline,
        "mlwe.status": rec.status,
        "mlwe.correlation_id": rec.correlation_id or "",
        **{f"mlwe.artifact.{k}": v for k, v in rec.artifacts.items()},
    }
    run = client.create_run(exp_id, start_time=_ms(rec.created), tags=tags, run_name=rec.id)
    rid = run.info.run_id
    for k, v in rec.params.items():
        client.log_param(rid, k, v)
    stamp = _ms(rec.updated)
    for k, v in _numbers(rec.metrics).items():
        client.log_metric(rid, k, v, timestamp=stamp)
    for st in rec.steps:
        child = client.create_run(
            exp_id,
            start_time=_ms(st.started or rec.created),
            run_name=f"{rec.id}/{st.step}",
            tags={
                "mlflow.parentRunId": rid,
                "mlwe.run_id": f"{rec.id}/{st.step}",
                "mlwe.step": st.step,
                "mlwe.kind": st.kind,
                "mlwe.status": st.status,
                "mlwe.workloads": ",".join(st.workloads),
                **({"mlwe.error": st.error[:5000]} if st.error else {}),
            },
        )
        cid = child.info.run_id
        for k, v in _numbers(st.metrics).items():
            client.log_metric(cid, k, v, timestamp=_ms(st.finished or rec.updated))
        client.set_terminated(cid, _STATUS.get(st.status, "FINISHED"), end_time=_ms(st.finished))
    client.log_dict(rid, rec.to_dict(), "mlwe_run.json")
    if rec.status in _STATUS:
        client.set_terminated(rid, _STATUS[rec.status], end_time=_ms(rec.updated))
    return Exported(rec.id, rid, exp_id, False)
