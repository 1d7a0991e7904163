"""Parsing workload specs from a request body (JSON or YAML), safely.

Read with :mod:`mlwe.specfile`'s strict loaders: YAML anchors and aliases are
refused (with them a small document can expand into a huge one, the "billion
laughs"), duplicate keys are an error, numbers must be finite (no ``NaN``,
``Infinity``, ``.inf``, no integers of thousands of digits); nesting too deep
is a clear error.
"""

from __future__ import annotations

from typing import Any

from mlwe.core.catalog import GpuCatalog
from mlwe.core.spec import WorkloadSpec
from mlwe.specfile import DocumentError, loads_json, loads_yaml, parse_workloads

JSON_TYPES = ("application/json",)
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")


class BodyError(ValueError):
    def __init__(self, errors: list[tuple[str, str]], status: int = 422) -> None:
        self.errors = errors
        self.status = status
        super().__init__("; ".join(f"{p}: {m}" if p else m for p, m in errors))


def media_type(content_type: str | None) -> str:
    return (content_type or "application/json").split(";", 1)[0].strip().lower()


def read_documents(body: bytes, content_type: str | None) -> list[Any]:
    kind = media_type(content_type)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError([("", f"body is not UTF-8: {exc}")]) from None
    if not text.strip():
        raise BodyError([("", "empty body: send a workload spec, a list of them, or {workloads: [...]}")])
    if kind in JSON_TYPES:
        try:
            return [loads_json(text)]
        except DocumentError as exc:
            raise BodyError([("", str(exc))]) from None
    if kind in YAML_TYPES:
        try:
            docs = loads_yaml(text)
        except DocumentError as exc:
            raise BodyError([("", str(exc))]) from None
        if not docs:
            raise BodyError([("", "the YAML body holds no document")])
        return docs
    raise BodyError(
        [("", f"unsupported content type {kind!r}: use application/json or application/yaml")],
        status=415,
    )


def parse_specs(body: bytes, content_type: str | None, catalog: GpuCatalog) -> list[WorkloadSpec]:
    """Every workload spec in the body; raises :class:`BodyError` listing every problem."""
    docs = read_documents(body, content_type)
    specs: list[WorkloadSpec] = []
    errors: list[tuple[str, str]] = []
    for n, doc in enumerate(docs):
        try:
            s, e = parse_workloads(doc, "", catalog)
        except RecursionError:
            raise BodyError([("", "the document is nested too deeply")]) from None
        prefix = f"document[{n}]." if len(docs) > 1 else ""
        specs += s
        errors += [(f"{prefix}{err.path}".rstrip("."), err.message) for err in e]
    if errors:
        raise BodyError(errors)
    if not specs:
        raise BodyError([("", "no workload spec in the body")])
    return specs
