"""Trace loaders: real GPU-cluster job traces (and a seeded synthetic one) as workload specs.

This package owns turning a trace file into what a replay needs: each job's
submit time and TRUE duration (for the simulator only), the
:class:`~mlwe.core.spec.WorkloadSpec` the scheduler sees (resources, queue,
priority, deadline, a user estimate only where the trace has one), the
trace's default cluster and GPU catalogue, and the assumptions made on the
way (``Trace.notes``, meant to be printed in every report).

Loaders, one module each: :func:`load_philly` (``philly``), :func:`load_itp`
(``itp``), :func:`load_alibaba` (``alibaba``), :func:`load_generic_csv`
(``generic``), :func:`synthetic_trace` (``synthetic``); :func:`load_trace`
here dispatches on a name ("philly", "itp:04", "alibaba", "synthetic") or a
file path. What they share: ``model`` (Trace, TraceJob, the trace GPU models
and catalogue), ``rows`` (reading rows, cell parsers, the gang rule, raw jobs
to specs) and ``cluster`` (the ``pooled:N`` / ``nodes:NxG`` grammar and the
cluster a trace is given). Rules shared by every loader:

* Submit times are shifted so the first (valid) submit is t=0; deadlines are
  shifted by the same offset. Jobs are sorted by (submit time, source line).
* Durations below 1 s become 1 s (zero-length jobs break JCT ratios).
* A row that cannot be used raises :class:`TraceError` ("file:line: what is
  wrong") unless ``skip_bad_rows=True``, which counts it in ``Trace.skipped``.
  Node/machine rows are never skipped: a bad one always raises.
* Gang rule: a job asking for more whole GPUs than the largest node of the
  cluster has becomes a gang of ``n // g`` replicas of ``g`` GPUs, ``g`` the
  largest divisor of ``n`` not above the largest node's GPU count (so the
  GPU total is exact: 16 -> 2x8, 12 -> 2x6, 24 -> 3x8 on 8-GPU nodes).
  CPU and memory are split evenly over the replicas (rounded up).
* Pooled clusters (``"pooled:N"``) have no node boundaries: every job of n
  whole GPUs becomes n replicas of one GPU, and GPU model constraints are
  dropped (the pool has one generic model).

Only the standard library and :mod:`mlwe.core` are imported here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mlwe.core.catalog import GpuCatalog
from mlwe.sim.traces.alibaba import ALIBABA_MODELS, ALIBABA_QOS_PRIORITY, load_alibaba
from mlwe.sim.traces.cluster import ClusterArg, parse_cluster_spec
from mlwe.sim.traces.generic import load_generic_csv
from mlwe.sim.traces.itp import load_itp
from mlwe.sim.traces.model import (
    ALIBABA_G2,
    ALIBABA_G3,
    ITP_GPU,
    PHILLY_GPU,
    POOL_GPU,
    TRACE_CATALOG,
    TRACE_GPU,
    TRACES_DIR_ENV,
    Trace,
    TraceError,
    TraceJob,
    jitter_submits,
    resolve_traces_dir,
)
from mlwe.sim.traces.philly import load_philly
from mlwe.sim.traces.rows import gang_shape
from mlwe.sim.traces.synthetic import SYNTHETIC_MIX, synthetic_cluster, synthetic_trace

__all__ = [
    "ALIBABA_G2",
    "ALIBABA_G3",
    "ALIBABA_MODELS",
    "ALIBABA_QOS_PRIORITY",
    "ITP_GPU",
    "PHILLY_GPU",
    "POOL_GPU",
    "SYNTHETIC_MIX",
    "TRACES_DIR_ENV",
    "TRACE_CATALOG",
    "TRACE_GPU",
    "Trace",
    "TraceError",
    "TraceJob",
    "gang_shape",
    "jitter_submits",
    "load_alibaba",
    "load_generic_csv",
    "load_itp",
    "load_philly",
    "load_trace",
    "parse_cluster_spec",
    "resolve_traces_dir",
    "synthetic_cluster",
    "synthetic_trace",
]
_ITP_NAME = re.compile(r"^itp:(\d{1,2})$")


# ---------------------------------------------------------------- dispatch


def load_trace(
    name_or_path: str,
    *,
    limit: int | None = None,
    seed: int = 0,
    skip_bad_rows: bool = False,
    traces_dir: str | Path | None = None,
    cluster: ClusterArg = None,
    catalog: GpuCatalog | None = None,
) -> Trace:
    """Load a trace by name ("philly", "itp:NN", "alibaba", "synthetic") or CSV path.

    ``limit`` keeps the first N jobs in submit order (for "synthetic" it is
    the number of jobs generated, default 1000); ``seed`` is used only by
    "synthetic". ``cluster`` overrides the trace's default cluster: a
    ClusterSpec or a short form for :func:`parse_cluster_spec`.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit {limit} is negative")
    name = name_or_path.strip()
    common: dict[str, Any] = {"cluster": cluster, "catalog": catalog}
    if name == "philly":
        return load_philly(
            limit=limit, skip_bad_rows=skip_bad_rows, traces_dir=traces_dir, **common
        )
    if name == "alibaba":
        return load_alibaba(
            limit=limit, skip_bad_rows=skip_bad_rows, traces_dir=traces_dir, **common
        )
    if name == "synthetic":
        return synthetic_trace(1000 if limit is None else limit, seed, **common)
    m = _ITP_NAME.match(name)
    if m:
        return load_itp(
            int(m.group(1)),
            limit=limit,
            skip_bad_rows=skip_bad_rows,
            traces_dir=traces_dir,
            **common,
        )
    if name.startswith("itp"):
        raise TraceError(f"trace name {name!r}: expected 'itp:NN' (e.g. itp:04)")
    path = Path(name)
    if not path.is_file():
        raise FileNotFoundError(
            f"trace {name!r} is neither a known trace (philly, itp:NN, alibaba, synthetic)"
            f" nor an existing file ({path.resolve()})"
        )
    return load_generic_csv(name, limit=limit, skip_bad_rows=skip_bad_rows, **common)
