"""The control plane's state: workloads, their lifecycle transitions, and decisions.

:class:`Workloads` writes and reads tables ``workloads`` and ``transitions``;
:class:`Decisions` table ``decisions``. The row forms are :mod:`mlwe.store.codec`.
Every write takes an optional ``conn`` (the caller's transaction) and is
idempotent: workloads are keyed by id, transitions by (workload, step),
decisions by sequence number, so a transaction retried after a commit whose
outcome was unknown stores nothing twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, func, select, update

from mlwe.core.catalog import GpuCatalog
from mlwe.core.decisions import DecisionRecord
from mlwe.core.lifecycle import State, Transition
from mlwe.core.model import Workload
from mlwe.store import schema as S
from mlwe.store.codec import (
    MUTABLE,
    SpecReader,
    decision_from_row,
    histories,
    mutable_values,
    raw_record,
    transition_row,
    workload_from_row,
)
from mlwe.store.db import Transactions
from mlwe.store.rows import CHUNK, CorruptRecord, Encoder, clip, insert_ignore

__all__ = ["WORKLOAD_COLUMNS", "Decisions", "Workloads"]

_w = S.workloads
#: The columns of a workload row, in the order :func:`~mlwe.store.codec.workload_from_row` reads.
WORKLOAD_COLUMNS = (
    _w.c.id, _w.c.seq, _w.c.spec, _w.c.submit_time, _w.c.deadline, _w.c.state, _w.c.attempt,
    _w.c.failures, _w.c.work_done, _w.c.progress, _w.c.priority_override, _w.c.placement,
    _w.c.started_at, _w.c.failure_cause, _w.c.run_base_work, _w.c.last_checkpoint_at,
    _w.c.preempted_by, _w.c.victims, _w.c.preemptions, _w.c.borrowing, _w.c.pending_reason,
    _w.c.exit_code,
)  # fmt: skip
_t = S.transitions
#: The columns of a transition row, in the order :func:`~mlwe.store.codec.histories` reads.
_TRANSITION_COLUMNS = (
    _t.c.workload_id, _t.c.step, _t.c.time, _t.c.source, _t.c.target, _t.c.reason, _t.c.cause_id
)


class Workloads:
    """Tables ``workloads`` and ``transitions`` (``context``: how stored specs are validated)."""

    def __init__(self, tx: Transactions, encode: Encoder, context: dict[str, Any]) -> None:
        self.tx = tx
        self.encode = encode
        self.ctx = context

    def _full_row(self, w: Workload, version: int, correlation_id: str | None) -> dict[str, Any]:
        row = {
            "id": w.id,
            "seq": w.seq,
            "spec": self.encode(w.spec.model_dump(mode="json")),
            "submit_time": w.submit_time,
            "deadline": w.deadline,
            "correlation_id": clip(correlation_id, 256),
        }
        row.update(mutable_values(w, version))
        return row

    def insert_workloads(
        self,
        workloads: Sequence[Workload],
        correlation_id: str | None = None,
        *,
        version: int = 0,
        with_history: bool = True,
        conn: Connection | None = None,
    ) -> None:
        """Store new workloads with their history, in one transaction.

        This is the durable half of a submission: acknowledge only after it
        returns. A workload already stored (same id) is left as it is, so a
        batch retried after an uncertain commit is harmless.
        ``correlation_id`` defaults to the cause of each workload's first transition.
        """
        rows = []
        trs: list[dict[str, Any]] = []
        for w in workloads:
            cid = correlation_id
            if cid is None and w.history:
                cid = w.history[0].cause_id
            rows.append(self._full_row(w, version, cid))
            if with_history:
                trs.extend(transition_row(w.id, i, tr) for i, tr in enumerate(w.history))

        def go(c: Connection) -> None:
            insert_ignore(c, S.workloads, ["id"], rows)
            insert_ignore(c, S.transitions, ["workload_id", "step"], trs)

        self.tx.write(go, conn)

    def update_specs(
        self, workloads: Sequence[Workload], *, conn: Connection | None = None
    ) -> None:
        """Rewrite the stored spec of workloads whose request changed (``SetResources``)."""
        if not workloads:
            return
        rows = [
            {"b_id": w.id, "b_spec": self.encode(w.spec.model_dump(mode="json"))} for w in workloads
        ]
        stmt = (
            update(S.workloads)
            .where(S.workloads.c.id == bindparam("b_id"))
            .values(spec=bindparam("b_spec"))
        )
        self.tx.write(lambda c: c.execute(stmt, rows), conn)

    def save_workload_states(
        self, workloads: Sequence[Workload], version: int, *, conn: Connection | None = None
    ) -> None:
        """Update the mutable columns (state, placement, counters...) of stored workloads.

        A workload that is not stored yet is inserted whole (without history:
        transitions are written by :meth:`append_transitions`).
        """
        if not workloads:
            return
        # bind names must differ from column names in an UPDATE ... SET
        rows = []
        for w in workloads:
            r = {f"b_{k}": v for k, v in mutable_values(w, version).items()}
            r["b_id"] = w.id
            rows.append(r)
        stmt = (
            update(S.workloads)
            .where(S.workloads.c.id == bindparam("b_id"))
            .values({c: bindparam(f"b_{c}") for c in MUTABLE})
        )
        by_id = {w.id: w for w in workloads}

        def go(c: Connection) -> None:
            res = c.execute(stmt, rows)
            if res.rowcount != len(rows) or not self.tx.engine.dialect.supports_sane_multi_rowcount:
                stored: set[str] = set()
                ids = list(by_id)
                for i in range(0, len(ids), CHUNK):
                    stored.update(
                        c.execute(
                            select(S.workloads.c.id).where(
                                S.workloads.c.id.in_(ids[i : i + CHUNK])
                            )
                        ).scalars()
                    )
                missing = [by_id[i] for i in ids if i not in stored]
                insert_ignore(
                    c,
                    S.workloads,
                    ["id"],
                    [
                        self._full_row(w, version, w.history[0].cause_id if w.history else None)
                        for w in missing
                    ],
                )

        self.tx.write(go, conn)

    def append_transitions(
        self,
        rows: Iterable[tuple[str, Transition] | tuple[str, int, Transition]],
        *,
        conn: Connection | None = None,
    ) -> None:
        """Append lifecycle transitions, each ``(workload_id, step, transition)``.

        ``step`` is the transition's position in the workload's history (0 for
        its submission); a row already stored at that step is left as it is.

        Rows may also be given as ``(workload_id, transition)``: they go after
        the workload's last stored step, in order, except that a leading run
        equal to the end of the stored history is recognised as already stored
        (so writing a new workload with its history through
        :meth:`insert_workloads` and then appending the same transitions in
        the same transaction stores them once). No legal history repeats a
        transition immediately, so this never drops a real one.
        """
        explicit: list[dict[str, Any]] = []
        implicit: dict[str, list[Transition]] = {}
        for r in rows:
            if len(r) == 3:
                explicit.append(transition_row(r[0], r[1], r[2]))
            else:
                implicit.setdefault(r[0], []).append(r[1])

        def go(c: Connection) -> None:
            out = list(explicit)
            if implicit:
                out += self._place_implicit(c, implicit, explicit)
            insert_ignore(c, S.transitions, ["workload_id", "step"], out)

        self.tx.write(go, conn)

    @staticmethod
    def _place_implicit(
        c: Connection, implicit: dict[str, list[Transition]], explicit: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        t = S.transitions
        ids = sorted(implicit)
        stored: dict[str, dict[int, tuple[Any, ...]]] = {}
        for i in range(0, len(ids), CHUNK):
            q = select(*_TRANSITION_COLUMNS).where(t.c.workload_id.in_(ids[i : i + CHUNK]))
            found: Any = c.execute(q)
            for wid, step, *rest in found:
                stored.setdefault(wid, {})[step] = tuple(rest)
        for row in explicit:
            if row["workload_id"] in implicit:
                stored.setdefault(row["workload_id"], {}).setdefault(
                    row["step"],
                    (row["time"], row["source"], row["target"], row["reason"], row["cause_id"]),
                )
        out = []
        for wid in ids:
            trs = implicit[wid]
            have = stored.get(wid, {})
            hist = [have[k] for k in sorted(have)]
            nxt = max(have) + 1 if have else 0
            keys = [
                (
                    tr.time,
                    tr.source.value if tr.source is not None else None,
                    tr.target.value,
                    tr.reason,
                    clip(tr.cause_id, 256),
                )
                for tr in trs
            ]
            overlap = 0
            for k in range(min(len(keys), len(hist)), 0, -1):
                if keys[:k] == hist[len(hist) - k :]:
                    overlap = k
                    break
            for j, tr in enumerate(trs[overlap:]):
                out.append(transition_row(wid, nxt + j, tr))
        return out

    def load_workloads(
        self,
        *,
        states: Iterable[State] | None = None,
        catalog: GpuCatalog | None = None,
        corrupt: list[tuple[CorruptRecord, dict[str, Any]]] | None = None,
    ) -> list[Workload]:
        """Every stored workload (or those in ``states``), complete: spec, history, placement.

        In arrival order (``seq``). Raises :class:`CorruptRecord` naming the
        workload and column of the first row that cannot be read back, unless
        ``corrupt`` is given: then such rows are left out and each is appended
        to it with its raw record (the row and its transitions), for quarantine.
        """
        w = S.workloads
        cols = WORKLOAD_COLUMNS
        t = S.transitions
        wanted = None if states is None else sorted(State(s).value for s in states)

        def fetch(c: Connection) -> tuple[Any, Any]:
            q = select(*cols).order_by(w.c.seq)
            tq = select(*_TRANSITION_COLUMNS).order_by(t.c.id)
            if wanted is not None:
                q = q.where(w.c.state.in_(wanted))
                tq = tq.where(t.c.workload_id.in_(select(w.c.id).where(w.c.state.in_(wanted))))
            return c.execute(q).all(), c.execute(tq).all()

        rows, trows = self.tx.read(fetch)
        reader = SpecReader(self.ctx if catalog is None else {"catalog": catalog})
        if corrupt is None:
            hist = histories(trows)
            return [workload_from_row(r, hist.get(r[0], []), reader) for r in rows]
        bad: dict[str, CorruptRecord] = {}
        hist = histories(trows, bad)
        out: list[Workload] = []
        for r in rows:
            problem = bad.get(r[0])
            if problem is None:
                try:
                    out.append(workload_from_row(r, hist.get(r[0], []), reader))
                    continue
                except CorruptRecord as exc:
                    problem = exc
            corrupt.append((problem, raw_record(r, cols, trows)))
        return out

    def workload(self, workload_id: str) -> Workload | None:
        """One stored workload with its history, or None."""
        w = S.workloads
        t = S.transitions

        def fetch(c: Connection) -> tuple[Any, Any]:
            row = c.execute(select(*WORKLOAD_COLUMNS).where(w.c.id == workload_id)).first()
            trs = c.execute(
                select(*_TRANSITION_COLUMNS)
                .where(t.c.workload_id == workload_id)
                .order_by(t.c.step)
            ).all()
            return row, trs

        row, trs = self.tx.read(fetch)
        if row is None:
            return None
        return workload_from_row(row, histories(trs).get(workload_id, []), SpecReader(self.ctx))

    def history(self, workload_id: str) -> list[Transition]:
        t = S.transitions
        trs = self.tx.read(
            lambda c: c.execute(
                select(*_TRANSITION_COLUMNS)
                .where(t.c.workload_id == workload_id)
                .order_by(t.c.step)
            ).all()
        )
        return histories(trs).get(workload_id, [])

    def workload_correlation(self, workload_id: str) -> str | None:
        return self.tx.read(
            lambda c: c.execute(
                select(S.workloads.c.correlation_id).where(S.workloads.c.id == workload_id)
            ).scalar()
        )

    def count_workloads(self) -> int:
        count = select(func.count()).select_from(S.workloads)
        return int(self.tx.read(lambda c: c.execute(count).scalar()) or 0)


class Decisions:
    """Table ``decisions``: the control plane's decision records, keyed by sequence number."""

    def __init__(self, tx: Transactions, encode: Encoder) -> None:
        self.tx = tx
        self.encode = encode

    def append_decisions(
        self, records: Iterable[DecisionRecord], *, conn: Connection | None = None
    ) -> None:
        """Store decision records (keyed by their sequence number; a repeat is ignored)."""
        rows = [
            {
                "seq": r.seq,
                "time": r.time,
                "kind": clip(r.kind, 32),
                "workload": clip(r.workload, 128),
                "cause_id": clip(r.cause_id, 256),
                "record": self.encode(r.to_dict()),
            }
            for r in records
        ]
        self.tx.write(lambda c: insert_ignore(c, S.decisions, ["seq"], rows), conn)

    def decisions_for(
        self, workload: str | None = None, cause_id: str | None = None, *, limit: int | None = None
    ) -> list[DecisionRecord]:
        """Decision records about ``workload`` and/or caused by ``cause_id``, oldest first."""
        d = S.decisions
        q = select(d.c.seq, d.c.time, d.c.record).order_by(d.c.seq)
        if workload is not None:
            q = q.where(d.c.workload == workload)
        if cause_id is not None:
            q = q.where(d.c.cause_id == cause_id)
        if limit is not None:
            q = q.limit(limit)
        rows: Any = self.tx.read(lambda c: c.execute(q).all())
        out = []
        for seq, time, text in rows:
            try:
                out.append(decision_from_row(seq, time, text))
            except (ValueError, KeyError, TypeError) as exc:
                raise CorruptRecord("decision", seq, "record", str(exc)) from exc
        return out

    def max_decision_seq(self) -> int:
        return int(
            self.tx.read(lambda c: c.execute(select(func.max(S.decisions.c.seq))).scalar()) or 0
        )
