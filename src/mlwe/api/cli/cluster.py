"""The cluster through a running server: ``nodes`` (list, detail, cordon / uncordon / drain) and ``queues``."""

from __future__ import annotations

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
    _fmt,
    _watch_rows,
)
from mlwe.output import Column, Format, fields, render

NODE_VERBS = ("cordon", "uncordon", "drain")


def _gib(mib: int) -> str:
    return f"{mib / 1024:.0f}Gi"


def _node_columns(now: float | None = None) -> list[Column]:
    return [
        Column("NODE", lambda n: n["name"]),
        Column("STATUS", lambda n: n["status"]),
        Column("GPUS", lambda n: f"{n['gpus']}x{n['gpu_model']}" if n["gpus"] else "-"),
        Column("FREE-GPU", lambda n: f"{n['free']['gpu'] / 1000:g}"),
        Column("FREE-CPU", lambda n: f"{n['free']['cpu'] / 1000:g}"),
        Column("FREE-MEM", lambda n: _gib(n["free"]["ram"])),
        Column("CAP-CPU", lambda n: f"{n['capacity']['cpu'] / 1000:g}", wide=True),
        Column("CAP-MEM", lambda n: _gib(n["capacity"]["ram"]), wide=True),
        Column("VRAM/GPU", lambda n: _gib(n["vram_per_gpu"]) if n["gpus"] else "-", wide=True),
        Column("WORKLOADS", lambda n: len(n["workloads"])),
        Column("RUNNING", lambda n: n["workloads"], wide=True),
        Column("LABELS", lambda n: n.get("labels"), wide=True),
    ]


def nodes_cmd(
    action: Annotated[str | None, typer.Argument(help="a node name (its detail), or cordon, uncordon or drain")] = None,
    node: Annotated[str | None, typer.Argument(help="the node to cordon, uncordon or drain")] = None,
    reason: Annotated[str, typer.Option("--reason", "-r", help="why (recorded in the audit log)")] = "",
    watch: Watch = False,
    interval: Interval = 2.0,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """List nodes, show one (mlwe nodes NODE), or cordon / uncordon / drain one."""
    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    if action in NODE_VERBS:
        if node is None:
            _echo(f"usage: mlwe nodes {action} NODE [--reason TEXT]", err=True)
            raise typer.Exit(2)
        r = _call(lambda: c.node_action(node, action, reason))
        _echo(r["message"])
        return
    if action is not None:
        if node is not None:
            _echo(f"error: {action!r} is not an action (cordon, uncordon or drain)", err=True)
            _echo("usage: mlwe nodes [NODE | cordon|uncordon|drain NODE]", err=True)
            raise typer.Exit(2)
        n = _call(lambda: c.node(action))
        if fmt in (Format.json, Format.yaml, Format.name):
            render([n], [], fmt, raw=n, name=lambda x: str(x["name"]))
            return
        labels = {"NODE": "Node", "STATUS": "Status", "GPUS": "GPUs", "FREE-GPU": "Free GPUs", "FREE-CPU": "Free CPUs",
                  "FREE-MEM": "Free memory", "CAP-CPU": "CPUs", "CAP-MEM": "Memory", "VRAM/GPU": "VRAM per GPU",
                  "WORKLOADS": "Workloads", "RUNNING": "Holders", "LABELS": "Labels"}
        fields([(labels.get(col.header, col.header), col.get(n)) for col in _node_columns()])
        if n["devices"]:
            _echo("GPUs:")
            render(n["devices"], [
                Column("INDEX", lambda d: d["index"]),
                Column("FREE", lambda d: f"{d['free_milli'] / 1000:g}"),
                Column("HOLDERS", lambda d: [f"{h.get('id')}({h.get('milli', 0) / 1000:g})" for h in d["holders"]]),
            ], Format.table)
        return

    def fetch() -> tuple[list[dict[str, Any]], float | None]:
        return c.nodes(), None

    if watch:
        _watch_rows(fetch, _node_columns, fmt, interval, "name")
        return
    items = _call(c.nodes)
    render(items, _node_columns(), fmt, raw=items, name=lambda x: str(x["name"]), empty="no nodes")


def queues_cmd(
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """Queues with their quotas, usage, pending and running counts."""
    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    items = _call(c.queues)
    render(items, [
        Column("QUEUE", lambda q: q["name"]),
        Column("COHORT", lambda q: q.get("cohort")),
        Column("WEIGHT", lambda q: q["weight"]),
        Column("PENDING", lambda q: q["pending"]),
        Column("RUNNING", lambda q: q["running"]),
        Column("GPU-USED", lambda q: f"{q['usage']['gpu'] / 1000:g}"),
        Column("GPU-QUOTA", lambda q: "-" if q["nominal"].get("gpu") is None else f"{q['nominal']['gpu'] / 1000:g}"),
        Column("NOMINAL", lambda q: {k: v for k, v in q["nominal"].items() if v is not None}, wide=True),
        Column("BORROW-LIMIT", lambda q: {k: v for k, v in q["borrowing_limit"].items() if v is not None}, wide=True),
    ], fmt, raw=items, name=lambda q: str(q["name"]), empty="no queues")
