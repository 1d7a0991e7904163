"""One real Slurm cluster per test process, shared by every Slurm test.

munged, slurmctld and three slurmd (n0, n1, n2) on this machine
(:class:`mlwe.backends.slurm.LocalSlurmCluster`), started on first use and
stopped when the test process exits. Each test uses its own job prefix, so
tests do not see (or adopt) each other's jobs. A test that kills a node
leaves it dead; the next test asking for it gets its slurmd started again.

Under ``CI=true`` a Slurm that cannot start fails the test; elsewhere the test
is skipped with the reason (not root, or slurm-wlm/munge missing: ``make slurm``
installs them).
"""

from __future__ import annotations

import atexit
import itertools
import os
import tempfile
from collections.abc import Iterable

import pytest

_cluster = None
_failure: str | None = None
_prefixes = itertools.count(1)

#: n0 and n1 have two fake T4s each (GRES over mknod'ed devices), n2 none.
NODES = (("n0", {"t4": 2}), ("n1", {"t4": 2}), ("n2", {}))


def slurm_cluster(names: Iterable[str] = ("n0", "n1", "n2")):  # type: ignore[no-untyped-def]
    """The shared LocalSlurmCluster, with a live slurmd for each of ``names``."""
    global _cluster, _failure
    if _failure is not None:
        _fail(_failure)
    if _cluster is None:
        try:
            from mlwe.backends.slurm import LocalSlurmCluster, SlurmNode, slurm_missing

            why = slurm_missing()
            if why is not None:
                raise RuntimeError(why)
            base = tempfile.mkdtemp(prefix="mlwe-slurm-tests-")
            _cluster = LocalSlurmCluster(
                [SlurmNode(n, cpus=4, memory_mib=4096, gpus=g) for n, g in NODES], base)
        except Exception as exc:
            _failure = f"cannot start a local Slurm cluster: {type(exc).__name__}: {exc}"
            _fail(_failure)
        atexit.register(_shutdown)
    wanted = list(names)
    for n in wanted:
        _cluster.start_node(n)  # a no-op where its slurmd runs
    _cluster.wait_nodes(wanted, timeout=90)
    return _cluster


def new_prefix(tag: str) -> str:
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
