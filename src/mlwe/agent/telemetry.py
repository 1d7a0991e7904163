"""A bounded window of recent telemetry, indexed by workload and by node.

The monitor feeds it samples drained from any backend (or given by the
runtime); triggers and tools read series out of it. Memory stays bounded: a
fixed number of samples per workload and per node, and a cap on how many
workloads and nodes are remembered (the oldest-updated are forgotten first).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from mlwe.core.backend import Telemetry


class TelemetryWindow:
    def __init__(self, per_key: int = 256, max_keys: int = 20_000) -> None:
        self.per_key = per_key
        self.max_keys = max_keys
        self._by_workload: OrderedDict[str, deque[Telemetry]] = OrderedDict()
        self._by_node: OrderedDict[str, deque[Telemetry]] = OrderedDict()
        self.received = 0

    def add(self, samples: Iterable[Telemetry]) -> int:
        n = 0
        for s in samples:
            n += 1
            if s.workload is not None:
                self._put(self._by_workload, s.workload, s)
            self._put(self._by_node, s.node, s)
        self.received += n
        return n

    def _put(self, index: OrderedDict[str, deque[Telemetry]], key: str, s: Telemetry) -> None:
        q = index.get(key)
        if q is None:
            q = index[key] = deque(maxlen=self.per_key)
            if len(index) > self.max_keys:
                index.popitem(last=False)
        else:
            index.move_to_end(key)
        q.append(s)

    def workloads(self) -> list[str]:
        return list(self._by_workload)

    def nodes(self) -> list[str]:
        return list(self._by_node)

    def samples(
        self,
        *,
        workload: str | None = None,
        node: str | None = None,
        metric: str | None = None,
        last: int | None = None,
    ) -> list[Telemetry]:
        """Samples of a workload (on any node) or of a node, oldest first."""
        if workload is not None:
            pool: Iterable[Telemetry] = self._by_workload.get(workload, ())
            if node is not None:
                pool = [s for s in pool if s.node == node]
        elif node is not None:
            pool = self._by_node.get(node, ())
        else:
            pool = sorted(
                (s for q in self._by_node.values() for s in q), key=lambda s: s.time
            )
        out = [s for s in pool if metric is None or metric in s.metrics]
        return out[-last:] if last else out

    def series(
        self, metric: str, *, workload: str | None = None, node: str | None = None
    ) -> list[tuple[float, float]]:
        """(time, value) of one metric; one value per time (the first node's, for a gang)."""
        out: list[tuple[float, float]] = []
        last_t: float | None = None
        for s in self.samples(workload=workload, node=node, metric=metric):
            if s.time == last_t:
                continue
            last_t = s.time
            out.append((s.time, float(s.metrics[metric])))
        return out

    def latest(
        self, metric: str, *, workload: str | None = None, node: str | None = None
    ) -> float | None:
        got = self.samples(workload=workload, node=node, metric=metric, last=1)
        return float(got[-1].metrics[metric]) if got else None

    def forget(self, workload: str) -> None:
        self._by_workload.pop(workload, None)
