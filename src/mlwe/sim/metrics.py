"""Replay metrics, collected from the control plane's transition stream.

Everything here is measured from what happened (transitions and the
simulator's ground truth), never from what the policy believed.

Periodic samples (every ``sample_every_s`` of simulated time, from the first
submission on) describe the cluster *just before* the first transition at or
after the sample time: allocation, queue, queueing delay and GPU
fragmentation. The state they read (free devices per node, waiting requests)
is mirrored here from the transitions themselves, so a sample costs
O(GPU models x GPUs per node), not a scan of every node or queued workload.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from mlwe.core.capacity import FULL, ReplicaAlloc
from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import HOLDING, QUEUED, State, Transition
from mlwe.core.model import Workload
from mlwe.core.spec import NodeStatus

#: Bounded slowdown's floor on the run time (seconds): a job's slowdown is its JCT
#: over max(run time, this), at least 1, so a 2-second job that waits a minute does
#: not read as slowed down 30 times (Feitelson et al., "Theory and practice in
#: parallel job scheduling", 1997: the customary 10 s)
BSLD_TAU_S = 10.0


@dataclass(slots=True)
class JobRecord:
    submit: float
    deadline: float | None
    priority: int
    queue: str
    gpus: float
    duration: float
    first_start: float | None = None
    finish: float | None = None
    state: str = "pending"
    preemptions: int = 0


class Sample(NamedTuple):
    """The cluster at one sample time (see the module docstring for the instant)."""

    t: float
    gpus_allocated: float  # GPUs held by workloads (fractions count as fractions)
    gpu_util: float  # time-averaged allocated / total GPUs over the window since the last sample
    queued: int  # workloads waiting (pending or preempted)
    queued_gpu: int  # of which ask for GPUs
    queue_delay_avg_s: float  # mean time the waiting workloads have waited so far (0: none)
    queue_delay_max_s: float  # the longest current wait (0: none)
    free_gpus: int  # wholly free GPUs on ready nodes
    unusable_gpus: int  # of which no waiting GPU workload could use (see Metrics)
    #: unusable / free, when GPU work waited and some GPU was free; None otherwise
    fragmentation: float | None
    #: of the unusable, those on nodes whose model some waiting workload accepts, but
    #: with fewer free GPUs than it asks (the packing share; the rest: no taker for the model)
    unusable_by_size_gpus: int = 0


class Series(list[tuple[float, float, int]]):
    """``(time, allocated GPUs, queued workloads)`` per sample, as plots always read it;
    the richer :class:`Sample` of each lies in ``samples`` (same order, same length)."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: list[Sample] = []

    def add(self, s: Sample) -> None:
        self.append((s.t, s.gpus_allocated, s.queued))
        self.samples.append(s)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def jain(xs: list[float]) -> float | None:
    if not xs:
        return None
    sq = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * sq) if sq else 1.0


#: what a waiting GPU workload needs of one node, for fragmentation: whole GPUs per
#: replica (a fraction counts as one), accepted models, minimum VRAM per GPU
_Request = tuple[int, tuple[str, ...], int]


@dataclass
class Metrics:
    """Collects a replay's metrics.

    Fragmentation ("GPUs free but unusable"): at each sample where GPU work
    waits, a wholly free GPU on a ready node is *unusable* when the node has
    fewer whole free GPUs than the smallest per-replica request (in whole GPUs)
    among the waiting workloads that accept the node's GPU model (accepted
    models and minimum VRAM as the scheduler reads them; CPU, RAM, node
    selectors and gang size are not considered). ``fragmentation_avg`` is the
    mean of unusable / free over the samples where GPU work waited and at
    least one GPU was wholly free. ``fragmentation_by_size_avg`` keeps only
    the packing share: GPUs on nodes whose model some waiting workload accepts
    but that have too few free for it (the rest sit on models nobody waiting
    accepts). Fractional GPU requests count as one whole GPU; nodes not ready
    are left out (readiness is read when the sample is taken: no transition
    announces it); CPU-only waiting work does not count as waiting here.
    """

    cp: ControlPlane
    durations: Mapping[str, float]
    total_gpus: float
    sample_every_s: float = 600.0
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    preemptions: int = 0
    #: samples for plots: ``(time, allocated GPUs, queued workloads)`` tuples, with the
    #: full :class:`Sample` of each in ``series.samples``
    series: Series = field(default_factory=Series)

    def __post_init__(self) -> None:
        self._alloc = 0.0
        self._area = 0.0
        self._last = 0.0
        self._next_sample = 0.0
        self._first_submit: float | None = None
        self._win_area = 0.0  # allocated GPU-seconds since the last sample
        self._win_last = 0.0
        self._prev_sample: float | None = None
        # mirror of the state samples read, kept from transitions
        self._waiting: dict[str, float] = {}  # queued id -> when it entered the queue
        self._wait_sum = 0.0
        self._request_of: dict[str, _Request] = {}  # queued GPU workload -> its request
        self._requests: dict[_Request, int] = {}  # distinct waiting requests -> how many
        self._held: dict[str, tuple[ReplicaAlloc, ...]] = {}  # holding id -> its placement
        self._dev: dict[str, list[int]] = {}  # GPU node -> free milli-GPU per device
        self._whole: dict[str, int] = {}  # GPU node -> wholly free devices
        self._model: dict[str, str] = {}  # GPU node -> its model
        self._hist: dict[str, list[int]] = {}  # model -> nodes by wholly free devices
        self._not_ready: list[str] = []  # GPU nodes not schedulable
        self._node_epoch: tuple[int, int] = (-1, -1)
        self._accepts: dict[tuple[tuple[str, ...], int], tuple[str, ...]] = {}
        cp = self.cp
        for info in cp.capacity.nodes():
            if info.gpu_model is not None:
                self._add_node(info.name, info.gpu_model, list(cp.capacity.free_devices(info.name)))
        for w in cp.workloads.values():  # metrics attached to a live control plane
            if w.state in HOLDING:
                self._held[w.id] = w.placement
            elif w.state in QUEUED:
                self._enqueue(w, w.history[-1].time if w.history else w.submit_time)
        self.cp.listeners.append(self._on)

    # ------------------------------------------------------------ mirrored state
    def _add_node(self, node: str, model: str, dev: list[int]) -> None:
        whole = sum(1 for d in dev if d == FULL)
        self._dev[node] = dev
        self._whole[node] = whole
        self._model[node] = model
        h = self._hist.setdefault(model, [])
        if len(h) <= len(dev):
            h.extend([0] * (len(dev) + 1 - len(h)))
        h[whole] += 1

    def _devices(self, node: str) -> list[int] | None:
        dev = self._dev.get(node)
        if dev is None:
            info = self.cp.capacity.info(node)
            if info.gpu_model is None:
                return None
            # a node added after we started: nothing was held on it before this
            self._add_node(node, info.gpu_model, [FULL] * info.gpu_count)
            dev = self._dev[node]
        return dev

    def _shift(self, allocs: tuple[ReplicaAlloc, ...], sign: int) -> None:
        for a in allocs:
            if not a.devices:
                continue
            dev = self._devices(a.node)
            if dev is None:
                continue
            old = self._whole[a.node]
            new = old
            for d in a.devices:
                before = dev[d]
                dev[d] = after = before - sign * a.gpu_per_device
                new += (after == FULL) - (before == FULL)
            if new != old:
                self._whole[a.node] = new
                h = self._hist[self._model[a.node]]
                h[old] -= 1
                h[new] += 1

    def _enqueue(self, w: Workload, t: float) -> None:
        self._waiting[w.id] = t
        self._wait_sum += t
        spec = w.spec
        gpu = spec.resources.gpu
        if gpu:
            req = (-(-gpu // FULL), spec.gpu_models, spec.min_vram_per_gpu)
            self._request_of[w.id] = req
            self._requests[req] = self._requests.get(req, 0) + 1

    def _dequeue(self, w: Workload) -> None:
        t = self._waiting.pop(w.id, None)
        if t is None:
            return
        self._wait_sum = self._wait_sum - t if self._waiting else 0.0
        req = self._request_of.pop(w.id, None)
        if req is not None:
            n = self._requests[req] - 1
            if n:
                self._requests[req] = n
            else:
                del self._requests[req]

    # ------------------------------------------------------------------ samples
    def _refresh_nodes(self) -> None:
        """Node additions and status changes (no transitions announce them)."""
        counters = self.cp.counters
        epoch = (counters.get("add-node", 0), counters.get("set-node-status", 0))
        if epoch == self._node_epoch:
            return
        if epoch[0] != self._node_epoch[0]:
            self._accepts.clear()
        self._node_epoch = epoch
        cap = self.cp.capacity
        for info in cap.nodes():
            if info.gpu_model is not None:
                self._devices(info.name)
        self._not_ready = [n for n in self._dev if cap.status(n) is not NodeStatus.READY]

    def _accepted(self, models: tuple[str, ...], min_vram: int) -> tuple[str, ...]:
        key = (models, min_vram)
        got = self._accepts.get(key)
        if got is None:
            catalog = self.cp.catalog
            present = self._hist.keys()
            names = models or tuple(present)
            got = tuple(
                m for m in names
                if m in present and (g := catalog.get(m)) is not None and g.vram_mib >= min_vram
            )
            self._accepts[key] = got
        return got

    def _sample(self, s: float) -> None:
        self._refresh_nodes()
        # the smallest waiting request each GPU model could serve, once per sample
        smallest: dict[str, int] = {}
        for (g, models, min_vram) in self._requests:
            for m in self._accepted(models, min_vram):
                if g < smallest.get(m, 1 << 30):
                    smallest[m] = g
        free = unusable = by_size = 0
        for model, hist in self._hist.items():
            need = smallest.get(model)
            for k in range(1, len(hist)):
                n = hist[k]
                if n:
                    free += k * n
                    if need is None:
                        unusable += k * n
                    elif k < need:
                        unusable += k * n
                        by_size += k * n
        for node in self._not_ready:
            k = self._whole[node]
            free -= k
            need = smallest.get(self._model[node])
            if need is None:
                unusable -= k
            elif k < need:
                unusable -= k
                by_size -= k
        queued_gpu = len(self._request_of)
        if not queued_gpu:
            unusable = by_size = 0  # nothing waits for a GPU: no free GPU is refused to anyone
        frag = unusable / free if queued_gpu and free else None
        n = len(self._waiting)
        if n:
            delay_avg = max(0.0, s - self._wait_sum / n)
            delay_max = s - next(iter(self._waiting.values()))  # entered in time order
        else:
            delay_avg = delay_max = 0.0
        total = self.total_gpus
        prev = self._prev_sample
        if not total:
            util = 0.0
        elif prev is not None and s > prev:
            util = self._win_area / (total * (s - prev))
        else:
            util = self._alloc / total
        self._win_area = 0.0
        self._prev_sample = s
        self.series.add(
            Sample(s, self._alloc, util, n, queued_gpu, delay_avg, delay_max, free, unusable, frag,
                   by_size)
        )

    def _advance(self, t: float) -> None:
        if self._first_submit is not None:
            every = self.sample_every_s
            while t >= self._next_sample:
                s = self._next_sample
                self._win_area += self._alloc * (s - self._win_last)
                self._win_last = s
                self._sample(s)
                self._next_sample = s + every
        self._area += self._alloc * (t - self._last)
        self._last = t
        self._win_area += self._alloc * (t - self._win_last)
        self._win_last = t

    # -------------------------------------------------------------- transitions
    def _on(self, w: Workload, tr: Transition) -> None:
        t = tr.time
        src, dst = tr.source, tr.target
        if src is None and self._first_submit is None:
            # samples start at the first submission, with the state just before it
            self._first_submit = t
            self._next_sample = t
            self._win_last = t
            self._win_area = 0.0
        self._advance(t)
        queued_before = src in QUEUED
        queued_after = dst in QUEUED
        if queued_after and not queued_before:
            self._enqueue(w, t)
        elif queued_before and not queued_after:
            self._dequeue(w)
        entering = dst in HOLDING and src not in HOLDING
        leaving = src in HOLDING and dst not in HOLDING
        if entering:
            # listeners run after the whole batch: the placement is the batch's final one
            # (empty if the same batch also released it, and then nothing is given back)
            self._held[w.id] = w.placement
            self._shift(w.placement, 1)
        elif leaving:
            self._shift(self._held.pop(w.id, ()), -1)
        if src is None:
            self.jobs[w.id] = JobRecord(
                submit=t, deadline=w.deadline, priority=w.priority, queue=w.queue,
                gpus=w.gpus(), duration=self.durations.get(w.id, 0.0),
            )
            return
        rec = self.jobs.get(w.id)
        if rec is None:
            return
        rec.state = dst.value
        if entering:
            self._alloc += rec.gpus
        elif leaving:
            self._alloc -= rec.gpus
        if dst is State.RUNNING and rec.first_start is None:
            rec.first_start = t
        elif dst is State.PREEMPTING:
            rec.preemptions += 1
            self.preemptions += 1
        elif dst in (State.SUCCEEDED, State.CANCELLED) or (
            dst is State.FAILED and w.failures > w.spec.max_retries
        ):
            rec.finish = t

    def free_devices_mirror(self) -> dict[str, tuple[int, ...]]:
        """Free milli-GPU per device of every GPU node, as the samples see it (for checks
        against the control plane's own index)."""
        return {node: tuple(dev) for node, dev in self._dev.items()}

    # ------------------------------------------------------------------ summary
    def summary(self, end: float, lost_gpu_s: float) -> dict[str, Any]:
        self._advance(end)
        done = [r for r in self.jobs.values() if r.state == "succeeded" and r.finish is not None]
        jct = [r.finish - r.submit for r in done if r.finish is not None]
        wait = [r.first_start - r.submit for r in self.jobs.values() if r.first_start is not None]
        first = self._first_submit or 0.0
        last = max((r.finish for r in done if r.finish is not None), default=first)
        makespan = last - first
        with_dl = [r for r in self.jobs.values() if r.deadline is not None]
        met = [r for r in with_dl if r.finish is not None and r.state == "succeeded" and r.finish <= r.deadline]  # type: ignore[operator]
        by_prio: dict[int, list[bool]] = {}
        outcomes: dict[int, dict[str, int]] = {}
        for r in with_dl:
            ok = r.finish is not None and r.state == "succeeded" and r.finish <= r.deadline  # type: ignore[operator]
            by_prio.setdefault(r.priority, []).append(ok)
            o = outcomes.setdefault(r.priority, {"met": 0, "late": 0, "unfinished": 0})
            o["met" if ok else "late" if r.state == "succeeded" else "unfinished"] += 1
        queues: dict[str, list[float]] = {}
        # bounded slowdown of every succeeded job whose run time is known: the tail a
        # JCT percentile hides (a short job that waited days reads as a few days of
        # JCT among jobs that run for weeks; its slowdown reads thousands)
        bsld: list[float] = []
        for r in done:
            if r.finish is not None and r.duration > 0:
                jct_s = r.finish - r.submit
                queues.setdefault(r.queue, []).append(jct_s / r.duration)
                bsld.append(max(1.0, jct_s / max(r.duration, BSLD_TAU_S)))
        slowdowns = [sum(v) / len(v) for v in queues.values()]
        span = max(1e-9, end - first)
        samples = self.series.samples
        fragmented = [s for s in samples if s.fragmentation is not None]
        return {
            "jobs": len(self.jobs),
            "completed": len(done),
            "unfinished": len(self.jobs) - len(done),
            "avg_jct_s": round(sum(jct) / len(jct), 3) if jct else None,
            "median_jct_s": _r(percentile(jct, 0.5)),
            "p99_jct_s": _r(percentile(jct, 0.99)),
            "avg_queue_delay_s": round(sum(wait) / len(wait), 3) if wait else None,
            "p99_queue_delay_s": _r(percentile(wait, 0.99)),
            "max_queue_delay_s": round(max(wait), 3) if wait else None,
            "makespan_s": round(makespan, 3),
            "gpu_util": round(self._area / (self.total_gpus * span), 6) if self.total_gpus else None,
            "deadline_jobs": len(with_dl),
            "deadline_met_ratio": round(len(met) / len(with_dl), 6) if with_dl else None,
            "deadline_met_by_priority": {
                str(p): round(sum(v) / len(v), 6) for p, v in sorted(by_prio.items())
            } or None,
            "preemptions": self.preemptions,
            "gpu_hours_lost_to_preemption": round(lost_gpu_s / 3600, 3),
            "queue_fairness_jain": _r(jain(slowdowns)),
            # added with the replay report; the keys above keep their meaning and rounding
            "deadline_met": len(met),
            "deadline_missed": len(with_dl) - len(met),
            #: per priority: met, late (succeeded after the deadline), unfinished (did not
            #: succeed by the end of the replay: still waiting or running, failed, cancelled)
            "deadline_outcomes_by_priority": {
                str(p): dict(o) for p, o in sorted(outcomes.items())
            } or None,
            # added with bounded slowdown; run time = the job's work as the trace
            # gives it, so work lost to preemption and re-run counts as slowdown
            "avg_bounded_slowdown": round(sum(bsld) / len(bsld), 3) if bsld else None,
            "p99_bounded_slowdown": _r(percentile(bsld, 0.99)),
            "max_bounded_slowdown": round(max(bsld), 3) if bsld else None,
            "sample_every_s": self.sample_every_s,
            "samples": len(samples),
            "queue_len_avg": _r(sum(s.queued for s in samples) / len(samples)) if samples else None,
            "queue_len_max": max((s.queued for s in samples), default=0),
            "fragmentation_avg": (
                round(sum(s.fragmentation or 0.0 for s in fragmented) / len(fragmented), 6)
                if fragmented else None
            ),
            #: the packing share of it: free GPUs on nodes of a model some waiting workload
            #: accepts, too few for the smallest such request (see Sample)
            "fragmentation_by_size_avg": (
                round(sum(s.unusable_by_size_gpus / s.free_gpus for s in fragmented)
                      / len(fragmented), 6)
                if fragmented else None
            ),
            "fragmentation_unusable_gpus_avg": (
                _r(sum(s.unusable_gpus for s in fragmented) / len(fragmented)) if fragmented else None
            ),
            "fragmentation_samples": len(fragmented),
        }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
