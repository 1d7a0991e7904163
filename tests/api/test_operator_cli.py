"""The operator's CLI against a real server: output formats, watch, submit sources,
token and audit through the API, contexts, serve's port check (issue 16)."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from mlwe.api.auth import Role
from mlwe.cli import app
from tests.api.conftest import Live, free_port, wait_for

runner = CliRunner()


def _env(live: Live, role: Role, **more: str) -> dict[str, str]:
    return {"MLWE_URL": live.url, "MLWE_TOKEN": live.api.tokens[role], **more}


def _submit(live: Live, text: str) -> None:
    r = live.api.client.post("/api/v1/workloads", content=text.encode(),
                             headers={**live.api.h(Role.SUBMITTER), "Content-Type": "application/yaml"})
    assert r.status_code == 201, r.text


LONG_ID = "a-workload-with-a-rather-long-identifier-0001"


def test_status_prints_full_ids_and_every_column_when_piped(live: Live) -> None:
    _submit(live, "id: fill\nname: fill\nreplicas: 2\nresources: {gpu: 4}\ngpu_models: [A100-80GB]\n"
                  "estimated_duration: 10h\n")
    assert wait_for(lambda: live.api.engine.cp.workloads["fill"].state.value == "running")
    _submit(live, f"id: {LONG_ID}\nname: long\nqueue: default\nresources: {{gpu: 4}}\n"
                  "gpu_models: [A100-80GB]\ndeadline_in: 2h\nestimated_duration: 1h\n")
    assert wait_for(lambda: live.api.engine.cp.workloads[LONG_ID].pending_reason != "")
    r = runner.invoke(app, ["status", "-o", "wide"], env=_env(live, Role.VIEWER))
    assert r.exit_code == 0, r.output
    header, row = r.output.splitlines()[:2]
    for col in ("ID", "NAME", "QUEUE", "OWNER", "STATE", "AGE", "DEADLINE", "WHY-WAITING", "CORRELATION"):
        assert col in header.split(), col
    assert row.startswith(LONG_ID + " ")  # never truncated
    assert "submitter-user" in row and "pending" in row
    assert not re.search(r"None|True|False|\{'", r.output)
    # the deadline as a duration, the age human
    assert re.search(r"\b1h\d+m\b|\b2h\b|\b1h59m\b", row), row
    # the reason stays on its line, whatever its length
    assert len(r.output.splitlines()) == 3  # header, long, fill

    r = runner.invoke(app, ["status", "-o", "name"], env=_env(live, Role.VIEWER))
    assert r.output.split() == [LONG_ID, "fill"]  # newest first
    r = runner.invoke(app, ["status", "-o", "yaml"], env=_env(live, Role.VIEWER))
    assert yaml.safe_load(r.output)[0]["id"] == LONG_ID
    r = runner.invoke(app, ["status", LONG_ID, "-o", "json"], env=_env(live, Role.VIEWER))
    assert json.loads(r.output)["history"][0]["target"] == "pending"
    r = runner.invoke(app, ["status", "-s", "running", "-o", "name"], env=_env(live, Role.VIEWER))
    assert r.exit_code == 0 and r.stdout.split() == ["fill"]


def test_nodes_shows_one_node_and_explains_a_wrong_call(live: Live) -> None:
    r = runner.invoke(app, ["nodes", "t4-0"], env=_env(live, Role.VIEWER))
    assert r.exit_code == 0, r.output
    assert re.search(r"Node:\s+t4-0", r.output) and re.search(r"GPUs:\s+2xT4", r.output)
    r = runner.invoke(app, ["nodes", "t4-0", "x"], env=_env(live, Role.VIEWER))
    assert r.exit_code == 2 and "usage: mlwe nodes [NODE | cordon|uncordon|drain NODE]" in r.output
    r = runner.invoke(app, ["nodes", "cordon"], env=_env(live, Role.OPERATOR))
    assert r.exit_code == 2 and "usage: mlwe nodes cordon NODE" in r.output
    r = runner.invoke(app, ["nodes", "nope"], env=_env(live, Role.VIEWER))
    assert r.exit_code == 1 and "404" in r.output
    r = runner.invoke(app, ["nodes", "-o", "name"], env=_env(live, Role.VIEWER))
    assert r.output.split() == ["a100-0", "a100-1", "t4-0", "cpu-0"]
    r = runner.invoke(app, ["queues"], env=_env(live, Role.VIEWER))
    assert r.exit_code == 0 and r.output.splitlines()[0].split()[:2] == ["QUEUE", "COHORT"]


def test_submit_reads_stdin_and_directories_and_names_every_bad_file(live: Live, tmp_path: Path) -> None:
    d = tmp_path / "specs"
    (d / "sub").mkdir(parents=True)
    (d / "a.yaml").write_text("id: s-a\nname: a\nresources: {cpu: 1}\n")
    (d / "sub" / "b.json").write_text(json.dumps({"id": "s-b", "name": "b", "resources": {"cpu": 1}}))
    (d / "typo.yaml").write_text("id: s-t\nname: t\nresources: {cpu: 1}\ngpu_modles: [T4]\n")
    (d / "broken.yml").write_text("id: s-x\n  name: [\n")
    (d / "notes.txt").write_text("not a spec")
    r = runner.invoke(app, ["submit", str(d), "-", "-o", "json"], env=_env(live, Role.SUBMITTER),
                      input="id: s-stdin\nname: stdin\nresources: {cpu: 1}\n")
    assert r.exit_code == 1
    body = json.loads(r.stdout)
    assert sorted(body["created"]) == ["s-a", "s-b", "s-stdin"]
    assert sorted(Path(f).name for f in body["failed"]) == ["broken.yml", "typo.yaml"]
    assert "did you mean 'gpu_models'?" in r.output
    assert re.search(r"broken\.yml: .*line 2, column \d+", r.output), r.output
    assert "<unicode string>" not in r.output
    assert "2 file(s) not submitted" in r.output


def test_token_and_audit_go_through_the_server(live: Live) -> None:
    admin = _env(live, Role.ADMIN)
    r = runner.invoke(app, ["token", "create", "-r", "viewer", "--name", "grafana"], env=admin)
    assert r.exit_code == 0, r.output
    secret = r.stdout.strip().splitlines()[-1]
    assert secret.startswith("mlwe_")
    r = runner.invoke(app, ["token", "list", "-o", "json"], env=admin)
    assert "grafana" in [t["name"] for t in json.loads(r.output)]
    r = runner.invoke(app, ["status"], env={"MLWE_URL": live.url, "MLWE_TOKEN": secret})
    assert r.exit_code == 0
    r = runner.invoke(app, ["audit", "show", "--kind", "config"], env=admin)
    assert r.exit_code == 0 and "token-create" in r.output and "role=viewer" in r.output
    r = runner.invoke(app, ["audit", "verify"], env=admin)
    assert r.exit_code == 0 and "audit chain ok" in r.output
    r = runner.invoke(app, ["token", "create", "-r", "viewer"], env=_env(live, Role.OPERATOR))
    assert r.exit_code == 1 and "403" in r.output


def test_local_token_commands_do_not_create_an_empty_data_dir(tmp_path: Path) -> None:
    where = tmp_path / "elsewhere"
    r = runner.invoke(app, ["token", "list", "--data-dir", str(where)])
    assert r.exit_code == 2 and "no engine database" in r.output
    assert not where.exists()


def test_watch_shows_the_current_state_then_connected_then_events(live: Live) -> None:
    import threading

    _submit(live, "id: w1\nname: w1\nresources: {cpu: 1}\nestimated_duration: 1h\n")
    hub = live.api.engine.streams
    base = hub.subscribers

    def publish() -> None:
        if wait_for(lambda: hub.subscribers > base, timeout=10):
            hub.publish("reasoning", {"source": "scheduler", "title": "a story", "choice": "evict x"})

    threading.Thread(target=publish, daemon=True).start()
    r = runner.invoke(app, ["watch", "--topics", "reasoning", "-n", "1"], env=_env(live, Role.VIEWER))
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith("-- now: 1 workloads")
    assert any(line.startswith("-- connected to") for line in lines)
    assert "[scheduler] a story: evict x" in lines[-1]


def test_watch_gives_up_on_a_dead_server_after_its_retries() -> None:
    r = runner.invoke(app, ["watch", "--retries", "0"],
                      env={"MLWE_URL": f"http://127.0.0.1:{free_port()}", "MLWE_TOKEN": "x"})
    assert r.exit_code == 1 and "cannot reach the server" in r.output


def test_contexts_hold_url_and_token(live: Live, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "config.yaml"
    monkeypatch.setenv("MLWE_CLIENT_CONFIG", str(cfg))
    monkeypatch.delenv("MLWE_URL", raising=False)
    monkeypatch.delenv("MLWE_TOKEN", raising=False)
    r = runner.invoke(app, ["config", "set-context", "test", "-u", live.url, "-t", live.api.tokens[Role.VIEWER]])
    assert r.exit_code == 0, r.output
    assert cfg.stat().st_mode & 0o077 == 0  # the token is a secret
    r = runner.invoke(app, ["config", "get-contexts"])
    assert "test" in r.output and live.api.tokens[Role.VIEWER] not in r.output
    r = runner.invoke(app, ["status", "-o", "json"])
    assert r.exit_code == 0, r.output
    # a context's token is never sent to another URL
    from mlwe.clientconfig import resolve

    assert resolve("http://elsewhere:1", None) == ("http://elsewhere:1", None)
    assert resolve(None, None) == (live.url, live.api.tokens[Role.VIEWER])


def test_serve_checks_its_port_before_printing_a_token(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = runner.invoke(app, ["serve", "--port", str(port), "--data-dir", str(tmp_path / "d")])
    assert r.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in r.output
    assert "token" not in r.output.lower() and "dashboard" not in r.output
    assert not (tmp_path / "d").exists()  # nothing was built


def test_version_and_completion() -> None:
    from mlwe import __version__

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"mlwe {__version__}"
    r = runner.invoke(app, ["--help"])
    assert "--install-completion" in r.output


def test_audit_is_local_where_the_environment_names_the_database(tmp_path: Path) -> None:
    # a shell in the server's container: MLWE_DATA_DIR set, no server URL given
    from mlwe.store.db import database_url, make_engine, migrate

    migrate(make_engine(database_url(tmp_path)))
    r = runner.invoke(app, ["audit", "verify"], env={"MLWE_DATA_DIR": str(tmp_path), "MLWE_URL": None,
                                                    "MLWE_CLIENT_CONFIG": str(tmp_path / "none.yaml")})
    assert r.exit_code == 0 and "audit chain ok" in r.output, r.output
    # with a server named, it asks the server (here: none listens)
    r = runner.invoke(app, ["audit", "verify", "--url", f"http://127.0.0.1:{free_port()}"],
                      env={"MLWE_DATA_DIR": str(tmp_path)})
    assert r.exit_code == 1 and "cannot reach the server" in r.output
