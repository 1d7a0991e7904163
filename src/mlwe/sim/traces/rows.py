"""The row machinery every CSV loader shares: reading a file row by row with
"file:line: what is wrong" errors (or counted skips), cell parsers, the duration clamp,
the gang rule (:func:`gang_shape`), and turning raw jobs into validated
:class:`~mlwe.core.spec.WorkloadSpec` s and a finished :class:`Trace`.
"""

from __future__ import annotations

import contextlib
import csv
import gc
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mlwe.core.catalog import GpuCatalog
from mlwe.core.spec import ClusterSpec, WorkloadSpec
from mlwe.sim.traces.cluster import (
    ClusterArg,
    _cluster_models,
    _is_pooled,
    _max_gpus_per_node,
    _override,
    _with_queues,
)
from mlwe.sim.traces.model import (
    JOB_CPU_MILLI_PER_GPU,
    JOB_MEMORY_MIB_PER_GPU,
    MIN_DURATION_S,
    Trace,
    TraceError,
    TraceJob,
    _ceil_div,
    _RawJob,
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


# ------------------------------------------------------------ the skeleton
# Every loader: parse rows (``_read_rows``), say its assumptions (notes), pick the
# cluster (the one given, or the trace's own: ``_choose_cluster``), then ``_finish``.


def _sized_on(raws: Sequence[_RawJob], limit: int | None) -> list[_RawJob]:
    """The jobs a replay will use (the first ``limit`` in submit order): what a default
    cluster is sized on."""
    ordered = sorted(raws, key=lambda r: (r.submit, r.line))
    return ordered[:limit] if limit is not None else ordered


def _choose_cluster(
    arg: ClusterArg,
    catalog: GpuCatalog,
    default_model: str,
    notes: list[str],
    default: Callable[[], tuple[ClusterSpec, list[str]]],
) -> tuple[ClusterSpec, bool]:
    """(the cluster to replay on, whether it was given): ``arg`` (a spec or the cluster
    grammar's text) if given, else the trace's own, ``default()``; what either says about
    itself goes first in ``notes``."""
    if arg is None:
        use, said = default()
        overridden = False
    else:
        use, said = _override(arg, catalog, default_model)
        overridden = True
    notes[:0] = said
    return use, overridden


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
    clamp: _Clamp | None,
    queues: Iterable[str] = (),
) -> Trace:
    if clamp is not None:  # a trace's own durations (a generator's are what it drew)
        notes.append(clamp.note())
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
