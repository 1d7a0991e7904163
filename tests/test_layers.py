"""The core stays pure: checked by reading its imports and calls (the AST, not a regex).

``src/mlwe/core`` may import nothing else from ``mlwe``, no I/O or concurrency
library, no wall clock and no unseeded randomness. This complements the
import-linter contract in pyproject.toml (which does not see calls such as
``datetime.now()`` or ``random.random()``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
CORE = SRC / "mlwe" / "core"

#: Top-level modules the core must not import.
FORBIDDEN_MODULES = frozenset(
    {
        "asyncio", "sqlite3", "sqlalchemy", "fastapi", "httpx", "requests", "subprocess",
        "socket", "psutil", "ray", "nats", "threading", "os", "time", "yaml", "rich", "typer",
        # the same spirit: processes, threads, files, network, dynamic imports
        "multiprocessing", "concurrent", "shutil", "tempfile", "urllib", "http", "importlib",
        "signal", "selectors",
    }
)
#: Builtins that do I/O.
FORBIDDEN_CALLS = frozenset({"open", "print", "input", "__import__"})
#: ``datetime.now()`` and friends read the wall clock.
CLOCK_METHODS = frozenset({"now", "utcnow", "today", "fromtimestamp", "utcfromtimestamp"})
CLOCK_OWNERS = frozenset({"datetime", "date"})


def module_name(path: Path) -> tuple[str, bool]:
    """Dotted name of a source file under src/, and whether it is a package ``__init__``."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _attr_chain(node: ast.expr) -> list[str]:
    out: list[str] = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        out.append(node.id)
    return out[::-1]


def purity_problems(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every way ``source`` (the module ``module``) breaks the core's purity rule."""
    tree = ast.parse(source)
    problems: list[str] = []
    random_modules: set[str] = set()  # names bound to the random module
    random_classes: set[str] = set()  # names bound to random.Random

    def imported(full: str, line: int) -> None:
        top = full.split(".")[0]
        if top == "mlwe" and full != "mlwe" and not (
            full == "mlwe.core" or full.startswith("mlwe.core.")
        ):
            problems.append(f"{module}:{line}: imports {full} (outside mlwe.core)")
        if top in FORBIDDEN_MODULES:
            problems.append(f"{module}:{line}: imports {full} (I/O, threads or wall clock)")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                imported(alias.name, node.lineno)
                if alias.name == "mlwe":
                    problems.append(f"{module}:{node.lineno}: imports the whole mlwe package")
                if alias.name == "random":
                    random_modules.add(alias.asname or "random")
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            imported(base, node.lineno)
            if base == "mlwe":
                for alias in node.names:
                    imported(f"mlwe.{alias.name}", node.lineno)
            if base == "random":
                for alias in node.names:
                    if alias.name == "Random":
                        random_classes.add(alias.asname or "Random")
                    else:
                        problems.append(
                            f"{module}:{node.lineno}: random.{alias.name} is unseeded randomness"
                        )
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in FORBIDDEN_CALLS:
                problems.append(f"{module}:{node.lineno}: calls {func.id}()")
            chain = _attr_chain(func)
            if (
                len(chain) >= 2
                and chain[-1] in CLOCK_METHODS
                and chain[-2] in CLOCK_OWNERS
            ):
                problems.append(f"{module}:{node.lineno}: reads the wall clock ({'.'.join(chain)})")
            if chain[-2:] == ["time", "time"] or chain[-2:] == ["time", "monotonic"]:
                problems.append(f"{module}:{node.lineno}: reads the wall clock ({'.'.join(chain)})")
            is_random_class = (
                isinstance(func, ast.Name) and func.id in random_classes
            ) or (
                len(chain) == 2 and chain[0] in random_modules and chain[1] == "Random"
            )
            if is_random_class and not node.args and not node.keywords:
                problems.append(f"{module}:{node.lineno}: Random() without a seed")
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in random_modules
            and node.attr != "Random"
        ):
            problems.append(f"{module}:{node.lineno}: random.{node.attr} is unseeded randomness")
    return problems


def core_files() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def test_core_sources_are_found() -> None:
    names = {module_name(p)[0] for p in core_files()}
    assert {"mlwe.core", "mlwe.core.controlplane", "mlwe.core.scheduler"} <= names
    assert any(n.startswith("mlwe.core.policies.") for n in names)


@pytest.mark.parametrize("path", core_files(), ids=lambda p: str(p.relative_to(SRC)))
def test_core_module_is_pure(path: Path) -> None:
    module, is_package = module_name(path)
    assert purity_problems(path.read_text(encoding="utf-8"), module, is_package) == []


# The checker itself must be able to fail: each of these breaks the rule.
IMPURE = {
    "sibling layer": ("from mlwe.sim import bench", "mlwe.core.x"),
    "sibling layer, plain import": ("import mlwe.store.sqlite", "mlwe.core.x"),
    "sibling via package": ("from mlwe import runtime", "mlwe.core.x"),
    "relative escape": ("from ..api import app", "mlwe.core.x"),
    "relative escape from a subpackage": ("from ...agent import loop", "mlwe.core.policies.x"),
    "cli": ("from mlwe.cli import main", "mlwe.core.x"),
    "os": ("import os", "mlwe.core.x"),
    "os.path": ("from os import path", "mlwe.core.x"),
    "time": ("import time", "mlwe.core.x"),
    "asyncio": ("import asyncio", "mlwe.core.x"),
    "threading": ("from threading import Lock", "mlwe.core.x"),
    "sqlite3": ("import sqlite3", "mlwe.core.x"),
    "yaml": ("import yaml", "mlwe.core.x"),
    "psutil": ("import psutil as ps", "mlwe.core.x"),
    "subprocess": ("import subprocess", "mlwe.core.x"),
    "socket": ("import socket", "mlwe.core.x"),
    "httpx": ("import httpx", "mlwe.core.x"),
    "datetime.now": ("import datetime\nx = datetime.datetime.now()", "mlwe.core.x"),
    "datetime.utcnow": ("from datetime import datetime\nx = datetime.utcnow()", "mlwe.core.x"),
    "date.today": ("from datetime import date\nx = date.today()", "mlwe.core.x"),
    "random.random": ("import random\nx = random.random()", "mlwe.core.x"),
    "random.choice": ("from random import choice", "mlwe.core.x"),
    "Random()": ("from random import Random\nr = Random()", "mlwe.core.x"),
    "open": ("data = open('f').read()", "mlwe.core.x"),
    "print": ("print('hello')", "mlwe.core.x"),
}

PURE = {
    "core absolute": ("from mlwe.core.resources import Resources", "mlwe.core.x"),
    "core relative": ("from .resources import Resources", "mlwe.core.x"),
    "core relative from a subpackage": ("from ..rules import preemptible", "mlwe.core.policies.x"),
    "mlwe.core package": ("from mlwe import core", "mlwe.core.x"),
    "seeded Random": ("import random\nr = random.Random(7)", "mlwe.core.x"),
    "seeded Random by name": ("from random import Random\nr = Random(seed)", "mlwe.core.x"),
    "datetime type only": ("from datetime import datetime\nx: datetime | None = None", "mlwe.core.x"),
    "clock.now is injected": ("def f(clock):\n    return clock.now()", "mlwe.core.x"),
    "stdlib pure": ("import hashlib, heapq, json, math, re", "mlwe.core.x"),
}


@pytest.mark.parametrize("source,module", IMPURE.values(), ids=IMPURE.keys())
def test_checker_catches(source: str, module: str) -> None:
    assert len(purity_problems(source, module)) >= 1


@pytest.mark.parametrize("source,module", PURE.values(), ids=PURE.keys())
def test_checker_allows(source: str, module: str) -> None:
    assert purity_problems(source, module) == []
