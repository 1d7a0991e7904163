"""The LocalBackend's handling of what daemons send: replica facts, reports, telemetry.

``started``, ``exited`` and reports are acknowledged (the daemon re-sends them
until they are) and move their replica and attempt on; replica 0's progress
becomes ``Progress``; reports and the daemons' samples become telemetry.
"""

from __future__ import annotations

from typing import Any

from mlwe.backends.local.attempts import _Attempts
from mlwe.backends.local.engine_state import _Attempt, _Replica
from mlwe.backends.local.link import _Daemon
from mlwe.backends.local.protocol import finite_metrics, is_fraction
from mlwe.core.actions import Progress, Started
from mlwe.core.backend import Telemetry


class _Messages(_Attempts):
    """One daemon message at a time, under the backend's lock."""

    def _ack(self, d: _Daemon, msg: dict[str, Any]) -> None:
        seq = msg.get("seq")
        if isinstance(seq, int):
            d.send({"type": "ack", "upto": seq})

    def _replica_of(self, msg: dict[str, Any]) -> tuple[_Attempt, _Replica] | None:
        try:
            key = (str(msg["workload"]), int(msg["attempt"]))
            index = int(msg.get("replica", 0))
        except (KeyError, TypeError, ValueError):
            return None
        att = self._attempts.get(key)
        if att is None:
            return None
        r = att.replicas.get(index)
        return None if r is None else (att, r)

    def _on_message(self, d: _Daemon, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "hb":
            return
        if kind == "telemetry":
            self._on_telemetry(msg)
            return
        if kind in ("started", "exited", "report"):
            found = self._replica_of(msg)
            if kind != "report" or "seq" in msg:
                self._ack(d, msg)
            if found is None:
                if kind == "started":
                    self._error(f"{d.describe()}: started {msg.get('workload')} attempt"
                                f" {msg.get('attempt')}, which this engine never started")
                return
            att, r = found
            if kind == "started":
                self._on_started(d, att, r)
            elif kind == "exited":
                self._on_exited(att, r, msg)
            else:
                self._on_report(att, r, msg)
            return
        if kind == "error":
            self._error(f"{d.describe()}: {msg.get('message')}")
            return
        if kind == "bye":
            reason = str(msg.get("reason", "shut down"))
            for name in d.nodes:
                node = self._nodes.get(name)
                if node is not None and node.daemon is d:
                    self._node_down(name, f"{d.describe()} left: {reason}")
            d.nodes = []
            return
        self._error(f"{d.describe()}: unknown message type {kind!r}")

    def _on_started(self, d: _Daemon, att: _Attempt, r: _Replica) -> None:
        if att.final:
            if att.lost:  # it was declared lost meanwhile: end the stale run
                d.send({"type": "stop", "request_id": f"stale:{att.workload}:{att.attempt}",
                        "workload": att.workload, "attempt": att.attempt, "grace_s": 0.0,
                        "replicas": [r.index]})
            return
        if r.state in ("queued", "sent"):
            r.state = "running"
        r.ever_started = True
        if not att.started_emitted and all(x.ever_started for x in att.replicas.values()):
            att.started_emitted = True
            self._emit(Started(att.workload, att.attempt), att.correlation_id)
            if att.pending_progress is not None:
                p, ck = att.pending_progress
                att.pending_progress = None
                self._progress(att, p, ck)

    def _on_exited(self, att: _Attempt, r: _Replica, msg: dict[str, Any]) -> None:
        if r.state == "gone":
            return
        r.state = "gone"
        code = msg.get("code")
        r.code = code if isinstance(code, int) else None
        r.cause = str(msg.get("cause") or "")
        t = msg.get("term_to_exit_s")
        r.term_to_exit_s = float(t) if isinstance(t, int | float) else None
        if r.index == 0 and is_fraction(msg.get("checkpoint")):
            att.checkpoint = float(msg["checkpoint"])
        if att.failure is None and not att.stop_requested and (r.code != 0 or r.cause):
            att.failure = r
        self._settle(att)

    def _progress(self, att: _Attempt, p: float, checkpointed: bool) -> None:
        if not checkpointed and att.last_progress is not None and p == att.last_progress:
            return
        att.last_progress = p
        self._emit(Progress(att.workload, att.attempt, p, checkpointed=checkpointed),
                   att.correlation_id)

    def _on_report(self, att: _Attempt, r: _Replica, msg: dict[str, Any]) -> None:
        data = msg.get("data")
        if not isinstance(data, dict):
            return
        p = data.get("progress")
        ckpt = bool(data.get("checkpoint"))
        if r.index == 0 and is_fraction(p):
            if ckpt:
                att.checkpoint = float(p)
            if not att.final:
                if att.started_emitted:
                    self._progress(att, float(p), ckpt)
                elif att.pending_progress is None or ckpt or not att.pending_progress[1]:
                    att.pending_progress = (float(p), ckpt)
        metrics = finite_metrics(data.get("metrics"))
        for k in ("loss", "step", "progress"):
            v = data.get(k)
            if isinstance(v, int | float) and not isinstance(v, bool):
                metrics[k] = float(v)
        if ckpt:
            metrics["checkpoint"] = 1.0
        if metrics:
            metrics["replica"] = float(r.index)
            metrics["attempt"] = float(att.attempt)
            self._telemetry.append(Telemetry(self.clock.now(), r.node, att.workload, metrics))

    def _on_telemetry(self, msg: dict[str, Any]) -> None:
        samples = msg.get("samples")
        if not isinstance(samples, list):
            return
        now = self.clock.now()
        for s in samples:
            if not isinstance(s, dict) or not isinstance(s.get("node"), str):
                continue
            wid = s.get("workload")
            declared = s.get("declared") or ()
            self._telemetry.append(Telemetry(
                now, s["node"], wid if isinstance(wid, str) else None,
                finite_metrics(s.get("metrics")),
                tuple(str(x) for x in declared) if isinstance(declared, list) else (),
            ))
