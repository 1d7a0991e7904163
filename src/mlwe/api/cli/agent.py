"""The agent's commands that talk to a running server (``mlwe agent status``, ``mode``, ``pending``, ``approve``, ``reject``)."""

from __future__ import annotations

from typing import Annotated

import typer

from mlwe.api.cli.common import (
    AsJson,
    CtxName,
    Output,
    Token,
    Url,
    _call,
    _client,
    _echo,
    _fmt,
)
from mlwe.output import Column, Format, age, fields, render

ApprovalId = Annotated[str, typer.Argument(help="id from `mlwe agent pending`")]


def agent_status_cmd(
    url: Url = None, token: Token = None, context: CtxName = None,
    output: Output = Format.table, as_json: AsJson = False,
) -> None:
    """The running agent's mode and status."""
    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    r = _call(lambda: c.agent())
    if fmt in (Format.json, Format.yaml, Format.name):
        render([{"id": r.get("mode")}], [], fmt, raw=r)
        return
    if not r.get("present"):
        _echo("no agent runs in this engine")
        return
    d = r.get("detail") or {}
    fields([("Mode", r["mode"]), ("Reasoner", r["reasoner"]), ("Awaiting approval", r["pending_approvals"]),
            ("Ticks", d.get("ticks")), ("Analyses", d.get("analyses"))])
    outcomes = d.get("recent_outcomes") or []
    if outcomes:
        _echo("Recent outcomes:")
        render(outcomes, [Column("CORRELATION", lambda o: o.get("correlation_id")),
                          Column("FINDING", lambda o: o.get("finding")),
                          Column("OUTCOME", lambda o: o.get("outcome")),
                          Column("PLAN", lambda o: o.get("plan")),
                          Column("REASONS", lambda o: o.get("reasons"))], Format.table)


def agent_mode_cmd(
    mode: Annotated[str, typer.Argument(help="autonomous, approve or observe")],
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
) -> None:
    """Set the agent's mode (audited as a configuration change)."""
    c = _client(url, token, context)
    r = _call(lambda: c.set_agent_mode(mode))
    _echo(f"agent mode: {r.get('mode')}")


def agent_pending_cmd(
    url: Url = None, token: Token = None, context: CtxName = None,
    output: Output = Format.table, as_json: AsJson = False,
) -> None:
    """Plans waiting for an operator's approval (approve mode)."""
    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    items = _call(lambda: c.approvals())
    render(items, [Column("ID", lambda a: a["id"]), Column("AGE", lambda a: age(a.get("time"))),
                   Column("CORRELATION", lambda a: a.get("correlation_id"), wide=True),
                   Column("SUMMARY", lambda a: a.get("summary"))],
           fmt, raw=items, empty="no plan waits for approval")


def agent_approve_cmd(
    approval_id: ApprovalId,
    comment: Annotated[str, typer.Option("--comment", "-m", help="recorded in the audit log")] = "",
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
) -> None:
    """Approve a pending plan: it is re-forecast and proposed to the control plane, which
    verifies it. Exits 1 when the plan was not committed (stale, no longer better, refused)."""
    c = _client(url, token, context)
    r = _call(lambda: c.decide(approval_id, True, comment))
    _echo(str(r.get("message", "")))
    for rej in r.get("rejections", []):
        _echo(f"  rejected: {rej}")
    if not r.get("accepted"):
        raise typer.Exit(1)


def agent_reject_cmd(
    approval_id: ApprovalId,
    comment: Annotated[str, typer.Option("--comment", "-m", help="why (recorded in the audit log)")] = "",
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
) -> None:
    """Reject a pending plan."""
    c = _client(url, token, context)
    r = _call(lambda: c.decide(approval_id, False, comment))
    _echo(str(r.get("message", "")))
