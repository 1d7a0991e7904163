"""Queue ordering policies: which waiting workload is considered first."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Protocol

from mlwe.core.model import Queue, Workload
from mlwe.core.resources import UNLIMITED, format_duration
from mlwe.core.spec import WorkloadSpec

if TYPE_CHECKING:
    from mlwe.core.controlplane import ControlPlane

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
    1. workloads whose deadline is still feasible by the estimate and urgent
       (0 <= slack < max(``urgency_horizon_s``, ``urgency_ratio`` x expected
       remaining time), slack = deadline - now - expected remaining time: the
       learned estimate, else the user's, else 0), least slack first;
    2. then every other workload (no deadline, a deadline far off, or one that
       can no longer be met: it is not left behind everything, it competes by
       size like the rest) by a virtual start time: the moment it entered the
       queue plus ``aging`` x its expected service per GPU, where expected
       service = 1 / the Gittins index of its learned service distribution at
       the service it has attained, if history exists, else the user's
       estimate of what is left, else attained service + ``las_quantum_s``
       (least attained service first, LAS). Smaller first. So a
       short job overtakes a long one, but only for as long as the long one
       has waited ``aging`` x its own size: nothing starves;
    3. then arrival.

    The keys change only when a workload runs (its attained service) or the
    estimator has learned 5% more, so they are cached per workload, and so is
    the order itself (:meth:`order`): a cycle over a long queue costs a pass
    that checks nothing changed, and an insertion per workload that did.
    """

    name = "size-aware"

    def __init__(
        self,
        estimator: RuntimeEstimatorLike,
        urgency_horizon_s: float = 2 * 3600.0,
        las_quantum_s: float = 600.0,
        aging: float = 1.0,
        urgency_ratio: float = 0.0,
    ) -> None:
        self.estimator = estimator
        self.urgency_horizon_s = urgency_horizon_s
        #: a deadline is also urgent while its slack is under this many times the
        #: work it has left (long jobs need their turn earlier). Off by default:
        #: measured on ITP 01-05 (checkpoint periodic:1800), 1.0 let long deadline
        #: jobs jump ahead for days and cost 0.1-4.3% of average JCT (itp:05 above
        #: edf's); 0.0 meets every cluster's deadline-met target as well
        self.urgency_ratio = urgency_ratio
        self.las_quantum_s = las_quantum_s
        self.aging = aging
        # id -> (attained, learned count, latest feasible start, virtual start, rule,
        # urgency window)
        self._keys: dict[str, tuple[float, int, float, float, str, float]] = {}
        # the last order (see order()): id -> (workload, transitions, priority,
        # key, spec, the cached entry the key was read from), the (key, workload)
        # pairs sorted, and the oldest learned count its keys were computed at
        # (None: no order kept)
        self._kept: dict[str, _Kept] | None = None
        self._sorted: list[tuple[tuple[int, int, float, int], Workload]] = []
        self._kept_learned = 0
        #: the control plane whose whole queue the kept order is, and the journal
        #: mark it is up to date with (None: not known to be a whole queue)
        self._synced: tuple[ControlPlane, tuple[int, int]] | None = None
        #: kept workloads that ask for no GPU
        self._no_gpu = 0

    def remaining(self, w: Workload, now: float) -> float | None:
        """Expected seconds left: the learned estimate, else the user's, else None."""
        a = attained(w, now)
        est = self.estimator.estimate(w, a)
        if est is not None:
            return float(est.remaining_s)
        return w.remaining_estimate(now)

    def _entry(self, w: Workload, now: float) -> tuple[float, int, float, float, str, float]:
        a = attained(w, now)
        got = self._keys.get(w.id)
        est = self.estimator
        if got is not None and got[0] == a and est.fresh(got[1]):
            return got
        g = est.gittins_index(w, a)
        rule = "gittins"
        if g is None or g <= 0:
            told = est.estimate(w, a)  # no history: the user's own estimate, if any
            if told is not None:
                service = max(1.0, float(told.remaining_s))
                rule = "estimate"
            else:
                service = a + self.las_quantum_s
                rule = "las"
        else:
            service = 1.0 / g
        per_gpu = service * max(1.0, w.gpus())
        # a job that ran re-enters at its requeue: its attained service already
        # counts in its index (from submission it would jump ahead of everything:
        # measured on philly 3000 / 16x8, avg JCT +11%, p99 -3%)
        since = w.history[-1].time if w.history else w.submit_time
        entered = since if a > 0 else w.submit_time
        latest = INF
        window = self.urgency_horizon_s
        if w.deadline is not None:
            rem = self.remaining(w, now)
            latest = w.deadline - (rem or 0.0)
            window = max(window, self.urgency_ratio * (rem or 0.0))
        got = (a, est.learned, latest, entered + self.aging * per_gpu, rule, window)
        if len(self._keys) > 200_000:
            self._keys.clear()
        self._keys[w.id] = got
        return got

    def key(self, w: Workload, now: float) -> tuple[int, int, float, int]:
        e = self._entry(w, now)
        latest = e[2]
        if latest < INF and 0.0 <= latest - now < e[5]:
            return (-w.priority, 0, latest, w.seq)
        return (-w.priority, 1, e[3], w.seq)

    def explain(self, w: Workload, now: float) -> str:
        """Which rule ranked ``w`` and on what estimate (for decision records)."""
        e = self._entry(w, now)
        latest = e[2]
        if latest < INF and 0.0 <= latest - now < e[5]:  # (what key() ranks as urgent)
            return f"feasible deadline, slack {format_duration(latest - now)}"
        rule = _RULE_TEXT.get(e[4], "least attained service (no history)")
        text = f"{rule}, virtual start t={e[3]:.0f}"
        est = self.estimator.estimate(w, e[0])
        if est is not None and hasattr(est, "describe"):
            text += f"; estimate {est.describe()}"
        return text

    def order_queue(self, cp: ControlPlane, total_gpu: int, now: float) -> list[Workload]:
        """``cp``'s whole queue sorted by :meth:`key`: :meth:`order` of
        ``cp.queued_workloads()``, but, where the kept order is that queue's as
        of a journal mark (:meth:`ControlPlane.changed_since`), brought up to date
        from the workloads changed since instead of a pass over the whole queue."""
        got = self._from_journal(cp, now)
        if got is not None:
            return got
        mark = cp.journal_mark()
        out = self.order(cp.queued_workloads(), cp.queues, total_gpu, now)
        if self._kept is not None:
            self._synced = (cp, mark)
        return out

    def queue_summary(self, cp: ControlPlane) -> tuple[int, bool] | None:
        """Of ``cp``'s queue as :meth:`order_queue` last ordered it: the highest
        priority in it, and whether every workload in it asks for GPUs (None: not
        known without a pass over it)."""
        synced = self._synced
        if synced is None or synced[0] is not cp or not self._sorted:
            return None
        return -self._sorted[0][0][0], self._no_gpu == 0

    def _from_journal(self, cp: ControlPlane, now: float) -> list[Workload] | None:
        synced = self._synced
        if synced is None or synced[0] is not cp or self._kept is None:
            return None
        changed = cp.changed_since(synced[1])
        if changed is None:
            return None
        self._rekey_stale(now)
        self._synced = (cp, cp.journal_mark())
        if not changed:
            return list(map(_SECOND, self._sorted))
        kept = self._kept
        queued, workloads = cp.queued, cp.workloads
        fresh: list[Workload] = []
        gone: list[str] = []
        # what _update asks of every queued workload, asked of those that changed
        for wid in dict.fromkeys(changed):
            w = workloads.get(wid)
            if w is None or wid not in queued:
                gone.append(wid)
                continue
            if _unchanged(kept.get(wid), w):
                continue
            if w.deadline is not None or w.started_at is not None:
                self._synced = None  # keys that move with the clock: sorted in full
                return None
            fresh.append(w)
        return self._apply(fresh, gone, now)

    def order(
        self, queued: Sequence[Workload], queues: Mapping[str, Queue], total_gpu: int, now: float
    ) -> list[Workload]:
        """``queued`` sorted by :meth:`key`. Without deadlines a key depends on
        nothing that moves with the clock while a workload waits, so the order is
        kept between calls: a workload is (re)keyed only when it joins the queue
        or has moved since (a transition, a new priority, a run), or once the
        estimator has learned enough since its key was read to change it (see
        :meth:`_entry` and :meth:`_rekey_stale`). The result is the full sort's,
        workload for workload (keys end in the unique arrival sequence: no two
        are equal); a queue with a deadline in it is sorted in full at every call."""
        self._synced = None  # (whatever ``queued`` is: maybe not a whole queue)
        if self._kept is not None:
            self._rekey_stale(now)
            got = self._update(queued, now)
            if got is not None:
                return got
        return self._rebuild(queued, now)

    def _rebuild(self, queued: Sequence[Workload], now: float) -> list[Workload]:
        key = self.key
        pairs = sorted(((key(w, now), w) for w in queued), key=_FIRST)
        self._kept = None
        # kept only without deadlines (their keys move with the clock) and with no
        # queue member running (none should be: attained service would move too)
        if all(w.deadline is None and w.started_at is None for w in queued):
            keys = self._keys
            self._kept = {
                w.id: (w, len(w.history), w.priority, k, w.spec, keys[w.id]) for k, w in pairs
            }
            self._sorted = pairs
            self._no_gpu = sum(1 for w in queued if not w.spec.resources.gpu)
            self._kept_learned = self._oldest_learned(self._kept)
        return [w for _, w in pairs]

    def _update(self, queued: Sequence[Workload], now: float) -> list[Workload] | None:
        """The kept order brought up to date with ``queued`` (None: it cannot be)."""
        kept = self._kept
        assert kept is not None
        fresh: list[Workload] = []
        gone: list[str] = []  # kept, but moved since (re-keyed below)
        same = 0
        for w in queued:
            k = kept.get(w.id)
            if _unchanged(k, w):
                same += 1
                continue
            if w.deadline is not None or w.started_at is not None:
                return None
            if k is not None:
                gone.append(w.id)
            fresh.append(w)
        if same + len(gone) != len(kept):  # some left the queue
            ids = {w.id for w in queued}
            gone += [i for i in kept if i not in ids]
        return self._apply(fresh, gone, now)

    def _rekey_stale(self, now: float) -> None:
        """Once the estimator has learned enough since the oldest kept key to change
        keys: re-key the kept workloads whose cached entry is stale (or is no longer
        the one their kept key was read from), as a full sort would, and leave the
        rest where they are (their key is what :meth:`key` gives now). A workload
        that moved since it was kept is left to the caller's pass over what
        changed, which decides whether it can be kept at all (a deadline, a run)."""
        kept, keys, fresh = self._kept, self._keys, self.estimator.fresh
        assert kept is not None
        if fresh(self._kept_learned):
            return
        stale = [
            k[0] for wid, k in kept.items()
            if ((e := keys.get(wid)) is not k[5] or not fresh(e[1])) and _unchanged(k, k[0])
        ]
        if stale:
            self._apply(stale, [], now)
        self._kept_learned = self._oldest_learned(kept)

    def _oldest_learned(self, ids: Iterable[str]) -> int:
        """The oldest learned count the cached keys of ``ids`` were read at."""
        keys = self._keys
        return min((keys[wid][1] for wid in ids), default=self.estimator.learned)

    def _apply(self, fresh: list[Workload], gone: list[str], now: float) -> list[Workload]:
        """The kept order without ``gone`` (ids, kept or not) and with ``fresh``
        (workloads to key anew, kept or not, none with a deadline or running)."""
        kept = self._kept
        assert kept is not None
        srt = self._sorted
        for wid in gone + [w.id for w in fresh]:
            k = kept.pop(wid, None)
            if k is None:
                continue
            i = bisect.bisect_left(srt, k[3], key=_FIRST)
            assert srt[i][1] is k[0]
            del srt[i]
            if not k[4].resources.gpu:
                self._no_gpu -= 1
        if fresh:
            key = self.key
            learned = self._keys
            for w in fresh:
                kw = key(w, now)
                kept[w.id] = (w, len(w.history), w.priority, kw, w.spec, learned[w.id])
                bisect.insort(srt, (kw, w), key=_FIRST)
                if not w.spec.resources.gpu:
                    self._no_gpu += 1
                self._kept_learned = min(self._kept_learned, learned[w.id][1])
        return list(map(_SECOND, srt))


#: what SizeAware keeps of a queued workload: the workload, its transitions, its
#: priority, its key, its spec (the key is read again when any of them moves) and
#: the cached entry (:meth:`SizeAware._entry`) the key was read from
_Kept = tuple[
    Workload, int, int, tuple[int, int, float, int], WorkloadSpec,
    tuple[float, int, float, float, str, float],
]


def _unchanged(k: _Kept | None, w: Workload) -> bool:
    """Whether kept entry ``k`` is still ``w``'s: the same workload, transitions,
    priority and spec (else its key is read again)."""
    return (
        k is not None
        and k[0] is w
        and k[1] == len(w.history)
        and k[2] == w.priority
        and k[4] is w.spec
    )


#: what a decision record says of the rule that ranked a workload (:meth:`SizeAware.explain`)
_RULE_TEXT = {
    "gittins": "Gittins index of learned run times",
    "estimate": "the user's estimate (no history)",
}
_FIRST = itemgetter(0)  # a (key, workload) pair's key
_SECOND = itemgetter(1)  # and its workload


class RuntimeEstimatorLike(Protocol):
    """What SizeAware needs of an estimator (mlwe.core.estimator.RuntimeEstimator)."""

    def estimate(self, w: Workload, attained_s: float = 0.0) -> Any: ...

    def gittins_index(self, w: Workload, attained_s: float) -> float | None: ...

    def fresh(self, learned_then: int) -> bool: ...

    @property
    def learned(self) -> int: ...


def attained(w: Workload, now: float) -> float:
    """Seconds of work ``w`` has done: saved work plus its current run."""
    done = w.work_done
    started = w.started_at
    if started is not None:
        # max(done, base + max(0.0, now - started - restore)), spelt out: a cycle asks
        # this of every waiting and running workload, several times
        base = w.run_base_work
        run = now - started
        if base > 0:
            run -= w.spec.restart_cost
        run = base + (run if run > 0.0 else 0.0)
        if run > done:
            done = run
    return done
