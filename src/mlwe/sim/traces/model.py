"""What every trace loader produces and shares: :class:`Trace` and :class:`TraceJob`,
:class:`TraceError`, the loaders' intermediate ``_RawJob``, the generic GPU models and
the one catalogue every trace uses, the per-GPU resource constants, and where the traces
folder is found (:func:`resolve_traces_dir`).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog, GpuModel
from mlwe.core.spec import ClusterSpec, WorkloadSpec

TRACES_DIR_ENV: Final = "MLWE_TRACES_DIR"

MIB_PER_GIB: Final = 1024
MIN_DURATION_S: Final = 1.0

# Generic catalogue models for traces that name no GPU type (or unknown ones).
PHILLY_GPU: Final = GpuModel("PHILLY-GPU", 12 * MIB_PER_GIB, rank=1)  # P100/K80 era, 12 GiB
ITP_GPU: Final = GpuModel("ITP-GPU", 32 * MIB_PER_GIB, rank=4)  # 2021, V100-32GB class
TRACE_GPU: Final = GpuModel("TRACE-GPU", 32 * MIB_PER_GIB, rank=4)  # generic CSV default
POOL_GPU: Final = GpuModel("POOL-GPU", 80 * MIB_PER_GIB, rank=5)  # "pooled:N" clusters
# Alibaba's G2 and G3 are undisclosed models; VRAM is an assumption (nothing in openb asks VRAM).
ALIBABA_G2: Final = GpuModel("G2", 32 * MIB_PER_GIB, rank=5)
ALIBABA_G3: Final = GpuModel("G3", 32 * MIB_PER_GIB, rank=5)

#: The catalogue every trace uses: the default one plus the generic trace models.
#: One superset for all traces, so any cluster override validates for any trace.
TRACE_CATALOG: Final = DEFAULT_CATALOG.extend(
    [PHILLY_GPU, ITP_GPU, TRACE_GPU, POOL_GPU, ALIBABA_G2, ALIBABA_G3]
)

# Philly / ITP / generic CSV: what one GPU's worth of a job asks, and what a node offers.
JOB_CPU_MILLI_PER_GPU: Final = 4_000
JOB_MEMORY_MIB_PER_GPU: Final = 32 * MIB_PER_GIB
NODE_CPU_MILLI_PER_GPU: Final = 4_000
NODE_CPU_MILLI_EXTRA: Final = 8_000
NODE_MEMORY_MIB_PER_GPU: Final = 64 * MIB_PER_GIB

ITP_TARGET_LOAD: Final = 0.85
ITP_GPUS_PER_NODE: Final = 8


class TraceError(ValueError):
    """A trace (or a row of it) cannot be used; the message names file and line."""


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One job of a trace.

    ``duration`` is the TRUE run time, known to the simulator only; what the
    scheduler may see is in ``spec`` (``estimated_duration`` is a user
    estimate where the trace gives one, else None).
    """

    job_id: str
    submit_time: float
    duration: float
    spec: WorkloadSpec
    line: int


@dataclass(frozen=True, slots=True)
class Trace:
    """A loaded trace: jobs in submit order, its default cluster and catalogue, assumptions."""

    name: str
    jobs: tuple[TraceJob, ...]
    cluster: ClusterSpec
    catalog: GpuCatalog
    skipped: int
    notes: tuple[str, ...]
    pooled: bool = False


def jitter_submits(trace: Trace, seconds: float, seed: int) -> Trace:
    """``trace`` with every job submitted a seeded uniform [0, ``seconds``) later,
    jobs in their new submit order (ties keep the old order); the name says so.

    A policy comparison on one contended trace moves by several percent under any
    small change (benchmarks/policy_noise.py measures how much): replaying the same
    trace with arrivals a second apart, under the same seed, tells a policy's real
    effect from the chance of one trace. Durations, specs and the cluster are kept."""
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"jitter seconds must be finite and >= 0, got {seconds!r}")
    if seconds == 0:
        return trace
    rng = random.Random(seed)
    moved = [
        (j.submit_time + rng.uniform(0.0, seconds), i, j) for i, j in enumerate(trace.jobs)
    ]
    moved.sort(key=lambda m: (m[0], m[1]))
    return replace(
        trace,
        name=f"{trace.name}~jitter{seconds:g}s#{seed}",
        jobs=tuple(replace(j, submit_time=t) for t, _, j in moved),
    )


# ---------------------------------------------------------------- locating files


def resolve_traces_dir(traces_dir: str | Path | None = None) -> Path:
    """The folder holding the traces.

    In order: ``traces_dir`` if given; else ``$MLWE_TRACES_DIR``; else
    ``<repo root>/../shared/traces`` where the repo root is the first folder
    holding ``pyproject.toml`` above the current directory, then above this
    file. Raises FileNotFoundError naming every path tried.
    """
    if traces_dir is not None:
        path = Path(traces_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"traces folder {path} does not exist")
        return path
    env = os.environ.get(TRACES_DIR_ENV)
    if env:
        path = Path(env)
        if not path.is_dir():
            raise FileNotFoundError(f"traces folder {path} (from ${TRACES_DIR_ENV}) does not exist")
        return path
    tried: list[Path] = []
    for start in (Path.cwd(), Path(__file__).resolve().parent):
        for base in (start, *start.parents):
            if (base / "pyproject.toml").is_file():
                candidate = (base / ".." / "shared" / "traces").resolve()
                if candidate.is_dir():
                    return candidate
                tried.append(candidate)
                break
    cwd_guess = (Path.cwd() / ".." / "shared" / "traces").resolve()
    if cwd_guess.is_dir():
        return cwd_guess
    tried.append(cwd_guess)
    raise FileNotFoundError(
        "traces folder not found; set $MLWE_TRACES_DIR or pass traces_dir. Tried: "
        + ", ".join(str(p) for p in dict.fromkeys(tried))
    )


# ---------------------------------------------------------------- jobs before shaping


@dataclass(slots=True)
class _RawJob:
    """A parsed row before it becomes a spec (the shape depends on the cluster)."""

    job_id: str
    line: int
    submit: float
    duration: float  # true, seconds, already clamped to >= 1 s
    gpu_milli: int  # total: a fraction (< 1000), 0, or whole GPUs * 1000
    cpu_milli: int  # total over all replicas
    memory_mib: int  # total over all replicas
    queue: str = "default"
    priority: int | str = 50
    deadline: float | None = None  # absolute, same clock as submit (before shifting)
    estimate: float | None = None
    gpu_models: tuple[str, ...] = ()
    kind: str = "other"
    replicas: int = 0  # 0 = decided by the gang rule
    labels: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
