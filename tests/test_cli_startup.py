"""The ``mlwe`` command starts fast: its client commands do not load the server.

``mlwe --help`` and ``mlwe status`` must not import FastAPI, SQLAlchemy, Alembic
or the engine (issue 16: 2.8 s of CPU before, for a command that makes one HTTP
call). Checked in a fresh interpreter, where ``sys.modules`` shows what an
import really pulled in; the timing itself is a figure (``python -X importtime``),
not a test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("fastapi", "starlette", "sqlalchemy", "alembic", "uvicorn", "mlwe.runtime",
         "mlwe.core", "mlwe.store.db", "mlwe.store.repository", "mlwe.store.audit", "mlwe.sim",
         "matplotlib", "numpy", "pydantic", "httpx")
#: what of mlwe the command may load before it runs one: packages (their __init__ is lazy),
#: the CLI modules (``*.cli``, and the modules of a ``cli`` package), and these
LIGHT = {"mlwe.output", "mlwe.clientconfig", "mlwe.bench_cli", "mlwe.backends.bench"}


def _loaded_after(code: str) -> set[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def _heavy(mods: set[str]) -> list[str]:
    import importlib.util

    def package(m: str) -> bool:
        spec = importlib.util.find_spec(m)
        return spec is not None and spec.submodule_search_locations is not None

    heavy = {m for m in mods if any(m == h or m.startswith(h + ".") for h in HEAVY)}
    mlwe = {m for m in mods if m.startswith("mlwe.") and not m.endswith(".cli") and ".cli." not in m
            and m not in LIGHT
            and not package(m)}
    return sorted(heavy | mlwe)


@pytest.mark.parametrize(
    "code",
    [
        "import mlwe.cli",
        # building the whole click command tree is what --help does
        "import typer.main, mlwe.cli\ntyper.main.get_command(mlwe.cli.app)",
    ],
    ids=["import", "command-tree"],
)
def test_the_cli_does_not_load_the_server(code: str) -> None:
    assert _heavy(_loaded_after(code)) == []


def test_help_runs_without_the_server_loaded() -> None:
    code = (
        "import sys, mlwe.cli\nsys.argv = ['mlwe', '--help']\n"
        "try:\n    mlwe.cli.main()\nexcept SystemExit:\n    pass"
    )
    assert _heavy(_loaded_after(code)) == []
