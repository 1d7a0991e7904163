"""Workload commands through a running server: ``submit``, ``status``, ``explain``, ``cancel``."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from mlwe.api.cli.common import (
    AsJson,
    CtxName,
    Interval,
    Output,
    Token,
    Url,
    Watch,
    _call,
    _client,
    _echo,
    _fail,
    _fmt,
    _watch_rows,
)
from mlwe.output import Column, Format, age, duration, fields, render, rfc3339

SPEC_SUFFIXES = (".yaml", ".yml", ".json")
WorkloadId = Annotated[str, typer.Argument(help="workload id")]


def _spec_sources(files: list[Path]) -> Iterator[tuple[str, str | None, bool]]:
    """(name, text or None when unreadable, is_yaml) for each file, ``-`` (stdin) and
    each spec file under a directory (sorted, recursively)."""
    for f in files:
        if str(f) == "-":
            yield "<stdin>", sys.stdin.read(), True
        elif f.is_dir():
            found = sorted(p for p in f.rglob("*") if p.is_file() and p.suffix.lower() in SPEC_SUFFIXES)
            if not found:
                _echo(f"warning: {f}: no .yaml, .yml or .json file in this directory", err=True)
            for p in found:
                yield from _read(p)
        else:
            yield from _read(f)


def _read(p: Path) -> Iterator[tuple[str, str | None, bool]]:
    try:
        yield str(p), p.read_text(encoding="utf-8"), p.suffix.lower() != ".json"
    except (OSError, UnicodeDecodeError) as exc:
        _echo(f"error: {p}: cannot read: {exc}", err=True)
        yield str(p), None, True


def submit_cmd(
    files: Annotated[list[Path], typer.Argument(help="spec files (YAML or JSON), directories of them, or - for stdin")],
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """Submit workload specs to a running server; every file is tried, and the bad ones named."""
    from mlwe.client import ClientError, ServerUnreachable

    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    created: list[str] = []
    failed: list[str] = []
    for name, text, is_yaml in _spec_sources(files):
        if text is None:
            failed.append(name)
            continue
        try:
            ids = list(c.submit_text(text, yaml=is_yaml)["created"])
        except ServerUnreachable as exc:
            raise _fail(exc) from None
        except ClientError as exc:
            failed.append(name)
            _echo(f"error: {name}: {exc.status}: {exc.detail}", err=True)
            for e in exc.errors:
                where = e.get("path") or ""
                _echo(f"  {name}: {where + ': ' if where else ''}{e.get('message', '')}", err=True)
            continue
        created += ids
        if fmt is Format.name:
            for i in ids:
                _echo(i)
        elif fmt in (Format.table, Format.wide):
            _echo(f"{name}: submitted {', '.join(ids)}")
    if fmt in (Format.json, Format.yaml):
        from mlwe.output import dump

        dump({"created": created, "failed": failed}, fmt)
    if failed:
        _echo(f"{len(failed)} file(s) not submitted: {', '.join(failed)}", err=True)
        raise typer.Exit(1)


def _deadline(w: Mapping[str, Any]) -> str:
    left = w.get("deadline_left_s")
    if left is None:
        return "-"
    if w.get("state") in ("succeeded", "failed", "cancelled"):
        return "met" if left >= 0 else "missed"
    return duration(left) + (" at-risk" if w.get("deadline_at_risk") else "")


def _workload_columns(now: float | None) -> list[Column]:
    return [
        Column("ID", lambda w: w["id"]),
        Column("NAME", lambda w: w["name"], wide=True),
        Column("KIND", lambda w: w.get("kind"), wide=True),
        Column("QUEUE", lambda w: w["queue"]),
        Column("OWNER", lambda w: w.get("owner")),
        Column("STATE", lambda w: w["state"]),
        Column("PRIO", lambda w: w["priority"]),
        Column("GPUS", lambda w: w["gpus"]),
        Column("NODES", lambda w: w["nodes"]),
        Column("PROGRESS", lambda w: f"{w['progress'] * 100:.0f}%"),
        Column("ATTEMPT", lambda w: w.get("attempt"), wide=True),
        Column("PREEMPTED", lambda w: w.get("preemptions"), wide=True),
        Column("DEADLINE", _deadline),
        Column("AGE", lambda w: age(w.get("submit_time"), now)),
        Column("CORRELATION", lambda w: w.get("correlation_id"), wide=True),
        Column("WHY-WAITING", _why_waiting),
    ]


def _why_waiting(w: Mapping[str, Any]) -> str:
    if w.get("condition") == "inadmissible":
        return "inadmissible: " + "; ".join(w.get("inadmissible_reasons") or [w.get("pending_reason") or ""])
    return str(w.get("pending_reason") or "")



def status_cmd(
    workload: Annotated[str | None, typer.Argument(help="a workload id: its detail")] = None,
    state: Annotated[str | None, typer.Option("--state", "-s", help="filter: comma-separated states")] = None,
    queue: Annotated[str | None, typer.Option("--queue", "-q", help="filter: one queue")] = None,
    owner: Annotated[str | None, typer.Option("--owner", help="filter: who submitted (token name)")] = None,
    limit: Annotated[int, typer.Option("--limit", "-l", min=1, max=1000)] = 50,
    watch: Watch = False,
    interval: Interval = 2.0,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """Workloads and their states (or one workload with its history)."""
    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    if workload:
        w = _call(lambda: c.workload(workload))
        if fmt in (Format.json, Format.yaml, Format.name):
            render([w], [], fmt, raw=w)
            return
        now = w.get("now")
        fields([
            ("ID", w["id"]), ("Name", w["name"]), ("Kind", w["kind"]), ("State", w["state"]),
            ("Queue", w["queue"]), ("Owner", w.get("owner")), ("Priority", w["priority"]),
            ("Replicas", w["replicas"]), ("GPUs", w["gpus"]), ("Nodes", w["nodes"]),
            ("Progress", f"{w['progress'] * 100:.0f}%"), ("Attempt", w["attempt"]),
            ("Preemptions", w["preemptions"]), ("Preempted by", w.get("preempted_by")),
            ("Submitted", f"{rfc3339(w['submit_time'])} ({age(w['submit_time'], now)} ago)"),
            ("Deadline", "-" if w.get("deadline") is None else f"{rfc3339(w['deadline'])} ({_deadline(w)})"),
            ("Work done", duration(w.get("work_done_s"))),
            ("Remaining", duration(w.get("remaining_estimate_s"))),
            ("Why waiting", w.get("pending_reason")), ("Failure", w.get("failure_cause")),
            ("Correlation", w.get("correlation_id")),
        ])
        _echo("History:")
        render(
            w["history"],
            [Column("TIME", lambda t: rfc3339(t["time"])), Column("FROM", lambda t: t["source"]),
             Column("TO", lambda t: t["target"]), Column("REASON", lambda t: t["reason"])],
            Format.table,
        )
        return

    def fetch() -> tuple[list[dict[str, Any]], float | None]:
        page = c.workload_page(state=state, queue=queue, owner=owner, limit=limit)
        return page["items"], page.get("now")

    if watch:
        _watch_rows(fetch, _workload_columns, fmt, interval, "id")
        return
    items, now = _call(fetch)
    render(items, _workload_columns(now), fmt, raw=items, empty="no workloads")


def explain_cmd(
    workload: WorkloadId,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """Why is a workload where it is: not placed, preempted, failed?"""
    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    e = _call(lambda: c.explain(workload))
    if fmt in (Format.json, Format.yaml, Format.name):
        render([{"id": e["workload"]}], [], fmt, raw=e)
        return
    _echo(e["summary"])
    decisions = e["decisions"] if fmt is Format.wide else e["decisions"][-10:]
    for d in decisions:
        _echo(f"  [{d['kind']}] {rfc3339(d['time'])} {d['policy']}: {d['chosen']}")
        for r in d["reasons"]:
            _echo(f"      - {r}")


def cancel_cmd(
    workload: WorkloadId,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
) -> None:
    """Cancel a workload."""
    c = _client(url, token, context)
    r = _call(lambda: c.cancel(workload))
    _echo(r["message"])
