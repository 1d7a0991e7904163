"""Snapshots of the control plane (table ``snapshots``) and the meta table (``meta_kv``).

A snapshot is the control plane's state as JSON at one version, keyed by that
version; ``meta_kv`` holds small values by key (``version``: the control-plane
version of the last write). :meth:`Snapshots.max_version` is the newest version
stored anywhere (meta, workload rows or snapshots).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, select

from mlwe.store import schema as S
from mlwe.store.db import Transactions
from mlwe.store.rows import Encoder, upsert

__all__ = ["Snapshot", "Snapshots"]


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: int
    time: float
    state: str  # JSON text


class Snapshots:
    """Tables ``snapshots`` and ``meta_kv``."""

    def __init__(self, tx: Transactions, encode: Encoder) -> None:
        self.tx = tx
        self.encode = encode

    def save_snapshot(
        self,
        version: int,
        time: float,
        state_json: str | Mapping[str, Any],
        *,
        conn: Connection | None = None,
    ) -> None:
        text = state_json if isinstance(state_json, str) else self.encode(dict(state_json))
        row = {"version": version, "time": time, "state": text}
        self.tx.write(lambda c: upsert(c, S.snapshots, ["version"], [row]), conn)

    def latest_snapshot(self) -> Snapshot | None:
        s = S.snapshots
        row = self.tx.read(
            lambda c: c.execute(
                select(s.c.version, s.c.time, s.c.state).order_by(s.c.version.desc()).limit(1)
            ).first()
        )
        return None if row is None else Snapshot(int(row[0]), float(row[1]), row[2])

    def meta_get(self, key: str, default: str | None = None) -> str | None:
        v = self.tx.read(
            lambda c: c.execute(select(S.meta_kv.c.value).where(S.meta_kv.c.key == key)).scalar()
        )
        return default if v is None else str(v)

    def meta_set(self, key: str, value: str, *, conn: Connection | None = None) -> None:
        row = {"key": key, "value": value}
        self.tx.write(lambda c: upsert(c, S.meta_kv, ["key"], [row]), conn)

    def max_version(self) -> int:
        """The newest control-plane version stored (meta, workload rows or snapshots)."""

        def go(c: Connection) -> int:
            meta = c.execute(select(S.meta_kv.c.value).where(S.meta_kv.c.key == "version")).scalar()
            wv = c.execute(select(func.max(S.workloads.c.updated_version))).scalar()
            sv = c.execute(select(func.max(S.snapshots.c.version))).scalar()
            return max(int(meta or 0), int(wv or 0), int(sv or 0))

        return self.tx.read(go)
