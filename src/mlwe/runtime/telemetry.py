"""Telemetry on its way through the engine: to the listeners, the stream, the store.

Each sample the backend reports goes, in this order, to the telemetry
listeners (the agent's monitor), onto the ``telemetry`` stream, and, at most
once per ``store_every_s`` per (node, workload), into a buffer written to the
store in batches. Telemetry is observation, not state: a batch the store
cannot take during an outage is logged and dropped, never retried ahead of
state. :meth:`TelemetrySink.maintenance` downsamples old samples and drops
those past retention.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mlwe.core.backend import Telemetry
from mlwe.runtime.streams import StreamHub
from mlwe.store.repository import Repository, TelemetrySample

log = logging.getLogger("mlwe.engine")

#: buffered samples written in one batch
BATCH = 200


@dataclass(frozen=True)
class TelemetryPolicy:
    """How much telemetry is kept: the sampling, downsampling and retention periods."""

    store_every_s: float = 5.0  # at most one stored sample per node/workload per this
    downsample_after_s: float = 3600.0
    downsample_to_s: int = 60
    retention_s: float = 7 * 86400.0


class TelemetrySink:
    """Fans telemetry out to listeners and the stream, and keeps a sampled share of it."""

    def __init__(self, repo: Repository, streams: StreamHub, policy: TelemetryPolicy) -> None:
        self.repo = repo
        self.streams = streams
        self.policy = policy
        #: called with each sample (the agent's monitor)
        self.listeners: list[Callable[[Telemetry], None]] = []
        self._stored: dict[tuple[str, str | None], float] = {}
        self._buffer: list[TelemetrySample] = []

    def ingest(self, samples: Iterable[Telemetry]) -> None:
        every = self.policy.store_every_s
        for s in samples:
            for listener in self.listeners:
                listener(s)
            self.streams.publish(
                "telemetry",
                {
                    "node": s.node,
                    "workload": s.workload,
                    "metrics": dict(s.metrics),
                    "declared": list(s.declared),
                },
                workload=s.workload,
                time=s.time,
            )
            key = (s.node, s.workload)
            if s.time - self._stored.get(key, -1e18) >= every:
                self._stored[key] = s.time
                metrics = {k: v for k, v in s.metrics.items()}
                if s.declared:
                    metrics["declared"] = list(s.declared)  # type: ignore[assignment]
                self._buffer.append(
                    TelemetrySample(time=s.time, node=s.node, workload=s.workload, metrics=metrics)
                )
        if len(self._buffer) >= BATCH:
            self.store()

    def store(self) -> None:
        """Write the buffered samples (dropped, with a warning, if the store fails)."""
        buf, self._buffer = self._buffer, []
        if not buf:
            return
        try:
            self.repo.append_telemetry(buf, resolution_s=int(self.policy.store_every_s))
        except Exception:  # observations, not state: losing some during an outage is accepted
            log.warning("telemetry not stored (%d samples)", len(buf), exc_info=True)

    def maintenance(self, now: float) -> tuple[int, int]:
        """Store what is buffered, downsample old samples, drop those past retention:
        (samples merged, samples pruned). Raises what the store raises."""
        p = self.policy
        self.store()
        merged, _ = self.repo.downsample_telemetry(now - p.downsample_after_s, p.downsample_to_s)
        pruned = self.repo.prune_telemetry(p.retention_s, now)
        return merged, pruned
