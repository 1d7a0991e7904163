"""The size-aware order kept between cycles is the full sort's, at every cycle.

:meth:`mlwe.core.policies.ordering.SizeAware.order` keeps the last order and
re-keys only the workloads that joined the queue or moved since (a transition,
a new priority), rebuilding it when the estimator has learned enough to change
keys, and sorting in full whenever a deadline is queued. Replays of contended
Philly jobs (no deadlines: the kept order serves most cycles) and of an ITP
cluster (deadlines) check every call against a full sort of every key.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import pytest

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
    original = SizeAware.order

    def checked(self: SizeAware, queued: Sequence[Workload], queues: Mapping[str, Queue],
                total_gpu: int, now: float) -> list[Workload]:
        kept = self._kept is not None and self.estimator.fresh(self._kept_learned)
        got = original(self, queued, queues, total_gpu, now)
        # the reference: one full sort of every workload's key (each key as
        # key() gives it now: its cached entry while that stands, see _entry)
        want = sorted(queued, key=lambda w: self.key(w, now))
        assert [w.id for w in got] == [w.id for w in want]
        calls["kept" if kept and self._kept is not None else "sorted"] += 1
        if any(w.deadline is not None for w in queued):
            calls["deadline"] += 1
        return got

    monkeypatch.setattr(SizeAware, "order", checked)
    r = replay(load_trace(name, **kw), ReplayConfig(policy="mlwe"))  # type: ignore[arg-type]
    assert r.metrics["completed"] == r.metrics["jobs"]
    if name == "philly":
        assert calls["kept"] > 5 * calls["sorted"] > 0  # the kept order served most cycles
    else:
        assert calls["deadline"] > 100  # deadlines queued: sorted in full, and still equal
