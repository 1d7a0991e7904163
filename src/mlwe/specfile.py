"""Loading workload and cluster specs from YAML or JSON files.

Every problem is reported with the file and the field path
(``jobs.yaml: workloads[2].resources.gpu: ...``); nothing invalid is returned.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.spec import ClusterSpec, WorkloadSpec


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


def read_documents(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        return [json.loads(text)]
    return [d for d in yaml.safe_load_all(text) if d is not None]


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


def _errors(exc: ValidationError, source: str, here: str) -> list[SpecError]:
    out = []
    for e in exc.errors():
        msg = e["msg"].removeprefix("Value error, ")
        out.append(SpecError(source, _loc(here, e["loc"]), msg))
    return out


def load_workloads(path: str | Path, catalog: GpuCatalog = DEFAULT_CATALOG) -> list[WorkloadSpec]:
    """All workload specs in ``path``; raises :class:`SpecFileError` listing every error."""
    p = Path(path)
    try:
        docs = read_documents(p)
    except (OSError, yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as exc:
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
    except (OSError, yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as exc:
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
