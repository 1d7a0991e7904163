"""Client contexts: named (server URL, token) pairs, like a kubeconfig.

The file is ``$MLWE_CLIENT_CONFIG``, else ``$XDG_CONFIG_HOME/mlwe/client.yaml``
(``~/.config/mlwe/client.yaml``; ``$MLWE_CONFIG`` is the server's config file)::

    current-context: prod
    contexts:
      prod: {url: https://mlwe.example.com, token: mlwe_...}
      local: {url: http://127.0.0.1:8080}

Where a client's URL and token come from, first match wins: the explicit
argument (``--url`` / ``--token``), ``$MLWE_URL`` / ``$MLWE_TOKEN``, the context
named by ``--context`` / ``$MLWE_CONTEXT``, the current context, and the
default URL. The file holds secrets, so it is written readable by its owner only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8080"


class ConfigError(ValueError):
    pass


def config_path() -> Path:
    env = os.environ.get("MLWE_CLIENT_CONFIG")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "mlwe" / "client.yaml"


@dataclass(frozen=True)
class Context:
    name: str
    url: str
    token: str | None = None


def load(path: Path | None = None) -> dict[str, Any]:
    p = path or config_path()
    if not p.exists():
        return {"current-context": None, "contexts": {}}
    import yaml

    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{p}: cannot read the client config: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("contexts", {}), dict):
        raise ConfigError(f"{p}: expected a mapping with 'contexts: {{NAME: {{url, token}}}}'")
    data.setdefault("contexts", {})
    data.setdefault("current-context", None)
    for name, ctx in data["contexts"].items():
        if not isinstance(ctx, dict) or not isinstance(ctx.get("url"), str):
            raise ConfigError(f"{p}: context {name!r} needs a 'url' string")
    return data


def save(data: dict[str, Any], path: Path | None = None) -> Path:
    import yaml

    p = path or config_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        yaml.safe_dump(data, f, sort_keys=True)
    os.replace(tmp, p)
    return p


def context(name: str | None = None, path: Path | None = None) -> Context | None:
    """The named context, else ``$MLWE_CONTEXT``, else the current one; None if there is none."""
    data = load(path)
    wanted = name or os.environ.get("MLWE_CONTEXT") or data.get("current-context")
    if not wanted:
        return None
    ctx = data["contexts"].get(wanted)
    if ctx is None:
        known = ", ".join(sorted(data["contexts"])) or "none"
        raise ConfigError(f"no client context {wanted!r} in {path or config_path()} (known: {known})")
    return Context(wanted, str(ctx["url"]), ctx.get("token"))


def resolve(url: str | None, token: str | None, context_name: str | None = None) -> tuple[str, str | None]:
    """The server URL and token a client uses (see the module's first lines for the order).

    A context's token goes only to that context's URL: with another ``--url`` (or
    ``$MLWE_URL``) and no token given, none is sent rather than leak one to a
    different server."""
    given_url = url or os.environ.get("MLWE_URL")
    given_token = token or os.environ.get("MLWE_TOKEN")
    ctx = context(context_name) if given_url is None or given_token is None else None
    final_url = (given_url or (ctx.url if ctx else None) or DEFAULT_URL).rstrip("/")
    if given_token is None and ctx is not None and ctx.url.rstrip("/") == final_url:
        given_token = ctx.token
    return final_url, given_token
