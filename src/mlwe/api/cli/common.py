"""What the service's CLI commands share: their options, and how they reach a server.

``--url`` / ``--token`` (else ``$MLWE_URL`` / ``$MLWE_TOKEN``, else a client context),
``-o`` formats, ``--watch`` (a list polled for changed rows), and the error handling that
turns a client error into exit status 1 (:func:`_call`) and a bad client configuration
into exit status 2 (:func:`_config`).
Only Typer, the standard library and :mod:`mlwe.output` load here.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from mlwe.output import Column, Format, cell, render

_T = TypeVar("_T")

Url = Annotated[
    str | None,
    typer.Option("--url", "-u", help="server URL; default $MLWE_URL, the current context, http://127.0.0.1:8080"),
]
Token = Annotated[
    str | None, typer.Option("--token", "-t", help="bearer token; default $MLWE_TOKEN or the current context")
]
CtxName = Annotated[str | None, typer.Option("--context", help="client context (mlwe config get-contexts)")]
AsJson = Annotated[bool, typer.Option("--json", help="same as -o json")]
Output = Annotated[Format, typer.Option("--output", "-o", help="table, wide, json, yaml or name")]
Watch = Annotated[bool, typer.Option("--watch", "-w", help="list, then print rows as they change")]
Interval = Annotated[float, typer.Option("--interval", min=0.2, help="--watch: seconds between looks")]
DataDir = Annotated[
    Path | None,
    typer.Option("--data-dir", help="local mode: data directory of the engine's SQLite store [$MLWE_DATA_DIR]"),
]
DatabaseUrl = Annotated[
    str | None, typer.Option("--database-url", help="local mode: SQLAlchemy URL of the engine's database")
]
Local = Annotated[bool, typer.Option("--local", help="open the engine's database instead of asking a server")]


def _echo(text: str = "", *, err: bool = False) -> None:
    (sys.stderr if err else sys.stdout).write(text + "\n")
    (sys.stderr if err else sys.stdout).flush()


def _fmt(output: Format, as_json: bool) -> Format:
    return Format.json if as_json else output


def _client(url: str | None, token: str | None, context: str | None = None) -> Any:
    from mlwe.client import Client
    from mlwe.clientconfig import resolve

    u, t = _config(lambda: resolve(url, token, context))
    return Client(u, t)


def _config(fn: Callable[[], _T]) -> _T:
    """``fn()`` (which reads the client configuration); exit 2 when that is bad."""
    from mlwe.clientconfig import ConfigError

    try:
        return fn()
    except ConfigError as exc:
        raise _fail(exc, 2) from None


def _fail(exc: Exception, code: int = 1) -> typer.Exit:
    """Say ``exc`` on stderr; the exit (status ``code``) to raise."""
    _echo(f"error: {exc}", err=True)
    return typer.Exit(code)


def _call(fn: Callable[[], Any]) -> Any:
    from mlwe.client import ClientError

    try:
        return fn()
    except ClientError as exc:
        raise _fail(exc) from None


def _watch_rows(
    fetch: Callable[[], tuple[list[dict[str, Any]], float | None]],
    columns: Callable[[float | None], list[Column]],
    fmt: Format,
    interval: float,
    key: str,
) -> None:
    """``--watch``: the list, then each row again when what it shows changes (polling)."""
    from mlwe.client import ClientError

    items, now = _call(fetch)
    render(items, columns(now), fmt, raw=items)
    def shown(x: Mapping[str, Any]) -> tuple[str, ...]:  # what a change means: the cells, not the ages
        return tuple(cell(c.get(x)) for c in columns(now) if c.header != "AGE")

    last = {str(x[key]): shown(x) for x in items}
    cols = [c for c in columns(now) if fmt is Format.wide or not c.wide]
    while True:
        time.sleep(interval)
        try:
            items, now = fetch()
        except ClientError as exc:
            _echo(f"watch: {exc}; trying again", err=True)
            continue
        for x in items:
            k = str(x[key])
            s = shown(x)
            if last.get(k) != s:
                last[k] = s
                if fmt in (Format.json, Format.yaml):
                    print(json.dumps(x, sort_keys=True), flush=True)
                elif fmt is Format.name:
                    _echo(k)
                else:
                    _echo("   ".join(cell(c.get(x)) for c in cols))
