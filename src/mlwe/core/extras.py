"""The optional parts of mlwe (pip extras) and the error that names one when it is missing.

``pip install mlwe`` is the engine, API, dashboard, store and bus. What only some
commands use is an extra, installed with ``pip install 'mlwe[NAME]'``; the table
below says which extra holds which libraries and what needs them. A module that
needs an extra imports it where it is used and turns the ``ImportError`` into
:class:`MissingExtra` (``raise missing_extra("reports", exc) from exc``), so the
message names the extra to install instead of a bare module name.

Pure data and one exception (no imports happen here): every layer may use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Extra:
    """One pip extra: its name, the distributions it adds, and what needs them."""

    name: str
    requires: tuple[str, ...]  # distribution names, as in pyproject.toml
    modules: tuple[str, ...]  # top-level import names those distributions provide
    used_by: str

    @property
    def install(self) -> str:
        return f"pip install 'mlwe[{self.name}]'"


#: Every extra of the distribution (``pyproject.toml`` ``[project.optional-dependencies]``
#: holds the same names and distributions, checked by ``tests/test_extras.py``).
EXTRAS: Mapping[str, Extra] = {
    e.name: e
    for e in (
        Extra("reports", ("matplotlib",), ("matplotlib",),
              "replay and compare plots (mlwe replay/compare --out)"),
        Extra("pipelines", ("scikit-learn", "scipy", "numpy"), ("sklearn", "scipy", "numpy"),
              "the pipelines' ML programs (digits, drift detection, inference scaling)"),
        Extra("postgres", ("psycopg",), ("psycopg",),
              "a PostgreSQL store (--database-url postgresql+psycopg://...)"),
        Extra("nats", ("nats-py",), ("nats",), "the NATS JetStream bus (--bus nats://...)"),
        Extra("ray", ("ray",), ("ray",), "the Ray backend (--backend ray)"),
        Extra("openai", ("openai",), ("openai",),
              "the OpenAI-compatible LLM reasoner of the agent"),
        Extra("adk", ("google-adk",), ("google.adk",), "the Google ADK reasoner of the agent"),
        Extra("litellm", ("litellm",), ("litellm",),
              "the ADK reasoner's LiteLLM bridge to a local OpenAI-compatible model"),
        Extra("mlflow", ("mlflow-skinny",), ("mlflow",), "exporting pipeline runs to MLflow"),
    )
}


class MissingExtra(ImportError):
    """A feature needs an optional part of mlwe that is not installed here.

    An ``ImportError``, so code that already falls back on a missing import still
    does; the message names the extra, what needs it and the command that adds it.
    """

    def __init__(self, extra: Extra, missing: str | None = None) -> None:
        self.extra = extra
        self.missing = missing
        what = f" (no module named {missing!r})" if missing else ""
        super().__init__(
            f"{extra.used_by} needs the optional '{extra.name}' part of mlwe{what}:"
            f" install it with {extra.install}",
            name=missing,
        )


def missing_extra(name: str, cause: BaseException | str | None = None) -> MissingExtra:
    """The error for the extra ``name``; ``cause``: the ImportError (or module name) seen."""
    extra = EXTRAS[name]
    missing = cause if isinstance(cause, str) else getattr(cause, "name", None)
    return MissingExtra(extra, missing)
