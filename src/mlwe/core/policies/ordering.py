"""Queue ordering policies: which waiting workload is considered first."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from mlwe.core.model import Queue, Workload
from mlwe.core.resources import UNLIMITED

INF = math.inf


class OrderingPolicy(Protocol):
    name: str

    def order(
        self, queued: Sequence[Workload], queues: Mapping[str, Queue], total_gpu: int, now: float
    ) -> list[Workload]: ...


def slack(w: Workload, now: float) -> float:
    """Seconds to spare before the deadline, after the remaining estimated work.

    No deadline: infinite. No estimate: the whole time to the deadline.
    """
    if w.deadline is None:
        return INF
    rem = w.remaining_estimate(now)
    return w.deadline - now - (rem or 0.0)


def queue_shares(queues: Mapping[str, Queue], total_gpu: int) -> dict[str, float]:
    """Dominant share of each queue's nominal quota in use, divided by its weight.

    A queue without quota is measured against the cluster's GPUs.
    """
    out = {}
    for name, q in queues.items():
        share = 0.0
        for used, nominal in zip(q.usage, q.nominal.as_tuple()):
            if nominal < UNLIMITED and nominal > 0:
                share = max(share, used / nominal)
        if share == 0.0 and total_gpu:
            share = q.usage[0] / total_gpu
        out[name] = share / q.spec.weight
    return out


class PriorityDeadlineFairShare:
    """The default: priority, then deadline urgency (least slack), then the queue's
    fair share (least used first), then arrival.

    Slack only counts once it is below ``urgency_horizon_s``: a deadline a week
    away does not jump ahead of work that has waited. A deadline that can no
    longer be met (slack below zero by the user's own estimate, or already past)
    earns no precedence: favouring a lost cause would only make other deadlines
    miss too. Such work is ordered like work without a deadline.
    """

    name = "priority-deadline-fairshare"

    def __init__(self, urgency_horizon_s: float = 24 * 3600.0) -> None:
        self.urgency_horizon_s = urgency_horizon_s

    def order(
        self, queued: Sequence[Workload], queues: Mapping[str, Queue], total_gpu: int, now: float
    ) -> list[Workload]:
        shares = queue_shares(queues, total_gpu)
        horizon = self.urgency_horizon_s

        def key(w: Workload) -> tuple[int, float, float, int]:
            s = slack(w, now)
            urgent = 0.0 <= s < horizon
            return (-w.priority, s if urgent else INF, shares.get(w.queue, 0.0), w.seq)

        return sorted(queued, key=key)


class ArrivalOrder:
    """Priority, then arrival (FIFO within a priority)."""

    name = "priority-fifo"

    def order(
        self, queued: Sequence[Workload], queues: Mapping[str, Queue], total_gpu: int, now: float
    ) -> list[Workload]:
        return sorted(queued, key=lambda w: (-w.priority, w.seq))


class SizeAware:
    """mlwe's default: size-aware within a priority class, from learned estimates.

    Within a priority (highest first):
    1. workloads whose deadline is still feasible by the estimate (slack >= 0,
       with the learned remaining time, or the user's estimate, or none) and
       urgent (slack below ``urgency_horizon_s``), least slack first;
    2. then every other workload (no deadline, a deadline far off, or one that
       can no longer be met: it is not left behind everything, it competes by
       size like the rest) by the Gittins index of its learned service
       distribution at the service it has attained, per GPU (a job of 8 GPUs
       must be 8 times as likely to end soon to go first), where history
       exists; where none does, by least attained service (LAS), as an index of
       1 / (attained + ``las_quantum_s``);
    3. aging: the index is multiplied by 1 + waited / ``aging_s`` (waited =
       time since submission not spent running), so no workload starves;
    4. then the queue's fair share, then arrival.
    """

    name = "size-aware"

    def __init__(
        self,
        estimator: RuntimeEstimatorLike,
        urgency_horizon_s: float = 24 * 3600.0,
        las_quantum_s: float = 600.0,
        aging_s: float = 6 * 3600.0,
    ) -> None:
        self.estimator = estimator
        self.urgency_horizon_s = urgency_horizon_s
        self.las_quantum_s = las_quantum_s
        self.aging_s = aging_s

    def remaining(self, w: Workload, now: float) -> float | None:
        """Expected seconds left: the learned estimate, else the user's, else None."""
        a = attained(w, now)
        est = self.estimator.estimate(w, a)
        if est is not None:
            return float(est.remaining_s)
        return w.remaining_estimate(now)

    def index(self, w: Workload, now: float) -> tuple[float, str]:
        """(aged index per GPU, which rule gave it)."""
        a = attained(w, now)
        g = self.estimator.gittins_index(w, a)
        rule = "gittins"
        if g is None:
            g = 1.0 / (a + self.las_quantum_s)
            rule = "las"
        waited = max(0.0, now - w.submit_time - a)
        return g / max(1.0, w.gpus()) * (1.0 + waited / self.aging_s), rule

    def key(self, w: Workload, now: float, shares: Mapping[str, float]) -> tuple[Any, ...]:
        if w.deadline is not None:
            rem = self.remaining(w, now)
            s = w.deadline - now - (rem or 0.0)
            if 0.0 <= s < self.urgency_horizon_s:
                return (-w.priority, 0, s, 0.0, w.seq)
        idx, _ = self.index(w, now)
        return (-w.priority, 1, -idx, shares.get(w.queue, 0.0), w.seq)

    def order(
        self, queued: Sequence[Workload], queues: Mapping[str, Queue], total_gpu: int, now: float
    ) -> list[Workload]:
        shares = queue_shares(queues, total_gpu)
        key = self.key
        return sorted(queued, key=lambda w: key(w, now, shares))


class RuntimeEstimatorLike(Protocol):
    """What SizeAware needs of an estimator (mlwe.core.estimator.RuntimeEstimator)."""

    def estimate(self, w: Workload, attained_s: float = 0.0) -> Any: ...

    def gittins_index(self, w: Workload, attained_s: float) -> float | None: ...


def attained(w: Workload, now: float) -> float:
    """Seconds of work ``w`` has done: saved work plus its current run."""
    done = w.work_done
    if w.started_at is not None:
        restore = w.spec.restart_cost if w.run_base_work > 0 else 0.0
        done = max(done, w.run_base_work + max(0.0, now - w.started_at - restore))
    return done
