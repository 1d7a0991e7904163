"""Parsing workload specs from a request body (JSON or YAML), safely.

YAML anchors and aliases are refused: with them a small document can expand
into a huge one (the "billion laughs"), and specs never need them. JSON is
parsed with the standard library; nesting too deep for it is a clear error.
"""

from __future__ import annotations

import json
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.events import AliasEvent
from yaml.nodes import Node

from mlwe.core.catalog import GpuCatalog
from mlwe.core.spec import WorkloadSpec
from mlwe.specfile import parse_workloads

JSON_TYPES = ("application/json",)
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")


class BodyError(ValueError):
    def __init__(self, errors: list[tuple[str, str]], status: int = 422) -> None:
        self.errors = errors
        self.status = status
        super().__init__("; ".join(f"{p}: {m}" if p else m for p, m in errors))


class _NoAliasLoader(yaml.SafeLoader):
    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        if self.check_event(AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise ComposerError(
                None, None, "YAML aliases (*name) are not accepted in specs", event.start_mark
            )
        return super().compose_node(parent, index)


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
            return [json.loads(text)]
        except json.JSONDecodeError as exc:
            raise BodyError([("", f"invalid JSON: {exc}")]) from None
        except RecursionError:
            raise BodyError([("", "invalid JSON: nested too deeply")]) from None
    if kind in YAML_TYPES:
        try:
            docs = [d for d in yaml.load_all(text, Loader=_NoAliasLoader) if d is not None]
        except yaml.YAMLError as exc:
            raise BodyError([("", f"invalid YAML: {exc}")]) from None
        except RecursionError:
            raise BodyError([("", "invalid YAML: nested too deeply")]) from None
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
