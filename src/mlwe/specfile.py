"""Loading workload and cluster specs from YAML or JSON files.

Every problem is reported with the file and the field path
(``jobs.yaml: workloads[2].resources.gpu: ...``); nothing invalid is returned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.events import AliasEvent
from yaml.nodes import MappingNode

from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.spec import ClusterSpec, WorkloadSpec
from mlwe.jsontext import DocumentError, loads_json

__all__ = ["DocumentError", "SpecLoader", "loads_json", "loads_yaml"]


@dataclass(frozen=True)
class SpecError:
    source: str
    path: str
    message: str

    def __str__(self) -> str:
        return (
            f"{self.source}: {self.path}: {self.message}"
            if self.path
            else f"{self.source}: {self.message}"
        )


class SpecFileError(ValueError):
    def __init__(self, errors: list[SpecError]):
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))


def _loc(prefix: str, loc: Iterable[int | str]) -> str:
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


class SpecLoader(yaml.SafeLoader):
    """YAML for specs: no aliases (a small document must not expand into a huge one),
    no duplicate keys (last-wins would silently drop a field), finite numbers only."""

    def compose_node(self, parent: Any, index: int) -> Any:
        if self.check_event(AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise ComposerError(
                None, None, "YAML aliases (*name) are not accepted in specs", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # an unhashable key: the base class reports it
                if first is not None:
                    raise ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"duplicate key {key!r} (first at line {first.line + 1})",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_float(self, node: Any) -> float:
        value = super().construct_yaml_float(node)
        if not math.isfinite(value):
            raise ConstructorError(
                None, None, f"{node.value!r} is not a finite number", node.start_mark
            )
        return float(value)


SpecLoader.add_constructor("tag:yaml.org,2002:float", SpecLoader.construct_yaml_float)


def loads_yaml(text: str) -> list[Any]:
    """Every document of a YAML stream, read with :class:`SpecLoader`; raises
    :class:`DocumentError` with the line of the problem."""
    try:
        return [d for d in yaml.load_all(text, Loader=SpecLoader) if d is not None]
    except yaml.YAMLError as exc:
        raise DocumentError(f"invalid YAML at {yaml_problem(exc)}") from None
    except RecursionError:
        raise DocumentError("invalid YAML: nested too deeply") from None
    except ValueError:  # an integer past Python's digit limit
        raise DocumentError("invalid YAML: a number has too many digits") from None


def read_documents(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        return [loads_json(text)]
    return loads_yaml(text)


def parse_workloads(
    data: Any, source: str = "<input>", catalog: GpuCatalog = DEFAULT_CATALOG
) -> tuple[list[WorkloadSpec], list[SpecError]]:
    """Validate one document: a spec, a list of specs, or ``{workloads: [...]}``."""
    if isinstance(data, dict) and "workloads" in data:
        items, prefix = data["workloads"], "workloads"
        extra = sorted(set(data) - {"workloads"})
        if extra:
            return [], [SpecError(source, extra[0], "unknown top-level key (expected 'workloads')")]
    elif isinstance(data, list):
        items, prefix = data, ""
    else:
        items, prefix = [data], None
    if not isinstance(items, list):
        return [], [SpecError(source, prefix or "", "expected a list of workload specs")]
    specs: list[WorkloadSpec] = []
    errors: list[SpecError] = []
    for i, item in enumerate(items):
        here = "" if prefix is None else f"{prefix}[{i}]"
        if not isinstance(item, dict):
            errors.append(SpecError(source, here, "expected a mapping of workload fields"))
            continue
        try:
            specs.append(WorkloadSpec.model_validate(item, context={"catalog": catalog}))
        except ValidationError as exc:
            errors += _errors(exc, source, here)
    return specs, errors


def _field_names(model: type[BaseModel], seen: set[type[BaseModel]] | None = None) -> set[str]:
    """Every field name of ``model`` and of the models nested in it (for "did you mean")."""
    import typing

    seen = seen if seen is not None else set()
    if model in seen:
        return set()
    seen.add(model)
    names: set[str] = set()
    for name, f in model.model_fields.items():
        names.add(f.alias or name)
        stack: list[Any] = [f.annotation]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                names |= _field_names(t, seen)
            stack += list(typing.get_args(t))
    return names


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """" (did you mean 'x'?)" for the closest choice, or "" when none is close."""
    import difflib

    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.7)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _errors(exc: ValidationError, source: str, here: str) -> list[SpecError]:
    out = []
    for e in exc.errors():
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden" and e["loc"] and isinstance(e["loc"][-1], str):
            msg = "unknown field" + did_you_mean(e["loc"][-1], _field_names(WorkloadSpec))
        out.append(SpecError(source, _loc(here, e["loc"]), msg))
    return out


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error as "line L, column C: problem", without PyYAML's ``<unicode string>``."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}" + (f" ({context})" if context else "")


def load_workloads(path: str | Path, catalog: GpuCatalog = DEFAULT_CATALOG) -> list[WorkloadSpec]:
    """All workload specs in ``path``; raises :class:`SpecFileError` listing every error."""
    p = Path(path)
    try:
        docs = read_documents(p)
    except (OSError, DocumentError, UnicodeDecodeError) as exc:
        raise SpecFileError([SpecError(str(p), "", f"cannot read: {exc}")]) from None
    specs: list[WorkloadSpec] = []
    errors: list[SpecError] = []
    for n, doc in enumerate(docs):
        source = str(p) if len(docs) == 1 else f"{p} (document {n + 1})"
        s, e = parse_workloads(doc, source, catalog)
        specs += s
        errors += e
    if errors:
        raise SpecFileError(errors)
    return specs


def load_model(
    path: str | Path, model: type[BaseModel], catalog: GpuCatalog = DEFAULT_CATALOG
) -> Any:
    p = Path(path)
    try:
        docs = read_documents(p)
    except (OSError, DocumentError, UnicodeDecodeError) as exc:
        raise SpecFileError([SpecError(str(p), "", f"cannot read: {exc}")]) from None
    if len(docs) != 1:
        raise SpecFileError([SpecError(str(p), "", "expected exactly one document")])
    try:
        return model.model_validate(docs[0], context={"catalog": catalog})
    except ValidationError as exc:
        raise SpecFileError(_errors(exc, str(p), "")) from None


def load_cluster(path: str | Path, catalog: GpuCatalog = DEFAULT_CATALOG) -> ClusterSpec:
    spec: ClusterSpec = load_model(path, ClusterSpec, catalog)
    return spec
