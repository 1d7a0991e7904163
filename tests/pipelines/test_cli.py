"""``mlwe pipeline`` and ``mlwe runs``: validate, run for real, and read back from the store."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml
from typer.testing import CliRunner

from mlwe.cli import app

cli = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


def write_pipeline(tmp_path: Path) -> Path:
    doc = {
        "name": "tiny",
        "params": {"word": "hello"},
        "defaults": {"resources": {"cpu": "250m", "memory": "64Mi"}},
        "steps": [
            {"name": "write", "command": [sys.executable, "-c",
                                          "import sys; open(sys.argv[1], 'w').write(sys.argv[2])",
                                          "${outputs.text}", "${params.word}"],
             "outputs": {"text": "text.txt"}},
            {"name": "count", "command": [sys.executable, "-c",
                                          "import json, sys; n = len(open(sys.argv[1]).read());"
                                          " json.dump({'chars': n}, open(sys.argv[2], 'w'))",
                                          "${inputs.text}", "${metrics}"],
             "inputs": {"text": {"from": "write.text"}}},
        ],
    }
    f = tmp_path / "tiny.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


def test_validate_reports_every_problem_and_exits_2() -> None:
    ok = cli.invoke(app, ["pipeline", "validate", str(ROOT / "examples/pipelines/digits-train.yaml")])
    assert ok.exit_code == 0 and "order prepare -> train -> evaluate" in ok.output
    bad = cli.invoke(app, ["pipeline", "validate",
                           str(ROOT / "examples/pipelines/invalid-cycle.yaml")])
    assert bad.exit_code == 2
    assert "step 'c': ${params.missing} names an undeclared parameter" in bad.output
    assert "cycle between steps: a -> b -> a" in bad.output


def test_run_then_status_and_runs(tmp_path: Path) -> None:
    f = write_pipeline(tmp_path)
    data = tmp_path / "data"
    res = cli.invoke(app, ["pipeline", "run", str(f), "-p", "word=pipelines",
                           "--data-dir", str(data), "--json"])
    assert res.exit_code == 0, res.output
    run = json.loads(res.stdout.strip().splitlines()[-1])
    assert run["id"] == "tiny-1" and run["status"] == "succeeded"
    assert run["metrics"] == {"count.chars": len("pipelines")}
    assert run["params"] == {"word": "pipelines"}

    listed = json.loads(cli.invoke(app, ["runs", "list", "--data-dir", str(data),
                                         "--json"]).stdout)
    assert [(r["id"], r["status"]) for r in listed] == [("tiny-1", "succeeded")]
    shown = json.loads(cli.invoke(app, ["runs", "show", "tiny-1", "--data-dir", str(data),
                                        "--json"]).stdout)
    assert [(s["step"], s["status"]) for s in shown["steps"]] == [
        ("write", "succeeded"), ("count", "succeeded")]
    assert Path(shown["artifacts"]["write.text"]).read_text() == "pipelines"
    status = cli.invoke(app, ["pipeline", "status", "--data-dir", str(data)])
    assert status.exit_code == 0 and "tiny-1" in status.output
    missing = cli.invoke(app, ["runs", "show", "tiny-9", "--data-dir", str(data)])
    assert missing.exit_code == 1 and "no run 'tiny-9' (latest: tiny-1)" in missing.output

    again = cli.invoke(app, ["pipeline", "run", str(f), "-p", "lr=1", "--data-dir", str(data)])
    assert again.exit_code == 2 and "unknown parameter 'lr' for pipeline 'tiny'" in again.output
    bad = cli.invoke(app, ["pipeline", "run", str(f), "-p", "oops", "--data-dir", str(data)])
    assert bad.exit_code == 2 and "expected NAME=VALUE" in bad.output


def test_a_killed_run_is_resumed_to_its_end(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import time

    from mlwe.store.db import SchemaError
    from mlwe.store.pipelines import PipelineStore
    from mlwe.store.repository import Repository

    doc = {
        "name": "slow",
        "defaults": {"resources": {"cpu": "250m", "memory": "64Mi"}},
        "steps": [
            {"name": "first", "command": [sys.executable, "-c",
                                          "import sys; open(sys.argv[1], 'w').write('1')",
                                          "${outputs.o}"], "outputs": {"o": "one.txt"}},
            {"name": "second", "command": [sys.executable, "-c",
                                           "import sys, time; time.sleep(1.5);"
                                           " open(sys.argv[1], 'w').write('2')", "${outputs.o}"],
             "outputs": {"o": "two.txt"}, "depends_on": ["first"]},
        ],
    }
    f = tmp_path / "slow.yaml"
    f.write_text(yaml.safe_dump(doc))
    data = tmp_path / "data"
    proc = subprocess.Popen([sys.executable, "-m", "mlwe.cli", "pipeline", "run", str(f),
                             "--data-dir", str(data)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until the second step runs
            try:
                repo = Repository.open(data_dir=data)
            except SchemaError:  # not created yet
                time.sleep(0.1)
                continue
            try:
                run = PipelineStore(repo).run("slow-1")
            finally:
                repo.close()
            if run is not None and run.steps[1].status == "running":
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the second step never ran")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI dies, and its daemons with it
        proc.wait()
    res = cli.invoke(app, ["pipeline", "resume", "--data-dir", str(data), "--json"])
    assert res.exit_code == 0, res.output
    run = json.loads(res.stdout.strip().splitlines()[-1])
    assert run["id"] == "slow-1" and run["status"] == "succeeded"
    assert [s["status"] for s in run["steps"]] == ["succeeded", "succeeded"]
    assert run["steps"][1]["attempts"] == 2  # its first attempt vanished with the machine
    assert (data / "runs" / "slow-1" / "two.txt").read_text() == "2"
