"""Pipeline specs: what is accepted, and every refusal naming its step (table tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlwe.pipelines.spec import (
    Pipeline,
    PipelineError,
    PipelineSpec,
    StepKind,
    base_values,
    load_pipeline,
    missing_inputs,
    parse_pipeline,
    render,
    resolve_params,
)

ROOT = Path(__file__).resolve().parents[2]


def step(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "command": kw.pop("command", ["echo", name]), **kw}


def pipeline(*steps: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"name": kw.pop("name", "p"), "steps": list(steps), **kw}


def problems(doc: dict[str, Any]) -> list[str]:
    with pytest.raises(PipelineError) as exc:
        parse_pipeline(doc, "p.yaml")
    return exc.value.problems


# ------------------------------------------------------------------ refusals
INVALID = [
    (
        "unknown dependency",
        pipeline(step("a", depends_on=["nope"])),
        "p.yaml: step 'a': depends on unknown step 'nope' (steps: a)",
    ),
    (
        "self dependency",
        pipeline(step("a", depends_on=["a"])),
        "p.yaml: step 'a': depends on itself",
    ),
    (
        "cycle of three",
        pipeline(step("a", depends_on=["c"]), step("b", depends_on=["a"]),
                 step("c", depends_on=["b"])),
        "p.yaml: cycle between steps: a -> b -> c -> a (each depends on the one before it)",
    ),
    (
        "cycle through an input",
        pipeline(step("a", inputs={"x": {"from": "b.out"}}, outputs={"o": "o"}),
                 step("b", inputs={"y": {"from": "a.o"}}, outputs={"out": "out"})),
        "p.yaml: cycle between steps: a -> b -> a",
    ),
    (
        "input from an unknown step",
        pipeline(step("a", inputs={"x": {"from": "ghost.out"}})),
        "p.yaml: step 'a': input 'x' comes from unknown step 'ghost' (steps: a)",
    ),
    (
        "input from an output that does not exist",
        pipeline(step("a", outputs={"data": "d"}), step("b", inputs={"x": {"from": "a.model"}})),
        "p.yaml: step 'b': input 'x' wants output 'model' of step 'a', which has no such output"
        " (its outputs: data)",
    ),
    (
        "input from a service",
        pipeline(step("s", kind="service", outputs={"o": "o"}),
                 step("b", inputs={"x": {"from": "s.o"}})),
        "p.yaml: step 'b': input 'x' comes from service step 's'; services have no files to pass"
        " (depend on the service instead)",
    ),
    (
        "duplicate names",
        pipeline(step("a"), step("a")),
        "p.yaml: duplicate step name(s): a",
    ),
    (
        "placeholder for an input the step lacks",
        pipeline(step("a", command=["cat", "${inputs.data}"])),
        "p.yaml: step 'a': ${inputs.data} names no input of the step (its inputs: none)",
    ),
    (
        "placeholder for an undeclared parameter",
        pipeline(step("a", command=["x", "${params.lr}"]), params={"seed": 1}),
        "p.yaml: step 'a': ${params.lr} names an undeclared parameter (declared: seed)",
    ),
    (
        "service placeholder in a batch step",
        pipeline(step("a", command=["x", "${endpoint}"])),
        "p.yaml: step 'a': ${endpoint} is only known to service steps",
    ),
    (
        "unknown placeholder",
        pipeline(step("a", command=["x", "${whatever}"])),
        "p.yaml: step 'a': unknown placeholder ${whatever}",
    ),
    (
        "output escaping the run directory",
        pipeline(step("a", outputs={"o": "../elsewhere"})),
        "must be a relative path inside the run directory",
    ),
    (
        "runner-owned workload field",
        pipeline(step("a", workload={"id": "x"})),
        "p.yaml: step 'a': workload field(s) id are set by the pipeline runner",
    ),
    (
        "bad workload field",
        pipeline(step("a", workload={"resources": {"gpu": "lots"}})),
        "p.yaml: step 'a': workload.resources.gpu: cannot parse gpu quantity 'lots'",
    ),
    (
        "unknown priority class",
        pipeline(step("a", workload={"priority": "asap"})),
        "p.yaml: step 'a': workload.priority: unknown priority class 'asap'",
    ),
    (
        "replicas on a batch step",
        pipeline(step("a", replicas=3)),
        "p.yaml: step 'a': 'replicas' is for services",
    ),
    (
        "registering an output the step lacks",
        pipeline(step("a", registers={"name": "m", "output": "model"})),
        "p.yaml: step 'a': registers output 'model', which is not one of its outputs (none)",
    ),
    (
        "empty command",
        pipeline(step("a", command=[])),
        "p.yaml: step 'a': command: Tuple should have at least 1 item",
    ),
    (
        "bad step name",
        pipeline(step("has space")),
        "step name 'has space' must start with a letter or digit",
    ),
    (
        "input with both a path and a reference",
        pipeline(step("a", inputs={"x": {"from": "b.o", "path": "p"}})),
        "an input gives exactly one of 'from' (STEP.OUTPUT) or 'path'",
    ),
]


@pytest.mark.parametrize(("case", "doc", "expected"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_pipelines_are_refused_naming_the_step(
    case: str, doc: dict[str, Any], expected: str
) -> None:
    found = problems(doc)
    assert any(expected in p for p in found), found


def test_every_problem_is_reported_at_once() -> None:
    found = problems(pipeline(
        step("a", depends_on=["b", "ghost"], command=["x", "${params.nope}"]),
        step("b", depends_on=["a"]),
    ))
    assert len(found) == 3, found
    assert "p.yaml: step 'a': depends on unknown step 'ghost' (steps: a, b)" in found
    assert "p.yaml: cycle between steps: a -> b -> a (each depends on the one before it)" in found


# ------------------------------------------------------------------ accepted
def test_builder_and_order() -> None:
    p = Pipeline("train", params={"seed": 1}, defaults={"resources": {"cpu": "250m"}})
    prep = p.step("prepare", ["prog", "${outputs.data}", "${params.seed}"],
                  outputs={"data": "d.npz"})
    p.step("report", ["prog"], depends_on=["fit"])
    p.step("fit", ["prog", "${inputs.data}"], inputs={"data": prep.output("data")}, retries=2,
           workload={"resources": {"memory": "2Gi"}, "priority": "high"})
    spec = p.build()
    assert spec.order() == ["prepare", "fit", "report"]
    fit = spec.step("fit")
    assert spec.dependencies(fit) == ["prepare"]  # implied by the input
    w = spec.workload_spec(fit, workload_id="r.fit", command=["prog", "x"],
                           labels={"mlwe.run": "r"})
    # defaults and the step's own fields merge: cpu from the defaults, memory from the step
    assert (w.id, w.name, w.max_retries, w.priority) == ("r.fit", "train/fit", 2, 100)
    assert (w.resources.cpu, w.resources.memory) == (250, 2048)
    assert w.command == ("prog", "x") and w.labels == {"mlwe.run": "r"}


def test_service_defaults_to_inference_kind() -> None:
    spec = parse_pipeline(pipeline(step("serve", kind="service", replicas=3,
                                        command=["srv", "${endpoint}", "${replica}"])))
    s = spec.step("serve")
    assert s.kind is StepKind.SERVICE and s.replicas == 3
    w = spec.workload_spec(s, workload_id="r.serve.0", command=["srv"], labels={})
    assert w.kind.value == "inference"


def test_example_files_load() -> None:
    spec = load_pipeline(ROOT / "examples" / "pipelines" / "digits-train.yaml")
    assert isinstance(spec, PipelineSpec)
    assert spec.order() == ["prepare", "train", "evaluate"]
    assert spec.step("evaluate").registers is not None
    with pytest.raises(PipelineError) as exc:
        load_pipeline(ROOT / "examples" / "pipelines" / "invalid-cycle.yaml")
    assert any("cycle between steps: a -> b -> a" in p for p in exc.value.problems)


def test_unreadable_and_multi_document_files(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match="cannot read"):
        load_pipeline(tmp_path / "absent.yaml")
    f = tmp_path / "two.yaml"
    f.write_text("name: a\n---\nname: b\n")
    with pytest.raises(PipelineError, match="expected exactly one pipeline document, found 2"):
        load_pipeline(f)


# ------------------------------------------------------------------- runtime
def test_params_resolution() -> None:
    spec = parse_pipeline(pipeline(step("a"), params={"seed": 0, "lr": 0.1}))
    assert resolve_params(spec, {"seed": 3}) == {"seed": 3, "lr": 0.1}
    with pytest.raises(PipelineError, match=r"unknown parameter 'sede' for pipeline 'p' \(declared: seed, lr\)"):
        resolve_params(spec, {"sede": 3})
    with pytest.raises(PipelineError, match="is not a string, number or boolean"):
        resolve_params(spec, {"seed": [1]})


def test_render_and_missing_inputs(tmp_path: Path) -> None:
    spec = parse_pipeline(pipeline(
        step("a", command=["x", "${inputs.raw}"], inputs={"raw": "datasets/${params.name}.csv"}),
        params={"name": "digits"},
    ))
    values = base_values("r1", tmp_path / "runs" / "r1", tmp_path, {"name": "digits"})
    assert render("${params.name}-${run_id}", values) == "digits-r1"
    assert missing_inputs(spec, tmp_path, values) == [
        f"step 'a': input 'raw': {tmp_path}/datasets/digits.csv does not exist"
    ]
    (tmp_path / "datasets").mkdir()
    (tmp_path / "datasets" / "digits.csv").write_text("1,2\n")
    assert missing_inputs(spec, tmp_path, values) == []
