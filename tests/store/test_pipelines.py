"""Runs, steps and the model registry in the store (schema 0002 tables)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlwe.store.pipelines import (
    ModelRegistry,
    PipelineStore,
    RegistryError,
    RunRecord,
    StepRecord,
)
from mlwe.store.repository import Repository


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[Repository]:
    r = Repository.open(data_dir=tmp_path, upgrade=True)
    yield r
    r.close()


def test_runs_and_steps_round_trip_and_are_sanitised(repo: Repository) -> None:
    store = PipelineStore(repo)
    run = RunRecord(
        id="p-1", pipeline="p", status="running", spec={"steps": [{"name": "b"}, {"name": "a"}]},
        params={"seed": 1, "api_key": "sk-abcdefghijklmnopqrstuvwx"}, created=10.0, updated=10.0,
    )
    steps = [StepRecord("p-1", "a", "waiting"), StepRecord("p-1", "b", "waiting", kind="service")]
    store.save_run(run, steps)
    assert store.next_number("p") == 2 and store.exists("p-1")
    steps[0].status, steps[0].workloads, steps[0].metrics = "succeeded", ["p-1.a"], {"acc": 0.9}
    run.status, run.updated = "succeeded", 12.0
    store.save_run(run, [steps[0]])  # idempotent upsert: only what changed
    got = store.run("p-1")
    assert got is not None and got.status == "succeeded" and got.updated == 12.0
    assert [s.step for s in got.steps] == ["b", "a"]  # the spec's order
    assert got.steps[1].metrics == {"acc": 0.9} and got.steps[1].workloads == ["p-1.a"]
    assert got.steps[0].kind == "service"
    assert got.params["seed"] == 1
    assert "sk-abcdefghij" not in json.dumps(got.params)  # the sanitizer ran
    assert [r.id for r in store.runs()] == ["p-1"] and store.runs("other") == []
    assert store.run("p-2") is None


def test_registry_stages_promote_rollback_reject(repo: Repository, tmp_path: Path) -> None:
    reg = ModelRegistry(repo, tmp_path)
    art = tmp_path / "m.pkl"
    art.write_bytes(b"model")
    with pytest.raises(RegistryError, match=r"artifact .*absent\.pkl does not exist"):
        reg.register("digits", tmp_path / "absent.pkl", time=1.0)
    v1 = reg.register("digits", art, metrics={"accuracy": 0.9}, run_id="r1", time=1.0)
    v2 = reg.register("digits", art, metrics={"accuracy": 0.95}, run_id="r2", time=2.0)
    v3 = reg.register("digits", art, time=3.0)
    assert (v1.version, v2.version, v3.version) == (1, 2, 3)
    assert reg.production("digits") is None
    with pytest.raises(RegistryError, match="no production version to roll back"):
        reg.rollback("digits")

    assert reg.promote("digits", 1) is None
    pointer = json.loads(reg.pointer_path("digits").read_text())
    assert pointer["version"] == 1 and pointer["path"] == str(art)
    with pytest.raises(RegistryError, match="only one that served"):
        reg.rollback("digits")
    prev = reg.promote("digits", 2)
    assert prev is not None and prev.version == 1
    assert {v.version: v.stage for v in reg.versions("digits")} == {
        1: "retired", 2: "production", 3: "candidate",
    }
    with pytest.raises(RegistryError, match="already production"):
        reg.promote("digits", 2)

    removed, restored = reg.rollback("digits")
    assert (removed.version, restored.version) == (2, 1)
    assert json.loads(reg.pointer_path("digits").read_text())["version"] == 1
    reg.reject("digits", 3)
    assert {v.version: v.stage for v in reg.versions("digits")} == {
        1: "production", 2: "rolled-back", 3: "rejected",
    }
    with pytest.raises(RegistryError, match="version 3 is rejected, not a candidate"):
        reg.reject("digits", 3)
    with pytest.raises(RegistryError, match=r"has no version 9 \(versions: 1, 2, 3\)"):
        reg.get("digits", 9)
