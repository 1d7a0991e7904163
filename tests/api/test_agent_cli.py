"""`mlwe agent status|mode|pending|approve|reject` against a running server with an agent."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import uvicorn
from typer.testing import CliRunner

from mlwe.api.auth import Role
from mlwe.api.serve import attach_agent
from mlwe.cli import app
from tests.api.conftest import free_port, make_api, wait_for

runner = CliRunner()


def test_an_operator_approves_the_agents_plan_from_the_cli(tmp_path: Path) -> None:
    api = make_api(tmp_path)
    agent = attach_agent(api.engine, "autonomous")
    api.svc.app.state.ctx.agent = agent
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(api.svc.app, host="127.0.0.1", port=port,
                                           log_level="warning", timeout_graceful_shutdown=1))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        op = {"MLWE_URL": f"http://127.0.0.1:{port}", "MLWE_TOKEN": api.tokens[Role.OPERATOR]}
        viewer = {**op, "MLWE_TOKEN": api.tokens[Role.VIEWER]}

        r = runner.invoke(app, ["agent", "mode", "approve"], env=viewer)
        assert r.exit_code != 0  # a viewer may not change the mode
        r = runner.invoke(app, ["agent", "mode", "approve"], env=op)
        assert r.exit_code == 0 and "approve" in r.output
        r = runner.invoke(app, ["agent", "status"], env=viewer)
        assert r.exit_code == 0 and re.search(r"Mode:\s+approve", r.output), r.output

        r = runner.invoke(app, ["agent", "pending"], env=viewer)
        assert r.exit_code == 0 and "no plan waits" in r.output
        api.client.post("/api/v1/scenarios/oom-loop", headers=api.h(Role.OPERATOR))
        assert wait_for(lambda: agent.pending(), timeout=60)
        r = runner.invoke(app, ["agent", "pending", "--json"], env=viewer)
        import json

        plan_id = json.loads(r.output)[0]["id"]
        r = runner.invoke(app, ["agent", "approve", "nope"], env=op)
        assert r.exit_code != 0 and "nope" in r.output
        r = runner.invoke(app, ["agent", "approve", plan_id, "--comment", "go"], env=op)
        assert plan_id in r.output, r.output
        # committed: exit 0; re-forecast on the current state and no longer better (or
        # refused by the control plane): the operator's approval did nothing, exit 1
        assert r.exit_code == (0 if f"plan {plan_id}: committed" in r.output else 1), r.output
        assert not any(p["id"] == plan_id for p in agent.pending())
    finally:
        server.should_exit = True
        t.join(timeout=10)
        api.svc.close()
