"""Spec validation at the edge: quantities in human units, and bad input stopped
with an error that names the field (``ValidationError.errors()`` loc) and the problem."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from mlwe.core import (
    DEFAULT_PRIORITY_CLASSES,
    ClusterSpec,
    NodePool,
    NodeSpec,
    QueueSpec,
    WorkloadSpec,
)
from mlwe.core.resources import UNLIMITED


def spec(**fields: Any) -> WorkloadSpec:
    return WorkloadSpec.model_validate({"name": "w", **fields})


def errors(exc: pytest.ExceptionInfo[ValidationError]) -> list[tuple[str, str]]:
    """(field path, message) per error; the root of the model is ''."""
    return [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in exc.value.errors()]


# ------------------------------------------------------------- quantities
QUANTITIES = [
    # (id, fields, attribute path, stored value)
    ("memory-Gi", {"resources": {"memory": "16Gi"}}, "resources.memory", 16 * 1024),
    ("memory-Mi", {"resources": {"memory": "512Mi"}}, "resources.memory", 512),
    ("memory-Ti", {"resources": {"memory": "1Ti"}}, "resources.memory", 1024 * 1024),
    ("memory-GB-is-decimal", {"resources": {"memory": "1GB"}}, "resources.memory", 954),
    ("memory-plain-number-is-MiB", {"resources": {"memory": 2048}}, "resources.memory", 2048),
    ("cpu-millicores", {"resources": {"cpu": "500m"}}, "resources.cpu", 500),
    ("cpu-cores", {"resources": {"cpu": 4}}, "resources.cpu", 4000),
    ("cpu-fractional-cores", {"resources": {"cpu": "1.5"}}, "resources.cpu", 1500),
    ("gpu-whole", {"resources": {"gpu": 8}}, "resources.gpu", 8000),
    ("gpu-fraction", {"resources": {"gpu": 0.25}}, "resources.gpu", 250),
    ("gpu-milli", {"resources": {"gpu": "500m"}}, "resources.gpu", 500),
    ("vram-Gi", {"resources": {"gpu": 1, "vram": "40Gi"}}, "resources.vram", 40960),
    ("duration-h-m", {"estimated_duration": "1h30m"}, "estimated_duration", 5400.0),
    ("duration-minutes", {"estimated_duration": "90m"}, "estimated_duration", 5400.0),
    ("duration-days", {"estimated_duration": "2d"}, "estimated_duration", 172800.0),
    ("duration-seconds-number", {"estimated_duration": 3600}, "estimated_duration", 3600.0),
    ("duration-milliseconds", {"checkpoint_cost": "500ms"}, "checkpoint_cost", 0.5),
    ("duration-m-s", {"restart_cost": "1m30s"}, "restart_cost", 90.0),
    ("min-vram", {"resources": {"gpu": 1}, "min_vram_per_gpu": "40Gi"}, "min_vram_per_gpu", 40960),
]


@pytest.mark.parametrize(
    ("fields", "path", "expected"),
    [q[1:] for q in QUANTITIES],
    ids=[q[0] for q in QUANTITIES],
)
def test_quantity_is_stored_as_engine_integer_or_seconds(
    fields: dict[str, Any], path: str, expected: float
) -> None:
    value: Any = spec(**fields)
    for part in path.split("."):
        value = getattr(value, part)
    assert value == expected
    assert type(value) is type(expected)


def test_defaults() -> None:
    s = spec()
    assert (s.priority, s.priority_class, s.queue, s.replicas) == (50, None, "default", 1)
    assert (s.resources.gpu, s.resources.cpu, s.resources.memory) == (0, 1000, 1024)


# -------------------------------------------------------- priority classes
@pytest.mark.parametrize(("name", "value"), sorted(DEFAULT_PRIORITY_CLASSES.items()))
def test_priority_class_name_resolves_to_its_value(name: str, value: int) -> None:
    s = spec(priority=name)
    assert (s.priority, s.priority_class) == (value, name)


def test_priority_integer_is_kept() -> None:
    assert (spec(priority=77).priority, spec(priority=77).priority_class) == (77, None)


def test_priority_classes_from_context() -> None:
    s = WorkloadSpec.model_validate(
        {"name": "w", "priority": "gold"}, context={"priority_classes": {"gold": 7}}
    )
    assert (s.priority, s.priority_class) == (7, "gold")


# -------------------------------------------------------------- rejections
REJECTED = [
    # (id, fields, field path in loc, fragment of the message)
    ("unknown-priority-class", {"priority": "urgentt"}, "priority",
     "unknown priority class 'urgentt'; known: best-effort, low, batch"),
    ("negative-priority", {"priority": -1}, "priority", "greater than or equal to 0"),
    ("unknown-gpu-model", {"resources": {"gpu": 1}, "gpu_models": ["A100-81GB"]},
     "gpu_models", "unknown GPU model(s) A100-81GB; known: A10, A100-40GB"),
    ("gpu-1.5", {"resources": {"gpu": 1.5}}, "resources.gpu",
     "whole GPUs (1, 2, 8) or one fraction below 1"),
    ("gpu-above-64", {"resources": {"gpu": 65}}, "resources.gpu", "at most 64 GPUs per replica"),
    ("negative-gpu", {"resources": {"gpu": -1}}, "resources.gpu", "must not be negative"),
    ("vram-without-gpu", {"resources": {"vram": "16Gi"}}, "resources",
     "vram asked for without any gpu"),
    ("vram-more-than-the-gpus-have",
     {"resources": {"gpu": 1, "vram": "32Gi"}, "gpu_models": ["T4"]}, "",
     "resources.vram is more than the accepted GPUs have"),
    ("gpu-models-without-gpu", {"gpu_models": ["T4"]}, "",
     "gpu_models / min_vram_per_gpu given for a workload that asks no GPU"),
    ("min-vram-no-model-has", {"resources": {"gpu": 1}, "min_vram_per_gpu": "200Gi"}, "",
     "no accepted GPU model has 204800 MiB of VRAM per GPU"),
    ("deadline-and-deadline-in", {"deadline": 100, "deadline_in": "1h"}, "",
     "give deadline or deadline_in, not both"),
    ("zero-deadline", {"deadline": 0}, "deadline", "greater than 0"),
    ("memory-unit", {"resources": {"memory": "16Gx"}}, "resources.memory",
     "unknown memory unit 'Gx' in '16Gx'"),
    ("memory-garbage", {"resources": {"memory": "lots"}}, "resources.memory",
     "cannot parse memory quantity 'lots'"),
    ("memory-bool", {"resources": {"memory": True}}, "resources.memory",
     "memory quantity must be a number"),
    ("negative-cpu", {"resources": {"cpu": -1}}, "resources.cpu", "must not be negative"),
    ("cpu-unit", {"resources": {"cpu": "2Gi"}}, "resources.cpu", "cannot parse cpu quantity '2Gi'"),
    ("empty-replica", {"resources": {"cpu": 0, "memory": 0}}, "resources",
     "a replica must ask for some gpu, cpu or memory"),
    ("duration-garbage", {"estimated_duration": "1h30x"}, "estimated_duration",
     "cannot parse duration '1h30x'"),
    ("duration-zero", {"estimated_duration": 0}, "estimated_duration", "greater than 0"),
    ("negative-restart-cost", {"restart_cost": -5}, "restart_cost", "must not be negative"),
    ("min-progress-above-1", {"min_progress": 1.5}, "min_progress", "less than or equal to 1"),
    ("zero-replicas", {"replicas": 0}, "replicas", "greater than or equal to 1"),
    ("bad-id", {"id": "bad id"}, "id", "must start with a letter or digit"),
    ("bad-queue", {"queue": "../etc"}, "queue", "must start with a letter or digit"),
    ("control-char-in-name", {"name": "a\nb"}, "name", "must not contain control characters"),
    ("empty-name", {"name": ""}, "name", "at least 1 character"),
    ("unknown-field", {"gpus": 8}, "gpus", "Extra inputs are not permitted"),
    ("unknown-nested-field", {"resources": {"gpus": 8}}, "resources.gpus",
     "Extra inputs are not permitted"),
]


@pytest.mark.parametrize(
    ("fields", "loc", "fragment"), [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED]
)
def test_invalid_workload_is_rejected_naming_the_field(
    fields: dict[str, Any], loc: str, fragment: str
) -> None:
    with pytest.raises(ValidationError) as exc:
        spec(**fields)
    errs = errors(exc)
    assert len(errs) == 1, errs
    (got_loc, msg) = errs[0]
    assert got_loc == loc
    assert fragment in msg


def test_cross_field_errors_name_the_fields_in_the_message() -> None:
    # root-level errors have an empty loc, so the message must say which fields clash
    for fields, names in [
        ({"deadline": 100, "deadline_in": "1h"}, ("deadline", "deadline_in")),
        ({"gpu_models": ["T4"]}, ("gpu_models",)),
    ]:
        with pytest.raises(ValidationError) as exc:
            spec(**fields)
        ((loc, msg),) = errors(exc)
        assert loc == ""
        for name in names:
            assert name in msg


def test_every_error_is_reported_not_just_the_first() -> None:
    with pytest.raises(ValidationError) as exc:
        spec(priority="nope", deadline=-5, min_progress=2)
    assert sorted(loc for loc, _ in errors(exc)) == ["deadline", "min_progress", "priority"]


def test_boolean_priority_is_refused() -> None:
    with pytest.raises(ValidationError) as exc:
        spec(priority=True)
    assert [loc for loc, _ in errors(exc)] == ["priority"]


def test_specs_are_frozen() -> None:
    s = spec()
    with pytest.raises(ValidationError):
        s.priority = 1  # type: ignore[misc]


def test_duplicate_gpu_models_are_collapsed_in_order() -> None:
    s = spec(resources={"gpu": 1}, gpu_models=["T4", "A100-80GB", "T4"])
    assert s.gpu_models == ("T4", "A100-80GB")


# ------------------------------------------------------ nodes, queues, clusters
NODE_REJECTED = [
    ("gpus-without-model", {"name": "n", "gpus": 8}, "a node with gpus needs a gpu_model"),
    ("model-without-gpus", {"name": "n", "gpu_model": "T4"}, "gpu_model given for a node with 0"),
    ("unknown-model", {"name": "n", "gpu_model": "Z100", "gpus": 8}, "unknown GPU model 'Z100'"),
    ("no-cpu", {"name": "n", "cpu": 0}, "a node needs some cpu"),
]


@pytest.mark.parametrize(
    ("fields", "fragment"), [r[1:] for r in NODE_REJECTED], ids=[r[0] for r in NODE_REJECTED]
)
def test_invalid_node_is_rejected(fields: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError) as exc:
        NodeSpec.model_validate(fields)
    ((_, msg),) = errors(exc)
    assert fragment in msg


def test_node_quantities() -> None:
    n = NodeSpec(name="n", gpu_model="A100-80GB", gpus=8, cpu="96", memory="1Ti")
    assert (n.cpu, n.memory) == (96_000, 1024 * 1024)


def test_cluster_rejects_duplicate_node_names_across_pools() -> None:
    with pytest.raises(ValidationError) as exc:
        ClusterSpec(
            nodes=(NodeSpec(name="gpu-0"),),
            pools=(NodePool(prefix="gpu", count=2),),
        )
    ((_, msg),) = errors(exc)
    assert "duplicate node names: gpu-0" in msg


def test_cluster_rejects_duplicate_queue_names() -> None:
    with pytest.raises(ValidationError) as exc:
        ClusterSpec(queues=(QueueSpec(name="q"), QueueSpec(name="q")))
    ((_, msg),) = errors(exc)
    assert "duplicate queue names" in msg


def test_pool_expands_to_named_nodes() -> None:
    c = ClusterSpec(pools=(NodePool(prefix="t4", count=3, gpu_model="T4", gpus=4),))
    assert [(n.name, n.gpu_model, n.gpus) for n in c.all_nodes()] == [
        ("t4-0", "T4", 4),
        ("t4-1", "T4", 4),
        ("t4-2", "T4", 4),
    ]


def test_queue_quota_left_out_is_unlimited() -> None:
    q = QueueSpec.model_validate({"name": "q", "cohort": "c", "nominal": {"gpu": 8}})
    assert q.nominal_vector().as_tuple() == (8000, UNLIMITED, UNLIMITED, UNLIMITED)
    assert q.borrow_vector().as_tuple() == (UNLIMITED,) * 4
    assert QueueSpec(name="solo").borrow_vector().as_tuple() == (0, 0, 0, 0)


# ------------------------------------------------------------- round trips
ROUND_TRIPS = [
    ("fractional-gpu", {"name": "a", "resources": {"gpu": 0.5, "cpu": "500m", "memory": "3Gi"}}),
    ("whole-gpus", {"name": "b", "resources": {"gpu": 8, "cpu": 32, "memory": "512Gi"},
                    "gpu_models": ["A100-80GB"], "estimated_duration": "2h", "deadline_in": "3h"}),
    ("cpu-only", {"name": "c", "resources": {"cpu": 96, "memory": "1Ti"}, "priority": "low"}),
]


@pytest.mark.parametrize(("fields",), [(f,) for _, f in ROUND_TRIPS], ids=[i for i, _ in ROUND_TRIPS])
def test_a_dumped_spec_loads_back_equal(fields: dict[str, object]) -> None:
    from mlwe.core import WorkloadSpec

    w = WorkloadSpec.model_validate(fields)
    assert WorkloadSpec.model_validate(w.model_dump()) == w
    assert WorkloadSpec.model_validate_json(w.model_dump_json()) == w


def test_node_pools_of_an_extended_catalogue_validate_with_it() -> None:
    from mlwe.core import DEFAULT_CATALOG, ClusterSpec, GpuModel

    cat = DEFAULT_CATALOG.extend([GpuModel("X9", 8192)])
    c = ClusterSpec.model_validate(
        {"pools": [{"prefix": "x", "count": 2, "gpu_model": "X9", "gpus": 4}]},
        context={"catalog": cat},
    )
    assert [(n.name, n.gpu_model, n.gpus) for n in c.all_nodes()] == [("x-0", "X9", 4), ("x-1", "X9", 4)]
