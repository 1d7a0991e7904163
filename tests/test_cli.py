"""The `mlwe` command, end to end through its Typer app (no server needed)."""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import text
from typer.testing import CliRunner

from mlwe.cli import app

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
runner = CliRunner()


def test_validate_accepts_the_examples() -> None:
    r = runner.invoke(app, ["validate", str(EXAMPLES / "fine-tune.yaml"), str(EXAMPLES / "batch-jobs.yaml"),
                            str(EXAMPLES / "mpi-gang.yaml")])
    assert r.exit_code == 0, r.output
    assert "1 workload spec(s) valid" in r.output and "3 workload spec(s) valid" in r.output
    assert "mpi-gang.yaml: 2 workload spec(s) valid" in r.output


def test_validate_lists_every_error_with_its_field_path() -> None:
    r = runner.invoke(app, ["validate", str(EXAMPLES / "invalid.yaml")])
    assert r.exit_code == 1
    for path in ("workloads[0].resources.gpu", "workloads[0].resources.memory",
                 "workloads[0].gpu_models", "workloads[1].priority", "workloads[1].deadline",
                 "workloads[1].min_progress"):
        assert path in r.output, path
    assert "6 error(s)" in r.output


def test_validate_names_an_unreadable_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("workloads: [ {name: x\n")
    r = runner.invoke(app, ["validate", str(bad)])
    assert r.exit_code == 1
    assert "broken.yaml" in r.output and "cannot read" in r.output


def test_demo_prints_the_preemption_with_its_reasons() -> None:
    r = runner.invoke(app, ["demo", "--json"])
    assert r.exit_code == 0, r.output
    records = [json.loads(line) for line in r.output.splitlines() if line.startswith("{")]
    kinds = [x["kind"] for x in records]
    assert "preempt" in kinds and "admit-deadline" in kinds
    pre = next(x for x in records if x["kind"] == "preempt")
    assert pre["workload"] == "ft-llama-urgent"
    assert any("lost work" in reason for reason in pre["reasons"])


def test_audit_commands_refuse_a_database_without_schema_then_detect_tampering(
    tmp_path: Path,
) -> None:
    d = str(tmp_path / "data")
    r = runner.invoke(app, ["audit", "verify", "--data-dir", d])
    assert r.exit_code == 2 and "mlwe db upgrade" in r.output
    assert runner.invoke(app, ["db", "upgrade", "--data-dir", d]).exit_code == 0

    from mlwe.store.audit import AuditLog
    from mlwe.store.db import database_url, make_engine

    engine = make_engine(database_url(data_dir=d))
    log = AuditLog(engine)
    for i in range(4):
        log.append("operator", "alice", {"i": i, "api_key": "sk-proj-abcdefghijklmnopqrstuvwxyz012345"},
                   workload="w1", correlation_id="c1")
    r = runner.invoke(app, ["audit", "verify", "--data-dir", d])
    assert r.exit_code == 0 and "4 records" in r.output
    r = runner.invoke(app, ["audit", "show", "--data-dir", d, "--correlation", "c1", "--json"])
    assert r.exit_code == 0
    shown = [json.loads(line) for line in r.output.splitlines()]
    assert [x["payload"]["i"] for x in shown] == [0, 1, 2, 3]
    assert "sk-proj" not in r.output
    with engine.begin() as conn:
        conn.execute(text("UPDATE audit SET actor = :a WHERE seq = 3"), {"a": "mallory"})
    r = runner.invoke(app, ["audit", "verify", "--data-dir", d])
    assert r.exit_code == 1 and "record 3" in r.output


def test_replay_rejects_an_unknown_policy() -> None:
    r = runner.invoke(app, ["replay", "synthetic", "--policy", "nope"])
    assert r.exit_code == 2 and "unknown policy" in r.output


def test_a_replay_without_contention_says_its_comparison_means_nothing() -> None:
    r = runner.invoke(app, ["replay", "synthetic", "--limit", "60", "--cluster", "pooled:2000", "--json"])
    assert r.exit_code == 0, r.output
    assert "warning: synthetic / mlwe: no contention" in r.output
    r = runner.invoke(app, ["replay", "synthetic", "--limit", "60", "--cluster", "pooled:4", "--json"])
    assert r.exit_code == 0 and "no contention" not in r.output
