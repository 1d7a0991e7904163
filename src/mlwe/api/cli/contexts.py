"""``mlwe config``: client contexts, named server URL + token pairs (see :mod:`mlwe.clientconfig`)."""

from __future__ import annotations

from typing import Annotated

import typer

from mlwe.api.cli.common import (
    Output,
    _config,
    _echo,
)
from mlwe.output import Column, Format, render

config_app = typer.Typer(help="Client contexts: named server URL + token pairs (like a kubeconfig).",
                         no_args_is_help=True)


@config_app.command("set-context")
def config_set_context(
    name: Annotated[str, typer.Argument(help="context name")],
    url: Annotated[str, typer.Option("--url", "-u", help="server URL")],
    token: Annotated[str | None, typer.Option("--token", "-t", help="bearer token (stored in the file, mode 0600)")] = None,
    use: Annotated[bool, typer.Option("--use", help="also make it the current context")] = False,
) -> None:
    """Add or change a context (URL and token of one server)."""
    from mlwe import clientconfig

    data = _config(clientconfig.load)
    data["contexts"][name] = {"url": url.rstrip("/"), **({"token": token} if token else {})}
    if use or not data.get("current-context"):
        data["current-context"] = name
    path = clientconfig.save(data)
    _echo(f"context {name} saved in {path}" + (" (current)" if data["current-context"] == name else ""))


@config_app.command("use-context")
def config_use_context(name: Annotated[str, typer.Argument(help="context name")]) -> None:
    """Make a context the current one."""
    from mlwe import clientconfig

    data = _config(clientconfig.load)
    if name not in data["contexts"]:
        _echo(f"error: no context {name!r} (known: {', '.join(sorted(data['contexts'])) or 'none'})", err=True)
        raise typer.Exit(1)
    data["current-context"] = name
    clientconfig.save(data)
    _echo(f"current context: {name}")


@config_app.command("get-contexts")
def config_get_contexts(output: Output = Format.table) -> None:
    """The contexts (tokens are not printed)."""
    from mlwe import clientconfig

    data = _config(clientconfig.load)
    items = [{"name": k, "url": v["url"], "token": "set" if v.get("token") else None,
              "current": k == data.get("current-context")} for k, v in sorted(data["contexts"].items())]
    render(items, [Column("CURRENT", lambda x: "*" if x["current"] else ""), Column("NAME", lambda x: x["name"]),
                   Column("URL", lambda x: x["url"]), Column("TOKEN", lambda x: x["token"])],
           output, raw=items, name=lambda x: str(x["name"]), empty=f"no contexts in {clientconfig.config_path()}")


@config_app.command("current-context")
def config_current_context() -> None:
    """The current context's name."""
    from mlwe import clientconfig

    current = _config(clientconfig.load).get("current-context")
    if not current:
        _echo("no current context", err=True)
        raise typer.Exit(1)
    _echo(str(current))
