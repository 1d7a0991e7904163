"""Read-only pipeline routes: runs (with steps, in pipeline order) and the model registry."""

from __future__ import annotations

from pathlib import Path

from mlwe.api.auth import Role
from mlwe.store.pipelines import ModelRegistry, PipelineStore, RunRecord, StepRecord
from tests.api.conftest import Api


def test_runs_and_models_are_listed_and_secrets_are_not(api: Api, tmp_path: Path) -> None:
    repo = api.engine.repo
    spec = {"name": "digits", "steps": [{"name": "train"}, {"name": "evaluate"}]}
    run = RunRecord(id="digits-1", pipeline="digits", status="succeeded", spec=spec,
                    params={"lr": 0.1, "api_key": "sk-" + "z" * 40}, created=1.0, updated=2.0,
                    metrics={"accuracy": 0.97})
    PipelineStore(repo).save_run(run, [
        StepRecord("digits-1", "evaluate", "succeeded", workload_id="digits-1-evaluate",
                   started=1.6, finished=1.9),
        StepRecord("digits-1", "train", "succeeded", workload_id="digits-1-train",
                   started=1.1, finished=1.5),
    ])
    model = tmp_path / "model.pkl"
    model.write_bytes(b"weights")
    ModelRegistry(repo, tmp_path).register("digits", model, metrics={"accuracy": 0.97},
                                           run_id="digits-1", time=2.0)

    r = api.client.get("/api/v1/pipelines/runs", headers=api.h(Role.VIEWER))
    assert r.status_code == 200
    runs = r.json()["runs"]
    assert [x["id"] for x in runs] == ["digits-1"] and "steps" not in runs[0]
    assert "sk-" not in r.text  # a credential in the parameters never leaves the engine

    r = api.client.get("/api/v1/pipelines/runs/digits-1", headers=api.h(Role.VIEWER))
    assert [s["step"] for s in r.json()["run"]["steps"]] == ["train", "evaluate"]
    assert r.json()["run"]["metrics"] == {"accuracy": 0.97}

    r = api.client.get("/api/v1/pipelines/runs/nope", headers=api.h(Role.VIEWER))
    assert r.status_code == 404 and "nope" in r.json()["detail"]

    r = api.client.get("/api/v1/pipelines/models?name=digits", headers=api.h(Role.VIEWER))
    assert [(m["name"], m["version"], m["stage"]) for m in r.json()["models"]] == [
        ("digits", 1, "candidate")]
    assert api.client.get("/api/v1/pipelines/models").status_code == 401
