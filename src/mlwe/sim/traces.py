"""Trace loaders: real GPU-cluster job traces (and a seeded synthetic one) as workload specs.

This module owns turning a trace file into what a replay needs: each job's
submit time and TRUE duration (for the simulator only), the
:class:`~mlwe.core.spec.WorkloadSpec` the scheduler sees (resources, queue,
priority, deadline, a user estimate only where the trace has one), the
trace's default cluster and GPU catalogue, and the assumptions made on the
way (``Trace.notes``, meant to be printed in every report).

Loaders: :func:`load_philly`, :func:`load_itp`, :func:`load_alibaba`,
:func:`load_generic_csv`, :func:`synthetic_trace`; :func:`load_trace`
dispatches on a name ("philly", "itp:04", "alibaba", "synthetic") or a
file path. Rules shared by every loader:

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

import contextlib
import csv
import gc
import math
import os
import random
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog, GpuModel
from mlwe.core.spec import ClusterSpec, NodePool, NodeSpec, QueueSpec, WorkloadSpec

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

#: Alibaba openb model names -> catalogue names.
ALIBABA_MODELS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "P100": "P100",
        "T4": "T4",
        "V100M16": "V100-16GB",
        "V100M32": "V100-32GB",
        "A10": "A10",
        "G2": "G2",
        "G3": "G3",
    }
)

#: Alibaba QoS class -> priority (LS = latency-sensitive services first, BE last).
ALIBABA_QOS_PRIORITY: Final[Mapping[str, int]] = MappingProxyType(
    {
        "LS": 100,
        "Guaranteed": 80,
        "Burstable": 50,
        "BE": 10,
    }
)

# Philly / ITP / generic CSV: what one GPU's worth of a job asks, and what a node offers.
JOB_CPU_MILLI_PER_GPU: Final = 4_000
JOB_MEMORY_MIB_PER_GPU: Final = 32 * MIB_PER_GIB
NODE_CPU_MILLI_PER_GPU: Final = 4_000
NODE_CPU_MILLI_EXTRA: Final = 8_000
NODE_MEMORY_MIB_PER_GPU: Final = 64 * MIB_PER_GIB

ITP_TARGET_LOAD: Final = 0.85
ITP_GPUS_PER_NODE: Final = 8

_POOLED_LABEL: Final = "mlwe.pooled"
_ITP_NAME = re.compile(r"^itp:(\d{1,2})$")
_NODES_FORM = re.compile(r"^nodes:(\d+)x(\d+)(?::(.+))?$")
_POOLED_FORM = re.compile(r"^pooled:(\d+)$")


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


def _trace_file(root: Path, relative: str) -> Path:
    path = root / relative
    if not path.is_file():
        raise FileNotFoundError(f"trace file {path} does not exist")
    return path


# ---------------------------------------------------------------- CSV reading


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while a loader allocates ~10^5 objects that all survive.

    Every gen-2 pass would rescan everything built so far; pausing it makes the
    full Philly load about 40% faster. Nothing built here forms reference cycles.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _RowError(Exception):
    """A row cannot be used; the message says why (file and line are added by the reader)."""


class _Row:
    """One CSV row with access by column name."""

    __slots__ = ("_index", "_values", "line")

    def __init__(self, index: Mapping[str, int], values: list[str], line: int) -> None:
        self._index = index
        self._values = values
        self.line = line

    def get(self, column: str) -> str:
        """The stripped value, or "" when the column is absent from the header."""
        i = self._index.get(column)
        return "" if i is None else self._values[i].strip()


def _read_rows(
    path: Path,
    label: str,
    required: Sequence[str],
    parse: Callable[[_Row], Any],
    *,
    skip_bad_rows: bool,
) -> tuple[list[Any], int]:
    """Parse every data row with ``parse``; bad rows raise or are counted."""
    out: list[Any] = []
    skipped = 0
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise TraceError(f"{label}:1: empty file (no header)") from None
        names = [h.strip() for h in header]
        missing = [c for c in required if c not in names]
        if missing:
            raise TraceError(
                f"{label}:1: missing column(s) {', '.join(missing)} (header: {', '.join(names)})"
            )
        index = {n: i for i, n in enumerate(names)}
        width = len(names)
        row = _Row(index, [], 0)  # one reused view: parse functions do not keep it
        for values in reader:
            line = reader.line_num
            if not values or (len(values) == 1 and not values[0].strip()):
                continue  # blank line
            try:
                if len(values) != width:
                    raise _RowError(f"expected {width} fields, got {len(values)}")
                row._values, row.line = values, line
                out.append(parse(row))
            except _RowError as e:
                if not skip_bad_rows:
                    raise TraceError(f"{label}:{line}: {e}") from None
                skipped += 1
    return out, skipped


def _number(text: str, column: str) -> float:
    if text == "":
        raise _RowError(f"{column} is missing")
    try:
        value = float(text)
    except ValueError:
        raise _RowError(f"{column} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise _RowError(f"{column} {text!r} is not a finite number")
    return value


def _whole(text: str, column: str) -> int:
    value = _number(text, column)
    if value != int(value):
        raise _RowError(f"{column} {text!r} is not a whole number")
    return int(value)


_WALL_CLOCK = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}")


def _wall_clock_utc(text: str, column: str) -> float:
    """'2017-10-09 07:01:55' read as UTC, in epoch seconds.

    Same result as ``strptime(text, "%Y-%m-%d %H:%M:%S")`` (the format is
    checked first), but fromisoformat is several times faster.
    """
    if _WALL_CLOCK.fullmatch(text):
        try:
            return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()
        except ValueError:
            pass
    raise _RowError(f"{column} {text!r} is not a date like '2017-10-09 07:01:55'")


def _non_negative(text: str, column: str) -> float:
    value = _number(text, column)
    if value < 0:
        raise _RowError(f"{column} {text!r} is negative")
    return value


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


def _per_gpu_job(
    job_id: str, line: int, submit: float, duration: float, gpus: int, **kw: Any
) -> _RawJob:
    return _RawJob(
        job_id=job_id,
        line=line,
        submit=submit,
        duration=duration,
        gpu_milli=gpus * 1000,
        cpu_milli=JOB_CPU_MILLI_PER_GPU * max(1, gpus),
        memory_mib=JOB_MEMORY_MIB_PER_GPU * max(1, gpus),
        **kw,
    )


class _Clamp:
    """Counts durations raised to the 1 s minimum."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, seconds: float) -> float:
        if seconds < MIN_DURATION_S:
            self.count += 1
            return MIN_DURATION_S
        return seconds

    def note(self) -> str:
        return (
            f"durations below {MIN_DURATION_S:g} s are raised to {MIN_DURATION_S:g} s"
            f" ({self.count} job(s) affected): zero-length jobs break JCT ratios"
        )


def gang_shape(gpus: int, max_gpus_per_node: int, *, pooled: bool = False) -> tuple[int, int]:
    """(replicas, GPUs per replica) for a job of ``gpus`` whole GPUs.

    Up to ``max_gpus_per_node`` GPUs: one replica. More: ``gpus // g``
    replicas of ``g`` GPUs, ``g`` the largest divisor of ``gpus`` not above
    ``max_gpus_per_node`` (exact total; 16 -> 2x8, 12 -> 2x6, 13 -> 13x1 on
    8-GPU nodes). Pooled: ``gpus`` replicas of one GPU.
    """
    if gpus <= 0:
        return 1, 0
    if pooled:
        return gpus, 1
    cap = max_gpus_per_node if max_gpus_per_node > 0 else 8
    if gpus <= cap:
        return 1, gpus
    per = next(d for d in range(cap, 0, -1) if gpus % d == 0)
    return gpus // per, per


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# A strict subset of the core's id rule (letters, digits, '.', '_', '-'; at most 128).
_PLAIN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _validation_message(e: ValueError) -> str:
    """A spec validation error as one line naming the fields.

    Specs raise pydantic's ValidationError, a ValueError; it is caught as such
    (and read through its ``errors()``) so that sim imports nothing but core.
    """
    errors = getattr(e, "errors", None)
    if not callable(errors):
        return str(e)
    parts = []
    for err in errors():
        loc = ".".join(str(x) for x in err["loc"])
        loc = {"id": "job_id", "name": "job_id"}.get(loc, loc)
        parts.append(f"{loc}: {err['msg']}" if loc else str(err["msg"]))
    return "; ".join(parts)


def _build_jobs(
    raws: list[_RawJob],
    *,
    label: str,
    catalog: GpuCatalog,
    cluster: ClusterSpec,
    pooled: bool,
    limit: int | None,
    skip_bad_rows: bool,
) -> tuple[list[TraceJob], int, int]:
    """Sort, shift, shape and validate; returns (jobs, skipped, GPU constraints dropped)."""
    raws.sort(key=lambda r: (r.submit, r.line))
    offset = raws[0].submit if raws else 0.0
    max_gpn = _max_gpus_per_node(cluster)
    context = {"catalog": catalog}
    jobs: list[TraceJob] = []
    skipped = 0
    dropped = 0
    seen: set[str] = set()
    # Specs that differ only in id/name share one fully validated template, copied
    # with the new id (Philly: 82k jobs, ~150 templates). Only ids that plainly pass
    # the core id rule take this path; anything else is validated in full.
    templates: dict[tuple[Any, ...], WorkloadSpec] = {}
    for r in raws:
        if limit is not None and len(jobs) >= limit:
            break
        try:
            if r.job_id in seen:
                raise _RowError(f"duplicate job_id {r.job_id!r}")
            if r.gpu_milli < 1000:
                replicas, gpu, cpu, mem = 1, r.gpu_milli, r.cpu_milli, r.memory_mib
            else:
                gpus = r.gpu_milli // 1000
                if r.replicas and not pooled and gpus // r.replicas <= max_gpn:
                    replicas, per = r.replicas, gpus // r.replicas
                else:
                    replicas, per = gang_shape(gpus, max_gpn, pooled=pooled)
                gpu = per * 1000
                cpu = _ceil_div(r.cpu_milli, replicas)
                mem = _ceil_div(r.memory_mib, replicas)
            models = r.gpu_models
            if pooled and models:
                models = ()
                dropped += 1
            key: tuple[Any, ...] | None = None
            if (
                r.deadline is None
                and r.estimate is None
                and not r.labels
                and not r.extra
                and _PLAIN_ID.fullmatch(r.job_id)
            ):
                key = (r.kind, r.queue, r.priority, replicas, gpu, cpu, mem, models)
                template = templates.get(key)
                if template is not None:
                    # fresh dicts: model_copy is shallow and these are mutable
                    spec = template.model_copy(
                        update={"id": r.job_id, "name": r.job_id, "labels": {}, "node_selector": {}}
                    )
            if key is None or template is None:
                spec = _validate_spec(r, replicas, gpu, cpu, mem, models, offset, context)
                if key is not None:
                    templates[key] = spec
        except _RowError as e:
            if not skip_bad_rows:
                raise TraceError(f"{label}:{r.line}: {e}") from None
            skipped += 1
            continue
        seen.add(r.job_id)
        jobs.append(TraceJob(r.job_id, r.submit - offset, r.duration, spec, r.line))
    return jobs, skipped, dropped


def _validate_spec(
    r: _RawJob,
    replicas: int,
    gpu: int,
    cpu: int,
    mem: int,
    models: tuple[str, ...],
    offset: float,
    context: dict[str, Any],
) -> WorkloadSpec:
    data: dict[str, Any] = {
        "id": r.job_id,
        "name": r.job_id,
        "kind": r.kind,
        "queue": r.queue,
        "priority": r.priority,
        "replicas": replicas,
        "resources": {"gpu": f"{gpu}m", "cpu": f"{cpu}m", "memory": mem},
    }
    if models:
        data["gpu_models"] = models
    if r.deadline is not None:
        data["deadline"] = r.deadline - offset
    if r.estimate is not None:
        data["estimated_duration"] = r.estimate
    if r.labels:
        data["labels"] = r.labels
    data.update(r.extra)
    try:
        return WorkloadSpec.model_validate(data, context=context)
    except ValueError as e:
        raise _RowError(_validation_message(e)) from None


# ---------------------------------------------------------------- clusters


def _node(
    name: str,
    model: str | None,
    gpus: int,
    cpu_milli: int,
    memory_mib: int,
    catalog: GpuCatalog,
    labels: Mapping[str, str] | None = None,
) -> NodeSpec:
    data: dict[str, Any] = {
        "name": name,
        "gpus": gpus,
        "cpu": f"{cpu_milli}m",
        "memory": memory_mib,
    }
    if gpus:
        data["gpu_model"] = model
    if labels:
        data["labels"] = dict(labels)
    return NodeSpec.model_validate(data, context={"catalog": catalog})


def _gpu_node(name: str, model: str, gpus: int, catalog: GpuCatalog) -> NodeSpec:
    """A node sized so its GPUs bind first: 4 cores per GPU + 8, 64 GiB per GPU (>= 64 GiB)."""
    return _node(
        name,
        model,
        gpus,
        NODE_CPU_MILLI_PER_GPU * gpus + NODE_CPU_MILLI_EXTRA,
        NODE_MEMORY_MIB_PER_GPU * max(1, gpus),
        catalog,
    )


def _max_gpus_per_node(cluster: ClusterSpec) -> int:
    # not cluster.all_nodes(): that rebuilds pool nodes against the default catalogue
    return max(
        [n.gpus for n in cluster.nodes] + [p.gpus for p in cluster.pools],
        default=0,
    )


def _cluster_models(cluster: ClusterSpec) -> set[str]:
    return {n.gpu_model for n in cluster.nodes if n.gpu_model} | {
        p.gpu_model for p in cluster.pools if p.gpu_model
    }


def _cluster_gpus(cluster: ClusterSpec) -> int:
    return sum(n.gpus for n in cluster.nodes) + sum(p.gpus * p.count for p in cluster.pools)


def _cluster_size(cluster: ClusterSpec) -> int:
    return len(cluster.nodes) + sum(p.count for p in cluster.pools)


def _is_pooled(cluster: ClusterSpec) -> bool:
    return any(n.labels.get(_POOLED_LABEL) == "true" for n in cluster.nodes)


def _cluster_of(
    catalog: GpuCatalog,
    nodes: Iterable[NodeSpec] = (),
    pools: Iterable[NodePool] = (),
    queues: Iterable[QueueSpec] = (),
) -> ClusterSpec:
    # validated with the trace catalogue: nested node specs are checked again against it
    return ClusterSpec.model_validate(
        {"nodes": tuple(nodes), "pools": tuple(pools), "queues": tuple(queues)},
        context={"catalog": catalog},
    )


def _with_queues(cluster: ClusterSpec, queues: Iterable[str], catalog: GpuCatalog) -> ClusterSpec:
    """``cluster`` plus an unlimited QueueSpec for each named queue it lacks."""
    have = {q.name for q in cluster.queues}
    extra = [QueueSpec(name=q) for q in sorted(set(queues)) if q not in have and q != "default"]
    if not extra:
        return cluster
    return _cluster_of(catalog, cluster.nodes, cluster.pools, (*cluster.queues, *extra))


def parse_cluster_spec(
    text: str, catalog: GpuCatalog = TRACE_CATALOG, *, default_model: str = TRACE_GPU.name
) -> ClusterSpec:
    """A cluster from a short form.

    ``pooled:N``: one pool of N GPUs with no node boundaries, as several
    published simulators assume. NodeSpec holds at most 64 GPUs, so the pool
    is ceil(N/64) nodes of model POOL-GPU labelled ``mlwe.pooled=true``;
    trace loaders see the label and split every job into 1-GPU replicas, so
    node boundaries never bind. Nodes get 64 cores and 1 TiB per GPU.

    ``nodes:NxG[:MODEL]``: N nodes of G GPUs of MODEL (default
    ``default_model``), 16 cores and 128 GiB per GPU (at least 32 cores and
    256 GiB) so GPUs bind first.

    A YAML cluster file is not accepted here (mlwe.sim reads no YAML): the
    CLI loads those and passes the ClusterSpec.
    """
    form = text.strip()
    m = _POOLED_FORM.match(form)
    if m:
        total = int(m.group(1))
        if total < 1:
            raise ValueError(f"cluster spec {text!r}: a pool needs at least 1 GPU")
        if POOL_GPU.name not in catalog:
            catalog = catalog.extend([POOL_GPU])
        nodes = []
        for i, start in enumerate(range(0, total, 64)):
            gpus = min(64, total - start)
            nodes.append(
                _node(
                    f"pool-{i}",
                    POOL_GPU.name,
                    gpus,
                    64_000 * gpus,
                    1024 * MIB_PER_GIB * gpus,
                    catalog,
                    {_POOLED_LABEL: "true"},
                )
            )
        return _cluster_of(catalog, nodes)
    m = _NODES_FORM.match(form)
    if m:
        count, gpus = int(m.group(1)), int(m.group(2))
        model = m.group(3) or default_model
        if count < 1:
            raise ValueError(f"cluster spec {text!r}: need at least 1 node")
        if not 1 <= gpus <= 64:
            raise ValueError(f"cluster spec {text!r}: GPUs per node must be 1..64, not {gpus}")
        if model not in catalog:
            raise ValueError(
                f"cluster spec {text!r}: unknown GPU model {model!r}; known: {', '.join(catalog.names())}"
            )
        width = len(str(count - 1))
        prefix = re.sub(r"[^A-Za-z0-9._-]", "-", model).lower()
        nodes = [
            _node(
                f"{prefix}-{i:0{width}d}",
                model,
                gpus,
                max(16_000 * gpus, 32_000),
                max(128 * MIB_PER_GIB * gpus, 256 * MIB_PER_GIB),
                catalog,
            )
            for i in range(count)
        ]
        return _cluster_of(catalog, nodes)
    if form.startswith(("pooled", "nodes")):
        raise ValueError(
            f"cluster spec {text!r} is malformed; expected 'pooled:N' or 'nodes:NxG[:MODEL]'"
        )
    if form.endswith((".yaml", ".yml", ".json")) or "/" in form or os.sep in form:
        raise ValueError(
            f"cluster spec {text!r} looks like a file: cluster files are loaded by the CLI"
            " (mlwe.sim reads no YAML); here give 'pooled:N' or 'nodes:NxG[:MODEL]'"
        )
    raise ValueError(f"cluster spec {text!r} is not 'pooled:N' or 'nodes:NxG[:MODEL]'")


ClusterArg = ClusterSpec | str | None


def _override(
    arg: ClusterSpec | str, catalog: GpuCatalog, default_model: str
) -> tuple[ClusterSpec, list[str]]:
    cluster = (
        parse_cluster_spec(arg, catalog, default_model=default_model)
        if isinstance(arg, str)
        else arg
    )
    unknown = sorted(m for m in _cluster_models(cluster) if m not in catalog)
    if unknown:
        raise ValueError(
            f"cluster uses GPU model(s) {', '.join(unknown)} that the trace catalogue lacks;"
            " pass catalog= with them"
        )
    what = f"{arg!r}" if isinstance(arg, str) else "a ClusterSpec"
    note = (
        f"cluster given by the caller ({what}): {_cluster_size(cluster)} nodes,"
        f" {_cluster_gpus(cluster)} GPUs"
    )
    if _is_pooled(cluster):
        note += (
            "; pooled: no node boundaries, every job of n whole GPUs runs as n 1-GPU"
            " replicas (a gang) and GPU model constraints are dropped"
        )
    return cluster, [note]


def _catalog_for(catalog: GpuCatalog | None) -> GpuCatalog:
    if catalog is None:
        return TRACE_CATALOG
    missing = [TRACE_CATALOG[n] for n in TRACE_CATALOG.names() if n not in catalog]
    return catalog.extend(missing) if missing else catalog


def _finish(
    name: str,
    raws: list[_RawJob],
    *,
    label: str,
    catalog: GpuCatalog,
    cluster: ClusterSpec,
    overridden: bool,
    notes: list[str],
    skipped: int,
    limit: int | None,
    skip_bad_rows: bool,
    queues: Iterable[str] = (),
) -> Trace:
    pooled = _is_pooled(cluster)
    jobs, bad, dropped = _build_jobs(
        raws,
        label=label,
        catalog=catalog,
        cluster=cluster,
        pooled=pooled,
        limit=limit,
        skip_bad_rows=skip_bad_rows,
    )
    cluster = _with_queues(cluster, {*queues, *(j.spec.queue for j in jobs)}, catalog)
    if pooled and dropped:
        notes.append(f"pooled cluster: GPU model constraints dropped from {dropped} job(s)")
    if overridden and not pooled:
        models = _cluster_models(cluster)
        stranded = sum(1 for j in jobs if j.spec.gpu_models and not set(j.spec.gpu_models) & models)
        if stranded:
            notes.append(
                f"{stranded} job(s) accept only GPU models the given cluster lacks: they can never start"
            )
    if limit is not None:
        notes.append(f"limited to the first {limit} jobs in submit order")
    if skip_bad_rows:
        notes.append(f"{skipped + bad} bad row(s) skipped")
    return Trace(
        name=name,
        jobs=tuple(jobs),
        cluster=cluster,
        catalog=catalog,
        skipped=skipped + bad,
        notes=tuple(notes),
        pooled=pooled,
    )


def _size_nodes(
    raws: Sequence[_RawJob], gpus_per_node: int, target: float = ITP_TARGET_LOAD
) -> tuple[int, float, float, int]:
    """Nodes so offered load is closest to ``target`` of capacity; (nodes, load GPUs, span, largest)."""
    if not raws:
        return 1, 0.0, 0.0, 0
    submits = [r.submit for r in raws]
    span = max(submits) - min(submits)
    largest = max(r.gpu_milli for r in raws)
    largest_gpus = _ceil_div(largest, 1000)
    n_min = max(1, _ceil_div(largest_gpus, gpus_per_node))
    gpu_seconds = sum(max(r.gpu_milli, 0) / 1000 * r.duration for r in raws)
    if span <= 0:
        return n_min, 0.0, span, largest_gpus
    load = gpu_seconds / span
    ideal = load / (target * gpus_per_node)
    lo, hi = max(n_min, math.floor(ideal)), max(n_min, math.ceil(ideal))

    def miss(n: int) -> float:
        return abs(load / (n * gpus_per_node) - target)

    return (lo if miss(lo) <= miss(hi) else hi), load, span, largest_gpus


def _sized_cluster(
    raws: Sequence[_RawJob], model: str, catalog: GpuCatalog, prefix: str
) -> tuple[ClusterSpec, str]:
    nodes, load, span, largest = _size_nodes(raws, ITP_GPUS_PER_NODE)
    capacity = nodes * ITP_GPUS_PER_NODE
    cluster = _cluster_of(
        catalog,
        (_gpu_node(f"{prefix}-{i:03d}", model, ITP_GPUS_PER_NODE, catalog) for i in range(nodes)),
    )
    if span > 0:
        share = load / capacity
        note = (
            f"cluster size is not in the trace: assumed {nodes} nodes x {ITP_GPUS_PER_NODE}"
            f" {model} = {capacity} GPUs, the count closest to {ITP_TARGET_LOAD:.0%} offered load"
            f" (offered load = sum(num_gpu*duration) / (last submit - first submit)"
            f" = {load:.1f} GPUs over {span:.0f} s, i.e. {share:.1%} of capacity),"
            f" and at least enough nodes for the largest job ({largest} GPUs)"
        )
        if not 0.80 <= share <= 0.90:
            reason = (
                "the largest job needs that many nodes"
                if nodes == max(1, _ceil_div(largest, ITP_GPUS_PER_NODE))
                else f"of {ITP_GPUS_PER_NODE}-GPU node granularity"
            )
            note += f"; load falls outside 80-90% because {reason}"
    else:
        note = (
            f"cluster size is not in the trace: all submits at one instant, so offered load is"
            f" undefined; assumed {nodes} nodes x {ITP_GPUS_PER_NODE} {model}, enough for the"
            f" largest job ({largest} GPUs)"
        )
    return cluster, note


# ---------------------------------------------------------------- Philly


@_gc_paused()
def load_philly(
    *,
    limit: int | None = None,
    skip_bad_rows: bool = False,
    traces_dir: str | Path | None = None,
    cluster: ClusterArg = None,
    catalog: GpuCatalog | None = None,
) -> Trace:
    """Microsoft Philly (2017): ``philly/jobs.csv`` and ``philly/machines.csv``.

    Assumes: submit = ``timestamp`` (wall clock, UTC), sorted (the file is
    not) and shifted so the first is t=0; duration = ``duration`` (s);
    ``gpu_time`` is ignored (it is duration x num_gpus). Philly names no GPU
    model: every GPU is PHILLY-GPU (12 GiB, P100/K80 era). Queue
    ``vc-<virtual cluster hash>`` (no quotas), priority 50, kind training,
    no user estimate. Each replica asks 4 cores and 32 GiB per GPU; nodes
    (one per machine, GPU count from the file, 0-GPU machines as CPU nodes)
    offer 4 cores per GPU + 8 and 64 GiB per GPU, so GPUs bind first.
    """
    cat = _catalog_for(catalog)
    root = resolve_traces_dir(traces_dir)
    jobs_label, machines_label = "philly/jobs.csv", "philly/machines.csv"
    clamp = _Clamp()

    def parse(row: _Row) -> _RawJob:
        submit = _wall_clock_utc(row.get("timestamp"), "timestamp")
        duration = clamp(_non_negative(row.get("duration"), "duration"))
        gpus = _whole(row.get("num_gpus"), "num_gpus")
        if gpus <= 0:
            raise _RowError(f"num_gpus {gpus} is not positive (Philly jobs use GPUs)")
        vc = row.get("cluster")
        if not vc:
            raise _RowError("cluster (virtual cluster) is missing")
        return _per_gpu_job(
            f"philly-{row.line}",
            row.line,
            submit,
            duration,
            gpus,
            queue=f"vc-{vc}",
            kind="training",
        )

    raws, skipped = _read_rows(
        _trace_file(root, jobs_label),
        jobs_label,
        ("timestamp", "duration", "num_gpus", "cluster"),
        parse,
        skip_bad_rows=skip_bad_rows,
    )
    vcs = {r.queue for r in raws}
    notes = [
        "Philly names no GPU model: every GPU is the generic catalogue model PHILLY-GPU"
        " (12 GiB VRAM, P100/K80 era); jobs ask no VRAM, so the size limits nothing",
        "submit = timestamp (wall clock read as UTC), sorted (jobs.csv is not) and shifted so"
        " the first submit is t=0"
        + (
            f" ({datetime.fromtimestamp(min(r.submit for r in raws), UTC):%Y-%m-%d %H:%M:%S} UTC)"
            if raws
            else ""
        ),
        "Philly has no user estimates: estimated_duration is None (a policy that uses"
        " durations is an oracle)",
        f"queue = vc-<virtual cluster hash> ({len(vcs)} queues, no quotas); priority 50 for"
        " every job; kind training; job_id = philly-<line of jobs.csv>",
        "each replica asks 4 cores and 32 GiB RAM per GPU; nodes offer 4 cores per GPU + 8"
        " and 64 GiB per GPU (at least 64 GiB), so GPUs bind first; gpu_time is ignored",
        "gang rule: a job with more GPUs than the largest node becomes n//g replicas of g GPUs,"
        " g the largest divisor of n not above that node size (16 -> 2x8, 12 -> 2x6,"
        " 24 -> 3x8, 128 -> 16x8 on 8-GPU machines)",
    ]
    if cluster is None:
        machines, zero = _philly_machines(root, machines_label, cat)
        default_cluster = _cluster_of(cat, machines)
        notes.insert(
            0,
            f"cluster = philly/machines.csv: {len(machines)} machines,"
            f" {_cluster_gpus(default_cluster)} GPUs ({zero} machines with 0 GPUs are CPU-only"
            " nodes)",
        )
        use, overridden = default_cluster, False
    else:
        use, extra = _override(cluster, cat, PHILLY_GPU.name)
        notes[:0] = extra
        overridden = True
    notes.append(clamp.note())
    return _finish(
        "philly",
        raws,
        label=jobs_label,
        catalog=cat,
        cluster=use,
        overridden=overridden,
        notes=notes,
        skipped=skipped,
        limit=limit,
        skip_bad_rows=skip_bad_rows,
        queues=vcs,
    )


def _philly_machines(root: Path, label: str, catalog: GpuCatalog) -> tuple[list[NodeSpec], int]:
    def parse(row: _Row) -> NodeSpec:
        name = row.get("machineId")
        if not name:
            raise _RowError("machineId is missing")
        gpus = _whole(row.get("number of GPUs"), "number of GPUs")
        if gpus < 0:
            raise _RowError(f"number of GPUs {gpus} is negative")
        try:
            return _gpu_node(name, PHILLY_GPU.name, gpus, catalog)
        except ValueError as e:
            raise _RowError(_validation_message(e)) from None

    nodes, _ = _read_rows(
        _trace_file(root, label),
        label,
        ("machineId", "number of GPUs"),
        parse,
        skip_bad_rows=False,
    )
    return nodes, sum(1 for n in nodes if n.gpus == 0)


# ---------------------------------------------------------------- ITP


@_gc_paused()
def load_itp(
    cluster_no: int,
    *,
    limit: int | None = None,
    skip_bad_rows: bool = False,
    traces_dir: str | Path | None = None,
    cluster: ClusterArg = None,
    catalog: GpuCatalog | None = None,
) -> Trace:
    """Microsoft ITP (2021), ``itp/clusterNN.csv``: jobs with deadlines.

    Assumes: submit = ``submission_time`` (s), deadline = ``deadline``
    (absolute, same clock; both shifted by the same offset, so deadline -
    submit is preserved), duration = ``duration`` (s), ``num_gpu`` whole
    GPUs of the generic model ITP-GPU (32 GiB). No user estimate
    (estimated_duration None), priority 50, queue default, kind training;
    model_name, batch_size and num_iteration go to labels. ITP gives no
    cluster size: the default cluster is the number of 8-GPU nodes whose
    capacity puts offered load (sum(num_gpu*duration) over last submit -
    first submit of the loaded jobs) closest to 85%, at least enough for
    the largest job; the note states the size and the load.
    """
    if not 1 <= cluster_no <= 99:
        raise TraceError(f"ITP cluster number must be 01..99, not {cluster_no}")
    cat = _catalog_for(catalog)
    root = resolve_traces_dir(traces_dir)
    label = f"itp/cluster{cluster_no:02d}.csv"
    path = root / label
    if not path.is_file():
        have = sorted(p.name for p in (root / "itp").glob("cluster*.csv"))
        raise FileNotFoundError(
            f"trace file {path} does not exist (ITP files there: {', '.join(have) or 'none'})"
        )
    clamp = _Clamp()

    def parse(row: _Row) -> _RawJob:
        job_id = row.get("job_id")
        if not job_id:
            raise _RowError("job_id is missing")
        submit = _non_negative(row.get("submission_time"), "submission_time")
        deadline = _number(row.get("deadline"), "deadline")
        if deadline <= submit:
            raise _RowError(f"deadline {deadline:g} is not after submission_time {submit:g}")
        duration = clamp(_non_negative(row.get("duration"), "duration"))
        gpus = _whole(row.get("num_gpu"), "num_gpu")
        if gpus <= 0:
            raise _RowError(f"num_gpu {gpus} is not positive (ITP jobs use GPUs)")
        labels = {
            k: row.get(k) for k in ("model_name", "batch_size", "num_iteration") if row.get(k)
        }
        return _per_gpu_job(
            job_id,
            row.line,
            submit,
            duration,
            gpus,
            deadline=deadline,
            kind="training",
            labels=labels,
        )

    raws, skipped = _read_rows(
        path,
        label,
        ("job_id", "submission_time", "deadline", "num_gpu", "duration"),
        parse,
        skip_bad_rows=skip_bad_rows,
    )
    notes = [
        "ITP names no GPU model: every GPU is the generic catalogue model ITP-GPU (32 GiB)",
        "deadline = the trace's absolute deadline, shifted with submit times (deadline - submit"
        " preserved; the trace drew it as submit + U[0.5,1.5] x duration)",
        "ITP has no user estimates: estimated_duration is None, deadlines are kept",
        "priority 50 and queue default for every job; kind training; model_name, batch_size and"
        " num_iteration kept as labels",
        "each replica asks 4 cores and 32 GiB RAM per GPU; nodes offer 4 cores per GPU + 8 and"
        " 64 GiB per GPU, so GPUs bind first",
        "gang rule: a job with more GPUs than the largest node becomes n//g replicas of g GPUs,"
        " g the largest divisor of n not above that node size (16 -> 2x8, 64 -> 8x8)",
    ]
    if cluster is None:
        # size on the jobs actually replayed (the first `limit` in submit order)
        ordered = sorted(raws, key=lambda r: (r.submit, r.line))
        sized_on = ordered[:limit] if limit is not None else ordered
        use, sizing = _sized_cluster(sized_on, ITP_GPU.name, cat, "itp")
        notes.insert(0, sizing)
        overridden = False
    else:
        use, extra = _override(cluster, cat, ITP_GPU.name)
        notes[:0] = extra
        overridden = True
    notes.append(clamp.note())
    return _finish(
        f"itp:{cluster_no:02d}",
        raws,
        label=label,
        catalog=cat,
        cluster=use,
        overridden=overridden,
        notes=notes,
        skipped=skipped,
        limit=limit,
        skip_bad_rows=skip_bad_rows,
    )


# ---------------------------------------------------------------- Alibaba openb


@_gc_paused()
def load_alibaba(
    *,
    limit: int | None = None,
    skip_bad_rows: bool = False,
    traces_dir: str | Path | None = None,
    cluster: ClusterArg = None,
    catalog: GpuCatalog | None = None,
) -> Trace:
    """Alibaba GPU cluster 2023 "openb": ``alibaba-openb/pods.csv`` and ``nodes.csv``.

    Assumes: nodes as in nodes.csv (cpu_milli, memory_mib, gpu, model mapped
    by ALIBABA_MODELS; G2 and G3 are undisclosed models given an assumed
    32 GiB). Pods: submit = creation_time; duration = deletion_time -
    scheduled_time, or deletion_time - creation_time for pods never
    scheduled (Pending) -- every phase is kept, pod_phase goes to labels;
    pods still Running at the end of the trace have a censored duration.
    num_gpu 0 = CPU-only; num_gpu 1 = gpu_milli of one GPU (fractional
    below 1000); num_gpu > 1 = that many whole GPUs. gpu_spec: accepted
    models separated by '|', empty = any. qos -> priority by
    ALIBABA_QOS_PRIORITY; LS pods are kind inference, others other. No user
    estimate, queue default.
    """
    cat = _catalog_for(catalog)
    root = resolve_traces_dir(traces_dir)
    pods_label, nodes_label = "alibaba-openb/pods.csv", "alibaba-openb/nodes.csv"
    clamp = _Clamp()

    def parse(row: _Row) -> tuple[_RawJob, bool, float]:
        name = row.get("name")
        if not name:
            raise _RowError("name is missing")
        cpu = _whole(row.get("cpu_milli"), "cpu_milli")
        mem = _whole(row.get("memory_mib"), "memory_mib")
        num_gpu = _whole(row.get("num_gpu"), "num_gpu")
        gpu_milli = _whole(row.get("gpu_milli"), "gpu_milli")
        for col, v in (
            ("cpu_milli", cpu),
            ("memory_mib", mem),
            ("num_gpu", num_gpu),
            ("gpu_milli", gpu_milli),
        ):
            if v < 0:
                raise _RowError(f"{col} {v} is negative")
        if num_gpu == 0:
            if gpu_milli:
                raise _RowError(f"gpu_milli {gpu_milli} given with num_gpu 0")
            total_gpu = 0
        elif num_gpu == 1:
            if not 0 < gpu_milli <= 1000:
                raise _RowError(f"gpu_milli {gpu_milli} is not in 1..1000 for num_gpu 1")
            total_gpu = gpu_milli
        else:
            total_gpu = num_gpu * 1000
        qos = row.get("qos")
        if qos not in ALIBABA_QOS_PRIORITY:
            raise _RowError(f"qos {qos!r} is not one of {', '.join(ALIBABA_QOS_PRIORITY)}")
        models: list[str] = []
        for part in row.get("gpu_spec").split("|"):
            part = part.strip()
            if not part:
                continue
            if part not in ALIBABA_MODELS:
                raise _RowError(
                    f"gpu_spec model {part!r} is not one of {', '.join(ALIBABA_MODELS)}"
                )
            models.append(ALIBABA_MODELS[part])
        if models and not total_gpu:
            raise _RowError("gpu_spec given for a pod that asks no GPU")
        created = _non_negative(row.get("creation_time"), "creation_time")
        deleted = _non_negative(row.get("deletion_time"), "deletion_time")
        sched_text = row.get("scheduled_time")
        start = _non_negative(sched_text, "scheduled_time") if sched_text else created
        if start < created:
            raise _RowError(f"scheduled_time {start:g} is before creation_time {created:g}")
        if deleted < start:
            what = "scheduled_time" if sched_text else "creation_time"
            raise _RowError(f"deletion_time {deleted:g} is before {what} {start:g}")
        phase = row.get("pod_phase")
        raw = _RawJob(
            job_id=name,
            line=row.line,
            submit=created,
            duration=clamp(deleted - start),
            gpu_milli=total_gpu,
            cpu_milli=cpu,
            memory_mib=mem,
            priority=ALIBABA_QOS_PRIORITY[qos],
            gpu_models=tuple(dict.fromkeys(models)),
            kind="inference" if qos == "LS" else "other",
            labels={"qos": qos, "pod_phase": phase} if phase else {"qos": qos},
        )
        return raw, bool(sched_text), deleted

    rows, skipped = _read_rows(
        _trace_file(root, pods_label),
        pods_label,
        (
            "name",
            "cpu_milli",
            "memory_mib",
            "num_gpu",
            "gpu_milli",
            "qos",
            "creation_time",
            "deletion_time",
        ),
        parse,
        skip_bad_rows=skip_bad_rows,
    )
    raws: list[_RawJob] = [r for r, _, _ in rows]
    never = sum(1 for _, scheduled, _ in rows if not scheduled)
    end = max((deleted for _, _, deleted in rows), default=0.0)
    censored = sum(
        1 for r, _, deleted in rows if deleted == end and r.labels.get("pod_phase") == "Running"
    )
    phases = Counter(r.labels.get("pod_phase", "") for r in raws)
    notes = [
        "G2 and G3 are undisclosed Alibaba GPU models: catalogue models G2 and G3 with an"
        " assumed 32 GiB VRAM each (no pod asks VRAM, so only fractional-GPU VRAM shares use it);"
        " V100M16 -> V100-16GB, V100M32 -> V100-32GB, P100/T4/A10 as named",
        "qos -> priority: LS 100, Guaranteed 80, Burstable 50, BE 10; LS pods are kind"
        " inference, the rest other; queue default; no user estimates (estimated_duration None)",
        "num_gpu 1 with gpu_milli < 1000 is a fractional GPU (gpu = gpu_milli milli-GPU);"
        " num_gpu > 1 asks that many whole GPUs; num_gpu 0 pods are CPU-only; gpu_spec"
        " ('|'-separated, empty = any) -> gpu_models",
        "submit = creation_time; duration = deletion_time - scheduled_time, or deletion_time -"
        f" creation_time for the {never} pod(s) never scheduled in the trace (Pending)",
        "every pod_phase is replayed ("
        + ", ".join(f"{k or '?'} {v}" for k, v in sorted(phases.items()))
        + f"); {censored} pod(s) still Running at the trace end ({end:.0f} s) have censored"
        " durations",
    ]
    if cluster is None:
        nodes = _alibaba_nodes(root, nodes_label, cat)
        use = _cluster_of(cat, nodes)
        notes.insert(
            0,
            f"cluster = alibaba-openb/nodes.csv: {len(nodes)} nodes, {_cluster_gpus(use)} GPUs,"
            " cpu and memory as given",
        )
        overridden = False
    else:
        use, extra = _override(cluster, cat, TRACE_GPU.name)
        notes[:0] = extra
        overridden = True
    notes.append(clamp.note())
    return _finish(
        "alibaba",
        raws,
        label=pods_label,
        catalog=cat,
        cluster=use,
        overridden=overridden,
        notes=notes,
        skipped=skipped,
        limit=limit,
        skip_bad_rows=skip_bad_rows,
    )


def _alibaba_nodes(root: Path, label: str, catalog: GpuCatalog) -> list[NodeSpec]:
    def parse(row: _Row) -> NodeSpec:
        name = row.get("sn")
        gpus = _whole(row.get("gpu"), "gpu")
        model_text = row.get("model")
        if gpus and model_text not in ALIBABA_MODELS:
            raise _RowError(f"model {model_text!r} is not one of {', '.join(ALIBABA_MODELS)}")
        try:
            return _node(
                name,
                ALIBABA_MODELS.get(model_text),
                gpus,
                _whole(row.get("cpu_milli"), "cpu_milli"),
                _whole(row.get("memory_mib"), "memory_mib"),
                catalog,
            )
        except ValueError as e:
            raise _RowError(_validation_message(e)) from None

    nodes, _ = _read_rows(
        _trace_file(root, label),
        label,
        ("sn", "cpu_milli", "memory_mib", "gpu", "model"),
        parse,
        skip_bad_rows=False,
    )
    return nodes


# ---------------------------------------------------------------- generic CSV


@_gc_paused()
def load_generic_csv(
    path: str | Path,
    *,
    limit: int | None = None,
    skip_bad_rows: bool = False,
    cluster: ClusterArg = None,
    catalog: GpuCatalog | None = None,
) -> Trace:
    """Any CSV with columns ``job_id,submit_time,duration,num_gpu`` (seconds).

    Optional columns: ``deadline`` (absolute s, same clock as submit_time,
    must be after it), ``estimated_duration`` (a user estimate, s),
    ``priority`` (an integer or a class name such as high), ``queue``,
    ``gpu_model`` (catalogue names, '|'-separated, empty = any). num_gpu
    may be 0 (CPU-only), a fraction below 1, or whole GPUs. Each job asks 4
    cores and 32 GiB per GPU (CPU-only and fractional jobs: as for one
    GPU). Default cluster: 8-GPU nodes sized like ITP (offered load closest
    to 85%), one group per GPU model named in the trace (TRACE-GPU for jobs
    that name none). Kind other.
    """
    cat = _catalog_for(catalog)
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"trace file {file} does not exist")
    label = str(path)
    clamp = _Clamp()

    def parse(row: _Row) -> _RawJob:
        job_id = row.get("job_id")
        if not job_id:
            raise _RowError("job_id is missing")
        submit = _non_negative(row.get("submit_time"), "submit_time")
        duration = clamp(_non_negative(row.get("duration"), "duration"))
        gpu_text = row.get("num_gpu")
        gpus = _non_negative(gpu_text, "num_gpu")
        if gpus >= 1 and gpus != int(gpus):
            raise _RowError(f"num_gpu {gpu_text!r}: above 1, GPUs must be whole")
        gpu_milli = round(gpus * 1000)
        if gpus > 0 and gpu_milli == 0:
            raise _RowError(f"num_gpu {gpu_text!r} is below one milli-GPU")
        deadline = None
        if row.get("deadline"):
            deadline = _number(row.get("deadline"), "deadline")
            if deadline <= submit:
                raise _RowError(f"deadline {deadline:g} is not after submit_time {submit:g}")
        estimate = None
        if row.get("estimated_duration"):
            estimate = _number(row.get("estimated_duration"), "estimated_duration")
            if estimate <= 0:
                raise _RowError(f"estimated_duration {estimate:g} is not positive")
        prio_text = row.get("priority")
        priority: int | str = 50
        if prio_text:
            priority = int(prio_text) if prio_text.lstrip("-").isdigit() else prio_text
        models = tuple(m.strip() for m in row.get("gpu_model").split("|") if m.strip())
        unknown = [m for m in models if m not in cat]
        if unknown:
            raise _RowError(
                f"gpu_model {', '.join(unknown)} is not in the GPU catalogue"
                f" (known: {', '.join(cat.names())})"
            )
        if models and not gpu_milli:
            raise _RowError("gpu_model given for a job with num_gpu 0")
        units = max(1000, gpu_milli)
        return _RawJob(
            job_id=job_id,
            line=row.line,
            submit=submit,
            duration=duration,
            gpu_milli=gpu_milli,
            cpu_milli=JOB_CPU_MILLI_PER_GPU * units // 1000,
            memory_mib=JOB_MEMORY_MIB_PER_GPU * units // 1000,
            queue=row.get("queue") or "default",
            priority=priority,
            deadline=deadline,
            estimate=estimate,
            gpu_models=models,
        )

    raws, skipped = _read_rows(
        file,
        label,
        ("job_id", "submit_time", "duration", "num_gpu"),
        parse,
        skip_bad_rows=skip_bad_rows,
    )
    notes = [
        "generic CSV: times in seconds, shifted so the first submit is t=0 (deadlines too);"
        " estimated_duration only where the file gives one",
        "each job asks 4 cores and 32 GiB RAM per GPU (CPU-only and fractional jobs: as one"
        " GPU); nodes offer 4 cores per GPU + 8 and 64 GiB per GPU",
        "gang rule: a job with more GPUs than the largest node becomes n//g replicas of g GPUs,"
        " g the largest divisor of n not above that node size",
    ]
    if cluster is None:
        ordered = sorted(raws, key=lambda r: (r.submit, r.line))
        sized_on = ordered[:limit] if limit is not None else ordered
        use, sizing = _generic_cluster(sized_on, cat)
        notes[:0] = sizing
        overridden = False
    else:
        use, extra = _override(cluster, cat, TRACE_GPU.name)
        notes[:0] = extra
        overridden = True
    notes.append(clamp.note())
    return _finish(
        label,
        raws,
        label=label,
        catalog=cat,
        cluster=use,
        overridden=overridden,
        notes=notes,
        skipped=skipped,
        limit=limit,
        skip_bad_rows=skip_bad_rows,
    )


def _generic_cluster(raws: Sequence[_RawJob], catalog: GpuCatalog) -> tuple[ClusterSpec, list[str]]:
    """One group of 8-GPU nodes per model named (first named model per job), sized like ITP."""
    groups: dict[str, list[_RawJob]] = {}
    for r in raws:
        if r.gpu_milli:
            groups.setdefault(r.gpu_models[0] if r.gpu_models else TRACE_GPU.name, []).append(r)
    if not groups:
        groups[TRACE_GPU.name] = list(raws)
    nodes: list[NodeSpec] = []
    notes: list[str] = []
    for model in sorted(groups):
        prefix = re.sub(r"[^A-Za-z0-9._-]", "-", model).lower()
        part, note = _sized_cluster(groups[model], model, catalog, prefix)
        nodes.extend(part.nodes)
        notes.append(f"{model}: {note}")
    return _cluster_of(catalog, nodes), notes


# ---------------------------------------------------------------- synthetic


SYNTHETIC_MIX: Final[Mapping[str, float]] = MappingProxyType(
    {
        "fine-tune": 0.12,
        "batch-embedding": 0.28,
        "data-processing": 0.12,
        "inference": 0.06,
        "training": 0.08,
        "cpu": 0.34,
    }
)

SYNTHETIC_QUEUES: Final = ("llm", "batch", "data", "serving", "research")


def synthetic_cluster(
    a100: int = 8, h100: int = 4, t4: int = 8, cpu: int = 4, catalog: GpuCatalog = TRACE_CATALOG
) -> ClusterSpec:
    """A heterogeneous cluster: A100-80GB x8 and H100-80GB x8 nodes (96 cores, 1 TiB),
    T4 x4 nodes (32 cores, 256 GiB), high-memory CPU nodes (128 cores, 2 TiB)."""
    pools: list[dict[str, Any]] = []
    for prefix, count, model, gpus, cores, memory in (
        ("a100", a100, "A100-80GB", 8, 96, "1Ti"),
        ("h100", h100, "H100-80GB", 8, 96, "1Ti"),
        ("t4", t4, "T4", 4, 32, "256Gi"),
        ("cpu", cpu, None, 0, 128, "2Ti"),
    ):
        if count < 0:
            raise ValueError(f"synthetic_cluster: {prefix}={count} is negative")
        if count:
            pool: dict[str, Any] = {
                "prefix": prefix,
                "count": count,
                "cpu": cores,
                "memory": memory,
            }
            if model:
                pool |= {"gpu_model": model, "gpus": gpus}
            pools.append(pool)
    if not pools:
        raise ValueError("synthetic_cluster: no nodes")
    return ClusterSpec.model_validate(
        {"pools": pools, "queues": [{"name": q} for q in SYNTHETIC_QUEUES]},
        context={"catalog": catalog},
    )


def _synthetic_job(rng: random.Random, kind: str) -> tuple[dict[str, Any], _RawJob]:
    """(extra spec fields, raw job without id/submit) for one synthetic job."""
    u = rng.uniform
    extra: dict[str, Any] = {}
    deadline_factor: float | None = None
    replicas = 0
    gpu_models: tuple[str, ...] = ()
    if kind == "fine-tune":
        duration = u(3600, 6 * 3600)
        gpus, cpu, mem = 8, 48_000, 512 * MIB_PER_GIB
        gpu_models = ("A100-80GB", "H100-80GB")
        priority: int | str = "urgent" if rng.random() < 0.3 else "high"
        deadline_factor = u(1.2, 2.0)
        extra = {
            "checkpoint_interval": u(900, 1800),
            "checkpoint_cost": 60.0,
            "restart_cost": 120.0,
        }
        queue, spec_kind = "llm", "fine-tune"
    elif kind == "batch-embedding":
        duration = u(600, 3 * 3600)
        gpus = rng.choice((1, 2, 4))
        cpu, mem = 8_000 * gpus, 32 * MIB_PER_GIB * gpus
        priority = rng.choice(("low", "batch"))
        extra = {"checkpoint_interval": u(600, 1200), "checkpoint_cost": 10.0, "restart_cost": 30.0}
        queue, spec_kind = "batch", "batch-embedding"
    elif kind == "data-processing":
        duration = u(600, 2 * 3600)
        gpus, cpu = 0, rng.choice((16, 32, 64)) * 1000
        mem = rng.choice((256, 512, 1024)) * MIB_PER_GIB
        priority = "low"
        queue, spec_kind = "data", "data-processing"
    elif kind == "inference":
        duration = u(6 * 3600, 24 * 3600)
        gpus, cpu, mem = rng.choice((1, 2)), 8_000, 32 * MIB_PER_GIB
        gpu_models = ("T4", "L4")
        priority = "high"
        extra = {"protected": True}
        queue, spec_kind = "serving", "inference"
    elif kind == "training":
        duration = u(2 * 3600, 12 * 3600)
        replicas = rng.choice((2, 3, 4))
        gpus, cpu, mem = 8 * replicas, 48_000 * replicas, 512 * MIB_PER_GIB * replicas
        gpu_models = ("A100-80GB", "H100-80GB")
        priority = "normal"
        extra = {
            "checkpoint_interval": u(1800, 3600),
            "checkpoint_cost": 120.0,
            "restart_cost": 300.0,
        }
        queue, spec_kind = "research", "training"
    else:  # "cpu"
        duration = u(120, 3600)
        gpus, cpu = 0, rng.choice((2, 4, 8)) * 1000
        mem = rng.choice((8, 16, 32)) * MIB_PER_GIB
        priority = rng.choice(("normal", "low"))
        queue, spec_kind = "default", "other"
    estimate = duration * u(0.8, 1.5)
    if deadline_factor is not None:
        extra["_deadline_after"] = estimate * deadline_factor
    raw = _RawJob(
        job_id="",
        line=0,
        submit=0.0,
        duration=duration,
        gpu_milli=gpus * 1000,
        cpu_milli=cpu,
        memory_mib=mem,
        queue=queue,
        priority=priority,
        estimate=estimate,
        gpu_models=gpu_models,
        kind=spec_kind,
        replicas=replicas,
        labels={"mix": kind},
    )
    return extra, raw


@_gc_paused()
def synthetic_trace(
    n_jobs: int = 1000,
    seed: int = 0,
    *,
    rate_per_hour: float = 20.0,
    mix: Mapping[str, float] | None = None,
    cluster: ClusterArg = None,
    catalog: GpuCatalog | None = None,
) -> Trace:
    """A seeded synthetic trace of the mission's workload mix (``random.Random(seed)``).

    Poisson arrivals at ``rate_per_hour`` (first at t=0). Mix (``SYNTHETIC_MIX``
    by default, keys as there): LLM fine-tunes (8 GPUs of A100-80GB/H100-80GB,
    priority high or urgent, deadline = submit + estimate x U[1.2, 2.0],
    checkpoints every 15-30 min), batch embedding (1/2/4 GPUs of any model,
    low or batch priority, checkpoints), data processing (CPU-only, 256 GiB-1
    TiB), inference services (1-2 T4/L4, protected, high priority, 6-24 h),
    training gangs (2-4 replicas x 8 GPUs), small CPU-only jobs. Every job
    carries a user estimate = true duration x U[0.8, 1.5] (honest noise).
    ``line`` is the 1-based sequence number.
    """
    if n_jobs < 0:
        raise ValueError(f"n_jobs {n_jobs} is negative")
    if rate_per_hour <= 0:
        raise ValueError(f"rate_per_hour {rate_per_hour} is not positive")
    weights = dict(SYNTHETIC_MIX if mix is None else mix)
    unknown = sorted(set(weights) - set(SYNTHETIC_MIX))
    if unknown:
        raise ValueError(
            f"unknown mix kind(s) {', '.join(unknown)}; known: {', '.join(SYNTHETIC_MIX)}"
        )
    if any(w < 0 for w in weights.values()) or not any(weights.values()):
        raise ValueError("mix weights must be non-negative and not all zero")
    cat = _catalog_for(catalog)
    rng = random.Random(seed)
    kinds = list(weights)
    kind_weights = [weights[k] for k in kinds]
    raws: list[_RawJob] = []
    now = 0.0
    width = max(5, len(str(n_jobs)))
    for i in range(n_jobs):
        if i:
            now += rng.expovariate(rate_per_hour / 3600.0)
        kind = rng.choices(kinds, kind_weights)[0]
        extra, raw = _synthetic_job(rng, kind)
        raw.job_id = f"syn-{i + 1:0{width}d}"
        raw.line = i + 1
        raw.submit = now
        after = extra.pop("_deadline_after", None)
        if after is not None:
            raw.deadline = now + after
        raw.extra = extra
        raws.append(raw)
    notes = [
        f"synthetic trace: {n_jobs} jobs, seed {seed}, Poisson arrivals at {rate_per_hour:g}/h,"
        " mix " + ", ".join(f"{k} {weights[k]:g}" for k in kinds),
        "every job has a user estimate = true duration x U[0.8, 1.5]; fine-tune deadlines ="
        " submit + estimate x U[1.2, 2.0]",
    ]
    if cluster is None:
        use = synthetic_cluster(catalog=cat)
        notes.insert(
            0,
            f"cluster = synthetic_cluster(): {_cluster_size(use)} nodes, {_cluster_gpus(use)} GPUs"
            " (A100-80GB x8, H100-80GB x8, T4 x4 nodes, high-memory CPU nodes)",
        )
        overridden = False
    else:
        use, extra_notes = _override(cluster, cat, "A100-80GB")
        notes[:0] = extra_notes
        overridden = True
    return _finish(
        "synthetic",
        raws,
        label="synthetic",
        catalog=cat,
        cluster=use,
        overridden=overridden,
        notes=notes,
        skipped=0,
        limit=None,
        skip_bad_rows=False,
        queues=SYNTHETIC_QUEUES,
    )


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
