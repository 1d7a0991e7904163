"""Export of pipeline runs to MLflow, against a local file store and a SQLite store.

MLflow is the optional extra ``mlwe[mlflow]`` (in dev): missing, these tests
skip, except under ``CI=true`` where they fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlwe.cli import app
from mlwe.pipelines.spec import Pipeline
from tests.pipelines.conftest import SimRig

if os.environ.get("CI") == "true":
    import mlflow  # noqa: F401  (CI installs the dev extras: it must be there)
else:
    pytest.importorskip("mlflow", reason="MLflow export needs mlwe[mlflow]")

from mlflow.tracking import MlflowClient

from mlwe.pipelines.mlflow_export import export_runs


def _run(sim: SimRig) -> str:
    p = Pipeline("exp", params={"lr": 0.1}, defaults={"estimated_duration": "5s"})
    p.step("a", ["x"], outputs={"model": "m.bin"})
    p.step("b", ["y"], depends_on=["a"])
    run = sim.runner.start(p.build())
    sim.until(lambda: sim.runner.status(run.id) == "succeeded")
    return run.id


@pytest.mark.parametrize("store", ["file", "sqlite"])
def test_runs_export_with_steps_nested_and_only_once(sim: SimRig, tmp_path: Path,
                                                     store: str) -> None:
    rid = _run(sim)
    uri = str(tmp_path / "mlruns") if store == "file" else f"sqlite:///{tmp_path / 'mlf.db'}"
    done = export_runs(sim.runner.store, uri)
    assert len(done) == 1 and not done[0].skipped and done[0].run_id == rid
    client = MlflowClient(
        tracking_uri=(tmp_path / "mlruns").as_uri() if store == "file" else uri
    )
    parent = client.get_run(done[0].mlflow_run_id)
    assert parent.info.status == "FINISHED" and parent.info.run_name == rid
    assert parent.data.params == {"lr": "0.1"}
    assert parent.data.tags["mlwe.pipeline"] == "exp"
    assert parent.data.tags["mlwe.artifact.a.model"].endswith(f"runs/{rid}/m.bin")
    children = client.search_runs(
        [done[0].experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    assert sorted(c.data.tags["mlwe.step"] for c in children) == ["a", "b"]
    assert {c.info.status for c in children} == {"FINISHED"}
    again = export_runs(sim.runner.store, uri)
    assert again[0].skipped and again[0].mlflow_run_id == done[0].mlflow_run_id


def test_cli_export_and_unknown_run(sim: SimRig, tmp_path: Path) -> None:
    rid = _run(sim)
    cli = CliRunner()
    data = str(sim.runner.data_dir)
    res = cli.invoke(app, ["runs", "export-mlflow", "--tracking-uri", str(tmp_path / "m"),
                           "--data-dir", data])
    assert res.exit_code == 0 and f"{rid}: exported as MLflow run" in res.output
    bad = cli.invoke(app, ["runs", "export-mlflow", "nope-1", "--tracking-uri",
                           str(tmp_path / "m"), "--data-dir", data])
    assert bad.exit_code == 2 and "no pipeline run 'nope-1'" in bad.output
