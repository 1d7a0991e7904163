"""The Python client and the CLI against a real server over HTTP."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlwe.api.auth import Role
from mlwe.cli import app
from mlwe.client import Client, ClientError
from tests.api.conftest import Live, wait_for

runner = CliRunner()


def _env(live: Live, role: Role) -> dict[str, str]:
    return {"MLWE_URL": live.url, "MLWE_TOKEN": live.api.tokens[role]}


def test_the_client_submits_explains_and_cancels(live: Live, tmp_path: Path) -> None:
    never = tmp_path / "never.yaml"  # 8 GPUs of a model whose nodes have 4: can never run
    never.write_text("id: c9\nname: c9\nresources: {gpu: 8, cpu: 1}\ngpu_models: [A100-80GB]\n")
    # the A100s are taken by c0: c1 waits for capacity (it is the longer of the two, so
    # preempting c0 for it gains nothing)
    f = tmp_path / "job.yaml"
    f.write_text(
        "id: c0\nname: c0\nreplicas: 2\nresources: {gpu: 4, cpu: 1}\ngpu_models: [A100-80GB]\n"
        "estimated_duration: 1d\n---\n"
        "id: c1\nname: c1\nresources: {gpu: 4, cpu: 1}\ngpu_models: [A100-80GB]\n"
        "estimated_duration: 2d\n"
    )
    with Client(live.url, live.api.tokens[Role.SUBMITTER]) as c:
        with pytest.raises(ClientError) as err:
            c.submit_file(never)
        assert err.value.status == 422 and "inadmissible" in str(err.value)
        assert c.submit_file(f) == ["c0", "c1"]
        assert c.whoami()["role"] == "submitter"
        assert wait_for(lambda: c.explain("c1")["pending_reason"] != "")
        assert "waiting" in c.explain("c1")["summary"]
        assert c.workloads(state="pending")[0]["id"] == "c1"
        assert c.cancel("c1")["accepted"]
        with pytest.raises(ClientError) as err:
            c.cancel("c1")
        assert err.value.status == 409 and "cancelled" in str(err.value)
        with pytest.raises(ClientError) as err:
            c.submit({"name": "bad", "replicas": -1})
        assert err.value.status == 422 and err.value.errors[0]["path"] == "replicas"
        with pytest.raises(ClientError) as err:
            c.node_action("a100-0", "cordon")
        assert err.value.status == 403


def test_the_client_follows_the_stream(live: Live) -> None:
    got = []
    with Client(live.url, live.api.tokens[Role.VIEWER]) as c:
        start = live.api.engine.streams.last_id

        def publish() -> None:
            for i in range(3):
                live.api.engine.streams.publish("reasoning", {"n": i})

        threading.Timer(0.3, publish).start()
        for ev in c.stream(["reasoning"], last_event_id=start):
            got.append(ev.data["data"]["n"])
            if len(got) == 3:
                break
    assert got == [0, 1, 2]


def test_cli_submit_status_explain_nodes_cancel(live: Live, tmp_path: Path) -> None:
    f = tmp_path / "jobs.yaml"
    f.write_text("workloads:\n  - {id: k1, name: k1, resources: {cpu: 1}, estimated_duration: 1h}\n")
    r = runner.invoke(app, ["submit", str(f), "--json"], env=_env(live, Role.SUBMITTER))
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {"created": ["k1"], "failed": []}
    assert wait_for(lambda: live.api.engine.cp.workloads["k1"].state.value == "running")
    r = runner.invoke(app, ["status", "--json"], env=_env(live, Role.VIEWER))
    assert r.exit_code == 0 and json.loads(r.output)[0]["id"] == "k1"
    r = runner.invoke(app, ["status", "k1"], env=_env(live, Role.VIEWER))
    assert r.exit_code == 0 and re.search(r"pending\s+admitted", r.output) and "running" in r.output
    r = runner.invoke(app, ["explain", "k1"], env=_env(live, Role.VIEWER))
    assert r.exit_code == 0 and "k1 (k1) is running" in r.output
    r = runner.invoke(app, ["nodes"], env=_env(live, Role.VIEWER))
    assert r.exit_code == 0 and "a100-0" in r.output
    r = runner.invoke(app, ["nodes", "cordon", "cpu-0", "--reason", "disk"], env=_env(live, Role.OPERATOR))
    assert r.exit_code == 0 and "cordon" in r.output
    r = runner.invoke(app, ["cancel", "k1"], env=_env(live, Role.SUBMITTER))
    assert r.exit_code == 0 and "cancelled" in r.output
    r = runner.invoke(app, ["explain", "nope"], env=_env(live, Role.VIEWER))
    assert r.exit_code == 1 and "unknown workload" in r.output
    r = runner.invoke(app, ["status"], env={"MLWE_URL": live.url, "MLWE_TOKEN": "wrong"})
    assert r.exit_code == 1 and "401" in r.output


def test_cli_watch_prints_events(live: Live) -> None:
    hub = live.api.engine.streams
    # a fresh watch starts at the live edge: publish once it is connected
    base = hub.subscribers

    def publish() -> None:
        if wait_for(lambda: hub.subscribers > base, timeout=10):
            hub.publish("reasoning", {"source": "scheduler", "title": "a story", "choice": "evict x"})

    threading.Thread(target=publish, daemon=True).start()
    r = runner.invoke(app, ["watch", "--topics", "reasoning", "--count", "1"], env=_env(live, Role.VIEWER))
    assert r.exit_code == 0, r.output
    assert "[scheduler] a story: evict x" in r.output


def test_cli_token_create_writes_a_hashed_token(tmp_path: Path) -> None:
    r = runner.invoke(app, ["token", "create", "--role", "operator", "--name", "ops", "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "schema" in r.output.lower()  # no engine database there yet
    from mlwe.store.db import database_url, make_engine, migrate

    migrate(make_engine(database_url(tmp_path)))
    r = runner.invoke(app, ["token", "create", "--role", "operator", "--name", "ops", "--data-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    token = r.output.strip().splitlines()[-1]
    assert token.startswith("mlwe_")
    from mlwe.api.auth import TokenStore

    store = TokenStore(make_engine(database_url(tmp_path)))
    p = store.verify(token)
    assert p is not None and p.role is Role.OPERATOR and p.name == "ops"
    r = runner.invoke(app, ["token", "create", "--role", "god", "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "unknown role" in r.output
    r = runner.invoke(app, ["token", "list", "--json", "--data-dir", str(tmp_path)])
    assert json.loads(r.output)[0]["name"] == "ops" and "token" not in json.loads(r.output)[0]
    r = runner.invoke(app, ["token", "revoke", p.token_id, "--data-dir", str(tmp_path)])
    assert r.exit_code == 0
    assert TokenStore(make_engine(database_url(tmp_path))).verify(token) is None
