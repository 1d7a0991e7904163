"""Local mode of ``token`` and ``audit``: when to open the engine's database directly, and
opening it (refusing to create an empty one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from mlwe.api.cli.common import (
    _echo,
    _fail,
)


def _local_engine(data_dir: Path | None, database_url: str | None) -> Any:
    """The engine's database, opened directly; refuses (instead of creating an empty one) when
    there is none at the given place."""
    import os

    from mlwe.store.db import ENV_DATA_DIR, ENV_URL, SchemaError, check_schema, make_engine
    from mlwe.store.db import database_url as resolve

    if database_url is None and not os.environ.get(ENV_URL, "").strip():
        d = Path(data_dir or os.environ.get(ENV_DATA_DIR, "").strip() or ".mlwe")
        if not (d / "mlwe.db").exists():
            _echo(f"error: no engine database at {(d / 'mlwe.db').resolve()}: the schema is missing"
                  f" (give the server's --data-dir, or create one with mlwe db upgrade --data-dir {d})", err=True)
            raise typer.Exit(2)
    from mlwe.core.extras import MissingExtra

    try:
        engine = make_engine(resolve(data_dir=data_dir, url=database_url))
    except (MissingExtra, ValueError) as exc:  # e.g. a postgres URL without psycopg
        raise _fail(exc, 2) from None
    try:
        check_schema(engine)
    except SchemaError as exc:
        raise _fail(exc, 2) from None
    return engine


def _is_local(local: bool, data_dir: Path | None, database_url: str | None, url: str | None,
              context: str | None) -> bool:
    """Local mode (open the engine's database) or through a server?

    Local with ``--local``, ``--data-dir`` or ``--database-url``; through a server with
    ``--url``, ``$MLWE_URL``, ``--context``/``$MLWE_CONTEXT`` or a current context; else
    local when ``$MLWE_DATA_DIR`` or ``$MLWE_DATABASE_URL`` names the database (a shell
    in the server's container), and through the default server otherwise."""
    import os

    if local or data_dir is not None or database_url is not None:
        return True
    if url or os.environ.get("MLWE_URL") or context or os.environ.get("MLWE_CONTEXT"):
        return False
    # the names of mlwe.store.db.ENV_DATA_DIR / ENV_URL (not imported: that loads SQLAlchemy)
    if not (os.environ.get("MLWE_DATA_DIR", "").strip() or os.environ.get("MLWE_DATABASE_URL", "").strip()):
        return False
    from mlwe.clientconfig import ConfigError
    from mlwe.clientconfig import context as current

    try:
        return current() is None
    except ConfigError:
        return False
