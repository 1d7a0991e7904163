"""Read-only views of the control plane's state, as plain JSON-able dicts.

The API's routes and the dashboard's snapshot are built here from the
control plane's records (read under the engine's lock by the caller). Nothing
here changes state. Every dict matches a model in ``mlwe.api.models``.
"""

from __future__ import annotations

from typing import Any

from mlwe.core.decisions import DecisionRecord
from mlwe.core.lifecycle import HOLDING, QUEUED, TERMINAL, State, Transition
from mlwe.core.model import Workload
from mlwe.core.reads import ClusterReads
from mlwe.core.resources import Resources
from mlwe.runtime.requests import inadmissible
from mlwe.store.sanitize import sanitize

#: The labels that record which token submitted a workload (set by the API, never by users):
#: the token's name, for people to read, and its subject (unique, never reused), which is
#: what ownership checks compare. A workload stored before subjects has the name only.
OWNER_LABEL = "mlwe.io/owner"
OWNER_SUBJECT_LABEL = "mlwe.io/owner-subject"
#: Label keys under this prefix are the engine's to set.
RESERVED_LABEL_PREFIX = "mlwe.io/"


def owner_subject(w: Workload) -> str | None:
    return w.spec.labels.get(OWNER_SUBJECT_LABEL)


def resources(r: Resources) -> dict[str, int]:
    return {"gpu": r.gpu, "vram": r.vram, "cpu": r.cpu, "ram": r.ram}


def rfc3339(t: float | None) -> str | None:
    """An engine-clock time (epoch seconds) as RFC 3339 UTC, milliseconds kept."""
    import datetime as _dt
    import math as _math

    if t is None or not _math.isfinite(t) or not -62135596800 < t < 253402300800:
        return None
    return _dt.datetime.fromtimestamp(t, _dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _milli(v: int) -> str:
    return f"{v // 1000}" if v % 1000 == 0 else f"{v}m"


def _mib(v: int) -> str:
    for unit, size in (("Ti", 1 << 20), ("Gi", 1 << 10)):
        if v % size == 0 and v >= size:
            return f"{v // size}{unit}"
    return f"{v}Mi"


def quantities(r: Resources) -> dict[str, str]:
    """Resources written as in specs: gpu and cpu as counts ("4", "500m"), memory and VRAM
    as binary sizes ("256Gi")."""
    return {"gpu": _milli(r.gpu), "cpu": _milli(r.cpu), "memory": _mib(r.ram), "vram": _mib(r.vram)}


def transition(tr: Transition) -> dict[str, Any]:
    return {
        "time": tr.time,
        "source": tr.source.value if tr.source is not None else None,
        "target": tr.target.value,
        "reason": tr.reason,
        "cause_id": tr.cause_id,
        "at": rfc3339(tr.time),
    }


#: failure causes that are not the workload's doing: its node was lost, or the engine
#: restarted and found the process gone (the dashboard draws these apart from failures)
LOST_CAUSES = frozenset({"node-lost", "vanished"})


def failure_cause(tr: Transition) -> str | None:
    """For a transition to failed, the cause the backend gave ("oom", "node-lost", ...)."""
    if tr.target is not State.FAILED:
        return None
    reason = tr.reason
    if reason.endswith(")") and "(" in reason:
        return reason[reason.rindex("(") + 1 : -1]
    return "error"


def correlation_of(w: Workload) -> str | None:
    return w.history[0].cause_id if w.history else None


def deadline_at_risk(w: Workload, now: float) -> bool:
    """True when the user's estimate says the deadline can no longer be met (or it passed)."""
    if w.deadline is None or w.state in TERMINAL:
        return False
    if now > w.deadline:
        return True
    rem = w.remaining_estimate(now)
    if rem is None:
        return False
    return now + rem > w.deadline


#: Per request: admission verdicts by workload shape (see :func:`admission`).
AdmissionCache = dict[tuple[Any, ...], list[str]]


def admission(cp: ClusterReads | None, w: Workload, cache: AdmissionCache | None = None
              ) -> tuple[str | None, list[str]]:
    """Kueue's distinction for a queued workload: ``inadmissible`` (it could never run
    here as the cluster and its queue are now: a quota lowered below it, say) with the
    reasons, or ``waiting`` (for capacity). None for a workload that is not queued."""
    if w.state not in QUEUED or cp is None:
        return None, []
    spec = w.spec
    q = cp.queues.get(spec.queue)
    key = (spec.resources, spec.replicas, spec.gpu_models, spec.min_vram_per_gpu,
           tuple(sorted(spec.node_selector.items())), spec.queue, id(q.spec) if q else None)
    reasons = None if cache is None else cache.get(key)
    if reasons is None:
        # a deadline that passed while it waited does not make it inadmissible: it was
        # admissible when it came, and it may still run
        reasons = inadmissible(cp, spec.model_copy(update={"deadline": None}), cp.now())
        if cache is not None:
            cache[key] = reasons
    return ("inadmissible", reasons) if reasons else ("waiting", [])


def workload_summary(
    w: Workload, now: float, cp: ClusterReads | None = None, cache: AdmissionCache | None = None
) -> dict[str, Any]:
    spec = w.spec
    condition, why = admission(cp, w, cache)
    return {
        "id": w.id,
        "name": spec.name,
        "kind": spec.kind.value,
        "queue": spec.queue,
        "state": w.state.value,
        "priority": w.priority,
        "replicas": spec.replicas,
        "gpus": w.gpus(),
        "submit_time": w.submit_time,
        "deadline": w.deadline,
        "deadline_left_s": None if w.deadline is None else w.deadline - now,
        "deadline_at_risk": deadline_at_risk(w, now),
        "progress": w.progress,
        "attempt": w.attempt,
        "preemptions": w.preemptions,
        "nodes": list(dict.fromkeys(a.node for a in w.placement)),
        "pending_reason": w.pending_reason if w.state in QUEUED else "",
        "condition": condition,
        "inadmissible_reasons": why,
        "owner": spec.labels.get(OWNER_LABEL),
        "owner_subject": spec.labels.get(OWNER_SUBJECT_LABEL),
        "correlation_id": correlation_of(w),
        "lifecycle": [t.target.value for t in w.history[-12:]],
        "transitions": len(w.history),
        "lifecycle_causes": [failure_cause(t) for t in w.history[-12:]],
        "preempted_by": w.preempted_by,
        "submitted_at": rfc3339(w.submit_time),
        "deadline_at": rfc3339(w.deadline),
    }


def workload_detail(w: Workload, now: float, cp: ClusterReads | None = None) -> dict[str, Any]:
    out = workload_summary(w, now, cp)
    out.update(
        {
            "spec": sanitize(w.spec.model_dump(mode="json")),
            "history": [transition(t) for t in w.history],
            "placement": [
                {
                    "node": a.node,
                    "devices": list(a.devices),
                    "gpu_per_device": a.gpu_per_device,
                    "res": resources(a.res),
                }
                for a in w.placement
            ],
            "victims": list(w.victims),
            "failures": w.failures,
            "failure_cause": w.failure_cause,
            "exit_code": w.exit_code,
            "work_done_s": w.work_done,
            "remaining_estimate_s": w.remaining_estimate(now),
        }
    )
    return out


def node_view(cp: ClusterReads, name: str) -> dict[str, Any]:
    info = cp.capacity.info(name)
    free_dev = cp.capacity.free_devices(name)
    holders: list[list[dict[str, Any]]] = [[] for _ in range(info.gpu_count)]
    ids = []
    for w in cp.holders(name):
        ids.append(w.id)
        for a in w.placement:
            if a.node != name:
                continue
            for d in a.devices:
                holders[d].append(
                    {
                        "id": w.id,
                        "name": w.spec.name,
                        "priority": w.priority,
                        "milli": a.gpu_per_device,
                        "state": w.state.value,
                    }
                )
    return {
        "name": name,
        "status": cp.capacity.status(name).value,
        "gpu_model": info.gpu_model,
        "gpus": info.gpu_count,
        "vram_per_gpu": info.vram_per_gpu,
        "labels": dict(info.labels),
        "capacity": resources(info.capacity),
        "free": resources(cp.capacity.free(name)),
        "quantities": {"capacity": quantities(info.capacity), "free": quantities(cp.capacity.free(name))},
        "devices": [
            {"index": i, "free_milli": free_dev[i], "holders": holders[i]}
            for i in range(info.gpu_count)
        ],
        "workloads": ids,
    }


def _quota(v: int) -> int | None:
    from mlwe.core.resources import UNLIMITED

    return None if v >= UNLIMITED else v


def queue_views(cp: ClusterReads) -> list[dict[str, Any]]:
    pending: dict[str, int] = {}
    running: dict[str, int] = {}
    for w in cp.workloads.values():
        if w.state in QUEUED:
            pending[w.queue] = pending.get(w.queue, 0) + 1
        elif w.state in HOLDING:
            running[w.queue] = running.get(w.queue, 0) + 1
    out = []
    for name, q in cp.queues.items():
        nominal = q.nominal
        borrow = q.borrow_limit
        out.append(
            {
                "name": name,
                "cohort": q.cohort,
                "weight": q.spec.weight,
                "nominal": {
                    "gpu": _quota(nominal.gpu),
                    "vram": _quota(nominal.vram),
                    "cpu": _quota(nominal.cpu),
                    "memory": _quota(nominal.ram),
                },
                "borrowing_limit": {
                    "gpu": _quota(borrow.gpu),
                    "vram": _quota(borrow.vram),
                    "cpu": _quota(borrow.cpu),
                    "memory": _quota(borrow.ram),
                },
                "usage": resources(q.usage_vector()),
                "pending": pending.get(name, 0),
                "running": running.get(name, 0),
            }
        )
    return out


def decision(rec: DecisionRecord) -> dict[str, Any]:
    d = rec.to_dict()
    d.setdefault("extra", {})
    d["at"] = rfc3339(rec.time)
    out: dict[str, Any] = sanitize(d)
    return out


def cluster_view(cp: ClusterReads, backend: str, *, max_workloads: int = 2000) -> dict[str, Any]:
    """The dashboard's snapshot: every node with its devices, and the live workloads."""
    now = cp.now()
    cache: AdmissionCache = {}
    nodes = [node_view(cp, n) for n in cp.capacity.node_names()]
    live = [
        w
        for w in cp.workloads.values()
        if w.state in HOLDING or w.state in QUEUED or (w.deadline is not None and w.state not in TERMINAL)
    ]
    live.sort(key=lambda w: (-w.priority, w.seq))
    gpu_total = sum(n["capacity"]["gpu"] for n in nodes) / 1000
    gpu_free = sum(n["free"]["gpu"] for n in nodes) / 1000
    counts: dict[str, float] = {s.value: 0 for s in State}
    for w in cp.workloads.values():
        counts[w.state.value] += 1
    totals = {
        "gpus": gpu_total,
        "gpus_used": gpu_total - gpu_free,
        "nodes": len(nodes),
        "nodes_ready": sum(1 for n in nodes if n["status"] == "ready"),
        "workloads": len(cp.workloads),
        "preemptions": cp.counters.get("preempt", 0),
        **counts,
    }
    return {
        "now": now,
        "version": cp.version,
        "backend": backend,
        "nodes": nodes,
        "workloads": [workload_summary(w, now, cp, cache) for w in live[:max_workloads]],
        "totals": totals,
    }


def explain(cp: ClusterReads, w: Workload, decisions: list[DecisionRecord]) -> dict[str, Any]:
    """Why a workload is where it is: its story in words, plus the records behind it."""
    now = cp.now()
    parts = [f"{w.id} ({w.spec.name}) is {w.state.value}"]
    condition, why = admission(cp, w)
    if condition == "inadmissible":
        parts.append("; ".join(why))  # each reason starts with "inadmissible:"
    elif w.state in QUEUED:
        parts.append(
            f"waiting: {w.pending_reason}" if w.pending_reason else "waiting for the next cycle"
        )
    if w.state in HOLDING and w.placement:
        parts.append("on " + ", ".join(dict.fromkeys(a.node for a in w.placement)))
    if w.preempted_by:
        parts.append(f"last preempted by {w.preempted_by}")
    if w.victims:
        parts.append("waiting for victims to release: " + ", ".join(w.victims))
    if w.preemptions:
        parts.append(f"preempted {w.preemptions} time(s) so far")
    if w.failure_cause:
        parts.append(f"last failure: {w.failure_cause}")
    if w.deadline is not None:
        left = w.deadline - now
        parts.append(
            f"deadline in {left:.0f} s" + (" (at risk)" if deadline_at_risk(w, now) else "")
            if left >= 0
            else f"deadline missed by {-left:.0f} s"
        )
    last = [d for d in decisions if d.kind in ("preempt", "drain", "unschedulable", "place", "reject")]
    if last:
        d = last[-1]
        parts.append(f"latest decision: {d.kind} by {d.policy}: " + "; ".join(d.reasons))
    return {
        "workload": w.id,
        "state": w.state.value,
        "summary": ". ".join(parts) + ".",
        "pending_reason": w.pending_reason,
        "condition": condition,
        "inadmissible_reasons": why,
        "preempted_by": w.preempted_by,
        "victims": list(w.victims),
        "history": [transition(t) for t in w.history],
        "decisions": [decision(d) for d in decisions],
    }
