"""ML pipelines and their supervision.

- :mod:`mlwe.pipelines.spec`: pipeline specs (YAML or the :class:`Pipeline`
  builder), a DAG of steps, each a workload plus a command, validated up front;
- :mod:`mlwe.pipelines.runner`: runs them, each step a workload submitted
  through the engine's control plane;
- runs, steps and the model registry are stored by :mod:`mlwe.store.pipelines`;
- :mod:`mlwe.pipelines.supervision`: application-layer agents (sensors with
  interval, cron and event triggers; rules; actuators that go through the
  verified proposal path);
- :mod:`mlwe.pipelines.drift`: the KS drift detector;
  :mod:`mlwe.pipelines.loadgen`: seeded request load and a client-side router;
- :mod:`mlwe.pipelines.loop`: one thread driving engine, runner and supervisors;
  :mod:`mlwe.pipelines.ports`: what they need of an engine (a protocol);
- :mod:`mlwe.pipelines.mlflow_export`: optional export;
- :mod:`mlwe.pipelines.drift_retrain` and
  :mod:`mlwe.pipelines.inference_scaling`: the two case studies, whose step
  programs are in :mod:`mlwe.pipelines.programs` (their cluster, a workload
  daemon per node with node failure injection, is
  :class:`mlwe.backends.local.nodes.LocalNodes`);
- :mod:`mlwe.pipelines.cli`: ``mlwe pipeline``, ``mlwe runs``, ``mlwe example``.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what mypy sees; at run time each name loads on first use
    from mlwe.pipelines.spec import (
        InputRef,
        ModelRegistration,
        Pipeline,
        PipelineError,
        PipelineSpec,
        StepKind,
        StepSpec,
        load_pipeline,
        parse_pipeline,
    )

__all__ = [
    "InputRef",
    "ModelRegistration",
    "Pipeline",
    "PipelineError",
    "PipelineSpec",
    "StepKind",
    "StepSpec",
    "load_pipeline",
    "parse_pipeline",
]


def __getattr__(name: str) -> Any:
    # loaded on first use: ``mlwe --help`` imports the pipelines' CLI, not the specs
    if name in __all__:
        return getattr(import_module("mlwe.pipelines.spec"), name)
    raise AttributeError(f"module 'mlwe.pipelines' has no attribute {name!r}")
