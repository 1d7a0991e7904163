"""LocalBackend: the engine's side of the workload daemons (the core Backend protocol).

It listens on a TCP address; daemons connect, register the nodes they serve
(checked against the cluster spec), heartbeat and run what they are sent.
It turns the engine's commands into per-replica messages and the daemons'
per-replica reports back into the workload-level facts the control plane
expects:

- ``Started`` once every replica of the attempt has a process;
- ``Exited`` once every replica's process tree is gone (the first failure
  decides the code and cause; the other replicas of a failed gang are
  force-stopped first);
- ``Released`` after a stop request, once every replica's tree is gone, with
  the progress of the last checkpoint the workload reported;
- ``Progress`` from replica 0's reports, ``NodeDown`` after missed heartbeats
  (or when a cluster node never gets a daemon), ``NodeUp`` when it returns.

Commands are idempotent by request id. Telemetry from the daemons (psutil,
NVML) and the workloads' own reports (loss, step, metrics) comes out of
:meth:`drain_telemetry`. Everything here is guarded by one lock; reads run
on one thread per daemon, writes on another, so a slow daemon never blocks
the engine.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from mlwe.backends.local.protocol import (
    MAX_LINE,
    PROTOCOL_VERSION,
    ProtocolError,
    decode,
    encode,
    finite_metrics,
    is_fraction,
    parse_address,
)
from mlwe.core.actions import Exited, Progress, Released, Started
from mlwe.core.backend import (
    Command,
    Event,
    Fact,
    NodeDown,
    NodeUp,
    RunningAttempt,
    StartCommand,
    StopCommand,
    Telemetry,
    dispatch,
)
from mlwe.core.spec import ClusterSpec, NodeSpec

log = logging.getLogger("mlwe.local")


class _Clock(Protocol):
    def now(self) -> float: ...


class _EpochClock:
    def now(self) -> float:
        return time.time()


@dataclass
class _Replica:
    index: int
    node: str
    msg: dict[str, Any]
    state: str = "queued"  # queued -> sent -> running -> gone
    ever_started: bool = False
    stop_sent: bool = False
    code: int | None = None
    cause: str = ""
    term_to_exit_s: float | None = None


@dataclass
class _Attempt:
    workload: str
    attempt: int
    correlation_id: str | None
    replicas: dict[int, _Replica]
    started_emitted: bool = False
    final: bool = False  # its terminal fact is out (or it was lost with its node)
    lost: bool = False
    stop_requested: bool = False
    grace_s: float = 0.0
    killing: bool = False
    failure: _Replica | None = None
    checkpoint: float | None = None
    pending_progress: tuple[float, bool] | None = None
    last_progress: float | None = None
    adopted: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.workload, self.attempt)


class _Daemon:
    """One registered daemon connection; writes go through a queue to its own thread."""

    def __init__(self, daemon_id: str, sock: socket.socket, hello: dict[str, Any]) -> None:
        self.id = daemon_id
        self.host = str(hello.get("host", "?"))
        self.pid = hello.get("pid")
        self.machine = hello.get("machine") if isinstance(hello.get("machine"), dict) else {}
        self.nodes: list[str] = []
        self.sock = sock
        self.connected = True
        self.last_seen = time.monotonic()
        self.out: queue.Queue[bytes | None] = queue.Queue()
        self.writer = threading.Thread(target=self._write_loop, name=f"mlwe-local-w-{daemon_id}",
                                       daemon=True)
        self.writer.start()

    def send(self, msg: dict[str, Any]) -> bool:
        if not self.connected:
            return False
        self.out.put(encode(msg))
        return True

    def _write_loop(self) -> None:
        sock = self.sock
        while True:
            data = self.out.get()
            if data is None:
                return
            try:
                sock.sendall(data)
            except OSError:
                self.connected = False
                return

    def close(self) -> None:
        self.connected = False
        self.out.put(None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()

    def describe(self) -> str:
        return f"daemon {self.id} ({self.host}, pid {self.pid})"


@dataclass
class _Node:
    name: str
    spec: NodeSpec | None
    daemon: _Daemon | None = None
    down: bool = False  # NodeDown emitted and no NodeUp since
    queued: list[tuple[tuple[str, int], int]] = field(default_factory=list)


class LocalBackend:
    """The Backend protocol over workload daemons (``mlwe daemon``) on real machines."""

    name = "local"

    def __init__(
        self,
        cluster: ClusterSpec | None = None,
        *,
        listen: str = "127.0.0.1:0",
        token: str | None = None,
        heartbeat_s: float = 1.0,
        missed_heartbeats: int = 3,
        telemetry_s: float = 1.0,
        report_s: float = 1.0,
        register_timeout_s: float | None = None,
        checkpoint_root: str | Path | None = None,
        work_dir: str | Path | None = None,
        clock: _Clock | None = None,
    ) -> None:
        if heartbeat_s <= 0 or missed_heartbeats < 1 or telemetry_s <= 0 or report_s <= 0:
            raise ValueError("heartbeat_s, telemetry_s and report_s must be positive;"
                             " missed_heartbeats at least 1")
        self.cluster = cluster
        self.token = token
        self.heartbeat_s = heartbeat_s
        self.missed_heartbeats = missed_heartbeats
        self.telemetry_s = telemetry_s
        self.report_s = report_s
        self.register_timeout_s = (
            register_timeout_s if register_timeout_s is not None else heartbeat_s * missed_heartbeats
        )
        self.checkpoint_root = Path(checkpoint_root) if checkpoint_root is not None else None
        self._work_dir = Path(work_dir) if work_dir is not None else None
        self.clock: _Clock = clock or _EpochClock()
        self._iid = uuid.uuid4().hex[:8]
        self._n = itertools.count(1)
        self._lock = threading.RLock()
        self._wake = threading.Event()
        #: Called (from the backend's threads) whenever an event is ready to poll:
        #: the runtime engine registers its wake-up here, so it reacts at once.
        self.event_listeners: list[Callable[[], None]] = []
        self._events: list[Event] = []
        self._telemetry: deque[Telemetry] = deque(maxlen=200_000)
        self._seen: set[str] = set()
        self._attempts: dict[tuple[str, int], _Attempt] = {}
        self._daemons: dict[str, _Daemon] = {}
        self._nodes: dict[str, _Node] = {}
        if cluster is not None:
            for spec in cluster.all_nodes():
                self._nodes[spec.name] = _Node(spec.name, spec)
        self.errors: deque[str] = deque(maxlen=1000)
        self._spawned: list[subprocess.Popen[bytes]] = []
        self._closed = False
        self._closing = False
        self._t0 = time.monotonic()
        host, port = parse_address(listen, any_port=True)
        self._server = socket.create_server((host, port))
        self._server.settimeout(0.2)
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept_loop, name="mlwe-local-accept", daemon=True)
        t.start()
        self._threads.append(t)

    # ================================================================ protocol
    def send(self, commands: Sequence[Command]) -> None:
        with self._lock:
            dispatch(commands, self._seen, self._start, self._stop)

    def poll(self) -> list[Event]:
        with self._lock:
            self._check_heartbeats()
            out, self._events = self._events, []
            self._wake.clear()
            return out

    def drain_telemetry(self) -> list[Telemetry]:
        with self._lock:
            out = list(self._telemetry)
            self._telemetry.clear()
            return out

    def inventory(self) -> list[RunningAttempt]:
        """What runs now; first waits (up to the registration timeout) for the
        cluster's daemons to register, since only they know what runs."""
        deadline = self._t0 + self.register_timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if all(n.daemon is not None or n.down for n in self._nodes.values()):
                    break
            time.sleep(0.02)
        with self._lock:
            return [
                RunningAttempt(
                    a.workload, a.attempt,
                    tuple(dict.fromkeys(r.node for r in a.replicas.values() if r.node != "?")),
                )
                for a in self._attempts.values()
                if not a.final and any(r.state in ("sent", "running") for r in a.replicas.values())
            ]

    def close(self) -> None:
        """Force-stop every workload, wait for the daemons to confirm, stop spawned daemons."""
        with self._lock:
            if self._closed:
                return
            self._closing = True
            live = [a for a in self._attempts.values() if not a.final]
            for a in live:
                a.stop_requested = True
                for r in a.replicas.values():
                    if r.state in ("sent", "running"):
                        self._send_stop(a, r, 0.0, "close")
        end = time.monotonic() + 10.0
        while time.monotonic() < end and self._unconfirmed(live):
            time.sleep(0.02)
        with self._lock:
            self._closed = True
        for p in self._spawned:
            if p.poll() is None:
                p.terminate()
        for p in self._spawned:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        with self._lock:
            for d in self._daemons.values():
                d.close()
        self._server.close()
        for t in self._threads:
            t.join(timeout=2)

    def detach(self) -> None:
        """Stop serving without stopping anything: the daemons and their workloads keep
        running and reconnect to whoever listens on this address next (an engine
        restarted or upgraded in place), which adopts them through :meth:`inventory`."""
        with self._lock:
            self._closed = True
            for d in self._daemons.values():
                d.close()
        self._server.close()
        for t in self._threads:
            t.join(timeout=2)
        self._spawned.clear()  # no longer ours to stop

    def _unconfirmed(self, attempts: list[_Attempt]) -> bool:
        """Whether any of ``attempts`` still runs on a daemon that can still confirm its end."""
        with self._lock:
            for a in attempts:
                if a.final:
                    continue
                for r in a.replicas.values():
                    node = self._nodes.get(r.node)
                    d = node.daemon if node is not None else None
                    if r.state in ("sent", "running") and d is not None and d.connected:
                        return True
            return False

    # ========================================================== engine helpers
    def wait(self, timeout: float) -> bool:
        """Block until an event is ready to poll (or ``timeout``); lets a driver loop
        react at once instead of sleeping a fixed period."""
        return self._wake.wait(timeout)

    def wait_for_nodes(self, names: Sequence[str] | None = None, timeout: float = 30.0) -> None:
        """Wait until every named node (default: the whole cluster) has a daemon."""
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                wanted = list(names) if names is not None else list(self._nodes)
                missing = [
                    n for n in wanted
                    if n not in self._nodes or self._nodes[n].daemon is None
                    or not self._nodes[n].daemon.connected  # type: ignore[union-attr]
                ]
            if not missing:
                return
            if time.monotonic() >= end:
                errors = "; ".join(list(self.errors)[-5:])
                dead = [
                    f"daemon pid {p.pid} exited with {p.returncode}"
                    for p in self._spawned if p.poll() is not None
                ]
                raise TimeoutError(
                    f"no daemon registered for node(s) {', '.join(missing)} within {timeout}s"
                    + (f" ({'; '.join(dead)})" if dead else "")
                    + (f"; errors: {errors}" if errors else "")
                )
            time.sleep(0.02)

    def spawn_daemon(
        self,
        nodes: Sequence[NodeSpec | tuple[NodeSpec, Sequence[int]]],
        *,
        declared_gpus: bool = False,
        state_dir: str | Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> subprocess.Popen[bytes]:
        """Start a daemon process on this machine serving ``nodes`` (for tests and demos).

        It exits with this process and is stopped by :meth:`close`. Its log is
        ``daemon.log`` in its state directory."""
        base = self._base_dir()
        sdir = Path(state_dir) if state_dir is not None else Path(
            tempfile.mkdtemp(prefix="daemon-", dir=base)
        )
        sdir.mkdir(parents=True, exist_ok=True)
        args = [
            sys.executable, "-m", "mlwe.backends.local", "--engine", self.address,
            "--state-dir", str(sdir), "--parent-pid", str(os.getpid()),
            "--checkpoint-root", str(self.checkpoint_root or base / "checkpoints"),
        ]
        for item in nodes:
            spec, indices = item if isinstance(item, tuple) else (item, None)
            data = spec.model_dump(mode="json")
            if indices is not None:
                data["gpu_indices"] = list(indices)
            args += ["--node", json.dumps(data)]
        if declared_gpus:
            args.append("--declared-gpus")
        args += list(extra_args)
        env = dict(os.environ)
        if self.token:
            env["MLWE_DAEMON_TOKEN"] = self.token  # not on the command line, where ps shows it
        with open(sdir / "daemon.log", "ab") as logf:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._spawned.append(proc)
        return proc

    def stop_wait_s(self, workload: str, attempt: int) -> float | None:
        """How long the attempt's slowest replica took between SIGTERM and its exit (its
        own checkpoint and shutdown, inside the grace period); None if not stopped so."""
        with self._lock:
            att = self._attempts.get((workload, attempt))
            if att is None:
                return None
            waits = [r.term_to_exit_s for r in att.replicas.values() if r.term_to_exit_s is not None]
            return max(waits) if waits else None

    def daemons(self) -> list[dict[str, Any]]:
        """The registered daemons, for status displays."""
        now = time.monotonic()
        with self._lock:
            return [
                {"id": d.id, "host": d.host, "pid": d.pid, "nodes": list(d.nodes),
                 "connected": d.connected, "seen_s_ago": round(now - d.last_seen, 3),
                 "machine": d.machine}
                for d in self._daemons.values()
            ]

    def _base_dir(self) -> Path:
        if self._work_dir is None:
            self._work_dir = Path(tempfile.mkdtemp(prefix="mlwe-local-"))
        self._work_dir.mkdir(parents=True, exist_ok=True)
        return self._work_dir

    # ================================================================= events
    def _emit(self, fact: Fact, correlation_id: str | None = None) -> None:
        self._events.append(
            Event(f"local-{self._iid}-{next(self._n)}", self.clock.now(), fact, correlation_id)
        )
        self._wake.set()
        for listener in self.event_listeners:
            listener()

    def _error(self, text: str) -> None:
        log.warning("%s", text)
        self.errors.append(text)

    # ================================================================ commands
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

    # ============================================================ aggregation
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

    # ============================================================ connections
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
        with self._lock:
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
            return d

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

    # ================================================================ messages
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
