"""``mlwe token``: API tokens (stored hashed), through the server or in local mode."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from mlwe.api.cli.common import (
    AsJson,
    CtxName,
    DatabaseUrl,
    DataDir,
    Local,
    Output,
    Token,
    Url,
    _call,
    _client,
    _echo,
    _fail,
    _fmt,
)
from mlwe.api.cli.local import _is_local, _local_engine
from mlwe.output import Column, Format, render, rfc3339

token_app = typer.Typer(help="API tokens (stored hashed): through the server, or --local.", no_args_is_help=True)


_TOKEN_COLUMNS = [
    Column("ID", lambda t: t["id"]),
    Column("NAME", lambda t: t["name"]),
    Column("ROLE", lambda t: t["role"]),
    Column("CREATED", lambda t: rfc3339(t.get("created"))),
    Column("REVOKED", lambda t: t.get("revoked")),
    Column("POLICY", lambda t: _policy_text(t.get("policy"))),
]


@token_app.command("create")
def token_create(
    role: Annotated[str, typer.Option("--role", "-r", help="viewer, submitter, operator or admin")],
    name: Annotated[str | None, typer.Option("--name", help="a name for the token (who holds it)")] = None,
    queue: Annotated[
        list[str] | None,
        typer.Option("--queue", help="a queue the token may submit to (repeat; default: any queue)"),
    ] = None,
    max_priority: Annotated[
        str | None,
        typer.Option("--max-priority", help="the highest priority it may ask for: an integer or a class (e.g. high)"),
    ] = None,
    allow_protected: Annotated[
        bool, typer.Option("--allow-protected/--no-protected", help="whether it may submit protected workloads")
    ] = True,
    local: Local = False,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
) -> None:
    """Create a token (admin); prints it once (only its hash is stored)."""
    from mlwe.api.auth import Role, TokenPolicy, TokenStore
    from mlwe.store.audit import AuditLog

    label = name or f"{role}-{int(time.time())}"
    if not _is_local(local, data_dir, database_url, url, context):
        c = _client(url, token, context)
        prio: int | str | None = int(max_priority) if max_priority and max_priority.strip().isdigit() else max_priority
        r = _call(lambda: c.create_token(label, role, queues=queue or None, max_priority=prio,
                                         allow_protected=allow_protected))
        if output in (Format.json, Format.yaml):
            render([r], [], output, raw=r)
            return
        _echo(f"created {r['role']} token {r['id']} ({r['name']}; {_policy_text(r.get('policy'))});"
              " it is shown once:", err=True)
        _echo(r["token"])
        return

    try:
        parsed = Role.parse(role)
        policy = TokenPolicy.build(
            queues=queue or None, max_priority=max_priority, allow_protected=allow_protected
        )
    except ValueError as exc:
        raise _fail(exc, 2) from None
    engine = _local_engine(data_dir, database_url)
    try:
        secret, info = TokenStore(engine).create(name or f"{parsed.label}-{int(time.time())}", parsed, policy)
    except ValueError as exc:
        raise _fail(exc, 2) from None
    AuditLog(engine).append(
        "config", "cli",
        {"action": "token-create", "token_id": info.id, "name": info.name, "role": parsed.label,
         "policy": policy.to_dict()},
    )
    _echo(f"created {parsed.label} token {info.id} ({info.name}; {_policy_text(policy.to_dict())});"
          " it is shown once:")
    _echo(secret)


@token_app.command("list")
def token_list(
    local: Local = False,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """Tokens (ids, names, roles; never the secrets)."""
    fmt = _fmt(output, as_json)
    if _is_local(local, data_dir, database_url, url, context):
        from mlwe.api.auth import TokenStore

        items = [{"id": t.id, "name": t.name, "role": t.role.label, "created": t.created, "revoked": t.revoked,
                  "subject": t.id, "policy": t.policy.to_dict()}
                 for t in TokenStore(_local_engine(data_dir, database_url)).list()]
    else:
        c = _client(url, token, context)
        items = _call(c.tokens)
    render(items, _TOKEN_COLUMNS, fmt, raw=items, empty="no tokens")


def _policy_text(d: dict[str, Any] | None) -> str:
    """A token's admission policy in words (``TokenPolicy.to_dict()`` or the API's)."""
    if not d:
        return "any queue, any priority, protected allowed"
    queues = ",".join(d["queues"]) if d.get("queues") is not None else "any"
    prio = d.get("max_priority_class") or "any"
    return f"queues {queues}; priority up to {prio}; protected {'yes' if d.get('allow_protected', True) else 'no'}"


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[str, typer.Argument(help="token id (from mlwe token list)")],
    local: Local = False,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
) -> None:
    """Revoke a token (a running server stops accepting it within seconds)."""
    if not _is_local(local, data_dir, database_url, url, context):
        c = _client(url, token, context)
        _echo(_call(lambda: c.revoke_token(token_id))["message"])
        return
    from mlwe.api.auth import TokenStore

    if not TokenStore(_local_engine(data_dir, database_url)).revoke(token_id):
        _echo(f"error: no token {token_id!r}", err=True)
        raise typer.Exit(1)
    _echo(f"revoked {token_id}")
