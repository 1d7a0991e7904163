"""The size-aware order kept between cycles is the full sort's, at every cycle.

:meth:`mlwe.core.policies.ordering.SizeAware.order` keeps the last order and
re-keys only the workloads that joined the queue or moved since (a transition,
a new priority, a new spec) or whose key the estimator has learned enough to
change since, and sorts in full whenever a deadline is queued;
:meth:`~mlwe.core.policies.ordering.SizeAware.order_queue`, which a cycle calls,
finds those workloads in the control plane's journal instead of a pass over the
queue. Replays of contended
Philly jobs (no deadlines: the kept order serves most cycles) and of an ITP
cluster (deadlines) check every call against a full sort of every key.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import pytest

from mlwe.core.controlplane import ControlPlane
from mlwe.core.model import Queue, Workload
from mlwe.core.policies.ordering import SizeAware
from mlwe.sim.replay import ReplayConfig, replay
from mlwe.sim.traces import load_trace


@pytest.mark.parametrize(
    ("name", "kw"),
    [("philly", {"limit": 600, "cluster": "nodes:4x8"}), ("itp:02", {"limit": 600})],
)
def test_the_kept_order_is_the_full_sort_at_every_cycle(
    name: str, kw: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: Counter[str] = Counter()
    original_order, original_queue = SizeAware.order, SizeAware.order_queue

    def checked(self: SizeAware, queued: Sequence[Workload], queues: Mapping[str, Queue],
                total_gpu: int, now: float) -> list[Workload]:
        kept = self._kept is not None and self.estimator.fresh(self._kept_learned)
        got = original_order(self, queued, queues, total_gpu, now)
        calls["kept" if kept and self._kept is not None else "sorted"] += 1
        return got

    def checked_queue(self: SizeAware, cp: ControlPlane, total_gpu: int,
                      now: float) -> list[Workload]:
        if calls["queue"] % 7 == 6:  # a reader of the order between cycles (the agent's)
            self.order(cp.queued_workloads(), cp.queues, total_gpu, now)
        calls["queue"] += 1
        before = sum(calls.values())
        got = original_queue(self, cp, total_gpu, now)
        if sum(calls.values()) == before:
            calls["journal"] += 1  # brought up to date from the journal alone
        queued = cp.queued_workloads()
        # the reference: one full sort of every workload's key (each key as
        # key() gives it now: its cached entry while that stands, see _entry)
        want = sorted(queued, key=lambda w: self.key(w, now))
        assert [w.id for w in got] == [w.id for w in want]
        summary = self.queue_summary(cp)
        if summary is not None:  # what the cycle's early stop reads instead of a pass
            assert summary == (max(w.priority for w in queued),
                               all(w.spec.resources.gpu for w in queued))
        if any(w.deadline is not None for w in queued):
            calls["deadline"] += 1
        return got

    monkeypatch.setattr(SizeAware, "order", checked)
    monkeypatch.setattr(SizeAware, "order_queue", checked_queue)
    r = replay(load_trace(name, **kw), ReplayConfig(policy="mlwe"))  # type: ignore[arg-type]
    assert r.metrics["completed"] == r.metrics["jobs"]
    if name == "philly":
        # the journal served most cycles; after another reader, the kept order
        assert calls["journal"] > 2 * (calls["kept"] + calls["sorted"])
        assert calls["kept"] > 0 and calls["sorted"] > 0
    else:
        assert calls["deadline"] > 100  # deadlines queued: sorted in full, and still equal
        assert calls["journal"] == 0
