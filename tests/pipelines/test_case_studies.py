"""Both case studies, end to end and for real: local workload daemons, real processes.

Run through the CLI (``mlwe example ... --json``), then checked against what
the engine stored: every step happened, in order, through the control plane,
with its figures recorded. Timing goals (p95 under target, seconds to
promotion) are printed figures, not assertions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from mlwe.cli import app
from mlwe.pipelines.inference_scaling import QUEUE
from mlwe.pipelines.loadgen import LoadProfile
from mlwe.store.audit import AuditLog
from mlwe.store.pipelines import ModelRegistry, PipelineStore
from mlwe.store.repository import Repository

cli = CliRunner()


def run_json(*args: str) -> dict[str, Any]:
    res = cli.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("{")][-1]
    out: dict[str, Any] = json.loads(line)
    return out


def test_drift_retrain_promote(tmp_path: Path) -> None:
    r = run_json("example", "drift-retrain", "--data-dir", str(tmp_path))
    for key in ("accuracy_before_drift", "accuracy_on_drift", "accuracy_after_retrain",
                "promoted", "seconds_drift_to_promotion"):
        assert key in r, key
    assert r["promoted"] is True and r["finished"] is True
    assert r["accuracy_on_drift"] < r["accuracy_before_drift"] - 0.2  # the shift hurt
    assert r["accuracy_after_retrain"] > r["accuracy_on_drift"] + 0.2  # retraining helped
    assert r["holdout_accuracy_candidate"] > r["holdout_accuracy_production"]
    assert r["seconds_drift_to_promotion"] > r["seconds_drift_to_detection"] > 0
    assert min(r["samples"].values()) > 0

    # each step happened, in this order
    what = [(ev["what"], ev.get("version")) for ev in r["timeline"]]
    milestones = [("promoted", 1), ("drift-detected", 1), ("retrain-started", None),
                  ("candidate-registered", 2), ("promoted", 2)]
    positions = [what.index(m) for m in milestones]
    assert positions == sorted(positions), what

    repo = Repository.open(data_dir=tmp_path)
    try:
        models = {v.version: v for v in ModelRegistry(repo, tmp_path).versions("digits")}
        assert (models[1].stage, models[2].stage) == ("retired", "production")
        assert models[2].metrics["baseline_version"] == 1  # compared with what served
        assert models[2].metrics["accuracy"] == r["holdout_accuracy_candidate"]
        store = PipelineStore(repo)
        retrain = store.run(models[2].run_id or "")
        assert retrain is not None and retrain.status == "succeeded"
        assert retrain.params["since"] >= 0 and retrain.metrics["prepare.new_samples"] > 0
        assert [s.status for s in retrain.steps] == ["succeeded"] * 3
        audit = AuditLog(repo.engine)
        proposals = [e for e in audit.show(kind="proposal", limit=None)
                     if e.actor == "supervisor:model-quality"]
        # registry decisions are filed apart ("supervision"); proposals have the one shape
        promos = [e.data() for e in audit.show(kind="supervision", limit=None)
                  if e.actor == "supervisor:model-quality"
                  and e.data().get("action") == "promote-model"]
        assert [(p["version"], p["accepted"]) for p in promos] == [(1, True), (2, True)]
        assert all(p.data()["action"] == "propose" for p in proposals)
        steps = [p.data() for p in proposals if p.data().get("actions")]
        assert len(steps) == 3 and all("drift on digits v1" in p["rationale"] for p in steps)
        assert all(p["accepted"] for p in steps)
        assert audit.verify().ok
    finally:
        repo.close()


def test_inference_scaling(tmp_path: Path) -> None:
    duration = 30.0
    r = run_json("example", "inference-scaling", "--duration", str(duration),
                 "--data-dir", str(tmp_path))
    for key in ("p95_latency_ms", "latency_target_ms", "max_replicas", "min_replicas",
                "requests", "errors"):
        assert key in r, key
    assert r["requests"] == len(LoadProfile(duration, 15.0, 150.0, seed=0).arrivals())
    assert r["errors"] <= 0.02 * r["requests"], r  # traffic went to the replicas that ran
    assert r["min_replicas"] == 1 and 3 <= r["max_replicas"] <= 6  # scaled within quota
    ups = [e for e in r["scale_events"] if e["to"] > e["from"]]
    downs = [e for e in r["scale_events"] if e["to"] < e["from"]]
    assert ups and downs and ups[0]["t"] < downs[-1]["t"]
    fail = r["node_failure"]
    assert fail["replicas_lost"] >= 1 and fail["replaced_after_s"] > 0
    assert fail["node"] not in fail["replaced_on"]

    repo = Repository.open(data_dir=tmp_path)
    try:
        run = PipelineStore(repo).runs("digits-online")[0]
        replicas = PipelineStore(repo).run(run.id).steps[2].workloads  # type: ignore[union-attr]
        assert len(replicas) >= r["max_replicas"]
        for wid in replicas:  # each replica a workload of the inference queue
            w = repo.workload(wid)
            assert w is not None and w.spec.queue == QUEUE
        audit = AuditLog(repo.engine)
        scale = [e.data() for e in audit.show(kind="proposal", limit=None)
                 if e.actor == "supervisor:inference-scaler"]
        assert scale and all(p["accepted"] for p in scale)
        scaled_down = {a["workload"] for p in scale for a in p["actions"]
                       if a["action"] == "Cancel"}
        for wid in fail["lost"]:
            # requeued because its node was lost (not lost with it), then ran again; or,
            # when traffic fell first, a scale-down cancelled it while it waited (what a
            # scale-down cancels first), which a loaded machine makes likely
            hist = [(t.target.value, t.reason) for t in repo.history(wid)]
            lost = next(i for i, (s, why) in enumerate(hist) if "node-lost" in why)
            after = [s for s, _ in hist[lost + 1:]]
            assert after[:1] == ["pending"], hist
            assert "running" in after or (after[-1] == "cancelled" and wid in scaled_down), hist
        kinds = [{a["action"] for a in p["actions"]} for p in scale]
        assert kinds.count({"Submit"}) == len(ups)  # every scale-up submitted its replicas
        # a scale-down cancels at once what it can (a replica waiting for a retry later)
        assert kinds.count({"Cancel"}) in range(1, len(downs) + 1)
        assert audit.verify().ok
    finally:
        repo.close()
