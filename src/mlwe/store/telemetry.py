"""Telemetry samples (table ``telemetry``): append, query, downsample, prune.

A sample is one node's (and optionally one workload's) metrics at one time, as
JSON, at a resolution in seconds (raw samples are finer; downsampling replaces
old ones by one averaged sample per bucket; pruning deletes the oldest). A
sample has no natural key: a write retried after an uncertain commit may store
one twice, never lose one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, delete, select

from mlwe.store import schema as S
from mlwe.store.db import Transactions
from mlwe.store.rows import CHUNK, Encoder, canonical_json

__all__ = ["Telemetry", "TelemetrySample"]


@dataclass(frozen=True, slots=True)
class TelemetrySample:
    time: float
    node: str
    metrics: Mapping[str, Any]
    workload: str | None = None
    resolution_s: int = 0  # filled in when read back


class Telemetry:
    """Table ``telemetry``."""

    def __init__(self, tx: Transactions, encode: Encoder) -> None:
        self.tx = tx
        self.encode = encode

    def append_telemetry(
        self,
        samples: Iterable[TelemetrySample],
        resolution_s: int = 1,
        *,
        conn: Connection | None = None,
    ) -> int:
        """Store raw telemetry samples at ``resolution_s``; returns how many."""
        rows = [
            {
                "time": s.time,
                "node": s.node,
                "workload": s.workload,
                "resolution_s": resolution_s,
                "metrics": self.encode(dict(s.metrics)),
            }
            for s in samples
        ]
        if rows:
            self.tx.write(lambda c: c.execute(S.telemetry.insert(), rows), conn)
        return len(rows)

    def telemetry(
        self,
        *,
        node: str | None = None,
        workload: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = None,
    ) -> list[TelemetrySample]:
        t = S.telemetry
        q = select(t.c.time, t.c.node, t.c.workload, t.c.resolution_s, t.c.metrics).order_by(
            t.c.time, t.c.id
        )
        if node is not None:
            q = q.where(t.c.node == node)
        if workload is not None:
            q = q.where(t.c.workload == workload)
        if since is not None:
            q = q.where(t.c.time >= since)
        if until is not None:
            q = q.where(t.c.time < until)
        if limit is not None:
            q = q.limit(limit)
        rows: Any = self.tx.read(lambda c: c.execute(q).all())
        return [
            TelemetrySample(time=tm, node=n, workload=wl, metrics=json.loads(m), resolution_s=res)
            for tm, n, wl, res, m in rows
        ]

    def downsample_telemetry(
        self, older_than: float, to_resolution_s: int, *, conn: Connection | None = None
    ) -> tuple[int, int]:
        """Replace samples older than ``older_than`` (and finer than ``to_resolution_s``) by
        one sample per node, workload and ``to_resolution_s`` bucket.

        Numeric metrics are averaged; others keep their latest value. The cut-off
        is rounded down to a bucket boundary, so no bucket is split. Returns
        (samples removed, samples written).
        """
        if to_resolution_s <= 0:
            raise ValueError("to_resolution_s must be positive")
        cutoff = math.floor(older_than / to_resolution_s) * to_resolution_s
        t = S.telemetry

        def go(c: Connection) -> tuple[int, int]:
            rows: Any = c.execute(
                select(t.c.id, t.c.time, t.c.node, t.c.workload, t.c.metrics)
                .where(t.c.time < cutoff, t.c.resolution_s < to_resolution_s)
                .order_by(t.c.time, t.c.id)
            ).all()
            if not rows:
                return 0, 0
            groups: dict[tuple[str, str | None, float], list[dict[str, Any]]] = {}
            for _id, tm, node, wl, m in rows:
                bucket = math.floor(tm / to_resolution_s) * to_resolution_s
                groups.setdefault((node, wl, float(bucket)), []).append(json.loads(m))
            out = []
            for (node, wl, start), ms in groups.items():
                agg: dict[str, Any] = {}
                sums: dict[str, list[float]] = {}
                for m in ms:
                    for k, v in m.items():
                        if isinstance(v, int | float) and not isinstance(v, bool):
                            sums.setdefault(k, []).append(float(v))
                        else:
                            agg[k] = v
                for k, vs in sums.items():
                    agg[k] = sum(vs) / len(vs)
                out.append(
                    {
                        "time": start,
                        "node": node,
                        "workload": wl,
                        "resolution_s": to_resolution_s,
                        "metrics": canonical_json(agg),
                    }
                )
            ids = [r[0] for r in rows]
            for i in range(0, len(ids), CHUNK):
                c.execute(delete(t).where(t.c.id.in_(ids[i : i + CHUNK])))
            c.execute(t.insert(), out)
            return len(ids), len(out)

        return self.tx.write(go, conn)

    def prune_telemetry(
        self, retention_s: float, now: float, *, conn: Connection | None = None
    ) -> int:
        """Delete samples older than ``now - retention_s``; returns how many."""
        t = S.telemetry
        return self.tx.write(
            lambda c: int(c.execute(delete(t).where(t.c.time < now - retention_s)).rowcount), conn
        )
