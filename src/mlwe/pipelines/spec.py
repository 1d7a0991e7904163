"""Pipeline specs: a DAG of steps, each a workload plus a command, validated up front.

A pipeline is written in YAML (``load_pipeline``) or built in Python
(:class:`Pipeline`). Each step is a workload spec (resources, priority, queue,
...: the fields of :class:`mlwe.core.spec.WorkloadSpec`) plus:

- ``command``: an argv (no shell). Placeholders ``${...}`` are filled in when
  the step is submitted: ``${inputs.NAME}``, ``${outputs.NAME}``,
  ``${params.NAME}``, ``${run_id}``, ``${run_dir}``, ``${data_dir}``,
  ``${step}``, ``${metrics}`` (a JSON file the step may write its metrics to),
  ``${python}`` (this interpreter), and for services ``${replica}`` and
  ``${endpoint}`` (a JSON file the replica writes its address to);
- ``depends_on``, ``inputs`` (``{from: STEP.OUTPUT}`` or a path under the data
  directory) and ``outputs`` (paths relative to the run directory): artifacts
  are files, passed by path; an input from a step is an implicit dependency;
- ``retries`` (the workload's ``max_retries``), ``kind`` (``batch`` or
  ``service``: a long-running server with ``replicas`` copies, each its own
  scheduled workload), and ``registers`` (register an output in the model
  registry when the step succeeds).

Everything that can be checked before running is checked here, and every
error names the step: unknown dependencies, cycles, inputs from unknown steps
or outputs, unknown placeholders, paths escaping the run directory, invalid
workload fields. Inputs that must already exist on disk are checked when a
run starts (:func:`missing_inputs`), before anything is submitted.
"""

from __future__ import annotations

import enum
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.spec import WorkloadKind, WorkloadSpec
from mlwe.specfile import DocumentError, loads_yaml

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,47}$")
_PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
_PARAM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: Workload fields a step may not set: the runner owns them.
RESERVED_WORKLOAD_FIELDS = frozenset({"id", "name", "command", "max_retries"})
#: Placeholders without a name part.
SIMPLE_PLACEHOLDERS = frozenset({"run_id", "run_dir", "data_dir", "step", "metrics", "python"})
SERVICE_PLACEHOLDERS = frozenset({"replica", "endpoint"})

ParamValue = str | int | float | bool


class StepKind(enum.StrEnum):
    BATCH = "batch"  # runs to completion; its outputs feed later steps
    SERVICE = "service"  # a long-running server (replicas); dependents start once it serves


class InputRef(BaseModel):
    """Where an input comes from: another step's output, or a path under the data dir."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    from_: str | None = Field(default=None, alias="from", description="STEP.OUTPUT")
    path: str | None = None

    @model_validator(mode="after")
    def _one(self) -> InputRef:
        if (self.from_ is None) == (self.path is None):
            raise ValueError("an input gives exactly one of 'from' (STEP.OUTPUT) or 'path'")
        if self.from_ is not None and self.from_.count(".") != 1:
            raise ValueError(f"'from' must be STEP.OUTPUT, got {self.from_!r}")
        if self.path is not None and not self.path.strip():
            raise ValueError("input path is empty")
        return self

    @property
    def step(self) -> str | None:
        return self.from_.split(".", 1)[0] if self.from_ else None

    @property
    def output(self) -> str | None:
        return self.from_.split(".", 1)[1] if self.from_ else None


def _as_input(v: Any) -> Any:
    # shorthand: a plain string is a path; "STEP.OUTPUT" references need the mapping form
    return {"path": v} if isinstance(v, str) else v


class ModelRegistration(BaseModel):
    """Register one of the step's outputs as a model version when the step succeeds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    output: str

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"model name {v!r}: letters, digits, '_' or '-', at most 48")
        return v


class StepSpec(BaseModel):
    """One step of a pipeline (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: StepKind = StepKind.BATCH
    command: tuple[str, ...] = Field(min_length=1)
    depends_on: tuple[str, ...] = ()
    inputs: dict[str, InputRef] = Field(default_factory=dict)
    outputs: dict[str, str] = Field(default_factory=dict)
    retries: int = Field(default=0, ge=0, le=20)
    replicas: int = Field(default=1, ge=1, le=256, description="service replicas")
    workload: dict[str, Any] = Field(
        default_factory=dict, description="WorkloadSpec fields (resources, priority, queue, ...)"
    )
    env: dict[str, str] = Field(default_factory=dict)
    registers: ModelRegistration | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(
                f"step name {v!r} must start with a letter or digit and contain only letters,"
                " digits, '_' or '-' (at most 48 characters)"
            )
        return v

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs(cls, v: Any) -> Any:
        if isinstance(v, Mapping):
            return {k: _as_input(x) for k, x in v.items()}
        return v

    @field_validator("inputs", "outputs")
    @classmethod
    def _io_names(cls, v: dict[str, Any]) -> dict[str, Any]:
        for k in v:
            if not _PARAM_NAME.match(k):
                raise ValueError(f"input/output name {k!r} must be letters, digits and '_'")
        return v

    @field_validator("outputs")
    @classmethod
    def _output_paths(cls, v: dict[str, str]) -> dict[str, str]:
        for k, p in v.items():
            pp = PurePosixPath(p)
            if not p.strip() or pp.is_absolute() or ".." in pp.parts:
                raise ValueError(
                    f"output {k!r}: {p!r} must be a relative path inside the run directory"
                )
        return v


class PipelineSpec(BaseModel):
    """A named DAG of steps with default parameters and workload defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    params: dict[str, ParamValue] = Field(default_factory=dict)
    defaults: dict[str, Any] = Field(
        default_factory=dict, description="WorkloadSpec fields every step starts from"
    )
    steps: tuple[StepSpec, ...] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(
                f"pipeline name {v!r} must start with a letter or digit and contain only letters,"
                " digits, '_' or '-' (at most 48 characters)"
            )
        return v

    @field_validator("params")
    @classmethod
    def _params(cls, v: dict[str, ParamValue]) -> dict[str, ParamValue]:
        for k in v:
            if not _PARAM_NAME.match(k):
                raise ValueError(f"parameter name {k!r} must be letters, digits and '_'")
        return v

    @model_validator(mode="after")
    def _graph(self, info: Any) -> PipelineSpec:
        ctx = info.context if isinstance(getattr(info, "context", None), dict) else {}
        catalog = ctx.get("catalog", DEFAULT_CATALOG)
        problems = graph_problems(self) + workload_problems(self, catalog)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    # ----------------------------------------------------------------- reading
    def step(self, name: str) -> StepSpec:
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(f"pipeline {self.name!r} has no step {name!r}")

    def dependencies(self, step: StepSpec) -> list[str]:
        """Explicit dependencies plus the steps its inputs come from, in order, once each."""
        deps = list(step.depends_on)
        deps += [i.step for i in step.inputs.values() if i.step is not None]
        return list(dict.fromkeys(deps))

    def order(self) -> list[str]:
        """Step names in a topological order (ties in the order written)."""
        indeg = {s.name: len(self.dependencies(s)) for s in self.steps}
        users: dict[str, list[str]] = {s.name: [] for s in self.steps}
        for s in self.steps:
            for d in self.dependencies(s):
                users[d].append(s.name)
        ready = [s.name for s in self.steps if indeg[s.name] == 0]
        out: list[str] = []
        while ready:
            n = ready.pop(0)
            out.append(n)
            for u in users[n]:
                indeg[u] -= 1
                if indeg[u] == 0:
                    ready.append(u)
        return out

    def workload_spec(
        self, step: StepSpec, *, workload_id: str, command: Sequence[str], labels: Mapping[str, str]
    ) -> WorkloadSpec:
        """The workload that runs ``step`` (validated: the pipeline check already passed)."""
        fields = _workload_fields(self, step)
        fields["labels"] = {**fields.get("labels", {}), **labels}
        fields.update(
            id=workload_id,
            name=f"{self.name}/{step.name}",
            command=tuple(command),
            max_retries=step.retries,
        )
        if step.env:
            fields["env"] = {**fields.get("env", {}), **step.env}
        return WorkloadSpec.model_validate(fields)


def _workload_fields(p: PipelineSpec, step: StepSpec) -> dict[str, Any]:
    fields: dict[str, Any] = {**p.defaults}
    for k, v in step.workload.items():
        if isinstance(v, Mapping) and isinstance(fields.get(k), Mapping):
            fields[k] = {**fields[k], **v}  # e.g. resources: a step overrides one figure
        else:
            fields[k] = v
    fields.setdefault(
        "kind",
        WorkloadKind.INFERENCE.value if step.kind is StepKind.SERVICE else WorkloadKind.OTHER.value,
    )
    return fields


def graph_problems(p: PipelineSpec) -> list[str]:
    """Every structural problem of the DAG, each naming its step."""
    problems: list[str] = []
    names = [s.name for s in p.steps]
    known = set(names)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        problems.append(f"duplicate step name(s): {', '.join(dup)}")
    by_name = {s.name: s for s in p.steps}
    for s in p.steps:
        where = f"step {s.name!r}"
        for d in s.depends_on:
            if d == s.name:
                problems.append(f"{where}: depends on itself")
            elif d not in known:
                problems.append(
                    f"{where}: depends on unknown step {d!r} (steps: {', '.join(names)})"
                )
        for iname, ref in s.inputs.items():
            if ref.step is None:
                continue
            src = by_name.get(ref.step)
            if ref.step == s.name:
                problems.append(f"{where}: input {iname!r} comes from the step itself")
            elif src is None:
                problems.append(
                    f"{where}: input {iname!r} comes from unknown step {ref.step!r}"
                    f" (steps: {', '.join(names)})"
                )
            elif ref.output not in src.outputs:
                have = ", ".join(src.outputs) or "none"
                problems.append(
                    f"{where}: input {iname!r} wants output {ref.output!r} of step {ref.step!r},"
                    f" which has no such output (its outputs: {have})"
                )
            elif src.kind is StepKind.SERVICE:
                problems.append(
                    f"{where}: input {iname!r} comes from service step {ref.step!r};"
                    " services have no files to pass (depend on the service instead)"
                )
        problems += _placeholder_problems(p, s)
        if s.kind is StepKind.BATCH and s.replicas != 1:
            problems.append(
                f"{where}: 'replicas' is for services; a batch step's gang size is"
                " workload.replicas"
            )
        if s.kind is StepKind.SERVICE and s.registers is not None:
            problems.append(f"{where}: a service step does not register models")
        if s.registers is not None and s.registers.output not in s.outputs:
            problems.append(
                f"{where}: registers output {s.registers.output!r}, which is not one of its"
                f" outputs ({', '.join(s.outputs) or 'none'})"
            )
        bad = sorted(set(s.workload) & RESERVED_WORKLOAD_FIELDS)
        if bad:
            problems.append(
                f"{where}: workload field(s) {', '.join(bad)} are set by the pipeline runner"
                " (use the step's name, command and retries)"
            )
        if s.kind is StepKind.SERVICE and "replicas" in s.workload:
            problems.append(f"{where}: a service's replica count is the step's 'replicas'")
    if not dup:
        cycle = find_cycle(p)
        if cycle:
            problems.append(
                f"cycle between steps: {' -> '.join(cycle)} (each depends on the one before it)"
            )
    bad_defaults = sorted(set(p.defaults) & RESERVED_WORKLOAD_FIELDS)
    if bad_defaults:
        problems.append(
            f"defaults: workload field(s) {', '.join(bad_defaults)} are set by the pipeline runner"
        )
    return problems


def _placeholder_problems(p: PipelineSpec, s: StepSpec) -> list[str]:
    out: list[str] = []
    where = f"step {s.name!r}"
    texts = [*s.command, *s.outputs.values(), *s.env.values()]
    texts += [ref.path for ref in s.inputs.values() if ref.path is not None]
    for text in texts:
        for m in _PLACEHOLDER.finditer(text):
            key = m.group(1).strip()
            group, _, name = key.partition(".")
            if not name:
                if key in SIMPLE_PLACEHOLDERS:
                    continue
                if key in SERVICE_PLACEHOLDERS:
                    if s.kind is not StepKind.SERVICE:
                        out.append(f"{where}: ${{{key}}} is only known to service steps")
                    continue
                out.append(
                    f"{where}: unknown placeholder ${{{key}}} (known: inputs.NAME,"
                    f" outputs.NAME, params.NAME, {', '.join(sorted(SIMPLE_PLACEHOLDERS))})"
                )
            elif group == "inputs" and name not in s.inputs:
                out.append(
                    f"{where}: ${{{key}}} names no input of the step"
                    f" (its inputs: {', '.join(s.inputs) or 'none'})"
                )
            elif group == "outputs" and name not in s.outputs:
                out.append(
                    f"{where}: ${{{key}}} names no output of the step"
                    f" (its outputs: {', '.join(s.outputs) or 'none'})"
                )
            elif group == "params" and name not in p.params:
                out.append(
                    f"{where}: ${{{key}}} names an undeclared parameter"
                    f" (declared: {', '.join(p.params) or 'none'})"
                )
            elif group not in ("inputs", "outputs", "params"):
                out.append(f"{where}: unknown placeholder ${{{key}}}")
    return out


def find_cycle(p: PipelineSpec) -> list[str]:
    """One dependency cycle as ``[a, b, ..., a]``, or ``[]`` when the graph is acyclic."""
    deps = {s.name: p.dependencies(s) for s in p.steps}
    colour: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str]:
        colour[n] = 1
        stack.append(n)
        for d in deps.get(n, []):
            if colour.get(d) == 1:
                return [*stack[stack.index(d) :], d][::-1]
            if colour.get(d) is None:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        colour[n] = 2
        return []

    for s in p.steps:
        if colour.get(s.name) is None:
            found = visit(s.name)
            if found:
                return found
    return []


def workload_problems(p: PipelineSpec, catalog: GpuCatalog = DEFAULT_CATALOG) -> list[str]:
    """Each step's workload fields, validated as a WorkloadSpec; errors name step and field."""
    out: list[str] = []
    for s in p.steps:
        if set(s.workload) & RESERVED_WORKLOAD_FIELDS or set(p.defaults) & RESERVED_WORKLOAD_FIELDS:
            continue  # reported by graph_problems
        fields = _workload_fields(p, s)
        fields.update(name=f"{p.name}/{s.name}", max_retries=s.retries, command=s.command)
        try:
            WorkloadSpec.model_validate(fields, context={"catalog": catalog})
        except ValidationError as exc:
            for e in exc.errors():
                loc = ".".join(str(x) for x in e["loc"])
                msg = e["msg"].removeprefix("Value error, ")
                out.append(f"step {s.name!r}: workload{'.' + loc if loc else ''}: {msg}")
    return out


# ======================================================================= runs
def resolve_params(p: PipelineSpec, overrides: Mapping[str, Any] | None) -> dict[str, ParamValue]:
    """The pipeline's parameters with ``overrides`` applied; unknown names are refused."""
    params: dict[str, ParamValue] = dict(p.params)
    for k, v in (overrides or {}).items():
        if k not in p.params:
            raise PipelineError(
                [f"unknown parameter {k!r} for pipeline {p.name!r}"
                 f" (declared: {', '.join(p.params) or 'none'})"]
            )
        if not isinstance(v, str | int | float | bool):
            raise PipelineError([f"parameter {k!r}: {v!r} is not a string, number or boolean"])
        params[k] = v
    return params


def render(text: str, values: Mapping[str, str]) -> str:
    """Fill the ``${...}`` placeholders of ``text`` from ``values`` (validated keys)."""

    def sub(m: re.Match[str]) -> str:
        key = m.group(1).strip()
        if key not in values:
            raise PipelineError([f"placeholder ${{{key}}} has no value here"])
        return values[key]

    return _PLACEHOLDER.sub(sub, text)


def input_path(ref: InputRef, data_dir: Path, values: Mapping[str, str]) -> Path:
    assert ref.path is not None
    p = Path(render(ref.path, values))
    return p if p.is_absolute() else data_dir / p


def missing_inputs(
    p: PipelineSpec, data_dir: Path, values: Mapping[str, str]
) -> list[str]:
    """Inputs given as paths that do not exist now, each naming its step."""
    out = []
    for s in p.steps:
        for iname, ref in s.inputs.items():
            if ref.path is None:
                continue
            path = input_path(ref, data_dir, values)
            if not path.exists():
                out.append(f"step {s.name!r}: input {iname!r}: {path} does not exist")
    return out


def base_values(run_id: str, run_dir: Path, data_dir: Path, params: Mapping[str, Any]) -> dict[str, str]:
    values = {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "data_dir": str(data_dir),
        "python": sys.executable,
    }
    for k, v in params.items():
        values[f"params.{k}"] = str(v).lower() if isinstance(v, bool) else str(v)
    return values


# ================================================================== loading
class PipelineError(ValueError):
    """A pipeline that cannot run, with every problem found (each names its step)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


def _flatten(exc: ValidationError, source: str, data: Mapping[str, Any]) -> list[str]:
    """Pydantic's errors as lines; a location inside a step is named by the step's name."""
    steps = data.get("steps")
    out = []
    for e in exc.errors():
        loc = list(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if loc == ["steps"] and isinstance(steps, list | tuple) and steps and (
            "at least 1 item" in msg
        ):
            continue  # pydantic's echo of an invalid step, not a missing list
        prefix = ""
        if len(loc) >= 2 and loc[0] == "steps" and isinstance(loc[1], int):
            item = steps[loc[1]] if isinstance(steps, list | tuple) and loc[1] < len(steps) else None
            name = item.get("name") if isinstance(item, Mapping) else None
            prefix = f"step {name!r}" if isinstance(name, str) else f"steps[{loc[1]}]"
            loc = loc[2:]
        where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")
        where = ": ".join(w for w in (prefix, where) if w)
        parts = msg.split("\n") if not where else [msg]
        for m in parts:
            out.append(f"{source}: {where + ': ' if where else ''}{m}")
    return out


def parse_pipeline(
    data: Any, source: str = "<pipeline>", catalog: GpuCatalog = DEFAULT_CATALOG
) -> PipelineSpec:
    """Validate a pipeline document; raises :class:`PipelineError` listing every problem."""
    if not isinstance(data, Mapping):
        raise PipelineError([f"{source}: expected a mapping with 'name' and 'steps'"])
    try:
        return PipelineSpec.model_validate(data, context={"catalog": catalog})
    except ValidationError as exc:
        raise PipelineError(_flatten(exc, source, data)) from None


def load_pipeline(path: str | Path, catalog: GpuCatalog = DEFAULT_CATALOG) -> PipelineSpec:
    """Read and validate a pipeline from a YAML or JSON file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        docs = loads_yaml(text)  # no aliases, no duplicate keys, finite numbers
    except (OSError, DocumentError, UnicodeDecodeError) as exc:
        raise PipelineError([f"{p}: cannot read: {exc}"]) from None
    if len(docs) != 1:
        raise PipelineError([f"{p}: expected exactly one pipeline document, found {len(docs)}"])
    doc = docs[0]
    if isinstance(doc, Mapping) and "pipeline" in doc and len(doc) == 1:
        doc = doc["pipeline"]
    return parse_pipeline(doc, str(p), catalog)


# ================================================================== builder
class StepHandle:
    """What :meth:`Pipeline.step` returns: names the step's outputs for later steps."""

    def __init__(self, name: str) -> None:
        self.name = name

    def output(self, name: str) -> dict[str, str]:
        return {"from": f"{self.name}.{name}"}


class Pipeline:
    """Build a pipeline in Python; :meth:`build` validates it like a YAML file.

    ::

        p = Pipeline("digits", params={"seed": 0})
        prep = p.step("prepare", ["${python}", "-m", "prog", "--out", "${outputs.data}"],
                      outputs={"data": "data.npz"})
        p.step("train", [...], inputs={"data": prep.output("data")}, retries=2,
               workload={"resources": {"cpu": "500m"}})
        spec = p.build()
    """

    def __init__(
        self,
        name: str,
        *,
        params: Mapping[str, ParamValue] | None = None,
        defaults: Mapping[str, Any] | None = None,
        description: str = "",
    ) -> None:
        self.name = name
        self.params = dict(params or {})
        self.defaults = dict(defaults or {})
        self.description = description
        self._steps: list[dict[str, Any]] = []

    def step(
        self,
        name: str,
        command: Sequence[str],
        *,
        kind: StepKind | str = StepKind.BATCH,
        depends_on: Sequence[str | StepHandle] = (),
        inputs: Mapping[str, str | Mapping[str, str]] | None = None,
        outputs: Mapping[str, str] | None = None,
        retries: int = 0,
        replicas: int = 1,
        workload: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        registers: Mapping[str, str] | None = None,
    ) -> StepHandle:
        self._steps.append(
            {
                "name": name,
                "kind": StepKind(kind).value,
                "command": list(command),
                "depends_on": [d.name if isinstance(d, StepHandle) else d for d in depends_on],
                "inputs": dict(inputs or {}),
                "outputs": dict(outputs or {}),
                "retries": retries,
                "replicas": replicas,
                "workload": dict(workload or {}),
                "env": dict(env or {}),
                **({"registers": dict(registers)} if registers else {}),
            }
        )
        return StepHandle(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "params": self.params,
            "defaults": self.defaults,
            "steps": self._steps,
        }

    def build(self, catalog: GpuCatalog = DEFAULT_CATALOG) -> PipelineSpec:
        return parse_pipeline(self.to_dict(), f"pipeline {self.name!r}", catalog)
