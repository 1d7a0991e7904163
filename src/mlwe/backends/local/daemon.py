"""The workload daemon: runs the engine's workloads as real processes on one machine.

One daemon serves one or more nodes of the cluster (several nodes on one
machine for tests and demos, each with its own declared capacity). It connects
to the engine's LocalBackend, registers its nodes, heartbeats, and runs what
the engine starts:

- each replica is a subprocess in a session of its own, with the workload's
  environment (``MLWE_WORKLOAD_ID``, ``MLWE_ATTEMPT``, ``MLWE_REPLICA``,
  ``CUDA_VISIBLE_DEVICES``, ``MLWE_CHECKPOINT_DIR``, ``MLWE_REPORT_FD``: the
  write end of a pipe for :mod:`mlwe.workload` reports);
- a stop is SIGTERM to the process group, up to the grace period for a
  checkpoint and exit, then SIGKILL to the whole tree; the exit is reported
  only once every process of the tree is gone, which is what lets the engine
  place a preemptor on the freed resources;
- telemetry: per replica CPU and RSS of the whole tree, per node CPU, memory
  and load (psutil), GPU utilisation, VRAM and power from NVML where GPUs
  exist; without GPUs the GPU figures are the allocation, labelled declared.

The daemon is one thread around a selector (the engine socket, a pidfd per
replica, a report pipe per replica), so 50 idle workloads cost it almost
nothing. Facts (started, exited, checkpoints) stay in an outbox until the
engine acknowledges them and are re-sent after a reconnect.

Its parts: the configuration and the check of its nodes against the machine
(:mod:`.daemon_config`), one replica's record, environment, process and exit
status (:mod:`.replica`), and what a telemetry sample says
(:mod:`.daemon_telemetry`); this module is the daemon itself: the engine link,
starts, stops, exits and the workload helper's reports.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

from mlwe.backends.local.daemon_config import (
    DaemonConfig,
    DaemonConfigError,
    NodeConfig,
    check_nodes,
)
from mlwe.backends.local.daemon_telemetry import daemon_samples
from mlwe.backends.local.procs import (
    ProcessTree,
    kill_tree,
    live_members,
    sample_trees,
    signal_tree,
)
from mlwe.backends.local.protocol import (
    MAX_LINE,
    PROTOCOL_VERSION,
    ProtocolError,
    decode,
    encode,
    finite_metrics,
    is_fraction,
)
from mlwe.backends.local.replica import (
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    EXIT_START_FAILED,
    Key,
    Replica,
    exit_status,
    parse_report,
    popen_replica,
    replica_env,
)
from mlwe.backends.local.telemetry import Nvml, machine_memory_mib, usable_cpus

log = logging.getLogger("mlwe.daemon")

__all__ = [  # what other modules import from here
    "EXIT_NOT_EXECUTABLE", "EXIT_NOT_FOUND", "EXIT_START_FAILED", "Daemon", "DaemonConfig",
    "DaemonConfigError", "Key", "NodeConfig", "Replica", "check_nodes",
]


class Daemon:
    def __init__(self, config: DaemonConfig, nvml: Nvml | None = None) -> None:
        self.config = config
        self.nvml = nvml
        self.id = uuid.uuid4().hex[:12]
        self.nodes = {n.spec.name: n for n in config.nodes}
        self.sel = selectors.DefaultSelector()
        self.replicas: dict[Key, Replica] = {}
        self.finished: OrderedDict[Key, None] = OrderedDict()
        self.outbox: OrderedDict[int, bytes] = OrderedDict()
        self.seq = 0
        self.sock: socket.socket | None = None
        self.ready = False
        self.inbuf = b""
        self.outbuf = bytearray()
        self.heartbeat_s = 1.0
        self.telemetry_s = 1.0
        self.report_s = 1.0
        now = time.monotonic()
        self.next_connect = now
        self.backoff = 0.1
        self.hello_deadline = 0.0
        self.next_hb = now
        self.next_tel = now
        self.next_report = now
        self.shutting_down = False
        self.exit_code: int | None = None
        self._exit_after = 0
        self.refused: str | None = None
        self.checkpoint_root = config.checkpoint_root or config.state_dir / "checkpoints"
        self.log_root = config.state_dir / "logs"
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._signals: list[int] = []

    # ------------------------------------------------------------------ running
    def run(self) -> int:
        """Serve until shut down (SIGTERM/SIGINT, parent gone, refused); the exit code."""
        self.sel.register(self._wake_r, selectors.EVENT_READ, self._on_wake)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        log.info("daemon %s serving %s", self.id, ", ".join(self.nodes))
        try:
            while self.exit_code is None:
                self._timers(time.monotonic())
                if self.exit_code is not None:
                    break
                timeout = max(0.0, min(1.0, self._next_deadline() - time.monotonic()))
                for key, mask in self.sel.select(timeout):
                    key.data(mask)
        finally:
            for rep in list(self.replicas.values()):  # never leave a workload behind
                if rep.tree is not None:
                    kill_tree(rep.tree)
            self._close_socket()
            signal.set_wakeup_fd(-1)
            if self.nvml is not None:
                self.nvml.close()
        return self.exit_code

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals.append(signum)

    def _on_wake(self, mask: int) -> None:
        with contextlib.suppress(BlockingIOError):
            self._wake_r.recv(4096)
        while self._signals:
            signum = self._signals.pop(0)
            if self.shutting_down:
                log.warning("second %s: force-stopping every workload", signal.Signals(signum).name)
                for rep in self.replicas.values():
                    self._force(rep)
            else:
                log.info("%s: stopping workloads (grace %.1fs), then exiting",
                         signal.Signals(signum).name, self.config.shutdown_grace_s)
                self._shutdown(self.config.shutdown_grace_s, 0)

    def _shutdown(self, grace: float, code: int) -> None:
        self.shutting_down = True
        self._exit_after = code
        for rep in self.replicas.values():
            if not rep.stopping:
                rep.shutdown = True
                self._request_stop(rep, grace)

    def _next_deadline(self) -> float:
        times = [self.next_connect if self.sock is None else self.next_hb]
        if self.ready:
            times += [self.next_tel, self.next_report]
        elif self.sock is not None:
            times.append(self.hello_deadline)
        for rep in self.replicas.values():
            if rep.stop_deadline is not None and not rep.forced:
                times.append(rep.stop_deadline)
            if rep.next_check is not None:
                times.append(rep.next_check)
        return min(times)

    def _timers(self, now: float) -> None:
        if self.shutting_down and not self.replicas:
            self._send({"type": "bye", "reason": self.refused or "daemon shut down"})
            self._flush_blocking(2.0)
            self.exit_code = self._exit_after
            return
        if self.sock is None and now >= self.next_connect and not self.shutting_down:
            self._connect()
        elif self.sock is not None and not self.ready and now >= self.hello_deadline:
            self._disconnect("no welcome from the engine")
        if now >= self.next_hb:
            self.next_hb = now + self.heartbeat_s
            if self.ready:
                self._send({"type": "hb"})
            parent = self.config.parent_pid
            if parent is not None and os.getppid() != parent and not self.shutting_down:
                log.warning("parent process %d is gone: shutting down", parent)
                self._shutdown(0.0, 0)
        if self.ready and now >= self.next_tel:
            self.next_tel = now + self.telemetry_s
            self._telemetry()
        if self.ready and now >= self.next_report:
            self.next_report = now + self.report_s
            for rep in self.replicas.values():
                self._flush_report(rep)
        for rep in list(self.replicas.values()):
            if rep.stop_deadline is not None and not rep.forced and now >= rep.stop_deadline:
                self._force(rep)
            if rep.next_check is not None and now >= rep.next_check:
                self._check(rep, now)

    # --------------------------------------------------------------- engine link
    def _connect(self) -> None:
        host, port = self.config.engine
        try:
            s = socket.create_connection((host, port), timeout=self.config.connect_timeout_s)
        except OSError as exc:
            log.warning("cannot reach the engine at %s:%d (%s); retrying in %.1fs",
                        host, port, exc, self.backoff)
            self.next_connect = time.monotonic() + self.backoff
            self.backoff = min(self.backoff * 2, 2.0)
            return
        s.setblocking(False)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = s
        self.ready = False
        self.inbuf = b""
        self.outbuf = bytearray()
        self.sel.register(s, selectors.EVENT_READ, self._on_sock)
        self.hello_deadline = time.monotonic() + 10.0
        self._write(encode(self._hello()))

    def _hello(self) -> dict[str, Any]:
        machine: dict[str, Any] = {
            "cpus": usable_cpus(),
            "memory_mib": machine_memory_mib(),
            "gpu_source": self.config.gpu_source,
            "gpus": [
                {"index": d.index, "name": d.name, "memory_mib": d.memory_mib}
                for d in (self.nvml.devices if self.nvml is not None else ())
            ],
        }
        running = [
            {
                "workload": r.key[0], "attempt": r.key[1], "replica": r.key[2],
                "replicas": r.replicas, "node": r.node, "correlation_id": r.correlation_id,
                "pid": r.proc.pid if r.proc is not None else None,
                "stopping": r.stopping, "checkpoint": r.checkpoint,
            }
            for r in self.replicas.values()
        ]
        return {
            "type": "hello", "protocol": PROTOCOL_VERSION, "daemon_id": self.id,
            "host": socket.gethostname(), "pid": os.getpid(), "token": self.config.token,
            "nodes": [n.to_wire() for n in self.config.nodes], "machine": machine,
            "running": running,
        }

    def _close_socket(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(self.sock)
            self.sock.close()
        self.sock = None
        self.ready = False

    def _disconnect(self, why: str) -> None:
        log.warning("engine connection lost (%s); reconnecting", why)
        self._close_socket()
        self.next_connect = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, 2.0)

    def _write(self, data: bytes) -> None:
        if self.sock is None:
            return
        self.outbuf += data
        self._flush()

    def _flush(self) -> None:
        sock = self.sock
        if sock is None:
            return
        try:
            while self.outbuf:
                n = sock.send(self.outbuf)
                del self.outbuf[:n]
        except BlockingIOError:
            pass
        except OSError as exc:
            self._disconnect(str(exc))
            return
        if len(self.outbuf) > 64 * MAX_LINE:
            self._disconnect("the engine is not reading")
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if self.outbuf else 0)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.modify(sock, want, self._on_sock)

    def _flush_blocking(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while self.sock is not None and self.outbuf and time.monotonic() < end:
            self._flush()
            time.sleep(0.005)

    def _send(self, msg: dict[str, Any]) -> None:
        """A message that may be lost (telemetry, heartbeats, plain reports)."""
        if self.ready:
            self._write(encode(msg))

    def _fact(self, msg: dict[str, Any]) -> None:
        """A message the engine must get: kept until acknowledged, re-sent on reconnect."""
        self.seq += 1
        msg["seq"] = self.seq
        msg["id"] = f"{self.id}:{self.seq}"
        data = encode(msg)
        self.outbox[self.seq] = data
        while len(self.outbox) > 100_000:
            self.outbox.popitem(last=False)
        if self.ready:
            self._write(data)

    def _on_sock(self, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush()
        if not mask & selectors.EVENT_READ or self.sock is None:
            return
        try:
            data = self.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError as exc:
            self._disconnect(str(exc))
            return
        if not data:
            self._disconnect("the engine closed the connection")
            return
        self.inbuf += data
        while b"\n" in self.inbuf:
            line, self.inbuf = self.inbuf.split(b"\n", 1)
            if line.strip():
                try:
                    self._on_engine(decode(line))
                except ProtocolError as exc:
                    log.error("bad message from the engine: %s", exc)
        if len(self.inbuf) > MAX_LINE:
            self._disconnect("message from the engine too long")

    def _on_engine(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "welcome":
            self.ready = True
            self.backoff = 0.1
            self.heartbeat_s = float(msg.get("heartbeat_s", self.heartbeat_s))
            self.telemetry_s = float(msg.get("telemetry_s", self.telemetry_s))
            self.report_s = float(msg.get("report_s", self.report_s))
            log.info("registered with the engine (%d facts to re-send)", len(self.outbox))
            for data in self.outbox.values():
                self._write(data)
        elif kind == "refused":
            self.refused = str(msg.get("reason", "no reason given"))
            print(f"mlwe daemon: the engine refused this daemon: {self.refused}",
                  file=sys.stderr, flush=True)
            self._shutdown(0.0, 2)
        elif kind == "start":
            self._start(msg)
        elif kind == "stop":
            self._stop(msg)
        elif kind == "ack":
            upto = int(msg.get("upto", 0))
            while self.outbox and next(iter(self.outbox)) <= upto:
                self.outbox.popitem(last=False)
        else:
            self._send({"type": "error", "message": f"unknown message type {kind!r}"})

    # -------------------------------------------------------------------- start
    def _start(self, msg: dict[str, Any]) -> None:
        try:
            key: Key = (str(msg["workload"]), int(msg["attempt"]), int(msg.get("replica", 0)))
        except (KeyError, TypeError, ValueError):
            self._send({"type": "error", "message": f"start without workload/attempt: {msg!r}"[:500]})
            return
        if key in self.replicas or key in self.finished:
            return  # idempotent: the engine sent it again (e.g. after a reconnect)
        node = self.nodes.get(str(msg.get("node")))
        devices = tuple(int(d) for d in msg.get("devices", ()))
        rep = Replica(
            key=key, replicas=int(msg.get("replicas", 1)), node=str(msg.get("node")),
            correlation_id=msg.get("correlation_id"),
            devices=tuple(node.gpu_indices[d] for d in devices if node and d < len(node.gpu_indices)),
            gpu_milli=int(msg.get("gpu_milli", 0)), vram_mib=int(msg.get("vram_mib", 0)),
        )
        command = self._start_command(rep, node, msg)
        if command is None:
            return
        ckpt = self._open_files(rep, msg)
        if ckpt is None:
            return
        r, w = os.pipe()
        env = replica_env(msg, rep, ckpt, w)
        proc = self._spawn(rep, command, env, r, w)
        if proc is not None:
            self._watch(rep, proc, r)

    def _start_command(
        self, rep: Replica, node: NodeConfig | None, msg: dict[str, Any]
    ) -> list[str] | None:
        """The command to start, or None once the start is reported failed."""
        if node is None:
            self._start_failed(rep, EXIT_START_FAILED,
                               f"node {rep.node!r} is not served by this daemon"
                               f" (it serves {', '.join(self.nodes)})")
            return None
        if self.shutting_down:
            self._start_failed(rep, EXIT_START_FAILED, "the daemon is shutting down")
            return None
        command = msg.get("command") or []
        if not isinstance(command, list) or not command or not all(
            isinstance(a, str) for a in command
        ):
            self._start_failed(rep, EXIT_NOT_FOUND,
                               "the workload has no command (set spec.command, e.g. [python, -m,"
                               " mlwe.programs.synthetic, --work, '30'])")
            return None
        return command

    def _open_files(self, rep: Replica, msg: dict[str, Any]) -> Path | None:
        """Check the checkpoint directory is writable and open the log file: the checkpoint
        directory, or None once the start is reported failed."""
        wid, attempt, index = rep.key
        ckpt = Path(msg.get("checkpoint_dir") or self.checkpoint_root / wid)
        try:
            ckpt.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=ckpt):
                pass
        except OSError as exc:
            self._start_failed(rep, EXIT_START_FAILED,
                               f"checkpoint directory {ckpt} is not writable:"
                               f" {exc.strerror or exc}")
            return None
        try:
            logdir = self.log_root / wid
            logdir.mkdir(parents=True, exist_ok=True)
            rep.log_file = open(logdir / f"a{attempt}-r{index}.log", "ab")  # noqa: SIM115
        except OSError as exc:
            self._start_failed(rep, EXIT_START_FAILED,
                               f"cannot open the log file in {self.log_root}: {exc.strerror or exc}")
            return None
        return ckpt

    def _spawn(
        self, rep: Replica, command: list[str], env: dict[str, str], r: int, w: int
    ) -> subprocess.Popen[bytes] | None:
        """Start the program (the report pipe's ends are ``r`` and ``w``); None once the
        start is reported failed (both ends closed)."""
        try:
            proc = popen_replica(command, env, rep.log_file, w)
        except FileNotFoundError:
            os.close(r)
            os.close(w)
            self._start_failed(rep, EXIT_NOT_FOUND, f"command not found: {command[0]!r}")
            return None
        except PermissionError:
            os.close(r)
            os.close(w)
            self._start_failed(rep, EXIT_NOT_EXECUTABLE, f"command not executable: {command[0]!r}")
            return None
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            os.close(r)
            os.close(w)
            self._start_failed(rep, EXIT_START_FAILED, f"cannot start {command[0]!r}: {exc}")
            return None
        os.close(w)
        return proc

    def _watch(self, rep: Replica, proc: subprocess.Popen[bytes], r: int) -> None:
        """The program runs: watch its reports and its exit, and report it started."""
        wid, attempt, index = rep.key
        os.set_blocking(r, False)
        rep.proc = proc
        rep.tree = ProcessTree(proc.pid)
        rep.report_fd = r
        self.sel.register(r, selectors.EVENT_READ, lambda mask, rep=rep: self._on_report(rep))
        try:
            rep.pidfd = os.pidfd_open(proc.pid)
            self.sel.register(rep.pidfd, selectors.EVENT_READ,
                              lambda mask, rep=rep: self._on_root_exit(rep))
        except (AttributeError, OSError):  # no pidfd (not Linux >= 5.3): poll
            rep.pidfd = None
            rep.next_check = time.monotonic() + 0.05
        self.replicas[rep.key] = rep
        log.info("started %s attempt %d replica %d on %s: pid %d", wid, attempt, index,
                 rep.node, proc.pid)
        self._fact({"type": "started", "workload": wid, "attempt": attempt, "replica": index,
                    "node": rep.node, "pid": proc.pid})

    def _start_failed(self, rep: Replica, code: int, why: str) -> None:
        wid, attempt, index = rep.key
        log.error("cannot start %s attempt %d replica %d: %s", wid, attempt, index, why)
        if rep.log_file is not None:
            rep.log_file.close()
        self._remember_finished(rep.key)
        self._fact({"type": "exited", "workload": wid, "attempt": attempt, "replica": index,
                    "node": rep.node, "code": code, "cause": f"start-failed: {why}",
                    "stopped": False, "forced": False, "checkpoint": None})

    def _remember_finished(self, key: Key) -> None:
        self.finished[key] = None
        while len(self.finished) > 10_000:
            self.finished.popitem(last=False)

    # --------------------------------------------------------------------- stop
    def _stop(self, msg: dict[str, Any]) -> None:
        wid, attempt = str(msg.get("workload")), int(msg.get("attempt", -1))
        grace = max(0.0, float(msg.get("grace_s", 0.0)))
        indices = msg.get("replicas")
        wanted = (
            [int(i) for i in indices] if isinstance(indices, list)
            else [k[2] for k in self.replicas if k[:2] == (wid, attempt)]
        )
        for index in wanted:
            key = (wid, attempt, index)
            rep = self.replicas.get(key)
            if rep is not None:
                rep.engine_stop = True
                self._request_stop(rep, grace)
            elif key not in self.finished:
                # never started here: nothing to stop, nothing holds resources
                self._remember_finished(key)
                self._fact({"type": "exited", "workload": wid, "attempt": attempt,
                            "replica": index, "node": msg.get("node"), "code": None,
                            "cause": "not running", "stopped": True, "forced": False,
                            "checkpoint": None})

    def _request_stop(self, rep: Replica, grace: float) -> None:
        if rep.tree is None or rep.forced:
            return
        if grace <= 0:
            self._force(rep)
            return
        deadline = time.monotonic() + grace
        if rep.stop_deadline is not None:  # already asked: a second request only shortens it
            rep.stop_deadline = min(rep.stop_deadline, deadline)
            return
        rep.stop_deadline = deadline
        sample_trees([rep.tree], time.monotonic())  # learn every descendant before signalling
        rep.term_at = time.monotonic()
        signal_tree(rep.tree, signal.SIGTERM)
        log.info("SIGTERM to %s (grace %.1fs)", rep.key, grace)

    def _force(self, rep: Replica) -> None:
        if rep.tree is None:
            return
        rep.forced = True
        gone_before = kill_tree(rep.tree)
        log.info("SIGKILL to %s (%d processes)", rep.key, len(gone_before))
        if rep.returncode is not None:
            rep.next_check = time.monotonic()

    # ------------------------------------------------------------------- exits
    def _on_root_exit(self, rep: Replica) -> None:
        assert rep.proc is not None
        if rep.proc.poll() is None:
            return
        rep.returncode = rep.proc.returncode
        rep.exit_at = time.monotonic()
        if rep.pidfd is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(rep.pidfd)
            os.close(rep.pidfd)
            rep.pidfd = None
        if not rep.stopping and rep.tree is not None:
            # the program ended: whatever it left behind goes with it
            kill_tree(rep.tree)
        rep.next_check = time.monotonic()

    def _check(self, rep: Replica, now: float) -> None:
        if rep.returncode is None:
            # no pidfd: poll the root
            assert rep.proc is not None
            if rep.proc.poll() is None:
                rep.next_check = now + 0.05
                return
            self._on_root_exit(rep)
        assert rep.tree is not None
        if live_members(rep.tree):
            # leftovers of a stopped tree get the rest of the grace period, then SIGKILL
            if rep.stop_deadline is None and not rep.forced:
                kill_tree(rep.tree)
            rep.next_check = now + 0.02
            return
        self._finish(rep)

    def _finish(self, rep: Replica) -> None:
        """The whole tree is gone: report the exit (the engine may now reuse the resources)."""
        rep.next_check = None
        if rep.report_fd is not None:
            self._on_report(rep)  # what it said last
            self._close_report(rep)
        self._flush_report(rep)
        if rep.log_file is not None:
            rep.log_file.close()
        code, cause = exit_status(rep)
        wid, attempt, index = rep.key
        del self.replicas[rep.key]
        self._remember_finished(rep.key)
        log.info("%s attempt %d replica %d gone: exit %d %s", wid, attempt, index, code, cause)
        self._fact({"type": "exited", "workload": wid, "attempt": attempt, "replica": index,
                    "node": rep.node, "code": code, "cause": cause, "stopped": rep.engine_stop,
                    "forced": rep.forced, "checkpoint": rep.checkpoint,
                    "elapsed_s": round(time.monotonic() - rep.started, 3),
                    # the workload's own time between SIGTERM and its exit (inside the grace)
                    "term_to_exit_s": (
                        round(rep.exit_at - rep.term_at, 6)
                        if rep.term_at is not None and rep.exit_at is not None else None
                    )})

    # ----------------------------------------------------------------- reports
    def _close_report(self, rep: Replica) -> None:
        if rep.report_fd is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(rep.report_fd)
        os.close(rep.report_fd)
        rep.report_fd = None

    def _on_report(self, rep: Replica) -> None:
        if rep.report_fd is None:
            return
        while True:
            try:
                data = os.read(rep.report_fd, 1 << 16)
            except BlockingIOError:
                break
            if not data:  # every writer closed it
                self._close_report(rep)
                break
            rep.report_buf += data
        while b"\n" in rep.report_buf:
            line, rep.report_buf = rep.report_buf.split(b"\n", 1)
            try:
                m = parse_report(line)
            except ProtocolError:
                rep.bad_reports += 1
                continue
            self._report(rep, m)
        if len(rep.report_buf) > MAX_LINE:
            rep.report_buf = b""
            rep.bad_reports += 1

    def _report(self, rep: Replica, m: dict[str, Any]) -> None:
        wid, attempt, index = rep.key
        if m.get("checkpoint"):
            p = m.get("progress")
            if is_fraction(p):
                rep.checkpoint = float(p)
            data: dict[str, Any] = {"checkpoint": True, "progress": rep.checkpoint}
            if isinstance(m.get("step"), int):
                data["step"] = m["step"]
            self._fact({"type": "report", "workload": wid, "attempt": attempt, "replica": index,
                        "node": rep.node, "data": data})
            return
        pend = rep.pending if rep.pending is not None else {}
        for k in ("step", "loss", "progress"):
            if k in m:
                pend[k] = m[k]
        metrics = finite_metrics(m.get("metrics"))
        if metrics:
            pend.setdefault("metrics", {}).update(metrics)
        rep.pending = pend

    def _flush_report(self, rep: Replica) -> None:
        if rep.pending:
            wid, attempt, index = rep.key
            self._send({"type": "report", "workload": wid, "attempt": attempt, "replica": index,
                        "node": rep.node, "data": rep.pending})
            rep.pending = None

    # --------------------------------------------------------------- telemetry
    def _telemetry(self) -> None:
        samples = daemon_samples(self.replicas.values(), self.nodes, self.nvml)
        self._send({"type": "telemetry", "samples": samples})
