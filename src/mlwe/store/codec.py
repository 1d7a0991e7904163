"""Row forms of the control plane's state, and reading them back validated.

A :class:`~mlwe.core.model.Workload` is one ``workloads`` row (identity, spec and the
mutable columns of :func:`mutable_values`, with its placement and victims as JSON)
and one ``transitions`` row per step of its history (:func:`transition_row`); a
:class:`~mlwe.core.decisions.DecisionRecord` is one ``decisions`` row. Reading back
raises :class:`~mlwe.store.rows.CorruptRecord` naming the row and column that
cannot be read; :class:`SpecReader` validates stored specs (once per template).
The SQL that writes and reads these rows is :mod:`mlwe.store.state`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from mlwe.core.capacity import ReplicaAlloc
from mlwe.core.decisions import DecisionRecord
from mlwe.core.lifecycle import State, Transition
from mlwe.core.model import Workload
from mlwe.core.resources import Resources
from mlwe.core.spec import WorkloadSpec
from mlwe.store.rows import CorruptRecord, canonical_json, clip

__all__ = [
    "MUTABLE",
    "SpecReader",
    "decision_from_row",
    "histories",
    "mutable_values",
    "placement_from_json",
    "placement_to_json",
    "raw_record",
    "transition_row",
    "victims_from_json",
    "victims_to_json",
    "workload_from_row",
]

def placement_to_json(placement: Sequence[ReplicaAlloc]) -> str:
    if not placement:
        return "[]"
    return canonical_json(
        [
            {
                "node": a.node,
                "devices": list(a.devices),
                "gpu_per_device": a.gpu_per_device,
                "res": {"gpu": a.res.gpu, "vram": a.res.vram, "cpu": a.res.cpu, "ram": a.res.ram},
            }
            for a in placement
        ]
    )


def _int(v: object, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{what} is {v!r}, not an integer")
    return v


def placement_from_json(text: str) -> tuple[ReplicaAlloc, ...]:
    if text == "[]":
        return ()
    items = json.loads(text)
    if not isinstance(items, list):
        raise ValueError("placement is not a JSON list")
    out = []
    for k, it in enumerate(items):
        if not isinstance(it, dict) or not isinstance(it.get("node"), str):
            raise ValueError(f"replica {k}: not an allocation object with a node")
        res = it.get("res")
        if not isinstance(res, dict):
            raise ValueError(f"replica {k}: no resource vector")
        devices = it.get("devices")
        if not isinstance(devices, list):
            raise ValueError(f"replica {k}: devices is not a list")
        out.append(
            ReplicaAlloc(
                node=it["node"],
                devices=tuple(_int(d, f"replica {k} device") for d in devices),
                gpu_per_device=_int(it.get("gpu_per_device"), f"replica {k} gpu_per_device"),
                res=Resources(
                    *(_int(res.get(n), f"replica {k} {n}") for n in ("gpu", "vram", "cpu", "ram"))
                ),
            )
        )
    return tuple(out)


def victims_to_json(victims: Sequence[str]) -> str:
    return canonical_json(list(victims)) if victims else "[]"


def victims_from_json(text: str) -> tuple[str, ...]:
    if text == "[]":
        return ()
    v = json.loads(text)
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("victims is not a JSON list of workload ids")
    return tuple(v)


def decision_from_row(seq: int, time: float, text: str) -> DecisionRecord:
    d = json.loads(text)
    return DecisionRecord(
        kind=d["kind"],
        workload=d["workload"],
        policy=d["policy"],
        chosen=d["chosen"],
        reasons=tuple(d.get("reasons", ())),
        candidates=tuple(d.get("candidates", ())),
        inputs_digest=d.get("inputs_digest", ""),
        cause_id=d.get("cause_id"),
        time=time,
        version=d.get("version", 0),
        seq=seq,
        extra=d.get("extra", {}),
    )


#: Mutable columns of a workload row (everything but the identity and the spec).
MUTABLE = (
    "state",
    "attempt",
    "failures",
    "work_done",
    "progress",
    "priority_override",
    "placement",
    "started_at",
    "failure_cause",
    "updated_version",
    "run_base_work",
    "last_checkpoint_at",
    "preempted_by",
    "victims",
    "preemptions",
    "borrowing",
    "pending_reason",
    "exit_code",
)


def mutable_values(w: Workload, version: int) -> dict[str, Any]:
    """The columns of a workload row that change as it goes through its lifecycle."""
    return {
        "state": w.state.value,
        "attempt": w.attempt,
        "failures": w.failures,
        "work_done": w.work_done,
        "progress": w.progress,
        "priority_override": w.priority_override,
        "placement": placement_to_json(w.placement),
        "started_at": w.started_at,
        "failure_cause": clip(w.failure_cause, 64),
        "updated_version": version,
        "run_base_work": w.run_base_work,
        "last_checkpoint_at": w.last_checkpoint_at,
        "preempted_by": w.preempted_by,
        "victims": victims_to_json(w.victims),
        "preemptions": w.preemptions,
        "borrowing": w.borrowing,
        "pending_reason": w.pending_reason,
        "exit_code": w.exit_code,
    }


def transition_row(workload_id: str, step: int, tr: Transition) -> dict[str, Any]:
    """A transitions row: the ``step``-th transition of the workload's history."""
    return {
        "workload_id": workload_id,
        "step": step,
        "time": tr.time,
        "source": tr.source.value if tr.source is not None else None,
        "target": tr.target.value,
        "reason": tr.reason,
        # ids come from outside (event ids); an overlong one must not make the write fail
        "cause_id": clip(tr.cause_id, 256),
    }


def _json_string(token: str) -> Any:
    """A JSON string (or null) token's value; without escapes it is just the inside."""
    if token == "null":
        return None
    return token[1:-1] if "\\" not in token else json.loads(token)


class SpecReader:
    """Reads stored WorkloadSpec JSON, validating every spec.

    Specs that differ only in ``id`` and ``name`` (jobs submitted from one
    template) are validated once: later ones are copies of the validated one
    with their own id and name, which get the same checks as in
    ``WorkloadSpec`` (an id of letters, digits, ``._-``; a name of 1-200
    printable characters; anything else goes through full validation, which
    reports it). Validation is most of the cost of recovery, so this matters
    at 100,000 workloads. The id and name are found by their neighbours in the
    canonical (sorted-key) text; if the spec's fields ever change so that the
    pattern does not match, every spec is simply validated in full.
    """

    _ID = re.compile(r'"id":(null|"(?:[^"\\]|\\.)*"),"kind":')
    _NAME = re.compile(r'"min_vram_per_gpu":\d+,"name":("(?:[^"\\]|\\.)*"),"node_selector":')
    _ID_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
    _CONTROL = re.compile(r"[\x00-\x1f\x7f]")

    def __init__(self, context: dict[str, Any], max_templates: int = 200_000) -> None:
        self._ctx = context
        self._templates: dict[str, WorkloadSpec] = {}
        self._max = max_templates
        self.validated = 0

    def _full(self, text: str) -> WorkloadSpec:
        self.validated += 1
        return WorkloadSpec.model_validate_json(text, context=self._ctx)

    def read(self, text: str) -> WorkloadSpec:
        mi = self._ID.search(text)
        mn = self._NAME.search(text) if mi is not None else None
        if mi is None or mn is None or mi.end(1) > mn.start(1):
            return self._full(text)
        key = text[: mi.start(1)] + text[mi.end(1) : mn.start(1)] + text[mn.end(1) :]
        tpl = self._templates.get(key)
        if tpl is None:
            spec = self._full(text)
            if len(self._templates) < self._max:
                self._templates[key] = spec
            return spec
        ident = _json_string(mi.group(1))
        name = _json_string(mn.group(1))
        if (
            (ident is not None and not (isinstance(ident, str) and self._ID_OK.fullmatch(ident)))
            or not isinstance(name, str)
            or not 0 < len(name) <= 200
            or self._CONTROL.search(name)
        ):
            return self._full(text)  # raises, naming the field
        return tpl.model_copy(update={"id": ident, "name": name})



def raw_record(r: Any, cols: Sequence[Any], trows: Sequence[Any]) -> dict[str, Any]:
    """A stored row as plain JSON values, with its transitions (for quarantine)."""
    wid = r[0]
    return {
        "row": {c.name: v for c, v in zip(cols, r)},
        "transitions": [
            {"step": t[1], "time": t[2], "source": t[3], "target": t[4], "reason": t[5],
             "cause_id": t[6]}
            for t in trows if t[0] == wid
        ],
    }


def histories(
    trows: Iterable[Any], bad: dict[str, CorruptRecord] | None = None
) -> dict[str, list[Transition]]:
    """Transitions grouped by workload, in step order; a gap in the steps is corruption
    (raised, or with ``bad`` given, noted there by workload)."""
    if bad is not None:
        try:
            return histories(trows)
        except CorruptRecord:
            pass
        by: dict[str, list[Any]] = {}
        for t in trows:
            by.setdefault(t[0], []).append(t)
        good: dict[str, list[Transition]] = {}
        for wid, ts in by.items():
            try:
                good.update(histories(ts))
            except CorruptRecord as exc:
                bad[wid] = exc
        return good
    states = {s.value: s for s in State}
    out: dict[str, list[Transition]] = {}
    # workloads whose rows did not arrive as steps 0, 1, 2, ...: (step, transition) pairs
    unordered: dict[str, list[tuple[int, Transition]]] = {}
    for wid, step, time, source, target, reason, cause in trows:
        try:
            tr = Transition(
                time, None if source is None else states[source], states[target], reason, cause
            )
        except KeyError as exc:
            raise CorruptRecord(
                "workload", wid, "transitions", f"unknown state {exc.args[0]!r} at step {step}"
            ) from None
        lst = out.get(wid)
        if lst is None:
            lst = out[wid] = []
        pairs = unordered.get(wid)
        if pairs is not None:
            pairs.append((step, tr))
        elif step != len(lst):
            unordered[wid] = [*enumerate(lst), (step, tr)]
        else:
            lst.append(tr)
    for wid, pairs in unordered.items():
        pairs.sort(key=lambda p: p[0])
        for i, (s, _) in enumerate(pairs):
            if s != i:
                raise CorruptRecord(
                    "workload", wid, "transitions", f"history has no step {i} (found {s})"
                )
        out[wid] = [tr for _, tr in pairs]
    return out


def workload_from_row(r: Any, history: list[Transition], reader: SpecReader) -> Workload:
    """A workload from its row (the columns of ``state.WORKLOAD_COLUMNS``) and history."""
    (wid, seq, spec_text, submit_time, deadline, state, attempt, failures, work_done, progress,
     prio, placement, started_at, failure_cause, run_base_work, last_ckpt, preempted_by,
     victims, preemptions, borrowing, pending_reason, exit_code) = r  # fmt: skip
    try:
        spec = reader.read(spec_text)
    except ValueError as exc:
        raise CorruptRecord("workload", wid, "spec", str(exc)) from exc
    try:
        st = State(state)
    except ValueError:
        raise CorruptRecord("workload", wid, "state", f"unknown state {state!r}") from None
    try:
        alloc = placement_from_json(placement)
    except ValueError as exc:
        raise CorruptRecord("workload", wid, "placement", str(exc)) from exc
    try:
        vic = victims_from_json(victims)
    except ValueError as exc:
        raise CorruptRecord("workload", wid, "victims", str(exc)) from exc
    return Workload(
        id=wid,
        spec=spec,
        seq=seq,
        submit_time=submit_time,
        deadline=deadline,
        state=st,
        history=history,
        placement=alloc,
        attempt=attempt,
        failures=failures,
        started_at=started_at,
        work_done=work_done,
        run_base_work=run_base_work,
        progress=progress,
        last_checkpoint_at=last_ckpt,
        preempted_by=preempted_by,
        victims=vic,
        preemptions=preemptions,
        borrowing=bool(borrowing),
        pending_reason=pending_reason,
        exit_code=exit_code,
        failure_cause=failure_cause,
        priority_override=prio,
    )
