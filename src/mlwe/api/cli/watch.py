"""``mlwe watch``: the live streams, the current state first, then events (resumes after a drop)."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

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
    _fail,
    _fmt,
)
from mlwe.output import Format, cell


def _event_line(ev: Any) -> str:
    d = ev.data
    if ev.id is None:
        return f"-- {ev.topic}: {d.get('message') or cell(d)}"
    data = d.get("data", {})
    t = time.strftime("%H:%M:%S", time.localtime(d.get("time", 0)))
    if ev.topic == "state":
        if data.get("type") == "command":
            return f"{t} command  {data.get('command')} {data.get('workload')} attempt {data.get('attempt')}"
        return f"{t} state    {data.get('workload')}: {data.get('from')} -> {data.get('to')} ({cell(data.get('reason'))})"
    if ev.topic == "audit":
        p = data.get("payload", {})
        what = p.get("chosen") or p.get("action") or p.get("event") or ""
        return f"{t} audit    #{data.get('seq')} {data.get('kind')} by {data.get('actor')}: {d.get('workload') or '-'} {cell(what)}"
    if ev.topic == "reasoning":
        return (f"{t} reason   [{data.get('source', 'agent')}] {data.get('title') or data.get('summary') or ''}:"
                f" {cell(data.get('choice') or data.get('outcome'))}")
    if ev.topic == "telemetry":
        m = data.get("metrics") or {}
        shown = " ".join(f"{k}={cell(v)}" for k, v in sorted(m.items())[:6])
        return f"{t} telem    {data.get('node') or '-'} {data.get('workload') or '-'} {shown}"
    return f"{t} {ev.topic:<8} {d.get('workload') or '-'} {cell(data)}"


def watch_cmd(
    topics: Annotated[str, typer.Option("--topics", help="comma-separated: state, reasoning, audit, telemetry")] = "state,reasoning,audit",
    workload: Annotated[str | None, typer.Option("--workload", "-W", help="only this workload's events")] = None,
    correlation: Annotated[str | None, typer.Option("--correlation", "-c", help="only this correlation id")] = None,
    count: Annotated[int | None, typer.Option("--count", "-n", min=1, help="stop after this many events")] = None,
    retries: Annotated[int, typer.Option("--retries", min=0, help="reconnect attempts in a row before giving up")] = 8,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """Follow the live streams: the current state first, then events (resumes after a drop)."""
    from mlwe.client import ClientError, ServerUnreachable

    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    structured = fmt in (Format.json, Format.yaml)
    wanted = [t.strip() for t in topics.split(",") if t.strip()]
    # the current state, so a quiet cluster is not a blank screen
    if workload:
        w = _call(lambda: c.workload(workload))
        if not structured:
            _echo(f"-- now: {w['id']} is {w['state']} (queue {w['queue']}, progress {w['progress'] * 100:.0f}%"
                  + (f", nodes {cell(w['nodes'])})" if w["nodes"] else ")"))
    else:
        page = _call(lambda: c.workload_page(limit=1000))
        if not structured:
            by: dict[str, int] = {}
            for x in page["items"]:
                by[x["state"]] = by.get(x["state"], 0) + 1
            states = ", ".join(f"{n} {s}" for s, n in sorted(by.items())) or "none"
            _echo(f"-- now: {page['total']} workloads ({states})")
    last: int | None = None
    seen = failures = 0
    while True:
        try:
            for ev in c.stream(wanted, last_event_id=last, workload=workload,
                               correlation_id=correlation, notices=True, reconnect=False):
                if ev.topic == "hello":
                    failures = 0
                    if not structured:
                        _echo(f"-- connected to {c.url} (topics {', '.join(wanted)}); waiting for events")
                    continue
                if ev.id is not None:
                    last = ev.id
                if structured:
                    print(json.dumps({"event": ev.topic, "id": ev.id, **ev.data}, sort_keys=True), flush=True)
                else:
                    _echo(_event_line(ev))
                if ev.id is not None:
                    seen += 1
                    if count is not None and seen >= count:
                        return
            raise ServerUnreachable(c.url, "the stream ended")
        except ServerUnreachable as exc:
            failures += 1
            if failures > retries:
                _echo(f"error: gave up after {retries} reconnect attempts: {exc}", err=True)
                raise typer.Exit(1) from None
            wait = min(30.0, 0.5 * 2 ** (failures - 1))
            _echo(f"-- stream interrupted ({exc}); reconnecting in {wait:g} s"
                  f" (attempt {failures}/{retries})", err=True)
            time.sleep(wait)
        except ClientError as exc:
            raise _fail(exc) from None
