"""The LocalBackend's daemon connections: accepting, registering, reading, adopting.

A daemon connects and says hello: its protocol, token and the nodes it serves,
checked against the cluster spec (a node served by another live daemon is
refused). Once registered, its nodes are up, what waited for them is sent, and
the replicas it already runs (after an engine restart) are adopted. Each
connection is read on a thread of its own.
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import threading
import time
import uuid
from typing import Any

from pydantic import ValidationError

from mlwe.backends.local.engine_state import _Attempt, _Node, _Replica, log
from mlwe.backends.local.link import _Daemon
from mlwe.backends.local.messages import _Messages
from mlwe.backends.local.protocol import (
    MAX_LINE,
    PROTOCOL_VERSION,
    ProtocolError,
    decode,
    encode,
    is_fraction,
)
from mlwe.core.backend import NodeUp
from mlwe.core.spec import NodeSpec


class _Registry(_Messages):
    """Serving daemon connections: registration, reading and adoption."""

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(target=self._serve, args=(conn,), name="mlwe-local-r", daemon=True)
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _serve(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        d: _Daemon | None = None
        try:
            conn.settimeout(10.0)
            line = f.readline(MAX_LINE + 1)
            conn.settimeout(None)
            if not line:
                return
            d = self._register(conn, line)
            if d is None:
                return
            while True:
                line = f.readline(MAX_LINE + 1)
                if not line:
                    break
                if not line.endswith(b"\n"):
                    self._error(f"{d.describe()}: message longer than {MAX_LINE} bytes; dropped")
                    break
                try:
                    msg = decode(line)
                except ProtocolError as exc:
                    self._error(f"{d.describe()}: {exc}")
                    continue
                with self._lock:
                    if self._daemons.get(d.id) is not d:
                        break  # replaced by a newer connection of the same daemon
                    d.last_seen = time.monotonic()
                    self._on_message(d, msg)
        except (OSError, ValueError) as exc:
            if d is not None:
                log.info("%s: connection closed (%s)", d.describe(), exc)
        finally:
            with self._lock:
                if d is not None:
                    d.connected = False
            with contextlib.suppress(OSError):
                f.close()
            if d is None:
                with contextlib.suppress(OSError):
                    conn.close()

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        self._error(f"refused a daemon: {reason}")
        with contextlib.suppress(OSError):
            conn.sendall(encode({"type": "refused", "reason": reason}))
        with contextlib.suppress(OSError):
            conn.close()

    def _register(self, conn: socket.socket, line: bytes) -> _Daemon | None:
        parsed = self._read_hello(conn, line)
        if parsed is None:
            return None
        hello, daemon_id, specs, problems = parsed
        with self._lock:
            problems += self._node_problems(specs, daemon_id)
            if problems:
                self._refuse(conn, "; ".join(problems))
                return None
            old = self._daemons.get(daemon_id)
            if old is not None:
                old.close()
            d = _Daemon(daemon_id, conn, hello)
            d.nodes = [s.name for s in specs]
            self._daemons[daemon_id] = d
            log.info("%s registered nodes %s", d.describe(), ", ".join(d.nodes))
            for s in specs:
                node = self._nodes.get(s.name)
                if node is None:
                    node = self._nodes[s.name] = _Node(s.name, None)
                node.daemon = d
                if node.down:
                    node.down = False
                    self._emit(NodeUp(s.name))
            d.send({"type": "welcome", "heartbeat_s": self.heartbeat_s,
                    "telemetry_s": self.telemetry_s, "report_s": self.report_s})
            self._adopt(d, hello.get("running"))
            self._resume(d)
            return d

    def _read_hello(
        self, conn: socket.socket, line: bytes
    ) -> tuple[dict[str, Any], str, list[NodeSpec], list[str]] | None:
        """The hello, the daemon's id, its nodes and what is wrong with them; None once
        the daemon is refused."""
        try:
            hello = decode(line)
        except ProtocolError as exc:
            self._refuse(conn, f"bad hello: {exc}")
            return None
        if hello.get("type") != "hello":
            self._refuse(conn, f"expected hello, got {hello.get('type')!r}")
            return None
        if hello.get("protocol") != PROTOCOL_VERSION:
            self._refuse(conn, f"protocol {hello.get('protocol')!r}; this engine speaks"
                               f" {PROTOCOL_VERSION}")
            return None
        if self.token is not None and not hmac.compare_digest(
            str(hello.get("token") or ""), self.token
        ):
            self._refuse(conn, "wrong or missing token (MLWE_DAEMON_TOKEN)")
            return None
        daemon_id = str(hello.get("daemon_id") or uuid.uuid4().hex[:12])
        raw_nodes = hello.get("nodes")
        if not isinstance(raw_nodes, list) or not raw_nodes:
            self._refuse(conn, "the daemon declares no node")
            return None
        specs: list[NodeSpec] = []
        problems: list[str] = []
        for raw in raw_nodes:
            data = {k: v for k, v in raw.items() if k != "gpu_indices"} if isinstance(raw, dict) else raw
            try:
                specs.append(NodeSpec.model_validate(data))
            except ValidationError as exc:
                problems.append(f"invalid node {raw!r}: {exc.errors()[0]['msg']}")
        return hello, daemon_id, specs, problems

    def _node_problems(self, specs: list[NodeSpec], daemon_id: str) -> list[str]:
        """Why the daemon may not serve these nodes (not in the cluster, not as the
        cluster declares them, served by another live daemon); under the lock."""
        problems: list[str] = []
        now = time.monotonic()
        window = self.heartbeat_s * self.missed_heartbeats
        for s in specs:
            node = self._nodes.get(s.name)
            if self.cluster is not None and (node is None or node.spec is None):
                problems.append(f"node {s.name} is not in the engine's cluster"
                                f" (known: {', '.join(sorted(self._nodes)) or 'none'})")
                continue
            if node is not None and node.spec is not None:
                want = node.spec
                diffs = [
                    f"{k} {getattr(s, k)!r} (cluster says {getattr(want, k)!r})"
                    for k in ("gpus", "gpu_model", "cpu", "memory")
                    if getattr(s, k) != getattr(want, k)
                ]
                if diffs:
                    problems.append(f"node {s.name} does not match the cluster spec: "
                                    + ", ".join(diffs))
            other = node.daemon if node is not None else None
            if (other is not None and other.id != daemon_id and other.connected
                    and now - other.last_seen <= window):
                problems.append(f"node {s.name} is already served by {other.describe()}")
        return problems

    def _resume(self, d: _Daemon) -> None:
        """A daemon (re)registered: send what waited for its nodes, and again what may
        have been lost with its previous connection; under the lock."""
        for name in d.nodes:
            node = self._nodes[name]
            queued, node.queued = node.queued, []
            for key, index in queued:
                att = self._attempts.get(key)
                if att is not None and not att.final:
                    self._dispatch(att, att.replicas[index])
        # what may have been lost with the previous connection
        for att in self._attempts.values():
            if att.final:
                continue
            for r in att.replicas.values():
                if r.node not in d.nodes:
                    continue
                if r.state == "sent":
                    d.send(r.msg)  # the daemon ignores a start it already has
                if att.stop_requested and r.state in ("sent", "running") and not r.stop_sent:
                    self._send_stop(att, r, att.grace_s, "resend")

    def _adopt(self, d: _Daemon, running: Any) -> None:
        """Replicas the daemon runs that this engine did not start (after an engine restart)."""
        if not isinstance(running, list):
            return
        for item in running:
            if not isinstance(item, dict):
                continue
            try:
                key = (str(item["workload"]), int(item["attempt"]))
                index = int(item.get("replica", 0))
                node = str(item["node"])
            except (KeyError, TypeError, ValueError):
                continue
            att = self._attempts.get(key)
            if att is None:
                total = int(item.get("replicas", 1))
                att = _Attempt(key[0], key[1], item.get("correlation_id"), {},
                               started_emitted=True, adopted=True)
                for i in range(total):  # the other replicas are on daemons not yet heard from
                    att.replicas[i] = _Replica(i, node if i == index else "?", {}, state="running")
                self._attempts[key] = att
            if att.final:
                # lost earlier (its node was declared down): a stale run, end it
                d.send({"type": "stop", "request_id": f"stale:{key[0]}:{key[1]}",
                        "workload": key[0], "attempt": key[1], "grace_s": 0.0,
                        "replicas": [index]})
                continue
            r = att.replicas.get(index)
            if r is None:
                continue
            r.node = node
            if r.state in ("queued", "sent"):
                r.state = "running"
            r.ever_started = True
            if is_fraction(item.get("checkpoint")) and index == 0:
                att.checkpoint = float(item["checkpoint"])
