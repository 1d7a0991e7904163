"""The LocalBackend's attempts: commands out as per-replica messages, facts back.

A start becomes one message per replica (queued while its node has no
daemon); a stop, one per live replica. Replica states are aggregated into the
attempt's fact (``Released``, ``Exited``; a failed gang's other replicas are
force-stopped first). A node whose daemon misses its heartbeats (or never
registers) is ``NodeDown``, and the attempts that had a replica there are lost
with it.
"""

from __future__ import annotations

import contextlib
import logging
import time

from mlwe.backends.local.engine_state import _Attempt, _LocalState, _Node, _Replica, log
from mlwe.core.actions import Exited, Released
from mlwe.core.backend import NodeDown, StartCommand, StopCommand


class _Attempts(_LocalState):
    """Sending the engine's commands and settling each attempt's end; node loss."""

    def _start(self, c: StartCommand) -> None:
        key = (c.workload, c.attempt)
        if key in self._attempts:
            return
        spec = c.spec
        att = _Attempt(c.workload, c.attempt, c.correlation_id, {})
        ckpt = str(self.checkpoint_root / c.workload) if self.checkpoint_root else None
        for i, alloc in enumerate(c.placement):
            msg = {
                "type": "start", "request_id": c.request_id, "workload": c.workload,
                "attempt": c.attempt, "replica": i, "replicas": len(c.placement),
                "node": alloc.node, "devices": list(alloc.devices), "gpu_milli": alloc.res.gpu,
                "vram_mib": alloc.res.vram, "cpu_milli": alloc.res.cpu,
                "memory_mib": alloc.res.ram, "command": list(spec.command),
                "env": dict(spec.env), "checkpoint_dir": ckpt,
                "resume_work_s": c.resume_work_s, "correlation_id": c.correlation_id,
            }
            att.replicas[i] = _Replica(i, alloc.node, msg)
        self._attempts[key] = att
        for r in att.replicas.values():
            self._dispatch(att, r)

    def _dispatch(self, att: _Attempt, r: _Replica) -> None:
        node = self._nodes.get(r.node)
        if node is None:
            node = self._nodes[r.node] = _Node(r.node, None)
        if node.down:
            # the control plane learns (or learnt) of the loss through NodeDown and
            # fails the attempt itself; nothing runs, nothing to report
            att.final = att.lost = True
            return
        d = node.daemon
        if d is not None and d.connected and d.send(r.msg):
            r.state = "sent"
        else:
            node.queued.append((att.key, r.index))

    def _stop(self, c: StopCommand) -> None:
        att = self._attempts.get((c.workload, c.attempt))
        if att is None:
            # never started here: nothing holds resources
            self._emit(Released(c.workload, c.attempt), c.correlation_id)
            return
        if att.final:
            return  # its terminal fact is already out
        att.stop_requested = True
        att.grace_s = c.grace_s
        for r in att.replicas.values():
            if r.state == "queued":
                node = self._nodes[r.node]
                with contextlib.suppress(ValueError):
                    node.queued.remove((att.key, r.index))
                r.state, r.cause = "gone", "never started"
            elif r.state in ("sent", "running"):
                self._send_stop(att, r, c.grace_s, c.request_id)
        self._settle(att)

    def _send_stop(self, att: _Attempt, r: _Replica, grace: float, request_id: str) -> None:
        node = self._nodes.get(r.node)
        d = node.daemon if node is not None else None
        msg = {"type": "stop", "request_id": request_id, "workload": att.workload,
               "attempt": att.attempt, "grace_s": grace, "replicas": [r.index], "node": r.node}
        r.stop_sent = d is not None and d.connected and d.send(msg)

    def _settle(self, att: _Attempt) -> None:
        if att.final:
            return
        live = [r for r in att.replicas.values() if r.state != "gone"]
        if att.stop_requested:
            if not live:
                att.final = True
                self._emit(
                    Released(att.workload, att.attempt, checkpointed_progress=att.checkpoint),
                    att.correlation_id,
                )
            return
        if att.failure is not None and live and not att.killing:
            att.killing = True  # a failed gang: the others would only hang
            for r in live:
                if r.state in ("sent", "running"):
                    self._send_stop(att, r, 0.0, f"gang-failed:{att.workload}:{att.attempt}")
                elif r.state == "queued":
                    node = self._nodes[r.node]
                    with contextlib.suppress(ValueError):
                        node.queued.remove((att.key, r.index))
                    r.state = "gone"
            live = [r for r in att.replicas.values() if r.state != "gone"]
        if live:
            return
        att.final = True
        if att.failure is not None:
            f = att.failure
            cause, code = f.cause or "error", f.code if f.code is not None else -1
            if f.cause == "daemon-shutdown":
                # its machine left the cluster (whatever the program's exit code after
                # its checkpoint): not the workload's fault, like a lost node
                cause, code = "node-lost", -1
            self._emit(Exited(att.workload, att.attempt, code, cause), att.correlation_id)
        else:
            self._emit(Exited(att.workload, att.attempt, 0), att.correlation_id)

    def _node_down(self, name: str, reason: str) -> None:
        node = self._nodes.get(name)
        if node is None or node.down:
            return
        node.down = True
        node.daemon = None
        node.queued.clear()
        log.log(logging.INFO if self._closing else logging.WARNING, "node %s down: %s", name, reason)
        self._emit(NodeDown(name, reason))
        for att in self._attempts.values():
            if att.final or not any(r.node == name for r in att.replicas.values()):
                continue
            # the control plane fails it (node-lost) when it handles NodeDown; the
            # replicas elsewhere must not keep running
            att.final = att.lost = True
            for r in att.replicas.values():
                if r.node != name and r.state in ("sent", "running"):
                    self._send_stop(att, r, 0.0, f"node-lost:{name}")

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        window = self.heartbeat_s * self.missed_heartbeats
        for d in list(self._daemons.values()):
            if not d.nodes or now - d.last_seen <= window:
                continue
            silent = now - d.last_seen
            d.close()
            for name in d.nodes:
                node = self._nodes.get(name)
                if node is not None and node.daemon is d:
                    self._node_down(
                        name, f"no heartbeat from {d.describe()} for {silent:.1f}s"
                        f" ({self.missed_heartbeats} missed)"
                    )
            d.nodes = []
        if now - self._t0 > self.register_timeout_s:
            for node in self._nodes.values():
                if node.daemon is None and not node.down and node.spec is not None:
                    self._node_down(
                        node.name,
                        f"no daemon registered for node {node.name} within"
                        f" {self.register_timeout_s:g}s",
                    )

