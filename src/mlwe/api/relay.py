"""The scheduler's reasoning, on the reasoning stream.

When the scheduler preempts, its decision record already holds a reasoning
trace: what it could not fit (the finding), the victim sets it weighed (the
options), the one it chose and why, and the control plane's verdict. This
relay turns each durable ``preempt`` decision (read from the audit stream, so
it is published only after it is stored) into a trace on the ``reasoning``
topic, labelled ``source: scheduler``, next to the agent's own traces. It is
not stored a second time: the audit record is the durable copy. It also
writes one ``mlwe.decision`` log line per decision (of every kind).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from mlwe.runtime.engine import Engine
from mlwe.runtime.streams import StreamEvent

log = logging.getLogger("mlwe.api.relay")

RELAYED_KINDS = frozenset({"preempt"})


def trace_of(ev: StreamEvent) -> dict[str, Any] | None:
    """The reasoning trace of an audit event about a relayed decision, else None."""
    data = ev.data
    payload = data.get("payload")
    if data.get("kind") != "decision" or not isinstance(payload, dict):
        return None
    trace = trace_of_decision(payload)
    if trace is not None:
        trace["audit_seq"] = data.get("seq")
    return trace


def trace_of_decision(payload: dict[str, Any]) -> dict[str, Any] | None:
    """The reasoning trace of a decision record (``DecisionRecord.to_dict()``), if relayed."""
    if payload.get("kind") not in RELAYED_KINDS:
        return None
    preemptor = str(payload.get("workload", ""))
    chosen = str(payload.get("chosen", ""))
    victims = [v.strip() for v in chosen.removeprefix("evict ").split(",") if v.strip()]
    reasons = [str(r) for r in payload.get("reasons", [])]
    return {
        "source": "scheduler",
        "title": f"preempt to place {preemptor}",
        "workload": preemptor,
        "workloads": [preemptor, *victims],
        "victims": victims,
        "findings": [f"{preemptor} cannot be placed on free capacity"],
        "options": [str(c) for c in payload.get("candidates", [])] or ["wait for capacity"],
        "choice": chosen,
        "why": reasons,
        "verdict": f"applied by the control plane at version {payload.get('version')}",
        "policy": payload.get("policy"),
        "decision_seq": payload.get("seq"),
    }


decision_log = logging.getLogger("mlwe.decision")


def log_decision(ev: StreamEvent) -> None:
    """One ``mlwe.decision`` log line per durable scheduling decision (audit kind ``decision``)."""
    data = ev.data
    p = data.get("payload")
    if data.get("kind") != "decision" or not isinstance(p, dict) or not decision_log.isEnabledFor(logging.INFO):
        return
    reasons = [str(r) for r in p.get("reasons", [])]
    decision_log.info(
        "%s %s: %s", p.get("kind"), p.get("workload"), p.get("chosen"),
        extra={"decision": p.get("kind"), "workload": p.get("workload"), "policy": p.get("policy"),
               "chosen": p.get("chosen"), "version": p.get("version"), "reasons": reasons[:5],
               "correlation_id": ev.correlation_id, "audit_seq": data.get("seq")},
    )


class DecisionRelay:
    """A daemon thread reading the audit stream and publishing scheduler traces."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sub = engine.streams.subscribe(["audit"], buffer=10_000)
        self.relayed = 0
        self._thread = threading.Thread(target=self._run, name="mlwe-decision-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sub = self.sub
        while not sub.closed:
            events, _ = sub.get(timeout=1.0)
            for ev in events:
                try:
                    log_decision(ev)
                    trace = trace_of(ev)
                    if trace is not None:
                        self.engine.streams.publish(
                            "reasoning", trace, correlation_id=ev.correlation_id,
                            workload=trace["workload"], time=ev.time,
                        )
                        self.relayed += 1
                except Exception:  # one odd record must not end the relay
                    log.exception("relaying a decision failed")

    def close(self) -> None:
        self.sub.close()
        self._thread.join(timeout=5)
