"""Scheduling policies for replays: mlwe's default and the baselines, as plug-ins.

Each baseline is a :class:`~mlwe.core.scheduler.Scheduler` configuration (an
ordering plug-in plus flags), never a fork of the simulator. Exact semantics
are in each factory's docstring and in ``POLICY_SEMANTICS`` (printed in reports).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from mlwe.core.model import Queue, Workload
from mlwe.core.scheduler import Scheduler, SchedulerConfig


class _Fifo:
    """Arrival order only (priorities ignored)."""

    name = "fifo"

    def order(
        self, queued: Sequence[Workload], queues: Mapping[str, Queue], total_gpu: int, now: float
    ) -> list[Workload]:
        return sorted(queued, key=lambda w: w.seq)


def mlwe_default(durations: Mapping[str, float]) -> Scheduler:
    """mlwe's default: priority, deadline slack, fair share, arrival; best fit; cheapest
    minimal preemption; EASY backfill. Uses only user estimates, never true durations."""
    return Scheduler(name="mlwe")


def fifo_strict(durations: Mapping[str, float]) -> Scheduler:
    """Strict FIFO: jobs start in arrival order; the first that does not fit blocks
    every later one. No preemption."""
    return Scheduler(
        ordering=_Fifo(), config=SchedulerConfig(preemption=False, backfill=False, strict_order=True),
        name="fifo",
    )


def fifo_backfill(durations: Mapping[str, float]) -> Scheduler:
    """FIFO with backfill: arrival order, and any later job that fits may start when
    an earlier one does not (no reservation). No preemption."""
    return Scheduler(
        ordering=_Fifo(), config=SchedulerConfig(preemption=False, backfill=False),
        name="fifo-backfill",
    )


POLICIES: dict[str, Callable[[Mapping[str, float]], Scheduler]] = {
    "mlwe": mlwe_default,
    "fifo": fifo_strict,
    "fifo-backfill": fifo_backfill,
}

POLICY_SEMANTICS: dict[str, str] = {name: (f.__doc__ or "").strip() for name, f in POLICIES.items()}


def make_policy(name: str, durations: Mapping[str, float]) -> Scheduler:
    try:
        return POLICIES[name](durations)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
