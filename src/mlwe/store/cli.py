"""``mlwe quarantine``: stored records that recovery could not load.

A record the engine cannot read back (a spec an older version accepted that
this one refuses, a row damaged on disk) never stops a start: recovery moves
it, whole, into the quarantine table and the rest of the cluster comes back
(see :func:`mlwe.store.recovery.recover`). These commands work on the
database directly (the engine need not run): ``list`` what is there, ``show``
one record as it was stored (its spec is the starting point of a repair:
fix it and submit it again with ``mlwe submit``), and ``drop`` it for good.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

quarantine_app = typer.Typer(
    help="Stored records recovery could not load (kept aside, not lost).", no_args_is_help=True
)
_out = Console(highlight=False)
_err = Console(stderr=True, highlight=False)

DataDir = Annotated[
    Path | None, typer.Option("--data-dir", help="data directory of the default SQLite store (./.mlwe)")
]
DatabaseUrl = Annotated[
    str | None,
    typer.Option("--database-url", help="SQLAlchemy URL; default $MLWE_DATABASE_URL or SQLite"),
]


def _repo(data_dir: Path | None, database_url: str | None):  # type: ignore[no-untyped-def]
    from mlwe.store import db
    from mlwe.store.repository import Repository

    url = db.database_url(data_dir=data_dir, url=database_url)
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        _err.print(f"error: no store at {url} (give --data-dir or --database-url)", markup=False)
        raise typer.Exit(2)
    engine = db.make_engine(url)
    try:
        db.check_schema(engine)
    except db.SchemaError as exc:
        _err.print(f"error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    return Repository(engine)


@quarantine_app.command("list")
def quarantine_list(
    as_json: Annotated[bool, typer.Option("--json", help="one JSON document")] = False,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Every quarantined record: its id, table, key and why it could not be loaded."""
    rows = _repo(data_dir, database_url).quarantined()
    if as_json:
        print(json.dumps([{k: v for k, v in r.items() if k != "record"} for r in rows],
                         sort_keys=True))
        return
    if not rows:
        _out.print("no quarantined records")
        return
    table = Table(title=f"quarantined records ({len(rows)})")
    for col in ("id", "table", "key", "problem"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(str(r["id"]), r["table"], r["key"], r["problem"])
    _out.print(table)


@quarantine_app.command("show")
def quarantine_show(
    qid: Annotated[int, typer.Argument(help="id from `mlwe quarantine list`")],
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
) -> None:
    """One quarantined record as it was stored (JSON): fix its spec and submit it again."""
    for r in _repo(data_dir, database_url).quarantined():
        if r["id"] == qid:
            print(json.dumps(r, indent=2, sort_keys=True))
            return
    _err.print(f"error: no quarantined record {qid}", markup=False)
    raise typer.Exit(1)


@quarantine_app.command("drop")
def quarantine_drop(
    qid: Annotated[int, typer.Argument(help="id from `mlwe quarantine list`")],
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Forget a quarantined record for good (audited)."""
    import getpass

    from mlwe.store.audit import AuditLog

    repo = _repo(data_dir, database_url)
    found = [r for r in repo.quarantined() if r["id"] == qid]
    if not found:
        _err.print(f"error: no quarantined record {qid}", markup=False)
        raise typer.Exit(1)

    def go(c: object) -> None:
        repo.drop_quarantined(qid, conn=c)
        AuditLog(repo.engine).append(
            "config", f"cli:{getpass.getuser()}",
            {"event": "quarantine-drop", "id": qid, "table": found[0]["table"],
             "key": found[0]["key"], "problem": found[0]["problem"]},
            conn=c,  # type: ignore[arg-type]
        )

    repo.write(go)
    _out.print(f"dropped quarantined record {qid}")
