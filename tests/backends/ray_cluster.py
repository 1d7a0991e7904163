"""One real multi-node Ray cluster per test process, shared by every Ray test.

Starting Ray takes seconds, so the cluster is started once, on first use, and
stopped when the test process exits. Each test asks for the nodes it needs
(:func:`ray_cluster` adds missing Ray nodes, by mlwe node name) and uses its
own name prefix for actors and placement groups, so tests do not see each
other's work. A test that kills a node leaves it dead; the next test asking
for it gets a fresh Ray node with the same mlwe name.

Under ``CI=true`` a Ray that cannot start fails the test; elsewhere the test
is skipped with the reason.
"""

from __future__ import annotations

import atexit
import itertools
import os
from collections.abc import Iterable

import pytest

from mlwe.core import NodeSpec

_cluster = None
_failure: str | None = None
_prefixes = itertools.count(1)

#: The Ray nodes started for every Ray test: two, as the conformance suite needs
#: (n0, n1), with fake GPUs of two different models. The conformance suite
#: declares them as CPU-only nodes (a Ray node may advertise more than the mlwe
#: node uses); the GPU tests declare their GPUs. Fewer Ray nodes: faster start.
BASE_NODES = (
    NodeSpec(name="n0", gpu_model="A100-80GB", gpus=2, cpu="4", memory="4Gi"),
    NodeSpec(name="n1", gpu_model="T4", gpus=2, cpu="4", memory="4Gi"),
)


def ray_cluster(nodes: Iterable[NodeSpec] = BASE_NODES):  # type: ignore[no-untyped-def]
    """The shared LocalRayCluster, with a live Ray node for each of ``nodes``."""
    global _cluster, _failure
    if _failure is not None:
        _fail(_failure)
    if _cluster is None:
        try:
            from mlwe.backends.ray import LocalRayCluster

            _cluster = LocalRayCluster(BASE_NODES, namespace="mlwe-tests")
        except Exception as exc:  # Ray missing or unable to start here
            _failure = f"cannot start a local Ray cluster: {type(exc).__name__}: {exc}"
            _fail(_failure)
        atexit.register(_shutdown)
    _cluster.ensure_nodes(list(nodes))
    return _cluster


def new_prefix(tag: str) -> str:
    """A name prefix for one test's actors and placement groups."""
    return f"t{os.getpid()}-{next(_prefixes)}-{tag}"


def _fail(why: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why)
    pytest.skip(why)


def _shutdown() -> None:
    global _cluster
    if _cluster is not None:
        _cluster.shutdown()
        _cluster = None
