"""The service's CLI commands, registered on the ``mlwe`` app by ``mlwe.cli``.

``serve`` runs the engine with its API and dashboard; the other commands talk to
a running server: the URL and token come from ``--url`` / ``--token``, else
``$MLWE_URL`` / ``$MLWE_TOKEN``, else a client context (``mlwe config``, see
:mod:`mlwe.clientconfig`). ``token`` and ``audit`` also have a local mode
(``--local``, or ``--data-dir`` / ``--database-url``) that opens the engine's
database directly: how the first tokens are made, and how an audit is checked
with no server running. (``mlwe bench api``, which measures the API, is in
:mod:`mlwe.bench_cli`.)

Every read command takes ``-o table|wide|json|yaml|name`` (see
:mod:`mlwe.output`). This package imports only Typer and the standard library at
load time; the client, the server and YAML load inside the commands. One module
a concern: :mod:`.serve`, :mod:`.workloads`, :mod:`.cluster` (nodes, queues),
:mod:`.watch`, :mod:`.tokens` and :mod:`.audit` (with :mod:`.local`, their local
mode), :mod:`.contexts` (``mlwe config``) and :mod:`.agent`; :mod:`.common` holds
their options and helpers.
"""

from __future__ import annotations

import typer

from mlwe.api.cli.agent import (
    agent_approve_cmd,
    agent_mode_cmd,
    agent_pending_cmd,
    agent_reject_cmd,
    agent_status_cmd,
)
from mlwe.api.cli.audit import audit_app
from mlwe.api.cli.cluster import nodes_cmd, queues_cmd
from mlwe.api.cli.contexts import config_app
from mlwe.api.cli.serve import serve_cmd
from mlwe.api.cli.tokens import token_app
from mlwe.api.cli.watch import watch_cmd
from mlwe.api.cli.workloads import cancel_cmd, explain_cmd, status_cmd, submit_cmd


def register_agent(agent_app: typer.Typer) -> None:
    """Add the agent commands that talk to a running server to ``mlwe agent``."""
    agent_app.command("status")(agent_status_cmd)
    agent_app.command("mode")(agent_mode_cmd)
    agent_app.command("pending")(agent_pending_cmd)
    agent_app.command("approve")(agent_approve_cmd)
    agent_app.command("reject")(agent_reject_cmd)


def register(app: typer.Typer) -> None:
    """Add the service commands to the ``mlwe`` app (called once by ``mlwe.cli``)."""
    app.command("serve")(serve_cmd)
    app.command("submit")(submit_cmd)
    app.command("status")(status_cmd)
    app.command("explain")(explain_cmd)
    app.command("cancel")(cancel_cmd)
    app.command("nodes")(nodes_cmd)
    app.command("queues")(queues_cmd)
    app.command("watch")(watch_cmd)
    app.add_typer(token_app, name="token")
    app.add_typer(audit_app, name="audit")
    app.add_typer(config_app, name="config")
