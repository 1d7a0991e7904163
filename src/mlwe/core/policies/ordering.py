"""Queue ordering policies: which waiting workload is considered first."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

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
