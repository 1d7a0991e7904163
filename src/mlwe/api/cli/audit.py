"""``mlwe audit``: the tamper-evident decision audit, through the server or in local mode."""

from __future__ import annotations

import json
from collections.abc import Mapping
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
)
from mlwe.api.cli.local import _is_local, _local_engine
from mlwe.output import Column, Format, cell, render, rfc3339

audit_app = typer.Typer(help="The tamper-evident decision audit: through the server, or --local.",
                        no_args_is_help=True)


@audit_app.command("verify")
def audit_verify(
    local: Local = False,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
) -> None:
    """Check the hash chain; name the first record that does not fit."""
    if _is_local(local, data_dir, database_url, url, context):
        from mlwe.store.audit import AuditLog

        v = AuditLog(_local_engine(data_dir, database_url)).verify()
        r = {"ok": v.ok, "checked": v.checked, "first_bad_seq": v.first_bad_seq, "reason": v.reason,
             "head_hash": v.head_hash}
    else:
        c = _client(url, token, context)
        r = _call(c.verify_audit)
    if r["ok"]:
        _echo(f"audit chain ok: {r['checked']} records, head {str(r['head_hash'])[:16]}")
        return
    _echo(f"audit chain BROKEN at record {r['first_bad_seq']}: {r['reason']}"
          f" ({r['checked']} records verified before it)", err=True)
    raise typer.Exit(1)


_NOISE = frozenset({"seq", "time", "version", "inputs_digest", "cause_id", "kind", "workload", "policy",
                    "candidates", "extra", "hash", "prev_hash"})


def _what(p: Mapping[str, Any]) -> str:
    """An audit payload in one readable line: a decision's choice and first reason, else its
    action (or event, outcome) and its other plain facts."""
    reasons = p.get("reasons")
    if p.get("chosen"):
        first = reasons[0] if isinstance(reasons, list) and reasons else ""
        return f"{cell(p['chosen'])}" + (f" ({cell(first)})" if first else "")
    head = p.get("action") or p.get("outcome") or p.get("event") or p.get("type") or ""
    rest = {k: v for k, v in p.items() if k not in _NOISE and k not in ("action", "outcome", "event", "type")
            and v not in (None, "", [], {}) and not isinstance(v, dict)}
    return (f"{head} " if head else "") + " ".join(f"{k}={cell(v)}" for k, v in sorted(rest.items())[:8])


@audit_app.command("show")
def audit_show(
    workload: Annotated[str | None, typer.Option("--workload", "-W", help="records about this workload")] = None,
    correlation: Annotated[str | None, typer.Option("--correlation", "-c", help="records with this correlation id")] = None,
    kind: Annotated[str | None, typer.Option("--kind", "-k", help="records of this kind")] = None,
    limit: Annotated[int, typer.Option("--limit", "-l", min=1, max=2000)] = 50,
    local: Local = False,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """Why: the audit records of a workload, of one correlation id, or the latest."""
    if as_json:
        output = Format.json
    if _is_local(local, data_dir, database_url, url, context):
        from mlwe.store.audit import AuditLog

        if workload is None and correlation is None and kind is None:
            _echo("give --workload ID, --correlation ID or --kind KIND", err=True)
            raise typer.Exit(2)
        entries = AuditLog(_local_engine(data_dir, database_url)).show(
            workload=workload, correlation_id=correlation, kind=kind, limit=limit
        )
        items = [{"seq": e.seq, "time": e.time, "kind": e.kind, "actor": e.actor, "workload": e.workload,
                  "correlation_id": e.correlation_id, "payload": e.data()} for e in entries]
    else:
        c = _client(url, token, context)
        items = _call(lambda: c.audit(workload=workload, correlation_id=correlation, kind=kind, limit=limit))
    if as_json:  # one record a line, as before
        for x in items:
            print(json.dumps(x, sort_keys=True))
        if not items:
            _echo("no audit records match", err=True)
        return
    render(items, [
        Column("SEQ", lambda e: e["seq"]),
        Column("TIME", lambda e: rfc3339(e["time"])),
        Column("KIND", lambda e: e["kind"]),
        Column("ACTOR", lambda e: e["actor"]),
        Column("WORKLOAD", lambda e: e.get("workload")),
        Column("CORRELATION", lambda e: e.get("correlation_id"), wide=True),
        Column("WHAT", lambda e: _what(e.get("payload") or {})),
    ], output, raw=items, name=lambda e: str(e["seq"]), empty="no audit records match")
